//! Incremental checkpoints: what changed in a shard's LMDB since its last
//! checkpoint, as one object.
//!
//! The writer records, in the same critical section as each commit, the new
//! value of every sum the commit changed, the dedupe log entry it added and
//! the entries it evicted ([`Changes::absorb`]). A checkpoint takes what has
//! accumulated ([`Changes::take`]) and uploads it as a delta on top of the
//! chain its record already names (a base snapshot, then deltas). Values are
//! absolute, not increments, so a delta taken over sequences `from..=to`
//! brings any state at a sequence in `from..=to` of the same lineage to the
//! state at `to`: that is what lets a full copy (whose own transaction may
//! start after the reset) sit under the next delta.
//!
//! Restore is base + deltas in order ([`Delta::apply`]), each checked against
//! its record entry (size, checksum), its lineage and its sequence range.
//!
//! After a warm start past its record, an aggregator reads the changes since
//! the record from the store itself ([`Changes::since`]): the first
//! checkpoint of that life is then a delta too, not a full copy.
//!
//! Format 3, all integers big-endian (format 2 is the same without the last
//! line, format 1 without the last two; both are still read):
//!
//! ```text
//! "ADSPDLTA" u32 version
//! u16 len, lineage
//! u64 from_seq, u64 to_seq
//! u64 limits, each: u8 len, limit, u8 has_lifetime, [u64 micros, u64 tuples],
//!                   u32 buckets, each: u32 bucket, u64 micros
//! u64 log entries added, each: [16] key, u32 ids, ids × [16]
//! u64 log entries evicted, each: [16] key
//! u8 has_evicted_below, [[16] key]: every log entry below the key is evicted
//! u8 has_clock, [u64 stream clock ms, u32 closed below]: the stream clock
//!    at to_seq, and every period sum of a bucket below is deleted (closed
//!    periods, `crate::apply::closed`)
//! ```

use std::io::Write;

use adspend_wire::types::{SumEntry, LIFETIME_BUCKET};
use bytes::Bytes;
use rustc_hash::FxHashMap;

use crate::error::Error;
use crate::store::{parse_lifetime, parse_sum_key, PeriodClock, Store};

const MAGIC: &[u8; 8] = b"ADSPDLTA";
/// The format written; [`Delta::decode`] reads this one and every earlier.
pub(crate) const FORMAT_VERSION: u32 = 3;

/// The changes of one limit: its lifetime sum and period buckets, as stored.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct LimitChange {
    lifetime: Option<(u64, u64)>,
    buckets: Vec<(u32, u64)>,
}

impl LimitChange {
    fn set_bucket(&mut self, bucket: u32, micros: u64) {
        match self.buckets.iter_mut().find(|(b, _)| *b == bucket) {
            Some(slot) => slot.1 = micros,
            None => self.buckets.push((bucket, micros)),
        }
    }
}

/// Everything the writer committed since the last checkpoint took its
/// changes, with the new values.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// The last applied sequence when accumulation started.
    pub(crate) from_seq: u64,
    /// The last applied sequence of the newest commit absorbed.
    pub(crate) to_seq: u64,
    limits: FxHashMap<String, LimitChange>,
    /// Each commit's new ids, as the writer handed them over: encoding
    /// refers to these bytes rather than copying them (a delta at 200,000
    /// impressions/s holds about 100 MB of them).
    log_added: FxHashMap<[u8; 16], Bytes>,
    log_evicted: Vec<[u8; 16]>,
    /// Every log entry with a smaller key is evicted. Set only by
    /// [`Changes::since`], which cannot name the entries evicted since the
    /// record, but knows they are the ones below the oldest entry left
    /// (eviction takes whole entries, oldest key first).
    log_evicted_below: Option<[u8; 16]>,
    /// The stream clock of the newest commit absorbed; no sum below its
    /// `closed_below` is kept (here or, once applied, in the store).
    clock: Option<PeriodClock>,
}

impl Changes {
    /// Nothing changed yet over a store at `seq`.
    pub(crate) fn at(seq: u64) -> Self {
        Changes {
            from_seq: seq,
            to_seq: seq,
            ..Default::default()
        }
    }

    /// Record one commit: the sums it changed (new values), the dedupe log
    /// entry it added, the entries it evicted, and its last applied sequence.
    pub(crate) fn absorb(
        &mut self,
        changed: &[SumEntry],
        log_added: Option<([u8; 16], &[u8])>,
        log_evicted: &[[u8; 16]],
        seq: u64,
    ) {
        for entry in changed {
            let limit = match self.limits.get_mut(entry.limit.as_str()) {
                Some(limit) => limit,
                None => self.limits.entry(entry.limit.clone()).or_default(),
            };
            if entry.bucket == LIFETIME_BUCKET {
                limit.lifetime = Some((entry.lifetime_micros, entry.lifetime_events));
            } else {
                limit.set_bucket(entry.bucket, entry.bucket_micros);
            }
        }
        if let Some((key, ids)) = log_added {
            self.log_added.insert(key, Bytes::copy_from_slice(ids));
        }
        for key in log_evicted {
            // Added and evicted within one interval: the base never had it,
            // but a copy taken after the reset may, so the eviction stays.
            self.log_added.remove(key);
            self.log_evicted.push(*key);
        }
        self.to_seq = self.to_seq.max(seq);
    }

