//! What the parts of one shard hand each other: messages read from `SPEND`
//! (consumer → writer), the sums changed by each commit (writer → pusher)
//! and checkpoint requests (writer → checkpointer).

use std::sync::Mutex;

use adspend_wire::types::{SpendMessage, SumEntry};
use rustc_hash::FxHashMap;

/// A message read from `SPEND`.
#[derive(Debug)]
pub struct Incoming {
    pub seq: u64,
    /// JetStream publish time of the message (unix ms): the dedupe clock.
    pub stream_ms: i64,
    /// Messages still behind this one in the stream when it was read.
    pub pending: u64,
    pub message: SpendMessage,
}

impl Incoming {
    pub(crate) fn tuples(&self) -> usize {
        match &self.message {
            SpendMessage::Batch(batch) => batch.tuples.len().max(1),
            SpendMessage::Marker(_) => 1,
        }
    }
}

/// Sums changed since the pusher last looked, plus the position they reflect.
#[derive(Default)]
pub struct Dirty {
    inner: Mutex<DirtyState>,
}

#[derive(Default)]
pub(crate) struct DirtyState {
    pub(crate) entries: FxHashMap<(String, u32), SumEntry>,
    pub(crate) seq: u64,
    pub(crate) watermark_ms: i64,
    /// Earliest source time (publish or impression `ts`) among batches not yet pushed.
    pub(crate) source_ms: Option<i64>,
}

impl Dirty {
    pub fn new(seq: u64) -> Self {
        Dirty {
            inner: Mutex::new(DirtyState {
                seq,
                ..Default::default()
            }),
        }
    }

    pub(crate) fn record(
        &self,
        entries: Vec<SumEntry>,
        seq: u64,
        watermark_ms: i64,
        source_ms: Option<i64>,
    ) {
        let mut state = self.inner.lock().expect("dirty lock");
        for entry in entries {
            state
                .entries
                .insert((entry.limit.clone(), entry.bucket), entry);
        }
        state.seq = seq;
        state.watermark_ms = watermark_ms;
        state.source_ms = match (state.source_ms, source_ms) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }

    /// Take the changed entries; the position stays.
    pub fn take(&self) -> (Vec<SumEntry>, u64, i64, Option<i64>) {
        let mut state = self.inner.lock().expect("dirty lock");
        let entries = std::mem::take(&mut state.entries).into_values().collect();
        (
            entries,
            state.seq,
            state.watermark_ms,
            state.source_ms.take(),
        )
    }

    /// The consumer is idle and caught up through `seq`: once the writer
    /// has applied that far, the sums are complete as of `now_ms`. A stuck
    /// writer never gets there, so its watermark stops and the pacer sees
    /// the shard fall behind.
    pub(crate) fn caught_up(&self, seq: u64, now_ms: i64) {
        let mut state = self.inner.lock().expect("dirty lock");
        if state.seq >= seq {
            state.watermark_ms = state.watermark_ms.max(now_ms);
        }
    }

    pub(crate) fn position(&self) -> (u64, i64) {
        let state = self.inner.lock().expect("dirty lock");
        (state.seq, state.watermark_ms)
    }
}

/// A checkpoint request: (request number, sequence of the marker).
pub type CheckpointRequest = (u64, u64);
