//! The links between regions (docs/REGIONS.md): three regions on
//! [`RegionsNats`], each with its `REGIONS` stream sourcing the other two.
//! Every region hears every region's latest report, and no region's
//! pipeline subjects reach another; a cut region keeps writing and
//! reading its own stream while the others stop hearing it, and
//! everything catches up once it heals; so it does after a regional
//! JetStream server restart (left to JetStream, then with
//! `resume_stalled_sources`) and a hub restart.
//!
//! Catch-up times are printed, not asserted (docs/REGIONS.md, "Links:
//! measured", says how to see them).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use adspend_common::nats::regions::{
    ensure_regions_stream, region_report_subject, regions_sources, resume_stalled_sources,
    SourceState,
};
use adspend_harness::{wait_until_ok, RegionsNats, REGION_NAMES};
use adspend_wire::regions::{RegionName, RegionReport};
use anyhow::{ensure, Context};
use async_nats::jetstream::{self, stream};
use futures::StreamExt;
use tokio::time::Instant;

/// Reports the cut region publishes while it is cut off.
const REPORTS_DURING_CUT: u64 = 3000;
/// Longest any catch-up may take.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(150);
const POLL: Duration = Duration::from_millis(20);

/// How long the cut lasts at least: `ADSPEND_REGIONS_CUT_SECS`, for
/// measuring a long cut by hand (docs/REGIONS.md; with
/// `ADSPEND_REGIONS_RESUME` set, [`resume_stalled_sources`] runs from the
/// heal on); by default only until every side has seen the links down
/// (about 5 s).
fn cut_hold() -> Duration {
    let seconds = std::env::var("ADSPEND_REGIONS_CUT_SECS")
        .ok()
        .map(|s| s.parse().expect("ADSPEND_REGIONS_CUT_SECS: whole seconds"))
        .unwrap_or(0);
    Duration::from_secs(seconds)
}

/// One region as a service of it sees it: its own JetStream and stream.
struct Region {
    name: RegionName,
    js: jetstream::Context,
    stream: stream::Stream,
    /// The `seq` of its newest report.
    seq: u64,
}

impl Region {
    async fn open(nats: &RegionsNats, name: &str) -> anyhow::Result<Region> {
        let region = RegionName::new(name)?;
        let peers: Vec<RegionName> = REGION_NAMES
            .iter()
            .filter(|peer| **peer != name)
            .map(|peer| RegionName::new(*peer))
            .collect::<Result<_, _>>()?;
        let client = async_nats::connect(nats.url(name)).await?;
        let js = jetstream::new(client);
        let stream = ensure_regions_stream(&js, &region, &peers, 1).await?;
        Ok(Region {
            name: region,
            js,
            stream,
            seq: 0,
        })
    }

    /// Publishes `count` more reports, acknowledged, in batches.
    async fn publish(&mut self, count: u64) -> anyhow::Result<()> {
        let subject = region_report_subject(&self.name);
        let mut left = count;
        while left > 0 {
            let batch = left.min(500);
            let mut acks = Vec::new();
            for _ in 0..batch {
                self.seq += 1;
                let report = RegionReport::new(self.name.clone(), self.seq, 0, Vec::new());
                acks.push(
                    self.js
                        .publish(subject.clone(), report.encode().into())
                        .await?,
                );
            }
            for ack in acks {
                ack.await?;
            }
            left -= batch;
        }
        Ok(())
    }

    /// Publishes one report, retrying while its server or its client is
    /// coming back.
    async fn publish_one(&mut self) -> anyhow::Result<()> {
        let subject = region_report_subject(&self.name);
        let seq = self.seq + 1;
        let report = RegionReport::new(self.name.clone(), seq, 0, Vec::new()).encode();
        let js = &self.js;
        wait_until_ok(CATCH_UP_TIMEOUT, Duration::from_millis(100), || {
            let (subject, report) = (subject.clone(), report.clone());
            async move {
                let ack = js.publish(subject, report.into()).await?;
                tokio::time::timeout(Duration::from_secs(2), ack).await??;
                Ok(())
            }
        })
        .await
        .with_context(|| format!("{} publishing report {seq}", self.name))?;
        self.seq = seq;
        Ok(())
    }

