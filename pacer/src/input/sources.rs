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
use adspend_wire::source_report::{SchedulingMode, SourceReport, SourcesReport};
use futures::StreamExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::error::Error;

/// A report is stale when this many of its intervals passed without another.
pub(crate) const STALE_INTERVALS: u64 = 3;
/// A report this old is dropped: its limiter is gone.
pub(crate) const FORGET_AFTER_MS: i64 = 60_000;
/// Most limiters kept: reports beyond it are dropped (a misconfigured
/// publisher cannot grow the pacer's memory).
pub(crate) const MAX_LIMITERS: usize = 256;

#[derive(Debug, Clone, PartialEq)]
struct Received {
    report: SourcesReport,
    received_ms: i64,
}

/// What became of a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Applied {
    /// Kept: the limiter's first, or newer than the one held.
    Kept,
    /// Older than the one held (sent before it): dropped.
    Older,
    /// A new limiter beyond [`MAX_LIMITERS`]: dropped.
    Full,
}

/// The latest report per limiter, and per consumer what its input lag was
/// last heard to be.
#[derive(Debug, Default)]
pub struct SourceReports {
    latest: HashMap<String, Received>,
    consumers: HashMap<String, ConsumerInput>,
}

/// A consumer's input as last reported by any of its limiters. Never
/// forgotten (a limiter stuck for longer than [`FORGET_AFTER_MS`] must not
/// look fresh again); at most [`MAX_LIMITERS`] are kept, and a pacer
/// restart clears them.
#[derive(Debug, Clone, Copy)]
struct ConsumerInput {
    received_ms: i64,
    interval_ms: u64,
    /// The oldest input waiting, ms, as of the report.
    lag_ms: i64,
}

/// One limiter's latest report as served.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct LimiterView {
    pub(crate) limiter: String,
    pub(crate) consumer: String,
    pub(crate) scheduling: SchedulingMode,
    /// When the limiter sent the report (its clock), unix ms.
    pub(crate) ts_ms: i64,
    /// When the pacer received it (its clock), unix ms.
    pub(crate) received_ms: i64,
    /// Since it was received, ms.
    pub(crate) age_ms: i64,
    /// No newer report for [`STALE_INTERVALS`] intervals: the limiter may
    /// have stopped; the numbers are as of `ts_ms`.
    pub(crate) stale: bool,
    pub(crate) interval_ms: u64,
    pub(crate) window_ms: u64,
    pub(crate) intervening: bool,
    /// By source name.
    pub(crate) sources: Vec<SourceReport>,
}

/// `GET /v1/sources`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct SourcesView {
    /// By limiter name.
    pub(crate) limiters: Vec<LimiterView>,
    pub(crate) stale_intervals: u64,
}

impl SourceReports {
    /// Keep `report` as its limiter's latest, received at `now_ms`.
    pub(crate) fn apply(&mut self, report: SourcesReport, now_ms: i64) -> Applied {
        self.forget_old(now_ms);
        match self.latest.get(&report.limiter) {
            Some(held) if report.ts_ms < held.report.ts_ms => return Applied::Older,
            None if self.latest.len() >= MAX_LIMITERS => return Applied::Full,
            _ => {}
        }
        if self.consumers.len() < MAX_LIMITERS || self.consumers.contains_key(&report.consumer) {
            let lag_seconds = report
                .sources
                .iter()
                .map(|s| s.lag_seconds)
                .fold(0.0, f64::max);
            self.consumers.insert(
                report.consumer.clone(),
                ConsumerInput {
                    received_ms: now_ms,
                    interval_ms: report.interval_ms.max(1),
                    lag_ms: (lag_seconds * 1000.0) as i64,
                },
            );
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

    /// How far behind the limiters' input is at `now_ms`, ms: the worst
    /// over consumers of the oldest input waiting, and, for a consumer
    /// whose reports stopped for [`STALE_INTERVALS`] intervals (a limiter
    /// stuck, cut off or gone with none to take over), the time since its
    /// last report on top. Spend waiting there reaches no aggregator, which
    /// therefore looks caught up: only this tells the pacer that it is not.
    pub(crate) fn input_lag_ms(&self, now_ms: i64) -> i64 {
        self.consumers
            .values()
            .map(|c| {
                let age = now_ms.saturating_sub(c.received_ms).max(0);
                let stopped = age as u64 > c.interval_ms.saturating_mul(STALE_INTERVALS);
                c.lag_ms + if stopped { age } else { 0 }
            })
            .max()
            .unwrap_or(0)
    }

    fn forget_old(&mut self, now_ms: i64) {
        self.latest
            .retain(|_, r| now_ms.saturating_sub(r.received_ms) < FORGET_AFTER_MS);
    }

    /// Every limiter's latest report as of `now_ms`, stale ones marked,
    /// forgotten ones left out.
    pub(crate) fn view(&mut self, now_ms: i64) -> SourcesView {
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

pub(crate) async fn subscribe(
    client: &async_nats::Client,
) -> Result<async_nats::Subscriber, Error> {
    client
        .subscribe(SOURCES_SUBJECT)
        .await
        .map_err(|source| Error::Subscribe {
            subject: SOURCES_SUBJECT.to_string(),
            source,
        })
}

/// Fold the reports into `store` until `cancel`.
pub(crate) async fn run(
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

    #[test]
    fn input_lag_is_the_oldest_waiting_and_grows_from_now_when_reports_stop() {
        let mut store = SourceReports::default();
        assert_eq!(
            store.input_lag_ms(5_000),
            0,
            "no limiter heard: nothing known"
        );
        store.apply(report("l1", 1_000, &[("a", 0.5)]), 1_000);
        let mut lagging = report("l1", 2_000, &[("a", 0.5)]);
        lagging.sources[0].lag_seconds = 0.25;
        store.apply(lagging, 2_000);
        assert_eq!(store.input_lag_ms(2_500), 250);
        assert_eq!(
            store.input_lag_ms(5_000),
            250,
            "three intervals: not yet stopped"
        );
        assert_eq!(
            store.input_lag_ms(5_001),
            250 + 3_001,
            "stopped: lag grows from now"
        );
        // Past the horizon the limiter's view is forgotten, its input not.
        assert_eq!(store.view(70_000).limiters.len(), 0);
        assert_eq!(store.input_lag_ms(70_000), 250 + 68_000);
        // Another limiter of the same consumer takes over: fresh again.
        store.apply(report("l2", 70_000, &[("a", 0.5)]), 70_000);
        assert_eq!(store.input_lag_ms(70_100), 0);
    }

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
