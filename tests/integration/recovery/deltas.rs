//! Incremental checkpoints: a cold restore is the recorded base plus every
//! recorded delta, each verified; a delta lost or damaged refuses the start
//! naming that delta, and with it back the restore lands exactly on the
//! record and stays exact. A warm start past the record extends the
//! recorded chain with a delta instead of copying a new base.

use std::time::{Duration, Instant};

use adspend_aggregator::record::CheckpointRecord;
use adspend_harness::{free_port, wait_until};

use crate::support::{assert_exact, sim_config, Pipeline};

use super::snapshots::refuse_corrupt;
use super::{
    current_record, etcd_record, log_field, log_since, merged, report, running_line,
    spawn_aggregator, wait_record, wipe_lmdb, ETCD_S3, SETTLE, START,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cold_restore_applies_every_delta_and_refuses_a_damaged_one_by_name() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    p.spawn_all().await;
    let mut aggregator = p.aggregator.take().unwrap();
    let first = p.publish(&sim_config(4_000, 61)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);
    // Spend after a base, so that deltas carry sums, not only positions.
    // The first checkpoint of each aggregator life copies a new base, and
    // a new base may be copied at any later one (after 30 deltas, or once
    // they outweigh the base). So: wait until this life has a base and a
    // delta after it, publish, wait briefly for a delta with that spend,
    // kill, and retry in a new life if the chain recorded at the kill has
    // none.
    let mut runs = vec![first];
    let record = loop {
        wait_record(&p, "a delta", |r| !r.deltas.is_empty()).await;
        let more = p.publish(&sim_config(2_000, 61 + runs.len() as u64)).await;
        runs.push(more);
        let truth = merged(&runs.iter().collect::<Vec<_>>());
        assert_exact(&p.settle(&truth, SETTLE).await, &truth);
        let _ = wait_until(
            Duration::from_secs(5),
            Duration::from_millis(100),
            || async { current_record(&p).await.is_ok_and(|r| has_spend_delta(&r)) },
        )
        .await;
        aggregator.kill();
        let record = etcd_record(&p).await.unwrap();
        if has_spend_delta(&record) {
            break record;
        }
        assert!(
            runs.len() < 8,
            "no recorded chain with spend in a delta: {record:?}"
        );
        aggregator.restart();
        aggregator
            .wait_for_log("aggregator running", START)
            .await
            .expect("aggregator restarted");
    };
    assert!(
        record.seq == record.deltas.last().unwrap().seq,
        "{record:?}"
    );
    wipe_lmdb(&p);
    let delta = record
        .deltas
        .iter()
        .find(|d| d.size_bytes > SPEND_DELTA_BYTES)
        .unwrap()
        .clone();
    let key = format!("snapshots/{}", delta.key);
    let (_, start, last_applied) = refuse_corrupt(
        &p,
        &mut aggregator,
        &record,
        &key,
        &delta.key,
        (delta.size_bytes, &delta.checksum),
    )
    .await;
    // Base + deltas land exactly on the record, and the pacer equals the
    // truth, including what comes after.
    assert_eq!(start, "cold");
    assert_eq!(last_applied, record.seq, "restored exactly to the record");
    runs.push(p.publish(&sim_config(2_000, 99)).await);
    let truth = merged(&runs.iter().collect::<Vec<_>>());
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    p.aggregator = Some(aggregator);
    report("delta_restore", started);
}

