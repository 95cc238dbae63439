//! One budget across regions, the pacer's side (CONTRACT.md "Regions";
//! docs/REGIONS.md). Only with ADSPEND_REGION set: without it nothing here
//! runs and grants are decided exactly as in one region.
//!
//! The arithmetic is `adspend_wire::regions`: per limit and period a
//! [`LimitLedger`](adspend_wire::regions::LimitLedger) holds this region's
//! allotment. [`book`] keeps one per catalog limit, with the grants decided
//! and not yet in the lease ledger and the demand that went unmet;
//! [`run`] reads every region's reports from the `REGIONS` stream
//! ([`stream`]) into it and, every ADSPEND_REGION_REPORT_INTERVAL_MS, gives
//! what this region can spare to the regions that want and publishes this
//! region's report (one pacer per region publishes). The lease committer
//! grants within [`Book::room`]; [`view`] adds the regions to
//! `GET /v1/limits`.

pub(crate) mod book;
mod run;
mod stream;
pub(crate) mod view;

#[cfg(test)]
mod tests;

use std::sync::{Arc, Mutex, MutexGuard};

use adspend_wire::catalog::Catalog;
use async_nats::jetstream;
use tokio::sync::{watch, RwLock};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

pub(crate) use book::Book;

use crate::pacing::state::SpendState;

/// The region settings, checked (built from ADSPEND_REGION and the rest by
/// the config; here so that the config depends on this module, not the
/// other way round).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct RegionSettings {
    pub(crate) region: adspend_wire::regions::RegionName,
    /// Every region, this one included.
    pub(crate) regions: std::collections::BTreeSet<adspend_wire::regions::RegionName>,
    pub(crate) report_interval: std::time::Duration,
    pub(crate) unheard_after: std::time::Duration,
}

/// Runs its argument with the lease ledger locked and a way to read, per
/// limit, what the live leases hold: how the report loop reads the leases
/// without this module depending on them (they depend on it). The ledger
/// is locked before the book, as the lease committer does.
pub(crate) type WithHeld = Box<dyn Fn(&mut dyn FnMut(&dyn Fn(&str) -> u64)) + Send + Sync>;

pub(crate) const REGION_REPORT_AGE_SECONDS: &str = "adspend_pacer_region_report_age_seconds";
pub(crate) const REGION_HEARD: &str = "adspend_pacer_region_heard";
pub(crate) const REGION_REPORTS_TOTAL: &str = "adspend_pacer_region_reports_total";
pub(crate) const REGION_LINK_UP: &str = "adspend_pacer_region_link_up";
pub(crate) const REGION_LINK_LAG: &str = "adspend_pacer_region_link_lag_messages";

pub(crate) const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        REGION_REPORT_AGE_SECONDS,
        "Age of the newest report heard of each region (its own clock's as_of), seconds; since the pacer started for a region never heard.",
    ),
    (
        REGION_HEARD,
        "1 if a report of the region was heard within ADSPEND_REGION_UNHEARD_MS, else 0.",
    ),
    (
        REGION_REPORTS_TOTAL,
        "Reports of its region this pacer published.",
    ),
    (
        REGION_LINK_UP,
        "1 if this region's REGIONS stream heard from the region's source within 5 s (the link through NATS is up), else 0.",
    ),
    (
        REGION_LINK_LAG,
        "Reports of the region its REGIONS source had not yet copied when last heard (stays at its last value while the link is down).",
    ),
];

/// This region's book of allotments, shared by the report loop, the lease
/// committer and the API.
#[derive(Clone)]
pub struct Regions {
    book: Arc<Mutex<Book>>,
}

impl Regions {
    pub(crate) fn new(settings: &RegionSettings) -> Regions {
        Regions {
            book: Arc::new(Mutex::new(Book::new(
                settings.region.clone(),
                settings.regions.clone(),
            ))),
        }
    }

    pub(crate) fn book(&self) -> MutexGuard<'_, Book> {
        self.book.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// What [`start`] needs besides the book.
pub(crate) struct Start {
    pub(crate) client: async_nats::Client,
    pub(crate) replicas: usize,
    pub(crate) settings: RegionSettings,
    pub(crate) spend: Arc<RwLock<SpendState>>,
    pub(crate) catalog: watch::Receiver<Arc<Catalog>>,
    pub(crate) held: WithHeld,
}

/// Start reading and publishing region reports. A `REGIONS` stream of
/// another region (this pacer pointed at the wrong NATS, or named after the
/// wrong region) stops the pacer like a bad setting; any other trouble with
/// the stream is retried in the background.
pub(crate) async fn start(
    regions: &Regions,
    start: Start,
    tasks: &TaskTracker,
    shutdown: CancellationToken,
) -> Result<(), adspend_common::Error> {
    adspend_common::telemetry::describe(DESCRIPTIONS, crate::telemetry::HISTOGRAMS);
    tracing::info!(
        region = %start.settings.region,
        regions = ?start.settings.regions.iter().map(|r| r.as_str()).collect::<Vec<_>>(),
        report_interval_ms = start.settings.report_interval.as_millis() as u64,
        "budgets split across regions"
    );
    let js = jetstream::new(start.client);
    let peers: Vec<_> = start
        .settings
        .regions
        .iter()
        .filter(|r| **r != start.settings.region)
        .cloned()
        .collect();
    match stream::ensure(&js, &start.settings.region, &peers, start.replicas).await {
        Err(e @ adspend_common::Error::RegionMismatch { .. }) => return Err(e),
        Err(e) => tracing::warn!(error = %e, "region reports stream unavailable; retrying"),
        Ok(_) => {}
    }
    let publishing = Arc::new(std::sync::atomic::AtomicBool::new(false));
    tasks.spawn(run::resume_links(
        js.clone(),
        publishing.clone(),
        shutdown.clone(),
    ));
    let runner = run::Runner {
        publishing,
        js,
        replicas: start.replicas,
        settings: start.settings,
        book: regions.book.clone(),
        spend: start.spend,
        catalog: start.catalog,
        held: start.held,
        shutdown,
        warned_parts: std::sync::atomic::AtomicBool::new(false),
    };
    tasks.spawn(runner.run());
    Ok(())
}
