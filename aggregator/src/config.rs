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
    /// Whether shards trim their `SPEND` partitions (`ADSPEND_SPEND_TRIM`).
    pub(crate) spend_trim: bool,
    /// Shards the operator allowed to be rebuilt at a loss ([`crate::checkpoint::missing`]).
    pub(crate) accept_loss: AcceptLoss,
}

/// The shards an operator allowed to be rebuilt at a loss
/// ([`Config::accept_loss`]): each one only at the checkpoint named.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct AcceptLoss(Vec<(String, u64)>);

impl AcceptLoss {
    /// `<shard>@<checkpoint id>`, comma-separated; empty: none.
    pub(crate) fn parse(value: &str) -> Result<Self, String> {
        let mut accepted = Vec::new();
        for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (shard, id) = item
                .split_once('@')
                .ok_or_else(|| format!("{item:?}: expected <shard>@<checkpoint id>, e.g. p3@17"))?;
            let valid_shard = !shard.is_empty()
                && shard.len() <= 64
                && shard
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !valid_shard {
                return Err(format!(
                    "{item:?}: the shard is \"all\", \"p<partition>\" or a fixed list's \"p1-3\""
                ));
            }
            let id: u64 = id
                .parse()
                .map_err(|e| format!("{item:?}: the checkpoint id: {e}"))?;
            accepted.push((shard.to_string(), id));
        }
        Ok(AcceptLoss(accepted))
    }

    /// Whether the loss of `shard`'s checkpoint `checkpoint_id` is accepted.
    pub(crate) fn covers(&self, shard: &str, checkpoint_id: u64) -> bool {
        self.0
            .iter()
            .any(|(s, id)| s == shard && *id == checkpoint_id)
    }
}

/// Which partitions this aggregator applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Ownership {
    /// All partitions, as one shard.
    All,
    /// A fixed list, as one shard.
    Fixed(Vec<u32>),
    /// Assigned through etcd among the live aggregators, this one joining
    /// as `member_id`; each partition is a shard of its own.
    Cluster { member_id: String },
}

impl Ownership {
    /// The shard name of a single-shard aggregator: the unit of ownership,
    /// checkpoints and pushes.
    pub(crate) fn shard(&self) -> String {
        match self {
            Ownership::Fixed(list) => format!(
                "p{}",
                list.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join("-")
            ),
            Ownership::All | Ownership::Cluster { .. } => "all".to_string(),
        }
    }
}

/// Where snapshots go: `ADSPEND_OBJECT_STORE_URL` parsed. A setting only;
/// the store is opened when the aggregator starts
/// ([`SnapshotStore::open`](crate::snapshot_store::SnapshotStore::open)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum SnapshotUrl {
    /// `file:///dir`.
    File { url: String, dir: PathBuf },
    /// `s3://bucket/prefix` (credentials and endpoint from `AWS_*`).
    S3 {
        url: String,
        bucket: String,
        prefix: String,
    },
}

impl SnapshotUrl {
    pub(crate) fn parse(url: &str) -> Result<Self, Error> {
        if let Some(path) = url.strip_prefix("file://") {
            if path.is_empty() {
                return Err(Self::bad(url, "no directory after file://"));
            }
            return Ok(SnapshotUrl::File {
                url: url.to_string(),
                dir: PathBuf::from(path),
            });
        }
        if let Some(rest) = url.strip_prefix("s3://") {
            let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
            if bucket.is_empty() {
                return Err(Self::bad(url, "no bucket after s3://"));
            }
            return Ok(SnapshotUrl::S3 {
                url: url.to_string(),
                bucket: bucket.to_string(),
                prefix: prefix.trim_matches('/').to_string(),
            });
        }
        Err(Self::bad(
            url,
            "expected file:///<dir> or s3://<bucket>/<prefix>",
        ))
    }

    pub(crate) fn as_str(&self) -> &str {
        match self {
            SnapshotUrl::File { url, .. } | SnapshotUrl::S3 { url, .. } => url,
        }
    }

    /// The setting's error for `url`, naming it.
    pub(crate) fn bad(url: &str, reason: impl Into<String>) -> Error {
        Error::Config {
            name: env::OBJECT_STORE_URL,
            value: url.to_string(),
            reason: reason.into(),
        }
    }
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
}

