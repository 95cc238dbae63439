//! The dedupe window in memory: the message ids of the window, for lookups
//! that never touch LMDB. LMDB holds the same ids in `dedupe_log` (the
//! durable copy, inside every snapshot); this set is rebuilt from it when the
//! writer opens the store, so it is only ever a cache of committed state plus
//! the ids of the transaction in progress.
//!
//! Message ids are xxh3-128 digests, already uniformly distributed, so the
//! set hashes an id by taking 64 of its bits instead of hashing it again.

use std::collections::HashSet;
use std::hash::{BuildHasherDefault, Hasher};
use std::time::Instant;

use crate::error::Error;
use crate::store::Store;

pub(crate) mod window;

/// Passes the low 64 bits of a `u128` id through as its hash.
#[derive(Default)]
pub(crate) struct IdHasher(u64);

impl Hasher for IdHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        // Only `write_u128` is used by `IdSet`; fold anything else.
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            word[..chunk.len()].copy_from_slice(chunk);
            self.0 = (self.0.rotate_left(5) ^ u64::from_le_bytes(word))
                .wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
        }
    }

    fn write_u128(&mut self, id: u128) {
        self.0 = id as u64;
    }
}

type Shard = HashSet<u128, BuildHasherDefault<IdHasher>>;

/// Shards of the set, by the id's top byte.
const SHARDS: usize = 256;
/// Entries one [`IdSet::grow_ahead`] rehashes at most (past its first
/// shard): about half a millisecond.
const GROW_AHEAD_ENTRIES: usize = 64 * 1024;

/// The ids of the window, in 256 hash sets. A hash set doubles its table
/// when it fills, rehashing every entry at once: at tens of millions of ids
/// one set would stall the writer for a second or more; a shard rehashes a
/// 256th of that.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdSet {
    shards: Vec<Shard>,
    len: usize,
}

impl Default for IdSet {
    fn default() -> Self {
        IdSet::with_capacity(0)
    }
}

impl IdSet {
    pub(crate) fn with_capacity(ids: usize) -> Self {
        IdSet {
            shards: (0..SHARDS)
                .map(|_| {
                    Shard::with_capacity_and_hasher(ids / SHARDS, BuildHasherDefault::default())
                })
                .collect(),
            len: 0,
        }
    }

    fn shard(id: u128) -> usize {
        (id >> 120) as usize
    }

    /// Adds `id`; false if it was already there.
    #[cfg(test)]
    pub(crate) fn insert(&mut self, id: u128) -> bool {
        let added = self.shards[Self::shard(id)].insert(id);
        self.len += usize::from(added);
        added
    }

    /// Adds every id of `ids` and sets `fresh[i]` to whether `ids[i]` was
    /// new: the same answers as [`IdSet::insert`] called on them in order.
    ///
    /// One at a time, each insert lands in a random place of the whole set
    /// (hundreds of megabytes at the window's bound): a TLB and cache miss
    /// each, the largest item of the writer in the end-to-end profile. Here
    /// the ids go shard by shard (a stable counting sort by shard), so each
    /// shard's table (a 256th of the set) is walked while its pages are in
    /// the TLB and cache. Within a shard the ids keep their order, and an
    /// id's answer depends only on the ids equal to it before it, which are
    /// all in its shard: hence the same answers.
    pub(crate) fn insert_in_shard_order(
        &mut self,
        ids: &[u128],
        scratch: &mut ShardOrder,
    ) -> usize {
        let ShardOrder { fresh, order } = scratch;
        let mut starts = [0u32; SHARDS + 1];
        for &id in ids {
            starts[Self::shard(id) + 1] += 1;
        }
        for shard in 0..SHARDS {
            starts[shard + 1] += starts[shard];
        }
        order.clear();
        order.resize(ids.len(), 0);
        for (at, &id) in ids.iter().enumerate() {
            let next = &mut starts[Self::shard(id)];
            order[*next as usize] = at as u32;
            *next += 1;
        }
        fresh.clear();
        fresh.resize(ids.len(), false);
        let mut added = 0;
        for &at in order.iter() {
            let id = ids[at as usize];
            let new = self.shards[Self::shard(id)].insert(id);
            fresh[at as usize] = new;
            added += usize::from(new);
        }
        self.len += added;
        added
    }

    pub(crate) fn remove(&mut self, id: &u128) -> bool {
        let removed = self.shards[Self::shard(*id)].remove(id);
        self.len -= usize::from(removed);
        removed
    }

