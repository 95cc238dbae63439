use adspend_aggregator::{run, Config};
use adspend_common::{shutdown, telemetry};
use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let config = Config::parse();
    telemetry::init_tracing();
    if let Err(e) = start(config).await {
        eprintln!("aggregator: error: {e:#}");
        return std::process::ExitCode::FAILURE;
    }
    std::process::ExitCode::SUCCESS
}

async fn start(config: Config) -> anyhow::Result<()> {
    let metrics_addr = config.validate()?;
    telemetry::install_metrics(metrics_addr)?;
    let shutdown = shutdown::on_signals()?;
    run(config, shutdown).await?;
    Ok(())
}
