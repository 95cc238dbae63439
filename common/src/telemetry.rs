//! Logging and metrics: `tracing` to stderr, `metrics` exported for
//! Prometheus. Every metric name lives here so that dashboards have one place
//! to look.

use std::net::SocketAddr;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

use crate::error::Error;

// limiter
pub const IMPRESSIONS_TOTAL: &str = "adspend_impressions_total";
pub const REJECTED_TOTAL: &str = "adspend_rejected_total";
pub const TUPLES_EMITTED_TOTAL: &str = "adspend_tuples_emitted_total";
pub const SPEND_MESSAGES_TOTAL: &str = "adspend_spend_messages_total";
pub const MARKERS_TOTAL: &str = "adspend_markers_total";
pub const CATALOG_RELOADS_TOTAL: &str = "adspend_catalog_reloads_total";
pub const CATALOG_ERRORS_TOTAL: &str = "adspend_catalog_errors_total";
// aggregator
pub const TUPLES_APPLIED_TOTAL: &str = "adspend_tuples_applied_total";
pub const DUPLICATES_DROPPED_TOTAL: &str = "adspend_duplicates_dropped_total";
pub const APPLY_COMMITS_TOTAL: &str = "adspend_apply_commits_total";
pub const LAST_APPLIED_SEQ: &str = "adspend_last_applied_seq";
pub const CHECKPOINTS_TOTAL: &str = "adspend_checkpoints_total";
pub const CHECKPOINTS_COALESCED_TOTAL: &str = "adspend_checkpoints_coalesced_total";
pub const CHECKPOINT_SECONDS: &str = "adspend_checkpoint_seconds";
/// Size of the recorded base snapshot (the compacted LMDB copy).
pub const SNAPSHOT_BYTES: &str = "adspend_snapshot_bytes";
/// Bytes uploaded by checkpoints, `kind="base"` (full copies) or
/// `kind="delta"` (what changed since the previous checkpoint).
pub const CHECKPOINT_UPLOADED_BYTES_TOTAL: &str = "adspend_checkpoint_uploaded_bytes_total";
pub const DEDUPE_IDS: &str = "adspend_dedupe_ids";
pub const DEDUPE_WINDOW_SECONDS: &str = "adspend_dedupe_window_seconds";
pub const SUMS_PUSHES_TOTAL: &str = "adspend_sums_pushes_total";
pub const STREAM_INTEGRITY_ERRORS_TOTAL: &str = "adspend_stream_integrity_errors_total";
/// `SPEND` messages or tuples the aggregator set aside (dead lettered) by
/// reason, instead of stopping on them.
pub const SPEND_SET_ASIDE_TOTAL: &str = "adspend_spend_set_aside_total";
// aggregator, cluster mode
/// Partitions this member applies now.
pub const AGGREGATOR_OWNED_PARTITIONS: &str = "adspend_aggregator_owned_partitions";
/// Changes of this member's assigned partitions (joins and departures).
pub const AGGREGATOR_REBALANCES_TOTAL: &str = "adspend_aggregator_rebalances_total";
/// Graceful handover, `side="take"`: from the partition being assigned here
/// until it applies here; `side="release"`: from being asked to let go
/// until the last checkpoint is recorded and the partition released.
pub const AGGREGATOR_HANDOVER_SECONDS: &str = "adspend_aggregator_handover_seconds";
/// From noticing the previous owner's lease gone until the partition
/// applies here (restore and catch-up included).
pub const AGGREGATOR_FAILOVER_SECONDS: &str = "adspend_aggregator_failover_seconds";
/// Membership leases lost (keepalives unanswered or expired).
pub const AGGREGATOR_LEASES_LOST_TOTAL: &str = "adspend_aggregator_leases_lost_total";
// pacer
pub const PACER_UPDATES_TOTAL: &str = "adspend_pacer_updates_total";
pub const PACER_STALE_UPDATES_TOTAL: &str = "adspend_pacer_stale_updates_total";
pub const PACER_RESYNCS_TOTAL: &str = "adspend_pacer_resyncs_total";
pub const PACER_LAG_SECONDS: &str = "adspend_pacer_lag_seconds";
/// Per push with new spend: from the JetStream publish of its earliest
/// impression to the pacer holding the sums (a histogram).
pub const PACER_FRESHNESS_SECONDS: &str = "adspend_pacer_freshness_seconds";
/// Bucket bounds of [`PACER_FRESHNESS_SECONDS`].
pub const FRESHNESS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
];
pub const DECISIONS_TOTAL: &str = "adspend_decisions_total";
/// Shards with no push (heartbeats included) for `ADSPEND_PACER_STALE_AFTER_MS`.
pub const PACER_STALE_SHARDS: &str = "adspend_pacer_stale_shards";
/// Catalog limits that are stale (their ads are not servable).
pub const PACER_STALE_LIMITS: &str = "adspend_pacer_stale_limits";
/// API requests refused, by `reason`: `unauthorized` (no or unknown bearer
/// token), `forbidden` (a token of the other scope) or `timeout`.
pub const PACER_HTTP_REFUSED_TOTAL: &str = "adspend_pacer_http_refused_total";

/// Bucket bounds of the ownership histograms (handover, failover).
pub const OWNERSHIP_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
];

static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();

/// The installed recorder's handle, for services that also serve `/metrics`
/// on their own port; `None` when no recorder was installed (in-process tests).
pub fn metrics_handle() -> Option<&'static PrometheusHandle> {
    HANDLE.get()
}

/// Log to stderr; `RUST_LOG` overrides the default `info`.
pub fn init_tracing() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Install the global Prometheus recorder and serve `/metrics` on `listen`.
/// Returns the handle, so a service can also render metrics on its own port.
/// Must be called inside a tokio runtime.
pub fn install_metrics(listen: SocketAddr) -> Result<PrometheusHandle, Error> {
    let bind_error = |reason: String| Error::Bind {
        what: "metrics listener",
        addr: listen.to_string(),
        reason,
    };
    // Bind first so a busy port is a clear error rather than a background panic.
    std::net::TcpListener::bind(listen).map_err(|e| bind_error(e.to_string()))?;
    let builder = PrometheusBuilder::new()
        .with_http_listener(listen)
        .set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full(PACER_FRESHNESS_SECONDS.into()),
            FRESHNESS_BUCKETS,
        )
        .and_then(|b| {
            b.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(AGGREGATOR_HANDOVER_SECONDS.into()),
                OWNERSHIP_BUCKETS,
            )
        })
        .and_then(|b| {
            b.set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(AGGREGATOR_FAILOVER_SECONDS.into()),
                OWNERSHIP_BUCKETS,
            )
        })
        .map_err(|e| bind_error(e.to_string()))?;
    let (recorder, exporter) = builder.build().map_err(|e| bind_error(e.to_string()))?;
    let handle = recorder.handle();
    metrics::set_global_recorder(recorder).map_err(|e| bind_error(e.to_string()))?;
    let _ = HANDLE.set(handle.clone());
    tokio::spawn(async move {
        if let Err(e) = exporter.await {
            tracing::error!(error = ?e, "metrics listener stopped");
        }
    });
    Ok(handle)
}
