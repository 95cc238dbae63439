//! The pacer's HTTP API: limits, decisions, leases and releases, with a
//! TLS CA, bearer tokens per scope, a timeout per try, and retries with
//! exponential backoff on connection errors and 5xx. A 4xx is not retried:
//! it comes back typed ([`Error`]), with the field the pacer named.
//!
//! Retrying a lease request whose answer was lost can leave a grant nobody
//! holds: it is held at the pacers until its expiry plus their grace
//! (underdelivery, never overspend). A release may be retried freely: the
//! first one of a lease counts.

use std::time::{Duration, Instant};

use reqwest::{Method, StatusCode};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::api::{
    Decision, DecisionRequest, Decisions, Grant, Grants, LeaseAsk, LeaseRequest, Limit, Release,
    ReleaseRequest, Released, ReleasedAll,
};
use crate::error::{named_field, Error};

/// Retries of a call that found the pacer unavailable.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Retry {
    /// Tries in all (1: no retry).
    pub tries: u32,
    /// The wait after the first failure, doubled after each, up to `max`.
    pub backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for Retry {
    fn default() -> Self {
        Self {
            tries: 4,
            backoff: Duration::from_millis(50),
            max_backoff: Duration::from_secs(1),
        }
    }
}

/// How to reach a pacer.
#[derive(Debug, Clone)]
pub struct PacerConfig {
    /// `http://host:port` or `https://host:port`.
    pub url: String,
    /// PEM file of the CA that signed the pacer's certificate (HTTPS with a
    /// private CA); the system's roots otherwise.
    pub ca_file: Option<std::path::PathBuf>,
    /// Bearer token of the read scope (limits), if the pacer requires one.
    pub read_token: Option<String>,
    /// Bearer token of the decide scope (decisions, leases, releases).
    pub decide_token: Option<String>,
    /// Each try's timeout.
    pub timeout: Duration,
    pub retry: Retry,
}

impl PacerConfig {
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            ca_file: None,
            read_token: None,
            decide_token: None,
            timeout: Duration::from_secs(2),
            retry: Retry::default(),
        }
    }
}

#[derive(Clone, Copy)]
enum Scope {
    Read,
    Decide,
}

/// A client of one pacer (cheap to clone: one connection pool).
#[derive(Debug, Clone)]
pub struct Pacer {
    base: String,
    http: reqwest::Client,
    read_token: Option<String>,
    decide_token: Option<String>,
    retry: Retry,
}

