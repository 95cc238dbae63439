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
//! covers ([`Ledger::report`]); leases retire once expired and caught up
//! past expiry plus the grace (the ticker calls [`Leases::retire`]).

mod ledger;
mod plan;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use adspend_wire::catalog::Catalog;
use adspend_wire::lease::{lease_of_key, LeaseId};
use adspend_wire::types::SumEntry;
use async_nats::jetstream::{self, consumer, context::PublishErrorKind, stream};
use futures::StreamExt;
use tokio::sync::{mpsc, oneshot, watch, Notify, RwLock};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub(crate) use ledger::{Batch, Grant, Ledger};
pub(crate) use plan::Ask;

use crate::pacing::state::SpendState;
use crate::telemetry::LEASE_COMMIT_SECONDS;

/// The ledger stream and its one subject.
pub(crate) const LEASES_STREAM: &str = "LEASES";
pub(crate) const LEASES_SUBJECT: &str = "adspend.leases";
/// How long the stream keeps a commit: far beyond the longest lease (10
/// minutes) plus any grace a pacer runs with, so a pacer starting now
/// still reads every grant that can be live.
pub(crate) const LEDGER_MAX_AGE: Duration = Duration::from_secs(3600);
/// Most requests planned and committed together.
const MAX_QUEUED: usize = 256;
/// How long a commit that lost the race waits to fold the winner's grants
/// before it gives up (503).
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(2);
/// How long a commit keeps planning again after lost races before it
/// gives up (503).
const RACE_TIMEOUT: Duration = Duration::from_secs(3);

pub(crate) const LEASE_GRANTS_TOTAL: &str = "adspend_pacer_lease_grants_total";
pub(crate) const LEASE_GRANTED_MICROS_TOTAL: &str = "adspend_pacer_lease_granted_micros_total";
pub(crate) const LEASE_REFUSALS_TOTAL: &str = "adspend_pacer_lease_refusals_total";
pub(crate) const LEASE_EXPIRIES_TOTAL: &str = "adspend_pacer_lease_expiries_total";
pub(crate) const LEASE_UNUSED_MICROS_TOTAL: &str = "adspend_pacer_lease_unused_micros_total";
pub(crate) const LEASES_LIVE: &str = "adspend_pacer_leases_live";
pub(crate) const LEASE_COMMIT_RACES_TOTAL: &str = "adspend_pacer_lease_commit_races_total";

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
];

/// One request's grants, each with its lease id when it granted anything.
pub(crate) type Granted = Vec<(Grant, Option<LeaseId>)>;

