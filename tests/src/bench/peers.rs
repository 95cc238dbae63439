//! The peers: what a team would build instead of adspend, run on the same
//! generated events so their numbers stand next to adspend's in one table.
//!
//! Each peer does the whole job, per impression, the way its design does it:
//! parse the JSON, map the ad to its limits through the catalog, drop
//! duplicates, and add the cost to every limit's lifetime sum and, for daily
//! limits, to the sum of the event's local day in the limit's time zone.
//! Their sums are then checked against the truth exactly as adspend's are, so
//! a fast peer that miscounts shows up as such.
//!
//! - [`jetstream_dedupe`]: let JetStream drop duplicates at publish
//!   (`Nats-Msg-Id` within the stream's duplicate window) and sum in a
//!   consumer's memory.
//! - [`redis_lua`]: the Tapjoy design; a consumer runs one Lua script per
//!   NDJSON message on Redis, which holds the dedupe ids and the sums.
//!
//! Both run against servers started for the run, durable or not, as the
//! caller asks, so the two settings can be reported side by side.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_common::types::MsgId;
use anyhow::{anyhow, bail, Context as _};
use async_nats::jetstream::consumer::pull::{self, OrderedConfig};
use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use async_nats::jetstream::{self, publish::PublishAck};
use async_nats::Subject;
use chrono::{DateTime, NaiveDate};
use chrono_tz::Tz;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;
use serde::Deserialize;
use tokio::sync::watch;
use tokio_util::task::AbortOnDropHandle;

use super::workload::Workload;
use crate::harness::{NatsOptions, NatsServer, RedisServer};
use crate::sim::{Catalog, Impression, LimitTruth, Period, Stats, TruthBuilder};

/// One peer's run, for the results table.
#[derive(Debug, Clone)]
pub struct PeerRun {
    pub name: &'static str,
    /// Whether every acknowledged write was on disk (fsync) before its ack.
    pub durable: bool,
    /// Events offered, duplicates included.
    pub events: u64,
    /// Distinct impressions the peer stored or booked, by its own count.
    pub unique_events: u64,
    /// From the first publish until the last event was summed.
    pub secs: f64,
    /// `events / secs`: offered load, duplicates included, as for adspend.
    pub events_per_sec: f64,
    /// Whether the peer's sums equal the truth for every limit, lifetime
    /// and per local day.
    pub exact: bool,
    /// Counts behind the figures, and the first differences when not exact.
    pub detail: String,
}

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

/// JetStream stream of the [`redis_lua`] peer.
const REDIS_STREAM: &str = "PEERREDIS";
const REDIS_SUBJECTS: &str = "peerredis.>";
const REDIS_SUBJECT: &str = "peerredis.batch";
const REDIS_CONSUMER: &str = "peer-redis";
/// NDJSON messages awaiting their publish ack.
const MESSAGE_PUBLISH_WINDOW: usize = 256;
/// Scripts sent on the multiplexed connection and not yet answered: Redis
/// runs them one at a time, but the next ones are already on the wire and,
/// with `appendfsync always`, share one fsync per event-loop turn.
const SCRIPTS_IN_FLIGHT: usize = 32;
/// Dedupe ids are kept in one hash per minute of event time, so a whole
/// minute expires at once, as Tapjoy's time buckets do.
const DEDUPE_BUCKET_MS: i64 = 60_000;
/// How long a dedupe bucket outlives its last write.
const DEDUPE_TTL_SECS: u64 = 2 * 60 * 60;

