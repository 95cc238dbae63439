//! NATS accounts and TLS (deploy/nats-auth.conf, scripts/nats-auth.sh): the
//! services run with their own least-privilege users over TLS and the
//! pipeline stays exact; an ad server can publish impressions and nothing
//! else; a user cannot subscribe to another user's inbox (replies); clients
//! without credentials, with a wrong password or without TLS are refused; a
//! wrong TLS setting is a config error naming it; a service connected to a
//! NATS that lets clients in without authentication says so in its log and
//! in `adspend_nats_unauthenticated`, and one connected with its user does
//! not.

mod grants;
mod support;

use self::support::*;

use std::time::Duration;

use adspend_common::config::NatsArgs;
use adspend_harness::{free_port, wait_until, NatsServer};
use adspend_sim as sim;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::support::{assert_exact, metric, sim_config, Backends, Pipeline};

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn services_with_their_own_users_over_tls_are_exact_and_an_ad_server_is_confined() {
    let auth = Auth::generate();
    let catalog = sim::generate_catalog(&sim::CatalogSpec::for_ads(200), 11).expect("catalog");
    let mut p = Pipeline::start_with(Backends::default(), auth.nats_options(), catalog).await;
    p.aggregator = Some(spawn_as(&p, &auth, "aggregator"));
    p.limiter = Some(spawn_as(&p, &auth, "limiter"));
    p.pacer = Some(spawn_as(&p, &auth, "pacer"));
    p.wait_pacer().await;
    wait_limiter_consumer(&p.nats).await;

    let (adserver, adserver_errors) = connect(&auth.args(&p.nats.url(), "adserver"))
        .await
        .expect("the ad server connects with its user over TLS");
    let config = sim::SimConfig {
        create_stream: false,
        ..sim_config(3_000, 5)
    };
    let truth = sim::run(&adserver, &config, &p.catalog, CancellationToken::new())
        .await
        .expect("the ad server publishes impressions");
    let comparison = p.settle(&truth, Duration::from_secs(60)).await;
    assert_exact(&comparison, &truth);

    // The limiter's source reports reach the pacer under their grants.
    let url = p.pacer_url();
    wait_until(Duration::from_secs(15), Duration::from_millis(200), || {
        let url = url.clone();
        async move {
            let Ok(response) = reqwest::get(format!("{url}/v1/sources")).await else {
                return false;
            };
            let body: serde_json::Value = response.json().await.unwrap_or_default();
            body["limiters"].as_array().is_some_and(|l| {
                l.iter()
                    .any(|l| l["sources"].as_array().is_some_and(|s| !s.is_empty()))
            })
        }
    })
    .await
    .expect("no source report from the limiter reached the pacer");

    // The pacer's lease ledger works under its grants: a lease is granted
    // (of every ad, one micro each: some have budget left).
    let asks: Vec<serde_json::Value> = p
        .catalog
        .ads
        .keys()
        .map(|ad| serde_json::json!({"ad_id": ad, "micros": 1}))
        .collect();
    let last = std::sync::Mutex::new(String::new());
    let granted = wait_until(Duration::from_secs(15), Duration::from_millis(200), || {
        let (url, asks, last) = (url.clone(), asks.clone(), &last);
        async move {
            let Ok(response) = reqwest::Client::new()
                .post(format!("{url}/v1/leases"))
                .json(&serde_json::json!({ "ads": asks }))
                .send()
                .await
            else {
                return false;
            };
            let body = response.text().await.unwrap_or_default();
            let granted = serde_json::from_str::<serde_json::Value>(&body)
                .ok()
                .and_then(|v| v["leases"].as_array().cloned())
                .is_some_and(|l| l.iter().any(|l| l["lease_id"].is_string()));
            *last.lock().unwrap() = body.chars().take(300).collect();
            granted
        }
    })
    .await;
    assert!(
        granted.is_ok(),
        "no lease granted under the pacer's NATS user: {}",
        last.lock().unwrap()
    );

    // The services needed nothing beyond their grants.
    let log = p.nats.log_tail(10_000);
    let violations: Vec<&str> = log.lines().filter(|l| l.contains("Violation")).collect();
    assert!(
        violations.is_empty(),
        "a service was refused something it needs:\n{}",
        violations.join("\n")
    );

    // The auditor reads IMPRESSIONS back (the compose cluster's checks do)
    // and may not write to it.
    let (auditor, auditor_errors) = connect(&auth.args(&p.nats.url(), "auditor"))
        .await
        .expect("the auditor connects");
    let read_back = adspend_sim::stream_truth::truth_from_stream(&auditor, &p.catalog)
        .await
        .expect("the auditor reads IMPRESSIONS");
    assert_eq!(
        read_back.limits, truth.limits,
        "IMPRESSIONS as the auditor reads it"
    );
    auditor
        .publish("impressions.audit", "{}".into())
        .await
        .expect("publish is buffered");
    auditor.flush().await.expect("flush");
    assert!(
        refused(&auditor_errors, "impressions.audit").await,
        "the auditor may publish impressions"
    );

    // The ad server may not write spend, pushes, resyncs, source reports or
    // dead letters, nor touch JetStream's API.
    let before = p.lifetimes().await.expect("pacer limits");
    let limit = before.keys().next().expect("a limit").clone();
    let forged = forged_push(&limit, 1 << 50);
    for subject in [
        "spend.0",
        "adspend.sums.all",
        "adspend.sums.forged",
        "adspend.resync",
        "adspend.sources",
        "deadletter.x",
        "adspend.leases",
        "$JS.API.STREAM.DELETE.IMPRESSIONS",
    ] {
        adserver
            .publish(subject, forged.clone().into())
            .await
            .expect("publish is buffered");
        adserver.flush().await.expect("flush");
        assert!(
            refused(&adserver_errors, subject).await,
            "no permissions violation for the ad server's publish to {subject}; server errors: {:?}",
            adserver_errors.lock().unwrap()
        );
    }
    // A barrier, not a wait: the server answered each forged publish (the
    // refusals above) before this push is sent, and hands the pacer's one
    // subscription its messages in the order it routed them, which the
    // pacer applies one by one. Once the barrier's shard shows, a forged
    // push that had got through would have landed.
    let (aggregator, _) = connect(&auth.args(&p.nats.url(), "aggregator"))
        .await
        .expect("aggregator user connects");
    aggregator
        .publish("adspend.sums.barrier", barrier_push().into())
        .await
        .expect("publish");
    aggregator.flush().await.expect("flush");
    let shards_url = format!("{}/v1/shards", p.pacer_url());
    wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        let url = shards_url.clone();
        async move {
            match reqwest::get(&url).await {
                Ok(r) => r
                    .text()
                    .await
                    .is_ok_and(|body| body.contains("\"shard\":\"barrier\"")),
                Err(_) => false,
            }
        }
    })
    .await
    .expect("the barrier push from the aggregator user did not reach the pacer");
    assert_eq!(
        p.lifetimes().await.expect("pacer limits"),
        before,
        "a forged push from the ad server moved the pacer"
    );
    assert_exact(&p.settle(&truth, Duration::from_secs(5)).await, &truth);

    // The same bytes from the aggregator's user do move it: the forgery was
    // one that would have counted.
    aggregator
        .publish("adspend.sums.forged", forged.into())
        .await
        .expect("publish");
    aggregator.flush().await.expect("flush");
    wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        let p = &p;
        let limit = limit.clone();
        async move {
            p.lifetimes()
                .await
                .is_ok_and(|l| l.get(&limit) == Some(&(1 << 50)))
        }
    })
    .await
    .expect("the control push from the aggregator user did not reach the pacer");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_credentials_or_tls_are_refused() {
    let auth = Auth::generate();
    let nats = NatsServer::start_with(auth.nats_options()).await;
    let url = nats.url();

    // Good user, TLS: accepted (so the refusals below are about what they
    // change).
    connect(&auth.args(&url, "pacer"))
        .await
        .expect("the pacer user connects over TLS");

    // Inboxes: the limiter's replies come below its own prefix, where it may
    // listen; another user's prefix and the shared `_INBOX.>` are refused.
    let (limiter, limiter_errors) = connect(&auth.args(&url, "limiter"))
        .await
        .expect("limiter user connects");
    let inbox = limiter.new_inbox();
    assert!(inbox.starts_with("_INBOX_limiter."), "{inbox}");
    let own = limiter
        .subscribe(format!(
            "{}.>",
            adspend_common::nats::inbox_prefix("limiter")
        ))
        .await
        .expect("subscribe");
    for subject in ["_INBOX_aggregator.>", "_INBOX_adserver.>", "_INBOX.>"] {
        let _refused = limiter.subscribe(subject).await.expect("subscribe is sent");
        limiter.flush().await.expect("flush");
        assert!(
            subscription_refused(&limiter_errors, subject).await,
            "no permissions violation for the limiter's subscription to {subject}; server errors: {:?}",
            limiter_errors.lock().unwrap()
        );
    }
    limiter.flush().await.expect("flush");
    let own_prefix = "_INBOX_limiter.".to_lowercase();
    assert!(
        !limiter_errors
            .lock()
            .unwrap()
            .iter()
            .any(|e| e.contains(&own_prefix)),
        "the limiter was refused its own inbox: {:?}",
        limiter_errors.lock().unwrap()
    );
    drop(own);

    let no_user = NatsArgs {
        nats_tls_ca: Some(auth.ca()),
        ..NatsArgs::plain(url.clone())
    };
    let err = connect(&no_user).await.expect_err("no credentials refused");
    assert!(
        err.to_string().to_lowercase().contains("authorization"),
        "not an authorization failure: {err}"
    );

    let wrong_password = NatsArgs {
        nats_password: Some("not-the-password".into()),
        ..auth.args(&url, "pacer")
    };
    let err = connect(&wrong_password)
        .await
        .expect_err("wrong password refused");
    assert!(
        err.to_string().to_lowercase().contains("authorization"),
        "not an authorization failure: {err}"
    );

    // Right password, but the client does not trust the demo CA (no
    // ADSPEND_NATS_TLS_CA): the server still insists on TLS, and the
    // client finds no trusted issuer, so it never sends the password.
    let untrusting = NatsArgs {
        nats_tls_ca: None,
        ..auth.args(&url, "pacer")
    };
    let err = connect(&untrusting)
        .await
        .expect_err("a client without the CA connected");
    assert!(
        err.to_string().contains("invalid peer certificate"),
        "not a certificate failure: {err}"
    );

    // A plaintext client: the server answers its CONNECT by closing the
    // connection (the TLS handshake it waits for fails), never with a PONG.
    let mut plain = tokio::net::TcpStream::connect(("127.0.0.1", nats.port()))
        .await
        .expect("tcp connect");
    let mut info = vec![0u8; 4096];
    let n = plain.read(&mut info).await.expect("read INFO");
    let info = String::from_utf8_lossy(&info[..n]).to_string();
    assert!(info.contains("\"tls_required\":true"), "{info}");
    let hello = format!(
        "CONNECT {{\"user\":\"pacer\",\"pass\":\"{}\",\"verbose\":false}}\r\nPING\r\n",
        auth.passwords["pacer"]
    );
    // The write may already fail if the server hung up first.
    let _ = plain.write_all(hello.as_bytes()).await;
    let mut answer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), plain.read_to_end(&mut answer))
        .await
        .expect("the server kept a plaintext client open");
    let answer = String::from_utf8_lossy(&answer);
    assert!(
        !answer.contains("PONG"),
        "a plaintext client was served ({read:?}): {answer}"
    );

    // A CA that did not sign the server's certificate: the handshake fails.
    let other = Auth::generate();
    let wrong_ca = NatsArgs {
        nats_tls_ca: Some(other.ca()),
        ..auth.args(&url, "pacer")
    };
    assert!(
        connect(&wrong_ca).await.is_err(),
        "a server certificate from another CA was trusted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_nats_credential_settings_are_config_errors_naming_them() {
    let dir = tempfile::tempdir().expect("tempdir");
    let not_pem = dir.path().join("ca.txt");
    std::fs::write(&not_pem, "hello").expect("write");
    let missing = dir.path().join("missing.pem");
    let url = "nats://127.0.0.1:4222";
    let cases = [
        (
            NatsArgs {
                nats_tls_ca: Some(missing.clone()),
                ..NatsArgs::plain(url)
            },
            "ADSPEND_NATS_TLS_CA",
        ),
        (
            NatsArgs {
                nats_tls_ca: Some(not_pem),
                ..NatsArgs::plain(url)
            },
            "ADSPEND_NATS_TLS_CA",
        ),
        (
            NatsArgs {
                nats_user: Some("limiter".into()),
                ..NatsArgs::plain(url)
            },
            "ADSPEND_NATS_USER",
        ),
        (
            NatsArgs {
                nats_password: Some("s3cret-value".into()),
                ..NatsArgs::plain(url)
            },
            "ADSPEND_NATS_PASSWORD",
        ),
        (
            NatsArgs {
                nats_tls_cert: Some(missing),
                ..NatsArgs::plain(url)
            },
            "ADSPEND_NATS_TLS_CERT",
        ),
    ];
    for (args, setting) in cases {
        let err = adspend_common::nats::options(&args)
            .err()
            .unwrap_or_else(|| panic!("{args:?} accepted"))
            .to_string();
        assert!(
            err.contains(setting),
            "{args:?}: {err:?} does not name {setting}"
        );
        assert!(!err.contains("s3cret-value"), "the password leaked: {err}");
    }

    // The Debug form a service may log never holds the password.
    let args = NatsArgs {
        nats_user: Some("limiter".into()),
        nats_password: Some("s3cret-value".into()),
        ..NatsArgs::plain(url)
    };
    assert!(!format!("{args:?}").contains("s3cret-value"));

    // And a service ends with that error, before connecting.
    let p = Pipeline::start(Backends::default(), 10).await;
    let mut limiter = p.spawn_with(
        "limiter",
        free_port(),
        &[("ADSPEND_NATS_TLS_CA", "/nonexistent/ca.pem")],
    );
    let status = limiter
        .wait_for_exit(Duration::from_secs(30))
        .await
        .expect("the limiter kept running with a missing CA file");
    let log = limiter.log_tail(20);
    // A bad setting: exit 64 (EX_USAGE).
    assert_eq!(status.code(), Some(64), "{log}");
    assert!(log.contains("ADSPEND_NATS_TLS_CA"), "{log}");
}

