//! The limiters' per-source reports (`adspend.sources`), kept for
//! `GET /v1/sources` and the dashboard's Sources panel.
//!
//! The latest report of each limiter is kept (a newer one replaces it, an
//! older one arriving late is dropped); a report not followed by another
//! within [`STALE_INTERVALS`] of its interval is served marked `stale`, and
//! one older than [`FORGET_AFTER_MS`] is forgotten (a stopped or
//! restarted limiter's). Ages are measured on the pacer's clock, from
//! arrival, so a limiter's clock skew does not make it stale.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use adspend_common::nats::SOURCES_SUBJECT;
use adspend_common::source_report::{SchedulingMode, SourceReport, SourcesReport};
use futures::StreamExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::error::Error;

/// A report is stale when this many of its intervals passed without another.
pub const STALE_INTERVALS: u64 = 3;
/// A report this old is dropped: its limiter is gone.
pub const FORGET_AFTER_MS: i64 = 60_000;
/// Most limiters kept: reports beyond it are dropped (a misconfigured
/// publisher cannot grow the pacer's memory).
pub const MAX_LIMITERS: usize = 256;

#[derive(Debug, Clone, PartialEq)]
struct Received {
    report: SourcesReport,
    received_ms: i64,
}

/// What became of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    /// Kept: the limiter's first, or newer than the one held.
    Kept,
    /// Older than the one held (sent before it): dropped.
    Older,
    /// A new limiter beyond [`MAX_LIMITERS`]: dropped.
    Full,
}

/// The latest report per limiter.
#[derive(Debug, Default)]
pub struct SourceReports {
    latest: HashMap<String, Received>,
}

/// One limiter's latest report as served.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LimiterView {
    pub limiter: String,
    pub consumer: String,
    pub scheduling: SchedulingMode,
    /// When the limiter sent the report (its clock), unix ms.
    pub ts_ms: i64,
    /// When the pacer received it (its clock), unix ms.
    pub received_ms: i64,
    /// Since it was received, ms.
    pub age_ms: i64,
    /// No newer report for [`STALE_INTERVALS`] intervals: the limiter may
    /// have stopped; the numbers are as of `ts_ms`.
    pub stale: bool,
    pub interval_ms: u64,
    pub window_ms: u64,
    pub intervening: bool,
    /// By source name.
    pub sources: Vec<SourceReport>,
}

/// `GET /v1/sources`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SourcesView {
    /// By limiter name.
    pub limiters: Vec<LimiterView>,
    pub stale_intervals: u64,
}

impl SourceReports {
    /// Keep `report` as its limiter's latest, received at `now_ms`.
    pub fn apply(&mut self, report: SourcesReport, now_ms: i64) -> Applied {
        self.forget_old(now_ms);
        match self.latest.get(&report.limiter) {
            Some(held) if report.ts_ms < held.report.ts_ms => return Applied::Older,
            None if self.latest.len() >= MAX_LIMITERS => return Applied::Full,
            _ => {}
        }
        self.latest.insert(
            report.limiter.clone(),
            Received {
                report,
                received_ms: now_ms,
            },
        );
        Applied::Kept
    }

    fn forget_old(&mut self, now_ms: i64) {
        self.latest
            .retain(|_, r| now_ms.saturating_sub(r.received_ms) < FORGET_AFTER_MS);
    }

    /// Every limiter's latest report as of `now_ms`, stale ones marked,
    /// forgotten ones left out.
    pub fn view(&mut self, now_ms: i64) -> SourcesView {
        self.forget_old(now_ms);
        let mut limiters: Vec<LimiterView> = self
            .latest
            .values()
            .map(|r| {
                let age_ms = now_ms.saturating_sub(r.received_ms).max(0);
                let interval = r.report.interval_ms.max(1);
                let mut sources = r.report.sources.clone();
                sources.sort_by(|a, b| a.source.cmp(&b.source));
                LimiterView {
                    limiter: r.report.limiter.clone(),
                    consumer: r.report.consumer.clone(),
                    scheduling: r.report.scheduling,
                    ts_ms: r.report.ts_ms,
                    received_ms: r.received_ms,
                    age_ms,
                    stale: age_ms as u64 > interval.saturating_mul(STALE_INTERVALS),
                    interval_ms: r.report.interval_ms,
                    window_ms: r.report.window_ms,
                    intervening: r.report.intervening,
                    sources,
                }
            })
            .collect();
        limiters.sort_by(|a, b| a.limiter.cmp(&b.limiter));
        SourcesView {
            limiters,
            stale_intervals: STALE_INTERVALS,
        }
    }
}

pub async fn subscribe(client: &async_nats::Client) -> Result<async_nats::Subscriber, Error> {
    client
        .subscribe(SOURCES_SUBJECT)
        .await
        .map_err(|source| Error::Subscribe {
            subject: SOURCES_SUBJECT.to_string(),
            source,
        })
}

