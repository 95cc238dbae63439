//! The failure-injection campaign, short: every failure point and every
//! SIGKILL / kill -9 kind once against real NATS, etcd and S3, then random
//! faults under other seeds, one of them with two aggregator writers. Each round asserts pacer == truth exactly, the
//! end asserts the aggregator's LMDB too; each fault is confirmed fired.

use adspend_chaos::local::{self as chaos, all_faults, CampaignConfig};
use adspend_harness::pipeline::Backends;

async fn campaign(config: CampaignConfig) {
    let seed = config.seed;
    let report = chaos::run(config, |index, fault, times| {
        eprintln!(
            "chaos seed {seed}: round {index}: {} ok ({times})",
            fault.name()
        );
    })
    .await
    .unwrap_or_else(|e| panic!("campaign with seed {seed} failed: {e:#}"));
    eprintln!("{}", report.render());
    assert_eq!(report.pacer_mismatches, 0, "seed {seed}");
    assert_eq!(report.aggregator_mismatches, 0, "seed {seed}");
    assert_eq!(report.max_abs_diff, 0, "seed {seed}");
    assert!(report.limits_compared > 0);
    assert_eq!(report.recovery_ms.len(), report.rounds);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_fault_kind_once_keeps_totals_exact() {
    let config = CampaignConfig::default();
    let kinds = all_faults().len();
    assert_eq!(config.rounds, kinds);
    campaign(config).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_single_machine_two_writers_seed_2() {
    campaign(CampaignConfig {
        rounds: 5,
        seed: 2,
        backends: Backends::default(),
        walk_all_first: false,
        writers: "2".into(),
        ..CampaignConfig::default()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn random_faults_with_etcd_and_s3_seed_3() {
    campaign(CampaignConfig {
        rounds: 5,
        seed: 3,
        walk_all_first: false,
        ..CampaignConfig::default()
    })
    .await;
}
