//! Turning one NDJSON line into an impression, or a rejection with a reason.
//!
//! Decisions depend on the bytes and the catalog only, so a replay of the same
//! input reaches the same decision (DESIGN.md rule 7).

use std::borrow::Cow;

use adspend_common::types::{Micros, MAX_ID_LEN};
use serde::Deserialize;

/// Default ceiling of one impression's cost (one million currency units):
/// far above any real impression, far below what could overflow a sum.
pub const DEFAULT_MAX_COST_MICROS: Micros = 1_000_000_000_000;

/// Latest accepted event time: 9999-12-31.
const MAX_TS_MS: i64 = 253_402_300_799_999;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Reason {
    InvalidJson,
    MissingField,
    InvalidField,
    NegativeCost,
    FractionalCost,
    IdTooLong,
    InvalidTs,
    UnknownAd,
    CostTooLarge,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::InvalidJson => "invalid_json",
            Reason::MissingField => "missing_field",
            Reason::InvalidField => "invalid_field",
            Reason::NegativeCost => "negative_cost",
            Reason::FractionalCost => "fractional_cost",
            Reason::IdTooLong => "id_too_long",
            Reason::InvalidTs => "invalid_ts",
            Reason::UnknownAd => "unknown_ad",
            Reason::CostTooLarge => "cost_too_large",
        }
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct Rejection {
    pub reason: Reason,
    pub detail: String,
}

fn reject(reason: Reason, detail: impl Into<String>) -> Rejection {
    Rejection {
        reason,
        detail: detail.into(),
    }
}

#[derive(Debug, PartialEq, Eq)]
pub struct Impression<'a> {
    pub id: Cow<'a, str>,
    pub ad_id: Cow<'a, str>,
    pub cost_micros: Micros,
    pub ts_ms: i64,
}

#[derive(Deserialize)]
struct Raw<'a> {
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    ad_id: Option<Cow<'a, str>>,
    cost_micros: Option<serde_json::Number>,
    ts: Option<serde_json::Number>,
}

