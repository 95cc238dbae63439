//! `adbench`: the benchmark suite in one command. Prints each figure as it is
//! measured and, at the end, the table of `docs/BENCHMARKS.md` (also written
//! to `--out`). Build it in release, with the services:
//! `cargo build --release --workspace --bins`, or run `scripts/bench.sh`.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use adspend_tests::bench::report::{number, Samples, Table, Target};
use adspend_tests::bench::workload::{Workload, WorkloadSpec};
use adspend_tests::bench::{e2e, peers, recovery, state};
use adspend_tests::pipeline::Backends;
use anyhow::Context as _;
use clap::{Parser, ValueEnum};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Section {
    Apply,
    Checkpoint,
    E2e,
    Peers,
    Recovery,
}

#[derive(Parser)]
#[command(name = "adbench", version)]
struct Args {
    /// Sections to run, comma-separated (default: all, in this order).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "apply,checkpoint,e2e,peers,recovery"
    )]
    sections: Vec<Section>,
    /// Runs of each measurement, for min/median/max.
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds of each sustained end-to-end run.
    #[arg(long, default_value_t = 60)]
    e2e_secs: u64,
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
    /// Skip the apply case over 1,000,000 uniform limits (for profiling the
    /// Zipf case alone).
    #[arg(long)]
    apply_skip_uniform: bool,
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
            Section::Apply => apply(args, &mut table)?,
            Section::Checkpoint => checkpoint(args, &mut table).await?,
            Section::E2e => end_to_end(args, &mut table).await?,
            Section::Peers => side_by_side(args, &mut table).await?,
            Section::Recovery => recover(args, &mut table).await?,
        }
    }
    Ok(table)
}

fn scratch(args: &Args, name: &str) -> anyhow::Result<tempfile::TempDir> {
    tempfile::Builder::new()
        .prefix(name)
        .tempdir_in(&args.scratch)
        .context("scratch directory")
}

fn apply(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let cases = [
        (
            "100,000 limits, Zipf 1.0",
            100_000,
            state::Skew::Zipf(1.0),
            true,
        ),
        (
            "1,000,000 limits, uniform",
            1_000_000,
            state::Skew::Uniform,
            false,
        ),
    ];
    let mut bytes_per_id = Samples::default();
    for (name, limits, skew, targeted) in cases {
        if args.apply_skip_uniform && !targeted {
            continue;
        }
        let mut rates = Samples::default();
        for run in 0..args.runs {
            let dir = scratch(args, "apply")?;
            let (mut writer, store, dirty) = state::writer(dir.path())?;
            let mut feed = state::Feed::new(limits, skew, run as u64 + 1)?;
            // Warm-up: the limits' keys exist, the map has grown.
            state::apply_rate(&mut writer, &dirty, &mut feed, 5)?;
            let measured = state::apply_rate(&mut writer, &dirty, &mut feed, 25)?;
            println!(
                "bench:   apply {name}: {} tuples in {:.2}s, {} tuples/s",
                measured.tuples,
                measured.secs,
                number(measured.tuples_per_sec)
            );
            rates.push(measured.tuples_per_sec);
            if targeted {
                bytes_per_id.push(state::dedupe_bytes_per_id(&store, writer.dedupe_ids())?);
            }
        }
        let target = targeted.then_some(Target {
            text: ">= 2,000,000",
            bound: 2_000_000.0,
            higher: true,
        });
        table.add(
            format!("aggregator apply, one core, {name}"),
            "tuples/s",
            rates,
            target,
            "200,000 tuples per LMDB commit, every id new",
        );
    }
    table.add(
        "dedupe on disk",
        "bytes/id",
        bytes_per_id,
        Some(Target {
            text: "<= 32",
            bound: 32.0,
            higher: false,
        }),
        "pages of the dedupe log / ids in it",
    );
    Ok(())
}

