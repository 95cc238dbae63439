//! Temporary directories for server data and logs.

use std::fs;
use std::path::Path;
use std::sync::Once;

use nix::errno::Errno;
use nix::sys::signal::kill;
use nix::unistd::Pid;
use tempfile::TempDir;

/// Every harness directory starts with this, followed by the owning
/// process's pid, so a later run can tell whose directory it is.
const PREFIX: &str = "adspend-h";

/// Creates `$TMPDIR/adspend-h<pid>-<kind>-XXXXXX`, removed on `Drop`.
///
/// A test process killed outright (SIGKILL, a CI timeout) never runs `Drop`,
/// so the first call in each process removes directories whose owner is gone.
///
/// # Panics
///
/// If the directory cannot be created (the temp dir is full or read-only).
pub(crate) fn scratch_dir(kind: &str) -> TempDir {
    static SWEEP: Once = Once::new();
    SWEEP.call_once(sweep_stale);
    tempfile::Builder::new()
        .prefix(&format!("{PREFIX}{}-{kind}-", std::process::id()))
        .tempdir()
        .unwrap_or_else(|err| panic!("cannot create a temporary directory for {kind}: {err}"))
}

fn sweep_stale() {
    let Ok(entries) = fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(owner) = name.to_str().and_then(owner_pid) else {
            continue;
        };
        if owner != std::process::id() && !process_exists(owner) {
            remove_quietly(&entry.path());
        }
    }
}

fn owner_pid(dir_name: &str) -> Option<u32> {
    let rest = dir_name.strip_prefix(PREFIX)?;
    let digits = rest.split('-').next()?;
    digits.parse().ok()
}

/// EPERM means the pid belongs to another user: alive, so not ours to clean.
/// A zombie counts as gone: a killed test process whose parent has not
/// reaped it yet still answers `kill(pid, 0)`, but its children are dead.
fn process_exists(pid: u32) -> bool {
    let Ok(raw) = i32::try_from(pid) else {
        return false;
    };
    if matches!(kill(Pid::from_raw(raw), None), Err(Errno::ESRCH)) {
        return false;
    }
    !is_zombie(pid)
}

fn is_zombie(pid: u32) -> bool {
    let Ok(stat) = fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return false;
    };
    // The state letter follows the command name, which is in parentheses
    // and may itself contain spaces or parentheses.
    stat.rfind(')')
        .and_then(|end| stat[end + 1..].split_whitespace().next())
        == Some("Z")
}

/// Another test binary may be sweeping the same directory at the same time;
/// losing that race is fine.
fn remove_quietly(path: &Path) {
    let _ = fs::remove_dir_all(path);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn owner_pid_reads_only_harness_directories() {
        assert_eq!(owner_pid("adspend-h1234-nats-abc123"), Some(1234));
        assert_eq!(owner_pid("adspend-h-nats"), None);
        assert_eq!(owner_pid("adspend-hx12-nats"), None);
        assert_eq!(owner_pid("tmp1234"), None);
    }
}
