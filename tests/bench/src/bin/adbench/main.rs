//! `adbench`: the benchmark suite in one command. Prints each figure as it is
//! measured and, at the end, the table of `docs/BENCHMARKS.md` (also written
//! to `--out`). Build it in release, with the services:
//! `cargo build --release --workspace --bins`, or run `scripts/bench.sh`.
//!
//! One module per section: `state` (apply, checkpoint), `e2e`, `peers`,
//! `recovery`, `publisher` (the client crate's); each adds its rows to the
//! table.

mod deltas;
mod e2e;
mod fair;
mod leases;
mod pacing;
mod peers;
mod publisher;
mod recovery;
mod scale;
mod soak;
mod state;

use std::path::PathBuf;
use std::process::ExitCode;

use adspend_bench::report::{Samples, Table};
use anyhow::Context as _;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Section {
    Apply,
    Checkpoint,
    Deltas,
    E2e,
    Peers,
    Recovery,
    /// Fair sharing among sources under a flood (not in the default list).
    Fair,
    /// Closed loop on the real pipeline (not in the default list).
    Pacing,
    /// The pacer's GET latency under cheap attacks (not in the default list).
    Attack,
    /// The CPU stages at 1..n threads and the pipeline with sets of
    /// processes (not in the default list).
    Scale,
    /// Spend lease grants through one and two pacers (not in the default
    /// list).
    Leases,
    /// Every store and process over a long steady run (not in the default
    /// list).
    Soak,
    /// The client crate's publisher into durable NATS (not in the default
    /// list).
    Publisher,
}

