//! Metric names only the pacer exports (the rule of
//! `adspend_common::telemetry`: `adspend_pacer_<thing>_<unit>`), with their
//! `# HELP` texts, and the bucket bounds of every histogram of the pacer.
//! The budget alerts' and the spend leases' other names are in
//! [`crate::alerts`] and [`crate::leases`]; every histogram is named here,
//! beside its bucket bounds, as the recorder is built from them before any
//! of those starts.

pub(crate) const PACER_UPDATES_TOTAL: &str = "adspend_pacer_updates_total";
pub(crate) const PACER_STALE_UPDATES_TOTAL: &str = "adspend_pacer_stale_updates_total";
pub(crate) const PACER_RESYNCS_TOTAL: &str = "adspend_pacer_resyncs_total";
pub(crate) const PACER_LAG_SECONDS: &str = "adspend_pacer_lag_seconds";
/// Per push with new spend: from the JetStream publish of its earliest
/// impression to the pacer holding the sums (a histogram).
pub(crate) const PACER_FRESHNESS_SECONDS: &str = "adspend_pacer_freshness_seconds";
/// Bucket bounds of [`PACER_FRESHNESS_SECONDS`].
const FRESHNESS_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 30.0,
];
pub(crate) const DECISIONS_TOTAL: &str = "adspend_pacer_decisions_total";
/// Shards with no push (heartbeats included) for `ADSPEND_PACER_STALE_AFTER_MS`.
pub(crate) const PACER_STALE_SHARDS: &str = "adspend_pacer_stale_shards";
/// Catalog limits that are stale (their ads are not servable).
pub(crate) const PACER_STALE_LIMITS: &str = "adspend_pacer_stale_limits";
/// How far behind the limiters' input is (the oldest input waiting, or how
/// long a consumer's limiters have not reported), seconds.
pub(crate) const PACER_INPUT_LAG_SECONDS: &str = "adspend_pacer_input_lag_seconds";
/// API requests refused, by `reason`: `unauthorized` (no or unknown bearer
/// token), `forbidden` (a token of the other scope) or `timeout`.
pub(crate) const PACER_HTTP_REFUSED_TOTAL: &str = "adspend_pacer_http_refused_total";

/// Time to plan and write one batch of lease requests to the ledger (a
/// histogram).
pub(crate) const LEASE_COMMIT_SECONDS: &str = "adspend_pacer_lease_commit_seconds";
/// Bucket bounds of [`LEASE_COMMIT_SECONDS`]: a commit is one
/// JetStream publish, or a few when it loses races to other pacers (it gives
/// up after 3 s of lost races, or after 2 s waiting for a winner's grants).
const LEASE_COMMIT_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// The pacer's histograms with their bucket bounds, for the recorder
/// (`adspend_common::service::Service::HISTOGRAMS`).
pub(crate) const HISTOGRAMS: &[(&str, &[f64])] = &[
    (PACER_FRESHNESS_SECONDS, FRESHNESS_BUCKETS),
    (LEASE_COMMIT_SECONDS, LEASE_COMMIT_BUCKETS),
];

/// The `# HELP` text of the names above, for
/// `adspend_common::telemetry::describe`.
pub(crate) const DESCRIPTIONS: &[(&str, &str)] = &[
    (PACER_UPDATES_TOTAL, "Sums pushes the pacer received."),
    (
        PACER_STALE_UPDATES_TOTAL,
        "Sums pushes the pacer ignored as older than what it holds (an old owner's).",
    ),
    (
        PACER_RESYNCS_TOTAL,
        "Full-state resyncs the pacer asked the aggregators for.",
    ),
    (
        PACER_LAG_SECONDS,
        "Now minus the watermark of the last sums push received.",
    ),
    (
        PACER_FRESHNESS_SECONDS,
        "From the JetStream publish of a push's earliest impression to the pacer holding its sums.",
    ),
    (DECISIONS_TOTAL, "Ad decisions answered."),
    (
        PACER_STALE_SHARDS,
        "Shards whose pushes are older than the stale threshold.",
    ),
    (
        PACER_STALE_LIMITS,
        "Catalog limits that are stale (their ads are not servable).",
    ),
    (
        PACER_INPUT_LAG_SECONDS,
        "How far behind the limiters' input is, as the pacer hears from them.",
    ),
    (PACER_HTTP_REFUSED_TOTAL, "API requests refused, by reason."),
    (
        LEASE_COMMIT_SECONDS,
        "Time to plan and write one batch of lease requests to the ledger.",
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_bounds_increase() {
        for (name, bounds) in HISTOGRAMS {
            assert!(!bounds.is_empty(), "{name}");
            assert!(bounds.windows(2).all(|w| w[0] < w[1]), "{name}");
        }
    }
}
