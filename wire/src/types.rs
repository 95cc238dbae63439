//! The records that travel between the services.
//!
//! Money is always integer micros (`u64`) and every sum is checked: an overflow
//! is an error, never a wrap.

use bincode::{Decode, Encode};
use serde::{Deserialize, Serialize};

/// Millionths of the currency unit.
pub type Micros = u64;

/// Bucket value for limits whose period is `lifetime`: they have no period
/// bucket, only the lifetime sum.
pub const LIFETIME_BUCKET: u32 = u32::MAX;

/// Longest limit id, ad id and impression id, in bytes (CONTRACT.md).
pub const MAX_ID_LEN: usize = 64;

/// 16-byte message id of one spend tuple, derived from (limit, impression id)
/// so that a re-emitted tuple carries the same id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Encode, Decode)]
pub struct MsgId(pub [u8; 16]);

impl MsgId {
    /// Deterministic across runs, versions and machines: xxh3-128 has a fixed
    /// specification and no random seed.
    pub fn derive(limit_id: &str, impression_id: &str) -> Self {
        // One-shot over a stack buffer (ids are at most 64 bytes); the
        // streaming hasher gives the same digest for longer input.
        let (limit, impression) = (limit_id.as_bytes(), impression_id.as_bytes());
        let len = 4 + limit.len() + impression.len();
        if len <= 4 + 2 * MAX_ID_LEN {
            let mut buf = [0u8; 4 + 2 * MAX_ID_LEN];
            buf[..4].copy_from_slice(&(limit.len() as u32).to_be_bytes());
            buf[4..4 + limit.len()].copy_from_slice(limit);
            buf[4 + limit.len()..len].copy_from_slice(impression);
            return MsgId(xxhash_rust::xxh3::xxh3_128(&buf[..len]).to_be_bytes());
        }
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&(limit.len() as u32).to_be_bytes());
        hasher.update(limit);
        hasher.update(impression);
        MsgId(hasher.digest128().to_be_bytes())
    }
}

/// One unit of spend against one limit of its batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Encode, Decode)]
pub struct SpendTuple {
    /// Index into the batch's `limits`.
    pub limit: u32,
    /// Period bucket the spend is booked to: for daily limits the local date
    /// (days since 1970-01-01) of the event in the limit's time zone, else
    /// [`LIFETIME_BUCKET`].
    pub bucket: u32,
    pub cost_micros: Micros,
    pub msg_id: MsgId,
}

/// Spend tuples of one partition. Each distinct limit id is carried once
/// and the tuples refer to it by index, so neither side allocates per tuple
/// and a message is about half the size it would be with the ids inline.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct SpendBatch {
    /// When the spend of this batch's chunk began (unix ms), for freshness
    /// and the pacer's lag: the earlier of the chunk's oldest JetStream
    /// publish time and its oldest impression `ts`, so that spend held back
    /// before the stream counts as lag (see `adspend_limiter::emit::chunk_source_ms`).
    pub source_ms: i64,
    pub limits: Vec<String>,
    pub tuples: Vec<SpendTuple>,
}

impl SpendBatch {
    /// The limit id of `tuple` (the codec has checked the index).
    pub fn limit_of(&self, tuple: &SpendTuple) -> &str {
        &self.limits[tuple.limit as usize]
    }
}

/// [`SpendBatch`] borrowed, for encoding without copying; encodes to the
/// same bytes.
#[derive(Debug, Encode)]
pub struct SpendBatchRef<'a> {
    pub source_ms: i64,
    pub limits: &'a [&'a str],
    pub tuples: &'a [SpendTuple],
}

/// Injected by the limiter into every partition each checkpoint interval.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct CheckpointMarker {
    /// Monotonic across limiter restarts (wall-clock based).
    pub marker_id: u64,
    pub partition: u32,
    pub emitted_ms: i64,
}

/// The payload of one message on `spend.<partition>`.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub enum SpendMessage {
    Batch(SpendBatch),
    Marker(CheckpointMarker),
}

/// [`SpendMessage`] borrowed, for encoding; same variants, same bytes.
#[derive(Debug, Encode)]
pub enum SpendMessageRef<'a> {
    Batch(SpendBatchRef<'a>),
    Marker(&'a CheckpointMarker),
}

/// The current value of one (limit, bucket) sum, pushed to the pacer.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode, Serialize, Deserialize)]
pub struct SumEntry {
    pub limit: String,
    pub bucket: u32,
    /// Sum of the bucket; equals `lifetime_micros` for [`LIFETIME_BUCKET`].
    pub bucket_micros: Micros,
    pub lifetime_micros: Micros,
    /// Spend tuples ever applied to the limit (so the pacer knows the
    /// typical cost of one event).
    pub lifetime_events: u64,
}

/// A push of absolute sums from an aggregator to the pacer. Absolute values
/// make pushes idempotent; the stamp `(epoch, seq)` lets the pacer refuse to
/// go backwards.
#[derive(Clone, Debug, PartialEq, Eq, Encode, Decode)]
pub struct SumsUpdate {
    pub shard: String,
    /// Owner epoch of the aggregator that sent this (fencing).
    pub epoch: u64,
    /// Last applied `SPEND` stream sequence these sums include.
    pub seq: u64,
    /// Per (shard, epoch) counter; a gap tells the pacer it missed a push.
    pub push_seq: u64,
    /// Set on the pushes that carry the full state after a resync request.
    pub full: bool,
    /// Unix ms up to which the sums are complete (see aggregator docs).
    pub watermark_ms: i64,
    /// Earliest source time (`SpendBatch::source_ms`: the publish time or
    /// the impression `ts`, whichever is older) among the batches in this push.
    pub source_ms: i64,
    pub entries: Vec<SumEntry>,
}

impl SumsUpdate {
    /// When the new spend of this push began, for freshness: `None` for a
    /// full resync, a heartbeat, or a push without a source time.
    pub fn fresh_source_ms(&self) -> Option<i64> {
        (!self.full && !self.entries.is_empty() && self.source_ms > 0).then_some(self.source_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn msg_id_depends_on_limit_and_impression() {
        let a = MsgId::derive("campaign-1", "imp-1");
        assert_eq!(a, MsgId::derive("campaign-1", "imp-1"));
        assert_ne!(a, MsgId::derive("campaign-2", "imp-1"));
        assert_ne!(a, MsgId::derive("campaign-1", "imp-2"));
        // The length prefix keeps ("ab","c") and ("a","bc") apart.
        assert_ne!(MsgId::derive("ab", "c"), MsgId::derive("a", "bc"));
        // Ids over the contract's length take the streaming path; both
        // paths hash the same bytes.
        let long = "x".repeat(100);
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&100u32.to_be_bytes());
        hasher.update(long.as_bytes());
        hasher.update(b"imp");
        assert_eq!(
            MsgId::derive(&long, "imp").0,
            hasher.digest128().to_be_bytes()
        );
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&10u32.to_be_bytes());
        hasher.update(b"campaign-1imp-1");
        assert_eq!(a.0, hasher.digest128().to_be_bytes());
    }
}
