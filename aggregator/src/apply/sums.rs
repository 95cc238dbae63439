//! Writing a group's additions inside its write transaction: the dedupe log
//! entry of its new ids, then the lifetime and bucket sums, each in key
//! order.

use adspend_wire::types::{SumEntry, LIFETIME_BUCKET};
use heed::RwTxn;
use rustc_hash::FxHashMap;

use super::accumulate::Pass;
use super::{checked, Writer};
use crate::error::Error;
use crate::store::{lifetime_value, log_key, parse_lifetime, sum_key};

/// (limit, bucket, micros to add) of one period bucket.
type BucketDelta<'a> = (&'a str, u32, u64);

/// Per limit: (lifetime micros, lifetime events) after the group.
type Lifetimes<'g> = FxHashMap<&'g str, (u64, u64)>;

impl Writer {
    /// Store the group's new ids as one dedupe log entry, keyed by the
    /// group's stream time and first sequence; returns its key.
    pub(super) fn log_new_ids(
        &self,
        wtxn: &mut RwTxn<'_>,
        pass: &Pass<'_>,
    ) -> Result<Option<[u8; 16]>, Error> {
        let store = &self.store;
        match (pass.first_applied, self.new_ids.is_empty()) {
            (Some(first), false) => {
                let key = log_key(pass.clock_ms, first);
                store
                    .dedupe_log
                    .put(wtxn, &key, &self.new_ids)
                    .map_err(store.err("put dedupe log"))?;
                Ok(Some(key))
            }
            _ => Ok(None),
        }
    }

    /// Add the group's sums to the stored ones, lifetime sums first (the
    /// bucket entries carry them); returns every sum that changed.
    pub(super) fn write_sums<'g>(
        &self,
        wtxn: &mut RwTxn<'_>,
        pass: &mut Pass<'g>,
    ) -> Result<Vec<SumEntry>, Error> {
        let lifetime_deltas = std::mem::take(&mut pass.lifetime_deltas);
        let bucket_deltas = std::mem::take(&mut pass.bucket_deltas);
        let mut changed = Vec::with_capacity(lifetime_deltas.len() + bucket_deltas.len());
        let lifetimes = self.write_lifetimes(wtxn, lifetime_deltas, &mut changed)?;
        self.write_buckets(wtxn, bucket_deltas, &lifetimes, &mut changed)?;
        Ok(changed)
    }

    fn write_lifetimes<'g>(
        &self,
        wtxn: &mut RwTxn<'_>,
        deltas: FxHashMap<&'g str, (u64, u64)>,
        changed: &mut Vec<SumEntry>,
    ) -> Result<Lifetimes<'g>, Error> {
        let store = &self.store;
        let mut new_lifetimes: Lifetimes<'g> = FxHashMap::default();
        new_lifetimes.reserve(deltas.len());
        // In key order, as `update_sorted` wants.
        let mut deltas: Vec<(&str, (u64, u64))> = deltas.into_iter().collect();
        deltas.sort_unstable_by_key(|(limit, _)| *limit);
        store.update_sorted(
            wtxn,
            store.lifetime.remap_types(),
            &deltas,
            |current, limit, (delta, tuples)| {
                let (micros, events) = match current {
                    None => (0, 0),
                    Some(value) => parse_lifetime(value).ok_or_else(|| {
                        store.corrupt(format!("the lifetime sum of {limit}"), value)
                    })?,
                };
                let total = checked(micros, *delta, limit, LIFETIME_BUCKET)?;
                let events = events + tuples;
                new_lifetimes.insert(limit, (total, events));
                changed.push(SumEntry {
                    limit: limit.to_string(),
                    bucket: LIFETIME_BUCKET,
                    bucket_micros: total,
                    lifetime_micros: total,
                    lifetime_events: events,
                });
                Ok(lifetime_value(total, events))
            },
        )?;
        Ok(new_lifetimes)
    }

    fn write_buckets(
        &self,
        wtxn: &mut RwTxn<'_>,
        deltas: FxHashMap<(&str, u32), u64>,
        lifetimes: &Lifetimes<'_>,
        changed: &mut Vec<SumEntry>,
    ) -> Result<(), Error> {
        let store = &self.store;
        let mut deltas: Vec<(Vec<u8>, BucketDelta)> = deltas
            .into_iter()
            .map(|((limit, bucket), delta)| (sum_key(limit, bucket), (limit, bucket, delta)))
            .collect();
        deltas.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        store.update_sorted(
            wtxn,
            store.sums.remap_types(),
            &deltas,
            |current, _, (limit, bucket, delta)| {
                let micros = current
                    .and_then(|v| v.try_into().ok())
                    .map_or(0, u64::from_be_bytes);
                let total = checked(micros, *delta, limit, *bucket)?;
                let (lifetime_micros, lifetime_events) = lifetimes[limit];
                changed.push(SumEntry {
                    limit: limit.to_string(),
                    bucket: *bucket,
                    bucket_micros: total,
                    lifetime_micros,
                    lifetime_events,
                });
                Ok(total.to_be_bytes())
            },
        )
    }
}
