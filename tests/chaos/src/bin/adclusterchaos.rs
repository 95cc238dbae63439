//! The random fault campaign against a running compose cluster; run it
//! with `bash scripts/cluster.sh chaos --faults N --seed S` (docs/CLUSTER.md).
//! The last line of its output is `chaos: N faults, M mismatches, …`.
//! With `--failover-runs N` (`bash scripts/cluster.sh failover --runs N`) it
//! runs the kill-then-pause failover N times instead, printing each run's
//! timeline and the time from the last publish to exact totals.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use adspend_chaos::cluster::chaos::{self, ChaosConfig};
use adspend_chaos::cluster::{connect_as, failover, Cluster, AGGREGATORS};
use adspend_sim::stream_truth::truth_from_stream;
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
    /// Instead of the campaign: this many kill-then-pause failovers (an
    /// aggregator killed 1.5 s into publishing at --rate, another paused 3 s
    /// later, publishing stopped 2 s after that), each healed before the next.
    #[arg(long)]
    failover_runs: Option<usize>,
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
    if let Some(runs) = args.failover_runs {
        return match failovers(&cluster, runs, args.rate, args.seed).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("failover: error: {e:#}");
                ExitCode::FAILURE
            }
        };
    }
    match chaos::run(cluster, &config, |line| eprintln!("chaos: {line}")).await {
        Ok(report) => {
            println!("{}", report.render());
            if report.clean() {
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

/// `runs` kill-then-pause failovers, each on other members, healed between
/// runs; prints every run and the spread of "exact after the last publish".
async fn failovers(cluster: &Cluster, runs: usize, rate: f64, seed: u64) -> anyhow::Result<()> {
    let catalog = chaos::ensure_catalog(cluster, &mut |line| eprintln!("failover: {line}")).await?;
    // What the stream holds already: the pacer must equal it plus each run.
    let auditor = connect_as("auditor").await?;
    let mut truth = truth_from_stream(&auditor, &catalog).await?;
    let mut after_last = Vec::new();
    for run in 0..runs {
        let killed = AGGREGATORS[run % AGGREGATORS.len()];
        let paused = AGGREGATORS[(run + 1) % AGGREGATORS.len()];
        let plan = failover::Plan {
            rate,
            seed: seed + run as u64,
            ..failover::Plan::default()
        };
        eprintln!(
            "failover: run {}/{runs}: kill {killed}, then pause {paused}",
            run + 1
        );
        let outcome =
            failover::kill_then_pause(cluster, &catalog, &plan, killed, paused, &mut truth).await;
        failover::heal(cluster, killed, paused).await?;
        let outcome = outcome?;
        println!("{}", outcome.render());
        let missing = outcome.kill.missing();
        if !missing.is_empty() || !outcome.pause.missing().is_empty() {
            println!(
                "failover: stages missing: {:?} {:?}",
                missing,
                outcome.pause.missing()
            );
        }
        after_last.push(outcome.exact_after_last_publish.as_secs_f64());
    }
    let mut sorted = after_last.clone();
    sorted.sort_by(f64::total_cmp);
    println!(
        "failover: {runs} runs, exact after the last publish (s): {} (median {:.1}, max {:.1})",
        after_last
            .iter()
            .map(|s| format!("{s:.1}"))
            .collect::<Vec<_>>()
            .join(", "),
        sorted.get(sorted.len() / 2).copied().unwrap_or_default(),
        sorted.last().copied().unwrap_or_default()
    );
    Ok(())
}
