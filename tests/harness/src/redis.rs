//! A real `redis-server` for one benchmark or test.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::ports::free_port;
use super::process::clean_env;
use super::scratch::scratch_dir;
use super::server::{Server, ServerSpec};
use super::tools::tool_path;

/// How long one readiness probe may take before it counts as "not yet".
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// A `redis-server` on a free loopback port, its data directory (AOF) in a
/// temporary directory that outlives `kill()` so `restart()` recovers what
/// was persisted, as a crashed production server would (after replaying its
/// append-only file, when durable).
///
/// Every setting is passed on the command line, so no config file a
/// developer keeps around can change it. Killed and its directory removed
/// on `Drop`.
pub type RedisServer = Server<RedisSpec>;

impl Server<RedisSpec> {
    /// Starts a server and returns once it answers commands.
    ///
    /// `durable`: `appendonly yes` with `appendfsync always`, so a reply
    /// means the write is on disk (Redis fsyncs once per event-loop turn,
    /// before answering the clients whose writes it holds). Otherwise no
    /// persistence at all (`appendonly no`, `save ""`): memory only.
    ///
    /// # Panics
    ///
    /// If `redis-server` is missing or does not start; the message carries
    /// its log tail.
    pub async fn start(durable: bool) -> RedisServer {
        let dir = scratch_dir("redis");
        // Redis reports its directory after chdir(), i.e. resolved; the
        // readiness probe compares against that form.
        let data_dir = dir.path().join("data");
        std::fs::create_dir(&data_dir)
            .unwrap_or_else(|err| panic!("create {}: {err}", data_dir.display()));
        let data_dir = data_dir
            .canonicalize()
            .unwrap_or_else(|err| panic!("resolve {}: {err}", data_dir.display()));
        let spec = RedisSpec {
            binary: tool_path("redis-server"),
            durable,
            data_dir,
            log_path: dir.path().join("redis-server.log"),
            port: 0,
            _dir: dir,
        };
        Server::launch(spec).await
    }

    /// The client URL, `redis://127.0.0.1:PORT/`; stable across restarts.
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port())
    }

    /// Whether writes are fsynced before Redis answers them.
    pub fn is_durable(&self) -> bool {
        self.spec().durable
    }

    /// Where the append-only file lives (empty when not durable).
    pub fn data_dir(&self) -> &Path {
        &self.spec().data_dir
    }
}

/// How [`RedisServer`] starts and probes `redis-server`.
pub struct RedisSpec {
    binary: PathBuf,
    durable: bool,
    /// Canonical, see `RedisServer::start`.
    data_dir: PathBuf,
    log_path: PathBuf,
    port: u16,
    /// Owns everything above; last so it is removed last.
    _dir: TempDir,
}

impl RedisSpec {
    /// Ready once `CONFIG GET dir` answers with our directory: that proves
    /// the server is done loading (it answers `-LOADING` before) and that
    /// the port is not another Redis that took it first.
    async fn serves_commands(&self) -> bool {
        let probe = async {
            let mut stream = TcpStream::connect(("127.0.0.1", self.port)).await.ok()?;
            stream
                .write_all(b"*3\r\n$6\r\nCONFIG\r\n$3\r\nGET\r\n$3\r\ndir\r\n")
                .await
                .ok()?;
            let dir = self.data_dir.to_string_lossy();
            let expected = format!("*2\r\n$3\r\ndir\r\n${}\r\n{dir}\r\n", dir.len());
            let mut reply = Vec::with_capacity(expected.len());
            let mut chunk = [0_u8; 512];
            while reply.len() < expected.len() {
                let read = stream.read(&mut chunk).await.ok()?;
                if read == 0 {
                    break;
                }
                reply.extend_from_slice(&chunk[..read]);
                // An error reply ends in one line; no need to wait for more.
                if reply.first() == Some(&b'-') && reply.ends_with(b"\r\n") {
                    break;
                }
            }
            Some(reply == expected.as_bytes())
        };
        matches!(
            tokio::time::timeout(PROBE_TIMEOUT, probe).await,
            Ok(Some(true))
        )
    }
}

impl ServerSpec for RedisSpec {
    const NAME: &'static str = "redis-server";

    fn pick_ports(&mut self) {
        self.port = free_port();
    }

    fn port(&self) -> u16 {
        self.port
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.binary);
        clean_env(&mut command);
        command
            .arg("--port")
            .arg(self.port.to_string())
            .arg("--bind")
            .arg("127.0.0.1")
            .arg("--dir")
            .arg(&self.data_dir)
            .arg("--daemonize")
            .arg("no")
            // Empty: log to stdout, which the harness sends to the log file.
            .arg("--logfile")
            .arg("")
            .arg("--save")
            .arg("");
        if self.durable {
            command
                .arg("--appendonly")
                .arg("yes")
                .arg("--appendfsync")
                .arg("always");
        } else {
            command.arg("--appendonly").arg("no");
        }
        command
    }

    fn log_path(&self) -> &Path {
        &self.log_path
    }

    fn probe(&self) -> impl Future<Output = bool> + '_ {
        self.serves_commands()
    }
}
