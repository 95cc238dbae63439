//! The limiter's per-source report to the pacers: every [`REPORT_EVERY`],
//! a [`SourcesReport`] on core NATS `adspend.sources` (fire and forget: it
//! is a view for operators, a lost one is replaced a second later).
//!
//! With fair scheduling it lists every source lane; with FIFO scheduling
//! there are no sources to tell apart, and the report says so (mode
//! `fifo`, no sources), so that the dashboard can tell "FIFO" from "no
//! limiter reports".

use std::collections::HashMap;
use std::time::{Duration, Instant};

use adspend_common::nats::SOURCES_SUBJECT;
use adspend_common::now_ms;
use adspend_wire::source_report::{SchedulingMode, SourceReport, SourcesReport};

use crate::config::Scheduling;
use crate::fair::{SourceStat, USAGE_WINDOW};

/// How often a report is sent.
pub(crate) const REPORT_EVERY: Duration = Duration::from_secs(1);
/// Longest wait for a report to be handed to the connection.
const PUBLISH_TIMEOUT: Duration = Duration::from_millis(500);

/// Builds the reports: the rates need the totals of the previous one.
pub(crate) struct Reporter {
    limiter: String,
    consumer: String,
    scheduling: SchedulingMode,
    /// Per source: (messages, bytes) taken as of the previous report.
    previous: HashMap<String, (u64, u64)>,
    previous_at: Option<Instant>,
    warned: bool,
}

impl Reporter {
    pub(crate) fn new(consumer: &str, scheduling: Scheduling) -> Reporter {
        Reporter {
            limiter: limiter_name(),
            consumer: consumer.to_string(),
            scheduling: match scheduling {
                Scheduling::Fair => SchedulingMode::Fair,
                Scheduling::Fifo => SchedulingMode::Fifo,
            },
            previous: HashMap::new(),
            previous_at: None,
            warned: false,
        }
    }

    /// The report of `stats` (`None`: FIFO scheduling) taken at `now`.
    pub(crate) fn build(
        &mut self,
        stats: Option<(Vec<SourceStat>, bool)>,
        now: Instant,
        ts_ms: i64,
    ) -> SourcesReport {
        let elapsed = self
            .previous_at
            .map(|at| now.saturating_duration_since(at).as_secs_f64())
            .filter(|&s| s > 0.0);
        self.previous_at = Some(now);
        let (stats, intervening) = stats.unwrap_or_default();
        let sources = stats
            .into_iter()
            .map(|s| {
                let (messages, bytes) = self
                    .previous
                    .insert(s.source.clone(), (s.messages_total, s.bytes_total))
                    .unwrap_or((s.messages_total, s.bytes_total));
                // Without a previous report there is no interval to divide by.
                let rate = |now: u64, then: u64| match elapsed {
                    Some(seconds) => now.saturating_sub(then) as f64 / seconds,
                    None => 0.0,
                };
                SourceReport {
                    messages_per_second: rate(s.messages_total, messages),
                    bytes_per_second: rate(s.bytes_total, bytes),
                    usage_share: s.usage_share.clamp(0.0, 1.0),
                    lag_seconds: s.lag_seconds.max(0.0),
                    held_back: s.held_back,
                    pending_messages: s.pending_messages,
                    pending_bytes: s.pending_bytes,
                    messages_total: s.messages_total,
                    source: s.source,
                }
            })
            .collect();
        SourcesReport {
            limiter: self.limiter.clone(),
            consumer: self.consumer.clone(),
            scheduling: self.scheduling,
            ts_ms,
            interval_ms: REPORT_EVERY.as_millis() as u64,
            window_ms: USAGE_WINDOW.as_millis() as u64,
            intervening,
            sources,
        }
    }

    /// Build and send a report; a failure is logged once and otherwise
    /// ignored (the next report follows).
    pub(crate) async fn send(
        &mut self,
        client: &async_nats::Client,
        stats: Option<(Vec<SourceStat>, bool)>,
    ) {
        let report = self.build(stats, Instant::now(), now_ms());
        let publish = client.publish(SOURCES_SUBJECT, report.encode().into());
        let failure = match tokio::time::timeout(PUBLISH_TIMEOUT, publish).await {
            Ok(Ok(())) => return,
            Ok(Err(e)) => e.to_string(),
            Err(_) => "timed out".to_string(),
        };
        if !self.warned {
            self.warned = true;
            tracing::warn!(
                error = failure,
                subject = SOURCES_SUBJECT,
                "sources report not sent; later failures are not logged"
            );
        }
    }
}

/// `<host name>:<pid>`: tells apart the limiters of a deployment, and a
/// restarted one from its predecessor.
fn limiter_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "limiter".to_string());
    format!("{host}:{}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stat(source: &str, messages_total: u64, bytes_total: u64) -> SourceStat {
        SourceStat {
            source: source.into(),
            usage_share: 0.5,
            lag_seconds: 0.2,
            pending_bytes: 100,
            pending_messages: 1,
            held_back: true,
            messages_total,
            bytes_total,
        }
    }

    #[test]
    fn rates_are_per_second_since_the_previous_report() {
        let mut reporter = Reporter::new("limiter", Scheduling::Fair);
        let t0 = Instant::now();
        let first = reporter.build(Some((vec![stat("a", 10, 1_000)], true)), t0, 1);
        assert_eq!(first.scheduling, SchedulingMode::Fair);
        assert!(first.intervening);
        assert_eq!(first.sources[0].messages_per_second, 0.0, "no interval yet");
        assert_eq!(first.sources[0].messages_total, 10);
        assert!(first.sources[0].held_back);

        let t1 = t0 + Duration::from_millis(500);
        let second = reporter.build(
            Some((vec![stat("a", 20, 3_000), stat("b", 4, 40)], false)),
            t1,
            2,
        );
        assert_eq!(second.sources[0].messages_per_second, 20.0);
        assert_eq!(second.sources[0].bytes_per_second, 4_000.0);
        // A source new since the previous report starts from its totals.
        assert_eq!(second.sources[1].messages_per_second, 0.0);
        assert!(!second.intervening);
        assert_eq!(second.interval_ms, 1_000);
        assert!(second
            .limiter
            .ends_with(&format!(":{}", std::process::id())));
        // It decodes as the pacer decodes it.
        assert_eq!(SourcesReport::decode(&second.encode()).unwrap(), second);
    }

    #[test]
    fn fifo_scheduling_reports_its_mode_and_no_sources() {
        let mut reporter = Reporter::new("limiter", Scheduling::Fifo);
        let report = reporter.build(None, Instant::now(), 1);
        assert_eq!(report.scheduling, SchedulingMode::Fifo);
        assert!(report.sources.is_empty());
        assert!(!report.intervening);
    }
}
