//! One simulated ad server of the closed loop ([`super::closed_loop`]):
//! each tick it draws the requests that arrived from the traffic curve,
//! then, by decisions, asks the pacer about their ads in batches and serves
//! what it may; by leases, notes the requests in the client crate's lease
//! book ([`super::loop_lease`]), leases ahead what the book plans in one
//! call (the crate's [`Pacer`]), serves what
//! [`LeaseBook::try_spend_at`](adspend_client::LeaseBook::try_spend_at)
//! lets it, and releases what the book let go.

use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Poisson, Zipf};
use serde::Deserialize;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::closed_loop::{hour_of, AdRecord, Counters, LoopConfig};
use adspend_client::api::{Grant, LeaseAsk, Release};
use adspend_client::{Ask, Pacer, PacerConfig, Retry};

use super::loop_lease::{LeaseMode, ServeMode, ServerLeases};
use super::loop_publish::Served;
use super::truth::CatalogIndex;
use super::CostDistribution;

#[derive(Deserialize)]
struct Decisions {
    decisions: Vec<Decision>,
}

#[derive(Deserialize)]
struct Decision {
    ad_id: String,
    servable: bool,
    multiplier: f64,
}

/// One simulated ad server.
pub(crate) struct Server {
    rng: SmallRng,
    zipf: Zipf<f64>,
    rank_to_ad: Arc<[u32]>,
    index: Arc<CatalogIndex>,
    config: LoopConfig,
    http: reqwest::Client,
    counters: Arc<Counters>,
    tx: mpsc::UnboundedSender<Served>,
    records: Vec<AdRecord>,
    failures: u32,
    /// Lease mode only: the book and the pacer it leases from.
    leases: Option<(ServerLeases, Pacer)>,
}

impl Server {
    pub(crate) fn new(
        i: usize,
        config: &LoopConfig,
        index: &Arc<CatalogIndex>,
        http: reqwest::Client,
        counters: Arc<Counters>,
        tx: mpsc::UnboundedSender<Served>,
    ) -> anyhow::Result<Self> {
        let ads = index.ad_ids.len();
        let mut config = config.clone();
        if !config.more_pacer_urls.is_empty() {
            let turn = i % (config.more_pacer_urls.len() + 1);
            if turn > 0 {
                config.pacer_url = config.more_pacer_urls[turn - 1].clone();
            }
        }
        // Popularity ranks are the same on every server: one seeded shuffle.
        let mut ranks: Vec<u32> = (0..ads as u32).collect();
        ranks.shuffle(&mut SmallRng::seed_from_u64(config.seed));
        Ok(Self {
            rng: SmallRng::seed_from_u64(config.seed ^ (0x9e37_79b9 * (i as u64 + 1))),
            zipf: Zipf::new(ads as f64, config.zipf_exponent)
                .map_err(|e| anyhow::anyhow!("bad Zipf exponent: {e}"))?,
            rank_to_ad: ranks.into(),
            index: index.clone(),
            config: config.clone(),
            http,
            counters,
            tx,
            records: vec![AdRecord::default(); ads],
            failures: 0,
            leases: match config.mode {
                ServeMode::Decisions => None,
                ServeMode::Leases(mode) => Some((
                    ServerLeases::new(mode, &config.cost, ads)?,
                    lease_pacer(&config)?,
                )),
            },
        })
    }

