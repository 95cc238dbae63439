//! How fast the pacers grant spend leases: `clients` HTTP clients POST
//! `/v1/leases` with `ads` ads a request, back to back, spread over
//! `pacers` pacer processes that share one ledger, for `secs` seconds on
//! the real pipeline (NATS, an aggregator pushing, a limiter). Every ask is
//! small against its budget, so every ad is granted: what is measured is
//! the cost of a grant, not of running out. Reports leased ads per second,
//! the request latency, and how often a commit lost the race to another
//! pacer's (what the shared ledger costs with more than one pacer).

use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_harness::pipeline::{try_metric, Backends, Pipeline};
use adspend_harness::{free_port, NatsOptions};
use adspend_sim::stats::quantile;
use adspend_sim::{self as sim, CatalogSpec};
use anyhow::Context as _;

use crate::e2e::SERVICE_ENV;

#[derive(Debug, Clone)]
pub struct LeaseBench {
    pub pacers: usize,
    pub clients: usize,
    pub ads: usize,
    pub secs: u64,
}

#[derive(Debug, Clone)]
pub struct LeaseResult {
    pub pacers: usize,
    pub clients: usize,
    pub ads_per_request: usize,
    pub requests: usize,
    pub failed: usize,
    pub leased_ads_per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub commits: f64,
    pub races: f64,
}

/// Run one configuration; prints its line.
pub async fn run(bench: &LeaseBench) -> anyhow::Result<LeaseResult> {
    let catalog = sim::generate_catalog(&CatalogSpec::for_ads(2_000), 36)?;
    let ads: Vec<String> = catalog.ads.keys().cloned().collect();
    let mut p = Pipeline::start_with(Backends::default(), NatsOptions::default(), catalog).await;
    p.aggregator = Some(p.spawn_with("aggregator", free_port(), SERVICE_ENV));
    p.limiter = Some(p.spawn_with("limiter", free_port(), SERVICE_ENV));
    let mut pacers = Vec::new();
    for _ in 0..bench.pacers.max(1) {
        let addr = format!("127.0.0.1:{}", free_port());
        let metrics = free_port();
        let mut env = SERVICE_ENV.to_vec();
        env.push(("ADSPEND_PACER_ADDR", &addr));
        let process = p.spawn_with("pacer", metrics, &env);
        pacers.push((addr, metrics, process));
    }
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()?;
    // Ready: every pacer grants (it answers 503 while it reads the ledger,
    // and grants nothing while the aggregator has not pushed yet).
    for (addr, _, _) in &pacers {
        let ready = adspend_harness::wait_until(
            Duration::from_secs(60),
            Duration::from_millis(200),
            || async {
                let body = serde_json::json!({"ads": [{"ad_id": ads[0], "micros": 1}]});
                match http
                    .post(format!("http://{addr}/v1/leases"))
                    .json(&body)
                    .send()
                    .await
                {
                    Ok(r) if r.status() == 200 => r
                        .json::<serde_json::Value>()
                        .await
                        .is_ok_and(|v| v["leases"][0]["granted_micros"] == 1),
                    _ => false,
                }
            },
        )
        .await;
        anyhow::ensure!(ready.is_ok(), "the pacer at {addr} never granted a lease");
    }
    let commits_before = sum_metric(&pacers, "adspend_pacer_lease_commit_seconds_count").await;
    let races_before = sum_metric(&pacers, "adspend_pacer_lease_commit_races_total").await;
    let stop = Arc::new(AtomicBool::new(false));
    let ads = Arc::new(ads);
    let mut clients = tokio::task::JoinSet::new();
    for client in 0..bench.clients.max(1) {
        let url = format!("http://{}/v1/leases", pacers[client % pacers.len()].0);
        let (http, ads, stop, per) = (http.clone(), ads.clone(), stop.clone(), bench.ads);
        clients.spawn(async move {
            let mut seen: Vec<(f64, usize)> = Vec::new();
            let mut next = client * per;
            while !stop.load(Relaxed) {
                let asks: Vec<serde_json::Value> = (0..per)
                    .map(|i| serde_json::json!({"ad_id": ads[(next + i) % ads.len()], "micros": 1}))
                    .collect();
                next += per;
                let body = serde_json::json!({"ads": asks, "ttl_ms": 1000});
                let sent = Instant::now();
                let granted = match http.post(&url).json(&body).send().await {
                    Ok(r) if r.status() == 200 => r
                        .json::<serde_json::Value>()
                        .await
                        .map(|v| {
                            v["leases"].as_array().map_or(0, |l| {
                                l.iter().filter(|l| l["lease_id"].is_string()).count()
                            })
                        })
                        .unwrap_or(0),
                    _ => usize::MAX,
                };
                seen.push((sent.elapsed().as_secs_f64() * 1000.0, granted));
            }
            seen
        });
    }
    let started = Instant::now();
    tokio::time::sleep(Duration::from_secs(bench.secs)).await;
    stop.store(true, Relaxed);
    let mut seen = Vec::new();
    while let Some(done) = clients.join_next().await {
        seen.extend(done.context("a lease client")?);
    }
    let elapsed = started.elapsed().as_secs_f64();
    let times: Vec<f64> = seen.iter().map(|(ms, _)| *ms).collect();
    let failed = seen.iter().filter(|(_, n)| *n == usize::MAX).count();
    let leased: usize = seen
        .iter()
        .filter(|(_, n)| *n != usize::MAX)
        .map(|(_, n)| n)
        .sum();
    let result = LeaseResult {
        pacers: pacers.len(),
        clients: bench.clients,
        ads_per_request: bench.ads,
        requests: seen.len(),
        failed,
        leased_ads_per_sec: leased as f64 / elapsed,
        p50_ms: quantile(&times, 0.5),
        p99_ms: quantile(&times, 0.99),
        commits: sum_metric(&pacers, "adspend_pacer_lease_commit_seconds_count").await
            - commits_before,
        races: sum_metric(&pacers, "adspend_pacer_lease_commit_races_total").await - races_before,
    };
    println!("{}", summary(&result));
    Ok(result)
}

async fn sum_metric(
    pacers: &[(String, u16, adspend_harness::ServiceProcess)],
    series: &str,
) -> f64 {
    let mut total = 0.0;
    for (_, port, _) in pacers {
        total += try_metric(*port, series).await.unwrap_or(0.0);
    }
    total
}

pub fn summary(r: &LeaseResult) -> String {
    format!(
        "bench: leases: {} pacer(s), {} clients, {} ads a request: {:.0} leased ads/s, request p50 {:.2} ms, p99 {:.2} ms ({} requests, {} failed; {:.0} commits, {:.0} races lost)",
        r.pacers,
        r.clients,
        r.ads_per_request,
        r.leased_ads_per_sec,
        r.p50_ms,
        r.p99_ms,
        r.requests,
        r.failed,
        r.commits,
        r.races
    )
}

pub fn markdown(results: &[LeaseResult]) -> String {
    let mut out = String::from(
        "| pacers | clients | ads a request | leased ads/s | request p50 ms | p99 ms | requests (failed) | commits | races lost |\n| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for r in results {
        out.push_str(&format!(
            "| {} | {} | {} | {:.0} | {:.2} | {:.2} | {} ({}) | {:.0} | {:.0} |\n",
            r.pacers,
            r.clients,
            r.ads_per_request,
            r.leased_ads_per_sec,
            r.p50_ms,
            r.p99_ms,
            r.requests,
            r.failed,
            r.commits,
            r.races
        ));
    }
    out
}
