//! Spend leases (CONTRACT.md "Spend leases"; docs/LEASES.md): an ad server
//! leases an amount of an ad's budget, serves within it and tags each
//! impression with the lease id; the pacers together never grant more than
//! a limit has left once the spend in flight is set aside.
//!
//! The ledger every pacer shares is the JetStream stream `LEASES`: each
//! commit of grants is one message, published only if the stream's last
//! sequence is still the one the grants were planned against (JetStream's
//! expected-last-sequence check). A pacer that loses that race folds what
//! the other committed and plans again, so the grants of all pacers form
//! one sequence and each was planned knowing every grant before it. Every
//! pacer follows the stream from its start ([`follow`]), so a restarted
//! pacer knows every live grant before it grants again, and a killed
//! pacer's grants stay counted until they retire.
//!
//! Requests queue for the one committer of this pacer ([`commit`]), which
//! plans every queued request against the ledger ([`plan`]) and publishes
//! them as one message: one stream write (and fsync) per batch of requests,
//! not per grant. The spend reported under each lease comes in with the
//! sums pushes (the limiter books it to the lease's key) and frees what it
//! covers ([`Ledger::report`]). An ad server done with a lease may release
//! it, saying what it served under it ([`Leases::release`]): the release
//! is committed like a grant, and every pacer frees what was not served.
//! Leases retire once expired and caught up past expiry plus the grace
//! (the ticker calls [`Leases::retire`]).

mod commit;
mod follow;
mod ledger;
mod plan;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use adspend_wire::catalog::Catalog;
use adspend_wire::lease::{lease_of_key, LeaseId};
use adspend_wire::types::SumEntry;
use async_nats::jetstream;
use tokio::sync::{mpsc, oneshot, watch, Notify, RwLock};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub(crate) use ledger::{Batch, Grant, Ledger, Release};
pub(crate) use plan::Ask;

use crate::pacing::state::SpendState;

/// The ledger stream and its one subject.
pub(crate) const LEASES_STREAM: &str = "LEASES";
pub(crate) const LEASES_SUBJECT: &str = "adspend.leases";
/// How long the stream keeps a commit: far beyond the longest lease (10
/// minutes) plus any grace a pacer runs with, so a pacer starting now
/// still reads every grant that can be live.
pub(crate) const LEDGER_MAX_AGE: Duration = Duration::from_secs(3600);

pub(crate) const LEASE_GRANTS_TOTAL: &str = "adspend_pacer_lease_grants_total";
pub(crate) const LEASE_GRANTED_MICROS_TOTAL: &str = "adspend_pacer_lease_granted_micros_total";
pub(crate) const LEASE_REFUSALS_TOTAL: &str = "adspend_pacer_lease_refusals_total";
pub(crate) const LEASE_EXPIRIES_TOTAL: &str = "adspend_pacer_lease_expiries_total";
pub(crate) const LEASE_UNUSED_MICROS_TOTAL: &str = "adspend_pacer_lease_unused_micros_total";
pub(crate) const LEASES_LIVE: &str = "adspend_pacer_leases_live";
pub(crate) const LEASE_COMMIT_RACES_TOTAL: &str = "adspend_pacer_lease_commit_races_total";
pub(crate) const LEASE_RELEASES_TOTAL: &str = "adspend_pacer_lease_releases_total";
pub(crate) const LEASE_RELEASED_MICROS_TOTAL: &str = "adspend_pacer_lease_released_micros_total";

pub(crate) const DESCRIPTIONS: &[(&str, &str)] = &[
    (LEASE_GRANTS_TOTAL, "Leases granted (more than 0 micros)."),
    (LEASE_GRANTED_MICROS_TOTAL, "Micros granted in leases."),
    (
        LEASE_REFUSALS_TOTAL,
        "Lease asks granted nothing, by reason: nothing_left (exhausted, stale or paced to 0), unavailable (the ledger could not be written or read).",
    ),
    (LEASE_EXPIRIES_TOTAL, "Leases retired after expiry plus the grace."),
    (
        LEASE_UNUSED_MICROS_TOTAL,
        "Micros granted in leases that retired with no spend reported against them.",
    ),
    (LEASES_LIVE, "Leases this pacer counts as live (all pacers' grants)."),
    (
        LEASE_COMMIT_RACES_TOTAL,
        "Lease commits that found another pacer's commit first and planned again.",
    ),
    (
        LEASE_RELEASES_TOTAL,
        "Leases released by their ad servers (all pacers' releases, as this pacer folded them).",
    ),
    (
        LEASE_RELEASED_MICROS_TOTAL,
        "Micros granted, not served, and freed by releases before expiry plus the grace.",
    ),
];

/// One request's grants, each with its lease id when it granted anything.
pub(crate) type Granted = Vec<(Grant, Option<LeaseId>)>;

/// One request waiting for the committer: asks to grant (a lease
/// request), or leases to release (a release request).
struct Queued {
    asks: Vec<Ask>,
    expires_at_ms: i64,
    releases: Vec<Release>,
    answer: oneshot::Sender<Result<Granted, Unavailable>>,
}

/// Why no grant could be made: the ledger is not loaded yet, or could not
/// be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Unavailable(pub String);

