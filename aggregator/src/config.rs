use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use adspend_common::config::{
    data_dir_or_default, parse_addr, EtcdArgs, NatsArgs, PartitionArgs, SpendTrimArgs, StreamArgs,
};
use adspend_common::env;
use adspend_common::Error;
use clap::Parser;

/// Environment variable of [`Config::accept_loss`]. Its own here (not in
/// `adspend_common::env`, which is maintained elsewhere); docs/CONFIGURATION.md
/// has its row.
pub(crate) const ACCEPT_LOSS: &str = "ADSPEND_AGGREGATOR_ACCEPT_LOSS";

/// Environment variable of [`Config::closed_period_days`] (the aggregator's
/// alone, like [`ACCEPT_LOSS`]).
pub(crate) const CLOSED_PERIOD_DAYS: &str = "ADSPEND_CLOSED_PERIOD_DAYS";

/// The dedupe window, bounded by stream time and by id count.
#[derive(Clone, Copy, Debug)]
pub struct DedupeLimits {
    pub window_ms: u64,
    pub max_ids: u64,
}

/// Settings every shard of a process shares.
#[derive(Clone, Debug)]
pub(crate) struct ShardSettings {
    pub(crate) dedupe: DedupeLimits,
    pub(crate) push_interval: Duration,
    pub(crate) snapshots_kept: usize,
    /// Deltas on one base before a checkpoint copies a new base.
    pub(crate) max_deltas: usize,
    pub(crate) lmdb_map_size: usize,
    pub(crate) stream_replicas: usize,
    /// Days after its end that a period's sums are kept ([`crate::apply::closed`]).
    pub(crate) closed_period_days: u64,
    /// Whether shards trim their `SPEND` partitions (`ADSPEND_SPEND_TRIM`).
    pub(crate) spend_trim: bool,
    /// Shards the operator allowed to be rebuilt at a loss ([`crate::checkpoint::missing`]).
    pub(crate) accept_loss: AcceptLoss,
}

/// The settings once validated: what [`Config`] holds, with every value
/// that needs parsing parsed, once.
#[derive(Clone, Debug)]
pub struct Validated {
    pub(crate) config: Config,
    pub(crate) ownership: Ownership,
    pub(crate) snapshots: SnapshotUrl,
    pub(crate) metrics_addr: SocketAddr,
}

