//! Metric names only the limiter exports (the rule of
//! `adspend_common::telemetry`: `adspend_limiter_<thing>_<unit>`, and the
//! contract's `adspend_rejected_total`), with their `# HELP` texts: its
//! input and output, fair scheduling among its sources, and how its output
//! publishes fare through an outage, which operators alert on
//! (docs/ALERTING.md, `AdspendPublishesFailing`).

pub const IMPRESSIONS_TOTAL: &str = "adspend_limiter_impressions_total";
/// Of those, impressions whose message JetStream delivered more than once
/// (an ack wait ran out, or a limiter died holding it); their tuples are
/// re-emitted and dropped by id downstream.
pub const REDELIVERED_IMPRESSIONS_TOTAL: &str = "adspend_limiter_redelivered_impressions_total";
pub(crate) const REJECTED_TOTAL: &str = "adspend_rejected_total";
/// Input messages the limiter set aside: NATS answered but kept refusing
/// their output (recorded on `deadletter.set_aside`).
pub(crate) const LIMITER_SET_ASIDE_TOTAL: &str = "adspend_limiter_set_aside_total";
pub(crate) const TUPLES_EMITTED_TOTAL: &str = "adspend_limiter_tuples_emitted_total";
pub(crate) const SPEND_MESSAGES_TOTAL: &str = "adspend_limiter_spend_messages_total";
pub(crate) const MARKERS_TOTAL: &str = "adspend_limiter_markers_total";
// fair scheduling among sources (gauges labelled `source`)
/// The source's share of the limiter's usage over the sliding window, 0..=1.
pub(crate) const LIMITER_SOURCE_USAGE_SHARE: &str = "adspend_limiter_source_usage_share";
/// Age of the source's oldest waiting event.
pub(crate) const LIMITER_SOURCE_LAG_SECONDS: &str = "adspend_limiter_source_lag_seconds";
/// 1 while the source is held back so that waiting sources get their share.
pub(crate) const LIMITER_SOURCE_HELD_BACK: &str = "adspend_limiter_source_held_back";
/// Tuples this limiter published to `SPEND` that no aggregator has reported
/// as applied (the queue behind it; fair scheduling keeps backlogs within a
/// window of `ADSPEND_LIMITER_DOWNSTREAM_MAX_TUPLES`).
pub(crate) const LIMITER_DOWNSTREAM_QUEUED_TUPLES: &str =
    "adspend_limiter_downstream_queued_tuples";
/// The window's size now, in tuples: the bound, or less while the other
/// sources' delay is over `ADSPEND_LIMITER_DOWNSTREAM_TARGET_MS`.
pub(crate) const LIMITER_DOWNSTREAM_WINDOW_TUPLES: &str =
    "adspend_limiter_downstream_window_tuples";
/// Fair rounds in which the window held a backlog back.
pub(crate) const LIMITER_CONGESTED_ROUNDS_TOTAL: &str = "adspend_limiter_congested_rounds_total";
// output publishes through an outage
/// Tries of an output publish that failed and are retried. Label `cause`:
/// `outage` (a timeout, a lost connection, a restarted server, a full
/// store: retried however long it lasts) or `refusal` (NATS refused the
/// message itself; after a few in a row its input is set aside).
pub(crate) const PUBLISH_RETRIES_TOTAL: &str = "adspend_limiter_publish_retries_total";
/// When the output publishes failing now first failed (unix seconds); 0
/// while they succeed. `time() - this` is how long the limiter has been
/// unable to write, its input waiting meanwhile.
pub(crate) const PUBLISH_FAILING_SINCE_SECONDS: &str =
    "adspend_limiter_publish_failing_since_seconds";
