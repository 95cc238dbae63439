use std::net::SocketAddr;
use std::time::Duration;

use adspend_common::catalog_source::CatalogSource;
use adspend_common::config::{parse_addr, CatalogArgs, EtcdArgs, NatsArgs, StreamArgs};
use adspend_common::env;
use adspend_common::Error;
use clap::Parser;

use crate::http::auth::{parse_tokens, Auth};
use crate::http::serve::HttpLimits;

mod regions;

use crate::regions::RegionSettings;

/// Holds budget state from the aggregators' pushes and answers ad servers:
/// may I bid on this ad, how hard, what is left.
#[derive(Parser, Clone, Debug)]
#[command(name = "pacer", version)]
pub struct Config {
    #[command(flatten)]
    pub(crate) nats: NatsArgs,
    #[command(flatten)]
    pub(crate) etcd: EtcdArgs,
    #[command(flatten)]
    pub(crate) catalog: CatalogArgs,
    /// Replicas of `ALERTS` when the pacer creates it.
    #[command(flatten)]
    pub(crate) streams: StreamArgs,
    /// Budget alerts are also POSTed here (http or https), signed with
    /// ADSPEND_ALERTS_WEBHOOK_SECRET; empty: no webhook (docs/BUDGET-ALERTS.md).
    #[arg(long, env = env::ALERTS_WEBHOOK_URL, default_value = "")]
    pub(crate) alerts_webhook_url: String,
    /// The HMAC-SHA256 key of the webhook's `X-Adspend-Signature`, at least
    /// 16 bytes; required with ADSPEND_ALERTS_WEBHOOK_URL.
    #[arg(
        long,
        env = env::ALERTS_WEBHOOK_SECRET,
        default_value = "",
        hide_env_values = true,
        hide_default_value = true
    )]
    pub(crate) alerts_webhook_secret: Secret,
    /// How long ALERTS keeps budget alerts, in milliseconds; the last alert
    /// of every limit stays whatever its age (docs/RETENTION.md).
    #[arg(long, env = env::ALERTS_RETENTION_MS, default_value_t = 3_024_000_000,
          value_parser = clap::value_parser!(u64).range(1_000..))]
    pub(crate) alerts_retention_ms: u64,
    /// HTTP listen address of the API and dashboard.
    #[arg(long, env = env::PACER_ADDR, default_value = "127.0.0.1:8080")]
    pub(crate) pacer_addr: String,
    /// PEM certificate chain (leaf first) of HTTPS on the API port; with
    /// ADSPEND_PACER_TLS_KEY. Empty: plain HTTP. The operations listener
    /// (ADSPEND_PACER_OPS_ADDR) stays plain.
    #[arg(long, env = env::PACER_TLS_CERT, default_value = "")]
    pub(crate) tls_cert: String,
    /// PEM private key of ADSPEND_PACER_TLS_CERT.
    #[arg(long, env = env::PACER_TLS_KEY, default_value = "")]
    pub(crate) tls_key: String,
    /// Prometheus /metrics listen address (also served on the API port).
    #[arg(long, env = env::METRICS_ADDR, default_value = "127.0.0.1:9103")]
    pub(crate) metrics_addr: String,
    /// Optional second listen address serving only /healthz and /metrics,
    /// never behind a token (for probes and scrapers kept off the API
    /// port's network). Empty: none; both stay on the API port either way.
    #[arg(long, env = env::PACER_OPS_ADDR, default_value = "")]
    pub(crate) ops_addr: String,
    /// Milliseconds after which a shard whose owner has pushed nothing (not
    /// even its heartbeat, sent at least every second while idle) is stale:
    /// its limits say `"stale": true` and the ads under them are not
    /// servable until it pushes again. Keep it above the aggregators' push
    /// interval (ADSPEND_PUSH_INTERVAL_MS).
    #[arg(long, env = env::PACER_STALE_AFTER_MS, default_value_t = 30_000,
          value_parser = clap::value_parser!(u64).range(2_000..=86_400_000))]
    pub(crate) stale_after_ms: u64,
    /// Bearer tokens of the read scope (GET /v1/limits…, /v1/shards: the
    /// dashboard's data), comma-separated, each at least 16 characters of
    /// A-Z a-z 0-9 - . _ ~ + / (= at the end). Empty: reading needs no token.
    #[arg(
        long,
        env = env::PACER_READ_TOKENS,
        default_value = "",
        hide_env_values = true,
        hide_default_value = true
    )]
    pub(crate) read_tokens: Secret,
    /// Bearer tokens of the decide scope (POST /v1/decisions), as for the
    /// read scope; a decide token does not read. Empty: deciding needs no
    /// token.
    #[arg(
        long,
        env = env::PACER_DECIDE_TOKENS,
        default_value = "",
        hide_env_values = true,
        hide_default_value = true
    )]
    pub(crate) decide_tokens: Secret,
    /// Milliseconds a request may take, from its first byte to its answer
    /// (head, body and handling): a slower one gets 408 or, still in its
    /// head, a closed connection. Also how long a new connection may stay
    /// silent and a response write may stall.
    #[arg(long, env = env::PACER_REQUEST_TIMEOUT_MS, default_value_t = 10_000,
          value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub(crate) request_timeout_ms: u64,
    /// Milliseconds a keep-alive connection may sit idle between requests.
    #[arg(long, env = env::PACER_IDLE_TIMEOUT_MS, default_value_t = 60_000,
          value_parser = clap::value_parser!(u64).range(100..=3_600_000))]
    pub(crate) idle_timeout_ms: u64,
    /// Most open connections on the API port (each carries one request at a
    /// time); more wait in the listen backlog until one closes.
    #[arg(long, env = env::PACER_MAX_CONNECTIONS, default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) max_connections: u64,
    /// Most open connections on the API port from one client address (an
    /// IPv6 client by its /64), so that one host cannot take every place
    /// under ADSPEND_PACER_MAX_CONNECTIONS: one more is answered 429 and
    /// closed. Behind a proxy every client has the proxy's address: set it
    /// to ADSPEND_PACER_MAX_CONNECTIONS there. Above that, that one applies.
    #[arg(long, env = env::PACER_MAX_CONNECTIONS_PER_ADDR, default_value_t = 128,
          value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub(crate) max_connections_per_addr: u64,
    /// Most ad ids in one POST /v1/decisions: a larger batch is answered
    /// 413 (JSON) without being decided. With each ad's limits bounded by
    /// the catalog's shape, this bounds a decision batch's time and answer.
    #[arg(long, env = env::PACER_MAX_DECISION_IDS, default_value_t = 1_000,
          value_parser = clap::value_parser!(u64).range(1..=100_000))]
    pub(crate) max_decision_ids: u64,
    /// The pacing served: `adspend` (its own) or `baseline` (LinkedIn-style
    /// pass-through rate, stop at the visible budget; for comparisons).
    #[arg(long, env = env::PACER_ALGORITHM, value_enum,
          default_value_t = crate::pacing::controller::Algorithm::Adspend)]
    pub(crate) algorithm: crate::pacing::controller::Algorithm,
    /// How long after a spend lease expires its unreported spend may still
    /// arrive: the lease holds its limits until the pipeline has caught up
    /// this far past its expiry (CONTRACT.md "Spend leases"). Spend
    /// reported later than that can take a limit over its budget.
    #[arg(long, env = env::PACER_LEASE_GRACE_MS, default_value_t = 60_000,
          value_parser = clap::value_parser!(u64).range(0..=86_400_000))]
    pub(crate) lease_grace_ms: u64,
    #[command(flatten)]
    pub(crate) regions: regions::RegionArgs,
}