/// Sums spend per limit in LMDB, snapshots it to object storage on each
/// checkpoint marker, and pushes fresh sums to the pacer.
#[derive(Parser, Clone, Debug)]
#[command(name = "aggregator", version)]
pub struct Config {
    #[command(flatten)]
    pub(crate) nats: NatsArgs,
    #[command(flatten)]
    pub(crate) streams: StreamArgs,
    #[command(flatten)]
    pub(crate) spend: SpendTrimArgs,
    #[command(flatten)]
    pub(crate) etcd: EtcdArgs,
    #[command(flatten)]
    pub(crate) partitions: PartitionArgs,
    /// Snapshot store: file:///dir or s3://bucket/prefix (AWS_* env for S3).
    /// Default: file://<data dir>/snapshots.
    #[arg(long, env = env::OBJECT_STORE_URL)]
    pub(crate) object_store_url: Option<String>,
    /// Local state directory (LMDB). Default: ./data/aggregator.
    #[arg(long, env = env::DATA_DIR)]
    pub(crate) data_dir: Option<PathBuf>,
    /// Prometheus /metrics listen address.
    #[arg(long, env = env::METRICS_ADDR, default_value = "127.0.0.1:9102")]
    pub(crate) metrics_addr: String,
    /// Partitions this aggregator owns: "all", a comma-separated list, or
    /// "auto" (cluster mode: partitions spread over the live aggregators
    /// through etcd; needs ADSPEND_ETCD_ENDPOINTS).
    #[arg(long, env = env::AGGREGATOR_PARTITIONS, default_value = "all")]
    pub(crate) owned_partitions: String,
    /// Writers of a single-machine aggregator: its partitions are split
    /// round robin into this many shards, each with its own LMDB
    /// environment, writer thread, checkpoint record and snapshots, under
    /// `<data dir>/p<list>/`. 1 keeps one shard in the data dir itself.
    /// "auto": the shards the data directory (or etcd's checkpoint
    /// records) already holds, else one per core, at most one per
    /// partition. Cluster mode already gives every partition a writer of
    /// its own.
    #[arg(long, env = env::AGGREGATOR_WRITERS, default_value = "auto",
          value_parser = parse_writers)]
    pub(crate) writers: Writers,
    /// Cluster mode: this aggregator's member id (letters, digits, '.', '_',
    /// '-'; at most 64). Default: the host name.
    #[arg(long, env = env::AGGREGATOR_ID)]
    pub(crate) aggregator_id: Option<String>,
    /// Cluster mode: TTL of the membership lease, milliseconds. A member
    /// silent for this long loses its partitions to the others; it stops
    /// applying once keepalives have gone unanswered for half of it.
    #[arg(long, env = env::LEASE_TTL_MS, default_value_t = 5_000,
          value_parser = clap::value_parser!(u64).range(2_000..=600_000))]
    pub(crate) lease_ttl_ms: u64,
    /// Dedupe window in stream time, milliseconds.
    #[arg(long, env = env::DEDUPE_WINDOW_MS, default_value_t = 3_600_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) dedupe_window_ms: u64,
    /// Most message ids kept for deduplication.
    #[arg(long, env = env::DEDUPE_MAX_IDS, default_value_t = 50_000_000,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) dedupe_max_ids: u64,
    /// Interval between pushes of changed sums to the pacer, milliseconds.
    #[arg(long, env = env::PUSH_INTERVAL_MS, default_value_t = 20,
          value_parser = clap::value_parser!(u64).range(1..=60_000))]
    pub(crate) push_interval_ms: u64,
    /// Older snapshots kept besides the newest.
    #[arg(long, env = env::SNAPSHOTS_KEPT, default_value_t = 2)]
    pub(crate) snapshots_kept: usize,
    /// Incremental checkpoints on one base snapshot before the next
    /// checkpoint copies a new base (0: every checkpoint is a full copy).
    #[arg(long, env = env::CHECKPOINT_MAX_DELTAS, default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(0..=1000))]
    pub(crate) checkpoint_max_deltas: u64,
    /// LMDB map size in GiB (address space; the file grows as needed).
    #[arg(long, env = env::LMDB_MAP_GIB, default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub(crate) lmdb_map_gib: u64,
    /// Shards whose recorded snapshot is gone while SPEND no longer holds
    /// their whole history, to rebuild anyway, accepting the loss:
    /// `<shard>@<checkpoint id>`, comma-separated, as the aggregator's
    /// ERROR line names them (e.g. p3@17). Such a shard starts again empty
    /// at SPEND's first sequence: the spend before it is not counted. Only
    /// the checkpoint named: a later loss needs a new decision. See
    /// docs/RECOVERY.md.
    #[arg(long, env = ACCEPT_LOSS)]
    pub(crate) accept_loss: Option<String>,
    /// Days after a period's end that its sums are kept. Past that, the
    /// period's sums leave the store, snapshots and pushes; spend that
    /// arrives later for it still counts toward the limit's lifetime sum,
    /// and is counted in adspend_aggregator_closed_period_tuples_total.
    /// Decided by the stream's clock (publish times of SPEND), so every
    /// replica and every replay decides alike: set it the same on every
    /// aggregator.
    #[arg(long, env = CLOSED_PERIOD_DAYS, default_value_t = 35,
          value_parser = clap::value_parser!(u64).range(1..=36_500))]
    pub(crate) closed_period_days: u64,
}

impl Config {
    /// Everything that can be checked before touching the network.
    pub fn validate(self) -> Result<Validated, Error> {
        self.etcd.validate()?;
        let ownership = self.ownership()?;
        if let Ownership::Cluster { .. } = ownership {
            if self.etcd.endpoints().is_empty() {
                return Err(Error::Config {
                    name: env::AGGREGATOR_PARTITIONS,
                    value: self.owned_partitions.clone(),
                    reason: "\"auto\" assigns partitions through etcd: set ADSPEND_ETCD_ENDPOINTS"
                        .into(),
                });
            }
        }
        self.parse_accept_loss()?;
        let snapshots = SnapshotUrl::parse(&self.object_store_url())?;
        let metrics_addr = parse_addr(env::METRICS_ADDR, &self.metrics_addr)?;
        Ok(Validated {
            config: self,
            ownership,
            snapshots,
            metrics_addr,
        })
    }

