//! The binary wire format: bincode 2 (pinned `=2.0.1`, see the README) with a
//! one-byte format version in front so the format can change without a flag
//! day. Everything that goes over NATS between services passes through here.

use bincode::{Decode, Encode};

use crate::error::Error;
use crate::types::{SpendMessage, SpendMessageRef, SumsUpdate, MAX_ID_LEN};

/// Version byte of the current format. Version 1 carried each tuple's limit
/// id inline; version 2 carries each batch's limit ids once.
pub const FORMAT_V2: u8 = 2;

fn config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_variable_int_encoding()
        .with_limit::<{ 64 * 1024 * 1024 }>()
}

fn encode<T: Encode>(value: &T, out: &mut Vec<u8>) {
    out.push(FORMAT_V2);
    // Writing into a Vec cannot fail, and our types have no fallible Encode.
    bincode::encode_into_std_write(value, out, config()).expect("encoding into a Vec");
}

fn decode<T: Decode<()>>(what: &'static str, bytes: &[u8]) -> Result<T, Error> {
    let (&version, body) = bytes.split_first().ok_or(Error::Decode {
        what,
        reason: "empty message".into(),
    })?;
    if version != FORMAT_V2 {
        return Err(Error::Decode {
            what,
            reason: format!("unknown format version {version}"),
        });
    }
    let (value, used) = bincode::decode_from_slice(body, config()).map_err(|e| Error::Decode {
        what,
        reason: e.to_string(),
    })?;
    if used != body.len() {
        return Err(Error::Decode {
            what,
            reason: format!("{} trailing bytes", body.len() - used),
        });
    }
    Ok(value)
}

pub fn encode_spend(message: &SpendMessage) -> Vec<u8> {
    let mut out = Vec::with_capacity(256);
    encode(message, &mut out);
    out
}

/// [`encode_spend`] of borrowed parts, into `out` (cleared first).
pub fn encode_spend_ref(message: &SpendMessageRef<'_>, out: &mut Vec<u8>) {
    out.clear();
    encode(message, out);
}

/// A limit id the contract allows (1..=64 bytes). The aggregator's LMDB keys
/// carry the id's length in one byte, so a longer id would corrupt them.
fn check_limit_id(what: &'static str, id: &str) -> Result<(), Error> {
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(Error::Decode {
            what,
            reason: format!("limit id of {} bytes, not 1..={MAX_ID_LEN}", id.len()),
        });
    }
    Ok(())
}

/// Decodes a message and checks that every limit id is one the contract
/// allows and every tuple's limit index is in range.
pub fn decode_spend(bytes: &[u8]) -> Result<SpendMessage, Error> {
    let message: SpendMessage = decode("spend message", bytes)?;
    if let SpendMessage::Batch(batch) = &message {
        for id in &batch.limits {
            check_limit_id("spend message", id)?;
        }
        let limits = batch.limits.len();
        if let Some(bad) = batch.tuples.iter().find(|t| t.limit as usize >= limits) {
            return Err(Error::Decode {
                what: "spend message",
                reason: format!("tuple refers to limit #{} of {limits}", bad.limit),
            });
        }
    }
    Ok(message)
}

pub fn encode_sums(update: &SumsUpdate) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + update.entries.len() * 40);
    encode(update, &mut out);
    out
}

/// Decodes a push and checks that every limit id is one the contract allows.
pub fn decode_sums(bytes: &[u8]) -> Result<SumsUpdate, Error> {
    let update: SumsUpdate = decode("sums update", bytes)?;
    for entry in &update.entries {
        check_limit_id("sums update", &entry.limit)?;
    }
    Ok(update)
}

