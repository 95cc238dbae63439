//! A real single-member `etcd` for one test.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use adspend_common::config::EtcdArgs;
use anyhow::{bail, Context};
// etcd's JSON gateway carries keys and values as standard base64 with padding.
use base64::engine::general_purpose::STANDARD as BASE64;
use base64::Engine as _;
use serde_json::json;
use tempfile::TempDir;

use super::ports::free_port;
use super::process::clean_env;
use super::scratch::scratch_dir;
use super::server::{Server, ServerSpec};
use super::tls::CertPair;
use super::tools::tool_path;
use super::wait::http_client;

/// A single-member etcd cluster on free loopback ports, its data in a
/// temporary directory that outlives `kill()` so `restart()` comes back with
/// the same keys and revisions, as a crashed production member would. A
/// paused member (`pause()`) lets leases held by services expire while
/// their connections look alive.
///
/// Killed and its directory removed on `Drop`.
pub type Etcd = Server<EtcdSpec>;

/// What a TLS etcd ([`Etcd::start_tls`]) presents and trusts.
#[derive(Clone, Debug)]
pub struct EtcdTls {
    /// The CA clients must be signed by (`--trusted-ca-file`).
    pub ca: PathBuf,
    /// The server's own certificate, for 127.0.0.1.
    pub server: CertPair,
    /// A client certificate from `ca`, for the harness's own probes and
    /// writes.
    pub client: CertPair,
}

impl Server<EtcdSpec> {
    /// Starts etcd and returns once it has elected itself leader and
    /// reports healthy.
    ///
    /// # Panics
    ///
    /// If `etcd` is missing or does not start; the message carries its log
    /// tail.
    pub async fn start() -> Etcd {
        Self::start_with(None).await
    }

    /// An etcd that serves clients over TLS only (`https://`) and requires
    /// a client certificate signed by `tls.ca` (`--client-cert-auth`).
    /// Readiness is probed on a separate plain listener that serves only
    /// `/health` and `/metrics`, and through the services' own connect path.
    /// [`Etcd::put`] and [`Etcd::get`] go through that path too.
    ///
    /// # Panics
    ///
    /// As [`Etcd::start`].
    pub async fn start_tls(tls: EtcdTls) -> Etcd {
        Self::start_with(Some(tls)).await
    }

    async fn start_with(tls: Option<EtcdTls>) -> Etcd {
        static MEMBERS: AtomicU32 = AtomicU32::new(0);
        let dir = scratch_dir("etcd");
        // Unique per member so the readiness probe can tell this etcd from
        // another one that took its port.
        let name = format!(
            "adspend-test-{}-{}",
            std::process::id(),
            MEMBERS.fetch_add(1, Ordering::Relaxed)
        );
        let spec = EtcdSpec {
            binary: tool_path("etcd"),
            name,
            data_dir: dir.path().join("data"),
            log_path: dir.path().join("etcd.log"),
            client_port: 0,
            peer_port: 0,
            metrics_port: 0,
            tls,
            _dir: dir,
        };
        Server::launch(spec).await
    }

    /// The client endpoint, `http://127.0.0.1:PORT` (`https://` with TLS);
    /// stable across restarts.
    pub fn endpoints(&self) -> String {
        self.spec().client_url()
    }

    /// Settings that reach this etcd: with TLS, the CA and the harness's
    /// client certificate.
    pub fn client_args(&self) -> EtcdArgs {
        self.spec().client_args()
    }

    /// The member's data, for tests that inspect or damage it on disk.
    pub fn data_dir(&self) -> &Path {
        &self.spec().data_dir
    }

    /// Whether etcd answers `/health` with `"health":"true"` right now; for
    /// tests that watch it come and go.
    pub async fn is_healthy(&self) -> bool {
        self.spec().healthy().await
    }

    /// Writes a key through etcd's JSON gateway, so tests can seed or
    /// tamper with state without a gRPC client.
    ///
    /// # Errors
    ///
    /// If etcd is unreachable or refuses the write.
    pub async fn put(&self, key: &str, value: &[u8]) -> anyhow::Result<()> {
        if self.spec().tls.is_some() {
            let mut client = adspend_common::etcd::connect(
                &self.client_args(),
                &adspend_common::etcd::Background::own(),
            )
            .await?;
            client.put(key, value, None).await?;
            return Ok(());
        }
        let body = json!({
            "key": BASE64.encode(key.as_bytes()),
            "value": BASE64.encode(value),
        });
        self.gateway("kv/put", body).await.map(drop)
    }