    #[cfg(test)]
    pub(crate) fn contains(&self, id: &u128) -> bool {
        self.shards[Self::shard(*id)].contains(id)
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Bytes the set's tables take: per shard, from its capacity, the
    /// buckets hashbrown allocates (a power of two, at most 7/8 full) of 16
    /// bytes plus a control byte each, and one group of control bytes more.
    /// A table never shrinks, so this is the size at the window's peak.
    pub fn table_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|shard| {
                let capacity = shard.capacity() as u64;
                let buckets = match capacity {
                    0 => return 0,
                    1..=7 => capacity + 1,
                    _ => capacity / 7 * 8,
                };
                buckets * 17 + 16
            })
            .sum()
    }

    /// Doubles, ahead of need, shards that are three quarters full, a few
    /// per call (the first, and more while fewer than
    /// [`GROW_AHEAD_ENTRIES`] were rehashed); returns how many.
    ///
    /// Ids spread evenly over the shards, so the shards fill together and,
    /// left alone, all double within a few thousand inserts of each other:
    /// 125 ms of rehashing at 14.7M ids and 250 ms at 29.4M landed inside
    /// a handful of consecutive groups, stalling the writer while the
    /// window filled. Called between groups, this spreads those doublings
    /// over the quarter of growth before them. A shard whose room already
    /// covers its part of `bound` (the most ids the window is meant to hold)
    /// is left to grow by itself if it must, so the set at its bound is no
    /// larger than without this.
    pub(crate) fn grow_ahead(&mut self, bound: usize) -> usize {
        let per_shard = bound.div_ceil(SHARDS);
        let mut rehashed = 0;
        let mut grown = 0;
        for shard in &mut self.shards {
            let (len, capacity) = (shard.len(), shard.capacity());
            if len == 0 || len * 4 < capacity * 3 || capacity >= per_shard {
                continue;
            }
            // Room for one more than it holds now: the next table size.
            shard.reserve(capacity + 1 - len);
            rehashed += len;
            grown += 1;
            if rehashed >= GROW_AHEAD_ENTRIES {
                break;
            }
        }
        grown
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// For adding many ids at once (loading the window): see [`Bulk`].
    pub(crate) fn bulk(&mut self) -> Bulk<'_> {
        Bulk {
            buckets: (0..SHARDS)
                .map(|_| Vec::with_capacity(BULK_CHUNK / SHARDS * 5 / 4))
                .collect(),
            pending: 0,
            threads: std::thread::available_parallelism()
                .map_or(1, |n| n.get())
                .clamp(1, 8),
            set: self,
        }
    }
}

/// What [`IdSet::insert_in_shard_order`] answers, and its working space,
/// kept between calls so a group allocates nothing.
#[derive(Debug, Default)]
pub(crate) struct ShardOrder {
    /// Whether each id was new.
    pub(crate) fresh: Vec<bool>,
    order: Vec<u32>,
}

/// Ids gathered by a [`Bulk`] before they go into the shards.
const BULK_CHUNK: usize = 1 << 20;

/// Adds ids a chunk at a time. One at a time, every insert lands in a
/// random place of the whole set (tens to hundreds of megabytes), a cache
/// miss each; a chunk is first sorted into per-shard buckets (sequential
/// writes), then each shard takes its bucket while its table is in cache,
/// the shards split between threads. Measured by `adbench --sections state`
/// ("dedupe window load").
pub(crate) struct Bulk<'a> {
    set: &'a mut IdSet,
    buckets: Vec<Vec<u128>>,
    pending: usize,
    threads: usize,
}

impl Bulk<'_> {
    pub(crate) fn insert(&mut self, id: u128) {
        self.buckets[IdSet::shard(id)].push(id);
        self.pending += 1;
        if self.pending == BULK_CHUNK {
            self.flush();
        }
    }

    /// Adds what is still gathered; dropping does the same.
    pub(crate) fn finish(mut self) {
        self.flush();
    }

    fn flush(&mut self) {
        if self.pending == 0 {
            return;
        }
        self.pending = 0;
        let per_thread = SHARDS.div_ceil(self.threads);
        let added: usize = std::thread::scope(|scope| {
            let mut handles = Vec::new();
            let groups = self
                .set
                .shards
                .chunks_mut(per_thread)
                .zip(self.buckets.chunks_mut(per_thread));
            for (shards, buckets) in groups {
                handles.push(scope.spawn(move || {
                    let mut added = 0;
                    for (shard, bucket) in shards.iter_mut().zip(buckets.iter_mut()) {
                        let before = shard.len();
                        shard.extend(bucket.drain(..));
                        added += shard.len() - before;
                    }
                    added
                }));
            }
            handles
                .into_iter()
                .map(|h| h.join().expect("dedupe bulk insert thread"))
                .sum()
        });
        self.set.len += added;
    }
}

impl Drop for Bulk<'_> {
    fn drop(&mut self) {
        self.flush();
    }
}

/// An id as the set keys it.
pub(crate) fn id_key(id: &[u8; 16]) -> u128 {
    u128::from_be_bytes(*id)
}

/// Iterates the packed ids of one log entry.
pub(crate) fn packed_ids(value: &[u8]) -> impl Iterator<Item = u128> + '_ {
    value
        .chunks_exact(16)
        .map(|chunk| u128::from_be_bytes(chunk.try_into().expect("16-byte chunk")))
}

/// Reads every id of `dedupe_log` into a new set.
pub fn load(store: &Store) -> Result<IdSet, Error> {
    let started = Instant::now();
    let txn = store.read_txn()?;
    let mut total = 0usize;
    for entry in store
        .dedupe_log
        .iter(&txn)
        .map_err(store.err("iterate dedupe log"))?
    {
        let (_, ids) = entry.map_err(store.err("iterate dedupe log"))?;
        total += ids.len() / 16;
    }
    let mut set = IdSet::with_capacity(total);
    let mut bulk = set.bulk();
    for entry in store
        .dedupe_log
        .iter(&txn)
        .map_err(store.err("iterate dedupe log"))?
    {
        let (_, ids) = entry.map_err(store.err("iterate dedupe log"))?;
        for id in packed_ids(ids) {
            bulk.insert(id);
        }
    }
    bulk.finish();
    tracing::info!(
        ids = set.len(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "dedupe window loaded"
    );
    Ok(set)
}

#[cfg(test)]
mod tests;
