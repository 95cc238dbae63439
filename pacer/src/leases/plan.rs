//! How much each ad of a lease request gets: what was asked, scaled by the
//! pacing of the limits above the ad, and never more than any of them has
//! left once the spend in flight is set aside (what every live lease still
//! holds, and what this batch has granted before it).

use std::collections::HashMap;
use std::sync::Arc;

use adspend_wire::catalog::Catalog;
use chrono::{DateTime, Utc};

use super::ledger::{Grant, Ledger};
use crate::pacing::state::SpendState;
use crate::pacing::verdict;

/// One ad of a request, checked: a known ad, at least one micro.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) ad_id: String,
    pub(crate) micros: u64,
}

/// Grants for `asks` (each with the expiry its lease gets), in order: 0
/// micros where nothing is left, a limit is stale or exhausted, or the ad
/// is not in `catalog` (the request was checked against another snapshot).
pub(super) fn plan(
    catalog: &Catalog,
    spend: &SpendState,
    ledger: &Ledger,
    asks: &[(&Ask, i64)],
    now: DateTime<Utc>,
) -> Vec<Grant> {
    // What this batch has granted of each limit so far.
    let mut granted: HashMap<Arc<str>, u64> = HashMap::new();
    // Each limit's room, worked out once per batch.
    let mut room: HashMap<Arc<str>, (u64, f64)> = HashMap::new();
    asks.iter()
        .map(|&(ask, expires_at_ms)| {
            let above = catalog.limits_above_ad(&ask.ad_id).unwrap_or_default();
            let mut paced: f64 = if above.is_empty() { 0.0 } else { 1.0 };
            let mut left = u64::MAX;
            for limit in &above {
                let (free, limit_paced) = *room.entry(limit.id.clone()).or_insert_with(|| {
                    let v = verdict(limit, spend, now);
                    (v.remaining.saturating_sub(ledger.held(&limit.id)), v.paced)
                });
                paced = paced.min(limit_paced);
                let used = granted.get(&limit.id).copied().unwrap_or(0);
                left = left.min(free.saturating_sub(used));
            }
            let wanted = (ask.micros as f64 * paced.clamp(0.0, 1.0)).floor() as u64;
            let micros = wanted.min(left);
            if micros > 0 {
                for limit in &above {
                    *granted.entry(limit.id.clone()).or_default() += micros;
                }
            }
            Grant {
                ad_id: ask.ad_id.clone(),
                limits: above.iter().map(|l| l.id.to_string()).collect(),
                micros,
                expires_at_ms,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::leases::ledger::Batch;
    use adspend_wire::types::{SumEntry, SumsUpdate, LIFETIME_BUCKET};

    fn catalog() -> Catalog {
        Catalog::parse(
            "test",
            br#"{"limits":{"c":{"budget_micros":10000,"period":"lifetime"},
                           "s":{"budget_micros":4000,"period":"lifetime","parent":"c"},
                           "t":{"budget_micros":100000,"period":"lifetime"}},
                 "ads":{"ad-1":["s"],"ad-2":["c"],"ad-3":["t"]}}"#,
        )
        .unwrap()
    }

    /// Spend state with `spent` on `c` and fresh pushes.
    fn spend(now: DateTime<Utc>, spent: u64) -> SpendState {
        let mut state = SpendState {
            stale_after_ms: 60_000,
            ..SpendState::default()
        };
        state.apply(
            &SumsUpdate {
                shard: "all".into(),
                epoch: 1,
                seq: 1,
                push_seq: 1,
                full: true,
                watermark_ms: now.timestamp_millis(),
                source_ms: now.timestamp_millis(),
                entries: vec![SumEntry {
                    limit: "c".into(),
                    bucket: LIFETIME_BUCKET,
                    bucket_micros: spent,
                    lifetime_micros: spent,
                    lifetime_events: 1,
                }],
            },
            now.timestamp_millis(),
        );
        state
    }

    fn ask(ad: &str, micros: u64) -> Ask {
        Ask {
            ad_id: ad.into(),
            micros,
        }
    }

    /// `plan` of `asks`, each expiring at 1.
    fn plan_of(
        catalog: &Catalog,
        spend: &SpendState,
        ledger: &Ledger,
        asks: &[Ask],
        now: DateTime<Utc>,
    ) -> Vec<Grant> {
        let asks: Vec<(&Ask, i64)> = asks.iter().map(|a| (a, 1)).collect();
        plan(catalog, spend, ledger, &asks, now)
    }

    #[test]
    fn grants_never_exceed_what_is_left_of_any_limit_above() {
        let now = Utc::now();
        let state = spend(now, 3_000);
        let mut ledger = Ledger::default();
        // ad-1 is under s (4000) and, through s's parent, c (10000 - 3000).
        let grants = plan_of(
            &catalog(),
            &state,
            &ledger,
            &[ask("ad-1", 2_500), ask("ad-1", 2_500), ask("ad-2", 9_000)],
            now,
        );
        let micros: Vec<u64> = grants.iter().map(|g| g.micros).collect();
        assert_eq!(micros, vec![2_500, 1_500, 3_000]);
        assert_eq!(grants[0].limits, vec!["s".to_string(), "c".to_string()]);
        // Folded, they hold all of c: nothing more for anybody under it.
        ledger.fold(
            1,
            &Batch {
                grants,
                ..Batch::default()
            },
        );
        assert_eq!(ledger.held("c"), 7_000);
        let again = plan_of(
            &catalog(),
            &state,
            &ledger,
            &[ask("ad-2", 1), ask("ad-3", 5)],
            now,
        );
        assert_eq!(again[0].micros, 0);
        assert_eq!(again[1].micros, 5, "other limits are untouched");
    }

    #[test]
    fn unknown_ads_and_stale_limits_get_nothing() {
        let now = Utc::now();
        let fresh = spend(now, 0);
        let grants = plan_of(
            &catalog(),
            &fresh,
            &Ledger::default(),
            &[ask("nope", 5)],
            now,
        );
        assert_eq!(grants[0].micros, 0);
        assert!(grants[0].limits.is_empty());
        // The shard pushed two minutes ago: stale.
        let stale = spend(now - chrono::Duration::minutes(2), 0);
        let grants = plan_of(
            &catalog(),
            &stale,
            &Ledger::default(),
            &[ask("ad-3", 5)],
            now,
        );
        assert_eq!(grants[0].micros, 0);
    }
}
