//! Renewals in the background: every tick, the book's asks go to the pacer
//! in batches, the grants are installed, and the releases of leases let go
//! are sent. At shutdown every lease left is released.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::api::{LeaseAsk, Release};
use crate::book::{now_ms, LeaseBook};
use crate::Pacer;

/// Ads in one `POST /v1/leases` (the pacer's default cap is 1,000).
pub const MAX_ADS_PER_REQUEST: usize = 500;

/// What the renewer has done so far.
#[derive(Debug, Default)]
pub struct RenewStats {
    pub requests: AtomicU64,
    pub grants: AtomicU64,
    pub granted_micros: AtomicU64,
    pub zero_grants: AtomicU64,
    /// Asks whose request failed (the pacer unavailable): asked again.
    pub failed_asks: AtomicU64,
    pub releases: AtomicU64,
    /// Releases the pacer did not take (`released: false`: the lease had
    /// retired already).
    pub releases_not_taken: AtomicU64,
}

/// A running renewer; [`Renewer::shutdown`] stops it and releases every
/// lease the book still holds.
#[derive(Debug)]
pub struct Renewer {
    stop: CancellationToken,
    task: JoinHandle<()>,
    stats: Arc<RenewStats>,
}

impl Renewer {
    /// Starts renewing `book` through `pacer` every `tick` (100 ms is a
    /// good start: well inside the policy's lead).
    pub fn start(book: LeaseBook, pacer: Pacer, tick: Duration) -> Self {
        let stop = CancellationToken::new();
        let stats = Arc::new(RenewStats::default());
        let task = tokio::spawn(run(book, pacer, tick, stop.clone(), stats.clone()));
        Self { stop, task, stats }
    }

    pub fn stats(&self) -> &RenewStats {
        &self.stats
    }

    /// Stops renewing and releases every lease left, with what was served
    /// under it (tried with the pacer client's retries).
    pub async fn shutdown(self) -> Arc<RenewStats> {
        self.stop.cancel();
        let _ = self.task.await;
        self.stats
    }
}

async fn run(
    book: LeaseBook,
    pacer: Pacer,
    tick: Duration,
    stop: CancellationToken,
    stats: Arc<RenewStats>,
) {
    let mut pending: Vec<Release> = Vec::new();
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => break,
            _ = interval.tick() => {}
        }
        renew_once(&book, &pacer, &stats).await;
        pending.extend(book.take_releases(now_ms()));
        send_releases(&pacer, &mut pending, &stats).await;
    }
    pending.extend(book.release_all());
    send_releases(&pacer, &mut pending, &stats).await;
    if !pending.is_empty() {
        tracing::warn!(
            leases = pending.len(),
            "could not release leases at shutdown: what they hold stays held at the pacers until expiry plus their grace"
        );
    }
}

/// One round: every ask the book wants now, in batches.
pub(crate) async fn renew_once(book: &LeaseBook, pacer: &Pacer, stats: &RenewStats) {
    let asks = book.plan_at(now_ms());
    let ttl_ms = book.policy().ttl_ms();
    for chunk in asks.chunks(MAX_ADS_PER_REQUEST) {
        let body: Vec<LeaseAsk<'_>> = chunk
            .iter()
            .map(|a| LeaseAsk {
                ad_id: &a.ad_id,
                micros: a.micros,
            })
            .collect();
        stats.requests.fetch_add(1, Relaxed);
        match pacer.lease(&body, ttl_ms).await {
            Ok(grants) => {
                let now = now_ms();
                for grant in &grants {
                    book.install(grant, now);
                    if grant.granted_micros > 0 {
                        stats.grants.fetch_add(1, Relaxed);
                        stats
                            .granted_micros
                            .fetch_add(grant.granted_micros, Relaxed);
                    } else {
                        stats.zero_grants.fetch_add(1, Relaxed);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, ads = chunk.len(), "lease request failed; asked again next tick");
                stats.failed_asks.fetch_add(chunk.len() as u64, Relaxed);
                for ask in chunk {
                    book.ask_failed(&ask.ad_id);
                }
            }
        }
    }
}

async fn send_releases(pacer: &Pacer, pending: &mut Vec<Release>, stats: &RenewStats) {
    while !pending.is_empty() {
        let n = pending.len().min(MAX_ADS_PER_REQUEST);
        match pacer.release(&pending[..n]).await {
            Ok(answers) => {
                stats.releases.fetch_add(n as u64, Relaxed);
                let not_taken = answers.iter().filter(|a| !a.released).count();
                stats
                    .releases_not_taken
                    .fetch_add(not_taken as u64, Relaxed);
                pending.drain(..n);
            }
            Err(e) if e.is_transient() => {
                tracing::warn!(error = %e, leases = pending.len(), "release failed; tried again next tick");
                return;
            }
            Err(e) => {
                tracing::warn!(error = %e, leases = n, "pacer refused a release; dropped");
                pending.drain(..n);
            }
        }
    }
}
