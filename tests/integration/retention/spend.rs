//! `SPEND` trimmed below the oldest kept checkpoint: the trim never reads
//! as a retention gap (a kill and a warm restart, exact), and a cold
//! restore from the oldest base kept, replaying from its position through
//! the trimmed stream, is exact too; with the data directory lost whole,
//! the restart stops at the gap instead of undercounting.

use std::path::Path;
use std::time::Duration;

use adspend_aggregator::record::CheckpointRecord;
use adspend_aggregator::snapshot_store::Checksum;
use adspend_harness::{free_port, wait_until, wait_until_ok};
use adspend_sim::Truth;

use super::{holds, state, POLL, SETTLE};
use crate::support::{assert_exact, metric, sim_config, Backends, Pipeline};

fn record_path(p: &Pipeline) -> std::path::PathBuf {
    p.aggregator_dir().join("checkpoint/checkpoint.json")
}

fn read_record(p: &Pipeline) -> anyhow::Result<CheckpointRecord> {
    Ok(serde_json::from_slice(&std::fs::read(record_path(p))?)?)
}

/// (id, position, file name) of every base snapshot of shard `all`,
/// oldest first.
fn bases(p: &Pipeline) -> Vec<(u64, u64, String)> {
    let dir = p.aggregator_dir().join("snapshots/all");
    let mut bases: Vec<(u64, u64, String)> = std::fs::read_dir(&dir)
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.ends_with(".mdb"))
                .filter_map(|n| Some((n.get(..20)?.parse().ok()?, n.get(21..41)?.parse().ok()?, n)))
                .collect()
        })
        .unwrap_or_default();
    bases.sort();
    bases
}

fn checksum(path: &Path) -> (String, u64) {
    let bytes = std::fs::read(path).expect("read the base");
    let mut sum = Checksum::default();
    sum.update(&bytes);
    (sum.finish(), bytes.len() as u64)
}

fn merged(truths: &[&Truth]) -> Truth {
    let mut merged = Truth::default();
    for truth in truths {
        merged.absorb(truth);
    }
    merged
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spend_trimmed_then_a_kill_and_a_cold_restore_from_the_oldest_base_are_exact() {
    let mut p = Pipeline::start(Backends::default(), 300).await;
    let port = free_port();
    // Every checkpoint a base, one older base kept: the trim follows
    // closely behind, a few markers back.
    let settings = [
        ("ADSPEND_CHECKPOINT_MAX_DELTAS", "0"),
        ("ADSPEND_SNAPSHOTS_KEPT", "1"),
        ("ADSPEND_SPEND_TRIM", "checkpoint"),
    ];
    let mut aggregator = p.spawn_with("aggregator", port, &settings);
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let first = p.publish(&sim_config(8_000, 311)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);
    wait_until(Duration::from_secs(30), POLL, || async {
        state(&p, "SPEND").await.0 > 1
    })
    .await
    .expect("SPEND was not trimmed");
    let trimmed = metric(
        port,
        "adspend_aggregator_spend_trimmed_messages_total{shard=\"all\"}",
    )
    .await;
    assert!(trimmed >= 1.0, "trims counted: {trimmed}");

    // A kill: the restart replays from its LMDB through the trimmed stream.
    aggregator.kill();
    let second = p.publish(&sim_config(4_000, 312)).await;
    aggregator.restart();
    let both = merged(&[&first, &second]);
    assert_exact(&p.settle(&both, SETTLE).await, &both);
    assert!(aggregator.is_running(), "{}", aggregator.log_tail(30));

    // Trimmed further as checkpoints go on; then a cold restore from the
    // oldest base still kept, its position below everything since.
    let (first_seq, _, _) = state(&p, "SPEND").await;
    wait_until(Duration::from_secs(30), POLL, || async {
        state(&p, "SPEND").await.0 > first_seq
    })
    .await
    .expect("SPEND was not trimmed after the restart");
    aggregator.kill();
    let current = read_record(&p).expect("the checkpoint record");
    let (id, seq, name) = bases(&p).into_iter().next().expect("a base kept");
    assert!(
        seq < current.seq || current.deltas.is_empty(),
        "the oldest base kept is the record's"
    );
    let (first_seq, _, _) = state(&p, "SPEND").await;
    assert!(first_seq > 1, "SPEND is trimmed");
    assert!(
        holds(&p, "SPEND", seq).await,
        "the oldest kept base's own message {seq} was trimmed"
    );
    let key = format!("all/{name}");
    let (checksum, size_bytes) = checksum(&p.aggregator_dir().join("snapshots").join(&key));
    let oldest = CheckpointRecord {
        checkpoint_id: id,
        seq,
        snapshot_key: key,
        checksum,
        size_bytes,
        deltas: Vec::new(),
        ..current
    };
    let tmp = record_path(&p).with_extension("tmp");
    std::fs::write(&tmp, serde_json::to_vec(&oldest).unwrap()).unwrap();
    std::fs::rename(&tmp, record_path(&p)).unwrap();
    let lmdb = p.aggregator_dir().join("lmdb");
    std::fs::remove_dir_all(&lmdb).expect("wipe the LMDB");
    let third = p.publish(&sim_config(2_000, 313)).await;
    aggregator.restart();
    let all = merged(&[&first, &second, &third]);
    assert_exact(&p.settle(&all, SETTLE).await, &all);
    let log = std::fs::read_to_string(aggregator.log_path()).expect("aggregator log");
    assert!(
        log.lines()
            .any(|l| l.contains("start=\"cold\"") && l.contains(&format!("last_applied_seq={seq}"))),
        "no cold restore from the oldest base at {seq}: {}",
        aggregator.log_tail(30)
    );
    // Checkpoints and trims go on from there.
    wait_until_ok(Duration::from_secs(30), POLL, || async {
        let record = read_record(&p)?;
        anyhow::ensure!(record.seq > seq, "record at {}", record.seq);
        Ok(())
    })
    .await
    .expect("no checkpoint after the cold restore");

    // The data directory lost whole (record, snapshots, LMDB): starting
    // from nothing would replay a trimmed stream and undercount. The
    // trims' marks say so, and the aggregator stops naming the gap.
    aggregator.kill();
    std::fs::remove_dir_all(p.aggregator_dir()).expect("remove the data directory");
    aggregator.restart();
    let status = aggregator
        .wait_for_exit(Duration::from_secs(30))
        .await
        .unwrap_or_else(|e| {
            panic!(
                "it ran on a trimmed stream ({e}): {}",
                aggregator.log_tail(20)
            )
        });
    assert_eq!(status.code(), Some(1), "{status:?}");
    let tail = aggregator.log_tail(20);
    assert!(tail.contains("retention gap"), "{tail}");
    println!(
        "retention::spend: trimmed below {first_seq} (first sequence), kill and cold restore from the base at {seq} exact; the data directory lost stops at the gap"
    );
}
