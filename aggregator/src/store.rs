//! The LMDB environment of one aggregator shard and its typed databases.
//!
//! - `sums`: (limit, bucket) → micros of that period bucket
//! - `lifetime`: limit → micros ever
//! - `events`: limit → spend tuples ever applied
//! - `dedupe`: message id → stream time (ms) the id was first seen
//! - `dedupe_by_time`: (stream time, message id) → (), so the oldest ids are a
//!   key prefix and eviction is a range delete
//! - `meta`: last applied sequence, lineage
//!
//! Integer keys are big-endian so byte order is numeric order. Methods take
//! the caller's transaction. All `unsafe` of the aggregator lives here.

use std::path::{Path, PathBuf};

use heed::byteorder::BigEndian;
use heed::types::{Bytes, Str, Unit, U64};
use heed::{CommitOrAbort, Database, Env, EnvOpenOptions, RoTxn, RwTxn, WithoutTls};

use crate::error::Error;

type Micros = U64<BigEndian>;

const DB_SUMS: &str = "sums";
const DB_LIFETIME: &str = "lifetime";
const DB_DEDUPE: &str = "dedupe";
const DB_DEDUPE_BY_TIME: &str = "dedupe_by_time";
const DB_META: &str = "meta";
const DB_EVENTS: &str = "events";
const META_LAST_APPLIED_SEQ: &str = "last_applied_seq";
const META_LINEAGE: &str = "lineage";

/// Virtual address space reserved for the map; the file grows as needed.
pub const DEFAULT_MAP_SIZE: usize = 64 << 30;

pub struct Store {
    pub env: Env<WithoutTls>,
    path: PathBuf,
    pub sums: Database<'static, Bytes, Micros>,
    pub lifetime: Database<'static, Str, Micros>,
    /// limit → spend tuples ever applied
    pub events: Database<'static, Str, Micros>,
    pub dedupe: Database<'static, Bytes, Micros>,
    pub dedupe_by_time: Database<'static, Bytes, Unit>,
    meta: Database<'static, Str, Bytes>,
}

/// `[len u8][limit][bucket u32 BE]`: the length prefix keeps one limit's
/// buckets together and apart from limits that share a prefix.
pub fn sum_key(limit: &str, bucket: u32) -> Vec<u8> {
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

pub fn time_key(time_ms: u64, id: &[u8; 16]) -> [u8; 24] {
    let mut key = [0u8; 24];
    key[..8].copy_from_slice(&time_ms.to_be_bytes());
    key[8..].copy_from_slice(id);
    key
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
        let (sums, lifetime, dedupe, dedupe_by_time, meta, events) = env
            .create_databases_and_commit(wtxn, |opener, wtxn| -> Result<_, heed::Error> {
                Ok(CommitOrAbort::<_, ()>::Commit((
                    opener.create_database::<Bytes, Micros>(wtxn, Some(DB_SUMS))?,
                    opener.create_database::<Str, Micros>(wtxn, Some(DB_LIFETIME))?,
                    opener.create_database::<Bytes, Micros>(wtxn, Some(DB_DEDUPE))?,
                    opener.create_database::<Bytes, Unit>(wtxn, Some(DB_DEDUPE_BY_TIME))?,
                    opener.create_database::<Str, Bytes>(wtxn, Some(DB_META))?,
                    opener.create_database::<Str, Micros>(wtxn, Some(DB_EVENTS))?,
                )))
            })
            .map_err(Error::lmdb(path, "create databases"))?
            .unwrap_commit();
        Ok(Store {
            env,
            path: path.to_path_buf(),
            sums,
            lifetime,
            events,
            dedupe,
            dedupe_by_time,
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