    pub(crate) async fn run(mut self, start: Instant, stop: CancellationToken) -> Vec<AdRecord> {
        let mut tick = tokio::time::interval(self.config.tick);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut last = Instant::now();
        let share = self.config.peak_rate / self.config.servers as f64;
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = stop.cancelled() => break,
            }
            if self.leases.is_some() && !stop.is_cancelled() {
                self.release_let_go().await;
            }
            let now = Instant::now();
            let dt = (now - last).as_secs_f64();
            last = now;
            let hour = hour_of(now - start, self.config.day);
            let mean = share * self.config.traffic.at(hour) * dt;
            let requests = match Poisson::new(mean) {
                Ok(p) => p.sample(&mut self.rng) as usize,
                Err(_) => 0,
            };
            if requests == 0 {
                continue;
            }
            self.counters.requests.fetch_add(requests as u64, Relaxed);
            let ads: Vec<u32> = (0..requests).map(|_| self.sample_ad()).collect();
            if let ServeMode::Leases(mode) = self.config.mode {
                if stop.is_cancelled() || !self.lease_and_serve(&ads, mode).await {
                    self.counters.unasked.fetch_add(ads.len() as u64, Relaxed);
                }
                continue;
            }
            for (n, chunk) in ads.chunks(self.config.decision_batch).enumerate() {
                if stop.is_cancelled() || !self.ask_and_serve(chunk).await {
                    let dropped = ads.len() - n * self.config.decision_batch;
                    self.counters.unasked.fetch_add(dropped as u64, Relaxed);
                    break;
                }
            }
        }
        if self.leases.is_some() {
            self.release_all().await;
        }
        self.records
    }

    fn sample_ad(&mut self) -> u32 {
        let rank = self.zipf.sample(&mut self.rng) as usize;
        self.rank_to_ad[rank.clamp(1, self.rank_to_ad.len()) - 1]
    }

    /// Asks about `ads` and serves what may be served; false (after backing
    /// off) when the pacer could not be asked.
    async fn ask_and_serve(&mut self, ads: &[u32]) -> bool {
        let asked = Instant::now();
        let ids: Vec<&str> = ads
            .iter()
            .map(|&a| self.index.ad_ids[a as usize].as_str())
            .collect();
        self.counters.decision_calls.fetch_add(1, Relaxed);
        let answer = self.decide(&ids).await;
        let decisions = match answer {
            Ok(d) if d.len() == ads.len() => d,
            Ok(d) => {
                let e = anyhow::anyhow!("{} decisions for {} ads", d.len(), ads.len());
                return self.back_off(e).await;
            }
            Err(e) => return self.back_off(e).await,
        };
        self.failures = 0;
        let ts = unix_ms();
        for (&ad, decision) in ads.iter().zip(decisions) {
            debug_assert_eq!(decision.ad_id, self.index.ad_ids[ad as usize]);
            let record = &mut self.records[ad as usize];
            if !decision.servable {
                record.not_servable += 1;
                self.counters.not_servable.fetch_add(1, Relaxed);
                continue;
            }
            record.servable += 1;
            record.last_servable_asked = Some(asked);
            self.counters.servable.fetch_add(1, Relaxed);
            if !self.rng.random_bool(decision.multiplier.clamp(0.0, 1.0)) {
                continue;
            }
            record.served += 1;
            record.last_served_asked = Some(asked);
            let cost = sample_cost(&self.config.cost, &mut self.rng);
            self.counters.served.fetch_add(1, Relaxed);
            self.counters.served_micros.fetch_add(cost, Relaxed);
            let served = Served {
                ad,
                cost,
                ts,
                due: Instant::now() + self.config.publish_delay,
                lease: None,
            };
            if self.tx.send(served).is_err() {
                return false;
            }
        }
        true
    }

    async fn decide(&self, ids: &[&str]) -> anyhow::Result<Vec<Decision>> {
        let body: Decisions = self
            .post("/v1/decisions", &serde_json::json!({ "ad_ids": ids }))
            .await?;
        Ok(body.decisions)
    }

    /// Lease mode's tick: notes the requests, leases ahead what the book
    /// plans (one call), then serves each request its ad's leases can pay
    /// for. False (after backing off) when the pacer could not be asked:
    /// then nothing of this tick is served.
    async fn lease_and_serve(&mut self, ads: &[u32], mode: LeaseMode) -> bool {
        let (mut leases, pacer) = self.leases.take().expect("lease mode has a book");
        let served = self
            .lease_and_serve_with(&mut leases, &pacer, ads, mode)
            .await;
        self.leases = Some((leases, pacer));
        served
    }

    async fn lease_and_serve_with(
        &mut self,
        leases: &mut ServerLeases,
        pacer: &Pacer,
        ads: &[u32],
        mode: LeaseMode,
    ) -> bool {
        let asked = Instant::now();
        let now_ms = unix_ms();
        let requested = leases.note_requests(ads, &self.index.ad_ids, now_ms);
        let asks = leases.asks(
            &requested,
            &self.index.ad_by_id,
            self.config.decision_batch,
            now_ms,
        );
        if !asks.is_empty() {
            self.counters.lease_calls.fetch_add(1, Relaxed);
            let body: Vec<LeaseAsk<'_>> = asks
                .iter()
                .map(|a| LeaseAsk {
                    ad_id: &a.ad_id,
                    micros: a.micros,
                })
                .collect();
            // The crate's client checks the answer against the asks (same
            // ads, in order, none above its ask, a lease id on every grant).
            match pacer.lease(&body, mode.ttl_ms()).await {
                Ok(grants) => self.record_grants(leases, &asks, &grants, unix_ms()),
                Err(e) => {
                    for ask in &asks {
                        leases.book().ask_failed(&ask.ad_id);
                    }
                    return self.back_off(e.into()).await;
                }
            }
            self.failures = 0;
        }
        let ts = unix_ms();
        for &ad in ads {
            let cost = sample_cost(&self.config.cost, &mut self.rng);
            leases.note_cost(cost);
            let record = &mut self.records[ad as usize];
            let ad_id = &self.index.ad_ids[ad as usize];
            let Ok(lease) = leases.book().try_spend_at(ad_id, cost, ts) else {
                record.not_servable += 1;
                self.counters.not_servable.fetch_add(1, Relaxed);
                self.counters.refused_no_lease.fetch_add(1, Relaxed);
                continue;
            };
            record.servable += 1;
            record.served += 1;
            record.last_servable_asked = Some(asked);
            record.last_served_asked = Some(asked);
            self.counters.servable.fetch_add(1, Relaxed);
            self.counters.served.fetch_add(1, Relaxed);
            self.counters.served_micros.fetch_add(cost, Relaxed);
            let served = Served {
                ad,
                cost,
                ts,
                due: Instant::now() + self.config.publish_delay,
                lease: Some(lease),
            };
            if self.tx.send(served).is_err() {
                return false;
            }
        }
        true
    }

    /// Installs every grant in the book, counting them.
    fn record_grants(&self, leases: &ServerLeases, asks: &[Ask], grants: &[Grant], now_ms: i64) {
        let c = &self.counters;
        for (ask, grant) in asks.iter().zip(grants) {
            c.leases_asked.fetch_add(1, Relaxed);
            c.lease_micros_asked.fetch_add(ask.micros, Relaxed);
            leases.book().install(grant, now_ms);
            if grant.granted_micros > 0 {
                c.leases_granted.fetch_add(1, Relaxed);
                c.lease_micros_granted
                    .fetch_add(grant.granted_micros, Relaxed);
            } else {
                c.leases_zero.fetch_add(1, Relaxed);
            }
        }
    }

    /// Releases every lease the book has let go with something left
    /// (lease mode), in calls of at most a decision batch. A failed call is
    /// counted and not retried: those leases stay held at the pacers until
    /// expiry plus their grace, which costs budget, never exactness.
    async fn release_let_go(&self) {
        let Some((leases, _)) = &self.leases else {
            return;
        };
        let releases = leases.take_releases(unix_ms());
        self.release(&releases).await;
    }

    /// At the end of the run: releases every lease the book still holds.
    async fn release_all(&self) {
        let Some((leases, _)) = &self.leases else {
            return;
        };
        let releases = leases.release_all();
        self.release(&releases).await;
    }

    /// `POST /v1/leases/release` of `releases`, in calls of at most a
    /// decision batch, counting the calls and the leases released.
    async fn release(&self, releases: &[Release]) {
        let Some((_, pacer)) = &self.leases else {
            return;
        };
        for chunk in releases.chunks(self.config.decision_batch.max(1)) {
            self.counters.release_calls.fetch_add(1, Relaxed);
            match pacer.release(chunk).await {
                Ok(answers) => {
                    let released = answers.iter().filter(|a| a.released).count();
                    self.counters
                        .leases_released
                        .fetch_add(released as u64, Relaxed);
                }
                Err(e) => {
                    if self.counters.lease_errors.fetch_add(1, Relaxed) == 0 {
                        tracing::warn!(error = %e, "cannot release leases; they stay held until expiry plus the grace");
                    }
                }
            }
        }
    }

    /// POSTs `body` as JSON to `path` of the pacer (with the decide token,
    /// if any) and decodes the answer; an error status is an error with
    /// the pacer's text.
    async fn post<B: serde::Serialize, R: serde::de::DeserializeOwned>(
        &self,
        path: &str,
        body: &B,
    ) -> anyhow::Result<R> {
        let url = format!("{}{path}", self.config.pacer_url);
        let mut request = self.http.post(&url).json(body);
        if let Some(token) = &self.config.pacer_token {
            request = request.bearer_auth(token);
        }
        let response = request
            .send()
            .await
            .with_context(|| format!("POST {url}"))?;
        let status = response.status();
        if !status.is_success() {
            let text = response.text().await.unwrap_or_default();
            anyhow::bail!("POST {url}: {status}: {}", text.trim());
        }
        response
            .json()
            .await
            .with_context(|| format!("decoding the answer of POST {url}"))
    }

    async fn back_off(&mut self, error: anyhow::Error) -> bool {
        let errors = match self.config.mode {
            ServeMode::Decisions => &self.counters.decision_errors,
            ServeMode::Leases(_) => &self.counters.lease_errors,
        };
        if errors.fetch_add(1, Relaxed) == 0 {
            tracing::warn!(error = %format!("{error:#}"), "cannot ask the pacer; serving nothing meanwhile");
        }
        self.failures = (self.failures + 1).min(5);
        tokio::time::sleep(Duration::from_millis(100 << self.failures).min(Duration::from_secs(2)))
            .await;
        false
    }
}

use crate::stats::unix_ms;

/// The crate's client of the pacer this server leases from: the decide
/// token, the loop's 5 s timeout, and no retry (the server backs off on its
/// own and serves nothing meanwhile, as before).
fn lease_pacer(config: &LoopConfig) -> anyhow::Result<Pacer> {
    let mut pacer = PacerConfig::new(config.pacer_url.clone());
    pacer.decide_token = config.pacer_token.clone();
    pacer.timeout = Duration::from_secs(5);
    pacer.retry = Retry {
        tries: 1,
        ..Retry::default()
    };
    Pacer::new(pacer).context("the pacer client of lease mode")
}

/// The cost of one served impression, integer micros.
fn sample_cost(cost: &CostDistribution, rng: &mut SmallRng) -> u64 {
    match *cost {
        CostDistribution::Uniform { min, max } => rng.random_range(min..=max),
        CostDistribution::LogUniform { min, max } => {
            let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
            (rng.random_range(lo..=hi).exp().round() as u64).clamp(min, max)
        }
    }
}

#[cfg(test)]
mod tests;
