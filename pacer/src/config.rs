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
