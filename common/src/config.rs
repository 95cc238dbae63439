//! Settings shared by several services. Each is a flag and an `ADSPEND_*`
//! environment variable (the flag wins), with a default that works on one
//! machine (CONTRACT.md).

use std::path::PathBuf;

use clap::Args;

use crate::catalog_source::CatalogSource;
use crate::error::Error;

#[derive(Args, Clone)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long = "nats-url",
        env = "ADSPEND_NATS_URL",
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,

    /// NATS user name (a user of the server's config file); needs
    /// ADSPEND_NATS_PASSWORD. Unset: connect without credentials.
    #[arg(long = "nats-user", env = "ADSPEND_NATS_USER")]
    pub nats_user: Option<String>,

    /// Password of ADSPEND_NATS_USER. Prefer the environment variable to the
    /// flag: a flag is visible in the process list. Never logged.
    #[arg(
        long = "nats-password",
        env = "ADSPEND_NATS_PASSWORD",
        hide_env_values = true
    )]
    pub nats_password: Option<String>,

    /// PEM file of the CA(s) to trust for the NATS server's certificate.
    /// Set: TLS is required, a server that does not offer it is refused.
    #[arg(long = "nats-tls-ca", env = "ADSPEND_NATS_TLS_CA")]
    pub nats_tls_ca: Option<PathBuf>,

    /// PEM client certificate, for a server that verifies clients (mutual
    /// TLS); needs ADSPEND_NATS_TLS_KEY.
    #[arg(long = "nats-tls-cert", env = "ADSPEND_NATS_TLS_CERT")]
    pub nats_tls_cert: Option<PathBuf>,

    /// PEM private key of ADSPEND_NATS_TLS_CERT.
    #[arg(long = "nats-tls-key", env = "ADSPEND_NATS_TLS_KEY")]
    pub nats_tls_key: Option<PathBuf>,
}

impl NatsArgs {
    /// Only a URL, no credentials and no TLS: the single-machine default.
    pub fn plain(url: impl Into<String>) -> NatsArgs {
        NatsArgs {
            nats_url: url.into(),
            nats_user: None,
            nats_password: None,
            nats_tls_ca: None,
            nats_tls_cert: None,
            nats_tls_key: None,
        }
    }
}

/// Written by hand so that a logged config never shows the password.
impl std::fmt::Debug for NatsArgs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsArgs")
            .field("nats_url", &self.nats_url)
            .field("nats_user", &self.nats_user)
            .field(
                "nats_password",
                &self.nats_password.as_ref().map(|_| "<redacted>"),
            )
            .field("nats_tls_ca", &self.nats_tls_ca)
            .field("nats_tls_cert", &self.nats_tls_cert)
            .field("nats_tls_key", &self.nats_tls_key)
            .finish()
    }
}

#[derive(Args, Clone, Debug)]
pub struct StreamArgs {
    /// Replicas of the JetStream streams this service creates when they are
    /// missing (3 on a three-node NATS cluster; 1 on a single server).
    #[arg(long = "stream-replicas", env = "ADSPEND_STREAM_REPLICAS", default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..=5))]
    pub stream_replicas: u8,
}

impl StreamArgs {
    pub fn replicas(&self) -> usize {
        usize::from(self.stream_replicas)
    }
}

#[derive(Args, Clone, Debug)]
pub struct EtcdArgs {
    /// Comma-separated etcd endpoints; empty means single-machine mode
    /// (checkpoint records kept in the data directory).
    #[arg(
        long = "etcd-endpoints",
        env = "ADSPEND_ETCD_ENDPOINTS",
        default_value = ""
    )]
    pub etcd_endpoints: String,
}

impl EtcdArgs {
    pub fn endpoints(&self) -> Vec<String> {
        self.etcd_endpoints
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    }

    pub fn validate(&self) -> Result<(), Error> {
        for endpoint in self.endpoints() {
            let with_scheme = if endpoint.contains("://") {
                endpoint.clone()
            } else {
                format!("http://{endpoint}")
            };
            let url = url::Url::parse(&with_scheme).map_err(|e| Error::Config {
                name: "ADSPEND_ETCD_ENDPOINTS",
                value: self.etcd_endpoints.clone(),
                reason: format!("{endpoint:?}: {e}"),
            })?;
            if url.port_or_known_default().is_none() || url.host_str().is_none() {
                return Err(Error::Config {
                    name: "ADSPEND_ETCD_ENDPOINTS",
                    value: self.etcd_endpoints.clone(),
                    reason: format!("{endpoint:?} has no host:port"),
                });
            }
        }
        Ok(())
    }
}

#[derive(Args, Clone, Debug)]
pub struct CatalogArgs {
    /// Catalog source: a file path, or etcd:///<key> (uses ADSPEND_ETCD_ENDPOINTS).
    #[arg(
        long = "catalog",
        env = "ADSPEND_CATALOG",
        default_value = "./catalog.json"
    )]
    pub catalog: String,
}

impl CatalogArgs {
    pub fn source(&self, etcd: &EtcdArgs) -> Result<CatalogSource, Error> {
        CatalogSource::parse(&self.catalog, etcd.endpoints())
    }
}

#[derive(Args, Clone, Debug)]
pub struct PartitionArgs {
    /// Number of spend partitions.
    #[arg(long = "partitions", env = "ADSPEND_PARTITIONS", default_value_t = 16,
          value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub partitions: u32,
}

/// `./data/<service>` unless set.
pub fn data_dir_or_default(data_dir: &Option<PathBuf>, service: &str) -> PathBuf {
    data_dir
        .clone()
        .unwrap_or_else(|| PathBuf::from("./data").join(service))
}

/// Parse a listen address with a clear error naming the setting.
pub fn parse_addr(name: &'static str, value: &str) -> Result<std::net::SocketAddr, Error> {
    value
        .parse()
        .map_err(|e: std::net::AddrParseError| Error::Config {
            name,
            value: value.to_string(),
            reason: e.to_string(),
        })
}
