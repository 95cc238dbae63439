//! Hostile data must not halt the pipeline: `SPEND` messages the aggregator
//! cannot decode are set aside (dead lettered with their sequence, counted,
//! logged) and everything else goes on exactly, also after a crash and a
//! replay over them.

use std::time::Duration;

use adspend_harness::free_port;
use adspend_wire::codec::{encode_spend, FORMAT_V2};
use adspend_wire::types::{SpendBatch, SpendMessage, SpendTuple};
use async_nats::jetstream::{self, consumer::pull::OrderedConfig};
use futures::StreamExt;

use crate::support::{assert_exact, metric, sim_config, Backends, Pipeline};

const SET_ASIDE: &str = "adspend_aggregator_spend_set_aside_total{reason=\"undecodable\"}";

/// Publish raw bytes on `subject` (its stream must exist); returns the
/// stream sequence.
pub(crate) async fn publish_raw(p: &Pipeline, subject: &str, payload: Vec<u8>) -> u64 {
    let js = jetstream::new(p.client().await);
    js.publish(subject.to_string(), payload.into())
        .await
        .expect("publish")
        .await
        .expect("acknowledged")
        .sequence
}

/// Three kinds of bad `SPEND` message: garbage, a format version this
/// aggregator does not know, and a tuple naming a limit its batch lacks.
fn poison() -> Vec<Vec<u8>> {
    let mut unknown_version = encode_spend(&SpendMessage::Batch(SpendBatch {
        source_ms: 1,
        limits: vec!["x".into()],
        tuples: vec![],
    }));
    unknown_version[0] = FORMAT_V2 + 7;
    let out_of_range = encode_spend(&SpendMessage::Batch(SpendBatch {
        source_ms: 1,
        limits: vec!["x".into()],
        tuples: vec![SpendTuple {
            limit: 5,
            bucket: u32::MAX,
            cost_micros: 1,
            msg_id: adspend_wire::types::MsgId([7; 16]),
        }],
    }));
    vec![
        b"\xffnot a spend message".to_vec(),
        unknown_version,
        out_of_range,
    ]
}

/// (reason, stream_seq) of every dead letter about `SPEND`.
async fn spend_dead_letters(p: &Pipeline, expected: usize) -> Vec<(String, u64)> {
    dead_letters(p, "deadletter.spend_undecodable", expected)
        .await
        .iter()
        .map(|letter| {
            (
                letter["reason"].as_str().unwrap().to_string(),
                letter["stream_seq"].as_u64().unwrap(),
            )
        })
        .collect()
}

