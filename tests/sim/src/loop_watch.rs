//! Watching the pacer while a closed loop runs: polls `GET /v1/limits`
//! and keeps, per limit, when it was first seen exhausted and the
//! `overspend_bound_micros` the pacer stated then (when it stopped the
//! limit), and the largest bound it ever stated.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Deserialize;
use tokio_util::sync::CancellationToken;

/// The fields of a pacer limit the watch reads (CONTRACT.md).
#[derive(Debug, Clone, Deserialize)]
pub struct WatchedLimit {
    pub limit_id: String,
    pub budget_micros: u64,
    pub spend_micros: u64,
    pub exhausted: bool,
    pub overspend_bound_micros: u64,
}

/// What the watch saw of one limit.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Stop {
    /// When a poll's answer, received at this instant, first said exhausted.
    pub seen_exhausted: Option<Instant>,
    /// The bound stated in that answer.
    pub bound_at_stop: Option<u64>,
    pub max_bound: u64,
}

/// Every limit the pacer serves, following the pages.
pub async fn fetch(
    http: &reqwest::Client,
    base: &str,
    token: Option<&str>,
) -> anyhow::Result<Vec<WatchedLimit>> {
    crate::check::fetch_limit_pages(http, base, token).await
}

/// Polls every `interval` until `stop` fires; returns what it saw.
pub fn spawn(
    base: String,
    token: Option<String>,
    interval: Duration,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<BTreeMap<String, Stop>> {
    tokio::spawn(async move {
        let mut seen = BTreeMap::<String, Stop>::new();
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(5))
            .build()
            .expect("HTTP client");
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => break,
            }
            let Ok(limits) = fetch(&http, &base, token.as_deref()).await else {
                continue;
            };
            let at = Instant::now();
            for l in limits {
                let s = seen.entry(l.limit_id).or_default();
                s.max_bound = s.max_bound.max(l.overspend_bound_micros);
                if l.exhausted && s.seen_exhausted.is_none() {
                    s.seen_exhausted = Some(at);
                    s.bound_at_stop = Some(l.overspend_bound_micros);
                }
            }
        }
        seen
    })
}
