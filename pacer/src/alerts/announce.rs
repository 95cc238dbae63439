//! Publishing a crossing once, whoever else sees it.
//!
//! For each queued crossing: read the last alert on the limit's subject;
//! if it covers the crossing ([`Alert::covers`]), it was announced already.
//! Otherwise publish with the crossing's message id (the stream drops a
//! second one within its duplicate window) and the subject's last sequence
//! as the expected one (the stream refuses the publish when anything was
//! published on the subject since the read): a refused publish reads
//! again, so two announcers racing past the duplicate window still
//! publish once. Retries are bounded; a crossing given up on is detected
//! again by a later pass ([`super::detect`]).

use std::time::Duration;

use adspend_common::nats::alert_subject;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use async_nats::HeaderMap;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::detect::{Key, SharedMarks};
use super::{Alert, ALERTS_ANNOUNCED_TOTAL};

/// Crossings waiting for the announcer.
pub(super) const QUEUE: usize = 1024;
/// Tries of one crossing (reads refused by a racing publish included).
const ATTEMPTS: u32 = 8;
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
const MAX_BACKOFF: Duration = Duration::from_secs(5);

/// What became of one crossing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Outcome {
    /// Published now (or found a duplicate of the same id by the stream).
    Published,
    /// The subject's last alert covers it; that alert's threshold.
    Covered(u16),
}

pub(super) struct Announcer {
    js: async_nats::jetstream::Context,
    stream: Stream,
    marks: SharedMarks,
}

impl Announcer {
    pub(super) fn new(
        js: async_nats::jetstream::Context,
        stream: Stream,
        marks: SharedMarks,
    ) -> Self {
        Announcer { js, stream, marks }
    }

    pub(super) async fn run(
        self,
        mut queue: mpsc::Receiver<(Key, Alert)>,
        shutdown: CancellationToken,
    ) {
        loop {
            let (key, alert) = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = queue.recv() => match next {
                    Some(next) => next,
                    None => return,
                },
            };
            let outcome = tokio::select! {
                _ = shutdown.cancelled() => return,
                outcome = self.announce(&alert) => outcome,
            };
            let now_ms = adspend_common::now_ms();
            let mut marks = self.marks.lock().expect("alert marks lock");
            match outcome {
                Ok(Outcome::Published) => {
                    metrics::counter!(ALERTS_ANNOUNCED_TOTAL, "outcome" => "published")
                        .increment(1);
                    tracing::info!(
                        limit = alert.limit_id,
                        period_start = alert.period_start,
                        threshold_percent = alert.threshold_percent,
                        spend_micros = alert.spend_micros,
                        "budget alert announced"
                    );
                    marks.announced(key, alert.threshold_percent, now_ms);
                }
                Ok(Outcome::Covered(threshold)) => {
                    metrics::counter!(ALERTS_ANNOUNCED_TOTAL, "outcome" => "covered").increment(1);
                    marks.announced(key, threshold, now_ms);
                }
                Err(reason) => {
                    metrics::counter!(ALERTS_ANNOUNCED_TOTAL, "outcome" => "failed").increment(1);
                    tracing::warn!(
                        limit = alert.limit_id,
                        threshold_percent = alert.threshold_percent,
                        error = reason,
                        "budget alert not announced yet; it will be tried again"
                    );
                    marks.failed(&key);
                }
            }
        }
    }

    /// Announce `alert` unless the stream has it; bounded retries.
    pub(super) async fn announce(&self, alert: &Alert) -> Result<Outcome, String> {
        let subject = alert_subject(&alert.limit_id);
        let payload = serde_json::to_vec(alert).expect("an alert serializes");
        let mut backoff = FIRST_BACKOFF;
        let mut last_error = String::new();
        for _ in 0..ATTEMPTS {
            match self.try_once(&subject, alert, &payload).await {
                Ok(outcome) => return Ok(outcome),
                // Someone published on the subject since the read: read
                // again at once.
                Err(Attempt::Raced) => continue,
                Err(Attempt::Failed(reason)) => last_error = reason,
            }
            tokio::time::sleep(backoff).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        Err(if last_error.is_empty() {
            "the subject kept changing under each attempt".to_string()
        } else {
            last_error
        })
    }

    async fn try_once(
        &self,
        subject: &str,
        alert: &Alert,
        payload: &[u8],
    ) -> Result<Outcome, Attempt> {
        let last_seq = match self.stream.get_last_raw_message_by_subject(subject).await {
            Ok(last) => {
                // An alert this pacer cannot read (another version's) covers
                // nothing: the id and the expected sequence still guard.
                if let Ok(previous) = serde_json::from_slice::<Alert>(&last.payload) {
                    if previous.covers(alert) {
                        return Ok(Outcome::Covered(previous.threshold_percent));
                    }
                }
                last.sequence
            }
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => 0,
            Err(e) => return Err(Attempt::Failed(format!("read the last alert: {e}"))),
        };
        let mut headers = HeaderMap::new();
        headers.insert(async_nats::header::NATS_MESSAGE_ID, alert.id().as_str());
        headers.insert(
            async_nats::header::NATS_EXPECTED_LAST_SUBJECT_SEQUENCE,
            last_seq.to_string().as_str(),
        );
        let sent = self
            .js
            .publish_with_headers(subject.to_string(), headers, payload.to_vec().into())
            .await
            .map_err(|e| Attempt::Failed(format!("publish: {e}")))?;
        match sent.await {
            // The stream had this crossing's id within its window.
            Ok(ack) if ack.duplicate => Ok(Outcome::Covered(alert.threshold_percent)),
            Ok(_) => Ok(Outcome::Published),
            Err(e) if e.kind() == PublishErrorKind::WrongLastSequence => Err(Attempt::Raced),
            Err(e) => Err(Attempt::Failed(format!("publish ack: {e}"))),
        }
    }
}

enum Attempt {
    Raced,
    Failed(String),
}
