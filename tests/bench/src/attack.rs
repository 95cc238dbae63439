//! The pacer under the cheap attacks of issue 27, each while another
//! client measures `GET /v1/limits/{id}` from another address: a pacer
//! process with its default settings, a generated catalog plus the costliest
//! shape the catalog bounds allow (an ad with 64 limits above it, one chain
//! 16 parents deep), and no other service (the answers need only the
//! catalog).
//!
//! - `none`: nothing else, the reference;
//! - `slowloris`: one address holds as many slow connections as it can
//!   (more than the whole connection cap), trickling a header line a second
//!   and reconnecting a second after each close;
//! - `decisions`: eight clients POST batches of the most ids allowed, of
//!   ordinary ads, back to back;
//! - `oversized`: eight clients POST the 2 MB batch of empty ids
//!   (refused 413), back to back;
//! - `deepest`: eight clients POST batches of the most ids allowed, all of
//!   the costliest ad, back to back;
//! - `pushes`: sums pushes several times faster than a pipeline sends
//!   them ([`AttackBench::push_shards`] shards, each pushing
//!   [`AttackBench::push_entries`] limits every [`PUSH_EVERY`], as an
//!   aggregator per partition would), to see the ingest keep up and the
//!   answers stay fast.
//!
//! Besides the GETs, the measuring client POSTs a decisions batch of
//! [`DECISION_IDS`] ordinary ads every [`GET_EVERY`], so each attack also
//! shows what it does to a bidder's decisions.
//!
//! The measuring client opens a new connection for each GET (the
//! slowloris attack starves accepts, not open connections), one every
//! [`GET_EVERY`], on a thread and runtime of its own (the attackers'
//! thousands of tasks would otherwise delay its own polling); a GET that
//! fails counts with the time it took. Attackers and pacer share the
//! machine's cores.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use tokio_util::sync::CancellationToken;

use crate::e2e::SERVICE_ENV;
use adspend_harness::pipeline::{Backends, Pipeline};
use adspend_harness::{free_port, NatsOptions};
use adspend_sim::stats::quantile;
use adspend_sim::{self as sim, Catalog, CatalogSpec, Limit, Period};
use adspend_wire::codec::encode_sums;
use adspend_wire::types::{SumEntry, SumsUpdate};

mod attackers;
use attackers::{start_attack, Pushing};

/// The pacer's defaults, restated for the attackers' sizes.
const MAX_DECISION_IDS: usize = 1_000;
/// Concurrent decisions clients (the eight).
const DECIDERS: usize = 8;
/// Empty ids in the oversized batch (just under the 2 MiB body
/// limit, so the id cap, not the body limit, refuses it).
const OVERSIZED_IDS: usize = 650_000;
/// One GET this often (each on a new connection).
pub const GET_EVERY: Duration = Duration::from_millis(10);
/// Where the measuring client connects from.
const MEASURER: &str = "127.0.0.2";
/// Ads in each of the measuring client's decisions batches.
pub const DECISION_IDS: usize = 100;
/// Each pushing shard pushes this often (the aggregator's default).
pub const PUSH_EVERY: Duration = Duration::from_millis(20);

/// Settings of the section.
#[derive(Debug, Clone)]
pub struct AttackBench {
    /// Ads in the generated part of the catalog.
    pub ads: u32,
    /// Seconds each attack is measured (after one second of warm-up).
    pub secs: u64,
    /// Slow connections the slowloris attacker keeps trying to hold.
    pub slow_connections: usize,
    /// `pushes`: shards pushing at once, and limits in each push.
    pub push_shards: usize,
    pub push_entries: usize,
    pub attacks: Vec<Attack>,
}

