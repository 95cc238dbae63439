//! Closed periods in the writer: sums dropped when their period closes in
//! stream time, late spend for them in the lifetime sums only, decided the
//! same in any grouping and across a restart.

use super::*;

const DAY_MS: i64 = 86_400_000;

/// Day 20_000's sums, then the stream clock moves to the day it closes (with
/// the default 35 days: 20_000 + 2 + 35), and a late impression for day
/// 20_000 arrives, next to one for today.
fn messages() -> Vec<Incoming> {
    let closes = (20_000 + 2 + 35) * DAY_MS;
    vec![
        batch(
            1,
            20_000 * DAY_MS + 5,
            vec![tuple("a", 20_000, 10, "i1"), tuple("b", 20_000, 4, "i2")],
        ),
        batch(2, 20_001 * DAY_MS, vec![tuple("a", 20_001, 3, "i3")]),
        // One millisecond short of closing day 20_000: still open.
        batch(3, closes - 1, vec![tuple("a", 20_000, 2, "i4")]),
        batch(4, closes, vec![tuple("a", 20_037, 1, "i5")]),
        // Late: day 20_000 closed as of message 4. A publish time behind
        // the clock (NATS leader change) does not reopen it.
        batch(5, closes - 10, vec![tuple("a", 20_000, 100, "i6")]),
    ]
}

#[test]
fn a_closed_period_leaves_the_store_and_late_spend_counts_in_lifetime_only() {
    let mut outcomes = Vec::new();
    for grouping in [vec![5], vec![1, 1, 1, 1, 1], vec![3, 2], vec![2, 3]] {
        let dir = tempfile::tempdir().unwrap();
        let (mut writer, _rx) = writer(dir.path(), WIDE);
        let mut all = messages().into_iter();
        let (mut late, mut dropped) = (0, 0);
        for size in grouping.iter() {
            let group: Vec<Incoming> = all.by_ref().take(*size).collect();
            // What earlier groups changed was pushed when it was current.
            writer.dirty.take();
            let stats = writer.apply_group(&group).unwrap();
            late += stats.late_tuples;
            dropped += stats.closed_sums_dropped;
        }
        assert_eq!(late, 1, "{grouping:?}");
        let (lifetime, buckets) = sums(&writer.store);
        assert_eq!(lifetime["a"], 10 + 3 + 2 + 1 + 100, "{grouping:?}");
        assert_eq!(lifetime["b"], 4);
        assert!(
            !buckets.keys().any(|(_, bucket)| *bucket == 20_000),
            "{grouping:?}: {buckets:?}"
        );
        assert_eq!(buckets[&("a".to_string(), 20_001)], 3);
        assert_eq!(buckets[&("a".to_string(), 20_037)], 1);
        // Dropped from the store, or never written there when the whole
        // life of the bucket fit in one group.
        assert!(dropped <= 2, "{grouping:?}");
        // The last group closed day 20_000 (or saw its late tuple): nothing
        // of it is pushed, even what an earlier message of the group added.
        let (entries, _, _, _) = writer.dirty.take();
        assert!(
            entries.iter().all(|e| e.bucket != 20_000),
            "{grouping:?}: {entries:?}"
        );
        outcomes.push((lifetime, buckets));
    }
    assert!(outcomes.iter().all(|o| o == &outcomes[0]), "{outcomes:?}");
}

/// A writer opened again over the store (a restart, or a restore of a
/// snapshot taken between the two groups) carries the stream clock on: a
/// late tuple is decided as one writer deciding everything would.
#[test]
fn the_stream_clock_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let (mut writer, _rx) = writer(dir.path(), WIDE);
    let mut all = messages().into_iter();
    writer
        .apply_group(&all.by_ref().take(4).collect::<Vec<_>>())
        .unwrap();
    let store = writer.store.clone();
    drop(writer);
    let (tx, _rx) = watch::channel((0, 0));
    let mut writer = Writer::new(store, WIDE, Arc::new(Dirty::new(0)), tx).unwrap();
    let stats = writer.apply_group(&all.collect::<Vec<_>>()).unwrap();
    assert_eq!((stats.applied, stats.late_tuples), (1, 1));
    let (lifetime, buckets) = sums(&writer.store);
    assert_eq!(lifetime["a"], 116);
    assert!(!buckets.keys().any(|(_, bucket)| *bucket == 20_000));
}

/// A shorter setting on a later start drops what it closes at the next
/// commit.
#[test]
fn a_shorter_setting_drops_at_the_next_commit() {
    let dir = tempfile::tempdir().unwrap();
    let (mut writer, _rx) = writer(dir.path(), WIDE);
    let day = 20_010 * DAY_MS;
    let group = vec![batch(1, day, vec![tuple("a", 20_000, 1, "i1")])];
    writer.apply_group(&group).unwrap();
    assert_eq!(sums(&writer.store).1.len(), 1);
    let store = writer.store.clone();
    drop(writer);
    let (tx, _rx) = watch::channel((0, 0));
    let mut writer = Writer::new(store, WIDE, Arc::new(Dirty::new(0)), tx)
        .unwrap()
        .with_closed_period_days(5);
    let group = vec![batch(2, day + 1, vec![tuple("a", 20_010, 1, "i2")])];
    let stats = writer.apply_group(&group).unwrap();
    assert_eq!(stats.closed_sums_dropped, 1);
    assert_eq!(sums(&writer.store).1.len(), 1, "only today's sum");
}