async fn checkpoint(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let dir = scratch(args, "checkpoint")?;
    let (mut writer, store, dirty) = state::writer(&dir.path().join("lmdb"))?;
    let mut feed = state::Feed::new(args.state_limits, state::Skew::Uniform, 7)?;
    let groups = (args.state_ids / 200_000).max(1) as usize;
    let built = state::apply_rate(&mut writer, &dirty, &mut feed, groups)?;
    println!(
        "bench:   state: {} limits, {} dedupe ids ({} tuples/s while building)",
        number(feed.limits() as f64),
        number(writer.dedupe_ids() as f64),
        number(built.tuples_per_sec)
    );
    let (mut secs, mut mb, mut share) =
        (Samples::default(), Samples::default(), Samples::default());
    let mut during = Samples::default();
    for run in 0..args.runs {
        let snap_dir = scratch(args, "snap")?;
        let (result, w, f) = state::checkpoint_under_load(
            writer,
            store.clone(),
            dirty.clone(),
            feed,
            snap_dir.path(),
            60,
        )
        .await?;
        writer = w;
        feed = f;
        println!(
            "bench:   checkpoint {run}: {:.2}s, {} MB, ingest {} tuples/s during vs {} before",
            result.secs,
            number(result.bytes as f64 / 1e6),
            number(result.ingest_during),
            number(result.ingest_before)
        );
        secs.push(result.secs);
        mb.push(result.bytes as f64 / 1e6);
        during.push(result.ingest_during);
        share.push(100.0 * result.ingest_during / result.ingest_before);
    }
    let state_note = format!(
        "{} limits, >= {} ids",
        number(args.state_limits as f64),
        number(args.state_ids as f64)
    );
    table.add(
        "checkpoint: snapshot (copy + upload to file:// + record)",
        "s",
        secs,
        Some(Target {
            text: "<= 2",
            bound: 2.0,
            higher: false,
        }),
        state_note.clone(),
    );
    table.add("checkpoint: snapshot size", "MB", mb, None, state_note);
    table.add(
        "checkpoint: ingest during snapshot",
        "tuples/s",
        during,
        None,
        "the writer applying 200,000-tuple groups meanwhile",
    );
    table.add(
        "checkpoint: ingest during / before",
        "%",
        share,
        Some(Target {
            text: ">= 80",
            bound: 80.0,
            higher: true,
        }),
        "the writer alone in the 2-3 s before",
    );
    Ok(())
}

async fn end_to_end(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let catalog = adspend_tests::sim::generate_catalog(
        &adspend_tests::sim::CatalogSpec::for_ads(args.ads),
        3,
    )?;
    for durable in [true, false] {
        let setting = if durable {
            "sync_interval always"
        } else {
            "NATS default sync (2 min)"
        };
        let (mut rates, mut p50, mut p99) =
            (Samples::default(), Samples::default(), Samples::default());
        for run in 0..args.runs {
            let p = e2e::start(catalog.clone(), durable, Backends::default()).await?;
            let result = e2e::sustained(
                &p,
                Duration::from_secs(args.e2e_secs),
                args.batch,
                100 + run as u64,
            )
            .await?;
            anyhow::ensure!(
                result.exact,
                "end-to-end run {run} ({setting}) did not match the truth"
            );
            println!(
                "bench:   e2e {setting}: {} events in {:.1}s = {} events/s, exact",
                result.events,
                result.secs,
                number(result.events_per_sec)
            );
            rates.push(result.events_per_sec);
            drop(p);
            // A fresh pipeline, so the state (and each checkpoint's size) is
            // what the half-rate run builds, not what the full-rate run left.
            let p = e2e::start(catalog.clone(), durable, Backends::default()).await?;
            let half = result.events_per_sec / 2.0;
            let fresh = e2e::freshness(
                &p,
                half,
                Duration::from_secs(30),
                args.batch,
                200 + run as u64,
            )
            .await?;
            println!(
                "bench:   freshness at {} events/s ({} achieved): p50 {:.0} ms, p99 {:.0} ms over {} pushes",
                number(half),
                number(fresh.events_per_sec),
                fresh.p50_ms,
                fresh.p99_ms,
                fresh.pushes
            );
            p50.push(fresh.p50_ms);
            p99.push(fresh.p99_ms);
        }
        let note = format!(
            "{} s sustained, NDJSON {} events/message, 5% duplicates, {setting}",
            args.e2e_secs, args.batch
        );
        let (rate_target, p99_target) = if durable {
            (
                Some(Target {
                    text: ">= 500,000",
                    bound: 500_000.0,
                    higher: true,
                }),
                Some(Target {
                    text: "<= 250",
                    bound: 250.0,
                    higher: false,
                }),
            )
        } else {
            (None, None)
        };
        table.add(
            format!("end to end ({setting})"),
            "impressions/s",
            rates,
            rate_target,
            note,
        );
        table.add(
            format!("freshness p50 at half rate ({setting})"),
            "ms",
            p50,
            None,
            "published → in the pacer",
        );
        table.add(
            format!("freshness p99 at half rate ({setting})"),
            "ms",
            p99,
            p99_target,
            "published → in the pacer",
        );
    }
    Ok(())
}

