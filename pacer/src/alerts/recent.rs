//! The newest alerts of the stream, for `GET /v1/alerts` and the
//! dashboard, and for detection: an alert another pacer published marks its
//! crossing announced here too.
//!
//! [`follow`] reads `ALERTS` through an ordered consumer from the
//! [`KEPT`]-th newest message on, and keeps the newest [`KEPT`] in memory;
//! a consumer that fails is created again from the next sequence.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use async_nats::jetstream::stream::Stream;
use futures::StreamExt;
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use super::detect::SharedMarks;
use super::Alert;

/// Alerts kept in memory (the newest).
pub(crate) const KEPT: usize = 1000;
/// Most alerts in one page of `GET /v1/alerts`.
pub(crate) const MAX_PAGE: usize = 1000;
const RETRY: Duration = Duration::from_secs(1);

/// One alert as `GET /v1/alerts` lists it: the stream's fields, its id and
/// its stream sequence (the cursor of the pages).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub(crate) struct Listed {
    pub(crate) id: String,
    pub(crate) seq: u64,
    #[serde(flatten)]
    pub(crate) alert: Alert,
}

/// The newest alerts, oldest first; cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct Recent(Arc<Mutex<VecDeque<Listed>>>);

#[derive(Debug, Serialize)]
pub(crate) struct Page {
    pub(crate) alerts: Vec<Listed>,
    /// Pass as `after` for the next (older) page; absent on the last.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) next: Option<String>,
}

impl Recent {
    pub(crate) fn push(&self, seq: u64, alert: Alert) {
        let mut kept = self.0.lock().expect("recent alerts lock");
        if kept.back().is_some_and(|last| last.seq >= seq) {
            return;
        }
        if kept.len() == KEPT {
            kept.pop_front();
        }
        kept.push_back(Listed {
            id: alert.id(),
            seq,
            alert,
        });
    }

    /// The next sequence to read.
    fn next_seq(&self) -> Option<u64> {
        let kept = self.0.lock().expect("recent alerts lock");
        kept.back().map(|last| last.seq + 1)
    }

    /// Up to `size` alerts older than the sequence `after` (all without
    /// one), newest first.
    pub(crate) fn page(&self, after: Option<u64>, size: usize) -> Page {
        let kept = self.0.lock().expect("recent alerts lock");
        let end = after.map_or(kept.len(), |after| {
            kept.partition_point(|listed| listed.seq < after)
        });
        let alerts: Vec<Listed> = kept.range(..end).rev().take(size).cloned().collect();
        let next = (end > size).then(|| alerts.last().map(|l| l.seq.to_string()));
        Page {
            alerts,
            next: next.flatten(),
        }
    }
}

/// Where to start reading: the [`KEPT`]-th newest message, or after what
/// is held.
async fn start_seq(stream: &mut Stream, recent: &Recent) -> Result<u64, String> {
    if let Some(next) = recent.next_seq() {
        return Ok(next);
    }
    let info = stream.info().await.map_err(|e| e.to_string())?;
    let last = info.state.last_sequence;
    Ok(last.saturating_sub(KEPT as u64 - 1).max(1))
}

/// Follow `ALERTS` into `recent` and `marks` until `shutdown`.
pub(crate) async fn follow(
    mut stream: Stream,
    recent: Recent,
    marks: SharedMarks,
    shutdown: CancellationToken,
) {
    loop {
        let consumer = match start_seq(&mut stream, &recent).await {
            Ok(start_sequence) => {
                let config = OrderedConfig {
                    deliver_policy: DeliverPolicy::ByStartSequence { start_sequence },
                    max_expires: Duration::from_secs(5),
                    ..Default::default()
                };
                match stream.create_consumer(config).await {
                    Ok(consumer) => consumer.messages().await.map_err(|e| e.to_string()),
                    Err(e) => Err(e.to_string()),
                }
            }
            Err(e) => Err(e),
        };
        let mut messages = match consumer {
            Ok(messages) => messages,
            Err(e) => {
                tracing::warn!(error = e, "ALERTS consumer unavailable; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(RETRY) => continue,
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
                    tracing::warn!(error = %e, "ALERTS consumer failed; recreating");
                    break;
                }
                None => break,
            };
            let Ok(info) = message.info() else { continue };
            let seq = info.stream_sequence;
            match serde_json::from_slice::<Alert>(&message.payload) {
                Ok(alert) => {
                    let key = (
                        Arc::from(alert.limit_id.as_str()),
                        alert.period_start.clone(),
                    );
                    marks.lock().expect("alert marks lock").announced(
                        key,
                        alert.threshold_percent,
                        adspend_common::now_ms(),
                    );
                    recent.push(seq, alert);
                }
                Err(e) => tracing::warn!(seq, error = %e, "unreadable alert on ALERTS skipped"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alert(threshold: u16) -> Alert {
        Alert {
            limit_id: "c".into(),
            period_start: None,
            threshold_percent: threshold,
            spend_micros: 1,
            budget_micros: 1,
            at_ms: 0,
        }
    }

    #[test]
    fn pages_go_from_newest_to_oldest_and_end() {
        let recent = Recent::default();
        for seq in 1..=5u64 {
            recent.push(seq * 10, alert(seq as u16));
        }
        let seqs = |page: &Page| page.alerts.iter().map(|l| l.seq).collect::<Vec<_>>();
        let first = recent.page(None, 2);
        assert_eq!(seqs(&first), [50, 40]);
        assert_eq!(first.next.as_deref(), Some("40"));
        let second = recent.page(Some(40), 2);
        assert_eq!(seqs(&second), [30, 20]);
        let last = recent.page(Some(20), 2);
        assert_eq!(seqs(&last), [10]);
        assert_eq!(last.next, None);
        assert_eq!(recent.page(None, 5).next, None);
        assert_eq!(recent.page(Some(10), 5).alerts.len(), 0);
        assert_eq!(first.alerts[0].id, "alert/c/lifetime/5");
    }

    #[test]
    fn only_the_newest_are_kept_and_a_repeat_is_ignored() {
        let recent = Recent::default();
        for seq in 1..=(KEPT as u64 + 5) {
            recent.push(seq, alert(1));
        }
        recent.push(3, alert(1));
        let all = recent.page(None, MAX_PAGE);
        assert_eq!(all.alerts.len(), KEPT);
        assert_eq!(all.alerts[0].seq, KEPT as u64 + 5);
        assert_eq!(all.alerts[KEPT - 1].seq, 6);
        assert_eq!(recent.next_seq(), Some(KEPT as u64 + 6));
    }
}
