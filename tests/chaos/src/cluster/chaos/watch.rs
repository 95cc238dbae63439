//! What a campaign watches throughout: each partition applying (the
//! pacer's `/v1/shards`, every 200 ms), the checkpoint records and owner
//! epochs in etcd (every second), and three invariants: no pacer value
//! moves backwards, no checkpoint record goes back to an older epoch or
//! sequence, and the pacer never serves a partition under an epoch etcd
//! has not issued.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde::Deserialize;
use tokio_util::sync::CancellationToken;

use crate::cluster::compose::Cluster;
use adspend_sim::check::fetch_limits;

const PACER_EVERY: Duration = Duration::from_millis(200);
const ETCD_EVERY: Duration = Duration::from_secs(1);

#[derive(Deserialize)]
struct ShardsDoc {
    shards: Vec<ShardDoc>,
}

#[derive(Deserialize)]
struct ShardDoc {
    shard: String,
    epoch: u64,
    seq: u64,
    lag_ms: i64,
}

/// What one fault's window saw.
#[derive(Debug, Clone, Copy, Default)]
pub struct WindowResult {
    /// The longest time any partition went without applying.
    pub apply_gap: Duration,
    /// The longest time any partition went without a new checkpoint record.
    pub checkpoint_gap: Duration,
    /// The pacer's largest per-partition lag during the window.
    pub max_lag_ms: i64,
}

#[derive(Default)]
struct Partition {
    seq: u64,
    epoch: u64,
    applied_at: Option<Instant>,
    record: (u64, u64),
    recorded_at: Option<Instant>,
    issued_epoch: u64,
}

#[derive(Default)]
struct State {
    /// The pacer watched: its API's URL and a client for it.
    pacer: (String, reqwest::Client),
    partitions: BTreeMap<u32, Partition>,
    lifetime: BTreeMap<String, u64>,
    window: Option<(Instant, WindowResult)>,
    violations: Vec<String>,
    samples: u64,
    /// The highest etcd revision a read was answered at.
    etcd_revision: i64,
    /// Reads answered from before it.
    stale_reads: Vec<String>,
}

impl State {
    fn since(&self, at: Option<Instant>) -> Duration {
        let start = self.window.map(|(s, _)| s);
        match (at, start) {
            (Some(at), Some(start)) => at.max(start).elapsed(),
            (None, Some(start)) => start.elapsed(),
            (Some(at), None) => at.elapsed(),
            (None, None) => Duration::ZERO,
        }
    }

    fn widen(&mut self) {
        let apply = self
            .partitions
            .values()
            .map(|p| self.since(p.applied_at))
            .max()
            .unwrap_or_default();
        let checkpoint = self
            .partitions
            .values()
            .map(|p| self.since(p.recorded_at))
            .max()
            .unwrap_or_default();
        if let Some((_, w)) = &mut self.window {
            w.apply_gap = w.apply_gap.max(apply);
            w.checkpoint_gap = w.checkpoint_gap.max(checkpoint);
        }
    }
}

