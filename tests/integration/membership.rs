//! Cluster mode with aggregators as real processes against real etcd, NATS
//! and S3: partitions spread over the members, handed over when one joins,
//! taken over when one is killed, and a paused member that outlives its
//! lease neither records a checkpoint nor moves the pacer backwards. Every
//! test ends with the pacer equal to the truth for every limit.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use adspend_aggregator::record::CheckpointRecord;
use adspend_harness::{free_port, wait_until, ServiceProcess};
use adspend_sim::{SimConfig, Truth};

use crate::support::{assert_exact, metric, sim_config, try_metric, Backends, Pipeline};

const ETCD_S3: Backends = Backends {
    etcd: true,
    s3: true,
};
const PARTITIONS: u32 = 4;
const TTL_MS: &str = "2000";
const SETTLE: Duration = Duration::from_secs(60);
const OWNED: &str = "adspend_aggregator_owned_partitions";

struct Member {
    process: ServiceProcess,
    port: u16,
    id: &'static str,
}

fn spawn_member(p: &Pipeline, id: &'static str) -> Member {
    spawn_member_with(p, id, &[])
}

fn spawn_member_with(p: &Pipeline, id: &'static str, extra: &[(&str, &str)]) -> Member {
    let port = free_port();
    let data_dir: PathBuf = p.dir.path().join(id);
    let data_dir = data_dir.display().to_string();
    let mut env = vec![
        ("ADSPEND_AGGREGATOR_PARTITIONS", "auto"),
        ("ADSPEND_AGGREGATOR_ID", id),
        ("ADSPEND_LEASE_TTL_MS", TTL_MS),
        ("ADSPEND_DATA_DIR", &data_dir),
    ];
    env.extend_from_slice(extra);
    let process = p.spawn_with("aggregator", port, &env);
    Member { process, port, id }
}

/// Wait until every member owns the given number of partitions.
async fn wait_owned(members: &[(&Member, u32)], timeout: Duration) -> Duration {
    let started = Instant::now();
    let result = wait_until(timeout, Duration::from_millis(100), || async {
        for (member, want) in members {
            // Not answering yet counts as not there yet.
            if try_metric(member.port, OWNED).await.ok() != Some(f64::from(*want)) {
                return false;
            }
        }
        true
    })
    .await;
    if result.is_err() {
        let mut seen = Vec::new();
        for (member, _) in members {
            seen.push(format!(
                "{} owns {:?}:\n{}",
                member.id,
                try_metric(member.port, OWNED).await.ok(),
                member.process.log_tail(30)
            ));
        }
        panic!(
            "partitions did not settle as {:?} within {timeout:?}:\n{}",
            members.iter().map(|(m, n)| (m.id, *n)).collect::<Vec<_>>(),
            seen.join("\n")
        );
    }
    started.elapsed()
}

/// partition → owner id, from etcd.
async fn owners(p: &Pipeline) -> BTreeMap<u32, String> {
    let etcd = p.etcd.as_ref().expect("etcd");
    etcd.get_prefix("/adspend/partitions/")
        .await
        .expect("read owners")
        .into_iter()
        .filter_map(|(key, value, _)| {
            let partition = key
                .strip_prefix("/adspend/partitions/")?
                .strip_suffix("/owner")?
                .parse()
                .ok()?;
            Some((partition, String::from_utf8(value).ok()?))
        })
        .collect()
}

async fn record(p: &Pipeline, partition: u32) -> Option<CheckpointRecord> {
    let etcd = p.etcd.as_ref().expect("etcd");
    let bytes = etcd
        .get(&format!("/adspend/shards/p{partition}/checkpoint"))
        .await
        .expect("read record")?;
    Some(serde_json::from_slice(&bytes).expect("a checkpoint record"))
}

async fn epoch(p: &Pipeline, partition: u32) -> u64 {
    let etcd = p.etcd.as_ref().expect("etcd");
    let bytes = etcd
        .get(&format!("/adspend/shards/p{partition}/epoch"))
        .await
        .expect("read epoch")
        .expect("an epoch");
    String::from_utf8(bytes).unwrap().trim().parse().unwrap()
}

