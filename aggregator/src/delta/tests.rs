use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use adspend_common::types::{MsgId, SpendBatch, SpendMessage, SpendTuple};
use heed::types::Bytes;
use heed::{CompactionOption, Database};
use proptest::prelude::*;
use tokio::sync::watch;

use super::*;
use crate::apply::{DedupeLimits, Dirty, Incoming, Writer};

/// Deterministic pseudo-random numbers (xorshift64*).
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// One message of `n` tuples over 40 limits, two buckets, a tenth of the
/// ids repeated from earlier messages (dropped as duplicates).
fn message(rng: &mut Rng, seq: u64, stream_ms: i64, n: usize) -> Incoming {
    let limits: Vec<String> = (0..40).map(|i| format!("limit-{i}")).collect();
    let tuples = (0..n)
        .map(|_| {
            let limit = (rng.next() % 40) as u32;
            let imp = if rng.next().is_multiple_of(10) {
                rng.next() % 50
            } else {
                rng.next()
            };
            SpendTuple {
                limit,
                bucket: match rng.next() % 3 {
                    0 => LIFETIME_BUCKET,
                    1 => 20_000,
                    _ => 20_001,
                },
                cost_micros: 1 + rng.next() % 1_000,
                msg_id: MsgId::derive(&limits[limit as usize], &imp.to_string()),
            }
        })
        .collect();
    Incoming {
        seq,
        stream_ms,
        pending: 1,
        message: SpendMessage::Batch(SpendBatch {
            source_ms: stream_ms,
            limits,
            tuples,
        }),
    }
}

type Dump = Vec<BTreeMap<Vec<u8>, Vec<u8>>>;

/// Every entry of every database, and the position.
fn dump(store: &Store) -> (Dump, (Option<String>, u64)) {
    let txn = store.read_txn().unwrap();
    let dbs: [Database<Bytes, Bytes>; 3] = [
        store.sums.remap_types(),
        store.lifetime.remap_types(),
        store.dedupe_log,
    ];
    let dump = dbs
        .iter()
        .map(|db| {
            db.iter(&txn)
                .unwrap()
                .map(|e| {
                    let (k, v) = e.unwrap();
                    (k.to_vec(), v.to_vec())
                })
                .collect()
        })
        .collect();
    drop(txn);
    (dump, store.position().unwrap())
}

fn writer(dir: &Path) -> (Writer, Arc<Store>) {
    let store = Arc::new(Store::open(dir, 1 << 28).unwrap());
    let mut txn = store.write_txn().unwrap();
    store.set_lineage(&mut txn, "lineage-a").unwrap();
    txn.commit().unwrap();
    let (tx, _rx) = watch::channel((0, 0));
    // A short window, so that evictions happen inside the deltas.
    let dedupe = DedupeLimits {
        window_ms: 3_000,
        max_ids: 2_000,
    };
    let writer = Writer::new(store.clone(), dedupe, Arc::new(Dirty::new(0)), tx).unwrap();
    (writer, store)
}

/// A base copied after the accumulated changes were reset (with commits in
/// between, as a checkpoint's copy may see), then deltas through the
/// writer's changes, encoded and decoded: base + deltas equals the live
/// store, entry for entry, at every link of the chain.
#[test]
fn base_plus_deltas_rebuilds_the_store_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (mut writer, store) = writer(&dir.path().join("live"));
    let changes = writer.changes();
    let mut rng = Rng(0x5eed);
    let mut seq = 0u64;
    let mut apply = |writer: &mut Writer, rng: &mut Rng, groups: usize| {
        for _ in 0..groups {
            let group: Vec<Incoming> = (0..3)
                .map(|_| {
                    seq += 1;
                    message(rng, seq, 1_000 * seq as i64, 50)
                })
                .collect();
            writer.apply_group(&group).unwrap();
        }
    };
    apply(&mut writer, &mut rng, 5);
    // The base: reset, then a commit lands before the copy starts.
    changes.lock().unwrap().take();
    apply(&mut writer, &mut rng, 1);
    let restored_dir = dir.path().join("restored");
    std::fs::create_dir_all(&restored_dir).unwrap();
    store
        .env
        .copy_to_path(restored_dir.join("data.mdb"), CompactionOption::Enabled)
        .unwrap();
    let restored = Store::open(&restored_dir, 1 << 28).unwrap();
    let mut evicted = 0;
    for link in 0..6 {
        apply(&mut writer, &mut rng, 2 + link);
        let taken = changes.lock().unwrap().take();
        evicted += taken.log_evicted.len();
        let mut bytes = Vec::new();
        taken.encode("lineage-a", &mut bytes).unwrap();
        let delta = Delta::decode(&bytes).unwrap();
        assert_eq!(delta.changes, taken, "link {link}: round trip");
        assert_eq!(delta.lineage, "lineage-a");
        delta.apply(&restored).unwrap();
        assert_eq!(dump(&restored), dump(&store), "after link {link}");
    }
    assert!(evicted > 0, "the chain covered evictions");
    let (_, (_, at)) = dump(&store);
    assert_eq!(at, seq);
}

fn sample() -> Changes {
    let mut changes = Changes::at(7);
    let entry = |limit: &str, bucket: u32, micros: u64| SumEntry {
        limit: limit.to_string(),
        bucket,
        bucket_micros: micros,
        lifetime_micros: micros * 2,
        lifetime_events: 3,
    };
    changes.absorb(
        &[
            entry("a", LIFETIME_BUCKET, 5),
            entry("a", 9, 4),
            entry("b", 9, 1),
        ],
        Some(([1; 16], &[2; 32])),
        &[[0; 16]],
        12,
    );
    changes
}

