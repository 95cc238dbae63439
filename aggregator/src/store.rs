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
//! - `meta`: last applied sequence, lineage
//!
//! Integer keys are big-endian so byte order is numeric order. Methods take
//! the caller's transaction. All `unsafe` of the aggregator lives here.

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

/// `[len u8][limit][bucket u32 BE]`: the length prefix keeps one limit's
/// buckets together and apart from limits that share a prefix.
/// Written into a reused buffer.
pub fn sum_key_into(key: &mut Vec<u8>, limit: &str, bucket: u32) {
    key.clear();
    key.push(limit.len() as u8);
    key.extend_from_slice(limit.as_bytes());
    key.extend_from_slice(&bucket.to_be_bytes());
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
pub fn lifetime_value(micros: u64, events: u64) -> [u8; 16] {
    let mut value = [0u8; 16];
    value[..8].copy_from_slice(&micros.to_be_bytes());
    value[8..].copy_from_slice(&events.to_be_bytes());
    value
}

/// (micros, tuples) of a `lifetime` value; a malformed one reads as zero.
pub fn parse_lifetime(value: &[u8]) -> (u64, u64) {
    let word = |range: std::ops::Range<usize>| {
        value
            .get(range)
            .and_then(|b| b.try_into().ok())
            .map_or(0, u64::from_be_bytes)
    };
    (word(0..8), word(8..16))
}

/// Key of one dedupe log entry: stream time, then the first sequence the
/// transaction applied (unique, since sequences only grow).
pub fn log_key(time_ms: u64, first_seq: u64) -> [u8; 16] {
    let mut key = [0u8; 16];
    key[..8].copy_from_slice(&time_ms.to_be_bytes());
    key[8..].copy_from_slice(&first_seq.to_be_bytes());
    key
}

/// The stream time of a dedupe log key.
pub fn log_key_time(key: &[u8]) -> u64 {
    key.get(..8)
        .and_then(|b| b.try_into().ok())
        .map_or(0, u64::from_be_bytes)
}

impl Store {
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

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn err(&self, op: &'static str) -> impl FnOnce(heed::Error) -> Error {
        Error::lmdb(&self.path, op)
    }

    pub fn read_txn(&self) -> Result<RoTxn<'_, WithoutTls>, Error> {
        self.env.read_txn().map_err(self.err("begin read"))
    }

    pub fn write_txn(&self) -> Result<RwTxn<'_>, Error> {
        self.env.write_txn().map_err(self.err("begin write"))
    }

    pub fn last_applied_seq(&self, txn: &RoTxn<'_>) -> Result<u64, Error> {
        Ok(self
            .meta
            .get(txn, META_LAST_APPLIED_SEQ)
            .map_err(self.err("get last_applied_seq"))?
            .and_then(|b| b.try_into().ok())
            .map(u64::from_be_bytes)
            .unwrap_or(0))
    }

    pub fn set_last_applied_seq(&self, txn: &mut RwTxn<'_>, seq: u64) -> Result<(), Error> {
        self.meta
            .put(txn, META_LAST_APPLIED_SEQ, &seq.to_be_bytes())
            .map_err(self.err("put last_applied_seq"))
    }

    pub fn lineage(&self, txn: &RoTxn<'_>) -> Result<Option<String>, Error> {
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

    /// (lineage, last applied sequence) in one read.
    pub fn position(&self) -> Result<(Option<String>, u64), Error> {
        let txn = self.read_txn()?;
        Ok((self.lineage(&txn)?, self.last_applied_seq(&txn)?))
    }
}
