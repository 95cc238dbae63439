//! The limiter: `IMPRESSIONS` → spend tuples on `SPEND`.
//!
//! [`run`] pulls input from a durable JetStream consumer in chunks; [`emit`]
//! parses each NDJSON line ([`validate`]), maps the ad to its limits through
//! the catalog and groups the tuples by partition; the chunk's output (spend
//! batches and dead letters) is published and acknowledged by JetStream before
//! the input is acknowledged. A timer injects a checkpoint marker into every
//! partition; it runs in the same loop, so markers are ordered with the
//! batches around them, as does a timer that sends the pacers a [`report`]
//! of how the input is shared among its sources.

pub mod config;
pub mod downstream;
pub mod emit;
pub mod error;
pub mod fair;
pub mod report;
pub mod validate;

use std::sync::Arc;
use std::time::Duration;

use adspend_common::catalog::Catalog;
use adspend_common::codec::encode_spend;
use adspend_common::nats::{self, spend_subject};
use adspend_common::service::{self, Context, Service};
use adspend_common::telemetry::{
    IMPRESSIONS_TOTAL, MARKERS_TOTAL, REDELIVERED_IMPRESSIONS_TOTAL, REJECTED_TOTAL,
    SPEND_MESSAGES_TOTAL, TUPLES_EMITTED_TOTAL,
};
use adspend_common::types::{CheckpointMarker, SpendMessage};
use adspend_common::{failpoint, now_ms};
use async_nats::jetstream::{self, consumer, context::PublishAckFuture};
use async_nats::HeaderMap;
use bytes::Bytes;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

pub use config::{Config, Validated};
use downstream::Downstream;
use emit::{Input, Output};
pub use error::Error;

const PROGRESS_EVERY: Duration = Duration::from_millis(500);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(5);
/// Longest wait for one round of publishes (or the input ack) to be confirmed.
const PUBLISH_TIMEOUT: Duration = Duration::from_secs(15);

impl Service for Validated {
    const NAME: &'static str = "limiter";
    type Config = Config;
    type Listeners = ();
    type Error = Error;

    fn validate(config: Config) -> Result<Self, Error> {
        Ok(config.validate()?)
    }

    fn metrics_addr(&self) -> std::net::SocketAddr {
        self.metrics_addr
    }

    async fn bind(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn run(self, _: (), context: Context) -> Result<(), Error> {
        run(self, context).await
    }
}

impl service::Failure for Error {
    fn exit_code(&self) -> u8 {
        Error::exit_code(self)
    }
}

/// Run until `context.shutdown`; on shutdown the chunk in hand is finished
/// first.
pub async fn run(validated: Validated, context: Context) -> Result<(), Error> {
    let Validated {
        config,
        catalog: catalog_source,
        ..
    } = validated;
    let shutdown = context.shutdown;
    let catalog = catalog_source.clone().watch(shutdown.clone()).await?;
    let client = nats::connect(&config.nats, "adspend-limiter").await?;
    let js = jetstream::new(client.clone());
    let replicas = config.streams.replicas();
    let impressions = nats::ensure_impressions(&js, replicas).await?;
    nats::ensure_spend(&js, replicas).await?;
    nats::ensure_deadletter(&js, replicas).await?;

    // FIFO scheduling holds nobody back: nothing to count.
    let fair = config.scheduling == config::Scheduling::Fair;
    let bound = if fair {
        config.downstream_max_tuples
    } else {
        0
    };
    let downstream = Downstream::new(
        config.partitions.partitions,
        downstream::Window {
            bound,
            target: (config.downstream_target_ms > 0)
                .then(|| Duration::from_millis(config.downstream_target_ms)),
        },
    );
    if bound > 0 {
        downstream.follow(&client, shutdown.clone()).await?;
    }
    let mut input = fair::Input::open(&impressions, &config, downstream.clone()).await?;

    tracing::info!(
        catalog = catalog_source.describe(),
        partitions = config.partitions.partitions,
        scheduling = ?config.scheduling,
        checkpoint_interval_ms = config.checkpoint_interval_ms,
        "limiter running"
    );
    let mut limiter = Limiter {
        js,
        catalog,
        partitions: config.partitions.partitions,
        tuples_per_message: config.tuples_per_message as usize,
        max_cost_micros: config.max_cost_micros,
        shutdown: shutdown.clone(),
        downstream,
    };
    let mut markers = tokio::time::interval(config.checkpoint_interval());
    markers.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    markers.tick().await;
    let mut reporter = report::Reporter::new(&config.consumer, config.scheduling);
    let mut reports = tokio::time::interval(report::REPORT_EVERY);
    reports.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = markers.tick() => limiter.publish_markers().await,
            _ = reports.tick() => reporter.send(&client, input.report()).await,
            chunk = input.next() => match chunk {
                Some(chunk) => limiter.handle_chunk(chunk).await,
                None => {
                    tracing::warn!("impressions consumer ended");
                    break;
                }
            },
        }
    }
    tracing::info!("limiter stopped");
    Ok(())
}

