//! Every bad-input kind of CONTRACT.md lands in DEADLETTER with its reason,
//! is counted in adspend_rejected_total, and the good events stay exact.

use std::collections::BTreeMap;
use std::time::Duration;

use adspend_harness::{free_port, wait_until_ok};
use adspend_sim::{BadKind, SimConfig};
use async_nats::jetstream::{self, consumer::pull::OrderedConfig};
use futures::StreamExt;

use crate::support::{assert_exact, try_metric, Backends, Pipeline};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_bad_kind_is_dead_lettered_with_its_reason() {
    let mut p = Pipeline::start(Backends::default(), 200).await;
    let limiter_metrics = free_port();
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn_with("limiter", limiter_metrics, &[]));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;

    let config = SimConfig {
        events: Some(6_000),
        duplicate_rate: 0.05,
        bad_rate: 0.15,
        bad_kinds: BadKind::ALL.to_vec(),
        batch: 20,
        seed: 5,
        ..SimConfig::default()
    };
    let truth = p.publish(&config).await;
    let expected: BTreeMap<String, u64> = truth.stats.bad_events_acked.clone();
    for kind in BadKind::ALL {
        assert!(
            expected.get(kind.reason()).copied().unwrap_or(0) > 0,
            "no {kind:?} sent: {expected:?}"
        );
    }
    let comparison = p.settle(&truth, Duration::from_secs(60)).await;
    assert_exact(&comparison, &truth);

    // Read DEADLETTER back and count reasons.
    let total: u64 = expected.values().sum();
    let js = jetstream::new(p.client().await);
    let stream = js
        .get_stream("DEADLETTER")
        .await
        .expect("DEADLETTER exists");
    let consumer = stream
        .create_consumer(OrderedConfig::default())
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut seen: BTreeMap<String, u64> = BTreeMap::new();
    for _ in 0..total {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("fewer dead letters than bad events")
            .expect("stream ended")
            .expect("message");
        let letter: serde_json::Value =
            serde_json::from_slice(&message.payload).expect("dead letter is JSON");
        let reason = letter["reason"].as_str().expect("reason").to_string();
        assert_eq!(message.subject.as_str(), format!("deadletter.{reason}"));
        assert!(
            letter["line"].is_string() && letter["detail"].is_string(),
            "{letter}"
        );
        *seen.entry(reason).or_default() += 1;
    }
    assert_eq!(seen, expected);
    let info = js
        .get_stream("DEADLETTER")
        .await
        .unwrap()
        .info()
        .await
        .unwrap()
        .clone();
    assert_eq!(info.state.messages, total, "extra dead letters");

    // The counter counts validations: input the limiter was redelivered (on
    // a loaded machine an ack can come late) is validated and counted again,
    // while its dead letter is dropped by JetStream as a duplicate (the
    // stream count above is exact).
    for (reason, n) in &expected {
        let series = format!("adspend_rejected_total{{reason=\"{reason}\"}}");
        wait_until_ok(
            Duration::from_secs(5),
            Duration::from_millis(100),
            || async {
                let counted = try_metric(limiter_metrics, &series).await?;
                anyhow::ensure!(counted >= *n as f64, "{series} is {counted}");
                Ok(())
            },
        )
        .await
        .unwrap_or_else(|e| panic!("{series} is below {n}: {e:#}"));
    }
}
