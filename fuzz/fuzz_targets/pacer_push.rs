//! The pacer's push decoder (pacer/src/ingest.rs `decode_push`, over
//! wire/src/codec.rs `decode_sums`): what the pacer runs on every message
//! of `sums.>` before folding it into the spend state.
//!
//! Raw: the bytes are one push; whatever decodes respects the contract
//! (limit ids 1..=64 bytes) and carries stamps an aggregator can send (times
//! not negative, a `push_seq` with a successor), re-encodes to at most as many bytes and decodes
//! back to itself, and folds into an empty state with each limit's lifetime
//! spend the largest the push carries. Structured: the bytes choose a
//! sequence of pushes over a few shards and limits, each encoded and decoded
//! as the pacer receives it (refused exactly when not acceptable); folding them in order never makes a shard's
//! epoch or watermark, or a limit's lifetime spend or a held bucket, go
//! backwards, and applying the same push twice changes no sum.
#![no_main]

use std::collections::HashMap;

use adspend_pacer::state::SpendState;
use adspend_wire::codec::{decode_push, decode_sums, encode_sums};
use adspend_wire::types::{SumEntry, SumsUpdate, LIFETIME_BUCKET, MAX_ID_LEN};
use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

const NOW_MS: i64 = 1_767_225_600_000; // 2026-01-01

/// What a push must satisfy to be folded in (the contract's ids; stamps an
/// aggregator can send).
fn acceptable(update: &SumsUpdate) -> bool {
    update
        .entries
        .iter()
        .all(|e| (1..=MAX_ID_LEN).contains(&e.limit.len()))
        && update.watermark_ms >= 0
        && update.source_ms >= 0
        && update.push_seq < u64::MAX
}

fn check_decoded(update: &SumsUpdate, input: &[u8]) {
    assert!(
        acceptable(update),
        "accepted a push no aggregator sends: {update:?}"
    );
    let bytes = encode_sums(update);
    assert!(bytes.len() <= input.len(), "re-encoding grew the push");
    assert_eq!(
        decode_sums(&bytes).expect("re-encoded push decodes"),
        *update
    );
}

fn lifetimes(state: &SpendState) -> HashMap<String, (u64, Vec<(u32, u64)>)> {
    state
        .limits
        .iter()
        .map(|(k, v)| {
            let buckets = v.buckets.iter().map(|(b, m)| (*b, *m)).collect();
            (k.clone(), (v.lifetime_micros, buckets))
        })
        .collect()
}

fn pick<'a>(u: &mut Unstructured<'_>, from: &[&'a str]) -> Result<&'a str> {
    Ok(from[u.choose_index(from.len())?])
}

/// Mostly small values, so that pushes meet each other; sometimes anything.
fn small_or_any(u: &mut Unstructured<'_>) -> Result<u64> {
    if u.ratio(7, 8)? {
        u.int_in_range(0..=6)
    } else {
        u.arbitrary()
    }
}

fn time(u: &mut Unstructured<'_>) -> Result<i64> {
    if u.ratio(7, 8)? {
        Ok(NOW_MS + u.int_in_range(-60_000..=60_000)?)
    } else {
        u.arbitrary()
    }
}

fn arb_update(u: &mut Unstructured<'_>) -> Result<SumsUpdate> {
    let count = u.int_in_range(0..=4)?;
    let mut entries = Vec::with_capacity(count);
    for _ in 0..count {
        let bucket = if u.ratio(1, 4)? {
            LIFETIME_BUCKET
        } else {
            u.int_in_range(20_000..=20_006)?
        };
        entries.push(SumEntry {
            limit: pick(u, &["a", "b", "c"])?.to_string(),
            bucket,
            bucket_micros: u.arbitrary()?,
            lifetime_micros: u.arbitrary()?,
            lifetime_events: u.arbitrary()?,
        });
    }
    Ok(SumsUpdate {
        shard: pick(u, &["all", "p0", "p1"])?.to_string(),
        epoch: u.int_in_range(0..=3)?,
        seq: small_or_any(u)?,
        push_seq: small_or_any(u)?,
        full: u.arbitrary()?,
        watermark_ms: time(u)?,
        source_ms: time(u)?,
        entries,
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(update) = decode_push(data) {
        check_decoded(&update, data);
        let mut state = SpendState::default();
        state.apply(&update, NOW_MS);
        let mut largest: HashMap<&str, u64> = HashMap::new();
        for e in &update.entries {
            let l = largest.entry(e.limit.as_str()).or_default();
            *l = (*l).max(e.lifetime_micros);
        }
        for (limit, micros) in largest {
            assert_eq!(state.limits[limit].lifetime_micros, micros);
        }
    }

    let mut u = Unstructured::new(data);
    let mut state = SpendState::default();
    let mut now = NOW_MS;
    while !u.is_empty() {
        let Ok(update) = arb_update(&mut u) else {
            break;
        };
        let bytes = encode_sums(&update);
        let received = match decode_push(&bytes) {
            Ok(received) => received,
            Err(e) => {
                assert!(!acceptable(&update), "refused {update:?}: {e}");
                continue;
            }
        };
        assert!(acceptable(&update), "accepted {update:?}");
        assert_eq!(received, update, "push round trip");
        now += u.int_in_range(0..=5_000).unwrap_or(0);
        let before = lifetimes(&state);
        let shards_before: HashMap<String, (u64, i64)> = state
            .shards
            .iter()
            .map(|(k, s)| (k.to_string(), (s.epoch, s.watermark_ms)))
            .collect();
        state.apply(&received, now);
        let after = lifetimes(&state);
        for (limit, (lifetime, buckets)) in &before {
            let (lifetime_now, buckets_now) = &after[limit];
            assert!(
                lifetime_now >= lifetime,
                "lifetime spend of {limit} went backwards"
            );
            for (bucket, micros) in buckets {
                if let Some((_, m)) = buckets_now.iter().find(|(b, _)| b == bucket) {
                    assert!(m >= micros, "bucket {bucket} of {limit} went backwards");
                }
            }
        }
        for (shard, (epoch, watermark)) in &shards_before {
            let s = &state.shards[shard.as_str()];
            assert!(s.epoch >= *epoch, "epoch of {shard} went backwards");
            assert!(
                s.watermark_ms >= *watermark,
                "watermark of {shard} went backwards"
            );
        }
        state.apply(&received, now);
        assert_eq!(
            lifetimes(&state),
            after,
            "applying a push twice changed a sum"
        );
    }
});
