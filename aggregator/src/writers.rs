//! A single-machine aggregator with several writers
//! (`ADSPEND_AGGREGATOR_WRITERS` > 1): its partitions split round robin
//! into that many shards, each a shard as cluster mode runs one per
//! partition (its own LMDB environment and writer thread, owner epoch,
//! checkpoint record and snapshot chain), in `<data dir>/<shard>/`, so they
//! apply in parallel. Checkpoints, restore, dedupe and fencing keep their
//! meaning, per shard.
//!
//! The layout of a data directory follows from the setting, so a start
//! with another one is refused ([`check_layout`]), naming what the data
//! directory holds and the way forward, instead of starting empty shards
//! beside state they would not read.

use std::path::Path;

use adspend_common::env;
use adspend_common::Error as CommonError;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::checkpoint::record::CheckpointStore;
use crate::config::{Config, Ownership};
use crate::error::Error;
use crate::shard;
use crate::snapshot_store::SnapshotStore;

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

/// The shard directories in `data_dir` (`p…/` holding an `lmdb/`).
fn shard_dirs(data_dir: &Path) -> Vec<String> {
    let Ok(entries) = std::fs::read_dir(data_dir) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter(|e| e.path().join("lmdb").is_dir())
        .filter_map(|e| e.file_name().to_str().map(str::to_string))
        .filter(|name| {
            name.strip_prefix('p').is_some_and(|rest| {
                !rest.is_empty() && rest.chars().all(|c| c.is_ascii_digit() || c == '-')
            })
        })
        .collect();
    names.sort();
    names
}

/// Refuse a data directory written with another number of writers:
/// `expected` are the shard names this start makes (`None`: one shard in
/// the data dir itself).
pub(crate) fn check_layout(
    data_dir: &Path,
    writers: u32,
    expected: Option<&[String]>,
) -> Result<(), Error> {
    let single = data_dir.join("lmdb").is_dir();
    let shards = shard_dirs(data_dir);
    let found = match (single, shards.is_empty()) {
        (false, true) => return Ok(()),
        (true, true) => "one shard for all its partitions (written with 1 writer)".to_string(),
        (false, false) => format!("the shards {}", shards.join(", ")),
        (true, false) => format!(
            "one shard for all its partitions and the shards {}",
            shards.join(", ")
        ),
    };
    let refuse = match expected {
        None => !shards.is_empty(),
        Some(names) => single || shards.iter().any(|s| !names.contains(s)),
    };
    if !refuse {
        return Ok(());
    }
    let asked = match expected {
        None => "one shard in the data dir itself".to_string(),
        Some(names) => format!("the shards {}", names.join(", ")),
    };
    Err(Error::Common(CommonError::Config {
        name: env::AGGREGATOR_WRITERS,
        value: writers.to_string(),
        reason: format!(
            "the data directory {} holds {found}, and this setting makes {asked}. \
             Start with the setting it was written with, or move the directory aside: \
             the new shards then restore from their own checkpoints if they have any, \
             else replay SPEND from its first sequence (exact while SPEND holds all of it; \
             otherwise each stops naming the gap, see docs/RECOVERY.md)",
            data_dir.display()
        ),
    }))
}

/// Run the shards of a single-machine aggregator with several writers until
/// `shutdown` or the first fatal error, which stops the others too.
pub(crate) async fn run(
    config: &Config,
    owned: Vec<u32>,
    snapshots: SnapshotStore,
    client: async_nats::Client,
    shutdown: &CancellationToken,
    tasks: &TaskTracker,
) -> Result<(), Error> {
    let data_dir = config.data_dir();
    let groups = groups(&owned, config.writers as usize);
    let names: Vec<String> = groups
        .iter()
        .map(|g| Ownership::Fixed(g.clone()).shard())
        .collect();
    check_layout(&data_dir, config.writers, Some(&names))?;
    // One token for all: the first shard to fail stops the others.
    let stop = shutdown.child_token();
    let background = adspend_common::etcd::Background::on(tasks, shutdown.clone());
    let mut handles = Vec::with_capacity(groups.len());
    for (partitions, name) in groups.into_iter().zip(names) {
        let dir = data_dir.join(&name);
        let records = CheckpointStore::open_with(&config.etcd, &dir, &name, &background).await?;
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

    #[test]
    fn a_data_dir_written_with_other_writers_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let two = vec!["p0-2".to_string(), "p1-3".to_string()];
        // Empty: anything goes.
        assert!(check_layout(dir.path(), 1, None).is_ok());
        assert!(check_layout(dir.path(), 2, Some(&two)).is_ok());

        std::fs::create_dir_all(dir.path().join("lmdb")).unwrap();
        assert!(check_layout(dir.path(), 1, None).is_ok());
        let e = check_layout(dir.path(), 2, Some(&two)).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("ADSPEND_AGGREGATOR_WRITERS") && text.contains("one shard for all"),
            "{text}"
        );
        assert_eq!(adspend_common::service::Failure::exit_code(&e), 64);

        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("p0-2/lmdb")).unwrap();
        std::fs::create_dir_all(dir.path().join("p1-3/lmdb")).unwrap();
        assert!(check_layout(dir.path(), 2, Some(&two)).is_ok());
        let e = check_layout(dir.path(), 1, None).unwrap_err();
        assert!(e.to_string().contains("p0-2, p1-3"), "{e}");
        let four: Vec<String> = ["p0", "p1", "p2", "p3"].map(String::from).to_vec();
        assert!(check_layout(dir.path(), 4, Some(&four)).is_err());
        // What is not a shard's directory does not count.
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir_all(dir.path().join("snapshots/x")).unwrap();
        std::fs::create_dir_all(dir.path().join("checkpoint")).unwrap();
        assert!(check_layout(dir.path(), 2, Some(&two)).is_ok());
    }
}
