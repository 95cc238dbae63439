//! Reading `SPEND`: an ordered consumer (no acknowledgements) from the first
//! sequence not yet applied, recreated from the last sequence handed on
//! whenever it fails, and whenever the client has reconnected (a restarted
//! server has lost the consumer, and the client's own recovery of it can
//! take seconds). Before reading, the stream's bounds are checked against
//! the restore point ([`super::bounds`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_common::nats::{spend_subject, Reconnect};
use adspend_common::now_ms;
use adspend_wire::codec::decode_spend;
use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use async_nats::jetstream::Message;
use futures::StreamExt;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::bounds::{bounds, Bounds};
use crate::apply::{Dirty, Incoming};
use crate::error::Error;
use crate::telemetry::SPEND_SET_ASIDE_TOTAL;

const INTEGRITY_CHECK: Duration = Duration::from_secs(2);
/// How long without a message before an idle, caught-up consumer says its
/// sums are complete as of now (well within the pacer's smallest stale
/// threshold, 2 s, with the pushes' 1 s heartbeat on top).
const IDLE_CHECK: Duration = Duration::from_millis(250);
/// No message for this long while the stream holds unread ones: recreate.
const STALL: Duration = Duration::from_secs(2);
/// Between tries to make a consumer while JetStream does not answer (a
/// server still starting).
const UNAVAILABLE_RETRY: Duration = Duration::from_millis(250);
pub(crate) struct Consumer {
    pub(crate) stream: Stream,
    /// The stream's bounds against the position, checked at every
    /// (re)creation and stall.
    pub(crate) bounds: Bounds,
    /// Where undecodable messages are set aside (`DEADLETTER`).
    pub(crate) deadletters: async_nats::jetstream::Context,
    pub(crate) owned: Option<Vec<u32>>,
    pub(crate) next_seq: u64,
    pub(crate) tx: mpsc::Sender<Incoming>,
    /// Told when the consumer is idle and caught up, so that the pushes'
    /// watermark moves while no spend arrives ([`Dirty::caught_up`]).
    pub(crate) dirty: Arc<Dirty>,
    /// Messages the stream had behind the last one received (`u64::MAX`:
    /// not known).
    pub(crate) last_pending: u64,
    /// The last sequence handed to the writer.
    pub(crate) last_sent_seq: u64,
}

