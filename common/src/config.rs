//! Settings shared by several services. Each is a flag and an `ADSPEND_*`
//! environment variable (the flag wins), with a default that works on one
//! machine (CONTRACT.md).

use std::path::PathBuf;

use clap::Args;

use crate::env;
use crate::error::Error;

#[derive(Args, Clone)]
pub struct NatsArgs {
    /// NATS server URL(s), comma-separated.
    #[arg(
        long = "nats-url",
        env = env::NATS_URL,
        default_value = "nats://127.0.0.1:4222"
    )]
    pub nats_url: String,

    /// NATS user name (a user of the server's config file); needs
    /// ADSPEND_NATS_PASSWORD. Unset: connect without credentials.
    #[arg(long = "nats-user", env = env::NATS_USER)]
    pub nats_user: Option<String>,

    /// Password of ADSPEND_NATS_USER. Prefer the environment variable to the
    /// flag: a flag is visible in the process list. Never logged.
    #[arg(
        long = "nats-password",
        env = env::NATS_PASSWORD,
        hide_env_values = true
    )]
    pub nats_password: Option<String>,

    /// PEM file of the CA(s) to trust for the NATS server's certificate.
    /// Set: TLS is required, a server that does not offer it is refused.
    #[arg(long = "nats-tls-ca", env = env::NATS_TLS_CA)]
    pub nats_tls_ca: Option<PathBuf>,

    /// PEM client certificate, for a server that verifies clients (mutual
    /// TLS); needs ADSPEND_NATS_TLS_KEY.
    #[arg(long = "nats-tls-cert", env = env::NATS_TLS_CERT)]
    pub nats_tls_cert: Option<PathBuf>,

    /// PEM private key of ADSPEND_NATS_TLS_CERT.
    #[arg(long = "nats-tls-key", env = env::NATS_TLS_KEY)]
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
    #[arg(long = "stream-replicas", env = env::STREAM_REPLICAS, default_value_t = 1,
          value_parser = clap::value_parser!(u8).range(1..=5))]
    pub(crate) stream_replicas: u8,
}

impl StreamArgs {
    pub fn replicas(&self) -> usize {
        usize::from(self.stream_replicas)
    }
}

/// What the limiter's streams keep (docs/RETENTION.md). The limiter applies
/// them to `IMPRESSIONS` and `DEADLETTER` at every start; the aggregator
/// creates a missing `DEADLETTER` with the defaults.
#[derive(Args, Clone, Debug, PartialEq)]
pub struct RetentionArgs {
    /// How long acknowledged impressions stay in IMPRESSIONS (replay of
    /// set-aside input, forensics), in milliseconds; input not yet
    /// acknowledged is never removed, whatever its age.
    #[arg(long = "input-retention-ms", env = env::INPUT_RETENTION_MS,
          default_value_t = 3_600_000,
          value_parser = clap::value_parser!(u64).range(1_000..))]
    pub input_retention_ms: u64,
    /// Byte cap of IMPRESSIONS: once reached, NATS refuses ad servers'
    /// publishes (backpressure, never a drop) until the limiter catches up;
    /// acknowledged input is then removed before its retention ends. 0: no
    /// cap of its own (the NATS store's limit bounds it).
    #[arg(long = "input-max-bytes", env = env::INPUT_MAX_BYTES, default_value_t = 0)]
    pub input_max_bytes: u64,
    /// How long DEADLETTER keeps rejected input, in milliseconds.
    #[arg(long = "deadletter-retention-ms", env = env::DEADLETTER_RETENTION_MS,
          default_value_t = 604_800_000,
          value_parser = clap::value_parser!(u64).range(1_000..))]
    pub deadletter_retention_ms: u64,
    /// Byte cap of DEADLETTER: once reached, its oldest dead letters go
    /// first (bad input never stops the pipeline).
    #[arg(long = "deadletter-max-bytes", env = env::DEADLETTER_MAX_BYTES,
          default_value_t = 1 << 30,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub deadletter_max_bytes: u64,
}

impl RetentionArgs {
    pub fn input_retention(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.input_retention_ms)
    }
}

/// How far back the aggregator keeps `SPEND` (docs/RETENTION.md).
#[derive(Args, Clone, Debug, PartialEq)]
pub struct SpendTrimArgs {
    /// `checkpoint` (the default): after each checkpoint a shard trims its
    /// partitions below the oldest base snapshot it keeps, marking how far
    /// in `SPEND_TRIMS` first. `off`: never; SPEND grows without bound, and
    /// a shard whose snapshots are all gone can still be rebuilt by
    /// replaying it from sequence 1.
    #[arg(long = "spend-trim", env = env::SPEND_TRIM, value_enum,
          default_value_t = SpendTrim::Checkpoint)]
    pub spend_trim: SpendTrim,
}

