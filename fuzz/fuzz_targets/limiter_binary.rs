//! The binary batch reader (wire/src/batch/binary.rs, which the limiter runs
//! on every input message that begins with its magic) and its encoder, two
//! readings of each input.
//!
//! - Raw: the bytes, after the magic and version 1 (or as they are, when the
//!   first byte is odd: other versions, NDJSON), read entry by entry.
//!   Reading is deterministic; the entries lie in order inside the message;
//!   an accepted entry respects the contract (ids 1..=64 bytes, `ts` in
//!   range) and, re-encoded, reads back the same; every rejection says why;
//!   the rejected entries get one dead letter each up to the cap and one
//!   summary past it, each small whatever its entry.
//! - Structured: the bytes choose impressions (ids of 0..=70 bytes, any
//!   cost and `ts`, a lease or none), written with `BinaryBatch`: each
//!   reads back as the NDJSON line of the same impression parses, the same
//!   fields or the same reason.
#![no_main]

use adspend_wire::batch::binary::{BinaryBatch, MAGIC, VERSION};
use adspend_wire::batch::{entries, Entry};
use adspend_wire::dead_letter::{self, DeadLetter, Overflow};
use adspend_wire::impression::{parse_line, Impression, Rejection, MAX_TS_MS};
use adspend_wire::types::MAX_ID_LEN;
use arbitrary::Unstructured;
use libfuzzer_sys::fuzz_target;

type Read = Result<(String, String, u64, i64, Option<String>), &'static str>;

fn read(parsed: &Result<Impression<'_>, Rejection>) -> Read {
    match parsed {
        Ok(i) => Ok((
            i.id.to_string(),
            i.ad_id.to_string(),
            i.cost_micros,
            i.ts_ms,
            i.lease_id.as_deref().filter(|l| !l.is_empty()).map(str::to_string),
        )),
        Err(r) => Err(r.reason.as_str()),
    }
}

fn raw(payload: &[u8]) {
    let first: Vec<Entry<'_>> = entries(payload).collect();
    let again: Vec<Entry<'_>> = entries(payload).collect();
    assert_eq!(first.len(), again.len(), "deterministic");
    let mut letters = Vec::new();
    let mut overflow = Overflow::default();
    let mut rejected = 0u64;
    let mut last_no = None;
    for (entry, same) in first.iter().zip(&again) {
        assert_eq!(read(&entry.parsed), read(&same.parsed), "deterministic");
        assert!(last_no.is_none_or(|n| entry.no > n), "entries in order");
        last_no = Some(entry.no);
        let start = entry.bytes.as_ptr() as usize - payload.as_ptr() as usize;
        assert!(start + entry.bytes.len() <= payload.len(), "inside the message");
        match &entry.parsed {
            Ok(i) => {
                assert!((1..=MAX_ID_LEN).contains(&i.id.len()), "id {}", i.id.len());
                assert!((1..=MAX_ID_LEN).contains(&i.ad_id.len()));
                assert!((0..=MAX_TS_MS).contains(&i.ts_ms), "ts {}", i.ts_ms);
                let mut batch = BinaryBatch::new();
                batch.push(&i.id, &i.ad_id, i.cost_micros, i.ts_ms, i.lease_id.as_deref());
                let reread: Vec<Read> = entries(batch.as_bytes()).map(|e| read(&e.parsed)).collect();
                assert_eq!(reread, vec![read(&entry.parsed)], "re-encoded");
            }
            Err(r) => {
                assert!(!r.detail.is_empty(), "a rejection says why");
                rejected += 1;
                let reason = r.reason.as_str();
                if overflow.admit(entry.no, reason) {
                    letters.push(DeadLetter::new(reason, r.detail.clone(), entry.bytes, 7, entry.no));
                }
            }
        }
    }
    letters.extend(overflow.finish(7));
    let per_message = u64::from(dead_letter::PER_MESSAGE);
    let expected = rejected.min(per_message) + u64::from(rejected > per_message);
    assert_eq!(letters.len() as u64, expected, "dead letters");
    for letter in &letters {
        let json = serde_json::to_vec(letter).expect("a dead letter serializes");
        assert!(json.len() < 40_000, "a dead letter of {} bytes", json.len());
        assert!(letter.line.len() <= dead_letter::LINE_BYTES);
    }
}

#[derive(Debug)]
struct Event {
    id: String,
    ad_id: String,
    cost: u64,
    ts: i64,
    lease: Option<String>,
}

fn structured(data: &[u8]) {
    let mut u = Unstructured::new(data);
    let mut events = Vec::new();
    while !u.is_empty() && events.len() < 64 {
        let event = (|| -> arbitrary::Result<Event> {
            Ok(Event {
                id: u.arbitrary()?,
                ad_id: u.arbitrary()?,
                cost: u.arbitrary()?,
                ts: u.arbitrary()?,
                lease: u.arbitrary()?,
            })
        })();
        match event {
            Ok(event) => events.push(event),
            Err(_) => break,
        }
    }
    let mut batch = BinaryBatch::new();
    for e in &events {
        batch.push(&e.id, &e.ad_id, e.cost, e.ts, e.lease.as_deref());
    }
    let got: Vec<Read> = entries(batch.as_bytes()).map(|e| read(&e.parsed)).collect();
    assert_eq!(got.len(), events.len(), "one entry an impression");
    for (e, got) in events.iter().zip(got) {
        let mut line = serde_json::json!({"id": e.id, "ad_id": e.ad_id, "cost_micros": e.cost, "ts": e.ts});
        if let Some(lease) = &e.lease {
            line["lease_id"] = lease.clone().into();
        }
        let line = serde_json::to_vec(&line).expect("serializes");
        assert_eq!(got, read(&parse_line(&line)), "binary and NDJSON disagree on {e:?}");
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    match mode % 3 {
        0 => {
            let mut payload = MAGIC.to_vec();
            payload.push(VERSION);
            payload.extend_from_slice(rest);
            raw(&payload);
        }
        1 => raw(rest),
        _ => structured(rest),
    }
});
