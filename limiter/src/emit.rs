//! From input messages to output: spend tuples grouped by partition, and
//! dead letters. Pure (no I/O), so that what the limiter emits for a given
//! input and catalog is decided here and tested here.

use std::sync::Arc;

use adspend_wire::batch::entries;
use adspend_wire::catalog::Catalog;
use adspend_wire::codec::encode_spend_ref;
use adspend_wire::dead_letter::{DeadLetter, Overflow};
use adspend_wire::impression::{Reason, Rejection};
use adspend_wire::lease::lease_key;
use adspend_wire::types::{
    Micros, MsgId, SpendBatchRef, SpendMessageRef, SpendTuple, LIFETIME_BUCKET,
};
use rustc_hash::FxHashMap;

/// Default ceiling of one impression's cost (one million currency units):
/// far above any real impression, far below what could overflow a sum.
pub(crate) const DEFAULT_MAX_COST_MICROS: Micros = 1_000_000_000_000;

/// An input message: its bytes and where it sits in `IMPRESSIONS`.
pub(crate) struct Input<'a> {
    pub(crate) stream_seq: u64,
    pub(crate) payload: &'a [u8],
}

/// The spend of one partition: tuples whose `limit` indexes `limits`.
#[derive(Default, Debug)]
pub(crate) struct PartitionOut {
    pub(crate) limits: Vec<Arc<str>>,
    pub(crate) tuples: Vec<SpendTuple>,
}

impl PartitionOut {
    #[cfg(test)]
    pub(crate) fn limit_of(&self, tuple: &SpendTuple) -> &str {
        &self.limits[tuple.limit as usize]
    }

    /// Encoded `SPEND` messages of at most `per_message` tuples each, with
    /// the number of tuples in each; each carries only the limit ids its
    /// tuples use.
    pub(crate) fn encode(&self, per_message: usize, source_ms: i64) -> Vec<(Vec<u8>, usize)> {
        let mut local = vec![u32::MAX; self.limits.len()];
        let mut names: Vec<&str> = Vec::new();
        let mut tuples: Vec<SpendTuple> = Vec::with_capacity(per_message.min(self.tuples.len()));
        let mut messages = Vec::new();
        for chunk in self.tuples.chunks(per_message.max(1)) {
            names.clear();
            tuples.clear();
            for tuple in chunk {
                let global = tuple.limit as usize;
                if local[global] == u32::MAX {
                    local[global] = names.len() as u32;
                    names.push(&self.limits[global]);
                }
                tuples.push(SpendTuple {
                    limit: local[global],
                    ..*tuple
                });
            }
            let mut payload = Vec::with_capacity(64 + tuples.len() * 32 + names.len() * 24);
            encode_spend_ref(
                &SpendMessageRef::Batch(SpendBatchRef {
                    source_ms,
                    limits: &names,
                    tuples: &tuples,
                }),
                &mut payload,
            );
            messages.push((payload, chunk.len()));
            for tuple in chunk {
                local[tuple.limit as usize] = u32::MAX;
            }
        }
        messages
    }
}

#[derive(Default)]
pub struct Output {
    /// Indexed by partition.
    pub(crate) partitions: Vec<PartitionOut>,
    /// The spend booked to spend leases' keys, indexed by partition: kept
    /// apart, to be published after the rest of the chunk is stored
    /// (`crate::chunk`), so that a lease's reported spend never reaches
    /// the aggregators before the same impressions' spend on its limits.
    pub(crate) leases: Vec<PartitionOut>,
    pub(crate) dead_letters: Vec<DeadLetter>,
    pub impressions: u64,
    pub(crate) rejected: Vec<(Reason, u64)>,
    /// Catalog limit (by address: one catalog serves a whole chunk, and the
    /// partitions' `limits` keep every id alive) → its partition and its
    /// index there. One lookup per tuple instead of hashing the id's text
    /// for its partition and then looking it up in that partition (the
    /// hash was 7% of the limiter's time in the end-to-end profile).
    slots: FxHashMap<usize, (u32, u32)>,
    /// The same for the keys of spend leases (by their text: each lease's
    /// key is made here, not taken from the catalog).
    lease_slots: FxHashMap<Box<str>, (u32, u32)>,
    /// Impressions costing more go to the dead letters (`cost_too_large`).
    pub(crate) max_cost_micros: u64,
    /// Earliest `ts` (unix ms) of the impressions mapped to spend; `None`
    /// with none (every line dead-lettered, or no line at all).
    pub(crate) oldest_ts_ms: Option<i64>,
}

/// When the spend of a chunk began, for the pacer's lag (`source_ms` of its
/// spend messages): the earlier of its oldest JetStream publish time and its
/// oldest impression `ts`. Spend held back before the stream (an ad server
/// buffering, a slow path to NATS, a backlog replayed) has an old `ts` and a
/// recent publish time, so only the `ts` shows it as lag; a replay of events
/// days old legitimately shows days of lag. The publish time bounds it the
/// other way: a `ts` ahead of the publish time (an ad server's clock running
/// fast) cannot make the lag negative or hide the time the chunk spent in
/// the stream.
pub(crate) fn chunk_source_ms(oldest_published_ms: i64, oldest_ts_ms: Option<i64>) -> i64 {
    oldest_ts_ms.map_or(oldest_published_ms, |ts| ts.min(oldest_published_ms))
}

