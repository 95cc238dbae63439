//! The whole pipeline, end to end: simulator → NATS (`IMPRESSIONS`) →
//! limiter → NATS (`SPEND`) → aggregator → pacer, every service a separate
//! process of the same build as `adbench`, NATS on this machine. A run ends
//! when the pacer's answer equals the truth of every acknowledged event,
//! so the figures are for exactly-once results, not for messages moved.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use async_nats::jetstream::{self, message::PublishMessage};
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use adspend_harness::pipeline::{Backends, Pipeline};
use adspend_harness::{free_port, NatsOptions};
use adspend_sim::check::wait_for_match;
use adspend_sim::stats::histogram_quantile;
use adspend_sim::{self as sim, Catalog, InputFormat, SimConfig, Truth};

/// Settings of the services in a benchmark: the contract's production
/// defaults, with logs at `info`.
pub const SERVICE_ENV: &[(&str, &str)] = &[
    ("RUST_LOG", "info"),
    ("ADSPEND_PARTITIONS", "16"),
    ("ADSPEND_CHECKPOINT_INTERVAL_MS", "10000"),
    ("ADSPEND_DEDUPE_WINDOW_MS", "3600000"),
    // The product's default (the test harness pins one writer).
    ("ADSPEND_AGGREGATOR_WRITERS", "auto"),
];

/// Longest wait for the pacer to catch up after publishing ends.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(600);

/// Metrics ports of the services of a benchmark pipeline.
#[derive(Debug, Clone, Copy)]
pub struct Ports {
    pub limiter: u16,
    pub aggregator: u16,
}

/// A pipeline with all three services running. `durable` chooses NATS's
/// `sync_interval: always` (fsync per message) over its default.
pub async fn start(
    catalog: Catalog,
    durable: bool,
    backends: Backends,
) -> anyhow::Result<Pipeline> {
    Ok(start_with_ports(catalog, durable, backends, &[]).await?.0)
}

/// [`start`], with `extra` settings for every service on top of
/// [`SERVICE_ENV`]; also returns the services' metrics ports.
pub async fn start_with_ports(
    catalog: Catalog,
    durable: bool,
    backends: Backends,
    extra: &[(String, String)],
) -> anyhow::Result<(Pipeline, Ports)> {
    let options = NatsOptions {
        lazy_sync: !durable,
        ..NatsOptions::default()
    };
    let ports = Ports {
        limiter: free_port(),
        aggregator: free_port(),
    };
    let mut env: Vec<(&str, &str)> = SERVICE_ENV
        .iter()
        .filter(|(k, _)| !extra.iter().any(|(e, _)| e == k))
        .copied()
        .collect();
    env.extend(extra.iter().map(|(k, v)| (k.as_str(), v.as_str())));
    let mut p = Pipeline::start_with(backends, options, catalog).await;
    p.aggregator = Some(p.spawn_with("aggregator", ports.aggregator, &env));
    p.limiter = Some(p.spawn_with("limiter", ports.limiter, &env));
    p.pacer = Some(p.spawn_with("pacer", free_port(), &env));
    p.wait_pacer().await;
    sim::ensure_stream(&p.client().await).await?;
    Ok((p, ports))
}

/// Publishes `messages` to `subject` with up to `in_flight` acks pending;
/// fails unless JetStream acknowledges every one. Returns how many it did.
pub async fn publish_all(
    client: &async_nats::Client,
    subject: &str,
    messages: impl IntoIterator<Item = Bytes>,
    in_flight: usize,
) -> anyhow::Result<u64> {
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(30))
        .max_ack_inflight(in_flight)
        .build(client.clone());
    let messages = messages
        .into_iter()
        .map(|payload| PublishMessage::build().payload(payload));
    let acks = super::peers::publish_all(&js, subject, messages, in_flight).await?;
    Ok(acks.stored + acks.duplicates)
}

/// How a run ended.
#[derive(Debug, Clone)]
pub struct Run {
    /// Events offered (duplicates included) that JetStream acknowledged.
    pub events: u64,
    /// From the first publish until the pacer equalled the truth.
    pub secs: f64,
    pub events_per_sec: f64,
    /// Whether the pacer equalled the truth for every limit.
    pub exact: bool,
}

/// Wait until the pacer equals `truth`: the run of `events` that began at
/// `started`.
pub async fn settle(
    p: &Pipeline,
    truth: &Truth,
    events: u64,
    started: Instant,
) -> anyhow::Result<Run> {
    let (comparison, _) = wait_for_match(&p.pacer_url(), truth, DRAIN_TIMEOUT).await?;
    let secs = started.elapsed().as_secs_f64();
    let exact = comparison.mismatches().is_empty();
    if !exact {
        eprintln!(
            "bench: the pacer differs from the truth:\n{}",
            comparison.render(10)
        );
    }
    Ok(Run {
        events,
        secs,
        events_per_sec: events as f64 / secs,
        exact,
    })
}

/// Publishes a pre-generated workload as fast as JetStream takes it.
pub async fn workload(p: &Pipeline, workload: &super::workload::Workload) -> anyhow::Result<Run> {
    let client = p.client().await;
    let started = Instant::now();
    publish_all(
        &client,
        "impressions.bench",
        workload.messages.iter().cloned(),
        256,
    )
    .await?;
    settle(p, &workload.truth, workload.events, started).await
}

