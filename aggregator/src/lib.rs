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
//! [`store`], or cold from the snapshot its checkpoint record names; when
//! that snapshot is gone, [`missing`](checkpoint::missing) rebuilds it from
//! the stream or waits visibly for an operator), then
//! [`consume`](shard::consume) reads `SPEND` and feeds [`apply`]'s single
//! writer thread (hand-offs in [`handoff`], the dedupe
//! window in [`dedupe`]), which commits each group of messages in one LMDB
//! transaction; on a marker the writer asks [`checkpointer`] for a
//! snapshot, and after every commit [`push`] sends the changed sums to the
//! pacer. [`fence`] is the lease deadline the writer and the checkpointer
//! obey in cluster mode. [`telemetry`] names the metrics of lost snapshots
//! and failed checkpoints.
//!
//! Grouped by what they do: [`shard`] holds a shard's life with its
//! consumer; [`handoff`] what its parts pass each other; [`checkpoint`]
//! holds durability ([`checkpointer`], [`delta`](checkpoint::delta),
//! [`record`], [`restore`], [`missing`](checkpoint::missing)) over
//! [`snapshot_store`], the object storage that settings open and
//! checkpoints use. No module imports one that imports it back
//! (`tests/integration/module_cycles/`). Other crates see [`run`],
//! [`Config`], [`apply`], [`dedupe`], [`store`], [`snapshot_store`] and the
//! checkpoint modules they open snapshots with.

pub mod apply;
pub(crate) mod background;
pub(crate) mod checkpoint;
pub(crate) mod cluster;
pub(crate) mod config;
pub mod dedupe;
pub(crate) mod disk;
pub(crate) mod error;
pub(crate) mod fence;
pub(crate) mod handoff;
pub(crate) mod push;
pub(crate) mod shard;
pub mod snapshot_store;
pub mod store;
pub(crate) mod telemetry;
pub(crate) mod writers;

// What other crates name (the tests crate's benches and recovery tests).
pub use checkpoint::{checkpointer, record, restore, trim};
pub use shard::bounds;

use std::net::SocketAddr;

use crate::checkpoint::record::CheckpointStore;
use crate::snapshot_store::SnapshotStore;
use adspend_common::nats;
use adspend_common::service::{self, Context, Service};

use config::Ownership;
pub use config::{Config, Validated};
pub use error::Error;

impl Service for Validated {
    const NAME: &'static str = "aggregator";
    const HISTOGRAMS: adspend_common::telemetry::Histograms = telemetry::HISTOGRAMS;
    type Config = Config;
    type Listeners = ();
    type Error = Error;

    fn validate(config: Config) -> Result<Self, Error> {
        Ok(config.validate()?)
    }

    fn metrics_addr(&self) -> SocketAddr {
        self.metrics_addr
    }

    async fn bind(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn run(self, _: (), context: Context) -> Result<(), Error> {
        run(self, context).await
    }
}

impl service::Failure for Error {
    fn common(&self) -> Option<&adspend_common::Error> {
        match self {
            Error::Common(e) => Some(e),
            _ => None,
        }
    }
}

/// Run until `context.shutdown` or a fatal error (fenced, stream integrity,
/// LMDB).
pub async fn run(validated: Validated, context: Context) -> Result<(), Error> {
    let Validated {
        config,
        ownership,
        snapshots,
        ..
    } = validated;
    let Context { shutdown, tasks } = context;
    // First: a store that cannot be opened is a setting to fix (exit 64).
    let snapshots = SnapshotStore::open(&snapshots)?;
    adspend_common::telemetry::describe(telemetry::DESCRIPTIONS, telemetry::HISTOGRAMS);
    disk::watch_free(config.data_dir(), &tasks, shutdown.clone());
    let client = nats::connect(&config.nats, "adspend-aggregator").await?;
    let name = ownership.shard();
    let partitions = match ownership {
        Ownership::Cluster { member_id } => {
            return cluster::run(&config, member_id, snapshots, client, shutdown, tasks).await
        }
        Ownership::All => None,
        Ownership::Fixed(list) => Some(list),
    };
    let owned = partitions
        .clone()
        .unwrap_or_else(|| (0..config.partitions.partitions).collect());
    let background = adspend_common::etcd::Background::on(&tasks, shutdown.clone());
    let (layout, why) = writers::layout::choose(&config, &owned, &name, &background).await?;
    tracing::info!(
        writers = layout.writers(),
        setting = %config.writers,
        chosen = why,
        "aggregator writers"
    );
    if let writers::layout::Layout::Shards(groups) = layout {
        let result = writers::run(
            &config,
            groups,
            snapshots,
            client,
            &shutdown,
            &tasks,
            &background,
        )
        .await;
        tracing::info!("aggregator stopped");
        return result;
    }
    let data_dir = config.data_dir();
    let records = CheckpointStore::open_with(&config.etcd, &data_dir, &name, &background).await?;
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
    let result = shard::start(spec, &shutdown, &tasks, None).join().await;
    tracing::info!("aggregator stopped");
    result
}
