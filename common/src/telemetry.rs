//! Logging and metrics: `tracing` to stderr, `metrics` exported for
//! Prometheus. Every metric name lives here so that dashboards have one place
//! to look.
//!
//! Names follow one rule: `adspend_<component>_<thing>_<unit>`, where the
//! component is the service that exports it (`limiter`, `aggregator`,
//! `pacer`), `catalog` for the catalog watcher the limiter and the pacer
//! both run, or `nats` for the NATS connection every service makes; the
//! unit is `total` (counters), `seconds` or `bytes`; gauges of a count or a
//! state carry no unit. The one exception is
//! `adspend_rejected_total`, whose name the external contract fixes.
//! Every histogram has bucket bounds in [`HISTOGRAM_BUCKETS`], so none is
//! exported as a summary.

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

// every service
/// 1 when the NATS server this service connected to lets clients in without
/// authentication (anyone reaching it may publish anything), else 0.
pub(crate) const NATS_UNAUTHENTICATED: &str = "adspend_nats_unauthenticated";

// limiter
pub const IMPRESSIONS_TOTAL: &str = "adspend_limiter_impressions_total";
/// Of those, impressions whose message JetStream delivered more than once
/// (an ack wait ran out, or a limiter died holding it); their tuples are
/// re-emitted and dropped by id downstream.
pub const REDELIVERED_IMPRESSIONS_TOTAL: &str = "adspend_limiter_redelivered_impressions_total";
pub const REJECTED_TOTAL: &str = "adspend_rejected_total";
/// Input messages the limiter set aside: NATS answered but kept refusing
/// their output (recorded on `deadletter.set_aside`).
pub const LIMITER_SET_ASIDE_TOTAL: &str = "adspend_limiter_set_aside_total";
pub const TUPLES_EMITTED_TOTAL: &str = "adspend_limiter_tuples_emitted_total";
pub const SPEND_MESSAGES_TOTAL: &str = "adspend_limiter_spend_messages_total";
pub const MARKERS_TOTAL: &str = "adspend_limiter_markers_total";
pub(crate) const CATALOG_RELOADS_TOTAL: &str = "adspend_catalog_reloads_total";
pub(crate) const CATALOG_ERRORS_TOTAL: &str = "adspend_catalog_errors_total";
// limiter, fair scheduling among sources (gauges labelled `source`)
/// The source's share of the limiter's usage over the sliding window, 0..=1.
pub const LIMITER_SOURCE_USAGE_SHARE: &str = "adspend_limiter_source_usage_share";
/// Age of the source's oldest waiting event.
pub const LIMITER_SOURCE_LAG_SECONDS: &str = "adspend_limiter_source_lag_seconds";
/// 1 while the source is held back so that waiting sources get their share.
pub const LIMITER_SOURCE_HELD_BACK: &str = "adspend_limiter_source_held_back";
/// Tuples this limiter published to `SPEND` that no aggregator has reported
/// as applied (the queue behind it; fair scheduling keeps backlogs within a
/// window of `ADSPEND_LIMITER_DOWNSTREAM_MAX_TUPLES`).
pub const LIMITER_DOWNSTREAM_QUEUED_TUPLES: &str = "adspend_limiter_downstream_queued_tuples";
/// The window's size now, in tuples: the bound, or less while the other
/// sources' delay is over `ADSPEND_LIMITER_DOWNSTREAM_TARGET_MS`.
pub const LIMITER_DOWNSTREAM_WINDOW_TUPLES: &str = "adspend_limiter_downstream_window_tuples";
/// Fair rounds in which the window held a backlog back.
pub const LIMITER_CONGESTED_ROUNDS_TOTAL: &str = "adspend_limiter_congested_rounds_total";
// aggregator
pub const TUPLES_APPLIED_TOTAL: &str = "adspend_aggregator_tuples_applied_total";
pub const DUPLICATES_DROPPED_TOTAL: &str = "adspend_aggregator_duplicates_dropped_total";
pub const APPLY_COMMITS_TOTAL: &str = "adspend_aggregator_apply_commits_total";
pub const LAST_APPLIED_SEQ: &str = "adspend_aggregator_last_applied_seq";
pub const CHECKPOINTS_TOTAL: &str = "adspend_aggregator_checkpoints_total";
pub const CHECKPOINTS_COALESCED_TOTAL: &str = "adspend_aggregator_checkpoints_coalesced_total";
pub const CHECKPOINT_SECONDS: &str = "adspend_aggregator_checkpoint_seconds";
/// Size of the recorded base snapshot (the compacted LMDB copy).
pub const SNAPSHOT_BYTES: &str = "adspend_aggregator_snapshot_bytes";
/// Bytes uploaded by checkpoints, `kind="base"` (full copies) or
/// `kind="delta"` (what changed since the previous checkpoint).
pub const CHECKPOINT_UPLOADED_BYTES_TOTAL: &str =
    "adspend_aggregator_checkpoint_uploaded_bytes_total";
