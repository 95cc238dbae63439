//! Metric names only the limiter exports and that live with it (the rule of
//! `adspend_common::telemetry`: `adspend_limiter_<thing>_<unit>`): how its
//! output publishes fare through an outage, which operators alert on
//! (docs/ALERTING.md, `AdspendPublishesFailing`).

/// Tries of an output publish that failed and are retried. Label `cause`:
/// `outage` (a timeout, a lost connection, a restarted server, a full
/// store: retried however long it lasts) or `refusal` (NATS refused the
/// message itself; after a few in a row its input is set aside).
pub const PUBLISH_RETRIES_TOTAL: &str = "adspend_limiter_publish_retries_total";
/// When the output publishes failing now first failed (unix seconds); 0
/// while they succeed. `time() - this` is how long the limiter has been
/// unable to write, its input waiting meanwhile.
pub const PUBLISH_FAILING_SINCE_SECONDS: &str = "adspend_limiter_publish_failing_since_seconds";
/// Bytes the account's streams hold in JetStream's file store, as
/// JetStream reports them every 15 s.
pub const NATS_STORAGE_BYTES: &str = "adspend_limiter_nats_storage_bytes";
/// The account's file store limit in bytes (its own or its tiers'); 0 when
/// unlimited, where only the server's `max_file_store` and the disk bound it.
pub const NATS_STORAGE_LIMIT_BYTES: &str = "adspend_limiter_nats_storage_limit_bytes";

/// The `# HELP` text of the names above, for
/// `adspend_common::telemetry::describe`.
pub const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        PUBLISH_RETRIES_TOTAL,
        "Output publishes that failed and are retried, by cause (outage or refusal).",
    ),
    (
        PUBLISH_FAILING_SINCE_SECONDS,
        "When the output publishes failing now first failed (unix seconds); 0 while they succeed.",
    ),
    (
        NATS_STORAGE_BYTES,
        "Bytes the account's streams hold in JetStream's file store.",
    ),
    (
        NATS_STORAGE_LIMIT_BYTES,
        "The account's JetStream file store limit in bytes; 0 when unlimited.",
    ),
];
