//! Where the external servers' binaries come from.

use std::env;
use std::path::{Path, PathBuf};

/// Overrides where the external tools are looked up, for machines that keep
/// them outside the repository (CI caches, a shared tools image).
const TOOLS_DIR_ENV: &str = "ADSPEND_TOOLS_DIR";

/// The workspace root, so lookups do not depend on the directory the test
/// runner happens to start in.
pub fn workspace_root() -> PathBuf {
    // This crate lives in `tests/harness`.
    let manifest_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .ancestors()
        .nth(2)
        .unwrap_or(manifest_dir)
        .to_path_buf()
}

/// Finds an external tool (`nats-server`, `etcd`, `moto_server`).
///
/// `ADSPEND_TOOLS_DIR`, when set, is the only place searched: a pinned tools
/// directory must not be silently replaced by whatever is on `PATH`. Without
/// it, the repository's `.tools/bin` (filled by `scripts/install-deps.sh
/// test`) wins over `PATH`, so every developer tests against the same
/// versions.
///
/// # Panics
///
/// If the tool cannot be found; the message says how to install it.
pub fn tool_path(name: &str) -> PathBuf {
    if let Some(dir) = env::var_os(TOOLS_DIR_ENV) {
        let candidate = Path::new(&dir).join(name);
        if is_executable_file(&candidate) {
            return candidate;
        }
        panic!(
            "{name} not found in {TOOLS_DIR_ENV}={}; run `scripts/install-deps.sh test` \
             or point {TOOLS_DIR_ENV} at a directory that has it",
            Path::new(&dir).display()
        );
    }
    let repo_tools = workspace_root().join(".tools").join("bin").join(name);
    if is_executable_file(&repo_tools) {
        return repo_tools;
    }
    if let Some(found) = find_on_path(name) {
        return found;
    }
    panic!(
        "{name} not found (looked in {} and on PATH); run `scripts/install-deps.sh test` \
         from the workspace root",
        repo_tools.display()
    );
}

fn find_on_path(name: &str) -> Option<PathBuf> {
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| is_executable_file(candidate))
}

/// A dangling symlink in `.tools/bin` (a removed venv) must count as missing,
/// hence `metadata` (which follows links) rather than `exists` on the link.
fn is_executable_file(path: &Path) -> bool {
    use std::os::unix::fs::PermissionsExt;
    path.metadata()
        .map(|meta| meta.is_file() && meta.permissions().mode() & 0o111 != 0)
        .unwrap_or(false)
}
