//! One simulated ad server of the closed loop ([`super::closed_loop`]):
//! each tick it draws the requests that arrived from the traffic curve,
//! then, by decisions, asks the pacer about their ads in batches and serves
//! what it may; by leases, leases ahead what its book wants in one call
//! ([`super::loop_lease`]) and serves what its leases can pay for.

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
use super::loop_lease::{
    Granted, LeaseAsk, LeaseBook, LeaseGrant, LeasePolicy, LeaseRelease, LeaseRequest,
    LeaseResponse, ReleaseRequest, ReleaseResponse, ServeMode,
};
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
    /// Lease mode only.
    leases: Option<LeaseBook>,
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
                // A new lease arrives within about two ticks of the ask.
                ServeMode::Leases(policy) => {
                    Some(LeaseBook::new(policy, &config.cost, ads, config.tick * 2))
                }
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
            if let ServeMode::Leases(policy) = self.config.mode {
                if stop.is_cancelled() || !self.lease_and_serve(&ads, policy).await {
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
    /// wants (one call), then serves each request its ad's lease can pay
    /// for. False (after backing off) when the pacer could not be asked:
    /// then nothing of this tick is served.
    async fn lease_and_serve(&mut self, ads: &[u32], policy: LeasePolicy) -> bool {
        let mut book = self.leases.take().expect("lease mode has a book");
        let served = self.lease_and_serve_with(&mut book, ads, policy).await;
        self.leases = Some(book);
        served
    }

    async fn lease_and_serve_with(
        &mut self,
        book: &mut LeaseBook,
        ads: &[u32],
        policy: LeasePolicy,
    ) -> bool {
        let asked = Instant::now();
        let now_ms = unix_ms();
        let mut requested = ads.to_vec();
        requested.sort_unstable();
        for run in requested.chunk_by(|a, b| a == b) {
            book.note_requests(run[0], run.len() as u64, now_ms);
        }
        requested.dedup();
        let asks = book.asks(&requested, self.config.decision_batch, now_ms);
        if !asks.is_empty() {
            self.counters.lease_calls.fetch_add(1, Relaxed);
            let grants = match self.lease(&asks, policy).await {
                Ok(grants) => grants,
                Err(e) => return self.back_off(e).await,
            };
            if let Err(e) = self.record_grants(book, &asks, &grants, unix_ms()) {
                return self.back_off(e).await;
            }
            self.failures = 0;
        }
        let ts = unix_ms();
        for &ad in ads {
            let cost = sample_cost(&self.config.cost, &mut self.rng);
            book.note_cost(cost);
            let record = &mut self.records[ad as usize];
            let Some(lease) = book.spend(ad, cost, ts) else {
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

    /// Releases every lease the book has let go with something left
    /// (lease mode), in calls of at most a decision batch. A failed call is
    /// counted and not retried: those leases stay held at the pacers until
    /// expiry plus their grace, which costs budget, never exactness.
    async fn release_let_go(&mut self) {
        let Some(book) = self.leases.as_mut() else {
            return;
        };
        let releases = book.take_releases(unix_ms());
        for chunk in releases.chunks(self.config.decision_batch.max(1)) {
            self.counters.release_calls.fetch_add(1, Relaxed);
            match self.release(chunk).await {
                Ok(released) => {
                    self.counters.leases_released.fetch_add(released, Relaxed);
                }
                Err(e) => {
                    if self.counters.lease_errors.fetch_add(1, Relaxed) == 0 {
                        tracing::warn!(error = %format!("{e:#}"), "cannot release leases; they stay held until expiry plus the grace");
                    }
                }
            }
        }
    }

    /// `POST /v1/leases/release`: how many of `releases` the pacer released.
    async fn release(&self, releases: &[LeaseRelease]) -> anyhow::Result<u64> {
        let body: ReleaseResponse = self
            .post("/v1/leases/release", &ReleaseRequest { leases: releases })
            .await?;
        anyhow::ensure!(
            body.leases.len() == releases.len(),
            "{} answers for {} releases",
            body.leases.len(),
            releases.len()
        );
        Ok(body.leases.iter().filter(|a| a.released).count() as u64)
    }

    /// Checks the answer against the asks (same ads, same order) and
    /// records every grant, counting them; an answer that breaks the
    /// contract is an error, and none of it is used.
    fn record_grants(
        &self,
        book: &mut LeaseBook,
        asks: &[(u32, u64)],
        grants: &[LeaseGrant],
        now_ms: i64,
    ) -> anyhow::Result<()> {
        anyhow::ensure!(
            grants.len() == asks.len(),
            "{} leases for {} ads asked",
            grants.len(),
            asks.len()
        );
        for (&(ad, micros), grant) in asks.iter().zip(grants) {
            let ad_id = &self.index.ad_ids[ad as usize];
            anyhow::ensure!(
                grant.ad_id == *ad_id,
                "lease for {:?} where {ad_id:?} was asked",
                grant.ad_id
            );
            anyhow::ensure!(
                grant.granted_micros <= micros,
                "{ad_id}: granted {} micros, more than the {micros} asked",
                grant.granted_micros
            );
            anyhow::ensure!(
                grant.granted_micros == 0 || grant.lease_id.is_some(),
                "{ad_id}: granted {} micros without a lease_id",
                grant.granted_micros
            );
        }
        let c = &self.counters;
        for (&(ad, micros), grant) in asks.iter().zip(grants) {
            c.leases_asked.fetch_add(1, Relaxed);
            c.lease_micros_asked.fetch_add(micros, Relaxed);
            match book
                .grant(ad, micros, grant, now_ms)
                .map_err(anyhow::Error::msg)?
            {
                Granted::Lease(granted) => {
                    c.leases_granted.fetch_add(1, Relaxed);
                    c.lease_micros_granted.fetch_add(granted, Relaxed);
                }
                Granted::Zero => {
                    c.leases_zero.fetch_add(1, Relaxed);
                }
            }
        }
        Ok(())
    }

    async fn lease(
        &self,
        asks: &[(u32, u64)],
        policy: LeasePolicy,
    ) -> anyhow::Result<Vec<LeaseGrant>> {
        let body = LeaseRequest {
            ads: asks
                .iter()
                .map(|&(ad, micros)| LeaseAsk {
                    ad_id: &self.index.ad_ids[ad as usize],
                    micros,
                })
                .collect(),
            ttl_ms: policy.ttl_ms(),
        };
        let body: LeaseResponse = self.post("/v1/leases", &body).await?;
        Ok(body.leases)
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
