//! The binary batch format end to end on real NATS: the simulator's
//! impressions published as binary batches (duplicates among them) come out
//! exact at the pacer, and a batch of malformed entries is dead-lettered
//! entry by entry with NDJSON's reasons while its good entry counts.

use std::collections::BTreeMap;
use std::time::Duration;

use adspend_sim::{InputFormat, SimConfig};
use adspend_wire::batch::binary::BinaryBatch;
use async_nats::jetstream::{self, consumer::pull::OrderedConfig};
use futures::StreamExt;

use crate::support::{assert_exact, sim_config, Backends, Pipeline};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn binary_batches_are_exact_and_their_bad_entries_dead_lettered() {
    let mut p = Pipeline::start(Backends::default(), 200).await;
    p.spawn_all().await;
    let config = SimConfig {
        format: InputFormat::Binary,
        batch: 200,
        ..sim_config(20_000, 8)
    };
    let truth = p.publish(&config).await;
    assert_eq!(truth.stats.events_acked, 20_000);

    // One binary message: a good impression of an ad of the catalog (whose
    // spend the truth then holds too), then one of each fault, then a
    // length past the end.
    let ad = p.catalog.ads.keys().next().expect("an ad").clone();
    let mut batch = BinaryBatch::new();
    batch.push("bin-good", &ad, 0, 1_700_000_000_000, None);
    batch.push("bin-unknown", "no-such-ad", 5, 1_700_000_000_000, None);
    batch.push(&"x".repeat(65), &ad, 5, 1_700_000_000_000, None);
    batch.push("bin-costly", &ad, u64::MAX, 1_700_000_000_000, None);
    batch.push("bin-late", &ad, 5, -1, None);
    let mut payload = batch.into_bytes();
    payload.extend_from_slice(&[60, 8, b'b']);
    let js = jetstream::new(p.client().await);
    js.publish("impressions.binary", payload.into())
        .await
        .expect("publish")
        .await
        .expect("stored");

    let comparison = p.settle(&truth, Duration::from_secs(90)).await;
    assert_exact(&comparison, &truth);

    let stream = js
        .get_stream("DEADLETTER")
        .await
        .expect("DEADLETTER exists");
    let consumer = stream
        .create_consumer(OrderedConfig::default())
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut seen = BTreeMap::new();
    for _ in 0..5 {
        let message = tokio::time::timeout(Duration::from_secs(30), messages.next())
            .await
            .expect("fewer dead letters than bad entries")
            .expect("stream ended")
            .expect("message");
        let letter: serde_json::Value =
            serde_json::from_slice(&message.payload).expect("dead letter is JSON");
        let reason = letter["reason"].as_str().expect("reason").to_string();
        assert_eq!(message.subject.as_str(), format!("deadletter.{reason}"));
        seen.insert(letter["line_no"].as_u64().expect("line_no"), reason);
    }
    let expected: BTreeMap<u64, String> = [
        (1, "unknown_ad"),
        (2, "id_too_long"),
        (3, "cost_too_large"),
        (4, "invalid_ts"),
        (5, "invalid_json"),
    ]
    .into_iter()
    .map(|(n, r)| (n, r.to_string()))
    .collect();
    assert_eq!(seen, expected);
}
