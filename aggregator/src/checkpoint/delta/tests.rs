use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;

use adspend_wire::types::{MsgId, SpendBatch, SpendMessage, SpendTuple};
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

/// `groups` write groups of three messages of `tuples` tuples each, their
/// sequences numbered on from `*seq`, their stream times 1 s apart.
fn apply(writer: &mut Writer, rng: &mut Rng, seq: &mut u64, groups: usize, tuples: usize) {
    for _ in 0..groups {
        let group: Vec<Incoming> = (0..3)
            .map(|_| {
                *seq += 1;
                message(rng, *seq, 1_000 * *seq as i64, tuples)
            })
            .collect();
        writer.apply_group(&group).unwrap();
    }
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
    apply(&mut writer, &mut rng, &mut seq, 5, 50);
    // The base: reset, then a commit lands before the copy starts.
    changes.lock().unwrap().take();
    apply(&mut writer, &mut rng, &mut seq, 1, 50);
    let restored_dir = dir.path().join("restored");
    std::fs::create_dir_all(&restored_dir).unwrap();
    store
        .env
        .copy_to_path(restored_dir.join("data.mdb"), CompactionOption::Enabled)
        .unwrap();
    let restored = Store::open(&restored_dir, 1 << 28).unwrap();
    let mut evicted = 0;
    for link in 0..6 {
        apply(&mut writer, &mut rng, &mut seq, 2 + link, 50);
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

/// A warm start past the record: the changes read from the store since the
/// record's sequence (evictions included, which the store cannot name), then
/// the writer's own on top, bring a copy taken at the record to the live
/// store exactly.
#[test]
fn changes_since_a_record_rebuild_the_store_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (mut writer, store) = writer(&dir.path().join("live"));
    let mut rng = Rng(0xfeed);
    let mut seq = 0u64;
    apply(&mut writer, &mut rng, &mut seq, 4, 50);
    let record_seq = store.position().unwrap().1;
    let recorded_dir = dir.path().join("recorded");
    std::fs::create_dir_all(&recorded_dir).unwrap();
    store
        .env
        .copy_to_path(recorded_dir.join("data.mdb"), CompactionOption::Enabled)
        .unwrap();
    let recorded = Store::open(&recorded_dir, 1 << 28).unwrap();
    let (recorded_dump, _) = dump(&recorded);
    // The aggregator dies past the record; the window moves on meanwhile.
    apply(&mut writer, &mut rng, &mut seq, 3, 50);
    drop(writer);
    let (live_dump, _) = dump(&store);
    let gone = recorded_dump[2]
        .keys()
        .filter(|k| !live_dump[2].contains_key(*k))
        .count();
    assert!(gone > 0, "entries of the record were evicted since");

    let since = Changes::since(&store, record_seq).unwrap();
    assert_eq!(since.from_seq, record_seq);
    assert_eq!(since.to_seq, store.position().unwrap().1);
    assert!(since.log_evicted.is_empty());
    let mut bytes = Vec::new();
    since.encode("lineage-a", &mut bytes).unwrap();
    let delta = Delta::decode(&bytes).unwrap();
    assert_eq!(delta.changes, since);
    let copy_dir = dir.path().join("copy");
    std::fs::create_dir_all(&copy_dir).unwrap();
    recorded
        .env
        .copy_to_path(copy_dir.join("data.mdb"), CompactionOption::Enabled)
        .unwrap();
    let copy = Store::open(&copy_dir, 1 << 28).unwrap();
    delta.apply(&copy).unwrap();
    assert_eq!(dump(&copy), dump(&store), "record + changes since");

    // The next life: its writer's commits accumulate on top of them.
    let (tx, _rx) = watch::channel((0, 0));
    let dedupe = DedupeLimits {
        window_ms: 3_000,
        max_ids: 2_000,
    };
    let mut writer = Writer::new(store.clone(), dedupe, Arc::new(Dirty::new(0)), tx).unwrap();
    *writer.changes().lock().unwrap() = since;
    apply(&mut writer, &mut rng, &mut seq, 3, 50);
    let taken = writer.changes().lock().unwrap().take();
    let mut bytes = Vec::new();
    taken.encode("lineage-a", &mut bytes).unwrap();
    Delta::decode(&bytes).unwrap().apply(&recorded).unwrap();
    assert_eq!(
        dump(&recorded),
        dump(&store),
        "record + the next life's delta"
    );
}

/// Closed periods inside a chain: the stream clock crosses days while the
/// deltas are taken, so buckets the base holds (and buckets some delta
/// carried) close; base + deltas still equals the live store, its stream
/// clock included, and neither holds a closed bucket.
#[test]
fn closed_periods_leave_base_plus_deltas_exactly() {
    const DAY_MS: i64 = 86_400_000;
    let dir = tempfile::tempdir().unwrap();
    let (writer, store) = writer(&dir.path().join("live"));
    let mut writer = writer.with_closed_period_days(1);
    let changes = writer.changes();
    let mut rng = Rng(0xc105ed);
    let mut seq = 0u64;
    // Buckets 20_000 and 20_001 close (one day after their end, taken as
    // two days after their date) at days 20_003 and 20_004.
    let mut day = |writer: &mut Writer, seq: &mut u64, day: i64, groups: usize| {
        for _ in 0..groups {
            let group: Vec<Incoming> = (0..3)
                .map(|_| {
                    *seq += 1;
                    message(&mut rng, *seq, day * DAY_MS + 1_000 * *seq as i64, 30)
                })
                .collect();
            writer.apply_group(&group).unwrap();
        }
    };
    day(&mut writer, &mut seq, 20_001, 3);
    changes.lock().unwrap().take();
    let restored_dir = dir.path().join("restored");
    std::fs::create_dir_all(&restored_dir).unwrap();
    store
        .env
        .copy_to_path(restored_dir.join("data.mdb"), CompactionOption::Enabled)
        .unwrap();
    let restored = Store::open(&restored_dir, 1 << 28).unwrap();
    let buckets = |store: &Store| -> Vec<u32> {
        let txn = store.read_txn().unwrap();
        let mut buckets: Vec<u32> = store
            .sums
            .iter(&txn)
            .unwrap()
            .map(|e| crate::store::parse_sum_key(e.unwrap().0).unwrap().1)
            .collect();
        buckets.sort_unstable();
        buckets.dedup();
        buckets
    };
    assert_eq!(buckets(&restored), vec![20_000, 20_001]);
    for (link, d) in [20_002, 20_003, 20_003, 20_004, 20_005]
        .into_iter()
        .enumerate()
    {
        day(&mut writer, &mut seq, d, 2);
        let taken = changes.lock().unwrap().take();
        let mut bytes = Vec::new();
        taken.encode("lineage-a", &mut bytes).unwrap();
        let delta = Delta::decode(&bytes).unwrap();
        assert_eq!(delta.changes, taken, "link {link}: round trip");
        delta.apply(&restored).unwrap();
        assert_eq!(dump(&restored), dump(&store), "after link {link}");
        let clock = |s: &Store| s.period_clock(&s.read_txn().unwrap()).unwrap();
        assert_eq!(clock(&restored), clock(&store), "after link {link}");
        let open = clock(&store).closed_below;
        assert!(buckets(&store).iter().all(|b| *b >= open), "link {link}");
    }
    assert!(buckets(&store).is_empty(), "both buckets closed");
    let lifetime = dump(&store).0[1].len();
    assert_eq!(lifetime, 40, "every limit's lifetime sum stays");
}

/// Formats 1 (before the evicted-below key) and 2 (before the stream
/// clock) are still read.
#[test]
fn formats_1_and_2_are_still_read() {
    let mut changes = sample();
    changes.log_evicted_below = None;
    changes.clock = None;
    let mut bytes = Vec::new();
    changes.encode("l", &mut bytes).unwrap();
    assert_eq!(bytes.pop(), Some(0), "no clock");
    bytes[8..12].copy_from_slice(&2u32.to_be_bytes());
    assert_eq!(Delta::decode(&bytes).unwrap().changes, changes);
    assert_eq!(bytes.pop(), Some(0), "no evicted-below key");
    bytes[8..12].copy_from_slice(&1u32.to_be_bytes());
    assert_eq!(Delta::decode(&bytes).unwrap().changes, changes);
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
    changes.log_evicted_below = Some([3; 16]);
    changes.clock(PeriodClock {
        stream_clock_ms: 1_000,
        closed_below: 2,
    });
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
    newer[11] = 4;
    let err = Delta::decode(&newer).unwrap_err();
    assert!(err.contains("delta format 4"), "{err}");
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
        below in proptest::option::of(any::<[u8; 16]>()),
        clock in proptest::option::of((any::<u64>(), any::<u32>())),
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
            changes.log_added.insert(key, vec![key[0]; ids * 16].into());
        }
        changes.log_evicted = evicted;
        changes.log_evicted_below = below;
        changes.clock = clock.map(|(stream_clock_ms, closed_below)| PeriodClock {
            stream_clock_ms,
            closed_below,
        });
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

mod chain;
