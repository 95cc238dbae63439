//! A shard's running parts: the writer thread, the consumer, the dead
//! lettering of set-aside tuples, the checkpointer and the pusher; started
//! in that order, wound down in an order that keeps a handover exact.
//!
//! The tokens form one tree: the consumer's is a child of the shard's stop
//! token, so a stop (or a failure) ends the intake first. The checkpointer
//! and the pusher must outlive the stop (a handover's last checkpoint and
//! the last push come after the writer's final commit), so theirs are
//! children of the shard's own `tail` token, cancelled one by one by the
//! wind-down, and all at once if the shard's task ends any other way.

use std::future::Future;
use std::sync::{Arc, Mutex};

use adspend_common::nats;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

use super::consume;
use super::{hex, Opened, Started, Stop};
use crate::apply::{self, Dirty, Overflowed, Writer};
use crate::checkpoint::checkpointer::Checkpointer;
use crate::checkpoint::delta::Changes;
use crate::checkpoint::record::CheckpointRecord;
use crate::checkpoint::trim::SpendTrim;
use crate::error::Error;
use crate::push;
use crate::store::Store;
use crate::telemetry::ShardGauges;

const INCOMING_QUEUE: usize = 512;

/// A shard applying: its parts, and what winding them down needs.
pub(super) struct Running {
    shard: String,
    started: Started,
    client: async_nats::Client,
    store: Arc<Store>,
    /// Every task of the shard.
    tasks: TaskTracker,
    /// Ends the intake: a child of the stop token, also cancelled by a failure.
    cancel: CancellationToken,
    failure: Failure,
    writer: std::thread::JoinHandle<()>,
    consumer: JoinHandle<()>,
    dead_letters: JoinHandle<()>,
    checkpointer: JoinHandle<Option<Checkpointer>>,
    checkpoint_stop: CancellationToken,
    pusher: JoinHandle<()>,
    push_stop: CancellationToken,
    /// Cancels the checkpointer's and pusher's tokens when dropped.
    _tail: DropGuard,
    _gauges: ShardGauges,
}

