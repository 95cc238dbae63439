//! Watching the catalog for changes, wherever it comes from
//! ([`CatalogSource`], a setting parsed in [`crate::config`]).
//!
//! A file is polled (cheap, works on every filesystem and with editors that
//! replace files); an etcd key is watched. A catalog that fails validation at
//! start-up is fatal; a bad update later is logged and counted, and the last
//! good catalog stays in force.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use adspend_wire::catalog::Catalog;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, Result};
use crate::telemetry::{CATALOG_ERRORS_TOTAL, CATALOG_RELOADS_TOTAL};

/// Where it stays for the services that name it here.
pub use crate::config::CatalogSource;

const FILE_POLL: Duration = Duration::from_millis(500);

impl CatalogSource {
    /// Load once, then keep the returned receiver up to date until `cancel`,
    /// from a task on `tasks`.
    pub async fn watch(
        self,
        cancel: CancellationToken,
        tasks: &TaskTracker,
    ) -> Result<watch::Receiver<Arc<Catalog>>> {
        match self {
            CatalogSource::File(path) => {
                let (bytes, stamp) = read_file(&path).await?;
                let catalog = Catalog::parse(&path.display().to_string(), &bytes)?;
                let (tx, rx) = watch::channel(Arc::new(catalog));
                tasks.spawn(poll_file(path, stamp, tx, cancel));
                Ok(rx)
            }
            CatalogSource::Etcd { etcd, key } => {
                let background = crate::etcd::Background::on(tasks, cancel.clone());
                let mut client = crate::etcd::connect(&etcd, &background).await?;
                let response = client
                    .get(key.as_str(), None)
                    .await
                    .map_err(Error::etcd("get", &key))?;
                let kv = response.kvs().first().ok_or_else(|| Error::Catalog {
                    source_name: format!("etcd://{key}"),
                    reason: "key not found".into(),
                })?;
                let catalog = Catalog::parse(&format!("etcd://{key}"), kv.value())?;
                let revision = response.header().map(|h| h.revision()).unwrap_or(0);
                let (tx, rx) = watch::channel(Arc::new(catalog));
                tasks.spawn(watch_etcd(client, key, revision, tx, cancel));
                Ok(rx)
            }
        }
    }
}

type FileStamp = (std::time::SystemTime, u64, u64);

async fn read_file(path: &PathBuf) -> Result<(Vec<u8>, FileStamp)> {
    let bytes = tokio::fs::read(path)
        .await
        .map_err(Error::io("read catalog", path))?;
    let meta = tokio::fs::metadata(path)
        .await
        .map_err(Error::io("stat catalog", path))?;
    let modified = meta.modified().unwrap_or(std::time::UNIX_EPOCH);
    let stamp = (modified, meta.len(), xxhash_rust::xxh3::xxh3_64(&bytes));
    Ok((bytes, stamp))
}

fn publish(tx: &watch::Sender<Arc<Catalog>>, source: &str, bytes: &[u8]) {
    match Catalog::parse(source, bytes) {
        Ok(catalog) => {
            tracing::info!(
                source,
                limits = catalog.limits.len(),
                ads = catalog.ads.len(),
                "catalog reloaded"
            );
            metrics::counter!(CATALOG_RELOADS_TOTAL).increment(1);
            tx.send_replace(Arc::new(catalog));
        }
        Err(e) => {
            tracing::error!(source, error = %e, "catalog update rejected; keeping the previous catalog");
            metrics::counter!(CATALOG_ERRORS_TOTAL).increment(1);
        }
    }
}

async fn poll_file(
    path: PathBuf,
    mut stamp: FileStamp,
    tx: watch::Sender<Arc<Catalog>>,
    cancel: CancellationToken,
) {
    let source = path.display().to_string();
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(FILE_POLL) => {}
        }
        match read_file(&path).await {
            Ok((bytes, new_stamp)) if new_stamp.2 != stamp.2 => {
                stamp = new_stamp;
                publish(&tx, &source, &bytes);
            }
            Ok(_) => {}
            Err(e) => {
                // Editors replace files by rename; a missing file for one poll is normal.
                tracing::debug!(error = %e, "catalog file not readable");
            }
        }
    }
}