/// The simulator at full speed into `impressions.bench` for `events` or
/// `duration`, `batch` events per message, 5% duplicates.
fn full_speed(
    events: Option<u64>,
    duration: Option<Duration>,
    batch: usize,
    seed: u64,
    format: InputFormat,
) -> SimConfig {
    SimConfig {
        format,
        subject: "impressions.bench".into(),
        events,
        duration,
        batch,
        duplicate_rate: 0.05,
        seed,
        in_flight: 64,
        progress_interval: Duration::from_secs(10),
        create_stream: false,
        ..SimConfig::default()
    }
}

/// The simulator at full speed until `events` are in `IMPRESSIONS`, `batch`
/// per message, 5% duplicates: a backlog when nothing reads it meanwhile.
/// Its truth; [`settle`] waits for the pacer to equal it.
pub async fn backlog(p: &Pipeline, events: u64, batch: usize, seed: u64) -> anyhow::Result<Truth> {
    let client = p.client().await;
    let config = full_speed(Some(events), None, batch, seed, InputFormat::Ndjson);
    let truth = sim::run(&client, &config, &p.catalog, CancellationToken::new()).await?;
    anyhow::ensure!(
        truth.stats.messages_failed == 0,
        "{} publishes failed",
        truth.stats.messages_failed
    );
    Ok(truth)
}

/// The simulator at full speed for `duration`, `batch` events per message
/// in `format`, 5% duplicates; then until the pacer has caught up.
pub async fn sustained(
    p: &Pipeline,
    duration: Duration,
    batch: usize,
    seed: u64,
    format: InputFormat,
) -> anyhow::Result<Run> {
    let client = p.client().await;
    let config = full_speed(None, Some(duration), batch, seed, format);
    let started = Instant::now();
    let truth = sim::run_with_progress(
        &client,
        &config,
        &p.catalog,
        CancellationToken::new(),
        |progress| {
            println!(
                "bench:   {:>4.0}s {} events sent, {} events/s",
                progress.elapsed.as_secs_f64(),
                progress.events_sent,
                progress.recent_rate.round()
            );
        },
    )
    .await?;
    anyhow::ensure!(
        truth.stats.messages_failed == 0,
        "{} publishes failed",
        truth.stats.messages_failed
    );
    settle(p, &truth, truth.stats.events_acked, started).await
}

/// Freshness (impression published, or its `ts` if older → its sums in the pacer) at `rate`
/// events/s for `duration`: quantiles of the pacer's freshness histogram
/// over exactly that interval.
pub struct Freshness {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub pushes: u64,
    pub events_per_sec: f64,
    /// The stages before the aggregator, over the same interval.
    pub stages: super::stages::Stages,
}

pub async fn freshness(
    p: &Pipeline,
    rate: f64,
    duration: Duration,
    batch: usize,
    seed: u64,
) -> anyhow::Result<Freshness> {
    let client = p.client().await;
    let http = reqwest::Client::new();
    let metrics_url = format!("{}/metrics", p.pacer_url());
    let config = SimConfig {
        subject: "impressions.bench".into(),
        events: None,
        duration: Some(duration),
        rate,
        batch,
        duplicate_rate: 0.05,
        seed,
        in_flight: 64,
        progress_interval: Duration::from_secs(3600),
        create_stream: false,
        ..SimConfig::default()
    };
    // Let the first seconds (stream and consumer warm-up) pass unmeasured.
    let run = {
        let client = client.clone();
        let catalog = p.catalog.clone();
        tokio::spawn(
            async move { sim::run(&client, &config, &catalog, CancellationToken::new()).await },
        )
    };
    let watch = super::stages::PushWatch::start(&client).await?;
    tokio::time::sleep(Duration::from_secs(3)).await;
    let before = scrape_histogram(&http, &metrics_url).await?;
    let from = std::time::SystemTime::now();
    let truth = run.await.context("simulator task")??;
    let until = std::time::SystemTime::now();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = scrape_histogram(&http, &metrics_url).await?;
    let pushes = watch
        .finish(from, until + Duration::from_millis(500))
        .await?;
    let stages = super::stages::read_back(&client, from, until, pushes).await?;
    let delta: Vec<(f64, u64)> = after
        .iter()
        .map(|(le, n)| {
            (
                *le,
                n - before.iter().find(|(b, _)| b == le).map_or(0, |(_, m)| *m),
            )
        })
        .collect();
    Ok(Freshness {
        p50_ms: histogram_quantile(&delta, 0.50) * 1000.0,
        p99_ms: histogram_quantile(&delta, 0.99) * 1000.0,
        pushes: delta.last().map_or(0, |(_, n)| *n),
        events_per_sec: truth.stats.events_per_sec,
        stages,
    })
}

/// Cumulative buckets `(le, count)` of the pacer's freshness histogram.
async fn scrape_histogram(http: &reqwest::Client, url: &str) -> anyhow::Result<Vec<(f64, u64)>> {
    let body = http.get(url).send().await?.text().await?;
    // By the name the pacer exports (`PACER_FRESHNESS_SECONDS` of
    // pacer/src/telemetry.rs): this crate does not link the pacer.
    let prefix = "adspend_pacer_freshness_seconds_bucket{le=\"";
    let mut buckets = Vec::new();
    for line in body.lines() {
        let Some(rest) = line.strip_prefix(prefix) else {
            continue;
        };
        let Some((le, count)) = rest.split_once("\"}") else {
            continue;
        };
        let le = if le == "+Inf" {
            f64::INFINITY
        } else {
            le.parse()?
        };
        buckets.push((le, count.trim().parse::<f64>()? as u64));
    }
    Ok(buckets)
}
