//! The two formats of an input message: the binary one round-trips, agrees
//! with NDJSON on every impression (same fields, same reasons), and breaks
//! into rejected entries, never a panic, whatever its bytes.

use super::binary::{BinaryBatch, HEADER_LEN, MAGIC, VERSION};
use super::*;
use crate::impression::{Reason, MAX_TS_MS};
use proptest::prelude::*;

type Read = Result<(String, String, u64, i64, Option<String>), Reason>;

fn read(entry: &Entry<'_>) -> Read {
    entry
        .parsed
        .as_ref()
        .map(|i| {
            (
                i.id.to_string(),
                i.ad_id.to_string(),
                i.cost_micros,
                i.ts_ms,
                i.lease_id.as_deref().map(str::to_string),
            )
        })
        .map_err(|r| r.reason)
}

fn reasons(payload: &[u8]) -> Vec<(u32, Read)> {
    entries(payload).map(|e| (e.no, read(&e))).collect()
}

fn one(id: &str, ad: &str, cost: u64, ts: i64, lease: Option<&str>) -> Vec<u8> {
    let mut batch = BinaryBatch::new();
    batch.push(id, ad, cost, ts, lease);
    batch.into_bytes()
}

#[test]
fn the_format_is_told_by_the_magic_alone() {
    assert_eq!(Format::of(b"{\"id\":1}"), Format::Ndjson);
    assert_eq!(Format::of(b""), Format::Ndjson);
    assert_eq!(Format::of(&[0xAD, b'I']), Format::Ndjson);
    assert_eq!(Format::of(&MAGIC), Format::Binary(0));
    assert_eq!(Format::of(BinaryBatch::new().as_bytes()), Format::Binary(1));
    // 0xAD without the rest of the magic is an NDJSON payload that is not
    // UTF-8, as before.
    assert_eq!(
        reasons(&[0xAD, b'I', b'X', 1]),
        vec![(0, Err(Reason::InvalidJson))]
    );
}

#[test]
fn a_batch_reads_back_entry_by_entry() {
    let mut batch = BinaryBatch::new();
    assert!(batch.is_empty());
    assert_eq!(entries(batch.as_bytes()).count(), 0, "the header alone");
    batch.push("i-1", "ad-1", 1_500, 1_700_000_000_000, None);
    batch.push("i-2", "ad-2", 0, 0, Some("k.1.0"));
    batch.push("é😀", "ad-3", u64::MAX, MAX_TS_MS, Some(""));
    assert_eq!(batch.len(), 3);
    assert_eq!(
        reasons(batch.as_bytes()),
        vec![
            (
                0,
                Ok(("i-1".into(), "ad-1".into(), 1_500, 1_700_000_000_000, None))
            ),
            (
                1,
                Ok(("i-2".into(), "ad-2".into(), 0, 0, Some("k.1.0".into())))
            ),
            (
                2,
                Ok(("é😀".into(), "ad-3".into(), u64::MAX, MAX_TS_MS, None))
            ),
        ]
    );
    // 1 + (1+3) + (1+4) + 2 + 6 + 1 bytes: under a third of the NDJSON line.
    let line = br#"{"id":"i-1","ad_id":"ad-1","cost_micros":1500,"ts":1700000000000}"#;
    let single = one("i-1", "ad-1", 1_500, 1_700_000_000_000, None);
    assert_eq!(single.len() - HEADER_LEN, 19);
    assert!(3 * (single.len() - HEADER_LEN) < line.len());
    batch.clear();
    assert_eq!(batch.as_bytes(), &[0xAD, b'I', b'B', VERSION]);
}

/// A binary message of one entry whose body is written by hand.
fn entry(body: &[u8]) -> Vec<u8> {
    let mut out = BinaryBatch::new().into_bytes();
    out.push(body.len() as u8);
    out.extend_from_slice(body);
    out
}

fn reason(payload: &[u8]) -> Reason {
    reasons(payload)[0].1.clone().unwrap_err()
}

