//! The closed loop: simulated ad servers that ask the pacer before they
//! serve. Each of `servers` tasks draws ad requests from a day-shaped
//! traffic curve compressed so that a day lasts `day` (or a flat one), and
//! serves in one of two modes ([`ServeMode`]):
//!
//! - decisions: asks `POST /v1/decisions` for the requested ads in batches
//!   (as a bidder would), and serves an ad only when the pacer says it is
//!   servable, with probability equal to its multiplier;
//! - leases: keeps its spend leases in the client crate's `LeaseBook` (at
//!   most two per ad, the newest and the one it replaced, spent first;
//!   [`super::loop_lease`]), leases ahead what the book plans in one
//!   `POST /v1/leases` per tick, and serves a request only when
//!   `try_spend_at` takes its cost out of one of the ad's leases before
//!   that lease's expiry (less a margin); every impression carries its
//!   `lease_id`, nothing is ever served outside a lease, and the leases
//!   let go with something left (all of them when the run ends) are
//!   released unless the mode says not to.
//!
//! Served impressions go to the publisher ([`super::loop_publish`]), which
//! may hold each one back by `publish_delay` before it reaches JetStream
//! and books it into the truth once acknowledged, so totals stay exactly
//! checkable.
//!
//! A server that cannot ask (the pacer unreachable, an error status, an
//! answer it cannot read) serves nothing for those requests, counts the
//! error and backs off, as a bidder that cannot ask does not bid.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use rand::Rng;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::loop_lease::ServeMode;
use super::loop_publish::{self, Served};
use super::loop_server::Server;
use super::truth::CatalogIndex;
use super::{check_run_id, Catalog, CostDistribution, Truth};

/// One closed-loop run.
#[derive(Debug, Clone)]
pub struct LoopConfig {
    /// Base URL of the pacer API, e.g. `http://127.0.0.1:8080`.
    pub pacer_url: String,
    /// More pacers of the same pipeline: server `i` asks the `i`th of
    /// `pacer_url` and these, in turn.
    pub more_pacer_urls: Vec<String>,
    /// Bearer token of the decide scope, if the pacer requires one.
    pub pacer_token: Option<String>,
    /// Simulated ad servers (concurrent tasks).
    pub servers: usize,
    /// Wall-clock length of one simulated day.
    pub day: Duration,
    /// How long the loop runs (e.g. one `day`).
    pub duration: Duration,
    /// Ad requests per second, all servers together, at the day's peak.
    pub peak_rate: f64,
    /// Ads per `POST /v1/decisions`, and most ads per `POST /v1/leases`.
    pub decision_batch: usize,
    pub mode: ServeMode,
    pub traffic: Traffic,
    /// How often each server takes the requests that arrived.
    pub tick: Duration,
    pub zipf_exponent: f64,
    pub cost: CostDistribution,
    /// Each served impression reaches JetStream this much later (its `ts`
    /// stays the instant it was served): a slow path from ad server to
    /// stream.
    pub publish_delay: Duration,
    /// Impressions per published message.
    pub batch: usize,
    pub subject: String,
    pub seed: u64,
    /// Impression id prefix; `None` draws a random one.
    pub run_id: Option<String>,
    pub progress_interval: Duration,
    /// Create `IMPRESSIONS` when it is missing. An ad server's NATS user may
    /// publish impressions and nothing else (not even look the stream up):
    /// then the limiter creates it.
    pub create_stream: bool,
}

impl Default for LoopConfig {
    fn default() -> Self {
        Self {
            pacer_url: "http://127.0.0.1:8080".to_owned(),
            more_pacer_urls: Vec::new(),
            pacer_token: None,
            servers: 4,
            day: Duration::from_secs(60),
            duration: Duration::from_secs(60),
            peak_rate: 2_000.0,
            decision_batch: 100,
            mode: ServeMode::Decisions,
            traffic: Traffic::Day,
            tick: Duration::from_millis(100),
            zipf_exponent: 1.0,
            cost: CostDistribution::Uniform {
                min: 100,
                max: 5_000_000,
            },
            publish_delay: Duration::ZERO,
            batch: 100,
            subject: "impressions.loop".to_owned(),
            seed: 1,
            run_id: None,
            progress_interval: Duration::from_secs(5),
            create_stream: true,
        }
    }
}

