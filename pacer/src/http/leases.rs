//! `POST /v1/leases` and `POST /v1/leases/release` (decide scope), and
//! `GET /v1/leases/{lease_id}` (read scope): each request checked field by
//! field (every error names its field, and nothing is granted or released
//! when any entry is wrong), then committed to the ledger.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use adspend_wire::lease::LeaseId;
use adspend_wire::types::MAX_ID_LEN;

use crate::http::app::AppState;
use crate::http::reply::{error, ApiJson, ApiPath};
use crate::leases::{Ask, Release};

/// Shortest and longest lease, and the default (CONTRACT.md).
pub(super) const MIN_TTL_MS: u64 = 1_000;
pub(super) const MAX_TTL_MS: u64 = 600_000;
pub(super) const DEFAULT_TTL_MS: u64 = 30_000;

/// The request as sent; every field is checked by hand so that an error
/// can name it.
#[derive(Deserialize)]
pub(crate) struct LeaseRequest {
    ads: Vec<Value>,
    /// `None` only when absent: a `null` is a value, and a wrong one.
    #[serde(default, deserialize_with = "present")]
    ttl_ms: Option<Value>,
}

fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

#[derive(Serialize, Debug, PartialEq)]
pub(super) struct Granted {
    pub(crate) ad_id: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) lease_id: Option<String>,
    pub(crate) granted_micros: u64,
    pub(crate) expires_at_ms: i64,
}

#[derive(Serialize)]
struct LeaseResponse {
    leases: Vec<Granted>,
}

/// `ads[i]` checked: a known ad id, micros an integer >= 1.
fn ask_of(i: usize, raw: &Value, app: &AppState) -> Result<Ask, String> {
    let Value::Object(fields) = raw else {
        return Err(format!(
            "ads[{i}] must be an object with \"ad_id\" and \"micros\""
        ));
    };
    let ad_id = match fields.get("ad_id") {
        Some(Value::String(id)) if !id.is_empty() && id.len() <= MAX_ID_LEN => id.clone(),
        Some(Value::String(id)) => {
            return Err(format!(
                "ads[{i}].ad_id must be 1..={MAX_ID_LEN} bytes, has {}",
                id.len()
            ))
        }
        Some(_) => return Err(format!("ads[{i}].ad_id must be a string")),
        None => return Err(format!("ads[{i}].ad_id is missing")),
    };
    if app.catalog.borrow().limits_of_ad(&ad_id).is_none() {
        return Err(format!("ads[{i}].ad_id {ad_id:?} is not in the catalog"));
    }
    let micros = match fields.get("micros") {
        Some(Value::Number(n)) => n.as_u64().filter(|&m| m >= 1),
        Some(_) => None,
        None => return Err(format!("ads[{i}].micros is missing")),
    };
    let micros = micros.ok_or_else(|| format!("ads[{i}].micros must be an integer >= 1"))?;
    Ok(Ask { ad_id, micros })
}

fn ttl_of(raw: Option<&Value>) -> Result<u64, String> {
    match raw {
        None => Ok(DEFAULT_TTL_MS),
        Some(Value::Number(n)) => n
            .as_u64()
            .filter(|t| (MIN_TTL_MS..=MAX_TTL_MS).contains(t))
            .ok_or_else(|| format!("ttl_ms must be an integer in {MIN_TTL_MS}..={MAX_TTL_MS}")),
        Some(_) => Err(format!(
            "ttl_ms must be an integer in {MIN_TTL_MS}..={MAX_TTL_MS}"
        )),
    }
}