    /// Compacts etcd's history up to its current revision (physically, so
    /// the old revisions are gone when this returns), as an operator's
    /// `etcdctl compact` or etcd's auto-compaction would. Returns that revision.
    ///
    /// # Errors
    ///
    /// If etcd is unreachable or refuses the compaction.
    pub async fn compact(&self) -> anyhow::Result<i64> {
        let mut client = adspend_common::etcd::connect(
            &self.client_args(),
            &adspend_common::etcd::Background::own(),
        )
        .await?;
        let revision = client
            .get("/", None)
            .await?
            .header()
            .map(|h| h.revision())
            .context("etcd answered without a header")?;
        client
            .compact(
                revision,
                Some(etcd_client::CompactionOptions::new().with_physical()),
            )
            .await?;
        Ok(revision)
    }

    /// Reads a key through etcd's JSON gateway; `None` if absent.
    ///
    /// # Errors
    ///
    /// If etcd is unreachable or the answer is malformed.
    pub async fn get(&self, key: &str) -> anyhow::Result<Option<Vec<u8>>> {
        if self.spec().tls.is_some() {
            let mut client = adspend_common::etcd::connect(
                &self.client_args(),
                &adspend_common::etcd::Background::own(),
            )
            .await?;
            let response = client.get(key, None).await?;
            return Ok(response.kvs().first().map(|kv| kv.value().to_vec()));
        }
        let body = json!({ "key": BASE64.encode(key.as_bytes()) });
        let answer = self.gateway("kv/range", body).await?;
        let Some(value) = answer["kvs"].get(0).map(|kv| &kv["value"]) else {
            return Ok(None);
        };
        // The gateway omits empty values altogether.
        let encoded = value.as_str().unwrap_or("");
        BASE64
            .decode(encoded)
            .map(Some)
            .with_context(|| format!("etcd returned a value that is not base64: {encoded:?}"))
    }

    /// Every key under `prefix` with its value and lease, in key order,
    /// through etcd's JSON gateway.
    ///
    /// # Errors
    ///
    /// If etcd is unreachable or the answer is malformed.
    pub async fn get_prefix(&self, prefix: &str) -> anyhow::Result<Vec<(String, Vec<u8>, i64)>> {
        // The range [prefix, prefix with its last byte + 1) holds exactly
        // the keys that start with it.
        let mut end = prefix.as_bytes().to_vec();
        let last = end.pop().context("empty prefix")?;
        end.push(last + 1);
        let body = json!({
            "key": BASE64.encode(prefix.as_bytes()),
            "range_end": BASE64.encode(&end),
        });
        let answer = self.gateway("kv/range", body).await?;
        let mut kvs = Vec::new();
        for kv in answer["kvs"].as_array().into_iter().flatten() {
            let key = BASE64.decode(kv["key"].as_str().unwrap_or(""))?;
            let value = BASE64.decode(kv["value"].as_str().unwrap_or(""))?;
            // int64 fields come as strings through the gateway.
            let lease = kv["lease"]
                .as_str()
                .and_then(|l| l.parse().ok())
                .or_else(|| kv["lease"].as_i64())
                .unwrap_or(0);
            kvs.push((String::from_utf8(key)?, value, lease));
        }
        Ok(kvs)
    }

    async fn gateway(
        &self,
        path: &str,
        body: serde_json::Value,
    ) -> anyhow::Result<serde_json::Value> {
        let url = format!("{}/v3/{path}", self.endpoints());
        let response = http_client()
            .post(&url)
            .json(&body)
            .send()
            .await
            .with_context(|| format!("POST {url}"))?;
        let status = response.status();
        let text = response.text().await.context("read etcd's answer")?;
        if !status.is_success() {
            bail!("POST {url}: {status}: {text}");
        }
        serde_json::from_str(&text).with_context(|| format!("POST {url}: not JSON: {text}"))
    }
}