    /// The stream clock after the commit just absorbed: the buckets it
    /// closed leave the changes (the delta deletes them from the store).
    pub(crate) fn clock(&mut self, clock: PeriodClock) {
        self.clock = Some(clock);
        self.forget_closed();
    }

    fn forget_closed(&mut self) {
        if let Some(clock) = self.clock {
            for change in self.limits.values_mut() {
                change.buckets.retain(|(b, _)| *b >= clock.closed_below);
            }
        }
    }

    /// What a warm store holds that the recorded checkpoint at `record_seq`
    /// (same lineage, `record_seq` at or below the store's position) does
    /// not, read from the store: every sum (the store does not say which
    /// changed since; sums are few next to dedupe ids), the log entries
    /// whose first sequence is past `record_seq`, and the evictions since as
    /// the key of the oldest entry left. Applied over the record's state it
    /// gives the store's state exactly. Costs one pass over the sums and the
    /// log's keys, less than the writer's own load of the log at start.
    pub(crate) fn since(store: &Store, record_seq: u64) -> Result<Changes, Error> {
        let txn = store.read_txn()?;
        let mut changes = Changes::at(record_seq);
        changes.to_seq = store.last_applied_seq(&txn)?;
        if changes.to_seq < record_seq {
            return Err(store.corrupt(
                format!(
                    "position {} behind the record's {record_seq}",
                    changes.to_seq
                ),
                &[],
            ));
        }
        for entry in store
            .lifetime
            .iter(&txn)
            .map_err(store.err("iterate lifetime"))?
        {
            let (limit, value) = entry.map_err(store.err("iterate lifetime"))?;
            let lifetime = parse_lifetime(value)
                .ok_or_else(|| store.corrupt(format!("lifetime of {limit}"), value))?;
            changes
                .limits
                .entry(limit.to_string())
                .or_default()
                .lifetime = Some(lifetime);
        }
        for entry in store.sums.iter(&txn).map_err(store.err("iterate sums"))? {
            let (key, micros) = entry.map_err(store.err("iterate sums"))?;
            let (limit, bucket) =
                parse_sum_key(key).ok_or_else(|| store.corrupt("sum key".to_string(), key))?;
            changes
                .limits
                .entry(limit.to_string())
                .or_default()
                .set_bucket(bucket, micros);
        }
        let mut oldest = None;
        for entry in store
            .dedupe_log
            .iter(&txn)
            .map_err(store.err("iterate dedupe log"))?
        {
            let (key, ids) = entry.map_err(store.err("iterate dedupe log"))?;
            let key: [u8; 16] = key
                .try_into()
                .map_err(|_| store.corrupt("dedupe log key".to_string(), key))?;
            oldest.get_or_insert(key);
            let first_seq = u64::from_be_bytes(key[8..].try_into().expect("8 bytes"));
            if first_seq > record_seq {
                changes.log_added.insert(key, Bytes::copy_from_slice(ids));
            }
        }
        // An empty log: everything the record held was evicted.
        changes.log_evicted_below = Some(oldest.unwrap_or([0xff; 16]));
        changes.clock = Some(store.period_clock(&txn)?);
        Ok(changes)
    }

    /// Put back what a failed checkpoint took (`older`, taken before
    /// anything now held): the result covers both, from `older`'s first
    /// sequence, with the newer value wherever both changed something, so
    /// the next delta still extends the chain the failed one was to extend.
    pub(crate) fn put_back(&mut self, older: Changes) {
        for (limit, old) in older.limits {
            let change = self.limits.entry(limit).or_default();
            if change.lifetime.is_none() {
                change.lifetime = old.lifetime;
            }
            for (bucket, micros) in old.buckets {
                if !change.buckets.iter().any(|(b, _)| *b == bucket) {
                    change.buckets.push((bucket, micros));
                }
            }
        }
        // An entry added then and evicted since stays out.
        let evicted_since: rustc_hash::FxHashSet<[u8; 16]> =
            self.log_evicted.iter().copied().collect();
        for (key, ids) in older.log_added {
            if !evicted_since.contains(&key) {
                self.log_added.entry(key).or_insert(ids);
            }
        }
        let mut evicted = older.log_evicted;
        evicted.append(&mut self.log_evicted);
        self.log_evicted = evicted;
        // Only a warm start sets it, and only on the first changes of a life.
        if self.log_evicted_below.is_none() {
            self.log_evicted_below = older.log_evicted_below;
        }
        self.from_seq = self.from_seq.min(older.from_seq);
        self.to_seq = self.to_seq.max(older.to_seq);
        if self.clock.is_none() {
            self.clock = older.clock;
        }
        self.forget_closed();
    }

