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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lease_request_is_the_contract_s_json() {
        let asks = [
            LeaseAsk {
                ad_id: "ad-1",
                micros: 2_000_000,
            },
            LeaseAsk {
                ad_id: "ad-\"2",
                micros: 1,
            },
        ];
        let body = LeaseRequest {
            ads: &asks,
            ttl_ms: 30_000,
        };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({
                "ads": [
                    {"ad_id": "ad-1", "micros": 2_000_000},
                    {"ad_id": "ad-\"2", "micros": 1}
                ],
                "ttl_ms": 30_000
            })
        );
    }

    #[test]
    fn grants_are_read_as_the_contract_writes_them() {
        let body = r#"{"leases": [
            {"ad_id": "ad-1", "lease_id": "01J9Z", "granted_micros": 1500000, "expires_at_ms": 1800000030000},
            {"ad_id": "ad-2", "granted_micros": 0, "expires_at_ms": 1800000030000, "reason": "exhausted"}
        ]}"#;
        let answer: Grants = serde_json::from_str(body).unwrap();
        assert_eq!(
            answer.leases,
            [
                Grant {
                    ad_id: "ad-1".into(),
                    lease_id: Some("01J9Z".into()),
                    granted_micros: 1_500_000,
                    expires_at_ms: 1_800_000_030_000,
                },
                Grant {
                    ad_id: "ad-2".into(),
                    lease_id: None,
                    granted_micros: 0,
                    expires_at_ms: 1_800_000_030_000,
                }
            ]
        );
        // A grant without its amount or expiry is not an answer.
        for broken in [
            r#"{"leases": [{"ad_id": "ad-1", "lease_id": "x", "expires_at_ms": 1}]}"#,
            r#"{"leases": [{"ad_id": "ad-1", "lease_id": "x", "granted_micros": 1}]}"#,
        ] {
            assert!(serde_json::from_str::<Grants>(broken).is_err(), "{broken}");
        }
    }

    #[test]
    fn a_release_and_its_answer_are_the_contract_s_json() {
        let releases = [Release {
            lease_id: "a.1.0".into(),
            served_micros: 5,
        }];
        let body = ReleaseRequest { leases: &releases };
        assert_eq!(
            serde_json::to_value(&body).unwrap(),
            serde_json::json!({"leases": [{"lease_id": "a.1.0", "served_micros": 5}]})
        );
        let answer: ReleasedAll = serde_json::from_str(
            r#"{"leases": [
                {"lease_id": "a.1.0", "released": false, "held_micros": 0},
                {"lease_id": "a.2.0", "released": true}
            ]}"#,
        )
        .unwrap();
        assert_eq!(
            answer.leases,
            [
                Released {
                    lease_id: "a.1.0".into(),
                    released: false,
                    held_micros: 0
                },
                Released {
                    lease_id: "a.2.0".into(),
                    released: true,
                    held_micros: 0
                }
            ]
        );
    }
}
