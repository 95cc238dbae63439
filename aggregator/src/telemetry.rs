//! Metric names only the aggregator exports, besides those in
//! `adspend_common::telemetry` (whose rule they follow:
//! `adspend_aggregator_<thing>_<unit>`): the recovery from lost objects
//! (docs/RECOVERY.md) and each shard's progress and checkpoint age, which
//! operators alert on (docs/ALERTING.md). They belong with the others there,
//! where they would move when that module's owner takes them.

/// 1 while a shard cannot restore because the snapshot (base or delta) its
/// checkpoint record names is gone and no safe way out was found; 0 once it
/// restored or was rebuilt. Label `shard`.
pub const SNAPSHOT_MISSING: &str = "adspend_aggregator_snapshot_missing";
/// Restores that found the recorded snapshot gone. Label `shard`.
pub const SNAPSHOT_MISSING_TOTAL: &str = "adspend_aggregator_snapshot_missing_total";
/// Shards rebuilt from an empty state because their recorded snapshot was
/// gone. Labels `shard`, `way`: `replay` (the whole stream, exact) or
/// `accept_loss` (from the stream's first sequence, at the operator's word).
pub const REBUILDS_TOTAL: &str = "adspend_aggregator_rebuilds_total";
/// Checkpoints that failed. Labels `shard`, `reason`: `bucket_missing` (S3
/// has no such bucket), `store` (the object store failed otherwise),
/// `record` (etcd or the local record), `other` (the copy, a task).
pub const CHECKPOINT_FAILURES_TOTAL: &str = "adspend_aggregator_checkpoint_failures_total";
/// Checkpoints that found objects of the recorded chain gone from the store
/// and copied a new base instead of a delta on it. Label `shard`.
pub const CHAIN_LOST_TOTAL: &str = "adspend_aggregator_checkpoint_chain_lost_total";
/// The shard's watermark (unix seconds): its sums are complete as of this
/// time (now while it is caught up, else the publish time of the last
/// message applied). Set every push interval while the shard runs here;
/// frozen while it applies nothing, 0 once it stopped here. Label `shard`.
pub const WATERMARK_TIMESTAMP_SECONDS: &str = "adspend_aggregator_watermark_timestamp_seconds";
/// When the shard's last checkpoint was recorded (unix seconds): the
/// restored record's time, or the shard's start here when it had none,
/// until its first checkpoint here; 0 once it stopped here. Label `shard`.
pub const LAST_CHECKPOINT_TIMESTAMP_SECONDS: &str =
    "adspend_aggregator_last_checkpoint_timestamp_seconds";

/// Times the lease keepalives went unanswered for half the TTL and the
/// partitions paused (each ends in a resume or a lost lease).
pub const LEASE_PAUSES_TOTAL: &str = "adspend_aggregator_lease_pauses_total";

/// 1 while the shard waits for space in the data directory (a commit or a
/// start-up write failed with ENOSPC); 0 once it went on. Label `shard`.
pub const DISK_FULL: &str = "adspend_aggregator_disk_full";
/// Free bytes of the file system that holds the data directory, as the
/// aggregator may write them; exported every 10 s.
pub const DATA_DIR_FREE_BYTES: &str = "adspend_aggregator_data_dir_free_bytes";
/// Size in bytes of the file system that holds the data directory.
pub const DATA_DIR_SIZE_BYTES: &str = "adspend_aggregator_data_dir_size_bytes";

