//! Starting a server process and waiting until it is really serving.

use std::future::Future;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

use nix::sys::signal::Signal;
use tokio::time::{sleep, timeout_at, Instant};

use super::process::{describe, log_tail, report_if_panicking, ManagedChild};

/// Upper bound for a server to become ready. Generous because the suite
/// shares two cores with a compiler; a healthy start takes well under a
/// second (nats, etcd) or a few seconds (moto's Python imports).
pub(crate) const STARTUP_TIMEOUT: Duration = Duration::from_secs(60);

/// How often a starting server is probed.
const PROBE_INTERVAL: Duration = Duration::from_millis(50);

/// First starts pick new ports this many times before giving up.
pub(crate) const FIRST_START_ATTEMPTS: u32 = 4;

/// Restarts keep their ports, so they can only wait for a port to be let go.
pub(crate) const RESTART_ATTEMPTS: u32 = 5;
pub(crate) const RESTART_BACKOFF: Duration = Duration::from_millis(300);

pub(crate) enum LaunchFailure {
    /// The process died before it was ready, usually because another
    /// process took its port between `free_port()` and bind: worth a retry.
    Exited(anyhow::Error),
    /// It could not be spawned or never became ready: retrying will not help.
    Fatal(anyhow::Error),
}

impl LaunchFailure {
    pub(crate) fn into_error(self) -> anyhow::Error {
        match self {
            LaunchFailure::Exited(err) | LaunchFailure::Fatal(err) => err,
        }
    }
}

/// Spawns `command` and returns once `ready` says so while the process is
/// still alive, so a foreign server that happens to answer on the port does
/// not count as ours having started.
pub(crate) async fn launch<P, Fut>(
    name: &str,
    command: Command,
    log_path: &Path,
    mut ready: P,
) -> Result<ManagedChild, LaunchFailure>
where
    P: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let mut child = ManagedChild::spawn(name, command, log_path).map_err(LaunchFailure::Fatal)?;
    let deadline = Instant::now() + STARTUP_TIMEOUT;
    loop {
        if let Some(status) = child.try_status() {
            return Err(LaunchFailure::Exited(anyhow::anyhow!(
                "{name} exited during startup ({}); log tail ({}):\n{}",
                describe(status),
                log_path.display(),
                log_tail(log_path, 30)
            )));
        }
        let answered = matches!(timeout_at(deadline, ready()).await, Ok(true));
        if answered && child.is_running() {
            return Ok(child);
        }
        if Instant::now() >= deadline {
            return Err(LaunchFailure::Fatal(anyhow::anyhow!(
                "{name} not ready after {STARTUP_TIMEOUT:?}; log tail ({}):\n{}",
                log_path.display(),
                log_tail(log_path, 30)
            )));
        }
        sleep(PROBE_INTERVAL).await;
    }
}

/// What the retry loops and [`Server`] need to know about one kind of server.
pub trait ServerSpec {
    /// For messages: "nats-server", "etcd", "moto_server".
    const NAME: &'static str;

    /// Chooses new ports before a first start (and again after a start that
    /// lost its port to another process).
    fn pick_ports(&mut self);

    /// The port clients connect to.
    fn port(&self) -> u16;

    fn command(&self) -> Command;

    fn log_path(&self) -> &Path;

    /// True once the server serves requests; must not hang past a few seconds.
    fn probe(&self) -> impl Future<Output = bool> + '_;
}

/// First start: on fresh ports, moving to other ports when the server dies
/// on startup (most likely its port was taken in the meantime).
///
/// # Panics
///
/// If the server cannot be started; the message carries its log tail.
pub(crate) async fn start_fresh<S: ServerSpec>(spec: &mut S) -> ManagedChild {
    let mut attempt = 1;
    loop {
        spec.pick_ports();
        match launch(S::NAME, spec.command(), spec.log_path(), || spec.probe()).await {
            Ok(child) => return child,
            Err(LaunchFailure::Exited(err)) if attempt < FIRST_START_ATTEMPTS => {
                tracing::warn!(
                    server = S::NAME,
                    attempt,
                    error = %format!("{err:#}"),
                    "Server died on startup, retrying on new ports."
                );
                attempt += 1;
            }
            Err(failure) => panic!("{:#}", failure.into_error()),
        }
    }
}

