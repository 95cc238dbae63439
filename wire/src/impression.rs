//! The impression contract: one NDJSON line, as ad servers publish it on
//! `IMPRESSIONS`, turned into an [`Impression`] or a [`Rejection`] with a
//! [`Reason`].
//!
//! Decisions depend on the bytes only, so a replay of the same input reaches
//! the same decision (DESIGN.md rule 7). The limiter adds the two reasons
//! that need more than the line ([`Reason::UnknownAd`] from the catalog,
//! [`Reason::CostTooLarge`] from its ceiling).

use std::borrow::Cow;

use serde::Deserialize;

use crate::types::{Micros, MAX_ID_LEN};

/// Latest accepted event time: 9999-12-31.
pub const MAX_TS_MS: i64 = 253_402_300_799_999;

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
    /// The spend lease it was served under, as the ad server wrote it
    /// (whether it is a lease id at all is [`crate::lease`]'s to say).
    pub lease_id: Option<Cow<'a, str>>,
}

#[derive(Deserialize)]
struct Raw<'a> {
    #[serde(borrow, default, deserialize_with = "lease_or_none")]
    lease_id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    id: Option<Cow<'a, str>>,
    #[serde(borrow)]
    ad_id: Option<Cow<'a, str>>,
    cost_micros: Option<serde_json::Number>,
    ts: Option<serde_json::Number>,
}

/// Parse and check one line; the catalog lookup and the cost ceiling are
/// the caller's.
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
        lease_id: raw.lease_id,
    })
}

/// `lease_id`: a string names the lease; any other value names none, and
/// the impression is spend like any other (CONTRACT.md), never a rejection.
fn lease_or_none<'de: 'a, 'a, D: serde::Deserializer<'de>>(
    d: D,
) -> Result<Option<Cow<'a, str>>, D::Error> {
    use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
    struct Lease;
    impl<'de> Visitor<'de> for Lease {
        type Value = Option<Cow<'de, str>>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("any JSON value")
        }
        fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Borrowed(v)))
        }
        fn visit_str<E>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(v.to_owned())))
        }
        fn visit_string<E>(self, v: String) -> Result<Self::Value, E> {
            Ok(Some(Cow::Owned(v)))
        }
        fn visit_unit<E>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_bool<E>(self, _: bool) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_i64<E>(self, _: i64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_u64<E>(self, _: u64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_f64<E>(self, _: f64) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
            while seq.next_element::<IgnoredAny>()?.is_some() {}
            Ok(None)
        }
        fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
            Ok(None)
        }
    }
    d.deserialize_any(Lease)
}

#[cfg(test)]
mod tests;
