//! The JSON of the pacer's API that the client sends and reads
//! (`../shared/CONTRACT.md`, docs/API.md).

use serde::{Deserialize, Serialize};

/// One ad of `POST /v1/leases`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct LeaseAsk<'a> {
    pub ad_id: &'a str,
    pub micros: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct LeaseRequest<'a> {
    pub(crate) ads: &'a [LeaseAsk<'a>],
    pub(crate) ttl_ms: u64,
}

/// One grant of `POST /v1/leases`, in the order asked.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Grant {
    pub ad_id: String,
    /// Absent when nothing was granted.
    #[serde(default)]
    pub lease_id: Option<String>,
    pub granted_micros: u64,
    pub expires_at_ms: i64,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Grants {
    pub(crate) leases: Vec<Grant>,
}

/// One lease of `POST /v1/leases/release`: everything served under it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Release {
    pub lease_id: String,
    pub served_micros: u64,
}

#[derive(Debug, Serialize)]
pub(crate) struct ReleaseRequest<'a> {
    pub(crate) leases: &'a [Release],
}

/// The pacer's answer to one release.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Released {
    pub lease_id: String,
    /// False for an id no live lease has (expired and retired, or unknown).
    pub released: bool,
    #[serde(default)]
    pub held_micros: u64,
}

#[derive(Debug, Deserialize)]
pub(crate) struct ReleasedAll {
    pub(crate) leases: Vec<Released>,
}

/// `GET /v1/limits/{id}`: the contract's fields a bidder reads.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Limit {
    pub limit_id: String,
    pub budget_micros: u64,
    pub period: String,
    pub spend_micros: u64,
    pub lifetime_spend_micros: u64,
    pub remaining_micros: u64,
    pub exhausted: bool,
    #[serde(default)]
    pub lag_ms: Option<i64>,
}

#[derive(Debug, Serialize)]
pub(crate) struct DecisionRequest<'a> {
    pub(crate) ad_ids: &'a [&'a str],
}

/// One ad of `POST /v1/decisions`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Decision {
    pub ad_id: String,
    pub servable: bool,
    pub multiplier: f64,
}

#[derive(Debug, Deserialize)]
pub(crate) struct Decisions {
    pub(crate) decisions: Vec<Decision>,
}
