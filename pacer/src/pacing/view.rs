//! A limit's verdict as `GET /v1/limits` serves it: the contract's fields,
//! timestamps as RFC 3339 strings.

use adspend_wire::catalog::Limit;
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;

use super::verdict::{plan_micros, verdict};
use crate::pacing::state::SpendState;

#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct PacingView {
    pub(crate) multiplier: f64,
    pub(crate) throttle: f64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub(crate) struct LimitView {
    pub(crate) limit_id: String,
    pub(crate) budget_micros: u64,
    pub(crate) period: &'static str,
    pub(crate) time_zone: String,
    pub(crate) period_start: Option<String>,
    pub(crate) period_end: Option<String>,
    pub(crate) spend_micros: u64,
    pub(crate) lifetime_spend_micros: u64,
    pub(crate) remaining_micros: u64,
    pub(crate) exhausted: bool,
    pub(crate) pacing: PacingView,
    pub(crate) watermark: Option<String>,
    pub(crate) lag_ms: i64,
    /// The limit's shard has not pushed for the stale threshold: its ads are
    /// not servable (see [`crate::pacing::state::SpendState::limit_stale`]).
    pub(crate) stale: bool,
    pub(crate) overspend_bound_micros: u64,
    /// Planned spend by now (daily limits; the budget for lifetime ones).
    pub(crate) plan_micros: u64,
    /// Granted under spend leases and not yet covered by the spend
    /// reported under them: spend in flight (CONTRACT.md "Spend leases").
    pub(crate) leased_micros: u64,
    /// The costliest impression seen on the limit (what one event beyond a
    /// grant can add).
    #[serde(skip)]
    pub(crate) max_cost_micros: u64,
    /// This region's share of the budget (with ADSPEND_REGION only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) allotment_micros: Option<u64>,
    /// Every region's part (with ADSPEND_REGION only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) regions: Option<std::collections::BTreeMap<String, RegionPart>>,
}

/// One region's part of a limit.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub(crate) struct RegionPart {
    pub(crate) spend_micros: u64,
    pub(crate) lifetime_spend_micros: u64,
    /// The region's allotment as it computed it at its last report (this
    /// region's: now).
    pub(crate) allotment_micros: u64,
    pub(crate) leased_micros: u64,
    /// When the region's figures were taken, by its clock; null for a
    /// region not heard in this period.
    pub(crate) as_of_ms: Option<i64>,
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

pub(crate) fn view(limit: &Limit, state: &SpendState, now: DateTime<Utc>) -> LimitView {
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
        stale: v.stale,
        overspend_bound_micros: v.overspend_bound,
        plan_micros: plan_micros(limit, state, now),
        leased_micros: 0,
        max_cost_micros: state
            .limits
            .get(&*limit.id)
            .map_or(0, |s| s.max_cost.max(s.avg_cost.ceil() as u64)),
        allotment_micros: None,
        regions: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pacing::test_support::push;
    use adspend_wire::catalog::Catalog;
    use chrono::TimeZone;

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
}