pub(crate) type PullMessage = Result<jetstream::Message, consumer::pull::MessagesError>;

struct Limiter {
    js: jetstream::Context,
    catalog: watch::Receiver<Arc<Catalog>>,
    partitions: u32,
    tuples_per_message: usize,
    max_cost_micros: u64,
    shutdown: CancellationToken,
    downstream: Downstream,
}

enum Publish {
    /// Acknowledged, with each message's stream sequence.
    Done(Vec<u64>),
    /// Shutdown came while retrying: the input stays unacknowledged and is
    /// redelivered to the next limiter.
    Abandoned,
}

impl Limiter {
    async fn handle_chunk(&mut self, chunk: Vec<PullMessage>) {
        let mut received = Vec::with_capacity(chunk.len());
        for message in chunk {
            match message {
                Ok(m) => received.push(m),
                // Heartbeat misses and the like: the stream recovers by itself.
                Err(e) => tracing::warn!(error = %e, "impressions consumer error"),
            }
        }
        if received.is_empty() {
            return;
        }
        let catalog = self.catalog.borrow().clone();
        let mut out = Output::new(self.partitions).with_max_cost(self.max_cost_micros);
        let mut published_min = i64::MAX;
        // Impressions read again: JetStream redelivered their message (an
        // ack wait ran out, or a limiter died holding it).
        let mut redelivered = 0;
        for message in &received {
            let (stream_seq, published_ms, delivered) = match message.info() {
                Ok(info) => (
                    info.stream_sequence,
                    (info.published.unix_timestamp_nanos() / 1_000_000) as i64,
                    info.delivered,
                ),
                Err(_) => (0, now_ms(), 1),
            };
            published_min = published_min.min(published_ms);
            let before = out.impressions;
            out.add(
                &Input {
                    stream_seq,
                    payload: &message.payload,
                },
                &catalog,
            );
            if delivered > 1 {
                redelivered += out.impressions - before;
            }
        }
        let source_ms = emit::chunk_source_ms(published_min, out.oldest_ts_ms);
        let publish = self.publish_output(&out, source_ms);
        tokio::pin!(publish);
        let mut progress =
            tokio::time::interval_at(tokio::time::Instant::now() + PROGRESS_EVERY, PROGRESS_EVERY);
        let published = loop {
            tokio::select! {
                published = &mut publish => break published,
                // Still publishing (NATS slow or away): tell JetStream the
                // input is in hand, so it is not redelivered meanwhile.
                _ = progress.tick() => {
                    let acks = futures::future::join_all(
                        received.iter().map(|m| m.ack_with(jetstream::AckKind::Progress)),
                    );
                    let _ = tokio::time::timeout(PROGRESS_EVERY, acks).await;
                }
            }
        };
        if let Publish::Abandoned = published {
            return;
        }
        failpoint::hit("limiter.after_publish");
        metrics::counter!(IMPRESSIONS_TOTAL).increment(out.impressions);
        metrics::counter!(REDELIVERED_IMPRESSIONS_TOTAL).increment(redelivered);
        metrics::counter!(TUPLES_EMITTED_TOTAL).increment(out.tuples() as u64);
        for (reason, n) in &out.rejected {
            metrics::counter!(REJECTED_TOTAL, "reason" => reason.as_str()).increment(*n);
        }
        // Only now is the input safe to acknowledge. A lost ack means a
        // redelivery, whose tuples carry the same ids and are dropped.
        let acks = futures::future::join_all(received.iter().map(|m| m.ack()));
        match tokio::time::timeout(PUBLISH_TIMEOUT, acks).await {
            Ok(results) => {
                if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
                    tracing::warn!(error = %e, "input ack failed; the message will be redelivered and deduplicated");
                }
            }
            Err(_) => tracing::warn!("input acks timed out; unacknowledged messages will be redelivered and deduplicated"),
        }
    }

    /// Publish everything and wait for JetStream to acknowledge all of it,
    /// retrying until it does (re-sent tuples carry the same ids and are
    /// dropped downstream).
    async fn publish_output(&self, out: &Output, source_ms: i64) -> Publish {
        let mut messages: Vec<(String, HeaderMap, Bytes)> = Vec::new();
        // Partition and tuples of each SPEND message, in `messages`' order.
        let mut spend = Vec::new();
        for (partition, out) in out.partitions.iter().enumerate() {
            for (payload, tuples) in out.encode(self.tuples_per_message, source_ms) {
                spend.push((partition as u32, tuples as u64));
                messages.push((
                    spend_subject(partition as u32),
                    HeaderMap::new(),
                    payload.into(),
                ));
            }
        }
        let spend_messages = messages.len();
        for letter in &out.dead_letters {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", letter.msg_id().as_str());
            headers.insert("Adspend-Reason", letter.reason);
            let payload = serde_json::to_vec(letter).expect("a dead letter serializes");
            messages.push((
                format!("deadletter.{}", letter.reason),
                headers,
                payload.into(),
            ));
        }
        let published = self.publish_all(&messages).await;
        if let Publish::Done(seqs) = &published {
            metrics::counter!(SPEND_MESSAGES_TOTAL).increment(spend_messages as u64);
            for (&(partition, tuples), &seq) in spend.iter().zip(seqs) {
                self.downstream.published(partition, seq, tuples);
            }
        }
        published
    }

    async fn publish_all(&self, messages: &[(String, HeaderMap, Bytes)]) -> Publish {
        let mut backoff = Duration::from_millis(50);
        loop {
            // A publish blocks while NATS is unreachable and its buffer is
            // full: bound it, and let shutdown interrupt it.
            let attempt = tokio::time::timeout(PUBLISH_TIMEOUT, self.try_publish_all(messages));
            let result = tokio::select! {
                _ = self.shutdown.cancelled() => return Publish::Abandoned,
                result = attempt => result.unwrap_or_else(|_| Err(format!("no acknowledgement within {PUBLISH_TIMEOUT:?}"))),
            };
            match result {
                Ok(seqs) => return Publish::Done(seqs),
                Err(e) => {
                    tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "publish failed; retrying");
                    tokio::select! {
                        _ = self.shutdown.cancelled() => return Publish::Abandoned,
                        _ = tokio::time::sleep(backoff) => {}
                    }
                    backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
                }
            }
        }
    }

    /// The stream sequence of each message, in order.
    async fn try_publish_all(
        &self,
        messages: &[(String, HeaderMap, Bytes)],
    ) -> Result<Vec<u64>, String> {
        // Pipelined: send everything, then collect the acknowledgements.
        let mut pending: Vec<PublishAckFuture> = Vec::with_capacity(messages.len());
        for (subject, headers, payload) in messages {
            let ack = self
                .js
                .publish_with_headers(subject.clone(), headers.clone(), payload.clone())
                .await
                .map_err(|e| format!("publish to {subject}: {e}"))?;
            pending.push(ack);
        }
        let mut seqs = Vec::with_capacity(pending.len());
        for ack in pending {
            seqs.push(ack.await.map_err(|e| format!("publish ack: {e}"))?.sequence);
        }
        Ok(seqs)
    }

    async fn publish_markers(&mut self) {
        let marker_id = now_ms() as u64;
        let messages: Vec<(String, HeaderMap, Bytes)> = (0..self.partitions)
            .map(|partition| {
                let payload = encode_spend(&SpendMessage::Marker(CheckpointMarker {
                    marker_id,
                    partition,
                    emitted_ms: now_ms(),
                }));
                (spend_subject(partition), HeaderMap::new(), payload.into())
            })
            .collect();
        if let Publish::Done(_) = self.publish_all(&messages).await {
            metrics::counter!(MARKERS_TOTAL).increment(u64::from(self.partitions));
        }
    }
}