pub(crate) async fn grant(
    State(app): State<AppState>,
    ApiJson(request): ApiJson<LeaseRequest>,
) -> Response {
    let Some(leases) = app.leases.clone() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "spend leases are not available on this pacer",
        );
    };
    if request.ads.len() > app.max_decision_ids {
        metrics::counter!(crate::telemetry::PACER_HTTP_REFUSED_TOTAL, "reason" => "lease_ads")
            .increment(1);
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "ads: {} ads, at most {} in one request (ADSPEND_PACER_MAX_DECISION_IDS)",
                request.ads.len(),
                app.max_decision_ids
            ),
        );
    }
    let ttl_ms = match ttl_of(request.ttl_ms.as_ref()) {
        Ok(t) => t,
        Err(e) => return error(StatusCode::UNPROCESSABLE_ENTITY, e),
    };
    let asks: Result<Vec<Ask>, String> = request
        .ads
        .iter()
        .enumerate()
        .map(|(i, raw)| ask_of(i, raw, &app))
        .collect();
    let asks = match asks {
        Ok(a) => a,
        Err(e) => return error(StatusCode::UNPROCESSABLE_ENTITY, e),
    };
    let expires_at_ms = adspend_common::now_ms() + ttl_ms as i64;
    match leases.grant(asks, expires_at_ms).await {
        Ok(grants) => Json(LeaseResponse {
            leases: grants
                .into_iter()
                .map(|(grant, id)| Granted {
                    ad_id: grant.ad_id,
                    lease_id: id.map(|id| id.encode()),
                    granted_micros: grant.micros,
                    expires_at_ms: grant.expires_at_ms,
                })
                .collect(),
        })
        .into_response(),
        Err(unavailable) => error(StatusCode::SERVICE_UNAVAILABLE, unavailable.0),
    }
}

/// The body of `POST /v1/leases/release`.
#[derive(Deserialize)]
pub(crate) struct ReleaseRequest {
    leases: Vec<Value>,
}

/// One lease of a release, as answered.
#[derive(Serialize, Debug, PartialEq)]
struct ReleaseAnswer {
    lease_id: String,
    /// False when no live lease has the id (never granted, granted
    /// nothing, or retired): there was nothing to release.
    released: bool,
    /// What the lease still holds of each of its limits: served and not
    /// yet reported.
    held_micros: u64,
}

#[derive(Serialize)]
struct ReleaseResponse {
    leases: Vec<ReleaseAnswer>,
}

/// `leases[i]` checked: a lease id of the pacers' format, served micros an
/// integer >= 0.
fn release_of(i: usize, raw: &Value) -> Result<(LeaseId, Release), String> {
    let Value::Object(fields) = raw else {
        return Err(format!(
            "leases[{i}] must be an object with \"lease_id\" and \"served_micros\""
        ));
    };
    let id = match fields.get("lease_id") {
        Some(Value::String(id)) => LeaseId::parse(id)
            .ok_or_else(|| format!("leases[{i}].lease_id {id:?} is not a lease id"))?,
        Some(_) => return Err(format!("leases[{i}].lease_id must be a string")),
        None => return Err(format!("leases[{i}].lease_id is missing")),
    };
    let served_micros = match fields.get("served_micros") {
        Some(Value::Number(n)) => n.as_u64(),
        Some(_) => None,
        None => return Err(format!("leases[{i}].served_micros is missing")),
    }
    .ok_or_else(|| format!("leases[{i}].served_micros must be an integer >= 0"))?;
    let release = Release {
        lease_id: id.encode(),
        served_micros,
    };
    Ok((id, release))
}

/// `POST /v1/leases/release`: the ad server is done with these leases and
/// says what it served under each; what it did not serve is freed for
/// every pacer at once, and what it served stays held until reported.
pub(crate) async fn release(
    State(app): State<AppState>,
    ApiJson(request): ApiJson<ReleaseRequest>,
) -> Response {
    let Some(leases) = app.leases.clone() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "spend leases are not available on this pacer",
        );
    };
    if request.leases.len() > app.max_decision_ids {
        metrics::counter!(crate::telemetry::PACER_HTTP_REFUSED_TOTAL, "reason" => "lease_releases")
            .increment(1);
        return error(
            StatusCode::PAYLOAD_TOO_LARGE,
            format!(
                "leases: {} leases, at most {} in one request (ADSPEND_PACER_MAX_DECISION_IDS)",
                request.leases.len(),
                app.max_decision_ids
            ),
        );
    }
    let checked: Result<Vec<(LeaseId, Release)>, String> = request
        .leases
        .iter()
        .enumerate()
        .map(|(i, raw)| release_of(i, raw))
        .collect();
    let checked = match checked {
        Ok(c) => c,
        Err(e) => return error(StatusCode::UNPROCESSABLE_ENTITY, e),
    };
    // Only live leases not released yet go to the ledger; the rest would
    // change nothing.
    let to_commit: Vec<Release> = {
        let ledger = leases.ledger();
        checked
            .iter()
            .filter(|(id, _)| ledger.lease(id).is_some_and(|l| l.served.is_none()))
            .map(|(_, release)| release.clone())
            .collect()
    };
    if !to_commit.is_empty() {
        if let Err(unavailable) = leases.release(to_commit).await {
            return error(StatusCode::SERVICE_UNAVAILABLE, unavailable.0);
        }
    }
    let ledger = leases.ledger();
    let answers = checked
        .into_iter()
        .map(|(id, release)| {
            let lease = ledger.lease(&id);
            ReleaseAnswer {
                lease_id: release.lease_id,
                released: lease.is_some_and(|l| l.served.is_some()),
                held_micros: lease.map_or(0, |l| l.holds()),
            }
        })
        .collect();
    Json(ReleaseResponse { leases: answers }).into_response()
}

