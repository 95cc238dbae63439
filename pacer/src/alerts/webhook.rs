//! Webhook delivery of alerts (`ADSPEND_ALERTS_WEBHOOK_URL`).
//!
//! All pacers pull from one durable consumer of `ALERTS`, so each alert goes
//! to one of them at a time. An alert is POSTed as the stream holds it (the
//! JSON body), signed `X-Adspend-Signature: sha256=<hex HMAC-SHA256 of the
//! body>` with `ADSPEND_ALERTS_WEBHOOK_SECRET`, and named by
//! `X-Adspend-Alert-Id` (the same for every delivery of one crossing, for
//! the receiver to dedupe on: delivery is at least once). It is acked only
//! after a 2xx answer; otherwise it is handed back to the stream with a
//! delay that doubles per delivery, and after [`MAX_DELIVERIES`] it is
//! terminated, counted and logged (it stays on the stream, and in
//! `GET /v1/alerts`). The consumer is apart from everything else the pacer
//! does, so a slow or failing receiver delays only other deliveries.

use std::time::Duration;

use adspend_common::nats::ALERTS_SUBJECTS;
use async_nats::jetstream::consumer::{pull, AckPolicy, DeliverPolicy, PullConsumer};
use async_nats::jetstream::stream::Stream;
use async_nats::jetstream::AckKind;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

use super::ALERTS_WEBHOOK_TOTAL;

/// The durable consumer every pacer shares.
pub(crate) const CONSUMER: &str = "adspend-alerts-webhook";
/// Deliveries of one alert before it is given up.
pub(crate) const MAX_DELIVERIES: i64 = 30;
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
const MAX_BACKOFF: Duration = Duration::from_secs(300);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Above the request timeout, so an alert being delivered is not handed to
/// another pacer meanwhile.
const ACK_WAIT: Duration = Duration::from_secs(30);

pub(crate) const SIGNATURE_HEADER: &str = "X-Adspend-Signature";
pub(crate) const ALERT_ID_HEADER: &str = "X-Adspend-Alert-Id";

/// Where alerts go and the key they are signed with.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) url: url::Url,
    pub(crate) secret: Vec<u8>,
}

impl std::fmt::Debug for Target {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Target")
            .field("url", &self.url.as_str())
            .field("secret", &format_args!("<{} bytes>", self.secret.len()))
            .finish()
    }
}

/// `sha256=<hex HMAC-SHA256 of body under secret>`.
pub fn signature(secret: &[u8], body: &[u8]) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, secret);
    let tag = ring::hmac::sign(&key, body);
    let hex: String = tag.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    format!("sha256={hex}")
}

/// Delay before delivery number `delivered + 1`.
pub(crate) fn backoff(delivered: i64) -> Duration {
    let doublings = u32::try_from(delivered.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
    (FIRST_BACKOFF * 2u32.pow(doublings)).min(MAX_BACKOFF)
}

/// The shared durable consumer (created by the first pacer to need it).
pub(crate) async fn consumer(stream: &Stream) -> Result<PullConsumer, adspend_common::Error> {
    stream
        .get_or_create_consumer(
            CONSUMER,
            pull::Config {
                durable_name: Some(CONSUMER.to_string()),
                description: Some("adspend pacers: budget alert webhook".to_string()),
                // Alerts from the consumer's creation on.
                deliver_policy: DeliverPolicy::New,
                ack_policy: AckPolicy::Explicit,
                ack_wait: ACK_WAIT,
                filter_subject: ALERTS_SUBJECTS.to_string(),
                max_ack_pending: 256,
                ..Default::default()
            },
        )
        .await
        .map_err(adspend_common::Error::jetstream(format!(
            "create consumer {CONSUMER} on ALERTS"
        )))
}

/// What to do with one alert after a delivery attempt.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    Delivered,
    Retry(Duration),
    GiveUp,
}

fn verdict(answered: Result<reqwest::StatusCode, String>, delivered: i64) -> (Verdict, String) {
    match answered {
        Ok(status) if status.is_success() => (Verdict::Delivered, status.to_string()),
        other => {
            let why = match other {
                Ok(status) => format!("answered {status}"),
                Err(e) => e,
            };
            if delivered >= MAX_DELIVERIES {
                (Verdict::GiveUp, why)
            } else {
                (Verdict::Retry(backoff(delivered)), why)
            }
        }
    }
}

