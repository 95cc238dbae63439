//! Fair sharing among sources: five sources (A–E) publish at steady rates
//! to `impressions.<source>`, then A floods (10x its rate) or replays a
//! backlog at once, on a real pipeline whose limiter schedules `fair` or
//! `fifo`. The same traffic for both.
//!
//! Freshness is measured per source in the pacer: each source's ads book to
//! a limit of its own (`src-<source>`), every event costs the same, and a
//! poller reads the five limits every few milliseconds; a message is fresh
//! at the first poll whose lifetime spend covers it (publish to the pacer
//! holding the sum, within the poll interval). The part of it before the
//! limiter can see a message, `ts` → stored in `IMPRESSIONS`, is read back
//! from the stream per source after the run.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use async_nats::jetstream;
use tokio::sync::Mutex;

use adspend_harness::pipeline::{Backends, Pipeline};
use adspend_harness::{free_port, NatsOptions};
use adspend_sim::{Catalog, Limit, Period};

pub const SOURCES: [&str; 5] = ["A", "B", "C", "D", "E"];
const ADS_PER_SOURCE: usize = 100;
const COST_MICROS: u64 = 1_000;
const POLL_EVERY: Duration = Duration::from_millis(5);
const TICK: Duration = Duration::from_millis(10);

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Surge {
    /// No surge: A keeps its rate (the control, what the same seconds give
    /// without a flood: checkpoints and the machine's own noise).
    None,
    /// A publishes at ten times its rate during the surge.
    Flood,
    /// A publishes this many events as fast as JetStream takes them at the
    /// start of the surge (an exchange reconnecting with its backlog).
    Backlog(u64),
}

#[derive(Debug, Clone)]
pub struct Scenario {
    /// `fair` or `fifo` (`ADSPEND_LIMITER_SCHEDULING`).
    pub scheduling: &'static str,
    pub surge: Surge,
    /// Events per second of each source while steady.
    pub rate: f64,
    /// Events per message.
    pub batch: usize,
    pub steady: Duration,
    pub surge_for: Duration,
    /// Settings for the limiter besides the scheduling (`ADSPEND_*` name,
    /// value), to compare tunings on the same traffic.
    pub limiter_env: Vec<(String, String)>,
    /// The most messages each source's ad server keeps published and not
    /// yet acknowledged by JetStream. A's backlog goes out at this many at
    /// a time: what waits in NATS's ingest ahead of the others' messages.
    pub max_unacked: usize,
}