/// One live lease as this pacer holds it.
#[derive(Serialize)]
struct LeaseView {
    lease_id: String,
    ad_id: String,
    limits: Vec<String>,
    granted_micros: u64,
    /// Spend reported under the lease so far (may pass the grant).
    reported_micros: u64,
    /// What it still holds of each of its limits.
    held_micros: u64,
    /// What its ad server said it served when it released it; absent
    /// while it is not released.
    #[serde(skip_serializing_if = "Option::is_none")]
    served_micros: Option<u64>,
    expires_at_ms: i64,
}

pub(crate) async fn read(
    State(app): State<AppState>,
    ApiPath(lease_id): ApiPath<String>,
) -> Response {
    let Some(leases) = app.leases.as_ref() else {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "spend leases are not available on this pacer",
        );
    };
    let Some(id) = LeaseId::parse(&lease_id) else {
        return error(
            StatusCode::NOT_FOUND,
            format!("{lease_id:?} is not a lease id"),
        );
    };
    let ledger = leases.ledger();
    match ledger.lease(&id) {
        Some(lease) => Json(LeaseView {
            lease_id,
            ad_id: lease.ad_id.to_string(),
            limits: lease.limits.iter().map(|l| l.to_string()).collect(),
            granted_micros: lease.granted,
            reported_micros: lease.reported,
            held_micros: lease.holds(),
            served_micros: lease.served,
            expires_at_ms: id.expires_at_ms,
        })
        .into_response(),
        None => error(
            StatusCode::NOT_FOUND,
            format!("no live lease {lease_id:?} (never granted, granted nothing, or retired)"),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_release_is_checked_and_named() {
        let id = LeaseId {
            expires_at_ms: 5_000,
            seq: 3,
            index: 1,
        };
        let good = serde_json::json!({"lease_id": id.encode(), "served_micros": 0});
        assert_eq!(release_of(0, &good).map(|(parsed, _)| parsed), Ok(id));
        for (bad, named) in [
            (serde_json::json!("x"), "leases[2] must be an object"),
            (
                serde_json::json!({"served_micros": 1}),
                "leases[2].lease_id is missing",
            ),
            (
                serde_json::json!({"lease_id": 7, "served_micros": 1}),
                "leases[2].lease_id must be a string",
            ),
            (
                serde_json::json!({"lease_id": "00.1.1", "served_micros": 1}),
                "leases[2].lease_id \"00.1.1\" is not a lease id",
            ),
            (
                serde_json::json!({"lease_id": id.encode()}),
                "leases[2].served_micros is missing",
            ),
            (
                serde_json::json!({"lease_id": id.encode(), "served_micros": -1}),
                "leases[2].served_micros must be an integer >= 0",
            ),
            (
                serde_json::json!({"lease_id": id.encode(), "served_micros": 1.5}),
                "leases[2].served_micros must be an integer >= 0",
            ),
        ] {
            let e = release_of(2, &bad).unwrap_err();
            assert!(e.starts_with(named), "{bad}: {e}");
        }
    }

    #[test]
    fn ttl_is_checked_and_named() {
        assert_eq!(ttl_of(None), Ok(DEFAULT_TTL_MS));
        assert_eq!(ttl_of(Some(&Value::from(1_000))), Ok(1_000));
        assert_eq!(ttl_of(Some(&Value::from(600_000))), Ok(600_000));
        for bad in [
            Value::from(999),
            Value::from(600_001),
            Value::from(-5),
            Value::from(1.5),
            Value::from("30000"),
            Value::Null,
        ] {
            assert!(
                ttl_of(Some(&bad)).unwrap_err().starts_with("ttl_ms"),
                "{bad}"
            );
        }
    }
}