pub const DEDUPE_IDS: &str = "adspend_aggregator_dedupe_ids";
pub const DEDUPE_WINDOW_SECONDS: &str = "adspend_aggregator_dedupe_window_seconds";
pub const SUMS_PUSHES_TOTAL: &str = "adspend_aggregator_sums_pushes_total";
pub const STREAM_INTEGRITY_ERRORS_TOTAL: &str = "adspend_aggregator_stream_integrity_errors_total";
/// `SPEND` messages or tuples the aggregator set aside (dead lettered) by
/// reason, instead of stopping on them.
pub const SPEND_SET_ASIDE_TOTAL: &str = "adspend_aggregator_spend_set_aside_total";
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
pub(crate) const FRESHNESS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
];
pub const DECISIONS_TOTAL: &str = "adspend_pacer_decisions_total";
/// Shards with no push (heartbeats included) for `ADSPEND_PACER_STALE_AFTER_MS`.
pub const PACER_STALE_SHARDS: &str = "adspend_pacer_stale_shards";
/// Catalog limits that are stale (their ads are not servable).
pub const PACER_STALE_LIMITS: &str = "adspend_pacer_stale_limits";
/// How far behind the limiters' input is (the oldest input waiting, or how
/// long a consumer's limiters have not reported), seconds.
pub const PACER_INPUT_LAG_SECONDS: &str = "adspend_pacer_input_lag_seconds";
/// API requests refused, by `reason`: `unauthorized` (no or unknown bearer
/// token), `forbidden` (a token of the other scope) or `timeout`.
pub const PACER_HTTP_REFUSED_TOTAL: &str = "adspend_pacer_http_refused_total";

/// Bucket bounds of the ownership histograms (handover, failover).
pub(crate) const OWNERSHIP_BUCKETS: &[f64] = &[
    0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0,
];

/// Bucket bounds of [`CHECKPOINT_SECONDS`]: a delta takes tens of
/// milliseconds, a base of a large store minutes.
pub(crate) const CHECKPOINT_BUCKETS: &[f64] = &[
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0,
];

/// Every histogram with its bucket bounds. A histogram missing here would be
/// exported as a summary (quantiles that cannot be aggregated across
/// processes); a test checks that every `histogram!` is listed.
pub(crate) const HISTOGRAM_BUCKETS: &[(&str, &[f64])] = &[
    (CHECKPOINT_SECONDS, CHECKPOINT_BUCKETS),
    (AGGREGATOR_HANDOVER_SECONDS, OWNERSHIP_BUCKETS),
    (AGGREGATOR_FAILOVER_SECONDS, OWNERSHIP_BUCKETS),
    (PACER_FRESHNESS_SECONDS, FRESHNESS_BUCKETS),
];

