//! Where a freshness measurement's time went, read back from what the
//! streams stored: each stored message carries JetStream's timestamp of
//! when it was stored, and its payload says when its spend began (the
//! impressions' `ts`, the spend batch's `source_ms`). Two stages come out:
//! - into `IMPRESSIONS`: an input message's oldest `ts` → stored (the ad
//!   server's queue and NATS's ingest, fsync included);
//! - into `SPEND`: a spend message's `source_ms` → stored (the above, plus
//!   the limiter's wait, work and its own publish).
//!
//! A third series is the pushes themselves, as a subscriber beside the
//! pacer receives them: `source_ms` of a push → received, the quantity the
//! pacer's freshness histogram counts, here with the time of each.

use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use async_nats::jetstream::{
    self,
    consumer::{pull::OrderedConfig, DeliverPolicy},
};
use futures::StreamExt;

use adspend_common::nats::{IMPRESSIONS_STREAM, SPEND_STREAM};
use adspend_wire::codec::decode_spend;
use adspend_wire::types::SpendMessage;

use adspend_sim::stats::{percentile, unix_ms_at};

/// `(when, delay)` in unix ms of each message one stage stored (or
/// received) in the interval.
#[derive(Debug, Clone, Default)]
pub struct Delays(Vec<(i64, i64)>);

impl Delays {
    pub fn series(&self) -> &[(i64, i64)] {
        &self.0
    }

    /// The `q` quantile (nearest rank), `None` when nothing was stored.
    pub fn quantile(&self, q: f64) -> Option<i64> {
        if self.0.is_empty() {
            return None;
        }
        let mut sorted: Vec<i64> = self.0.iter().map(|&(_, d)| d).collect();
        sorted.sort_unstable();
        Some(percentile(&sorted, q * 100.0))
    }

