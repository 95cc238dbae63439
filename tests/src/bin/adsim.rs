//! `adsim`, the ad-server simulator: `adsim catalog` writes a generated
//! catalog, `adsim run` publishes impressions to JetStream and writes the
//! ground truth of everything JetStream acknowledged.

use std::process::ExitCode;

use adspend_tests::sim::{self, cli, Catalog};
use anyhow::Context as _;
use clap::error::ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand;
use clap::Parser;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

#[derive(Parser)]
#[command(name = "adsim", about = "Ad-server simulator for adspend")]
enum Cli {
    /// Write a catalog generated from a seed.
    Catalog(cli::CatalogArgs),
    /// Publish impressions and write the truth.
    Run(Box<cli::RunArgs>),
}

/// mimalloc keeps large freed blocks for reuse; the system allocator
/// returned them to the kernel and paid for zeroed pages on every batch.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) if e.use_stderr() && e.kind() != DisplayHelpOnMissingArgumentOrSubcommand => {
            let rendered = e.render().to_string();
            eprintln!("adsim: {}", rendered.lines().next().unwrap_or_default());
            return ExitCode::from(2);
        }
        Err(e) => e.exit(),
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let result = match cli {
        Cli::Catalog(args) => catalog(args),
        Cli::Run(args) => run(*args).await,
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("adsim: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn catalog(args: cli::CatalogArgs) -> anyhow::Result<()> {
    let catalog = sim::generate_catalog(&args.spec(), args.seed)?;
    catalog.save(&args.out)?;
    let (limits, ads) = (catalog.limits.len(), catalog.ads.len());
    eprintln!(
        "adsim: wrote {} ({limits} limits, {ads} ads)",
        args.out.display()
    );
    Ok(())
}

async fn run(args: cli::RunArgs) -> anyhow::Result<()> {
    let config = args.sim_config();
    config.validate()?;
    let catalog = Catalog::load(&args.catalog)?;
    let client = async_nats::connect(&args.nats_url)
        .await
        .with_context(|| format!("connecting to NATS at {}", args.nats_url))?;
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    tokio::spawn(async move {
        tokio::select! { _ = tokio::signal::ctrl_c() => {}, _ = terminate.recv() => {} }
        on_signal.cancel();
    });
    let truth = sim::run_with_progress(&client, &config, &catalog, cancel, |p| {
        eprintln!("adsim: {}", cli::progress_line(p));
    })
    .await?;
    truth.save(&args.truth_out)?;
    let stats = &truth.stats;
    eprintln!(
        "adsim: done: {}; truth in {}",
        cli::summary_line(stats),
        args.truth_out.display()
    );
    if stats.messages_failed > 0 {
        eprintln!(
            "adsim: warning: {} messages were not acknowledged; their events are left out of \
             the truth but may be in the stream",
            stats.messages_failed
        );
    }
    Ok(())
}
