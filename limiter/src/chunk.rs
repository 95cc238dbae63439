//! One chunk of input messages, from pulled to acknowledged, in two steps
//! that run apart: [`Mapping::map_chunk`], on a thread of its own, maps
//! the chunk to output ([`emit`](crate::emit)) and encodes it; then, in the
//! order the chunks were read, [`Limiter::complete`] publishes the output
//! ([`publish`](crate::publish)) and acknowledges the input. Output NATS
//! keeps refusing for what it is is narrowed down to the message that
//! makes it, which is set aside ([`set_aside`](crate::set_aside)), so one
//! message can never stop the others.

use std::sync::Arc;
use std::time::Duration;

use adspend_common::nats::spend_subject;
use adspend_common::{failpoint, now_ms};
use adspend_wire::catalog::Catalog;
use async_nats::jetstream::{self, consumer};
use async_nats::HeaderMap;
use tokio::sync::watch;

use crate::downstream::Downstream;
use crate::emit::{self, Input, Output};
use crate::publish::{OutMessage, Publish, Publisher};
use crate::telemetry::{
    IMPRESSIONS_TOTAL, MARKERS_TOTAL, REDELIVERED_IMPRESSIONS_TOTAL, REJECTED_TOTAL,
    SPEND_MESSAGES_TOTAL, TUPLES_EMITTED_TOTAL,
};

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

/// Tuples per `SPEND` message: the setting, or fewer when the server's max
/// payload could not take that many.
pub(crate) fn tuples_per_message(setting: u32, max_payload: usize) -> usize {
    let fit = (max_payload as u64).saturating_sub(MESSAGE_OVERHEAD_BYTES) / MAX_TUPLE_BYTES;
    (u64::from(setting).min(fit)).max(1) as usize
}

/// What mapping a chunk needs; cloned into every mapping thread.
#[derive(Clone)]
pub struct Mapping {
    pub catalog: watch::Receiver<Arc<Catalog>>,
    pub partitions: u32,
    pub tuples_per_message: usize,
    pub max_cost_micros: u64,
    /// The server's max payload (bytes): the failure point that makes an
    /// output NATS refuses goes one past it.
    #[cfg_attr(not(feature = "failpoints"), allow(dead_code))]
    pub max_payload: usize,
}

/// One input message as mapping reads it.
pub struct RawInput<'a> {
    pub stream_seq: u64,
    /// When JetStream stored it (unix ms).
    pub published_ms: i64,
    /// 1 the first time it is delivered.
    pub delivered: i64,
    pub payload: &'a [u8],
}

/// A chunk's output, encoded: the `SPEND` messages (their partition and
/// tuples in `spend`, in order) followed by the dead letters.
pub struct Encoded {
    pub out: Output,
    pub(crate) outgoing: Vec<OutMessage>,
    /// `outgoing[after..]` (the spend on leases' keys, then the dead
    /// letters) is published only once `outgoing[..after]` (the spend on
    /// limits) is stored: a lease's reported spend must never be counted
    /// before the same impressions' spend on its limits can be.
    pub(crate) after: usize,
    pub(crate) spend: Vec<(u32, u64)>,
    /// Impressions read again (their message was redelivered).
    pub(crate) redelivered: u64,
}

/// A chunk mapped and encoded, waiting to be published in its turn.
pub(crate) struct Mapped {
    messages: Vec<jetstream::Message>,
    encoded: Encoded,
}

