//! Budget alerts (docs/BUDGET-ALERTS.md): each crossing of a limit's threshold is
//! one message on `ALERTS`, through an aggregator crash and replay, a
//! pacer's crash (its memory of what was announced gone, the stream's
//! duplicate window too short to help) and two pacers watching the same
//! spend; `GET /v1/alerts` lists them newest first, in pages; the webhook
//! retries a failing receiver with backoff until it answers 2xx, signed;
//! a catalog with bad thresholds is refused with a clear error.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use adspend_common::nats::{ALERTS_STREAM, ALERTS_SUBJECTS};
use adspend_harness::{free_port, wait_until, NatsOptions, ServiceProcess};
use adspend_pacer::alerts::webhook::signature;
use adspend_sim::{self as sim, Period};
use async_nats::jetstream::{self, stream};
use futures::StreamExt;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{Backends, Pipeline};

const BUDGET: u64 = 1_000_000;

/// Two limits with alerts: `camp` (lifetime, ad-1) and `day` (daily, ad-2).
fn catalog() -> sim::Catalog {
    let limit = |period| sim::Limit {
        budget_micros: BUDGET,
        period,
        time_zone: "UTC".into(),
        parent: None,
    };
    sim::Catalog {
        limits: BTreeMap::from([
            ("camp".to_string(), limit(Period::Lifetime)),
            ("day".to_string(), limit(Period::Daily)),
        ]),
        ads: BTreeMap::from([
            ("ad-1".to_string(), vec!["camp".to_string()]),
            ("ad-2".to_string(), vec!["day".to_string()]),
        ]),
    }
}

/// The pipeline's catalog file with `alerts` added to both limits.
async fn start(alerts: &str) -> Pipeline {
    let p = Pipeline::start_with(Backends::default(), NatsOptions::default(), catalog()).await;
    let mut doc: Value = serde_json::from_slice(&std::fs::read(&p.catalog_path).unwrap()).unwrap();
    for limit in ["camp", "day"] {
        doc["limits"][limit]["alerts"] = serde_json::from_str(alerts).unwrap();
    }
    std::fs::write(&p.catalog_path, serde_json::to_vec(&doc).unwrap()).unwrap();
    p
}

/// `ALERTS` made before any pacer, with a duplicate window of one second:
/// past it, only the comparison with a subject's last alert keeps a
/// crossing from being announced twice.
async fn short_memory_alerts_stream(client: &async_nats::Client) {
    jetstream::new(client.clone())
        .create_stream(stream::Config {
            name: ALERTS_STREAM.into(),
            subjects: vec![ALERTS_SUBJECTS.into()],
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(1),
            ..Default::default()
        })
        .await
        .expect("create ALERTS");
}

