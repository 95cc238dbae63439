//! Comparing what the pacer serves with the simulator's ground truth.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context;
use chrono::{DateTime, Utc};
use serde::de::DeserializeOwned;
use serde::Deserialize;

use crate::{day_key, local_date, Truth};

/// The fields of a pacer limit this crate reads (CONTRACT.md).
#[derive(Debug, Clone, Deserialize)]
pub struct PacerLimit {
    pub limit_id: String,
    pub budget_micros: u64,
    pub period: String,
    pub time_zone: String,
    pub period_start: Option<String>,
    pub spend_micros: u64,
    pub lifetime_spend_micros: u64,
    pub remaining_micros: u64,
    pub exhausted: bool,
    pub lag_ms: i64,
}

#[derive(Deserialize)]
struct Page<T> {
    limits: Vec<T>,
    next: Option<String>,
}

/// Every limit, following the pages.
pub async fn fetch_limits(http: &reqwest::Client, base: &str) -> anyhow::Result<Vec<PacerLimit>> {
    fetch_limit_pages(http, base, None).await
}

/// Every limit of `GET /v1/limits`, following the pages, read as `T` (the
/// fields a caller needs), with a bearer `token` when the pacer asks for one.
pub async fn fetch_limit_pages<T: DeserializeOwned>(
    http: &reqwest::Client,
    base: &str,
    token: Option<&str>,
) -> anyhow::Result<Vec<T>> {
    let mut all = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let mut request = http
            .get(format!("{base}/v1/limits"))
            .query(&[("limit", "1000")]);
        if let Some(after) = &after {
            request = request.query(&[("after", after)]);
        }
        if let Some(token) = token {
            request = request.bearer_auth(token);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("GET {base}/v1/limits"))?;
        anyhow::ensure!(
            response.status().is_success(),
            "GET {base}/v1/limits: {}",
            response.status()
        );
        let page: Page<T> = response.json().await.context("decoding /v1/limits")?;
        all.extend(page.limits);
        match page.next {
            Some(next) => after = Some(next),
            None => return Ok(all),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub limit_id: String,
    pub period: String,
    pub pacer_lifetime: u64,
    pub truth_lifetime: u64,
    pub pacer_period: u64,
    pub truth_period: u64,
}

impl Row {
    pub fn matches(&self) -> bool {
        self.pacer_lifetime == self.truth_lifetime && self.pacer_period == self.truth_period
    }
}

#[derive(Debug, Clone)]
pub struct Comparison {
    pub rows: Vec<Row>,
}

impl Comparison {
    pub fn mismatches(&self) -> Vec<&Row> {
        self.rows.iter().filter(|r| !r.matches()).collect()
    }

    pub fn total_pacer(&self) -> u64 {
        self.rows.iter().map(|r| r.pacer_lifetime).sum()
    }

    pub fn total_truth(&self) -> u64 {
        self.rows.iter().map(|r| r.truth_lifetime).sum()
    }

    /// Largest absolute per-limit difference (lifetime).
    pub fn max_abs_diff(&self) -> u64 {
        self.rows
            .iter()
            .map(|r| r.pacer_lifetime.abs_diff(r.truth_lifetime))
            .max()
            .unwrap_or(0)
    }

    /// A table of the `n` limits with the most spend, then a totals line.
    pub fn render(&self, n: usize) -> String {
        let mut rows: Vec<&Row> = self.rows.iter().collect();
        rows.sort_by(|a, b| {
            b.truth_lifetime
                .cmp(&a.truth_lifetime)
                .then(a.limit_id.cmp(&b.limit_id))
        });
        let mut out = format!(
            "{:<28} {:>8} {:>18} {:>18} {:>18} {:>18}  {}\n",
            "limit",
            "period",
            "pacer period",
            "truth period",
            "pacer lifetime",
            "truth lifetime",
            "match"
        );
        for r in rows.iter().take(n) {
            out += &format!(
                "{:<28} {:>8} {:>18} {:>18} {:>18} {:>18}  {}\n",
                r.limit_id,
                r.period,
                r.pacer_period,
                r.truth_period,
                r.pacer_lifetime,
                r.truth_lifetime,
                if r.matches() { "yes" } else { "NO" }
            );
        }
        let mismatches = self.mismatches().len();
        out += &format!(
            "{} limits compared, {} mismatches; total spend pacer {} micros, truth {} micros\n",
            self.rows.len(),
            mismatches,
            self.total_pacer(),
            self.total_truth()
        );
        out
    }
}

/// The local date that the pacer's current period starts on, as the truth
/// keys it ("YYYY-MM-DD").
fn period_date(limit: &PacerLimit) -> Option<String> {
    let start: DateTime<Utc> = limit.period_start.as_deref()?.parse().ok()?;
    let tz: chrono_tz::Tz = limit.time_zone.parse().ok()?;
    local_date(tz, start.timestamp_millis()).ok().map(day_key)
}

pub fn compare(truth: &Truth, pacer: &[PacerLimit]) -> Comparison {
    let by_id: BTreeMap<&str, &PacerLimit> =
        pacer.iter().map(|l| (l.limit_id.as_str(), l)).collect();
    let mut ids: Vec<&str> = truth.limits.keys().map(String::as_str).collect();
    ids.extend(by_id.keys().copied());
    ids.sort_unstable();
    ids.dedup();
    let rows = ids
        .into_iter()
        .map(|id| {
            let t = truth.limits.get(id);
            let p = by_id.get(id);
            let truth_lifetime = t.map_or(0, |t| t.lifetime_micros);
            let period = p.map_or("?".to_string(), |p| p.period.clone());
            let truth_period = match p {
                Some(p) if p.period == "daily" => period_date(p)
                    .and_then(|d| t.and_then(|t| t.daily.get(&d).copied()))
                    .unwrap_or(0),
                _ => truth_lifetime,
            };
            Row {
                limit_id: id.to_string(),
                period,
                pacer_lifetime: p.map_or(0, |p| p.lifetime_spend_micros),
                truth_lifetime,
                pacer_period: p.map_or(0, |p| p.spend_micros),
                truth_period,
            }
        })
        .collect();
    Comparison { rows }
}

/// Poll the pacer until every limit equals the truth, or `timeout`; returns
/// the last comparison either way (the caller decides what a mismatch means).
pub async fn wait_for_match(
    base: &str,
    truth: &Truth,
    timeout: Duration,
) -> anyhow::Result<(Comparison, Duration)> {
    wait_for_match_with(&reqwest::Client::new(), base, truth, timeout).await
}

/// [`wait_for_match`] through `http` (a client trusting the pacer's CA and
/// sending its read token, for a pacer that asks for them).
pub async fn wait_for_match_with(
    http: &reqwest::Client,
    base: &str,
    truth: &Truth,
    timeout: Duration,
) -> anyhow::Result<(Comparison, Duration)> {
    let started = Instant::now();
    loop {
        let comparison = match fetch_limits(http, base).await {
            Ok(limits) => Some(compare(truth, &limits)),
            Err(e) if started.elapsed() >= timeout => return Err(e),
            Err(_) => None,
        };
        if let Some(c) = comparison {
            if c.mismatches().is_empty() || started.elapsed() >= timeout {
                return Ok((c, started.elapsed()));
            }
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// How a client on the host reaches pacer1's API (`../shared/CONTRACT.md`,
/// "Cluster"): from `pacer-client.env` when `scripts/cluster.sh` wrote one
/// (HTTPS with the cluster CA and a read token), else plain
/// `http://127.0.0.1:8080`; or from `adcheck`'s flags.
#[derive(Debug, Clone)]
pub struct PacerAccess {
    /// `ADSPEND_PACER_URL`.
    pub url: String,
    /// `ADSPEND_PACER_TLS_CA`.
    pub ca: Option<PathBuf>,
    /// `ADSPEND_PACER_READ_TOKEN`.
    pub read_token: Option<String>,
}

impl PacerAccess {
    /// Reads a `pacer-client.env` (as `scripts/cluster.sh` writes it); a
    /// missing file means plain `http://127.0.0.1:8080`.
    ///
    /// # Errors
    ///
    /// If the file exists but cannot be read or lacks `ADSPEND_PACER_URL`.
    pub fn from_env_file(path: &std::path::Path) -> anyhow::Result<PacerAccess> {
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(PacerAccess {
                    url: "http://127.0.0.1:8080".into(),
                    ca: None,
                    read_token: None,
                })
            }
            Err(e) => return Err(e).with_context(|| path.display().to_string()),
        };
        let value = |name: &str| {
            text.lines()
                .find_map(|line| line.strip_prefix(name)?.strip_prefix('='))
                .map(|v| v.trim().to_string())
                .filter(|v| !v.is_empty())
        };
        Ok(PacerAccess {
            url: value("ADSPEND_PACER_URL")
                .with_context(|| format!("{} has no ADSPEND_PACER_URL", path.display()))?,
            ca: value("ADSPEND_PACER_TLS_CA").map(PathBuf::from),
            read_token: value("ADSPEND_PACER_READ_TOKEN"),
        })
    }

    /// An HTTP client that trusts the CA and sends the read token.
    ///
    /// # Errors
    ///
    /// If the CA file cannot be read or parsed.
    pub fn client(&self, timeout: std::time::Duration) -> anyhow::Result<reqwest::Client> {
        self.builder(timeout)?.build().context("http client")
    }

    /// [`PacerAccess::client`] reaching `host` (a name in the pacers'
    /// certificate, e.g. `pacer2`) at `addr`.
    ///
    /// # Errors
    ///
    /// As [`PacerAccess::client`].
    pub fn client_resolving(
        &self,
        timeout: std::time::Duration,
        host: &str,
        addr: std::net::SocketAddr,
    ) -> anyhow::Result<reqwest::Client> {
        self.builder(timeout)?
            .resolve(host, addr)
            .build()
            .context("http client")
    }

    /// The API's URL on `host` with this access's scheme and port 8080.
    pub fn url_of(&self, host: &str) -> String {
        let scheme = self.url.split("://").next().unwrap_or("http");
        format!("{scheme}://{host}:8080")
    }

    fn builder(&self, timeout: std::time::Duration) -> anyhow::Result<reqwest::ClientBuilder> {
        let mut builder = reqwest::Client::builder().timeout(timeout);
        if let Some(ca) = &self.ca {
            let pem = std::fs::read(ca).with_context(|| ca.display().to_string())?;
            let cert = reqwest::Certificate::from_pem(&pem)
                .with_context(|| format!("{}: not a PEM certificate", ca.display()))?;
            builder = builder.add_root_certificate(cert);
        }
        if let Some(token) = &self.read_token {
            let mut headers = reqwest::header::HeaderMap::new();
            let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {token}"))
                .context("ADSPEND_PACER_READ_TOKEN is not a valid header value")?;
            value.set_sensitive(true);
            headers.insert(reqwest::header::AUTHORIZATION, value);
            builder = builder.default_headers(headers);
        }
        Ok(builder)
    }
}
