//! Stream integrity: `SPEND` no longer holds what the aggregator needs
//! (retention gap) or holds less than it applied (log went backwards).

use std::time::{Duration, Instant};

use adspend_harness::free_port;
use async_nats::jetstream;

use crate::support::{assert_exact, sim_config, Backends, Pipeline};

use super::{
    expect_refusal, lmdb_position, merged, names_number, purge_spend_before, report, spend_bounds,
    wait_applied, wait_limiter_drained, SETTLE, START,
};

// ---- 3. retention gap ----------------------------------------------------

/// Purging only what the aggregator already applied is fine; purging one
/// message it still needs makes the restart fail naming both sequences,
/// with its LMDB and the pacer untouched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_gap_at_restart_refuses_naming_both_sequences() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let first = p.publish(&sim_config(3_000, 31)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);

    // Boundary: everything up to the last applied sequence may go.
    assert!(aggregator
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (_, applied) = lmdb_position(&p);
    assert!(applied > 0);
    let second = p.publish(&sim_config(3_000, 32)).await;
    wait_limiter_drained(&p).await;
    purge_spend_before(&p, applied + 1).await;
    assert_eq!(spend_bounds(&p).await.0, applied + 1);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("a purge of applied messages only must not stop the aggregator");
    let truth = merged(&[&first, &second]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);

    // Gap: the next message it needs is purged.
    assert!(aggregator
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (lineage, applied) = lmdb_position(&p);
    let third = p.publish(&sim_config(3_000, 33)).await;
    wait_limiter_drained(&p).await;
    let (_, last) = spend_bounds(&p).await;
    assert!(last >= applied + 2, "last {last}, applied {applied}");
    let keep_from = applied + 2;
    purge_spend_before(&p, keep_from).await;
    assert_eq!(spend_bounds(&p).await.0, keep_from);

    let error = expect_refusal(&mut aggregator).await;
    assert!(error.contains("retention gap"), "{error}");
    assert!(names_number(&error, keep_from), "{error}");
    assert!(names_number(&error, applied + 1), "{error}");
    assert_eq!(lmdb_position(&p), (lineage, applied), "LMDB changed");
    // The pacer still shows what was applied, nothing of the third run.
    assert_exact(&p.settle(&truth, Duration::from_secs(5)).await, &truth);
    assert!(third.stats.unique_events > 0);
    report("retention_gap_at_restart", started);
}

/// A lagging aggregator (paused) whose next messages are purged before it
/// reads them must stop with a retention gap too, not skip them silently
/// (DESIGN.md rule 4: never silently skip).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_gap_while_lagging_stops_the_aggregator() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    let aggregator_port = free_port();
    // One tuple per SPEND message: many messages, more than the consumer
    // has asked the server for, so some are still in the stream when purged.
    let one_tuple = [("ADSPEND_LIMITER_TUPLES_PER_MESSAGE", "1")];
    let mut aggregator = p.spawn_with("aggregator", aggregator_port, &[]);
    p.limiter = Some(p.spawn_with("limiter", free_port(), &one_tuple));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let first = p.publish(&sim_config(500, 34)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);

    let mut limiter = p.limiter.take().unwrap();
    assert!(limiter
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (_, applied) = spend_bounds(&p).await;
    wait_applied(aggregator_port, applied).await;
    aggregator.pause().unwrap();
    limiter.restart();
    let second = p.publish(&sim_config(1_500, 35)).await;
    wait_limiter_drained(&p).await;
    let (_, last) = spend_bounds(&p).await;
    assert!(last > applied + 1_500, "only {} new", last - applied);
    purge_spend_before(&p, last).await;
    aggregator.resume().unwrap();

    let truth = merged(&[&first, &second]);
    if let Err(e) = aggregator.wait_for_exit(Duration::from_secs(20)).await {
        let comparison = p.settle(&truth, Duration::from_secs(5)).await;
        panic!(
            "the aggregator needed sequence {} but SPEND now starts at {last}, and it \
             kept running ({e}); pacer total {} vs truth {} micros, {} limits differ:\n{}",
            applied + 1,
            comparison.total_pacer(),
            comparison.total_truth(),
            comparison.mismatches().len(),
            aggregator.log_tail(10)
        );
    }
    let status = aggregator.exit_status().unwrap();
    assert_eq!(status.code(), Some(1), "{status:?}");
    let tail = aggregator.log_tail(20);
    assert!(tail.contains("retention gap"), "{tail}");
    report("retention_gap_while_lagging", started);
}

// ---- 4. log went backwards -----------------------------------------------

/// SPEND deleted and recreated (by a restarted limiter) with fewer messages
/// than the aggregator applied: the restart fails naming both sequences.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn log_went_backwards_refuses_naming_both_sequences() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    let aggregator_port = free_port();
    let mut aggregator = p.spawn_with("aggregator", aggregator_port, &[]);
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let truth = p.publish(&sim_config(3_000, 41)).await;
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    // Markers (8 a second) make the applied sequence clearly larger than
    // what the new stream will hold.
    wait_applied(aggregator_port, 30).await;
    assert!(aggregator
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (lineage, applied) = lmdb_position(&p);
    let mut limiter = p.limiter.take().unwrap();
    assert!(limiter
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());

    let js = jetstream::new(p.client().await);
    js.delete_stream("SPEND").await.expect("delete SPEND");
    // The limiter creates SPEND when it starts; no markers for a minute, so
    // only the new impressions' batches land in it.
    let mut limiter = p.spawn_with(
        "limiter",
        free_port(),
        &[("ADSPEND_CHECKPOINT_INTERVAL_MS", "60000")],
    );
    limiter
        .wait_for_log("limiter running", START)
        .await
        .expect("limiter started");
    let few = p.publish(&sim_config(200, 42)).await;
    assert!(few.stats.unique_events > 0);
    wait_limiter_drained(&p).await;
    assert!(limiter
        .terminate(Duration::from_secs(20))
        .unwrap()
        .success());
    let (_, last) = spend_bounds(&p).await;
    assert!(
        last >= 1 && last < applied,
        "new SPEND ends at {last}, applied {applied}"
    );

    let error = expect_refusal(&mut aggregator).await;
    assert!(error.contains("log went backwards"), "{error}");
    assert!(names_number(&error, last), "{error}");
    assert!(names_number(&error, applied), "{error}");
    assert_eq!(lmdb_position(&p), (lineage, applied), "LMDB changed");
    report("log_went_backwards", started);
}
