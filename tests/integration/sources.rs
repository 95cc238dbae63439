//! The limiter's per-source reports as the pacer serves them
//! (`GET /v1/sources`): real NATS, limiter, aggregator and pacer processes.
//! Sources with a backlog are listed with shares that sum to 1 while the
//! limiter works, non-negative lags and held-back flags only where messages
//! wait; once drained the report decays to idle; a killed limiter's entry
//! goes stale; a FIFO limiter reports its mode and no sources.

use std::collections::BTreeMap;
use std::time::Duration;

use adspend_harness::{free_port, wait_until_ok};
use adspend_sim::SimConfig;
use anyhow::{ensure, Context};
use serde::Deserialize;

use crate::support::{assert_exact, Backends, Pipeline};

#[derive(Debug, Clone, Deserialize)]
struct SourcesView {
    limiters: Vec<Limiter>,
    stale_intervals: u64,
}

#[derive(Debug, Clone, Deserialize)]
struct Limiter {
    limiter: String,
    consumer: String,
    scheduling: String,
    ts_ms: i64,
    age_ms: i64,
    stale: bool,
    interval_ms: u64,
    intervening: bool,
    sources: Vec<Source>,
}

/// Typed: a `held_back` that is not a JSON boolean fails the read.
#[derive(Debug, Clone, Deserialize)]
struct Source {
    source: String,
    usage_share: f64,
    lag_seconds: f64,
    held_back: bool,
    pending_messages: u64,
    messages_total: u64,
    messages_per_second: f64,
}

async fn read_sources(url: &str) -> anyhow::Result<SourcesView> {
    let response = reqwest::get(format!("{url}/v1/sources")).await?;
    ensure!(response.status().is_success(), "{}", response.status());
    Ok(response.json().await?)
}

fn sim(source: &str, events: u64, batch: usize, seed: u64) -> SimConfig {
    SimConfig {
        subject: format!("impressions.{source}"),
        events: Some(events),
        batch,
        seed,
        run_id: Some(format!("sources{seed}")),
        ..SimConfig::default()
    }
}

/// The entry of the limiter process `pid`, once it has one.
fn entry(view: &SourcesView, pid: u32) -> Option<&Limiter> {
    let suffix = format!(":{pid}");
    view.limiters.iter().find(|l| l.limiter.ends_with(&suffix))
}

