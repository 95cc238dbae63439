//! NATS JetStream: connection and the streams every service agrees on.

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::Duration;

use crate::config::NatsArgs;
use crate::env;
use crate::error::{Error, Result};
use crate::telemetry::{NATS_PERMISSION_VIOLATIONS_TOTAL, NATS_UNAUTHENTICATED};

mod age;
pub mod regions;
mod streams;

pub use age::first_newer_than;
pub use streams::{
    ensure_alerts, ensure_deadletter, ensure_deadletter_with, ensure_impressions,
    ensure_impressions_with, ensure_spend, ensure_spend_trims, DeadletterLimits, InputLimits,
};

pub const IMPRESSIONS_STREAM: &str = "IMPRESSIONS";
pub const IMPRESSIONS_SUBJECTS: &str = "impressions.>";
pub const SPEND_STREAM: &str = "SPEND";
pub const SPEND_SUBJECTS: &str = "spend.*";
/// How far each part of `SPEND` was trimmed: one message per subject, the
/// newest ([`spend_trim_subject`]), written before each trim. What tells a
/// trim from a lost head for a shard that has applied nothing yet.
pub const SPEND_TRIMS_STREAM: &str = "SPEND_TRIMS";
pub(crate) const SPEND_TRIMS_SUBJECTS: &str = "adspend.spend-trims.*";
pub const DEADLETTER_STREAM: &str = "DEADLETTER";
pub(crate) const DEADLETTER_SUBJECTS: &str = "deadletter.>";
pub const ALERTS_STREAM: &str = "ALERTS";
pub const ALERTS_SUBJECTS: &str = "adspend.alerts.>";
/// Budget alerts per limit on `ALERTS` (`adspend.alerts.<limit id>`).
pub(crate) const ALERTS_SUBJECT_PREFIX: &str = "adspend.alerts";
/// How long `ALERTS` remembers a message id: a second announcement of the
/// same crossing within it is dropped by the server. Past it, announcers
/// compare with the subject's last message instead (docs/BUDGET-ALERTS.md).
pub(crate) const ALERTS_DUPLICATE_WINDOW: Duration = Duration::from_secs(48 * 3600);
/// Alerts kept per limit (the newest; the last one always).
pub(crate) const ALERTS_PER_LIMIT: i64 = 1000;
/// Core NATS subject prefix for sum pushes (aggregator → pacer).
pub const SUMS_SUBJECT_PREFIX: &str = "adspend.sums";
/// Core NATS subject on which a pacer asks every aggregator for its full state.
pub const SUMS_RESYNC_SUBJECT: &str = "adspend.resync";
/// Core NATS subject of the limiters' per-source reports (limiter → pacer,
/// `adspend_wire::source_report`).
pub const SOURCES_SUBJECT: &str = "adspend.sources";

/// Core NATS subject prefix of the aggregators' progress reports
/// (aggregator → limiter, [`Progress`]), one subject per shard.
pub const PROGRESS_SUBJECT_PREFIX: &str = "adspend.progress";

/// How far one aggregator shard has applied `SPEND`: every message of its
/// partitions up to `applied_seq` is in its sums. The limiters hold a
/// flooding source back while what they published is far ahead of this
/// (fair scheduling); a lost report only delays that by one interval.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Progress {
    /// The shard's partitions; `None` for all of them.
    pub partitions: Option<Vec<u32>>,
    pub applied_seq: u64,
}

impl Progress {
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a progress report serializes")
    }

    pub fn decode(bytes: &[u8]) -> std::result::Result<Progress, serde_json::Error> {
        serde_json::from_slice(bytes)
    }
}

pub fn progress_subject(shard: &str) -> String {
    format!("{PROGRESS_SUBJECT_PREFIX}.{shard}")
}

pub fn spend_subject(partition: u32) -> String {
    format!("spend.{partition}")
}

/// The subject of `SPEND_TRIMS` that says below which sequence `part`
/// (a partition's number, or `all` for every partition) was trimmed.
pub fn spend_trim_subject(part: &str) -> String {
    format!("adspend.spend-trims.{part}")
}

pub fn alert_subject(limit_id: &str) -> String {
    format!("{ALERTS_SUBJECT_PREFIX}.{limit_id}")
}

pub fn sums_subject(shard: &str) -> String {
    format!("{SUMS_SUBJECT_PREFIX}.{shard}")
}

/// Connect, failing with one clear error when the server cannot be reached
/// or a setting is wrong. Once connected, the client reconnects by itself
/// forever: a NATS restart must not stop the services.
pub async fn connect(nats: &NatsArgs, name: &str) -> Result<async_nats::Client> {
    let url = nats.nats_url.as_str();
    let fail = |source: async_nats::ConnectError| Error::NatsConnect {
        url: url.to_string(),
        source,
    };
    let options = options(nats)?
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None)
        .request_timeout(Some(Duration::from_secs(10)));
    // A comma-separated list names several servers of one cluster.
    let servers: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let connect = options.connect(servers);
    match tokio::time::timeout(Duration::from_secs(10), connect).await {
        Ok(Ok(client)) => {
            report_authentication(&client, nats, name);
            for kind in ["publish", "subscribe"] {
                metrics::counter!(NATS_PERMISSION_VIOLATIONS_TOTAL, "kind" => kind).increment(0);
            }
            Ok(client)
        }
        Ok(Err(e)) => Err(fail(e)),
        Err(_) => Err(fail(async_nats::ConnectError::new(
            async_nats::ConnectErrorKind::TimedOut,
        ))),
    }
}

