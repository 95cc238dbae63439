//! `POST /v1/decisions`, with its cost bounded by the settings: at most
//! `ADSPEND_PACER_MAX_DECISION_IDS` ad ids a batch (one more and the body
//! stops being read into ids: 413), each at most an ad id's 64 bytes (422),
//! each costing one verdict per limit above its ad (bounded by the
//! catalog's shape, [`adspend_wire::catalog::MAX_LIMITS_ABOVE_AD`]); so
//! the answer is at most a few hundred bytes per id allowed.
//!
//! The batch is decided a chunk of [`VERDICTS_PER_YIELD`] verdicts at a
//! time, yielding between chunks, so the request timeout can end a batch
//! that runs long and other requests on the same worker threads wait at
//! most a chunk behind it. Each chunk reads the spend
//! under its own read lock (the ingest may apply a push in between: a later
//! chunk can see newer spend); the whole batch sees one catalog and one
//! instant.

use std::cell::Cell;
use std::fmt;

use adspend_wire::types::MAX_ID_LEN;
use axum::body::Bytes;
use axum::extract::{FromRequest, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use chrono::Utc;
use serde::de::{self, DeserializeSeed, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::Serialize;

use crate::http::app::AppState;
use crate::http::reply::error;
use crate::pacing::{decide_counted, Decision};
use crate::telemetry::{DECISIONS_TOTAL, PACER_HTTP_REFUSED_TOTAL};
use adspend_common::env::PACER_MAX_DECISION_IDS;

/// Verdicts computed between two yields (one ad's verdicts are never
/// split): a verdict is about a microsecond in a release build, so a chunk
/// is well under a millisecond.
const VERDICTS_PER_YIELD: usize = 512;

#[derive(Serialize)]
struct DecisionResponse {
    decisions: Vec<Decision>,
}

/// On the bidder's hot path: one catalog snapshot for the whole batch, the
/// spend read a chunk at a time.
pub(crate) async fn decisions(State(app): State<AppState>, request: Request) -> Response {
    let ad_ids = match read_ids(request, &app, app.max_decision_ids).await {
        Ok(ids) => ids,
        Err(response) => return response,
    };
    let catalog = app.catalog.borrow().clone();
    let now = Utc::now();
    let mut decisions: Vec<Decision> = Vec::with_capacity(ad_ids.len());
    let mut ad_ids = ad_ids.into_iter();
    loop {
        {
            let spend = app.spend.read().await;
            let mut verdicts = 0;
            while verdicts < VERDICTS_PER_YIELD {
                let Some(ad_id) = ad_ids.next() else { break };
                let (decision, cost) = decide_counted(&catalog, &spend, ad_id, now);
                decisions.push(decision);
                // An unknown ad costs a lookup: count it as one.
                verdicts += cost.max(1);
            }
        }
        if ad_ids.len() == 0 {
            break;
        }
        // Where the request timeout can end the batch, and other tasks run.
        tokio::task::yield_now().await;
    }
    metrics::counter!(DECISIONS_TOTAL).increment(decisions.len() as u64);
    Json(DecisionResponse { decisions }).into_response()
}

/// The request's `ad_ids`, read without holding more than `max` of them,
/// or the JSON error to answer: 415 not JSON, 413 body or batch too large,
/// 400 malformed, 422 wrong shape or an id too long.
async fn read_ids(request: Request, app: &AppState, max: usize) -> Result<Vec<String>, Response> {
    if !json_content_type(request.headers()) {
        return Err(error(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "Expected request with `Content-Type: application/json`",
        ));
    }
    let body = Bytes::from_request(request, app)
        .await
        .map_err(|rejection| error(rejection.status(), rejection.body_text()))?;
    let too_many = Cell::new(false);
    let mut deserializer = serde_json::Deserializer::from_slice(&body);
    let parsed = BatchSeed {
        max,
        too_many: &too_many,
    }
    .deserialize(&mut deserializer)
    .and_then(|ids| deserializer.end().map(|()| ids));
    match parsed {
        Ok(ids) => Ok(ids),
        Err(_) if too_many.get() => {
            metrics::counter!(PACER_HTTP_REFUSED_TOTAL, "reason" => "decision_ids").increment(1);
            Err(error(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("too many ad_ids: at most {max} in one request ({PACER_MAX_DECISION_IDS})"),
            ))
        }
        Err(e) => Err(match e.classify() {
            serde_json::error::Category::Data => error(
                StatusCode::UNPROCESSABLE_ENTITY,
                format!("Failed to deserialize the JSON body into the target type: {e}"),
            ),
            _ => error(
                StatusCode::BAD_REQUEST,
                format!("Failed to parse the request body as JSON: {e}"),
            ),
        }),
    }
}

/// `application/json` or any `application/*+json`, as axum's `Json` takes.
fn json_content_type(headers: &HeaderMap) -> bool {
    let Some(value) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or_default().trim();
    let Some((kind, subtype)) = essence.split_once('/') else {
        return false;
    };
    kind.eq_ignore_ascii_case("application")
        && (subtype.eq_ignore_ascii_case("json") || subtype.to_ascii_lowercase().ends_with("+json"))
}

/// `{"ad_ids": [...]}` (other fields ignored), the ids bounded as they are
/// read.
struct BatchSeed<'a> {
    max: usize,
    too_many: &'a Cell<bool>,
}

impl<'de> DeserializeSeed<'de> for BatchSeed<'_> {
    type Value = Vec<String>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for BatchSeed<'_> {
    type Value = Vec<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an object with \"ad_ids\"")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut ids = None;
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            if key != "ad_ids" {
                map.next_value::<IgnoredAny>()?;
                continue;
            }
            if ids.is_some() {
                return Err(de::Error::duplicate_field("ad_ids"));
            }
            ids = Some(map.next_value_seed(IdsSeed {
                max: self.max,
                too_many: self.too_many,
            })?);
        }
        ids.ok_or_else(|| de::Error::missing_field("ad_ids"))
    }
}

