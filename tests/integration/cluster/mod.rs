//! Faults on the docker-compose cluster (deploy/docker-compose.yml): real
//! containers, killed, paused, cut off from etcd, scaled, while the simulator
//! publishes with duplicates; every scenario ends with the pacer equal to the
//! ground truth for every limit, and prints what it measured. The cluster
//! runs with NATS users over TLS and etcd client certificates; the failover
//! test's all-up start also shows plaintext and credential-less clients
//! refused.
//!
//! They need Docker and the images (`bash scripts/cluster.sh images`), use
//! host ports 4222 and 8080, and must run one at a time: `scripts/test.sh`
//! runs them in their own phase (`cluster::docker_`, `--test-threads=1`).

mod support;

use self::support::*;

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use adspend_chaos::cluster::chaos::{self, ChaosConfig};
use adspend_chaos::cluster::{
    failover, metric_value, wait_applied, Cluster, Monotonic, Shard, Traffic, AGGREGATORS,
    PARTITIONS,
};

/// All up first: each aggregator owns partitions, plaintext and
/// credential-less clients are refused while the simulator publishes, and
/// the totals are exact. Then the object store restarts, and under traffic
/// an aggregator is killed and, 3 s later, another paused: their partitions
/// come back on the survivor from the snapshots, exact; every stage of
/// each failover shows in the services' logs (its timeline is printed);
/// every budget alert threshold a limit's spend crossed is announced on
/// `ALERTS` once, none twice; and no service was refused a NATS call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_kill_aggregator_failover() {
    let catalog = catalog(22);
    let cluster = Cluster::start_json(&with_alerts(&catalog, &ALERT_THRESHOLDS))
        .await
        .expect("cluster");
    let owners = stable_owners(&cluster, &AGGREGATORS).await;
    for member in AGGREGATORS {
        assert!(
            !partitions_of(&owners, member).is_empty(),
            "{member} owns nothing: {owners:?}"
        );
    }
    let started = Instant::now();
    let traffic = Traffic::start(&catalog, 20_000, RATE, 1).await.unwrap();
    plain_clients_refused(&cluster).await;
    let mut truth = traffic.finish().await.expect("simulator run");
    settle_truth(&catalog, &truth, "all up").await;
    figure(&format!(
        "all up: 20000 events at {RATE}/s, published and settled in {:.1}s",
        started.elapsed().as_secs_f64()
    ));

    // The object store restarts first: the snapshots must outlive it.
    let state = cluster.restart("s3").await.expect("docker restart s3");
    assert!(state.running, "{state:?}");
    cluster
        .wait_healthy("s3", Duration::from_secs(60))
        .await
        .expect("s3 healthy again");

    let (victim, paused) = ("aggregator2", "aggregator3");
    let plan = failover::Plan {
        rate: RATE,
        seed: 2,
        ..failover::Plan::default()
    };
    let run = failover::kill_then_pause(&cluster, &catalog, &plan, victim, paused, &mut truth)
        .await
        .expect("kill then pause");
    figure(&run.render());
    for timeline in [&run.kill, &run.pause] {
        let missing = timeline.missing();
        assert!(
            missing.is_empty(),
            "{}: stages missing from the logs: {missing:?}\n{}",
            timeline.what,
            timeline.render()
        );
    }
    assert!(!cluster.members().await.unwrap().iter().any(|m| m == victim));
    assert!(
        !cluster.state(victim).await.unwrap().running,
        "{victim} came back by itself"
    );
    // Each partition came back from a snapshot kept across the store's
    // restart (or the survivor's own LMDB), not by replaying everything.
    let survivor = "aggregator1";
    let logs = cluster.logs(survivor, 5000).await.expect("logs");
    for p in run
        .kill
        .partitions
        .keys()
        .chain(run.pause.partitions.keys())
    {
        let needle = format!("partition={p} ");
        let line = logs
            .lines()
            .rfind(|l| {
                l.contains("partition running")
                    && l.contains(&needle)
                    && l.contains("kind=\"failover\"")
            })
            .unwrap_or_else(|| panic!("no failover start of p{p} in {survivor}'s log"));
        assert!(
            line.contains("start=\"cold\"") || line.contains("start=\"warm\""),
            "p{p} was not restored from a snapshot after the store restarted: {line}"
        );
    }
    let (sum, count) =
        histogram(&cluster, &[survivor], "adspend_aggregator_failover_seconds").await;
    assert!(count >= 1.0, "no failover recorded by {survivor}");
    figure(&format!(
        "kill {victim}, pause {paused}: adspend_aggregator_failover_seconds on {survivor}: {count} takeovers, mean {:.2}s",
        sum / count
    ));
    let (crossings, limits) = alerts_announced_once(&ALERT_THRESHOLDS).await;
    figure(&format!(
        "alerts through a failover: {crossings} crossings announced once each over {limits} limits"
    ));
    no_permission_violations(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_pause_aggregator_fenced() {
    let catalog = catalog(23);
    let cluster = Cluster::start(&catalog).await.expect("cluster");
    stable_owners(&cluster, &AGGREGATORS).await;
    let monotonic = Monotonic::start();
    let traffic = Traffic::start(&catalog, 60_000, RATE, 3).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;

    let victim = "aggregator3";
    let owned = partitions_of(&cluster.owners().await.unwrap(), victim);
    assert!(!owned.is_empty(), "{victim} owns no partition");
    let before = shards_now(&owned).await;
    let paused_at = Instant::now();
    cluster.pause(victim).await.expect("docker pause");
    let takeover = wait_applied(&http(), &before, paused_at, TAKEOVER)
        .await
        .expect("takeover of a paused member");
    assert!(
        cluster.state(victim).await.unwrap().paused,
        "{victim} was not paused throughout"
    );
    figure(&format!(
        "pause {victim}: takeover (pause -> applied under a new epoch): {}",
        takeover.render()
    ));

    cluster.unpause(victim).await.expect("docker unpause");
    let unpaused_at = Instant::now();
    // Once the new owners have checkpointed, the stale epochs must never
    // come back in the records, whatever the unpaused member tries.
    let mut newer_seen: BTreeSet<u32> = BTreeSet::new();
    let mut polls = 0;
    while unpaused_at.elapsed() < Duration::from_secs(15) || newer_seen.len() < owned.len() {
        assert!(
            unpaused_at.elapsed() < TAKEOVER,
            "the new owners of {owned:?} wrote no checkpoint; records seen: {newer_seen:?}"
        );
        let records = cluster.checkpoints().await.expect("checkpoint records");
        polls += 1;
        for p in &owned {
            let old_epoch = before[p].epoch;
            let Some((epoch, _)) = records.get(p) else {
                continue;
            };
            if *epoch > old_epoch {
                newer_seen.insert(*p);
            } else {
                assert!(
                    !newer_seen.contains(p),
                    "p{p}: checkpoint record went back to epoch {epoch} (stale owner wrote it)"
                );
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let logs = cluster.logs(victim, 400).await.unwrap();
    let fenced: Vec<&str> = logs
        .lines()
        .filter(|l| {
            ["lease lost", "fenced", "no longer ours", "keepalive"]
                .iter()
                .any(|w| l.contains(w))
        })
        .collect();
    assert!(
        !fenced.is_empty(),
        "{victim} logged nothing about losing its lease:\n{logs}"
    );
    // The cluster's Prometheus evaluates deploy/prometheus/rules.yml: the
    // lost lease fires AdspendLeaseLost for the victim.
    wait_alert("AdspendLeaseLost", &format!("{victim}:9102")).await;
    figure(&format!(
        "pause {victim}: Prometheus fired AdspendLeaseLost {:.1}s after the unpause",
        unpaused_at.elapsed().as_secs_f64()
    ));
    settle(&catalog, traffic, "pause aggregator").await;
    no_permission_violations(&cluster).await;
    let (samples, backwards) = monotonic.finish().await;
    assert!(samples > 20, "only {samples} pacer samples");
    assert!(
        backwards.is_empty(),
        "pacer values moved backwards: {backwards:?}"
    );
    figure(&format!(
        "pause {victim}: {polls} checkpoint-record polls after unpause, no stale epoch; \
         {samples} pacer samples, none backwards; the victim logged: {}",
        fenced.first().map_or("", |l| l.trim())
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_kill_nats_and_etcd_node() {
    let catalog = catalog(24);
    let cluster = Cluster::start(&catalog).await.expect("cluster");
    stable_owners(&cluster, &AGGREGATORS).await;
    let traffic = Traffic::start(&catalog, 45_000, RATE, 4).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;

    // nats1 carries the host's port 4222 (the simulator's connection); nats3
    // is as much a stream replica as it.
    let state = cluster.kill("nats3").await.expect("kill nats3");
    assert!(!state.running);
    let leader = cluster.etcd_leader().await.expect("etcd leader");
    let records_before = cluster.checkpoints().await.expect("checkpoints");
    let killed_at = Instant::now();
    let state = cluster.kill(&leader).await.expect("kill the etcd leader");
    assert!(!state.running);
    // Quorum holds: every partition checkpoints again past its record.
    let mut advanced: BTreeMap<u32, Duration> = BTreeMap::new();
    while advanced.len() < PARTITIONS as usize {
        if killed_at.elapsed() >= TAKEOVER {
            // What the aggregators said, for the diagnosis.
            let mut logs = String::new();
            for aggregator in AGGREGATORS {
                let tail = cluster
                    .logs(aggregator, 40)
                    .await
                    .unwrap_or_else(|e| format!("{e:#}"));
                logs.push_str(&format!("---- {aggregator} ----\n{tail}\n"));
            }
            panic!("checkpoints stopped after killing {leader}: advanced {advanced:?}\n{logs}");
        }
        if let Ok(records) = cluster.checkpoints().await {
            for (p, (_, seq)) in &records {
                let old = records_before.get(p).map_or(0, |r| r.1);
                if *seq > old {
                    advanced.entry(*p).or_insert(killed_at.elapsed());
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let slowest = advanced.values().max().unwrap();
    figure(&format!(
        "kill nats3 and the etcd leader {leader}: every partition checkpointed again within {:.2}s",
        slowest.as_secs_f64()
    ));
    assert!(!cluster.state("nats3").await.unwrap().running);
    assert!(!cluster.state(&leader).await.unwrap().running);
    settle(&catalog, traffic, "kill nats3 + etcd leader").await;
    no_permission_violations(&cluster).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_aggregator_cut_off_from_etcd() {
    let catalog = catalog(25);
    let cluster = Cluster::start(&catalog).await.expect("cluster");
    stable_owners(&cluster, &AGGREGATORS).await;
    let monotonic = Monotonic::start();
    let traffic = Traffic::start(&catalog, 45_000, RATE, 5).await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;

    let victim = "aggregator1";
    let owned = partitions_of(&cluster.owners().await.unwrap(), victim);
    assert!(!owned.is_empty(), "{victim} owns no partition");
    let gauge = "adspend_aggregator_owned_partitions";
    let body = cluster.metrics(victim, AGGREGATOR_METRICS).await.unwrap();
    assert_eq!(
        metric_value(&body, gauge),
        Some(owned.len() as f64),
        "{gauge} before the cut"
    );
    let before = shards_now(&owned).await;
    let cut_at = Instant::now();
    let state = cluster
        .disconnect(victim, "control")
        .await
        .expect("disconnect");
    assert!(state.running && state.networks == ["data"], "{state:?}");
    let takeover = wait_applied(&http(), &before, cut_at, TAKEOVER)
        .await
        .expect("takeover of the cut-off member's partitions");
    figure(&format!(
        "cut {victim} off etcd: takeover: {}",
        takeover.render()
    ));
    // It stops applying by itself: its owned-partitions gauge drops to 0.
    let mut stopped_after = None;
    while cut_at.elapsed() < TAKEOVER {
        let body = cluster.metrics(victim, AGGREGATOR_METRICS).await.unwrap();
        if metric_value(&body, gauge) == Some(0.0) {
            stopped_after = Some(cut_at.elapsed());
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let stopped_after =
        stopped_after.unwrap_or_else(|| panic!("{victim} still reports owned partitions"));
    let logs = cluster.logs(victim, 400).await.unwrap();
    let lost: Vec<&str> = logs
        .lines()
        .filter(|l| {
            ["lease lost", "keepalive", "fenced", "no longer ours"]
                .iter()
                .any(|w| l.contains(w))
        })
        .collect();
    assert!(
        !lost.is_empty(),
        "{victim} logged nothing about its lease:\n{logs}"
    );
    figure(&format!(
        "cut {victim} off etcd: it reported 0 owned partitions {:.2}s after the cut; it logged: {}",
        stopped_after.as_secs_f64(),
        lost.first().map_or("", |l| l.trim())
    ));
    cluster.connect(victim, "control").await.expect("reconnect");
    wait_owners(
        &cluster,
        TAKEOVER,
        "shared with the reconnected member again",
        |o| o.values().any(|m| m == victim),
    )
    .await;
    settle(&catalog, traffic, "aggregator cut off from etcd").await;
    no_permission_violations(&cluster).await;
    let (samples, backwards) = monotonic.finish().await;
    assert!(
        backwards.is_empty(),
        "pacer values moved backwards: {backwards:?}"
    );
    figure(&format!(
        "cut off from etcd: {samples} pacer samples, none backwards"
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_scale_aggregators() {
    let catalog = catalog(26);
    let cluster = Cluster::start(&catalog).await.expect("cluster");
    stable_owners(&cluster, &AGGREGATORS).await;
    let monotonic = Monotonic::start();
    let traffic = Traffic::start(&catalog, 70_000, RATE, 6).await.unwrap();
    tokio::time::sleep(Duration::from_secs(4)).await;

    // 3 -> 4. Owners as they are just before the scale, not at the start: a
    // member that fails a partition on a passing error (JetStream still
    // electing its leaders) releases it, and another member takes it.
    let owners3 = stable_owners(&cluster, &AGGREGATORS).await;
    let all: Vec<u32> = (0..PARTITIONS).collect();
    let before = shards_now(&all).await;
    let scaled_at = Instant::now();
    cluster.up("aggregator4").await.expect("start aggregator4");
    let four = ["aggregator1", "aggregator2", "aggregator3", "aggregator4"];
    let owners4 = stable_owners(&cluster, &four).await;
    let moved: BTreeMap<u32, Shard> = owners4
        .iter()
        .filter(|(p, o)| owners3.get(p) != Some(o))
        .map(|(p, _)| (*p, before[p]))
        .collect();
    assert!(!moved.is_empty(), "nothing moved to aggregator4");
    let handover = wait_applied(&http(), &moved, scaled_at, TAKEOVER)
        .await
        .expect("handover to aggregator4");
    figure(&format!("scale 3 -> 4: {}", handover.render()));
    let name = "adspend_aggregator_handover_seconds";
    let (sum, count) = histogram(&cluster, &["aggregator4"], name).await;
    assert!(count >= 1.0, "aggregator4 recorded no handover");
    figure(&format!(
        "scale 3 -> 4: {name} on aggregator4: {count} handovers, mean {:.2}s",
        sum / count
    ));

    // 4 -> 2: clean shutdowns hand their partitions over, and the
    // receivers count handovers, not failovers.
    let two = ["aggregator1", "aggregator2"];
    let (_, handovers_before) = histogram(&cluster, &two, name).await;
    let (_, failovers_before) =
        histogram(&cluster, &two, "adspend_aggregator_failover_seconds").await;
    let before = shards_now(&all).await;
    let scaled_at = Instant::now();
    for member in ["aggregator3", "aggregator4"] {
        let state = cluster.stop(member).await.expect("stop");
        assert_eq!(
            state.exit_code, 0,
            "{member} did not shut down cleanly: {state:?}"
        );
    }
    let owners2 = stable_owners(&cluster, &two).await;
    let moved: BTreeMap<u32, Shard> = owners2
        .iter()
        .filter(|(p, o)| owners4.get(p) != Some(o))
        .map(|(p, _)| (*p, before[p]))
        .collect();
    assert!(moved.len() >= partitions_of(&owners4, "aggregator3").len());
    let handover = wait_applied(&http(), &moved, scaled_at, TAKEOVER)
        .await
        .expect("handover from the stopped members");
    figure(&format!("scale 4 -> 2: {}", handover.render()));
    let (sum, count) = histogram(&cluster, &two, name).await;
    let (failover_sum, failover_count) =
        histogram(&cluster, &two, "adspend_aggregator_failover_seconds").await;
    assert_eq!(
        failover_count, failovers_before,
        "a scale-down by SIGTERM was counted as failover on aggregator1+2"
    );
    assert!(
        count - handovers_before >= moved.len() as f64,
        "aggregator1+2 recorded {} handovers for {} moves",
        count - handovers_before,
        moved.len()
    );
    figure(&format!(
        "scale 4 -> 2: on aggregator1+2 since start: {name} {count} (sum {sum:.2}s), \
         adspend_aggregator_failover_seconds {failover_count} (sum {failover_sum:.2}s)"
    ));
    settle(&catalog, traffic, "scale 3 -> 4 -> 2").await;
    no_permission_violations(&cluster).await;
    let (samples, backwards) = monotonic.finish().await;
    assert!(
        backwards.is_empty(),
        "pacer values moved backwards: {backwards:?}"
    );
    figure(&format!("scale: {samples} pacer samples, none backwards"));
}

/// A short random campaign (`scripts/cluster.sh chaos` runs long ones):
/// ADSPEND_CHAOS_FAULTS faults (default 20) drawn with ADSPEND_CHAOS_SEED.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn docker_chaos_campaign() {
    let env = |name: &str, default: u64| {
        std::env::var(name)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let config = ChaosConfig {
        faults: env("ADSPEND_CHAOS_FAULTS", 20) as usize,
        seed: env("ADSPEND_CHAOS_SEED", 1),
        ..ChaosConfig::default()
    };
    let cluster = std::sync::Arc::new(Cluster::start(&catalog(31)).await.expect("cluster"));
    stable_owners(&cluster, &AGGREGATORS).await;
    let report = chaos::run(cluster.clone(), &config, |line| eprintln!("chaos: {line}"))
        .await
        .expect("campaign");
    let rendered = report.render();
    println!("{rendered}");
    for line in rendered.lines().filter(|l| l.starts_with("chaos:")) {
        figure(line);
    }
    assert_eq!(report.mismatches, 0, "{rendered}");
    assert!(report.violations.is_empty(), "{rendered}");
    assert_eq!(report.stalls(), 0, "{rendered}");
    assert!(report.permission_violations.is_empty(), "{rendered}");
}
