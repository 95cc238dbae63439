//! One shard from restore to stop: the unit of ownership, state and recovery.
//!
//! A shard is a set of partitions with one LMDB environment, one checkpoint
//! record and one owner epoch. In single-machine mode the aggregator runs one
//! shard (all partitions, or the configured list); in cluster mode each
//! partition is a shard of its own, started and stopped as ownership moves
//! ([`crate::cluster`]).
//!
//! [`start`] returns a [`ShardHandle`] to hand the shard over, abandon it
//! or wait for it. Its life, in phases: [`open`] takes ownership (a new
//! owner epoch), restores ([`crate::checkpoint::restore`]: warm from the local LMDB, or
//! cold from the recorded snapshot; [`crate::checkpoint::missing`] if that snapshot is
//! gone) and checks the stream's bounds; [`parts`] starts four parts:
//! [`crate::shard::consume`] reads `SPEND` from the next sequence and feeds
//! [`crate::apply`]'s writer thread; on a marker the writer asks
//! [`crate::checkpoint::checkpointer`] for a snapshot, and after every commit
//! [`crate::push`] sends the changed sums to the pacer; then, once asked to
//! stop or failed, it winds them down in order, with a last checkpoint on a
//! handover.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use adspend_common::nats;
use async_nats::jetstream::{self, stream::Stream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::checkpoint::missing;
use crate::checkpoint::record::{CheckpointRecord, CheckpointStore};
use crate::checkpoint::restore::Start;
use crate::config::ShardSettings;
use crate::disk;
use crate::error::Error;
use crate::fence::Validity;
use crate::snapshot_store::SnapshotStore;
use crate::store::Store;
use crate::telemetry::ShardGauges;

pub mod bounds;
pub(crate) mod consume;
mod parts;

/// One shard to run.
pub(crate) struct Spec {
    /// Name of the unit of ownership, checkpoints and pushes (`all`, `p3`…).
    pub(crate) name: String,
    /// Partitions read, or `None` for all.
    pub(crate) partitions: Option<Vec<u32>>,
    /// The shard's own local state (`lmdb/`, `tmp/`).
    pub(crate) data_dir: PathBuf,
    pub(crate) records: CheckpointStore,
    pub(crate) snapshots: SnapshotStore,
    pub(crate) client: async_nats::Client,
    pub(crate) settings: ShardSettings,
    /// Cluster mode: the lease the shard is owned under.
    pub(crate) lease: Option<Arc<Validity>>,
}

/// How a shard came up, reported once it is applying.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Started {
    pub(crate) epoch: u64,
    pub(crate) start: Start,
    pub(crate) last_applied_seq: u64,
}

/// A running shard, from [`start`]: ask it to stop, then wait for it.
pub(crate) struct ShardHandle {
    stop: Stop,
    task: JoinHandle<Result<(), Error>>,
}

impl ShardHandle {
    /// Stop after a last checkpoint, so the next owner restores from
    /// exactly where this one stopped.
    pub(crate) fn hand_over(&self) {
        self.stop.hand_over();
    }

    /// Stop now; what was applied stays, the next owner replays the rest.
    pub(crate) fn abandon(&self) {
        self.stop.abandon();
    }

    pub(crate) fn is_finished(&self) -> bool {
        self.task.is_finished()
    }

    /// Wait for the shard to end: `Ok` once stopped as asked, else the error
    /// that stopped it (fenced, lease lost, stream integrity, LMDB).
    pub(crate) async fn join(self) -> Result<(), Error> {
        self.task
            .await
            .unwrap_or_else(|e| Err(Error::task("shard")(e)))
    }
}

/// Start a shard as a task of `tasks`, stopped by `parent` (its stop token
/// is a child of it) or through the handle. `started` hears once the shard
/// is applying.
pub(crate) fn start(
    spec: Spec,
    parent: &CancellationToken,
    tasks: &TaskTracker,
    started: Option<oneshot::Sender<Started>>,
) -> ShardHandle {
    let stop = Stop::new(parent.child_token());
    let task = tasks.spawn(run(spec, stop.clone(), started));
    ShardHandle { stop, task }
}

/// How a running shard is asked to stop.
#[derive(Debug, Clone, Default)]
struct Stop {
    token: CancellationToken,
    /// A graceful handover: after the writer's last commit, take a
    /// checkpoint so the next owner restores from exactly here.
    handover: Arc<AtomicBool>,
}

