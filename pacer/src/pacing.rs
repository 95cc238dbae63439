//! The answer for one limit at one instant: spend in the current period,
//! what is left, whether it is exhausted, how hard to bid, and the spend it
//! can still overrun by; plus the periodic tick that advances every limit's
//! controller and records its history.
//!
//! - Plan: the budget spread over the period following the learned traffic
//!   shape (blended with uniform), [`crate::shape`].
//! - Multiplier: the controller's output ([`crate::controller`]), capped by
//!   the lag guard; 0 when exhausted.
//! - Exhausted: the remainder cannot pay for one more typical event.

use adspend_common::catalog::{Catalog, Limit, Period};
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;

use crate::controller::{lag_guard, Gains, Observation};
use crate::state::{LimitSums, Pacing, Point, SpendState};

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PacingView {
    pub multiplier: f64,
    pub throttle: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LimitView {
    pub limit_id: String,
    pub budget_micros: u64,
    pub period: &'static str,
    pub time_zone: String,
    pub period_start: Option<String>,
    pub period_end: Option<String>,
    pub spend_micros: u64,
    pub lifetime_spend_micros: u64,
    pub remaining_micros: u64,
    pub exhausted: bool,
    pub pacing: PacingView,
    pub watermark: Option<String>,
    pub lag_ms: i64,
    pub overspend_bound_micros: u64,
    /// Planned spend by now (daily limits; the budget for lifetime ones).
    pub plan_micros: u64,
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// Fraction of the period elapsed at `now` (None for lifetime limits).
fn elapsed_fraction(limit: &Limit, now: DateTime<Utc>) -> Option<(f64, f64)> {
    let bounds = limit.period_at(now);
    let (start, end) = (bounds.start?, bounds.end?);
    let length = (end - start).num_milliseconds().max(1) as f64;
    let elapsed = (now - start).num_milliseconds() as f64;
    Some(((elapsed / length).clamp(0.0, 1.0), length))
}

/// Spend in the current period.
fn period_spend(limit: &Limit, sums: Option<&LimitSums>, now: DateTime<Utc>) -> u64 {
    match limit.period {
        Period::Lifetime => sums.map_or(0, |s| s.lifetime_micros),
        Period::Daily => {
            let bucket = limit.period_at(now).bucket;
            sums.and_then(|s| s.buckets.get(&bucket).copied())
                .unwrap_or(0)
        }
    }
}

fn plan_micros(limit: &Limit, state: &SpendState, now: DateTime<Utc>) -> u64 {
    match elapsed_fraction(limit, now) {
        Some((f, _)) => (limit.budget_micros as f64 * state.shape.plan_fraction(f)).round() as u64,
        None => limit.budget_micros,
    }
}

/// The pacing numbers of one limit, without the presentation strings: what
/// both the limit view and the bidder's decisions need.
#[derive(Debug, Clone, Copy)]
pub struct Verdict {
    pub spend: u64,
    pub remaining: u64,
    pub exhausted: bool,
    pub multiplier: f64,
    pub overspend_bound: u64,
    pub watermark_ms: Option<i64>,
    pub staleness_ms: i64,
}

pub fn verdict(limit: &Limit, state: &SpendState, now: DateTime<Utc>) -> Verdict {
    let sums: Option<&LimitSums> = state.limits.get(&*limit.id);
    let spend = period_spend(limit, sums, now);
    let remaining = limit.budget_micros.saturating_sub(spend);
    let typical = sums.map_or(0.0, |s| s.avg_cost);
    let exhausted = remaining == 0 || (remaining as f64) < typical;
    let watermark_ms = state.watermark_ms(sums);
    let staleness_ms = watermark_ms.map_or(0, |w| (now.timestamp_millis() - w).max(0));
    // The guard plans for the worse of the measured p99 and the current staleness.
    let lag_ms = state.lag.p99().max(staleness_ms);
    let controlled = match (limit.period, state.pacing.get(&*limit.id)) {
        (Period::Daily, Some(p)) if p.bucket == limit.bucket_of(now.timestamp_millis()) => {
            p.controller.multiplier
        }
        _ => 1.0,
    };
    // In flight: the recent peak rate, raised by how much the traffic shape
    // expects it to grow within the lag.
    let growth = match elapsed_fraction(limit, now) {
        Some((f, length)) => {
            let later = (f + lag_ms as f64 / length).min(1.0);
            (state.shape.plan_density(later) / state.shape.plan_density(f).max(1e-9)).max(1.0)
        }
        None => 1.0,
    };
    let rate = sums.map_or(0.0, |s| s.peak_rate_per_ms.max(s.rate_per_ms)) * growth;
    let max_cost = sums.map_or(0, |s| s.max_cost.max(s.avg_cost.ceil() as u64));
    let guard = lag_guard(remaining, rate, controlled, lag_ms as f64, max_cost);
    Verdict {
        spend,
        remaining,
        exhausted,
        multiplier: if exhausted {
            0.0
        } else {
            controlled.min(guard.cap)
        },
        overspend_bound: guard.overspend_bound,
        watermark_ms,
        staleness_ms,
    }
}

pub fn view(limit: &Limit, state: &SpendState, now: DateTime<Utc>) -> LimitView {
    let bounds = limit.period_at(now);
    let v = verdict(limit, state, now);
    LimitView {
        limit_id: limit.id.to_string(),
        budget_micros: limit.budget_micros,
        period: limit.period.as_str(),
        time_zone: limit.time_zone.name().to_string(),
        period_start: bounds.start.map(rfc3339),
        period_end: bounds.end.map(rfc3339),
        spend_micros: v.spend,
        lifetime_spend_micros: state
            .limits
            .get(&*limit.id)
            .map_or(0, |s| s.lifetime_micros),
        remaining_micros: v.remaining,
        exhausted: v.exhausted,
        pacing: PacingView {
            multiplier: v.multiplier,
            throttle: 1.0 - v.multiplier,
        },
        watermark: v
            .watermark_ms
            .and_then(DateTime::<Utc>::from_timestamp_millis)
            .map(rfc3339),
        lag_ms: v.staleness_ms,
        overspend_bound_micros: v.overspend_bound,
        plan_micros: plan_micros(limit, state, now),
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Decision {
    pub ad_id: String,
    pub servable: bool,
    pub multiplier: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<&'static str>,
}

/// May the bidder bid on `ad_id`, and how hard: servable only if every limit
/// above the ad (its own and their parents) is; the multiplier is the least
/// of theirs.
pub fn decide(
    catalog: &Catalog,
    state: &SpendState,
    ad_id: String,
    now: DateTime<Utc>,
) -> Decision {
    let Some(limits) = catalog.limits_of_ad(&ad_id) else {
        return Decision {
            ad_id,
            servable: false,
            multiplier: 0.0,
            error: Some("unknown ad"),
        };
    };
    let mut multiplier: f64 = 1.0;
    let mut servable = true;
    let mut seen: Vec<&str> = Vec::with_capacity(limits.len() + 2);
    for direct in limits {
        let mut cursor = Some(direct);
        while let Some(limit) = cursor {
            if seen.contains(&&*limit.id) {
                break;
            }
            seen.push(&limit.id);
            let v = verdict(limit, state, now);
            servable &= !v.exhausted;
            multiplier = multiplier.min(v.multiplier);
            cursor = limit.parent.as_deref().and_then(|p| catalog.limit(p));
        }
    }
    Decision {
        ad_id,
        servable,
        multiplier: if servable { multiplier } else { 0.0 },
        error: None,
    }
}

/// Most points kept per limit; when full, every other point is dropped, so
/// the history always spans the whole period at a coarser resolution.
const HISTORY_POINTS: usize = 720;
/// Limits with a history (the memory bound of the dashboard's charts).
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
        if observation.is_none() && !record {
            continue;
        }
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
        if let Some(obs) = observation {
            pacing.controller.step(&obs, dt_min, gains);
        }
        if record {
            // The multiplier the API serves (guard and exhaustion included).
            let multiplier = verdict(limit, state, now).multiplier;
            let Some(pacing) = state.pacing.get_mut(&*limit.id) else {
                continue;
            };
            if pacing.history.len() >= HISTORY_POINTS {
                let mut keep = false;
                pacing.history.retain(|_| {
                    keep = !keep;
                    keep
                });
            }
            with_history += usize::from(pacing.history.is_empty());
            pacing.history.push(Point {
                t: now_ms,
                spend_micros: spend,
                plan_micros: plan,
                multiplier,
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use adspend_common::types::{SumEntry, SumsUpdate};
    use chrono::TimeZone;

    fn push(
        state: &mut SpendState,
        limit: &str,
        entries: Vec<(u32, u64)>,
        lifetime: u64,
        events: u64,
        now: i64,
    ) {
        state.apply(
            &SumsUpdate {
                shard: "all".into(),
                epoch: 1,
                seq: state.shards.values().map(|s| s.seq).max().unwrap_or(0) + 1,
                push_seq: state.shards.values().map(|s| s.push_seq).max().unwrap_or(0) + 1,
                full: false,
                watermark_ms: now,
                source_ms: now,
                entries: entries
                    .into_iter()
                    .map(|(bucket, micros)| SumEntry {
                        limit: limit.into(),
                        bucket,
                        bucket_micros: micros,
                        lifetime_micros: lifetime,
                        lifetime_events: events,
                    })
                    .collect(),
            },
            now,
        );
    }

    #[test]
    fn daily_spend_is_the_current_local_day() {
        let catalog = Catalog::parse(
            "t",
            br#"{"limits":{"d":{"budget_micros":1000,"period":"daily","time_zone":"America/New_York"}}}"#,
        )
        .unwrap();
        let limit = catalog.limit("d").unwrap();
        // 2026-11-21 12:00 New York.
        let now = Utc.with_ymd_and_hms(2026, 11, 21, 17, 0, 0).unwrap();
        let today = limit.bucket_of(now.timestamp_millis());
        let mut state = SpendState::default();
        push(
            &mut state,
            "d",
            vec![(today - 1, 300), (today, 600)],
            900,
            9,
            now.timestamp_millis(),
        );
        let v = view(limit, &state, now);
        assert_eq!(v.spend_micros, 600);
        assert_eq!(v.lifetime_spend_micros, 900);
        assert_eq!(v.remaining_micros, 400);
        assert_eq!(v.period_start.as_deref(), Some("2026-11-21T05:00:00.000Z"));
        assert_eq!(v.period_end.as_deref(), Some("2026-11-22T05:00:00.000Z"));
        assert_eq!(v.plan_micros, 500);
        assert!(!v.exhausted);
    }

    #[test]
    fn exhausted_when_the_remainder_cannot_pay_a_typical_event() {
        let catalog = Catalog::parse(
            "t",
            br#"{"limits":{"l":{"budget_micros":1000,"period":"lifetime"}}}"#,
        )
        .unwrap();
        let limit = catalog.limit("l").unwrap();
        let now = Utc.with_ymd_and_hms(2026, 11, 21, 17, 0, 0).unwrap();
        let mut state = SpendState::default();
        // 10 events of 95 micros: 50 left, less than one typical event.
        push(
            &mut state,
            "l",
            vec![(u32::MAX, 950)],
            950,
            10,
            now.timestamp_millis(),
        );
        let v = view(limit, &state, now);
        assert_eq!(v.remaining_micros, 50);
        assert!(v.exhausted);
        assert_eq!(v.pacing.multiplier, 0.0);
    }

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

    const HIERARCHY: &[u8] = br#"{
      "limits": {
        "account": {"budget_micros": 10000, "period": "lifetime"},
        "campaign": {"budget_micros": 5000, "period": "daily", "time_zone": "Europe/Berlin", "parent": "account"},
        "adset-a": {"budget_micros": 1000, "period": "lifetime", "parent": "campaign"},
        "adset-b": {"budget_micros": 4000, "period": "lifetime", "parent": "campaign"}
      },
      "ads": {"ad-a": ["adset-a"], "ad-b": ["adset-b"]}
    }"#;

    #[test]
    fn an_ad_is_servable_only_if_every_limit_above_it_is() {
        let catalog = Catalog::parse("t", HIERARCHY).unwrap();
        let now = Utc.with_ymd_and_hms(2026, 11, 21, 11, 0, 0).unwrap();
        let ms = now.timestamp_millis();
        let day = catalog.limit("campaign").unwrap().bucket_of(ms);
        let mut state = SpendState::default();
        let d = |state: &SpendState, ad: &str| decide(&catalog, state, ad.to_string(), now);
        assert!(d(&state, "ad-a").servable && d(&state, "ad-b").servable);
        // adset-a spent out (10 events of 100): only ad-a stops.
        push(&mut state, "adset-a", vec![(u32::MAX, 1000)], 1000, 10, ms);
        assert!(!d(&state, "ad-a").servable);
        assert_eq!(d(&state, "ad-a").multiplier, 0.0);
        assert!(d(&state, "ad-b").servable);
        // The campaign above both spent out today: both stop, through `parent`.
        push(&mut state, "campaign", vec![(day, 5000)], 5000, 50, ms);
        assert!(!d(&state, "ad-b").servable);
        let unknown = d(&state, "nope");
        assert_eq!(
            (unknown.servable, unknown.error),
            (false, Some("unknown ad"))
        );
    }

    #[test]
    fn dst_days_plan_the_full_budget_over_23_and_25_hours() {
        let catalog = Catalog::parse(
            "t",
            br#"{"limits":{"d":{"budget_micros":2400000,"period":"daily","time_zone":"America/New_York"}}}"#,
        )
        .unwrap();
        let limit = catalog.limit("d").unwrap();
        let state = SpendState::default();
        for (day, hours) in [
            ((2026, 3, 8), 23),
            ((2026, 11, 1), 25),
            ((2026, 11, 21), 24),
        ] {
            // Local noon of that day, then the period it falls in.
            let noon = Utc.with_ymd_and_hms(day.0, day.1, day.2, 17, 0, 0).unwrap();
            let v = view(limit, &state, noon);
            let start: DateTime<Utc> = v.period_start.unwrap().parse().unwrap();
            let end: DateTime<Utc> = v.period_end.unwrap().parse().unwrap();
            assert_eq!((end - start).num_hours(), hours, "{day:?}");
            // The plan reaches the whole budget at the period's last instant.
            let last = view(limit, &state, end - chrono::Duration::milliseconds(1));
            assert!(
                limit.budget_micros - last.plan_micros <= 1,
                "{day:?}: {}",
                last.plan_micros
            );
            assert_eq!(view(limit, &state, start).plan_micros, 0);
        }
    }

    #[test]
    fn a_budget_change_applies_at_once() {
        let before = Catalog::parse("t", HIERARCHY).unwrap();
        let after = Catalog::parse(
            "t",
            &String::from_utf8_lossy(HIERARCHY)
                .replace("1000, \"period\"", "3000, \"period\"")
                .into_bytes(),
        )
        .unwrap();
        let now = Utc.with_ymd_and_hms(2026, 11, 21, 11, 0, 0).unwrap();
        let mut state = SpendState::default();
        push(
            &mut state,
            "adset-a",
            vec![(u32::MAX, 1000)],
            1000,
            10,
            now.timestamp_millis(),
        );
        assert!(view(before.limit("adset-a").unwrap(), &state, now).exhausted);
        let v = view(after.limit("adset-a").unwrap(), &state, now);
        assert_eq!(
            (v.budget_micros, v.remaining_micros, v.exhausted),
            (3000, 2000, false)
        );
        assert!(decide(&after, &state, "ad-a".into(), now).servable);
    }
}