/// `ADSPEND_AGGREGATOR_WRITERS`: a count, or chosen at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writers {
    /// What the data directory or the records hold, else one per core.
    Auto,
    /// Exactly this many (1..=1024); a data directory written otherwise is
    /// refused.
    Count(u32),
}

fn parse_writers(value: &str) -> Result<Writers, String> {
    let value = value.trim();
    if value == "auto" {
        return Ok(Writers::Auto);
    }
    match value.parse::<u32>() {
        Ok(n @ 1..=1024) => Ok(Writers::Count(n)),
        _ => Err(format!(
            "{value:?} is not \"auto\" or a number of writers from 1 to 1024"
        )),
    }
}

impl std::fmt::Display for Writers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Writers::Auto => f.write_str("auto"),
            Writers::Count(n) => write!(f, "{n}"),
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn validate(args: &[&str]) -> Result<Validated, Error> {
        let dir = tempfile::tempdir().unwrap();
        let store = format!("--object-store-url=file://{}", dir.path().display());
        let mut all = vec!["aggregator", store.as_str()];
        all.extend_from_slice(args);
        Config::try_parse_from(all).unwrap().validate()
    }

    #[test]
    fn ownership_is_parsed_once_into_the_validated_settings() {
        let fixed = validate(&["--owned-partitions=3, 1,3"]).unwrap();
        assert_eq!(fixed.ownership, Ownership::Fixed(vec![1, 3]));
        assert_eq!(fixed.ownership.shard(), "p1-3");
        assert_eq!(validate(&[]).unwrap().ownership.shard(), "all");
        let cluster = validate(&[
            "--owned-partitions=auto",
            "--etcd-endpoints=127.0.0.1:2379",
            "--aggregator-id=agg-1",
        ])
        .unwrap();
        assert_eq!(
            cluster.ownership,
            Ownership::Cluster {
                member_id: "agg-1".into()
            }
        );
    }

    #[test]
    fn accepted_losses_name_a_shard_and_its_checkpoint() {
        let accepted = validate(&["--accept-loss=p3@17, all@2"]).unwrap();
        let accepted = accepted.config.shard_settings().accept_loss;
        assert!(accepted.covers("p3", 17) && accepted.covers("all", 2));
        assert!(!accepted.covers("p3", 18) && !accepted.covers("p4", 17));
        assert_eq!(
            validate(&[]).unwrap().config.shard_settings().accept_loss,
            AcceptLoss::default()
        );
        for bad in ["p3", "p3@", "@17", "P3@17", "p3@x", "all@-1"] {
            let error = validate(&[&format!("--accept-loss={bad}")]).unwrap_err();
            assert_eq!(
                error.exit_code(),
                adspend_common::error::EXIT_BAD_SETTING,
                "{bad}: {error}"
            );
            assert!(error.to_string().contains(ACCEPT_LOSS), "{error}");
        }
    }

    #[test]
    fn writers_are_auto_or_a_count() {
        assert_eq!(parse_writers("auto"), Ok(Writers::Auto));
        assert_eq!(parse_writers(" 2 "), Ok(Writers::Count(2)));
        assert_eq!(parse_writers("1024"), Ok(Writers::Count(1024)));
        for bad in ["0", "1025", "-1", "two", ""] {
            let e = parse_writers(bad).unwrap_err();
            assert!(e.contains("auto") && e.contains("1 to 1024"), "{bad}: {e}");
        }
        assert_eq!(Writers::Auto.to_string(), "auto");
        assert_eq!(Writers::Count(3).to_string(), "3");
    }

    #[test]
    fn bad_ownership_settings_are_config_errors() {
        for args in [
            &["--owned-partitions=16"][..],
            &["--owned-partitions=x"],
            &["--owned-partitions=auto"],
            &[
                "--owned-partitions=auto",
                "--etcd-endpoints=127.0.0.1:2379",
                "--aggregator-id=a/b",
            ],
        ] {
            let error = validate(args).unwrap_err();
            assert_eq!(
                error.exit_code(),
                adspend_common::error::EXIT_BAD_SETTING,
                "{args:?}: {error}"
            );
        }
    }
}
