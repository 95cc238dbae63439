//! One budget across regions: how a limit's budget is split among the
//! regions of a deployment, moved to where the demand is, and reported
//! between them, so that grants of all regions together never exceed the
//! budget, with the links up or cut (CONTRACT.md, "Regions").
//!
//! **Allotments.** Per limit and period each region holds a share of the
//! budget, its allotment; its pacers grant only within allotment − own
//! spend − own leases in flight ([`LimitLedger::room`]). Every region starts
//! from [`initial_share`]: the budget split evenly over the sorted region
//! names, the remainder one micro each to the first names, so the shares
//! add up to the budget exactly.
//!
//! **Transfers** follow the demarcation protocol (a bounded counter): a
//! region with room *gives* by raising its own grow-only counter
//! `given[to]` ([`LimitLedger::give`]). The debit is in the giver's own
//! state before any report carries it, so no one can count it earlier; the
//! receiver credits whatever it last heard of the giver's counter. So
//! region `r`, as `r` itself computes it, has
//!
//! ```text
//! allotment(r) = initial_share(r) + Σ_{o≠r} heard(o).given[r] − Σ_{t≠r} own.given[t]
//! ```
//!
//! Since a heard counter is never above the giver's own, the allotments of
//! all regions add up to at most the budget; when every region has heard
//! every other's latest report, exactly to it. Budget in transit (debited
//! at the giver, not yet credited at the receiver) is stranded for a
//! while, never doubled.
//!
//! **Who gets what.** Each region reports its unmet demand (`want_micros`)
//! and what it has credited of every giver (`received`).
//! [`LimitLedger::plan_gifts`] keeps the larger of a reserve (a per-mille
//! of the allotment) and the region's own unmet demand, and gives the rest
//! of its room to the regions that want, less what is still in transit to
//! them: all of each need if the spare covers them, else in proportion.
//!
//! **Reports.** Every region publishes its state as a [`RegionReport`];
//! receivers [`merge`](LimitLedger::merge) it by taking the maximum of each
//! grow-only counter within a period, so duplicates, reordering, loss and a
//! replay after a cut never move a value backwards or count a transfer
//! twice. A newer period replaces an older one; counters restart at 0.
//!
//! What this module assumes of its caller: every region has the same region
//! set and the same budget (while a catalog edit spreads, regions split
//! different budgets; a lowered budget can leave a region's allotment below
//! what it already granted, and its room is then 0); a region keeps its `given` counters durably before
//! publishing them (merging its own last report back restores them);
//! `seq` grows across restarts; when a ledger moves to a newer period
//! ([`Merged::NewPeriod`] or [`LimitLedger::roll_to`]) the caller's own
//! spend and leases passed to it are those of that period.

mod ledger;
mod name;
mod report;
#[cfg(test)]
mod sim_tests;

pub use ledger::{initial_share, Heard, LimitLedger, Merged, Origin};
pub use name::{RegionError, RegionName, MAX_REGION_NAME_LEN};
pub use report::{
    LimitEntry, RegionReport, LIFETIME_PERIOD_START_MS, MAX_REGIONS, MAX_REPORT_BYTES,
    MAX_REPORT_LIMITS, REPORT_VERSION,
};
