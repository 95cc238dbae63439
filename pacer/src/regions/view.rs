//! A limit's regions as `GET /v1/limits` serves them (CONTRACT.md
//! "Regions"): each region's part as this region last heard it, this
//! region's allotment, and the spend of all regions together.

use std::collections::BTreeMap;

use super::Book;
use crate::pacing::{LimitView, RegionPart};

/// Turns a one-region view (this region's own figures, its leases
/// included) into the deployment's: spend and remaining across regions,
/// this region's allotment, and every region's part. Unchanged when the
/// book has no ledger of the limit or has not yet read its own reports
/// back (its allotment may still be missing what it gave).
pub(crate) fn with_regions(mut view: LimitView, book: &Book, now_ms: i64) -> LimitView {
    let Some(ledger) = book.ledger(&view.limit_id).filter(|_| book.is_ready()) else {
        return view;
    };
    let mut parts = BTreeMap::new();
    for region in book.regions() {
        let part = if region == book.region() {
            RegionPart {
                spend_micros: view.spend_micros,
                lifetime_spend_micros: view.lifetime_spend_micros,
                allotment_micros: ledger.allotment(),
                leased_micros: view.leased_micros,
                as_of_ms: Some(now_ms),
            }
        } else {
            let heard = ledger.heard(region);
            RegionPart {
                spend_micros: heard.map_or(0, |h| h.spend_micros),
                lifetime_spend_micros: heard.map_or(0, |h| h.lifetime_spend_micros),
                allotment_micros: ledger.allotment_of(region),
                leased_micros: heard.map_or(0, |h| h.leased_micros),
                as_of_ms: heard.map(|h| h.as_of_ms),
            }
        };
        parts.insert(region.to_string(), part);
    }
    let spend = ledger.global_spend(view.spend_micros);
    view.lifetime_spend_micros = ledger.global_lifetime_spend(view.lifetime_spend_micros);
    view.spend_micros = spend;
    view.remaining_micros = view.budget_micros.saturating_sub(spend);
    view.allotment_micros = Some(ledger.allotment());
    view.regions = Some(parts);
    view
}
