//! The impression publisher: impressions into `impressions.<source>` on
//! JetStream, in batches, with acknowledgements.
//!
//! Batches are in the binary batch format of docs/INPUT.md by default (less
//! than half of NDJSON's bytes per impression in `IMPRESSIONS`, and cheaper
//! for the limiter to read); [`BatchFormat::Ndjson`] writes the contract's
//! NDJSON lines instead, for a pipeline older than the binary format.
//!
//! [`Publisher::publish`] puts an impression into a bounded buffer and
//! waits while the buffer is full (backpressure: the bidder slows down
//! instead of the process growing). A background task cuts batches of at
//! most `batch` impressions (or whatever arrived within `linger`), keeps at
//! most `in_flight` publishes waiting for their acks, and publishes a batch
//! whose ack failed again, with backoff, up to `tries` times. A retry is
//! harmless: the pipeline counts an impression id once, however often it
//! arrives. [`Publisher::close`] flushes everything and says what could not
//! be delivered.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use adspend_wire::batch::binary::BinaryBatch;
use async_nats::jetstream::{self, context::PublishAckFuture};
use bytes::{BufMut, Bytes, BytesMut};
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// One impression served.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Impression {
    /// Unique per impression: the same id twice is counted once.
    pub id: String,
    pub ad_id: String,
    pub cost_micros: u64,
    /// When it was served, unix milliseconds.
    pub ts_ms: i64,
    /// The lease it was served under ([`crate::LeaseBook::try_spend`]).
    pub lease_id: Option<Arc<str>>,
}

/// The format of the messages a [`Publisher`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BatchFormat {
    /// The binary batch format (docs/INPUT.md, "Binary batches").
    #[default]
    Binary,
    /// NDJSON lines (docs/INPUT.md), which every limiter version reads.
    Ndjson,
}

/// How a [`Publisher`] publishes.
#[derive(Debug, Clone)]
pub struct PublisherConfig {
    /// `impressions.<source>`.
    pub subject: String,
    /// The messages' format: binary unless asked.
    pub format: BatchFormat,
    /// Impressions per message (the benchmarks use 1,000).
    pub batch: usize,
    /// How long a batch waits to fill before it goes out anyway.
    pub linger: Duration,
    /// Impressions the buffer holds before `publish` waits.
    pub buffer: usize,
    /// Messages waiting for their JetStream ack at once.
    pub in_flight: usize,
    /// How long an ack may take.
    pub ack_timeout: Duration,
    /// Publishes of a batch in all before it counts as undelivered.
    pub tries: u32,
}

impl PublisherConfig {
    pub fn new(source: &str) -> Self {
        Self {
            subject: format!("impressions.{source}"),
            format: BatchFormat::default(),
            batch: 1_000,
            linger: Duration::from_millis(5),
            buffer: 100_000,
            in_flight: 64,
            ack_timeout: Duration::from_secs(10),
            tries: 5,
        }
    }
}

/// What a publisher did, returned by [`Publisher::close`].
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct PublishReport {
    /// Impressions in acknowledged messages.
    pub delivered: u64,
    pub messages: u64,
    /// Publishes made again after a failed one (harmless: ids dedupe).
    pub retries: u64,
    /// Impressions of batches that failed on every try: not in the
    /// pipeline, unless a try's ack was lost after NATS stored it. Publish
    /// them again (same ids) to be sure.
    pub undelivered: Vec<Impression>,
}

/// Why [`Publisher::publish`] took nothing.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("the publisher is closed")]
pub struct Closed;

/// A running publisher.
#[derive(Debug)]
pub struct Publisher {
    tx: mpsc::Sender<Impression>,
    task: JoinHandle<PublishReport>,
}

impl Publisher {
    pub fn start(client: async_nats::Client, config: PublisherConfig) -> Self {
        let (tx, rx) = mpsc::channel(config.buffer.max(1));
        let js = jetstream::ContextBuilder::new()
            .timeout(config.ack_timeout)
            .max_ack_inflight(config.in_flight.max(1))
            .build(client);
        let task = tokio::spawn(run(js, config, rx));
        Self { tx, task }
    }

