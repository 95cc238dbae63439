//! A recorded snapshot that is gone, and a store that lost everything
//! (issues 27 and 28, docs/RECOVERY.md): never a silent retry loop, never a
//! stop for good.
//!
//! - The snapshot objects and the local LMDB gone while `SPEND` holds every
//!   message: the aggregator rebuilds the shard by replaying the stream, the
//!   totals are exact and the next checkpoint is a new base.
//! - The same for one partition of a cluster member while `SPEND` no longer
//!   holds its first messages: the member stays up and applies the others,
//!   the partition holds still and visible (gauge, ERROR naming the way out,
//!   backoff, no release-and-claim loop), until the operator accepts the loss
//!   with `ADSPEND_AGGREGATOR_ACCEPT_LOSS`.
//! - The store emptied under a running aggregator (moto restarted without
//!   its bucket; a `file://` directory removed): checkpoints fail loudly or
//!   find their chain gone, then record a new base by themselves, which a
//!   cold restore uses.

mod support;

use self::support::*;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use adspend_harness::{free_port, wait_until, ServiceProcess};
use adspend_sim::Truth;
use async_nats::jetstream;

use crate::recovery::{log_len, log_since};
use crate::support::{assert_exact, metric, sim_config, try_metric, Backends, Pipeline};

/// The store loses every object of the shard and the aggregator its LMDB
/// while it is down; `SPEND` still holds every message (the shards do not
/// trim it: `ADSPEND_SPEND_TRIM=off`, docs/RETENTION.md). Restarted, it says
/// so, rebuilds the shard from an empty state by replaying the whole stream
/// (start `rebuilt`, at sequence 0), and a fresh pacer is exact, duplicates
/// and all; the rebuild is counted, the next checkpoint is a new base of a
/// new lineage under the new epoch, and it is in the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_snapshot_is_rebuilt_exactly_by_replaying_the_whole_stream() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    let port = free_port();
    let mut aggregator = p.spawn_with("aggregator", port, &[("ADSPEND_SPEND_TRIM", "off")]);
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let first = p.publish(&sim_config(10_000, 71)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);
    wait_record(&p, "all", "a sequence", |r| r.seq > 0).await;

    aggregator.kill();
    let old = record(&p, "all").await.unwrap();
    assert!(delete_objects(&p, "snapshots/all/").await >= 1);
    wipe(&p.aggregator_dir().join("lmdb"));
    let second = p.publish(&sim_config(5_000, 72)).await;
    wait_limiter_drained(&p).await;
    let (first_seq, last_seq) = spend_bounds(&p).await;
    assert_eq!(first_seq, 1, "SPEND holds everything");

    let offset = log_len(&aggregator);
    let restarted = Instant::now();
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("the aggregator rebuilt the shard and runs");
    let log = log_since(&aggregator, offset);
    let field = |name| log_field(&log, "aggregator running", "", name).unwrap();
    assert_eq!(field("start"), "rebuilt", "{log}");
    assert_eq!(field("last_applied_seq"), "0", "{log}");
    let said = log
        .lines()
        .find(|l| l.contains("SPEND still holds every message from sequence 1"))
        .unwrap_or_else(|| panic!("no ERROR saying why it rebuilds:\n{log}"));
    assert!(
        said.contains("ERROR") && said.contains(&old.snapshot_key),
        "{said}"
    );

    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(50),
        || async {
            metric(port, "adspend_aggregator_last_applied_seq{shard=\"all\"}").await
                >= last_seq as f64
        },
    )
    .await
    .expect("the replay reached the end of SPEND");
    let replayed = restarted.elapsed();
    fresh_pacer(&mut p).await;
    let truth = merged(&[&first, &second]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);

    let rebuilds = [("shard", "all"), ("way", "replay")];
    assert_eq!(
        series(port, "adspend_aggregator_rebuilds_total", &rebuilds).await,
        1.0
    );
    let shard = [("shard", "all")];
    assert_eq!(
        series(port, "adspend_aggregator_snapshot_missing_total", &shard).await,
        1.0
    );
    assert_eq!(
        series(port, "adspend_aggregator_snapshot_missing", &shard).await,
        0.0
    );
    let epoch: u64 = field("epoch").parse().unwrap();
    assert!(epoch > old.epoch);
    let new = wait_record(&p, "all", "the new epoch", |r| r.epoch == epoch).await;
    assert!(new.checkpoint_id > old.checkpoint_id, "{new:?}");
    assert_ne!(new.lineage, old.lineage, "a new lineage");
    assert_ne!(new.snapshot_key, old.snapshot_key, "a new base");
    assert!(s3_holds(&p, &new).await, "{new:?} is in the store");
    assert!(aggregator.is_running());
    eprintln!(
        "snapshot_gone::rebuild: {last_seq} SPEND messages ({} events) replayed from sequence 1 \
         in {:.1}s from the restart",
        first.stats.events_acked + second.stats.events_acked,
        replayed.as_secs_f64()
    );
    report("rebuilt_by_replay", started);
}

