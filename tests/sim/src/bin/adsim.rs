//! `adsim`, the ad-server simulator: `adsim catalog` writes a generated
//! catalog, `adsim run` publishes impressions to JetStream and writes the
//! ground truth of everything JetStream acknowledged; `adsim serve` is the
//! closed loop: ad servers that ask the pacer before they serve.

use std::process::ExitCode;

use adspend_sim::{self as sim, cli, Catalog};
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
    /// Ad servers that ask the pacer (POST /v1/decisions, or spend leases
    /// with --mode leases) and serve only what it allows, over a compressed
    /// day; write the truth.
    Serve(Box<cli::ServeArgs>),
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
        Cli::Serve(args) => serve(*args).await,
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
    let mut config = args.sim_config();
    // An ad server's NATS user may publish impressions and nothing else: the
    // stream is the limiter's to create.
    config.create_stream = args.nats_auth.user.is_none();
    config.validate()?;
    let catalog = Catalog::load(&args.catalog)?;
    let client = args.nats_auth.connect(&args.nats_url).await?;
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

async fn serve(args: cli::ServeArgs) -> anyhow::Result<()> {
    let config = args.loop_config();
    config.validate()?;
    let catalog = Catalog::load(&args.catalog)?;
    let client = args.nats_auth.connect(&args.nats_url).await?;
    let cancel = CancellationToken::new();
    let on_signal = cancel.clone();
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    tokio::spawn(async move {
        tokio::select! { _ = tokio::signal::ctrl_c() => {}, _ = terminate.recv() => {} }
        on_signal.cancel();
    });
    eprintln!(
        "adsim: {} ad servers asking {} by {} over a {:?} day, peak {} requests/s",
        config.servers,
        config.pacer_url,
        config.mode.name(),
        config.day,
        config.peak_rate
    );
    let outcome = sim::run_closed_loop(&client, &config, &catalog, cancel, |p| {
        eprintln!("adsim: {}", cli::loop_line(p));
    })
    .await?;
    outcome.truth.save(&args.truth_out)?;
    let p = &outcome.progress;
    eprintln!(
        "adsim: done: {}; truth in {}",
        cli::loop_summary(p),
        args.truth_out.display()
    );
    if outcome.truth.stats.messages_failed > 0 {
        eprintln!(
            "adsim: warning: {} messages were not acknowledged; their impressions are left out \
             of the truth but may be in the stream",
            outcome.truth.stats.messages_failed
        );
    }
    Ok(())
}
