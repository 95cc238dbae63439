//! The pacing numbers of one limit at one instant, and the bidder's decision
//! for an ad built from the verdicts of every limit above it.

use adspend_wire::catalog::{Catalog, Limit, Period};
use chrono::{DateTime, Utc};
use serde::Serialize;

use crate::pacing::controller::{lag_guard, Algorithm, GuardInput};
use crate::pacing::state::{LimitSums, SpendState, RATE_WINDOW_MS};

/// Fraction of the period elapsed at `now` and the period's length in ms
/// (None for lifetime limits).
pub(super) fn elapsed_fraction(limit: &Limit, now: DateTime<Utc>) -> Option<(f64, f64)> {
    let bounds = limit.period_at(now);
    let (start, end) = (bounds.start?, bounds.end?);
    let length = (end - start).num_milliseconds().max(1) as f64;
    let elapsed = (now - start).num_milliseconds() as f64;
    Some(((elapsed / length).clamp(0.0, 1.0), length))
}

/// Spend in the current period.
pub(crate) fn period_spend(limit: &Limit, sums: Option<&LimitSums>, now: DateTime<Utc>) -> u64 {
    match limit.period {
        Period::Lifetime => sums.map_or(0, |s| s.lifetime_micros),
        Period::Daily => {
            let bucket = limit.period_at(now).bucket;
            sums.and_then(|s| s.buckets.get(&bucket).copied())
                .unwrap_or(0)
        }
    }
}

pub(super) fn plan_micros(limit: &Limit, state: &SpendState, now: DateTime<Utc>) -> u64 {
    match elapsed_fraction(limit, now) {
        Some((f, _)) => (limit.budget_micros as f64 * state.shape.plan_fraction(f)).round() as u64,
        None => limit.budget_micros,
    }
}

/// The pacing numbers of one limit, without the presentation strings: what
/// both the limit view and the bidder's decisions need.
#[derive(Debug, Clone, Copy)]
pub struct Verdict {
    pub(crate) spend: u64,
    pub(crate) remaining: u64,
    pub exhausted: bool,
    pub multiplier: f64,
    /// The pacing controller's multiplier alone, without the lag guard's
    /// cap (0 when exhausted or stale): what spend leases are sized by,
    /// since a lease's spend is held in flight until reported and needs
    /// no guard against the lag.
    pub(crate) paced: f64,
    pub overspend_bound: u64,
    pub(crate) watermark_ms: Option<i64>,
    pub(crate) staleness_ms: i64,
    /// The limit's shard has not pushed for `stale_after_ms`: not servable.
    pub(crate) stale: bool,
}