impl LoopConfig {
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(self.servers >= 1, "servers must be >= 1");
        anyhow::ensure!(!self.day.is_zero(), "day must be > 0");
        anyhow::ensure!(!self.duration.is_zero(), "duration must be > 0");
        anyhow::ensure!(
            self.peak_rate.is_finite() && self.peak_rate > 0.0,
            "peak rate {} must be > 0",
            self.peak_rate
        );
        anyhow::ensure!(
            (1..=10_000).contains(&self.decision_batch),
            "decision batch {} must be within 1..=10000",
            self.decision_batch
        );
        anyhow::ensure!(!self.tick.is_zero(), "tick must be > 0");
        anyhow::ensure!(self.batch >= 1, "batch must be >= 1");
        anyhow::ensure!(
            self.zipf_exponent.is_finite() && self.zipf_exponent >= 0.0,
            "Zipf exponent {} must be >= 0",
            self.zipf_exponent
        );
        anyhow::ensure!(
            self.subject.starts_with("impressions.") && self.subject.len() > 12,
            "subject {:?} must be under impressions.",
            self.subject
        );
        if let Some(run_id) = &self.run_id {
            check_run_id(run_id)?;
        }
        self.mode.validate()?;
        self.cost.validate().map_err(anyhow::Error::msg)
    }
}

/// The shape of the ad requests over time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Traffic {
    /// [`day_shape`] over each `day`: the peak rate in the evening only.
    Day,
    /// The peak rate all the time.
    Flat,
}

impl Traffic {
    /// Share of the peak rate at hour `h` of the simulated day.
    pub(crate) fn at(self, h: f64) -> f64 {
        match self {
            Traffic::Day => day_shape(h),
            Traffic::Flat => 1.0,
        }
    }
}

/// Traffic at hour `h` of the day, 1.0 at the evening peak: a night trough
/// (about 0.17), a morning bump and an evening peak.
pub fn day_shape(h: f64) -> f64 {
    let bump = |center: f64, width: f64| (-((h - center) / width).powi(2)).exp();
    let raw = 0.25 + 0.6 * bump(9.0, 2.0) + 1.2 * bump(20.0, 2.5);
    raw / 1.4515
}

/// Counters shared by the servers and the publisher.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) requests: AtomicU64,
    /// Requests dropped because their server could not ask the pacer.
    pub(crate) unasked: AtomicU64,
    pub(crate) decision_calls: AtomicU64,
    pub(crate) decision_errors: AtomicU64,
    pub(crate) servable: AtomicU64,
    pub(crate) not_servable: AtomicU64,
    pub(crate) served: AtomicU64,
    pub(crate) served_micros: AtomicU64,
    pub(crate) acked: AtomicU64,
    pub(crate) messages_failed: AtomicU64,
    pub(crate) lease_calls: AtomicU64,
    pub(crate) lease_errors: AtomicU64,
    pub(crate) leases_asked: AtomicU64,
    pub(crate) leases_granted: AtomicU64,
    pub(crate) leases_zero: AtomicU64,
    pub(crate) lease_micros_asked: AtomicU64,
    pub(crate) lease_micros_granted: AtomicU64,
    pub(crate) refused_no_lease: AtomicU64,
    pub(crate) release_calls: AtomicU64,
    pub(crate) leases_released: AtomicU64,
}

/// A snapshot of a running loop, reported every `progress_interval`.
#[derive(Debug, Clone, PartialEq)]
pub struct LoopProgress {
    pub mode: ServeMode,
    pub elapsed: Duration,
    /// Hour of the simulated day.
    pub hour: f64,
    pub requests: u64,
    pub decision_calls: u64,
    pub decision_errors: u64,
    /// Requests that could be served (decisions: the pacer said servable;
    /// leases: a live lease could pay for them) and those that could not.
    pub servable: u64,
    pub not_servable: u64,
    pub served: u64,
    pub served_micros: u64,
    /// Impressions JetStream acknowledged.
    pub acked: u64,
    pub leases: LeaseCounts,
}

