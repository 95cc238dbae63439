use super::*;

/// Distinct, evenly spread ids (xorshift, never zero).
fn ids(n: usize, seed: u128) -> impl Iterator<Item = u128> {
    let mut x = seed | 1;
    (0..n).map(move |_| {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    })
}

#[test]
fn growing_ahead_spreads_the_doublings_and_stops_at_the_bound() {
    let bound = 600_000;
    let mut set = IdSet::default();
    let mut natural = 0;
    let mut ahead = 0;
    let all: Vec<u128> = ids(bound, 7).collect();
    for group in all.chunks(1_000) {
        let before: Vec<usize> = set.shards.iter().map(|s| s.capacity()).collect();
        for &id in group {
            assert!(set.insert(id));
        }
        // Doublings inside the group, of shards past the first sizes.
        natural += set
            .shards
            .iter()
            .zip(&before)
            .filter(|(s, &b)| b >= 256 && s.capacity() != b)
            .count();
        ahead += set.grow_ahead(bound);
    }
    assert_eq!(natural, 0, "a shard doubled inside a group");
    assert!(ahead >= SHARDS, "{ahead} doublings ahead");
    assert_eq!(set.len(), bound);
    assert!(all.iter().all(|id| set.contains(id)));
    // At the bound, no shard has more room than filling it by itself
    // would have given it.
    let mut alone = IdSet::default();
    for &id in &all {
        alone.insert(id);
    }
    for (grown, by_itself) in set.shards.iter().zip(&alone.shards) {
        assert!(grown.capacity() <= by_itself.capacity().max(bound / SHARDS));
    }
    // Past its part of the bound a shard is left alone.
    assert_eq!(set.grow_ahead(bound), 0);
}

/// A table is a power of two of buckets, at most 7/8 full: 17 bytes a
/// bucket puts an id between 17 × 8/7 and 17 × 16/7 bytes (plus the
/// control groups of small tables).
#[test]
fn table_bytes_per_id_lie_between_a_full_and_a_just_doubled_table() {
    let mut set = IdSet::default();
    assert_eq!(set.table_bytes(), 0);
    for n in [1_000usize, 300_000, 1_000_000] {
        for id in ids(n - set.len(), n as u128) {
            set.insert(id);
        }
        let per_id = set.table_bytes() as f64 / set.len() as f64;
        assert!(
            (19.4..=39.0).contains(&per_id) || n < 10_000,
            "{n}: {per_id}"
        );
        assert!(per_id > 17.0, "{n}: {per_id}");
    }
}

#[test]
fn bulk_inserts_equal_one_by_one_inserts() {
    // More than one chunk, with repeats inside and across chunks.
    let mut x: u128 = 0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835;
    let ids: Vec<u128> = (0..BULK_CHUNK * 2 + 777)
        .map(|i| {
            if i % 10 == 9 {
                return (i as u128 / 10) * 7;
            }
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect();
    let mut one_by_one = IdSet::default();
    for id in &ids {
        one_by_one.insert(*id);
    }
    let mut bulk_set = IdSet::with_capacity(ids.len());
    let mut bulk = bulk_set.bulk();
    for id in &ids {
        bulk.insert(*id);
    }
    bulk.finish();
    assert_eq!(bulk_set.len(), one_by_one.len());
    assert_eq!(bulk_set, one_by_one);
    // Dropping flushes too.
    let mut dropped = IdSet::default();
    {
        let mut bulk = dropped.bulk();
        bulk.insert(5);
        bulk.insert(5);
    }
    assert_eq!(dropped.len(), 1);
    assert!(dropped.contains(&5));
}

#[test]
fn ids_round_trip_through_the_packed_form() {
    let a = [7u8; 16];
    let mut b = [0u8; 16];
    b[15] = 1;
    let packed: Vec<u8> = [a, b].concat();
    let ids: Vec<u128> = packed_ids(&packed).collect();
    assert_eq!(ids, vec![id_key(&a), id_key(&b)]);
    let mut set = IdSet::default();
    assert!(set.insert(ids[0]));
    assert!(set.insert(ids[1]));
    assert!(!set.insert(id_key(&a)));
    assert!(set.contains(&1));
    assert_eq!(set.len(), 2);
    assert!(set.remove(&1));
    assert!(!set.remove(&1));
    assert_eq!(set.len(), 1);
}

proptest::proptest! {
    /// Shard order answers as inserting one by one in order does, for
    /// ids repeated inside the batch and ids already in the set, and
    /// leaves the same set behind.
    #[test]
    fn shard_order_answers_as_one_by_one(
        before in proptest::collection::vec(0u16..400, 0..200),
        batch in proptest::collection::vec(0u16..400, 0..2_000),
        spread in 0u32..128,
    ) {
        // Small numbers spread over the shards (the top byte) and, with
        // `spread`, over a shard's table.
        let id = |n: u16| (u128::from(n) << 119) ^ u128::from(n) << spread;
        let mut one_by_one = IdSet::default();
        for &n in &before {
            one_by_one.insert(id(n));
        }
        let mut sorted = one_by_one.clone();
        let expected: Vec<bool> = batch.iter().map(|&n| one_by_one.insert(id(n))).collect();
        let ids: Vec<u128> = batch.iter().map(|&n| id(n)).collect();
        let mut scratch = ShardOrder::default();
        let added = sorted.insert_in_shard_order(&ids, &mut scratch);
        proptest::prop_assert_eq!(&scratch.fresh, &expected);
        proptest::prop_assert_eq!(added, expected.iter().filter(|&&f| f).count());
        proptest::prop_assert_eq!(sorted.len(), one_by_one.len());
        proptest::prop_assert_eq!(sorted, one_by_one);
    }
}