impl Default for AttackBench {
    fn default() -> Self {
        AttackBench {
            ads: 20_000,
            secs: 10,
            slow_connections: 2_000,
            push_shards: 64,
            push_entries: 500,
            attacks: vec![
                Attack::None,
                Attack::Slowloris,
                Attack::Decisions,
                Attack::Oversized,
                Attack::Deepest,
                Attack::Pushes,
            ],
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Attack {
    None,
    Slowloris,
    Decisions,
    Oversized,
    Deepest,
    Pushes,
}

impl Attack {
    pub fn name(self) -> &'static str {
        match self {
            Attack::None => "none",
            Attack::Slowloris => "slowloris",
            Attack::Decisions => "decisions",
            Attack::Oversized => "oversized",
            Attack::Deepest => "deepest",
            Attack::Pushes => "pushes",
        }
    }
}

/// The figures of one attack.
#[derive(Debug, Clone)]
pub struct AttackResult {
    pub attack: Attack,
    pub gets: usize,
    pub failed: usize,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// The measuring client's decisions batches.
    pub decide_p50_ms: f64,
    pub decide_p99_ms: f64,
    /// What the attacker got done meanwhile.
    pub attacker: String,
}

/// The costliest ad the catalog bounds allow: four chains (17, 16, 16 and
/// 15 limits: the first 16 parents deep), the ad under each chain's bottom,
/// 64 limits above it.
pub const DEEPEST_AD: &str = "ad-deepest";

/// The generated catalog plus [`DEEPEST_AD`] and its chains.
pub fn catalog(ads: u32) -> anyhow::Result<Catalog> {
    let mut catalog = sim::generate_catalog(&CatalogSpec::for_ads(ads), 27)?;
    let mut bottoms = Vec::new();
    for (chain, length) in [17, 16, 16, 15].into_iter().enumerate() {
        for level in 0..length {
            let parent = (level > 0).then(|| format!("deep-{chain}-{}", level - 1));
            catalog.limits.insert(
                format!("deep-{chain}-{level}"),
                Limit {
                    budget_micros: 1_000_000_000_000,
                    period: Period::Daily,
                    time_zone: "America/New_York".into(),
                    parent,
                },
            );
        }
        bottoms.push(format!("deep-{chain}-{}", length - 1));
    }
    catalog.ads.insert(DEEPEST_AD.into(), bottoms);
    Ok(catalog)
}

/// Run every attack of `bench` against one pacer; prints each as it ends.
pub async fn run(bench: &AttackBench) -> anyhow::Result<(Duration, Vec<AttackResult>)> {
    let catalog = catalog(bench.ads)?;
    let mut p = Pipeline::start_with(Backends::default(), NatsOptions::default(), catalog).await;
    let started = Instant::now();
    let metrics_port = free_port();
    p.pacer = Some(p.spawn_with("pacer", metrics_port, SERVICE_ENV));
    p.wait_pacer().await;
    let start_time = started.elapsed();
    println!(
        "bench: attack: pacer healthy {:.2} s after start ({} limits, {} ads)",
        start_time.as_secs_f64(),
        p.catalog.limits.len(),
        p.catalog.ads.len()
    );
    let target = p.pacer_url();
    let limit = p
        .catalog
        .limits
        .keys()
        .find(|id| id.starts_with("adset-"))
        .context("an ad set")?
        .clone();
    let ads: Vec<String> = p
        .catalog
        .ads
        .keys()
        .filter(|ad| ad.as_str() != DEEPEST_AD)
        .take(MAX_DECISION_IDS)
        .cloned()
        .collect();
    let limits: Arc<Vec<String>> = Arc::new(p.catalog.limits.keys().cloned().collect());
    let client = p.client().await;
    let mut results = Vec::new();
    for &attack in &bench.attacks {
        let stop = CancellationToken::new();
        let applied_before = pushes_applied(metrics_port).await;
        let pushing = Pushing {
            client: client.clone(),
            limits: limits.clone(),
        };
        let attacker = start_attack(attack, bench, &target, &ads, &pushing, stop.clone())?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let measured = measure(
            &target,
            &limit,
            &ads[..DECISION_IDS.min(ads.len())],
            Duration::from_secs(bench.secs),
        )
        .await?;
        stop.cancel();
        let (mut attacker, published) = attacker.finish().await;
        if attack == Attack::Pushes {
            attacker.push_str(&kept_up(metrics_port, applied_before, published).await);
        }
        let times: Vec<f64> = measured.gets.iter().map(|(ms, _)| *ms).collect();
        let decide: Vec<f64> = measured.decisions.iter().map(|(ms, _)| *ms).collect();
        let result = AttackResult {
            attack,
            gets: measured.gets.len(),
            failed: measured.gets.iter().filter(|(_, ok)| !ok).count()
                + measured.decisions.iter().filter(|(_, ok)| !ok).count(),
            p50_ms: quantile(&times, 0.5),
            p99_ms: quantile(&times, 0.99),
            max_ms: quantile(&times, 1.0),
            decide_p50_ms: quantile(&decide, 0.5),
            decide_p99_ms: quantile(&decide, 0.99),
            attacker,
        };
        println!("{}", summary(&result));
        results.push(result);
        // Let the attack's connections drain before the next.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    Ok((start_time, results))
}

/// Sums pushes the pacer has taken in (its own counter).
async fn pushes_applied(metrics_port: u16) -> f64 {
    adspend_harness::pipeline::try_metric(metrics_port, "adspend_pacer_updates_total")
        .await
        .unwrap_or(0.0)
}

/// Whether the pacer took in every push published since `before`: waits up
/// to 5 s after the last for the count to reach what was published.
async fn kept_up(metrics_port: u16, before: f64, published: u64) -> String {
    let published = published as f64;
    let started = Instant::now();
    let mut applied = pushes_applied(metrics_port).await - before;
    while applied < published && started.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(50)).await;
        applied = pushes_applied(metrics_port).await - before;
    }
    format!(
        "; the pacer took in {applied:.0} of {published:.0} ({:.2} s after the last)",
        started.elapsed().as_secs_f64()
    )
}

pub fn summary(r: &AttackResult) -> String {
    format!(
        "bench: attack {}: GET p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} GETs, {} requests failed); decisions of {DECISION_IDS} p50 {:.2} ms, p99 {:.2} ms; attacker: {}",
        r.attack.name(),
        r.p50_ms,
        r.p99_ms,
        r.max_ms,
        r.gets,
        r.failed,
        r.decide_p50_ms,
        r.decide_p99_ms,
        r.attacker
    )
}

/// What the measuring client saw: (milliseconds, answered 200) each.
struct Measured {
    gets: Vec<(f64, bool)>,
    decisions: Vec<(f64, bool)>,
}

/// GETs of `limit`, a new connection each, and decisions of `ads` on a
/// kept connection, from [`MEASURER`], for `duration`, on a runtime of
/// their own.
async fn measure(
    target: &str,
    limit: &str,
    ads: &[String],
    duration: Duration,
) -> anyhow::Result<Measured> {
    let (target, limit) = (target.to_string(), limit.to_string());
    let body = Bytes::from(serde_json::to_vec(&serde_json::json!({ "ad_ids": ads }))?);
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(requests(&target, &limit, body, duration))
    })
    .await
    .context("the measuring thread")?
}

