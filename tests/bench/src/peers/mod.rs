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
//!
//! Each peer has its own file (`jetstream.rs`, `redis.rs`); what both use
//! (the catalog as a consumer holds it, event parsing, publishing with a
//! window of acks) is here; the comparison with the truth is the
//! simulator's own ([`adspend_sim::differences`]).

mod jetstream;
mod redis;

pub use self::jetstream::jetstream_dedupe;
pub use self::redis::redis_lua;

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::Duration;

use anyhow::{anyhow, bail, Context as _};
use async_nats::jetstream::context::PublishAckFuture;
use async_nats::jetstream::message::PublishMessage;
use async_nats::jetstream::publish::PublishAck;
use async_nats::Subject;
use chrono::NaiveDate;
use chrono_tz::Tz;
use futures::stream::{FuturesUnordered, StreamExt};
use futures::FutureExt;
use serde::Deserialize;

use adspend_harness::{NatsOptions, NatsServer};
use adspend_sim::{local_date, Catalog, Period};

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

/// Publish acks and Redis replies slower than this fail the run.
const REPLY_TIMEOUT: Duration = Duration::from_secs(30);
/// A consumer that receives nothing for this long while events are missing
/// fails the run instead of hanging it.
const STALL_TIMEOUT: Duration = Duration::from_secs(60);

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
    js: &async_nats::jetstream::Context,
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
        local_date(zone, ts_ms).map(Some)
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::{Workload, WorkloadSpec};

    /// Small enough for a durable JetStream run to take well under a second,
    /// with enough duplicates (some within one message) that a peer which
    /// failed to drop them could not match the truth.
    pub(super) fn tiny_workload() -> Workload {
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

    pub(super) fn assert_exact(run: &PeerRun) {
        println!("{run:?}");
        assert!(
            run.exact,
            "{} (durable: {}): {}",
            run.name, run.durable, run.detail
        );
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
