//! One durable pull consumer per source on `IMPRESSIONS` (a lane), and the
//! handover between the single FIFO consumer and the lanes in either
//! direction, so that switching `ADSPEND_LIMITER_SCHEDULING` (or upgrading
//! from a limiter that knew only the FIFO consumer) neither skips nor
//! re-reads old input.
//!
//! A lane's consumer is `<consumer>-src-<xxh3 of the source, hex>` (consumer
//! names cannot hold every character a subject token can), with the source
//! in its description and filter subjects that select exactly that source:
//! `impressions.<*. …>source` and `….source.>`. Subjects too short to have a
//! source token share one lane, the source `""`.

use std::time::Duration;

use adspend_common::nats::{IMPRESSIONS_STREAM, IMPRESSIONS_SUBJECTS};
use async_nats::jetstream::consumer::{self, pull, DeliverPolicy};
use async_nats::jetstream::stream::Stream as JsStream;
use futures::TryStreamExt;

use crate::error::Error;

/// How long JetStream waits for an acknowledgement before redelivering: the
/// time a limiter that died holding input delays that input (FIFO consumer
/// and lanes alike). Short; a chunk whose output takes longer to publish is
/// kept by progress acknowledgements instead.
pub(crate) const ACK_WAIT: Duration = Duration::from_millis(1_500);

/// The stream's subject prefix, `impressions`.
fn root() -> &'static str {
    IMPRESSIONS_SUBJECTS.trim_end_matches(".>")
}

/// The source of `subject`: its token at `token` (0 is `impressions`), or
/// `""` when the subject is shorter.
pub(crate) fn source_of(subject: &str, token: usize) -> &str {
    subject.split('.').nth(token).unwrap_or("")
}

/// Filter subjects that select exactly the subjects whose source is
/// `source`; for `""`, the subjects too short to have one.
pub(crate) fn filters(source: &str, token: usize) -> Vec<String> {
    let wildcards = ".*".repeat(token.saturating_sub(1));
    if source.is_empty() {
        return (1..token)
            .map(|n| format!("{}{}", root(), ".*".repeat(n)))
            .collect();
    }
    let exact = format!("{}{wildcards}.{source}", root());
    vec![format!("{exact}.>"), exact]
}

/// The durable name of `source`'s lane under the deployment's `prefix`
/// (`ADSPEND_LIMITER_CONSUMER`).
pub fn lane_name(prefix: &str, source: &str) -> String {
    format!(
        "{prefix}-src-{:016x}",
        xxhash_rust::xxh3::xxh3_64(source.as_bytes())
    )
}

fn consumer_error(consumer: &str, e: impl Into<adspend_common::error::BoxError>) -> Error {
    Error::Consumer {
        stream: IMPRESSIONS_STREAM,
        consumer: consumer.to_string(),
        source: e.into(),
    }
}

/// Metadata key of a lane: its source.
pub(crate) const SOURCE_KEY: &str = "adspend_source";
/// Metadata key prefix of the FIFO consumer: `<prefix><source>` → the
/// stream sequence up to which that source's lane had handled everything
/// when the FIFO consumer took over.
const HANDLED_KEY: &str = "adspend_handled_by_lane.";

fn lane_config(name: &str, source: &str, token: usize, start: Option<u64>) -> pull::Config {
    pull::Config {
        metadata: [(SOURCE_KEY.to_string(), source.to_string())].into(),
        durable_name: Some(name.to_string()),
        description: Some(format!("adspend limiter lane of source {source:?}")),
        filter_subjects: filters(source, token),
        deliver_policy: match start {
            Some(start_sequence) => DeliverPolicy::ByStartSequence { start_sequence },
            None => DeliverPolicy::All,
        },
        // Explicit, never All: acking a later message must not acknowledge
        // earlier ones that a stopped limiter pulled but never handled.
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: ACK_WAIT,
        max_ack_pending: 100_000,
        ..Default::default()
    }
}