/// Bytes the account's streams hold in JetStream's file store, as
/// JetStream reports them every 15 s.
pub(crate) const NATS_STORAGE_BYTES: &str = "adspend_limiter_nats_storage_bytes";
/// The account's file store limit in bytes (its own or its tiers'); 0 when
/// unlimited, where only the server's `max_file_store` and the disk bound it.
pub(crate) const NATS_STORAGE_LIMIT_BYTES: &str = "adspend_limiter_nats_storage_limit_bytes";

// what the input streams keep (docs/RETENTION.md)
/// Bytes a stream the limiter writes or reads holds (label `stream`:
/// `IMPRESSIONS`, `DEADLETTER`), read every retention round.
pub(crate) const STREAM_BYTES: &str = "adspend_limiter_stream_bytes";
/// That stream's byte cap; 0 when it has none. At the cap `IMPRESSIONS`
/// refuses ad servers' publishes and `DEADLETTER` drops its oldest letters.
pub(crate) const STREAM_MAX_BYTES: &str = "adspend_limiter_stream_max_bytes";
/// Age of the oldest message `IMPRESSIONS` holds: about
/// `ADSPEND_INPUT_RETENTION_MS` in steady state, more while input waits
/// unacknowledged, less while the byte cap presses.
pub(crate) const INPUT_OLDEST_SECONDS: &str = "adspend_limiter_input_oldest_seconds";
/// Acknowledged input messages purged from `IMPRESSIONS`, by `reason`:
/// `age` (past the retention) or `cap` (before it, the byte cap pressing).
pub(crate) const INPUT_PURGED_TOTAL: &str = "adspend_limiter_input_purged_messages_total";
/// The `# HELP` text of the names above, for
/// `adspend_common::telemetry::describe`.
pub(crate) const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        IMPRESSIONS_TOTAL,
        "Impressions the limiter took from IMPRESSIONS and published spend for.",
    ),
    (
        REDELIVERED_IMPRESSIONS_TOTAL,
        "Impressions whose message JetStream delivered more than once (their tuples are dropped by id downstream).",
    ),
    (
        REJECTED_TOTAL,
        "Input rejected and dead lettered to DEADLETTER, by reason.",
    ),
    (
        LIMITER_SET_ASIDE_TOTAL,
        "Input messages the limiter set aside because NATS kept refusing their output.",
    ),
    (
        TUPLES_EMITTED_TOTAL,
        "Spend tuples (limit, cost, id) the limiter published to SPEND.",
    ),
    (SPEND_MESSAGES_TOTAL, "SPEND messages the limiter published."),
    (
        MARKERS_TOTAL,
        "Checkpoint markers the limiter published (one per partition per interval).",
    ),
    (
        LIMITER_SOURCE_USAGE_SHARE,
        "The source's share of the limiter's usage over the sliding window, 0 to 1.",
    ),
    (
        LIMITER_SOURCE_LAG_SECONDS,
        "Age of the source's oldest waiting input event.",
    ),
    (
        LIMITER_SOURCE_HELD_BACK,
        "1 while the source is held back so that waiting sources get their share.",
    ),
    (
        LIMITER_DOWNSTREAM_QUEUED_TUPLES,
        "Tuples this limiter published to SPEND that no aggregator has reported applied.",
    ),
    (
        LIMITER_DOWNSTREAM_WINDOW_TUPLES,
        "The downstream window's size now, in tuples.",
    ),
    (
        LIMITER_CONGESTED_ROUNDS_TOTAL,
        "Fair rounds in which the downstream window held a backlog back.",
    ),
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
    (
        STREAM_BYTES,
        "Bytes the stream holds (IMPRESSIONS, DEADLETTER), by stream.",
    ),
    (
        STREAM_MAX_BYTES,
        "The stream's byte cap; 0 when it has none.",
    ),
    (
        INPUT_OLDEST_SECONDS,
        "Age of the oldest message IMPRESSIONS holds.",
    ),
    (
        INPUT_PURGED_TOTAL,
        "Acknowledged input messages purged from IMPRESSIONS, by reason (age, cap).",
    ),
];