// ---- b. the stream lost its first messages: visible until accepted --------

const PARTITIONS: u32 = 4;
const GONE: u32 = 1;

fn spawn_member(p: &Pipeline, port: u16, extra: &[(&str, &str)]) -> ServiceProcess {
    let data_dir = p.dir.path().join("m1").display().to_string();
    let mut env = vec![
        ("ADSPEND_AGGREGATOR_PARTITIONS", "auto"),
        ("ADSPEND_AGGREGATOR_ID", "m1"),
        ("ADSPEND_LEASE_TTL_MS", "2000"),
        ("ADSPEND_DATA_DIR", data_dir.as_str()),
        // The test removes SPEND's first messages itself.
        ("ADSPEND_SPEND_TRIM", "off"),
    ];
    env.extend_from_slice(extra);
    p.spawn_with("aggregator", port, &env)
}

fn member_dir(p: &Pipeline) -> PathBuf {
    p.dir.path().join("m1")
}

/// `truth` without `lost`'s spend on the limits of partition `partition`.
fn without(truth: &Truth, lost: &Truth, partition: u32) -> Truth {
    let mut kept = truth.clone();
    for (limit, gone) in &lost.limits {
        if adspend_limiter::emit::partition_of(limit, PARTITIONS) != partition {
            continue;
        }
        let ours = kept
            .limits
            .get_mut(limit)
            .expect("every limit is in the truth");
        ours.lifetime_micros -= gone.lifetime_micros;
        for (day, micros) in &gone.daily {
            *ours.daily.get_mut(day).expect("the day is in the truth") -= micros;
        }
    }
    kept
}