/// Parse and check one line; the catalog lookup is the caller's.
pub fn parse_line(line: &[u8]) -> Result<Impression<'_>, Rejection> {
    // JSON is UTF-8, but serde_json checks only the strings it keeps: bytes
    // that are not UTF-8 in an ignored field's string would pass unseen.
    let line = std::str::from_utf8(line)
        .map_err(|e| reject(Reason::InvalidJson, format!("not UTF-8: {e}")))?;
    let raw: Raw<'_> = serde_json::from_str(line).map_err(|e| {
        let reason = if e.is_data() {
            Reason::InvalidField
        } else {
            Reason::InvalidJson
        };
        reject(reason, e.to_string())
    })?;
    let id = raw
        .id
        .ok_or_else(|| reject(Reason::MissingField, "missing \"id\""))?;
    let ad_id = raw
        .ad_id
        .ok_or_else(|| reject(Reason::MissingField, "missing \"ad_id\""))?;
    let cost = raw
        .cost_micros
        .ok_or_else(|| reject(Reason::MissingField, "missing \"cost_micros\""))?;
    let ts = raw
        .ts
        .ok_or_else(|| reject(Reason::MissingField, "missing \"ts\""))?;
    if id.is_empty() || id.len() > MAX_ID_LEN {
        return Err(reject(
            Reason::IdTooLong,
            format!("\"id\" must be 1..={MAX_ID_LEN} bytes, has {}", id.len()),
        ));
    }
    if ad_id.is_empty() || ad_id.len() > MAX_ID_LEN {
        return Err(reject(
            Reason::IdTooLong,
            format!(
                "\"ad_id\" must be 1..={MAX_ID_LEN} bytes, has {}",
                ad_id.len()
            ),
        ));
    }
    let cost_micros = match cost.as_u64() {
        Some(c) => c,
        None if cost.is_i64() => {
            return Err(reject(
                Reason::NegativeCost,
                format!("cost_micros {cost} is negative"),
            ))
        }
        None => {
            // A float: fractional micros, or an integer too large for u64.
            let reason = match cost.as_f64() {
                Some(f) if f < 0.0 => Reason::NegativeCost,
                Some(f) if f.fract() != 0.0 => Reason::FractionalCost,
                _ => Reason::InvalidField,
            };
            return Err(reject(
                reason,
                format!("cost_micros {cost} is not a non-negative integer"),
            ));
        }
    };
    let ts_ms = ts
        .as_i64()
        .filter(|t| (0..=MAX_TS_MS).contains(t))
        .ok_or_else(|| {
            reject(
                Reason::InvalidTs,
                format!("ts {ts} is not unix milliseconds"),
            )
        })?;
    Ok(Impression {
        id,
        ad_id,
        cost_micros,
        ts_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn reason(line: &str) -> Reason {
        parse_line(line.as_bytes()).unwrap_err().reason
    }

    #[test]
    fn accepts_the_contract_format_and_ignores_unknown_fields() {
        let i = parse_line(
            br#"{"id":"i-1","ad_id":"ad-1","cost_micros":1500,"ts":1700000000000,"x":[1]}"#,
        )
        .unwrap();
        assert_eq!(i.id, "i-1");
        assert_eq!(i.ad_id, "ad-1");
        assert_eq!(i.cost_micros, 1500);
        assert_eq!(i.ts_ms, 1_700_000_000_000);
        let escaped = parse_line(br#"{"id":"a\"b","ad_id":"ad","cost_micros":0,"ts":0}"#).unwrap();
        assert_eq!(escaped.id, "a\"b");
    }

    #[test]
    fn every_bad_kind_has_its_reason() {
        assert_eq!(reason("not json"), Reason::InvalidJson);
        assert_eq!(reason("{\"id\":\"a\""), Reason::InvalidJson);
        assert_eq!(
            reason(r#"{"ad_id":"a","cost_micros":1,"ts":1}"#),
            Reason::MissingField
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","ts":1}"#),
            Reason::MissingField
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","cost_micros":1}"#),
            Reason::MissingField
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","cost_micros":-5,"ts":1}"#),
            Reason::NegativeCost
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","cost_micros":-5.5,"ts":1}"#),
            Reason::NegativeCost
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","cost_micros":12.5,"ts":1}"#),
            Reason::FractionalCost
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","cost_micros":"12","ts":1}"#),
            Reason::InvalidField
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","cost_micros":1e30,"ts":1}"#),
            Reason::InvalidField
        );
        let long = "x".repeat(65);
        assert_eq!(
            reason(&format!(
                r#"{{"id":"{long}","ad_id":"a","cost_micros":1,"ts":1}}"#
            )),
            Reason::IdTooLong
        );
        assert_eq!(
            reason(r#"{"id":"","ad_id":"a","cost_micros":1,"ts":1}"#),
            Reason::IdTooLong
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","cost_micros":1,"ts":-1}"#),
            Reason::InvalidTs
        );
        assert_eq!(
            reason(r#"{"id":"a","ad_id":"a","cost_micros":1,"ts":1.5}"#),
            Reason::InvalidTs
        );
    }

    /// Found by fuzzing (fuzz target limiter_line): a line whose unknown
    /// field held bytes that are not UTF-8 was accepted, though it is not
    /// JSON.
    #[test]
    fn bytes_that_are_not_utf8_are_invalid_json() {
        let mut line = br#"{"id":"i-1","ad_id":"ad-1","cost_micros":1,"ts":1,"z":"w"#.to_vec();
        line.extend_from_slice(b"\xff\xfe\"}");
        let rejection = parse_line(&line).unwrap_err();
        assert_eq!(rejection.reason, Reason::InvalidJson);
        assert!(
            rejection.detail.contains("not UTF-8"),
            "{}",
            rejection.detail
        );
        // In a kept field serde_json saw it already; same reason either way.
        let mut id = br#"{"id":"i-"#.to_vec();
        id.extend_from_slice(b"\xc3\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":1}");
        assert_eq!(parse_line(&id).unwrap_err().reason, Reason::InvalidJson);
        // UTF-8 beyond ASCII is fine, in kept and ignored fields alike.
        let ok = parse_line(
            "{\"id\":\"é😀\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":1,\"z\":\"ü\"}".as_bytes(),
        )
        .unwrap();
        assert_eq!(ok.id, "é😀");
    }

    proptest! {
        #[test]
        fn never_panics_and_is_deterministic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
            let a = parse_line(&bytes).map(|i| (i.id.into_owned(), i.cost_micros)).map_err(|r| r.reason);
            let b = parse_line(&bytes).map(|i| (i.id.into_owned(), i.cost_micros)).map_err(|r| r.reason);
            prop_assert_eq!(a, b);
        }

        #[test]
        fn valid_events_roundtrip(id in "[a-zA-Z0-9-]{1,64}", ad in "[a-z0-9-]{1,64}", cost in any::<u64>(), ts in 0i64..MAX_TS_MS) {
            let line = serde_json::json!({"id": id, "ad_id": ad, "cost_micros": cost, "ts": ts}).to_string();
            let i = parse_line(line.as_bytes()).unwrap();
            prop_assert_eq!((i.id.as_ref(), i.ad_id.as_ref(), i.cost_micros, i.ts_ms), (id.as_str(), ad.as_str(), cost, ts));
        }
    }
}