impl Consumer {
    fn config(&self) -> OrderedConfig {
        let mut config = OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartSequence {
                start_sequence: self.next_seq,
            },
            // Short pulls: after a server restart the (in-memory) consumer
            // is gone, and a long pull hides that for its whole duration.
            max_expires: Duration::from_secs(2),
            ..Default::default()
        };
        if let Some(owned) = &self.owned {
            config.filter_subjects = owned.iter().map(|p| spend_subject(*p)).collect();
        }
        config
    }

    /// The last sequence of `SPEND` this consumer reads: the stream's last,
    /// or, for a shard of some partitions, the last of their subjects (the
    /// stream's head may be another shard's).
    async fn own_last(&mut self) -> Result<u64, Error> {
        let Some(owned) = &self.owned else {
            return Ok(bounds(&mut self.stream).await?.1);
        };
        let mut last = 0;
        for partition in owned {
            match self
                .stream
                .get_last_raw_message_by_subject(&spend_subject(*partition))
                .await
            {
                Ok(message) => last = last.max(message.sequence),
                Err(e) if matches!(e.kind(), LastRawMessageErrorKind::NoMessageFound) => {}
                Err(e) => return Err(Error::consumer("last message of a partition")(e)),
            }
        }
        Ok(last)
    }

    pub(crate) async fn run(mut self, cancel: CancellationToken) -> Result<(), Error> {
        let mut first = true;
        let statistics = self.deadletters.client().statistics();
        loop {
            // Watched from before the consumer is made: a reconnect from
            // here on may have lost it.
            let reconnect = Reconnect::from_now(&statistics);
            // On every (re)creation: a stream that lost messages we still
            // need, or went back below what we applied, is a loud stop.
            if !first {
                match self.bounds.check(self.next_seq - 1).await {
                    Ok(_) => {}
                    Err(e) if !e.is_retryable() => return Err(e),
                    Err(e) => tracing::warn!(error = %e, "SPEND bounds check failed; retrying"),
                }
            }
            first = false;
            // Caught up at (re)creation when our part of the stream ends
            // before us.
            if let Ok(last) = self.own_last().await {
                self.last_pending = last.saturating_sub(self.next_seq - 1);
            }
            let messages = match self.stream.create_consumer(self.config()).await {
                Ok(consumer) => consumer.messages().await,
                Err(e) => Err(async_nats::jetstream::consumer::StreamError::with_source(
                    async_nats::jetstream::consumer::StreamErrorKind::Other,
                    e,
                )),
            };
            let mut messages = match messages {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, next_seq = self.next_seq, "SPEND consumer unavailable; retrying");
                    tokio::select! {
                        _ = cancel.cancelled() => return Ok(()),
                        _ = tokio::time::sleep(UNAVAILABLE_RETRY) => continue,
                    }
                }
            };
            if let Next::Stop = self.drain(&mut messages, &reconnect, &cancel).await? {
                return Ok(());
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    /// Hands what one consumer delivers to the writer until it must be
    /// recreated (an error, an end, a stall) or the consumer stops (a
    /// cancel, the writer gone).
    async fn drain<S, E>(
        &mut self,
        messages: &mut S,
        reconnect: &Reconnect<'_>,
        cancel: &CancellationToken,
    ) -> Result<Next, Error>
    where
        S: futures::Stream<Item = Result<Message, E>> + Unpin,
        E: std::fmt::Display,
    {
        let mut integrity = tokio::time::interval(INTEGRITY_CHECK);
        integrity.tick().await;
        let mut last_received = Instant::now();
        // Since when NATS has answered the bounds checks: a consumer is
        // called stalled only once NATS has been reachable for `STALL`
        // (after an outage the reconnect recreates it first).
        let mut reachable_since = Instant::now();
        let mut last_gap_check: Option<Instant> = None;
        // The stream had nothing behind the last message received (or
        // nothing was received yet on a caught-up start), and the
        // sequence of the last one handed to the writer.
        let mut idle = tokio::time::interval(IDLE_CHECK);
        loop {
            let next = tokio::select! {
                _ = cancel.cancelled() => return Ok(Next::Stop),
                next = messages.next() => next,
                // Nothing arrives: if the last message read had nothing
                // behind it and the writer applied everything handed to
                // it, the sums are complete as of now.
                _ = idle.tick() => {
                    if reconnect.happened() {
                        tracing::info!(next_seq = self.next_seq, "NATS reconnected; recreating the SPEND consumer");
                        return Ok(Next::Recreate);
                    }
                    if self.last_pending == 0 && last_received.elapsed() >= IDLE_CHECK {
                        self.dirty.caught_up(self.last_sent_seq, now_ms());
                    }
                    continue;
                }
                // The consumer recreates itself inside the client after a
                // server restart; a stream that lost data then simply goes
                // quiet. Look at its bounds now and then.
                _ = integrity.tick() => {
                    match self.bounds.check(self.next_seq - 1).await {
                        Err(e) if !e.is_retryable() => return Err(e),
                        Err(_) => {
                            reachable_since = Instant::now();
                            continue;
                        }
                        // Messages of ours wait in the stream but none
                        // arrive while NATS answers: the consumer was lost
                        // (a server restart); recreate it.
                        Ok(last)
                            if last >= self.next_seq
                                && last_received.elapsed() >= STALL
                                && reachable_since.elapsed() >= STALL =>
                        {
                            if reconnect.happened() {
                                tracing::info!(next_seq = self.next_seq, "NATS reconnected; recreating the SPEND consumer");
                                return Ok(Next::Recreate);
                            }
                            let ours = match self.owned {
                                None => last,
                                Some(_) => self.own_last().await.unwrap_or(last),
                            };
                            if ours < self.next_seq {
                                // The stream's head is other partitions'.
                                continue;
                            }
                            tracing::warn!(next_seq = self.next_seq, last_seq = ours, "SPEND consumer stalled; recreating");
                            return Ok(Next::Recreate);
                        }
                        _ => continue,
                    }
                }
            };
            let message = match next {
                Some(Ok(m)) => m,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, next_seq = self.next_seq, "SPEND consumer error; recreating");
                    return Ok(Next::Recreate);
                }
                None => return Ok(Next::Recreate),
            };
            last_received = Instant::now();
            if let Next::Stop = self.handle(message, &mut last_gap_check, cancel).await? {
                return Ok(Next::Stop);
            }
        }
    }

    /// One delivered message: skipped when replayed, set aside when it
    /// does not decode, else handed to the writer (`Stop` once the writer
    /// is gone).
    async fn handle(
        &mut self,
        message: Message,
        last_gap_check: &mut Option<Instant>,
        cancel: &CancellationToken,
    ) -> Result<Next, Error> {
        let info = message
            .info()
            .map_err(Error::consumer("message metadata"))?;
        let seq = info.stream_sequence;
        if seq < self.next_seq {
            return Ok(Next::Go);
        }
        // A jump: normal when filtering some partitions (the others'
        // messages are skipped), a lost range otherwise. Where the
        // stream's head moved past what we need, stop loudly.
        if seq > self.next_seq
            && (self.owned.is_none() || last_gap_check.is_none_or(|t| t.elapsed() >= STALL))
        {
            *last_gap_check = Some(Instant::now());
            match self.bounds.check(self.next_seq - 1).await {
                Err(e) if !e.is_retryable() => return Err(e),
                // Unreachable for now: the next message or tick looks again.
                _ => {}
            }
        }
        let decoded = match decode_spend(&message.payload) {
            Ok(decoded) => decoded,
            Err(e) => {
                // Data, not environment: set it aside and go on. A
                // replay reaches the same message and the same decision.
                set_aside(
                    &self.deadletters,
                    seq,
                    &message.subject,
                    &message.payload,
                    &e.to_string(),
                )
                .await;
                self.next_seq = seq + 1;
                return Ok(Next::Go);
            }
        };
        let incoming = Incoming {
            seq,
            stream_ms: (info.published.unix_timestamp_nanos() / 1_000_000) as i64,
            pending: info.pending,
            message: decoded,
        };
        self.last_pending = incoming.pending;
        // The writer may hold the channel full for long (waiting for space
        // on a full disk): a stop must not wait for it.
        let sent = tokio::select! {
            sent = self.tx.send(incoming) => sent.is_ok(),
            _ = cancel.cancelled() => false,
        };
        if !sent {
            return Ok(Next::Stop);
        }
        self.last_sent_seq = seq;
        self.next_seq = seq + 1;
        Ok(Next::Go)
    }
}

