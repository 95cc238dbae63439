//! The Tapjoy design: Redis holds the dedupe ids and the sums, and a
//! consumer runs one Lua script per NDJSON message on it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Instant;

use adspend_wire::types::MsgId;
use anyhow::{anyhow, Context as _};
use async_nats::jetstream;
use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::consumer::AckPolicy;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::stream::{Config as StreamConfig, StorageType};
use futures::stream::{FuturesUnordered, StreamExt};
use redis::aio::MultiplexedConnection;
use redis::AsyncConnectionConfig;
use tokio_util::task::AbortOnDropHandle;

use super::{parse_event, publish_all, start_nats, Book, PeerRun, REPLY_TIMEOUT, STALL_TIMEOUT};
use crate::workload::Workload;
use adspend_harness::RedisServer;
use adspend_sim::{day_key, differences, LimitTruth};

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
    let mismatch = differences(&workload.truth.limits, &actual);
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
                Some(day) => call.arg(day_key(day)),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peers::tests::{assert_exact, tiny_workload};

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
}