/// Freshness (seconds) of one source's messages, per phase.
#[derive(Debug, Clone, Default)]
pub struct SourceResult {
    pub steady: Vec<f64>,
    pub surge: Vec<f64>,
    /// The surge's messages published once A's backlog was stored (all of
    /// it acknowledged by JetStream): the drain, without the time NATS
    /// takes the backlog in on the machine the pipeline runs on. Empty in
    /// the flood.
    pub after_stored: Vec<f64>,
    /// Into `IMPRESSIONS` (a message's `ts` → stored, seconds), the part of
    /// the freshness before the limiter can see a message, per phase.
    pub ingest_steady: Vec<f64>,
    pub ingest_surge: Vec<f64>,
    /// From stored in `IMPRESSIONS` to the pacer holding the sum (seconds),
    /// per phase (of the publish, as `steady` and `surge`): the freshness
    /// from the moment the limiter can see a message, which is what its
    /// scheduling decides. The time into the stream is NATS's and the ad
    /// server's.
    pub pipeline_steady: Vec<f64>,
    pub pipeline_surge: Vec<f64>,
    /// Every message's freshness and time into the stream, as `(kind,
    /// seconds since the run started, seconds)`, kind `fresh` (at publish),
    /// `into_stream` (at stored) or `from_stream` (at stored: stored to
    /// the pacer).
    pub series: Vec<(&'static str, f64, f64)>,
    pub events: u64,
}

impl SourceResult {
    /// `source,kind,at_s,delay_ms` lines, one per message and kind.
    pub fn csv_lines(&self, source: &str) -> String {
        self.series
            .iter()
            .map(|(kind, at, delay)| format!("{source},{kind},{at:.3},{:.1}\n", delay * 1000.0))
            .collect()
    }
}

#[derive(Debug, Clone)]
pub struct Outcome {
    pub sources: BTreeMap<&'static str, SourceResult>,
    /// From the end of publishing until A's last event was in the pacer.
    pub a_drain_secs: f64,
    /// Whether every source's total equals what was acknowledged.
    pub exact: bool,
    /// From the start of the surge until A's backlog was stored.
    pub backlog_stored_secs: Option<f64>,
    /// From the start of the surge until all of A's backlog was in the
    /// pacer.
    pub backlog_drained_secs: Option<f64>,
}

pub fn catalog() -> Catalog {
    let limit = |period| Limit {
        budget_micros: u64::MAX / 4,
        period,
        time_zone: "UTC".into(),
        parent: None,
    };
    let mut catalog = Catalog {
        limits: BTreeMap::new(),
        ads: BTreeMap::new(),
    };
    for source in SOURCES {
        catalog
            .limits
            .insert(format!("src-{source}"), limit(Period::Lifetime));
        for i in 0..ADS_PER_SOURCE {
            let own = format!("{source}-lim-{}", i % 20);
            catalog.limits.insert(own.clone(), limit(Period::Daily));
            catalog.ads.insert(
                format!("{source}-ad-{i}"),
                vec![own, format!("src-{source}")],
            );
        }
    }
    catalog
}

pub async fn start(scheduling: &str, limiter_env: &[(String, String)]) -> anyhow::Result<Pipeline> {
    let options = NatsOptions {
        lazy_sync: true,
        ..NatsOptions::default()
    };
    let mut p = Pipeline::start_with(Backends::default(), options, catalog()).await;
    let mut env: Vec<(&str, &str)> = super::e2e::SERVICE_ENV.to_vec();
    env.push(("ADSPEND_LIMITER_SCHEDULING", scheduling));
    p.aggregator = Some(p.spawn_with("aggregator", free_port(), &env));
    let mut limiter = env.clone();
    limiter.extend(limiter_env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    p.limiter = Some(p.spawn_with("limiter", free_port(), &limiter));
    p.pacer = Some(p.spawn_with("pacer", free_port(), &env));
    p.wait_pacer().await;
    adspend_sim::ensure_stream(&p.client().await).await?;
    Ok(p)
}

/// (when, lifetime spend) per source, as the pacer served it.
type Polls = Arc<Mutex<BTreeMap<&'static str, Vec<(Instant, u64)>>>>;

/// One published message.
struct Mark {
    at: Instant,
    /// The source's events published up to and including it.
    upto: u64,
    /// Its first impression's id (finds it in the stream).
    first_id: String,
}

/// What a source published, message by message.
#[derive(Default)]
struct Sent {
    marks: Vec<Mark>,
}

struct Publisher {
    js: jetstream::Context,
    source: &'static str,
    sent: Arc<Mutex<Sent>>,
    next_id: u64,
    /// Events published so far.
    published: u64,
    acks: tokio::task::JoinSet<anyhow::Result<()>>,
    max_unacked: usize,
}

/// The id of `source`'s impression number `n`.
fn impression_id(source: &str, n: u64) -> String {
    format!("{source}-{n}")
}

/// `events` impressions of `source` as one NDJSON message, with ids from
/// `first` on and `ts` now.
fn payload(source: &str, first: u64, events: u64) -> bytes::Bytes {
    let ts = adspend_common::now_ms();
    let mut payload = String::with_capacity(events as usize * 80);
    for n in first..first + events {
        payload.push_str(&format!(
            "{{\"id\":\"{source}-{n}\",\"ad_id\":\"{source}-ad-{}\",\"cost_micros\":{COST_MICROS},\"ts\":{ts}}}\n",
            n as usize % ADS_PER_SOURCE
        ));
    }
    payload.into()
}

/// A's backlog, built before the run: an ad server flushing what it stored
/// during an outage has its messages at hand, so the benchmark's own
/// formatting stays out of the surge (ids from 2^40 on, apart from the
/// steady ones).
fn backlog(source: &str, events: u64) -> Vec<(bytes::Bytes, u64, String)> {
    const MESSAGE: u64 = 1_000;
    (0..events)
        .step_by(MESSAGE as usize)
        .map(|first| {
            let (n, first) = (MESSAGE.min(events - first), (1 << 40) + first);
            (payload(source, first, n), n, impression_id(source, first))
        })
        .collect()
}

impl Publisher {
    /// `events` impressions as one NDJSON message, numbered on from the
    /// last, and its first id.
    fn payload(&mut self, events: u64) -> (bytes::Bytes, String) {
        let payload = payload(self.source, self.next_id, events);
        let first_id = impression_id(self.source, self.next_id);
        self.next_id += events;
        (payload, first_id)
    }

    async fn publish(&mut self, events: u64) -> anyhow::Result<()> {
        let (payload, first_id) = self.payload(events);
        self.send(payload, events, first_id).await
    }

    /// Publish a message of `events` (built earlier, or just now).
    async fn send(
        &mut self,
        payload: bytes::Bytes,
        events: u64,
        first_id: String,
    ) -> anyhow::Result<()> {
        let at = Instant::now();
        self.published += events;
        let upto = self.published;
        let ack = self
            .js
            .publish(format!("impressions.{}", self.source), payload)
            .await
            .context("publish")?;
        self.sent
            .lock()
            .await
            .marks
            .push(Mark { at, upto, first_id });
        self.acks
            .spawn(async move { ack.await.map(|_| ()).context("publish ack") });
        while self.acks.len() > self.max_unacked {
            self.acks.join_next().await.expect("non-empty")??;
        }
        Ok(())
    }

    /// Publish at `rate` events/s until `until`, in messages of `batch`.
    async fn steady(&mut self, rate: f64, batch: usize, until: Instant) -> anyhow::Result<()> {
        let started = Instant::now();
        let mut published = 0u64;
        let mut tick = tokio::time::interval(TICK);
        while Instant::now() < until {
            tick.tick().await;
            let due = (started.elapsed().as_secs_f64() * rate) as u64;
            while published + batch as u64 <= due {
                self.publish(batch as u64).await?;
                published += batch as u64;
            }
        }
        Ok(())
    }

    async fn finish(mut self) -> anyhow::Result<u64> {
        while let Some(r) = self.acks.join_next().await {
            r??;
        }
        Ok(self.published)
    }
}

/// Run one scenario on a fresh pipeline.
pub async fn run(s: &Scenario) -> anyhow::Result<Outcome> {
    let mut backlogs = BTreeMap::new();
    if let Surge::Backlog(events) = s.surge {
        backlogs.insert("A", backlog("A", events));
    }
    let p = start(s.scheduling, &s.limiter_env).await?;
    let http = reqwest::Client::builder().no_proxy().build()?;
    let stop_polling = tokio_util::sync::CancellationToken::new();
    let polls: Polls = Default::default();
    let poller = {
        let (polls, stop, url) = (polls.clone(), stop_polling.clone(), p.pacer_url());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let reads = SOURCES.map(|source| {
                    let http = http.clone();
                    let url = format!("{url}/v1/limits/src-{source}");
                    async move {
                        let spend = async {
                            let v: serde_json::Value =
                                http.get(&url).send().await.ok()?.json().await.ok()?;
                            v["lifetime_spend_micros"].as_u64()
                        }
                        .await;
                        (source, Instant::now(), spend)
                    }
                });
                for (source, at, spend) in futures::future::join_all(reads).await {
                    if let Some(spend) = spend {
                        polls
                            .lock()
                            .await
                            .entry(source)
                            .or_default()
                            .push((at, spend));
                    }
                }
                tokio::time::sleep(POLL_EVERY).await;
            }
        })
    };

    let started = Instant::now();
    let started_wall = SystemTime::now();
    let surge_at = started + s.steady;
    let end = surge_at + s.surge_for;
    let mut tasks = tokio::task::JoinSet::new();
    let mut sents = BTreeMap::new();
    // When A's backlog was stored, and A's events published by then.
    let backlog_stored: Arc<Mutex<Option<(Instant, u64)>>> = Default::default();
    for source in SOURCES {
        let sent = Arc::new(Mutex::new(Sent::default()));
        sents.insert(source, sent.clone());
        // A connection of its own per source, as separate exchanges' ad
        // servers have: on one shared connection the others' messages
        // would queue behind A's backlog in the client before NATS saw them.
        let mut publisher = Publisher {
            js: jetstream::new(p.client().await),
            source,
            sent,
            next_id: 0,
            published: 0,
            acks: tokio::task::JoinSet::new(),
            max_unacked: s.max_unacked,
        };
        let backlog = backlogs.remove(source).unwrap_or_default();
        let stored = backlog_stored.clone();
        let (rate, batch, surge) = (s.rate, s.batch, s.surge);
        tasks.spawn(async move {
            publisher.steady(rate, batch, surge_at).await?;
            match (source, surge) {
                ("A", Surge::Flood) => publisher.steady(rate * 10.0, batch, end).await?,
                ("A", Surge::Backlog(_)) => {
                    for (payload, events, first_id) in backlog {
                        publisher.send(payload, events, first_id).await?;
                    }
                    while let Some(r) = publisher.acks.join_next().await {
                        r??;
                    }
                    *stored.lock().await = Some((Instant::now(), publisher.published));
                    publisher.steady(rate, batch, end).await?;
                }
                _ => publisher.steady(rate, batch, end).await?,
            }
            anyhow::Ok((source, publisher.finish().await?))
        });
    }
    let mut totals = BTreeMap::new();
    while let Some(done) = tasks.join_next().await {
        let (source, events) = done??;
        totals.insert(source, events);
    }
    let published = Instant::now();

    // Until every source's total is in the pacer (or the drain timeout).
    let deadline = published + Duration::from_secs(600);
    let mut a_done = None;
    loop {
        let polls = polls.lock().await;
        let caught_up = |source: &str| {
            polls
                .get(source)
                .and_then(|v| v.last())
                .map(|&(at, spend)| (at, spend))
                .filter(|&(_, spend)| spend >= totals[source] * COST_MICROS)
        };
        if a_done.is_none() {
            a_done = caught_up("A").map(|(at, _)| at);
        }
        if SOURCES.iter().all(|s| caught_up(s).is_some()) || Instant::now() > deadline {
            break;
        }
        drop(polls);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    stop_polling.cancel();
    poller.await?;
    let polls = polls.lock().await;
    let client = p.client().await;
    let backlog_stored = *backlog_stored.lock().await;
    let stored_at_backlog = backlog_stored.map(|(at, _)| at);
    let surge_wall = started_wall + s.steady;
    let end_wall = surge_wall + s.surge_for;
    let mut exact = true;
    let mut sources = BTreeMap::new();
    for source in SOURCES {
        let empty = Vec::new();
        let source_polls = polls.get(source).unwrap_or(&empty);
        let final_spend = source_polls.last().map_or(0, |&(_, s)| s);
        exact &= final_spend == totals[source] * COST_MICROS;
        let mut result = SourceResult {
            events: totals[source],
            ..Default::default()
        };
        let (surge_ms, start_ms, end_ms) = (
            adspend_sim::stats::unix_ms_at(surge_wall),
            adspend_sim::stats::unix_ms_at(started_wall),
            adspend_sim::stats::unix_ms_at(end_wall),
        );
        // Everything stored, the drain's last messages included.
        let stored = super::stages::impressions_stored(
            &client,
            &format!("impressions.{source}"),
            started_wall,
            SystemTime::now() + Duration::from_secs(3600),
        )
        .await?;
        let mut stored_at = std::collections::HashMap::with_capacity(stored.len());
        for m in &stored {
            let delay = (m.stored_ms - m.ts_ms) as f64 / 1000.0;
            stored_at.insert(m.first_id.as_str(), m.stored_ms);
            if m.stored_ms >= end_ms {
                continue;
            }
            result.series.push((
                "into_stream",
                (m.stored_ms - start_ms) as f64 / 1000.0,
                delay,
            ));
            let phase = if m.stored_ms < surge_ms {
                &mut result.ingest_steady
            } else {
                &mut result.ingest_surge
            };
            phase.push(delay);
        }
        let sent = sents[source].lock().await;
        let mut cursor = 0;
        for mark in &sent.marks {
            while cursor < source_polls.len() && source_polls[cursor].1 < mark.upto * COST_MICROS {
                cursor += 1;
            }
            let Some(&(seen, _)) = source_polls.get(cursor) else {
                break;
            };
            let fresh = seen.saturating_duration_since(mark.at).as_secs_f64();
            let offset = mark.at.saturating_duration_since(started).as_secs_f64();
            result.series.push(("fresh", offset, fresh));
            // Stored to seen, on the wall clock of the stored time.
            let pipeline = stored_at.get(mark.first_id.as_str()).map(|&stored_ms| {
                let seen_ms = start_ms as f64
                    + seen.saturating_duration_since(started).as_secs_f64() * 1000.0;
                let pipeline = ((seen_ms - stored_ms as f64) / 1000.0).max(0.0);
                result.series.push((
                    "from_stream",
                    (stored_ms - start_ms) as f64 / 1000.0,
                    pipeline,
                ));
                pipeline
            });
            if mark.at < surge_at {
                result.steady.push(fresh);
                result.pipeline_steady.extend(pipeline);
            } else {
                result.surge.push(fresh);
                result.pipeline_surge.extend(pipeline);
                if stored_at_backlog.is_some_and(|stored| mark.at >= stored) {
                    result.after_stored.push(fresh);
                }
            }
        }
        sources.insert(source, result);
    }
    Ok(Outcome {
        sources,
        a_drain_secs: a_done.map_or(f64::NAN, |at| {
            at.saturating_duration_since(published).as_secs_f64()
        }),
        exact,
        backlog_stored_secs: stored_at_backlog
            .map(|stored| stored.saturating_duration_since(surge_at).as_secs_f64()),
        backlog_drained_secs: backlog_stored.and_then(|(_, upto)| {
            let (seen, _) = polls
                .get("A")?
                .iter()
                .find(|&&(_, spend)| spend >= upto * COST_MICROS)?;
            Some(seen.saturating_duration_since(surge_at).as_secs_f64())
        }),
    })
}
