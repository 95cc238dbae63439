//! Metric names of the aggregator's recovery from lost objects, following
//! `adspend_common::telemetry`'s rule (`adspend_aggregator_<thing>_<unit>`).
//! They belong with the others there, where they would move when that
//! module's owner takes them; docs/RECOVERY.md describes them.

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
