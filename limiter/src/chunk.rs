//! One chunk of input messages, from pulled to acknowledged: mapped to
//! output ([`emit`](crate::emit)), the output published
//! ([`publish`](crate::publish)), then the input acknowledged. Output NATS
//! keeps refusing while it answers is narrowed down to the message that
//! makes it, which is set aside ([`set_aside`](crate::set_aside)), so one
//! message can never stop the others.

use std::sync::Arc;
use std::time::Duration;

use adspend_common::catalog::Catalog;
use adspend_common::nats::spend_subject;
use adspend_common::telemetry::{
    IMPRESSIONS_TOTAL, MARKERS_TOTAL, REDELIVERED_IMPRESSIONS_TOTAL, REJECTED_TOTAL,
    SPEND_MESSAGES_TOTAL, TUPLES_EMITTED_TOTAL,
};
use adspend_common::{failpoint, now_ms};
use async_nats::jetstream::{self, consumer};
use async_nats::HeaderMap;
use tokio::sync::watch;

use crate::downstream::Downstream;
use crate::emit::{self, Input, Output};
use crate::publish::{OutMessage, Publish, Publisher};

const PROGRESS_EVERY: Duration = Duration::from_millis(500);
/// Longest wait for the input's acknowledgements.
const ACK_TIMEOUT: Duration = Duration::from_secs(15);
/// The most a spend tuple takes in a `SPEND` message: its fields, varint
/// encoded, and its limit id (up to 64 bytes) when it is the first of that
/// limit in the message. Bounds a message's tuples by the server's max payload.
const MAX_TUPLE_BYTES: u64 = 128;
/// Room in a `SPEND` message for its header and headers.
const MESSAGE_OVERHEAD_BYTES: u64 = 4096;

pub(crate) type PullMessage = Result<jetstream::Message, consumer::pull::MessagesError>;

pub(crate) struct Limiter {
    pub publisher: Publisher,
    pub catalog: watch::Receiver<Arc<Catalog>>,
    pub partitions: u32,
    pub tuples_per_message: usize,
    pub max_cost_micros: u64,
    pub downstream: Downstream,
    /// The server's max payload (bytes): the failure point that makes an
    /// output NATS refuses goes one past it.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub max_payload: usize,
}

/// Tuples per `SPEND` message: the setting, or fewer when the server's max
/// payload could not take that many.
pub(crate) fn tuples_per_message(setting: u32, max_payload: usize) -> usize {
    let fit = (max_payload as u64).saturating_sub(MESSAGE_OVERHEAD_BYTES) / MAX_TUPLE_BYTES;
    (u64::from(setting).min(fit)).max(1) as usize
}

/// The output NATS would not take, though it answered.
struct Refused(String);

impl Limiter {
    pub async fn handle_chunk(&mut self, chunk: Vec<PullMessage>) {
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
        let Err(Refused(error)) = self.handle_messages(&received).await else {
            return;
        };
        if received.len() == 1 {
            crate::set_aside::set_aside(&self.publisher, &received[0], &error).await;
            return;
        }
        tracing::warn!(messages = received.len(), error = %error, "NATS refuses a chunk's output; trying its messages one by one");
        for message in &received {
            if let Err(Refused(error)) = self.handle_messages(std::slice::from_ref(message)).await {
                crate::set_aside::set_aside(&self.publisher, message, &error).await;
            }
        }
    }

