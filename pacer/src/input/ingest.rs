//! Receiving the aggregators' pushes (each decoded by
//! `adspend_wire::codec::decode_push`, which refuses stamps no aggregator
//! sends), and asking for a resync when the pacer starts or notices a
//! missed push.

use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_common::nats::{SUMS_RESYNC_SUBJECT, SUMS_SUBJECT_PREFIX};
use adspend_wire::catalog::Catalog;
use adspend_wire::codec::decode_push;
use chrono::Offset;
use futures::StreamExt;
use tokio::sync::{watch, RwLock};
use tokio_util::sync::CancellationToken;

use crate::error::Error;
use crate::pacing::state::{Applied, SpendState};
use crate::telemetry::{
    PACER_FRESHNESS_SECONDS, PACER_LAG_SECONDS, PACER_RESYNCS_TOTAL, PACER_STALE_UPDATES_TOTAL,
    PACER_UPDATES_TOTAL,
};

const RESYNC_MIN_INTERVAL: Duration = Duration::from_secs(1);
/// With no push at all for this long, ask again (aggregators may have
/// started after our first request).
const SILENCE: Duration = Duration::from_secs(3);

/// `adspend.sums.window.`: the dedupe window reports share the sums'
/// subjects ([`adspend_common::dedupe_window`]).
static WINDOW_PREFIX: std::sync::LazyLock<String> =
    std::sync::LazyLock::new(|| format!("{}.", adspend_common::dedupe_window::SUBJECT_PREFIX));

/// Keep a shard's dedupe window report for `GET /v1/shards`.
async fn take_window_report(state: &RwLock<SpendState>, message: &async_nats::Message) {
    match adspend_common::dedupe_window::Report::decode(&message.payload) {
        Ok(report) => {
            let mut state = state.write().await;
            state.dedupe_windows.insert(report.shard.clone(), report);
        }
        Err(e) => {
            tracing::warn!(error = %e, subject = %message.subject, "undecodable dedupe window report dropped")
        }
    }
}

pub(crate) async fn subscribe(
    client: &async_nats::Client,
) -> Result<async_nats::Subscriber, Error> {
    let subject = format!("{SUMS_SUBJECT_PREFIX}.>");
    client
        .subscribe(subject.clone())
        .await
        .map_err(|source| Error::Subscribe { subject, source })
}

pub(crate) async fn run(
    client: async_nats::Client,
    mut pushes: async_nats::Subscriber,
    state: Arc<RwLock<SpendState>>,
    catalog: watch::Receiver<Arc<Catalog>>,
    leases: Option<crate::leases::Leases>,
    cancel: CancellationToken,
) {
    let mut arrivals: Vec<(String, u64)> = Vec::new();
    let mut last_resync: Option<Instant> = None;
    let mut last_push = Instant::now();
    request_resync(&client, &mut last_resync).await;
    let mut silence = tokio::time::interval(SILENCE);
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = silence.tick() => {
                if last_push.elapsed() >= SILENCE {
                    request_resync(&client, &mut last_resync).await;
                }
            }
            message = pushes.next() => {
                let Some(message) = message else { return };
                if message.subject.starts_with(WINDOW_PREFIX.as_str()) {
                    take_window_report(&state, &message).await;
                    continue;
                }
                let mut update = match decode_push(&message.payload) {
                    Ok(u) => u,
                    Err(e) => {
                        tracing::warn!(error = %e, subject = %message.subject, "undecodable sums push dropped");
                        continue;
                    }
                };
                last_push = Instant::now();
                if let Some(leases) = &leases {
                    leases.take_reports(&mut update.entries, update.watermark_ms);
                }
                let now = adspend_common::now_ms();
                let (applied, caught_up_ms) = {
                    let mut state = state.write().await;
                    arrivals.clear();
                    let applied = state.apply_with_arrivals(&update, now, &mut arrivals);
                    let caught_up_ms = state.shards.values().map(|s| s.watermark_ms).min();
                    // Impression arrivals teach the traffic shape, in each
                    // limit's local time of day.
                    let catalog = catalog.borrow();
                    let arrived = chrono::DateTime::from_timestamp_millis(now).unwrap_or_default();
                    for (limit, events) in &arrivals {
                        if let Some(limit) = catalog.limit(limit) {
                            let offset = arrived.with_timezone(&limit.time_zone).offset().fix().local_minus_utc();
                            state.shape.observe(now + i64::from(offset) * 1000, *events as f64);
                        }
                    }
                    (applied, caught_up_ms)
                };
                // Reports that every shard has caught up with free what they
                // cover, and leases past expiry plus grace retire, as soon
                // as a push shows it.
                if let (Some(leases), Some(caught_up_ms)) = (&leases, caught_up_ms) {
                    leases.retire(caught_up_ms);
                }
                metrics::counter!(PACER_UPDATES_TOTAL).increment(1);
                metrics::gauge!(PACER_LAG_SECONDS).set((now - update.watermark_ms).max(0) as f64 / 1000.0);
                if let Some(source_ms) = update.fresh_source_ms() {
                    metrics::histogram!(PACER_FRESHNESS_SECONDS).record((now - source_ms).max(0) as f64 / 1000.0);
                }
                match applied {
                    Applied::Ok => {}
                    Applied::Stale => {
                        metrics::counter!(PACER_STALE_UPDATES_TOTAL).increment(1);
                    }
                    Applied::Gap => request_resync(&client, &mut last_resync).await,
                }
            }
        }
    }
}

async fn request_resync(client: &async_nats::Client, last: &mut Option<Instant>) {
    if last.is_some_and(|t| t.elapsed() < RESYNC_MIN_INTERVAL) {
        return;
    }
    *last = Some(Instant::now());
    metrics::counter!(PACER_RESYNCS_TOTAL).increment(1);
    let publish = client.publish(SUMS_RESYNC_SUBJECT, "".into());
    match tokio::time::timeout(Duration::from_secs(2), publish).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::warn!(error = %e, "resync request failed"),
        Err(_) => tracing::warn!("resync request timed out"),
    }
}

#[cfg(test)]
mod tests {
    use adspend_wire::codec::{decode_push, encode_sums};
    use adspend_wire::types::{SumEntry, SumsUpdate};

    use crate::pacing::state::SpendState;

    fn push(push_seq: u64, watermark_ms: i64, source_ms: i64) -> SumsUpdate {
        SumsUpdate {
            shard: "all".into(),
            epoch: 1,
            seq: 1,
            push_seq,
            full: false,
            watermark_ms,
            source_ms,
            entries: vec![SumEntry {
                limit: "a".into(),
                bucket: 1,
                bucket_micros: 5,
                lifetime_micros: 5,
                lifetime_events: 1,
            }],
        }
    }

    /// Found by fuzzing (fuzz target pacer_push): a push_seq of u64::MAX
    /// followed by another push of the same epoch overflowed the gap check,
    /// and a source_ms of i64::MIN overflowed the freshness arithmetic.
    /// `decode_push` refuses those (its own test is in the wire crate); the
    /// extremes it lets through fold in without overflow.
    #[test]
    fn the_extreme_stamps_a_push_may_carry_fold_in() {
        let mut state = SpendState::default();
        for good in [
            push(u64::MAX - 1, 0, 0),
            push(u64::MAX - 1, i64::MAX, i64::MAX),
        ] {
            let decoded = decode_push(&encode_sums(&good)).unwrap();
            state.apply(&decoded, 1_700_000_000_000);
        }
        assert_eq!(state.limits["a"].lifetime_micros, 5);
    }
}
