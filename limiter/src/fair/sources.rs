//! What the fair scheduler knows per source, for operators: the gauges
//! `adspend_limiter_source_*` (labelled `source`), and
//! [`super::Scheduler::report`], the view the limiter sends the pacers
//! (`crate::report`).

use std::time::Duration;

use serde::Serialize;

use crate::telemetry::{
    LIMITER_SOURCE_HELD_BACK, LIMITER_SOURCE_LAG_SECONDS, LIMITER_SOURCE_USAGE_SHARE,
};

/// How often the gauges are refreshed (not every round).
pub(super) const PUBLISH_EVERY: Duration = Duration::from_millis(250);

#[derive(Debug, Clone, PartialEq, Serialize)]
pub(crate) struct SourceStat {
    pub(crate) source: String,
    /// Share of the limiter's recent usage (payload bytes over the usage
    /// window), `0..=1`.
    pub(crate) usage_share: f64,
    /// Age of the source's oldest waiting event at the last round.
    pub(crate) lag_seconds: f64,
    /// Payload bytes waiting (an estimate from the last round: the messages
    /// pending times the size of the oldest).
    pub(crate) pending_bytes: u64,
    /// Messages waiting (on the server and buffered here).
    pub(crate) pending_messages: u64,
    /// Given less than it had waiting, so that others got their share.
    pub(crate) held_back: bool,
    /// Input messages and their payload bytes taken since the limiter
    /// started.
    pub(crate) messages_total: u64,
    pub(crate) bytes_total: u64,
}

pub(super) fn publish(stats: &[SourceStat]) {
    for s in stats {
        let label = [("source", s.source.clone())];
        metrics::gauge!(LIMITER_SOURCE_USAGE_SHARE, &label).set(s.usage_share);
        metrics::gauge!(LIMITER_SOURCE_LAG_SECONDS, &label).set(s.lag_seconds);
        metrics::gauge!(LIMITER_SOURCE_HELD_BACK, &label).set(if s.held_back { 1.0 } else { 0.0 });
    }
}

impl super::Scheduler {
    /// Per source as of now (shares and what waits looked at afresh, so an
    /// idle limiter's report decays instead of repeating its last busy
    /// round), and whether the last round intervened. A source stays held
    /// back while the last round held it back and it still has messages
    /// waiting; with nothing waiting anywhere nobody is intervening.
    /// Refreshes the gauges too.
    pub(crate) fn report(&mut self) -> (Vec<SourceStat>, bool) {
        self.refresh(std::time::Instant::now());
        for lane in &mut self.lanes {
            lane.held_back &= lane.pending_messages > 0;
        }
        self.intervening &= self.lanes.iter().any(|l| l.pending_messages > 0);
        let stats = self.stats();
        publish(&stats);
        (stats, self.intervening)
    }
}