    /// Buffers `impression`, waiting while the buffer is full.
    pub async fn publish(&self, impression: Impression) -> Result<(), Closed> {
        self.tx.send(impression).await.map_err(|_| Closed)
    }

    /// Buffers `impression` if there is room now; gives it back if not.
    pub fn try_publish(&self, impression: Impression) -> Result<(), Impression> {
        self.tx.try_send(impression).map_err(|e| e.into_inner())
    }

    /// Publishes everything buffered, waits for every ack, and reports.
    pub async fn close(self) -> PublishReport {
        drop(self.tx);
        self.task.await.unwrap_or_default()
    }
}

/// A batch on its way: its impressions, and tries made.
struct Batch {
    impressions: Vec<Impression>,
    payload: Bytes,
    tries: u32,
}

type Acked = (Result<(), String>, Batch);

async fn await_ack(ack: PublishAckFuture, batch: Batch) -> Acked {
    (ack.await.map(|_| ()).map_err(|e| e.to_string()), batch)
}

async fn run(
    js: jetstream::Context,
    config: PublisherConfig,
    mut rx: mpsc::Receiver<Impression>,
) -> PublishReport {
    let mut report = PublishReport::default();
    let mut in_flight = FuturesUnordered::new();
    let mut retry: VecDeque<Batch> = VecDeque::new();
    let mut open = true;
    let batch_size = config.batch.max(1);
    while open || !in_flight.is_empty() || !retry.is_empty() {
        // A batch: what is buffered, up to the batch size, waiting at most
        // the linger for it to fill.
        let mut impressions = Vec::new();
        if open && retry.is_empty() {
            let first = tokio::select! {
                got = rx.recv() => got,
                Some(acked) = in_flight.next(), if !in_flight.is_empty() => {
                    settle(acked, &config, &mut report, &mut retry).await;
                    continue;
                }
            };
            match first {
                Some(i) => impressions.push(i),
                None => open = false,
            }
            let linger = tokio::time::sleep(config.linger);
            tokio::pin!(linger);
            while open && impressions.len() < batch_size {
                tokio::select! {
                    got = rx.recv() => match got {
                        Some(i) => impressions.push(i),
                        None => open = false,
                    },
                    _ = &mut linger => break,
                }
            }
        }
        let batch = match retry.pop_front() {
            Some(b) => Some(b),
            None if !impressions.is_empty() => Some(Batch {
                payload: encode(config.format, &impressions),
                impressions,
                tries: 0,
            }),
            None => None,
        };
        if let Some(mut batch) = batch {
            while in_flight.len() >= config.in_flight.max(1) {
                let acked = in_flight.next().await.expect("not empty");
                settle(acked, &config, &mut report, &mut retry).await;
            }
            batch.tries += 1;
            if batch.tries > 1 {
                report.retries += 1;
            }
            match js
                .publish(config.subject.clone(), batch.payload.clone())
                .await
            {
                Ok(ack) => in_flight.push(await_ack(ack, batch)),
                Err(e) => {
                    settle(
                        (Err(e.to_string()), batch),
                        &config,
                        &mut report,
                        &mut retry,
                    )
                    .await
                }
            }
        } else if let Some(acked) = in_flight.next().await {
            settle(acked, &config, &mut report, &mut retry).await;
        }
    }
    report
}

async fn settle(
    acked: Acked,
    config: &PublisherConfig,
    report: &mut PublishReport,
    retry: &mut VecDeque<Batch>,
) {
    match acked {
        (Ok(()), batch) => {
            report.delivered += batch.impressions.len() as u64;
            report.messages += 1;
        }
        (Err(e), batch) if batch.tries < config.tries => {
            let backoff = Duration::from_millis(50u64 << batch.tries.min(6));
            tracing::warn!(error = %e, tries = batch.tries, "publish not acknowledged; publishing the batch again");
            tokio::time::sleep(backoff).await;
            retry.push_back(batch);
        }
        (Err(e), batch) => {
            tracing::warn!(error = %e, impressions = batch.impressions.len(), "publish failed on every try: undelivered");
            report.undelivered.extend(batch.impressions);
        }
    }
}