/// Start the writer thread, then the consumer, the dead lettering of
/// set-aside tuples, the checkpointer and the pusher.
pub(super) async fn start(opened: Opened, stop: &Stop) -> Result<Running, Error> {
    let cancel = stop.token.child_token();
    let tail = CancellationToken::new();
    let failure = Failure::new(&opened.shard, cancel.clone());
    let tasks = TaskTracker::new();
    let dirty = Arc::new(Dirty::new(opened.last_applied));
    let (checkpoint_tx, checkpoint_rx) = watch::channel((0, 0));
    let writer = Writer::new(
        opened.store.clone(),
        opened.settings.dedupe,
        dirty.clone(),
        checkpoint_tx,
    )?
    .with_closed_period_days(opened.settings.closed_period_days)
    .for_shard(&opened.shard, opened.lease.clone());
    let changes = writer.changes();
    let window = writer.window();
    // The next checkpoint extends the recorded chain when the store is of
    // its lineage: at the record (a cold restore) the writer's changes start
    // there; past it (a warm start) they start with what the store holds
    // since the record, read from it. Another lineage starts a new base.
    let chain = (opened.record.clone()).filter(|r| r.lineage == opened.lineage);
    resume_chain(&opened, chain.as_ref(), &changes).await?;
    let (overflow_tx, overflow_rx) = mpsc::unbounded_channel::<Overflowed>();
    let writer = writer.with_overflow_sink(overflow_tx);
    let (incoming_tx, incoming_rx) = mpsc::channel(INCOMING_QUEUE);
    let writer = spawn_writer(&opened.shard, writer, incoming_rx, failure.clone())?;

    nats::ensure_deadletter(&opened.js, opened.settings.stream_replicas).await?;
    let trim = (opened.settings.spend_trim).then(|| {
        SpendTrim::new(
            opened.stream.clone(),
            opened.js.clone(),
            opened.partitions.clone(),
        )
    });
    let consumer = consume::Consumer {
        stream: opened.stream,
        bounds: opened.bounds,
        deadletters: opened.js.clone(),
        owned: opened.partitions.clone(),
        next_seq: opened.last_applied + 1,
        tx: incoming_tx,
        dirty: dirty.clone(),
        last_pending: u64::MAX,
        last_sent_seq: opened.last_applied,
    };
    let consumer = spawn_failing(&tasks, &failure, consumer.run(cancel.clone()));
    let dead_letters = tasks.spawn(dead_letter_overflows(opened.js, overflow_rx));
    let checkpointer = Checkpointer {
        store: opened.store.clone(),
        snapshots: opened.snapshots,
        records: opened.records,
        shard: opened.shard.clone(),
        epoch: opened.epoch,
        lineage: opened.lineage,
        next_id: (opened.record.as_ref()).map_or(1, |r| r.checkpoint_id + 1),
        tmp_dir: opened.tmp_dir,
        keep: opened.settings.snapshots_kept,
        lease: opened.lease,
        changes,
        chain,
        max_deltas: opened.settings.max_deltas,
        trim,
    };
    // Stopped only after the writer's last commit, so that a handover's
    // final checkpoint holds everything applied.
    let checkpoint_stop = tail.child_token();
    let checkpointer = {
        let run = checkpointer.run(checkpoint_rx, checkpoint_stop.clone());
        let failure = failure.clone();
        tasks.spawn(async move { run.await.map_err(|e| failure.fail(e)).ok() })
    };
    let pusher = push::Pusher::new(
        opened.client.clone(),
        opened.store.clone(),
        dirty,
        opened.shard.clone(),
        opened.epoch,
        opened.settings.push_interval,
    )
    .with_progress(opened.partitions)
    .with_window(window);
    let push_stop = tail.child_token();
    let pusher = spawn_failing(&tasks, &failure, pusher.run(push_stop.clone()));
    tasks.close();
    Ok(Running {
        shard: opened.shard,
        started: Started {
            epoch: opened.epoch,
            start: opened.start,
            last_applied_seq: opened.last_applied,
        },
        client: opened.client,
        store: opened.store,
        tasks,
        cancel,
        failure,
        writer,
        consumer,
        dead_letters,
        checkpointer,
        checkpoint_stop,
        pusher,
        push_stop,
        _tail: tail.drop_guard(),
        _gauges: opened.gauges,
    })
}

/// Run `part` as a task of the shard; its error stops the shard.
fn spawn_failing(
    tasks: &TaskTracker,
    failure: &Failure,
    part: impl Future<Output = Result<(), Error>> + Send + 'static,
) -> JoinHandle<()> {
    let failure = failure.clone();
    tasks.spawn(async move {
        if let Err(e) = part.await {
            failure.fail(e);
        }
    })
}

/// A warm start past the recorded checkpoint: the writer's changes start
/// with what the store holds since the record.
async fn resume_chain(
    opened: &Opened,
    chain: Option<&CheckpointRecord>,
    changes: &Mutex<Changes>,
) -> Result<(), Error> {
    let last_applied = opened.last_applied;
    let Some(record) = chain.filter(|r| r.seq < last_applied) else {
        return Ok(());
    };
    let started = std::time::Instant::now();
    let store = opened.store.clone();
    let record_seq = record.seq;
    let since = tokio::task::spawn_blocking(move || Changes::since(&store, record_seq))
        .await
        .map_err(Error::task("changes since the checkpoint"))??;
    tracing::info!(
        shard = opened.shard,
        from_seq = record_seq,
        to_seq = last_applied,
        sums = since.sums(),
        ids = since.ids_added(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "warm start: the next checkpoint is a delta on the recorded chain"
    );
    *changes.lock().expect("changes lock") = since;
    Ok(())
}

/// The writer on a thread of its own (it blocks on LMDB).
fn spawn_writer(
    shard: &str,
    writer: Writer,
    incoming: mpsc::Receiver<apply::Incoming>,
    failure: Failure,
) -> Result<std::thread::JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name(format!("lmdb-writer-{shard}"))
        .spawn(move || {
            if let Err(e) = writer.run(incoming) {
                failure.fail(e);
            }
        })
        .map_err(Error::task("writer"))
}

