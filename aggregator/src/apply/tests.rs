use super::*;
use adspend_wire::types::{CheckpointMarker, MsgId, SpendBatch, SpendTuple};
use std::collections::HashMap;

/// (limit, bucket, cost, impression id)
type T = (&'static str, u32, u64, &'static str);

fn tuple(limit: &'static str, bucket: u32, cost: u64, imp: &'static str) -> T {
    (limit, bucket, cost, imp)
}

fn batch(seq: u64, stream_ms: i64, tuples: Vec<T>) -> Incoming {
    let mut limits: Vec<String> = Vec::new();
    let tuples = tuples
        .into_iter()
        .map(|(limit, bucket, cost, imp)| {
            let index = match limits.iter().position(|l| l == limit) {
                Some(i) => i,
                None => {
                    limits.push(limit.to_string());
                    limits.len() - 1
                }
            };
            SpendTuple {
                limit: index as u32,
                bucket,
                cost_micros: cost,
                msg_id: MsgId::derive(limit, imp),
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

fn writer(
    dir: &std::path::Path,
    dedupe: DedupeLimits,
) -> (Writer, watch::Receiver<CheckpointRequest>) {
    let store = Arc::new(Store::open(dir, 1 << 30).unwrap());
    let (tx, rx) = watch::channel((0, 0));
    (
        Writer::new(store, dedupe, Arc::new(Dirty::new(0)), tx).unwrap(),
        rx,
    )
}

fn sums(store: &Store) -> (HashMap<String, u64>, HashMap<(String, u32), u64>) {
    let txn = store.read_txn().unwrap();
    let lifetime = store
        .lifetime
        .iter(&txn)
        .unwrap()
        .map(|e| {
            e.map(|(k, v)| (k.to_string(), parse_lifetime(v).unwrap().0))
                .unwrap()
        })
        .collect();
    let buckets = store
        .sums
        .iter(&txn)
        .unwrap()
        .map(|e| {
            let (k, v) = e.unwrap();
            let (l, b) = crate::store::parse_sum_key(k).unwrap();
            ((l.to_string(), b), v)
        })
        .collect();
    (lifetime, buckets)
}

const WIDE: DedupeLimits = DedupeLimits {
    window_ms: u64::MAX,
    max_ids: u64::MAX,
};

#[test]
fn sums_dedupes_by_id_and_skips_replays_by_seq() {
    let dir = tempfile::tempdir().unwrap();
    let (mut w, _rx) = writer(dir.path(), WIDE);
    let first = vec![batch(
        1,
        1000,
        vec![
            tuple("a", 5, 10, "i1"),
            tuple("a", 5, 7, "i2"),
            tuple("b", LIFETIME_BUCKET, 3, "i1"),
        ],
    )];
    let stats = w.apply_group(&first).unwrap();
    assert_eq!(stats.applied, 3);
    // Same sequence again (replay) and a re-emit of i1 under a new sequence.
    let again = vec![
        batch(1, 1000, vec![tuple("a", 5, 10, "i1")]),
        batch(
            2,
            1001,
            vec![tuple("a", 5, 10, "i1"), tuple("a", 6, 1, "i3")],
        ),
    ];
    let stats = w.apply_group(&again).unwrap();
    assert_eq!(
        stats,
        GroupStats {
            applied: 1,
            duplicates_by_id: 1,
            replayed_by_seq: 1,
            evicted: 0,
            overflowed: 0,
            leases_pruned: 0,
            late_tuples: 0,
            closed_sums_dropped: 0,
        }
    );
    let (lifetime, buckets) = sums(&w.store);
    assert_eq!(lifetime["a"], 18);
    assert_eq!(lifetime["b"], 3);
    assert_eq!(buckets[&("a".to_string(), 5)], 17);
    assert_eq!(buckets[&("a".to_string(), 6)], 1);
    assert!(!buckets.contains_key(&("b".to_string(), LIFETIME_BUCKET)));
    assert_eq!(w.store.position().unwrap().1, 2);
    let (entries, seq, _, _) = w.dirty.take();
    assert_eq!(seq, 2);
    assert!(entries.iter().any(|e| e.limit == "a"
        && e.bucket == 6
        && e.bucket_micros == 1
        && e.lifetime_micros == 18));
}

#[test]
fn a_message_with_several_buckets_of_one_limit_books_each() {
    let dir = tempfile::tempdir().unwrap();
    let (mut w, _rx) = writer(dir.path(), WIDE);
    w.apply_group(&[batch(
        1,
        1,
        vec![
            tuple("a", 5, 10, "i1"),
            tuple("a", 6, 3, "i2"),
            tuple("a", 5, 1, "i3"),
            tuple("a", 7, 2, "i4"),
        ],
    )])
    .unwrap();
    let (lifetime, buckets) = sums(&w.store);
    assert_eq!(lifetime["a"], 16);
    assert_eq!(buckets[&("a".to_string(), 5)], 11);
    assert_eq!(buckets[&("a".to_string(), 6)], 3);
    assert_eq!(buckets[&("a".to_string(), 7)], 2);
}

#[test]
fn overflow_sets_the_tuple_aside_and_the_writer_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let (mut w, _rx) = writer(dir.path(), WIDE);
    w.apply_group(&[batch(1, 1, vec![tuple("a", 1, u64::MAX, "i1")])])
        .unwrap();
    let stats = w
        .apply_group(&[batch(2, 2, vec![tuple("a", 1, 1, "i2")])])
        .unwrap();
    assert_eq!((stats.applied, stats.overflowed), (0, 1));
    assert_eq!(w.store.position().unwrap().1, 2);
    // The set-aside tuple's id is in the window: a re-emit is a duplicate.
    let stats = w
        .apply_group(&[batch(
            3,
            3,
            vec![tuple("a", 1, 1, "i2"), tuple("a", 1, 0, "i3")],
        )])
        .unwrap();
    assert_eq!(
        (stats.applied, stats.duplicates_by_id, stats.overflowed),
        (1, 1, 0)
    );
    assert_eq!(sums(&w.store).0["a"], u64::MAX);
}

#[test]
fn window_evicts_by_time_and_by_count() {
    let dir = tempfile::tempdir().unwrap();
    let (mut w, _rx) = writer(
        dir.path(),
        DedupeLimits {
            window_ms: 100,
            max_ids: 3,
        },
    );
    w.apply_group(&[batch(
        1,
        1000,
        vec![tuple("a", 1, 1, "i1"), tuple("a", 1, 1, "i2")],
    )])
    .unwrap();
    // 50 ms later: within the window, i1 is still known.
    let s = w
        .apply_group(&[batch(
            2,
            1050,
            vec![tuple("a", 1, 1, "i1"), tuple("a", 1, 1, "i3")],
        )])
        .unwrap();
    assert_eq!((s.applied, s.duplicates_by_id), (1, 1));
    // Count bound 3: adding i4 (4 ids) evicts the oldest transaction's
    // entry, i1 and i2 together.
    let s = w
        .apply_group(&[batch(3, 1060, vec![tuple("a", 1, 1, "i4")])])
        .unwrap();
    assert_eq!(s.evicted, 2);
    // At t=1200 everything before t=1100 is evicted (after that group's
    // lookups): i3 and i4, so a later i3 counts again.
    let s = w
        .apply_group(&[batch(4, 1200, vec![tuple("a", 1, 1, "i5")])])
        .unwrap();
    assert_eq!(s.evicted, 2);
    let s = w
        .apply_group(&[batch(5, 1201, vec![tuple("a", 1, 1, "i3")])])
        .unwrap();
    assert_eq!((s.applied, s.duplicates_by_id), (1, 0));
    assert_eq!(w.ids.len(), 2);
    // The set is exactly what the log holds.
    assert_eq!(dedupe::load(&w.store).unwrap(), w.ids);
}

#[test]
fn markers_request_one_checkpoint_per_marker_id() {
    let dir = tempfile::tempdir().unwrap();
    let (mut w, rx) = writer(dir.path(), WIDE);
    let marker = |seq, partition| Incoming {
        seq,
        stream_ms: 5,
        pending: 0,
        message: SpendMessage::Marker(CheckpointMarker {
            marker_id: 77,
            partition,
            emitted_ms: 5,
        }),
    };
    w.apply_group(&[
        batch(1, 1, vec![tuple("a", 1, 1, "i")]),
        marker(2, 0),
        marker(3, 1),
    ])
    .unwrap();
    assert_eq!(*rx.borrow(), (1, 2));
}

#[test]
fn a_malformed_lifetime_sum_is_an_error_and_commits_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let (mut w, _rx) = writer(dir.path(), WIDE);
    w.apply_group(&[batch(1, 1, vec![tuple("a", 1, 5, "i1")])])
        .unwrap();
    let store = w.store.clone();
    let mut wtxn = store.write_txn().unwrap();
    store.lifetime.put(&mut wtxn, "a", &[9; 7]).unwrap();
    wtxn.commit().unwrap();
    let err = w
        .apply_group(&[batch(2, 2, vec![tuple("a", 1, 1, "i2")])])
        .unwrap_err();
    assert!(matches!(err, Error::CorruptValue { .. }), "{err}");
    assert!(err.to_string().contains("the lifetime sum of a"), "{err}");
    assert_eq!(w.store.position().unwrap().1, 1, "nothing committed");
}

/// Two impressions whose costs together pass u64 micros: the second tuple
/// is set aside (reported with its sequence), everything else applies, and
/// the writer goes on. One group or one message per group, the decision and
/// the sums are the same.
#[test]
fn a_tuple_that_would_overflow_is_set_aside_the_same_way_in_any_grouping() {
    let half = u64::MAX / 2 + 1;
    let messages = || {
        vec![
            batch(
                1,
                10,
                vec![tuple("a", 3, half, "i1"), tuple("b", 3, 5, "i2")],
            ),
            batch(
                2,
                11,
                vec![tuple("a", 3, half, "i3"), tuple("b", 3, 7, "i4")],
            ),
            batch(3, 12, vec![tuple("a", 3, 1, "i5"), tuple("b", 3, 1, "i6")]),
        ]
    };
    let mut outcomes = Vec::new();
    for grouping in [vec![3], vec![1, 1, 1], vec![2, 1]] {
        let dir = tempfile::tempdir().unwrap();
        let (writer, _rx) = writer(dir.path(), WIDE);
        let (tx, mut set_aside) = mpsc::unbounded_channel();
        let mut writer = writer.with_overflow_sink(tx);
        let mut all = messages().into_iter();
        let mut overflowed = 0;
        for size in grouping {
            let group: Vec<Incoming> = all.by_ref().take(size).collect();
            overflowed += writer.apply_group(&group).unwrap().overflowed;
        }
        assert_eq!(overflowed, 1);
        let tuple = set_aside.try_recv().unwrap();
        assert_eq!((tuple.seq, tuple.limit.as_str()), (2, "a"));
        assert_eq!((tuple.cost_micros, tuple.lifetime_micros), (half, half));
        assert!(set_aside.try_recv().is_err());
        assert_eq!(writer.last_applied_seq, 3);
        outcomes.push(sums(&writer.store));
    }
    let (lifetime, buckets) = &outcomes[0];
    assert_eq!(lifetime["a"], half + 1);
    assert_eq!(lifetime["b"], 13);
    assert_eq!(buckets[&("a".to_string(), 3)], half + 1);
    assert!(outcomes.iter().all(|o| o == &outcomes[0]), "{outcomes:?}");
}

#[test]
fn lease_sums_go_an_hour_past_their_lease_and_limits_stay() {
    use adspend_wire::lease::{LeaseId, LEASE_RETENTION_MS};
    let dir = tempfile::tempdir().unwrap();
    let (mut w, _rx) = writer(dir.path(), WIDE);
    let key = |expires_at_ms: i64| -> &'static str {
        let id = LeaseId {
            expires_at_ms,
            seq: 1,
            index: 0,
        };
        Box::leak(id.key().into_boxed_str())
    };
    let (early, late) = (key(10_000), key(500_000));
    let t0 = 20_000i64;
    w.apply_group(&[batch(
        1,
        t0,
        vec![
            tuple(early, LIFETIME_BUCKET, 5, "i1"),
            tuple(late, LIFETIME_BUCKET, 7, "i2"),
            tuple("a", LIFETIME_BUCKET, 12, "i1"),
        ],
    )])
    .unwrap();
    assert_eq!(sums(&w.store).0.len(), 3);
    // An hour past the first lease's expiry, in stream time: it goes, the
    // other lease and the limit stay.
    let later = 10_000 + LEASE_RETENTION_MS as i64 + 1;
    let stats = w
        .apply_group(&[batch(2, later, vec![tuple("a", LIFETIME_BUCKET, 1, "i3")])])
        .unwrap();
    assert_eq!(stats.leases_pruned, 1);
    let lifetime = sums(&w.store).0;
    assert!(!lifetime.contains_key(early));
    assert_eq!(lifetime[late], 7);
    assert_eq!(lifetime["a"], 13);
    // Not again within the pass interval, even once the second is due.
    let stats = w
        .apply_group(&[batch(
            3,
            500_000 + LEASE_RETENTION_MS as i64 + 1,
            vec![tuple("a", LIFETIME_BUCKET, 1, "i4")],
        )])
        .unwrap();
    assert_eq!(
        stats.leases_pruned, 1,
        "the second lease is due and a pass is too"
    );
}

mod closed;