/// How [`Etcd`] starts and probes `etcd`.
pub struct EtcdSpec {
    binary: PathBuf,
    name: String,
    data_dir: PathBuf,
    log_path: PathBuf,
    client_port: u16,
    peer_port: u16,
    /// Plain `/health` and `/metrics` (TLS only; otherwise the client port
    /// serves them).
    metrics_port: u16,
    tls: Option<EtcdTls>,
    /// Owns everything above; last so it is removed last.
    _dir: TempDir,
}

impl EtcdSpec {
    fn client_url(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        format!("{scheme}://127.0.0.1:{}", self.client_port)
    }

    fn client_args(&self) -> EtcdArgs {
        let mut args = EtcdArgs::plain(self.client_url());
        if let Some(tls) = &self.tls {
            args.etcd_tls_ca = Some(tls.ca.clone());
            args.etcd_tls_cert = Some(tls.client.cert.clone());
            args.etcd_tls_key = Some(tls.client.key.clone());
        }
        args
    }

    async fn healthy(&self) -> bool {
        let port = if self.tls.is_some() {
            self.metrics_port
        } else {
            self.client_port
        };
        let url = format!("http://127.0.0.1:{port}/health");
        let Ok(response) = http_client().get(&url).send().await else {
            return false;
        };
        if !response.status().is_success() {
            return false;
        }
        let Ok(health) = response.json::<serde_json::Value>().await else {
            return false;
        };
        health["health"] == "true"
    }

    /// The port may belong to another etcd that took it first.
    async fn is_this_member(&self) -> bool {
        if self.tls.is_some() {
            let Ok(mut client) = adspend_common::etcd::connect(
                &self.client_args(),
                &adspend_common::etcd::Background::own(),
            )
            .await
            else {
                return false;
            };
            let Ok(list) = client.member_list().await else {
                return false;
            };
            return list.members().iter().any(|m| m.name() == self.name);
        }
        let url = format!(
            "http://127.0.0.1:{}/v3/cluster/member/list",
            self.client_port
        );
        let Ok(response) = http_client().post(&url).json(&json!({})).send().await else {
            return false;
        };
        let Ok(list) = response.json::<serde_json::Value>().await else {
            return false;
        };
        list["members"].as_array().is_some_and(|members| {
            members
                .iter()
                .any(|member| member["name"] == self.name.as_str())
        })
    }

    async fn ready(&self) -> bool {
        self.healthy().await && self.is_this_member().await
    }
}

impl ServerSpec for EtcdSpec {
    const NAME: &'static str = "etcd";

    fn pick_ports(&mut self) {
        self.client_port = free_port();
        self.peer_port = free_port();
        self.metrics_port = free_port();
    }

    fn port(&self) -> u16 {
        self.client_port
    }

    fn command(&self) -> Command {
        let client_url = self.client_url();
        let peer_url = format!("http://127.0.0.1:{}", self.peer_port);
        let mut command = Command::new(&self.binary);
        // A developer's ETCD_* variables would override these flags.
        clean_env(&mut command);
        command
            .arg("--name")
            .arg(&self.name)
            .arg("--data-dir")
            .arg(&self.data_dir)
            .arg("--listen-client-urls")
            .arg(&client_url)
            .arg("--advertise-client-urls")
            .arg(&client_url)
            .arg("--listen-peer-urls")
            .arg(&peer_url)
            .arg("--initial-advertise-peer-urls")
            .arg(&peer_url)
            .arg("--initial-cluster")
            .arg(format!("{}={peer_url}", self.name))
            .arg("--initial-cluster-state")
            .arg("new")
            .arg("--initial-cluster-token")
            .arg(&self.name)
            .arg("--logger")
            .arg("zap")
            .arg("--log-outputs")
            .arg("stderr");
        if let Some(tls) = &self.tls {
            command
                .arg("--client-cert-auth")
                .arg("--trusted-ca-file")
                .arg(&tls.ca)
                .arg("--cert-file")
                .arg(&tls.server.cert)
                .arg("--key-file")
                .arg(&tls.server.key)
                .arg("--listen-metrics-urls")
                .arg(format!("http://127.0.0.1:{}", self.metrics_port));
        }
        command
    }

    fn log_path(&self) -> &Path {
        &self.log_path
    }

    fn probe(&self) -> impl Future<Output = bool> + '_ {
        self.ready()
    }
}
