//! The periodic tick: advances every daily limit's controller, records the
//! multiplier each limit with spend is served at (for the lag guard), and
//! the history points the dashboard charts.

use adspend_wire::catalog::Catalog;
use chrono::{DateTime, Utc};

use super::verdict::{elapsed_fraction, period_spend, plan_micros, verdict};
use crate::pacing::controller::{baseline_step, Algorithm, Gains, Observation};
use crate::pacing::state::{Pacing, Point, SpendState};

/// Most points kept per limit; when full, every other point is dropped, so
/// the history always spans the whole period at a coarser resolution. At a
/// point every 10 s the history fills in 2 hours; its buffer is taken whole
/// and written through at the first point, so it never grows past this by
/// doubling and its memory is resident (and counted) from the start.
const HISTORY_POINTS: usize = 720;
/// Limits with a history (the memory bound of the dashboard's charts:
/// 10,000 × 720 points × 32 bytes, about 230 MB; docs/RETENTION.md).
const HISTORY_LIMITS: usize = 10_000;

/// Advance every daily limit's controller to `now`; record history points.
pub fn tick(
    state: &mut SpendState,
    catalog: &Catalog,
    now: DateTime<Utc>,
    dt_min: f64,
    record: bool,
    gains: &Gains,
) {
    let now_ms = now.timestamp_millis();
    let mut with_history = state
        .pacing
        .values()
        .filter(|p| !p.history.is_empty())
        .count();
    for limit in catalog.limits.values() {
        let Some(sums) = state.limits.get(&*limit.id) else {
            continue;
        };
        let spend = period_spend(limit, Some(sums), now);
        let rate = sums.rate_per_ms;
        let bucket = limit.period_at(now).bucket;
        let plan = plan_micros(limit, state, now);
        let observation = match (elapsed_fraction(limit, now), limit.budget_micros) {
            (Some((f, length_ms)), budget) if budget > 0 => {
                let budget = budget as f64;
                Some(Observation {
                    plan: plan as f64 / budget,
                    spent: spend as f64 / budget,
                    plan_rate: state.shape.plan_density(f) / (length_ms / 60_000.0),
                    rate: rate * 60_000.0 / budget,
                })
            }
            _ => None,
        };
        let has_history = state
            .pacing
            .get(&*limit.id)
            .is_some_and(|p| !p.history.is_empty());
        let record = record && (has_history || with_history < HISTORY_LIMITS);
        let pacing = state
            .pacing
            .entry(limit.id.clone())
            .or_insert_with(|| Pacing {
                bucket,
                ..Pacing::default()
            });
        if pacing.bucket != bucket {
            // A new period: start over, keep nothing of yesterday's integral.
            *pacing = Pacing {
                bucket,
                ..Pacing::default()
            };
        }
        match (observation, state.algorithm) {
            (Some(obs), Algorithm::Adspend) => {
                pacing.controller.step(&obs, dt_min, gains);
            }
            (Some(obs), Algorithm::Baseline) => {
                let even = elapsed_fraction(limit, now).map_or(1.0, |(f, _)| f);
                let c = &mut pacing.controller;
                c.multiplier = baseline_step(c.multiplier, even, obs.spent, dt_min);
            }
            (None, _) => {}
        }
        // The multiplier the API serves (guard and exhaustion included),
        // until the next tick: the lag guard reads it back one lag later.
        let multiplier = verdict(limit, state, now).multiplier;
        let Some(pacing) = state.pacing.get_mut(&*limit.id) else {
            continue;
        };
        pacing.served.record(now_ms, multiplier);
        if record {
            if pacing.history.len() >= HISTORY_POINTS {
                let mut keep = false;
                pacing.history.retain(|_| {
                    keep = !keep;
                    keep
                });
            }
            if pacing.history.is_empty() {
                with_history += 1;
                // Take the whole buffer and touch it now, so its pages are
                // resident from the first point: the pacer's memory is then
                // level from the start instead of creeping over the 2 hours
                // the history takes to fill.
                pacing.history.reserve_exact(HISTORY_POINTS);
                pacing.history.resize(HISTORY_POINTS, Point::default());
                pacing.history.clear();
            }
            pacing.history.push(Point {
                t: now_ms,
                spend_micros: spend,
                plan_micros: plan,
                multiplier,
            });
        }
    }
}

/// Catalog limits that are stale at `now` (the stale-limits gauge).
pub(crate) fn stale_limits(state: &SpendState, catalog: &Catalog, now: DateTime<Utc>) -> usize {
    let now_ms = now.timestamp_millis();
    catalog
        .limits
        .values()
        .filter(|l| state.limit_stale(state.limits.get(&*l.id), now_ms))
        .count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pacing::test_support::push;
    use crate::pacing::view;
    use chrono::TimeZone;

    #[test]
    fn ahead_of_plan_lowers_the_multiplier_over_ticks() {
        let catalog = Catalog::parse(
            "t",
            br#"{"limits":{"d":{"budget_micros":1000000,"period":"daily"}}}"#,
        )
        .unwrap();
        let limit = catalog.limit("d").unwrap();
        // 06:00 UTC: a quarter of the day, 60% spent.
        let now = Utc.with_ymd_and_hms(2026, 11, 21, 6, 0, 0).unwrap();
        let mut state = SpendState::default();
        let today = limit.bucket_of(now.timestamp_millis());
        push(
            &mut state,
            "d",
            vec![(today, 600_000)],
            600_000,
            600,
            now.timestamp_millis(),
        );
        for i in 0..10 {
            tick(
                &mut state,
                &catalog,
                now + chrono::Duration::minutes(i),
                1.0,
                true,
                &Gains::default(),
            );
        }
        let v = view(limit, &state, now + chrono::Duration::minutes(10));
        assert!(v.pacing.multiplier < 0.5, "{}", v.pacing.multiplier);
        assert_eq!(state.pacing["d"].history.len(), 10);
    }

    #[test]
    fn a_history_never_holds_more_than_its_points_nor_grows_its_buffer() {
        let catalog = Catalog::parse(
            "t",
            br#"{"limits":{"d":{"budget_micros":1000000,"period":"daily"}}}"#,
        )
        .unwrap();
        let start = Utc.with_ymd_and_hms(2026, 11, 21, 0, 0, 1).unwrap();
        let mut state = SpendState::default();
        let today = catalog
            .limit("d")
            .unwrap()
            .bucket_of(start.timestamp_millis());
        push(
            &mut state,
            "d",
            vec![(today, 1)],
            1,
            1,
            start.timestamp_millis(),
        );
        // Three and a half fills at a point every 10 s (under 10 hours).
        for i in 0..(HISTORY_POINTS as i64 * 7 / 2) {
            let now = start + chrono::Duration::seconds(10 * i);
            tick(
                &mut state,
                &catalog,
                now,
                1.0 / 6.0,
                true,
                &Gains::default(),
            );
            let history = &state.pacing["d"].history;
            assert!(history.len() <= HISTORY_POINTS, "{} points", history.len());
            assert_eq!(history.capacity(), HISTORY_POINTS, "after {i} ticks");
        }
        let history = &state.pacing["d"].history;
        assert!(history.len() > HISTORY_POINTS / 2);
        assert_eq!(
            history[0].t,
            start.timestamp_millis(),
            "still spans the period"
        );
    }
}
