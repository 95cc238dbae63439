//! The random fault campaign against a running compose cluster; run it
//! with `bash scripts/cluster.sh chaos --faults N --seed S` (docs/CLUSTER.md).
//! The last line of its output is `chaos: N faults, M mismatches, …`.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use adspend_chaos::cluster::chaos::{self, ChaosConfig};
use adspend_chaos::cluster::Cluster;
use clap::Parser;

#[derive(Parser)]
#[command(name = "adclusterchaos", version)]
struct Args {
    /// Faults to inject, one after another (now and then two at once).
    #[arg(long, default_value_t = 20)]
    faults: usize,
    /// Seed of the draw of faults, targets, holds and events.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The compose project to attack (scripts/cluster.sh's ADSPEND_CLUSTER_PROJECT).
    #[arg(long, env = "ADSPEND_CLUSTER_PROJECT", default_value = "adspend")]
    project: String,
    /// Simulator events per second, over all sources.
    #[arg(long, default_value_t = 900.0)]
    rate: f64,
    /// Sources (subjects impressions.chaos-<n>) the simulator publishes to.
    #[arg(long, default_value_t = 3)]
    sources: usize,
    /// The aggregators' lease TTL in milliseconds (the compose default).
    #[arg(long, env = "ADSPEND_LEASE_TTL_MS", default_value_t = 5000)]
    lease_ttl_ms: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let config = ChaosConfig {
        faults: args.faults,
        seed: args.seed,
        rate: args.rate,
        sources: args.sources.max(1),
        lease_ttl: Duration::from_millis(args.lease_ttl_ms),
        ..ChaosConfig::default()
    };
    let cluster = match Cluster::attach(&args.project) {
        Ok(c) => Arc::new(c),
        Err(e) => {
            eprintln!("chaos: error: {e:#}");
            return ExitCode::FAILURE;
        }
    };
    match chaos::run(cluster, &config, |line| eprintln!("chaos: {line}")).await {
        Ok(report) => {
            println!("{}", report.render());
            let clean =
                report.mismatches == 0 && report.stalls() == 0 && report.violations.is_empty();
            if clean {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("chaos: error (seed {}): {e:#}", args.seed);
            println!("chaos: 0 faults, campaign aborted: {e:#}");
            ExitCode::FAILURE
        }
    }
}
