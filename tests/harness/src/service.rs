//! The workspace's own binaries (`limiter`, `aggregator`, `pacer`, `adsim`)
//! run as real processes, so a test can crash one with a real signal.

use std::env;
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus};
use std::time::Duration;

use nix::sys::signal::Signal;
use tempfile::TempDir;

use super::process::{clean_env, log_tail, report_if_panicking, ManagedChild};
use super::scratch::scratch_dir;
use super::tools::workspace_root;

/// Finds a workspace binary in the cargo target directory this test binary
/// was built into.
///
/// `cargo test -p adspend-tests` does not build the other packages'
/// binaries, and a binary left over from an older build would silently
/// test old code, so build them first: `cargo build --workspace --bins`.
///
/// # Panics
///
/// If the binary has not been built; the message says how to build it.
pub fn service_binary(name: &str) -> PathBuf {
    let candidates = binary_candidates(name);
    if let Some(found) = candidates.iter().find(|path| path.is_file()) {
        return found.clone();
    }
    let looked_in: Vec<String> = candidates
        .iter()
        .map(|path| path.display().to_string())
        .collect();
    panic!(
        "service binary `{name}` is not built (looked for {}); run \
         `cargo build --workspace --bins` (with the same profile and features \
         as the tests) before the integration suite",
        looked_in.join(", ")
    );
}

/// The test executable lives in `<target>/<profile>/deps/`, the binaries one
/// level up; `CARGO_TARGET_DIR` and the workspace's `target/` cover tests run
/// from a copied or relocated executable.
fn binary_candidates(name: &str) -> Vec<PathBuf> {
    let current = env::current_exe().ok();
    let profile_dir = current
        .as_deref()
        .and_then(Path::parent)
        .filter(|deps| deps.file_name() == Some(OsStr::new("deps")))
        .and_then(Path::parent);
    let profile = profile_dir
        .and_then(Path::file_name)
        .map(OsStr::to_os_string)
        .unwrap_or_else(|| OsString::from("debug"));

    let mut candidates = Vec::new();
    if let Some(dir) = profile_dir {
        candidates.push(dir.join(name));
    } else if let Some(dir) = current.as_deref().and_then(Path::parent) {
        // A workspace binary (adchaos, adbench) sits beside the services
        // built with the same profile and features.
        candidates.push(dir.join(name));
    }
    if let Some(target) = env::var_os("CARGO_TARGET_DIR") {
        // Relative target directories are relative to where cargo ran,
        // which for this workspace is its root.
        candidates.push(workspace_root().join(target).join(&profile).join(name));
    }
    candidates.push(workspace_root().join("target").join(&profile).join(name));
    candidates.dedup();
    candidates
}

/// How to start a service; kept by the [`ServiceProcess`] so `restart()`
/// brings back exactly the same process after a crash.
#[derive(Clone, Debug)]
pub struct ServiceBuilder {
    name: String,
    binary: PathBuf,
    args: Vec<OsString>,
    envs: Vec<(OsString, OsString)>,
    log_file: Option<PathBuf>,
    current_dir: Option<PathBuf>,
}

impl ServiceBuilder {
    /// Appends a command-line argument; kept for `restart()`.
    pub fn arg(mut self, arg: impl AsRef<OsStr>) -> Self {
        self.args.push(arg.as_ref().to_owned());
        self
    }

    /// Appends command-line arguments; kept for `restart()`.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: AsRef<OsStr>,
    {
        self.args
            .extend(args.into_iter().map(|arg| arg.as_ref().to_owned()));
        self
    }

    /// Sets a variable in the service's environment, which otherwise holds
    /// only `PATH`, `HOME`, the locale and `RUST_LOG`/`RUST_BACKTRACE` from
    /// the test process: a developer's own `ADSPEND_*` or `AWS_*` settings
    /// must not leak into the service under test.
    pub fn env(mut self, name: impl AsRef<OsStr>, value: impl AsRef<OsStr>) -> Self {
        self.envs
            .push((name.as_ref().to_owned(), value.as_ref().to_owned()));
        self
    }