/// What the servers of a run in lease mode asked and got (all zero in
/// decisions mode).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeaseCounts {
    /// `POST /v1/leases` calls, and those that failed (no answer, an error
    /// status, or an answer that breaks the contract).
    pub calls: u64,
    pub errors: u64,
    /// Leases asked for (one per ad in a call), granted (a `lease_id`), and
    /// answered with 0 micros.
    pub asked: u64,
    pub granted: u64,
    pub zero: u64,
    pub micros_asked: u64,
    pub micros_granted: u64,
    /// Requests not served because no live lease of their ad could pay
    /// for them.
    pub refused: u64,
    /// `POST /v1/leases/release` calls (their failures count in `errors`),
    /// and leases they released.
    pub release_calls: u64,
    pub released: u64,
}

impl Counters {
    pub(crate) fn progress(&self, elapsed: Duration, config: &LoopConfig) -> LoopProgress {
        LoopProgress {
            mode: config.mode,
            elapsed,
            hour: hour_of(elapsed, config.day),
            requests: self.requests.load(Relaxed),
            decision_calls: self.decision_calls.load(Relaxed),
            decision_errors: self.decision_errors.load(Relaxed),
            servable: self.servable.load(Relaxed),
            not_servable: self.not_servable.load(Relaxed),
            served: self.served.load(Relaxed),
            served_micros: self.served_micros.load(Relaxed),
            acked: self.acked.load(Relaxed),
            leases: LeaseCounts {
                calls: self.lease_calls.load(Relaxed),
                errors: self.lease_errors.load(Relaxed),
                asked: self.leases_asked.load(Relaxed),
                granted: self.leases_granted.load(Relaxed),
                zero: self.leases_zero.load(Relaxed),
                micros_asked: self.lease_micros_asked.load(Relaxed),
                micros_granted: self.lease_micros_granted.load(Relaxed),
                refused: self.refused_no_lease.load(Relaxed),
                release_calls: self.release_calls.load(Relaxed),
                released: self.leases_released.load(Relaxed),
            },
        }
    }
}

pub(crate) fn hour_of(elapsed: Duration, day: Duration) -> f64 {
    (elapsed.as_secs_f64() / day.as_secs_f64()).fract() * 24.0
}

/// What the servers saw of one ad: how many of its requests could be served
/// or not (decisions: what the pacer said; leases: whether a live lease
/// could pay), and when the last request that could be served (and the
/// last one that led to an impression) was asked about.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct AdRecord {
    pub servable: u64,
    pub not_servable: u64,
    pub served: u64,
    pub last_servable_asked: Option<Instant>,
    pub last_served_asked: Option<Instant>,
}

impl AdRecord {
    fn merge(&mut self, other: &AdRecord) {
        self.servable += other.servable;
        self.not_servable += other.not_servable;
        self.served += other.served;
        self.last_servable_asked = self.last_servable_asked.max(other.last_servable_asked);
        self.last_served_asked = self.last_served_asked.max(other.last_served_asked);
    }
}

/// The result of a run: the truth of every acknowledged impression, the
/// final counters, and per ad what the pacer answered.
#[derive(Debug)]
pub struct LoopOutcome {
    pub truth: Truth,
    pub progress: LoopProgress,
    pub ads: BTreeMap<String, AdRecord>,
}