/// The `# HELP` text of every metric named here, one line each: Prometheus
/// tooling (`promtool check metrics`) wants one for every metric.
pub const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        NATS_UNAUTHENTICATED,
        "1 when the NATS server this service connected to lets clients in without authentication, else 0.",
    ),
    (IMPRESSIONS_TOTAL, "Impressions the limiter took from IMPRESSIONS and published spend for."),
    (
        REDELIVERED_IMPRESSIONS_TOTAL,
        "Impressions whose message JetStream delivered more than once (their tuples are dropped by id downstream).",
    ),
    (REJECTED_TOTAL, "Input rejected and dead lettered to DEADLETTER, by reason."),
    (
        LIMITER_SET_ASIDE_TOTAL,
        "Input messages the limiter set aside because NATS kept refusing their output.",
    ),
    (TUPLES_EMITTED_TOTAL, "Spend tuples (limit, cost, id) the limiter published to SPEND."),
    (SPEND_MESSAGES_TOTAL, "SPEND messages the limiter published."),
    (MARKERS_TOTAL, "Checkpoint markers the limiter published (one per partition per interval)."),
    (CATALOG_RELOADS_TOTAL, "Catalog versions loaded."),
    (
        CATALOG_ERRORS_TOTAL,
        "Catalog versions refused or unreadable (the previous catalog stays in force).",
    ),
    (
        LIMITER_SOURCE_USAGE_SHARE,
        "The source's share of the limiter's usage over the sliding window, 0 to 1.",
    ),
    (LIMITER_SOURCE_LAG_SECONDS, "Age of the source's oldest waiting input event."),
    (
        LIMITER_SOURCE_HELD_BACK,
        "1 while the source is held back so that waiting sources get their share.",
    ),
    (
        LIMITER_DOWNSTREAM_QUEUED_TUPLES,
        "Tuples this limiter published to SPEND that no aggregator has reported applied.",
    ),
    (LIMITER_DOWNSTREAM_WINDOW_TUPLES, "The downstream window's size now, in tuples."),
    (LIMITER_CONGESTED_ROUNDS_TOTAL, "Fair rounds in which the downstream window held a backlog back."),
    (TUPLES_APPLIED_TOTAL, "Spend tuples added to the sums."),
    (
        DUPLICATES_DROPPED_TOTAL,
        "Spend tuples dropped as duplicates, by=id (dedupe window) or by=seq (replay).",
    ),
    (APPLY_COMMITS_TOTAL, "LMDB write transactions committed by the writer."),
    (LAST_APPLIED_SEQ, "SPEND stream sequence the shard has applied through."),
    (CHECKPOINTS_TOTAL, "Checkpoints taken, by outcome (ok, failed)."),
    (
        CHECKPOINTS_COALESCED_TOTAL,
        "Checkpoint requests folded into a newer one while a checkpoint ran.",
    ),
    (CHECKPOINT_SECONDS, "Time to take a checkpoint, by kind (base, delta)."),
    (SNAPSHOT_BYTES, "Size of the shard's recorded base snapshot."),
    (CHECKPOINT_UPLOADED_BYTES_TOTAL, "Bytes uploaded by checkpoints, by kind (base, delta)."),
    (DEDUPE_IDS, "Message ids in the shard's dedupe window."),
    (DEDUPE_WINDOW_SECONDS, "Stream time the shard's dedupe window covers now."),
    (SUMS_PUSHES_TOTAL, "Pushes of changed sums to the pacers (heartbeats included)."),
    (
        STREAM_INTEGRITY_ERRORS_TOTAL,
        "SPEND found with a retention gap or gone backwards, by kind; the shard stops.",
    ),
    (SPEND_SET_ASIDE_TOTAL, "SPEND messages or tuples set aside (dead lettered), by reason."),
    (AGGREGATOR_OWNED_PARTITIONS, "Partitions this member applies now."),
    (AGGREGATOR_REBALANCES_TOTAL, "Changes of this member's assigned partitions."),
    (
        AGGREGATOR_HANDOVER_SECONDS,
        "Graceful handover time of a partition, by side (take, release).",
    ),
    (
        AGGREGATOR_FAILOVER_SECONDS,
        "From noticing a previous owner's lease gone until the partition applies here.",
    ),
    (AGGREGATOR_LEASES_LOST_TOTAL, "Membership leases this member lost."),
    (PACER_UPDATES_TOTAL, "Sums pushes the pacer received."),
    (
        PACER_STALE_UPDATES_TOTAL,
        "Sums pushes the pacer ignored as older than what it holds (an old owner's).",
    ),
    (PACER_RESYNCS_TOTAL, "Full-state resyncs the pacer asked the aggregators for."),
    (PACER_LAG_SECONDS, "Now minus the watermark of the last sums push received."),
    (
        PACER_FRESHNESS_SECONDS,
        "From the JetStream publish of a push's earliest impression to the pacer holding its sums.",
    ),
    (DECISIONS_TOTAL, "Ad decisions answered."),
    (PACER_STALE_SHARDS, "Shards whose pushes are older than the stale threshold."),
    (PACER_STALE_LIMITS, "Catalog limits that are stale (their ads are not servable)."),
    (
        PACER_INPUT_LAG_SECONDS,
        "How far behind the limiters' input is, as the pacer hears from them.",
    ),
    (PACER_HTTP_REFUSED_TOTAL, "API requests refused, by reason."),
];

