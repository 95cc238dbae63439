//! Pacers of three regions on real links (docs/REGIONS.md): each pacer on
//! its own region's JetStream server of [`RegionsNats`], the regions linked
//! only through their hubs. Each pacer makes its region's `REGIONS` stream
//! with sources from the other two, hears every region's report, and
//! exports each link's state; a cut of one region shows as that region's
//! links down on both sides while its pacer goes on serving its own
//! allotment, and after the heal every link is up and every region heard
//! again. Times are printed, not asserted.
//!
//! No demand here (no limiter or aggregator: `regions_pacer` covers the
//! allotments moving); what this adds is the pacers on the topology a
//! deployment runs, with its subject filters.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use adspend_harness::{free_port, wait_until, RegionsNats, ServiceProcess, REGION_NAMES};
use anyhow::Context;
use serde_json::Value;

use crate::regions_pacer::catalog;

const BUDGET: u64 = 3_000_000;
const WAIT: Duration = Duration::from_secs(60);
const POLL: Duration = Duration::from_millis(250);

struct RegionPacer {
    region: &'static str,
    addr: String,
    metrics: String,
    _process: ServiceProcess,
}

impl RegionPacer {
    /// This region's view of `global`: its allotment and the regions it
    /// has heard.
    async fn view(&self) -> anyhow::Result<Value> {
        let url = format!("http://{}/v1/limits/global", self.addr);
        Ok(reqwest::get(&url).await?.error_for_status()?.json().await?)
    }

    /// `adspend_pacer_region_link_up{region}` for every peer it exports.
    async fn links(&self) -> anyhow::Result<BTreeMap<String, bool>> {
        let url = format!("http://{}/metrics", self.metrics);
        let body = reqwest::get(&url).await?.text().await?;
        let mut links = BTreeMap::new();
        for line in body.lines() {
            let Some(rest) = line.strip_prefix("adspend_pacer_region_link_up{region=\"") else {
                continue;
            };
            let (region, value) = rest.split_once("\"} ").context("a link_up line")?;
            links.insert(region.to_string(), value.trim() == "1");
        }
        Ok(links)
    }

    /// Whether every peer's link reads `up`.
    async fn links_are(&self, up: bool) -> bool {
        match self.links().await {
            Ok(links) => links.len() == REGION_NAMES.len() - 1 && links.values().all(|l| *l == up),
            Err(_) => false,
        }
    }

    /// Whether `peer`'s link reads `up`.
    async fn link_to_is(&self, peer: &str, up: bool) -> bool {
        matches!(self.links().await, Ok(links) if links.get(peer) == Some(&up))
    }
}

fn spawn(nats: &RegionsNats, region: &'static str, catalog_path: &str) -> RegionPacer {
    let addr = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let ops = format!("127.0.0.1:{}", free_port());
    let process = ServiceProcess::builder("pacer")
        .env("ADSPEND_NATS_URL", nats.url(region))
        .env("ADSPEND_CATALOG", catalog_path)
        .env("ADSPEND_PARTITIONS", "4")
        .env("ADSPEND_PACER_ADDR", &addr)
        .env("ADSPEND_PACER_OPS_ADDR", &ops)
        .env("ADSPEND_METRICS_ADDR", &metrics)
        .env("ADSPEND_REGION", region)
        .env("ADSPEND_REGIONS", REGION_NAMES.join(","))
        .env("RUST_LOG", "info")
        .spawn();
    RegionPacer {
        region,
        addr,
        metrics,
        _process: process,
    }
}

/// Every pacer's own allotment, once each has one.
async fn allotments(pacers: &[RegionPacer]) -> Option<BTreeMap<&'static str, u64>> {
    let mut all = BTreeMap::new();
    for pacer in pacers {
        let view = pacer.view().await.ok()?;
        all.insert(pacer.region, view["allotment_micros"].as_u64()?);
    }
    Some(all)
}

/// Whether `pacer` has a report of every region in its view.
async fn hears_everyone(pacer: &RegionPacer) -> bool {
    match pacer.view().await {
        Ok(view) => REGION_NAMES.iter().all(|r| {
            view["regions"][*r]["as_of_ms"]
                .as_i64()
                .is_some_and(|t| t > 0)
        }),
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pacers_on_linked_regions_hear_each_other_and_see_a_cut() -> anyhow::Result<()> {
    let nats = RegionsNats::start().await;
    let dir = tempfile::tempdir()?;
    let catalog_path = dir.path().join("catalog.json");
    catalog().save(&catalog_path)?;
    let catalog_path = catalog_path.display().to_string();
    let started = Instant::now();
    let pacers: Vec<RegionPacer> = REGION_NAMES
        .iter()
        .map(|r| spawn(&nats, r, &catalog_path))
        .collect();

    for pacer in &pacers {
        wait_until(WAIT, POLL, || hears_everyone(pacer))
            .await
            .with_context(|| format!("{} never heard every region", pacer.region))?;
        wait_until(WAIT, POLL, || pacer.links_are(true))
            .await
            .with_context(|| format!("{}'s links never all read up", pacer.region))?;
    }
    println!(
        "regions figure: three pacers started, every region heard and every link up after {:.2}s",
        started.elapsed().as_secs_f64()
    );
    let before = allotments(&pacers).await.context("allotments")?;
    anyhow::ensure!(
        before.values().sum::<u64>() <= BUDGET,
        "allotments {before:?} add up past the budget {BUDGET}"
    );

    let east = &pacers[0];
    let cut_at = Instant::now();
    nats.cut("east");
    wait_until(WAIT, POLL, || east.links_are(false))
        .await
        .context("east's links never read down while cut")?;
    for peer in &pacers[1..] {
        wait_until(WAIT, POLL, || peer.link_to_is("east", false))
            .await
            .with_context(|| format!("{}'s link to east never read down", peer.region))?;
        anyhow::ensure!(
            peer.link_to_is(
                if peer.region == "west" {
                    "south"
                } else {
                    "west"
                },
                true
            )
            .await,
            "{}'s link to the region not cut went down",
            peer.region
        );
    }
    println!(
        "regions figure: east cut: every side read its links to east down after {:.2}s",
        cut_at.elapsed().as_secs_f64()
    );
    // Cut off, east goes on serving its own allotment.
    let during = east.view().await.context("east's view while cut")?;
    anyhow::ensure!(
        during["allotment_micros"].as_u64() == Some(before["east"]),
        "east's allotment moved while cut: {during}"
    );

    let healed_at = Instant::now();
    nats.heal("east");
    for pacer in &pacers {
        wait_until(WAIT, POLL, || pacer.links_are(true))
            .await
            .with_context(|| format!("{}'s links never came back up", pacer.region))?;
        wait_until(WAIT, POLL, || hears_everyone(pacer)).await?;
    }
    println!(
        "regions figure: east healed: every link up again after {:.2}s",
        healed_at.elapsed().as_secs_f64()
    );
    let after = allotments(&pacers).await.context("allotments")?;
    anyhow::ensure!(
        after.values().sum::<u64>() <= BUDGET,
        "allotments {after:?} add up past the budget {BUDGET}"
    );
    Ok(())
}
