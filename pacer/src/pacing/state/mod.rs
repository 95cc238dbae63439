//! Spend state as pushed by the aggregators.
//!
//! Pushes carry absolute sums stamped with (owner epoch, stream sequence). A
//! push from an epoch older than the newest seen for its shard is a fenced
//! owner's and is dropped; an entry older (by sequence) than what is held is
//! dropped too. Both owners of a shard compute the same sums for the same
//! sequence (the log and the dedupe rules are deterministic), so comparing
//! sequences is enough to never go backwards while a new owner catches up.
//!
//! A shard is stale when no push from its current owner (an empty heartbeat
//! counts: aggregators push one at least every second while idle) has been
//! accepted for longer than `stale_after_ms`: its owner is gone or cut off,
//! and spend it has not pushed may already exceed what the pacer holds.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

use adspend_wire::types::{SumsUpdate, LIFETIME_BUCKET};

use crate::pacing::controller::{Algorithm, Controller};
use crate::pacing::shape::TrafficShape;

/// Buckets kept per limit: today in any zone plus a little history.
const BUCKETS_KEPT: usize = 4;

#[derive(Debug, Default, Clone)]
pub(crate) struct LimitSums {
    pub(crate) lifetime_micros: u64,
    pub(crate) buckets: BTreeMap<u32, u64>,
    pub(crate) seq: u64,
    pub(crate) shard: Option<Arc<str>>,
    /// Smoothed lifetime spend rate, micros per millisecond.
    pub(crate) rate_per_ms: f64,
    /// Recent peak of the spend rate (decays slowly): what the stated
    /// overspend bound assumes, since traffic can rise within the lag.
    pub(crate) peak_rate_per_ms: f64,
    /// Spend over the last `RATE_WINDOW_MS` or so (exponentially weighted),
    /// per ms, as of `last_change_ms`: the rate the lag guard caps with. A
    /// peak of single-push samples reads a burst of two events in 50 ms as
    /// the rate, several times the real one, and the guard then holds back
    /// budget for spend that is not in flight.
    windowed_rate_per_ms: f64,
    last_change_ms: i64,
    pub(crate) lifetime_events: u64,
    /// Smoothed cost of one event, micros.
    pub(crate) avg_cost: f64,
    /// Largest average event cost seen in one push, micros.
    pub(crate) max_cost: u64,
}

impl LimitSums {
    /// The windowed spend rate at `now_ms`, micros per ms: it decays while
    /// no spend arrives.
    pub(crate) fn windowed_rate(&self, now_ms: i64) -> f64 {
        let quiet = (now_ms - self.last_change_ms).max(0) as f64;
        self.windowed_rate_per_ms * (-quiet / RATE_WINDOW_MS).exp()
    }
}

#[derive(Debug, Default, Clone)]
pub(crate) struct ShardState {
    pub(crate) epoch: u64,
    pub(crate) push_seq: u64,
    pub(crate) seq: u64,
    pub(crate) watermark_ms: i64,
    /// Freshness: arrival time minus the earliest source time (the JetStream
    /// publish time or the impression `ts`, whichever is older).
    pub(crate) lag_ms: i64,
    /// When the last accepted push (heartbeats included) arrived, unix ms.
    pub(crate) updated_ms: i64,
    /// Stale as of the last tick: turns a change into one log line.
    pub(crate) reported_stale: bool,
}

/// Freshness samples (arrival minus source time) over a window, and
/// their p99, recomputed at most once a second as samples arrive: the lag
/// guard reads it for every limit of every decision, so reading must not sort.
#[derive(Debug, Default)]
pub(crate) struct LagWindow {
    samples: VecDeque<(i64, i64)>,
    p99_ms: i64,
    /// The largest sample in the window (raised at once by a larger sample,
    /// lowered at the recomputation).
    max_ms: i64,
    /// When `p99_ms` was last computed (unix ms); 0 = never.
    computed_ms: i64,
}

const LAG_WINDOW_MS: i64 = 300_000;
/// Time constant of a limit's windowed spend rate.
pub(crate) const RATE_WINDOW_MS: f64 = 2_000.0;
const LAG_SAMPLES: usize = 10_000;
const LAG_P99_EVERY_MS: i64 = 1_000;

