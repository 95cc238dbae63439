//! A full disk is an outage, never a verdict. The limiter sets nothing
//! aside when NATS goes away and comes back mid-publish (the acks of the
//! output in flight are lost with the server); the aggregator whose data
//! directory fills holds its shard and waits, through a crash and a restart
//! on the full disk, and is exact once space returns.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use adspend_harness::{free_port, wait_until};
use async_nats::jetstream;

use crate::support::{assert_exact, metric, sim_config, Backends, Pipeline};

/// The limiter has applied some of its backlog (its impressions counter
/// moved): it is mid-publish from here on.
async fn limiter_busy(port: u16) {
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(20),
        || async move {
            crate::support::try_metric(port, "adspend_limiter_impressions_total")
                .await
                .is_ok_and(|n| n > 0.0)
        },
    )
    .await
    .expect("the limiter did not start on its backlog");
}

/// Whether `DEADLETTER` holds anything on `subject`.
async fn has_dead_letter(p: &Pipeline, subject: &str) -> bool {
    let js = jetstream::new(p.client().await);
    let stream = js.get_stream("DEADLETTER").await.expect("DEADLETTER");
    stream
        .get_last_raw_message_by_subject(subject)
        .await
        .is_ok()
}

/// Finding: the NATS store filled, nats-server restarted while a publish of
/// the limiter's output was in flight, its ack never came, and the probe
/// that followed reached the restarted server: the limiter set the input
/// aside as if NATS had refused it, and terminated it. Here the server is
/// paused (every publish times out, as on a full store) until the limiter
/// has failed six tries, then killed and restarted under the seventh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_restart_mid_publish_sets_nothing_aside() {
    let mut p = Pipeline::start(Backends::default(), 50).await;
    let js = jetstream::new(p.client().await);
    adspend_common::nats::ensure_impressions(&js, 1)
        .await
        .expect("IMPRESSIONS");
    // A backlog of 1,200 messages, read one at a time.
    let truth = p.publish(&sim_config(60_000, 81)).await;
    let limiter_metrics = free_port();
    p.aggregator = Some(p.spawn("aggregator"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    p.limiter = Some(p.spawn_with(
        "limiter",
        limiter_metrics,
        // No checkpoint marker due during the outage: the chunk's own
        // publish is the one that fails.
        &[
            ("ADSPEND_LIMITER_MAX_BATCH", "1"),
            ("ADSPEND_CHECKPOINT_INTERVAL_MS", "120000"),
            // A publisher of its own, reading on while it publishes: the
            // pause finds a publish in flight more surely than it does
            // when the one loop alternates reading and publishing.
            ("ADSPEND_LIMITER_WORKERS", "2"),
        ],
    ));
    limiter_busy(limiter_metrics).await;
    p.nats.pause();
    let limiter = p.limiter.as_mut().expect("limiter");
    limiter
        .wait_for_log("tries=6", Duration::from_secs(90))
        .await
        .expect("six failed tries while NATS is paused");
    // The seventh try starts 1.6 s after the sixth failed: the server dies
    // under it and comes back, so its acks never arrive.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    p.nats.kill();
    p.nats.restart().await;

    let restarted = Instant::now();
    assert_exact(&p.settle(&truth, Duration::from_secs(120)).await, &truth);
    let log = std::fs::read_to_string(p.limiter.as_ref().expect("limiter").log_path())
        .expect("limiter log");
    let warns = log
        .lines()
        .filter(|l| l.contains("publish failed; retrying"))
        .count();
    // The seventh try's acknowledgements died with the server: it is tried
    // again at the reconnect, not at the ack timeout.
    assert!(
        log.contains("NATS reconnected while acknowledgements were awaited"),
        "the seventh try waited out its ack timeout"
    );
    // The aggregator's consumer, lost with the server, is made anew at the
    // reconnect (or was being made when it came), never left for the stall
    // check to find.
    let aggregator = p.aggregator.as_ref().expect("aggregator").log_path();
    assert!(
        !std::fs::read_to_string(aggregator)
            .expect("aggregator log")
            .contains("SPEND consumer stalled; recreating"),
        "the aggregator's consumer was left stalled after the reconnect"
    );
    println!(
        "NATS paused then restarted mid-publish: {warns} WARN line(s) while publishes failed, exact {} ms after the restart",
        restarted.elapsed().as_millis()
    );
    assert_eq!(
        metric(limiter_metrics, "adspend_limiter_set_aside_total").await,
        0.0,
        "an outage set input aside"
    );
    assert!(
        !has_dead_letter(&p, "deadletter.set_aside").await,
        "a set-aside record was written"
    );
    let retries = metric(
        limiter_metrics,
        "adspend_limiter_publish_retries_total{cause=\"outage\"}",
    )
    .await;
    assert!(retries >= 7.0, "outage retries counted: {retries}");
    assert_eq!(
        metric(
            limiter_metrics,
            "adspend_limiter_publish_failing_since_seconds"
        )
        .await,
        0.0,
        "publishes succeed again"
    );
}

/// A small tmpfs mounted at a directory for one test, unmounted (lazily, so
/// a process still in it does not stop the unmount) on drop.
struct Tmpfs {
    dir: PathBuf,
}

impl Tmpfs {
    /// # Panics
    ///
    /// If it cannot be mounted: the test needs root (CI runs as root).
    fn mount(dir: &Path, bytes: u64) -> Tmpfs {
        std::fs::create_dir_all(dir).expect("create the mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(dir)
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "mounting a {bytes}-byte tmpfs at {} failed ({status}): this test needs root",
            dir.display()
        );
        Tmpfs {
            dir: dir.to_path_buf(),
        }
    }

    /// Write a file until the file system is full; its path.
    fn fill(&self) -> PathBuf {
        let path = self.dir.join("filler");
        let mut file = std::fs::File::create(&path).expect("create the filler");
        let mut chunk = vec![0xa5u8; 1 << 20];
        while !chunk.is_empty() {
            match file.write(&chunk) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(nix::errno::Errno::ENOSPC as i32) => {
                    let half = chunk.len() / 2;
                    chunk.truncate(half);
                }
                Err(e) => panic!("filling {}: {e}", path.display()),
            }
        }
        let _ = file.sync_all();
        path
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

/// Whether the pacer shows shard `shard` stale.
async fn shard_stale(p: &Pipeline, shard: &str) -> bool {
    let Ok(response) = reqwest::get(format!("{}/v1/shards", p.pacer_url())).await else {
        return false;
    };
    let Ok(body) = response.json::<serde_json::Value>().await else {
        return false;
    };
    body["shards"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|s| s["shard"] == shard && s["stale"] == true)
}

async fn disk_full_gauge(port: u16) -> f64 {
    crate::support::try_metric(port, "adspend_aggregator_disk_full{shard=\"all\"}")
        .await
        .unwrap_or(-1.0)
}

/// Finding: with its data directory full the aggregator exited on the
/// failed LMDB commit, then crash-looped on the epoch file at every start
/// (49 exits in 50 s). Now it waits, running, with its limits stale, and
/// goes on by itself when space returns, exact; a crash and a restart on
/// the full disk wait the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aggregator_whose_data_directory_fills_waits_and_is_exact() {
    let mut p = Pipeline::start(Backends::default(), 50).await;
    let disk = Tmpfs::mount(&p.aggregator_dir(), 48 << 20);
    // Snapshots elsewhere: this disk is the data directory alone.
    let snapshots = format!("file://{}", p.dir.path().join("snapshots").display());
    let aggregator_metrics = free_port();
    let stale_ms = "2000";
    p.aggregator = Some(p.spawn_with(
        "aggregator",
        aggregator_metrics,
        &[("ADSPEND_OBJECT_STORE_URL", snapshots.as_str())],
    ));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn_with(
        "pacer",
        free_port(),
        &[("ADSPEND_PACER_STALE_AFTER_MS", stale_ms)],
    ));
    p.wait_pacer().await;
    let mut truth = p.publish(&sim_config(5_000, 82)).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);

    let filler = disk.fill();
    // New ids and sums need new LMDB pages, which the full disk refuses.
    truth.absorb(&p.publish(&sim_config(30_000, 83)).await);
    wait_until(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async { disk_full_gauge(aggregator_metrics).await == 1.0 },
    )
    .await
    .expect("the aggregator never reported its disk full");
    wait_until(Duration::from_secs(30), Duration::from_millis(100), || {
        shard_stale(&p, "all")
    })
    .await
    .expect("the pacer did not show the shard stale");
    let aggregator = p.aggregator.as_mut().expect("aggregator");
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        aggregator.is_running(),
        "the aggregator exited on a full disk:\n{}",
        aggregator.log_tail(20)
    );
    aggregator
        .wait_for_log("data directory full", Duration::from_secs(5))
        .await
        .expect("the wait is logged");

    // A crash, and a start on the full disk: it waits there too.
    aggregator.kill();
    aggregator.restart();
    let restarted = Instant::now();
    aggregator
        .wait_for_log("data directory full", Duration::from_secs(30))
        .await
        .expect("the restarted aggregator waits for space");
    tokio::time::sleep(Duration::from_secs(5)).await;
    assert!(
        aggregator.is_running(),
        "the restarted aggregator exited on a full disk:\n{}",
        aggregator.log_tail(20)
    );
    let log = std::fs::read_to_string(aggregator.log_path()).expect("aggregator log");
    let errors = log
        .lines()
        .filter(|l| l.contains("ERROR") && l.contains("data directory full"))
        .count();
    assert!(
        errors <= 3,
        "one ERROR per minute of waiting, not one per try: {errors} in {:?}",
        restarted.elapsed()
    );

    std::fs::remove_file(&filler).expect("free the space");
    let freed = Instant::now();
    assert_exact(&p.settle(&truth, Duration::from_secs(90)).await, &truth);
    println!(
        "full data directory: waited {:.1} s across a restart, {errors} ERROR line(s), exact {} ms after space returned",
        restarted.elapsed().as_secs_f64(),
        freed.elapsed().as_millis()
    );
    let aggregator = p.aggregator.as_mut().expect("aggregator");
    aggregator
        .wait_for_log("space returned", Duration::from_secs(10))
        .await
        .expect("the end of the wait is logged");
    assert_eq!(disk_full_gauge(aggregator_metrics).await, 0.0);
    drop(p);
    drop(disk);
}