/// Says loudly, in the log and in [`NATS_UNAUTHENTICATED`], when the server
/// just connected to lets clients in without authentication: then anyone
/// who reaches it, an ad server included, may publish on any subject, e.g.
/// a sum push with a huge owner epoch that freezes a limit in the pacer.
/// Either sign is enough: the server's INFO does not ask for credentials,
/// or this service has none configured and was let in all the same.
fn report_authentication(client: &async_nats::Client, nats: &NatsArgs, service: &str) {
    let server_requires_auth = client.server_info().auth_required;
    let has_credentials = nats.nats_user.is_some() || nats.nats_tls_cert.is_some();
    let open = !server_requires_auth || !has_credentials;
    metrics::gauge!(NATS_UNAUTHENTICATED).set(if open { 1.0 } else { 0.0 });
    if open {
        tracing::error!(
            service,
            url = %nats.nats_url,
            server_requires_auth,
            has_credentials,
            "NATS accepts clients without authentication: any client that reaches it, \
             an ad server included, can publish spend, forge sum pushes to the pacer or \
             delete streams; run NATS with the least-privilege users of \
             deploy/nats-auth.conf (bash scripts/nats-auth.sh DIR writes its config) and \
             give each service its ADSPEND_NATS_USER, ADSPEND_NATS_PASSWORD and \
             ADSPEND_NATS_TLS_CA (docs/SECURITY.md)"
        );
    }
}

/// What the server refused for lack of permission, from the client's event:
/// (`publish` or `subscribe`, the subject), or `None` for any other event.
/// The server says so only in an asynchronous `-ERR`; a refused request
/// gets no answer and times out, so without this the cause shows nowhere
/// but the client's generic INFO line.
fn permission_violation(event: &async_nats::Event) -> Option<(&'static str, &str)> {
    let async_nats::Event::ServerError(async_nats::ServerError::Other(text)) = event else {
        return None;
    };
    // `Permissions Violation for Publish to "<subject>"` (or `Subscription`).
    let rest = text
        .trim_matches('\'')
        .strip_prefix("Permissions Violation for ")?;
    let (kind, subject) = if let Some(subject) = rest.strip_prefix("Publish to ") {
        ("publish", subject)
    } else if let Some(subject) = rest.strip_prefix("Subscription to ") {
        ("subscribe", subject)
    } else {
        ("other", rest)
    };
    Some((kind, subject.trim_matches('"')))
}

/// A refused operation is a missing grant (deploy/nats-auth.conf) or a call
/// the service should not make: loud, counted, naming what was refused.
fn report_denied(event: &async_nats::Event) {
    if let Some((kind, subject)) = permission_violation(event) {
        metrics::counter!(NATS_PERMISSION_VIOLATIONS_TOTAL, "kind" => kind).increment(1);
        tracing::warn!(
            kind,
            subject,
            "NATS permission denied: this service's NATS user lacks a grant it needs \
             (deploy/nats-auth.conf); the refused call gets no answer"
        );
    }
}

/// Whether the client has connected again since this was made. A server
/// that restarted has lost what it held for the client (ephemeral
/// consumers, acknowledgements it owed), and the client does not say so:
/// who waits on such a thing watches for the reconnect.
pub struct Reconnect<'a> {
    statistics: &'a async_nats::Statistics,
    connects: u64,
}

impl<'a> Reconnect<'a> {
    /// How often [`Reconnect::wait`] looks.
    const CHECK: Duration = Duration::from_millis(50);

    /// Watches for the next reconnect of the client `statistics` belong to.
    pub fn from_now(statistics: &'a async_nats::Statistics) -> Self {
        Reconnect {
            connects: statistics.connects.load(Ordering::Relaxed),
            statistics,
        }
    }

    pub fn happened(&self) -> bool {
        self.statistics.connects.load(Ordering::Relaxed) != self.connects
    }

    /// Resolves once it has happened.
    pub async fn wait(&self) {
        while !self.happened() {
            tokio::time::sleep(Self::CHECK).await;
        }
    }
}

/// The reply subjects of a client that logs in as `user`:
/// `_INBOX_<user>.…`. The server lets each user subscribe only below its
/// own prefix (deploy/nats-auth.conf), so no user can read another's
/// replies (JetStream acks, API answers, pulled messages). An ad server
/// with its own NATS client sets the same prefix for its user.
pub fn inbox_prefix(user: &str) -> String {
    format!("_INBOX_{user}")
}