/// Fold the reports into `store` until `cancel`.
pub async fn run(
    mut reports: async_nats::Subscriber,
    store: Arc<Mutex<SourceReports>>,
    cancel: CancellationToken,
) {
    let mut warned = false;
    loop {
        let message = tokio::select! {
            _ = cancel.cancelled() => return,
            message = reports.next() => match message {
                Some(message) => message,
                None => return,
            },
        };
        match SourcesReport::decode(&message.payload) {
            Ok(report) => {
                let now = adspend_common::now_ms();
                let applied = store
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .apply(report, now);
                if applied == Applied::Full && !warned {
                    warned = true;
                    tracing::warn!(
                        max = MAX_LIMITERS,
                        "too many limiters report their sources; the newest are left out"
                    );
                }
            }
            // Once: a wrong publisher would repeat every second.
            Err(e) if !warned => {
                warned = true;
                tracing::warn!(error = %e, subject = %message.subject, "undecodable sources report dropped");
            }
            Err(_) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(limiter: &str, ts_ms: i64, sources: &[(&str, f64)]) -> SourcesReport {
        SourcesReport {
            limiter: limiter.into(),
            consumer: "limiter".into(),
            scheduling: SchedulingMode::Fair,
            ts_ms,
            interval_ms: 1_000,
            window_ms: 5_000,
            intervening: false,
            sources: sources
                .iter()
                .map(|&(source, usage_share)| SourceReport {
                    source: source.into(),
                    usage_share,
                    lag_seconds: 0.0,
                    held_back: false,
                    pending_messages: 0,
                    pending_bytes: 0,
                    messages_total: 0,
                    messages_per_second: 0.0,
                    bytes_per_second: 0.0,
                })
                .collect(),
        }
    }

    fn shares(view: &LimiterView) -> Vec<(&str, f64)> {
        view.sources
            .iter()
            .map(|s| (s.source.as_str(), s.usage_share))
            .collect()
    }

    #[test]
    fn a_newer_report_replaces_the_held_one_and_an_older_one_is_dropped() {
        let mut store = SourceReports::default();
        let t = 1_700_000_000_000;
        assert_eq!(
            store.apply(report("l1", t, &[("b", 0.25), ("a", 0.75)]), t),
            Applied::Kept
        );
        let view = store.view(t);
        assert_eq!(view.limiters.len(), 1);
        // Sources by name.
        assert_eq!(shares(&view.limiters[0]), vec![("a", 0.75), ("b", 0.25)]);

        assert_eq!(
            store.apply(report("l1", t + 1_000, &[("a", 1.0)]), t + 1_000),
            Applied::Kept
        );
        // Sent before the held one, arriving after it.
        assert_eq!(
            store.apply(report("l1", t + 500, &[("c", 1.0)]), t + 1_100),
            Applied::Older
        );
        let view = store.view(t + 1_100);
        assert_eq!(view.limiters.len(), 1);
        assert_eq!(shares(&view.limiters[0]), vec![("a", 1.0)]);
        assert_eq!(view.limiters[0].ts_ms, t + 1_000);
        assert_eq!(view.limiters[0].age_ms, 100);

        // Another limiter is kept beside it; limiters by name.
        store.apply(report("l0", t + 1_200, &[("c", 1.0)]), t + 1_200);
        let view = store.view(t + 1_200);
        let names: Vec<&str> = view.limiters.iter().map(|l| l.limiter.as_str()).collect();
        assert_eq!(names, vec!["l0", "l1"]);
    }

    #[test]
    fn a_silent_limiter_goes_stale_then_is_forgotten() {
        let mut store = SourceReports::default();
        let t = 1_700_000_000_000;
        store.apply(report("l1", t, &[("a", 1.0)]), t);
        let at = |store: &mut SourceReports, ms: i64| store.view(t + ms).limiters;
        assert!(!at(&mut store, 3_000)[0].stale, "three intervals: not yet");
        assert!(at(&mut store, 3_001)[0].stale);
        assert_eq!(at(&mut store, 3_001)[0].age_ms, 3_001);
        assert_eq!(at(&mut store, FORGET_AFTER_MS - 1).len(), 1);
        assert!(at(&mut store, FORGET_AFTER_MS).is_empty(), "forgotten");
        // A report after that is the limiter's first again.
        store.apply(report("l1", t, &[("a", 1.0)]), t + FORGET_AFTER_MS + 1);
        let fresh = at(&mut store, FORGET_AFTER_MS + 1);
        assert_eq!(fresh.len(), 1);
        assert!(!fresh[0].stale);

        // Staleness follows the report's own interval, and a report's
        // clock ahead of the pacer's does not make it fresh or stale.
        let mut slow = report("l2", t + 3_600_000, &[]);
        slow.interval_ms = 10_000;
        store.apply(slow, t);
        let l2 = |store: &mut SourceReports, ms: i64| {
            store
                .view(t + ms)
                .limiters
                .into_iter()
                .find(|l| l.limiter == "l2")
                .unwrap()
        };
        assert!(!l2(&mut store, 29_000).stale);
        assert!(l2(&mut store, 30_001).stale);
    }

    #[test]
    fn limiters_beyond_the_cap_are_dropped_until_one_is_forgotten() {
        let mut store = SourceReports::default();
        let t = 1_700_000_000_000;
        for i in 0..MAX_LIMITERS {
            assert_eq!(
                store.apply(report(&format!("l{i}"), t, &[]), t),
                Applied::Kept
            );
        }
        assert_eq!(store.apply(report("new", t, &[]), t), Applied::Full);
        // A held limiter still reports.
        assert_eq!(store.apply(report("l0", t + 1, &[]), t + 1), Applied::Kept);
        let later = t + FORGET_AFTER_MS;
        assert_eq!(store.apply(report("new", later, &[]), later), Applied::Kept);
        let names: Vec<String> = store
            .view(later)
            .limiters
            .into_iter()
            .map(|l| l.limiter)
            .collect();
        assert_eq!(names, vec!["l0".to_string(), "new".to_string()]);
    }
}
