//! Spend state as pushed by the aggregators.
//!
//! Pushes carry absolute sums stamped with (owner epoch, stream sequence). A
//! push from an epoch older than the newest seen for its shard is a fenced
//! owner's and is dropped; an entry older (by sequence) than what is held is
//! dropped too. Both owners of a shard compute the same sums for the same
//! sequence (the log and the dedupe rules are deterministic), so comparing
//! sequences is enough to never go backwards while a new owner catches up.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use adspend_common::types::{SumsUpdate, LIFETIME_BUCKET};

use crate::controller::Controller;
use crate::shape::TrafficShape;

/// Buckets kept per limit: today in any zone plus a little history.
const BUCKETS_KEPT: usize = 4;

#[derive(Debug, Default, Clone)]
pub struct LimitSums {
    pub lifetime_micros: u64,
    pub buckets: BTreeMap<u32, u64>,
    pub seq: u64,
    pub shard: Option<Arc<str>>,
    /// Smoothed lifetime spend rate, micros per millisecond.
    pub rate_per_ms: f64,
    /// Recent peak of the spend rate (decays slowly): what the lag guard
    /// assumes is in flight, since traffic can rise within the lag.
    pub peak_rate_per_ms: f64,
    last_change_ms: i64,
    pub lifetime_events: u64,
    /// Smoothed cost of one event, micros.
    pub avg_cost: f64,
    /// Largest average event cost seen in one push, micros.
    pub max_cost: u64,
}

#[derive(Debug, Default, Clone)]
pub struct ShardState {
    pub epoch: u64,
    pub push_seq: u64,
    pub seq: u64,
    pub watermark_ms: i64,
    /// Freshness: arrival time minus the earliest source publish time.
    pub lag_ms: i64,
    pub updated_ms: i64,
}

/// Freshness samples (arrival minus source publish time) over a window, and
/// their p99, recomputed at most once a second as samples arrive: the lag
/// guard reads it for every limit of every decision, so reading must not sort.
#[derive(Debug, Default)]
pub struct LagWindow {
    samples: VecDeque<(i64, i64)>,
    p99_ms: i64,
    /// When `p99_ms` was last computed (unix ms); 0 = never.
    computed_ms: i64,
}

const LAG_WINDOW_MS: i64 = 300_000;
const LAG_SAMPLES: usize = 10_000;
const LAG_P99_EVERY_MS: i64 = 1_000;

impl LagWindow {
    pub fn record(&mut self, now_ms: i64, lag_ms: i64) {
        self.samples.push_back((now_ms, lag_ms.max(0)));
        while self
            .samples
            .front()
            .is_some_and(|(t, _)| now_ms - t > LAG_WINDOW_MS)
            || self.samples.len() > LAG_SAMPLES
        {
            self.samples.pop_front();
        }
        if self.computed_ms == 0 || now_ms - self.computed_ms >= LAG_P99_EVERY_MS {
            self.p99_ms = self.compute_p99();
            self.computed_ms = now_ms;
        }
    }

    /// p99 of the window's samples (the last five minutes, at most 10,000
    /// of them) as of the last recomputation; 0 with none.
    pub fn p99(&self) -> i64 {
        self.p99_ms
    }

    fn compute_p99(&self) -> i64 {
        let mut lags: Vec<i64> = self.samples.iter().map(|(_, l)| *l).collect();
        if lags.is_empty() {
            return 0;
        }
        let rank = ((lags.len() as f64 * 0.99).ceil() as usize).clamp(1, lags.len()) - 1;
        *lags.select_nth_unstable(rank).1
    }
}

/// A point of a limit's history, for the dashboard.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Point {
    pub t: i64,
    pub spend_micros: u64,
    pub plan_micros: u64,
    pub multiplier: f64,
}

/// Per-limit pacing state the tick maintains.
#[derive(Debug, Default, Clone)]
pub struct Pacing {
    pub controller: Controller,
    /// Period bucket the controller is running for; a new period resets it.
    pub bucket: u32,
    pub history: Vec<Point>,
}

#[derive(Debug, Default)]
pub struct SpendState {
    pub limits: HashMap<String, LimitSums>,
    pub shards: HashMap<Arc<str>, ShardState>,
    pub lag: LagWindow,
    pub shape: TrafficShape,
    pub pacing: HashMap<Arc<str>, Pacing>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum Applied {
    Ok,
    /// From a fenced (older) epoch: dropped.
    Stale,
    /// Applied, but pushes were missed: the caller should ask for a resync.
    Gap,
}

impl SpendState {
    /// Fold in a push. New events per limit are appended to `arrivals` (for
    /// the traffic shape).
    pub fn apply(&mut self, update: &SumsUpdate, now_ms: i64) -> Applied {
        self.apply_with_arrivals(update, now_ms, &mut Vec::new())
    }

