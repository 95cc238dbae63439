//! The LMDB environment of one aggregator shard and its typed databases.
//!
//! - `sums`: (limit, bucket) → micros of that period bucket
//! - `lifetime`: limit → (micros ever, spend tuples ever applied), 16 bytes
//! - `dedupe_log`: (stream time ms, first sequence) → the 16-byte message ids
//!   first seen by one write transaction, packed. Keys are time-ordered, so
//!   the oldest ids are a key prefix and eviction deletes whole entries; an id
//!   costs 16 bytes on disk plus its share of one key per transaction. The
//!   writer keeps the ids of the window in memory for the lookups
//!   ([`crate::dedupe`]) and rebuilds that set from this log when it opens.
//! - `meta`: last applied sequence, lineage, the stream clock and the first
//!   bucket still open ([`PeriodClock`], `crate::apply::closed`)
//!
//! Integer keys are big-endian so byte order is numeric order. Methods take
//! the caller's transaction. All `unsafe` of the aggregator lives here.

use std::ops::Bound;
use std::path::{Path, PathBuf};

use heed::byteorder::BigEndian;
use heed::types::{Bytes, Str, U64};
use heed::{CommitOrAbort, Database, Env, EnvOpenOptions, RoTxn, RwTxn, WithoutTls};

use crate::error::Error;

type Micros = U64<BigEndian>;

const DB_SUMS: &str = "sums";
const DB_LIFETIME: &str = "lifetime";
const DB_DEDUPE_LOG: &str = "dedupe_log";
/// Databases of the first format (one LMDB entry per id in two trees, about
/// 90 bytes per id); a data dir that has them is refused, not misread.
const DB_FORMAT1_DEDUPE: &str = "dedupe_by_time";
const DB_META: &str = "meta";
const META_LAST_APPLIED_SEQ: &str = "last_applied_seq";
const META_LINEAGE: &str = "lineage";
/// The stream clock of closed periods ([`PeriodClock`]).
const META_STREAM_CLOCK: &str = "stream_clock_ms";
const META_CLOSED_BELOW: &str = "closed_below";

/// [`Store::update_sorted`] walks the whole key range once the updates are
/// more than one in this many keys.
const WALK_RATIO: u64 = 16;

/// File name of the LMDB data file, in snapshots as in the environment.
pub(crate) const DATA_FILE: &str = "data.mdb";

/// Virtual address space reserved for the map; the file grows as needed.
pub const DEFAULT_MAP_SIZE: usize = 64 << 30;

pub struct Store {
    pub env: Env<WithoutTls>,
    path: PathBuf,
    pub sums: Database<'static, Bytes, Micros>,
    pub lifetime: Database<'static, Str, Bytes>,
    pub dedupe_log: Database<'static, Bytes, Bytes>,
    meta: Database<'static, Str, Bytes>,
}

/// Makes `dir`'s entries (a file just renamed or created in it) durable.
pub(crate) fn fsync_dir(dir: &Path) -> adspend_common::error::Result<()> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(adspend_common::Error::io("fsync", dir))
}

/// `[len u8][limit][bucket u32 BE]`: the length prefix keeps one limit's
/// buckets together and apart from limits that share a prefix.
pub(crate) fn sum_key(limit: &str, bucket: u32) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + limit.len() + 4);
    key.push(limit.len() as u8);
    key.extend_from_slice(limit.as_bytes());
    key.extend_from_slice(&bucket.to_be_bytes());
    key
}

pub fn parse_sum_key(key: &[u8]) -> Option<(&str, u32)> {
    let (&len, rest) = key.split_first()?;
    let len = len as usize;
    if rest.len() != len + 4 {
        return None;
    }
    let limit = std::str::from_utf8(&rest[..len]).ok()?;
    let bucket = u32::from_be_bytes(rest[len..].try_into().ok()?);
    Some((limit, bucket))
}

/// A `lifetime` value: micros and tuples, big-endian.
pub(crate) fn lifetime_value(micros: u64, events: u64) -> [u8; 16] {
    let mut value = [0u8; 16];
    value[..8].copy_from_slice(&micros.to_be_bytes());
    value[8..].copy_from_slice(&events.to_be_bytes());
    value
}

/// (micros, tuples) of a `lifetime` value, `None` unless it is the 16 bytes
/// [`lifetime_value`] writes.
pub fn parse_lifetime(value: &[u8]) -> Option<(u64, u64)> {
    let value: &[u8; 16] = value.try_into().ok()?;
    let (micros, events) = value.split_at(8);
    Some((
        u64::from_be_bytes(micros.try_into().ok()?),
        u64::from_be_bytes(events.try_into().ok()?),
    ))
}