/// The first `expected` dead letters on `subject`.
pub(crate) async fn dead_letters(
    p: &Pipeline,
    subject: &str,
    expected: usize,
) -> Vec<serde_json::Value> {
    let js = jetstream::new(p.client().await);
    let stream = js.get_stream("DEADLETTER").await.expect("DEADLETTER");
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: subject.into(),
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut letters = Vec::new();
    while letters.len() < expected {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .unwrap_or_else(|_| panic!("only {} dead letters: {letters:?}", letters.len()))
            .expect("stream ended")
            .expect("message");
        letters.push(serde_json::from_slice(&message.payload).unwrap());
    }
    letters
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undecodable_spend_messages_are_set_aside_and_replay_sets_them_aside_again() {
    let mut p = Pipeline::start(Backends::default(), 100).await;
    let metrics_port = free_port();
    // The replay from nothing below needs SPEND whole (docs/RETENTION.md).
    p.aggregator = Some(p.spawn_with("aggregator", metrics_port, &[("ADSPEND_SPEND_TRIM", "off")]));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;

    let mut truth = p.publish(&sim_config(2_000, 31)).await;
    let mut poisoned = Vec::new();
    for (i, payload) in poison().into_iter().enumerate() {
        poisoned.push(publish_raw(&p, &format!("spend.{}", i % 4), payload).await);
    }
    truth.absorb(&p.publish(&sim_config(2_000, 32)).await);
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    let aggregator = p.aggregator.as_mut().unwrap();
    assert!(aggregator.is_running(), "{}", aggregator.log_tail(20));
    assert_eq!(metric(metrics_port, SET_ASIDE).await, poisoned.len() as f64);
    let letters = spend_dead_letters(&p, poisoned.len()).await;
    let seqs: Vec<u64> = letters.iter().map(|(_, seq)| *seq).collect();
    assert_eq!(
        seqs, poisoned,
        "one dead letter per bad message, with its sequence"
    );
    assert!(letters
        .iter()
        .all(|(reason, _)| reason == "spend_undecodable"));

    // Crash and lose every local record (LMDB, checkpoint, snapshots): the
    // restarted aggregator replays the whole stream, meets the same bad
    // messages, and makes the same decisions; the totals stay exact.
    let aggregator = p.aggregator.as_mut().unwrap();
    aggregator.kill();
    std::fs::remove_dir_all(p.aggregator_dir()).expect("wipe the aggregator's data dir");
    p.aggregator.as_mut().unwrap().restart();
    truth.absorb(&p.publish(&sim_config(1_000, 33)).await);
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    let aggregator = p.aggregator.as_mut().unwrap();
    assert!(aggregator.is_running(), "{}", aggregator.log_tail(20));
    assert_eq!(
        metric(metrics_port, SET_ASIDE).await,
        poisoned.len() as f64,
        "the replay set the same messages aside"
    );
    // JetStream dropped the replay's copies of the dead letters by message
    // id (the runs sent no bad impressions, so these are all it holds).
    assert!(truth.stats.bad_events_acked.values().all(|n| *n == 0));
    let js = jetstream::new(p.client().await);
    let mut stream = js.get_stream("DEADLETTER").await.expect("DEADLETTER");
    let held = stream.info().await.expect("info").state.messages;
    assert_eq!(held, poisoned.len() as u64, "dead letters in DEADLETTER");
}

const OVERFLOWED: &str = "adspend_aggregator_spend_set_aside_total{reason=\"sum_overflow\"}";

/// The poison pill of the report: two impressions whose costs together pass
/// u64 micros for one limit. The second tuple is set aside (dead lettered
/// with its sequence, counted, logged), the rest of its message and of the
/// stream applies, and a replay from nothing sets the same tuple aside.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sum_that_would_overflow_sets_one_tuple_aside_and_nothing_stops() {
    let mut p = Pipeline::start(Backends::default(), 100).await;
    let metrics_port = free_port();
    // The replay from nothing below needs SPEND whole (docs/RETENTION.md).
    p.aggregator = Some(p.spawn_with("aggregator", metrics_port, &[("ADSPEND_SPEND_TRIM", "off")]));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;

    let half = u64::MAX / 2 + 1;
    let pill = |imp: u8| {
        encode_spend(&SpendMessage::Batch(SpendBatch {
            source_ms: adspend_common::now_ms(),
            limits: vec!["poison-limit".into()],
            tuples: vec![SpendTuple {
                limit: 0,
                bucket: adspend_wire::types::LIFETIME_BUCKET,
                cost_micros: half,
                msg_id: adspend_wire::types::MsgId([imp; 16]),
            }],
        }))
    };
    let mut truth = p.publish(&sim_config(2_000, 41)).await;
    let first = publish_raw(&p, "spend.1", pill(1)).await;
    let second = publish_raw(&p, "spend.1", pill(2)).await;
    truth.absorb(&p.publish(&sim_config(2_000, 42)).await);
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    let aggregator = p.aggregator.as_mut().unwrap();
    assert!(aggregator.is_running(), "{}", aggregator.log_tail(20));
    assert_eq!(metric(metrics_port, OVERFLOWED).await, 1.0);
    let letters = dead_letters(&p, "deadletter.sum_overflow", 1).await;
    let letter = &letters[0];
    assert_eq!(letter["reason"], "sum_overflow");
    assert_eq!(letter["stream_seq"].as_u64(), Some(second), "not {first}");
    assert_eq!(letter["limit_id"], "poison-limit");
    assert_eq!(letter["cost_micros"].as_u64(), Some(half));
    assert_eq!(letter["lifetime_micros"].as_u64(), Some(half));

    // Crash and lose every local record: the replay makes the same decision,
    // JetStream drops its copy of the dead letter by message id.
    p.aggregator.as_mut().unwrap().kill();
    std::fs::remove_dir_all(p.aggregator_dir()).expect("wipe the aggregator's data dir");
    p.aggregator.as_mut().unwrap().restart();
    truth.absorb(&p.publish(&sim_config(1_000, 43)).await);
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    let aggregator = p.aggregator.as_mut().unwrap();
    assert!(aggregator.is_running(), "{}", aggregator.log_tail(20));
    assert_eq!(metric(metrics_port, OVERFLOWED).await, 1.0);
    let js = jetstream::new(p.client().await);
    let mut stream = js.get_stream("DEADLETTER").await.expect("DEADLETTER");
    let held = stream.info().await.expect("info").state.messages;
    assert_eq!(held, 1, "one dead letter after the replay");
}