/// Give every metric of `descriptions` its `# HELP` text, in the installed
/// recorder. Its kind follows from the naming rule: `_total` a counter, a
/// name of [`HISTOGRAM_BUCKETS`] a histogram, else a gauge.
pub fn describe(descriptions: &[(&'static str, &'static str)]) {
    for &(name, help) in descriptions {
        if name.ends_with("_total") {
            metrics::describe_counter!(name, help);
        } else if HISTOGRAM_BUCKETS.iter().any(|(n, _)| *n == name) {
            metrics::describe_histogram!(name, help);
        } else {
            metrics::describe_gauge!(name, help);
        }
    }
}

/// `builder` with the bucket bounds of [`HISTOGRAM_BUCKETS`].
fn with_histogram_buckets(
    mut builder: PrometheusBuilder,
) -> Result<PrometheusBuilder, metrics_exporter_prometheus::BuildError> {
    for (name, buckets) in HISTOGRAM_BUCKETS {
        builder = builder.set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full((*name).to_string()),
            buckets,
        )?;
    }
    Ok(builder)
}

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

/// Install the global Prometheus recorder. Returns the handle whose
/// `render()` the services serve as `/metrics` on listeners they bound
/// themselves ([`crate::service`]).
pub(crate) fn install_metrics() -> PrometheusHandle {
    let recorder = with_histogram_buckets(PrometheusBuilder::new())
        .expect("every bucket list is non-empty")
        .build_recorder();
    let handle = recorder.handle();
    // Once per process; a second install keeps the first recorder.
    if metrics::set_global_recorder(recorder).is_ok() {
        let _ = HANDLE.set(handle.clone());
        describe(DESCRIPTIONS);
    }
    HANDLE.get().cloned().unwrap_or(handle)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `(const name, metric name)` of every metric name declared here.
    fn declared() -> Vec<(String, String)> {
        include_str!("telemetry.rs")
            .split(';')
            .filter_map(|item| {
                // One line however rustfmt wrapped it.
                let item = item.split_whitespace().collect::<Vec<_>>().join(" ");
                let rest = item
                    .split_once("pub const ")
                    .or_else(|| item.split_once("pub(crate) const "))?
                    .1;
                let (ident, value) = rest.split_once(": &str = \"")?;
                let value = value.strip_suffix('"')?;
                Some((ident.to_string(), value.to_string()))
            })
            .collect()
    }

    #[test]
    fn every_name_follows_the_rule() {
        let names = declared();
        assert!(names.len() >= 35, "found only {} names", names.len());
        assert!(names
            .iter()
            .any(|(i, _)| i == "CHECKPOINT_UPLOADED_BYTES_TOTAL"));
        for (ident, name) in names {
            if name == "adspend_rejected_total" {
                continue;
            }
            let rest = ["limiter", "aggregator", "pacer", "catalog", "nats"]
                .iter()
                .find_map(|c| name.strip_prefix(&format!("adspend_{c}_")));
            let thing = rest.unwrap_or_else(|| panic!("{ident} = {name}: no component"));
            assert!(
                !thing.is_empty() && thing.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{ident} = {name}"
            );
            if ident.ends_with("_TOTAL") {
                assert!(name.ends_with("_total"), "{ident} = {name}");
            }
            if ident.ends_with("_SECONDS") || ident.ends_with("_BYTES") {
                let unit = ident.rsplit('_').next().unwrap().to_ascii_lowercase();
                assert!(name.ends_with(&format!("_{unit}")), "{ident} = {name}");
            }
        }
    }

    #[test]
    fn every_name_has_help() {
        let names = declared();
        for (ident, name) in &names {
            assert!(
                DESCRIPTIONS
                    .iter()
                    .any(|(n, help)| n == name && !help.trim().is_empty()),
                "{ident} = {name} has no description in DESCRIPTIONS"
            );
        }
        for (name, _) in DESCRIPTIONS {
            assert!(
                names.iter().any(|(_, n)| n == name),
                "{name} is described but not declared here"
            );
        }
    }

    #[test]
    fn descriptions_render_as_help_lines() {
        let recorder = with_histogram_buckets(PrometheusBuilder::new())
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            describe(DESCRIPTIONS);
            metrics::counter!(REJECTED_TOTAL, "reason" => "unknown_ad").increment(1);
            metrics::gauge!(PACER_STALE_LIMITS).set(2.0);
            metrics::histogram!(CHECKPOINT_SECONDS).record(0.2);
        });
        let text = handle.render();
        for (name, kind) in [
            (REJECTED_TOTAL, "counter"),
            (PACER_STALE_LIMITS, "gauge"),
            (CHECKPOINT_SECONDS, "histogram"),
        ] {
            let help = DESCRIPTIONS.iter().find(|(n, _)| *n == name).unwrap().1;
            assert!(
                text.contains(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n")),
                "{name}: {text}"
            );
        }
    }

    /// The name consts that `histogram!` calls in the services' sources use.
    fn histograms_used() -> Vec<String> {
        fn walk(dir: &std::path::Path, out: &mut Vec<String>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for (i, m) in text.match_indices("histogram!(") {
                        let after = &text[i + m.len()..];
                        let ident: String = after
                            .trim_start()
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        out.push(ident);
                    }
                }
            }
        }
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut used = Vec::new();
        for krate in ["common", "limiter", "aggregator", "pacer"] {
            walk(&root.join(krate).join("src"), &mut used);
        }
        // Names that are not consts (this module's own tests) are left out.
        used.retain(|ident| {
            !ident.is_empty() && ident.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
        });
        used.sort();
        used.dedup();
        used
    }

    #[test]
    fn every_histogram_has_buckets() {
        let declared = declared();
        let used = histograms_used();
        assert!(used.len() >= 4, "found only {used:?}");
        for ident in used {
            let name = declared
                .iter()
                .find(|(i, _)| *i == ident)
                .map(|(_, n)| n.as_str())
                .unwrap_or_else(|| panic!("histogram {ident} is not declared here"));
            assert!(
                HISTOGRAM_BUCKETS.iter().any(|(n, _)| *n == name),
                "histogram {name} has no buckets in HISTOGRAM_BUCKETS"
            );
        }
        for (name, buckets) in HISTOGRAM_BUCKETS {
            assert!(!buckets.is_empty(), "{name}");
            assert!(
                buckets.windows(2).all(|w| w[0] < w[1]),
                "{name}: bounds not increasing"
            );
        }
    }

    #[test]
    fn histograms_render_as_buckets_not_quantiles() {
        let recorder = with_histogram_buckets(PrometheusBuilder::new())
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            for (name, _) in HISTOGRAM_BUCKETS {
                metrics::histogram!(*name).record(0.2);
            }
        });
        let text = handle.render();
        assert!(!text.contains("quantile="), "{text}");
        for (name, buckets) in HISTOGRAM_BUCKETS {
            assert!(
                text.contains(&format!("# TYPE {name} histogram")),
                "{name}: {text}"
            );
            // 0.2 s falls in every bucket from the first bound at or above it.
            for bound in buckets.iter() {
                let count = u64::from(*bound >= 0.2);
                let line = format!("{name}_bucket{{le=\"{bound}\"}} {count}");
                assert!(text.contains(&line), "missing {line}: {text}");
            }
            assert!(text.contains(&format!("{name}_count 1")), "{name}: {text}");
        }
    }
}
