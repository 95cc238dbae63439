//! Publishing a chunk's output to JetStream, so that no output can stall
//! the limiter.
//!
//! Messages go out in windows of at most [`WINDOW`] unacknowledged
//! publishes (the client refuses more than it allows in flight, and a chunk
//! of many rejected lines has thousands of dead letters), each window
//! retried until JetStream acknowledges it.
//!
//! Every failed try is judged ([`Failure`]): a refusal about the message
//! itself (over the server's max payload, or a JetStream answer that the
//! request is bad) or an outage (a timeout, a lost connection, a restarted
//! server, a store that is full or has no room). Only a refusal that
//! repeats [`TRIES_BEFORE_BLAME`] times in a row blames the output: the
//! caller is told so ([`Publish::Refused`]) and sets the input aside instead
//! of retrying it forever. An outage is retried with backoff, visibly
//! (a WARN per try, `adspend_limiter_publish_retries_total` and
//! `adspend_limiter_publish_failing_since_seconds`), however long it lasts,
//! and the input waits for it: a message that was fine is never set aside
//! because NATS was away when its output was due.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use adspend_common::nats::{spend_subject, Reconnect};
use adspend_common::now_ms;
use adspend_wire::codec::encode_spend;
use adspend_wire::types::{CheckpointMarker, SpendMessage};
use async_nats::jetstream::{self, context::PublishAckFuture, context::PublishErrorKind};
use async_nats::HeaderMap;
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use crate::telemetry::{PUBLISH_FAILING_SINCE_SECONDS, PUBLISH_RETRIES_TOTAL};

/// Most publishes awaiting their acknowledgement at once.
pub(crate) const WINDOW: usize = 256;
/// Refusals of one window in a row after which the output is blamed.
pub(crate) const TRIES_BEFORE_BLAME: u32 = 5;
/// Longest wait for one window to be acknowledged.
const WINDOW_TIMEOUT: Duration = Duration::from_secs(15);
const RETRY_BACKOFF_MAX: Duration = Duration::from_secs(5);

/// One message to publish.
pub(crate) struct OutMessage {
    pub(crate) subject: String,
    pub(crate) headers: HeaderMap,
    pub(crate) payload: Bytes,
}

pub(crate) enum Publish {
    /// Acknowledged, with each message's stream sequence.
    Done(Vec<u64>),
    /// Shutdown came while retrying: the input stays unacknowledged and is
    /// redelivered to the next limiter.
    Abandoned,
    /// NATS answers, but would not take this output: the last error.
    Refused(String),
}

/// Why one try of a window failed, and whose fault it is.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) text: String,
    /// The message itself is refused, and would be again: over the max
    /// payload, or JetStream answered that the request is bad. Otherwise
    /// an outage, which says nothing about the message.
    pub(crate) refusal: bool,
}

impl Failure {
    fn outage(text: String) -> Self {
        Failure {
            text,
            refusal: false,
        }
    }

    /// Judge a publish error: a refusal only when it is about the message.
    /// A timeout (no ack: the server paused, restarted, its store full), a
    /// broken connection, no stream answering, a full store (JetStream's
    /// 503 "insufficient resources") or anything unknown is an outage.
    pub(crate) fn of(error: &jetstream::context::PublishError, text: String) -> Self {
        let refusal = match error.kind() {
            PublishErrorKind::MaxPayloadExceeded => true,
            PublishErrorKind::Other => std::error::Error::source(error)
                .and_then(|source| source.downcast_ref::<jetstream::Error>())
                .is_some_and(|answer| answer.code() == 400),
            _ => false,
        };
        Failure { text, refusal }
    }
}

