//! The peer users would reach for first: JetStream drops duplicates at
//! publish (`Nats-Msg-Id` within the stream's duplicate window) and a
//! consumer sums in memory.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use async_nats::jetstream;
use async_nats::jetstream::consumer::pull::{self, OrderedConfig};
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use chrono::NaiveDate;
use futures::stream::StreamExt;
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

use super::{
    parse_event, publish_all, start_nats, Book, Event, PeerRun, REPLY_TIMEOUT, STALL_TIMEOUT,
};
use crate::workload::Workload;
use adspend_sim::{day_key, differences, Impression, LimitTruth, Stats, TruthBuilder};

/// JetStream stream of the [`jetstream_dedupe`] peer.
const JS_STREAM: &str = "PEERJS";
const JS_SUBJECTS: &str = "peerjs.>";
const JS_SUBJECT: &str = "peerjs.impression";
/// JetStream's default, and the window the test pipelines run with.
const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);
/// Single-impression publishes awaiting their ack: enough to keep a
/// lazily-syncing server busy, a few hundred milliseconds of work for one
/// that fsyncs every message.
const EVENT_PUBLISH_WINDOW: usize = 4096;

/// The peer users would reach for first: JetStream already deduplicates.
///
/// Every impression is published as its own message with `Nats-Msg-Id` set
/// to the impression id, to a stream with a two-minute duplicate window, so
/// JetStream stores each id once; an ordered consumer (the fastest way to
/// read a stream with async-nats: no acks, pulls kept outstanding by the
/// client) parses each stored message and sums it in memory. That is all the code a team needs,
/// which is why it is the fair "instead of adspend" baseline. Its limits are
/// the design's own: dedupe holds only within the window, one message per
/// impression makes the per-message cost (and, when durable, the
/// per-message fsync) the bottleneck, and the sums live in one process's
/// memory.
///
/// Uses the first `events` events of the workload (all of them if it has
/// fewer); per-message fsync is slow, so durable runs usually take a prefix.
/// The prefix's expected sums are recomputed from its events. The clock runs
/// from the first publish until the consumer has summed every stored message.
///
/// # Errors
///
/// If an event does not parse or names an unknown ad, or the server fails a
/// publish, a read or stalls.
///
/// # Panics
///
/// If `nats-server` cannot be started (the harness panics with its log).
pub async fn jetstream_dedupe(
    workload: &Workload,
    events: u64,
    durable: bool,
) -> anyhow::Result<PeerRun> {
    let book = Arc::new(Book::new(&workload.catalog)?);
    // What an ad server has before it publishes: each impression's id next
    // to its JSON. Prepared before the clock starts.
    let prefix = events < workload.events;
    let mut prefix_truth = if prefix {
        Some(TruthBuilder::new(&workload.catalog)?)
    } else {
        None
    };
    let mut outgoing = Vec::new();
    for line in workload
        .events()
        .take(usize::try_from(events).unwrap_or(usize::MAX))
    {
        let impression: Impression = serde_json::from_slice(&line)
            .with_context(|| format!("workload event {}", String::from_utf8_lossy(&line)))?;
        if let Some(truth) = &mut prefix_truth {
            truth.record(&impression)?;
        }
        outgoing.push(
            PublishMessage::build()
                .message_id(&impression.id)
                .payload(line),
        );
    }
    let offered = outgoing.len() as u64;
    let expected = match prefix_truth {
        Some(truth) => Cow::Owned(truth.finish(Stats::default()).limits),
        None => Cow::Borrowed(&workload.truth.limits),
    };

    let nats = start_nats(durable).await;
    let client = async_nats::connect(nats.url())
        .await
        .with_context(|| format!("connect to nats-server at {}", nats.url()))?;
    let js = jetstream::ContextBuilder::new()
        .timeout(REPLY_TIMEOUT)
        .max_ack_inflight(EVENT_PUBLISH_WINDOW)
        .build(client);
    let mut stream = js
        .create_stream(StreamConfig {
            name: JS_STREAM.to_owned(),
            subjects: vec![JS_SUBJECTS.to_owned()],
            storage: StorageType::File,
            duplicate_window: DUPLICATE_WINDOW,
            ..Default::default()
        })
        .await
        .with_context(|| format!("create stream {JS_STREAM}"))?;
    let messages = stream
        .create_consumer(OrderedConfig::default())
        .await
        .with_context(|| format!("create an ordered consumer on {JS_STREAM}"))?
        .messages()
        .await
        .with_context(|| format!("read {JS_STREAM}"))?;
    // The consumer learns how many messages to expect once every publish
    // is acknowledged; until then it sums whatever arrives.
    let (stored_tx, stored_rx) = watch::channel(None);
    let consumer = AbortOnDropHandle::new(tokio::spawn(sum_in_memory(
        messages,
        book.clone(),
        stored_rx,
    )));

    let started = Instant::now();
    let acks = publish_all(&js, JS_SUBJECT, outgoing, EVENT_PUBLISH_WINDOW).await?;
    stored_tx.send_replace(Some(acks.stored));
    let (sums, consumed) = consumer
        .await
        .context("the JetStream-dedupe consumer task panicked")??;
    let secs = started.elapsed().as_secs_f64();

    let in_stream = stream
        .info()
        .await
        .with_context(|| format!("stream info of {JS_STREAM}"))?
        .state
        .messages;
    let actual = sums.into_limits(&book);
    let mismatch = match differences(&expected, &actual) {
        None if in_stream != acks.stored => Some(format!(
            "{JS_STREAM} holds {in_stream} messages, its acks said {} were stored",
            acks.stored
        )),
        other => other,
    };
    let mut detail = format!(
        "{} of {offered} events stored, {} dropped by JetStream as duplicates; \
         {consumed} summed",
        acks.stored, acks.duplicates
    );
    if let Some(mismatch) = &mismatch {
        detail.push_str("; NOT EXACT: ");
        detail.push_str(mismatch);
    }
    Ok(PeerRun {
        name: "jetstream-dedupe",
        durable,
        events: offered,
        unique_events: acks.stored,
        secs,
        events_per_sec: offered as f64 / secs,
        exact: mismatch.is_none(),
        detail,
    })
}

