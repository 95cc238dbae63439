//! What the cluster fault tests share: the catalog, figures, owners and
//! shards read from etcd and the pacer, settling, and the checks of
//! refused plaintext clients, of Prometheus alerts and of budget alerts.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use adspend_chaos::cluster::{
    connect_as, metric_sum, nats_args, pacer, pacer_client, settle_exact, shards, Cluster,
    PacerAccess, Shard, Traffic, NATS_URL, PARTITIONS,
};
use adspend_common::config::NatsArgs;
use adspend_sim::{generate_catalog, Catalog, CatalogSpec, Truth};

pub(super) const SETTLE: Duration = Duration::from_secs(150);
pub(super) const TAKEOVER: Duration = Duration::from_secs(90);
/// Events per second: the 2-core CI machine runs 15 containers besides.
pub(super) const RATE: f64 = 1500.0;
pub(super) const AGGREGATOR_METRICS: u16 = 9102;
/// The cluster's Prometheus, published on the host.
pub(super) const PROMETHEUS_ALERTS: &str = "http://127.0.0.1:9090/api/v1/alerts";

pub(super) fn catalog(seed: u64) -> Catalog {
    generate_catalog(&CatalogSpec::for_ads(200), seed).expect("catalog")
}

pub(super) fn figure(line: &str) {
    println!("cluster figure: {line}");
}

/// A client of pacer1's API as the host reaches it (pacer-client.env).
pub(super) fn http() -> reqwest::Client {
    pacer_client(Duration::from_secs(5))
}

