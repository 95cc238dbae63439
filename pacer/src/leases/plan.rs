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
use crate::regions::Book;

/// One ad of a request, checked: a known ad, at least one micro.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) ad_id: String,
    pub(crate) micros: u64,
}

/// Grants for `asks` (each with the expiry its lease gets), in order: 0
/// micros where nothing is left, a limit is stale or exhausted, or the ad
/// is not in `catalog` (the request was checked against another snapshot).
///
/// Across regions (`regions` set) a limit has left at most this region's
/// room in its allotment ([`Book::room`]); what an ask wanted beyond that
/// room is the region's unmet demand ([`Book::add_want`]), which other
/// regions answer by giving. Without regions this is exactly the one
/// region's plan.
pub(super) fn plan(
    catalog: &Catalog,
    spend: &SpendState,
    ledger: &Ledger,
    mut regions: Option<&mut Book>,
    asks: &[(&Ask, i64)],
    now: DateTime<Utc>,
) -> Vec<Grant> {
    // What this batch has granted of each limit so far.
    let mut granted: HashMap<Arc<str>, u64> = HashMap::new();
    // Each limit's room (and, across regions, its room in this region's
    // allotment), worked out once per batch.
    let mut room: HashMap<Arc<str>, (u64, Option<u64>, f64)> = HashMap::new();
    let mut grants = Vec::with_capacity(asks.len());
    for &(ask, expires_at_ms) in asks {
        let above = catalog.limits_above_ad(&ask.ad_id).unwrap_or_default();
        let mut paced: f64 = if above.is_empty() { 0.0 } else { 1.0 };
        let mut left = u64::MAX;
        for limit in &above {
            let (free, allotted, limit_paced) =
                *room.entry(limit.id.clone()).or_insert_with(|| {
                    let v = verdict(limit, spend, now);
                    let held = ledger.held(&limit.id);
                    let allotted = regions.as_deref().map(|b| b.room(&limit.id, v.spend, held));
                    (v.remaining.saturating_sub(held), allotted, v.paced)
                });
            paced = paced.min(limit_paced);
            let used = granted.get(&limit.id).copied().unwrap_or(0);
            left = left.min(free.saturating_sub(used));
            if let Some(allotted) = allotted {
                left = left.min(allotted.saturating_sub(used));
            }
        }
        let wanted = (ask.micros as f64 * paced.clamp(0.0, 1.0)).floor() as u64;
        let micros = wanted.min(left);
        if micros > 0 {
            for limit in &above {
                *granted.entry(limit.id.clone()).or_default() += micros;
            }
        }
        if let Some(book) = regions.as_deref_mut() {
            for limit in &above {
                let (_, allotted, _) = room[&limit.id];
                let used = granted.get(&limit.id).copied().unwrap_or(0);
                // Before this grant, the allotment had `allotted - (used -
                // micros)` left; the ask went short of it by the rest.
                let had = allotted.unwrap_or(0).saturating_sub(used - micros);
                let short = wanted.saturating_sub(had);
                if short > 0 {
                    book.add_want(&limit.id, short);
                }
            }
        }
        grants.push(Grant {
            ad_id: ask.ad_id.clone(),
            limits: above.iter().map(|l| l.id.to_string()).collect(),
            micros,
            expires_at_ms,
        });
    }
    grants
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
        plan(catalog, spend, ledger, None, &asks, now)
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
    fn across_regions_grants_stay_within_the_allotment_and_the_rest_is_wanted() {
        use adspend_wire::regions::RegionName;
        let now = Utc::now();
        let state = spend(now, 3_000);
        let regions = ["east", "west"].map(|r| RegionName::new(r).unwrap());
        let mut book = Book::new(regions[0].clone(), regions.iter().cloned().collect());
        book.follow_catalog(&catalog(), now);
        let asks = [ask("ad-2", 9_000), ask("ad-2", 1_000), ask("ad-3", 5)];
        let asked: Vec<(&Ask, i64)> = asks.iter().map(|a| (a, 1)).collect();
        // Not ready (its own reports not read back): nothing on c or t.
        let grants = plan(
            &catalog(),
            &state,
            &Ledger::default(),
            Some(&mut book),
            &asked,
            now,
        );
        assert!(grants.iter().all(|g| g.micros == 0), "{grants:?}");
        book.set_ready();
        // c's budget 10000 split in two: east's 5000, less 3000 spent.
        book.add_pending([("c", 500)]);
        let grants = plan(
            &catalog(),
            &state,
            &Ledger::default(),
            Some(&mut book),
            &asked,
            now,
        );
        let micros: Vec<u64> = grants.iter().map(|g| g.micros).collect();
        assert_eq!(micros, vec![1_500, 0, 5]);
        // Without regions the same asks get what the budget has left.
        let alone = plan(&catalog(), &state, &Ledger::default(), None, &asked, now);
        let micros: Vec<u64> = alone.iter().map(|g| g.micros).collect();
        assert_eq!(micros, vec![7_000, 0, 5]);
        // What went short of the room is wanted: 7500 + 1000 on c, and,
        // from the first plan before the book was ready, all of it.
        let own = std::collections::HashMap::new();
        let (_, entries) = book.next_report(&catalog(), &own);
        let want = |id: &str| {
            entries
                .iter()
                .find(|e| e.limit_id == id)
                .unwrap()
                .want_micros
        };
        assert_eq!(want("c"), 10_000 + 8_500);
        assert_eq!(want("t"), 5);
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