/// How a consumer's loop goes on.
enum Next {
    /// On to the next message.
    Go,
    /// Make a new consumer from where the writer stands.
    Recreate,
    /// Stop consuming (cancelled, or the writer is gone).
    Stop,
}

/// A `SPEND` message that cannot be decoded (garbage, an unknown format
/// version, a tuple naming a limit the batch does not carry): logged,
/// counted, and dead lettered with its sequence, under a message id that
/// lets JetStream drop the copy a replay publishes again.
async fn set_aside(
    deadletters: &async_nats::jetstream::Context,
    seq: u64,
    subject: &str,
    payload: &[u8],
    reason: &str,
) {
    metrics::counter!(SPEND_SET_ASIDE_TOTAL, "reason" => "undecodable").increment(1);
    tracing::error!(
        seq,
        subject,
        bytes = payload.len(),
        error = reason,
        "SPEND message set aside: it cannot be decoded"
    );
    let letter = serde_json::json!({
        "reason": "spend_undecodable",
        "detail": reason,
        "stream": adspend_common::nats::SPEND_STREAM,
        "subject": subject,
        "stream_seq": seq,
        "bytes": payload.len(),
    });
    publish_dead_letter(
        deadletters,
        "spend_undecodable",
        &format!("spend-{seq}"),
        &letter,
    )
    .await;
}

/// Publish a dead letter about `SPEND` on `deadletter.<reason>`. The message
/// id makes a replay's copy a JetStream duplicate; a failure is logged, not
/// retried (the error log and the metric already tell).
pub(crate) async fn publish_dead_letter(
    deadletters: &async_nats::jetstream::Context,
    reason: &str,
    msg_id: &str,
    letter: &serde_json::Value,
) {
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg_id);
    headers.insert("Adspend-Reason", reason);
    let publish = async {
        deadletters
            .publish_with_headers(
                format!("deadletter.{reason}"),
                headers,
                letter.to_string().into(),
            )
            .await?
            .await
            .map(drop)
            .map_err(async_nats::Error::from)
    };
    match tokio::time::timeout(Duration::from_secs(5), publish).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::warn!(msg_id, error = %e, "dead letter about SPEND not published")
        }
        Err(_) => tracing::warn!(msg_id, "dead letter about SPEND timed out"),
    }
}
