//! The API's side: every limit as `/v1/limits` pages it, the dashboard's
//! order, what the history endpoint has for a limit, and the sources the
//! limiters report.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

#[derive(Debug, Clone, PartialEq)]
pub(super) struct ApiLimit {
    pub(super) limit_id: String,
    pub(super) daily: bool,
    pub(super) spend_micros: u64,
    pub(super) budget_micros: u64,
    pub(super) remaining_micros: u64,
    pub(super) leased_micros: u64,
    pub(super) exhausted: bool,
}

impl ApiLimit {
    /// The dashboard's order after exhaustion: share of the budget used.
    pub(super) fn share(&self) -> f64 {
        self.spend_micros as f64 / self.budget_micros as f64
    }
}

/// The dashboard's order: exhausted first, then by share of the budget used
/// (ties by id).
pub(super) fn urgency(a: &ApiLimit, b: &ApiLimit) -> std::cmp::Ordering {
    b.exhausted
        .cmp(&a.exhausted)
        .then(b.share().total_cmp(&a.share()))
        .then(a.limit_id.cmp(&b.limit_id))
}

/// Every limit, through the same pages the dashboard reads.
pub(super) async fn read_api(url: &str) -> BTreeMap<String, ApiLimit> {
    let mut limits = BTreeMap::new();
    let mut after: Option<String> = None;
    loop {
        let mut request = reqwest::Client::new()
            .get(format!("{url}/v1/limits"))
            .query(&[("limit", "1000")]);
        if let Some(after) = &after {
            request = request.query(&[("after", after)]);
        }
        let page: Value = request
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .expect("GET /v1/limits")
            .json()
            .await
            .expect("limits page is JSON");
        for limit in page["limits"].as_array().expect("limits array") {
            let micros = |field: &str| {
                limit[field]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{field} is not a u64 in {limit}"))
            };
            let parsed = ApiLimit {
                limit_id: limit["limit_id"].as_str().expect("limit_id").to_owned(),
                daily: limit["period"] == "daily",
                spend_micros: micros("spend_micros"),
                budget_micros: micros("budget_micros"),
                remaining_micros: micros("remaining_micros"),
                leased_micros: micros("leased_micros"),
                exhausted: limit["exhausted"].as_bool().expect("exhausted"),
            };
            limits.insert(parsed.limit_id.clone(), parsed);
        }
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => return limits,
        }
    }
}

/// Every (limiter, source) of `/v1/sources`, with its held-back flag.
pub(super) async fn read_sources(url: &str) -> BTreeSet<(String, String, bool)> {
    let body: Value = reqwest::get(format!("{url}/v1/sources"))
        .await
        .and_then(|r| r.error_for_status())
        .expect("GET /v1/sources")
        .json()
        .await
        .expect("/v1/sources is JSON");
    let mut sources = BTreeSet::new();
    for limiter in body["limiters"].as_array().expect("limiters array") {
        let name = limiter["limiter"].as_str().expect("limiter name");
        for source in limiter["sources"].as_array().expect("sources array") {
            sources.insert((
                name.to_owned(),
                source["source"].as_str().expect("source name").to_owned(),
                source["held_back"].as_bool().expect("held_back"),
            ));
        }
    }
    sources
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub(super) enum HistoryState {
    /// 404: the pacer has no history endpoint (yet).
    Missing,
    #[default]
    Empty,
    Points,
}

pub(super) async fn read_history(url: &str, limit_id: &str) -> HistoryState {
    let response = reqwest::Client::new()
        .get(format!("{url}/v1/limits/{limit_id}/history"))
        .send()
        .await
        .expect("GET history");
    if response.status() == reqwest::StatusCode::NOT_FOUND {
        return HistoryState::Missing;
    }
    let body: Value = response
        .error_for_status()
        .expect("history status")
        .json()
        .await
        .expect("history is JSON");
    match body["points"].as_array() {
        Some(points) if !points.is_empty() => HistoryState::Points,
        _ => HistoryState::Empty,
    }
}