/// Runs the loop for `config.duration` (or until `cancel`), then waits for
/// the held-back and unacknowledged impressions and returns the outcome.
pub async fn run_closed_loop(
    client: &async_nats::Client,
    config: &LoopConfig,
    catalog: &Catalog,
    cancel: CancellationToken,
    mut on_progress: impl FnMut(&LoopProgress),
) -> anyhow::Result<LoopOutcome> {
    config.validate()?;
    let index = Arc::new(CatalogIndex::new(catalog).context("invalid catalog")?);
    anyhow::ensure!(!index.ad_ids.is_empty(), "the catalog has no ads");
    let run_id = config.run_id.clone().unwrap_or_else(random_run_id);
    check_run_id(&run_id)?;
    let counters = Arc::new(Counters::default());
    let (tx, rx) = mpsc::unbounded_channel::<Served>();
    let publisher = tokio::spawn(loop_publish::run(
        client.clone(),
        config.clone(),
        index.clone(),
        run_id,
        counters.clone(),
        rx,
    ));
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(5))
        .build()?;
    let start = Instant::now();
    let stop = cancel.child_token();
    let mut servers = Vec::with_capacity(config.servers);
    for i in 0..config.servers {
        let server = Server::new(
            i,
            config,
            &index,
            http.clone(),
            counters.clone(),
            tx.clone(),
        )?;
        servers.push(tokio::spawn(server.run(start, stop.clone())));
    }
    drop(tx);
    let end = start + config.duration;
    let mut report = tokio::time::interval_at(
        (start + config.progress_interval).into(),
        config.progress_interval,
    );
    loop {
        tokio::select! {
            _ = report.tick() => on_progress(&counters.progress(start.elapsed(), config)),
            _ = tokio::time::sleep_until(end.into()) => break,
            _ = cancel.cancelled() => break,
        }
    }
    stop.cancel();
    let mut ads = vec![AdRecord::default(); index.ad_ids.len()];
    for server in servers {
        let records = server.await.context("ad server task")?;
        for (all, one) in ads.iter_mut().zip(&records) {
            all.merge(one);
        }
    }
    let truth = publisher.await.context("publisher task")??;
    let progress = counters.progress(start.elapsed(), config);
    on_progress(&progress);
    let ads = index.ad_ids.iter().cloned().zip(ads).collect();
    Ok(LoopOutcome {
        truth,
        progress,
        ads,
    })
}

/// `loop-` and six base-36 characters.
fn random_run_id() -> String {
    const DIGITS: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut rng = rand::rng();
    let tail: String = (0..6)
        .map(|_| DIGITS[rng.random_range(0..DIGITS.len())] as char)
        .collect();
    format!("loop-{tail}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_day_peaks_in_the_evening_and_sleeps_at_night() {
        let peak = (0..2400)
            .map(|i| day_shape(i as f64 / 100.0))
            .fold(0.0, f64::max);
        assert!((peak - 1.0).abs() < 0.01, "{peak}");
        assert!(day_shape(3.0) < 0.2 && day_shape(20.0) > 0.99);
        assert!(day_shape(9.0) > 2.0 * day_shape(3.0));
    }

    #[test]
    fn a_compressed_day_maps_elapsed_time_to_hours() {
        let day = Duration::from_secs(60);
        assert_eq!(hour_of(Duration::from_secs(30), day), 12.0);
        assert_eq!(hour_of(Duration::from_secs(75), day), 6.0);
    }

    #[test]
    fn settings_are_checked() {
        let bad = LoopConfig {
            servers: 0,
            ..LoopConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("servers"));
        let bad = LoopConfig {
            subject: "spend.x".into(),
            ..LoopConfig::default()
        };
        assert!(bad.validate().is_err());
        let bad = LoopConfig {
            mode: ServeMode::Leases(crate::LeaseMode::with_ttl(Duration::from_millis(500))),
            ..LoopConfig::default()
        };
        assert!(bad.validate().unwrap_err().to_string().contains("ttl"));
        LoopConfig::default().validate().unwrap();
        LoopConfig {
            mode: ServeMode::Leases(Default::default()),
            ..LoopConfig::default()
        }
        .validate()
        .unwrap();
    }

    #[test]
    fn flat_traffic_is_the_peak_all_day() {
        assert_eq!(Traffic::Flat.at(3.0), 1.0);
        assert_eq!(Traffic::Day.at(3.0), day_shape(3.0));
    }
}