#[derive(Parser)]
#[command(name = "adbench", version)]
struct Args {
    /// Sections to run, comma-separated (default: all, in this order).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "apply,checkpoint,deltas,e2e,peers,recovery"
    )]
    sections: Vec<Section>,
    /// Runs of each measurement, for min/median/max.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds of each sustained end-to-end run.
    #[arg(long, default_value_t = 60)]
    e2e_secs: u64,
    /// Write each freshness run's delays, stage by stage and message by
    /// message (`stage,unix_ms,delay_ms`), into this folder.
    #[arg(long)]
    e2e_stages_csv: Option<std::path::PathBuf>,
    /// Settings for every service of the end-to-end runs, on top of the
    /// contract's defaults (e.g. `ADSPEND_PUSH_INTERVAL_MS=20`, or
    /// `RUST_LOG=adspend_aggregator=debug` for one filter without commas, or
    /// the allocator's `MIMALLOC_*` options).
    #[arg(long, value_delimiter = ',', value_parser = name_value)]
    e2e_service_env: Vec<(String, String)>,
    /// NATS sync settings of the end-to-end runs: `durable`
    /// (`sync_interval: always`) and `default` (NATS's default).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "durable,default"
    )]
    e2e_syncs: Vec<e2e::NatsSync>,
    /// Events per second of the freshness runs. Without it each freshness
    /// run follows a sustained run and publishes at half its rate; with it
    /// the sustained runs are skipped (for comparing builds and settings on
    /// the same load).
    #[arg(long)]
    e2e_fresh_rate: Option<f64>,
    /// Events per NDJSON message in the end-to-end and peer runs.
    #[arg(long, default_value_t = 1000)]
    batch: usize,
    /// Events of the workload every contender of the peer section consumes.
    #[arg(long, default_value_t = 1_000_000)]
    peer_events: u64,
    /// Events published before the first kill of the recovery section (about
    /// 3.3 dedupe ids each).
    #[arg(long, default_value_t = 3_000_000)]
    recovery_events: u64,
    /// Ads in the generated catalogs of the pipeline runs.
    #[arg(long, default_value_t = 20_000)]
    ads: u32,
    /// Limits and dedupe ids of the checkpoint state.
    #[arg(long, default_value_t = 1_000_000)]
    state_limits: usize,
    #[arg(long, default_value_t = 10_000_000)]
    state_ids: u64,
    /// Dedupe-id counts of the incremental checkpoint table (ascending; one
    /// store grows through them).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1000000,10000000,50000000"
    )]
    delta_ids: Vec<usize>,
    /// Skip the apply case over 1,000,000 uniform limits (for profiling the
    /// Zipf case alone).
    #[arg(long)]
    apply_skip_uniform: bool,
    /// Wall-clock seconds of the compressed day of the pacing section.
    #[arg(long, default_value_t = 60)]
    pacing_day_secs: u64,
    /// Ad requests per second at the day's peak in the pacing section.
    #[arg(long, default_value_t = 1500.0)]
    pacing_peak_rate: f64,
    /// Added (reporting) delays, seconds, of the pacing section [default:
    /// 0,1,10,30 in the day scenario, 1,5,10,30 in the fast one].
    #[arg(long, value_delimiter = ',')]
    pacing_delays: Vec<f64>,
    /// How the pacing section's ad servers ask the pacer, side by side:
    /// decisions (POST /v1/decisions) and leases (POST /v1/leases).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "decisions,leases"
    )]
    pacing_modes: Vec<adspend_sim::cli::ModeArg>,
    /// The pacing algorithms (ADSPEND_PACER_ALGORITHM) of the pacing section.
    #[arg(long, value_delimiter = ',', value_parser = ["adspend", "baseline"],
          default_value = "adspend,baseline")]
    pacing_algorithms: Vec<String>,
    /// The pacing section's scenario: day (a compressed day over the
    /// generated catalog) or fast (20 budgets of 2,000 impressions spent
    /// within seconds; prints the worst overspend per mode and delay).
    #[arg(long, value_enum, default_value = "day")]
    pacing_scenario: adspend_bench::pacing::Scenario,
    /// Pacer processes in each pacing run (the ad servers ask them in turn).
    #[arg(long, default_value_t = 1)]
    pacing_pacers: usize,
    /// The pacing section's lease grace: its pacer's
    /// ADSPEND_PACER_LEASE_GRACE_MS is each run's delay plus this.
    #[arg(long, default_value_t = 2_000)]
    pacing_lease_grace_margin_ms: u64,
    /// The ttl_ms of the leases of the pacing section's lease mode.
    #[arg(long, default_value_t = 3_000,
          value_parser = clap::value_parser!(u64).range(1_000..=600_000))]
    pacing_lease_ttl_ms: u64,
    /// Whether the ad servers of the pacing section's lease mode release
    /// the leases they let go with something left (POST /v1/leases/release).
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    pacing_lease_release: bool,
    /// Events per second of each source of the fair section while steady.
    #[arg(long, default_value_t = 30_000.0)]
    fair_rate: f64,
    /// Events A replays at once in the fair section's backlog case.
    #[arg(long, default_value_t = 3_000_000)]
    fair_backlog: u64,
    /// The most publishes each source of the fair section keeps waiting for
    /// their JetStream ack (A's backlog goes out this many messages of 1,000
    /// events at a time).
    #[arg(long, default_value_t = 512)]
    fair_max_unacked: usize,
    /// Seconds of A's surge in the fair section.
    #[arg(long, default_value_t = 10)]
    fair_secs: u64,
    /// A's surges of the fair section (`none` is the control: the same
    /// seconds with A at its rate).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "none,flood,backlog"
    )]
    fair_surges: Vec<fair::FairSurge>,
    /// The limiter's schedulings compared in the fair section.
    #[arg(long, value_enum, value_delimiter = ',', default_value = "fair,fifo")]
    fair_scheduling: Vec<fair::Scheduling>,
    /// Limiter settings for the fair section, `NAME=value` (for example
    /// `ADSPEND_LIMITER_FAIR_LAG_MS=50`); the defaults otherwise.
    #[arg(long, value_delimiter = ',', value_parser = name_value)]
    fair_limiter_env: Vec<(String, String)>,
    /// Write each fair run's per-message freshness and time into the stream
    /// (`source,kind,at_s,delay_ms`) into this folder.
    #[arg(long)]
    fair_csv: Option<std::path::PathBuf>,
    /// Thread counts of the scale section's stage benchmarks (the limiter's
    /// CPU path and the aggregator's apply); the first is the base of the
    /// speedups.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    scale_threads: Vec<usize>,
    /// Process sets of the scale section's pipeline runs,
    /// `LIMITERSxAGGREGATORS` (`none`: no pipeline runs).
    #[arg(long, value_delimiter = ',', value_parser = scale::process_set, default_value = "1x1,2x2")]
    scale_sets: Vec<Option<(usize, usize)>>,
    /// Input messages per chunk of the limiter's CPU path in the scale section.
    #[arg(long, default_value_t = 8)]
    scale_chunk: usize,
    /// Seconds of each sustained run of the scale section.
    #[arg(long, default_value_t = 30)]
    scale_secs: u64,
    /// Events of the backlog each process set of the scale section drains
    /// after its sustained runs (published while the limiters are paused);
    /// 0: no backlog run.
    #[arg(long, default_value_t = 3_000_000)]
    scale_backlog: u64,
    /// Input formats of the scale section's limiter CPU path and of the
    /// e2e section's sustained runs, run back to back: ndjson, binary
    /// (docs/INPUT.md).
    #[arg(long, value_delimiter = ',', default_value = "ndjson")]
    input_formats: Vec<adspend_sim::InputFormat>,
    /// Leave the scale section's stage benchmarks out (for pipeline runs
    /// of another build's services).
    #[arg(long)]
    scale_skip_stages: bool,
    /// Attacks of the attack section, comma-separated (default: all):
    /// none, slowloris, decisions, oversized, deepest, pushes.
    #[arg(long, value_delimiter = ',')]
    attacks: Vec<String>,
    /// Pacer processes of each leases run, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,2")]
    leases_pacers: Vec<usize>,
    /// Concurrent lease clients (spread over the pacers).
    #[arg(long, default_value_t = 8)]
    leases_clients: usize,
    /// Ads in each lease request.
    #[arg(long, default_value_t = 100)]
    leases_ads: usize,
    /// Seconds of each leases run.
    #[arg(long, default_value_t = 10)]
    leases_secs: u64,
    /// Impressions of each publisher run.
    #[arg(long, default_value_t = 2_000_000)]
    publisher_impressions: u64,
    /// Impressions per message of the publisher runs.
    #[arg(long, default_value_t = 1_000)]
    publisher_batch: usize,
    /// Batch formats of the publisher runs, comma-separated (binary, ndjson).
    #[arg(long, value_delimiter = ',', default_value = "binary,ndjson")]
    publisher_formats: Vec<String>,
    /// Shards pushing sums at once in the `pushes` attack, each every 20 ms.
    #[arg(long, default_value_t = 64)]
    attack_push_shards: usize,
    /// Limits in each push of the `pushes` attack.
    #[arg(long, default_value_t = 500)]
    attack_push_entries: usize,
    /// Events the limiter's CPU path maps in the scale section.
    #[arg(long, default_value_t = 2_000_000)]
    scale_events: u64,
    /// Events per second of the soak section.
    #[arg(long, default_value_t = 20_000.0)]
    soak_rate: f64,
    /// Seconds of the soak; its second half is judged (make the first
    /// half at least two of the longest retention windows).
    #[arg(long, default_value_t = 1_800)]
    soak_secs: u64,
    /// Seconds between the soak's samples.
    #[arg(long, default_value_t = 30)]
    soak_interval_secs: u64,
    /// Share of the soak's events published malformed (into DEADLETTER).
    #[arg(long, default_value_t = 0.0001)]
    soak_bad_rate: f64,
    /// Run the soak with the services' default windows instead of its
    /// shortened ones (5 minutes of input, dedupe ids and dead letters,
    /// a checkpoint every 2 s).
    #[arg(long)]
    soak_default_windows: bool,
    /// Settings for the soak's services, `NAME=value`, on top of its own.
    #[arg(long, value_delimiter = ',', value_parser = name_value)]
    soak_service_env: Vec<(String, String)>,
    /// Where to write the results table (markdown).
    #[arg(long, default_value = "target/bench/results.md")]
    out: PathBuf,
    /// Scratch directory for LMDB stores and snapshots (on the disk under test).
    #[arg(long, default_value = "target/bench/scratch")]
    scratch: PathBuf,
}