/// One message of `impressions` in `format`.
pub(crate) fn encode(format: BatchFormat, impressions: &[Impression]) -> Bytes {
    match format {
        BatchFormat::Binary => encode_binary(impressions),
        BatchFormat::Ndjson => encode_ndjson(impressions),
    }
}

/// A binary batch (docs/INPUT.md).
fn encode_binary(impressions: &[Impression]) -> Bytes {
    let mut batch = BinaryBatch::with_capacity(impressions.len() * 48);
    for i in impressions {
        batch.push(
            &i.id,
            &i.ad_id,
            i.cost_micros,
            i.ts_ms,
            i.lease_id.as_deref(),
        );
    }
    Bytes::from(batch.into_bytes())
}

/// NDJSON lines of docs/INPUT.md.
fn encode_ndjson(impressions: &[Impression]) -> Bytes {
    let mut out = BytesMut::with_capacity(impressions.len() * 110);
    for (n, i) in impressions.iter().enumerate() {
        if n > 0 {
            out.put_u8(b'\n');
        }
        let mut line = serde_json::json!({
            "id": i.id,
            "ad_id": i.ad_id,
            "cost_micros": i.cost_micros,
            "ts": i.ts_ms,
        });
        if let Some(lease) = &i.lease_id {
            line["lease_id"] = serde_json::Value::from(&**lease);
        }
        out.put_slice(line.to_string().as_bytes());
    }
    out.freeze()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn impressions() -> Vec<Impression> {
        vec![
            Impression {
                id: "a\"1".into(),
                ad_id: "ad-1".into(),
                cost_micros: 1_500,
                ts_ms: 1_767_225_600_000,
                lease_id: Some("mjuoif5c.3mv.0".into()),
            },
            Impression {
                id: "a2".into(),
                ad_id: "ad-2".into(),
                cost_micros: 0,
                ts_ms: 1_767_225_600_001,
                lease_id: None,
            },
        ]
    }

    #[test]
    fn lines_parse_as_the_limiter_reads_them() {
        let payload = encode(BatchFormat::Ndjson, &impressions());
        let lines: Vec<&[u8]> = payload.split(|b| *b == b'\n').collect();
        assert_eq!(lines.len(), 2);
        let first = adspend_wire::impression::parse_line(lines[0]).expect("a valid line");
        assert_eq!(first.id, "a\"1");
        assert_eq!(first.ad_id, "ad-1");
        assert_eq!(first.cost_micros, 1_500);
        assert_eq!(first.lease_id.as_deref(), Some("mjuoif5c.3mv.0"));
        let second = adspend_wire::impression::parse_line(lines[1]).expect("a valid line");
        assert_eq!(second.cost_micros, 0);
    }

    #[test]
    fn binary_batches_are_the_default_and_read_as_the_limiter_reads_them() {
        let config = PublisherConfig::new("s");
        assert_eq!(config.format, BatchFormat::Binary);
        let imps = impressions();
        let payload = encode(config.format, &imps);
        assert_eq!(
            adspend_wire::batch::Format::of(&payload),
            adspend_wire::batch::Format::Binary(adspend_wire::batch::binary::VERSION)
        );
        let read: Vec<_> = adspend_wire::batch::entries(&payload)
            .map(|e| e.parsed.expect("a valid entry"))
            .collect();
        assert_eq!(read.len(), imps.len());
        for (got, sent) in read.iter().zip(&imps) {
            assert_eq!(got.id, sent.id);
            assert_eq!(got.ad_id, sent.ad_id);
            assert_eq!(got.cost_micros, sent.cost_micros);
            assert_eq!(got.ts_ms, sent.ts_ms);
            assert_eq!(got.lease_id.as_deref(), sent.lease_id.as_deref());
        }
        let ndjson = encode(BatchFormat::Ndjson, &imps);
        assert!(
            payload.len() < ndjson.len(),
            "{} vs {}",
            payload.len(),
            ndjson.len()
        );
    }
}
