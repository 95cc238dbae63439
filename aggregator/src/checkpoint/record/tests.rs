use super::*;

fn record(epoch: u64, id: u64) -> CheckpointRecord {
    CheckpointRecord {
        checkpoint_id: id,
        seq: id * 10,
        snapshot_key: format!("s/{id}"),
        checksum: "x".into(),
        size_bytes: 1,
        epoch,
        lineage: "l".into(),
        created_ms: 0,
        deltas: Vec::new(),
    }
}

#[tokio::test]
async fn a_garbled_epoch_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = CheckpointStore::open(&[], dir.path(), "all").await.unwrap();
    store.acquire_epoch().await.unwrap();
    let path = dir.path().join("checkpoint").join("epoch");
    std::fs::write(&path, b"x7").unwrap();
    for err in [
        store.acquire_epoch().await.unwrap_err(),
        store.current_epoch().await.unwrap_err(),
    ] {
        let text = err.to_string();
        assert!(
            text.contains("owner epoch") && text.contains("\"x7\""),
            "{text}"
        );
        assert!(text.contains(&path.display().to_string()), "{text}");
    }
    assert_eq!(std::fs::read(&path).unwrap(), b"x7", "nothing overwritten");
}

#[tokio::test]
async fn local_store_fences_stale_owner() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = CheckpointStore::open(&[], dir.path(), "all").await.unwrap();
    assert!(first.load().await.unwrap().is_none());
    let e1 = first.acquire_epoch().await.unwrap();
    first.commit(&record(e1, 1)).await.unwrap();
    let mut second = CheckpointStore::open(&[], dir.path(), "all").await.unwrap();
    let e2 = second.acquire_epoch().await.unwrap();
    assert_eq!(e2, e1 + 1);
    let err = first.commit(&record(e1, 2)).await.unwrap_err();
    assert!(matches!(err, Error::Fenced { .. }), "{err}");
    second.commit(&record(e2, 3)).await.unwrap();
    assert_eq!(second.load().await.unwrap().unwrap(), record(e2, 3));
}
