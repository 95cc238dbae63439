//! Metric names only the aggregator exports (the rule of
//! `adspend_common::telemetry`: `adspend_aggregator_<thing>_<unit>`), with
//! their `# HELP` texts and the bucket bounds of its histograms: applying
//! spend, checkpoints, cluster ownership, the recovery from lost objects
//! (docs/RECOVERY.md), the data directory's disk, and each shard's progress
//! and checkpoint age, which operators alert on (docs/ALERTING.md).

pub(crate) const TUPLES_APPLIED_TOTAL: &str = "adspend_aggregator_tuples_applied_total";
pub(crate) const DUPLICATES_DROPPED_TOTAL: &str = "adspend_aggregator_duplicates_dropped_total";
pub(crate) const APPLY_COMMITS_TOTAL: &str = "adspend_aggregator_apply_commits_total";
pub(crate) const LAST_APPLIED_SEQ: &str = "adspend_aggregator_last_applied_seq";
pub(crate) const CHECKPOINTS_TOTAL: &str = "adspend_aggregator_checkpoints_total";
pub(crate) const CHECKPOINTS_COALESCED_TOTAL: &str =
    "adspend_aggregator_checkpoints_coalesced_total";
pub(crate) const CHECKPOINT_SECONDS: &str = "adspend_aggregator_checkpoint_seconds";
/// Size of the recorded base snapshot (the compacted LMDB copy).
pub(crate) const SNAPSHOT_BYTES: &str = "adspend_aggregator_snapshot_bytes";
/// Bytes uploaded by checkpoints, `kind="base"` (full copies) or
/// `kind="delta"` (what changed since the previous checkpoint).
pub(crate) const CHECKPOINT_UPLOADED_BYTES_TOTAL: &str =
    "adspend_aggregator_checkpoint_uploaded_bytes_total";
pub(crate) const DEDUPE_IDS: &str = "adspend_aggregator_dedupe_ids";
/// The effective window: stream time between the oldest id the shard still
/// holds and the newest message applied. Label `shard`.
pub(crate) const DEDUPE_WINDOW_SECONDS: &str = "adspend_aggregator_dedupe_window_seconds";
/// `ADSPEND_DEDUPE_WINDOW_MS` in seconds, next to it for the alert. Label `shard`.
pub(crate) const DEDUPE_WINDOW_TARGET_SECONDS: &str =
    "adspend_aggregator_dedupe_window_target_seconds";
/// Bytes of the dedupe set's in-memory tables. Label `shard`.
pub(crate) const DEDUPE_MEMORY_BYTES: &str = "adspend_aggregator_dedupe_memory_bytes";
/// Ids evicted from the window, `by="time"` (older than the window) or
/// `by="count"` (the count bound, before their time: the window is cut).
/// Label `shard`.
pub(crate) const DEDUPE_EVICTED_TOTAL: &str = "adspend_aggregator_dedupe_evicted_total";
/// Spend tuples of closed periods (`ADSPEND_CLOSED_PERIOD_DAYS`): added to
/// their limits' lifetime sums only. Label `shard`.
pub(crate) const CLOSED_PERIOD_TUPLES_TOTAL: &str = "adspend_aggregator_closed_period_tuples_total";
/// Their micros. Label `shard`.
pub(crate) const CLOSED_PERIOD_MICROS_TOTAL: &str = "adspend_aggregator_closed_period_micros_total";
pub(crate) const SUMS_PUSHES_TOTAL: &str = "adspend_aggregator_sums_pushes_total";
pub(crate) const STREAM_INTEGRITY_ERRORS_TOTAL: &str =
    "adspend_aggregator_stream_integrity_errors_total";
/// `SPEND` messages of the shard's partitions trimmed below its oldest kept
/// checkpoint (docs/RETENTION.md).
pub(crate) const SPEND_TRIMMED_TOTAL: &str = "adspend_aggregator_spend_trimmed_messages_total";
/// The sequence below which the shard's partitions are trimmed.
pub(crate) const SPEND_TRIMMED_BELOW: &str = "adspend_aggregator_spend_trimmed_below_seq";
/// `SPEND` messages or tuples the aggregator set aside (dead lettered) by
/// reason, instead of stopping on them.
pub(crate) const SPEND_SET_ASIDE_TOTAL: &str = "adspend_aggregator_spend_set_aside_total";
// cluster mode
/// Partitions this member applies now.
pub(crate) const AGGREGATOR_OWNED_PARTITIONS: &str = "adspend_aggregator_owned_partitions";
/// Changes of this member's assigned partitions (joins and departures).
pub(crate) const AGGREGATOR_REBALANCES_TOTAL: &str = "adspend_aggregator_rebalances_total";
/// Graceful handover, `side="take"`: from the partition being assigned here
/// until it applies here; `side="release"`: from being asked to let go
/// until the last checkpoint is recorded and the partition released.
pub(crate) const AGGREGATOR_HANDOVER_SECONDS: &str = "adspend_aggregator_handover_seconds";
/// From noticing the previous owner's lease gone until the partition
/// applies here (restore and catch-up included).
pub(crate) const AGGREGATOR_FAILOVER_SECONDS: &str = "adspend_aggregator_failover_seconds";
/// Membership leases lost (keepalives unanswered or expired).
pub(crate) const AGGREGATOR_LEASES_LOST_TOTAL: &str = "adspend_aggregator_leases_lost_total";