impl LagWindow {
    pub(crate) fn record(&mut self, now_ms: i64, lag_ms: i64) {
        self.samples.push_back((now_ms, lag_ms.max(0)));
        self.max_ms = self.max_ms.max(lag_ms);
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
            self.max_ms = self.samples.iter().map(|(_, l)| *l).max().unwrap_or(0);
            self.computed_ms = now_ms;
        }
    }

    /// p99 of the window's samples (the last five minutes, at most 10,000
    /// of them) as of the last recomputation; 0 with none.
    pub(crate) fn p99(&self) -> i64 {
        self.p99_ms
    }

    /// The largest sample of the window; 0 with none. The stated overspend
    /// bound reads spend as in flight for this long: a bound read over the
    /// p99 is broken by the 1% of spend that arrives later.
    pub(crate) fn max(&self) -> i64 {
        self.max_ms
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
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub(crate) struct Point {
    pub(crate) t: i64,
    pub(crate) spend_micros: u64,
    pub(crate) plan_micros: u64,
    pub(crate) multiplier: f64,
}

/// Per-limit pacing state the tick maintains.
#[derive(Debug, Default, Clone)]
pub(crate) struct Pacing {
    pub(crate) controller: Controller,
    /// Period bucket the controller is running for; a new period resets it.
    pub(crate) bucket: u32,
    pub(crate) history: Vec<Point>,
    /// The multipliers served, for the lag guard's in-flight estimate.
    pub(crate) served: crate::pacing::served::Served,
}

/// How long a shard may go without an accepted push before its limits are
/// stale (`ADSPEND_PACER_STALE_AFTER_MS`).
pub(crate) const DEFAULT_STALE_AFTER_MS: i64 = 30_000;

#[derive(Debug)]
pub struct SpendState {
    pub(crate) limits: HashMap<String, LimitSums>,
    pub(crate) shards: HashMap<Arc<str>, ShardState>,
    pub(crate) lag: LagWindow,
    pub shape: TrafficShape,
    pub(crate) pacing: HashMap<Arc<str>, Pacing>,
    /// A shard with no accepted push for longer than this is stale.
    pub(crate) stale_after_ms: i64,
    /// When the pacer started listening for pushes (unix ms): with no shard
    /// heard from at all, every limit is stale once this is `stale_after_ms`
    /// old. `None` (tests, benches): never stale for want of any shard.
    pub(crate) listening_since_ms: Option<i64>,
    /// The pacing served (`ADSPEND_PACER_ALGORITHM`).
    pub(crate) algorithm: Algorithm,
    /// How far behind the limiters' input is, ms (set every tick from
    /// their reports, [`crate::input::sources::SourceReports::input_lag_ms`]).
    pub(crate) input_lag_ms: i64,
    /// Each shard's latest dedupe window report (`GET /v1/shards`).
    pub(crate) dedupe_windows: HashMap<String, adspend_common::dedupe_window::Report>,
}

impl Default for SpendState {
    fn default() -> Self {
        SpendState {
            limits: HashMap::new(),
            shards: HashMap::new(),
            lag: LagWindow::default(),
            shape: TrafficShape::default(),
            pacing: HashMap::new(),
            stale_after_ms: DEFAULT_STALE_AFTER_MS,
            listening_since_ms: None,
            algorithm: Algorithm::Adspend,
            input_lag_ms: 0,
            dedupe_windows: HashMap::new(),
        }
    }
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
            if state.epoch != 0 {
                // A new owner took the shard over (failover or handover).
                tracing::info!(
                    shard = &*shard,
                    epoch = update.epoch,
                    previous_epoch = state.epoch,
                    seq = update.seq,
                    "pushes from a new owner epoch taken"
                );
            }
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
                    let decay = (-elapsed / RATE_WINDOW_MS).exp();
                    sums.windowed_rate_per_ms =
                        sums.windowed_rate_per_ms * decay + delta / RATE_WINDOW_MS;
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
    pub(crate) fn watermark_ms(&self, limit: Option<&LimitSums>) -> Option<i64> {
        let shard = limit
            .and_then(|l| l.shard.as_ref())
            .and_then(|s| self.shards.get(s));
        match shard {
            Some(s) => Some(s.watermark_ms),
            None => self.shards.values().map(|s| s.watermark_ms).min(),
        }
    }

    /// No push from the shard's owner accepted for longer than `stale_after_ms`.
    pub(crate) fn shard_stale(&self, shard: &ShardState, now_ms: i64) -> bool {
        now_ms - shard.updated_ms > self.stale_after_ms
    }

    /// How old the newest spend the shard's sums may lack is, from now (as
    /// [`Self::staleness_ms`]).
    pub(crate) fn shard_staleness_ms(&self, shard: &ShardState, now_ms: i64) -> i64 {
        (now_ms - shard.watermark_ms).max(0).max(self.input_lag_ms)
    }

    /// How old, at `now_ms`, the newest spend a limit's sums may lack is,
    /// measured from now: the later of its watermark (which stops while
    /// its shard is behind or silent) and the limiters' input lag (spend
    /// waiting before any aggregator, which then looks caught up).
    pub(crate) fn staleness_ms(&self, limit: Option<&LimitSums>, now_ms: i64) -> i64 {
        let behind = self.watermark_ms(limit).map_or(0, |w| (now_ms - w).max(0));
        behind.max(self.input_lag_ms)
    }

    /// Whether a limit's sums may be out of date by more than the lag guard
    /// can account for: spend for it stopped flowing for `stale_after_ms`
    /// somewhere on its way (input waiting at the limiters, while the
    /// aggregators look caught up; its shard behind, its watermark stopped
    /// though it pushes), or its shard is silent. A limit with no spend yet could get
    /// it from any shard (as its watermark is the oldest of all), so it is
    /// stale when any shard is, or when none has pushed since the pacer
    /// started listening `stale_after_ms` ago.
    pub(crate) fn limit_stale(&self, limit: Option<&LimitSums>, now_ms: i64) -> bool {
        if self.staleness_ms(limit, now_ms) > self.stale_after_ms {
            return true;
        }
        let shard = limit
            .and_then(|l| l.shard.as_ref())
            .and_then(|s| self.shards.get(s));
        match shard {
            Some(shard) => self.shard_stale(shard, now_ms),
            None if self.shards.is_empty() => self
                .listening_since_ms
                .is_some_and(|since| now_ms - since > self.stale_after_ms),
            None => self.shards.values().any(|s| self.shard_stale(s, now_ms)),
        }
    }

    /// Take the limiters' input lag (every tick), logging once when it
    /// passes the stale threshold and once when it is back under.
    pub(crate) fn set_input_lag(&mut self, input_lag_ms: i64) {
        let was = self.input_lag_ms > self.stale_after_ms;
        let is = input_lag_ms > self.stale_after_ms;
        if is && !was {
            tracing::warn!(
                input_lag_ms,
                stale_after_ms = self.stale_after_ms,
                "limiter input stale: input waits at the limiters (or a limiter stopped reporting); every limit is stale and its ads are not servable until it flows again"
            );
        } else if was && !is {
            tracing::info!(input_lag_ms, "limiter input flowing again");
        }
        self.input_lag_ms = input_lag_ms;
    }

    /// Record which shards are stale at `now_ms`, logging each change once;
    /// returns how many are.
    pub(crate) fn mark_stale_shards(&mut self, now_ms: i64) -> usize {
        let after_ms = self.stale_after_ms;
        let mut stale = 0;
        for (name, shard) in &mut self.shards {
            let is_stale = now_ms - shard.updated_ms > after_ms;
            stale += usize::from(is_stale);
            if is_stale == shard.reported_stale {
                continue;
            }
            shard.reported_stale = is_stale;
            if is_stale {
                tracing::error!(
                    shard = %name,
                    epoch = shard.epoch,
                    seq = shard.seq,
                    silent_ms = now_ms - shard.updated_ms,
                    "shard stale: no push from its owner; ads under its limits are not servable until it pushes again"
                );
            } else {
                tracing::info!(shard = %name, epoch = shard.epoch, seq = shard.seq, "shard pushing again, no longer stale");
            }
        }
        stale
    }
}

#[cfg(test)]
mod tests;