/// A cluster member loses partition 1's snapshot objects and LMDB while it
/// is down, and `SPEND` its first messages (those of the first run). The
/// restarted member stays up and applies the other partitions; partition 1
/// holds still: ERROR lines naming the key and the way out, retried with
/// backoff, claimed once and never released and claimed again, gauge 1,
/// nothing applied. Then the operator does what the line says (restarts
/// it with `ADSPEND_AGGREGATOR_ACCEPT_LOSS=p1@<id>`): partition 1 is rebuilt
/// from SPEND's first sequence, and a fresh pacer equals the truth minus
/// the first run's spend on partition 1's limits, the loss accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gone_snapshot_the_stream_cannot_replace_waits_visibly_until_the_loss_is_accepted() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    let port = free_port();
    let mut member = spawn_member(&p, port, &[]);
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let owned = "adspend_aggregator_owned_partitions";
    wait_until(START, Duration::from_millis(100), || async {
        try_metric(port, owned).await.ok() == Some(f64::from(PARTITIONS))
    })
    .await
    .expect("the member owns every partition");
    let first = p.publish(&sim_config(6_000, 73)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);
    wait_limiter_drained(&p).await;
    let (_, lost_through) = spend_bounds(&p).await;
    let second = p.publish(&sim_config(4_000, 74)).await;
    let both = merged(&[&first, &second]);
    assert_exact(&p.settle(&both, SETTLE).await, &both);
    // Every partition's record past what SPEND will lose: only the one
    // whose snapshot goes is harmed.
    for partition in 0..PARTITIONS {
        let shard = format!("p{partition}");
        wait_record(&p, &shard, "a sequence past the purge", |r| {
            r.seq > lost_through
        })
        .await;
    }

    member.kill();
    let old = record(&p, "p1").await.unwrap();
    assert!(delete_objects(&p, "snapshots/p1/").await >= 1);
    wipe(&member_dir(&p).join("p1/lmdb"));
    let js = jetstream::new(p.client().await);
    let spend = js.get_stream("SPEND").await.expect("SPEND");
    spend
        .purge()
        .sequence(lost_through + 1)
        .await
        .expect("purge SPEND");
    assert_eq!(spend_bounds(&p).await.0, lost_through + 1);
    let third = p.publish(&sim_config(3_000, 75)).await;
    wait_limiter_drained(&p).await;

    let offset = log_len(&member);
    member.restart();
    let waiting = "SPEND no longer holds this shard's whole history";
    member
        .wait_for_log(waiting, START)
        .await
        .expect("the member says partition 1 waits");
    wait_until(START, Duration::from_millis(200), || async {
        let log = log_since(&member, offset);
        let running: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("partition running"))
            .collect();
        running.len() == PARTITIONS as usize - 1
            && !running
                .iter()
                .any(|l| l.contains(&format!("partition={GONE} ")))
    })
    .await
    .unwrap_or_else(|_| panic!("the other partitions run:\n{}", member.log_tail(40)));
    // Watched for a while: still there, still visible, backing off.
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert!(member.is_running(), "{}", member.log_tail(30));
    let log = log_since(&member, offset);
    let attempts = log.lines().filter(|l| l.contains(waiting)).count();
    assert!(
        (2..=6).contains(&attempts),
        "{attempts} attempts in about 15 s: retried with backoff, not in a tight loop:\n{log}"
    );
    let line = log.lines().find(|l| l.contains(waiting)).unwrap();
    let way_out = format!("{ACCEPT_LOSS}=p1@{}", old.checkpoint_id);
    for needle in [
        "ERROR",
        "shard=\"p1\"",
        old.snapshot_key.as_str(),
        way_out.as_str(),
        "docs/RECOVERY.md",
    ] {
        assert!(line.contains(needle), "{needle} is not in: {line}");
    }
    let claims = log
        .lines()
        .filter(|l| l.contains("partition claimed") && l.contains("partition=1 "))
        .count();
    assert_eq!(
        claims, 1,
        "claimed once, not released and claimed again:\n{log}"
    );
    assert!(!log.contains("partition stopped; releasing it"), "{log}");
    let p1 = [("shard", "p1")];
    assert_eq!(
        series(port, "adspend_aggregator_snapshot_missing", &p1).await,
        1.0
    );
    assert_eq!(
        series(port, "adspend_aggregator_snapshot_missing_total", &p1).await,
        1.0
    );
    assert_eq!(
        metric(port, "adspend_aggregator_last_applied_seq{shard=\"p1\"}").await,
        0.0,
        "partition 1 applies nothing"
    );
    assert_eq!(metric(port, owned).await, f64::from(PARTITIONS));
    assert_eq!(record(&p, "p1").await.unwrap(), old, "its record untouched");

    // The operator's way out, as the line says.
    member.kill();
    let accept = format!("p1@{}", old.checkpoint_id);
    let port = free_port();
    let mut member = spawn_member(&p, port, &[(ACCEPT_LOSS, &accept)]);
    member
        .wait_for_log("accepts the loss of checkpoint", START)
        .await
        .expect("the member rebuilds partition 1 at a loss");
    wait_until(START, Duration::from_millis(200), || async {
        log_field(
            &log_since(&member, 0),
            "partition running",
            "partition=1 ",
            "start",
        )
        .as_deref()
            == Some("rebuilt")
    })
    .await
    .unwrap_or_else(|_| panic!("partition 1 runs rebuilt:\n{}", member.log_tail(40)));
    let rebuilds = [("shard", "p1"), ("way", "accept_loss")];
    assert_eq!(
        series(port, "adspend_aggregator_rebuilds_total", &rebuilds).await,
        1.0
    );
    assert_eq!(
        series(port, "adspend_aggregator_snapshot_missing", &p1).await,
        0.0
    );

    // The loss accepted: partition 1's limits lack the first run's spend,
    // for good; everything else is exact.
    fresh_pacer(&mut p).await;
    let all = merged(&[&first, &second, &third]);
    let expected = without(&all, &first, GONE);
    assert_ne!(
        expected.limits, all.limits,
        "partition 1 had spend in the first run"
    );
    assert_exact(&p.settle(&expected, SETTLE).await, &expected);
    let new = wait_record(&p, "p1", "a new base", |r| {
        r.checkpoint_id > old.checkpoint_id
    })
    .await;
    assert!(
        new.epoch > old.epoch && new.lineage != old.lineage,
        "{new:?}"
    );
    assert!(s3_holds(&p, &new).await, "{new:?} is in the store");
    assert!(member.is_running());
    eprintln!(
        "snapshot_gone::accept_loss: p1 waited through {attempts} attempts in about 15 s; \
         rebuilt from sequence {} (the first run's spend on p1's limits, {} micros, lost)",
        lost_through + 1,
        all.limits
            .iter()
            .map(|(limit, t)| t.lifetime_micros - expected.limits[limit].lifetime_micros)
            .sum::<u64>()
    );
    report("waits_until_the_loss_is_accepted", started);
}

// ---- c. the store emptied under a running aggregator ----------------------