async fn watch_etcd(
    mut client: etcd_client::Client,
    key: String,
    mut revision: i64,
    tx: watch::Sender<Arc<Catalog>>,
    cancel: CancellationToken,
) {
    let source = format!("etcd://{key}");
    loop {
        let options = etcd_client::WatchOptions::new().with_start_revision(revision + 1);
        let watch = tokio::select! {
            _ = cancel.cancelled() => return,
            w = client.watch(key.as_str(), Some(options)) => w,
        };
        let mut stream = match watch {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(error = %e, key, "catalog watch failed; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        loop {
            let message = tokio::select! {
                _ = cancel.cancelled() => return,
                m = stream.message() => m,
            };
            match message {
                Ok(Some(response)) if response.canceled() => {
                    // Asked to resume after a revision etcd has compacted
                    // away (a watch re-established after a long outage, or
                    // one that fell behind): the events in between are gone,
                    // so read the key as it is now and watch on from there.
                    tracing::warn!(
                        key,
                        after_revision = revision,
                        compacted_to = response.compact_revision(),
                        reason = response.cancel_reason(),
                        "catalog watch cancelled by etcd; re-reading the key"
                    );
                    if let Some(now) = reread(&mut client, &key, revision, &tx, &source).await {
                        revision = now;
                    }
                    break;
                }
                Ok(Some(response)) => {
                    for event in response.events() {
                        if let Some(kv) = event.kv() {
                            revision = revision.max(kv.mod_revision());
                            if event.event_type() == etcd_client::EventType::Put {
                                publish(&tx, &source, kv.value());
                            } else {
                                key_deleted(&key);
                            }
                        }
                    }
                }
                Ok(None) | Err(_) => {
                    tracing::warn!(key, "catalog watch ended; re-establishing");
                    break;
                }
            }
        }
    }
}

/// The key as it is now: published when it changed after `revision`. Returns
/// the store revision the read saw, to watch on from (None when etcd could
/// not be read; the caller keeps its revision and retries the watch).
async fn reread(
    client: &mut etcd_client::Client,
    key: &str,
    revision: i64,
    tx: &watch::Sender<Arc<Catalog>>,
    source: &str,
) -> Option<i64> {
    let response = match client.get(key, None).await {
        Ok(response) => response,
        Err(e) => {
            tracing::warn!(error = %e, key, "catalog re-read failed; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            return None;
        }
    };
    match response.kvs().first() {
        Some(kv) if kv.mod_revision() > revision => publish(tx, source, kv.value()),
        Some(_) => {}
        None => key_deleted(key),
    }
    response.header().map(|h| h.revision())
}

fn key_deleted(key: &str) {
    tracing::error!(key, "catalog key deleted; keeping the previous catalog");
    metrics::counter!(CATALOG_ERRORS_TOTAL).increment(1);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::EtcdArgs;

    const ONE: &str = r#"{"limits":{"a":{"budget_micros":1,"period":"daily"}},"ads":{"x":["a"]}}"#;
    const TWO: &str = r#"{"limits":{"a":{"budget_micros":2,"period":"daily"}},"ads":{"x":["a"]}}"#;

    fn budget(rx: &watch::Receiver<Arc<Catalog>>) -> u64 {
        rx.borrow().limit("a").unwrap().budget_micros
    }

    #[tokio::test]
    async fn file_changes_apply_and_bad_updates_keep_the_last_good_catalog() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("catalog.json");
        std::fs::write(&path, ONE).unwrap();
        let cancel = CancellationToken::new();
        let source = CatalogSource::parse(path.to_str().unwrap(), &EtcdArgs::default()).unwrap();
        let tasks = TaskTracker::new();
        let mut rx = source.watch(cancel.clone(), &tasks).await.unwrap();
        assert_eq!(budget(&rx), 1);

        // Replace by rename, as editors and deploy tools do.
        let tmp = dir.path().join("catalog.tmp");
        std::fs::write(&tmp, TWO).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        tokio::time::timeout(Duration::from_secs(5), rx.changed())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(budget(&rx), 2);

        std::fs::write(
            &path,
            r#"{"limits":{"a":{"budget_micros":-3,"period":"daily"}}}"#,
        )
        .unwrap();
        tokio::time::sleep(FILE_POLL * 3).await;
        assert!(!rx.has_changed().unwrap());
        assert_eq!(budget(&rx), 2);
        // The poll ends with its token: the tracker is then empty.
        cancel.cancel();
        tasks.close();
        tokio::time::timeout(Duration::from_secs(5), tasks.wait())
            .await
            .expect("the file poll stops when cancelled");
    }
}