/// [`decode_sums`] for the pacer: also refuses stamps no aggregator sends.
/// Times are unix ms, never negative (the pacer subtracts them from now),
/// and a `push_seq` must have a successor for the pacer's gap check.
pub fn decode_push(bytes: &[u8]) -> Result<SumsUpdate, Error> {
    let update = decode_sums(bytes)?;
    let refuse = |reason: String| Error::Decode {
        what: "sums update",
        reason,
    };
    if update.watermark_ms < 0 || update.source_ms < 0 {
        return Err(refuse(format!(
            "negative time: watermark_ms {}, source_ms {}",
            update.watermark_ms, update.source_ms
        )));
    }
    if update.push_seq == u64::MAX {
        return Err(refuse(format!("push_seq {} has no successor", u64::MAX)));
    }
    Ok(update)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CheckpointMarker, MsgId, SpendBatch, SpendBatchRef, SpendTuple, SumEntry};
    use proptest::prelude::*;

    fn batch() -> impl Strategy<Value = SpendBatch> {
        (
            any::<i64>(),
            prop::collection::vec("[a-z0-9-]{1,64}", 1..8),
            prop::collection::vec(
                (any::<u32>(), any::<u32>(), any::<u64>(), any::<[u8; 16]>()),
                0..50,
            ),
        )
            .prop_map(|(source_ms, limits, tuples)| {
                let n = limits.len() as u32;
                let tuples = tuples
                    .into_iter()
                    .map(|(limit, bucket, cost_micros, id)| SpendTuple {
                        limit: limit % n,
                        bucket,
                        cost_micros,
                        msg_id: MsgId(id),
                    })
                    .collect();
                SpendBatch {
                    source_ms,
                    limits,
                    tuples,
                }
            })
    }

    fn spend_message() -> impl Strategy<Value = SpendMessage> {
        prop_oneof![
            batch().prop_map(SpendMessage::Batch),
            (any::<u64>(), any::<u32>(), any::<i64>()).prop_map(
                |(marker_id, partition, emitted_ms)| {
                    SpendMessage::Marker(CheckpointMarker {
                        marker_id,
                        partition,
                        emitted_ms,
                    })
                }
            ),
        ]
    }

    /// Bytes are either refused with a decode error, or decode to a message
    /// the contract allows whose encoding is those very bytes (so nothing
    /// the decoder accepts can be read two ways).
    fn judge_spend(bytes: &[u8]) -> Result<(), TestCaseError> {
        match decode_spend(bytes) {
            Ok(message) => {
                if let SpendMessage::Batch(batch) = &message {
                    let n = batch.limits.len();
                    prop_assert!(batch
                        .limits
                        .iter()
                        .all(|l| (1..=MAX_ID_LEN).contains(&l.len())));
                    prop_assert!(batch.tuples.iter().all(|t| (t.limit as usize) < n));
                }
                prop_assert_eq!(encode_spend(&message), bytes);
            }
            Err(e) => prop_assert!(
                matches!(
                    e,
                    Error::Decode {
                        what: "spend message",
                        ..
                    }
                ),
                "{:?}",
                e
            ),
        }
        Ok(())
    }

    /// [`judge_spend`] for pushes.
    fn judge_sums(bytes: &[u8]) -> Result<(), TestCaseError> {
        match decode_sums(bytes) {
            Ok(update) => {
                prop_assert!(update
                    .entries
                    .iter()
                    .all(|e| (1..=MAX_ID_LEN).contains(&e.limit.len())));
                prop_assert_eq!(encode_sums(&update), bytes);
            }
            Err(e) => prop_assert!(
                matches!(
                    e,
                    Error::Decode {
                        what: "sums update",
                        ..
                    }
                ),
                "{:?}",
                e
            ),
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn spend_roundtrip(message in spend_message()) {
            let bytes = encode_spend(&message);
            prop_assert_eq!(decode_spend(&bytes).unwrap(), message);
        }

        #[test]
        fn borrowed_batches_encode_to_the_same_bytes(batch in batch()) {
            let limits: Vec<&str> = batch.limits.iter().map(String::as_str).collect();
            let mut out = Vec::new();
            encode_spend_ref(
                &SpendMessageRef::Batch(SpendBatchRef {
                    source_ms: batch.source_ms,
                    limits: &limits,
                    tuples: &batch.tuples,
                }),
                &mut out,
            );
            prop_assert_eq!(&out, &encode_spend(&SpendMessage::Batch(batch)));
        }

        #[test]
        fn spend_truncated_is_an_error_not_a_panic(message in spend_message(), cut in 0usize..64) {
            let bytes = encode_spend(&message);
            let cut = cut.min(bytes.len());
            if cut < bytes.len() {
                prop_assert!(decode_spend(&bytes[..cut]).is_err());
            }
        }

        #[test]
        fn garbage_is_refused_unless_it_is_an_encoding(
            versioned in any::<bool>(),
            body in prop::collection::vec(any::<u8>(), 0..256),
        ) {
            let mut bytes = body;
            if versioned {
                bytes.insert(0, FORMAT_V2);
            }
            judge_spend(&bytes)?;
            judge_sums(&bytes)?;
        }

        #[test]
        fn a_changed_byte_is_refused_or_still_an_encoding(
            message in spend_message(),
            at in any::<prop::sample::Index>(),
            bit in 0u8..8,
        ) {
            let mut bytes = encode_spend(&message);
            let at = at.index(bytes.len());
            bytes[at] ^= 1 << bit;
            if at == 0 {
                let refused = decode_spend(&bytes);
                prop_assert!(
                    matches!(&refused, Err(Error::Decode { reason, .. }) if reason.contains("unknown format version")),
                    "{:?}", refused
                );
            }
            judge_spend(&bytes)?;
        }

        #[test]
        fn sums_roundtrip(
            epoch in any::<u64>(), seq in any::<u64>(), push_seq in any::<u64>(), full in any::<bool>(),
            entries in prop::collection::vec(("[a-z0-9]{1,64}", any::<u32>(), any::<u64>(), any::<u64>(), any::<u64>()), 0..20),
        ) {
            let update = SumsUpdate {
                shard: "all".into(), epoch, seq, push_seq, full, watermark_ms: 1, source_ms: 2,
                entries: entries.into_iter().map(|(limit, bucket, bucket_micros, lifetime_micros, lifetime_events)| SumEntry {
                    limit, bucket, bucket_micros, lifetime_micros, lifetime_events,
                }).collect(),
            };
            prop_assert_eq!(decode_sums(&encode_sums(&update)).unwrap(), update);
        }
    }

    #[test]
    fn a_limit_index_out_of_range_is_rejected() {
        let bytes = encode_spend(&SpendMessage::Batch(SpendBatch {
            source_ms: 0,
            limits: vec!["a".into()],
            tuples: vec![SpendTuple {
                limit: 1,
                bucket: 0,
                cost_micros: 1,
                msg_id: MsgId([0; 16]),
            }],
        }));
        let err = decode_spend(&bytes).unwrap_err().to_string();
        assert!(err.contains("limit #1 of 1"), "{err}");
    }

    /// Found by fuzzing (fuzz target spend_decode): batches whose limit ids
    /// were empty or longer than the contract's 64 bytes decoded.
    #[test]
    fn limit_ids_outside_the_contract_are_rejected() {
        for id in [String::new(), "x".repeat(MAX_ID_LEN + 1), "x".repeat(300)] {
            let bytes = encode_spend(&SpendMessage::Batch(SpendBatch {
                source_ms: 0,
                limits: vec!["ok".into(), id.clone()],
                tuples: vec![],
            }));
            let err = decode_spend(&bytes).unwrap_err().to_string();
            assert!(
                err.contains(&format!("limit id of {} bytes", id.len())),
                "{err}"
            );
            let update = SumsUpdate {
                shard: "all".into(),
                epoch: 1,
                seq: 1,
                push_seq: 1,
                full: false,
                watermark_ms: 1,
                source_ms: 1,
                entries: vec![SumEntry {
                    limit: id.clone(),
                    bucket: 0,
                    bucket_micros: 1,
                    lifetime_micros: 1,
                    lifetime_events: 1,
                }],
            };
            let err = decode_sums(&encode_sums(&update)).unwrap_err().to_string();
            assert!(err.contains("sums update"), "{err}");
        }
        let longest = "x".repeat(MAX_ID_LEN);
        let message = SpendMessage::Batch(SpendBatch {
            source_ms: 0,
            limits: vec![longest],
            tuples: vec![],
        });
        assert_eq!(decode_spend(&encode_spend(&message)).unwrap(), message);
    }

    fn push(push_seq: u64, watermark_ms: i64, source_ms: i64) -> SumsUpdate {
        SumsUpdate {
            shard: "all".into(),
            epoch: 1,
            seq: 1,
            push_seq,
            full: false,
            watermark_ms,
            source_ms,
            entries: vec![SumEntry {
                limit: "a".into(),
                bucket: 1,
                bucket_micros: 5,
                lifetime_micros: 5,
                lifetime_events: 1,
            }],
        }
    }

    /// Found by fuzzing (fuzz target pacer_push): a push_seq of u64::MAX
    /// followed by another push of the same epoch overflowed the pacer's
    /// gap check, and a source_ms of i64::MIN its freshness arithmetic.
    #[test]
    fn stamps_no_aggregator_sends_are_refused() {
        for (bad, what) in [
            (push(u64::MAX, 1, 1), "no successor"),
            (push(1, i64::MIN, 1), "negative time"),
            (push(1, 1, i64::MIN), "negative time"),
            (push(1, -1, 0), "negative time"),
        ] {
            let bytes = encode_sums(&bad);
            assert_eq!(decode_sums(&bytes).unwrap(), bad, "a valid encoding");
            let err = decode_push(&bytes).unwrap_err().to_string();
            assert!(err.contains("cannot decode sums update"), "{err}");
            assert!(err.contains(what), "{err}");
        }
        for good in [
            push(u64::MAX - 1, 0, 0),
            push(u64::MAX - 1, i64::MAX, i64::MAX),
        ] {
            assert_eq!(decode_push(&encode_sums(&good)).unwrap(), good);
        }
    }

    #[test]
    fn unknown_version_is_rejected() {
        let mut bytes = encode_spend(&SpendMessage::Batch(SpendBatch {
            source_ms: 0,
            limits: vec![],
            tuples: vec![],
        }));
        bytes[0] = 9;
        let err = decode_spend(&bytes).unwrap_err().to_string();
        assert!(err.contains("unknown format version 9"), "{err}");
    }
}