/// The [`jetstream_dedupe`] consumer: sums every message until it has as
/// many as the publisher reports stored. Returns the sums and that count.
async fn sum_in_memory(
    mut messages: pull::Ordered,
    book: Arc<Book>,
    mut stored: watch::Receiver<Option<u64>>,
) -> anyhow::Result<(Sums, u64)> {
    let mut sums = Sums::new(book.limit_ids.len());
    let mut consumed = 0_u64;
    loop {
        let target = *stored.borrow_and_update();
        if target.is_some_and(|target| consumed >= target) {
            return Ok((sums, consumed));
        }
        tokio::select! {
            changed = stored.changed(), if target.is_none() => {
                changed.context("the publisher stopped before reporting its count")?;
            }
            next = tokio::time::timeout(STALL_TIMEOUT, messages.next()) => {
                let message = next
                    .map_err(|_| anyhow!("no message from {JS_STREAM} for {STALL_TIMEOUT:?}"))?
                    .with_context(|| format!("the consumer of {JS_STREAM} ended"))?
                    .with_context(|| format!("read {JS_STREAM}"))?;
                let event = parse_event(&message.payload)?;
                sums.add(&book, &event)?;
                consumed += 1;
            }
        }
    }
}

/// The [`jetstream_dedupe`] consumer's in-memory sums, by limit position.
struct Sums {
    lifetime: Vec<u64>,
    daily: Vec<HashMap<NaiveDate, u64>>,
}

impl Sums {
    fn new(limits: usize) -> Sums {
        Sums {
            lifetime: vec![0; limits],
            daily: vec![HashMap::new(); limits],
        }
    }

    fn add(&mut self, book: &Book, event: &Event<'_>) -> anyhow::Result<()> {
        for &limit in book.limits_of(&event.ad_id)? {
            let id = &book.limit_ids[limit];
            let lifetime = &mut self.lifetime[limit];
            *lifetime = lifetime
                .checked_add(event.cost_micros)
                .with_context(|| format!("lifetime spend of {id} overflows u64"))?;
            if let Some(day) = book.day_of(limit, event.ts)? {
                let spent = self.daily[limit].entry(day).or_insert(0);
                *spent = spent
                    .checked_add(event.cost_micros)
                    .with_context(|| format!("spend of {id} on {day} overflows u64"))?;
            }
        }
        Ok(())
    }

    fn into_limits(self, book: &Book) -> BTreeMap<String, LimitTruth> {
        book.limit_ids
            .iter()
            .zip(self.lifetime.into_iter().zip(self.daily))
            .map(|(id, (lifetime_micros, daily))| {
                let daily = daily
                    .into_iter()
                    .map(|(day, spent)| (day_key(day), spent))
                    .collect();
                let sums = LimitTruth {
                    lifetime_micros,
                    daily,
                };
                (id.clone(), sums)
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peers::tests::{assert_exact, tiny_workload};

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jetstream_dedupe_is_exact_when_durable() {
        let workload = tiny_workload();
        let run = jetstream_dedupe(&workload, workload.events, true)
            .await
            .unwrap();
        assert_exact(&run);
        assert_eq!(run.events, workload.events);
        assert_eq!(run.unique_events, workload.unique_events);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn jetstream_dedupe_is_exact_on_a_prefix() {
        let workload = tiny_workload();
        let run = jetstream_dedupe(&workload, 1_234, false).await.unwrap();
        assert_exact(&run);
        assert_eq!(run.events, 1_234);
        assert!(run.unique_events < 1_234, "{}", run.detail);
    }
}
