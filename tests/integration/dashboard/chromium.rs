//! Headless Chromium: finding it, and one run on a URL with a deadline.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::VIRTUAL_TIME_MS;

/// Debian's package puts its launcher here (`scripts/install-deps.sh test`).
const CHROMIUM: &str = "/usr/bin/chromium";
/// A headless run takes a few seconds; this only bounds a hung browser.
const CHROMIUM_TIMEOUT: Duration = Duration::from_secs(120);

pub(super) fn chromium_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("chromium"))
            .find(|candidate| candidate.is_file())
    });
    on_path
        .or_else(|| Some(PathBuf::from(CHROMIUM)).filter(|p| p.is_file()))
        .unwrap_or_else(|| {
            panic!(
                "chromium not found (looked on PATH and at {CHROMIUM}); the dashboard test \
                 renders the page in headless Chromium: run `scripts/install-deps.sh test` \
                 from the workspace root"
            )
        })
}

/// Runs headless Chromium on `target` with `extra` flags and returns its
/// standard output; fails the test on a timeout or a failed exit.
pub(super) async fn run_chromium(chromium: &Path, extra: &[String], target: &str) -> String {
    let chromium = chromium.to_owned();
    let extra = extra.to_vec();
    let target = target.to_owned();
    tokio::task::spawn_blocking(move || run_chromium_blocking(&chromium, &extra, &target))
        .await
        .expect("chromium runner panicked")
}

fn run_chromium_blocking(chromium: &Path, extra: &[String], target: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir for chromium");
    let stdout_path = dir.path().join("stdout");
    let stderr_path = dir.path().join("stderr");
    // Output to files, not pipes: a DOM bigger than a pipe buffer would
    // block the browser while this thread waits for it to exit.
    let mut child = Command::new(chromium)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
        ])
        .arg(format!(
            "--user-data-dir={}",
            dir.path().join("profile").display()
        ))
        .arg(format!("--virtual-time-budget={VIRTUAL_TIME_MS}"))
        .args(extra)
        .arg(target)
        .stdin(Stdio::null())
        .stdout(File::create(&stdout_path).expect("chromium stdout file"))
        .stderr(File::create(&stderr_path).expect("chromium stderr file"))
        // Its own process group, so a timeout takes the renderer and GPU
        // processes down with it.
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromium.display()));
    let deadline = Instant::now() + CHROMIUM_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for chromium") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.wait();
            panic!(
                "chromium did not finish {target} within {CHROMIUM_TIMEOUT:?}; its stderr:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(&stdout_path).expect("chromium output");
    assert!(
        status.success(),
        "chromium failed on {target} ({status}); its stderr:\n{}",
        std::fs::read_to_string(&stderr_path).unwrap_or_default()
    );
    stdout
}
