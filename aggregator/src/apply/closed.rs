//! Closed periods: the sums of a period bucket that ended more than
//! `ADSPEND_CLOSED_PERIOD_DAYS` ago leave the store, and with it every later
//! snapshot and push. A late tuple for such a bucket still adds to its
//! limit's lifetime sum; its bucket part is counted in
//! [`CLOSED_PERIOD_TUPLES_TOTAL`] and [`CLOSED_PERIOD_MICROS_TOTAL`] and
//! reported in a WARN line at most once a minute per shard.
//!
//! The clock is the stream's, not a wall clock: the running maximum of the
//! JetStream publish times of the `SPEND` messages applied, stored with
//! each commit ([`PeriodClock`]). A tuple's bucket is closed when the clock
//! *as of its own message* is past the bucket's end, so the decision
//! depends only on the stream's content and order, never on how messages
//! were grouped, on when a replica applies them, or on its wall clock: a
//! replay from any checkpoint decides every tuple as the first pass did.
//!
//! The aggregator does not know a limit's time zone, only its bucket (a
//! local date); a bucket's end is taken as the end of that date in the
//! westernmost zone, rounded up to a whole UTC day: `(bucket + 2)` days
//! after the epoch. A bucket is closed once the clock reaches that end plus
//! the setting's days.

use std::time::{Duration, Instant};

use heed::RwTxn;

use super::Writer;
use crate::error::Error;
use crate::store::PeriodClock;
use crate::telemetry::{CLOSED_PERIOD_MICROS_TOTAL, CLOSED_PERIOD_TUPLES_TOTAL};

const DAY_MS: u64 = 86_400_000;

/// Default of `ADSPEND_CLOSED_PERIOD_DAYS`.
pub(crate) const DEFAULT_CLOSED_PERIOD_DAYS: u64 = 35;

/// Least time between two WARN lines of one shard about late tuples.
const REPORT_EVERY: Duration = Duration::from_secs(60);

/// The first bucket still open at stream time `clock_ms`: every bucket below
/// it is closed.
pub(crate) fn closed_below(clock_ms: u64, closed_days: u64) -> u32 {
    let day = clock_ms / DAY_MS;
    let below = day.saturating_sub(1).saturating_sub(closed_days);
    u32::try_from(below).unwrap_or(u32::MAX - 1)
}

/// Late tuples of closed periods not yet reported in a log line.
#[derive(Debug)]
pub(crate) struct LateReport {
    tuples: u64,
    micros: u64,
    oldest_bucket: u32,
    last_line: Option<Instant>,
}

impl Default for LateReport {
    fn default() -> Self {
        LateReport {
            tuples: 0,
            micros: 0,
            oldest_bucket: u32::MAX,
            last_line: None,
        }
    }
}

impl LateReport {
    /// Count one group's late tuples (committed) and log them, with what
    /// was held back since the last line, if a line is due.
    pub(super) fn add(&mut self, shard: &str, tuples: u64, micros: u64, oldest: u32, open: u32) {
        if tuples == 0 {
            return;
        }
        metrics::counter!(CLOSED_PERIOD_TUPLES_TOTAL, "shard" => shard.to_string())
            .increment(tuples);
        metrics::counter!(CLOSED_PERIOD_MICROS_TOTAL, "shard" => shard.to_string())
            .increment(micros);
        self.tuples += tuples;
        self.micros = self.micros.saturating_add(micros);
        self.oldest_bucket = self.oldest_bucket.min(oldest);
        if self
            .last_line
            .is_some_and(|last| last.elapsed() < REPORT_EVERY)
        {
            return;
        }
        self.last_line = Some(Instant::now());
        tracing::warn!(
            shard,
            tuples = self.tuples,
            micros = self.micros,
            oldest_bucket = %bucket_name(self.oldest_bucket),
            first_open_bucket = %bucket_name(open),
            "spend for closed periods: added to the limits' lifetime sums only \
             (their period sums were dropped; ADSPEND_CLOSED_PERIOD_DAYS); \
             counts since the last such line"
        );
        self.tuples = 0;
        self.micros = 0;
        self.oldest_bucket = u32::MAX;
    }
}

/// A bucket as its date, for log lines.
fn bucket_name(bucket: u32) -> String {
    adspend_wire::catalog::bucket_date(bucket)
        .map_or_else(|| bucket.to_string(), |date| date.to_string())
}

impl Writer {
    /// Delete the sums of the buckets that closed since the last pass, if
    /// the clock `clock` closed any, and store the clock; returns it and how
    /// many sums went.
    pub(super) fn drop_closed(
        &mut self,
        wtxn: &mut RwTxn<'_>,
        clock: u64,
    ) -> Result<(PeriodClock, u64), Error> {
        let below = closed_below(clock, self.closed_days);
        let deleted = if below > self.period_clock.closed_below {
            self.store.delete_sums_below(wtxn, below)?
        } else {
            0
        };
        let clock = PeriodClock {
            stream_clock_ms: clock,
            // Lower than before only if the setting grew: the store holds
            // no sum below either.
            closed_below: below,
        };
        self.store.set_period_clock(wtxn, clock)?;
        Ok((clock, deleted))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bucket_closes_two_days_plus_the_setting_after_its_date() {
        // Day 100 (a local date) ends at the latest at the start of UTC
        // day 102; closed 35 days after that.
        let closes = (100 + 2 + 35) * DAY_MS;
        assert_eq!(closed_below(closes - 1, 35), 100);
        assert_eq!(closed_below(closes, 35), 101);
        assert_eq!(closed_below(0, 35), 0);
        assert_eq!(closed_below(u64::MAX, 0), u32::MAX - 1);
    }
}
