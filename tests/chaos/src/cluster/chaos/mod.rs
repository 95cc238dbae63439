//! The random fault campaign over the compose cluster
//! (`scripts/cluster.sh chaos --faults N --seed S`, docs/CLUSTER.md).
//!
//! While the simulator publishes with duplicates to several sources as the
//! `adserver` role, faults drawn from a seeded generator ([`plan`]) hit any
//! container: kills, pauses past the lease, restarts, cuts from the etcd or
//! the data network, the etcd and NATS leaders, the object store, scaling
//! aggregators up and down, and now and then two at once. Each fault is
//! confirmed by `docker inspect` ([`inject`]), held, healed, and followed
//! by a wait until every partition applies and checkpoints again (a stall
//! when that takes longer than 30 s). [`watch`] samples the pacer and etcd
//! throughout for the invariants; at the end the pacer must equal the truth
//! read back from `IMPRESSIONS` for every limit ([`report`]).

mod inject;
mod plan;
mod report;
mod watch;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use self::plan::{Action, Template};
pub use self::report::{FaultRecord, Report};
use self::watch::Watch;
use super::compose::pacer;
use super::compose::Cluster;
use super::observe::PARTITIONS;
use super::timeline::{Logs, Timeline};
use super::traffic::{connect_as, Traffic};
use adspend_sim::check::wait_for_match_with;
use adspend_sim::stream_truth::truth_from_stream;
use adspend_sim::{generate_catalog, Catalog, CatalogSpec};

#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub faults: usize,
    pub seed: u64,
    /// Events per second over all sources.
    pub rate: f64,
    pub sources: usize,
    /// The aggregators' `ADSPEND_LEASE_TTL_MS`.
    pub lease_ttl: Duration,
    /// Longer than this from healing to every partition applying and
    /// checkpointing again is a stall.
    pub stall_after: Duration,
    /// Give up waiting for a partition after this.
    pub recover_timeout: Duration,
    pub settle_timeout: Duration,
}

impl Default for ChaosConfig {
    fn default() -> Self {
        ChaosConfig {
            faults: 20,
            seed: 1,
            rate: 900.0,
            sources: 3,
            lease_ttl: Duration::from_secs(5),
            stall_after: Duration::from_secs(30),
            recover_timeout: Duration::from_secs(120),
            settle_timeout: Duration::from_secs(240),
        }
    }
}

const CATALOG_KEY: &str = "/adspend/catalog";
/// Limits and ads the campaign adds to a small catalog, under this prefix.
const PREFIX: &str = "chaos-";
const ADS: u32 = 200;
/// The watch's requests to the pacer.
const WATCH_TIMEOUT: Duration = Duration::from_secs(2);

/// Runs the campaign against a running project; `say` gets each progress line.
pub async fn run(
    cluster: Arc<Cluster>,
    config: &ChaosConfig,
    mut say: impl FnMut(String),
) -> anyhow::Result<Report> {
    let catalog = ensure_catalog(&cluster, &mut say).await?;
    let access = pacer();
    let watch = Watch::start(cluster.clone(), &access.url, access.client(WATCH_TIMEOUT)?);
    say("waiting for every partition to apply and checkpoint".into());
    wait_partitions(&watch, config.recover_timeout).await?;
    let mut traffic = Vec::new();
    for i in 0..config.sources {
        let subject = format!("impressions.chaos-{}", i + 1);
        let rate = config.rate / config.sources as f64;
        traffic
            .push(Traffic::start_on(&catalog, &subject, None, rate, config.seed + i as u64).await?);
    }
    say(format!(
        "publishing {:.0} events/s (10% duplicates) to {} sources as adserver",
        config.rate, config.sources
    ));
    let mut rng = StdRng::seed_from_u64(config.seed);
    let mut report = Report {
        seed: config.seed,
        ..Report::default()
    };
    while report.faults.len() < config.faults {
        let template = plan::draw(&mut rng, inject::scaled_up(&cluster).await);
        let Some(actions) = inject::resolve(&cluster, &template, &mut rng).await? else {
            report.skipped += 1;
            continue;
        };
        let n = report.faults.len() + 1;
        let record = one_fault(&cluster, &watch, config, &mut rng, &template, &actions).await?;
        for timeline in &record.timelines {
            say(timeline.render().trim_end().to_owned());
        }
        say(format!(
            "fault {n}/{}: {} [{}]: apply gap {:.1}s, checkpoint gap {:.1}s, max lag {:.1}s, recovered {:.1}s after healing{}",
            config.faults,
            record.kind,
            record.what,
            record.window.apply_gap.as_secs_f64(),
            record.window.checkpoint_gap.as_secs_f64(),
            record.window.max_lag_ms as f64 / 1000.0,
            record.recovered.as_secs_f64(),
            if record.stalled { " STALL" } else { "" }
        ));
        report.faults.push(record);
        tokio::time::sleep(Duration::from_millis(rng.random_range(500..2_000))).await;
    }
    say("stopping the simulator; reading the truth back from IMPRESSIONS".into());
    for t in traffic {
        let truth = t.stop().await?;
        report.events_sent += truth.stats.events_sent;
        report.publishes_failed += truth.stats.messages_failed;
    }
    settle(&catalog, config, &mut report).await?;
    report.permission_violations = cluster.permission_violations().await?;
    let (samples, violations, stale_reads) = watch.finish().await;
    report.samples = samples;
    report.violations = violations;
    report.etcd_stale_reads = stale_reads;
    Ok(report)
}

