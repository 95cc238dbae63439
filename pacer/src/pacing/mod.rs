//! Pacing: the spend the pacer holds, and from it the answer for one limit
//! at one instant: spend in the current period, what is left, whether it is
//! exhausted, how hard to bid, and the spend it can still overrun by; plus
//! the periodic tick that advances every limit's controller and records its
//! history.
//!
//! - [`state`]: the spend as pushed by the aggregators, per limit and shard,
//!   with each limit's pacing memory (controller, history, multipliers
//!   served) and the traffic shape.
//! - `verdict`: the numbers of one limit, and the bidder's decision for an
//!   ad from the verdicts of every limit above it.
//! - `view`: a verdict as the limits API serves it.
//! - `tick`: the controllers' clock, the dashboard's history, and the
//!   multipliers served ([`served`]) that the lag guard reads back.
//!
//! - Plan: the budget spread over the period following the learned traffic
//!   shape (blended with uniform), [`shape`].
//! - Multiplier: the controller's output ([`controller`]), capped by the lag
//!   guard (which counts the spend served within the last lag as in
//!   flight); 0 when exhausted or stale.
//! - Exhausted: the remainder cannot pay for one more typical event.
//! - Stale: the limit's shard has not pushed (not even a heartbeat) for the
//!   stale threshold; not servable ([`SpendState::limit_stale`]).

pub(crate) mod controller;
pub(crate) mod served;
pub(crate) mod shape;
pub(crate) mod state;
mod tick;
mod verdict;
mod view;

pub use state::SpendState;
pub(crate) use tick::stale_limits;
pub use tick::tick;
pub(crate) use verdict::decide_counted;
pub(crate) use verdict::period_spend;
pub use verdict::{decide, verdict, Decision, Verdict};
pub(crate) use view::{view, LimitView, RegionPart};

#[cfg(test)]
mod loop_tests;

#[cfg(test)]
pub(crate) mod test_support {
    use adspend_wire::types::{SumEntry, SumsUpdate};

    use crate::pacing::state::SpendState;

    /// Push `entries` (bucket, micros) of one limit from shard "all", one
    /// sequence past what the state holds.
    pub(crate) fn push(
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

    pub(crate) const HIERARCHY: &[u8] = br#"{
      "limits": {
        "account": {"budget_micros": 10000, "period": "lifetime"},
        "campaign": {"budget_micros": 5000, "period": "daily", "time_zone": "Europe/Berlin", "parent": "account"},
        "adset-a": {"budget_micros": 1000, "period": "lifetime", "parent": "campaign"},
        "adset-b": {"budget_micros": 4000, "period": "lifetime", "parent": "campaign"}
      },
      "ads": {"ad-a": ["adset-a"], "ad-b": ["adset-b"]}
    }"#;
}
