//! The limiter's per-source report (limiter → pacer, core NATS subject
//! `adspend.sources`, `adspend_common::nats::SOURCES_SUBJECT`; compact JSON,
//! about once a second):
//! how the fair scheduler shares the limiter among the sources of
//! `IMPRESSIONS`, for the pacer's `/v1/sources` and its dashboard.
//!
//! A report replaces the previous one of the same limiter; it is a view
//! for operators, never an input to spend or pacing, so a lost report
//! costs nothing but a late refresh.

use serde::{Deserialize, Serialize};

/// How the limiter pulls its input (`ADSPEND_LIMITER_SCHEDULING`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SchedulingMode {
    /// One lane per source; the report lists them.
    Fair,
    /// One consumer in stream order: no per-source view, `sources` is empty.
    Fifo,
}

/// One limiter's report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourcesReport {
    /// The limiter process: `<host name>:<pid>` (a restarted limiter is a
    /// new one; the old one's last report goes stale).
    pub limiter: String,
    /// Its durable consumer name (`ADSPEND_LIMITER_CONSUMER`): limiters of
    /// one deployment share it and its lanes.
    pub consumer: String,
    pub scheduling: SchedulingMode,
    /// When the limiter sent it, unix ms (its clock).
    pub ts_ms: i64,
    /// How often it reports, ms: a report older than a few intervals is stale.
    pub interval_ms: u64,
    /// The window the usage shares are measured over, ms.
    pub window_ms: u64,
    /// The last round enforced the fair order (some source was a victim).
    pub intervening: bool,
    pub sources: Vec<SourceReport>,
}

/// One source (the subject token after `impressions.`) as one limiter sees it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct SourceReport {
    pub source: String,
    /// Share of this limiter's usage (payload bytes) over the window,
    /// `0..=1`; the shares of one report sum to 1 while the limiter has
    /// handled anything in the window, to 0 when idle.
    pub usage_share: f64,
    /// Age of the source's oldest waiting message, seconds; 0 when nothing
    /// waits.
    pub lag_seconds: f64,
    /// Given less than it had waiting in the last round, so that others got
    /// their fair share.
    pub held_back: bool,
    /// Messages waiting (on the server and buffered in the limiter), as of
    /// the report.
    pub pending_messages: u64,
    /// Payload bytes waiting (an estimate: the messages waiting times the
    /// size of the oldest).
    pub pending_bytes: u64,
    /// Input messages taken from the source since the limiter started.
    pub messages_total: u64,
    /// Input messages per second since the previous report.
    pub messages_per_second: f64,
    /// Payload bytes per second since the previous report.
    pub bytes_per_second: f64,
}

/// Largest report accepted: far above a thousand sources.
pub(crate) const MAX_REPORT_BYTES: usize = 512 * 1024;

impl SourcesReport {
    pub fn encode(&self) -> Vec<u8> {
        // Plain data: serializing it cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Decodes a report, refusing what no limiter sends (non-finite or
    /// out-of-range numbers, a negative time, an empty limiter name).
    pub fn decode(payload: &[u8]) -> Result<SourcesReport, crate::Error> {
        let refuse = |reason: String| crate::Error::Decode {
            what: "sources report",
            reason,
        };
        if payload.len() > MAX_REPORT_BYTES {
            return Err(refuse(format!("{} bytes", payload.len())));
        }
        let report: SourcesReport =
            serde_json::from_slice(payload).map_err(|e| refuse(e.to_string()))?;
        if report.limiter.is_empty() {
            return Err(refuse("no limiter name".into()));
        }
        if report.ts_ms < 0 {
            return Err(refuse(format!("negative ts_ms {}", report.ts_ms)));
        }
        for s in &report.sources {
            let finite_non_negative = [
                s.lag_seconds,
                s.messages_per_second,
                s.bytes_per_second,
                s.usage_share,
            ]
            .iter()
            .all(|v| v.is_finite() && *v >= 0.0);
            if !finite_non_negative || s.usage_share > 1.0 + 1e-9 {
                return Err(refuse(format!("source {:?}: bad numbers", s.source)));
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> SourcesReport {
        SourcesReport {
            limiter: "host:1".into(),
            consumer: "limiter".into(),
            scheduling: SchedulingMode::Fair,
            ts_ms: 1_700_000_000_000,
            interval_ms: 1000,
            window_ms: 5000,
            intervening: true,
            sources: vec![SourceReport {
                source: "a".into(),
                usage_share: 1.0,
                lag_seconds: 0.25,
                held_back: true,
                pending_messages: 3,
                pending_bytes: 300,
                messages_total: 10,
                messages_per_second: 10.0,
                bytes_per_second: 1000.0,
            }],
        }
    }

    #[test]
    fn round_trips_and_refuses_what_no_limiter_sends() {
        let good = report();
        let bytes = good.encode();
        assert!(String::from_utf8_lossy(&bytes).contains(r#""scheduling":"fair""#));
        assert_eq!(SourcesReport::decode(&bytes).unwrap(), good);

        let mut bad = report();
        bad.sources[0].usage_share = 1.5;
        assert!(SourcesReport::decode(&bad.encode()).is_err());
        let mut bad = report();
        bad.sources[0].lag_seconds = -1.0;
        assert!(SourcesReport::decode(&bad.encode()).is_err());
        let mut bad = report();
        bad.limiter.clear();
        assert!(SourcesReport::decode(&bad.encode()).is_err());
        let mut bad = report();
        bad.ts_ms = -1;
        assert!(SourcesReport::decode(&bad.encode()).is_err());
        // NaN does not survive JSON at all.
        assert!(SourcesReport::decode(br#"{"limiter":"x"}"#).is_err());
        assert!(SourcesReport::decode(&vec![b' '; MAX_REPORT_BYTES + 1]).is_err());
    }
}
