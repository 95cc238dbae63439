//! Every call every service makes is granted by deploy/nats-auth.conf: the
//! services run with their own users, the aggregator as shards of some
//! partitions (each reads the last message of its own subjects), through
//! budget alerts with a webhook, leases and releases, an idle spell (each
//! shard's stall check), the limiter's source watch reset (its ordered
//! consumer deleted and made again) and a NATS restart (every consumer made
//! again), with short retention windows (input, dead letters and alerts
//! purged), and neither the server nor any service saw a permission
//! violation.

use std::time::Duration;

use adspend_harness::{free_port, wait_until, ServiceProcess};
use adspend_sim as sim;
use tokio_util::sync::CancellationToken;

use super::support::{connect, Auth};
use crate::support::{assert_exact, metric, sim_config, Backends, Pipeline};

/// Metric of refused operations (common's telemetry).
const VIOLATIONS: &str = "adspend_nats_permission_violations_total";

struct Service {
    name: &'static str,
    metrics_port: u16,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_call_of_every_service_is_granted() {
    let auth = Auth::generate();
    let catalog = sim::generate_catalog(&sim::CatalogSpec::for_ads(200), 12).expect("catalog");
    let mut p = Pipeline::start_with(Backends::default(), auth.nats_options(), catalog).await;
    with_alerts(&p, "[1, 2, 5]");
    let (hook, received) = crate::alerts::receiver(0).await;
    let services = [
        Service {
            name: "aggregator",
            metrics_port: free_port(),
        },
        Service {
            name: "limiter",
            metrics_port: free_port(),
        },
        Service {
            name: "pacer",
            metrics_port: free_port(),
        },
    ];
    let spawn = |s: &Service, extra: &[(&str, &str)]| -> ServiceProcess {
        let mut env: Vec<(&str, String)> = auth.env(s.name);
        env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        p.spawn_with(s.name, s.metrics_port, &env)
    };
    // Two writers: each shard reads only its partitions' subjects.
    let aggregator = spawn(&services[0], &[("ADSPEND_AGGREGATOR_WRITERS", "2")]);
    // Short retention windows: input, dead letters and alerts are purged
    // (and the limits applied to a DEADLETTER an aggregator may have made
    // first) under the services' own users too.
    let limiter = spawn(
        &services[1],
        &[
            ("ADSPEND_INPUT_RETENTION_MS", "2000"),
            ("ADSPEND_INPUT_MAX_BYTES", "268435456"),
            ("ADSPEND_DEADLETTER_RETENTION_MS", "86400000"),
        ],
    );
    let pacer = spawn(
        &services[2],
        &[
            ("ADSPEND_ALERTS_RETENTION_MS", "2000"),
            ("ADSPEND_ALERTS_WEBHOOK_URL", &hook),
            (
                "ADSPEND_ALERTS_WEBHOOK_SECRET",
                "webhook-secret-for-the-test",
            ),
        ],
    );
    p.aggregator = Some(aggregator);
    p.limiter = Some(limiter);
    p.pacer = Some(pacer);
    p.wait_pacer().await;

    let (adserver, _) = connect(&auth.args(&p.nats.url(), "adserver"))
        .await
        .expect("the ad server connects");
    let publish = |events: u64, seed: u64| {
        let config = sim::SimConfig {
            create_stream: false,
            ..sim_config(events, seed)
        };
        let (adserver, catalog) = (adserver.clone(), p.catalog.clone());
        async move {
            sim::run(&adserver, &config, &catalog, CancellationToken::new())
                .await
                .expect("the ad server publishes")
        }
    };
    let mut truth = publish(3_000, 5).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);

    // Leases: a grant and its release go through the ledger.
    lease_and_release(&p.pacer_url(), &p.catalog).await;
    // Alerts were announced and delivered to the webhook.
    wait_until(Duration::from_secs(30), Duration::from_millis(200), || {
        let n = received.lock().unwrap().len();
        async move { n > 0 }
    })
    .await
    .expect("no budget alert reached the webhook");
    // Idle: each shard's stall check finds the stream's head in the other
    // shard's partitions and reads where its own part ends.
    tokio::time::sleep(Duration::from_secs(6)).await;
    // Meanwhile the windows ran out: acknowledged input and alerts but each
    // limit's last were purged, with the services' own grants.
    for (port, series) in [
        (
            services[1].metrics_port,
            "adspend_limiter_input_purged_messages_total{reason=\"age\"}",
        ),
        (services[2].metrics_port, "adspend_alerts_purged_total"),
    ] {
        wait_until(
            Duration::from_secs(20),
            Duration::from_millis(200),
            || async move {
                crate::support::try_metric(port, series)
                    .await
                    .is_ok_and(|n| n > 0.0)
            },
        )
        .await
        .unwrap_or_else(|_| panic!("nothing purged: {series}"));
    }

