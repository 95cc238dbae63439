//! A real `nats-server` with JetStream for one test.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};

use tempfile::TempDir;

use super::ports::free_port;
use super::process::clean_env;
use super::scratch::scratch_dir;
use super::server::{Server, ServerSpec};
use super::tools::tool_path;
use super::wait::{accepts_tcp, http_client};

/// How a test's server differs from the default one.
#[derive(Clone, Debug, Default)]
pub struct NatsOptions {
    /// Leave fsync to nats-server's default interval instead of `always`.
    ///
    /// Faster, but a `kill()` can then lose messages the server already
    /// acknowledged, so only tests that never crash the server should set
    /// it: exactly-once tests rely on an ack meaning "on disk".
    pub lazy_sync: bool,
    /// Appended verbatim to the generated config file, for settings only a
    /// few tests need (limits, accounts).
    pub extra_config: String,
    /// The JetStream domain this server serves (`jetstream { domain }`), so
    /// that servers linked by leaf nodes reach each other's JetStream as
    /// `$JS.<domain>.API`.
    pub jetstream_domain: Option<String>,
}

/// A JetStream-enabled `nats-server` on free loopback ports, with its store
/// in a temporary directory that outlives `kill()` so `restart()` recovers
/// the same streams, as a crashed production server would.
///
/// Killed and its directory removed on `Drop`.
pub type NatsServer = Server<NatsSpec>;

impl Server<NatsSpec> {
    /// Starts a server with the default options (fsync on every write) and
    /// returns once JetStream is serving.
    ///
    /// # Panics
    ///
    /// If `nats-server` is missing or does not start; the message carries
    /// its log tail.
    pub async fn start() -> NatsServer {
        NatsServer::start_with(NatsOptions::default()).await
    }

    /// Like [`NatsServer::start`], with options.
    ///
    /// # Panics
    ///
    /// As [`NatsServer::start`].
    pub async fn start_with(options: NatsOptions) -> NatsServer {
        static SERVERS: AtomicU32 = AtomicU32::new(0);
        let dir = scratch_dir("nats");
        let spec = NatsSpec {
            binary: tool_path("nats-server"),
            server_name: format!(
                "adspend-test-{}-{}",
                std::process::id(),
                SERVERS.fetch_add(1, Ordering::Relaxed)
            ),
            config_path: dir.path().join("nats.conf"),
            store_dir: dir.path().join("store"),
            log_path: dir.path().join("nats-server.log"),
            options,
            port: 0,
            monitor_port: 0,
            _dir: dir,
        };
        Server::launch(spec).await
    }

    /// The client URL, `nats://127.0.0.1:PORT`; stable across restarts.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port())
    }

    /// The monitoring endpoint (`/varz`, `/jsz`, `/healthz`), for tests that
    /// assert on server-side state such as a consumer's pending count.
    pub fn monitor_url(&self) -> String {
        format!("http://127.0.0.1:{}", self.spec().monitor_port)
    }

    /// JetStream's store, for tests that inspect or damage it on disk.
    pub fn store_dir(&self) -> &Path {
        &self.spec().store_dir
    }
}

/// How [`NatsServer`] starts and probes `nats-server`.
pub struct NatsSpec {
    binary: PathBuf,
    /// Unique, so the readiness probe can tell this server from another one
    /// that took its port.
    server_name: String,
    config_path: PathBuf,
    store_dir: PathBuf,
    log_path: PathBuf,
    options: NatsOptions,
    port: u16,
    monitor_port: u16,
    /// Owns everything above; last so it is removed last.
    _dir: TempDir,
}

impl NatsSpec {
    fn config(&self) -> String {
        let sync = if self.options.lazy_sync {
            ""
        } else {
            "  sync_interval: always\n"
        };
        let domain = match &self.options.jetstream_domain {
            Some(domain) => format!("  domain: {domain:?}\n"),
            None => String::new(),
        };
        // Paths are written as quoted strings; Debug formatting escapes
        // quotes and backslashes the way nats-server's parser expects.
        format!(
            "server_name: {name:?}\n\
             listen: \"127.0.0.1:{port}\"\n\
             http: \"127.0.0.1:{monitor}\"\n\
             max_payload: 8MB\n\
             jetstream {{\n  store_dir: {store:?}\n{domain}{sync}}}\n\
             {extra}\n",
            name = self.server_name,
            port = self.port,
            monitor = self.monitor_port,
            store = self.store_dir.to_string_lossy(),
            extra = self.options.extra_config,
        )
    }

    async fn serves_jetstream(&self) -> bool {
        if !accepts_tcp(self.port).await {
            return false;
        }
        let client = http_client();
        let health = format!(
            "http://127.0.0.1:{}/healthz?js-enabled-only=true",
            self.monitor_port
        );
        match client.get(&health).send().await {
            Ok(response) if response.status().is_success() => {}
            _ => return false,
        }
        // The port may belong to another server that took it first.
        let varz = format!("http://127.0.0.1:{}/varz", self.monitor_port);
        let Ok(response) = client.get(&varz).send().await else {
            return false;
        };
        let Ok(varz) = response.json::<serde_json::Value>().await else {
            return false;
        };
        varz["server_name"] == self.server_name.as_str()
    }
}

impl ServerSpec for NatsSpec {
    const NAME: &'static str = "nats-server";

    fn pick_ports(&mut self) {
        self.port = free_port();
        self.monitor_port = free_port();
        let config = self.config();
        std::fs::write(&self.config_path, config)
            .unwrap_or_else(|err| panic!("write {}: {err}", self.config_path.display()));
    }

    fn port(&self) -> u16 {
        self.port
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.binary);
        clean_env(&mut command);
        command.arg("--config").arg(&self.config_path);
        command
    }

    fn log_path(&self) -> &Path {
        &self.log_path
    }

    fn probe(&self) -> impl Future<Output = bool> + '_ {
        self.serves_jetstream()
    }
}
