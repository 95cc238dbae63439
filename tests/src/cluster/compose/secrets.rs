//! The credentials `scripts/cluster.sh` generates for the host's clients
//! (deploy/.secrets, git-ignored): each role's `ADSPEND_NATS_*` settings in
//! `<role>.env`, with the host's paths and `nats://127.0.0.1:4222`.

use std::path::PathBuf;

use adspend_common::config::NatsArgs;
use anyhow::Context;

use crate::harness::workspace_root;

/// Where `scripts/cluster.sh` writes the cluster's CA, certificates and
/// passwords, relative to the workspace.
pub const SECRETS_DIR: &str = "deploy/.secrets";

/// The NATS settings of `role` (`adserver`, `auditor`, ...) as the cluster's
/// clients on the host use them.
///
/// # Errors
///
/// If the env file is missing (the cluster was never started) or lacks a
/// setting.
pub fn nats_args(role: &str) -> anyhow::Result<NatsArgs> {
    let path = workspace_root()
        .join(SECRETS_DIR)
        .join(format!("{role}.env"));
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: run scripts/cluster.sh start first", path.display()))?;
    let value = |name: &str| -> anyhow::Result<String> {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix('='))
            .map(str::to_string)
            .with_context(|| format!("{} has no {name}", path.display()))
    };
    Ok(NatsArgs {
        nats_user: Some(value("ADSPEND_NATS_USER")?),
        nats_password: Some(value("ADSPEND_NATS_PASSWORD")?),
        nats_tls_ca: Some(PathBuf::from(value("ADSPEND_NATS_TLS_CA")?)),
        ..NatsArgs::plain(value("ADSPEND_NATS_URL")?)
    })
}

/// How a client on the host reaches pacer1's API (`../shared/CONTRACT.md`,
/// "Cluster"): from `pacer-client.env` when `scripts/cluster.sh` wrote one
/// (HTTPS with the cluster CA and a read token), else plain
/// `http://127.0.0.1:8080`.
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
    /// Reads `deploy/.secrets/pacer-client.env`.
    ///
    /// # Errors
    ///
    /// If the file exists but cannot be read or lacks `ADSPEND_PACER_URL`.
    pub fn load() -> anyhow::Result<PacerAccess> {
        let path = workspace_root().join(SECRETS_DIR).join("pacer-client.env");
        let text = match std::fs::read_to_string(&path) {
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

/// pacer1's API as the host reaches it now ([`PacerAccess::load`]; read
/// on each call, since `scripts/cluster.sh start` may write it meanwhile).
///
/// # Panics
///
/// If `pacer-client.env` exists but is unusable.
pub fn pacer() -> PacerAccess {
    PacerAccess::load().expect("deploy/.secrets/pacer-client.env")
}

/// [`pacer`]'s client with `timeout`.
///
/// # Panics
///
/// If the CA it names cannot be read.
pub fn pacer_client(timeout: std::time::Duration) -> reqwest::Client {
    pacer().client(timeout).expect("pacer client")
}