/// A run that lasts a few seconds, so ownership can move under it.
fn steady(events: u64, seed: u64) -> SimConfig {
    SimConfig {
        rate: 4_000.0,
        ..sim_config(events, seed)
    }
}

async fn start_pipeline() -> Pipeline {
    let mut p = Pipeline::start(ETCD_S3, 200).await;
    // The fixture runs every service with ADSPEND_PARTITIONS=4.
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    p
}

async fn settle_exact(p: &Pipeline, truth: &Truth) {
    let comparison = p.settle(truth, SETTLE).await;
    assert_exact(&comparison, truth);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn members_share_partitions_hand_over_on_join_and_take_over_on_kill() {
    let started = Instant::now();
    let p = start_pipeline().await;
    let mut a = spawn_member(&p, "agg-a");
    wait_owned(&[(&a, PARTITIONS)], Duration::from_secs(30)).await;
    let mut truth = p.publish(&sim_config(3_000, 1)).await;
    settle_exact(&p, &truth).await;

    // b joins while traffic flows: half the partitions move to it.
    let mut b = None;
    let run = steady(16_000, 2);
    let (during_join, handover) = tokio::join!(p.publish(&run), async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let joined = spawn_member(&p, "agg-b");
        let took = wait_owned(&[(&a, 2), (&joined, 2)], Duration::from_secs(30)).await;
        b = Some(joined);
        took
    });
    let mut b = b.expect("b joined");
    truth.absorb(&during_join);
    settle_exact(&p, &truth).await;
    let owners_now = owners(&p).await;
    assert_eq!(owners_now.len(), PARTITIONS as usize, "{owners_now:?}");
    assert_eq!(owners_now.values().filter(|o| *o == "agg-b").count(), 2);
    let taken = metric(
        b.port,
        "adspend_aggregator_handover_seconds_count{side=\"take\"}",
    )
    .await;
    let released = metric(
        a.port,
        "adspend_aggregator_handover_seconds_count{side=\"release\"}",
    )
    .await;
    assert_eq!(
        (taken, released),
        (2.0, 2.0),
        "handovers counted by both sides"
    );
    eprintln!("membership: handover of 2 partitions to a joining member settled in {handover:?}");

    // a is killed while traffic flows: b takes everything over.
    let a_partitions: Vec<u32> = owners_now
        .iter()
        .filter(|(_, o)| *o == "agg-a")
        .map(|(p, _)| *p)
        .collect();
    let run = steady(16_000, 3);
    let (during_kill, failover) = tokio::join!(p.publish(&run), async {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let killed = Instant::now();
        a.process.kill();
        wait_owned(&[(&b, PARTITIONS)], Duration::from_secs(30)).await;
        killed.elapsed()
    });
    truth.absorb(&during_kill);
    settle_exact(&p, &truth).await;
    let failovers = metric(b.port, "adspend_aggregator_failover_seconds_count").await;
    assert_eq!(
        failovers,
        a_partitions.len() as f64,
        "b counted a failover per partition"
    );
    for partition in &a_partitions {
        let record = record(&p, *partition).await.expect("a record");
        assert_eq!(
            record.epoch,
            epoch(&p, *partition).await,
            "b records p{partition}"
        );
    }
    eprintln!("membership: SIGKILL -> partitions applying on the survivor in {failover:?} (lease TTL {TTL_MS} ms)");

    b.process
        .terminate(Duration::from_secs(30))
        .expect("b stops on SIGTERM");
    eprintln!(
        "membership::join_and_kill: {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn paused_member_past_its_lease_records_nothing_and_moves_no_value_back() {
    let started = Instant::now();
    let p = start_pipeline().await;
    let mut a = spawn_member(&p, "agg-a");
    wait_owned(&[(&a, PARTITIONS)], Duration::from_secs(30)).await;
    let b = spawn_member(&p, "agg-b");
    wait_owned(&[(&a, 2), (&b, 2)], Duration::from_secs(30)).await;
    let mut truth = p.publish(&sim_config(4_000, 11)).await;
    settle_exact(&p, &truth).await;
    let a_partitions: Vec<u32> = owners(&p)
        .await
        .into_iter()
        .filter(|(_, o)| o == "agg-a")
        .map(|(p, _)| p)
        .collect();
    assert_eq!(a_partitions.len(), 2);
    let mut stale_epochs = BTreeMap::new();
    for partition in &a_partitions {
        stale_epochs.insert(*partition, epoch(&p, *partition).await);
    }

    // a freezes; once its lease is gone b owns everything.
    a.process.pause().expect("SIGSTOP a");
    let paused = Instant::now();
    wait_owned(&[(&b, PARTITIONS)], Duration::from_secs(30)).await;
    eprintln!(
        "membership: paused member's partitions taken over {:?} after SIGSTOP",
        paused.elapsed()
    );
    let more = p.publish(&sim_config(4_000, 12)).await;
    truth.absorb(&more);
    settle_exact(&p, &truth).await;
    let before_resume = p.lifetimes().await.expect("pacer values");

    // a wakes up believing it owns two partitions. Watch the pacer while it
    // notices, stops, rejoins and takes its share back by handover.
    a.process.resume().expect("SIGCONT a");
    let mut last = before_resume.clone();
    let watch_until = Instant::now() + Duration::from_secs(8);
    while Instant::now() < watch_until {
        let now = p.lifetimes().await.expect("pacer values");
        for (limit, value) in &now {
            let previous = last.get(limit).copied().unwrap_or(0);
            assert!(
                *value >= previous,
                "pacer value of {limit} went back from {previous} to {value} after the stale member woke"
            );
        }
        last = now;
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    a.process
        .wait_for_log("membership lease lost", Duration::from_secs(10))
        .await
        .expect("a notices that its lease is gone");
    wait_owned(&[(&a, 2), (&b, 2)], Duration::from_secs(30)).await;
    // No record of a's old epoch came back: every record since is newer.
    for (partition, stale) in &stale_epochs {
        let record = record(&p, *partition).await.expect("a record");
        assert!(
            record.epoch > *stale,
            "p{partition}: the record carries epoch {} of the stale owner",
            record.epoch
        );
    }
    let last_batch = p.publish(&sim_config(3_000, 13)).await;
    truth.absorb(&last_batch);
    settle_exact(&p, &truth).await;
    eprintln!(
        "membership::paused: {:.1}s",
        started.elapsed().as_secs_f64()
    );
}

/// etcd stalling past a fresh lease's TTL between the grant and the member
/// key's put answers "lease not found" (seen in a loaded CI run, where the
/// aggregator then exited): the member must grant a new lease and join.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_that_lapses_before_the_join_is_replaced_not_fatal() {
    let p = start_pipeline().await;
    // TTL_MS is 2000: the first join stalls past it.
    let mut a = spawn_member_with(
        &p,
        "agg-a",
        &[("ADSPEND_FAILPOINTS", "aggregator.before_join~3500")],
    );
    a.process
        .wait_for_log(
            "FAILPOINT STALLED: aggregator.before_join",
            Duration::from_secs(30),
        )
        .await
        .expect("the first join stalls");
    a.process
        .wait_for_log(
            "rejoining the cluster failed; retrying",
            Duration::from_secs(30),
        )
        .await
        .expect("the put under the lapsed lease fails and the member retries");
    wait_owned(&[(&a, PARTITIONS)], Duration::from_secs(30)).await;
    assert!(a.process.is_running(), "the member is still running");
    let truth = p.publish(&sim_config(2_000, 21)).await;
    settle_exact(&p, &truth).await;
}

/// An etcd that stops answering for longer than half the lease TTL but not
/// past the lease (an election, a slow disk) pauses the member's partitions
/// and resumes them when etcd answers again: no lost lease, no partition
/// restarted, nothing lost. Before, the member declared its lease lost at
/// half the TTL and stopped and restarted every partition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_etcd_stall_within_the_lease_pauses_partitions_without_a_restart() {
    let mut p = start_pipeline().await;
    // Keepalives every 2 s, each good for 3 s; the lease lives 6 s in etcd.
    let mut a = spawn_member_with(&p, "agg-a", &[("ADSPEND_LEASE_TTL_MS", "6000")]);
    wait_owned(&[(&a, PARTITIONS)], Duration::from_secs(30)).await;
    let first = p.publish(&sim_config(3_000, 31)).await;
    let claims = std::fs::read_to_string(a.process.log_path())
        .unwrap_or_default()
        .matches("partition claimed")
        .count();
    assert_eq!(claims, PARTITIONS as usize, "{}", a.process.log_tail(40));

    // Frozen for 3.5 s: past the 3 s the last answer was good for, inside
    // the 6 s etcd keeps the lease from the last keepalive it answered.
    let etcd = p.etcd.as_mut().expect("etcd");
    etcd.pause();
    tokio::time::sleep(Duration::from_millis(3_500)).await;
    etcd.resume();
    a.process
        .wait_for_log(
            "etcd confirmed the lease; partitions resume",
            Duration::from_secs(20),
        )
        .await
        .expect("the member resumes once etcd answers");

    let second = p.publish(&sim_config(3_000, 32)).await;
    assert_eq!(
        try_metric(a.port, "adspend_aggregator_leases_lost_total")
            .await
            .ok(),
        Some(0.0),
        "the lease was declared lost"
    );
    assert!(
        try_metric(a.port, "adspend_aggregator_lease_pauses_total")
            .await
            .is_ok_and(|n| n >= 1.0),
        "no pause was counted"
    );
    assert_eq!(
        std::fs::read_to_string(a.process.log_path())
            .unwrap_or_default()
            .matches("partition claimed")
            .count(),
        claims,
        "partitions were restarted:\n{}",
        a.process.log_tail(60)
    );
    let mut truth = first;
    truth.absorb(&second);
    settle_exact(&p, &truth).await;
}

