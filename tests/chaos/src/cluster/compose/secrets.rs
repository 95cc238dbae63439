//! The credentials `scripts/cluster.sh` generates for the host's clients
//! (deploy/.secrets, git-ignored): each role's `ADSPEND_NATS_*` settings in
//! `<role>.env`, with the host's paths and `nats://127.0.0.1:4222`.

use std::path::PathBuf;

use adspend_common::config::NatsArgs;
use anyhow::Context;

use adspend_harness::workspace_root;
pub use adspend_sim::check::PacerAccess;

/// Where `scripts/cluster.sh` writes the cluster's CA, certificates and
/// passwords, relative to the workspace.
pub const SECRETS_DIR: &str = "deploy/.secrets";

/// The NATS settings of `role` (`adserver`, `auditor`, ...) as the cluster's
/// clients on the host use them.
///
/// # Errors
///
/// If the env file is missing (the cluster was never started) or lacks a
/// setting.
pub fn nats_args(role: &str) -> anyhow::Result<NatsArgs> {
    let path = workspace_root()
        .join(SECRETS_DIR)
        .join(format!("{role}.env"));
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: run scripts/cluster.sh start first", path.display()))?;
    let value = |name: &str| -> anyhow::Result<String> {
        text.lines()
            .find_map(|line| line.strip_prefix(name)?.strip_prefix('='))
            .map(str::to_string)
            .with_context(|| format!("{} has no {name}", path.display()))
    };
    Ok(NatsArgs {
        nats_user: Some(value("ADSPEND_NATS_USER")?),
        nats_password: Some(value("ADSPEND_NATS_PASSWORD")?),
        nats_tls_ca: Some(PathBuf::from(value("ADSPEND_NATS_TLS_CA")?)),
        ..NatsArgs::plain(value("ADSPEND_NATS_URL")?)
    })
}

/// pacer1's API as the host reaches it now ([`PacerAccess::from_env_file`]; read
/// on each call, since `scripts/cluster.sh start` may write it meanwhile).
///
/// # Panics
///
/// If `pacer-client.env` exists but is unusable.
pub fn pacer() -> PacerAccess {
    PacerAccess::from_env_file(&workspace_root().join(SECRETS_DIR).join("pacer-client.env"))
        .expect("deploy/.secrets/pacer-client.env")
}

/// [`pacer`]'s client with `timeout`.
///
/// # Panics
///
/// If the CA it names cannot be read.
pub fn pacer_client(timeout: std::time::Duration) -> reqwest::Client {
    pacer().client(timeout).expect("pacer client")
}