/// A setting whose value must never be printed: `Debug` shows its length.
#[derive(Clone, Default)]
pub(crate) struct Secret(pub String);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes>)", self.0.len())
    }
}

impl std::str::FromStr for Secret {
    // Never fails, so clap never echoes the value in an error; validation
    // (naming entries by position only) is `Config::validate`'s.
    type Err = std::convert::Infallible;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Ok(Secret(s.to_string()))
    }
}

/// The settings once validated: what [`Config`] holds, with every value
/// that needs parsing parsed, once.
#[derive(Debug, Clone)]
pub struct Validated {
    pub(crate) config: Config,
    pub(crate) settings: Settings,
    pub(crate) catalog: CatalogSource,
}

/// The settings that needed parsing.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) api_addr: SocketAddr,
    pub(crate) metrics_addr: SocketAddr,
    pub(crate) ops_addr: Option<SocketAddr>,
    /// HTTPS on the API port; None: plain HTTP.
    pub(crate) tls: Option<crate::http::serve::tls::Https>,
    pub(crate) auth: Auth,
    pub(crate) http: HttpLimits,
    pub(crate) max_decision_ids: usize,
    pub(crate) alerts: crate::alerts::Settings,
    /// One budget across regions; None: one region.
    pub(crate) regions: Option<RegionSettings>,
}

/// Shortest webhook secret accepted, bytes.
const MIN_WEBHOOK_SECRET: usize = 16;

impl Config {
    /// The validated settings, or the first bad one.
    pub fn validate(self) -> Result<Validated, Error> {
        let settings = self.settings()?;
        let catalog = self.catalog.source(&self.etcd)?;
        Ok(Validated {
            config: self,
            settings,
            catalog,
        })
    }