/// Credentials and TLS of `nats`, checked before any connection attempt so
/// that a wrong setting is reported by its name, not as a failed handshake.
pub fn options(nats: &NatsArgs) -> Result<async_nats::ConnectOptions> {
    install_crypto_provider();
    let mut options = async_nats::ConnectOptions::new().event_callback(|event| async move {
        report_denied(&event);
    });
    match (&nats.nats_user, &nats.nats_password) {
        (Some(user), Some(password)) => {
            if user.is_empty() {
                return Err(config_error(env::NATS_USER, user, "empty"));
            }
            // It becomes a subject token of the inbox prefix.
            if user
                .chars()
                .any(|c| c.is_whitespace() || matches!(c, '.' | '*' | '>'))
            {
                return Err(config_error(
                    env::NATS_USER,
                    user,
                    "may not hold whitespace, '.', '*' or '>'",
                ));
            }
            options = options
                .user_and_password(user.clone(), password.clone())
                .custom_inbox_prefix(inbox_prefix(user));
        }
        (None, None) => {}
        (Some(user), None) => {
            return Err(config_error(
                env::NATS_USER,
                user,
                "ADSPEND_NATS_PASSWORD is not set",
            ))
        }
        // The password itself is never echoed.
        (None, Some(_)) => {
            return Err(config_error(
                env::NATS_PASSWORD,
                "<redacted>",
                "ADSPEND_NATS_USER is not set",
            ))
        }
    }
    if let Some(ca) = &nats.nats_tls_ca {
        check_pem(env::NATS_TLS_CA, ca, &["-----BEGIN CERTIFICATE-----"])?;
        options = options.add_root_certificates(ca.clone()).require_tls(true);
    }
    match (&nats.nats_tls_cert, &nats.nats_tls_key) {
        (Some(cert), Some(key)) => {
            check_pem(env::NATS_TLS_CERT, cert, &["-----BEGIN CERTIFICATE-----"])?;
            check_pem(env::NATS_TLS_KEY, key, &["PRIVATE KEY-----"])?;
            options = options
                .add_client_certificate(cert.clone(), key.clone())
                .require_tls(true);
        }
        (None, None) => {}
        (Some(cert), None) => {
            return Err(config_error(
                env::NATS_TLS_CERT,
                &cert.display().to_string(),
                "ADSPEND_NATS_TLS_KEY is not set",
            ))
        }
        (None, Some(key)) => {
            return Err(config_error(
                env::NATS_TLS_KEY,
                &key.display().to_string(),
                "ADSPEND_NATS_TLS_CERT is not set",
            ))
        }
    }
    Ok(options)
}

/// rustls picks its crypto by crate features; the workspace enables both
/// `ring` (async-nats) and `aws-lc-rs` (the AWS and HTTP clients), and then
/// a TLS handshake panics unless the process chose one. `ring` is the one
/// async-nats (and etcd-client's `tls-ring`) are built for; a provider
/// already chosen elsewhere is kept.
pub(crate) fn install_crypto_provider() {
    let _ = async_nats::rustls::crypto::ring::default_provider().install_default();
}

fn config_error(name: &'static str, value: &str, reason: &str) -> Error {
    Error::Config {
        name,
        value: value.to_string(),
        reason: reason.to_string(),
    }
}

/// The file is readable and holds one of `markers` (PEM armour); its
/// contents are never part of the error.
fn check_pem(name: &'static str, path: &Path, markers: &[&str]) -> Result<()> {
    let value = path.display().to_string();
    let text = std::fs::read_to_string(path)
        .map_err(|e| config_error(name, &value, &format!("cannot read: {e}")))?;
    if !markers.iter().any(|m| text.contains(m)) {
        return Err(config_error(
            name,
            &value,
            &format!("not a PEM file (no {:?})", markers[0]),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_publish_or_subscription_is_told_apart_from_other_events() {
        let event = |text: &str| {
            async_nats::Event::ServerError(async_nats::ServerError::Other(text.to_string()))
        };
        assert_eq!(
            permission_violation(&event(
                "Permissions Violation for Publish to \"$JS.API.STREAM.MSG.GET.SPEND\""
            )),
            Some(("publish", "$JS.API.STREAM.MSG.GET.SPEND"))
        );
        assert_eq!(
            permission_violation(&event(
                "'Permissions Violation for Subscription to \"_INBOX.x\"'"
            )),
            Some(("subscribe", "_INBOX.x"))
        );
        assert_eq!(
            permission_violation(&event("Maximum Payload Violation")),
            None
        );
        assert_eq!(permission_violation(&async_nats::Event::Disconnected), None);
    }

    #[tokio::test]
    async fn a_reconnect_is_seen_from_the_moment_it_was_watched() {
        let statistics = async_nats::Statistics::default();
        statistics.connects.store(1, Ordering::Relaxed);
        let reconnect = Reconnect::from_now(&statistics);
        assert!(!reconnect.happened());
        statistics.connects.fetch_add(1, Ordering::Relaxed);
        assert!(reconnect.happened());
        reconnect.wait().await;
        assert!(!Reconnect::from_now(&statistics).happened());
    }
}