async fn requests(
    target: &str,
    limit: &str,
    body: Bytes,
    duration: Duration,
) -> anyhow::Result<Measured> {
    let fresh = reqwest::Client::builder()
        .no_proxy()
        .local_address(MEASURER.parse::<IpAddr>()?)
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()?;
    let kept = reqwest::Client::builder()
        .no_proxy()
        .local_address(MEASURER.parse::<IpAddr>()?)
        .timeout(Duration::from_secs(30))
        .build()?;
    let url = format!("{target}/v1/limits/{limit}");
    let decide = format!("{target}/v1/decisions");
    let mut out = Measured {
        gets: Vec::new(),
        decisions: Vec::new(),
    };
    let mut every = tokio::time::interval(GET_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let end = Instant::now() + duration;
    while Instant::now() < end {
        every.tick().await;
        let sent = Instant::now();
        let ok = match fresh.get(&url).send().await {
            Ok(response) => response.status() == 200 && response.bytes().await.is_ok(),
            Err(_) => false,
        };
        out.gets.push((sent.elapsed().as_secs_f64() * 1000.0, ok));
        let sent = Instant::now();
        let posted = kept
            .post(&decide)
            .header("content-type", "application/json")
            .body(body.clone())
            .send()
            .await;
        let ok = match posted {
            Ok(response) => response.status() == 200 && response.bytes().await.is_ok(),
            Err(_) => false,
        };
        out.decisions
            .push((sent.elapsed().as_secs_f64() * 1000.0, ok));
    }
    Ok(out)
}

/// The section's table: one row per attack.
pub fn markdown(start: Duration, results: &[AttackResult]) -> String {
    let mut out = format!(
        "pacer healthy {:.2} s after start\n\n| attack | GETs | failed | GET p50 ms | GET p99 ms | GET max ms | decisions of {DECISION_IDS}: p50 ms | p99 ms | attacker |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n",
        start.as_secs_f64()
    );
    for r in results {
        out.push_str(&format!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {:.2} | {} |\n",
            r.attack.name(),
            r.gets,
            r.failed,
            r.p50_ms,
            r.p99_ms,
            r.max_ms,
            r.decide_p50_ms,
            r.decide_p99_ms,
            r.attacker
        ));
    }
    out
}