async fn side_by_side(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let workload = Workload::generate(&WorkloadSpec {
        ads: args.ads,
        events: args.peer_events,
        batch: args.batch,
        duplicate_rate: 0.05,
        seed: 42,
    })?;
    println!(
        "bench:   workload: {} events ({} unique, {} tuples), {} messages, {} MB",
        workload.events,
        workload.unique_events,
        workload.unique_tuples,
        workload.messages.len(),
        number(workload.bytes() as f64 / 1e6)
    );
    for durable in [true, false] {
        let setting = if durable { "durable" } else { "not durable" };
        let mut ours = Samples::default();
        let mut redis = Samples::default();
        let mut jetstream = Samples::default();
        // Per-message fsync makes the JetStream peer slow; a prefix keeps its
        // runs to tens of seconds.
        let js_events = if durable { 50_000 } else { 300_000 }.min(workload.events);
        for run in 0..args.runs {
            let p = e2e::start(workload.catalog.clone(), durable, Backends::default()).await?;
            let result = e2e::workload(&p, &workload).await?;
            drop(p);
            anyhow::ensure!(
                result.exact,
                "adspend run {run} ({setting}) did not match the truth"
            );
            println!(
                "bench:   adspend ({setting}): {} events/s",
                number(result.events_per_sec)
            );
            ours.push(result.events_per_sec);
            let peer = peers::redis_lua(&workload, durable).await?;
            anyhow::ensure!(
                peer.exact,
                "Redis-Lua peer run {run} ({setting}) did not match the truth: {}",
                peer.detail
            );
            println!(
                "bench:   redis-lua ({setting}): {} events/s",
                number(peer.events_per_sec)
            );
            redis.push(peer.events_per_sec);
            let peer = peers::jetstream_dedupe(&workload, js_events, durable).await?;
            anyhow::ensure!(
                peer.exact,
                "JetStream-dedupe peer run {run} ({setting}) did not match: {}",
                peer.detail
            );
            println!(
                "bench:   jetstream-dedupe ({setting}): {} events/s",
                number(peer.events_per_sec)
            );
            jetstream.push(peer.events_per_sec);
        }
        let ratio =
            |peer: &Samples| samples(ours.values.iter().zip(&peer.values).map(|(a, b)| a / b));
        let what = format!(
            "{} events, {} per message, 5% duplicates",
            number(workload.events as f64),
            args.batch
        );
        table.add(
            format!("same workload: adspend ({setting})"),
            "impressions/s",
            ours.clone(),
            None,
            what.clone(),
        );
        table.add(
            format!("same workload: Redis-Lua peer ({setting})"),
            "impressions/s",
            redis.clone(),
            None,
            what.clone(),
        );
        table.add(
            format!("same workload: JetStream-dedupe peer ({setting})"),
            "impressions/s",
            jetstream.clone(),
            None,
            format!("first {} events, one per message", number(js_events as f64)),
        );
        let (redis_target, js_target) = if durable {
            (
                Some(Target {
                    text: ">= 5",
                    bound: 5.0,
                    higher: true,
                }),
                Some(Target {
                    text: ">= 2",
                    bound: 2.0,
                    higher: true,
                }),
            )
        } else {
            (None, None)
        };
        table.add(
            format!("ratio adspend / Redis-Lua ({setting})"),
            "x",
            ratio(&redis),
            redis_target,
            "per run",
        );
        table.add(
            format!("ratio adspend / JetStream-dedupe ({setting})"),
            "x",
            ratio(&jetstream),
            js_target,
            "per run",
        );
    }
    Ok(())
}

async fn recover(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let result = recovery::run(args.ads, args.recovery_events, args.batch, args.runs).await?;
    let note = format!(
        "SIGKILL → pacer exact; {} ads; {} MB snapshot, {} dedupe ids, etcd + S3 (moto)",
        args.ads.min(recovery::MAX_ADS),
        number(result.snapshot_bytes as f64 / 1e6),
        number(result.dedupe_ids as f64)
    );
    table.add(
        "recovery, warm (local LMDB)",
        "s",
        samples(result.warm_secs),
        Some(Target {
            text: "<= 2",
            bound: 2.0,
            higher: false,
        }),
        note.clone(),
    );
    table.add(
        "recovery, cold (download from S3)",
        "s",
        samples(result.cold_secs),
        Some(Target {
            text: "<= 10",
            bound: 10.0,
            higher: false,
        }),
        note,
    );
    Ok(())
}