    /// "p50 12 ms, p99 40 ms, max 70 ms over 9,000 messages".
    pub fn summary(&self) -> String {
        match (self.quantile(0.5), self.quantile(0.99), self.quantile(1.0)) {
            (Some(p50), Some(p99), Some(max)) => format!(
                "p50 {p50} ms, p99 {p99} ms, max {max} ms over {} messages",
                self.0.len()
            ),
            _ => "no messages".into(),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct Stages {
    /// Input message: oldest impression `ts` → stored in `IMPRESSIONS`.
    pub impressions: Delays,
    /// Spend message: `source_ms` → stored in `SPEND`.
    pub spend: Delays,
    /// Push with new spend: `source_ms` → received beside the pacer.
    pub pushes: Delays,
}

impl Stages {
    /// Every delay as CSV lines `stage,unix_ms,delay_ms`, header first.
    pub fn csv(&self) -> String {
        let mut out = String::from("stage,unix_ms,delay_ms\n");
        for (stage, delays) in [
            ("impressions", &self.impressions),
            ("spend", &self.spend),
            ("pushes", &self.pushes),
        ] {
            for (at, delay) in delays.series() {
                out.push_str(&format!("{stage},{at},{delay}\n"));
            }
        }
        out
    }
}

/// Receives the aggregators' pushes from now until [`PushWatch::finish`],
/// timing each push with new spend as the pacer does.
pub struct PushWatch {
    task: tokio::task::JoinHandle<Vec<(i64, i64)>>,
    stop: tokio_util::sync::CancellationToken,
}

impl PushWatch {
    pub async fn start(client: &async_nats::Client) -> anyhow::Result<Self> {
        let subject = format!("{}.>", adspend_common::nats::SUMS_SUBJECT_PREFIX);
        let mut subscription = client
            .subscribe(subject)
            .await
            .context("subscribing to the sums pushes")?;
        let stop = tokio_util::sync::CancellationToken::new();
        let cancel = stop.clone();
        let task = tokio::spawn(async move {
            let mut pushes = Vec::new();
            loop {
                let message = tokio::select! {
                    _ = cancel.cancelled() => break,
                    message = subscription.next() => match message {
                        Some(m) => m,
                        None => break,
                    },
                };
                let now = adspend_common::now_ms();
                let update = adspend_wire::codec::decode_sums(&message.payload);
                if let Some(source_ms) = update.ok().and_then(|u| u.fresh_source_ms()) {
                    pushes.push((now, now - source_ms));
                }
            }
            pushes
        });
        Ok(PushWatch { task, stop })
    }

    /// The pushes received in `[from, until)`.
    pub async fn finish(self, from: SystemTime, until: SystemTime) -> anyhow::Result<Delays> {
        self.stop.cancel();
        let (from, until) = (unix_ms_at(from), unix_ms_at(until));
        let pushes = self.task.await.context("push watch task")?;
        Ok(Delays(
            pushes
                .into_iter()
                .filter(|&(at, _)| (from..until).contains(&at))
                .collect(),
        ))
    }
}

/// Reads back the messages `IMPRESSIONS` and `SPEND` stored in
/// `[from, until)` and times both stages for each; `pushes` is what a
/// [`PushWatch`] received over the same interval.
pub async fn read_back(
    client: &async_nats::Client,
    from: SystemTime,
    until: SystemTime,
    pushes: Delays,
) -> anyhow::Result<Stages> {
    let js = jetstream::new(client.clone());
    let impressions = into_impressions(client, None, from, until).await?;
    let spend = read_stream(
        &js,
        SPEND_STREAM,
        None,
        from,
        until,
        |payload| match decode_spend(payload) {
            Ok(SpendMessage::Batch(batch)) => Some(batch.source_ms),
            _ => None,
        },
    )
    .await?;
    Ok(Stages {
        impressions,
        spend,
        pushes,
    })
}

/// Into `IMPRESSIONS`: each input message's oldest `ts` → stored, for the
/// messages stored in `[from, until)` on `subject` (a filter such as
/// `impressions.B`; every subject when `None`).
pub async fn into_impressions(
    client: &async_nats::Client,
    subject: Option<&str>,
    from: SystemTime,
    until: SystemTime,
) -> anyhow::Result<Delays> {
    let js = jetstream::new(client.clone());
    read_stream(&js, IMPRESSIONS_STREAM, subject, from, until, oldest_ts).await
}

/// One message of impressions as `IMPRESSIONS` stored it.
#[derive(Debug, Clone)]
pub struct StoredImpressions {
    /// When JetStream stored it (unix ms).
    pub stored_ms: i64,
    /// Its oldest `ts` (unix ms).
    pub ts_ms: i64,
    /// The `id` of its first impression, which tells the message apart.
    pub first_id: String,
}

/// Every message of impressions stored in `[from, until)` on `subject`, in
/// stream order.
pub async fn impressions_stored(
    client: &async_nats::Client,
    subject: &str,
    from: SystemTime,
    until: SystemTime,
) -> anyhow::Result<Vec<StoredImpressions>> {
    let js = jetstream::new(client.clone());
    read_stream_with(
        &js,
        IMPRESSIONS_STREAM,
        Some(subject),
        from,
        until,
        |stored_ms, payload| {
            Some(StoredImpressions {
                stored_ms,
                ts_ms: oldest_ts(payload)?,
                first_id: first_id(payload)?.to_string(),
            })
        },
    )
    .await
}

/// Stored time − `began(payload)` of every message stored in the interval
/// (messages for which `began` is `None`, such as checkpoint markers, are
/// skipped), on `subject` when given.
async fn read_stream(
    js: &jetstream::Context,
    name: &str,
    subject: Option<&str>,
    from: SystemTime,
    until: SystemTime,
    began: impl Fn(&[u8]) -> Option<i64>,
) -> anyhow::Result<Delays> {
    let delays = read_stream_with(js, name, subject, from, until, |stored_ms, payload| {
        began(payload).map(|began| (stored_ms, stored_ms - began))
    })
    .await?;
    Ok(Delays(delays))
}

/// `each(stored time, payload)` of every message stored in the interval,
/// on `subject` when given, in stream order (`None`s left out).
async fn read_stream_with<T>(
    js: &jetstream::Context,
    name: &str,
    subject: Option<&str>,
    from: SystemTime,
    until: SystemTime,
    mut each: impl FnMut(i64, &[u8]) -> Option<T>,
) -> anyhow::Result<Vec<T>> {
    let mut stream = js
        .get_stream(name)
        .await
        .with_context(|| format!("stream {name}"))?;
    let last = match subject {
        Some(subject) => {
            stream
                .get_last_raw_message_by_subject(subject)
                .await
                .with_context(|| format!("last message on {subject}"))?
                .sequence
        }
        None => stream.info().await?.state.last_sequence,
    };
    let until_ms = unix_ms_at(until);
    let consumer = stream
        .create_consumer(OrderedConfig {
            deliver_policy: DeliverPolicy::ByStartTime {
                start_time: time::OffsetDateTime::from(from),
            },
            filter_subject: subject.unwrap_or_default().to_string(),
            ..OrderedConfig::default()
        })
        .await
        .with_context(|| format!("ordered consumer on {name}"))?;
    let mut messages = consumer
        .messages()
        .await
        .with_context(|| format!("reading {name}"))?;
    let mut delays = Vec::new();
    loop {
        let Ok(next) = tokio::time::timeout(Duration::from_secs(5), messages.next()).await else {
            // Nothing stored at or after `from`: the consumer has nothing
            // to deliver.
            break;
        };
        let message = next.with_context(|| format!("{name} ended early"))??;
        let info = message
            .info()
            .map_err(|e| anyhow::anyhow!("{name} message without info: {e}"))?;
        let stored_ms = (info.published.unix_timestamp_nanos() / 1_000_000) as i64;
        let sequence = info.stream_sequence;
        if stored_ms >= until_ms {
            break;
        }
        delays.extend(each(stored_ms, &message.payload));
        if sequence >= last {
            break;
        }
    }
    Ok(delays)
}

/// The `id` of the first impression of an NDJSON message.
fn first_id(payload: &[u8]) -> Option<&str> {
    const KEY: &[u8] = b"\"id\":\"";
    let at = payload.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
    let len = payload[at..].iter().position(|&b| b == b'"')?;
    std::str::from_utf8(&payload[at..at + len]).ok()
}

/// The oldest `"ts":` of an NDJSON message of impressions.
fn oldest_ts(payload: &[u8]) -> Option<i64> {
    const KEY: &[u8] = b"\"ts\":";
    payload
        .split(|&b| b == b'\n')
        .filter_map(|line| {
            let at = line.windows(KEY.len()).position(|w| w == KEY)? + KEY.len();
            let digits: Vec<u8> = line[at..]
                .iter()
                .copied()
                .skip_while(u8::is_ascii_whitespace)
                .take_while(u8::is_ascii_digit)
                .collect();
            std::str::from_utf8(&digits).ok()?.parse().ok()
        })
        .min()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_ts_of_a_message() {
        let payload = b"{\"id\":\"a\",\"ad_id\":\"x\",\"cost_micros\":5,\"ts\":1700000000500}\n\
{\"id\":\"b\",\"ad_id\":\"x\",\"cost_micros\":5,\"ts\": 1700000000100}\n\
{\"id\":\"c\",\"ad_id\":\"x\"}";
        assert_eq!(oldest_ts(payload), Some(1_700_000_000_100));
        assert_eq!(oldest_ts(b"not json"), None);
        assert_eq!(first_id(payload), Some("a"));
        assert_eq!(first_id(b"{\"ad_id\":\"x\"}"), None);
    }

    #[test]
    fn quantiles_by_nearest_rank() {
        let d = Delays((1..=100).rev().map(|d| (0, d)).collect());
        assert_eq!(d.quantile(0.5), Some(50));
        assert_eq!(d.quantile(0.99), Some(99));
        assert_eq!(d.quantile(1.0), Some(100));
        assert_eq!(Delays::default().quantile(0.5), None);
    }
}
