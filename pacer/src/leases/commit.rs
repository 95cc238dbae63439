//! The one committer of a pacer: plans every queued request against the
//! ledger and writes them as one commit, expecting the stream's last
//! sequence to be the one it planned against; on a lost race it folds the
//! winner and plans again.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use adspend_wire::catalog::Catalog;
use async_nats::jetstream::{self, context::PublishErrorKind};
use tokio::sync::{mpsc, watch, Notify, RwLock};
use tokio_util::sync::CancellationToken;

use super::plan;
use super::{
    Ask, Batch, Grant, Granted, Ledger, Queued, Release, Unavailable, LEASES_STREAM,
    LEASES_SUBJECT, LEASE_COMMIT_RACES_TOTAL, LEASE_GRANTED_MICROS_TOTAL, LEASE_GRANTS_TOTAL,
    LEASE_REFUSALS_TOTAL,
};
use crate::pacing::state::SpendState;
use crate::telemetry::LEASE_COMMIT_SECONDS;

/// Most requests planned and committed together.
pub(super) const MAX_QUEUED: usize = 256;
/// How long a commit that lost the race waits to fold the winner's grants
/// before it gives up (503).
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a commit keeps planning again after lost races before it
/// gives up (503).
const RACE_TIMEOUT: Duration = Duration::from_secs(3);

/// What the committer needs besides the queue.
pub(super) struct Committer {
    pub(super) js: jetstream::Context,
    pub(super) ledger: Arc<Mutex<Ledger>>,
    pub(super) folded: Arc<Notify>,
    pub(super) spend: Arc<RwLock<SpendState>>,
    pub(super) catalog: watch::Receiver<Arc<Catalog>>,
    pub(super) pacer: String,
    /// The allotments across regions; None in one region.
    pub(super) regions: Option<crate::regions::Regions>,
}

/// The one committer: takes every queued request, plans them against the
/// ledger and writes them as one commit; on a lost race, waits to fold the
/// winner and plans again.
pub(super) async fn commit(
    committer: Committer,
    mut queued: mpsc::Receiver<Queued>,
    shutdown: CancellationToken,
) {
    let mut batch: Vec<Queued> = Vec::new();
    loop {
        let first = tokio::select! {
            _ = shutdown.cancelled() => return,
            q = queued.recv() => q,
        };
        let Some(first) = first else { return };
        batch.push(first);
        while batch.len() < MAX_QUEUED {
            match queued.try_recv() {
                Ok(q) => batch.push(q),
                Err(_) => break,
            }
        }
        let started = Instant::now();
        let outcome = committer.commit_batch(&batch).await;
        metrics::histogram!(LEASE_COMMIT_SECONDS).record(started.elapsed().as_secs_f64());
        match outcome {
            Ok(mut answers) => {
                for (q, answer) in batch.drain(..).zip(answers.drain(..)) {
                    let _ = q.answer.send(Ok(answer));
                }
            }
            Err(e) => {
                tracing::warn!(error = %e.0, requests = batch.len(), "lease grants not written");
                for q in batch.drain(..) {
                    metrics::counter!(LEASE_REFUSALS_TOTAL, "reason" => "unavailable")
                        .increment(q.asks.len() as u64);
                    let _ = q.answer.send(Err(e.clone()));
                }
            }
        }
    }
}

type Answers = Vec<Granted>;