/// Deliver until `shutdown`; the consumer's stream is opened again after
/// an error.
pub(crate) async fn run(consumer: PullConsumer, target: Target, shutdown: CancellationToken) {
    let http = match reqwest::Client::builder().timeout(REQUEST_TIMEOUT).build() {
        Ok(http) => http,
        Err(e) => return tracing::error!(error = %e, "alert webhook: no HTTP client"),
    };
    tracing::info!(url = target.url.as_str(), "alert webhook delivering");
    loop {
        let mut messages = match consumer.messages().await {
            Ok(messages) => messages,
            Err(e) => {
                tracing::warn!(error = %e, "alert webhook consumer unavailable; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(1)) => continue,
                }
            }
        };
        loop {
            let next = tokio::select! {
                _ = shutdown.cancelled() => return,
                next = messages.next() => next,
            };
            let message = match next {
                Some(Ok(message)) => message,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "alert webhook consumer failed; reopening");
                    break;
                }
                None => break,
            };
            let delivered = message.info().map_or(1, |info| info.delivered);
            let id = message
                .headers
                .as_ref()
                .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                .map(|v| v.as_str().to_string())
                .unwrap_or_default();
            let body = message.payload.clone();
            let answered = http
                .post(target.url.clone())
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .header(SIGNATURE_HEADER, signature(&target.secret, &body))
                .header(ALERT_ID_HEADER, id.as_str())
                .body(body)
                .send()
                .await
                .map(|r| r.status())
                .map_err(|e| e.without_url().to_string());
            let (verdict, why) = verdict(answered, delivered);
            let ack = match verdict {
                Verdict::Delivered => {
                    metrics::counter!(ALERTS_WEBHOOK_TOTAL, "outcome" => "delivered").increment(1);
                    message.ack().await
                }
                Verdict::Retry(delay) => {
                    metrics::counter!(ALERTS_WEBHOOK_TOTAL, "outcome" => "retried").increment(1);
                    tracing::warn!(
                        alert = id,
                        delivered,
                        retry_in_ms = delay.as_millis() as u64,
                        reason = why,
                        "alert webhook delivery failed; retrying"
                    );
                    message.ack_with(AckKind::Nak(Some(delay))).await
                }
                Verdict::GiveUp => {
                    metrics::counter!(ALERTS_WEBHOOK_TOTAL, "outcome" => "given_up").increment(1);
                    tracing::error!(alert = id, delivered, reason = why,
                        "alert webhook delivery given up; the alert stays on ALERTS and in GET /v1/alerts");
                    message.ack_with(AckKind::Term).await
                }
            };
            if let Err(e) = ack {
                // Unacked, it comes back after the ack wait.
                tracing::warn!(alert = id, error = %e, "alert webhook ack failed");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_hex_hmac_sha256_of_the_body() {
        // RFC 4231, test case 2.
        assert_eq!(
            signature(b"Jefe", b"what do ya want for nothing?"),
            "sha256=5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn retries_back_off_and_end() {
        assert_eq!(backoff(1), Duration::from_millis(500));
        assert_eq!(backoff(2), Duration::from_secs(1));
        assert_eq!(backoff(4), Duration::from_secs(4));
        assert_eq!(backoff(30), MAX_BACKOFF);
        let ok = reqwest::StatusCode::NO_CONTENT;
        let bad = reqwest::StatusCode::SERVICE_UNAVAILABLE;
        assert_eq!(verdict(Ok(ok), 7).0, Verdict::Delivered);
        assert_eq!(
            verdict(Ok(bad), 1),
            (
                Verdict::Retry(backoff(1)),
                "answered 503 Service Unavailable".into()
            )
        );
        assert_eq!(
            verdict(Err("refused".into()), 2).0,
            Verdict::Retry(backoff(2))
        );
        assert_eq!(verdict(Ok(bad), MAX_DELIVERIES).0, Verdict::GiveUp);
    }
}