/// Polls the partition owners in etcd until `done` accepts them.
pub(super) async fn wait_owners(
    cluster: &Cluster,
    timeout: Duration,
    what: &str,
    mut done: impl FnMut(&BTreeMap<u32, String>) -> bool,
) -> BTreeMap<u32, String> {
    let started = Instant::now();
    let mut last = BTreeMap::new();
    while started.elapsed() < timeout {
        if let Ok(owners) = cluster.owners().await {
            if owners.len() == PARTITIONS as usize && done(&owners) {
                return owners;
            }
            last = owners;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    panic!("partition owners never became {what} within {timeout:?}; last {last:?}");
}

/// Owners once all `members` are in the assignment and it held still for 2 s.
pub(super) async fn stable_owners(cluster: &Cluster, members: &[&str]) -> BTreeMap<u32, String> {
    let wanted: BTreeSet<&str> = members.iter().copied().collect();
    let mut previous: Option<(BTreeMap<u32, String>, Instant)> = None;
    let started = Instant::now();
    loop {
        let owners = wait_owners(cluster, TAKEOVER, "the wanted members", |o| {
            o.values().map(String::as_str).collect::<BTreeSet<_>>() == wanted
        })
        .await;
        match &previous {
            Some((p, since)) if *p == owners && since.elapsed() >= Duration::from_secs(2) => {
                return owners
            }
            Some((p, _)) if *p == owners => {}
            _ => previous = Some((owners, Instant::now())),
        }
        assert!(
            started.elapsed() < TAKEOVER,
            "the assignment over {members:?} never held still"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

pub(super) fn partitions_of(owners: &BTreeMap<u32, String>, member: &str) -> Vec<u32> {
    owners
        .iter()
        .filter(|(_, o)| o.as_str() == member)
        .map(|(p, _)| *p)
        .collect()
}

pub(super) async fn shards_now(partitions: &[u32]) -> BTreeMap<u32, Shard> {
    let all = shards(&http()).await.expect("pacer /v1/shards");
    partitions
        .iter()
        .map(|p| {
            (
                *p,
                *all.get(p).unwrap_or_else(|| panic!("pacer has no p{p}")),
            )
        })
        .collect()
}

/// Sum of a histogram's `_sum` and `_count` series over every aggregator that answers.
pub(super) async fn histogram(cluster: &Cluster, members: &[&str], name: &str) -> (f64, f64) {
    let (mut sum, mut count) = (0.0, 0.0);
    for member in members {
        if let Ok(body) = cluster.metrics(member, AGGREGATOR_METRICS).await {
            sum += metric_sum(&body, &format!("{name}_sum")).unwrap_or(0.0);
            count += metric_sum(&body, &format!("{name}_count")).unwrap_or(0.0);
        }
    }
    (sum, count)
}

pub(super) async fn settle(catalog: &Catalog, traffic: Traffic, test: &str) {
    let truth = traffic.finish().await.expect("simulator run");
    settle_truth(catalog, &truth, test).await;
}

/// [`settle`] against the truth of every run so far.
pub(super) async fn settle_truth(catalog: &Catalog, truth: &Truth, test: &str) {
    let (_, summary) = settle_exact(catalog, truth, SETTLE)
        .await
        .unwrap_or_else(|e| panic!("{test}: {e:#}"));
    figure(&format!("{test}: {summary}"));
}

/// No service (nor the auditor) was refused a NATS call: every grant it
/// needs is in deploy/nats-auth.conf.
pub(super) async fn no_permission_violations(cluster: &Cluster) {
    let refused = cluster
        .permission_violations()
        .await
        .expect("reading the logs");
    assert!(
        refused.is_empty(),
        "NATS refused calls the services make:\n{}",
        refused.join("\n")
    );
}

/// Budget alert thresholds (percent) of the failover test's limits.
pub(super) const ALERT_THRESHOLDS: [u64; 3] = [1, 2, 5];

/// `catalog` as JSON, every limit alerting at `thresholds`.
pub(super) fn with_alerts(catalog: &Catalog, thresholds: &[u64]) -> serde_json::Value {
    let mut doc = serde_json::to_value(catalog).expect("catalog as JSON");
    for limit in doc["limits"].as_object_mut().expect("limits").values_mut() {
        limit["alerts"] = serde_json::json!(thresholds);
    }
    doc
}

/// Every threshold a limit's period spend reached (per the pacer's
/// figures, settled exact before) announced on `ALERTS`, and none twice:
/// the crossings seen and the limits compared.
pub(super) async fn alerts_announced_once(thresholds: &[u64]) -> (usize, usize) {
    let limits = adspend_sim::check::fetch_limits(&http(), &pacer().url)
        .await
        .expect("limits");
    let mut expected = BTreeSet::new();
    for limit in &limits {
        for &threshold in thresholds {
            if u128::from(limit.spend_micros) * 100
                >= u128::from(threshold) * u128::from(limit.budget_micros)
            {
                let start = serde_json::to_value(&limit.period_start).unwrap();
                expected.insert((limit.limit_id.clone(), start.to_string(), threshold));
            }
        }
    }
    assert!(!expected.is_empty(), "no limit crossed a threshold");
    let client = connect_as("pacer").await.expect("NATS as pacer");
    let started = Instant::now();
    let (seen, counts) = loop {
        let mut counts: BTreeMap<(String, String, u64), u32> = BTreeMap::new();
        for (_, alert) in crate::alerts::stream_alerts(&client).await {
            let key = (
                alert["limit_id"].as_str().unwrap_or("").to_owned(),
                alert["period_start"].to_string(),
                alert["threshold_percent"].as_u64().unwrap_or(0),
            );
            *counts.entry(key).or_default() += 1;
        }
        let seen: BTreeSet<_> = counts.keys().cloned().collect();
        if expected.is_subset(&seen) || started.elapsed() > Duration::from_secs(60) {
            break (seen, counts);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    };
    let missing: Vec<_> = expected.difference(&seen).collect();
    assert!(missing.is_empty(), "crossings never announced: {missing:?}");
    let twice: Vec<_> = counts.iter().filter(|(_, n)| **n > 1).collect();
    assert!(
        twice.is_empty(),
        "crossings announced more than once: {twice:?}"
    );
    (counts.len(), limits.len())
}

/// Clients without TLS or credentials get nothing from NATS or etcd while
/// the services, with theirs, keep spend flowing.
pub(super) async fn plain_clients_refused(cluster: &Cluster) {
    // NATS from the host, plaintext: the server demands TLS in its INFO and
    // answers a plain CONNECT by closing, never with a PONG.
    let mut plain = tokio::net::TcpStream::connect("127.0.0.1:4222")
        .await
        .expect("tcp connect to nats1");
    let mut info = vec![0u8; 4096];
    let n = plain.read(&mut info).await.expect("read INFO");
    let info = String::from_utf8_lossy(&info[..n]).to_string();
    assert!(info.contains("\"tls_required\":true"), "{info}");
    let _ = plain
        .write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n")
        .await;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut answer))
        .await
        .expect("nats1 kept a plaintext client open")
        .ok();
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        !answer.contains("PONG"),
        "a plaintext client was served: {answer}"
    );

    // TLS with the CA but no user: refused.
    let ca = nats_args("adserver").expect("adserver.env").nats_tls_ca;
    let anonymous = NatsArgs {
        nats_tls_ca: ca,
        ..NatsArgs::plain(NATS_URL)
    };
    let err = adspend_common::nats::connect(&anonymous, "anonymous")
        .await
        .expect_err("a client without credentials connected");
    assert!(
        err.to_string().to_lowercase().contains("authorization"),
        "not an authorization failure: {err}"
    );

    // etcd, from inside its own container: plaintext, then TLS without a
    // client certificate; the admin's settings (the control) are served.
    cluster
        .etcdctl_as(&[], &["get", "/adspend/catalog", "--keys-only"])
        .await
        .expect("etcdctl with the admin certificate");
    let no_tls = [
        ("ETCDCTL_ENDPOINTS", "http://127.0.0.1:2379"),
        ("ETCDCTL_CACERT", ""),
        ("ETCDCTL_CERT", ""),
        ("ETCDCTL_KEY", ""),
    ];
    let no_cert = [("ETCDCTL_CERT", ""), ("ETCDCTL_KEY", "")];
    for (what, env) in [
        ("plaintext", &no_tls[..]),
        ("no client certificate", &no_cert[..]),
    ] {
        let result = cluster
            .etcdctl_as(env, &["get", "/adspend/catalog", "--keys-only"])
            .await;
        assert!(
            result.is_err(),
            "etcd served a client with {what}: {result:?}"
        );
    }
    // etcd says why: an empty ETCDCTL_* is ignored, so these were refused by
    // the server, not given up by the client.
    let log = cluster.logs("etcd1", 400).await.expect("etcd1 log");
    for reason in [
        "first record does not look like a TLS handshake",
        "client didn't provide a certificate",
    ] {
        assert!(
            log.contains(reason),
            "etcd1 logged no rejected connection with {reason:?}:\n{log}"
        );
    }
    // Between the servers: a plaintext NATS route (from the host to nats2's
    // cluster port) and a plain HTTP peer request to etcd2 are refused.
    let nats2 = cluster
        .state("nats2")
        .await
        .expect("nats2")
        .data_ip
        .expect("nats2 address");
    let mut route = tokio::net::TcpStream::connect((nats2.as_str(), 6222))
        .await
        .expect("tcp connect to nats2's route port");
    let _ = route
        .write_all(b"CONNECT {\"verbose\":false}\r\nPING\r\n")
        .await;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), route.read_to_end(&mut answer))
        .await
        .expect("nats2 kept a plaintext route open")
        .ok();
    let answer = String::from_utf8_lossy(&answer);
    // The route port speaks TLS first: plaintext gets no INFO and no PONG.
    assert!(
        !answer.contains("PONG") && !answer.contains("INFO"),
        "a plaintext route was served: {answer}"
    );
    let id = cluster.id("etcd1").await.expect("etcd1");
    let peer = tokio::process::Command::new("docker")
        .args(["exec", &id, "/adspend-probe", "http://etcd2:2380/members"])
        .output()
        .await
        .expect("docker exec adspend-probe");
    let said = String::from_utf8_lossy(&peer.stderr);
    // Plain peers got 200 and the member list; TLS peers close the connection.
    assert!(
        !peer.status.success(),
        "etcd2 answered a plain peer request: {said}"
    );
    pacer_plain_and_tokenless_refused().await;
    figure("all up: plaintext and credential-less clients refused by NATS, etcd and the pacer, plain routes and peers too");
}

/// pacer1's API from the host: plain HTTP gets no answer, HTTPS without a
/// token gets 401 on a read, the read token does not decide, and the client
/// of pacer-client.env reads.
async fn pacer_plain_and_tokenless_refused() {
    let access = pacer();
    assert!(
        access.url.starts_with("https://") && access.read_token.is_some(),
        "pacer-client.env should name an HTTPS URL and a read token: {access:?}"
    );
    let plain = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let result = plain.get("http://127.0.0.1:8080/v1/shards").send().await;
    assert!(result.is_err(), "pacer1 answered plain HTTP: {result:?}");
    let tokenless = PacerAccess {
        read_token: None,
        ..access.clone()
    }
    .client(Duration::from_secs(5))
    .unwrap();
    let status = tokenless
        .get(format!("{}/v1/shards", access.url))
        .send()
        .await
        .expect("https without a token")
        .status();
    assert_eq!(status, reqwest::StatusCode::UNAUTHORIZED);
    let with_read = http();
    let status = with_read
        .post(format!("{}/v1/decisions", access.url))
        .json(&serde_json::json!({"ad_ids": ["any"]}))
        .send()
        .await
        .expect("a decision with the read token")
        .status();
    assert!(
        status == reqwest::StatusCode::UNAUTHORIZED || status == reqwest::StatusCode::FORBIDDEN,
        "the read token decided: {status}"
    );
    let status = with_read
        .get(format!("{}/v1/shards", access.url))
        .send()
        .await
        .expect("https with the read token")
        .status();
    assert!(status.is_success(), "the read token was refused: {status}");
}

/// Polls the cluster's Prometheus (`127.0.0.1:9090`) until `alert` fires
/// for `instance`.
pub(super) async fn wait_alert(alert: &str, instance: &str) {
    let started = Instant::now();
    let mut last = String::new();
    while started.elapsed() < Duration::from_secs(150) {
        if let Ok(response) = reqwest::Client::new().get(PROMETHEUS_ALERTS).send().await {
            if let Ok(doc) = response.json::<serde_json::Value>().await {
                let alerts = doc["data"]["alerts"]
                    .as_array()
                    .cloned()
                    .unwrap_or_default();
                if alerts.iter().any(|a| {
                    a["labels"]["alertname"] == alert
                        && a["labels"]["instance"] == instance
                        && a["state"] == "firing"
                }) {
                    return;
                }
                last = doc.to_string();
            }
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    panic!("Prometheus never fired {alert} for {instance}; last answer: {last}");
}