pub fn verdict(limit: &Limit, state: &SpendState, now: DateTime<Utc>) -> Verdict {
    let sums: Option<&LimitSums> = state.limits.get(&*limit.id);
    let spend = period_spend(limit, sums, now);
    let remaining = limit.budget_micros.saturating_sub(spend);
    let typical = sums.map_or(0.0, |s| s.avg_cost);
    let baseline = state.algorithm == Algorithm::Baseline;
    // The baseline stops when the visible spend reaches the budget.
    let exhausted = remaining == 0 || (!baseline && (remaining as f64) < typical);
    let watermark_ms = state.watermark_ms(sums);
    let stale = state.limit_stale(sums, now.timestamp_millis());
    let staleness_ms = state.staleness_ms(sums, now.timestamp_millis());
    // The guard plans for the worse of the measured p99 and the current staleness.
    let lag_ms = state.lag.p99().max(staleness_ms);
    let pacing = state.pacing.get(&*limit.id);
    let controlled = match (limit.period, pacing) {
        (Period::Daily, Some(p)) if p.bucket == limit.bucket_of(now.timestamp_millis()) => {
            p.controller.multiplier
        }
        _ => 1.0,
    };
    // Arriving: the recent peak rate, raised by how much the traffic shape
    // expects it to grow within the lag.
    let growth = match elapsed_fraction(limit, now) {
        Some((f, length)) => {
            let later = (f + lag_ms as f64 / length).min(1.0);
            (state.shape.plan_density(later) / state.shape.plan_density(f).max(1e-9)).max(1.0)
        }
        None => 1.0,
    };
    let now_ms = now.timestamp_millis();
    let rate = sums.map_or(0.0, |s| s.windowed_rate(now_ms)) * growth;
    let peak_rate = sums.map_or(0.0, |s| s.peak_rate_per_ms.max(s.rate_per_ms)) * growth;
    let max_cost = sums.map_or(0, |s| s.max_cost.max(s.avg_cost.ceil() as u64));
    // Before the tick has recorded anything for the limit, it was served
    // at the controller's multiplier: with no spend seen, the guard had
    // nothing to cap it with. The rate arriving now was served over the
    // rate's window, one lag ago.
    let window = RATE_WINDOW_MS as i64;
    let max_lag_ms = state.lag.max().max(lag_ms);
    let (served_then, served_over_lag, served_over_max_lag) = match pacing {
        Some(p) => (
            p.served
                .integral(now_ms - lag_ms - window, now_ms - lag_ms, controlled)
                / RATE_WINDOW_MS,
            p.served.integral(now_ms - lag_ms, now_ms, controlled),
            p.served.integral(now_ms - max_lag_ms, now_ms, controlled),
        ),
        None => (
            controlled,
            controlled * lag_ms as f64,
            controlled * max_lag_ms as f64,
        ),
    };
    let guard = lag_guard(GuardInput {
        remaining,
        rate_per_ms: rate,
        bound_rate_per_ms: peak_rate,
        served_then,
        served_over_lag,
        served_over_max_lag,
        lag_ms: lag_ms as f64,
        typical_cost: typical,
        max_cost,
    });
    Verdict {
        spend,
        remaining,
        exhausted,
        // Stale: not capped by the guard but stopped, because the guard's
        // in-flight estimate comes from the very pushes that stopped.
        multiplier: if exhausted || stale {
            0.0
        } else if baseline {
            controlled
        } else {
            controlled.min(guard.cap)
        },
        paced: if exhausted || stale { 0.0 } else { controlled },
        // A bound on how far the spend can end over the budget: what is
        // over it already counts too, not only what is still in flight.
        overspend_bound: guard
            .overspend_bound
            .saturating_add(spend.saturating_sub(limit.budget_micros)),
        watermark_ms,
        staleness_ms,
        stale,
    }
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Decision {
    pub(crate) ad_id: String,
    pub servable: bool,
    pub(crate) multiplier: f64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) error: Option<&'static str>,
    /// Some limit above the ad is stale (the reason it is not servable);
    /// serialized only when true.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub(crate) stale: bool,
}

/// May the bidder bid on `ad_id`, and how hard: servable only if every limit
/// above the ad (its own and their parents) is, that is neither exhausted nor
/// stale; the multiplier is the least of theirs. One verdict per limit above
/// the ad (at most [`adspend_wire::catalog::MAX_LIMITS_ABOVE_AD`], their
/// ancestors worked out when the catalog was parsed).
pub fn decide(
    catalog: &Catalog,
    state: &SpendState,
    ad_id: String,
    now: DateTime<Utc>,
) -> Decision {
    decide_counted(catalog, state, ad_id, now).0
}

