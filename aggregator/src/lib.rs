//! The aggregator: `SPEND` → LMDB sums → pacer, with checkpoints.
//!
//! [`run`] restores state ([`restore`]: warm from the local LMDB of
//! [`store`], or cold from the snapshot its checkpoint record names), takes
//! ownership of the shard (a new owner epoch), checks the stream's bounds and
//! starts four parts: [`consume`] reads `SPEND` from the next sequence and
//! feeds [`apply`]'s single writer thread, which commits each group of
//! messages in one LMDB transaction; on a marker the writer asks
//! [`checkpointer`] for a snapshot, and after every commit [`push`] sends the
//! changed sums to the pacer.

pub mod apply;
pub mod checkpointer;
pub mod config;
pub mod consume;
pub mod dedupe;
pub mod error;
pub mod push;
pub mod restore;
pub mod store;

use std::sync::{Arc, Mutex};

use adspend_common::checkpoint::CheckpointStore;
use adspend_common::nats;
use adspend_common::snapshot_store::SnapshotStore;
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub use config::Config;
pub use error::Error;

const INCOMING_QUEUE: usize = 512;

/// Run until `shutdown` or a fatal error (fenced, stream integrity, LMDB).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let owned = config.owned()?;
    let shard = config.shard();
    let data_dir = config.data_dir();
    let tmp_dir = data_dir.join("tmp");
    std::fs::create_dir_all(&tmp_dir).map_err(adspend_common::Error::io("create", &tmp_dir))?;
    let snapshots = SnapshotStore::from_url(&config.object_store_url())?;
    let client = nats::connect(&config.nats.nats_url, "adspend-aggregator").await?;
    let mut records = CheckpointStore::open(&config.etcd.endpoints(), &data_dir, &shard).await?;

    // Take ownership first: from here on, the previous owner cannot record.
    let epoch = records.acquire_epoch().await?;
    let record = records.load().await?;
    let map_size = usize::try_from(config.lmdb_map_gib << 30).unwrap_or(usize::MAX);
    let (store, lineage, start) = restore::open_or_restore(
        &data_dir.join("lmdb"),
        &tmp_dir,
        record.as_ref(),
        &snapshots,
        map_size,
    )
    .await?;
    let store = Arc::new(store);
    let (_, last_applied) = store.position()?;

    let js = async_nats::jetstream::new(client.clone());
    let mut stream = nats::ensure_spend(&js).await?;
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

    let stop = shutdown.child_token();
    let failure: Arc<Mutex<Option<Error>>> = Arc::default();
    let fail = {
        let failure = failure.clone();
        let stop = stop.clone();
        move |e: Error| {
            tracing::error!(error = %e, "aggregator stopping");
            failure.lock().expect("failure lock").get_or_insert(e);
            stop.cancel();
        }
    };

    let dirty = Arc::new(apply::Dirty::new(last_applied));
    let (checkpoint_tx, checkpoint_rx) = watch::channel((0, 0));
    let writer = apply::Writer::new(store.clone(), config.dedupe(), dirty.clone(), checkpoint_tx)?;
    let (incoming_tx, incoming_rx) = mpsc::channel(INCOMING_QUEUE);
    let tasks = TaskTracker::new();

    let writer_fail = fail.clone();
    let writer_thread = std::thread::Builder::new()
        .name("lmdb-writer".into())
        .spawn(move || {
            if let Err(e) = writer.run(incoming_rx) {
                writer_fail(e);
            }
        })
        .map_err(|e| Error::Task("writer", e.to_string()))?;

    let consumer = consume::Consumer {
        stream,
        owned,
        next_seq: last_applied + 1,
        tx: incoming_tx,
    };
    {
        let (stop, fail) = (stop.clone(), fail.clone());
        tasks.spawn(async move {
            if let Err(e) = consumer.run(stop).await {
                fail(e);
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
        keep: config.snapshots_kept,
    };
    {
        let (stop, fail) = (stop.clone(), fail.clone());
        tasks.spawn(async move {
            if let Err(e) = checkpointer.run(checkpoint_rx, stop).await {
                fail(e);
            }
        });
    }
    let pusher = push::Pusher::new(
        client.clone(),
        store.clone(),
        dirty,
        shard,
        epoch,
        config.push_interval(),
    );
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

    stop.cancelled().await;
    // The consumer drops its sender when it stops; the writer then drains
    // what was queued, commits, and exits.
    tasks.wait().await;
    let _ = tokio::task::spawn_blocking(move || writer_thread.join()).await;
    // Last push after the writer's final commit.
    push_stop.cancel();
    let _ = push_task.await;
    let _ = client.flush().await;
    tracing::info!("aggregator stopped");
    let failure = failure.lock().expect("failure lock").take();
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}
