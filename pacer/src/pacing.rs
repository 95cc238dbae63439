//! The answer for one limit at one instant: spend in the current period,
//! what is left, and how hard to bid.
//!
//! Pacing here is the simple rule: bid at full strength while spend is at or
//! under an even spread of the budget over the period; above it, scale the
//! multiplier down by how far ahead spend is.

use adspend_common::catalog::{Limit, Period};
use chrono::{DateTime, SecondsFormat, Utc};
use serde::Serialize;

use crate::state::{LimitSums, SpendState};

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Pacing {
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
    pub pacing: Pacing,
    pub watermark: Option<String>,
    pub lag_ms: i64,
    pub overspend_bound_micros: u64,
}

fn rfc3339(t: DateTime<Utc>) -> String {
    t.to_rfc3339_opts(SecondsFormat::Millis, true)
}

pub fn view(limit: &Limit, state: &SpendState, now: DateTime<Utc>) -> LimitView {
    let sums: Option<&LimitSums> = state.limits.get(&*limit.id);
    let bounds = limit.period_at(now);
    let lifetime = sums.map_or(0, |s| s.lifetime_micros);
    let spend = match limit.period {
        Period::Lifetime => lifetime,
        Period::Daily => sums
            .and_then(|s| s.buckets.get(&bounds.bucket).copied())
            .unwrap_or(0),
    };
    let remaining = limit.budget_micros.saturating_sub(spend);
    let exhausted = remaining == 0;
    let multiplier = if exhausted {
        0.0
    } else {
        match (bounds.start, bounds.end) {
            (Some(start), Some(end)) => {
                let length = (end - start).num_milliseconds().max(1) as f64;
                let left = (end - now).num_milliseconds().clamp(0, length as i64) as f64 / length;
                let planned_remaining = limit.budget_micros as f64 * left;
                if planned_remaining <= 0.0 {
                    1.0
                } else {
                    (remaining as f64 / planned_remaining).clamp(0.0, 1.0)
                }
            }
            _ => 1.0,
        }
    };
    let watermark_ms = state.watermark_ms(sums);
    let lag_ms = watermark_ms.map_or(0, |w| (now.timestamp_millis() - w).max(0));
    let rate = sums.map_or(0.0, |s| s.rate_per_ms);
    let overspend_bound_micros =
        (rate * lag_ms as f64 * multiplier.max(if exhausted { 0.0 } else { 1.0 })).ceil() as u64;
    LimitView {
        limit_id: limit.id.to_string(),
        budget_micros: limit.budget_micros,
        period: limit.period.as_str(),
        time_zone: limit.time_zone.name().to_string(),
        period_start: bounds.start.map(rfc3339),
        period_end: bounds.end.map(rfc3339),
        spend_micros: spend,
        lifetime_spend_micros: lifetime,
        remaining_micros: remaining,
        exhausted,
        pacing: Pacing {
            multiplier,
            throttle: 1.0 - multiplier,
        },
        watermark: watermark_ms
            .and_then(DateTime::<Utc>::from_timestamp_millis)
            .map(rfc3339),
        lag_ms,
        overspend_bound_micros,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use adspend_common::catalog::Catalog;
    use adspend_common::types::{SumEntry, SumsUpdate};
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
        state.apply(
            &SumsUpdate {
                shard: "all".into(),
                epoch: 1,
                seq: 1,
                push_seq: 1,
                full: true,
                watermark_ms: now.timestamp_millis(),
                source_ms: now.timestamp_millis(),
                entries: vec![
                    SumEntry {
                        limit: "d".into(),
                        bucket: today - 1,
                        bucket_micros: 300,
                        lifetime_micros: 900,
                    },
                    SumEntry {
                        limit: "d".into(),
                        bucket: today,
                        bucket_micros: 600,
                        lifetime_micros: 900,
                    },
                ],
            },
            now.timestamp_millis(),
        );
        let v = view(limit, &state, now);
        assert_eq!(v.spend_micros, 600);
        assert_eq!(v.lifetime_spend_micros, 900);
        assert_eq!(v.remaining_micros, 400);
        assert_eq!(v.period_start.as_deref(), Some("2026-11-21T05:00:00.000Z"));
        assert_eq!(v.period_end.as_deref(), Some("2026-11-22T05:00:00.000Z"));
        // Half the day left, 40% of the budget left: ahead of plan.
        assert!(
            (v.pacing.multiplier - 0.8).abs() < 1e-9,
            "{}",
            v.pacing.multiplier
        );
        assert!(!v.exhausted);
    }
}