/// Bucket bounds of the ownership histograms (handover, failover).
const OWNERSHIP_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
];

/// Bucket bounds of [`CHECKPOINT_SECONDS`]: a delta takes tens of
/// milliseconds, a base of a large store minutes.
const CHECKPOINT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// The aggregator's histograms with their bucket bounds, for the recorder
/// (`adspend_common::service::Service::HISTOGRAMS`).
pub(crate) const HISTOGRAMS: &[(&str, &[f64])] = &[
    (CHECKPOINT_SECONDS, CHECKPOINT_BUCKETS),
    (AGGREGATOR_HANDOVER_SECONDS, OWNERSHIP_BUCKETS),
    (AGGREGATOR_FAILOVER_SECONDS, OWNERSHIP_BUCKETS),
];

// recovery from lost objects
/// 1 while a shard cannot restore because the snapshot (base or delta) its
/// checkpoint record names is gone and no safe way out was found; 0 once it
/// restored or was rebuilt. Label `shard`.
pub(crate) const SNAPSHOT_MISSING: &str = "adspend_aggregator_snapshot_missing";
/// Restores that found the recorded snapshot gone. Label `shard`.
pub(crate) const SNAPSHOT_MISSING_TOTAL: &str = "adspend_aggregator_snapshot_missing_total";
/// Shards rebuilt from an empty state because their recorded snapshot was
/// gone. Labels `shard`, `way`: `replay` (the whole stream, exact) or
/// `accept_loss` (from the stream's first sequence, at the operator's word).
pub(crate) const REBUILDS_TOTAL: &str = "adspend_aggregator_rebuilds_total";
/// Checkpoints that failed. Labels `shard`, `reason`: `bucket_missing` (S3
/// has no such bucket), `store` (the object store failed otherwise),
/// `record` (etcd or the local record), `other` (the copy, a task).
pub(crate) const CHECKPOINT_FAILURES_TOTAL: &str = "adspend_aggregator_checkpoint_failures_total";
/// Checkpoints that found objects of the recorded chain gone from the store
/// and copied a new base instead of a delta on it. Label `shard`.
pub(crate) const CHAIN_LOST_TOTAL: &str = "adspend_aggregator_checkpoint_chain_lost_total";
/// The shard's watermark (unix seconds): its sums are complete as of this
/// time (now while it is caught up, else the publish time of the last
/// message applied). Set every push interval while the shard runs here;
/// frozen while it applies nothing, 0 once it stopped here. Label `shard`.
pub(crate) const WATERMARK_TIMESTAMP_SECONDS: &str =
    "adspend_aggregator_watermark_timestamp_seconds";
/// When the shard's last checkpoint was recorded (unix seconds): the
/// restored record's time, or the shard's start here when it had none,
/// until its first checkpoint here; 0 once it stopped here. Label `shard`.
pub(crate) const LAST_CHECKPOINT_TIMESTAMP_SECONDS: &str =
    "adspend_aggregator_last_checkpoint_timestamp_seconds";

/// Times the lease keepalives went unanswered for half the TTL and the
/// partitions paused (each ends in a resume or a lost lease).
pub(crate) const LEASE_PAUSES_TOTAL: &str = "adspend_aggregator_lease_pauses_total";

/// 1 while the shard waits for space in the data directory (a commit or a
/// start-up write failed with ENOSPC); 0 once it went on. Label `shard`.
pub(crate) const DISK_FULL: &str = "adspend_aggregator_disk_full";
/// Free bytes of the file system that holds the data directory, as the
/// aggregator may write them; exported every 10 s.
pub(crate) const DATA_DIR_FREE_BYTES: &str = "adspend_aggregator_data_dir_free_bytes";
/// Size in bytes of the file system that holds the data directory.
pub(crate) const DATA_DIR_SIZE_BYTES: &str = "adspend_aggregator_data_dir_size_bytes";

