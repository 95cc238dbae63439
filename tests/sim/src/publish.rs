//! The publish loop: paces event generation with a token bucket, keeps a
//! bounded window of JetStream publishes in flight, and books each message's
//! impressions into the truth when, and only when, its ack arrives.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::context::{PublishAckFuture, PublishError, PublishErrorKind};
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_nats::jetstream::{self, publish::PublishAck};
use async_nats::Subject;
use bytes::BytesMut;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use rand::Rng;
use tokio_util::sync::CancellationToken;

use super::event::{BadKind, Batch, Generator, GeneratorConfig};
use super::truth::{CatalogIndex, Stats, Truth, TruthBuilder};
use super::{check_run_id, Catalog, SimConfig, STREAM, STREAM_SUBJECTS};

/// A snapshot of a running simulation, reported every `progress_interval`.
#[derive(Debug, Clone, PartialEq)]
pub struct Progress {
    pub elapsed: Duration,
    pub events_sent: u64,
    pub messages_published: u64,
    pub messages_acked: u64,
    pub messages_failed: u64,
    pub acks_pending: usize,
    /// Events per second since the previous report.
    pub recent_rate: f64,
}

/// Creates the `IMPRESSIONS` stream (file storage) unless it exists; safe to
/// race with the limiter doing the same.
pub async fn ensure_stream(client: &async_nats::Client) -> anyhow::Result<()> {
    ensure_stream_in(&jetstream::new(client.clone())).await
}

async fn ensure_stream_in(js: &jetstream::Context) -> anyhow::Result<()> {
    let config = StreamConfig {
        name: STREAM.to_owned(),
        subjects: vec![STREAM_SUBJECTS.to_owned()],
        storage: StorageType::File,
        ..Default::default()
    };
    if js.get_or_create_stream(config).await.is_ok() {
        return Ok(());
    }
    // Someone else may have created it between our lookup and our create.
    js.get_stream(STREAM)
        .await
        .map(drop)
        .with_context(|| format!("creating JetStream stream {STREAM}"))
}

/// Runs the simulation, reporting progress through `tracing` at INFO.
pub async fn run(
    client: &async_nats::Client,
    config: &SimConfig,
    catalog: &Catalog,
    cancel: CancellationToken,
) -> anyhow::Result<Truth> {
    run_with_progress(client, config, catalog, cancel, |p| {
        tracing::info!(
            events_sent = p.events_sent,
            rate = p.recent_rate.round(),
            acks_pending = p.acks_pending,
            messages_failed = p.messages_failed,
            "simulator progress"
        );
    })
    .await
}