    pub fn apply_with_arrivals(
        &mut self,
        update: &SumsUpdate,
        now_ms: i64,
        arrivals: &mut Vec<(String, u64)>,
    ) -> Applied {
        let shard: Arc<str> = match self.shards.get_key_value(update.shard.as_str()) {
            Some((k, _)) => k.clone(),
            None => Arc::from(update.shard.as_str()),
        };
        let state = self.shards.entry(shard.clone()).or_default();
        if update.epoch < state.epoch {
            return Applied::Stale;
        }
        let gap = update.epoch == state.epoch
            && state.push_seq != 0
            && update.push_seq != state.push_seq + 1;
        if update.epoch > state.epoch {
            state.epoch = update.epoch;
        }
        state.push_seq = update.push_seq;
        if update.seq >= state.seq {
            state.seq = update.seq;
            state.watermark_ms = state.watermark_ms.max(update.watermark_ms);
        }
        if !update.entries.is_empty() {
            state.lag_ms = (now_ms - update.source_ms).max(0);
            self.lag.record(now_ms, state.lag_ms);
        }
        state.updated_ms = now_ms;
        for entry in &update.entries {
            let sums = self.limits.entry(entry.limit.clone()).or_default();
            if update.seq < sums.seq {
                continue;
            }
            if entry.lifetime_events > sums.lifetime_events
                && entry.lifetime_micros >= sums.lifetime_micros
            {
                let events = entry.lifetime_events - sums.lifetime_events;
                let cost = (entry.lifetime_micros - sums.lifetime_micros) as f64 / events as f64;
                sums.avg_cost = if sums.lifetime_events == 0 {
                    cost
                } else {
                    0.9 * sums.avg_cost + 0.1 * cost
                };
                sums.max_cost = sums.max_cost.max(cost.ceil() as u64);
                arrivals.push((entry.limit.clone(), events));
                sums.lifetime_events = entry.lifetime_events;
            }
            if entry.lifetime_micros > sums.lifetime_micros {
                let delta = (entry.lifetime_micros - sums.lifetime_micros) as f64;
                let elapsed = (now_ms - sums.last_change_ms).max(1) as f64;
                if sums.last_change_ms > 0 {
                    let sample = delta / elapsed;
                    sums.rate_per_ms = 0.8 * sums.rate_per_ms + 0.2 * sample;
                    sums.peak_rate_per_ms = sample
                        .max(sums.peak_rate_per_ms * 0.98)
                        .max(sums.rate_per_ms);
                }
                sums.last_change_ms = now_ms;
            }
            sums.seq = update.seq;
            sums.shard = Some(shard.clone());
            sums.lifetime_micros = sums.lifetime_micros.max(entry.lifetime_micros);
            if entry.bucket != LIFETIME_BUCKET {
                let bucket = sums.buckets.entry(entry.bucket).or_default();
                *bucket = (*bucket).max(entry.bucket_micros);
                while sums.buckets.len() > BUCKETS_KEPT {
                    sums.buckets.pop_first();
                }
            }
        }
        if gap {
            Applied::Gap
        } else {
            Applied::Ok
        }
    }

    /// Watermark for a limit: its shard's, or the oldest of all shards when
    /// the limit has had no spend yet.
    pub fn watermark_ms(&self, limit: Option<&LimitSums>) -> Option<i64> {
        let shard = limit
            .and_then(|l| l.shard.as_ref())
            .and_then(|s| self.shards.get(s));
        match shard {
            Some(s) => Some(s.watermark_ms),
            None => self.shards.values().map(|s| s.watermark_ms).min(),
        }
    }

    pub fn lag_ms(&self) -> i64 {
        self.shards.values().map(|s| s.lag_ms).max().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use adspend_common::types::SumEntry;

    fn update(epoch: u64, seq: u64, push_seq: u64, lifetime: u64) -> SumsUpdate {
        SumsUpdate {
            shard: "all".into(),
            epoch,
            seq,
            push_seq,
            full: false,
            watermark_ms: seq as i64,
            source_ms: 0,
            entries: vec![SumEntry {
                limit: "a".into(),
                bucket: 10,
                bucket_micros: lifetime,
                lifetime_micros: lifetime,
                lifetime_events: lifetime / 10,
            }],
        }
    }

    #[test]
    fn never_goes_backwards() {
        let mut state = SpendState::default();
        assert_eq!(state.apply(&update(1, 10, 1, 100), 1), Applied::Ok);
        // A new owner catching up from an older checkpoint: lower seq, ignored.
        assert_eq!(state.apply(&update(2, 5, 1, 60), 2), Applied::Ok);
        assert_eq!(state.limits["a"].lifetime_micros, 100);
        // The new owner passes the old position.
        assert_eq!(state.apply(&update(2, 12, 2, 130), 3), Applied::Ok);
        assert_eq!(state.limits["a"].lifetime_micros, 130);
        assert_eq!(state.limits["a"].buckets[&10], 130);
        // The fenced old owner keeps pushing: dropped.
        assert_eq!(state.apply(&update(1, 20, 2, 999), 4), Applied::Stale);
        assert_eq!(state.limits["a"].lifetime_micros, 130);
    }

    #[test]
    fn lag_p99_is_kept_current_without_sorting_on_read() {
        let mut window = LagWindow::default();
        assert_eq!(window.p99(), 0);
        // 100 samples at one instant: 1..=100 ms; p99 is the 99th.
        for lag in 1..=100 {
            window.record(1_000, lag);
        }
        assert_eq!(window.p99(), 1, "recomputed at most once a second");
        window.record(2_000, 0);
        assert_eq!(window.p99(), 99);
        // Samples older than five minutes leave the window.
        window.record(2_000 + LAG_WINDOW_MS + 1_000, 5);
        assert_eq!(window.p99(), 5);
    }

    #[test]
    fn push_gap_is_reported() {
        let mut state = SpendState::default();
        assert_eq!(state.apply(&update(1, 1, 1, 1), 1), Applied::Ok);
        assert_eq!(state.apply(&update(1, 2, 3, 2), 2), Applied::Gap);
        assert_eq!(state.limits["a"].lifetime_micros, 2);
    }
}