/// One request waiting for the committer.
struct Queued {
    asks: Vec<Ask>,
    expires_at_ms: i64,
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
        let (retired, live) = {
            let mut ledger = self.ledger();
            ledger.settle(caught_up_ms);
            (ledger.retire(caught_up_ms, self.grace_ms), ledger.live())
        };
        metrics::counter!(LEASE_EXPIRIES_TOTAL).increment(retired.leases);
        metrics::counter!(LEASE_UNUSED_MICROS_TOTAL).increment(retired.unused_micros);
        metrics::gauge!(LEASES_LIVE).set(live as f64);
    }

    /// Grant what can be granted of `asks`, each lease expiring at
    /// `expires_at_ms`.
    pub(crate) async fn grant(
        &self,
        asks: Vec<Ask>,
        expires_at_ms: i64,
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

/// What the committer needs besides the queue.
struct Committer {
    js: jetstream::Context,
    ledger: Arc<Mutex<Ledger>>,
    folded: Arc<Notify>,
    spend: Arc<RwLock<SpendState>>,
    catalog: watch::Receiver<Arc<Catalog>>,
    pacer: String,
}

/// Start the ledger: create the stream if missing, follow it, and commit
/// grants. A pacer whose NATS user may not use the stream still serves
/// everything else; its lease requests are answered 503 until it can.
pub(crate) async fn start(
    client: async_nats::Client,
    replicas: usize,
    grace_ms: i64,
    spend: Arc<RwLock<SpendState>>,
    catalog: watch::Receiver<Arc<Catalog>>,
    tasks: &TaskTracker,
    shutdown: CancellationToken,
) -> Leases {
    adspend_common::telemetry::describe(DESCRIPTIONS, crate::telemetry::HISTOGRAMS);
    let ledger = Arc::new(Mutex::new(Ledger::default()));
    let folded = Arc::new(Notify::new());
    let (ready_tx, ready) = watch::channel(false);
    let (queue, queued) = mpsc::channel(MAX_QUEUED);
    let js = jetstream::new(client);
    tasks.spawn(follow(
        js.clone(),
        replicas,
        ledger.clone(),
        folded.clone(),
        ready_tx,
        shutdown.clone(),
    ));
    let committer = Committer {
        js,
        ledger: ledger.clone(),
        folded: folded.clone(),
        spend,
        catalog,
        pacer: instance_name(),
    };
    tasks.spawn(commit(committer, queued, shutdown));
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

/// Create `LEASES` if it is missing (an existing one is used as it is).
async fn ensure_stream(js: &jetstream::Context, replicas: usize) -> Result<stream::Stream, String> {
    js.get_or_create_stream(stream::Config {
        name: LEASES_STREAM.into(),
        subjects: vec![LEASES_SUBJECT.into()],
        storage: stream::StorageType::File,
        num_replicas: replicas,
        max_age: LEDGER_MAX_AGE,
        max_message_size: 4 * 1024 * 1024,
        ..Default::default()
    })
    .await
    .map_err(|e| format!("create stream {LEASES_STREAM}: {e}"))
}

/// Fold every commit of the ledger stream, from its first, in order; mark
/// the ledger ready once it has reached the stream's end as it was when
/// this began. Starts over (from the first commit not folded) whenever
/// the consumer fails.
async fn follow(
    js: jetstream::Context,
    replicas: usize,
    ledger: Arc<Mutex<Ledger>>,
    folded: Arc<Notify>,
    ready: watch::Sender<bool>,
    shutdown: CancellationToken,
) {
    let mut warned = false;
    loop {
        let followed = follow_once(&js, replicas, &ledger, &folded, &ready, &shutdown).await;
        if shutdown.is_cancelled() {
            return;
        }
        if let Err(e) = followed {
            if !warned {
                tracing::warn!(error = %e, "lease ledger unavailable: lease requests are answered 503 until it is; retrying");
                warned = true;
            } else {
                tracing::debug!(error = %e, "lease ledger still unavailable");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

async fn follow_once(
    js: &jetstream::Context,
    replicas: usize,
    ledger: &Mutex<Ledger>,
    folded: &Notify,
    ready: &watch::Sender<bool>,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let mut stream = ensure_stream(js, replicas).await?;
    let state = stream
        .info()
        .await
        .map_err(|e| format!("stream {LEASES_STREAM} info: {e}"))?
        .state
        .clone();
    let last = state.last_sequence;
    // Commits older than the stream's first have aged out (an hour after
    // they were written: their leases are long retired); there is nothing
    // to fold before it, and the next commit must follow `last`.
    let from = {
        let mut ledger = ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.skip_to(state.first_sequence.saturating_sub(1).min(last));
        ledger.folded_seq() + 1
    };
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: from,
            },
            ..Default::default()
        })
        .await
        .map_err(|e| format!("ledger consumer: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| format!("ledger consumer: {e}"))?;
    if from > last {
        ready.send_replace(true);
    }
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            m = messages.next() => m,
        };
        let Some(message) = message else {
            return Err("ledger consumer ended".into());
        };
        let message = message.map_err(|e| format!("ledger consumer: {e}"))?;
        let seq = message
            .info()
            .map_err(|e| format!("ledger message info: {e}"))?
            .stream_sequence;
        match serde_json::from_slice::<Batch>(&message.payload) {
            Ok(batch) => ledger
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .fold(seq, &batch),
            // Not ours: nothing to fold, but the sequence is taken.
            Err(e) => {
                tracing::warn!(seq, error = %e, "unreadable lease ledger message skipped");
                ledger
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .fold(seq, &Batch::default());
            }
        }
        folded.notify_waiters();
        if seq >= last {
            ready.send_replace(true);
        }
    }
}

/// The one committer: takes every queued request, plans them against the
/// ledger and writes them as one commit; on a lost race, waits to fold the
/// winner and plans again.
async fn commit(
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
            let sizes: Vec<usize> = batch.iter().map(|q| q.asks.len()).collect();
            if grants.iter().all(|g| g.micros == 0) {
                self.count(&grants);
                return Ok(answers(&sizes, grants, None));
            }
            let record = Batch {
                pacer: self.pacer.clone(),
                at_ms: adspend_common::now_ms(),
                grants,
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
                    self.ledger
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .fold(ack.sequence, &record);
                    self.count(&record.grants);
                    return Ok(answers(&sizes, record.grants, Some(ack.sequence)));
                }
                Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => {
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
                Err(e) => return Err(Unavailable(format!("write to {LEASES_STREAM}: {e}"))),
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
        let planned = plan::plan(&catalog, &spend, &ledger, &asks, now);
        (ledger.folded_seq(), planned)
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
