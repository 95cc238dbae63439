//! The ad-server simulator, and what compares the pipeline with it.
//!
//! The simulator: `catalog` generates the catalog document from a
//! seed; `event` writes good, duplicate and bad impressions into NDJSON
//! payloads; `publish` sends them to JetStream with many acks in flight and,
//! for every acknowledged message, feeds its impressions to `truth`, which
//! sums spend per limit and local day: what the pipeline must end up with.
//!
//! The closed loop: `closed_loop` runs simulated ad servers
//! (`loop_server`) that ask the pacer before they serve, by decisions or by
//! spend leases (`loop_lease`: the client crate's lease book, fed the
//! simulator's demand); `loop_publish` publishes what they served
//! and books it into the truth once acknowledged; `loop_watch` polls the
//! pacer meanwhile.

mod catalog;
pub mod check;
pub mod cli;
pub mod closed_loop;
pub mod event;
mod loop_lease;
mod loop_publish;
mod loop_server;
pub mod loop_watch;
mod publish;
pub mod stats;
pub mod stream_truth;
pub mod truth;

use std::time::Duration;

pub use adspend_client::LeasePolicy;
pub use catalog::{generate_catalog, Catalog, CatalogSpec, Limit, Period, MAX_ID_BYTES, ZONES};
pub use closed_loop::{
    run_closed_loop, AdRecord, LeaseCounts, LoopConfig, LoopOutcome, LoopProgress, Traffic,
};
pub use event::{BadKind, CostDistribution, EventTime, InputFormat};
pub use loop_lease::{LeaseMode, ServeMode, LEAD};
pub use publish::{ensure_stream, run, run_with_progress, Progress};
pub use truth::{
    day_key, differences, local_date, Impression, LimitTruth, Recorded, Stats, Truth, TruthBuilder,
};

/// The stream the limiter reads, and the subjects it covers.
pub const STREAM: &str = "IMPRESSIONS";
pub const STREAM_SUBJECTS: &str = "impressions.>";

/// Longest run id: `<run id>-x<u64>` must stay a valid impression id.
pub const MAX_RUN_ID_BYTES: usize = 40;

/// One simulator run. Events stop at `events` or `duration`, whichever comes
/// first; with neither, at cancellation.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// Subject to publish to, under `impressions.`.
    pub subject: String,
    /// Events to send, duplicates and bad ones included.
    pub events: Option<u64>,
    pub duration: Option<Duration>,
    /// Target events per second; 0 = as fast as JetStream acknowledges.
    pub rate: f64,
    /// Zipf exponent of ad popularity; 0 = uniform.
    pub zipf_exponent: f64,
    pub cost: CostDistribution,
    /// Share of events that re-send an earlier impression verbatim.
    pub duplicate_rate: f64,
    /// Share of events that are bad lines, of a kind drawn from `bad_kinds`.
    pub bad_rate: f64,
    pub bad_kinds: Vec<BadKind>,
    /// Events per message (NDJSON); 1 = one JSON object per message.
    pub batch: usize,
    pub event_time: EventTime,
    /// Seeds every random choice of the run; the run id excepted.
    pub seed: u64,
    /// Prefix of impression ids, so runs against one stream never share ids;
    /// `None` draws a random one.
    pub run_id: Option<String>,
    /// Messages published but not yet acknowledged, at most.
    pub in_flight: usize,
    /// How long to wait for a publish ack before counting it failed.
    pub ack_timeout: Duration,
    pub progress_interval: Duration,
    /// Create the `IMPRESSIONS` stream if it is missing.
    pub create_stream: bool,
    /// NDJSON or the binary batch format (which takes no bad events).
    pub format: InputFormat,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            subject: "impressions.sim".to_owned(),
            events: Some(10_000),
            duration: None,
            rate: 0.0,
            zipf_exponent: 1.0,
            cost: CostDistribution::Uniform {
                min: 100,
                max: 5_000_000,
            },
            duplicate_rate: 0.0,
            bad_rate: 0.0,
            bad_kinds: BadKind::ALL.to_vec(),
            batch: 100,
            event_time: EventTime::Now,
            seed: 1,
            run_id: None,
            in_flight: 256,
            ack_timeout: Duration::from_secs(10),
            progress_interval: Duration::from_secs(1),
            create_stream: true,
            format: InputFormat::Ndjson,
        }
    }
}

impl SimConfig {
    /// Every setting checked, with an error naming the bad one.
    pub fn validate(&self) -> anyhow::Result<()> {
        let fail = |msg: String| Err(anyhow::anyhow!(msg));
        let suffix = self.subject.strip_prefix("impressions.").unwrap_or("");
        if suffix.is_empty()
            || suffix.contains(['*', '>', ' ', '\t', '\r', '\n'])
            || suffix.split('.').any(str::is_empty)
        {
            return fail(format!(
                "subject {:?} must be a literal subject impressions.<token>[.<token>…]",
                self.subject
            ));
        }
        if !(self.rate.is_finite() && self.rate >= 0.0) {
            return fail(format!("rate {} must be >= 0", self.rate));
        }
        if !(self.zipf_exponent.is_finite() && self.zipf_exponent >= 0.0) {
            return fail(format!("Zipf exponent {} must be >= 0", self.zipf_exponent));
        }
        for (name, rate) in [("duplicate", self.duplicate_rate), ("bad", self.bad_rate)] {
            if !(0.0..=1.0).contains(&rate) {
                return fail(format!("{name} rate {rate} must be within 0..=1"));
            }
        }
        if self.bad_rate > 0.0 && self.format == InputFormat::Binary {
            return fail("the binary format has no bad events: set the bad rate to 0".to_owned());
        }
        if self.bad_rate > 0.0 && self.bad_kinds.is_empty() {
            return fail("bad rate > 0 needs at least one bad-event kind".to_owned());
        }
        if self.batch == 0 || self.batch > u32::MAX as usize {
            return fail(format!("batch {} must be >= 1", self.batch));
        }
        if self.in_flight == 0 {
            return fail("in-flight window must be >= 1".to_owned());
        }
        if self.ack_timeout.is_zero() {
            return fail("ack timeout must be > 0".to_owned());
        }
        if let EventTime::Range { start_ms, end_ms } = self.event_time {
            if start_ms >= end_ms {
                return fail(format!("event time range {start_ms}..{end_ms} is empty"));
            }
        }
        if let Some(run_id) = &self.run_id {
            check_run_id(run_id)?;
        }
        self.cost.validate().map_err(anyhow::Error::msg)
    }
}

fn check_run_id(run_id: &str) -> anyhow::Result<()> {
    let ok_chars = run_id
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if run_id.is_empty() || run_id.len() > MAX_RUN_ID_BYTES || !ok_chars {
        anyhow::bail!(
            "run id {run_id:?} must be 1..={MAX_RUN_ID_BYTES} characters of [A-Za-z0-9_.-]"
        );
    }
    Ok(())
}

/// `250ms`, `30s`, `5m`, `2h`, `1d`, or bare (possibly fractional) seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (number, unit) = s.split_at(split);
    let value: f64 = number
        .parse()
        .map_err(|_| format!("bad duration {s:?}, expected e.g. 500ms, 30s, 5m, 2h"))?;
    let scale = match unit {
        "ms" => 0.001,
        "" | "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        "d" => 86_400.0,
        _ => {
            return Err(format!(
                "bad duration unit {unit:?} in {s:?}, expected ms, s, m, h or d"
            ))
        }
    };
    Duration::try_from_secs_f64(value * scale).map_err(|e| format!("bad duration {s:?}: {e}"))
}

#[cfg(test)]
mod tests;