impl Pacer {
    /// A client for `config`; fails on a URL that is not HTTP(S) or a CA
    /// file that cannot be read.
    pub fn new(config: PacerConfig) -> Result<Self, Error> {
        let base = config.url.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(Error::Config(format!(
                "pacer url {base:?} must start with http:// or https://"
            )));
        }
        if config.retry.tries == 0 {
            return Err(Error::Config("retry.tries must be at least 1".into()));
        }
        let mut builder = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.timeout)
            .tcp_nodelay(true);
        if let Some(path) = &config.ca_file {
            let pem = std::fs::read(path)
                .map_err(|e| Error::Config(format!("reading CA file {}: {e}", path.display())))?;
            let cert = reqwest::Certificate::from_pem(&pem)
                .map_err(|e| Error::Config(format!("CA file {}: {e}", path.display())))?;
            builder = builder.add_root_certificate(cert);
        }
        let http = builder
            .build()
            .map_err(|e| Error::Config(format!("HTTP client: {e}")))?;
        Ok(Self {
            base,
            http,
            read_token: config.read_token,
            decide_token: config.decide_token,
            retry: config.retry,
        })
    }

    /// `GET /v1/limits/{id}`.
    pub async fn limit(&self, limit_id: &str) -> Result<Limit, Error> {
        let path = format!("/v1/limits/{limit_id}");
        self.call::<(), Limit>(Method::GET, &path, Scope::Read, None)
            .await
    }

    /// One page of `GET /v1/limits`, and the `after` of the next.
    pub async fn limits_page(
        &self,
        after: Option<&str>,
        limit: usize,
    ) -> Result<(Vec<Limit>, Option<String>), Error> {
        #[derive(serde::Deserialize)]
        struct Page {
            limits: Vec<Limit>,
            #[serde(default)]
            next: Option<String>,
        }
        let mut path = format!("/v1/limits?limit={limit}");
        if let Some(after) = after {
            path.push_str(&format!("&after={after}"));
        }
        let page: Page = self
            .call::<(), Page>(Method::GET, &path, Scope::Read, None)
            .await?;
        Ok((page.limits, page.next))
    }

    /// `POST /v1/decisions`: one answer per ad, in order.
    pub async fn decide(&self, ad_ids: &[&str]) -> Result<Vec<Decision>, Error> {
        let body = DecisionRequest { ad_ids };
        let answer: Decisions = self
            .call(Method::POST, "/v1/decisions", Scope::Decide, Some(&body))
            .await?;
        expect_len(answer.decisions, ad_ids.len(), "decisions")
    }

    /// `POST /v1/leases`: one grant per ask, in order.
    pub async fn lease(&self, asks: &[LeaseAsk<'_>], ttl_ms: u64) -> Result<Vec<Grant>, Error> {
        let body = LeaseRequest { ads: asks, ttl_ms };
        let answer: Grants = self
            .call(Method::POST, "/v1/leases", Scope::Decide, Some(&body))
            .await?;
        let grants = expect_len(answer.leases, asks.len(), "leases")?;
        for (ask, grant) in asks.iter().zip(&grants) {
            if grant.ad_id != ask.ad_id || grant.granted_micros > ask.micros {
                return Err(Error::Protocol(format!(
                    "asked {} micros for {}, got {:?}",
                    ask.micros, ask.ad_id, grant
                )));
            }
            if grant.granted_micros > 0 && grant.lease_id.is_none() {
                return Err(Error::Protocol(format!(
                    "a grant without a lease_id: {grant:?}"
                )));
            }
        }
        Ok(grants)
    }

    /// `POST /v1/leases/release`: one answer per release, in order.
    pub async fn release(&self, releases: &[Release]) -> Result<Vec<Released>, Error> {
        let body = ReleaseRequest { leases: releases };
        let answer: ReleasedAll = self
            .call(
                Method::POST,
                "/v1/leases/release",
                Scope::Decide,
                Some(&body),
            )
            .await?;
        expect_len(answer.leases, releases.len(), "releases")
    }

    async fn call<B: Serialize, T: DeserializeOwned>(
        &self,
        method: Method,
        path: &str,
        scope: Scope,
        body: Option<&B>,
    ) -> Result<T, Error> {
        let url = format!("{}{path}", self.base);
        let token = match scope {
            Scope::Read => &self.read_token,
            Scope::Decide => &self.decide_token,
        };
        let started = Instant::now();
        let mut wait = self.retry.backoff;
        let mut last = String::new();
        for attempt in 1..=self.retry.tries {
            let mut request = self.http.request(method.clone(), &url);
            if let Some(token) = token {
                request = request.bearer_auth(token);
            }
            if let Some(body) = body {
                request = request.json(body);
            }
            match request.send().await {
                Ok(response) if response.status().is_success() => {
                    let bytes = response
                        .bytes()
                        .await
                        .map_err(|e| Error::Protocol(format!("reading the answer: {e}")))?;
                    return serde_json::from_slice(&bytes)
                        .map_err(|e| Error::Protocol(format!("{method} {path}: {e}")));
                }
                Ok(response) if response.status().is_server_error() => {
                    last = format!("{} {}", response.status(), error_text(response).await);
                }
                Ok(response) => return Err(refusal(response).await),
                Err(e) => last = e.to_string(),
            }
            if attempt < self.retry.tries {
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(self.retry.max_backoff);
            }
        }
        Err(Error::Unavailable {
            tries: self.retry.tries,
            elapsed: started.elapsed(),
            last,
        })
    }
}

fn expect_len<T>(items: Vec<T>, asked: usize, what: &str) -> Result<Vec<T>, Error> {
    if items.len() == asked {
        Ok(items)
    } else {
        Err(Error::Protocol(format!(
            "{} {what} for {asked} asked",
            items.len()
        )))
    }
}

/// The contract's `{"error": "..."}`, or the body as text.
async fn error_text(response: reqwest::Response) -> String {
    let body = response.text().await.unwrap_or_default();
    serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(str::to_string))
        .unwrap_or(body)
}

async fn refusal(response: reqwest::Response) -> Error {
    let status = response.status();
    let message = error_text(response).await;
    match status {
        StatusCode::UNAUTHORIZED | StatusCode::FORBIDDEN => Error::Unauthorized {
            status: status.as_u16(),
            message,
        },
        StatusCode::NOT_FOUND => Error::NotFound(message),
        _ => Error::Refused {
            status: status.as_u16(),
            field: named_field(&message),
            message,
        },
    }
}