/// Scaling down by SIGTERM is a handover: the leaving member gets off the
/// member list, records a last checkpoint per partition and releases them
/// while its lease lives; the receiver counts handovers, not failovers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_stopped_by_sigterm_hands_over_not_fails_over() {
    let p = start_pipeline().await;
    // b claims every partition alone, then half of them from a: its last
    // claim stalls a second, long enough for a (which waits only until
    // every key it released is claimed) to revoke its lease meanwhile.
    let last_claim = format!(
        "aggregator.after_claim@{}~1000",
        PARTITIONS + PARTITIONS / 2
    );
    let mut b = spawn_member_with(&p, "agg-b", &[("ADSPEND_FAILPOINTS", &last_claim)]);
    wait_owned(&[(&b, PARTITIONS)], Duration::from_secs(30)).await;
    let mut a = spawn_member(&p, "agg-a");
    wait_owned(
        &[(&a, PARTITIONS / 2), (&b, PARTITIONS / 2)],
        Duration::from_secs(60),
    )
    .await;
    let mut truth = p.publish(&sim_config(3_000, 41)).await;

    const TAKE: &str = "adspend_aggregator_handover_seconds_count{side=\"take\"}";
    const FAILOVER: &str = "adspend_aggregator_failover_seconds_count";
    let takes_before = metric(b.port, TAKE).await;
    let failovers_before = metric(b.port, FAILOVER).await;
    let status = a
        .process
        .terminate(Duration::from_secs(30))
        .expect("SIGTERM a");
    assert!(status.success(), "a did not shut down cleanly: {status:?}");
    wait_owned(&[(&b, PARTITIONS)], Duration::from_secs(30)).await;
    // Counted once each partition applies there (after its restore).
    let want = f64::from(PARTITIONS / 2);
    let _ = wait_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async { metric(b.port, TAKE).await - takes_before >= want },
    )
    .await;
    b.process
        .wait_for_log(
            "FAILPOINT STALLED: aggregator.after_claim",
            Duration::from_secs(5),
        )
        .await
        .expect("b's last claim stalled");
    let takes = metric(b.port, TAKE).await - takes_before;
    let body = reqwest::get(format!("http://127.0.0.1:{}/metrics", b.port))
        .await
        .expect("b's metrics")
        .text()
        .await
        .expect("b's metrics");
    let moves: Vec<&str> = body
        .lines()
        .filter(|l| l.contains("handover") || l.contains("failover"))
        .collect();
    assert!(
        takes >= want,
        "b counted {takes} handovers for {want} partitions: {moves:#?}"
    );
    assert_eq!(
        metric(b.port, FAILOVER).await,
        failovers_before,
        "a scale-down by SIGTERM was counted as failover"
    );
    truth.absorb(&p.publish(&sim_config(3_000, 42)).await);
    settle_exact(&p, &truth).await;
}
