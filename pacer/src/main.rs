use adspend_common::{shutdown, telemetry};
use adspend_pacer::{run, Config};
use clap::Parser;

/// mimalloc keeps large freed blocks for reuse; the system allocator
/// returned them to the kernel and paid for zeroed pages on every batch.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = Config::parse();
    telemetry::init_tracing();
    if let Err(e) = start(config).await {
        eprintln!("pacer: error: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

async fn start(config: Config) -> anyhow::Result<()> {
    let settings = config.validate()?;
    telemetry::install_metrics(settings.metrics_addr)?;
    let shutdown = shutdown::on_signals()?;
    run(config, shutdown).await?;
    Ok(())
}