pub fn partition_of(limit: &str, partitions: u32) -> u32 {
    (xxhash_rust::xxh3::xxh3_64(limit.as_bytes()) % u64::from(partitions)) as u32
}

impl Output {
    pub(crate) fn new(partitions: u32) -> Self {
        Output {
            partitions: (0..partitions).map(|_| PartitionOut::default()).collect(),
            leases: (0..partitions).map(|_| PartitionOut::default()).collect(),
            max_cost_micros: DEFAULT_MAX_COST_MICROS,
            ..Default::default()
        }
    }

    pub(crate) fn with_max_cost(mut self, max_cost_micros: u64) -> Self {
        self.max_cost_micros = max_cost_micros;
        self
    }

    /// Where `limit`'s tuples go: its partition and its index in that
    /// partition's `limits`.
    fn slot_of(&mut self, limit: &Arc<str>) -> (u32, u32) {
        let partitions = &mut self.partitions;
        *self
            .slots
            .entry(Arc::as_ptr(limit).cast::<u8>() as usize)
            .or_insert_with(|| {
                let partition = partition_of(limit, partitions.len() as u32);
                let out = &mut partitions[partition as usize];
                out.limits.push(limit.clone());
                (partition, out.limits.len() as u32 - 1)
            })
    }

    pub(crate) fn tuples(&self) -> usize {
        self.partitions
            .iter()
            .chain(&self.leases)
            .map(|p| p.tuples.len())
            .sum()
    }

    /// The impression was served under the spend lease `lease_id`: its cost
    /// is booked once more, to the lease's key, so the pacer learns the
    /// spend reported under the lease as exactly as any limit's. An id that
    /// is not a lease id of ours books nothing more.
    fn add_lease_spend(&mut self, lease_id: &str, impression_id: &str, cost_micros: Micros) {
        let Some(key) = lease_key(lease_id) else {
            return;
        };
        let (partition, index) = match self.lease_slots.get(key.as_str()) {
            Some(slot) => *slot,
            None => {
                let partition = partition_of(&key, self.leases.len() as u32);
                let out = &mut self.leases[partition as usize];
                out.limits.push(Arc::from(key.as_str()));
                let slot = (partition, out.limits.len() as u32 - 1);
                self.lease_slots.insert(key.clone().into_boxed_str(), slot);
                slot
            }
        };
        self.leases[partition as usize].tuples.push(SpendTuple {
            limit: index,
            bucket: LIFETIME_BUCKET,
            cost_micros,
            msg_id: MsgId::derive(&key, impression_id),
        });
    }

    fn count_rejection(&mut self, reason: Reason) {
        match self.rejected.iter_mut().find(|(r, _)| *r == reason) {
            Some((_, n)) => *n += 1,
            None => self.rejected.push((reason, 1)),
        }
    }

    /// Split one input message into its entries (NDJSON lines or binary
    /// entries: `adspend_wire::batch`) and map each.
    pub(crate) fn add(&mut self, input: &Input<'_>, catalog: &Catalog) {
        let mut overflow = Overflow::default();
        for entry in entries(input.payload) {
            let rejection = match entry.parsed {
                Ok(impression) if impression.cost_micros > self.max_cost_micros => Rejection {
                    reason: Reason::CostTooLarge,
                    detail: format!(
                        "cost_micros {} is above the ceiling {} (ADSPEND_MAX_COST_MICROS)",
                        impression.cost_micros, self.max_cost_micros
                    ),
                },
                Ok(impression) => match catalog.limits_of_ad(&impression.ad_id) {
                    Some(limits) => {
                        self.impressions += 1;
                        self.oldest_ts_ms = Some(
                            self.oldest_ts_ms
                                .map_or(impression.ts_ms, |t| t.min(impression.ts_ms)),
                        );
                        for limit in limits {
                            let (partition, index) = self.slot_of(&limit.id);
                            let tuple = SpendTuple {
                                limit: index,
                                bucket: limit.bucket_of(impression.ts_ms),
                                cost_micros: impression.cost_micros,
                                msg_id: MsgId::derive(&limit.id, &impression.id),
                            };
                            self.partitions[partition as usize].tuples.push(tuple);
                        }
                        if let Some(lease) = impression.lease_id.as_deref() {
                            self.add_lease_spend(lease, &impression.id, impression.cost_micros);
                        }
                        continue;
                    }
                    None => Rejection {
                        reason: Reason::UnknownAd,
                        detail: format!("ad {:?} is not in the catalog", impression.ad_id),
                    },
                },
                Err(rejection) => rejection,
            };
            self.count_rejection(rejection.reason);
            let reason = rejection.reason.as_str();
            if overflow.admit(entry.no, reason) {
                self.dead_letters.push(DeadLetter::new(
                    reason,
                    rejection.detail,
                    entry.bytes,
                    input.stream_seq,
                    entry.no,
                ));
            }
        }
        self.dead_letters.extend(overflow.finish(input.stream_seq));
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod binary_tests;
