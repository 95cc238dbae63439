//! One child process the harness owns: spawning, signals, waiting, logs, and
//! the guarantee that it dies with the test.
//!
//! This is the harness's only `unsafe`: `Command::pre_exec`, to arm the
//! parent-death signal in the child.
#![allow(unsafe_code)]

use std::fs::{File, OpenOptions};
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// How often exit and log polls look again.
const POLL: Duration = Duration::from_millis(20);

/// How much of a log `log_tail` reads at most, so a chatty service at debug
/// level cannot make every assertion message slow.
const TAIL_WINDOW: u64 = 4 << 20;

/// Variables a child may inherit. Everything else is dropped: a developer's
/// `ADSPEND_*` settings would silently reconfigure the service under test,
/// and real `AWS_*` credentials or proxy settings could send test traffic
/// somewhere real.
const INHERITED_ENV: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "TMPDIR",
    "LANG",
    "LC_ALL",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "RUST_LIB_BACKTRACE",
];

/// Replaces `command`'s environment with the allow-listed part of ours.
pub(crate) fn clean_env(command: &mut Command) {
    command.env_clear();
    for name in INHERITED_ENV {
        if let Some(value) = std::env::var_os(name) {
            command.env(name, value);
        }
    }
}

/// A running (or exited, not yet dropped) child with its output in a log file.
pub(crate) struct ManagedChild {
    /// Used in messages only: "nats-server", "limiter", ...
    name: String,
    child: Child,
    /// Set once the child has been reaped; from then on its pid may belong
    /// to an unrelated process, so no signal is sent.
    status: Option<ExitStatus>,
    log_path: PathBuf,
    /// Where this run's output starts in a log shared with earlier runs.
    log_start: u64,
}

impl ManagedChild {
    /// Starts `command` with stdout and stderr appended to `log_path`.
    pub(crate) fn spawn(
        name: &str,
        mut command: Command,
        log_path: &Path,
    ) -> anyhow::Result<ManagedChild> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(log_path)
            .with_context(|| format!("open log file {}", log_path.display()))?;
        let log_start = log.metadata().map(|meta| meta.len()).unwrap_or(0);
        let stderr = log.try_clone().context("duplicate log file handle")?;
        command
            .stdin(Stdio::null())
            .stdout(Stdio::from(log))
            .stderr(Stdio::from(stderr));
        let program = command.get_program().to_owned();
        let child = spawn_dying_with_us(command)
            .with_context(|| format!("spawn {name} ({})", Path::new(&program).display()))?;
        Ok(ManagedChild {
            name: name.to_owned(),
            child,
            status: None,
            log_path: log_path.to_owned(),
            log_start,
        })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The exit status if the child has exited, reaping it.
    pub(crate) fn try_status(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            // An error here means the child was already reaped elsewhere,
            // which cannot happen: this struct owns the only handle.
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    pub(crate) fn is_running(&mut self) -> bool {
        self.try_status().is_none()
    }

    pub(crate) fn signal(&mut self, signal: Signal) -> anyhow::Result<()> {
        if let Some(status) = self.try_status() {
            bail!(
                "cannot send {signal} to {}: it already exited ({})",
                self.name,
                describe(status)
            );
        }
        let pid = i32::try_from(self.pid()).context("pid out of range")?;
        kill(Pid::from_raw(pid), signal)
            .with_context(|| format!("send {signal} to {} (pid {pid})", self.name))
    }

    /// SIGKILL and reap; a no-op returning the old status if it already exited.
    pub(crate) fn kill(&mut self) -> ExitStatus {
        if let Some(status) = self.try_status() {
            return status;
        }
        // SIGKILL also ends a SIGSTOPped process, so no SIGCONT is needed.
        let _ = self.child.kill();
        let status = self
            .child
            .wait()
            .unwrap_or_else(|err| panic!("wait for killed {}: {err}", self.name));
        self.status = Some(status);
        status
    }

    /// SIGTERM, then wait; SIGKILL (and an error) if it outlives `timeout`.
    pub(crate) fn terminate(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        if let Some(status) = self.try_status() {
            return Ok(status);
        }
        self.signal(Signal::SIGTERM)?;
        // A paused process would hold the SIGTERM until continued.
        let _ = self.signal(Signal::SIGCONT);
        match self.wait_exit(timeout) {
            Ok(status) => Ok(status),
            Err(err) => {
                self.kill();
                Err(err.context(format!("{} ignored SIGTERM and was killed", self.name)))
            }
        }
    }

    /// Blocks the calling thread; meant for the short waits after a signal.
    pub(crate) fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status() {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!("{} still running after {timeout:?}", self.name);
            }
            std::thread::sleep(POLL);
        }
    }

    /// Like [`ManagedChild::wait_exit`], but lets the test's runtime keep
    /// running other tasks meanwhile.
    pub(crate) async fn wait_for_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = self.try_status() {
                return Ok(status);
            }
            if Instant::now() >= deadline {
                bail!("{} still running after {timeout:?}", self.name);
            }
            tokio::time::sleep(POLL).await;
        }
    }

    /// Waits until this run of the child has written `needle` to its log.
    ///
    /// Keeps looking after the child exits until the log is final, because
    /// the line a test waits for is often the last one before a crash.
    pub(crate) async fn wait_for_log(
        &mut self,
        needle: &str,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            let exited = self.try_status();
            if self.log_since_start()?.contains(needle) {
                return Ok(());
            }
            if let Some(status) = exited {
                bail!(
                    "{} exited ({}) without logging {needle:?}; log tail:\n{}",
                    self.name,
                    describe(status),
                    log_tail(&self.log_path, 30)
                );
            }
            if Instant::now() >= deadline {
                bail!(
                    "{} did not log {needle:?} within {timeout:?}; log tail:\n{}",
                    self.name,
                    log_tail(&self.log_path, 30)
                );
            }
            tokio::time::sleep(POLL).await;
        }
    }

    fn log_since_start(&self) -> anyhow::Result<String> {
        let mut file = File::open(&self.log_path)
            .with_context(|| format!("open {}", self.log_path.display()))?;
        file.seek(SeekFrom::Start(self.log_start))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }
}

