//! How full the account's JetStream file store is, as JetStream reports it
//! (`$JS.API.INFO`, the account's view of what the server's monitoring
//! endpoint shows in `/jsz`), exported so that an alert fires before the
//! store fills: once it has, ad servers' publishes time out or get 503
//! "insufficient resources", and the limiter's output waits with them
//! (docs/OPERATIONS.md, "A full disk").

use std::time::Duration;

use async_nats::jetstream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::telemetry::{NATS_STORAGE_BYTES, NATS_STORAGE_LIMIT_BYTES};

const EVERY: Duration = Duration::from_secs(15);
const TIMEOUT: Duration = Duration::from_secs(5);

/// The account's file store limit in bytes: its own, or the largest of its
/// tiers' (R1, R3 in a cluster); `None` when unlimited (the server's own
/// `max_file_store` then bounds it, which the account does not see).
fn limit(account: &jetstream::account::Account) -> Option<u64> {
    std::iter::once(&account.limits)
        .chain(account.tiers.values().map(|tier| &tier.limits))
        .filter_map(|limits| limits.max_storage)
        .filter(|&max| max > 0)
        .max()
        .map(|max| max as u64)
}

/// Export the store's use every [`EVERY`] until `cancel`.
pub(crate) fn watch(js: jetstream::Context, tasks: &TaskTracker, cancel: CancellationToken) {
    tasks.spawn(async move {
        let mut tick = tokio::time::interval(EVERY);
        let mut warned = false;
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tick.tick() => {}
            }
            match tokio::time::timeout(TIMEOUT, js.query_account()).await {
                Ok(Ok(account)) => {
                    warned = false;
                    metrics::gauge!(NATS_STORAGE_BYTES).set(account.storage as f64);
                    let limit = limit(&account).unwrap_or(0);
                    metrics::gauge!(NATS_STORAGE_LIMIT_BYTES).set(limit as f64);
                }
                // An outage shows elsewhere; a refusal (no permission for
                // `$JS.API.INFO`) is said once.
                Ok(Err(e)) if !warned => {
                    warned = true;
                    tracing::warn!(error = %e, "JetStream account info unavailable: the store's fill is not exported");
                }
                _ => {}
            }
        }
    });
}
