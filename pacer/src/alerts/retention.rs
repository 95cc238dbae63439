//! What `ALERTS` keeps (docs/RETENTION.md): alerts younger than
//! `ADSPEND_ALERTS_RETENTION_MS`, and the last alert of every limit
//! whatever its age, which announcers compare with once the stream's
//! duplicate window is past (docs/BUDGET-ALERTS.md). A stream `max_age`
//! would remove that last alert too, so a pacer purges instead: per limit's
//! subject, below the lesser of the first young alert and the subject's
//! last one, and never past what the webhook's consumer has not yet
//! acknowledged. Purges are idempotent: every pacer may run them.

use std::collections::HashMap;
use std::time::Duration;

use adspend_common::nats::{first_newer_than, ALERTS_SUBJECTS};
use async_nats::jetstream::stream::Stream;
use futures::TryStreamExt;
use tokio_util::sync::CancellationToken;

use super::webhook::CONSUMER as WEBHOOK_CONSUMER;
use super::ALERTS_PURGED_TOTAL;

/// Purge rounds run every quarter of the retention, between a quarter
/// second and an hour.
fn every(retention: Duration) -> Duration {
    (retention / 4).clamp(Duration::from_millis(250), Duration::from_secs(3600))
}

/// Rounds until `shutdown`; a failed round is said once and tried again.
pub(crate) async fn run(mut stream: Stream, retention: Duration, shutdown: CancellationToken) {
    let mut tick = tokio::time::interval(every(retention));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tick.tick() => {}
        }
        match round(&mut stream, retention).await {
            Ok(_) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "ALERTS retention round failed; retrying");
            }
            Err(_) => {}
        }
    }
}

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// One round; returns how many alerts went.
async fn round(stream: &mut Stream, retention: Duration) -> Result<u64, BoxError> {
    let state = stream.info().await?.state.clone();
    if state.messages == 0 {
        return Ok(0);
    }
    let cutoff_ms = adspend_common::now_ms() - retention.as_millis() as i64;
    let mut bound = first_newer_than(
        stream,
        ALERTS_SUBJECTS,
        state.first_sequence,
        state.last_sequence,
        cutoff_ms,
    )
    .await?;
    if let Ok(webhook) = stream.consumer_info(WEBHOOK_CONSUMER).await {
        bound = bound.min(webhook.ack_floor.stream_sequence + 1);
    }
    if bound <= state.first_sequence {
        return Ok(0);
    }
    let subjects: HashMap<String, usize> = stream
        .info_with_subjects(ALERTS_SUBJECTS)
        .await?
        .try_collect()
        .await?;
    let mut purged = 0;
    for (subject, count) in subjects {
        // A limit's only alert is its last.
        if count < 2 {
            continue;
        }
        let first = stream.get_first_raw_message_by_subject(&subject, 1).await?;
        if first.sequence >= bound {
            continue;
        }
        let last = stream.get_last_raw_message_by_subject(&subject).await?;
        let below = bound.min(last.sequence);
        if below <= first.sequence {
            continue;
        }
        purged += stream.purge().filter(subject).sequence(below).await?.purged;
    }
    if purged > 0 {
        metrics::counter!(ALERTS_PURGED_TOTAL).increment(purged);
        tracing::debug!(purged, below = bound, "alerts past their retention purged");
    }
    Ok(purged)
}