    /// The `seq` of the newest report of `origin` in this region's stream.
    async fn latest(&self, origin: &RegionName) -> anyhow::Result<Option<u64>> {
        let subject = region_report_subject(origin);
        match self.stream.get_last_raw_message_by_subject(&subject).await {
            Ok(message) => Ok(Some(RegionReport::decode(&message.payload)?.seq)),
            Err(e) if e.kind() == stream::LastRawMessageErrorKind::NoMessageFound => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    async fn links(&self) -> anyhow::Result<Vec<SourceState>> {
        let mut stream = self.stream.clone();
        Ok(regions_sources(&mut stream).await?)
    }
}

fn newest(regions: &[Region]) -> BTreeMap<RegionName, u64> {
    regions.iter().map(|r| (r.name.clone(), r.seq)).collect()
}

/// Waits until every region has heard every region's newest report, and
/// prints how long that took since `since`, and the slowest link.
async fn catch_up(regions: &[Region], what: &str, since: Instant) -> anyhow::Result<Duration> {
    let want = newest(regions);
    // When each (receiver, origin) first had the origin's newest report.
    let mut arrived: BTreeMap<(RegionName, RegionName), Duration> = BTreeMap::new();
    let deadline = Instant::now() + CATCH_UP_TIMEOUT;
    while arrived.len() < regions.len() * want.len() {
        ensure!(
            Instant::now() < deadline,
            "{what}: after {CATCH_UP_TIMEOUT:?} only {arrived:?} of {want:?} arrived"
        );
        for region in regions {
            for (origin, seq) in &want {
                let key = (region.name.clone(), origin.clone());
                if arrived.contains_key(&key) {
                    continue;
                }
                if matches!(region.latest(origin).await, Ok(Some(heard)) if heard >= *seq) {
                    arrived.insert(key, since.elapsed());
                }
            }
        }
        tokio::time::sleep(POLL).await;
    }
    let ((to, from), took) = arrived
        .iter()
        .max_by_key(|(_, took)| **took)
        .map(|(key, took)| (key.clone(), *took))
        .context("no regions")?;
    let slow: Vec<String> = arrived
        .iter()
        .filter(|(_, took)| **took > Duration::from_secs(1))
        .map(|((to, from), took)| format!("{from}->{to} {} ms", took.as_millis()))
        .collect();
    println!(
        "regions_links: {what}: {} ms (last: {from} -> {to}; over 1 s: {slow:?})",
        took.as_millis()
    );
    Ok(took)
}

/// Waits until the links between `region` and the others, as each side's
/// sources see them, are all up (`linked`) or all down.
async fn wait_links(regions: &[Region], region: &str, linked: bool) -> anyhow::Result<()> {
    let deadline = Instant::now() + CATCH_UP_TIMEOUT;
    loop {
        let mut seen = Vec::new();
        for r in regions {
            let states = r.links().await?;
            ensure!(states.len() == 2, "{}: {states:?}", r.name);
            seen.extend(
                states
                    .into_iter()
                    .filter(|state| r.name.as_str() == region || state.region.as_str() == region)
                    .map(|state| (r.name.clone(), state)),
            );
        }
        if seen.iter().all(|(_, state)| state.is_linked() == linked) {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "links of {region} never all linked={linked}: {seen:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_hear_each_other_through_cuts_and_restarts() -> anyhow::Result<()> {
    let mut nats = RegionsNats::start().await;
    let mut regions = Vec::new();
    for name in REGION_NAMES {
        regions.push(Region::open(&nats, name).await?);
    }

    let start = Instant::now();
    for region in &mut regions {
        region.publish(1).await?;
    }
    catch_up(&regions, "first reports everywhere", start).await?;
    pipeline_subjects_stay_in_their_region(&nats).await?;
    for name in REGION_NAMES {
        wait_links(&regions, name, true).await?;
    }

    cut_and_heal(&mut nats, &mut regions).await?;

    nats.kill_region("west");
    regions[0].publish(1).await?;
    regions[2].publish(1).await?;
    nats.restart_region("west").await;
    let restarted = Instant::now();
    regions[1].publish_one().await?;
    catch_up(&regions, "after a regional server restart", restarted).await?;

    restart_with_resume(&mut nats, &mut regions).await?;

    nats.kill_hub("south");
    for region in &mut regions {
        region.publish_one().await?;
    }
    nats.restart_hub("south").await;
    let restarted = Instant::now();
    catch_up(&regions, "after a hub restart", restarted).await?;
    Ok(())
}

/// Cuts east off: it keeps publishing into and reading its own stream, the
/// others stop hearing it and it them; once healed, everyone has
/// everything.
async fn cut_and_heal(nats: &mut RegionsNats, regions: &mut [Region]) -> anyhow::Result<()> {
    let (east, west) = (regions[0].name.clone(), regions[1].name.clone());
    let before = regions[0].seq;
    nats.cut("east");
    let cut = Instant::now();
    regions[0].publish(REPORTS_DURING_CUT).await?;
    regions[1].publish(1).await?;
    println!(
        "regions_links: east published {REPORTS_DURING_CUT} reports while cut in {} ms",
        cut.elapsed().as_millis()
    );
    assert_eq!(regions[0].latest(&east).await?, Some(regions[0].seq));

    wait_links(regions, "east", false).await?;
    println!(
        "regions_links: east's links seen down after {} ms; west's sources: {:?}",
        cut.elapsed().as_millis(),
        regions[1].links().await?
    );
    for other in &regions[1..] {
        let heard = other.latest(&east).await?.context("east's first report")?;
        assert!(
            heard < regions[0].seq,
            "{} heard east's report {heard} while east was cut (published {before}..={})",
            other.name,
            regions[0].seq
        );
    }
    let heard = regions[0]
        .latest(&west)
        .await?
        .context("west's first report")?;
    assert!(
        heard < regions[1].seq,
        "east heard west's {heard} while cut"
    );

    tokio::time::sleep(cut_hold().saturating_sub(cut.elapsed())).await;
    let lasted = cut.elapsed();
    nats.heal("east");
    let healed = Instant::now();
    // By hand: how fast a long cut heals with the stalled sources resumed.
    let _resumers = std::env::var_os("ADSPEND_REGIONS_RESUME").map(|_| start_resumers(regions));
    catch_up(
        regions,
        &format!(
            "catch-up after a {} ms cut, {REPORTS_DURING_CUT} reports waiting",
            lasted.as_millis()
        ),
        healed,
    )
    .await?;
    wait_links(regions, "east", true).await?;
    for region in regions.iter() {
        println!(
            "regions_links: {} links: {:?}",
            region.name,
            region.links().await?
        );
    }
    Ok(())
}

/// South's JetStream server restarted, as west's was, but with
/// [`resume_stalled_sources`] running in every region every 500 ms: the
/// peers' sources of south, whose consumers died with it, are made again
/// as soon as south answers, instead of at the server's own retry.
async fn restart_with_resume(nats: &mut RegionsNats, regions: &mut [Region]) -> anyhow::Result<()> {
    nats.kill_region("south");
    regions[0].publish(1).await?;
    regions[1].publish(1).await?;
    nats.restart_region("south").await;
    let restarted = Instant::now();
    regions[2].publish_one().await?;
    let (mut resumers, resumed) = start_resumers(regions);
    let caught_up = catch_up(
        regions,
        "after a regional server restart, stalled sources resumed",
        restarted,
    )
    .await;
    resumers.abort_all();
    caught_up?;
    assert!(
        resumed.load(Ordering::Relaxed) > 0,
        "no source was made again: the catch-up did not test resume_stalled_sources"
    );
    Ok(())
}

/// Runs [`resume_stalled_sources`] in every region every 500 ms until the
/// set is dropped; the counter adds up the sources it made again.
fn start_resumers(regions: &[Region]) -> (tokio::task::JoinSet<()>, Arc<AtomicUsize>) {
    let resumed = Arc::new(AtomicUsize::new(0));
    let mut resumers = tokio::task::JoinSet::new();
    for region in regions {
        let (js, mut stream, resumed) = (
            region.js.clone(),
            region.stream.clone(),
            Arc::clone(&resumed),
        );
        resumers.spawn(async move {
            loop {
                if let Ok(peers) = resume_stalled_sources(&js, &mut stream).await {
                    resumed.fetch_add(peers.len(), Ordering::Relaxed);
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        });
    }
    (resumers, resumed)
}

/// Core traffic crosses from east to west (a control subject), but none of
/// east's pipeline subjects do: published before a second control message,
/// on the same path, they would be in before it.
async fn pipeline_subjects_stay_in_their_region(nats: &RegionsNats) -> anyhow::Result<()> {
    const CONTROL: &str = "regions-test.control";
    let local = [
        "impressions.exchange-a",
        "spend.0",
        "deadletter.bad",
        "adspend.sums.p0",
        "adspend.leases",
    ];
    let east = async_nats::connect(nats.url("east")).await?;
    let west = async_nats::connect(nats.url("west")).await?;
    let mut control = west.subscribe(CONTROL).await?;
    let mut leaks = Vec::new();
    for subject in local {
        leaks.push(west.subscribe(subject).await?);
    }
    west.flush().await?;
    // West's interest takes a moment to reach east.
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        east.publish(CONTROL, "probe".into()).await?;
        east.flush().await?;
        if tokio::time::timeout(Duration::from_millis(200), control.next())
            .await
            .is_ok()
        {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "no core message crossed from east to west"
        );
    }
    for subject in local {
        east.publish(subject, "from east".into()).await?;
    }
    east.publish(CONTROL, "after".into()).await?;
    east.flush().await?;
    loop {
        let message = tokio::time::timeout(Duration::from_secs(5), control.next())
            .await
            .context("the control message after east's pipeline subjects")?
            .context("control subscription closed")?;
        if message.payload.as_ref() == b"after" {
            break;
        }
    }
    for (subject, leak) in local.iter().zip(&mut leaks) {
        let leaked = tokio::time::timeout(Duration::from_millis(50), leak.next()).await;
        assert!(leaked.is_err(), "east's {subject} reached west: {leaked:?}");
    }
    Ok(())
}
