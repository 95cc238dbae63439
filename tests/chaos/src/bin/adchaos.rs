//! The long failure-injection campaign: many rounds of faults against a real
//! pipeline (NATS, etcd, S3), printing the figures of the README. Needs the
//! service binaries built with failure points:
//! `cargo build --workspace --bins --features adspend-tests/failpoints`.

use std::process::ExitCode;

use adspend_chaos::local::{self as chaos, CampaignConfig};
use adspend_harness::pipeline::Backends;
use clap::Parser;

#[derive(Parser)]
#[command(name = "adchaos", version)]
struct Args {
    /// Rounds; each injects one fault (every kind once first, then random).
    #[arg(long, default_value_t = 200)]
    rounds: usize,
    /// Seed of the fault choice, timing and events; printed on failure.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Impressions published per round.
    #[arg(long, default_value_t = 12_000)]
    events: u64,
    /// Publish rate during a round, events/s.
    #[arg(long, default_value_t = 6_000.0)]
    rate: f64,
    /// Share of impressions sent twice by the simulator.
    #[arg(long, default_value_t = 0.1)]
    duplicate_rate: f64,
    /// Keep snapshots on the local filesystem and checkpoints in the data
    /// dir instead of S3 and etcd.
    #[arg(long)]
    single_machine: bool,
    /// The aggregator's writers (ADSPEND_AGGREGATOR_WRITERS): "auto", as a
    /// deployment runs by default, or a count.
    #[arg(long, default_value = "auto")]
    writers: String,
    /// Only the faults whose name contains one of these words, comma
    /// separated (e.g. `nats-server`, `failpoint`, `SIGKILL aggregator`).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let backends = if args.single_machine {
        Backends::default()
    } else {
        Backends {
            etcd: true,
            s3: true,
        }
    };
    let config = CampaignConfig {
        rounds: args.rounds,
        seed: args.seed,
        events_per_round: args.events,
        rate: args.rate,
        duplicate_rate: args.duplicate_rate,
        backends,
        writers: args.writers,
        only: args.only,
        ..CampaignConfig::default()
    };
    let rounds = config.rounds;
    let result = chaos::run(config, |index, fault, times| {
        eprintln!(
            "adchaos: round {}/{rounds}: {} ok ({times})",
            index + 1,
            fault.name()
        );
    })
    .await;
    match result {
        Ok(report) => {
            print!("{}", report.render());
            if report.pacer_mismatches + report.aggregator_mismatches == 0 {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Err(e) => {
            eprintln!("adchaos: FAILED (seed {}): {e:#}", args.seed);
            ExitCode::FAILURE
        }
    }
}