/// This pacer's view of the ledger and its way in.
#[derive(Clone)]
pub struct Leases {
    ledger: Arc<Mutex<Ledger>>,
    /// Set once the ledger has been read up to where the stream was when
    /// this pacer started; grants wait for it.
    ready: watch::Receiver<bool>,
    queue: mpsc::Sender<Queued>,
    grace_ms: i64,
}

impl Leases {
    pub(crate) fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// What the live leases hold of `limit`'s budget (its spend in flight
    /// under leases), and how many there are.
    pub(crate) fn held_and_live(&self, limit: &str) -> (u64, u64) {
        let held = self.ledger().held_by(limit);
        (held.micros, held.leases)
    }

    /// Take the lease keys out of a sums push complete as of `as_of_ms`:
    /// their sums are the spend reported under each lease, which frees
    /// what it covers once every shard has caught up ([`Leases::retire`]).
    pub(crate) fn take_reports(&self, entries: &mut Vec<SumEntry>, as_of_ms: i64) {
        if !entries.iter().any(|e| e.limit.starts_with('~')) {
            return;
        }
        let mut ledger = self.ledger();
        entries.retain(|entry| match lease_of_key(&entry.limit) {
            Some(id) => {
                ledger.report(id, entry.lifetime_micros, as_of_ms);
                false
            }
            None => true,
        });
    }

    /// Every shard has caught up to `caught_up_ms`: apply the reports that
    /// waited for it, and retire what expired more than the grace before.
    pub(crate) fn retire(&self, caught_up_ms: i64) {
        let (retired, live, released) = {
            let mut ledger = self.ledger();
            ledger.settle(caught_up_ms);
            let retired = ledger.retire(caught_up_ms, self.grace_ms);
            (retired, ledger.live(), ledger.released())
        };
        metrics::counter!(LEASE_EXPIRIES_TOTAL).increment(retired.leases);
        metrics::counter!(LEASE_UNUSED_MICROS_TOTAL).increment(retired.unused_micros);
        metrics::counter!(LEASE_RELEASES_TOTAL).absolute(released.leases);
        metrics::counter!(LEASE_RELEASED_MICROS_TOTAL).absolute(released.micros);
        metrics::gauge!(LEASES_LIVE).set(live as f64);
    }

    /// Commit `releases` (each of a live lease this pacer has not seen
    /// released) to the ledger; once this returns, every pacer that folds
    /// the ledger this far frees what each lease's ad server did not serve.
    pub(crate) async fn release(&self, releases: Vec<Release>) -> Result<(), Unavailable> {
        self.enqueue(Vec::new(), 0, releases).await.map(|_| ())
    }

    /// Grant what can be granted of `asks`, each lease expiring at
    /// `expires_at_ms`.
    pub(crate) async fn grant(
        &self,
        asks: Vec<Ask>,
        expires_at_ms: i64,
    ) -> Result<Granted, Unavailable> {
        self.enqueue(asks, expires_at_ms, Vec::new()).await
    }

    async fn enqueue(
        &self,
        asks: Vec<Ask>,
        expires_at_ms: i64,
        releases: Vec<Release>,
    ) -> Result<Granted, Unavailable> {
        if !*self.ready.borrow() {
            return Err(Unavailable(
                "the lease ledger is still being read (this pacer just started)".into(),
            ));
        }
        let (answer, answered) = oneshot::channel();
        let queued = Queued {
            asks,
            expires_at_ms,
            releases,
            answer,
        };
        self.queue
            .send(queued)
            .await
            .map_err(|_| Unavailable("the pacer is stopping".into()))?;
        answered
            .await
            .map_err(|_| Unavailable("the pacer is stopping".into()))?
    }
}

/// What grants are planned against besides the ledger.
pub(crate) struct Inputs {
    pub(crate) spend: Arc<RwLock<SpendState>>,
    pub(crate) catalog: watch::Receiver<Arc<Catalog>>,
    /// The allotments across regions; None in one region.
    pub(crate) regions: Option<crate::regions::Regions>,
}

/// Start the ledger: create the stream if missing, follow it, and commit
/// grants. A pacer whose NATS user may not use the stream still serves
/// everything else; its lease requests are answered 503 until it can.
pub(crate) async fn start(
    client: async_nats::Client,
    replicas: usize,
    grace_ms: i64,
    inputs: Inputs,
    tasks: &TaskTracker,
    shutdown: CancellationToken,
) -> Leases {
    let Inputs {
        spend,
        catalog,
        regions,
    } = inputs;
    adspend_common::telemetry::describe(DESCRIPTIONS, crate::telemetry::HISTOGRAMS);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let folded = Arc::new(Notify::new());
    let (ready_tx, ready) = watch::channel(false);
    let (queue, queued) = mpsc::channel(commit::MAX_QUEUED);
    let js = jetstream::new(client);
    tasks.spawn(follow::follow(
        js.clone(),
        replicas,
        ledger.clone(),
        folded.clone(),
        ready_tx,
        shutdown.clone(),
    ));
    let committer = commit::Committer {
        js,
        ledger: ledger.clone(),
        folded: folded.clone(),
        spend,
        catalog,
        pacer: instance_name(),
        regions,
    };
    tasks.spawn(commit::commit(committer, queued, shutdown));
    Leases {
        ledger,
        ready,
        queue,
        grace_ms,
    }
}

fn instance_name() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
    format!("{}/{}", host.trim(), std::process::id())
}