/// What a service logs when its NATS lets anyone in (common/src/nats.rs).
const OPEN_NATS_WARNING: &str = "NATS accepts clients without authentication";

/// The gauge's value on a service's `/metrics`, once the service has
/// connected to NATS and set it.
async fn unauthenticated_gauge(metrics_port: u16) -> f64 {
    let series = "adspend_nats_unauthenticated";
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async move {
            let Ok(response) =
                reqwest::get(format!("http://127.0.0.1:{metrics_port}/metrics")).await
            else {
                return false;
            };
            response
                .text()
                .await
                .is_ok_and(|body| crate::support::metric_value(&body, series).is_some())
        },
    )
    .await
    .unwrap_or_else(|_| panic!("no {series} on port {metrics_port}"));
    metric(metrics_port, series).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_on_an_open_nats_says_so_and_one_with_its_user_does_not() {
    // The single-machine default before the demo ran with users: a NATS
    // without accounts, services without credentials. Every service says
    // loudly that anyone may publish anything, naming the fix.
    let mut p = Pipeline::start(Backends::default(), 10).await;
    let ports = [free_port(), free_port(), free_port()];
    p.aggregator = Some(p.spawn_with("aggregator", ports[0], &[]));
    p.limiter = Some(p.spawn_with("limiter", ports[1], &[]));
    p.pacer = Some(p.spawn_with("pacer", ports[2], &[]));
    p.wait_pacer().await;
    for (service, port) in [
        (p.aggregator.as_mut().unwrap(), ports[0]),
        (p.limiter.as_mut().unwrap(), ports[1]),
        (p.pacer.as_mut().unwrap(), ports[2]),
    ] {
        let name = service.name().to_string();
        service
            .wait_for_log(OPEN_NATS_WARNING, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{name} did not warn about the open NATS: {e}"));
        let log = service.log_tail(200);
        let line = log
            .lines()
            .find(|l| l.contains(OPEN_NATS_WARNING))
            .expect("the warning line");
        assert!(line.contains("ERROR"), "{name}: not an error: {line}");
        for fix in [
            "deploy/nats-auth.conf",
            "scripts/nats-auth.sh",
            "ADSPEND_NATS_USER",
        ] {
            assert!(
                line.contains(fix),
                "{name}: the warning does not name {fix}: {line}"
            );
        }
        assert_eq!(unauthenticated_gauge(port).await, 1.0, "{name}");
    }
    drop(p);

    // The demo's setup (scripts/nats-auth.sh, deploy/nats-auth.conf): the
    // limiter connects with its own user over TLS, and neither warns nor
    // raises the gauge. (That an ad server there cannot forge a push is
    // services_with_their_own_users_over_tls_are_exact_and_an_ad_server_is_confined.)
    let auth = Auth::generate();
    let catalog = sim::generate_catalog(&sim::CatalogSpec::for_ads(10), 11).expect("catalog");
    let mut p = Pipeline::start_with(Backends::default(), auth.nats_options(), catalog).await;
    let port = free_port();
    let env = auth.env("limiter");
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    p.limiter = Some(p.spawn_with("limiter", port, &extra));
    wait_limiter_consumer(&p.nats).await;
    assert_eq!(unauthenticated_gauge(port).await, 0.0);
    let limiter = p.limiter.as_mut().unwrap();
    assert!(limiter.is_running(), "{}", limiter.log_tail(50));
    let log = limiter.log_tail(10_000);
    assert!(!log.contains(OPEN_NATS_WARNING), "{log}");
}

/// A pacer of a region with the pacer's own user (docs/REGIONS.md): it
/// creates its region's `REGIONS` with a source for its peer, publishes and
/// reads its reports, and probes the unlinked peer, without a refused call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_region_pacer_with_its_user_reports_without_a_refused_call() {
    let auth = Auth::generate();
    let p = Pipeline::start_with(
        Backends::default(),
        auth.nats_options(),
        crate::regions_pacer::catalog(),
    )
    .await;
    let addr = format!("127.0.0.1:{}", free_port());
    let mut env = auth.env("pacer");
    env.extend([
        ("ADSPEND_PACER_ADDR", addr.clone()),
        ("ADSPEND_REGION", "east".to_string()),
        ("ADSPEND_REGIONS", "east,west".to_string()),
    ]);
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut pacer = p.spawn_with("pacer", free_port(), &env);
    pacer
        .wait_for_log(
            "this pacer publishes its region's reports",
            Duration::from_secs(30),
        )
        .await
        .expect("the pacer publishes east's reports");
    // The publisher probes west (no such domain here: unlinked) every 2 s.
    tokio::time::sleep(Duration::from_secs(5)).await;
    let view = crate::leases::limit(&addr, "global").await;
    assert!(
        view["allotment_micros"].as_u64().is_some(),
        "east's book never read its stream: {view}"
    );
    let log = pacer.log_tail(400);
    assert!(
        !log.contains("NATS permission denied"),
        "a refused call:\n{log}"
    );
    assert!(!log.contains("region reports interrupted"), "{log}");
}
