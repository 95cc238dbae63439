//! The push decoder (wire/src/codec.rs `decode_push`, over `decode_sums`):
//! what the pacer runs on every message of `sums.>` before folding it into
//! its spend state.
//!
//! Raw: the bytes are one push; whatever decodes respects the contract
//! (limit ids 1..=64 bytes) and carries stamps an aggregator can send (times
//! not negative, a `push_seq` with a successor), and re-encodes to at most
//! as many bytes and decodes back to itself. Structured: the bytes choose a
//! sequence of pushes over a few shards and limits, each encoded and decoded
//! as the pacer receives it: refused exactly when not acceptable, else equal
//! to what was sent.
//!
//! What folding pushes does to the pacer's state (never going backwards, a
//! repeated push changing no sum) is the pacer's own code:
//! pacer/src/pacing/state/tests.rs checks it with proptest.
#![no_main]

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
    }

    let mut u = Unstructured::new(data);
    while !u.is_empty() {
        let Ok(update) = arb_update(&mut u) else {
            break;
        };
        let bytes = encode_sums(&update);
        match decode_push(&bytes) {
            Ok(received) => {
                assert!(acceptable(&update), "accepted {update:?}");
                assert_eq!(received, update, "push round trip");
            }
            Err(e) => assert!(!acceptable(&update), "refused {update:?}: {e}"),
        }
    }
});
