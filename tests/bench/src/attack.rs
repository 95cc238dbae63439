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
//!   the costliest ad, back to back.
//!
//! The measuring client opens a new connection for each GET (the
//! slowloris attack starves accepts, not open connections), one every
//! [`GET_EVERY`], on a thread and runtime of its own (the attackers'
//! thousands of tasks would otherwise delay its own polling); a GET that
//! fails counts with the time it took. Attackers and pacer share the
//! machine's cores.

use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::e2e::SERVICE_ENV;
use adspend_harness::pipeline::{Backends, Pipeline};
use adspend_harness::{free_port, NatsOptions};
use adspend_sim::stats::quantile;
use adspend_sim::{self as sim, Catalog, CatalogSpec, Limit, Period};

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

/// Settings of the section.
#[derive(Debug, Clone)]
pub struct AttackBench {
    /// Ads in the generated part of the catalog.
    pub ads: u32,
    /// Seconds each attack is measured (after one second of warm-up).
    pub secs: u64,
    /// Slow connections the slowloris attacker keeps trying to hold.
    pub slow_connections: usize,
    pub attacks: Vec<Attack>,
}

impl Default for AttackBench {
    fn default() -> Self {
        AttackBench {
            ads: 20_000,
            secs: 10,
            slow_connections: 2_000,
            attacks: vec![
                Attack::None,
                Attack::Slowloris,
                Attack::Decisions,
                Attack::Oversized,
                Attack::Deepest,
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
}

impl Attack {
    pub fn name(self) -> &'static str {
        match self {
            Attack::None => "none",
            Attack::Slowloris => "slowloris",
            Attack::Decisions => "decisions",
            Attack::Oversized => "oversized",
            Attack::Deepest => "deepest",
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
    p.pacer = Some(p.spawn_with("pacer", free_port(), SERVICE_ENV));
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
    let mut results = Vec::new();
    for &attack in &bench.attacks {
        let stop = CancellationToken::new();
        let attacker = start_attack(attack, bench, &target, &ads, stop.clone())?;
        tokio::time::sleep(Duration::from_secs(1)).await;
        let latencies = measure_gets(&target, &limit, Duration::from_secs(bench.secs)).await?;
        stop.cancel();
        let attacker = attacker.finish().await;
        let times: Vec<f64> = latencies.iter().map(|(ms, _)| *ms).collect();
        let result = AttackResult {
            attack,
            gets: latencies.len(),
            failed: latencies.iter().filter(|(_, ok)| !ok).count(),
            p50_ms: quantile(&times, 0.5),
            p99_ms: quantile(&times, 0.99),
            max_ms: quantile(&times, 1.0),
            attacker,
        };
        println!("{}", summary(&result));
        results.push(result);
        // Let the attack's connections drain before the next.
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    Ok((start_time, results))
}

pub fn summary(r: &AttackResult) -> String {
    format!(
        "bench: attack {}: GET p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms ({} GETs, {} failed); attacker: {}",
        r.attack.name(),
        r.p50_ms,
        r.p99_ms,
        r.max_ms,
        r.gets,
        r.failed,
        r.attacker
    )
}

/// GETs of `limit`, a new connection each, from [`MEASURER`], for
/// `duration`, on a runtime of their own: (milliseconds, answered 200) each.
async fn measure_gets(
    target: &str,
    limit: &str,
    duration: Duration,
) -> anyhow::Result<Vec<(f64, bool)>> {
    let (target, limit) = (target.to_string(), limit.to_string());
    tokio::task::spawn_blocking(move || {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?
            .block_on(gets(&target, &limit, duration))
    })
    .await
    .context("the measuring thread")?
}

async fn gets(target: &str, limit: &str, duration: Duration) -> anyhow::Result<Vec<(f64, bool)>> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .local_address(MEASURER.parse::<IpAddr>()?)
        .pool_max_idle_per_host(0)
        .timeout(Duration::from_secs(30))
        .build()?;
    let url = format!("{target}/v1/limits/{limit}");
    let mut out = Vec::new();
    let mut every = tokio::time::interval(GET_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let end = Instant::now() + duration;
    while Instant::now() < end {
        every.tick().await;
        let sent = Instant::now();
        let ok = match http.get(&url).send().await {
            Ok(response) => response.status() == 200 && response.bytes().await.is_ok(),
            Err(_) => false,
        };
        out.push((sent.elapsed().as_secs_f64() * 1000.0, ok));
    }
    Ok(out)
}

/// An attack under way: its tasks and what they count.
struct Running {
    tasks: JoinSet<()>,
    counts: Arc<Counts>,
    attack: Attack,
    started: Instant,
}

#[derive(Default)]
struct Counts {
    /// Requests answered, by kind.
    ok: AtomicU64,
    refused: AtomicU64,
    other: AtomicU64,
    /// Slowloris: connections opened, and closed by the pacer.
    opened: AtomicU64,
    closed: AtomicU64,
}

impl Running {
    async fn finish(mut self) -> String {
        let secs = self.started.elapsed().as_secs_f64();
        while self.tasks.join_next().await.is_some() {}
        let c = &self.counts;
        let (ok, refused, other) = (
            c.ok.load(Relaxed),
            c.refused.load(Relaxed),
            c.other.load(Relaxed),
        );
        match self.attack {
            Attack::None => "none".to_string(),
            Attack::Slowloris => format!(
                "{} connections opened, {} closed by the pacer, {:.0}/s",
                c.opened.load(Relaxed),
                c.closed.load(Relaxed),
                c.opened.load(Relaxed) as f64 / secs
            ),
            _ => format!(
                "{ok} answered 200, {refused} refused 413, {other} other ({:.1} requests/s)",
                (ok + refused + other) as f64 / secs
            ),
        }
    }
}

fn start_attack(
    attack: Attack,
    bench: &AttackBench,
    target: &str,
    ads: &[String],
    stop: CancellationToken,
) -> anyhow::Result<Running> {
    let counts = Arc::new(Counts::default());
    let mut tasks = JoinSet::new();
    let address = target.trim_start_matches("http://").to_string();
    match attack {
        Attack::None => {}
        Attack::Slowloris => {
            for _ in 0..bench.slow_connections {
                tasks.spawn(slow_client(address.clone(), counts.clone(), stop.clone()));
            }
        }
        Attack::Decisions | Attack::Oversized | Attack::Deepest => {
            let body = match attack {
                Attack::Decisions => serde_json::to_vec(&serde_json::json!({ "ad_ids": ads }))?,
                Attack::Deepest => serde_json::to_vec(
                    &serde_json::json!({ "ad_ids": vec![DEEPEST_AD; MAX_DECISION_IDS] }),
                )?,
                _ => serde_json::to_vec(&serde_json::json!({ "ad_ids": vec![""; OVERSIZED_IDS] }))?,
            };
            let body = Bytes::from(body);
            let http = reqwest::Client::builder()
                .no_proxy()
                .timeout(Duration::from_secs(60))
                .build()?;
            for _ in 0..DECIDERS {
                tasks.spawn(decider(
                    http.clone(),
                    format!("{target}/v1/decisions"),
                    body.clone(),
                    counts.clone(),
                    stop.clone(),
                ));
            }
        }
    }
    Ok(Running {
        tasks,
        counts,
        attack,
        started: Instant::now(),
    })
}

/// POSTs `body` back to back until `stop`.
async fn decider(
    http: reqwest::Client,
    url: String,
    body: Bytes,
    counts: Arc<Counts>,
    stop: CancellationToken,
) {
    while !stop.is_cancelled() {
        let sent = http
            .post(&url)
            .header("content-type", "application/json")
            .body(body.clone())
            .send();
        let response = tokio::select! {
            _ = stop.cancelled() => return,
            r = sent => r,
        };
        let counter = match response {
            Ok(r) if r.status() == 200 => {
                let _ = r.bytes().await;
                &counts.ok
            }
            Ok(r) if r.status() == 413 => &counts.refused,
            _ => &counts.other,
        };
        counter.fetch_add(1, Relaxed);
    }
}

/// One slowloris connection at a time: a head that never ends, a header
/// line a second; a second after the pacer closes it, again.
async fn slow_client(address: String, counts: Arc<Counts>, stop: CancellationToken) {
    while !stop.is_cancelled() {
        let connected = tokio::select! {
            _ = stop.cancelled() => return,
            c = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(&address)) => c,
        };
        if let Ok(Ok(mut stream)) = connected {
            counts.opened.fetch_add(1, Relaxed);
            if stream
                .write_all(b"GET /healthz HTTP/1.1\r\nHost: pacer\r\n")
                .await
                .is_ok()
            {
                let mut buf = [0u8; 1024];
                let mut trickle = tokio::time::interval(Duration::from_secs(1));
                loop {
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        read = stream.read(&mut buf) => {
                            if matches!(read, Ok(0) | Err(_)) {
                                counts.closed.fetch_add(1, Relaxed);
                                break;
                            }
                        }
                        _ = trickle.tick() => {
                            if stream.write_all(b"X-Slow: a\r\n").await.is_err() {
                                counts.closed.fetch_add(1, Relaxed);
                                break;
                            }
                        }
                    }
                }
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// The section's table: one row per attack.
pub fn markdown(start: Duration, results: &[AttackResult]) -> String {
    let mut out = format!(
        "pacer healthy {:.2} s after start\n\n| attack | GETs | failed | GET p50 ms | GET p99 ms | GET max ms | attacker |\n| --- | ---: | ---: | ---: | ---: | ---: | --- |\n",
        start.as_secs_f64()
    );
    for r in results {
        out.push_str(&format!(
            "| {} | {} | {} | {:.2} | {:.2} | {:.2} | {} |\n",
            r.attack.name(),
            r.gets,
            r.failed,
            r.p50_ms,
            r.p99_ms,
            r.max_ms,
            r.attacker
        ));
    }
    out
}
