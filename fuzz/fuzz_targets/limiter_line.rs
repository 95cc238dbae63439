//! The impression line parser (wire/src/impression.rs `parse_line`, which
//! the limiter runs on every line of its input) and the dead letters of the
//! lines it rejects (wire/src/dead_letter.rs), on NDJSON payloads.
//!
//! Beyond "no panic": parsing is deterministic; an accepted line respects the
//! contract (ids 1..=64 bytes, `cost_micros` an integer ≥ 0, `ts` unix ms in
//! range), is UTF-8, and an independent reading of the same JSON agrees with
//! it (JSON that `serde_json::Value` cannot hold, such as a number beyond f64
//! in an ignored field, is read field by field); a line the independent
//! reading finds valid is accepted; a rejection says why. The rejected lines
//! of a payload get one dead letter each up to the cap and one summary past
//! it, and every letter stays small whatever its line.
//!
//! What the limiter makes of the accepted lines (the catalog lookup, the
//! cost ceiling, the spend tuples and their SPEND messages) is its own code:
//! limiter/src/emit/tests.rs checks it with proptest.
#![no_main]

use adspend_wire::dead_letter::{self, DeadLetter, Overflow};
use adspend_wire::impression::{parse_line, Impression, Rejection, MAX_TS_MS};
use adspend_wire::types::MAX_ID_LEN;
use libfuzzer_sys::fuzz_target;
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::{Map, Value};

type Summary = Result<(String, String, u64, i64), (&'static str, String)>;

fn summary(parsed: &Result<Impression<'_>, Rejection>) -> Summary {
    match parsed {
        Ok(i) => Ok((
            i.id.to_string(),
            i.ad_id.to_string(),
            i.cost_micros,
            i.ts_ms,
        )),
        Err(r) => Err((r.reason.as_str(), r.detail.clone())),
    }
}

fn id_ok(id: &str) -> bool {
    (1..=MAX_ID_LEN).contains(&id.len())
}

/// What an independent reading (serde_json::Value) says the contract accepts.
fn contract_reading(v: &Value) -> Option<(&str, &str, u64, i64)> {
    let o = v.as_object()?;
    let id = o.get("id")?.as_str().filter(|s| id_ok(s))?;
    let ad = o.get("ad_id")?.as_str().filter(|s| id_ok(s))?;
    let cost = o.get("cost_micros")?.as_u64()?;
    let ts = o
        .get("ts")?
        .as_i64()
        .filter(|t| (0..=MAX_TS_MS).contains(t))?;
    Some((id, ad, cost, ts))
}

/// JSON that `serde_json::Value` cannot hold, though the grammar allows it:
/// numbers beyond f64, unpaired surrogate escapes, deep nesting. In an
/// ignored field such a value is fine (the contract ignores unknown fields).
fn beyond_value(e: &serde_json::Error) -> bool {
    let m = e.to_string();
    [
        "number out of range",
        "recursion limit exceeded",
        "lone leading surrogate",
        "unexpected end of hex escape",
        "invalid unicode code point",
    ]
    .iter()
    .any(|what| m.starts_with(what))
}

/// The contract's four fields of a JSON object as `Value`s, every other
/// field skipped unread; a repeated field keeps its last value.
struct ContractFields(Map<String, Value>);

impl<'de> Deserialize<'de> for ContractFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields;
        impl<'de> Visitor<'de> for Fields {
            type Value = ContractFields;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ContractFields, A::Error> {
                let mut fields = Map::new();
                while let Some(key) = map.next_key::<String>()? {
                    if ["id", "ad_id", "cost_micros", "ts"].contains(&key.as_str()) {
                        fields.insert(key, map.next_value::<Value>()?);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(ContractFields(fields))
            }
        }
        d.deserialize_map(Fields)
    }
}

/// Checks one line; returns its rejection, if any.
fn check_line(line: &[u8]) -> Option<Rejection> {
    let first = parse_line(line);
    assert_eq!(summary(&first), summary(&parse_line(line)), "deterministic");
    let value = serde_json::from_slice::<Value>(line);
    match &first {
        Ok(i) => {
            assert!(id_ok(&i.id), "accepted id of {} bytes", i.id.len());
            assert!(id_ok(&i.ad_id), "accepted ad_id of {} bytes", i.ad_id.len());
            assert!(
                (0..=MAX_TS_MS).contains(&i.ts_ms),
                "accepted ts {}",
                i.ts_ms
            );
            assert!(
                std::str::from_utf8(line).is_ok(),
                "accepted a line that is not UTF-8"
            );
            let value = match value {
                Ok(value) => value,
                Err(e) if beyond_value(&e) => {
                    let fields: ContractFields = serde_json::from_slice(line)
                        .unwrap_or_else(|e| panic!("an accepted line is not JSON: {e}"));
                    Value::Object(fields.0)
                }
                Err(e) => panic!("an accepted line is not JSON: {e}"),
            };
            assert_eq!(
                contract_reading(&value),
                Some((&*i.id, &*i.ad_id, i.cost_micros, i.ts_ms)),
                "an independent reading of an accepted line disagrees"
            );
        }
        Err(r) => {
            assert!(!r.detail.is_empty(), "a rejection says why");
            // Duplicate keys make the line ambiguous (the validator rejects
            // them, Value keeps the last); a canonical re-serialization of a
            // line the contract allows must be accepted.
            if let Some(v) = value
                .as_ref()
                .ok()
                .filter(|v| contract_reading(v).is_some())
            {
                let canonical = serde_json::to_vec(v).expect("serializes");
                let again = parse_line(&canonical);
                let (id, ad, cost, ts) = contract_reading(v).expect("checked");
                assert_eq!(
                    summary(&again),
                    Ok((id.to_string(), ad.to_string(), cost, ts)),
                    "a contract-valid line is rejected"
                );
            }
        }
    }
    first.err()
}

fuzz_target!(|data: &[u8]| {
    // As the limiter splits a payload: lines numbered from 0, blank ones
    // skipped, each rejected one dead-lettered until the cap.
    let mut rejected = 0u64;
    let mut letters = Vec::new();
    let mut overflow = Overflow::default();
    for (line_no, raw) in data.split(|&b| b == b'\n').enumerate() {
        let line = raw.strip_suffix(b"\r").unwrap_or(raw);
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        let Some(rejection) = check_line(line) else {
            continue;
        };
        rejected += 1;
        let reason = rejection.reason.as_str();
        if overflow.admit(line_no as u32, reason) {
            letters.push(DeadLetter::new(
                reason,
                rejection.detail,
                line,
                7,
                line_no as u32,
            ));
        }
    }
    letters.extend(overflow.finish(7));
    // One letter per rejected line up to the cap, the rest in one summary.
    let per_message = u64::from(dead_letter::PER_MESSAGE);
    let expected = rejected.min(per_message) + u64::from(rejected > per_message);
    assert_eq!(letters.len() as u64, expected, "dead letters");
    for letter in &letters {
        let json = serde_json::to_vec(letter).expect("a dead letter serializes");
        assert!(json.len() < 40_000, "a dead letter of {} bytes", json.len());
        assert!(letter.line.len() <= dead_letter::LINE_BYTES);
    }
});