    /// Map, publish and acknowledge `messages` as one; `Refused` leaves
    /// them unacknowledged.
    async fn handle_messages(&mut self, messages: &[jetstream::Message]) -> Result<(), Refused> {
        let catalog = self.catalog.borrow().clone();
        let mut out = Output::new(self.partitions).with_max_cost(self.max_cost_micros);
        let mut published_min = i64::MAX;
        // Impressions read again: JetStream redelivered their message (an
        // ack wait ran out, or a limiter died holding it).
        let mut redelivered = 0;
        for message in messages {
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
        let publish = self.publish_output(&out, source_ms, messages);
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
                        messages.iter().map(|m| m.ack_with(jetstream::AckKind::Progress)),
                    );
                    let _ = tokio::time::timeout(PROGRESS_EVERY, acks).await;
                }
            }
        };
        match published {
            Publish::Done(_) => {}
            Publish::Abandoned => return Ok(()),
            Publish::Refused(error) => return Err(Refused(error)),
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
        let acks = futures::future::join_all(messages.iter().map(|m| m.ack()));
        match tokio::time::timeout(ACK_TIMEOUT, acks).await {
            Ok(results) => {
                if let Some(Err(e)) = results.into_iter().find(Result::is_err) {
                    tracing::warn!(error = %e, "input ack failed; the message will be redelivered and deduplicated");
                }
            }
            Err(_) => tracing::warn!("input acks timed out; unacknowledged messages will be redelivered and deduplicated"),
        }
        Ok(())
    }

    /// Publish everything and wait for JetStream to acknowledge all of it
    /// (re-sent tuples carry the same ids and are dropped downstream).
    async fn publish_output(
        &self,
        out: &Output,
        source_ms: i64,
        _input: &[jetstream::Message],
    ) -> Publish {
        let mut messages: Vec<OutMessage> = Vec::new();
        // Partition and tuples of each SPEND message, in `messages`' order.
        let mut spend = Vec::new();
        for (partition, out) in out.partitions.iter().enumerate() {
            for (payload, tuples) in out.encode(self.tuples_per_message, source_ms) {
                spend.push((partition as u32, tuples as u64));
                messages.push(OutMessage {
                    subject: spend_subject(partition as u32),
                    headers: HeaderMap::new(),
                    payload: payload.into(),
                });
            }
        }
        let spend_messages = messages.len();
        for letter in &out.dead_letters {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", letter.msg_id().as_str());
            headers.insert("Adspend-Reason", letter.reason);
            let payload = serde_json::to_vec(letter).expect("a dead letter serializes");
            messages.push(OutMessage {
                subject: format!("deadletter.{}", letter.reason),
                headers,
                payload: payload.into(),
            });
        }
        #[cfg(feature = "failpoints")]
        self.refuse_for_failpoint(_input, &mut messages);
        let published = self.publisher.publish(&messages, true).await;
        if let Publish::Done(seqs) = &published {
            metrics::counter!(SPEND_MESSAGES_TOTAL).increment(spend_messages as u64);
            for (&(partition, tuples), &seq) in spend.iter().zip(seqs) {
                self.downstream.published(partition, seq, tuples);
            }
        }
        published
    }

    /// `limiter.oversized_output=SEQ`: the output of the input message at
    /// stream sequence SEQ gets one message over the server's max payload,
    /// which NATS refuses as it would any such message.
    #[cfg(feature = "failpoints")]
    fn refuse_for_failpoint(&self, input: &[jetstream::Message], messages: &mut Vec<OutMessage>) {
        let poisoned = input.iter().any(|m| {
            m.info().is_ok_and(|info| {
                failpoint::armed_for("limiter.oversized_output", info.stream_sequence)
            })
        });
        if poisoned {
            messages.push(OutMessage {
                subject: "deadletter.failpoint".to_string(),
                headers: HeaderMap::new(),
                payload: vec![0u8; self.max_payload + 1].into(),
            });
        }
    }

    pub async fn publish_markers(&mut self) {
        let markers = crate::publish::markers(self.partitions);
        if let Publish::Done(_) = self.publisher.publish(&markers, false).await {
            metrics::counter!(MARKERS_TOTAL).increment(u64::from(self.partitions));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spend_messages_fit_the_servers_max_payload() {
        assert_eq!(tuples_per_message(20_000, 8 * 1024 * 1024), 20_000);
        // NATS's default 1 MiB: fewer tuples, each message under it.
        let fit = tuples_per_message(20_000, 1024 * 1024);
        assert!(fit < 20_000 && fit > 1_000, "{fit}");
        assert!(fit as u64 * MAX_TUPLE_BYTES + MESSAGE_OVERHEAD_BYTES <= 1024 * 1024);
        assert_eq!(tuples_per_message(20_000, 100), 1, "at least one");
    }
}
