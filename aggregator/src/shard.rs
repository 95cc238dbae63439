//! One shard from restore to stop: the unit of ownership, state and recovery.
//!
//! A shard is a set of partitions with one LMDB environment, one checkpoint
//! record and one owner epoch. In single-machine mode the aggregator runs one
//! shard (all partitions, or the configured list); in cluster mode each
//! partition is a shard of its own, started and stopped as ownership moves
//! ([`crate::cluster`]).
//!
//! [`run`] takes ownership (a new owner epoch), restores ([`crate::restore`]:
//! warm from the local LMDB, or cold from the recorded snapshot;
//! [`crate::missing`] if that snapshot is gone), checks the
//! stream's bounds and starts four parts: [`crate::consume`] reads `SPEND`
//! from the next sequence and feeds [`crate::apply`]'s writer thread; on a
//! marker the writer asks [`crate::checkpointer`] for a snapshot, and after
//! every commit [`crate::push`] sends the changed sums to the pacer.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::record::CheckpointStore;
use crate::snapshot_store::SnapshotStore;
use adspend_common::nats;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::apply::{self, DedupeLimits};
use crate::config::AcceptLoss;
use crate::error::Error;
use crate::fence::Validity;
use crate::restore::{self, Start};
use crate::telemetry::ShardGauges;
use crate::{checkpointer, consume, delta, missing, push};

const INCOMING_QUEUE: usize = 512;

/// Settings every shard of a process shares.
#[derive(Clone, Debug)]
pub struct Settings {
    pub dedupe: DedupeLimits,
    pub push_interval: Duration,
    pub snapshots_kept: usize,
    /// Deltas on one base before a checkpoint copies a new base.
    pub max_deltas: usize,
    pub lmdb_map_size: usize,
    pub stream_replicas: usize,
    /// Shards the operator allowed to be rebuilt at a loss ([`missing`]).
    pub accept_loss: AcceptLoss,
}

/// One shard to run.
pub struct Spec {
    /// Name of the unit of ownership, checkpoints and pushes (`all`, `p3`…).
    pub name: String,
    /// Partitions read, or `None` for all.
    pub partitions: Option<Vec<u32>>,
    /// The shard's own local state (`lmdb/`, `tmp/`).
    pub data_dir: PathBuf,
    pub records: CheckpointStore,
    pub snapshots: SnapshotStore,
    pub client: async_nats::Client,
    pub settings: Settings,
    /// Cluster mode: the lease the shard is owned under.
    pub lease: Option<Arc<Validity>>,
}

/// How a shard came up, reported once it is applying.
#[derive(Debug, Clone, Copy)]
pub struct Started {
    pub epoch: u64,
    pub start: Start,
    pub last_applied_seq: u64,
}

/// How a running shard is asked to stop.
#[derive(Debug, Clone, Default)]
pub struct Stop {
    token: CancellationToken,
    /// A graceful handover: after the writer's last commit, take a
    /// checkpoint so the next owner restores from exactly here.
    handover: Arc<std::sync::atomic::AtomicBool>,
}

impl Stop {
    pub fn new(token: CancellationToken) -> Self {
        Stop {
            token,
            handover: Arc::default(),
        }
    }

    /// Stop now; what was applied stays, the next owner replays the rest.
    pub fn abandon(&self) {
        self.token.cancel();
    }

    /// Stop after a last checkpoint.
    pub fn hand_over(&self) {
        self.handover
            .store(true, std::sync::atomic::Ordering::Release);
        self.token.cancel();
    }