    fn settings(&self) -> Result<Settings, Error> {
        self.etcd.validate()?;
        let ops_addr = match self.ops_addr.trim() {
            "" => None,
            addr => Some(parse_addr(env::PACER_OPS_ADDR, addr)?),
        };
        let tokens = |name: &'static str, secret: &Secret| {
            parse_tokens(&secret.0).map_err(|bad| Error::Config {
                name,
                value: "<not shown>".to_string(),
                reason: format!("token {} {}", bad.position, bad.reason),
            })
        };
        let auth = Auth::new(
            tokens(env::PACER_READ_TOKENS, &self.read_tokens)?,
            tokens(env::PACER_DECIDE_TOKENS, &self.decide_tokens)?,
        );
        Ok(Settings {
            api_addr: parse_addr(env::PACER_ADDR, &self.pacer_addr)?,
            metrics_addr: parse_addr(env::METRICS_ADDR, &self.metrics_addr)?,
            ops_addr,
            tls: self.tls()?,
            auth,
            http: HttpLimits {
                request_timeout: Duration::from_millis(self.request_timeout_ms),
                idle_timeout: Duration::from_millis(self.idle_timeout_ms),
                max_connections: self.max_connections as usize,
                max_connections_per_addr: self.max_connections_per_addr.min(self.max_connections)
                    as usize,
            },
            max_decision_ids: self.max_decision_ids as usize,
            alerts: crate::alerts::Settings {
                stream_replicas: self.streams.replicas(),
                webhook: self.webhook()?,
                retention: std::time::Duration::from_millis(self.alerts_retention_ms),
            },
            regions: self.regions.settings()?,
        })
    }

    fn tls(&self) -> Result<Option<crate::http::serve::tls::Https>, Error> {
        let (cert, key) = (self.tls_cert.trim(), self.tls_key.trim());
        let missing = |name: &'static str, other: &str| Error::Config {
            name,
            value: String::new(),
            reason: format!("is needed with {other}"),
        };
        match (cert.is_empty(), key.is_empty()) {
            (true, true) => Ok(None),
            (false, true) => Err(missing(env::PACER_TLS_KEY, env::PACER_TLS_CERT)),
            (true, false) => Err(missing(env::PACER_TLS_CERT, env::PACER_TLS_KEY)),
            (false, false) => crate::http::serve::tls::load(
                (env::PACER_TLS_CERT, std::path::Path::new(cert)),
                (env::PACER_TLS_KEY, std::path::Path::new(key)),
            )
            .map(Some),
        }
    }

    fn webhook(&self) -> Result<Option<crate::alerts::webhook::Target>, Error> {
        let url = self.alerts_webhook_url.trim();
        let secret = &self.alerts_webhook_secret.0;
        let fail = |name: &'static str, value: &str, reason: &str| Error::Config {
            name,
            value: value.to_string(),
            reason: reason.to_string(),
        };
        if url.is_empty() {
            if !secret.is_empty() {
                return Err(fail(
                    env::ALERTS_WEBHOOK_SECRET,
                    "<not shown>",
                    "set without ADSPEND_ALERTS_WEBHOOK_URL",
                ));
            }
            return Ok(None);
        }
        let parsed =
            url::Url::parse(url).map_err(|e| fail(env::ALERTS_WEBHOOK_URL, url, &e.to_string()))?;
        if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
            return Err(fail(
                env::ALERTS_WEBHOOK_URL,
                url,
                "must be an http:// or https:// URL with a host",
            ));
        }
        if secret.len() < MIN_WEBHOOK_SECRET {
            return Err(fail(
                env::ALERTS_WEBHOOK_SECRET,
                "<not shown>",
                &format!(
                    "needs at least {MIN_WEBHOOK_SECRET} bytes with ADSPEND_ALERTS_WEBHOOK_URL set"
                ),
            ));
        }
        Ok(Some(crate::alerts::webhook::Target {
            url: parsed,
            secret: secret.as_bytes().to_vec(),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Config {
        let mut all = vec!["pacer"];
        all.extend_from_slice(args);
        Config::try_parse_from(all).unwrap()
    }

    #[test]
    fn defaults_leave_the_api_open_with_the_documented_limits() {
        let settings = parse(&[]).validate().unwrap().settings;
        assert_eq!(settings.ops_addr, None);
        assert!(settings.tls.is_none());
        assert!(!settings.auth.required(crate::http::auth::Scope::Read));
        assert!(!settings.auth.required(crate::http::auth::Scope::Decide));
        assert_eq!(settings.http.request_timeout, Duration::from_secs(10));
        assert_eq!(settings.http.idle_timeout, Duration::from_secs(60));
        assert_eq!(settings.http.max_connections, 1024);
        assert_eq!(settings.http.max_connections_per_addr, 128);
        assert_eq!(settings.max_decision_ids, 1_000);
        assert_eq!(parse(&[]).stale_after_ms, 30_000);
    }

    #[test]
    fn the_per_address_cap_is_at_most_the_connection_cap() {
        let settings = parse(&["--max-connections=10"])
            .validate()
            .unwrap()
            .settings;
        assert_eq!(settings.http.max_connections_per_addr, 10);
        let settings = parse(&["--max-connections-per-addr=3"])
            .validate()
            .unwrap()
            .settings;
        assert_eq!(settings.http.max_connections_per_addr, 3);
    }

    #[test]
    fn a_bad_token_is_named_by_setting_and_position_never_shown() {
        let config = parse(&["--decide-tokens=good-token-0123456789,oops"]);
        let shown = format!("{config:?}");
        let message = config.validate().unwrap_err().to_string();
        assert!(message.contains(env::PACER_DECIDE_TOKENS), "{message}");
        assert!(message.contains("token 2 is shorter"), "{message}");
        assert!(
            !message.contains("oops") && !message.contains("good-token"),
            "{message}"
        );
        assert!(!shown.contains("good-token"), "{shown}");
    }

    #[test]
    fn the_webhook_needs_a_url_and_a_long_enough_secret_never_shown() {
        assert!(parse(&[])
            .validate()
            .unwrap()
            .settings
            .alerts
            .webhook
            .is_none());
        let secret = "--alerts-webhook-secret=s3cret-s3cret-s3cret";
        let target = parse(&["--alerts-webhook-url=https://hooks.example/adspend", secret])
            .validate()
            .unwrap()
            .settings
            .alerts
            .webhook
            .unwrap();
        assert_eq!(target.url.as_str(), "https://hooks.example/adspend");
        assert!(!format!("{target:?}").contains("s3cret"));
        for (args, name, reason) in [
            (
                vec![secret],
                env::ALERTS_WEBHOOK_SECRET,
                "without ADSPEND_ALERTS_WEBHOOK_URL",
            ),
            (
                vec!["--alerts-webhook-url=ftp://x/y", secret],
                env::ALERTS_WEBHOOK_URL,
                "http://",
            ),
            (
                vec!["--alerts-webhook-url=not a url", secret],
                env::ALERTS_WEBHOOK_URL,
                "not a url",
            ),
            (
                vec![
                    "--alerts-webhook-url=http://x/y",
                    "--alerts-webhook-secret=short-s3cret",
                ],
                env::ALERTS_WEBHOOK_SECRET,
                "at least 16 bytes",
            ),
            (
                vec!["--alerts-webhook-url=http://x/y"],
                env::ALERTS_WEBHOOK_SECRET,
                "at least 16",
            ),
        ] {
            let message = parse(&args).validate().unwrap_err().to_string();
            assert!(
                message.contains(name) && message.contains(reason),
                "{args:?}: {message}"
            );
            assert!(!message.contains("s3cret"), "{message}");
        }
    }

    #[test]
    fn out_of_range_timeouts_and_bad_addresses_are_refused() {
        let parse_err = |args: &[&str]| {
            let mut all = vec!["pacer"];
            all.extend_from_slice(args);
            Config::try_parse_from(all).unwrap_err().to_string()
        };
        assert!(parse_err(&["--stale-after-ms=500"]).contains("2000"));
        assert!(parse_err(&["--stale-after-ms=soon"]).contains("stale-after-ms"));
        assert!(parse_err(&["--request-timeout-ms=0"]).contains("request-timeout-ms"));
        assert!(parse_err(&["--max-connections=0"]).contains("max-connections"));
        assert!(parse_err(&["--max-connections-per-addr=0"]).contains("max-connections-per-addr"));
        assert!(parse_err(&["--max-decision-ids=0"]).contains("max-decision-ids"));
        assert!(parse_err(&["--max-decision-ids=many"]).contains("max-decision-ids"));
        assert!(parse_err(&["--max-decision-ids=100001"]).contains("100000"));
        let message = parse(&["--tls-cert=/etc/pacer.pem"])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(message.contains(env::PACER_TLS_KEY), "{message}");
        let message = parse(&[
            "--tls-cert=/nonexistent/pacer.pem",
            "--tls-key=/nonexistent/k.pem",
        ])
        .validate()
        .unwrap_err()
        .to_string();
        assert!(
            message.contains(env::PACER_TLS_CERT) && message.contains("/nonexistent/pacer.pem"),
            "{message}"
        );
        let message = parse(&["--ops-addr=nowhere"])
            .validate()
            .unwrap_err()
            .to_string();
        assert!(message.contains(env::PACER_OPS_ADDR), "{message}");
    }
}
