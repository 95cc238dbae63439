use std::net::SocketAddr;
use std::time::Duration;

use adspend_common::catalog_source::CatalogSource;
use adspend_common::config::{
    parse_addr, CatalogArgs, EtcdArgs, NatsArgs, PartitionArgs, RetentionArgs, StreamArgs,
};
use adspend_common::env;
use adspend_common::Error;
use clap::Parser;

/// Reads impressions from NATS JetStream, maps each ad to its budget limits
/// and emits spend tuples with checkpoint markers into the SPEND stream.
#[derive(Parser, Clone, Debug)]
#[command(name = "limiter", version)]
pub struct Config {
    #[command(flatten)]
    pub(crate) nats: NatsArgs,
    #[command(flatten)]
    pub(crate) streams: StreamArgs,
    #[command(flatten)]
    pub(crate) retention: RetentionArgs,
    #[command(flatten)]
    pub(crate) etcd: EtcdArgs,
    #[command(flatten)]
    pub(crate) catalog: CatalogArgs,
    #[command(flatten)]
    pub(crate) partitions: PartitionArgs,
    /// Interval between checkpoint markers, in milliseconds.
    #[arg(long, env = env::CHECKPOINT_INTERVAL_MS, default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(10..=3_600_000))]
    pub(crate) checkpoint_interval_ms: u64,
    /// Prometheus /metrics listen address.
    #[arg(long, env = env::METRICS_ADDR, default_value = "127.0.0.1:9101")]
    pub(crate) metrics_addr: String,
    /// Durable consumer name on IMPRESSIONS (one per limiter deployment).
    #[arg(long, env = env::LIMITER_CONSUMER, default_value = "limiter")]
    pub(crate) consumer: String,
    /// Most input messages handled (and acknowledged) together.
    #[arg(long, env = env::LIMITER_MAX_BATCH, default_value_t = 1000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) max_batch: u32,
    /// Most spend tuples in one SPEND message.
    #[arg(long, env = env::LIMITER_TUPLES_PER_MESSAGE, default_value_t = 20_000,
          value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub(crate) tuples_per_message: u32,
    /// Most one impression may cost, in micros; a costlier one is dead
    /// lettered with reason cost_too_large (a sum of u64 micros must never
    /// overflow on hostile input).
    #[arg(long, env = env::MAX_COST_MICROS,
          default_value_t = crate::emit::DEFAULT_MAX_COST_MICROS,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) max_cost_micros: u64,
    /// How input is pulled from IMPRESSIONS: `fair` (one consumer per
    /// source, a flooding source cannot make the others' spend stale) or
    /// `fifo` (one consumer, stream order).
    #[arg(long, env = env::LIMITER_SCHEDULING, value_enum, default_value_t = Scheduling::Fair)]
    pub(crate) scheduling: Scheduling,
    /// Which token of the impression subject names its source (0 is
    /// `impressions`): 1 reads the source of `impressions.<source>`.
    #[arg(long, env = env::LIMITER_SOURCE_TOKEN, default_value_t = 1,
          value_parser = clap::value_parser!(u32).range(1..=16))]
    pub(crate) source_token: u32,
    /// Fair scheduling steps in when a source's oldest event has waited this
    /// long (milliseconds) while another source uses more than its share.
    #[arg(long, env = env::LIMITER_FAIR_LAG_MS, default_value_t = 100,
          value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub(crate) fair_lag_ms: u64,
    /// Fair scheduling holds back sources with a backlog (more waiting than
    /// their share of a round) while more than this many of the tuples this
    /// limiter published are not yet applied by the aggregators (as they
    /// report it), so the others' tuples do not queue behind the backlog's
    /// in SPEND; 0 turns it off. About 0.15 s of an aggregator's apply rate.
    #[arg(long, env = env::LIMITER_DOWNSTREAM_MAX_TUPLES, default_value_t = 200_000)]
    pub(crate) downstream_max_tuples: u64,
    /// The window follows the other sources' delay: it halves while their
    /// spend takes longer than this (milliseconds) from `IMPRESSIONS` to
    /// applied, or the oldest unapplied tuple has waited longer, and grows
    /// back up to the bound while both are under half of it; 0 keeps the
    /// window at the bound.
    #[arg(long, env = env::LIMITER_DOWNSTREAM_TARGET_MS, default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(0..=60_000))]
    pub(crate) downstream_target_ms: u64,
    /// Chunks mapped at once (decoded, validated, mapped through the
    /// catalog and encoded), each on a thread of the blocking pool, while
    /// the mapped ones are published in order; 1: each chunk is mapped and
    /// published in the loop that reads it; 0: one per four cores, at
    /// least one.
    #[arg(long, env = env::LIMITER_WORKERS, default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=1024))]
    pub(crate) workers: u32,
}

impl Config {
    /// [`Config::workers`], with 0 read for the machine's cores.
    pub(crate) fn workers(&self) -> usize {
        match self.workers {
            0 => auto_workers(std::thread::available_parallelism().map_or(1, usize::from)),
            n => n as usize,
        }
    }
}

/// Mapping threads for `cores` when the setting leaves it to the machine:
/// one per four cores, at least one. The limiter's CPU path is about a
/// sixth of the pipeline's CPU (NATS, the aggregators and the pacer share
/// the machine), and on two cores mapping chunks on threads of their own
/// costs more in hand-offs and smaller output messages than it gives
/// (docs/BENCHMARKS.md).
fn auto_workers(cores: usize) -> usize {
    (cores / 4).max(1)
}

#[cfg(test)]
mod tests {
    #[test]
    fn one_mapping_thread_per_four_cores_at_least_one() {
        let auto: Vec<usize> = [1, 2, 4, 7, 8, 16, 64].map(super::auto_workers).into();
        assert_eq!(auto, vec![1, 1, 1, 1, 2, 4, 16]);
    }
}

/// See [`Config::scheduling`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Scheduling {
    Fair,
    Fifo,
}

impl Config {
    pub(crate) fn checkpoint_interval(&self) -> Duration {
        Duration::from_millis(self.checkpoint_interval_ms)
    }

    /// Everything that can be checked before connecting to anything, once.
    pub fn validate(self) -> Result<Validated, Error> {
        self.etcd.validate()?;
        let catalog = self.catalog.source(&self.etcd)?;
        let metrics_addr = parse_addr(env::METRICS_ADDR, &self.metrics_addr)?;
        Ok(Validated {
            config: self,
            catalog,
            metrics_addr,
        })
    }
}

/// The settings once validated: what [`Config`] holds, with every value
/// that needs parsing parsed.
#[derive(Clone, Debug)]
pub struct Validated {
    pub(crate) config: Config,
    pub(crate) catalog: CatalogSource,
    pub(crate) metrics_addr: SocketAddr,
}