/// [`decide`], and how many verdicts it took (what a batch budgets its
/// time in).
pub(crate) fn decide_counted(
    catalog: &Catalog,
    state: &SpendState,
    ad_id: String,
    now: DateTime<Utc>,
) -> (Decision, usize) {
    let Some(above) = catalog.limits_above_ad(&ad_id) else {
        let unknown = Decision {
            ad_id,
            servable: false,
            multiplier: 0.0,
            error: Some("unknown ad"),
            stale: false,
        };
        return (unknown, 0);
    };
    let mut multiplier: f64 = 1.0;
    let mut servable = true;
    let mut stale = false;
    for limit in &above {
        let v = verdict(limit, state, now);
        servable &= !v.exhausted && !v.stale;
        stale |= v.stale;
        multiplier = multiplier.min(v.multiplier);
    }
    if servable {
        // What the lag guard counts as served under each of these limits.
        for limit in &above {
            if let Some(pacing) = state.pacing.get(&*limit.id) {
                pacing.served.note(multiplier);
            }
        }
    }
    let decision = Decision {
        ad_id,
        servable,
        multiplier: if servable { multiplier } else { 0.0 },
        error: None,
        stale,
    };
    (decision, above.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pacing::test_support::{push, HIERARCHY};
    use crate::pacing::view;
    use chrono::TimeZone;

    /// A lifetime limit `l` of 1,000 micros with `events` events summing to
    /// `spent` pushed, and the time they were pushed at.
    fn lifetime_limit_spent(spent: u64, events: u64) -> (Catalog, SpendState, DateTime<Utc>) {
        let catalog = Catalog::parse(
            "t",
            br#"{"limits":{"l":{"budget_micros":1000,"period":"lifetime"}}}"#,
        )
        .unwrap();
        let now = Utc.with_ymd_and_hms(2026, 11, 21, 17, 0, 0).unwrap();
        let mut state = SpendState::default();
        push(
            &mut state,
            "l",
            vec![(u32::MAX, spent)],
            spent,
            events,
            now.timestamp_millis(),
        );
        (catalog, state, now)
    }

    #[test]
    fn exhausted_when_the_remainder_cannot_pay_a_typical_event() {
        // 10 events of 95 micros: 50 left, less than one typical event.
        let (catalog, state, now) = lifetime_limit_spent(950, 10);
        let v = view(catalog.limit("l").unwrap(), &state, now);
        assert_eq!(v.remaining_micros, 50);
        assert!(v.exhausted);
        assert_eq!(v.pacing.multiplier, 0.0);
    }

    #[test]
    fn the_stated_bound_counts_what_is_already_over_the_budget() {
        // 12 events of 100 micros landed: 200 over the budget already.
        let (catalog, state, now) = lifetime_limit_spent(1_200, 12);
        let v = verdict(catalog.limit("l").unwrap(), &state, now);
        assert!(v.exhausted);
        assert_eq!(v.remaining, 0);
        assert!(
            v.overspend_bound >= 200 + 100,
            "the 200 over plus at least one event: {}",
            v.overspend_bound
        );
    }

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
    fn a_stale_shard_stops_its_limits_and_the_ads_under_them() {
        let catalog = Catalog::parse("t", HIERARCHY).unwrap();
        let now = Utc.with_ymd_and_hms(2026, 11, 21, 11, 0, 0).unwrap();
        let ms = now.timestamp_millis();
        let mut state = SpendState::default();
        push(&mut state, "adset-a", vec![(u32::MAX, 100)], 100, 1, ms);
        let later = now + chrono::Duration::milliseconds(state.stale_after_ms);
        let fresh = decide(&catalog, &state, "ad-a".into(), later);
        assert!(fresh.servable && !fresh.stale, "{fresh:?}");
        assert!(!view(catalog.limit("adset-a").unwrap(), &state, later).stale);

        let silent = later + chrono::Duration::milliseconds(1);
        let v = view(catalog.limit("adset-a").unwrap(), &state, silent);
        assert!(v.stale && !v.exhausted);
        assert_eq!((v.pacing.multiplier, v.pacing.throttle), (0.0, 1.0));
        // adset-a's shard is the only one: every limit above it is stale too
        // (the ones with no spend could be that shard's).
        assert!(view(catalog.limit("account").unwrap(), &state, silent).stale);
        for ad in ["ad-a", "ad-b"] {
            let d = decide(&catalog, &state, ad.into(), silent);
            assert_eq!((d.servable, d.multiplier, d.stale), (false, 0.0, true));
            let json = serde_json::to_value(&d).unwrap();
            assert_eq!(json["stale"], true);
        }
        // The next push (a heartbeat would do) makes them servable again.
        push(
            &mut state,
            "adset-a",
            vec![(u32::MAX, 100)],
            100,
            1,
            silent.timestamp_millis(),
        );
        let d = decide(&catalog, &state, "ad-a".into(), silent);
        assert!(d.servable && !d.stale);
        let json = serde_json::to_value(&d).unwrap();
        assert!(json.get("stale").is_none(), "{json}");
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