/// The `ad_ids` array: stops at the first id past `max` (flagging it) and
/// at the first id longer than an ad id can be.
struct IdsSeed<'a> {
    max: usize,
    too_many: &'a Cell<bool>,
}

impl<'de> DeserializeSeed<'de> for IdsSeed<'_> {
    type Value = Vec<String>;

    fn deserialize<D: de::Deserializer<'de>>(
        self,
        deserializer: D,
    ) -> Result<Self::Value, D::Error> {
        deserializer.deserialize_seq(self)
    }
}

impl<'de> Visitor<'de> for IdsSeed<'_> {
    type Value = Vec<String>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("an array of ad ids")
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut ids: Vec<String> = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(self.max));
        while let Some(id) = seq.next_element::<std::borrow::Cow<'de, str>>()? {
            if ids.len() == self.max {
                self.too_many.set(true);
                return Err(de::Error::custom(format_args!(
                    "more than {} ad_ids",
                    self.max
                )));
            }
            if id.len() > MAX_ID_LEN {
                return Err(de::Error::custom(format_args!(
                    "ad id {} is {} bytes, longer than the {MAX_ID_LEN} an ad id can be",
                    ids.len() + 1,
                    id.len()
                )));
            }
            ids.push(id.into_owned());
        }
        Ok(ids)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(body: &str, max: usize) -> (Result<Vec<String>, serde_json::Error>, bool) {
        let too_many = Cell::new(false);
        let mut deserializer = serde_json::Deserializer::from_str(body);
        let parsed = BatchSeed {
            max,
            too_many: &too_many,
        }
        .deserialize(&mut deserializer)
        .and_then(|ids| deserializer.end().map(|()| ids));
        (parsed, too_many.get())
    }

    #[test]
    fn reads_the_ids_and_ignores_other_fields() {
        let (ids, too_many) = parse(r#"{"x":[1,{"y":2}],"ad_ids":["a","b\u0041"],"z":null}"#, 2);
        assert_eq!(ids.unwrap(), vec!["a", "bA"]);
        assert!(!too_many);
    }

    #[test]
    fn stops_at_the_first_id_past_the_cap() {
        let (ids, too_many) = parse(r#"{"ad_ids":["a","b","c"]}"#, 2);
        assert!(ids.is_err() && too_many);
        // Flagged before reading the rest: even a broken tail is "too many".
        let (ids, too_many) = parse(r#"{"ad_ids":["","","",  oops"#, 2);
        assert!(ids.is_err() && too_many);
    }

    #[test]
    fn shape_errors_are_data_errors_and_not_too_many() {
        for body in [
            r#"{"ad_ids":5}"#,
            r#"{"ad_ids":[1]}"#,
            r#"{}"#,
            r#"{"ad_ids":[],"ad_ids":[]}"#,
            r#"[]"#,
        ] {
            let (ids, too_many) = parse(body, 10);
            let e = ids.unwrap_err();
            assert_eq!(
                e.classify(),
                serde_json::error::Category::Data,
                "{body}: {e}"
            );
            assert!(!too_many, "{body}");
        }
        let long = format!(r#"{{"ad_ids":["ok","{}"]}}"#, "x".repeat(MAX_ID_LEN + 1));
        let e = parse(&long, 10).0.unwrap_err();
        assert!(e.to_string().contains("ad id 2 is 65 bytes"), "{e}");
        let (ids, _) = parse(r#"{"ad_ids":["a"]"#, 10);
        assert_eq!(
            ids.unwrap_err().classify(),
            serde_json::error::Category::Eof
        );
    }

    #[test]
    fn json_content_types() {
        let with = |value: &str| {
            let mut headers = HeaderMap::new();
            headers.insert(header::CONTENT_TYPE, value.parse().unwrap());
            json_content_type(&headers)
        };
        assert!(with("application/json"));
        assert!(with("Application/JSON; charset=utf-8"));
        assert!(with("application/vnd.bidder+json"));
        assert!(!with("text/json"));
        assert!(!with("application/jsonx"));
        assert!(!json_content_type(&HeaderMap::new()));
    }
}