/// See [`SpendTrimArgs`].
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpendTrim {
    Checkpoint,
    Off,
}
/// etcd's default `--quota-backend-bytes`: 2 GiB.
pub const ETCD_DEFAULT_QUOTA_BYTES: u64 = 2 << 30;

#[derive(Args, Clone, Debug, Default, PartialEq)]
pub struct EtcdArgs {
    /// Comma-separated etcd endpoints; empty means single-machine mode
    /// (checkpoint records kept in the data directory).
    #[arg(
        long = "etcd-endpoints",
        env = env::ETCD_ENDPOINTS,
        default_value = ""
    )]
    pub etcd_endpoints: String,

    /// PEM file of the CA(s) to trust for etcd's server certificate. Set:
    /// every endpoint is reached over TLS (`https://`, or no scheme).
    #[arg(long = "etcd-tls-ca", env = env::ETCD_TLS_CA)]
    pub etcd_tls_ca: Option<PathBuf>,

    /// PEM client certificate, for an etcd started with
    /// `--client-cert-auth`; needs ADSPEND_ETCD_TLS_KEY and ADSPEND_ETCD_TLS_CA.
    #[arg(long = "etcd-tls-cert", env = env::ETCD_TLS_CERT)]
    pub etcd_tls_cert: Option<PathBuf>,

    /// PEM private key of ADSPEND_ETCD_TLS_CERT.
    #[arg(long = "etcd-tls-key", env = env::ETCD_TLS_KEY)]
    pub etcd_tls_key: Option<PathBuf>,

    /// etcd's quota (its --quota-backend-bytes), which its API does not
    /// report: the services compare etcd's database size with it
    /// (adspend_etcd_db_size_bytes, adspend_etcd_quota_bytes). Default:
    /// etcd's own default, 2 GiB.
    #[arg(long = "etcd-quota-bytes", env = env::ETCD_QUOTA_BYTES,
          default_value_t = ETCD_DEFAULT_QUOTA_BYTES,
          value_parser = clap::value_parser!(u64).range(1..))]
    pub etcd_quota_bytes: u64,
}

/// The PEM contents behind [`EtcdArgs`]' TLS settings, read and checked.
#[derive(Clone)]
pub(crate) struct EtcdTlsFiles {
    pub(crate) ca: Vec<u8>,
    /// Client certificate and key, for mutual TLS.
    pub(crate) identity: Option<(Vec<u8>, Vec<u8>)>,
}

impl EtcdArgs {
    /// Only endpoints, no TLS: etcd on a trusted network or one machine.
    pub fn plain(endpoints: impl Into<String>) -> EtcdArgs {
        EtcdArgs {
            etcd_endpoints: endpoints.into(),
            ..EtcdArgs::default()
        }
    }

    /// [`EtcdArgs::etcd_quota_bytes`]; etcd's default where unset (0, as
    /// [`EtcdArgs::plain`] leaves it).
    pub fn quota_bytes(&self) -> u64 {
        match self.etcd_quota_bytes {
            0 => ETCD_DEFAULT_QUOTA_BYTES,
            quota => quota,
        }
    }

    pub fn endpoints(&self) -> Vec<String> {
        self.etcd_endpoints
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string)
            .collect()
    }

    pub fn validate(&self) -> Result<(), Error> {
        let tls = self.etcd_tls_ca.is_some();
        for endpoint in self.endpoints() {
            let scheme = endpoint.split_once("://").map(|(scheme, _)| scheme);
            let with_scheme = match scheme {
                Some(_) => endpoint.clone(),
                None => format!("http://{endpoint}"),
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
            let reason = match (scheme, tls) {
                (Some("http"), true) => Some(format!(
                    "{endpoint:?} is plain http while ADSPEND_ETCD_TLS_CA asks for TLS; use https://"
                )),
                (Some("https"), false) => Some(format!(
                    "{endpoint:?} is https but ADSPEND_ETCD_TLS_CA is not set (no CA to trust)"
                )),
                (Some(other), _) if other != "http" && other != "https" => {
                    Some(format!("{endpoint:?}: scheme must be http or https"))
                }
                _ => None,
            };
            if let Some(reason) = reason {
                return Err(Error::Config {
                    name: "ADSPEND_ETCD_ENDPOINTS",
                    value: self.etcd_endpoints.clone(),
                    reason,
                });
            }
        }
        self.tls_files().map(drop)
    }

    /// The TLS files, read and checked (`None` without ADSPEND_ETCD_TLS_CA).
    /// A wrong combination or an unreadable file is an error naming its
    /// setting; a file's contents are never part of the error.
    pub(crate) fn tls_files(&self) -> Result<Option<EtcdTlsFiles>, Error> {
        let identity = match (&self.etcd_tls_cert, &self.etcd_tls_key) {
            (Some(cert), Some(key)) => Some((
                read_pem("ADSPEND_ETCD_TLS_CERT", cert, "-----BEGIN CERTIFICATE-----")?,
                read_pem("ADSPEND_ETCD_TLS_KEY", key, "PRIVATE KEY-----")?,
            )),
            (None, None) => None,
            (Some(cert), None) => {
                return Err(Error::Config {
                    name: "ADSPEND_ETCD_TLS_CERT",
                    value: cert.display().to_string(),
                    reason: "ADSPEND_ETCD_TLS_KEY is not set".into(),
                })
            }
            (None, Some(key)) => {
                return Err(Error::Config {
                    name: "ADSPEND_ETCD_TLS_KEY",
                    value: key.display().to_string(),
                    reason: "ADSPEND_ETCD_TLS_CERT is not set".into(),
                })
            }
        };
        let Some(ca) = &self.etcd_tls_ca else {
            if let Some(cert) = &self.etcd_tls_cert {
                return Err(Error::Config {
                    name: "ADSPEND_ETCD_TLS_CERT",
                    value: cert.display().to_string(),
                    reason: "a client certificate needs TLS: set ADSPEND_ETCD_TLS_CA too".into(),
                });
            }
            return Ok(None);
        };
        Ok(Some(EtcdTlsFiles {
            ca: read_pem("ADSPEND_ETCD_TLS_CA", ca, "-----BEGIN CERTIFICATE-----")?,
            identity,
        }))
    }
}

