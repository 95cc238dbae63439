//! Which thresholds the held spend has crossed and no alert covers yet.
//!
//! Detection compares state, not changes: a threshold counts as crossed
//! whenever the period's spend has reached it, so a push the pacer missed,
//! a restart, or a crossing seen by another pacer first changes nothing;
//! [`Marks`] remembers, per (limit, period), the highest threshold known
//! announced (from the announcer and from the stream) and the highest
//! queued, so a pass queues only what is new. A full queue is never waited
//! on: what did not fit is queued by a later pass.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use adspend_wire::catalog::{day_start, Catalog, Limit, Period};
use chrono::{DateTime, SecondsFormat, Utc};
use tokio::sync::{mpsc, watch, RwLock};
use tokio_util::sync::CancellationToken;

use super::Alert;
use crate::pacing::state::SpendState;

/// How often the held spend is compared with the thresholds.
const PASS_EVERY: Duration = Duration::from_millis(250);
/// Marks not looked at for this long (past periods) are forgotten.
const FORGET_AFTER_MS: i64 = 3_600_000;

/// The thresholds of `thresholds` (ascending percents of `budget`) that
/// `spend` has reached. No spend crosses nothing, even of a zero budget.
pub(super) fn crossed(thresholds: &[u16], budget: u64, spend: u64) -> &[u16] {
    if spend == 0 {
        return &[];
    }
    let reached = |t: &u16| u128::from(spend) * 100 >= u128::from(budget) * u128::from(*t);
    &thresholds[..thresholds.partition_point(reached)]
}

/// A period's start as the pacer API renders it.
pub(super) fn render_start(start: DateTime<Utc>) -> String {
    start.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// (limit id, period start as rendered; `None` for lifetime).
pub(super) type Key = (Arc<str>, Option<String>);

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mark {
    /// Highest threshold known to be on the stream for the period.
    pub(crate) announced: u16,
    /// Highest threshold handed to the announcer.
    pub(crate) queued: u16,
    touched_ms: i64,
}

#[derive(Debug, Default)]
pub(crate) struct Marks {
    marks: HashMap<Key, Mark>,
    forgotten_ms: i64,
}

pub(super) type SharedMarks = Arc<Mutex<Marks>>;

impl Marks {
    pub(crate) fn shared() -> SharedMarks {
        Arc::default()
    }

    pub(crate) fn get(&self, key: &Key) -> Mark {
        self.marks.get(key).copied().unwrap_or_default()
    }

    /// `threshold` is on the stream for `key`'s period (and so, by
    /// [`Alert::covers`], every lower one).
    pub(crate) fn announced(&mut self, key: Key, threshold: u16, now_ms: i64) {
        let mark = self.marks.entry(key).or_default();
        mark.announced = mark.announced.max(threshold);
        mark.queued = mark.queued.max(threshold);
        mark.touched_ms = now_ms;
    }

    /// The announcer gave up on `key` for now: what was queued beyond the
    /// announced is detected again by the next pass.
    pub(crate) fn failed(&mut self, key: &Key) {
        if let Some(mark) = self.marks.get_mut(key) {
            mark.queued = mark.announced;
        }
    }

    fn queued(&mut self, key: Key, threshold: u16, now_ms: i64) {
        let mark = self.marks.entry(key).or_default();
        mark.queued = mark.queued.max(threshold);
        mark.touched_ms = now_ms;
    }

    fn touch(&mut self, key: &Key, now_ms: i64) {
        if let Some(mark) = self.marks.get_mut(key) {
            mark.touched_ms = now_ms;
        }
    }

    fn forget_old(&mut self, now_ms: i64) {
        if now_ms - self.forgotten_ms < FORGET_AFTER_MS / 4 {
            return;
        }
        self.forgotten_ms = now_ms;
        self.marks
            .retain(|_, mark| now_ms - mark.touched_ms < FORGET_AFTER_MS);
    }
}

/// One period of a limit to look at: its key, bucket and rendered start.
fn periods(limit: &Limit, now: DateTime<Utc>) -> Vec<(Option<String>, u32)> {
    let bounds = limit.period_at(now);
    match limit.period {
        Period::Lifetime => vec![(None, bounds.bucket)],
        Period::Daily => {
            // The previous day too: spend of its last moments may arrive
            // after midnight.
            let mut out = vec![(bounds.start.map(render_start), bounds.bucket)];
            if let Some(before) = bounds.bucket.checked_sub(1) {
                out.push((
                    Some(render_start(day_start(limit.time_zone, before))),
                    before,
                ));
            }
            out
        }
    }
}

/// The crossings of one pass over the held spend, in each period's
/// threshold order; `marks` says which are new.
pub(super) fn pass(
    catalog: &Catalog,
    spend: &SpendState,
    marks: &mut Marks,
    now: DateTime<Utc>,
) -> Vec<(Key, Alert)> {
    let now_ms = now.timestamp_millis();
    let mut found = Vec::new();
    for limit in catalog.alerting() {
        let Some(sums) = spend.limits.get(&*limit.id) else {
            continue;
        };
        for (start, bucket) in periods(limit, now) {
            let period_spend = match limit.period {
                Period::Lifetime => sums.lifetime_micros,
                Period::Daily => match sums.buckets.get(&bucket) {
                    Some(&micros) => micros,
                    None => continue,
                },
            };
            let key: Key = (limit.id.clone(), start);
            let reached = crossed(&limit.alerts, limit.budget_micros, period_spend);
            let mark = marks.get(&key);
            marks.touch(&key, now_ms);
            for &threshold in reached.iter().filter(|&&t| t > mark.queued) {
                let alert = Alert {
                    limit_id: limit.id.to_string(),
                    period_start: key.1.clone(),
                    threshold_percent: threshold,
                    spend_micros: period_spend,
                    budget_micros: limit.budget_micros,
                    at_ms: now_ms,
                };
                found.push((key.clone(), alert));
            }
        }
    }
    marks.forget_old(now_ms);
    found
}

/// Compare every [`PASS_EVERY`] until `shutdown`, queueing what is new.
pub(super) async fn run(
    spend: Arc<RwLock<SpendState>>,
    catalog: watch::Receiver<Arc<Catalog>>,
    marks: SharedMarks,
    queue: mpsc::Sender<(Key, Alert)>,
    shutdown: CancellationToken,
) {
    let mut ticker = tokio::time::interval(PASS_EVERY);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let catalog = catalog.borrow().clone();
        if catalog.alerting().is_empty() {
            continue;
        }
        let now = Utc::now();
        let found = {
            let spend = spend.read().await;
            let mut marks = marks.lock().expect("alert marks lock");
            pass(&catalog, &spend, &mut marks, now)
        };
        for (key, alert) in found {
            let threshold = alert.threshold_percent;
            match queue.try_send((key.clone(), alert)) {
                Ok(()) => marks.lock().expect("alert marks lock").queued(
                    key,
                    threshold,
                    now.timestamp_millis(),
                ),
                // Full: the rest waits for a later pass. Closed: stopping.
                Err(_) => break,
            }
        }
    }
}

#[cfg(test)]
mod tests;
