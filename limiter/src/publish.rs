//! Publishing a chunk's output to JetStream, so that no output can stall
//! the limiter.
//!
//! Messages go out in windows of at most [`WINDOW`] unacknowledged
//! publishes (the client refuses more than it allows in flight, and a chunk
//! of many rejected lines has thousands of dead letters), each window
//! retried until JetStream acknowledges it. When a window still fails after
//! [`TRIES_BEFORE_BLAME`] tries while NATS answers (a checkpoint marker to
//! every partition is stored in `SPEND`, and `DEADLETTER`'s info comes
//! back), the output itself is at fault, not NATS: the caller is told so
//! ([`Publish::Refused`]) and sets the input aside instead of retrying it
//! forever. While NATS does not answer, it retries without end: that is an
//! outage, and the input must wait for it.

use std::time::Duration;

use adspend_common::codec::encode_spend;
use adspend_common::nats::{spend_subject, DEADLETTER_STREAM};
use adspend_common::now_ms;
use adspend_common::types::{CheckpointMarker, SpendMessage};
use async_nats::jetstream::{self, context::PublishAckFuture};
use async_nats::HeaderMap;
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

/// Most publishes awaiting their acknowledgement at once.
pub const WINDOW: usize = 256;
/// Failed tries of one window, NATS answering all along, after which the
/// output is blamed.
pub const TRIES_BEFORE_BLAME: u32 = 5;
/// Longest wait for one window to be acknowledged.
const WINDOW_TIMEOUT: Duration = Duration::from_secs(15);
/// Longest wait for the probe when asking whether NATS answers.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// One message to publish.
pub struct OutMessage {
    pub subject: String,
    pub headers: HeaderMap,
    pub payload: Bytes,
}

pub enum Publish {
    /// Acknowledged, with each message's stream sequence.
    Done(Vec<u64>),
    /// Shutdown came while retrying: the input stays unacknowledged and is
    /// redelivered to the next limiter.
    Abandoned,
    /// NATS answers, but would not take this output: the last error.
    Refused(String),
}

/// A checkpoint marker for every partition, all with one id: what the
/// limiter injects every checkpoint interval.
pub fn markers(partitions: u32) -> Vec<OutMessage> {
    let marker_id = now_ms() as u64;
    (0..partitions)
        .map(|partition| OutMessage {
            subject: spend_subject(partition),
            headers: HeaderMap::new(),
            payload: encode_spend(&SpendMessage::Marker(CheckpointMarker {
                marker_id,
                partition,
                emitted_ms: now_ms(),
            }))
            .into(),
        })
        .collect()
}

#[derive(Clone)]
pub struct Publisher {
    js: jetstream::Context,
    shutdown: CancellationToken,
    partitions: u32,
}

impl Publisher {
    pub fn new(js: jetstream::Context, partitions: u32, shutdown: CancellationToken) -> Self {
        Publisher {
            js,
            shutdown,
            partitions,
        }
    }

    /// Publish every message in order. `may_refuse`: give up on output that
    /// NATS keeps refusing while it answers; otherwise retry until done or
    /// shut down (for small messages we make ourselves, like markers).
    pub async fn publish(&self, messages: &[OutMessage], may_refuse: bool) -> Publish {
        let mut seqs = Vec::with_capacity(messages.len());
        for window in messages.chunks(WINDOW) {
            match self.publish_window(window, may_refuse).await {
                Publish::Done(window_seqs) => seqs.extend(window_seqs),
                other => return other,
            }
        }
        Publish::Done(seqs)
    }

    async fn publish_window(&self, window: &[OutMessage], may_refuse: bool) -> Publish {
        let mut backoff = Duration::from_millis(50);
        let mut tries = 0;
        loop {
            // A publish blocks while NATS is unreachable and the client's
            // buffer is full: bound it, and let shutdown interrupt it.
            let attempt = tokio::time::timeout(WINDOW_TIMEOUT, self.try_window(window));
            let result = tokio::select! {
                _ = self.shutdown.cancelled() => return Publish::Abandoned,
                result = attempt => result.unwrap_or_else(|_| {
                    Err(format!("no acknowledgement within {WINDOW_TIMEOUT:?}"))
                }),
            };
            let error = match result {
                Ok(seqs) => return Publish::Done(seqs),
                Err(e) => e,
            };
            tries += 1;
            if may_refuse && tries >= TRIES_BEFORE_BLAME && self.nats_answers().await {
                return Publish::Refused(error);
            }
            tracing::warn!(error = %error, tries, retry_in_ms = backoff.as_millis() as u64, "publish failed; retrying");
            tokio::select! {
                _ = self.shutdown.cancelled() => return Publish::Abandoned,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// The stream sequence of each message, in order. Pipelined: the whole
    /// window is sent, then its acknowledgements collected.
    async fn try_window(&self, window: &[OutMessage]) -> Result<Vec<u64>, String> {
        let mut pending: Vec<PublishAckFuture> = Vec::with_capacity(window.len());
        for m in window {
            let ack = self
                .js
                .publish_with_headers(m.subject.clone(), m.headers.clone(), m.payload.clone())
                .await
                .map_err(|e| {
                    format!("publish to {} ({} bytes): {e}", m.subject, m.payload.len())
                })?;
            pending.push(ack);
        }
        let mut seqs = Vec::with_capacity(pending.len());
        for ack in pending {
            seqs.push(ack.await.map_err(|e| format!("publish ack: {e}"))?.sequence);
        }
        Ok(seqs)
    }

    /// Whether NATS takes what the limiter writes: a marker to every
    /// partition is stored (an extra checkpoint is harmless), and
    /// `DEADLETTER` answers. Then a publish that keeps failing is the
    /// output's fault.
    async fn nats_answers(&self) -> bool {
        let probe = async {
            self.try_window(&markers(self.partitions)).await.is_ok()
                && self.js.get_stream(DEADLETTER_STREAM).await.is_ok()
        };
        tokio::time::timeout(PROBE_TIMEOUT, probe)
            .await
            .unwrap_or(false)
    }
}
