//! The failure-injection campaign: rounds of publishing with duplicates while
//! one fault is injected into the running pipeline (a named failure point, a
//! SIGKILL of a service, a kill -9 of NATS or etcd), each followed by a
//! restart; after every round the pacer must equal the truth exactly, and at
//! the end so must the aggregator's own LMDB.
//!
//! Used by the integration suite (a short campaign) and by `adchaos` (a long
//! one that prints the figures in the README).

//! `campaign` runs the rounds and the final check; `report` holds the
//! figures and prints them.

mod campaign;
mod report;
mod shards;

use std::collections::BTreeMap;

use anyhow::Context;

pub use self::campaign::run;
pub use self::report::Report;
use adspend_harness::pipeline::Backends;

/// One kind of fault.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fault {
    /// A named failure point in the aggregator or limiter (`ADSPEND_FAILPOINTS`).
    Point(&'static str),
    KillAggregator,
    KillLimiter,
    KillPacer,
    KillNats,
    KillEtcd,
}

impl Fault {
    pub fn name(self) -> String {
        match self {
            Fault::Point(p) => format!("failpoint {p}"),
            Fault::KillAggregator => "SIGKILL aggregator".into(),
            Fault::KillLimiter => "SIGKILL limiter".into(),
            Fault::KillPacer => "SIGKILL pacer".into(),
            Fault::KillNats => "kill -9 nats-server".into(),
            Fault::KillEtcd => "kill -9 etcd".into(),
        }
    }
}

/// Where one round's time went, in milliseconds: the wait before the
/// fault, injecting it (stops, a failure point's life until it fires, kills),
/// the victim's recovery after its restart, the rest of the publisher's
/// run, reading the truth back from the stream, and settling to it.
#[derive(Clone, Copy, Debug, Default)]
pub struct RoundTimes {
    pub total: u64,
    pub before: u64,
    pub inject: u64,
    pub recover: u64,
    pub publisher: u64,
    pub truth: u64,
    pub settle: u64,
}

impl std::fmt::Display for RoundTimes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ms: before {} inject {} recover {} publisher {} truth {} settle {}",
            self.total,
            self.before,
            self.inject,
            self.recover,
            self.publisher,
            self.truth,
            self.settle
        )
    }
}

/// Every failure point the services define.
pub const POINTS: [&str; 8] = [
    "aggregator.before_commit",
    "aggregator.after_commit",
    "aggregator.mid_copy",
    "aggregator.mid_upload",
    "aggregator.after_upload",
    "aggregator.after_record",
    "aggregator.during_restore",
    "limiter.after_publish",
];

/// Every kind, in the order a campaign first walks through them (restore
/// needs a checkpoint, so it comes after the others have made some).
pub fn all_faults() -> Vec<Fault> {
    let mut faults: Vec<Fault> = vec![Fault::KillAggregator, Fault::KillLimiter];
    faults.extend(POINTS.iter().map(|p| Fault::Point(p)));
    faults.extend([Fault::KillPacer, Fault::KillNats, Fault::KillEtcd]);
    faults
}

#[derive(Clone, Debug)]
pub struct CampaignConfig {
    pub rounds: usize,
    pub seed: u64,
    pub events_per_round: u64,
    /// Simulator rate (events/s) during a round.
    pub rate: f64,
    pub duplicate_rate: f64,
    pub ads: u32,
    pub backends: Backends,
    /// Inject every kind once, in order, before picking at random.
    pub walk_all_first: bool,
    /// The aggregator's `ADSPEND_AGGREGATOR_WRITERS` ("auto" or a count).
    pub writers: String,
    /// Only the faults whose name contains one of these (all when empty),
    /// to study one kind's recovery.
    pub only: Vec<String>,
}

impl Default for CampaignConfig {
    fn default() -> Self {
        CampaignConfig {
            rounds: all_faults().len(),
            seed: 1,
            events_per_round: 12_000,
            rate: 6_000.0,
            duplicate_rate: 0.1,
            ads: 300,
            backends: Backends {
                etcd: true,
                s3: true,
            },
            walk_all_first: true,
            writers: "1".into(),
            only: Vec::new(),
        }
    }
}

/// Lifetime sums in an aggregator's LMDB (the aggregator must be stopped).
pub fn aggregator_totals(lmdb_dir: &std::path::Path) -> anyhow::Result<BTreeMap<String, u64>> {
    let store = adspend_aggregator::store::Store::open(lmdb_dir, 1 << 30)?;
    let totals = {
        let txn = store.read_txn()?;
        let mut totals = BTreeMap::new();
        for item in store.lifetime.iter(&txn)? {
            let (limit, value) = item?;
            let (micros, _) = adspend_aggregator::store::parse_lifetime(value)
                .context("a lifetime value that is not 16 bytes")?;
            totals.insert(limit.to_string(), micros);
        }
        totals
    };
    store.env.prepare_for_closing().wait();
    Ok(totals)
}