    // The limiter's source watch (an ordered consumer) loses its consumer
    // on the server, as when a NATS node dies: it deletes what is left of
    // it and makes a new one. Then a restart: every consumer is made again
    // after the reconnect.
    let watch = delete_watch_consumer(&p, &auth).await;
    wait_until(Duration::from_secs(20), Duration::from_millis(200), || {
        let (p, watch) = (&p, watch.clone());
        async move {
            consumer_names(p)
                .await
                .iter()
                .any(|n| n.starts_with(&watch) && *n != watch)
        }
    })
    .await
    .expect("the source watch did not make a new consumer");
    p.nats.kill();
    p.nats.restart().await;
    truth.absorb(&publish(2_000, 6).await);
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);

    // Neither the server nor any service saw a refusal.
    let nats_log = std::fs::read_to_string(p.nats.log_path()).unwrap_or_default();
    let refused: Vec<&str> = nats_log
        .lines()
        .filter(|l| l.contains("Violation"))
        .collect();
    assert!(
        refused.is_empty(),
        "NATS refused a service something it calls:\n{}",
        refused.join("\n")
    );
    for (service, process) in services.iter().zip([&p.aggregator, &p.limiter, &p.pacer]) {
        let process = process.as_ref().expect("running");
        let log = std::fs::read_to_string(process.log_path()).unwrap_or_default();
        let denied: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("Permissions Violation") || l.contains("permission denied"))
            .collect();
        assert!(
            denied.is_empty(),
            "{} was refused a call:\n{}",
            service.name,
            denied.join("\n")
        );
        for kind in ["publish", "subscribe"] {
            let series = format!("{VIOLATIONS}{{kind=\"{kind}\"}}");
            assert_eq!(
                metric(service.metrics_port, &series).await,
                0.0,
                "{}: {series}",
                service.name
            );
        }
    }
}

/// The pipeline's catalog file with `alerts` on every limit (the pacer
/// watches the file).
fn with_alerts(p: &Pipeline, alerts: &str) {
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&p.catalog_path).unwrap()).unwrap();
    let limits = doc["limits"].as_object_mut().expect("limits");
    for limit in limits.values_mut() {
        limit["alerts"] = serde_json::from_str(alerts).unwrap();
    }
    std::fs::write(&p.catalog_path, serde_json::to_vec(&doc).unwrap()).unwrap();
}

/// A lease of one micro for every ad, then its release.
async fn lease_and_release(url: &str, catalog: &sim::Catalog) {
    let http = reqwest::Client::new();
    let asks: Vec<serde_json::Value> = catalog
        .ads
        .keys()
        .map(|ad| serde_json::json!({"ad_id": ad, "micros": 1}))
        .collect();
    let body: serde_json::Value = http
        .post(format!("{url}/v1/leases"))
        .json(&serde_json::json!({ "ads": asks }))
        .send()
        .await
        .expect("lease request")
        .json()
        .await
        .expect("lease answer");
    let leases: Vec<serde_json::Value> = body["leases"]
        .as_array()
        .expect("leases")
        .iter()
        .filter_map(|l| l["lease_id"].as_str())
        .map(|id| serde_json::json!({"lease_id": id, "served_micros": 0}))
        .collect();
    assert!(!leases.is_empty(), "nothing granted: {body}");
    let released: serde_json::Value = http
        .post(format!("{url}/v1/leases/release"))
        .json(&serde_json::json!({ "leases": leases }))
        .send()
        .await
        .expect("release request")
        .json()
        .await
        .expect("release answer");
    assert!(
        released["leases"]
            .as_array()
            .is_some_and(|l| l.iter().all(|l| l["released"] == true)),
        "not every lease released: {released}"
    );
}

/// The consumers on `IMPRESSIONS`, from the server's monitoring endpoint.
async fn consumer_names(p: &Pipeline) -> Vec<String> {
    let url = format!("{}/jsz?consumers=true", p.nats.monitor_url());
    let Ok(response) = reqwest::get(&url).await else {
        return Vec::new();
    };
    let body: serde_json::Value = response.json().await.unwrap_or_default();
    let mut names = Vec::new();
    for account in body["account_details"].as_array().into_iter().flatten() {
        for stream in account["stream_detail"].as_array().into_iter().flatten() {
            if stream["name"] != "IMPRESSIONS" {
                continue;
            }
            for consumer in stream["consumer_detail"].as_array().into_iter().flatten() {
                if let Some(name) = consumer["name"].as_str() {
                    names.push(name.to_owned());
                }
            }
        }
    }
    names
}

/// Deletes the limiter's source watch consumer as the auditor may; returns
/// its name.
async fn delete_watch_consumer(p: &Pipeline, auth: &Auth) -> String {
    let watch = wait_until_some(p).await;
    let (auditor, _) = connect(&auth.args(&p.nats.url(), "auditor"))
        .await
        .expect("the auditor connects");
    let js = async_nats::jetstream::new(auditor);
    let stream = js.get_stream("IMPRESSIONS").await.expect("IMPRESSIONS");
    stream
        .delete_consumer(&watch)
        .await
        .expect("the auditor deletes the watch's consumer");
    watch
}

async fn wait_until_some(p: &Pipeline) -> String {
    let found = std::sync::Mutex::new(None);
    wait_until(Duration::from_secs(10), Duration::from_millis(200), || {
        let found = &found;
        async move {
            let name = consumer_names(p)
                .await
                .into_iter()
                .find(|n| n.contains("-watch-"));
            let some = name.is_some();
            *found.lock().unwrap() = name;
            some
        }
    })
    .await
    .expect("no source watch consumer on IMPRESSIONS");
    found.into_inner().unwrap().unwrap()
}