fn samples(values: impl IntoIterator<Item = f64>) -> Samples {
    Samples {
        values: values.into_iter().collect(),
    }
}

/// mimalloc keeps large freed blocks for reuse; the system allocator
/// returned them to the kernel and paid for zeroed pages on every batch.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    adspend_common::telemetry::init_tracing();
    let args = Args::parse();
    match run(&args).await {
        Ok(table) => {
            let markdown = table.markdown();
            println!("\n{markdown}");
            if let Some(dir) = args.out.parent() {
                let _ = std::fs::create_dir_all(dir);
            }
            if let Err(e) = std::fs::write(&args.out, &markdown) {
                eprintln!("adbench: writing {}: {e}", args.out.display());
                return ExitCode::FAILURE;
            }
            println!("adbench: table written to {}", args.out.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("adbench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: &Args) -> anyhow::Result<Table> {
    anyhow::ensure!(args.runs > 0, "--runs must be at least 1");
    std::fs::create_dir_all(&args.scratch)
        .with_context(|| format!("creating {}", args.scratch.display()))?;
    let mut table = Table::default();
    for section in &args.sections {
        println!("bench: == {section:?} ==");
        match section {
            Section::Apply => state::apply(args, &mut table)?,
            Section::Checkpoint => state::checkpoint(args, &mut table).await?,
            Section::Deltas => deltas::deltas(args, &mut table).await?,
            Section::E2e => e2e::end_to_end(args, &mut table).await?,
            Section::Peers => peers::side_by_side(args, &mut table).await?,
            Section::Recovery => recovery::recover(args, &mut table).await?,
            Section::Fair => fair::fair_sharing(args, &mut table).await?,
            Section::Pacing => pacing::closed_loop(args, &mut table).await?,
            Section::Attack => attack(args, &mut table).await?,
            Section::Scale => scale::scaling(args, &mut table).await?,
            Section::Leases => leases::grants(args, &mut table).await?,
            Section::Soak => soak::soak(args, &mut table).await?,
            Section::Publisher => publisher::publisher(args, &mut table).await?,
        }
    }
    Ok(table)
}

/// `adspend_bench::attack` with its defaults; a row per attack.
async fn attack(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    use adspend_bench::attack::{self, AttackBench};
    use adspend_bench::report::Target;
    let mut bench = AttackBench {
        push_shards: args.attack_push_shards,
        push_entries: args.attack_push_entries,
        ..AttackBench::default()
    };
    if !args.attacks.is_empty() {
        bench
            .attacks
            .retain(|a| args.attacks.iter().any(|n| n == a.name()));
        anyhow::ensure!(
            bench.attacks.len() == args.attacks.len(),
            "--attacks: unknown attack among {:?} (none, slowloris, decisions, oversized, deepest, pushes)",
            args.attacks
        );
    }
    let (start, results) = attack::run(&bench).await?;
    println!("\n{}", attack::markdown(start, &results));
    for r in &results {
        table.add(
            format!("pacer GET p99 under attack: {}", r.attack.name()),
            "ms",
            samples([r.p99_ms]),
            Some(Target {
                text: "<= 50 ms",
                bound: 50.0,
                higher: false,
            }),
            format!(
                "p50 {:.2} ms; decisions p50 {:.2} ms, p99 {:.2} ms; {}",
                r.p50_ms, r.decide_p50_ms, r.decide_p99_ms, r.attacker
            ),
        );
    }
    Ok(())
}

fn scratch(args: &Args, name: &str) -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(name)
        .tempdir_in(&args.scratch)
        .context("scratch directory")
}

/// `NAME=value` of an `ADSPEND_*` setting, an allocator option
/// (`MIMALLOC_*`) or the log filter (`RUST_LOG`).
fn name_value(arg: &str) -> Result<(String, String), String> {
    match arg.split_once('=') {
        Some((name, value))
            if name.starts_with("ADSPEND_")
                || name.starts_with("MIMALLOC_")
                || name == "RUST_LOG" =>
        {
            Ok((name.to_string(), value.to_string()))
        }
        _ => Err(format!(
            "expected ADSPEND_<NAME>=<value>, MIMALLOC_<NAME>=<value> or RUST_LOG=<filter>, got {arg:?}"
        )),
    }
}