/// Every report's own sanity: shares in `0..=1` summing to 1 or (idle) 0,
/// lags non-negative, held back only where messages wait.
fn check_report(l: &Limiter) -> anyhow::Result<f64> {
    let mut sum = 0.0;
    for s in &l.sources {
        ensure!(
            (0.0..=1.0).contains(&s.usage_share),
            "{}: share {}",
            s.source,
            s.usage_share
        );
        ensure!(
            s.lag_seconds.is_finite() && s.lag_seconds >= 0.0,
            "{}: lag {}",
            s.source,
            s.lag_seconds
        );
        ensure!(s.messages_per_second >= 0.0, "{}: rate", s.source);
        ensure!(
            !s.held_back || s.pending_messages > 0,
            "{} held back with nothing waiting: {s:?}",
            s.source
        );
        sum += s.usage_share;
    }
    ensure!(
        sum.abs() < 1e-6 || (sum - 1.0).abs() < 1e-6,
        "shares sum to {sum}: {:?}",
        l.sources
    );
    ensure!(l.age_ms >= 0 && l.ts_ms > 0 && l.interval_ms > 0, "{l:?}");
    Ok(sum)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sources_are_listed_with_shares_lag_and_held_back_and_go_stale() {
    let mut p = Pipeline::start(Backends::default(), 300).await;
    p.aggregator = Some(p.spawn("aggregator"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let url = p.pacer_url();
    let view = read_sources(&url).await.expect("/v1/sources");
    assert!(view.limiters.is_empty(), "no limiter runs yet: {view:?}");
    assert_eq!(view.stale_intervals, 3);

    // A backlog in three sources before any limiter runs: one large, two
    // small, so the limiter has work from all of them at once.
    let mut truth = p.publish(&sim("A", 60_000, 200, 1)).await;
    let mut published: BTreeMap<&str, u64> = BTreeMap::new();
    published.insert("A", truth.stats.messages_acked);
    for (source, seed) in [("B", 2), ("C", 3)] {
        let run = p.publish(&sim(source, 3_000, 10, seed)).await;
        published.insert(source, run.stats.messages_acked);
        truth.absorb(&run);
    }
    let limiter = p.spawn("limiter");
    let pid = limiter.pid();
    p.limiter = Some(limiter);

    // While it works: every source listed, the shares of this limiter's
    // usage summing to 1.
    let busy = wait_until_ok(Duration::from_secs(60), Duration::from_millis(200), || {
        let url = url.clone();
        async move {
            let view = read_sources(&url).await?;
            let l = entry(&view, pid).context("no report from the limiter yet")?;
            let sum = check_report(l)?;
            let names: Vec<&str> = l.sources.iter().map(|s| s.source.as_str()).collect();
            ensure!(names == ["A", "B", "C"], "sources {names:?}");
            ensure!(sum > 0.5, "idle report (shares sum to {sum})");
            Ok(l.clone())
        }
    })
    .await
    .expect("a busy report listing A, B and C");
    eprintln!("sources: busy report {busy:?}");
    assert_eq!(busy.scheduling, "fair");
    assert_eq!(busy.consumer, "limiter");
    assert!(!busy.stale, "{busy:?}");

    // Drained: nothing waits, nobody is held back, every message was taken
    // at least once, and once the usage window passed the shares are 0.
    assert_exact(&p.settle(&truth, Duration::from_secs(120)).await, &truth);
    let idle = wait_until_ok(Duration::from_secs(30), Duration::from_millis(250), || {
        let url = url.clone();
        async move {
            let view = read_sources(&url).await?;
            let l = entry(&view, pid).context("the limiter's report is gone")?;
            let sum = check_report(l)?;
            ensure!(!l.stale, "stale while the limiter runs: {l:?}");
            ensure!(sum == 0.0, "not idle yet: shares sum to {sum}");
            Ok(l.clone())
        }
    })
    .await
    .expect("an idle report");
    eprintln!("sources: idle report {idle:?}");
    assert!(
        !idle.intervening,
        "nothing waits, yet intervening: {idle:?}"
    );
    for s in &idle.sources {
        assert_eq!(s.pending_messages, 0, "{s:?}");
        assert_eq!(s.lag_seconds, 0.0, "{s:?}");
        assert!(!s.held_back, "{s:?}");
        assert!(
            s.messages_total >= published[s.source.as_str()],
            "{} took {} messages, {} were published",
            s.source,
            s.messages_total,
            published[s.source.as_str()]
        );
    }

    // Killed: its last report is kept, marked stale.
    p.limiter.as_mut().expect("the fair limiter").kill();
    wait_until_ok(Duration::from_secs(20), Duration::from_millis(250), || {
        let url = url.clone();
        async move {
            let view = read_sources(&url).await?;
            let l = entry(&view, pid).context("the killed limiter's report is gone")?;
            ensure!(l.stale, "not stale yet (age {} ms)", l.age_ms);
            ensure!(l.age_ms as u64 > 3 * l.interval_ms, "{l:?}");
            Ok(())
        }
    })
    .await
    .expect("the killed limiter's report goes stale");

    // A FIFO limiter: its mode, no sources; the old entry still stale.
    let fifo = p.spawn_with(
        "limiter",
        free_port(),
        &[("ADSPEND_LIMITER_SCHEDULING", "fifo")],
    );
    let fifo_pid = fifo.pid();
    p.limiter = Some(fifo);
    let view = wait_until_ok(Duration::from_secs(30), Duration::from_millis(250), || {
        let url = url.clone();
        async move {
            let view = read_sources(&url).await?;
            let l = entry(&view, fifo_pid).context("no report from the FIFO limiter yet")?;
            ensure!(!l.stale, "{l:?}");
            Ok(view)
        }
    })
    .await
    .expect("a report from the FIFO limiter");
    let l = entry(&view, fifo_pid).unwrap();
    assert_eq!(l.scheduling, "fifo", "{l:?}");
    assert!(l.sources.is_empty(), "{l:?}");
    assert!(!l.intervening);
    assert!(entry(&view, pid).is_some_and(|old| old.stale), "{view:?}");
}