impl Mapping {
    /// Map `inputs` through the catalog as it is now, and encode the
    /// output. The CPU path of the limiter, with no NATS in it.
    pub fn map_inputs(&self, inputs: &[RawInput<'_>]) -> Encoded {
        let catalog = self.catalog.borrow().clone();
        let mut out = Output::new(self.partitions).with_max_cost(self.max_cost_micros);
        let mut published_min = i64::MAX;
        let mut redelivered = 0;
        for input in inputs {
            published_min = published_min.min(input.published_ms);
            let before = out.impressions;
            out.add(
                &Input {
                    stream_seq: input.stream_seq,
                    payload: input.payload,
                },
                &catalog,
            );
            if input.delivered > 1 {
                redelivered += out.impressions - before;
            }
        }
        let source_ms = emit::chunk_source_ms(published_min, out.oldest_ts_ms);
        let mut outgoing: Vec<OutMessage> = Vec::new();
        let mut spend = Vec::new();
        let encode = |parts: &[emit::PartitionOut],
                      outgoing: &mut Vec<OutMessage>,
                      spend: &mut Vec<(u32, u64)>| {
            for (partition, part) in parts.iter().enumerate() {
                for (payload, tuples) in part.encode(self.tuples_per_message, source_ms) {
                    spend.push((partition as u32, tuples as u64));
                    outgoing.push(OutMessage {
                        subject: spend_subject(partition as u32),
                        headers: HeaderMap::new(),
                        payload: payload.into(),
                    });
                }
            }
        };
        encode(&out.partitions, &mut outgoing, &mut spend);
        let limits_end = outgoing.len();
        encode(&out.leases, &mut outgoing, &mut spend);
        // Nothing waits for the limits' spend when no lease's follows.
        let after = if outgoing.len() > limits_end {
            limits_end
        } else {
            outgoing.len() + out.dead_letters.len()
        };
        for letter in &out.dead_letters {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", letter.msg_id().as_str());
            headers.insert("Adspend-Reason", letter.reason);
            let payload = serde_json::to_vec(letter).expect("a dead letter serializes");
            outgoing.push(OutMessage {
                subject: format!("deadletter.{}", letter.reason),
                headers,
                payload: payload.into(),
            });
        }
        Encoded {
            out,
            outgoing,
            after,
            spend,
            redelivered,
        }
    }

    /// Map the messages of a pulled chunk; `None` when it held none.
    pub(crate) fn map_chunk(&self, chunk: Vec<PullMessage>) -> Option<Mapped> {
        let mut received = Vec::with_capacity(chunk.len());
        for message in chunk {
            match message {
                Ok(m) => received.push(m),
                // Heartbeat misses and the like: the stream recovers by itself.
                Err(e) => tracing::warn!(error = %e, "impressions consumer error"),
            }
        }
        (!received.is_empty()).then(|| self.map(received))
    }

    fn map(&self, messages: Vec<jetstream::Message>) -> Mapped {
        let inputs: Vec<RawInput<'_>> = messages
            .iter()
            .map(|message| match message.info() {
                Ok(info) => RawInput {
                    stream_seq: info.stream_sequence,
                    published_ms: (info.published.unix_timestamp_nanos() / 1_000_000) as i64,
                    delivered: info.delivered,
                    payload: &message.payload,
                },
                Err(_) => RawInput {
                    stream_seq: 0,
                    published_ms: now_ms(),
                    delivered: 1,
                    payload: &message.payload,
                },
            })
            .collect();
        #[cfg_attr(not(feature = "failpoints"), allow(unused_mut))]
        let mut encoded = self.map_inputs(&inputs);
        #[cfg(feature = "failpoints")]
        self.refuse_for_failpoint(&inputs, &mut encoded.outgoing);
        drop(inputs);
        Mapped { messages, encoded }
    }

    /// `limiter.oversized_output=SEQ`: the output of the input message at
    /// stream sequence SEQ gets one message over the server's max payload,
    /// which NATS refuses as it would any such message.
    #[cfg(feature = "failpoints")]
    fn refuse_for_failpoint(&self, inputs: &[RawInput<'_>], outgoing: &mut Vec<OutMessage>) {
        let poisoned = inputs
            .iter()
            .any(|input| failpoint::armed_for("limiter.oversized_output", input.stream_seq));
        if poisoned {
            outgoing.push(OutMessage {
                subject: "deadletter.failpoint".to_string(),
                headers: HeaderMap::new(),
                payload: vec![0u8; self.max_payload + 1].into(),
            });
        }
    }
}

/// What publishes mapped chunks, in order, and acknowledges their input.
pub(crate) struct Limiter {
    pub(crate) publisher: Publisher,
    pub(crate) mapping: Mapping,
    pub(crate) downstream: Downstream,
}

/// The output NATS would not take, though it answered.
struct Refused(String);

impl Limiter {
    /// Publish a mapped chunk and acknowledge its input. Output NATS
    /// refuses is narrowed down to the message that makes it, mapped anew
    /// one message at a time, and that message is set aside.
    pub(crate) async fn complete(&mut self, mapped: Mapped) {
        let Err(Refused(error)) = self.publish_and_ack(&mapped).await else {
            return;
        };
        let messages = mapped.messages;
        if messages.len() == 1 {
            crate::set_aside::set_aside(&self.publisher, &messages[0], &error).await;
            return;
        }
        tracing::warn!(messages = messages.len(), error = %error, "NATS refuses a chunk's output; trying its messages one by one");
        for message in messages {
            let single = self.mapping.map(vec![message]);
            if let Err(Refused(error)) = self.publish_and_ack(&single).await {
                crate::set_aside::set_aside(&self.publisher, &single.messages[0], &error).await;
            }
        }
    }

    /// Publish `mapped`'s output and acknowledge its input as one;
    /// `Refused` leaves the input unacknowledged.
    async fn publish_and_ack(&mut self, mapped: &Mapped) -> Result<(), Refused> {
        let Mapped { messages, encoded } = mapped;
        let publish = self.publish_output(encoded);
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
        let out = &encoded.out;
        metrics::counter!(IMPRESSIONS_TOTAL).increment(out.impressions);
        metrics::counter!(REDELIVERED_IMPRESSIONS_TOTAL).increment(encoded.redelivered);
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
    /// (re-sent tuples carry the same ids and are dropped downstream): the
    /// spend on limits first, then, once it is stored, the rest.
    async fn publish_output(&self, encoded: &Encoded) -> Publish {
        let (first, then) = encoded
            .outgoing
            .split_at(encoded.after.min(encoded.outgoing.len()));
        let published = match self.publisher.publish(first, true).await {
            Publish::Done(mut seqs) if !then.is_empty() => {
                match self.publisher.publish(then, true).await {
                    Publish::Done(more) => {
                        seqs.extend(more);
                        Publish::Done(seqs)
                    }
                    other => other,
                }
            }
            other => other,
        };
        if let Publish::Done(seqs) = &published {
            metrics::counter!(SPEND_MESSAGES_TOTAL).increment(encoded.spend.len() as u64);
            for (&(partition, tuples), &seq) in encoded.spend.iter().zip(seqs) {
                self.downstream.published(partition, seq, tuples);
            }
        }
        published
    }

    pub(crate) async fn publish_markers(&mut self) {
        let markers = crate::publish::markers(self.mapping.partitions);
        if let Publish::Done(_) = self.publisher.publish(&markers, false).await {
            metrics::counter!(MARKERS_TOTAL).increment(u64::from(self.mapping.partitions));
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