/// Restart: same ports and data, which the old process may take a moment
/// to let go of.
///
/// # Panics
///
/// If the server cannot be started again; the message carries its log tail.
pub(crate) async fn start_again<S: ServerSpec>(spec: &S) -> ManagedChild {
    let mut attempt = 1;
    loop {
        match launch(S::NAME, spec.command(), spec.log_path(), || spec.probe()).await {
            Ok(child) => return child,
            Err(LaunchFailure::Exited(err)) if attempt < RESTART_ATTEMPTS => {
                tracing::warn!(
                    server = S::NAME,
                    attempt,
                    error = %format!("{err:#}"),
                    "Server died on restart, retrying on the same ports."
                );
                attempt += 1;
                sleep(RESTART_BACKOFF).await;
            }
            Err(failure) => panic!("restart: {:#}", failure.into_error()),
        }
    }
}

/// How long a graceful stop may take before it counts as hung.
const STOP_TIMEOUT: Duration = Duration::from_secs(30);

/// One server process on free loopback ports, of the kind `S` describes,
/// with the lifecycle every kind shares: crash, graceful stop, pause and
/// restart on the same ports with the same data. Each kind adds its own
/// addresses and helpers ([`super::NatsServer`], [`super::Etcd`],
/// [`super::S3Server`], [`super::RedisServer`]).
///
/// Killed on `Drop`, and its directory removed; after a failed test its log
/// tail is printed.
pub struct Server<S: ServerSpec> {
    /// Declared before `spec` so the process is dead before `spec` removes
    /// the directory it writes to.
    child: Option<ManagedChild>,
    spec: S,
}

impl<S: ServerSpec> Server<S> {
    /// Starts the server on fresh ports and returns once it serves.
    ///
    /// # Panics
    ///
    /// If the binary is missing or does not start; the message carries its
    /// log tail.
    pub(crate) async fn launch(mut spec: S) -> Self {
        let child = start_fresh(&mut spec).await;
        Server {
            child: Some(child),
            spec,
        }
    }

    pub(crate) fn spec(&self) -> &S {
        &self.spec
    }

    /// The port clients connect to, for configs that take host and port
    /// apart; stable across restarts.
    pub fn port(&self) -> u16 {
        self.spec.port()
    }

    /// `None` while the server is down.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(ManagedChild::pid)
    }

    /// Whether the process is alive; a paused one counts. Reaps it if it
    /// died, hence `&mut`.
    pub fn is_running(&mut self) -> bool {
        self.child.as_mut().is_some_and(ManagedChild::is_running)
    }

    /// Crashes the server (SIGKILL) and waits until it is gone: no flush, no
    /// goodbye to clients, like a power cut. No-op if already down.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            child.kill();
        }
    }

    /// Shuts the server down gracefully (SIGTERM) and waits until it is gone.
    ///
    /// # Panics
    ///
    /// If it is still running after 30 s (it is then killed).
    pub fn stop(&mut self) {
        if let Some(mut child) = self.child.take() {
            if let Err(err) = child.terminate(STOP_TIMEOUT) {
                panic!("{err:#}; log tail:\n{}", self.log_tail(30));
            }
        }
    }

    /// Freezes the server (SIGSTOP): connections stay open but nothing is
    /// answered, which is how a stalled server differs from a dead one.
    ///
    /// # Panics
    ///
    /// If the server is not running.
    pub fn pause(&mut self) {
        self.signal(Signal::SIGSTOP);
    }

    /// Undoes [`Server::pause`].
    ///
    /// # Panics
    ///
    /// If the server is not running.
    pub fn resume(&mut self) {
        self.signal(Signal::SIGCONT);
    }

    fn signal(&mut self, signal: Signal) {
        let child = self
            .child
            .as_mut()
            .unwrap_or_else(|| panic!("{} is not running; cannot send {signal}", S::NAME));
        if let Err(err) = child.signal(signal) {
            panic!("{err:#}");
        }
    }

    /// Starts the server again on the same ports with the same data, and
    /// returns once it serves. Clients connected before reconnect on their
    /// own.
    ///
    /// # Panics
    ///
    /// If the server is still running (`kill()` or `stop()` it first: a
    /// crash and a clean shutdown are different tests), or does not start.
    pub async fn restart(&mut self) {
        if self.is_running() {
            panic!(
                "{} is still running; call kill() or stop() before restart()",
                S::NAME
            );
        }
        // The old handle goes first: its process has exited and been reaped,
        // and nothing may signal its pid once the new process is up.
        self.child = None;
        self.child = Some(start_again(&self.spec).await);
    }

    /// Kept across restarts (appended), so one file tells the whole story.
    pub fn log_path(&self) -> &Path {
        self.spec.log_path()
    }

    /// The server's last log lines, for assertion messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(self.spec.log_path(), lines)
    }
}

impl<S: ServerSpec> Drop for Server<S> {
    fn drop(&mut self) {
        report_if_panicking(S::NAME, self.spec.log_path());
    }
}