    fn wants_checkpoint(&self) -> bool {
        self.handover.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Run the shard until `stop` or a fatal error (fenced, lease lost, stream
/// integrity, LMDB). `started` hears once the shard is applying.
pub async fn run(
    spec: Spec,
    stop: Stop,
    started: Option<oneshot::Sender<Started>>,
) -> Result<(), Error> {
    let Spec {
        name: shard,
        partitions,
        data_dir,
        mut records,
        snapshots,
        client,
        settings,
        lease,
    } = spec;
    let tmp_dir = data_dir.join("tmp");
    std::fs::create_dir_all(&tmp_dir).map_err(adspend_common::Error::io("create", &tmp_dir))?;

    // Take ownership first: from here on, the previous owner cannot record.
    let epoch = records.acquire_epoch().await?;
    let js = async_nats::jetstream::new(client.clone());
    let mut stream = nats::ensure_spend(&js, settings.stream_replicas).await?;
    let lmdb_dir = data_dir.join("lmdb");
    let local = missing::Local {
        shard: &shard,
        lmdb_dir: &lmdb_dir,
        tmp_dir: &tmp_dir,
        map_size: settings.lmdb_map_size,
        accept_loss: &settings.accept_loss,
    };
    // A recorded snapshot that is gone is waited on here, visibly, unless
    // it has a safe way out (`missing`); a stop then ends the shard.
    let Some(opened) =
        missing::open(&local, &mut records, &snapshots, &mut stream, &stop.token).await?
    else {
        return Ok(());
    };
    let missing::Opened {
        store,
        lineage,
        start,
        record,
    } = opened;
    // Zeroed when the shard stops here, however it stops.
    let _gauges = ShardGauges::start(
        &shard,
        record
            .as_ref()
            .map(|r| r.created_ms)
            .filter(|&ms| ms > 0)
            .unwrap_or_else(adspend_common::now_ms),
    );
    let store = Arc::new(store);
    let (_, last_applied) = store.position()?;
    consume::check_bounds(&mut stream, last_applied).await?;
    tracing::info!(
        shard,
        epoch,
        start = start.as_str(),
        last_applied_seq = last_applied,
        checkpoint = record.as_ref().map(|r| r.checkpoint_id),
        snapshots = snapshots.url(),
        "aggregator running"
    );

    let cancel = stop.token.child_token();
    let failure: Arc<Mutex<Option<Error>>> = Arc::default();
    let fail = {
        let failure = failure.clone();
        let cancel = cancel.clone();
        let shard = shard.clone();
        move |e: Error| {
            if e.lost_ownership() {
                tracing::warn!(shard, error = %e, "shard stopping");
            } else {
                tracing::error!(shard, error = %e, "shard stopping");
            }
            failure.lock().expect("failure lock").get_or_insert(e);
            cancel.cancel();
        }
    };

    let dirty = Arc::new(apply::Dirty::new(last_applied));
    let (checkpoint_tx, checkpoint_rx) = watch::channel((0, 0));
    let writer = apply::Writer::new(store.clone(), settings.dedupe, dirty.clone(), checkpoint_tx)?
        .for_shard(&shard, lease.clone());
    let changes = writer.changes();
    // The next checkpoint extends the recorded chain when the store is of
    // its lineage: at the record (a cold restore) the writer's changes start
    // there; past it (a warm start) they start with what the store holds
    // since the record, read from it. Another lineage starts a new base.
    let chain = record.clone().filter(|r| r.lineage == lineage);
    if let Some(r) = chain.as_ref().filter(|r| r.seq < last_applied) {
        let started = std::time::Instant::now();
        let store = store.clone();
        let record_seq = r.seq;
        let since = tokio::task::spawn_blocking(move || delta::Changes::since(&store, record_seq))
            .await
            .map_err(Error::task("changes since the checkpoint"))??;
        tracing::info!(
            shard,
            from_seq = record_seq,
            to_seq = last_applied,
            sums = since.sums(),
            ids = since.ids_added(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "warm start: the next checkpoint is a delta on the recorded chain"
        );
        *changes.lock().expect("changes lock") = since;
    }
    let (overflow_tx, mut overflow_rx) = mpsc::unbounded_channel::<apply::Overflowed>();
    let writer = writer.with_overflow_sink(overflow_tx);
    let (incoming_tx, incoming_rx) = mpsc::channel(INCOMING_QUEUE);
    let tasks = TaskTracker::new();

    let writer_fail = fail.clone();
    let writer_thread = std::thread::Builder::new()
        .name(format!("lmdb-writer-{shard}"))
        .spawn(move || {
            if let Err(e) = writer.run(incoming_rx) {
                writer_fail(e);
            }
        })
        .map_err(Error::task("writer"))?;

    nats::ensure_deadletter(&js, settings.stream_replicas).await?;
    let consumer = consume::Consumer {
        stream,
        deadletters: js.clone(),
        owned: partitions.clone(),
        next_seq: last_applied + 1,
        tx: incoming_tx,
        dirty: dirty.clone(),
        last_pending: u64::MAX,
        last_sent_seq: last_applied,
    };
    {
        let (cancel, fail) = (cancel.clone(), fail.clone());
        tasks.spawn(async move {
            if let Err(e) = consumer.run(cancel).await {
                fail(e);
            }
        });
    }
    {
        // Tuples the writer set aside for overflow, dead lettered; ends when
        // the writer does.
        let js = js.clone();
        tasks.spawn(async move {
            while let Some(tuple) = overflow_rx.recv().await {
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
        });
    }
    let checkpointer = checkpointer::Checkpointer {
        store: store.clone(),
        snapshots,
        records,
        shard: shard.clone(),
        epoch,
        lineage,
        next_id: record.as_ref().map_or(1, |r| r.checkpoint_id + 1),
        tmp_dir,
        keep: settings.snapshots_kept,
        lease,
        changes,
        chain,
        max_deltas: settings.max_deltas,
    };
    // Stopped only after the writer's last commit, so that a handover's
    // final checkpoint holds everything applied.
    let checkpoint_stop = CancellationToken::new();
    let checkpoint_task = {
        let (stop, fail) = (checkpoint_stop.clone(), fail.clone());
        tokio::spawn(async move {
            match checkpointer.run(checkpoint_rx, stop).await {
                Ok(checkpointer) => Some(checkpointer),
                Err(e) => {
                    fail(e);
                    None
                }
            }
        })
    };
    let pusher = push::Pusher::new(
        client.clone(),
        store.clone(),
        dirty,
        shard.clone(),
        epoch,
        settings.push_interval,
    )
    .with_progress(partitions);
    let push_stop = CancellationToken::new();
    let push_task = {
        let (stop, fail) = (push_stop.clone(), fail.clone());
        tokio::spawn(async move {
            if let Err(e) = pusher.run(stop).await {
                fail(e);
            }
        })
    };
    tasks.close();
    if let Some(started) = started {
        let _ = started.send(Started {
            epoch,
            start,
            last_applied_seq: last_applied,
        });
    }

    cancel.cancelled().await;
    // The consumer drops its sender when it stops; the writer then drains
    // what was queued, commits, and exits.
    tasks.wait().await;
    let _ = tokio::task::spawn_blocking(move || writer_thread.join()).await;
    checkpoint_stop.cancel();
    if !stop.wants_checkpoint() {
        // Abandoned (the lease is gone, or shutdown): a checkpoint in flight
        // may be cut anywhere, as a crash would; waiting for it could mean
        // waiting out an unreachable etcd.
        checkpoint_task.abort();
    }
    let checkpointer = checkpoint_task.await.ok().flatten();
    let failed = failure.lock().expect("failure lock").is_some();
    if let (Some(mut checkpointer), true, false) = (checkpointer, stop.wants_checkpoint(), failed) {
        let seq = store.position()?.1;
        match checkpointer.checkpoint(seq).await {
            Ok(record) => tracing::info!(
                shard,
                seq = record.seq,
                checkpoint = record.checkpoint_id,
                "handover checkpoint recorded"
            ),
            Err(e) => fail(e),
        }
    }
    // Last push after the writer's final commit.
    push_stop.cancel();
    let _ = push_task.await;
    let _ = client.flush().await;
    // Close the environment now, so the partition can be opened again by
    // this process if it comes back.
    if let Ok(store) = Arc::try_unwrap(store) {
        restore::close(store);
    }
    tracing::info!(shard, "shard stopped");
    let failure = failure.lock().expect("failure lock").take();
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