    fn ownership(&self) -> Result<Ownership, Error> {
        Ok(match self.owned_partitions.trim() {
            "auto" => Ownership::Cluster {
                member_id: self.member_id()?,
            },
            _ => match self.owned()? {
                None => Ownership::All,
                Some(list) => Ownership::Fixed(list),
            },
        })
    }

    /// The member id in cluster mode: the setting, else the host name.
    fn member_id(&self) -> Result<String, Error> {
        let id = match &self.aggregator_id {
            Some(id) => id.trim().to_string(),
            None => std::fs::read_to_string("/proc/sys/kernel/hostname")
                .map(|h| h.trim().to_string())
                .unwrap_or_default(),
        };
        let valid = !id.is_empty()
            && id.len() <= 64
            && id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !valid {
            return Err(Error::Config {
                name: env::AGGREGATOR_ID,
                value: id,
                reason: "1 to 64 letters, digits, '.', '_' or '-'".into(),
            });
        }
        Ok(id)
    }

    fn parse_accept_loss(&self) -> Result<AcceptLoss, Error> {
        let value = self.accept_loss.as_deref().unwrap_or_default();
        AcceptLoss::parse(value).map_err(|reason| Error::Config {
            name: ACCEPT_LOSS,
            value: value.to_string(),
            reason,
        })
    }

    pub(crate) fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.lease_ttl_ms)
    }

    pub(crate) fn shard_settings(&self) -> ShardSettings {
        ShardSettings {
            dedupe: self.dedupe(),
            push_interval: self.push_interval(),
            snapshots_kept: self.snapshots_kept,
            max_deltas: self.checkpoint_max_deltas as usize,
            lmdb_map_size: usize::try_from(self.lmdb_map_gib << 30).unwrap_or(usize::MAX),
            stream_replicas: self.streams.replicas(),
            closed_period_days: self.closed_period_days,
            spend_trim: self.spend.spend_trim == adspend_common::config::SpendTrim::Checkpoint,
            // Checked by `validate`.
            accept_loss: self.parse_accept_loss().unwrap_or_default(),
        }
    }

    pub(crate) fn data_dir(&self) -> PathBuf {
        data_dir_or_default(&self.data_dir, "aggregator")
    }

    pub(crate) fn object_store_url(&self) -> String {
        self.object_store_url
            .clone()
            .unwrap_or_else(|| format!("file://{}", self.data_dir().join("snapshots").display()))
    }

    /// Owned partitions of a fixed list, or `None` for all (and for auto).
    fn owned(&self) -> Result<Option<Vec<u32>>, Error> {
        let value = self.owned_partitions.trim();
        if value == "all" || value == "auto" {
            return Ok(None);
        }
        let bad = |reason: String| Error::Config {
            name: env::AGGREGATOR_PARTITIONS,
            value: value.to_string(),
            reason,
        };
        let mut owned = Vec::new();
        for part in value.split(',') {
            let p: u32 = part
                .trim()
                .parse()
                .map_err(|e| bad(format!("{part:?}: {e}")))?;
            if p >= self.partitions.partitions {
                return Err(bad(format!(
                    "partition {p} is not below ADSPEND_PARTITIONS={}",
                    self.partitions.partitions
                )));
            }
            owned.push(p);
        }
        owned.sort_unstable();
        owned.dedup();
        Ok(Some(owned))
    }

    pub(crate) fn dedupe(&self) -> DedupeLimits {
        DedupeLimits {
            window_ms: self.dedupe_window_ms,
            max_ids: self.dedupe_max_ids,
        }
    }

    pub(crate) fn push_interval(&self) -> Duration {
        Duration::from_millis(self.push_interval_ms)
    }
}

mod accept_loss;
mod ownership;
mod snapshot_url;
mod writers;

pub(crate) use accept_loss::AcceptLoss;
pub(crate) use ownership::Ownership;
pub(crate) use snapshot_url::SnapshotUrl;
use writers::parse_writers;
pub(crate) use writers::Writers;

#[cfg(test)]
mod tests;