/// The sampler, running until [`Watch::finish`].
pub(super) struct Watch {
    state: Arc<Mutex<State>>,
    cancel: CancellationToken,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Watch {
    /// Watches the pacer at `url` through `http`.
    pub(super) fn start(cluster: Arc<Cluster>, url: &str, http: reqwest::Client) -> Watch {
        let state = Arc::new(Mutex::new(State {
            pacer: (url.to_owned(), http),
            ..State::default()
        }));
        let cancel = CancellationToken::new();
        let tasks = vec![
            tokio::spawn(sample_pacer(state.clone(), cancel.clone())),
            tokio::spawn(sample_etcd(cluster, state.clone(), cancel.clone())),
        ];
        Watch {
            state,
            cancel,
            tasks,
        }
    }

    /// Watch another pacer from now on (the usual one is under a fault),
    /// forgetting the values seen, which belonged to another process.
    pub(super) fn switch_pacer(&self, url: &str, http: reqwest::Client) {
        let mut state = self.state.lock().unwrap();
        state.pacer = (url.to_owned(), http);
        state.lifetime.clear();
        for p in state.partitions.values_mut() {
            p.seq = 0;
            p.epoch = 0;
        }
    }

    pub(super) fn open_window(&self) {
        self.state.lock().unwrap().window = Some((Instant::now(), WindowResult::default()));
    }

    pub(super) fn close_window(&self) -> WindowResult {
        let mut state = self.state.lock().unwrap();
        state.widen();
        state.window.take().map(|(_, w)| w).unwrap_or_default()
    }

    /// Partition → (applied seq, checkpoint seq) now, to wait for progress past.
    pub(super) fn marks(&self) -> BTreeMap<u32, (u64, u64)> {
        let state = self.state.lock().unwrap();
        state
            .partitions
            .iter()
            .map(|(p, s)| (*p, (s.seq, s.record.1)))
            .collect()
    }

    /// Partitions that have not both applied and checkpointed past `marks`.
    pub(super) fn behind(&self, marks: &BTreeMap<u32, (u64, u64)>) -> Vec<u32> {
        let state = self.state.lock().unwrap();
        marks
            .iter()
            .filter(|(p, (seq, record))| {
                state
                    .partitions
                    .get(p)
                    .is_none_or(|s| s.seq <= *seq || s.record.1 <= *record)
            })
            .map(|(p, _)| *p)
            .collect()
    }

    pub(super) fn partitions(&self) -> usize {
        self.state.lock().unwrap().partitions.len()
    }

    /// Stops sampling; returns the samples taken, every violation seen and
    /// every etcd read answered from behind.
    pub(super) async fn finish(self) -> (u64, Vec<String>, Vec<String>) {
        self.cancel.cancel();
        for task in self.tasks {
            let _ = task.await;
        }
        let state = self.state.lock().unwrap();
        (
            state.samples,
            state.violations.clone(),
            state.stale_reads.clone(),
        )
    }
}

async fn fetch_shards(http: &reqwest::Client, base: &str) -> anyhow::Result<Vec<(u32, ShardDoc)>> {
    let doc: ShardsDoc = http
        .get(format!("{base}/v1/shards"))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?;
    doc.shards
        .into_iter()
        .map(|s| {
            let p = s.shard.strip_prefix('p').and_then(|p| p.parse().ok());
            Ok((p.with_context(|| format!("shard {:?}", s.shard))?, s))
        })
        .collect()
}

async fn sample_pacer(state: Arc<Mutex<State>>, cancel: CancellationToken) {
    let mut round = 0u64;
    loop {
        let (base, http) = state.lock().unwrap().pacer.clone();
        let shards = fetch_shards(&http, &base).await;
        // Limits page through everything: once a second is enough.
        let limits = if round.is_multiple_of(5) {
            Some(fetch_limits(&http, &base).await)
        } else {
            None
        };
        round += 1;
        {
            let mut state = state.lock().unwrap();
            let state = &mut *state;
            if state.pacer.0 == base {
                if let Ok(shards) = shards {
                    state.samples += 1;
                    observe_shards(state, shards);
                }
                if let Some(Ok(limits)) = limits {
                    for limit in limits {
                        let last = state.lifetime.entry(limit.limit_id.clone()).or_default();
                        if limit.lifetime_spend_micros < *last {
                            state.violations.push(format!(
                                "{base}: limit {} lifetime spend went back from {} to {}",
                                limit.limit_id, last, limit.lifetime_spend_micros
                            ));
                        }
                        *last = limit.lifetime_spend_micros;
                    }
                }
            }
            state.widen();
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(PACER_EVERY) => {}
        }
    }
}

fn observe_shards(state: &mut State, shards: Vec<(u32, ShardDoc)>) {
    let now = Instant::now();
    for (p, s) in shards {
        if let Some((_, w)) = &mut state.window {
            w.max_lag_ms = w.max_lag_ms.max(s.lag_ms);
        }
        let part = state.partitions.entry(p).or_default();
        if (s.epoch, s.seq) < (part.epoch, part.seq) {
            state.violations.push(format!(
                "pacer shard p{p} went back from epoch {} seq {} to epoch {} seq {}",
                part.epoch, part.seq, s.epoch, s.seq
            ));
        }
        if s.seq > part.seq {
            part.applied_at = Some(now);
        }
        part.seq = s.seq;
        part.epoch = s.epoch;
    }
}

async fn sample_etcd(cluster: Arc<Cluster>, state: Arc<Mutex<State>>, cancel: CancellationToken) {
    loop {
        // The pacer's epochs as they were before the read: etcd's only grow,
        // so each must be at most what the read returns.
        let served: BTreeMap<u32, u64> = {
            let state = state.lock().unwrap();
            state
                .partitions
                .iter()
                .map(|(p, s)| (*p, s.epoch))
                .collect()
        };
        if let Ok(read) = cluster.etcd_prefix_at("/adspend/shards/p").await {
            let now = Instant::now();
            let mut state = state.lock().unwrap();
            let state = &mut *state;
            // A member that answers from before a revision already seen is
            // behind (a pause leaves etcd 3.4 members serving old reads,
            // etcd-io/etcd#20418): its values are older ones, not values
            // written back. Counted apart, checked against nothing.
            let keys = if read.revision < state.etcd_revision {
                state.stale_reads.push(format!(
                    "member {:x} answered at revision {} after {} had been read",
                    read.member, read.revision, state.etcd_revision
                ));
                BTreeMap::new()
            } else {
                state.etcd_revision = read.revision;
                read.values
            };
            for (key, value) in keys {
                let Some((p, field)) = key
                    .strip_prefix("/adspend/shards/p")
                    .and_then(|k| k.split_once('/'))
                else {
                    continue;
                };
                let Ok(p) = p.parse::<u32>() else { continue };
                let part = state.partitions.entry(p).or_default();
                match field {
                    "epoch" => part.issued_epoch = value.trim().parse().unwrap_or(0),
                    "checkpoint" => {
                        let record = serde_json::from_str::<serde_json::Value>(&value)
                            .ok()
                            .and_then(|r| Some((r["epoch"].as_u64()?, r["seq"].as_u64()?)));
                        let Some(record) = record else {
                            state
                                .violations
                                .push(format!("checkpoint record of p{p} unreadable: {value}"));
                            continue;
                        };
                        if record < part.record {
                            state.violations.push(format!(
                                "checkpoint record of p{p} went back from {:?} to {record:?} (epoch, seq)",
                                part.record
                            ));
                        }
                        if record != part.record {
                            part.recorded_at = Some(now);
                        }
                        part.record = record;
                    }
                    _ => {}
                }
            }
            for (p, part) in &state.partitions {
                if part.record.0 > part.issued_epoch && part.issued_epoch > 0 {
                    state.violations.push(format!(
                        "checkpoint record of p{p} carries epoch {} beyond the issued {}",
                        part.record.0, part.issued_epoch
                    ));
                }
                let epoch = served.get(p).copied().unwrap_or(0);
                if epoch > part.issued_epoch {
                    state.violations.push(format!(
                        "the pacer serves p{p} under epoch {epoch} that etcd never issued (issued {})",
                        part.issued_epoch
                    ));
                }
            }
        }
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(ETCD_EVERY) => {}
        }
    }
}