/// Publish acks and Redis replies slower than this fail the run.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// A consumer that receives nothing for this long while events are missing
/// fails the run instead of hanging it.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

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
    let mismatch = match compare(&expected, &actual) {
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

/// The Tapjoy design: Redis dedupes and sums, one Lua script per message.
///
/// The workload's NDJSON messages go to a JetStream stream as ad servers
/// send them. A durable pull consumer parses each message, maps every
/// impression to its limits, and sends ONE script for the whole message
/// (`EVALSHA`, loaded once with `SCRIPT LOAD`), so the message is applied
/// atomically: with 16-byte binary ids (xxh3-128 of limit and impression id,
/// as adspend derives them), kept in one hash per minute of event time with
/// a two-hour expiry, the script `HMGET`s the ids, skips those present (and
/// repeats within the message), `HSET`s the new ones and `HINCRBY`s the
/// per-limit sum hashes (`sum:<limit>`: field `lifetime`, and the local date
/// for daily limits). The message is acked once the script has returned; a
/// redelivery is harmless because its ids are then known. Scripts are
/// pipelined on one multiplexed connection (up to [`SCRIPTS_IN_FLIGHT`]), so
/// round trips do not bound the consumer.
///
/// Durable means `sync_interval: always` on JetStream and `appendfsync
/// always` on Redis. The clock runs from the first publish until every
/// message has been applied; the sums are then read back from Redis and
/// compared with the workload's truth.
///
/// # Errors
///
/// If an event does not parse or names an unknown ad, or either server
/// fails a command, a read or stalls.
///
/// # Panics
///
/// If `nats-server` or `redis-server` cannot be started (the harness
/// panics with its log).
pub async fn redis_lua(workload: &Workload, durable: bool) -> anyhow::Result<PeerRun> {
    let book = Arc::new(Book::new(&workload.catalog)?);
    let (nats, redis_server) = tokio::join!(start_nats(durable), RedisServer::start(durable));
    let mut redis = redis::Client::open(redis_server.url())
        .with_context(|| format!("redis client for {}", redis_server.url()))?
        .get_multiplexed_async_connection_with_config(
            &AsyncConnectionConfig::new().set_response_timeout(Some(REPLY_TIMEOUT)),
        )
        .await
        .with_context(|| format!("connect to redis-server at {}", redis_server.url()))?;
    let sha: String = redis::cmd("SCRIPT")
        .arg("LOAD")
        .arg(APPLY_MESSAGE_LUA)
        .query_async(&mut redis)
        .await
        .context("SCRIPT LOAD the apply-message script")?;

    let client = async_nats::connect(nats.url())
        .await
        .with_context(|| format!("connect to nats-server at {}", nats.url()))?;
    let js = jetstream::ContextBuilder::new()
        .timeout(REPLY_TIMEOUT)
        .max_ack_inflight(MESSAGE_PUBLISH_WINDOW)
        .build(client);
    let stream = js
        .create_stream(StreamConfig {
            name: REDIS_STREAM.to_owned(),
            subjects: vec![REDIS_SUBJECTS.to_owned()],
            storage: StorageType::File,
            ..Default::default()
        })
        .await
        .with_context(|| format!("create stream {REDIS_STREAM}"))?;
    let messages = stream
        .create_consumer(pull::Config {
            durable_name: Some(REDIS_CONSUMER.to_owned()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: STALL_TIMEOUT,
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .with_context(|| format!("create consumer {REDIS_CONSUMER} on {REDIS_STREAM}"))?
        .messages()
        .await
        .with_context(|| format!("read {REDIS_STREAM}"))?;
    let consumer = AbortOnDropHandle::new(tokio::spawn(apply_in_redis(
        messages,
        book.clone(),
        redis.clone(),
        sha,
        workload.messages.len(),
    )));

    let started = Instant::now();
    let outgoing = workload
        .messages
        .iter()
        .map(|payload| PublishMessage::build().payload(payload.clone()));
    publish_all(&js, REDIS_SUBJECT, outgoing, MESSAGE_PUBLISH_WINDOW).await?;
    let applied = consumer
        .await
        .context("the Redis-Lua consumer task panicked")??;
    let secs = started.elapsed().as_secs_f64();

    let actual = read_sums(&mut redis, &book).await?;
    let stats = redis_stats(&mut redis).await?;
    let mismatch = compare(&workload.truth.limits, &actual);
    let mut detail = format!(
        "{} messages, {} impressions booked ({} (limit, impression) ids); {stats}",
        workload.messages.len(),
        applied.impressions,
        applied.ids
    );
    if let Some(mismatch) = &mismatch {
        detail.push_str("; NOT EXACT: ");
        detail.push_str(mismatch);
    }
    Ok(PeerRun {
        name: "redis-lua",
        durable,
        events: workload.events,
        unique_events: applied.impressions,
        secs,
        events_per_sec: workload.events as f64 / secs,
        exact: mismatch.is_none(),
        detail,
    })
}

async fn start_nats(durable: bool) -> NatsServer {
    if durable {
        NatsServer::start().await
    } else {
        NatsServer::start_with(NatsOptions {
            lazy_sync: true,
            ..Default::default()
        })
        .await
    }
}

/// What the acks of a publish run said.
#[derive(Debug, Default)]
pub(crate) struct Acks {
    pub(crate) stored: u64,
    /// Acknowledged but not stored: the stream had the message id already.
    pub(crate) duplicates: u64,
}

impl Acks {
    fn count(&mut self, ack: Result<PublishAck, impl std::fmt::Display>) -> anyhow::Result<()> {
        match ack {
            Ok(ack) if ack.duplicate => self.duplicates += 1,
            Ok(_) => self.stored += 1,
            Err(err) => bail!("JetStream did not acknowledge a publish: {err}"),
        }
        Ok(())
    }
}

/// Publishes every message in order with up to `window` acks outstanding,
/// as the simulator does, and returns once all are acknowledged.
pub(crate) async fn publish_all(
    js: &jetstream::Context,
    subject: &str,
    messages: impl IntoIterator<Item = PublishMessage>,
    window: usize,
) -> anyhow::Result<Acks> {
    let subject = Subject::from(subject);
    let mut acks = Acks::default();
    let mut in_flight = FuturesUnordered::new();
    for message in messages {
        while in_flight.len() >= window {
            if let Some(ack) = in_flight.next().await {
                acks.count(ack)?;
            }
        }
        let ack: PublishAckFuture = js
            .send_publish(subject.clone(), message)
            .await
            .with_context(|| format!("publish to {subject}"))?;
        // `StreamExt` has an `into_future` of its own.
        in_flight.push(std::future::IntoFuture::into_future(ack));
        while let Some(Some(ack)) = in_flight.next().now_or_never() {
            acks.count(ack)?;
        }
    }
    while let Some(ack) = in_flight.next().await {
        acks.count(ack)?;
    }
    Ok(acks)
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

/// What the scripts of a [`redis_lua`] run reported.
#[derive(Debug, Default)]
struct Applied {
    /// Impressions with at least one id new to Redis.
    impressions: u64,
    /// (limit, impression) ids new to Redis.
    ids: u64,
}

/// The [`redis_lua`] consumer: one script per message, acked once applied,
/// until each of the stream's `total` messages has been applied once.
async fn apply_in_redis(
    mut messages: pull::Stream,
    book: Arc<Book>,
    redis: MultiplexedConnection,
    sha: String,
    total: usize,
) -> anyhow::Result<Applied> {
    // By stream sequence, so a redelivery is not mistaken for progress.
    let mut done = vec![false; total];
    let mut left = total;
    let mut applied = Applied::default();
    let mut in_flight = FuturesUnordered::new();
    while left > 0 {
        tokio::select! {
            Some(result) = in_flight.next(), if !in_flight.is_empty() => {
                let (seq, impressions, ids): (u64, u64, u64) = result?;
                let slot = usize::try_from(seq - 1)
                    .ok()
                    .and_then(|index| done.get_mut(index))
                    .with_context(|| {
                        format!("{REDIS_STREAM} has message {seq}, only {total} were published")
                    })?;
                if !std::mem::replace(slot, true) {
                    left -= 1;
                }
                applied.impressions += impressions;
                applied.ids += ids;
            }
            next = tokio::time::timeout(STALL_TIMEOUT, messages.next()),
                if in_flight.len() < SCRIPTS_IN_FLIGHT =>
            {
                let message = next
                    .map_err(|_| anyhow!("no message from {REDIS_STREAM} for {STALL_TIMEOUT:?}"))?
                    .with_context(|| format!("the consumer of {REDIS_STREAM} ended"))?
                    .map_err(|err| anyhow!("read {REDIS_STREAM}: {err}"))?;
                let seq = message
                    .info()
                    .map_err(|err| anyhow!("a {REDIS_STREAM} message without metadata: {err}"))?
                    .stream_sequence;
                let script = script_call(&book, &sha, &message.payload)
                    .with_context(|| format!("{REDIS_STREAM} message {seq}"))?;
                let mut redis = redis.clone();
                in_flight.push(async move {
                    let (impressions, ids): (u64, u64) = script
                        .query_async(&mut redis)
                        .await
                        .with_context(|| format!("apply {REDIS_STREAM} message {seq} in Redis"))?;
                    message
                        .ack()
                        .await
                        .map_err(|err| anyhow!("ack {REDIS_STREAM} message {seq}: {err}"))?;
                    anyhow::Ok((seq, impressions, ids))
                });
            }
        }
    }
    Ok(applied)
}

/// Applies one NDJSON message: dedupe by (limit, impression) id, remember
/// the new ids, add their costs to the sums; all or nothing, as a script is.
///
/// KEYS: the message's dedupe bucket hashes. ARGV\[1\]: their expiry in
/// seconds; then per impression: its bucket (index into KEYS), cost, number
/// of limits `n`, and `n` times (id, sum hash key, local date or "" for a
/// lifetime limit). Returns {impressions with a new id, new ids}.
///
/// Lua's `unpack` has a stack limit, hence the slices of 1000 fields.
const APPLY_MESSAGE_LUA: &str = r"
local ttl = ARGV[1]
local ids = {}
for k = 1, #KEYS do ids[k] = {} end
local i = 2
while i <= #ARGV do
  local bucket, n = tonumber(ARGV[i]), tonumber(ARGV[i + 2])
  local list = ids[bucket]
  for t = 0, n - 1 do list[#list + 1] = ARGV[i + 3 + 3 * t] end
  i = i + 3 + 3 * n
end

local seen = {}
for k = 1, #KEYS do
  local list = ids[k]
  for first = 1, #list, 1000 do
    local last = math.min(first + 999, #list)
    local held = redis.call('HMGET', KEYS[k], unpack(list, first, last))
    for j = first, last do
      if held[j - first + 1] then seen[list[j]] = true end
    end
  end
end

local fresh = {}
for k = 1, #KEYS do fresh[k] = {} end
local sums = {}
local impressions, new_ids = 0, 0
i = 2
while i <= #ARGV do
  local bucket, cost, n = tonumber(ARGV[i]), tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local booked = false
  for t = 0, n - 1 do
    local at = i + 3 + 3 * t
    local id = ARGV[at]
    if not seen[id] then
      seen[id] = true
      local list = fresh[bucket]
      list[#list + 1] = id
      list[#list + 1] = '1'
      local key, day = ARGV[at + 1], ARGV[at + 2]
      local fields = sums[key]
      if not fields then fields = {}; sums[key] = fields end
      fields['lifetime'] = (fields['lifetime'] or 0) + cost
      if day ~= '' then fields[day] = (fields[day] or 0) + cost end
      new_ids = new_ids + 1
      booked = true
    end
  end
  if booked then impressions = impressions + 1 end
  i = i + 3 + 3 * n
end

for k = 1, #KEYS do
  local list = fresh[k]
  for first = 1, #list, 1000 do
    redis.call('HSET', KEYS[k], unpack(list, first, math.min(first + 999, #list)))
  end
  if #list > 0 then redis.call('EXPIRE', KEYS[k], ttl) end
end
for key, fields in pairs(sums) do
  for field, micros in pairs(fields) do
    redis.call('HINCRBY', key, field, string.format('%d', micros))
  end
end
return {impressions, new_ids}
";

/// Builds the `EVALSHA` of [`APPLY_MESSAGE_LUA`] for one NDJSON message.
fn script_call(book: &Book, sha: &str, payload: &[u8]) -> anyhow::Result<redis::Cmd> {
    let events = payload
        .split(|&byte| byte == b'\n')
        .filter(|line| !line.is_empty())
        .map(parse_event)
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut buckets: Vec<i64> = Vec::new();
    let bucket_of: Vec<usize> = events
        .iter()
        .map(|event| {
            let bucket = event.ts.div_euclid(DEDUPE_BUCKET_MS);
            buckets
                .iter()
                .position(|&known| known == bucket)
                .unwrap_or_else(|| {
                    buckets.push(bucket);
                    buckets.len() - 1
                })
        })
        .collect();

    let mut call = redis::cmd("EVALSHA");
    call.arg(sha).arg(buckets.len());
    for bucket in &buckets {
        call.arg(format!("dd:{bucket}"));
    }
    call.arg(DEDUPE_TTL_SECS);
    for (event, bucket) in events.iter().zip(bucket_of) {
        let limits = book.limits_of(&event.ad_id)?;
        // Lua indexes from 1.
        call.arg(bucket + 1)
            .arg(event.cost_micros)
            .arg(limits.len());
        for &limit in limits {
            call.arg(&MsgId::derive(&book.limit_ids[limit], &event.id).0[..])
                .arg(&book.sum_keys[limit]);
            match book.day_of(limit, event.ts)? {
                Some(day) => call.arg(format_day(day)),
                None => call.arg(""),
            };
        }
    }
    Ok(call)
}

/// Every limit's sums as Redis holds them, in the truth's shape.
async fn read_sums(
    redis: &mut MultiplexedConnection,
    book: &Book,
) -> anyhow::Result<BTreeMap<String, LimitTruth>> {
    let mut reads = redis::pipe();
    for key in &book.sum_keys {
        reads.hgetall(key);
    }
    let hashes: Vec<HashMap<String, u64>> = reads
        .query_async(redis)
        .await
        .context("read the sum hashes back from Redis")?;
    Ok(book
        .limit_ids
        .iter()
        .zip(hashes)
        .map(|(limit, mut fields)| {
            let lifetime_micros = fields.remove("lifetime").unwrap_or(0);
            let daily = fields.into_iter().collect();
            let sums = LimitTruth {
                lifetime_micros,
                daily,
            };
            (limit.clone(), sums)
        })
        .collect())
}

/// Where Redis's time and memory went: `used_memory_human`, to set next
/// to adspend's store size, and the time spent inside the scripts, to tell
/// a Redis-bound run from a consumer-bound one.
async fn redis_stats(redis: &mut MultiplexedConnection) -> anyhow::Result<String> {
    let info: String = redis::cmd("INFO")
        .arg("memory")
        .arg("commandstats")
        .query_async(redis)
        .await
        .context("INFO memory commandstats")?;
    let memory = info
        .lines()
        .find_map(|line| line.strip_prefix("used_memory_human:"))
        .unwrap_or("unknown")
        .trim();
    let script_usec = info
        .lines()
        .find_map(|line| line.strip_prefix("cmdstat_evalsha:"))
        .and_then(|stats| {
            stats
                .split(',')
                .find_map(|stat| stat.strip_prefix("usec="))
                .and_then(|usec| usec.parse::<u64>().ok())
        })
        .unwrap_or(0);
    Ok(format!(
        "Redis used_memory {memory}, {:.2} s inside the scripts",
        script_usec as f64 / 1e6
    ))
}

/// The catalog as a peer's consumer holds it.
struct Book {
    limit_ids: Vec<String>,
    /// `sum:<limit>`, the Redis peer's sum hash of each limit.
    sum_keys: Vec<String>,
    /// The zone of each daily limit; `None` for lifetime limits.
    zones: Vec<Option<Tz>>,
    /// Ad id → positions in `limit_ids`.
    ads: HashMap<String, Vec<usize>>,
}

impl Book {
    fn new(catalog: &Catalog) -> anyhow::Result<Book> {
        let position: HashMap<&str, usize> = catalog
            .limits
            .keys()
            .enumerate()
            .map(|(index, id)| (id.as_str(), index))
            .collect();
        let zones =
            catalog
                .limits
                .iter()
                .map(|(id, limit)| match limit.period {
                    Period::Lifetime => Ok(None),
                    Period::Daily => limit.time_zone.parse::<Tz>().map(Some).map_err(|_| {
                        anyhow!("limit {id}: unknown time zone {:?}", limit.time_zone)
                    }),
                })
                .collect::<anyhow::Result<_>>()?;
        let ads = catalog
            .ads
            .iter()
            .map(|(ad, limits)| {
                let limits = limits
                    .iter()
                    .map(|limit| {
                        position
                            .get(limit.as_str())
                            .copied()
                            .with_context(|| format!("ad {ad} names unknown limit {limit}"))
                    })
                    .collect::<anyhow::Result<_>>()?;
                Ok((ad.clone(), limits))
            })
            .collect::<anyhow::Result<_>>()?;
        Ok(Book {
            limit_ids: catalog.limits.keys().cloned().collect(),
            sum_keys: catalog
                .limits
                .keys()
                .map(|id| format!("sum:{id}"))
                .collect(),
            zones,
            ads,
        })
    }

    fn limits_of(&self, ad: &str) -> anyhow::Result<&[usize]> {
        self.ads
            .get(ad)
            .map(Vec::as_slice)
            .with_context(|| format!("impression of unknown ad {ad:?}"))
    }

    /// The local date of `ts_ms` in a daily limit's zone; `None` for a
    /// lifetime limit.
    fn day_of(&self, limit: usize, ts_ms: i64) -> anyhow::Result<Option<NaiveDate>> {
        let Some(zone) = self.zones[limit] else {
            return Ok(None);
        };
        let instant = DateTime::from_timestamp_millis(ts_ms)
            .with_context(|| format!("event time {ts_ms} ms is out of range"))?;
        Ok(Some(instant.with_timezone(&zone).date_naive()))
    }
}

/// One impression as the CONTRACT defines it, borrowed from the payload.
#[derive(Deserialize)]
struct Event<'a> {
    #[serde(borrow)]
    id: Cow<'a, str>,
    #[serde(borrow)]
    ad_id: Cow<'a, str>,
    cost_micros: u64,
    ts: i64,
}

fn parse_event(line: &[u8]) -> anyhow::Result<Event<'_>> {
    serde_json::from_slice(line)
        .with_context(|| format!("not an impression: {}", String::from_utf8_lossy(line)))
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
                    .map(|(day, spent)| (format_day(day), spent))
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

/// `YYYY-MM-DD`, the truth's and the Redis sum hashes' day format.
fn format_day(day: NaiveDate) -> String {
    day.format("%Y-%m-%d").to_string()
}

/// `None` if `actual` equals `expected` for every limit; otherwise how many
/// limits differ and the first few of them.
fn compare(
    expected: &BTreeMap<String, LimitTruth>,
    actual: &BTreeMap<String, LimitTruth>,
) -> Option<String> {
    const SHOWN: usize = 3;
    let empty = LimitTruth::default();
    let differing: Vec<String> = expected
        .keys()
        .chain(actual.keys().filter(|id| !expected.contains_key(*id)))
        .filter_map(|id| {
            let want = expected.get(id).unwrap_or(&empty);
            let got = actual.get(id).unwrap_or(&empty);
            (want != got).then(|| {
                format!(
                    "{id}: expected lifetime {} daily {:?}, got lifetime {} daily {:?}",
                    want.lifetime_micros, want.daily, got.lifetime_micros, got.daily
                )
            })
        })
        .collect();
    if differing.is_empty() {
        return None;
    }
    let shown = differing[..differing.len().min(SHOWN)].join("; ");
    Some(format!("{} limits differ: {shown}", differing.len()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::workload::WorkloadSpec;

    /// Small enough for a durable JetStream run to take well under a second,
    /// with enough duplicates (some within one message) that a peer which
    /// failed to drop them could not match the truth.
    fn tiny_workload() -> Workload {
        let workload = Workload::generate(&WorkloadSpec {
            ads: 50,
            events: 2_000,
            batch: 100,
            duplicate_rate: 0.1,
            seed: 11,
        })
        .unwrap();
        assert!(
            workload.unique_events < workload.events,
            "the workload must hold duplicates for these tests to mean anything"
        );
        workload
    }

    fn assert_exact(run: &PeerRun) {
        println!("{run:?}");
        assert!(
            run.exact,
            "{} (durable: {}): {}",
            run.name, run.durable, run.detail
        );
    }

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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_lua_is_exact_when_durable() {
        let workload = tiny_workload();
        let run = redis_lua(&workload, true).await.unwrap();
        assert_exact(&run);
        assert_eq!(run.unique_events, workload.unique_events);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn redis_lua_is_exact_in_memory() {
        let workload = tiny_workload();
        let run = redis_lua(&workload, false).await.unwrap();
        assert_exact(&run);
        assert_eq!(run.unique_events, workload.unique_events);
    }

    #[test]
    fn compare_names_the_limits_that_differ() {
        let mut expected = BTreeMap::new();
        expected.insert(
            "campaign-1".to_owned(),
            LimitTruth {
                lifetime_micros: 5,
                daily: BTreeMap::from([("2026-01-01".to_owned(), 5)]),
            },
        );
        expected.insert("adset-1".to_owned(), LimitTruth::default());
        let mut actual = expected.clone();
        assert_eq!(compare(&expected, &actual), None);

        actual.get_mut("campaign-1").unwrap().daily.clear();
        actual.insert(
            "ghost".to_owned(),
            LimitTruth {
                lifetime_micros: 1,
                daily: BTreeMap::new(),
            },
        );
        let mismatch = compare(&expected, &actual).unwrap();
        assert!(mismatch.starts_with("2 limits differ"), "{mismatch}");
        assert!(
            mismatch.contains("campaign-1") && mismatch.contains("ghost"),
            "{mismatch}"
        );
        assert!(!mismatch.contains("adset-1"), "{mismatch}");
    }

    /// Throughput of both peers, durable and not, on a workload big enough
    /// to measure; prints the runs. `cargo test -p adspend-tests --release
    /// --lib bench::peers -- --ignored --nocapture`.
    #[tokio::test(flavor = "multi_thread")]
    #[ignore = "a measurement, not a test: takes a minute"]
    async fn measure_peers() {
        let workload = Workload::generate(&WorkloadSpec {
            ads: 2_000,
            events: 200_000,
            batch: 1_000,
            duplicate_rate: 0.05,
            seed: 3,
        })
        .unwrap();
        for durable in [false, true] {
            // Per-message fsync manages a few thousand messages a second.
            let events = if durable { 20_000 } else { workload.events };
            let runs = [
                jetstream_dedupe(&workload, events, durable).await.unwrap(),
                redis_lua(&workload, durable).await.unwrap(),
            ];
            for run in runs {
                println!(
                    "{:<17} durable={:<5} events={:>7} unique={:>7} {:>7.2}s {:>10.0} events/s exact={} ({})",
                    run.name,
                    run.durable,
                    run.events,
                    run.unique_events,
                    run.secs,
                    run.events_per_sec,
                    run.exact,
                    run.detail
                );
                assert!(run.exact, "{}", run.detail);
            }
        }
    }
}