/// Bind to `source`'s lane, creating it when missing. A new lane reads its
/// source from the beginning of the stream, or from `start` when the lanes
/// take over from the FIFO consumer: then an existing lane is recreated
/// there (its position predates the FIFO consumer's).
pub(crate) async fn open_lane(
    stream: &JsStream,
    prefix: &str,
    source: &str,
    token: usize,
    start: Option<u64>,
) -> Result<consumer::PullConsumer, Error> {
    let name = lane_name(prefix, source);
    if start.is_some() {
        let _ = stream.delete_consumer(&name).await;
    } else if let Ok(existing) = stream.get_consumer::<pull::Config>(&name).await {
        return Ok(existing);
    }
    stream
        .create_consumer(lane_config(&name, source, token, start))
        .await
        .map_err(|e| consumer_error(&name, e))
}

/// Sources with messages in the stream now.
pub(crate) async fn sources(stream: &JsStream, token: usize) -> Result<Vec<String>, Error> {
    let subjects: Vec<(String, usize)> = stream
        .info_with_subjects(IMPRESSIONS_SUBJECTS)
        .await
        .map_err(|e| consumer_error("(discovery)", e))?
        .try_collect()
        .await
        .map_err(|e| consumer_error("(discovery)", e))?;
    let mut sources: Vec<String> = subjects
        .iter()
        .map(|(subject, _)| source_of(subject, token).to_string())
        .collect();
    sources.sort();
    sources.dedup();
    Ok(sources)
}

/// Lanes of this deployment that exist on the server, with their infos.
async fn existing_lanes(stream: &JsStream, prefix: &str) -> Result<Vec<consumer::Info>, Error> {
    let lane_prefix = format!("{prefix}-src-");
    let infos: Vec<consumer::Info> = stream
        .consumers()
        .try_collect()
        .await
        .map_err(|e| consumer_error("(list)", e))?;
    Ok(infos
        .into_iter()
        .filter(|i| i.name.starts_with(&lane_prefix))
        .collect())
}

/// Where the lanes start when they take over from the FIFO consumer `fifo`
/// (`None`: no FIFO consumer, nothing to take over). Everything at or below
/// its ack floor was handled; what lies above is read again by the lanes
/// (and its tuples deduplicated downstream by message id).
pub(crate) async fn takeover_from_fifo(stream: &JsStream, fifo: &str) -> Option<u64> {
    let info = stream.consumer_info(fifo).await.ok()?;
    Some(info.ack_floor.stream_sequence + 1)
}

/// The FIFO consumer is no longer needed once every lane is in place.
pub(crate) async fn retire_fifo(stream: &JsStream, fifo: &str) -> Result<(), Error> {
    stream
        .delete_consumer(fifo)
        .await
        .map(|_| ())
        .map_err(|e| consumer_error(fifo, e))
}

/// What the lanes had handled when the FIFO consumer took over from them:
/// per source, every message up to that stream sequence. The FIFO reader
/// acknowledges such messages without handling them again.
pub(crate) type Handled = std::collections::HashMap<String, u64>;