/// Injects, holds, heals, and waits for every partition.
async fn one_fault(
    cluster: &Cluster,
    watch: &Watch,
    config: &ChaosConfig,
    rng: &mut StdRng,
    template: &Template,
    actions: &[Action],
) -> anyhow::Result<FaultRecord> {
    let pairs: Vec<_> = match template {
        Template::One(v, t) => vec![(*v, *t)],
        Template::Two(a, b) => vec![*a, *b],
        Template::ScaleUp | Template::ScaleDown => vec![],
    };
    let hold = pairs
        .iter()
        .map(|(v, t)| plan::hold(rng, *v, *t, config.lease_ttl))
        .max()
        .unwrap_or_default();
    let pacer1_hit = actions.iter().any(|a| a.target() == "pacer1");
    if pacer1_hit {
        let ip = cluster
            .state("pacer2")
            .await?
            .data_ip
            .context("pacer2 has no address on the data network")?;
        // pacer2 by its name in the pacers' certificate, at its address.
        let access = pacer();
        let addr = format!("{ip}:8080").parse().context("pacer2's address")?;
        let http = access.client_resolving(WATCH_TIMEOUT, "pacer2", addr)?;
        watch.switch_pacer(&access.url_of("pacer2"), http);
    }
    // Which partitions an aggregator killed or paused owns: their
    // failover's timeline is read from the logs once they are back.
    let mut failovers = Vec::new();
    for action in actions {
        if let Action::Kill(member) | Action::Pause(member) = action {
            if member.starts_with("aggregator") {
                let owned: Vec<u32> = cluster
                    .owners()
                    .await?
                    .into_iter()
                    .filter(|(_, m)| m == member)
                    .map(|(p, _)| p)
                    .collect();
                failovers.push((action.describe(), member.clone(), owned));
            }
        }
    }
    let fault_at = chrono::Utc::now();
    watch.open_window();
    for action in actions {
        inject::inject(cluster, action)
            .await
            .with_context(|| action.describe())?;
    }
    tokio::time::sleep(hold).await;
    for action in actions.iter().rev() {
        inject::heal(cluster, action)
            .await
            .with_context(|| format!("healing {}", action.describe()))?;
    }
    if pacer1_hit {
        let access = pacer();
        watch.switch_pacer(&access.url, access.client(WATCH_TIMEOUT)?);
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let healed = Instant::now();
    let marks = watch.marks();
    let mut stalled = false;
    loop {
        let behind = watch.behind(&marks);
        if behind.is_empty() {
            break;
        }
        if healed.elapsed() > config.recover_timeout {
            stalled = true;
            eprintln!(
                "chaos: partitions {behind:?} did not apply and checkpoint within {:?} of healing",
                config.recover_timeout
            );
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let recovered = healed.elapsed();
    let mut timelines = Vec::new();
    if !failovers.is_empty() {
        let logs = Logs::read(cluster).await?;
        for (what, member, owned) in &failovers {
            timelines.push(Timeline::collect(
                what, member, fault_at, None, owned, &logs,
            ));
        }
    }
    Ok(FaultRecord {
        timelines,
        kind: template.kind(),
        what: actions
            .iter()
            .map(Action::describe)
            .collect::<Vec<_>>()
            .join(" + ")
            + &format!(" for {:.1}s", hold.as_secs_f64()),
        window: watch.close_window(),
        recovered,
        stalled: stalled || recovered > config.stall_after,
    })
}

async fn wait_partitions(watch: &Watch, timeout: Duration) -> anyhow::Result<()> {
    let started = Instant::now();
    while watch.partitions() < PARTITIONS as usize {
        if started.elapsed() > timeout {
            bail!(
                "the pacer and etcd show {} of {PARTITIONS} partitions",
                watch.partitions()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let marks = watch.marks();
    while !watch.behind(&marks).is_empty() {
        if started.elapsed() > timeout {
            bail!(
                "partitions {:?} neither apply nor checkpoint",
                watch.behind(&marks)
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// The catalog the cluster runs (in etcd).
async fn catalog_of(cluster: &Cluster) -> anyhow::Result<Catalog> {
    let text = cluster
        .etcdctl(&["get", "--print-value-only", CATALOG_KEY])
        .await?;
    serde_json::from_str(text.trim()).with_context(|| format!("the catalog at {CATALOG_KEY}"))
}

/// The catalog in etcd, with a generated one of [`ADS`] ads added under
/// [`PREFIX`] when it has fewer (the example catalog has two); the pacer
/// must serve the added limits before anything is published for them.
pub async fn ensure_catalog(
    cluster: &Cluster,
    say: &mut impl FnMut(String),
) -> anyhow::Result<Catalog> {
    let mut catalog = catalog_of(cluster).await?;
    if catalog.ads.len() >= ADS as usize || catalog.ads.keys().any(|a| a.starts_with(PREFIX)) {
        return Ok(catalog);
    }
    let extra = generate_catalog(&CatalogSpec::for_ads(ADS), 2811)?;
    let named = |id: &str| format!("{PREFIX}{id}");
    for (id, mut limit) in extra.limits {
        limit.parent = limit.parent.as_deref().map(named);
        catalog.limits.insert(named(&id), limit);
    }
    for (id, limits) in extra.ads {
        catalog
            .ads
            .insert(named(&id), limits.iter().map(|l| named(l)).collect());
    }
    catalog.validate()?;
    say(format!(
        "adding {ADS} ads and their limits under {PREFIX}* to the catalog in etcd"
    ));
    cluster
        .etcdctl_put(CATALOG_KEY, &serde_json::to_string(&catalog)?)
        .await?;
    let access = pacer();
    let http = access.client(Duration::from_secs(10))?;
    let probe = catalog
        .limits
        .keys()
        .find(|l| l.starts_with(PREFIX))
        .cloned();
    let started = Instant::now();
    loop {
        let limits = adspend_sim::check::fetch_limits(&http, &access.url)
            .await
            .unwrap_or_default();
        if limits.iter().any(|l| Some(&l.limit_id) == probe.as_ref()) {
            break;
        }
        if started.elapsed() > Duration::from_secs(60) {
            bail!("the pacer did not pick up the catalog with {probe:?} within 60 s");
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The limiters watch the same key; give them the pacer's head start.
    tokio::time::sleep(Duration::from_secs(5)).await;
    Ok(catalog)
}

/// The pacer against `IMPRESSIONS` read back, for every limit.
async fn settle(
    catalog: &Catalog,
    config: &ChaosConfig,
    report: &mut Report,
) -> anyhow::Result<()> {
    let client = connect_as("auditor").await?;
    let truth = truth_from_stream(&client, catalog).await?;
    let access = pacer();
    let http = access.client(Duration::from_secs(10))?;
    let (comparison, took) =
        wait_for_match_with(&http, &access.url, &truth, config.settle_timeout).await?;
    report.limits = comparison.rows.len();
    report.mismatches = comparison.mismatches().len();
    report.total_micros = comparison.total_truth();
    report.settled = took;
    if report.mismatches > 0 {
        eprintln!("{}", comparison.render(20));
    }
    Ok(())
}