/// Publishes until the configured number of events or duration is reached,
/// or `cancel` fires; then waits for the acks still in flight and returns the
/// truth of everything acknowledged. Cancellation is not an error.
pub async fn run_with_progress(
    client: &async_nats::Client,
    config: &SimConfig,
    catalog: &Catalog,
    cancel: CancellationToken,
    mut on_progress: impl FnMut(&Progress),
) -> anyhow::Result<Truth> {
    config.validate()?;
    let index = Arc::new(CatalogIndex::new(catalog).context("invalid catalog")?);
    let run_id = match &config.run_id {
        Some(run_id) => run_id.clone(),
        None => random_run_id(),
    };
    check_run_id(&run_id)?;
    let mut generator = Generator::new(
        index.clone(),
        GeneratorConfig {
            seed: config.seed,
            zipf_exponent: config.zipf_exponent,
            cost: config.cost,
            duplicate_rate: config.duplicate_rate,
            bad_rate: config.bad_rate,
            bad_kinds: config.bad_kinds.clone(),
            event_time: config.event_time,
        },
        &run_id,
    )
    .and_then(|g| g.with_format(config.format))
    .map_err(anyhow::Error::msg)?;
    // Our own window bounds what is in flight; the context's must not be
    // smaller or publish would fail instead of waiting.
    let js = jetstream::ContextBuilder::new()
        .timeout(config.ack_timeout)
        .max_ack_inflight(config.in_flight)
        .build(client.clone());
    if config.create_stream {
        ensure_stream_in(&js).await?;
    }

    let mut sim = Sim {
        truth: TruthBuilder::from_index(index),
        counters: Counters::default(),
        spare: Vec::new(),
        first_failure_logged: false,
    };
    let subject = Subject::from(config.subject.as_str());
    let mut in_flight = FuturesUnordered::new();
    let mut payload = BytesMut::new();
    let mut bucket = TokenBucket::new(config.rate, config.batch);
    let start = Instant::now();
    let mut report = Report {
        at: start + config.progress_interval,
        last: start,
        events: 0,
    };

    loop {
        if cancel.is_cancelled() {
            break;
        }
        let now = Instant::now();
        if config.duration.is_some_and(|d| now - start >= d) {
            break;
        }
        if now >= report.at {
            on_progress(&report.next(now, start, &sim.counters, in_flight.len(), config));
        }
        let remaining = config
            .events
            .map_or(u64::MAX, |e| e - sim.counters.events_sent);
        if remaining == 0 {
            break;
        }
        let events = config
            .batch
            .min(usize::try_from(remaining).unwrap_or(usize::MAX));

        if let Some(wait) = bucket.take(events, now) {
            let deadline = config
                .duration
                .map_or(report.at, |d| report.at.min(start + d));
            let wait = wait.min(deadline.saturating_duration_since(now));
            // Ahead of the target rate: take in acks while the bucket fills.
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = cancel.cancelled() => {}
                Some((result, batch)) = in_flight.next(), if !in_flight.is_empty() => {
                    sim.on_ack(result, batch)?;
                }
            }
            continue;
        }
        while in_flight.len() >= config.in_flight {
            let (result, batch) = in_flight.next().await.expect("window is not empty");
            sim.on_ack(result, batch)?;
        }

        let mut batch = sim.spare.pop().unwrap_or_default();
        // Payloads are split off one shared buffer, refilled a chunk at a
        // time, so building a message allocates only now and then.
        let typical = config.batch * 128;
        if payload.capacity() < typical {
            payload.reserve(typical.max(1 << 20));
        }
        generator.write_message(events, unix_ms(), &mut payload, &mut batch);
        sim.counters.on_publish(&batch);
        match js.publish(subject.clone(), payload.split().freeze()).await {
            Ok(ack) => in_flight.push(await_ack(ack, batch)),
            Err(e) if e.kind() == PublishErrorKind::MaxPayloadExceeded => {
                let advice = "lower the batch size";
                anyhow::bail!(
                    "a batch of {events} events is too large for the server ({e}): {advice}"
                );
            }
            Err(e) => sim.on_failure(&e, batch),
        }
        while let Some(Some((result, batch))) = in_flight.next().now_or_never() {
            sim.on_ack(result, batch)?;
        }
    }

    while let Some((result, batch)) = in_flight.next().await {
        sim.on_ack(result, batch)?;
    }
    let elapsed = start.elapsed();
    let stats = sim.counters.into_stats(run_id, config.seed, elapsed);
    Ok(sim.truth.finish(stats))
}

/// One type for every ack future, so they fit one `FuturesUnordered`.
async fn await_ack(
    ack: PublishAckFuture,
    batch: Batch,
) -> (Result<PublishAck, PublishError>, Batch) {
    (ack.await, batch)
}

struct Sim {
    truth: TruthBuilder,
    counters: Counters,
    /// Batches whose acks were handled, kept to reuse their allocations.
    spare: Vec<Batch>,
    first_failure_logged: bool,
}

impl Sim {
    fn on_ack(
        &mut self,
        result: Result<PublishAck, PublishError>,
        mut batch: Batch,
    ) -> anyhow::Result<()> {
        match result {
            Ok(_) => {
                let c = &mut self.counters;
                c.messages_acked += 1;
                c.events_acked += u64::from(batch.events);
                for (acked, n) in c.bad_acked.iter_mut().zip(batch.bad) {
                    *acked += u64::from(n);
                }
                for event in &batch.good {
                    self.truth
                        .record_seq(event.seq, event.ad, event.cost, event.ts)?;
                }
            }
            Err(e) => {
                self.on_failure(&e, batch);
                return Ok(());
            }
        }
        batch.clear();
        self.spare.push(batch);
        Ok(())
    }