/// Key of one dedupe log entry: stream time, then the first sequence the
/// transaction applied (unique, since sequences only grow).
pub(crate) fn log_key(time_ms: u64, first_seq: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&time_ms.to_be_bytes());
    key[8..].copy_from_slice(&first_seq.to_be_bytes());
    key
}

/// The stream time of a dedupe log key.
pub(crate) fn log_key_time(key: &[u8]) -> u64 {
    key.get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_be_bytes)
}

/// Where a shard's stream clock stands: the latest JetStream publish time
/// of the `SPEND` messages applied (a running maximum, so the same data
/// gives the same clock however it is grouped or replayed), and the first
/// period bucket not yet closed at that clock: the store holds no sum of an
/// earlier bucket (`crate::apply::closed`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct PeriodClock {
    pub(crate) stream_clock_ms: u64,
    pub(crate) closed_below: u32,
}

impl Store {
    /// Close the environment now and wait until it is, so that its
    /// directory can be opened again by this process.
    pub(crate) fn close(self) {
        self.env.prepare_for_closing().wait();
    }

    /// Open (creating if needed) the environment in directory `path`.
    pub fn open(path: &Path, map_size: usize) -> Result<Store, Error> {
        std::fs::create_dir_all(path).map_err(adspend_common::Error::io("create", path))?;
        let mut options = EnvOpenOptions::new().read_txn_without_tls();
        options.map_size(map_size).max_dbs(8);
        // SAFETY: heed requires that the environment is not opened twice in
        // one process and that nothing else truncates the file while open.
        // The aggregator opens each directory once (it owns its data dir, and
        // snapshot copies are opened only under fresh temporary paths).
        #[allow(unsafe_code)]
        let env = unsafe { options.open(path) }.map_err(Error::lmdb(path, "open"))?;
        let wtxn = env.write_txn().map_err(Error::lmdb(path, "begin"))?;
        let opened = env
            .create_databases_and_commit(wtxn, |opener, wtxn| -> Result<_, heed::Error> {
                if opener
                    .open_database::<Bytes, Bytes>(wtxn, Some(DB_FORMAT1_DEDUPE))?
                    .is_some()
                {
                    return Ok(CommitOrAbort::Abort(()));
                }
                Ok(CommitOrAbort::Commit((
                    opener.create_database::<Bytes, Micros>(wtxn, Some(DB_SUMS))?,
                    opener.create_database::<Str, Bytes>(wtxn, Some(DB_LIFETIME))?,
                    opener.create_database::<Bytes, Bytes>(wtxn, Some(DB_DEDUPE_LOG))?,
                    opener.create_database::<Str, Bytes>(wtxn, Some(DB_META))?,
                )))
            })
            .map_err(Error::lmdb(path, "create databases"))?;
        let CommitOrAbort::Commit((sums, lifetime, dedupe_log, meta)) = opened else {
            return Err(Error::OldFormat(path.to_path_buf()));
        };
        Ok(Store {
            env,
            path: path.to_path_buf(),
            sums,
            lifetime,
            dedupe_log,
            meta,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The map size the environment was opened with.
    pub fn map_size(&self) -> usize {
        self.env.info().map_size
    }

    pub(crate) fn err(&self, op: &'static str) -> impl FnOnce(heed::Error) -> Error {
        Error::lmdb(&self.path, op)
    }

    pub fn read_txn(&self) -> Result<RoTxn<'_, WithoutTls>, Error> {
        self.env.read_txn().map_err(self.err("begin read"))
    }

    pub fn write_txn(&self) -> Result<RwTxn<'_>, Error> {
        self.env.write_txn().map_err(self.err("begin write"))
    }

    /// 0 for a store that never applied anything; a value that is not 8
    /// bytes is an error (read as 0 it would replay the whole stream, past
    /// the dedupe window).
    pub fn last_applied_seq(&self, txn: &RoTxn<'_>) -> Result<u64, Error> {
        match self
            .meta
            .get(txn, META_LAST_APPLIED_SEQ)
            .map_err(self.err("get last_applied_seq"))?
        {
            None => Ok(0),
            Some(bytes) => bytes
                .try_into()
                .map(u64::from_be_bytes)
                .map_err(|_| self.corrupt(META_LAST_APPLIED_SEQ.to_string(), bytes)),
        }
    }

    /// The error for a stored value that does not parse.
    pub(crate) fn corrupt(&self, what: String, bytes: &[u8]) -> Error {
        Error::CorruptValue {
            path: self.path().to_path_buf(),
            what,
            bytes: bytes.to_vec(),
        }
    }

    pub(crate) fn set_last_applied_seq(&self, txn: &mut RwTxn<'_>, seq: u64) -> Result<(), Error> {
        self.meta
            .put(txn, META_LAST_APPLIED_SEQ, &seq.to_be_bytes())
            .map_err(self.err("put last_applied_seq"))
    }

    pub(crate) fn lineage(&self, txn: &RoTxn<'_>) -> Result<Option<String>, Error> {
        Ok(self
            .meta
            .get(txn, META_LINEAGE)
            .map_err(self.err("get lineage"))?
            .map(|b| String::from_utf8_lossy(b).into_owned()))
    }

    pub fn set_lineage(&self, txn: &mut RwTxn<'_>, lineage: &str) -> Result<(), Error> {
        self.meta
            .put(txn, META_LINEAGE, lineage.as_bytes())
            .map_err(self.err("put lineage"))
    }

    /// Read-modify-write of many keys of `db` in one transaction: for each
    /// `(key, delta)` of `updates`, which must be sorted by key bytes and
    /// free of repeats, stores `combine(current value, delta)`.
    ///
    /// Touching a large share of the keys, it walks the database once with
    /// a cursor from the first key and overwrites each touched value in
    /// place: one sequential pass instead of two tree searches per key.
    /// Touching few, it looks each key up.
    pub(crate) fn update_sorted<K, D, V>(
        &self,
        wtxn: &mut RwTxn<'_>,
        db: Database<'static, Bytes, Bytes>,
        updates: &[(K, D)],
        mut combine: impl FnMut(Option<&[u8]>, &K, &D) -> Result<V, Error>,
    ) -> Result<(), Error>
    where
        K: AsRef<[u8]>,
        V: AsRef<[u8]>,
    {
        let Some((first, _)) = updates.first() else {
            return Ok(());
        };
        let entries = db.len(wtxn).map_err(self.err("count"))?;
        if (updates.len() as u64).saturating_mul(WALK_RATIO) < entries {
            for (k, delta) in updates {
                let key = k.as_ref();
                let value = combine(db.get(wtxn, key).map_err(self.err("get"))?, k, delta)?;
                db.put(wtxn, key, value.as_ref()).map_err(self.err("put"))?;
            }
            return Ok(());
        }
        let mut missing: Vec<usize> = Vec::new();
        let mut next = 0;
        {
            let start = first.as_ref();
            let mut walk = db
                .range_mut(wtxn, &(Bound::Included(start), Bound::Unbounded))
                .map_err(self.err("walk"))?;
            let mut current_key: Vec<u8> = Vec::with_capacity(80);
            while next < updates.len() {
                let Some(entry) = walk.next() else { break };
                let (key, value) = entry.map_err(self.err("walk"))?;
                while next < updates.len() && updates[next].0.as_ref() < key {
                    missing.push(next);
                    next += 1;
                }
                if next < updates.len() && updates[next].0.as_ref() == key {
                    let (k, delta) = &updates[next];
                    let new = combine(Some(value), k, delta)?;
                    current_key.clear();
                    current_key.extend_from_slice(key);
                    // SAFETY: heed requires that no value read through this
                    // cursor is used after the overwrite; `value` and `key`
                    // are dead here (the key was copied) and the next read
                    // comes from `walk.next()`.
                    #[allow(unsafe_code)]
                    unsafe { walk.put_current(&current_key, new.as_ref()) }
                        .map_err(self.err("overwrite"))?;
                    next += 1;
                }
            }
        }
        missing.extend(next..updates.len());
        for i in missing {
            let (key, delta) = &updates[i];
            let value = combine(None, key, delta)?;
            db.put(wtxn, key.as_ref(), value.as_ref())
                .map_err(self.err("put"))?;
        }
        Ok(())
    }

    /// The stored [`PeriodClock`]; zeros for a store written before it
    /// existed (or that never applied anything).
    pub(crate) fn period_clock(&self, txn: &RoTxn<'_>) -> Result<PeriodClock, Error> {
        let mut clock = PeriodClock::default();
        if let Some(bytes) = self
            .meta
            .get(txn, META_STREAM_CLOCK)
            .map_err(self.err("get stream clock"))?
        {
            clock.stream_clock_ms = bytes
                .try_into()
                .map(u64::from_be_bytes)
                .map_err(|_| self.corrupt(META_STREAM_CLOCK.to_string(), bytes))?;
        }
        if let Some(bytes) = self
            .meta
            .get(txn, META_CLOSED_BELOW)
            .map_err(self.err("get closed_below"))?
        {
            clock.closed_below = bytes
                .try_into()
                .map(u32::from_be_bytes)
                .map_err(|_| self.corrupt(META_CLOSED_BELOW.to_string(), bytes))?;
        }
        Ok(clock)
    }

    pub(crate) fn set_period_clock(
        &self,
        txn: &mut RwTxn<'_>,
        clock: PeriodClock,
    ) -> Result<(), Error> {
        self.meta
            .put(txn, META_STREAM_CLOCK, &clock.stream_clock_ms.to_be_bytes())
            .map_err(self.err("put stream clock"))?;
        self.meta
            .put(txn, META_CLOSED_BELOW, &clock.closed_below.to_be_bytes())
            .map_err(self.err("put closed_below"))
    }

    /// Delete every period sum of a bucket below `closed_below`; returns
    /// how many. One pass over the sums (keys are limit first, so the
    /// closed buckets are not one range): at most once per day of stream
    /// time, when a day closes.
    pub(crate) fn delete_sums_below(
        &self,
        txn: &mut RwTxn<'_>,
        closed_below: u32,
    ) -> Result<u64, Error> {
        let mut deleted = 0;
        let mut walk = self.sums.iter_mut(txn).map_err(self.err("walk sums"))?;
        while let Some(entry) = walk.next() {
            let (key, _) = entry.map_err(self.err("walk sums"))?;
            let closed = parse_sum_key(key).is_some_and(|(_, bucket)| bucket < closed_below);
            if closed {
                // SAFETY: heed requires that no key or value read through
                // this cursor is used after the deletion; `key` is dead
                // here and the next read comes from `walk.next()`.
                #[allow(unsafe_code)]
                unsafe { walk.del_current() }.map_err(self.err("delete closed sum"))?;
                deleted += 1;
            }
        }
        Ok(deleted)
    }

    /// (lineage, last applied sequence) in one read.
    pub fn position(&self) -> Result<(Option<String>, u64), Error> {
        let txn = self.read_txn()?;
        Ok((self.lineage(&txn)?, self.last_applied_seq(&txn)?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    #[test]
    fn malformed_values_are_errors_naming_them_not_zero() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 26).unwrap();
        let mut wtxn = store.write_txn().unwrap();
        store
            .meta
            .put(&mut wtxn, META_LAST_APPLIED_SEQ, &[1, 2, 3])
            .unwrap();
        wtxn.commit().unwrap();
        let txn = store.read_txn().unwrap();
        let err = store.last_applied_seq(&txn).unwrap_err();
        assert!(matches!(err, Error::CorruptValue { .. }) && err.is_fatal());
        let text = err.to_string();
        assert!(
            text.contains("last_applied_seq") && text.contains("[01, 02, 03]"),
            "{text}"
        );
        assert!(text.contains(&dir.path().display().to_string()), "{text}");

        assert_eq!(parse_lifetime(&lifetime_value(7, 2)), Some((7, 2)));
        assert_eq!(parse_lifetime(&[0; 15]), None);
        assert_eq!(parse_lifetime(&[0; 17]), None);
    }

    /// Both paths of `update_sorted` (lookups and the walk) against a model,
    /// with keys missing before, between and after the stored ones.
    #[test]
    fn update_sorted_matches_a_model_on_both_paths() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path(), 1 << 26).unwrap();
        let db: Database<'static, Bytes, Bytes> = store.sums.remap_types();
        let mut model: BTreeMap<Vec<u8>, u64> = BTreeMap::new();
        let key = |i: u32| format!("k{i:05}").into_bytes();
        let mut wtxn = store.write_txn().unwrap();
        for i in (0..400).step_by(2) {
            db.put(&mut wtxn, &key(i), &1u64.to_be_bytes()).unwrap();
            model.insert(key(i), 1);
        }
        // 3 updates of 200 keys: lookups; 150: the walk.
        for picks in [
            vec![1u32, 4, 999],
            (0..300).step_by(2).map(|i| i + i % 3).collect(),
        ] {
            let mut updates: Vec<(Vec<u8>, u64)> =
                picks.iter().map(|&i| (key(i), u64::from(i) + 1)).collect();
            updates.sort();
            updates.dedup_by(|a, b| a.0 == b.0);
            store
                .update_sorted(&mut wtxn, db, &updates, |current, _, delta| {
                    let old = current.map_or(0, |v| u64::from_be_bytes(v.try_into().unwrap()));
                    Ok((old + delta).to_be_bytes())
                })
                .unwrap();
            for (k, delta) in &updates {
                *model.entry(k.clone()).or_default() += delta;
            }
            let stored: BTreeMap<Vec<u8>, u64> = db
                .iter(&wtxn)
                .unwrap()
                .map(|e| {
                    let (k, v) = e.unwrap();
                    (k.to_vec(), u64::from_be_bytes(v.try_into().unwrap()))
                })
                .collect();
            assert_eq!(stored, model);
        }
    }
}