    /// Take what accumulated; accumulation starts again from `to_seq`.
    pub(crate) fn take(&mut self) -> Changes {
        let next = Changes::at(self.to_seq);
        std::mem::replace(self, next)
    }

    /// Changed sums (a limit's lifetime and each bucket count one each).
    pub(crate) fn sums(&self) -> usize {
        self.limits
            .values()
            .map(|l| usize::from(l.lifetime.is_some()) + l.buckets.len())
            .sum()
    }

    /// Dedupe ids added.
    pub(crate) fn ids_added(&self) -> usize {
        self.log_added.values().map(|ids| ids.len() / 16).sum()
    }

    /// Encode as format 3, in key order, into `out`.
    #[cfg(test)]
    pub(crate) fn encode(&self, lineage: &str, out: &mut impl Write) -> std::io::Result<()> {
        for piece in self.encode_pieces(lineage)? {
            out.write_all(&piece)?;
        }
        Ok(())
    }

    /// Format 3, in key order, as consecutive pieces: the dedupe ids are
    /// the bytes [`Changes::absorb`] kept, not copies, so a delta costs no
    /// second buffer of its size (a first touch of fresh memory, which on
    /// this kind of machine cost more than the copy itself).
    pub(crate) fn encode_pieces(&self, lineage: &str) -> std::io::Result<Vec<Bytes>> {
        let mut pieces = Vec::with_capacity(2 * self.log_added.len() + 2);
        let mut out = Vec::with_capacity(self.head_len_hint());
        out.write_all(MAGIC)?;
        out.write_all(&FORMAT_VERSION.to_be_bytes())?;
        let lineage_len = u16::try_from(lineage.len()).map_err(|_| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, "lineage too long")
        })?;
        out.write_all(&lineage_len.to_be_bytes())?;
        out.write_all(lineage.as_bytes())?;
        out.write_all(&self.from_seq.to_be_bytes())?;
        out.write_all(&self.to_seq.to_be_bytes())?;
        let mut limits: Vec<(&String, &LimitChange)> = self.limits.iter().collect();
        limits.sort_unstable_by_key(|(limit, _)| limit.as_str());
        out.write_all(&(limits.len() as u64).to_be_bytes())?;
        for (limit, change) in limits {
            // Limit ids are 1..=64 bytes (the limiter refuses others).
            out.write_all(&[limit.len() as u8])?;
            out.write_all(limit.as_bytes())?;
            match change.lifetime {
                Some((micros, tuples)) => {
                    out.write_all(&[1])?;
                    out.write_all(&micros.to_be_bytes())?;
                    out.write_all(&tuples.to_be_bytes())?;
                }
                None => out.write_all(&[0])?,
            }
            out.write_all(&(change.buckets.len() as u32).to_be_bytes())?;
            for (bucket, micros) in &change.buckets {
                out.write_all(&bucket.to_be_bytes())?;
                out.write_all(&micros.to_be_bytes())?;
            }
        }
        let mut added: Vec<(&[u8; 16], &Bytes)> = self.log_added.iter().collect();
        added.sort_unstable_by_key(|(key, _)| **key);
        out.write_all(&(added.len() as u64).to_be_bytes())?;
        for (key, ids) in added {
            out.write_all(key)?;
            out.write_all(&((ids.len() / 16) as u32).to_be_bytes())?;
            pieces.push(Bytes::from(std::mem::take(&mut out)));
            pieces.push(ids.clone());
        }
        out.write_all(&(self.log_evicted.len() as u64).to_be_bytes())?;
        for key in &self.log_evicted {
            out.write_all(key)?;
        }
        match &self.log_evicted_below {
            Some(key) => {
                out.write_all(&[1])?;
                out.write_all(key)?;
            }
            None => out.write_all(&[0])?,
        }
        match &self.clock {
            Some(clock) => {
                out.write_all(&[1])?;
                out.write_all(&clock.stream_clock_ms.to_be_bytes())?;
                out.write_all(&clock.closed_below.to_be_bytes())?;
            }
            None => out.write_all(&[0])?,
        }
        pieces.push(Bytes::from(out));
        Ok(pieces)
    }

    /// About the size of everything but the dedupe ids, for the first piece.
    fn head_len_hint(&self) -> usize {
        let limits: usize = self
            .limits
            .iter()
            .map(|(limit, change)| 1 + limit.len() + 17 + 4 + 12 * change.buckets.len())
            .sum();
        64 + limits + 33
    }
}

mod decode;

pub(crate) use decode::Delta;

#[cfg(test)]
mod tests;
