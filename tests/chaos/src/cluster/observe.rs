//! What the pacer serves, watched from outside: per-partition owner epoch and
//! sequence (`/v1/shards`), takeover times, and a sampler that records any
//! value moving backwards.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::cluster::compose::{pacer, pacer_client};
use adspend_sim::check::fetch_limits;

/// `ADSPEND_PARTITIONS` in the compose file.
pub const PARTITIONS: u32 = 16;

/// One partition as the pacer holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Shard {
    pub epoch: u64,
    pub seq: u64,
}

#[derive(Deserialize)]
struct ShardsDoc {
    shards: Vec<ShardDoc>,
}

#[derive(Deserialize)]
struct ShardDoc {
    shard: String,
    epoch: u64,
    seq: u64,
}

/// Partition → what the pacer last applied for it.
pub async fn shards(http: &reqwest::Client) -> anyhow::Result<BTreeMap<u32, Shard>> {
    let url = format!("{}/v1/shards", pacer().url);
    let response = http.get(&url).send().await.with_context(|| url.clone())?;
    anyhow::ensure!(
        response.status().is_success(),
        "{url}: {}",
        response.status()
    );
    let doc: ShardsDoc = response.json().await.context("decoding /v1/shards")?;
    doc.shards
        .into_iter()
        .map(|s| {
            let p = s
                .shard
                .strip_prefix('p')
                .and_then(|p| p.parse().ok())
                .with_context(|| format!("shard name {:?}", s.shard))?;
            Ok((
                p,
                Shard {
                    epoch: s.epoch,
                    seq: s.seq,
                },
            ))
        })
        .collect()
}

/// How long after a fault each partition was applied again under a new owner.
#[derive(Debug, Clone)]
pub struct Takeover {
    pub per_partition: BTreeMap<u32, Duration>,
    /// Until the last of them.
    pub total: Duration,
}

impl Takeover {
    pub fn render(&self) -> String {
        let parts: Vec<String> = self
            .per_partition
            .iter()
            .map(|(p, d)| format!("p{p} {:.2}s", d.as_secs_f64()))
            .collect();
        format!(
            "{} partitions, all applied again after {:.2}s ({})",
            self.per_partition.len(),
            self.total.as_secs_f64(),
            parts.join(", ")
        )
    }
}

/// Polls the pacer until every partition of `before` shows a higher owner
/// epoch and a sequence past the one it had: a new owner applied it. Times
/// are measured from `since` (the fault).
pub async fn wait_applied(
    http: &reqwest::Client,
    before: &BTreeMap<u32, Shard>,
    since: Instant,
    timeout: Duration,
) -> anyhow::Result<Takeover> {
    let mut done: BTreeMap<u32, Duration> = BTreeMap::new();
    loop {
        if let Ok(now) = shards(http).await {
            for (p, old) in before {
                if done.contains_key(p) {
                    continue;
                }
                if now
                    .get(p)
                    .is_some_and(|s| s.epoch > old.epoch && s.seq > old.seq)
                {
                    done.insert(*p, since.elapsed());
                }
            }
        }
        if done.len() == before.len() {
            let total = done.values().copied().max().unwrap_or_default();
            return Ok(Takeover {
                per_partition: done,
                total,
            });
        }
        if since.elapsed() > timeout {
            let missing: Vec<u32> = before
                .keys()
                .filter(|p| !done.contains_key(p))
                .copied()
                .collect();
            bail!("partitions {missing:?} not applied under a new epoch within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A value seen moving backwards between two samples.
#[derive(Debug, Clone)]
pub struct Backwards {
    pub what: String,
    pub before: String,
    pub after: String,
}

#[derive(Default)]
struct Seen {
    samples: u64,
    lifetime: BTreeMap<String, u64>,
    shards: BTreeMap<u32, Shard>,
    backwards: Vec<Backwards>,
}

/// Samples the pacer every 200 ms until finished: each limit's lifetime
/// spend and each partition's (epoch, seq) must never decrease.
pub struct Monotonic {
    seen: Arc<Mutex<Seen>>,
    cancel: CancellationToken,
    task: tokio::task::JoinHandle<()>,
}

impl Monotonic {
    pub fn start() -> Monotonic {
        let seen = Arc::new(Mutex::new(Seen::default()));
        let cancel = CancellationToken::new();
        let task = tokio::spawn(sample(seen.clone(), cancel.clone()));
        Monotonic { seen, cancel, task }
    }

    /// Stops sampling; returns the number of samples and every regression.
    pub async fn finish(self) -> (u64, Vec<Backwards>) {
        self.cancel.cancel();
        let _ = self.task.await;
        let seen = self.seen.lock().unwrap();
        (seen.samples, seen.backwards.clone())
    }
}

async fn sample(seen: Arc<Mutex<Seen>>, cancel: CancellationToken) {
    let http = pacer_client(Duration::from_secs(3));
    let url = pacer().url;
    loop {
        let limits = fetch_limits(&http, &url).await;
        let parts = shards(&http).await;
        {
            let mut seen = seen.lock().unwrap();
            let seen = &mut *seen;
            if let Ok(limits) = limits {
                seen.samples += 1;
                for limit in limits {
                    let last = seen.lifetime.entry(limit.limit_id.clone()).or_default();
                    if limit.lifetime_spend_micros < *last {
                        seen.backwards.push(Backwards {
                            what: format!("limit {}", limit.limit_id),
                            before: last.to_string(),
                            after: limit.lifetime_spend_micros.to_string(),
                        });
                    }
                    *last = limit.lifetime_spend_micros;
                }
            }
            for (p, shard) in parts.unwrap_or_default() {
                if let Some(last) = seen.shards.insert(p, shard) {
                    if shard < last {
                        seen.backwards.push(Backwards {
                            what: format!("shard p{p}"),
                            before: format!("{last:?}"),
                            after: format!("{shard:?}"),
                        });
                    }
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
        }
    }
}
