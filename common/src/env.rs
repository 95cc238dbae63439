//! The name of every `ADSPEND_*` environment variable, in one place: the
//! settings' `#[arg(env = ...)]` and the errors that name a setting use
//! these, so a rename cannot leave one behind. Each is also a flag;
//! docs/CONFIGURATION.md says what they mean.

// Every service
pub(crate) const NATS_URL: &str = "ADSPEND_NATS_URL";
pub(crate) const NATS_USER: &str = "ADSPEND_NATS_USER";
pub(crate) const NATS_PASSWORD: &str = "ADSPEND_NATS_PASSWORD";
pub(crate) const NATS_TLS_CA: &str = "ADSPEND_NATS_TLS_CA";
pub(crate) const NATS_TLS_CERT: &str = "ADSPEND_NATS_TLS_CERT";
pub(crate) const NATS_TLS_KEY: &str = "ADSPEND_NATS_TLS_KEY";
pub(crate) const ETCD_ENDPOINTS: &str = "ADSPEND_ETCD_ENDPOINTS";
pub(crate) const ETCD_TLS_CA: &str = "ADSPEND_ETCD_TLS_CA";
pub(crate) const ETCD_TLS_CERT: &str = "ADSPEND_ETCD_TLS_CERT";
pub(crate) const ETCD_TLS_KEY: &str = "ADSPEND_ETCD_TLS_KEY";
pub const METRICS_ADDR: &str = "ADSPEND_METRICS_ADDR";
// Read only by the armed failure points.
#[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
pub(crate) const FAILPOINTS: &str = "ADSPEND_FAILPOINTS";
pub(crate) const WORKER_THREADS: &str = "ADSPEND_WORKER_THREADS";

// Limiter and aggregator
pub(crate) const STREAM_REPLICAS: &str = "ADSPEND_STREAM_REPLICAS";
pub const PARTITIONS: &str = "ADSPEND_PARTITIONS";

// Limiter and pacer
pub(crate) const CATALOG: &str = "ADSPEND_CATALOG";

// Limiter
pub const CHECKPOINT_INTERVAL_MS: &str = "ADSPEND_CHECKPOINT_INTERVAL_MS";
pub const LIMITER_CONSUMER: &str = "ADSPEND_LIMITER_CONSUMER";
pub const LIMITER_MAX_BATCH: &str = "ADSPEND_LIMITER_MAX_BATCH";
pub const LIMITER_TUPLES_PER_MESSAGE: &str = "ADSPEND_LIMITER_TUPLES_PER_MESSAGE";
pub const MAX_COST_MICROS: &str = "ADSPEND_MAX_COST_MICROS";
pub const LIMITER_SCHEDULING: &str = "ADSPEND_LIMITER_SCHEDULING";
pub const LIMITER_SOURCE_TOKEN: &str = "ADSPEND_LIMITER_SOURCE_TOKEN";
pub const LIMITER_FAIR_LAG_MS: &str = "ADSPEND_LIMITER_FAIR_LAG_MS";
pub const LIMITER_DOWNSTREAM_MAX_TUPLES: &str = "ADSPEND_LIMITER_DOWNSTREAM_MAX_TUPLES";
pub const LIMITER_DOWNSTREAM_TARGET_MS: &str = "ADSPEND_LIMITER_DOWNSTREAM_TARGET_MS";
pub const LIMITER_WORKERS: &str = "ADSPEND_LIMITER_WORKERS";
pub const INPUT_RETENTION_MS: &str = "ADSPEND_INPUT_RETENTION_MS";
pub const INPUT_MAX_BYTES: &str = "ADSPEND_INPUT_MAX_BYTES";
pub const DEADLETTER_RETENTION_MS: &str = "ADSPEND_DEADLETTER_RETENTION_MS";
pub const DEADLETTER_MAX_BYTES: &str = "ADSPEND_DEADLETTER_MAX_BYTES";

// Aggregator
pub const OBJECT_STORE_URL: &str = "ADSPEND_OBJECT_STORE_URL";
pub const DATA_DIR: &str = "ADSPEND_DATA_DIR";
pub const AGGREGATOR_PARTITIONS: &str = "ADSPEND_AGGREGATOR_PARTITIONS";
pub const AGGREGATOR_ID: &str = "ADSPEND_AGGREGATOR_ID";
pub const AGGREGATOR_WRITERS: &str = "ADSPEND_AGGREGATOR_WRITERS";
pub const LEASE_TTL_MS: &str = "ADSPEND_LEASE_TTL_MS";
pub const DEDUPE_WINDOW_MS: &str = "ADSPEND_DEDUPE_WINDOW_MS";
pub const DEDUPE_MAX_IDS: &str = "ADSPEND_DEDUPE_MAX_IDS";
pub const PUSH_INTERVAL_MS: &str = "ADSPEND_PUSH_INTERVAL_MS";
pub const SNAPSHOTS_KEPT: &str = "ADSPEND_SNAPSHOTS_KEPT";
pub const CHECKPOINT_MAX_DELTAS: &str = "ADSPEND_CHECKPOINT_MAX_DELTAS";
pub const LMDB_MAP_GIB: &str = "ADSPEND_LMDB_MAP_GIB";
pub const SPEND_TRIM: &str = "ADSPEND_SPEND_TRIM";

