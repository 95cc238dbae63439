//! Reading a delta object back ([`Delta::decode`], every length and count
//! checked against what is left) and writing it into a shard's store
//! ([`Delta::apply`]).

use std::ops::Bound;

use adspend_wire::types::LIFETIME_BUCKET;

use bytes::Bytes;

use super::{Changes, LimitChange, FORMAT_VERSION, MAGIC};
use crate::error::Error;
use crate::store::{lifetime_value, sum_key, PeriodClock, Store};

/// A decoded delta object.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Delta {
    pub(crate) lineage: String,
    pub(crate) changes: Changes,
}

/// Bounds-checked reads over the object's bytes.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if self.bytes.len() < n {
            return Err(format!("truncated in {what}"));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn u8(&mut self, what: &str) -> Result<u8, String> {
        Ok(self.take(1, what)?[0])
    }

    fn u16(&mut self, what: &str) -> Result<u16, String> {
        Ok(u16::from_be_bytes(
            self.take(2, what)?.try_into().expect("2 bytes"),
        ))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_be_bytes(
            self.take(4, what)?.try_into().expect("4 bytes"),
        ))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_be_bytes(
            self.take(8, what)?.try_into().expect("8 bytes"),
        ))
    }

    fn key(&mut self, what: &str) -> Result<[u8; 16], String> {
        Ok(self.take(16, what)?.try_into().expect("16 bytes"))
    }

    /// A count of items of at least `min_size` bytes each, checked against
    /// what is left so a corrupt count cannot ask for a huge allocation.
    fn count(&mut self, what: &str, min_size: usize) -> Result<usize, String> {
        let n = self.u64(what)?;
        if n > (self.bytes.len() / min_size.max(1)) as u64 {
            return Err(format!("{what}: {n} entries cannot fit in what is left"));
        }
        Ok(n as usize)
    }
}

impl Delta {
    /// Decode format 1, 2 or 3; any other content is an error saying where it
    /// broke.
    pub(crate) fn decode(bytes: &[u8]) -> Result<Delta, String> {
        let mut r = Reader { bytes };
        if r.take(8, "magic")? != MAGIC {
            return Err("not a delta (bad magic)".into());
        }
        let version = r.u32("version")?;
        if !(1..=FORMAT_VERSION).contains(&version) {
            return Err(format!(
                "delta format {version}; this aggregator reads formats 1 to {FORMAT_VERSION}"
            ));
        }
        let len = r.u16("lineage")? as usize;
        let lineage = std::str::from_utf8(r.take(len, "lineage")?)
            .map_err(|_| "lineage is not UTF-8".to_string())?
            .to_string();
        let from_seq = r.u64("from_seq")?;
        let to_seq = r.u64("to_seq")?;
        if from_seq > to_seq {
            return Err(format!("sequence range {from_seq}..={to_seq} is backwards"));
        }
        let mut changes = Changes::at(from_seq);
        changes.to_seq = to_seq;
        let limits = r.count("limits", 6)?;
        changes.limits.reserve(limits);
        for _ in 0..limits {
            let len = r.u8("limit id")? as usize;
            if !(1..=64).contains(&len) {
                return Err(format!("limit id of {len} bytes"));
            }
            let limit = std::str::from_utf8(r.take(len, "limit id")?)
                .map_err(|_| "limit id is not UTF-8".to_string())?
                .to_string();
            let mut change = LimitChange::default();
            match r.u8("lifetime flag")? {
                0 => {}
                1 => change.lifetime = Some((r.u64("lifetime")?, r.u64("lifetime")?)),
                other => return Err(format!("lifetime flag {other} of {limit}")),
            }
            let buckets = r.u32("buckets")? as usize;
            if buckets > r.bytes.len() / 12 {
                return Err(format!("{limit}: {buckets} buckets cannot fit"));
            }
            for _ in 0..buckets {
                let bucket = r.u32("bucket")?;
                if bucket == LIFETIME_BUCKET {
                    return Err(format!("{limit}: the lifetime bucket as a period bucket"));
                }
                change.buckets.push((bucket, r.u64("bucket micros")?));
            }
            if changes.limits.insert(limit.clone(), change).is_some() {
                return Err(format!("limit {limit} twice"));
            }
        }
        let added = r.count("log entries", 20)?;
        for _ in 0..added {
            let key = r.key("log key")?;
            let ids = r.u32("log ids")? as usize;
            let ids = Bytes::copy_from_slice(r.take(ids.saturating_mul(16), "log ids")?);
            changes.log_added.insert(key, ids);
        }
        let evicted = r.count("evictions", 16)?;
        for _ in 0..evicted {
            changes.log_evicted.push(r.key("eviction")?);
        }
        if version >= 2 {
            match r.u8("evicted-below flag")? {
                0 => {}
                1 => changes.log_evicted_below = Some(r.key("evicted-below key")?),
                other => return Err(format!("evicted-below flag {other}")),
            }
        }
        if version >= 3 {
            match r.u8("clock flag")? {
                0 => {}
                1 => {
                    changes.clock = Some(PeriodClock {
                        stream_clock_ms: r.u64("stream clock")?,
                        closed_below: r.u32("closed below")?,
                    })
                }
                other => return Err(format!("clock flag {other}")),
            }
        }
        if !r.bytes.is_empty() {
            return Err(format!("{} bytes after the end", r.bytes.len()));
        }
        Ok(Delta { lineage, changes })
    }

    /// Write the changes into `store` in one transaction, ending at `to_seq`.
    pub(crate) fn apply(&self, store: &Store) -> Result<(), Error> {
        let mut wtxn = store.write_txn()?;
        for (limit, change) in &self.changes.limits {
            if let Some((micros, tuples)) = change.lifetime {
                store
                    .lifetime
                    .put(&mut wtxn, limit.as_str(), &lifetime_value(micros, tuples))
                    .map_err(store.err("put lifetime"))?;
            }
            for (bucket, micros) in &change.buckets {
                store
                    .sums
                    .put(&mut wtxn, sum_key(limit, *bucket).as_slice(), micros)
                    .map_err(store.err("put sum"))?;
            }
        }
        // First, so that an entry added since cannot be taken by the range.
        if let Some(below) = &self.changes.log_evicted_below {
            let range = (Bound::Unbounded, Bound::Excluded(below.as_slice()));
            store
                .dedupe_log
                .delete_range(&mut wtxn, &range)
                .map_err(store.err("evict dedupe log"))?;
        }
        for (key, ids) in &self.changes.log_added {
            store
                .dedupe_log
                .put(&mut wtxn, key.as_slice(), ids.as_ref())
                .map_err(store.err("put dedupe log"))?;
        }
        for key in &self.changes.log_evicted {
            store
                .dedupe_log
                .delete(&mut wtxn, key.as_slice())
                .map_err(store.err("evict dedupe log"))?;
        }
        // After the sums: a bucket the delta carries may have closed since
        // (the writer's own changes leave such buckets out, but a base may
        // still hold them).
        if let Some(clock) = self.changes.clock {
            store.delete_sums_below(&mut wtxn, clock.closed_below)?;
            store.set_period_clock(&mut wtxn, clock)?;
        }
        store.set_last_applied_seq(&mut wtxn, self.changes.to_seq)?;
        wtxn.commit().map_err(store.err("commit"))
    }
}