    fn on_failure(&mut self, error: &dyn std::fmt::Display, mut batch: Batch) {
        self.counters.messages_failed += 1;
        if !self.first_failure_logged {
            self.first_failure_logged = true;
            tracing::warn!(%error, "publish not acknowledged; its events are left out of the truth");
        }
        batch.clear();
        self.spare.push(batch);
    }
}

#[derive(Debug, Default)]
struct Counters {
    messages_published: u64,
    messages_acked: u64,
    messages_failed: u64,
    events_sent: u64,
    events_acked: u64,
    duplicates_sent: u64,
    bad_sent: [u64; BadKind::ALL.len()],
    bad_acked: [u64; BadKind::ALL.len()],
}

impl Counters {
    fn on_publish(&mut self, batch: &Batch) {
        self.messages_published += 1;
        self.events_sent += u64::from(batch.events);
        self.duplicates_sent += u64::from(batch.duplicates);
        for (sent, n) in self.bad_sent.iter_mut().zip(batch.bad) {
            *sent += u64::from(n);
        }
    }

    fn into_stats(self, run_id: String, seed: u64, elapsed: Duration) -> Stats {
        let by_reason = |counts: [u64; BadKind::ALL.len()]| {
            BadKind::ALL
                .iter()
                .zip(counts)
                .map(|(kind, n)| (kind.reason().to_owned(), n))
                .collect()
        };
        Stats {
            run_id,
            seed,
            messages_published: self.messages_published,
            messages_acked: self.messages_acked,
            messages_failed: self.messages_failed,
            events_sent: self.events_sent,
            events_acked: self.events_acked,
            unique_events: 0, // filled in by the truth
            duplicates_sent: self.duplicates_sent,
            bad_events_sent: by_reason(self.bad_sent),
            bad_events_acked: by_reason(self.bad_acked),
            elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
            events_per_sec: self.events_sent as f64 / elapsed.as_secs_f64().max(1e-9),
        }
    }
}

struct Report {
    /// When the next report is due.
    at: Instant,
    last: Instant,
    events: u64,
}

impl Report {
    fn next(
        &mut self,
        now: Instant,
        start: Instant,
        counters: &Counters,
        acks_pending: usize,
        config: &SimConfig,
    ) -> Progress {
        let since = now - self.last;
        let progress = Progress {
            elapsed: now - start,
            events_sent: counters.events_sent,
            messages_published: counters.messages_published,
            messages_acked: counters.messages_acked,
            messages_failed: counters.messages_failed,
            acks_pending,
            recent_rate: (counters.events_sent - self.events) as f64
                / since.as_secs_f64().max(1e-9),
        };
        self.at = now + config.progress_interval;
        self.last = now;
        self.events = counters.events_sent;
        progress
    }
}

/// Paces whole messages: tokens are events, refilled at the target rate, and
/// capped so that falling behind (slow acks) does not turn into a burst.
struct TokenBucket {
    rate: f64,
    capacity: f64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    fn new(rate: f64, batch: usize) -> Self {
        let capacity = (batch as f64).max(rate * 0.05);
        Self {
            rate,
            capacity,
            tokens: batch as f64,
            last: Instant::now(),
        }
    }

    /// Takes `events` tokens, or says how long until there are enough.
    fn take(&mut self, events: usize, now: Instant) -> Option<Duration> {
        if self.rate == 0.0 {
            return None;
        }
        let refill = (now - self.last).as_secs_f64() * self.rate;
        self.tokens = (self.tokens + refill).min(self.capacity);
        self.last = now;
        let events = events as f64;
        if self.tokens >= events {
            self.tokens -= events;
            None
        } else {
            Some(Duration::from_secs_f64((events - self.tokens) / self.rate))
        }
    }
}

use crate::stats::unix_ms;

/// Eight base-36 characters: ids of two runs against one stream never meet.
fn random_run_id() -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::rng();
    (0..8)
        .map(|_| DIGITS[rng.random_range(0..DIGITS.len())] as char)
        .collect()
}