#[test]
fn every_truncation_and_foreign_header_is_an_error() {
    let mut bytes = Vec::new();
    sample().encode("l", &mut bytes).unwrap();
    assert_eq!(Delta::decode(&bytes).unwrap().changes, sample());
    for len in 0..bytes.len() {
        assert!(
            Delta::decode(&bytes[..len]).is_err(),
            "prefix of {len} bytes"
        );
    }
    let mut newer = bytes.clone();
    newer[11] = 2;
    let err = Delta::decode(&newer).unwrap_err();
    assert!(err.contains("delta format 2"), "{err}");
    let mut longer = bytes.clone();
    longer.push(0);
    assert!(Delta::decode(&longer)
        .unwrap_err()
        .contains("after the end"));
    let mut foreign = bytes;
    foreign[0] = b'X';
    assert!(Delta::decode(&foreign).unwrap_err().contains("magic"));
}

#[test]
fn a_later_value_replaces_an_earlier_one_and_eviction_cancels_an_add() {
    let mut changes = sample();
    let entry = SumEntry {
        limit: "b".into(),
        bucket: 9,
        bucket_micros: 100,
        lifetime_micros: 0,
        lifetime_events: 0,
    };
    changes.absorb(&[entry], None, &[[1; 16]], 20);
    assert_eq!(changes.limits["b"].buckets, vec![(9, 100)]);
    assert!(changes.log_added.is_empty());
    assert_eq!(changes.log_evicted, vec![[0; 16], [1; 16]]);
    assert_eq!((changes.from_seq, changes.to_seq), (7, 20));
    let taken = changes.take();
    assert_eq!(taken.sums(), 3);
    assert_eq!(changes, Changes::at(20));
}

proptest! {
    /// Whatever the writer can hand it, the format carries it unchanged.
    #[test]
    fn encode_then_decode_is_identity(
        limits in proptest::collection::vec(
            ("[a-z0-9-]{1,64}", proptest::option::of((any::<u64>(), any::<u64>())),
             proptest::collection::vec((0u32..LIFETIME_BUCKET, any::<u64>()), 0..4)),
            0..20),
        added in proptest::collection::vec((any::<[u8; 16]>(), 0usize..5), 0..5),
        evicted in proptest::collection::vec(any::<[u8; 16]>(), 0..5),
        from in 0u64..1_000, span in 0u64..1_000,
    ) {
        let mut changes = Changes::at(from);
        changes.to_seq = from + span;
        for (limit, lifetime, buckets) in limits {
            let change = changes.limits.entry(limit).or_default();
            change.lifetime = lifetime;
            for (bucket, micros) in buckets {
                change.set_bucket(bucket, micros);
            }
        }
        for (key, ids) in added {
            changes.log_added.insert(key, vec![key[0]; ids * 16]);
        }
        changes.log_evicted = evicted;
        let mut bytes = Vec::new();
        changes.encode("lineage", &mut bytes).unwrap();
        let delta = Delta::decode(&bytes).unwrap();
        prop_assert_eq!(delta.changes, changes);
        prop_assert_eq!(delta.lineage, "lineage");
    }

    /// Arbitrary bytes after a valid header never panic the decoder.
    #[test]
    fn garbage_is_an_error_not_a_panic(tail in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut bytes = Vec::new();
        Changes::at(0).encode("l", &mut bytes).unwrap();
        bytes.truncate(8 + 4 + 2 + 1 + 16);
        bytes.extend_from_slice(&tail);
        let _ = Delta::decode(&bytes);
    }
}

/// Through the checkpointer and restore as the service runs them: a base,
/// then deltas, a new base after `max_deltas`, each recorded; GC keeps
/// whole chains; a cold restore of the record equals the live store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checkpoints_then_cold_restore_equal_the_live_store() {
    use crate::record::CheckpointStore;
    use crate::snapshot_store::SnapshotStore;

    use crate::checkpointer::Checkpointer;

    let dir = tempfile::tempdir().unwrap();
    let (mut writer, store) = writer(&dir.path().join("live"));
    let mut rng = Rng(0xc0ffee);
    let mut seq = 0u64;
    let mut apply = |writer: &mut Writer, rng: &mut Rng| {
        let group: Vec<Incoming> = (0..3)
            .map(|_| {
                seq += 1;
                message(rng, seq, 1_000 * seq as i64, 40)
            })
            .collect();
        writer.apply_group(&group).unwrap();
    };
    let snapshots =
        SnapshotStore::from_url(&format!("file://{}", dir.path().join("objects").display()))
            .unwrap();
    let mut records = CheckpointStore::open(&[], dir.path(), "s").await.unwrap();
    let epoch = records.acquire_epoch().await.unwrap();
    let mut checkpointer = Checkpointer {
        store: store.clone(),
        snapshots: snapshots.clone(),
        records,
        shard: "s".into(),
        epoch,
        lineage: "lineage-a".into(),
        next_id: 1,
        tmp_dir: dir.path().join("tmp"),
        keep: 1,
        lease: None,
        changes: writer.changes(),
        chain: None,
        max_deltas: 3,
    };
    let mut kinds = Vec::new();
    for _ in 0..6 {
        apply(&mut writer, &mut rng);
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

    let restored_dir = dir.path().join("restored");
    std::fs::create_dir_all(dir.path().join("rtmp")).unwrap();
    std::fs::create_dir_all(&restored_dir).unwrap();
    let (restored, lineage, start) = crate::restore::open_or_restore(
        &restored_dir.join("lmdb"),
        &dir.path().join("rtmp"),
        Some(&record),
        &snapshots,
        1 << 28,
    )
    .await
    .unwrap();
    assert_eq!(start, crate::restore::Start::Cold);
    assert_eq!(lineage, "lineage-a");
    assert_eq!(dump(&restored), dump(&store));
}
