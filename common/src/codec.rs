//! The binary wire format: bincode 2 (pinned `=2.0.1`, see the README) with a
//! one-byte format version in front so the format can change without a flag
//! day. Everything that goes over NATS between services passes through here.

use bincode::{Decode, Encode};

use crate::error::Error;
use crate::types::{SpendMessage, SumsUpdate};

/// Version byte of the current format.
pub const FORMAT_V1: u8 = 1;

fn config() -> impl bincode::config::Config {
    bincode::config::standard()
        .with_little_endian()
        .with_variable_int_encoding()
        .with_limit::<{ 64 * 1024 * 1024 }>()
}

fn encode<T: Encode>(value: &T, out: &mut Vec<u8>) {
    out.push(FORMAT_V1);
    // Writing into a Vec cannot fail, and our types have no fallible Encode.
    bincode::encode_into_std_write(value, out, config()).expect("encoding into a Vec");
}

fn decode<T: Decode<()>>(what: &'static str, bytes: &[u8]) -> Result<T, Error> {
    let (&version, body) = bytes.split_first().ok_or(Error::Decode {
        what,
        reason: "empty message".into(),
    })?;
    if version != FORMAT_V1 {
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

pub fn decode_spend(bytes: &[u8]) -> Result<SpendMessage, Error> {
    decode("spend message", bytes)
}

pub fn encode_sums(update: &SumsUpdate) -> Vec<u8> {
    let mut out = Vec::with_capacity(64 + update.entries.len() * 40);
    encode(update, &mut out);
    out
}

pub fn decode_sums(bytes: &[u8]) -> Result<SumsUpdate, Error> {
    decode("sums update", bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CheckpointMarker, MsgId, SpendTuple, SumEntry};
    use proptest::prelude::*;

    fn tuple() -> impl Strategy<Value = SpendTuple> {
        (
            "[a-z0-9-]{1,64}",
            any::<u32>(),
            any::<u64>(),
            any::<[u8; 16]>(),
        )
            .prop_map(|(limit, bucket, cost_micros, id)| SpendTuple {
                limit,
                bucket,
                cost_micros,
                msg_id: MsgId(id),
            })
    }

    fn spend_message() -> impl Strategy<Value = SpendMessage> {
        prop_oneof![
            (any::<i64>(), prop::collection::vec(tuple(), 0..50))
                .prop_map(|(source_ms, tuples)| SpendMessage::Batch { source_ms, tuples }),
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

    proptest! {
        #[test]
        fn spend_roundtrip(message in spend_message()) {
            let bytes = encode_spend(&message);
            prop_assert_eq!(decode_spend(&bytes).unwrap(), message);
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
        fn garbage_never_panics(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = decode_spend(&bytes);
            let _ = decode_sums(&bytes);
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
    fn unknown_version_is_rejected() {
        let mut bytes = encode_spend(&SpendMessage::Batch {
            source_ms: 0,
            tuples: vec![],
        });
        bytes[0] = 9;
        let err = decode_spend(&bytes).unwrap_err().to_string();
        assert!(err.contains("unknown format version 9"), "{err}");
    }
}