    /// Several [`ServiceBuilder::env`] at once, e.g. [`super::S3Server::env`].
    pub fn envs<I, K, V>(mut self, vars: I) -> Self
    where
        I: IntoIterator<Item = (K, V)>,
        K: AsRef<OsStr>,
        V: AsRef<OsStr>,
    {
        for (name, value) in vars {
            self = self.env(name, value);
        }
        self
    }

    /// Where stdout and stderr go (appended), for a test that wants the log
    /// to outlive the process handle; by default it goes to a temporary
    /// directory removed on `Drop`.
    pub fn log_file(mut self, path: impl Into<PathBuf>) -> Self {
        self.log_file = Some(path.into());
        self
    }

    /// For services that resolve relative paths (a catalog, a local
    /// checkpoint directory) against where they run.
    pub fn current_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.current_dir = Some(dir.into());
        self
    }

    /// Starts the process. It is not waited for: readiness means different
    /// things per service, see [`ServiceProcess::wait_for_log`].
    ///
    /// # Panics
    ///
    /// If the process cannot be spawned or its log file cannot be opened.
    pub fn spawn(self) -> ServiceProcess {
        let (scratch, log_path) = match &self.log_file {
            Some(path) => (None, path.clone()),
            None => {
                let dir = scratch_dir(&self.name);
                let path = dir.path().join(format!("{}.log", self.name));
                (Some(dir), path)
            }
        };
        let child = self.spawn_child(&log_path);
        ServiceProcess {
            child,
            builder: self,
            _scratch: scratch,
        }
    }

    fn spawn_child(&self, log_path: &Path) -> ManagedChild {
        let mut command = Command::new(&self.binary);
        clean_env(&mut command);
        if env::var_os("RUST_BACKTRACE").is_none() {
            // A panicking service should say where, in its log.
            command.env("RUST_BACKTRACE", "1");
        }
        command.args(&self.args);
        command.envs(self.envs.iter().map(|(name, value)| (name, value)));
        if let Some(dir) = &self.current_dir {
            command.current_dir(dir);
        }
        ManagedChild::spawn(&self.name, command, log_path).unwrap_or_else(|err| panic!("{err:#}"))
    }
}

/// A workspace binary running as its own process, killed on `Drop`.
///
/// Blocking methods ([`ServiceProcess::terminate`],
/// [`ServiceProcess::wait_exit`]) hold the calling thread for at most their
/// timeout, which is fine for the short waits after a signal; use the
/// `wait_for_*` methods when the test's runtime must keep running meanwhile.
pub struct ServiceProcess {
    /// Declared before `_scratch` so the process is dead before its log
    /// directory is removed.
    child: ManagedChild,
    builder: ServiceBuilder,
    _scratch: Option<TempDir>,
}

impl ServiceProcess {
    /// Starts describing a run of the binary `name`.
    ///
    /// # Panics
    ///
    /// If the binary has not been built (see [`service_binary`]).
    pub fn builder(name: &str) -> ServiceBuilder {
        ServiceBuilder {
            name: name.to_owned(),
            binary: service_binary(name),
            args: Vec::new(),
            envs: Vec::new(),
            log_file: None,
            current_dir: None,
        }
    }

    /// Like [`ServiceProcess::builder`], for a program outside the workspace
    /// (a fault-injecting helper, or a script standing in for a service in
    /// the harness's own tests) that should get the same supervision.
    pub fn builder_at(program: impl Into<PathBuf>) -> ServiceBuilder {
        let binary = program.into();
        let name = binary
            .file_name()
            .map(|name| name.to_string_lossy().into_owned())
            .unwrap_or_else(|| "program".to_owned());
        ServiceBuilder {
            name,
            binary,
            args: Vec::new(),
            envs: Vec::new(),
            log_file: None,
            current_dir: None,
        }
    }