impl Drop for ManagedChild {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The last `lines` lines of a log, or a note saying why there are none.
/// Lossy on purpose: a half-written UTF-8 sequence must not hide the rest.
pub(crate) fn log_tail(path: &Path, lines: usize) -> String {
    match read_tail_window(path) {
        Ok(text) => {
            let all: Vec<&str> = text.lines().collect();
            all[all.len().saturating_sub(lines)..].join("\n")
        }
        Err(err) => format!("<no log at {}: {err}>", path.display()),
    }
}

fn read_tail_window(path: &Path) -> io::Result<String> {
    let mut file = File::open(path)?;
    let len = file.metadata()?.len();
    file.seek(SeekFrom::Start(len.saturating_sub(TAIL_WINDOW)))?;
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Prints a child's log tail into the failing test's captured output, so a
/// CI failure shows why the server or service misbehaved.
pub(crate) fn report_if_panicking(name: &str, log_path: &Path) {
    if std::thread::panicking() {
        eprint!(
            "\n---- last log lines of {name} ({}) ----\n{}\n----\n",
            log_path.display(),
            log_tail(log_path, 40)
        );
    }
}

/// "exit code 0" / "killed by SIGKILL", for messages.
pub(crate) fn describe(status: ExitStatus) -> String {
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit code {code}"),
        (None, Some(signal)) => match Signal::try_from(signal) {
            Ok(signal) => format!("killed by {signal}"),
            Err(_) => format!("killed by signal {signal}"),
        },
        (None, None) => status.to_string(),
    }
}

struct SpawnRequest {
    command: Command,
    reply: mpsc::SyncSender<io::Result<Child>>,
}

/// Spawns `command` so the kernel SIGKILLs it when the test process dies,
/// even when `Drop` never runs (SIGKILL, abort, a CI timeout).
///
/// The parent-death signal fires when the *thread* that forked the child
/// exits, not the process. Test threads end with their test, and a server
/// kept in a static outlives the test that started it, so every child is
/// forked from one thread that lives as long as the process.
fn spawn_dying_with_us(mut command: Command) -> io::Result<Child> {
    static SPAWNER: OnceLock<mpsc::Sender<SpawnRequest>> = OnceLock::new();

    let parent = nix::unistd::getpid();
    // SAFETY: the closure runs between fork and exec, where only
    // async-signal-safe calls are allowed; it makes two raw system calls
    // (prctl, getppid) and builds an `io::Error` from an errno, none of which
    // allocate or take locks.
    unsafe {
        command.pre_exec(move || {
            nix::sys::prctl::set_pdeathsig(Signal::SIGKILL).map_err(io::Error::from)?;
            // The parent may have died between fork and prctl; then the
            // signal above will never come.
            if nix::unistd::getppid() != parent {
                return Err(io::Error::from(nix::errno::Errno::ESRCH));
            }
            Ok(())
        });
    }

    let spawner = SPAWNER.get_or_init(|| {
        let (requests, incoming) = mpsc::channel::<SpawnRequest>();
        std::thread::Builder::new()
            .name("harness-spawner".into())
            .spawn(move || {
                for mut request in incoming {
                    let _ = request.reply.send(request.command.spawn());
                }
            })
            .expect("start the harness spawner thread");
        requests
    });
    let (reply, result) = mpsc::sync_channel(1);
    spawner
        .send(SpawnRequest { command, reply })
        .map_err(|_| io::Error::other("harness spawner thread is gone"))?;
    result
        .recv()
        .map_err(|_| io::Error::other("harness spawner thread is gone"))?
}