impl Committer {
    async fn commit_batch(&self, batch: &[Queued]) -> Result<Answers, Unavailable> {
        let deadline = Instant::now() + RACE_TIMEOUT;
        let mut races: u32 = 0;
        while Instant::now() < deadline {
            let (expected, grants) = self.plan(batch).await;
            // Across regions the grants are out of the allotment's room
            // from now until the ledger holds them (or they fail).
            let planned = grants.clone();
            let sizes: Vec<usize> = batch.iter().map(|q| q.asks.len()).collect();
            let releases: Vec<Release> = batch
                .iter()
                .flat_map(|q| q.releases.iter().cloned())
                .collect();
            if grants.iter().all(|g| g.micros == 0) && releases.is_empty() {
                self.count(&grants);
                return Ok(answers(&sizes, grants, None));
            }
            let record = Batch {
                pacer: self.pacer.clone(),
                at_ms: adspend_common::now_ms(),
                grants,
                releases,
            };
            let payload = serde_json::to_vec(&record).expect("a lease batch serializes");
            let publish = jetstream::message::PublishMessage::build()
                .payload(payload.into())
                .expected_last_sequence(expected);
            let acked = match self.js.send_publish(LEASES_SUBJECT, publish).await {
                Ok(ack) => ack.await,
                Err(e) => Err(e),
            };
            match acked {
                Ok(ack) => {
                    let mut ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
                    ledger.fold(ack.sequence, &record);
                    self.unpend(&planned);
                    drop(ledger);
                    self.count(&record.grants);
                    return Ok(answers(&sizes, record.grants, Some(ack.sequence)));
                }
                Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
                    self.unpend(&planned);
                    metrics::counter!(LEASE_COMMIT_RACES_TOTAL).increment(1);
                    self.catch_up(expected).await?;
                    races += 1;
                    // Two pacers committing back to back can keep taking
                    // the same turn: after the first loss, step aside for
                    // a random while, longer with each loss.
                    if races > 1 {
                        tokio::time::sleep(jitter(races)).await;
                    }
                }
                Err(e) => {
                    self.unpend(&planned);
                    return Err(Unavailable(format!("write to {LEASES_STREAM}: {e}")));
                }
            }
        }
        Err(Unavailable(format!(
            "lost {races} races in a row to other pacers' commits within {RACE_TIMEOUT:?}"
        )))
    }

    /// Plan every queued request against the ledger as folded now; the
    /// sequence it was folded to is what the commit expects to follow.
    async fn plan(&self, batch: &[Queued]) -> (u64, Vec<Grant>) {
        let catalog = self.catalog.borrow().clone();
        let spend = self.spend.read().await;
        let ledger = self.ledger.lock().unwrap_or_else(|e| e.into_inner());
        let now = chrono::Utc::now();
        // Requests of one commit plan one after the other: what an earlier
        // one got is set aside for the later ones.
        let asks: Vec<(&Ask, i64)> = batch
            .iter()
            .flat_map(|q| q.asks.iter().map(|a| (a, q.expires_at_ms)))
            .collect();
        let mut book = self.regions.as_ref().map(|r| r.book());
        let planned = plan::plan(&catalog, &spend, &ledger, book.as_deref_mut(), &asks, now);
        if let Some(book) = book.as_deref_mut() {
            book.add_pending(pending(&planned));
        }
        (ledger.folded_seq(), planned)
    }

    /// The grants planned are in the ledger, or will never be.
    fn unpend(&self, planned: &[Grant]) {
        if let Some(regions) = &self.regions {
            regions.book().remove_pending(pending(planned));
        }
    }

    /// Wait until the ledger has folded past `expected` (the commit that
    /// won the race).
    async fn catch_up(&self, expected: u64) -> Result<(), Unavailable> {
        let deadline = tokio::time::Instant::now() + CATCH_UP_TIMEOUT;
        loop {
            let notified = self.folded.notified();
            if self
                .ledger
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .folded_seq()
                > expected
            {
                return Ok(());
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return Err(Unavailable(format!(
                    "another pacer's commit to {LEASES_STREAM} did not arrive within {CATCH_UP_TIMEOUT:?}"
                )));
            }
        }
    }

    fn count(&self, grants: &[Grant]) {
        let given: Vec<&Grant> = grants.iter().filter(|g| g.micros > 0).collect();
        metrics::counter!(LEASE_GRANTS_TOTAL).increment(given.len() as u64);
        metrics::counter!(LEASE_GRANTED_MICROS_TOTAL)
            .increment(given.iter().map(|g| g.micros).sum::<u64>());
        metrics::counter!(LEASE_REFUSALS_TOTAL, "reason" => "nothing_left")
            .increment((grants.len() - given.len()) as u64);
    }
}

/// Each grant's micros on each limit it holds.
fn pending(grants: &[Grant]) -> impl Iterator<Item = (&str, u64)> {
    grants
        .iter()
        .filter(|g| g.micros > 0)
        .flat_map(|g| g.limits.iter().map(move |l| (l.as_str(), g.micros)))
}

/// A random pause up to 0.5 ms for each race lost in a row (at most 8 ms).
fn jitter(races: u32) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    // A cheap spread of the clock's low bits (they differ between pacers).
    let spread =
        (u64::from(nanos).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40) as f64 / (1u64 << 24) as f64;
    Duration::from_micros((spread * 500.0 * f64::from(races.min(16))) as u64)
}

/// The grants of one commit split back into its requests, each grant with
/// its lease id when it granted anything.
fn answers(sizes: &[usize], grants: Vec<Grant>, seq: Option<u64>) -> Answers {
    let mut grants = grants.into_iter().enumerate();
    sizes
        .iter()
        .map(|&n| {
            grants
                .by_ref()
                .take(n)
                .map(|(index, grant)| {
                    let id = match seq {
                        Some(seq) if grant.micros > 0 => Some(Batch::lease_id(seq, index, &grant)),
                        _ => None,
                    };
                    (grant, id)
                })
                .collect()
        })
        .collect()
}