/// The file's bytes if it is readable and holds `marker` (PEM armour).
fn read_pem(name: &'static str, path: &std::path::Path, marker: &str) -> Result<Vec<u8>, Error> {
    let fail = |reason: String| Error::Config {
        name,
        value: path.display().to_string(),
        reason,
    };
    let bytes = std::fs::read(path).map_err(|e| fail(format!("cannot read: {e}")))?;
    if !String::from_utf8_lossy(&bytes).contains(marker) {
        return Err(fail(format!("not a PEM file (no {marker:?})")));
    }
    Ok(bytes)
}

#[derive(Args, Clone, Debug)]
pub struct CatalogArgs {
    /// Catalog source: a file path, or etcd:///<key> (uses ADSPEND_ETCD_ENDPOINTS).
    #[arg(
        long = "catalog",
        env = env::CATALOG,
        default_value = "./catalog.json"
    )]
    pub(crate) catalog: String,
}

impl CatalogArgs {
    pub fn source(&self, etcd: &EtcdArgs) -> Result<CatalogSource, Error> {
        CatalogSource::parse(&self.catalog, etcd)
    }
}

/// Where the catalog comes from: [`CatalogArgs`] parsed. A setting only;
/// `catalog_source` watches it (that module depends on this one, never the
/// other way).
#[derive(Clone, Debug, PartialEq)]
pub enum CatalogSource {
    File(PathBuf),
    Etcd { etcd: EtcdArgs, key: String },
}

impl CatalogSource {
    /// `etcd:///<key>` or a path.
    pub(crate) fn parse(value: &str, etcd: &EtcdArgs) -> Result<Self, Error> {
        if let Some(key) = value.strip_prefix("etcd://") {
            if etcd.endpoints().is_empty() {
                return Err(Error::Config {
                    name: env::CATALOG,
                    value: value.to_string(),
                    reason: "an etcd catalog needs ADSPEND_ETCD_ENDPOINTS".into(),
                });
            }
            if !key.starts_with('/') || key.len() < 2 {
                return Err(Error::Config {
                    name: env::CATALOG,
                    value: value.to_string(),
                    reason: "expected etcd:///<key>, e.g. etcd:///adspend/catalog".into(),
                });
            }
            return Ok(CatalogSource::Etcd {
                etcd: etcd.clone(),
                key: key.to_string(),
            });
        }
        if value.is_empty() {
            return Err(Error::Config {
                name: env::CATALOG,
                value: value.into(),
                reason: "empty".into(),
            });
        }
        Ok(CatalogSource::File(PathBuf::from(value)))
    }

    pub fn describe(&self) -> String {
        match self {
            CatalogSource::File(path) => path.display().to_string(),
            CatalogSource::Etcd { key, .. } => format!("etcd://{key}"),
        }
    }
}

#[derive(Args, Clone, Debug)]
pub struct PartitionArgs {
    /// Number of spend partitions.
    #[arg(long = "partitions", env = env::PARTITIONS, default_value_t = 16,
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_with_clear_errors() {
        assert_eq!(
            CatalogSource::parse(
                "etcd:///adspend/catalog",
                &EtcdArgs::plain("127.0.0.1:2379")
            )
            .unwrap(),
            CatalogSource::Etcd {
                etcd: EtcdArgs::plain("127.0.0.1:2379"),
                key: "/adspend/catalog".into()
            }
        );
        let err = CatalogSource::parse("etcd:///adspend/catalog", &EtcdArgs::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(env::ETCD_ENDPOINTS), "{err}");
        let err = CatalogSource::parse("etcd://", &EtcdArgs::plain("e:1"))
            .unwrap_err()
            .to_string();
        assert!(err.contains("etcd:///<key>"), "{err}");
    }
}