/// moto restarts and loses its bucket under a running aggregator whose
/// record is a chain of deltas: checkpoints fail (counted as
/// `bucket_missing`, an ERROR saying so), the aggregator creates the bucket
/// again, and the next checkpoint is a new base, all in the store; a cold
/// restore from it after the LMDB is wiped is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_resume_by_themselves_after_the_s3_store_restarts_empty() {
    let started = Instant::now();
    let mut p = Pipeline::start(ETCD_S3, 300).await;
    let port = free_port();
    let mut aggregator = p.spawn_with("aggregator", port, &[]);
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let first = p.publish(&sim_config(5_000, 76)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);
    let old = wait_record(&p, "all", "deltas", |r| !r.deltas.is_empty()).await;

    let s3 = p.s3.as_mut().unwrap();
    s3.kill();
    s3.restart().await;
    let emptied = Instant::now();
    let failed = [("shard", "all"), ("reason", "bucket_missing")];
    wait_until(
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            series(
                port,
                "adspend_aggregator_checkpoint_failures_total",
                &failed,
            )
            .await
                >= 1.0
        },
    )
    .await
    .unwrap_or_else(|_| panic!("no failed checkpoint:\n{}", aggregator.log_tail(30)));
    let new = wait_record(&p, "all", "a new base", |r| {
        r.snapshot_key != old.snapshot_key
    })
    .await;
    let resumed = emptied.elapsed();
    assert!(
        new.checkpoint_id > old.checkpoint_id && new.epoch == old.epoch,
        "{new:?}"
    );
    assert!(s3_holds(&p, &new).await, "{new:?} is in the store");
    let log = log_since(&aggregator, 0);
    for said in [
        "S3 has no such bucket",
        "created the snapshot bucket again",
        "checkpoints resumed",
    ] {
        assert!(log.contains(said), "{said:?} is not in the log:\n{log}");
    }

    let second = p.publish(&sim_config(3_000, 77)).await;
    let truth = merged(&[&first, &second]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    wait_record(&p, "all", "the second run", |r| {
        r.checkpoint_id > new.checkpoint_id
    })
    .await;
    aggregator.kill();
    wipe(&p.aggregator_dir().join("lmdb"));
    let offset = log_len(&aggregator);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("cold restore");
    let log = log_since(&aggregator, offset);
    assert_eq!(
        log_field(&log, "aggregator running", "", "start").as_deref(),
        Some("cold"),
        "{log}"
    );
    fresh_pacer(&mut p).await;
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    eprintln!(
        "snapshot_gone::s3_restart: a new base recorded {:.1}s after the store restarted empty",
        resumed.as_secs_f64()
    );
    report("s3_restarts_empty", started);
}

/// Single-machine mode: the `file://` snapshot directory is removed under a
/// running aggregator whose record is a chain of deltas (and which would add
/// many more before a new base). The next checkpoint finds the chain's
/// objects gone and copies a new base instead of a delta on them; a cold
/// restore from what it recorded is exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_directory_removed_under_a_running_aggregator_gets_a_new_base() {
    let started = Instant::now();
    let mut p = Pipeline::start(Backends::default(), 200).await;
    let port = free_port();
    let mut aggregator = p.spawn_with(
        "aggregator",
        port,
        &[("ADSPEND_CHECKPOINT_MAX_DELTAS", "1000")],
    );
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let first = p.publish(&sim_config(4_000, 78)).await;
    assert_exact(&p.settle(&first, SETTLE).await, &first);
    let old = wait_record(&p, "all", "deltas", |r| !r.deltas.is_empty()).await;
    let snapshots = p.aggregator_dir().join("snapshots");
    std::fs::remove_dir_all(&snapshots).expect("remove the snapshot directory");

    let new = wait_record(&p, "all", "a new base", |r| {
        r.snapshot_key != old.snapshot_key
    })
    .await;
    assert!(new.checkpoint_id > old.checkpoint_id, "{new:?}");
    for key in named(&new) {
        assert!(snapshots.join(&key).exists(), "{key} of {new:?} is on disk");
    }
    assert!(
        series(
            port,
            "adspend_aggregator_checkpoint_chain_lost_total",
            &[("shard", "all")]
        )
        .await
            >= 1.0
    );
    assert!(log_since(&aggregator, 0).contains("objects of the recorded checkpoint are gone"));

    let second = p.publish(&sim_config(2_000, 79)).await;
    let truth = merged(&[&first, &second]);
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    aggregator.kill();
    wipe(&p.aggregator_dir().join("lmdb"));
    let offset = log_len(&aggregator);
    aggregator.restart();
    aggregator
        .wait_for_log("aggregator running", START)
        .await
        .expect("cold restore");
    let log = log_since(&aggregator, offset);
    assert_eq!(
        log_field(&log, "aggregator running", "", "start").as_deref(),
        Some("cold"),
        "{log}"
    );
    fresh_pacer(&mut p).await;
    assert_exact(&p.settle(&truth, SETTLE).await, &truth);
    report("file_dir_removed", started);
}
