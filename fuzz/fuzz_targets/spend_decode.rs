//! The SPEND message decoder (wire/src/codec.rs `decode_spend`).
//!
//! Two readings of each input. Raw: the bytes are a message; whatever
//! decodes has every tuple's limit index in range and every limit id within
//! the contract's 1..=64 bytes, re-encodes to at most as many bytes (the
//! encoding is canonical and minimal) and decodes back to itself. Structured:
//! the bytes choose a message, which must survive encode → decode unchanged
//! (owned and borrowed encoders agree) when valid and be refused when not.
#![no_main]

use adspend_wire::codec::{decode_spend, encode_spend, encode_spend_ref};
use adspend_wire::types::{
    CheckpointMarker, MsgId, SpendBatch, SpendBatchRef, SpendMessage, SpendMessageRef, SpendTuple,
    MAX_ID_LEN,
};
use arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;

fn valid(message: &SpendMessage) -> bool {
    match message {
        SpendMessage::Marker(_) => true,
        SpendMessage::Batch(b) => {
            b.limits.iter().all(|l| (1..=MAX_ID_LEN).contains(&l.len()))
                && b.tuples.iter().all(|t| (t.limit as usize) < b.limits.len())
        }
    }
}

fn arb_id(u: &mut Unstructured<'_>) -> Result<String> {
    let len = u.int_in_range(0..=MAX_ID_LEN + 3)?;
    let mut id = String::new();
    while id.len() < len {
        let c: char = if u.ratio(7, 8)? {
            char::from(u.int_in_range(b'-'..=b'z')?)
        } else {
            u.arbitrary()?
        };
        id.push(c);
    }
    Ok(id)
}

fn arb_message(u: &mut Unstructured<'_>) -> Result<SpendMessage> {
    if u.ratio(1, 5)? {
        return Ok(SpendMessage::Marker(CheckpointMarker {
            marker_id: u.arbitrary()?,
            partition: u.arbitrary()?,
            emitted_ms: u.arbitrary()?,
        }));
    }
    let n = u.int_in_range(0..=4u32)?;
    let limits = (0..n).map(|_| arb_id(u)).collect::<Result<Vec<_>>>()?;
    let count = u.int_in_range(0..=8)?;
    let mut tuples = Vec::with_capacity(count);
    for _ in 0..count {
        let limit = if n > 0 && u.ratio(15, 16)? {
            u.int_in_range(0..=n - 1)?
        } else {
            u.arbitrary()?
        };
        tuples.push(SpendTuple {
            limit,
            bucket: u.arbitrary()?,
            cost_micros: u.arbitrary()?,
            msg_id: MsgId(u.arbitrary()?),
        });
    }
    Ok(SpendMessage::Batch(SpendBatch {
        source_ms: u.arbitrary()?,
        limits,
        tuples,
    }))
}

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = decode_spend(data) {
        assert!(
            valid(&message),
            "decoded a message the contract forbids: {message:?}"
        );
        if let SpendMessage::Batch(batch) = &message {
            for tuple in &batch.tuples {
                let _ = batch.limit_of(tuple);
            }
        }
        let bytes = encode_spend(&message);
        assert!(bytes.len() <= data.len(), "re-encoding grew the message");
        assert_eq!(
            decode_spend(&bytes).expect("re-encoded message decodes"),
            message
        );
    }

    let mut u = Unstructured::new(data);
    if let Ok(message) = arb_message(&mut u) {
        let bytes = encode_spend(&message);
        let mut borrowed = Vec::new();
        match &message {
            SpendMessage::Batch(b) => {
                let limits: Vec<&str> = b.limits.iter().map(String::as_str).collect();
                encode_spend_ref(
                    &SpendMessageRef::Batch(SpendBatchRef {
                        source_ms: b.source_ms,
                        limits: &limits,
                        tuples: &b.tuples,
                    }),
                    &mut borrowed,
                );
            }
            SpendMessage::Marker(m) => encode_spend_ref(&SpendMessageRef::Marker(m), &mut borrowed),
        }
        assert_eq!(bytes, borrowed, "owned and borrowed encoders disagree");
        match decode_spend(&bytes) {
            Ok(decoded) => {
                assert!(
                    valid(&message),
                    "accepted a message the contract forbids: {message:?}"
                );
                assert_eq!(decoded, message);
            }
            Err(e) => assert!(!valid(&message), "refused a valid message {message:?}: {e}"),
        }
        for cut in [0, 1, bytes.len() / 2, bytes.len().saturating_sub(1)] {
            if cut < bytes.len() {
                assert!(
                    decode_spend(&bytes[..cut]).is_err(),
                    "truncated message decoded"
                );
            }
        }
    }
});
