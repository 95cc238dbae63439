//! The attackers of [`super`]: one task set per attack, counting what
//! each request got.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use super::*;
/// An attack under way: its tasks and what they count.
pub(super) struct Running {
    tasks: JoinSet<()>,
    counts: Arc<Counts>,
    attack: Attack,
    started: Instant,
}

#[derive(Default)]
struct Counts {
    /// Requests answered, by kind.
    ok: AtomicU64,
    refused: AtomicU64,
    other: AtomicU64,
    /// Slowloris: connections opened, and closed by the pacer.
    opened: AtomicU64,
    closed: AtomicU64,
}

impl Running {
    /// What the attacker got done, and how many requests (pushes) it sent
    /// that were answered.
    pub(super) async fn finish(mut self) -> (String, u64) {
        let secs = self.started.elapsed().as_secs_f64();
        while self.tasks.join_next().await.is_some() {}
        let c = &self.counts;
        let (ok, refused, other) = (
            c.ok.load(Relaxed),
            c.refused.load(Relaxed),
            c.other.load(Relaxed),
        );
        let done = match self.attack {
            Attack::None => "none".to_string(),
            Attack::Slowloris => format!(
                "{} connections opened, {} closed by the pacer, {:.0}/s",
                c.opened.load(Relaxed),
                c.closed.load(Relaxed),
                c.opened.load(Relaxed) as f64 / secs
            ),
            Attack::Pushes => format!(
                "{ok} pushes of {} entries published ({:.0}/s), {other} failed",
                c.opened.load(Relaxed),
                ok as f64 / secs
            ),
            _ => format!(
                "{ok} answered 200, {refused} refused 413, {other} other ({:.1} requests/s)",
                (ok + refused + other) as f64 / secs
            ),
        };
        (done, ok)
    }
}

pub(super) fn start_attack(
    attack: Attack,
    bench: &AttackBench,
    target: &str,
    ads: &[String],
    pushing: &Pushing,
    stop: CancellationToken,
) -> anyhow::Result<Running> {
    let counts = Arc::new(Counts::default());
    let mut tasks = JoinSet::new();
    let address = target.trim_start_matches("http://").to_string();
    match attack {
        Attack::None => {}
        Attack::Pushes => {
            counts.opened.store(bench.push_entries as u64, Relaxed);
            let shards = bench.push_shards.max(1);
            for shard in 0..shards {
                // Each shard its own limits, as partitions split them.
                let own: Vec<String> = pushing
                    .limits
                    .iter()
                    .skip(shard)
                    .step_by(shards)
                    .cloned()
                    .collect();
                tasks.spawn(pusher(
                    pushing.client.clone(),
                    format!("bench-{shard}"),
                    own,
                    bench.push_entries,
                    counts.clone(),
                    stop.clone(),
                ));
            }
        }
        Attack::Slowloris => {
            for _ in 0..bench.slow_connections {
                tasks.spawn(slow_client(address.clone(), counts.clone(), stop.clone()));
            }
        }
        Attack::Decisions | Attack::Oversized | Attack::Deepest => {
            let body = match attack {
                Attack::Decisions => serde_json::to_vec(&serde_json::json!({ "ad_ids": ads }))?,
                Attack::Deepest => serde_json::to_vec(
                    &serde_json::json!({ "ad_ids": vec![DEEPEST_AD; MAX_DECISION_IDS] }),
                )?,
                _ => serde_json::to_vec(&serde_json::json!({ "ad_ids": vec![""; OVERSIZED_IDS] }))?,
            };
            let body = Bytes::from(body);
            let http = reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(60))
                .build()?;
            for _ in 0..DECIDERS {
                tasks.spawn(decider(
                    http.clone(),
                    format!("{target}/v1/decisions"),
                    body.clone(),
                    counts.clone(),
                    stop.clone(),
                ));
            }
        }
    }
    Ok(Running {
        tasks,
        counts,
        attack,
        started: Instant::now(),
    })
}

/// What the `pushes` attack pushes with.
pub(super) struct Pushing {
    pub(super) client: async_nats::Client,
    pub(super) limits: Arc<Vec<String>>,
}

/// One shard's pushes, one every [`PUSH_EVERY`] until `stop`: `entries` of
/// its `limits` each (taken in turn), every one with more spend than the
/// last push gave it, consecutive `push_seq`s, as an aggregator pushes.
async fn pusher(
    client: async_nats::Client,
    shard: String,
    limits: Vec<String>,
    entries: usize,
    counts: Arc<Counts>,
    stop: CancellationToken,
) {
    if limits.is_empty() {
        return;
    }
    let subject = adspend_common::nats::sums_subject(&shard);
    let day = (adspend_common::now_ms() / 86_400_000) as u32;
    let mut next = 0usize;
    let mut every = tokio::time::interval(PUSH_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    for push_seq in 1u64.. {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = every.tick() => {}
        }
        let now = adspend_common::now_ms();
        let take = entries.min(limits.len());
        let batch = (0..take)
            .map(|i| {
                let limit = limits[(next + i) % limits.len()].clone();
                SumEntry {
                    limit,
                    bucket: day,
                    bucket_micros: push_seq * 1_000,
                    lifetime_micros: push_seq * 1_000,
                    lifetime_events: push_seq,
                }
            })
            .collect();
        next = (next + take) % limits.len();
        let update = SumsUpdate {
            shard: shard.clone(),
            epoch: 1,
            seq: push_seq,
            push_seq,
            full: false,
            watermark_ms: now,
            source_ms: now - 5,
            entries: batch,
        };
        let counter = match client
            .publish(subject.clone(), encode_sums(&update).into())
            .await
        {
            Ok(()) => &counts.ok,
            Err(_) => &counts.other,
        };
        counter.fetch_add(1, Relaxed);
    }
}

/// POSTs `body` back to back until `stop`.
async fn decider(
    http: reqwest::Client,
    url: String,
    body: Bytes,
    counts: Arc<Counts>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let sent = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body.clone())
            .send();
        let response = tokio::select! {
            _ = stop.cancelled() => return,
            r = sent => r,
        };
        let counter = match response {
            Ok(r) if r.status() == 200 => {
                let _ = r.bytes().await;
                &counts.ok
            }
            Ok(r) if r.status() == 413 => &counts.refused,
            _ => &counts.other,
        };
        counter.fetch_add(1, Relaxed);
    }
}

/// One slowloris connection at a time: a head that never ends, a header
/// line a second; a second after the pacer closes it, again.
async fn slow_client(address: String, counts: Arc<Counts>, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            c = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(&address)) => c,
        };
        if let Ok(Ok(mut stream)) = connected {
            counts.opened.fetch_add(1, Relaxed);
            if stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: pacer\r\n")
                .await
                .is_ok()
            {
                let mut buf = [0u8; 1024];
                let mut trickle = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        read = stream.read(&mut buf) => {
                            if matches!(read, Ok(0) | Err(_)) {
                                counts.closed.fetch_add(1, Relaxed);
                                break;
                            }
                        }
                        _ = trickle.tick() => {
                            if stream.write_all(b"X-Slow: a\r\n").await.is_err() {
                                counts.closed.fetch_add(1, Relaxed);
                                break;
                            }
                        }
                    }
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}