/// The single FIFO consumer. When lanes exist (the limiter ran fair), it is
/// created at the oldest message any lane has not handled, with each lane's
/// ack floor in its metadata (so that no lane's handled input is read
/// again, however old), and the lanes are deleted once it exists. An
/// existing FIFO consumer keeps its position and its metadata.
pub(crate) async fn open_fifo(
    stream: &JsStream,
    name: &str,
    token: usize,
) -> Result<(consumer::PullConsumer, Handled), Error> {
    let lanes = existing_lanes(stream, name).await?;
    let existing = stream.consumer_info(name).await.ok();
    let (deliver_policy, metadata) = match (&existing, lanes.is_empty()) {
        (Some(info), _) => (info.config.deliver_policy, info.config.metadata.clone()),
        (None, true) => (DeliverPolicy::All, Default::default()),
        (None, false) => {
            let start_sequence = oldest_unhandled(stream, &lanes, token).await?;
            let handled = lanes
                .iter()
                .filter_map(|lane| {
                    let source = lane.config.metadata.get(SOURCE_KEY)?;
                    Some((
                        format!("{HANDLED_KEY}{source}"),
                        lane.ack_floor.stream_sequence.to_string(),
                    ))
                })
                .collect();
            (DeliverPolicy::ByStartSequence { start_sequence }, handled)
        }
    };
    let handled: Handled = metadata
        .iter()
        .filter_map(|(k, v)| Some((k.strip_prefix(HANDLED_KEY)?.to_string(), v.parse().ok()?)))
        .collect();
    // Create or update: a consumer made by an older limiter gets the
    // current ack wait.
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(name.to_string()),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: ACK_WAIT,
            max_ack_pending: 100_000,
            deliver_policy,
            metadata,
            ..Default::default()
        })
        .await
        .map_err(|e| consumer_error(name, e))?;
    for lane in &lanes {
        stream
            .delete_consumer(&lane.name)
            .await
            .map_err(|e| consumer_error(&lane.name, e))?;
    }
    if !lanes.is_empty() {
        tracing::info!(
            lanes = lanes.len(),
            ?deliver_policy,
            "FIFO consumer took over from the source lanes"
        );
    }
    Ok((consumer, handled))
}

/// The first stream sequence no lane has handled: each busy lane's ack
/// floor + 1, and the first message of any source without a lane (it
/// appeared after the fair limiter's last look).
async fn oldest_unhandled(
    stream: &JsStream,
    lanes: &[consumer::Info],
    token: usize,
) -> Result<u64, Error> {
    let mut info = stream.clone();
    let last = info
        .info()
        .await
        .map_err(|e| consumer_error("(stream info)", e))?
        .state
        .last_sequence;
    let mut oldest = last + 1;
    for lane in lanes {
        if lane.num_pending > 0 || lane.num_ack_pending > 0 {
            oldest = oldest.min(lane.ack_floor.stream_sequence + 1);
        }
    }
    let laned: std::collections::HashSet<&str> = lanes.iter().map(|l| l.name.as_str()).collect();
    let prefix = lanes[0]
        .name
        .rsplit_once("-src-")
        .map_or("", |(prefix, _)| prefix);
    for source in sources(stream, token).await? {
        if laned.contains(lane_name(prefix, &source).as_str()) {
            continue;
        }
        for filter in filters(&source, token) {
            if let Ok(first) = stream.get_first_raw_message_by_subject(&filter, 1).await {
                oldest = oldest.min(first.sequence);
            }
        }
    }
    Ok(oldest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_and_their_filters() {
        assert_eq!(source_of("impressions.exchange-a", 1), "exchange-a");
        assert_eq!(source_of("impressions.exchange-a.eu.1", 1), "exchange-a");
        assert_eq!(source_of("impressions.eu.exchange-a", 2), "exchange-a");
        assert_eq!(source_of("impressions.eu", 2), "");
        assert_eq!(
            filters("a", 1),
            vec!["impressions.a.>".to_string(), "impressions.a".to_string()]
        );
        assert_eq!(
            filters("a", 3),
            vec![
                "impressions.*.*.a.>".to_string(),
                "impressions.*.*.a".to_string()
            ]
        );
        assert_eq!(
            filters("", 3),
            vec!["impressions.*".to_string(), "impressions.*.*".to_string()]
        );
        assert!(filters("", 1).is_empty());
    }

    #[test]
    fn lane_names_are_valid_consumer_names_and_distinct() {
        let a = lane_name("limiter", "a.b c*>/");
        assert!(a
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_'));
        assert_ne!(lane_name("limiter", "a"), lane_name("limiter", "b"));
        assert!(lane_name("limiter", "a").starts_with("limiter-src-"));
    }
}
