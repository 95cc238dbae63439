//! Input set aside: a message whose output NATS keeps refusing while it
//! answers is recorded in `DEADLETTER` (`deadletter.set_aside`) by its
//! stream sequence, counted, logged, and acknowledged, so the limiter moves
//! on. The message itself stays in `IMPRESSIONS` (until the stream's
//! retention removes it): an operator reads it back by its sequence, and
//! republishes it once the cause is mended (its impressions carry their
//! ids, so nothing is counted twice).

use async_nats::jetstream::{self, AckKind};
use async_nats::HeaderMap;
use serde::Serialize;

use crate::publish::{OutMessage, Publish, Publisher};
use crate::telemetry::{LIMITER_SET_ASIDE_TOTAL, REJECTED_TOTAL};

/// The reason (and subject suffix) of a set-aside record.
pub(crate) const REASON: &str = "set_aside";
/// The longest error text a record carries, in bytes.
const ERROR_BYTES: usize = 1024;

/// What `deadletter.set_aside` holds for one input message.
#[derive(Debug, Serialize)]
pub(crate) struct SetAside {
    pub(crate) reason: &'static str,
    /// Why its output could not be published (the last error).
    pub(crate) detail: String,
    pub(crate) stream_seq: u64,
    pub(crate) subject: String,
    pub(crate) payload_bytes: usize,
    /// The message's xxh3-64, hex.
    pub(crate) payload_xxh3: String,
}

impl SetAside {
    pub(crate) fn new(stream_seq: u64, subject: &str, payload: &[u8], error: &str) -> Self {
        let mut detail = error.to_string();
        if detail.len() > ERROR_BYTES {
            let mut end = ERROR_BYTES;
            while !detail.is_char_boundary(end) {
                end -= 1;
            }
            detail.truncate(end);
        }
        SetAside {
            reason: REASON,
            detail,
            stream_seq,
            subject: subject.to_string(),
            payload_bytes: payload.len(),
            payload_xxh3: format!("{:016x}", xxhash_rust::xxh3::xxh3_64(payload)),
        }
    }

    fn message(&self) -> OutMessage {
        let mut headers = HeaderMap::new();
        headers.insert(
            "Nats-Msg-Id",
            format!("set-aside-{}", self.stream_seq).as_str(),
        );
        headers.insert("Adspend-Reason", REASON);
        OutMessage {
            subject: format!("deadletter.{REASON}"),
            headers,
            payload: serde_json::to_vec(self)
                .expect("a record serializes")
                .into(),
        }
    }
}

/// Record `message` as set aside, then acknowledge it for good.
pub(crate) async fn set_aside(publisher: &Publisher, message: &jetstream::Message, error: &str) {
    let stream_seq = message.info().map(|i| i.stream_sequence).unwrap_or(0);
    let record = SetAside::new(
        stream_seq,
        message.subject.as_str(),
        &message.payload,
        error,
    );
    // Small and well formed: retried until NATS takes it or shutdown.
    if let Publish::Done(_) = publisher.publish(&[record.message()], false).await {
        metrics::counter!(LIMITER_SET_ASIDE_TOTAL).increment(1);
        metrics::counter!(REJECTED_TOTAL, "reason" => REASON).increment(1);
        tracing::error!(
            stream_seq,
            subject = %message.subject,
            payload_bytes = message.payload.len(),
            error,
            "input message set aside: NATS answers but refuses its output; recorded on deadletter.set_aside, read it from IMPRESSIONS by its sequence"
        );
        if let Err(e) = message.ack_with(AckKind::Term).await {
            tracing::warn!(error = %e, stream_seq, "ack of a set-aside message failed; it will be redelivered and set aside again");
        }
    }
}