impl Stop {
    fn new(token: CancellationToken) -> Self {
        Stop {
            token,
            handover: Arc::default(),
        }
    }

    fn abandon(&self) {
        self.token.cancel();
    }

    fn hand_over(&self) {
        self.handover.store(true, Ordering::Release);
        self.token.cancel();
    }

    fn wants_checkpoint(&self) -> bool {
        self.handover.load(Ordering::Acquire)
    }
}

/// The shard's life: open, start its parts, wind them down.
async fn run(
    spec: Spec,
    stop: Stop,
    started: Option<oneshot::Sender<Started>>,
) -> Result<(), Error> {
    let Some(opened) = open(spec, &stop).await? else {
        return Ok(());
    };
    let running = parts::start(opened, &stop).await?;
    if let Some(started) = started {
        let _ = started.send(running.started());
    }
    running.wind_down(&stop).await
}

/// A shard owned, restored and checked against the stream: ready to apply.
struct Opened {
    shard: String,
    partitions: Option<Vec<u32>>,
    client: async_nats::Client,
    js: jetstream::Context,
    stream: Stream,
    bounds: bounds::Bounds,
    records: CheckpointStore,
    snapshots: SnapshotStore,
    settings: ShardSettings,
    lease: Option<Arc<Validity>>,
    tmp_dir: PathBuf,
    epoch: u64,
    store: Arc<Store>,
    lineage: String,
    start: Start,
    record: Option<CheckpointRecord>,
    last_applied: u64,
    /// Zeroed when the shard stops, however it stops.
    gauges: ShardGauges,
}

/// Take ownership, then open or restore the store and check the stream's
/// bounds. `None` when a stop came first.
async fn open(spec: Spec, stop: &Stop) -> Result<Option<Opened>, Error> {
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
    // A full disk is waited out at each local write of the start, as it is
    // at each commit once running (`crate::disk`); a stop ends the wait.
    let mut waiting: Option<disk::SpaceWait> = None;
    macro_rules! patiently {
        ($step:literal, $attempt:expr) => {
            loop {
                let error: Error = match $attempt {
                    Ok(value) => break value,
                    Err(e) => e.into(),
                };
                if !disk::is_full(&error) {
                    return Err(error);
                }
                let wait = waiting
                    .get_or_insert_with(|| disk::SpaceWait::new(&data_dir, &shard, $step))
                    .at($step);
                if !wait.wait(&error, &stop.token).await {
                    return Ok(None);
                }
            }
        };
    }
    patiently!(
        "create tmp",
        std::fs::create_dir_all(&tmp_dir).map_err(adspend_common::Error::io("create", &tmp_dir))
    );

    // Take ownership first: from here on, the previous owner cannot record.
    let epoch = patiently!("take ownership", records.acquire_epoch().await);
    let js = jetstream::new(client.clone());
    let mut stream = nats::ensure_spend(&js, settings.stream_replicas).await?;
    let trims = nats::ensure_spend_trims(&js, settings.stream_replicas).await?;
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
    let opened = patiently!(
        "restore",
        missing::open(&local, &mut records, &snapshots, &mut stream, &stop.token).await
    );
    let Some(opened) = opened else {
        return Ok(None);
    };
    if let Some(waiting) = waiting.take() {
        waiting.resumed();
    }
    let missing::Opened {
        store,
        lineage,
        start,
        record,
    } = opened;
    let gauges = ShardGauges::start(
        &shard,
        record
            .as_ref()
            .map(|r| r.created_ms)
            .filter(|&ms| ms > 0)
            .unwrap_or_else(adspend_common::now_ms),
    );
    let store = Arc::new(store);
    let (_, last_applied) = store.position()?;
    let mut bounds = bounds::Bounds {
        stream: stream.clone(),
        trims,
        owned: partitions.clone(),
    };
    bounds.check(last_applied).await?;
    tracing::info!(
        shard,
        epoch,
        start = start.as_str(),
        last_applied_seq = last_applied,
        checkpoint = record.as_ref().map(|r| r.checkpoint_id),
        snapshots = snapshots.url(),
        "aggregator running"
    );
    Ok(Some(Opened {
        shard,
        partitions,
        client,
        js,
        stream,
        bounds,
        records,
        snapshots,
        settings,
        lease,
        tmp_dir,
        epoch,
        store,
        lineage,
        start,
        record,
        last_applied,
        gauges,
    }))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