/// The `# HELP` text of the names above, for
/// `adspend_common::telemetry::describe`.
pub const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        DISK_FULL,
        "1 while the shard waits for space in the data directory; 0 once it went on.",
    ),
    (
        DATA_DIR_FREE_BYTES,
        "Free bytes of the file system that holds the data directory.",
    ),
    (
        DATA_DIR_SIZE_BYTES,
        "Size in bytes of the file system that holds the data directory.",
    ),
    (
        LEASE_PAUSES_TOTAL,
        "Times the lease keepalives went unanswered for half the TTL and the partitions paused.",
    ),
    (
        SNAPSHOT_MISSING,
        "1 while the shard cannot restore because its recorded snapshot is gone.",
    ),
    (
        SNAPSHOT_MISSING_TOTAL,
        "Restores that found the recorded snapshot gone.",
    ),
    (
        REBUILDS_TOTAL,
        "Shards rebuilt from an empty state because their recorded snapshot was gone, by way.",
    ),
    (
        CHECKPOINT_FAILURES_TOTAL,
        "Checkpoints that failed, by reason.",
    ),
    (
        CHAIN_LOST_TOTAL,
        "Checkpoints that found the recorded chain's objects gone and copied a new base.",
    ),
    (
        WATERMARK_TIMESTAMP_SECONDS,
        "Unix time the shard's sums are complete as of; frozen while it applies nothing, 0 once it stopped here.",
    ),
    (
        LAST_CHECKPOINT_TIMESTAMP_SECONDS,
        "Unix time of the shard's last recorded checkpoint (its start here before the first); 0 once it stopped here.",
    ),
];

/// The gauges of one shard running here, set to 0 when it stops here
/// (dropped), so that a shard that moved to another member is not taken
/// for one that stopped applying.
pub(crate) struct ShardGauges {
    pub watermark: metrics::Gauge,
    pub last_checkpoint: metrics::Gauge,
}

impl ShardGauges {
    /// The gauges of `shard`, whose last checkpoint was recorded at
    /// `checkpoint_ms` (unix ms).
    pub fn start(shard: &str, checkpoint_ms: i64) -> Self {
        let gauges = ShardGauges {
            watermark: watermark(shard),
            last_checkpoint: last_checkpoint(shard),
        };
        gauges.last_checkpoint.set(checkpoint_ms as f64 / 1000.0);
        gauges
    }
}

impl Drop for ShardGauges {
    fn drop(&mut self) {
        self.watermark.set(0.0);
        self.last_checkpoint.set(0.0);
    }
}

pub(crate) fn watermark(shard: &str) -> metrics::Gauge {
    metrics::gauge!(WATERMARK_TIMESTAMP_SECONDS, "shard" => shard.to_string())
}

pub(crate) fn last_checkpoint(shard: &str) -> metrics::Gauge {
    metrics::gauge!(LAST_CHECKPOINT_TIMESTAMP_SECONDS, "shard" => shard.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_exporter_prometheus::PrometheusBuilder;

    #[test]
    fn every_name_here_has_help() {
        let names = include_str!("telemetry.rs").split("#[cfg(test)]").next();
        let declared: Vec<&str> = names
            .unwrap()
            .split("pub const ")
            .skip(1)
            .filter_map(|item| item.split_once(": &str =")?.1.split('"').nth(1))
            .collect();
        assert!(declared.len() >= 7, "{declared:?}");
        for name in &declared {
            assert!(
                DESCRIPTIONS
                    .iter()
                    .any(|(n, help)| n == name && !help.is_empty()),
                "{name} has no description"
            );
        }
        assert_eq!(DESCRIPTIONS.len(), declared.len());
    }

    #[test]
    fn shard_gauges_are_set_at_start_and_zero_once_stopped() {
        let recorder = PrometheusBuilder::new().build_recorder();
        let handle = recorder.handle();
        let line = |text: &str, name: &str| {
            let series = format!("{name}{{shard=\"p3\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&series).map(str::to_string))
                .unwrap_or_else(|| panic!("no {series}: {text}"))
        };
        metrics::with_local_recorder(&recorder, || {
            let gauges = ShardGauges::start("p3", 1_700_000_000_500);
            gauges.watermark.set(1_700_000_001.25);
            let text = handle.render();
            assert_eq!(
                line(&text, LAST_CHECKPOINT_TIMESTAMP_SECONDS),
                "1700000000.5"
            );
            assert_eq!(line(&text, WATERMARK_TIMESTAMP_SECONDS), "1700000001.25");
            drop(gauges);
        });
        let text = handle.render();
        assert_eq!(line(&text, LAST_CHECKPOINT_TIMESTAMP_SECONDS), "0");
        assert_eq!(line(&text, WATERMARK_TIMESTAMP_SECONDS), "0");
    }
}