// Pacer
pub const PACER_ADDR: &str = "ADSPEND_PACER_ADDR";
pub const PACER_OPS_ADDR: &str = "ADSPEND_PACER_OPS_ADDR";
pub const PACER_STALE_AFTER_MS: &str = "ADSPEND_PACER_STALE_AFTER_MS";
pub const PACER_READ_TOKENS: &str = "ADSPEND_PACER_READ_TOKENS";
pub const PACER_DECIDE_TOKENS: &str = "ADSPEND_PACER_DECIDE_TOKENS";
pub const PACER_REQUEST_TIMEOUT_MS: &str = "ADSPEND_PACER_REQUEST_TIMEOUT_MS";
pub const PACER_IDLE_TIMEOUT_MS: &str = "ADSPEND_PACER_IDLE_TIMEOUT_MS";
pub const PACER_MAX_CONNECTIONS: &str = "ADSPEND_PACER_MAX_CONNECTIONS";
pub const PACER_ALGORITHM: &str = "ADSPEND_PACER_ALGORITHM";
pub const PACER_MAX_CONNECTIONS_PER_ADDR: &str = "ADSPEND_PACER_MAX_CONNECTIONS_PER_ADDR";
pub const PACER_MAX_DECISION_IDS: &str = "ADSPEND_PACER_MAX_DECISION_IDS";
pub const PACER_TLS_CERT: &str = "ADSPEND_PACER_TLS_CERT";
pub const PACER_TLS_KEY: &str = "ADSPEND_PACER_TLS_KEY";
pub const PACER_LEASE_GRACE_MS: &str = "ADSPEND_PACER_LEASE_GRACE_MS";
pub const ALERTS_WEBHOOK_URL: &str = "ADSPEND_ALERTS_WEBHOOK_URL";
pub const ALERTS_WEBHOOK_SECRET: &str = "ADSPEND_ALERTS_WEBHOOK_SECRET";
pub const ALERTS_RETENTION_MS: &str = "ADSPEND_ALERTS_RETENTION_MS";
/// etcd's quota (`--quota-backend-bytes`), which its API does not report.
pub const ETCD_QUOTA_BYTES: &str = "ADSPEND_ETCD_QUOTA_BYTES";

/// Every name above, for checks over all of them.
#[cfg(test)]
const ALL: &[&str] = &[
    NATS_URL,
    NATS_USER,
    NATS_PASSWORD,
    NATS_TLS_CA,
    NATS_TLS_CERT,
    NATS_TLS_KEY,
    ETCD_ENDPOINTS,
    ETCD_TLS_CA,
    ETCD_TLS_CERT,
    ETCD_TLS_KEY,
    METRICS_ADDR,
    FAILPOINTS,
    WORKER_THREADS,
    STREAM_REPLICAS,
    PARTITIONS,
    CATALOG,
    CHECKPOINT_INTERVAL_MS,
    LIMITER_CONSUMER,
    LIMITER_MAX_BATCH,
    LIMITER_TUPLES_PER_MESSAGE,
    MAX_COST_MICROS,
    LIMITER_SCHEDULING,
    LIMITER_SOURCE_TOKEN,
    LIMITER_FAIR_LAG_MS,
    LIMITER_DOWNSTREAM_MAX_TUPLES,
    LIMITER_DOWNSTREAM_TARGET_MS,
    LIMITER_WORKERS,
    INPUT_RETENTION_MS,
    INPUT_MAX_BYTES,
    DEADLETTER_RETENTION_MS,
    DEADLETTER_MAX_BYTES,
    OBJECT_STORE_URL,
    DATA_DIR,
    AGGREGATOR_PARTITIONS,
    AGGREGATOR_ID,
    AGGREGATOR_WRITERS,
    LEASE_TTL_MS,
    DEDUPE_WINDOW_MS,
    DEDUPE_MAX_IDS,
    PUSH_INTERVAL_MS,
    SNAPSHOTS_KEPT,
    CHECKPOINT_MAX_DELTAS,
    LMDB_MAP_GIB,
    SPEND_TRIM,
    PACER_ADDR,
    PACER_OPS_ADDR,
    PACER_STALE_AFTER_MS,
    PACER_READ_TOKENS,
    PACER_DECIDE_TOKENS,
    PACER_REQUEST_TIMEOUT_MS,
    PACER_IDLE_TIMEOUT_MS,
    PACER_MAX_CONNECTIONS,
    PACER_ALGORITHM,
    PACER_MAX_CONNECTIONS_PER_ADDR,
    PACER_MAX_DECISION_IDS,
    PACER_TLS_CERT,
    PACER_TLS_KEY,
    PACER_LEASE_GRACE_MS,
    ALERTS_WEBHOOK_URL,
    ALERTS_WEBHOOK_SECRET,
    ALERTS_RETENTION_MS,
    ETCD_QUOTA_BYTES,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_documented() {
        let doc = include_str!("../../docs/CONFIGURATION.md");
        let mut seen = std::collections::BTreeSet::new();
        for name in ALL {
            assert!(seen.insert(name), "{name} listed twice");
            assert!(name.starts_with("ADSPEND_"), "{name}");
            assert!(
                doc.contains(&format!("`{name}`")),
                "{name} is not in docs/CONFIGURATION.md"
            );
        }
    }
}
