use std::net::SocketAddr;

use adspend_common::config::{parse_addr, CatalogArgs, EtcdArgs, NatsArgs};
use adspend_common::Error;
use clap::Parser;

/// Holds budget state from the aggregators' pushes and answers ad servers:
/// may I bid on this ad, how hard, what is left.
#[derive(Parser, Clone, Debug)]
#[command(name = "pacer", version)]
pub struct Config {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub etcd: EtcdArgs,
    #[command(flatten)]
    pub catalog: CatalogArgs,
    /// HTTP listen address of the API and dashboard.
    #[arg(long, env = "ADSPEND_PACER_ADDR", default_value = "127.0.0.1:8080")]
    pub pacer_addr: String,
    /// Prometheus /metrics listen address (also served on the API port).
    #[arg(long, env = "ADSPEND_METRICS_ADDR", default_value = "127.0.0.1:9103")]
    pub metrics_addr: String,
    /// Milliseconds after which a shard whose owner has pushed nothing (not
    /// even its heartbeat, sent at least every second while idle) is stale:
    /// its limits say `"stale": true` and the ads under them are not
    /// servable until it pushes again. Keep it above the aggregators' push
    /// interval (ADSPEND_PUSH_INTERVAL_MS).
    #[arg(long, env = "ADSPEND_PACER_STALE_AFTER_MS", default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(2_000..=86_400_000))]
    pub stale_after_ms: u64,
}

impl Config {
    /// (API address, metrics address), or the first bad setting.
    pub fn validate(&self) -> Result<(SocketAddr, SocketAddr), Error> {
        self.etcd.validate()?;
        self.catalog.source(&self.etcd)?;
        Ok((
            parse_addr("ADSPEND_PACER_ADDR", &self.pacer_addr)?,
            parse_addr("ADSPEND_METRICS_ADDR", &self.metrics_addr)?,
        ))
    }
}