    /// The binary's name, as used in messages and the default log file.
    pub fn name(&self) -> &str {
        &self.builder.name
    }

    /// The current process's pid; a restart changes it.
    pub fn pid(&self) -> u32 {
        self.child.pid()
    }

    /// # Errors
    ///
    /// If the process has already exited (its pid may have been reused).
    pub fn signal(&mut self, signal: Signal) -> anyhow::Result<()> {
        self.child.signal(signal)
    }

    /// Graceful shutdown: SIGTERM, then waits up to `timeout` for the exit.
    ///
    /// # Errors
    ///
    /// If the process was still running at the timeout; it is then killed,
    /// so a hung shutdown fails the test instead of leaking the process.
    pub fn terminate(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        self.child.terminate(timeout)
    }

    /// Crash: SIGKILL, then reaps it. Returns the old status if it had
    /// already exited.
    pub fn kill(&mut self) -> ExitStatus {
        self.child.kill()
    }

    /// Freezes the process (SIGSTOP), e.g. to let its leases expire while
    /// its connections stay open.
    ///
    /// # Errors
    ///
    /// If the process has already exited.
    pub fn pause(&mut self) -> anyhow::Result<()> {
        self.child.signal(Signal::SIGSTOP)
    }

    /// Undoes [`ServiceProcess::pause`].
    ///
    /// # Errors
    ///
    /// If the process has already exited.
    pub fn resume(&mut self) -> anyhow::Result<()> {
        self.child.signal(Signal::SIGCONT)
    }

    /// Blocks until the process exits on its own.
    ///
    /// # Errors
    ///
    /// If it is still running after `timeout` (it is left running).
    pub fn wait_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        self.child.wait_exit(timeout)
    }

    /// Like [`ServiceProcess::wait_exit`], without blocking the runtime.
    ///
    /// # Errors
    ///
    /// If it is still running after `timeout` (it is left running).
    pub async fn wait_for_exit(&mut self, timeout: Duration) -> anyhow::Result<ExitStatus> {
        self.child.wait_for_exit(timeout).await
    }

    /// A paused process counts as running.
    pub fn is_running(&mut self) -> bool {
        self.child.is_running()
    }

    /// `None` while running.
    pub fn exit_status(&mut self) -> Option<ExitStatus> {
        self.child.try_status()
    }

    /// Kept across restarts (appended), so one file tells the whole story.
    pub fn log_path(&self) -> &Path {
        self.child.log_path()
    }

    /// The last log lines, across restarts, for assertion messages.
    pub fn log_tail(&self, lines: usize) -> String {
        log_tail(self.child.log_path(), lines)
    }

    /// Waits until the current run (not an earlier one before a restart)
    /// has logged `needle`: how tests know a service is ready, or that a
    /// failure point fired before the crash.
    ///
    /// # Errors
    ///
    /// If `needle` has not appeared within `timeout`, or the process exited
    /// without logging it; the error carries the log tail.
    pub async fn wait_for_log(&mut self, needle: &str, timeout: Duration) -> anyhow::Result<()> {
        self.child.wait_for_log(needle, timeout).await
    }

    /// Starts the same binary with the same arguments, environment and log
    /// file again, as a supervisor would after a crash.
    ///
    /// # Panics
    ///
    /// If the process is still running (`kill()` or `terminate()` it first:
    /// a crash and a clean shutdown are different tests), or cannot be
    /// spawned.
    pub fn restart(&mut self) {
        if self.child.is_running() {
            panic!(
                "{} is still running; call kill() or terminate() before restart()",
                self.builder.name
            );
        }
        let log_path = self.child.log_path().to_owned();
        self.child = self.builder.spawn_child(&log_path);
    }
}

impl Drop for ServiceProcess {
    fn drop(&mut self) {
        report_if_panicking(&self.builder.name, self.child.log_path());
    }
}