/// The aggregator dies after uploading a checkpoint it never records, so its
/// LMDB is past the record with spend the record lacks. Its next life reads
/// those changes from the store, and its first checkpoint is one more delta
/// on the recorded chain, no new base. A cold restore of that chain (base,
/// the deltas before, the warm start's delta) is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warm_start_past_the_record_extends_the_chain_with_a_delta() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    p.spawn_all().await;
    let mut runs = vec![p.publish(&sim_config(4_000, 81)).await];
    assert_exact(&p.settle(&runs[0], SETTLE).await, &runs[0]);
    wait_record(&p, "a delta", |r| !r.deltas.is_empty()).await;
    p.aggregator.take().unwrap().kill();

    // Spend published while no aggregator runs; a life armed to die after
    // its first upload replays it, uploads a checkpoint holding it and dies
    // before recording that, so its LMDB is past the record with ids the
    // record lacks. Retried (rarely needed) until the warm start says so.
    let (before, warm) = loop {
        assert!(runs.len() < 6, "no life died past the record with new ids");
        let life = runs.len();
        runs.push(p.publish(&sim_config(2_000, 81 + life as u64)).await);
        let mut armed = spawn_aggregator(
            &p,
            &format!("aggregator-armed-{life}.log"),
            free_port(),
            &[("ADSPEND_FAILPOINTS", "aggregator.after_upload")],
        );
        armed
            .wait_for_exit(START)
            .await
            .unwrap_or_else(|e| panic!("the failure point did not fire: {e}"));
        let before = etcd_record(&p).await.unwrap();
        let mut warm =
            spawn_aggregator(&p, &format!("aggregator-warm-{life}.log"), free_port(), &[]);
        warm.wait_for_log("aggregator running", START)
            .await
            .expect("warm start");
        let log = log_since(&warm, 0);
        let (_, start, last_applied) = running_line(&log);
        assert_eq!(start, "warm");
        assert!(last_applied > before.seq, "{last_applied} vs {before:?}");
        warm.wait_for_log("next checkpoint is a delta", START)
            .await
            .expect("the warm start reads the changes since the record");
        let log = log_since(&warm, 0);
        let field = |name| {
            log_field(&log, "next checkpoint is a delta", name)
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {name} on the warm start line:\n{log}"))
        };
        assert_eq!(
            (field("from_seq"), field("to_seq")),
            (before.seq, last_applied)
        );
        if field("ids") > 0 {
            break (before, warm);
        }
        warm.kill();
    };
    let truth = merged(&runs.iter().collect::<Vec<_>>());
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    let after = wait_record(&p, "a checkpoint of the warm life", |r| {
        r.checkpoint_id > before.checkpoint_id
    })
    .await;
    eprintln!(
        "recovery::warm_start_delta: chain before the warm start: {} deltas, {} bytes on a {}-byte base; after: {} deltas",
        before.deltas.len(),
        before.delta_bytes(),
        before.size_bytes,
        after.deltas.len()
    );
    if before.deltas.len() < 30 && before.delta_bytes() < before.size_bytes {
        assert_eq!(after.snapshot_key, before.snapshot_key, "no new base");
        assert_eq!(after.deltas[..before.deltas.len()], before.deltas[..]);
        assert_eq!(after.deltas.len(), before.deltas.len() + 1, "{after:?}");
    }

    // Cold: the chain with the warm start's delta lands on its record.
    let mut aggregator = warm;
    aggregator.kill();
    let record = etcd_record(&p).await.unwrap();
    wipe_lmdb(&p);
    let offset = super::log_len(&aggregator);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("cold start");
    let (_, start, last_applied) = running_line(&log_since(&aggregator, offset));
    assert_eq!(start, "cold");
    assert_eq!(last_applied, record.seq, "restored exactly to the record");
    runs.push(p.publish(&sim_config(2_000, 98)).await);
    let truth = merged(&runs.iter().collect::<Vec<_>>());
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    p.aggregator = Some(aggregator);
    report("warm_start_delta", started);
}

/// A delta bigger than this carries sums and dedupe ids, not only the
/// position an idle interval records (86 bytes).
const SPEND_DELTA_BYTES: u64 = 1_000;

fn has_spend_delta(record: &CheckpointRecord) -> bool {
    record
        .deltas
        .iter()
        .any(|d| d.size_bytes > SPEND_DELTA_BYTES)
}
