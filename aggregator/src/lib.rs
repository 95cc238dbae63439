//! The aggregator: `SPEND` → LMDB sums → pacer, with checkpoints.
//!
//! [`run`] starts in one of two modes. Single-machine (or a fixed list of
//! partitions): one [`shard`] holds the configured partitions. Cluster mode
//! (`ADSPEND_AGGREGATOR_PARTITIONS=auto`): [`cluster`] joins the members in
//! etcd under a lease, computes the balanced assignment of partitions to the
//! live members, and runs each partition it owns as a shard of its own,
//! handing partitions over when members join and taking them over when a
//! member's lease expires.
//!
//! A shard restores its state ([`restore`]: warm from the local LMDB of
//! [`store`], or cold from the snapshot its checkpoint record names), then
//! [`consume`] reads `SPEND` and feeds [`apply`]'s single writer thread
//! (hand-offs in [`handoff`], the dedupe window in [`dedupe`]), which commits
//! each group of messages in one LMDB transaction; on a marker the writer
//! asks [`checkpointer`] for a snapshot, and after every commit [`push`]
//! sends the changed sums to the pacer. [`fence`] is the lease deadline the
//! writer and the checkpointer obey in cluster mode.

pub mod apply;
pub mod checkpointer;
pub mod cluster;
pub mod config;
pub mod consume;
pub mod dedupe;
pub mod delta;
pub mod error;
pub mod fence;
pub mod handoff;
pub mod push;
pub mod record;
pub mod restore;
pub mod shard;
pub mod snapshot_store;
pub mod store;

use crate::record::CheckpointStore;
use crate::snapshot_store::SnapshotStore;
use adspend_common::nats;
use tokio_util::sync::CancellationToken;

pub use config::{Config, Ownership};
pub use error::Error;

/// Run until `shutdown` or a fatal error (fenced, stream integrity, LMDB).
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    config.validate()?;
    let ownership = config.ownership()?;
    let snapshots = SnapshotStore::from_url(&config.object_store_url())?;
    let client = nats::connect(&config.nats, "adspend-aggregator").await?;
    let partitions = match ownership {
        Ownership::Cluster => return cluster::run(&config, snapshots, client, shutdown).await,
        Ownership::All => None,
        Ownership::Fixed(list) => Some(list),
    };
    let data_dir = config.data_dir();
    let name = config.shard();
    let records = CheckpointStore::open(&config.etcd.endpoints(), &data_dir, &name).await?;
    let spec = shard::Spec {
        name,
        partitions,
        data_dir,
        records,
        snapshots,
        client,
        settings: config.shard_settings(),
        lease: None,
    };
    let result = shard::run(spec, shard::Stop::new(shutdown), None).await;
    tracing::info!("aggregator stopped");
    result
}