/// Publish one impression of `ad` costing `cost` micros, acknowledged.
async fn spend(client: &async_nats::Client, id: &str, ad: &str, cost: u64) {
    sim::ensure_stream(client).await.expect("IMPRESSIONS");
    let js = jetstream::new(client.clone());
    let ts = adspend_common::now_ms();
    let body = format!(r#"{{"id":"{id}","ad_id":"{ad}","cost_micros":{cost},"ts":{ts}}}"#);
    js.publish("impressions.test", body.into())
        .await
        .expect("publish")
        .await
        .expect("impression acknowledged");
}

/// Every alert on the stream, in stream order: (subject, alert JSON).
pub(crate) async fn stream_alerts(client: &async_nats::Client) -> Vec<(String, Value)> {
    let js = jetstream::new(client.clone());
    let Ok(mut stream) = js.get_stream(ALERTS_STREAM).await else {
        return Vec::new();
    };
    let last = stream
        .info()
        .await
        .expect("ALERTS info")
        .state
        .last_sequence;
    let mut out = Vec::new();
    if last == 0 {
        return out;
    }
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await
        .expect("ordered consumer");
    let mut messages = consumer.messages().await.expect("messages");
    while let Some(message) = messages.next().await {
        let message = message.expect("alert message");
        let payload: Value = serde_json::from_slice(&message.payload).expect("alert JSON");
        out.push((message.subject.to_string(), payload));
        if message.info().expect("info").stream_sequence >= last {
            break;
        }
    }
    out
}

/// (limit, threshold) of each alert on the stream, in stream order.
async fn crossings(client: &async_nats::Client) -> Vec<(String, u64)> {
    stream_alerts(client)
        .await
        .into_iter()
        .map(|(_, a)| {
            let limit = a["limit_id"].as_str().unwrap().to_string();
            (limit, a["threshold_percent"].as_u64().unwrap())
        })
        .collect()
}

/// Waits for the alerts on the stream to be `expected` (in any order across
/// limits: the pacers see limits' spend in any order), and checks that
/// each limit's alerts came in ascending order.
async fn wait_crossings(client: &async_nats::Client, expected: &[(&str, u64)], what: &str) {
    let mut expected: Vec<(String, u64)> =
        expected.iter().map(|(l, t)| (l.to_string(), *t)).collect();
    expected.sort();
    let reached = wait_until(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async { crossings(client).await.len() >= expected.len() },
    )
    .await;
    let seen = crossings(client).await;
    assert!(
        reached.is_ok(),
        "{what}: alerts {seen:?}, expected {expected:?}"
    );
    let mut sorted = seen.clone();
    sorted.sort();
    assert_eq!(sorted, expected, "{what}");
    for limit in ["camp", "day"] {
        let of_limit: Vec<u64> = seen
            .iter()
            .filter(|(l, _)| l == limit)
            .map(|(_, t)| *t)
            .collect();
        assert!(
            of_limit.is_sorted(),
            "{what}: {limit}'s alerts out of order: {seen:?}"
        );
    }
}

fn spawn_pacer(p: &Pipeline, addr: &str, extra: &[(&str, &str)]) -> ServiceProcess {
    let mut settings = vec![("ADSPEND_PACER_ADDR", addr)];
    settings.extend_from_slice(extra);
    p.spawn_with("pacer", free_port(), &settings)
}

async fn wait_healthy(addr: &str) {
    let url = format!("http://{addr}/healthz");
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            reqwest::get(&url)
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await
    .unwrap_or_else(|_| panic!("pacer at {addr} did not become healthy"));
}

async fn get_json(url: &str) -> Value {
    let response = reqwest::get(url).await.expect("GET");
    assert!(
        response.status().is_success(),
        "{url}: {}",
        response.status()
    );
    response.json().await.expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_crossing_is_announced_once_through_crashes_and_two_pacers() {
    let mut p = start("[25, 50, 100]").await;
    let client = p.client().await;
    short_memory_alerts_stream(&client).await;
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let second_addr = format!("127.0.0.1:{}", free_port());
    let mut second = spawn_pacer(&p, &second_addr, &[]);
    wait_healthy(&second_addr).await;

    // 30% of camp: 25 crossed; 60% of day: 25 and 50 crossed.
    spend(&client, "i1", "ad-1", 300_000).await;
    spend(&client, "i2", "ad-2", 600_000).await;
    let first = [("camp", 25), ("day", 25), ("day", 50)];
    wait_crossings(&client, &first, "first crossings").await;

    // The aggregator crashes right after committing the next spend, before
    // pushing it; meanwhile the first pacer crashes and comes back with
    // nothing in memory, past the stream's duplicate window.
    p.aggregator.as_mut().unwrap().kill();
    let mut crashing = p.spawn_with(
        "aggregator",
        free_port(),
        &[("ADSPEND_FAILPOINTS", "aggregator.after_commit")],
    );
    spend(&client, "i3", "ad-1", 250_000).await;
    crashing
        .wait_for_exit(Duration::from_secs(30))
        .await
        .expect("the aggregator did not crash at its failure point");
    assert!(
        crashing
            .log_tail(50)
            .contains("FAILPOINT FIRED: aggregator.after_commit"),
        "{}",
        crashing.log_tail(50)
    );
    p.pacer.as_mut().unwrap().kill();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    p.pacer.as_mut().unwrap().restart();
    p.wait_pacer().await;
    // The next aggregator restores what the crashed one committed and
    // replays the stream after it, then pushes its full state.
    p.aggregator = Some(p.spawn("aggregator"));
    let after_crashes = [("camp", 25), ("day", 25), ("day", 50), ("camp", 50)];
    wait_crossings(&client, &after_crashes, "after the crashes").await;

    // Past the budget: 100 once, though both pacers see it.
    spend(&client, "i4", "ad-1", 500_000).await;
    spend(&client, "i1", "ad-1", 300_000).await; // a duplicate: not counted
    let expected = [
        ("camp", 25),
        ("day", 25),
        ("day", 50),
        ("camp", 50),
        ("camp", 100),
    ];
    wait_crossings(&client, &expected, "at 105%").await;
    // Both pacers have compared their spend with the stream several times
    // since (every 250 ms): nothing more may appear.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(crossings(&client).await.len(), expected.len(), "a repeat");

    let alerts = stream_alerts(&client).await;
    let (subject, last) = alerts.last().unwrap();
    assert_eq!(last["threshold_percent"], 100);
    assert_eq!(subject, "adspend.alerts.camp");
    assert_eq!(last["budget_micros"], BUDGET);
    assert_eq!(last["spend_micros"], 1_050_000);
    assert!(last["period_start"].is_null(), "{last}");
    assert!(last["at_ms"].as_i64().unwrap() > 0);
    let (_, day) = alerts
        .iter()
        .find(|(_, a)| a["limit_id"] == "day" && a["threshold_percent"] == 50)
        .unwrap();
    let limit = get_json(&format!("{}/v1/limits/day", p.pacer_url())).await;
    assert_eq!(day["period_start"], limit["period_start"]);
    assert_eq!(day["spend_micros"], 600_000);

    // Newest first, in pages, on either pacer.
    let newest_first: Vec<String> = alerts
        .iter()
        .rev()
        .map(|(_, a)| {
            let start = a["period_start"].as_str().unwrap_or("lifetime");
            format!(
                "alert/{}/{start}/{}",
                a["limit_id"].as_str().unwrap(),
                a["threshold_percent"]
            )
        })
        .collect();
    for base in [p.pacer_url(), format!("http://{second_addr}")] {
        let mut listed = Vec::new();
        let mut after = String::new();
        let mut pages = 0;
        loop {
            let page = get_json(&format!("{base}/v1/alerts?limit=3{after}")).await;
            pages += 1;
            for alert in page["alerts"].as_array().unwrap() {
                listed.push(alert["id"].as_str().unwrap().to_string());
            }
            match page["next"].as_str() {
                Some(next) => after = format!("&after={next}"),
                None => break,
            }
        }
        assert_eq!(listed, newest_first, "{base}");
        assert_eq!(pages, 2, "{base}");
    }
    second
        .terminate(Duration::from_secs(10))
        .expect("stop the second pacer");
}

/// One request the receiver got: its alert id, signature and body.
#[derive(Debug, Clone)]
pub(crate) struct Received {
    id: String,
    signature: String,
    body: Vec<u8>,
    answered: u16,
}

/// A webhook receiver that answers 503 to the first `failures` requests,
/// then 204.
pub(crate) async fn receiver(failures: usize) -> (String, Arc<Mutex<Vec<Received>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/hook", listener.local_addr().unwrap());
    let received: Arc<Mutex<Vec<Received>>> = Arc::default();
    let log = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((mut socket, _)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let mut raw = Vec::new();
                let mut buf = [0u8; 4096];
                let (head, body_start, length) = loop {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    raw.extend_from_slice(&buf[..n]);
                    if let Some(end) = raw.windows(4).position(|w| w == b"\r\n\r\n") {
                        let head = String::from_utf8_lossy(&raw[..end]).to_ascii_lowercase();
                        let length = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .map_or(0, |v| v.trim().parse().unwrap());
                        break (head, end + 4, length);
                    }
                };
                while raw.len() < body_start + length {
                    let n = socket.read(&mut buf).await.unwrap_or(0);
                    if n == 0 {
                        return;
                    }
                    raw.extend_from_slice(&buf[..n]);
                }
                let header = |name: &str| {
                    head.lines()
                        .find_map(|l| l.strip_prefix(&format!("{name}:")))
                        .unwrap_or_default()
                        .trim()
                        .to_string()
                };
                let answered = {
                    let mut log = log.lock().unwrap();
                    let answered = if log.len() < failures { 503 } else { 204 };
                    log.push(Received {
                        id: header("x-adspend-alert-id"),
                        signature: header("x-adspend-signature"),
                        body: raw[body_start..body_start + length].to_vec(),
                        answered,
                    });
                    answered
                };
                let reply = format!(
                    "HTTP/1.1 {answered} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
                let _ = socket.write_all(reply.as_bytes()).await;
            });
        }
    });
    (url, received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_webhook_retries_a_failing_receiver_until_it_recovers_signed() {
    const SECRET: &str = "webhook-secret-for-the-test";
    const FAILURES: usize = 3;
    let mut p = start("[25, 50]").await;
    let (url, received) = receiver(FAILURES).await;
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn_with(
        "pacer",
        free_port(),
        &[
            ("ADSPEND_ALERTS_WEBHOOK_URL", &url),
            ("ADSPEND_ALERTS_WEBHOOK_SECRET", SECRET),
        ],
    ));
    p.wait_pacer().await;
    let client = p.client().await;
    spend(&client, "i1", "ad-1", 600_000).await;
    wait_crossings(&client, &[("camp", 25), ("camp", 50)], "crossings").await;

    let delivered = |log: &[Received]| {
        let mut ids: Vec<String> = log
            .iter()
            .filter(|r| r.answered == 204)
            .map(|r| r.id.clone())
            .collect();
        ids.sort();
        ids
    };
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async { delivered(&received.lock().unwrap()).len() >= 2 },
    )
    .await
    .unwrap_or_else(|_| panic!("not delivered: {:?}", received.lock().unwrap()));
    // Acked after the 2xx: no delivery of either after its first success.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = received.lock().unwrap().clone();
    assert_eq!(
        delivered(&log),
        ["alert/camp/lifetime/25", "alert/camp/lifetime/50"],
        "{log:?}"
    );
    assert_eq!(log.len(), FAILURES + 2, "{log:?}");
    for request in &log {
        assert_eq!(
            request.signature,
            signature(SECRET.as_bytes(), &request.body)
        );
        let alert: Value = serde_json::from_slice(&request.body).unwrap();
        let id = format!("alert/camp/lifetime/{}", alert["threshold_percent"]);
        assert_eq!(request.id, id, "{alert}");
    }
    let metrics = crate::support::metric_value;
    let body = reqwest::get(format!("{}/metrics", p.pacer_url()))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let retried = r#"adspend_alerts_webhook_total{outcome="retried"}"#;
    assert_eq!(metrics(&body, retried), Some(FAILURES as f64), "{body}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_with_bad_alert_thresholds_is_refused_naming_the_limit() {
    let p = start("[50]").await;
    for (alerts, expected) in [
        (
            "[90, 50]",
            "limit \"camp\": alert thresholds must be ascending (90 before 50)",
        ),
        (
            "[0, 50]",
            "limit \"camp\": alert threshold 0 must be 1..=1000",
        ),
        (
            "[50, 50]",
            "limit \"camp\": alert threshold 50 is listed twice",
        ),
        (
            "[1001]",
            "limit \"camp\": alert threshold 1001 must be 1..=1000",
        ),
    ] {
        let path = p.dir.path().join("bad.json");
        let mut doc: Value =
            serde_json::from_slice(&std::fs::read(&p.catalog_path).unwrap()).unwrap();
        doc["limits"]["camp"]["alerts"] = serde_json::from_str(alerts).unwrap();
        std::fs::write(&path, serde_json::to_vec(&doc).unwrap()).unwrap();
        for service in ["pacer", "limiter"] {
            let mut process = p.spawn_with(
                service,
                free_port(),
                &[("ADSPEND_CATALOG", path.to_str().unwrap())],
            );
            let status = process
                .wait_for_exit(Duration::from_secs(30))
                .await
                .unwrap_or_else(|_| panic!("{service} ran with alerts {alerts}"));
            let log = process.log_tail(30);
            assert_eq!(status.code(), Some(1), "{service}: {log}");
            let line = log
                .lines()
                .rev()
                .find(|l| l.starts_with(&format!("{service}: error: ")))
                .unwrap_or_default();
            assert!(
                line.contains(expected) && line.contains("bad.json"),
                "{service}: {log}"
            );
        }
    }
    // A webhook URL without its secret is a bad setting, named.
    let mut pacer = p.spawn_with(
        "pacer",
        free_port(),
        &[("ADSPEND_ALERTS_WEBHOOK_URL", "http://127.0.0.1:9/hook")],
    );
    let status = pacer
        .wait_for_exit(Duration::from_secs(30))
        .await
        .expect("exit");
    assert_eq!(status.code(), Some(64), "{}", pacer.log_tail(30));
    assert!(
        pacer.log_tail(30).contains("ADSPEND_ALERTS_WEBHOOK_SECRET"),
        "{}",
        pacer.log_tail(30)
    );
}
