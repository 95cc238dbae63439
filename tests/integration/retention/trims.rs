//! What tells a trim of `SPEND` from a lost head, against a real
//! nats-server and the aggregator's own check (`adspend_aggregator::bounds`):
//! a shard that has applied nothing is not stopped by other partitions'
//! trims, is stopped when its own partitions were trimmed (its checkpoint
//! record was lost), and is stopped when no trim ever ran; a shard that has
//! applied something is stopped when its own partitions were trimmed past
//! its position or its last applied message is gone with the head.

use adspend_aggregator::bounds::{trimmed_below, Bounds};
use adspend_aggregator::Error;
use adspend_common::nats::{ensure_spend, ensure_spend_trims, spend_subject, spend_trim_subject};
use adspend_harness::NatsServer;
use async_nats::jetstream;

/// Publish to `subject`, returning the stream sequence.
async fn publish(js: &jetstream::Context, subject: String) -> u64 {
    js.publish(subject, "x".into())
        .await
        .expect("publish")
        .await
        .expect("acknowledged")
        .sequence
}

fn is_gap(result: &Result<u64, Error>) -> bool {
    matches!(result, Err(Error::RetentionGap { .. }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trim_is_told_from_a_lost_head_for_a_shard_that_applied_nothing() {
    let nats = NatsServer::start().await;
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let js = jetstream::new(client);
    let stream = ensure_spend(&js, 1).await.expect("SPEND");
    let trims = ensure_spend_trims(&js, 1).await.expect("SPEND_TRIMS");
    let bounds = |owned: Option<Vec<u32>>| Bounds {
        stream: stream.clone(),
        trims: trims.clone(),
        owned,
    };

    // Partitions 0 and 1 interleaved: 1..=10.
    let mut seqs = Vec::new();
    for i in 0..10u32 {
        seqs.push(publish(&js, spend_subject(i % 2)).await);
    }
    assert_eq!(seqs, (1..=10).collect::<Vec<_>>());

    // The head lost with no trim ever run (partition 0's first message):
    // a shard of partition 1 that has applied nothing stops, so does one
    // of partition 0.
    stream
        .purge()
        .filter(spend_subject(0))
        .sequence(2)
        .await
        .expect("purge");
    for owned in [vec![0], vec![1]] {
        let result = bounds(Some(owned.clone())).check(0).await;
        assert!(is_gap(&result), "{owned:?}: {result:?}");
    }

    // Partition 0 trimmed below 7, marked first as a shard's trim does:
    // a shard of partition 1 that applied nothing reads from the start
    // (its messages are all there); one of partition 0 that applied
    // nothing has lost its checkpoint and stops.
    publish(&js, spend_trim_subject("0")).await;
    js.publish(spend_trim_subject("0"), "7".into())
        .await
        .unwrap()
        .await
        .unwrap();
    stream
        .purge()
        .filter(spend_subject(0))
        .sequence(7)
        .await
        .expect("purge");
    assert_eq!(
        trimmed_below(&trims, Some(&[0])).await.unwrap(),
        7,
        "the newest mark counts"
    );
    assert_eq!(trimmed_below(&trims, Some(&[1])).await.unwrap(), 0);
    let fresh_other = bounds(Some(vec![1])).check(0).await;
    assert_eq!(fresh_other.unwrap(), 10, "partition 1 was never trimmed");
    let fresh_trimmed = bounds(Some(vec![0])).check(0).await;
    assert!(is_gap(&fresh_trimmed), "{fresh_trimmed:?}");
    // Shards of partition 0 restored at 7 or 9 (past the trim): running
    // on; one restored at 3 (a record older than every base kept, its
    // messages 5 gone though the stream's head is partition 1's) stops.
    assert_eq!(bounds(Some(vec![0])).check(7).await.unwrap(), 10);
    assert_eq!(bounds(Some(vec![0])).check(9).await.unwrap(), 10);
    let behind = bounds(Some(vec![0])).check(3).await;
    assert!(is_gap(&behind), "{behind:?}");

    // A mark under `all` (the only shard of a single machine, before the
    // partitions were shared out) covers every partition.
    js.publish(spend_trim_subject("all"), "3".into())
        .await
        .unwrap()
        .await
        .unwrap();
    let after_all = bounds(Some(vec![1])).check(0).await;
    assert!(is_gap(&after_all), "{after_all:?}");

    // The stream's head lost below a shard that applied something: its
    // last applied message gone (partition 1's 2 and 4), it stops.
    stream
        .purge()
        .filter(spend_subject(1))
        .sequence(5)
        .await
        .expect("purge");
    let lost = bounds(Some(vec![1])).check(2).await;
    assert!(is_gap(&lost), "{lost:?}");
    println!("retention::trims: a trim told from a lost head for shards that applied nothing");
}