/// Tuples the writer set aside for overflow, dead lettered; ends when the
/// writer does.
async fn dead_letter_overflows(
    js: async_nats::jetstream::Context,
    mut overflowed: mpsc::UnboundedReceiver<Overflowed>,
) {
    while let Some(tuple) = overflowed.recv().await {
        let msg_id = hex(&tuple.msg_id);
        let letter = serde_json::json!({
            "reason": "sum_overflow",
            "stream": nats::SPEND_STREAM,
            "stream_seq": tuple.seq,
            "limit_id": tuple.limit,
            "bucket": tuple.bucket,
            "cost_micros": tuple.cost_micros,
            "lifetime_micros": tuple.lifetime_micros,
            "msg_id": msg_id,
        });
        let id = format!("overflow-{}-{msg_id}", tuple.seq);
        consume::publish_dead_letter(&js, "sum_overflow", &id, &letter).await;
    }
}

impl Running {
    pub(super) fn started(&self) -> Started {
        self.started
    }

    /// Once stopped or failed: drain the intake and the writer, take a last
    /// checkpoint on a handover, push last, close the store.
    pub(super) async fn wind_down(self, stop: &Stop) -> Result<(), Error> {
        self.cancel.cancelled().await;
        // The consumer drops its sender when it stops; the writer then drains
        // what was queued, commits, and exits.
        let _ = self.consumer.await;
        let _ = self.dead_letters.await;
        let writer = self.writer;
        let _ = self.tasks.spawn_blocking(move || writer.join()).await;
        self.checkpoint_stop.cancel();
        if !stop.wants_checkpoint() {
            // Abandoned (the lease is gone, or shutdown): a checkpoint in flight
            // may be cut anywhere, as a crash would; waiting for it could mean
            // waiting out an unreachable etcd.
            self.checkpointer.abort();
        }
        let checkpointer = self.checkpointer.await.ok().flatten();
        if let (Some(checkpointer), true, false) =
            (checkpointer, stop.wants_checkpoint(), self.failure.is_set())
        {
            last_checkpoint(checkpointer, &self.store, &self.shard, &self.failure).await?;
        }
        // Last push after the writer's final commit.
        self.push_stop.cancel();
        let _ = self.pusher.await;
        let _ = self.client.flush().await;
        self.tasks.wait().await;
        // Close the environment now, so the partition can be opened again by
        // this process if it comes back.
        if let Ok(store) = Arc::try_unwrap(self.store) {
            store.close();
        }
        tracing::info!(shard = self.shard, "shard stopped");
        match self.failure.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

/// A handover's checkpoint, after the writer's final commit.
async fn last_checkpoint(
    mut checkpointer: Checkpointer,
    store: &Store,
    shard: &str,
    failure: &Failure,
) -> Result<(), Error> {
    let seq = store.position()?.1;
    match checkpointer.checkpoint(seq).await {
        Ok(record) => tracing::info!(
            shard,
            seq = record.seq,
            checkpoint = record.checkpoint_id,
            "handover checkpoint recorded"
        ),
        Err(e) => failure.fail(e),
    }
    Ok(())
}

/// The first error that stops the shard; recording one ends the intake.
#[derive(Clone)]
struct Failure {
    shard: String,
    first: Arc<Mutex<Option<Error>>>,
    cancel: CancellationToken,
}

impl Failure {
    fn new(shard: &str, cancel: CancellationToken) -> Self {
        Failure {
            shard: shard.to_string(),
            first: Arc::default(),
            cancel,
        }
    }

    fn fail(&self, e: Error) {
        let shard = &self.shard;
        if e.lost_ownership() {
            tracing::warn!(shard, error = %e, "shard stopping");
        } else {
            tracing::error!(shard, error = %e, "shard stopping");
        }
        self.first.lock().expect("failure lock").get_or_insert(e);
        self.cancel.cancel();
    }

    fn is_set(&self) -> bool {
        self.first.lock().expect("failure lock").is_some()
    }

    fn take(&self) -> Option<Error> {
        self.first.lock().expect("failure lock").take()
    }
}