/// A checkpoint marker for every partition, all with one id: what the
/// limiter injects every checkpoint interval.
pub(crate) fn markers(partitions: u32) -> Vec<OutMessage> {
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
pub(crate) struct Publisher {
    js: jetstream::Context,
    /// The client's counters: its `connects` tells a reconnect.
    statistics: Arc<async_nats::Statistics>,
    shutdown: CancellationToken,
    /// Unix ms of the first failure of the publishes failing now, 0 while
    /// they succeed: `adspend_limiter_publish_failing_since_seconds`.
    failing_since_ms: Arc<AtomicI64>,
}

impl Publisher {
    pub(crate) fn new(js: jetstream::Context, shutdown: CancellationToken) -> Self {
        metrics::gauge!(PUBLISH_FAILING_SINCE_SECONDS).set(0.0);
        Publisher {
            statistics: js.client().statistics(),
            js,
            shutdown,
            failing_since_ms: Arc::default(),
        }
    }

    /// Publish every message in order. `may_refuse`: give up on output that
    /// NATS keeps refusing for what it is; otherwise retry until done or
    /// shut down (for small messages we make ourselves, like markers).
    pub(crate) async fn publish(&self, messages: &[OutMessage], may_refuse: bool) -> Publish {
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
        let mut refusals = 0;
        loop {
            // A publish blocks while NATS is unreachable and the client's
            // buffer is full: bound it, and let shutdown interrupt it.
            let attempt = tokio::time::timeout(WINDOW_TIMEOUT, self.try_window(window));
            let reconnect = Reconnect::from_now(&self.statistics);
            let result = tokio::select! {
                _ = self.shutdown.cancelled() => return Publish::Abandoned,
                result = attempt => result.unwrap_or_else(|_| {
                    Err(Failure::outage(format!("no acknowledgement within {WINDOW_TIMEOUT:?}")))
                }),
                // The acknowledgements a lost server owed will not come:
                // publish again now rather than at the ack timeout (the
                // message ids make the copies duplicates).
                () = reconnect.wait() => Err(Failure::outage(
                    "NATS reconnected while acknowledgements were awaited".into(),
                )),
            };
            let failure = match result {
                Ok(seqs) => {
                    self.succeeded();
                    return Publish::Done(seqs);
                }
                Err(failure) => failure,
            };
            tries += 1;
            // An outage between two refusals says nothing about the message.
            refusals = if failure.refusal { refusals + 1 } else { 0 };
            if may_refuse && refusals >= TRIES_BEFORE_BLAME {
                return Publish::Refused(failure.text);
            }
            let cause = if failure.refusal { "refusal" } else { "outage" };
            metrics::counter!(PUBLISH_RETRIES_TOTAL, "cause" => cause).increment(1);
            let failing_for_s = self.failing_for_s();
            tracing::warn!(
                error = %failure.text,
                cause,
                tries,
                failing_for_s,
                retry_in_ms = backoff.as_millis() as u64,
                "publish failed; retrying"
            );
            tokio::select! {
                _ = self.shutdown.cancelled() => return Publish::Abandoned,
                _ = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(RETRY_BACKOFF_MAX);
        }
    }

    /// Note a failure; how long publishes have been failing, in seconds.
    fn failing_for_s(&self) -> u64 {
        let now = now_ms();
        let since = match self.failing_since_ms.compare_exchange(
            0,
            now,
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => {
                metrics::gauge!(PUBLISH_FAILING_SINCE_SECONDS).set(now as f64 / 1000.0);
                now
            }
            Err(since) => since,
        };
        (now - since).max(0) as u64 / 1000
    }

    fn succeeded(&self) {
        let since = self.failing_since_ms.swap(0, Ordering::AcqRel);
        if since != 0 {
            metrics::gauge!(PUBLISH_FAILING_SINCE_SECONDS).set(0.0);
            tracing::info!(failed_for_ms = now_ms() - since, "publishes succeed again");
        }
    }

    /// The stream sequence of each message, in order. Pipelined: the whole
    /// window is sent, then its acknowledgements collected.
    async fn try_window(&self, window: &[OutMessage]) -> Result<Vec<u64>, Failure> {
        let mut pending: Vec<PublishAckFuture> = Vec::with_capacity(window.len());
        for m in window {
            let ack = self
                .js
                .publish_with_headers(m.subject.clone(), m.headers.clone(), m.payload.clone())
                .await
                .map_err(|e| {
                    let text = format!("publish to {} ({} bytes): {e}", m.subject, m.payload.len());
                    Failure::of(&e, text)
                })?;
            pending.push(ack);
        }
        let mut seqs = Vec::with_capacity(pending.len());
        for ack in pending {
            let ack = ack
                .await
                .map_err(|e| Failure::of(&e, format!("publish ack: {e}")))?;
            seqs.push(ack.sequence);
        }
        Ok(seqs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jetstream::context::PublishError;

    fn answer(json: &str) -> PublishError {
        let error: jetstream::Error = serde_json::from_str(json).expect("a JetStream error");
        PublishError::with_source(PublishErrorKind::Other, error)
    }

    fn refusal(error: &PublishError) -> bool {
        Failure::of(error, error.to_string()).refusal
    }

    #[test]
    fn only_an_answer_about_the_message_is_a_refusal() {
        let too_big = PublishError::with_source(
            PublishErrorKind::MaxPayloadExceeded,
            std::io::Error::other("9 MB over 8 MB"),
        );
        assert!(refusal(&too_big));
        let bad = answer(
            r#"{"code":400,"err_code":10054,"description":"message size exceeds maximum allowed"}"#,
        );
        assert!(refusal(&bad));
    }

    #[test]
    fn timeouts_lost_connections_and_full_stores_are_outages() {
        for kind in [
            PublishErrorKind::TimedOut,
            PublishErrorKind::BrokenPipe,
            PublishErrorKind::StreamNotFound,
            PublishErrorKind::MaxAckPending,
            PublishErrorKind::Other,
        ] {
            assert!(!refusal(&PublishError::new(kind)), "{kind:?}");
        }
        let full =
            answer(r#"{"code":503,"err_code":10023,"description":"insufficient resources"}"#);
        assert!(!refusal(&full));
        let store = answer(r#"{"code":500,"err_code":10077,"description":"store failed"}"#);
        assert!(!refusal(&store));
    }
}
