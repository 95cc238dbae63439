//! Chains through the checkpointer and a cold restore, as the service runs
//! them.

use super::*;
use crate::checkpointer::Checkpointer;
use crate::record::{CheckpointRecord, CheckpointStore};
use crate::snapshot_store::SnapshotStore;

/// A checkpointer of shard "s" over `store`, its objects under
/// `dir/objects`, its record in `dir` (single-machine mode), no chain yet.
async fn checkpointer(
    dir: &Path,
    store: &Arc<Store>,
    writer: &Writer,
    max_deltas: usize,
) -> Checkpointer {
    let snapshots =
        SnapshotStore::from_url(&format!("file://{}", dir.join("objects").display())).unwrap();
    let mut records = CheckpointStore::open(&[], dir, "s").await.unwrap();
    let epoch = records.acquire_epoch().await.unwrap();
    Checkpointer {
        store: store.clone(),
        snapshots,
        records,
        shard: "s".into(),
        epoch,
        lineage: "lineage-a".into(),
        next_id: 1,
        tmp_dir: dir.join("tmp"),
        keep: 1,
        lease: None,
        changes: writer.changes(),
        chain: None,
        max_deltas,
        trim: None,
    }
}

/// Through the checkpointer and restore as the service runs them: a base,
/// then deltas, a new base after `max_deltas`, each recorded; GC keeps
/// whole chains; a cold restore of the record equals the live store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_then_cold_restore_equal_the_live_store() {
    let dir = tempfile::tempdir().unwrap();
    let (mut writer, store) = writer(&dir.path().join("live"));
    let mut rng = Rng(0xc0ffee);
    let mut seq = 0u64;
    let mut checkpointer = checkpointer(dir.path(), &store, &writer, 3).await;
    let snapshots = checkpointer.snapshots.clone();
    let mut kinds = Vec::new();
    for _ in 0..6 {
        apply(&mut writer, &mut rng, &mut seq, 1, 40);
        let at = store.position().unwrap().1;
        let record = checkpointer.checkpoint(at).await.unwrap();
        assert_eq!(record.seq, at);
        kinds.push(record.deltas.len());
    }
    // A base, three deltas, a new base, a delta.
    assert_eq!(kinds, vec![0, 1, 2, 3, 0, 1]);
    let record = checkpointer.chain.clone().unwrap();
    let objects = snapshots.list("s").await.unwrap();
    assert_eq!(objects.len(), 6, "two chains kept (keep = 1): {objects:?}");

    let lineage = cold_restore_equals_live(dir.path(), &record, &snapshots, &store).await;
    assert_eq!(lineage, "lineage-a");
}

/// A cold restore of `record` into a fresh directory under `dir` equals the
/// live store, entry for entry; returns the restored lineage.
async fn cold_restore_equals_live(
    dir: &Path,
    record: &CheckpointRecord,
    snapshots: &SnapshotStore,
    live: &Store,
) -> String {
    let restored_dir = dir.join("restored");
    std::fs::create_dir_all(dir.join("rtmp")).unwrap();
    std::fs::create_dir_all(&restored_dir).unwrap();
    let (restored, lineage, start) = crate::restore::open_or_restore(
        &restored_dir.join("lmdb"),
        &dir.join("rtmp"),
        Some(record),
        snapshots,
        1 << 28,
    )
    .await
    .unwrap();
    assert_eq!(start, crate::restore::Start::Cold);
    assert_eq!(dump(&restored), dump(live));
    lineage
}

/// A delta whose upload fails puts its changes back: the next checkpoint is
/// one more delta on the same chain, carrying both intervals, and a cold
/// restore of that chain equals the live store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_delta_puts_its_changes_back_on_the_same_chain() {
    let dir = tempfile::tempdir().unwrap();
    let (mut writer, store) = writer(&dir.path().join("live"));
    let mut rng = Rng(0xbad);
    let mut seq = 0u64;
    let mut checkpointer = checkpointer(dir.path(), &store, &writer, 10).await;
    let snapshots = checkpointer.snapshots.clone();
    let (objects, epoch) = (dir.path().join("objects"), checkpointer.epoch);
    for _ in 0..2 {
        apply(&mut writer, &mut rng, &mut seq, 1, 40);
        let at = store.position().unwrap().1;
        checkpointer.checkpoint(at).await.unwrap();
    }
    // A directory where the next delta's object goes: its upload fails.
    apply(&mut writer, &mut rng, &mut seq, 1, 40);
    let at = store.position().unwrap().1;
    let blocked = objects.join(format!(
        "s/{:020}-{at:020}-e{epoch}.delta",
        checkpointer.next_id
    ));
    std::fs::create_dir_all(&blocked).unwrap();
    checkpointer.checkpoint(at).await.unwrap_err();
    let chain = checkpointer.chain.clone().expect("the chain stands");
    assert_eq!(chain.deltas.len(), 1);

    apply(&mut writer, &mut rng, &mut seq, 1, 40);
    let at = store.position().unwrap().1;
    let record = checkpointer.checkpoint(at).await.unwrap();
    assert_eq!(record.snapshot_key, chain.snapshot_key, "no new base");
    assert_eq!(record.deltas.len(), 2);
    assert_eq!(record.seq, at);

    cold_restore_equals_live(dir.path(), &record, &snapshots, &store).await;
}