#[test]
fn every_malformed_entry_has_the_reason_ndjson_gives() {
    let long = "x".repeat(65);
    assert_eq!(reason(&one("", "a", 1, 1, None)), Reason::IdTooLong);
    assert_eq!(reason(&one(&long, "a", 1, 1, None)), Reason::IdTooLong);
    assert_eq!(reason(&one("i", "", 1, 1, None)), Reason::IdTooLong);
    assert_eq!(reason(&one("i", &long, 1, 1, None)), Reason::IdTooLong);
    assert_eq!(reason(&one("i", "a", 1, -1, None)), Reason::InvalidTs);
    assert_eq!(
        reason(&one("i", "a", 1, MAX_TS_MS + 1, None)),
        Reason::InvalidTs
    );
    // What the encoder cannot write.
    let beyond_u64 = [0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x02];
    let with = |cost: &[u8], ts: &[u8], id: &[u8]| {
        let mut body = vec![id.len() as u8];
        body.extend_from_slice(id);
        body.extend_from_slice(&[1, b'a']);
        body.extend_from_slice(cost);
        body.extend_from_slice(ts);
        body.push(0);
        entry(&body)
    };
    assert_eq!(reasons(&with(&[5], &[7], b"i"))[0].1.clone().unwrap().2, 5);
    assert_eq!(reason(&with(&beyond_u64, &[7], b"i")), Reason::InvalidField);
    assert_eq!(reason(&with(&[5], &beyond_u64, b"i")), Reason::InvalidTs);
    assert_eq!(reason(&with(&[5], &[7], b"\xff")), Reason::InvalidField);
    assert_eq!(reason(&with(&[0x80; 11], &[7], b"i")), Reason::InvalidJson);
    assert_eq!(reason(&entry(&[])), Reason::InvalidJson);
    assert_eq!(
        reason(&entry(&[1, b'i', 1, b'a', 5, 7])),
        Reason::InvalidJson
    );
    assert_eq!(
        reason(&entry(&[1, b'i', 1, b'a', 5, 7, 0, 0])),
        Reason::InvalidJson
    );
    assert_eq!(
        reason(&entry(&[9, b'i', 1, b'a', 5, 7, 0])),
        Reason::InvalidJson
    );
    let mut lease = one("i", "a", 1, 1, Some("k"));
    *lease.last_mut().unwrap() = 0xff;
    assert_eq!(reason(&lease), Reason::InvalidField);
}

#[test]
fn a_message_of_an_unknown_version_is_one_rejected_entry() {
    let mut v2 = one("i", "a", 1, 1, None);
    v2[MAGIC.len()] = 2;
    let read: Vec<_> = entries(&v2).collect();
    assert_eq!(read.len(), 1);
    assert_eq!(read[0].bytes, &v2[..]);
    let detail = &read[0].parsed.as_ref().unwrap_err().detail;
    assert!(detail.contains("version 2"), "{detail}");
    assert_eq!(reason(&MAGIC), Reason::InvalidJson);
}

#[test]
fn a_bad_entry_leaves_the_next_one_alone_and_a_bad_length_ends_the_message() {
    let mut batch = BinaryBatch::new();
    batch.push("i-1", "ad-1", 1, 1, None);
    batch.push("", "ad-1", 1, 1, None);
    batch.push("i-3", "ad-1", 3, 3, None);
    let got = reasons(batch.as_bytes());
    assert_eq!(got[1], (1, Err(Reason::IdTooLong)));
    assert_eq!(got[2].1.clone().unwrap().0, "i-3");
    // A zero-length entry is rejected and reading goes on.
    let mut bytes = batch.clone().into_bytes();
    bytes.push(0);
    binary::put_entry(&mut bytes, "i-5", "ad-1", 5, 5, None);
    let got = reasons(&bytes);
    assert_eq!(got[3], (3, Err(Reason::InvalidJson)));
    assert_eq!(got[4].1.clone().unwrap().0, "i-5");
    // A length past the end: the rest of the message is one entry.
    let mut bytes = batch.into_bytes();
    let rest = bytes.len();
    bytes.extend_from_slice(&[40, 1, b'i']);
    let read: Vec<_> = entries(&bytes).collect();
    assert_eq!(read.len(), 4);
    assert_eq!((read[3].no, read[3].bytes), (3, &bytes[rest..]));
    assert_eq!(
        read[3].parsed.as_ref().unwrap_err().reason,
        Reason::InvalidJson
    );
}

#[test]
fn ndjson_entries_are_its_non_blank_lines_numbered_from_0() {
    let payload = b"{\"id\":\"a\",\"ad_id\":\"x\",\"cost_micros\":1,\"ts\":1}\r\n\n  \nnot json";
    let got: Vec<_> = entries(payload).map(|e| (e.no, e.bytes.len())).collect();
    assert_eq!(got, vec![(0, 45), (3, 8)]);
    assert_eq!(reasons(payload)[1].1, Err(Reason::InvalidJson));
}

/// An id of the shape an ad server might send, sometimes out of range.
fn id() -> impl Strategy<Value = String> {
    prop_oneof![
        8 => "[a-zA-Z0-9-]{1,64}",
        1 => "[a-z]{0,70}",
        1 => "\\PC{0,20}",
    ]
}

