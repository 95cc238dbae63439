//! A single-machine aggregator with several writers
//! (`ADSPEND_AGGREGATOR_WRITERS` > 1): its partitions split round robin
//! into that many shards, each a shard as cluster mode runs one per
//! partition (its own LMDB environment and writer thread, owner epoch,
//! checkpoint record and snapshot chain), in `<data dir>/<shard>/`, so they
//! apply in parallel. Checkpoints, restore, dedupe and fencing keep their
//! meaning, per shard.
//!
//! Which shards, from the setting and what the data directory holds:
//! [`layout`].

use adspend_common::etcd::Background;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::checkpoint::record::CheckpointStore;
use crate::config::Config;
use crate::error::Error;
use crate::shard;
use crate::snapshot_store::SnapshotStore;

pub(crate) mod layout;

/// The shards of `owned` partitions over `writers` writers: partition
/// `owned[i]` goes to shard `i % writers`; empty shards are left out.
pub(crate) fn groups(owned: &[u32], writers: usize) -> Vec<Vec<u32>> {
    let writers = writers.max(1);
    let mut groups = vec![Vec::new(); writers];
    for (i, &partition) in owned.iter().enumerate() {
        groups[i % writers].push(partition);
    }
    groups.retain(|g| !g.is_empty());
    groups
}

/// Run the shards of a single-machine aggregator with several writers until
/// `shutdown` or the first fatal error, which stops the others too.
pub(crate) async fn run(
    config: &Config,
    groups: Vec<Vec<u32>>,
    snapshots: SnapshotStore,
    client: async_nats::Client,
    shutdown: &CancellationToken,
    tasks: &TaskTracker,
    background: &Background,
) -> Result<(), Error> {
    let data_dir = config.data_dir();
    let names = layout::names(&groups);
    // One token for all: the first shard to fail stops the others.
    let stop = shutdown.child_token();
    let mut handles = Vec::with_capacity(groups.len());
    for (partitions, name) in groups.into_iter().zip(names) {
        let dir = data_dir.join(&name);
        let records = CheckpointStore::open_with(&config.etcd, &dir, &name, background).await?;
        let spec = shard::Spec {
            name,
            partitions: Some(partitions),
            data_dir: dir,
            records,
            snapshots: snapshots.clone(),
            client: client.clone(),
            settings: config.shard_settings(),
            lease: None,
        };
        handles.push(shard::start(spec, &stop, tasks, None));
    }
    tracing::info!(
        writers = handles.len(),
        "aggregator running its shards in parallel"
    );
    let joined = futures::future::join_all(handles.into_iter().map(|handle| {
        let stop = stop.clone();
        async move {
            let result = handle.join().await;
            if result.is_err() {
                stop.cancel();
            }
            result
        }
    }))
    .await;
    joined.into_iter().find(Result::is_err).unwrap_or(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partitions_are_dealt_round_robin() {
        assert_eq!(groups(&[0, 1, 2, 3, 4], 2), vec![vec![0, 2, 4], vec![1, 3]]);
        assert_eq!(groups(&[5, 9], 4), vec![vec![5], vec![9]]);
        assert_eq!(groups(&[0, 1], 1), vec![vec![0, 1]]);
    }
}