/// The `# HELP` text of the names above, for
/// `adspend_common::telemetry::describe`.
pub(crate) const DESCRIPTIONS: &[(&str, &str)] = &[
    (TUPLES_APPLIED_TOTAL, "Spend tuples added to the sums."),
    (
        DUPLICATES_DROPPED_TOTAL,
        "Spend tuples dropped as duplicates, by=id (dedupe window) or by=seq (replay).",
    ),
    (
        APPLY_COMMITS_TOTAL,
        "LMDB write transactions committed by the writer.",
    ),
    (
        LAST_APPLIED_SEQ,
        "SPEND stream sequence the shard has applied through.",
    ),
    (
        CHECKPOINTS_TOTAL,
        "Checkpoints taken, by outcome (ok, failed).",
    ),
    (
        CHECKPOINTS_COALESCED_TOTAL,
        "Checkpoint requests folded into a newer one while a checkpoint ran.",
    ),
    (
        CHECKPOINT_SECONDS,
        "Time to take a checkpoint, by kind (base, delta).",
    ),
    (SNAPSHOT_BYTES, "Size of the shard's recorded base snapshot."),
    (
        CHECKPOINT_UPLOADED_BYTES_TOTAL,
        "Bytes uploaded by checkpoints, by kind (base, delta).",
    ),
    (DEDUPE_IDS, "Message ids in the shard's dedupe window."),
    (
        DEDUPE_WINDOW_SECONDS,
        "Stream time the shard's dedupe window covers now: from the oldest id it holds to the newest message.",
    ),
    (
        DEDUPE_WINDOW_TARGET_SECONDS,
        "The dedupe window configured (ADSPEND_DEDUPE_WINDOW_MS), in seconds.",
    ),
    (
        DEDUPE_MEMORY_BYTES,
        "Bytes of the shard's in-memory dedupe set.",
    ),
    (
        DEDUPE_EVICTED_TOTAL,
        "Ids evicted from the dedupe window, by=time (past the window) or by=count (ADSPEND_DEDUPE_MAX_IDS, before their time).",
    ),
    (
        CLOSED_PERIOD_TUPLES_TOTAL,
        "Spend tuples of periods closed for longer than ADSPEND_CLOSED_PERIOD_DAYS: added to lifetime sums only.",
    ),
    (
        CLOSED_PERIOD_MICROS_TOTAL,
        "Micros of the spend tuples of closed periods (lifetime sums only).",
    ),
    (
        SUMS_PUSHES_TOTAL,
        "Pushes of changed sums to the pacers (heartbeats included).",
    ),
    (
        STREAM_INTEGRITY_ERRORS_TOTAL,
        "SPEND found with a retention gap or gone backwards, by kind; the shard stops.",
    ),
    (
        SPEND_TRIMMED_TOTAL,
        "SPEND messages of the shard's partitions trimmed below its oldest kept checkpoint.",
    ),
    (
        SPEND_TRIMMED_BELOW,
        "The sequence below which the shard's SPEND partitions are trimmed.",
    ),
    (
        SPEND_SET_ASIDE_TOTAL,
        "SPEND messages or tuples set aside (dead lettered), by reason.",
    ),
    (
        AGGREGATOR_OWNED_PARTITIONS,
        "Partitions this member applies now.",
    ),
    (
        AGGREGATOR_REBALANCES_TOTAL,
        "Changes of this member's assigned partitions.",
    ),
    (
        AGGREGATOR_HANDOVER_SECONDS,
        "Graceful handover time of a partition, by side (take, release).",
    ),
    (
        AGGREGATOR_FAILOVER_SECONDS,
        "From noticing a previous owner's lease gone until the partition applies here.",
    ),
    (
        AGGREGATOR_LEASES_LOST_TOTAL,
        "Membership leases this member lost.",
    ),
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
    pub(crate) watermark: metrics::Gauge,
    pub(crate) last_checkpoint: metrics::Gauge,
}

impl ShardGauges {
    /// The gauges of `shard`, whose last checkpoint was recorded at
    /// `checkpoint_ms` (unix ms).
    pub(crate) fn start(shard: &str, checkpoint_ms: i64) -> Self {
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
            .split("pub(crate) const ")
            .skip(1)
            .filter_map(|item| item.split_once(": &str =")?.1.split('"').nth(1))
            .collect();
        assert!(declared.len() >= 30, "{declared:?}");
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
    fn histogram_bounds_increase() {
        for (name, bounds) in HISTOGRAMS {
            assert!(!bounds.is_empty(), "{name}");
            assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{name}");
        }
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