fn ts() -> impl Strategy<Value = i64> {
    prop_oneof![
        8 => 0..=MAX_TS_MS,
        1 => any::<i64>(),
        1 => MAX_TS_MS - 2..MAX_TS_MS + 2,
    ]
}

proptest! {
    #[test]
    fn binary_and_ndjson_agree_on_every_impression(
        id in id(),
        ad in id(),
        cost in any::<u64>(),
        ts in ts(),
        lease in prop::option::of("[a-z0-9.]{0,20}"),
    ) {
        let binary = one(&id, &ad, cost, ts, lease.as_deref());
        let mut line = serde_json::json!({"id": id, "ad_id": ad, "cost_micros": cost, "ts": ts});
        if let Some(lease) = &lease {
            line["lease_id"] = lease.clone().into();
        }
        let line = line.to_string();
        let from_binary = reasons(&binary);
        let from_ndjson = reasons(line.as_bytes());
        prop_assert_eq!(from_binary.len(), 1);
        // An empty lease_id names no lease in either (lease_key refuses it).
        let no_empty = |r: &Read| {
            r.clone().map(|(i, a, c, t, l)| (i, a, c, t, l.filter(|l| !l.is_empty())))
        };
        prop_assert_eq!(no_empty(&from_binary[0].1), no_empty(&from_ndjson[0].1), "{}", line);
    }

    #[test]
    fn batches_round_trip(
        events in prop::collection::vec(
            (
                "\\PC{1,16}",
                "[a-z0-9-]{1,64}",
                any::<u64>(),
                0..=MAX_TS_MS,
                prop::option::of("[a-z0-9.]{1,30}"),
            ),
            0..50,
        ),
    ) {
        let mut batch = BinaryBatch::with_capacity(events.len() * 30);
        for (id, ad, cost, ts, lease) in &events {
            batch.push(id, ad, *cost, *ts, lease.as_deref());
        }
        let got: Vec<Read> = entries(batch.as_bytes()).map(|e| read(&e)).collect();
        let expected: Vec<Read> = events.into_iter().map(Ok).collect();
        prop_assert_eq!(got, expected);
    }

    #[test]
    fn a_cut_batch_keeps_every_whole_entry_before_the_cut(
        events in prop::collection::vec(("[a-z]{1,10}", 0u64..1 << 40, 0..=MAX_TS_MS), 1..10),
        cut in any::<prop::sample::Index>(),
    ) {
        let mut batch = BinaryBatch::new();
        let mut ends = Vec::new();
        for (id, cost, ts) in &events {
            batch.push(id, "ad", *cost, *ts, None);
            ends.push(batch.as_bytes().len());
        }
        let bytes = batch.as_bytes();
        let cut = HEADER_LEN + cut.index(bytes.len() - HEADER_LEN);
        let whole = ends.iter().filter(|&&end| end <= cut).count();
        let got = reasons(&bytes[..cut]);
        prop_assert!(got[..whole].iter().all(|(_, r)| r.is_ok()));
        prop_assert_eq!(got.len(), whole + usize::from(cut > HEADER_LEN && !ends.contains(&cut)));
        if let Some((_, last)) = got.get(whole) {
            prop_assert_eq!(last.clone(), Err(Reason::InvalidJson));
        }
    }

    #[test]
    fn any_bytes_after_the_magic_are_entries_never_a_panic(
        body in prop::collection::vec(any::<u8>(), 0..300),
    ) {
        let mut payload = BinaryBatch::new().into_bytes();
        payload.extend_from_slice(&body);
        let mut covered = HEADER_LEN;
        for entry in entries(&payload) {
            covered += entry.bytes.len();
            if let Ok(i) = &entry.parsed {
                prop_assert!((1..=crate::types::MAX_ID_LEN).contains(&i.id.len()));
                prop_assert!((0..=MAX_TS_MS).contains(&i.ts_ms));
                // What decodes re-encodes to an entry that reads the same,
                // in at most as many bytes (the encoder's varints are minimal).
                let mut again = BinaryBatch::new();
                again.push(&i.id, &i.ad_id, i.cost_micros, i.ts_ms, i.lease_id.as_deref());
                let again = again.into_bytes();
                let reread: Vec<Read> = entries(&again).map(|e| read(&e)).collect();
                prop_assert_eq!(reread, vec![read(&entry)]);
            }
        }
        prop_assert!(covered <= payload.len());
    }
}
