//! Pacing on the real pipeline: the closed loop ([`adspend_sim::closed_loop`])
//! against NATS, limiter, aggregator and pacer processes, once per pacing
//! algorithm (`ADSPEND_PACER_ALGORITHM`), serving mode (decisions or spend
//! leases, [`ServeMode`]) and added delay, each run on a fresh pipeline
//! with the same catalog, traffic and seeds.
//!
//! Two scenarios ([`Scenario`]): a compressed day over the generated
//! catalog, and [`fast`] exhaustion, budgets that demand spends within
//! seconds. [`table`] prints their tables.
//!
//! The added delay holds every served impression back before it is
//! published (its `ts` stays the serving instant): a slow path from ad
//! server to stream. The pacer measures its lag from the stream's publish
//! time, so this delay is spend it cannot see coming: the hard case.
//!
//! Budgets are lifetime budgets: the loop compresses a day of traffic into
//! minutes, but a daily limit's period (and the pacer's plan over it) is a
//! real day, so only lifetime budgets are spent within the run.

pub mod fast;
mod table;

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use crate::e2e::SERVICE_ENV;
use adspend_harness::pipeline::{Backends, Pipeline};
use adspend_harness::{free_port, NatsOptions};
use adspend_sim::check::wait_for_match;
use adspend_sim::{
    self as sim, loop_watch, run_closed_loop, Catalog, CatalogSpec, CostDistribution, LeaseCounts,
    LoopConfig, Period, ServeMode,
};

pub use table::{fast_markdown, markdown};

/// Settings of the section.
#[derive(Debug, Clone)]
pub struct PacingBench {
    pub scenario: Scenario,
    /// Ads of the generated catalog (the day scenario).
    pub ads: u32,
    pub day: Duration,
    pub peak_rate: f64,
    pub delays: Vec<Duration>,
    pub algorithms: Vec<&'static str>,
    pub modes: Vec<ServeMode>,
    pub seed: u64,
    /// The pacer's lease grace is the run's reporting delay plus this: what
    /// an operator sets it to (the slowest report, and a margin), so that a
    /// lease's unused grant is not held longer than its reports can come.
    pub lease_grace_margin: Duration,
    /// Pacer processes; the ad servers ask them in turn.
    pub pacers: usize,
}

/// What the closed loop runs against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// A day compressed into --pacing-day-secs, over the generated catalog.
    Day,
    /// 20 budgets of 2,000 impressions that demand spends within seconds.
    Fast,
}

/// Cost of an impression: uniform, one currency unit on average.
pub const COST: CostDistribution = CostDistribution::Uniform {
    min: 100_000,
    max: 1_900_000,
};

/// The figures of one run. Percentages are of the limit's budget.
#[derive(Debug, Clone)]
pub struct RunResult {
    pub algorithm: &'static str,
    pub mode: ServeMode,
    pub delay: Duration,
    pub limits: usize,
    /// Limits whose traffic could have bought their budget (requests asked
    /// for ads under them times the mean cost): those a pacer must stop.
    pub constrained: usize,
    pub over_budget: usize,
    /// Limits whose final overspend is within the bound the pacer stated
    /// when it stopped them (a limit never over budget is within).
    pub within_bound: usize,
    pub over_pct: Vec<f64>,
    /// Of the constrained limits only.
    pub under_pct: Vec<f64>,
    /// (overspend + underspend) / budgets, constrained limits, percent.
    pub over_under_total_pct: f64,
    /// Underspend / budgets, constrained limits, percent.
    pub under_total_pct: f64,
    pub served: u64,
    pub spent_micros: u64,
    pub decision_errors: u64,
    /// Zero in decisions mode.
    pub leases: LeaseCounts,
    pub exact: bool,
}

/// The generated catalog with every budget made a lifetime budget.
pub fn catalog(ads: u32, seed: u64) -> anyhow::Result<Catalog> {
    let mut catalog = sim::generate_catalog(&CatalogSpec::for_ads(ads), seed)?;
    for limit in catalog.limits.values_mut() {
        limit.period = Period::Lifetime;
    }
    Ok(catalog)
}

/// Every run of the section: for each delay, each mode side by side, each
/// algorithm.
pub async fn run(bench: &PacingBench) -> anyhow::Result<Vec<RunResult>> {
    let catalog = match bench.scenario {
        Scenario::Day => catalog(bench.ads, bench.seed)?,
        Scenario::Fast => fast::catalog()?,
    };
    let mut results = Vec::new();
    for &delay in &bench.delays {
        for &mode in &bench.modes {
            for &algorithm in &bench.algorithms {
                let result = one_run(bench, &catalog, algorithm, mode, delay).await?;
                println!("{}", table::summary(&result));
                results.push(result);
            }
        }
    }
    Ok(results)
}

/// The loop of one run of the day scenario.
fn day_config(
    bench: &PacingBench,
    pacer_url: String,
    mode: ServeMode,
    delay: Duration,
) -> LoopConfig {
    LoopConfig {
        pacer_url,
        servers: 4,
        day: bench.day,
        duration: bench.day,
        peak_rate: bench.peak_rate,
        cost: COST,
        mode,
        publish_delay: delay,
        seed: bench.seed,
        progress_interval: Duration::from_secs(15),
        ..LoopConfig::default()
    }
}

async fn one_run(
    bench: &PacingBench,
    catalog: &Catalog,
    algorithm: &'static str,
    mode: ServeMode,
    delay: Duration,
) -> anyhow::Result<RunResult> {
    let mut p = Pipeline::start_with(
        Backends::default(),
        NatsOptions {
            lazy_sync: true,
            ..NatsOptions::default()
        },
        catalog.clone(),
    )
    .await;
    let mut pacer_env = SERVICE_ENV.to_vec();
    pacer_env.push(("ADSPEND_PACER_ALGORITHM", algorithm));
    let grace = (delay + bench.lease_grace_margin).as_millis().to_string();
    pacer_env.push(("ADSPEND_PACER_LEASE_GRACE_MS", &grace));
    p.aggregator = Some(p.spawn_with("aggregator", free_port(), SERVICE_ENV));
    p.limiter = Some(p.spawn_with("limiter", free_port(), SERVICE_ENV));
    p.pacer = Some(p.spawn_with("pacer", free_port(), &pacer_env));
    p.wait_pacer().await;
    let mut more_pacers = Vec::new();
    let mut more_urls = Vec::new();
    for _ in 1..bench.pacers.max(1) {
        let addr = format!("127.0.0.1:{}", free_port());
        let mut env = pacer_env.clone();
        env.push(("ADSPEND_PACER_ADDR", &addr));
        more_pacers.push(p.spawn_with("pacer", free_port(), &env));
        let url = format!("http://{addr}");
        adspend_harness::pipeline::wait_pacer_at(&url).await?;
        more_urls.push(url);
    }
    let mut config = match bench.scenario {
        Scenario::Day => day_config(bench, p.pacer_url(), mode, delay),
        Scenario::Fast => fast::loop_config(p.pacer_url(), mode, delay, bench.seed),
    };
    config.more_pacer_urls = more_urls;
    let stop = CancellationToken::new();
    let watch = loop_watch::spawn(
        p.pacer_url(),
        None,
        Duration::from_millis(500),
        stop.clone(),
    );
    let client = p.client().await;
    let loop_start = std::time::Instant::now();
    let label = format!(
        "{algorithm} by {}, delay {}s",
        mode.name(),
        delay.as_secs_f64()
    );
    let outcome = run_closed_loop(&client, &config, catalog, CancellationToken::new(), |pr| {
        println!("bench: pacing {label}: {}", sim::cli::loop_line(pr));
    })
    .await
    .context("closed loop")?;
    let (comparison, _) =
        wait_for_match(&p.pacer_url(), &outcome.truth, Duration::from_secs(120)).await?;
    stop.cancel();
    let mut seen = watch.await.context("watch task")?;
    // A last look, for limits that went over after the watch's last poll.
    let http = reqwest::Client::builder().no_proxy().build()?;
    for l in loop_watch::fetch(&http, &p.pacer_url(), None).await? {
        let s = seen.entry(l.limit_id).or_default();
        if l.exhausted && s.bound_at_stop.is_none() {
            s.bound_at_stop = Some(l.overspend_bound_micros);
        }
    }

    // Demand: requests asked per ad, booked to every limit above the ad.
    let mean_cost = match config.cost {
        CostDistribution::Uniform { min, max } => (min + max) as f64 / 2.0,
        CostDistribution::LogUniform { .. } => unreachable!("uniform"),
    };
    let mut demand: BTreeMap<&str, f64> = BTreeMap::new();
    for (ad, limits) in &catalog.ads {
        let r = &outcome.ads[ad];
        let asked = (r.servable + r.not_servable) as f64 * mean_cost;
        for limit in limits {
            *demand.entry(limit.as_str()).or_default() += asked;
        }
    }
    let mut result = RunResult {
        algorithm,
        mode,
        delay,
        limits: catalog.limits.len(),
        constrained: 0,
        over_budget: 0,
        within_bound: 0,
        over_pct: Vec::new(),
        under_pct: Vec::new(),
        over_under_total_pct: 0.0,
        under_total_pct: 0.0,
        served: outcome.progress.served,
        spent_micros: outcome.progress.served_micros,
        decision_errors: outcome.progress.decision_errors,
        leases: outcome.progress.leases.clone(),
        exact: comparison.mismatches().is_empty(),
    };
    let (mut off, mut short, mut budgets) = (0.0, 0.0, 0.0);
    for (id, limit) in &catalog.limits {
        let budget = limit.budget_micros as f64;
        let spend = outcome.truth.limits[id].lifetime_micros;
        let over = spend.saturating_sub(limit.budget_micros);
        let bound = seen.get(id).and_then(|s| s.bound_at_stop).unwrap_or(0);
        result.over_budget += usize::from(over > 0);
        result.within_bound += usize::from(over <= bound);
        if over > bound {
            // Each break, for diagnosis: when the watch first saw the limit
            // exhausted (seconds into the loop) and what it was told then.
            let at = seen
                .get(id)
                .and_then(|s| s.seen_exhausted)
                .map(|t| t.saturating_duration_since(loop_start).as_secs_f64());
            println!(
                "bench: pacing {label}: {id} broke its bound: budget {}, spend {spend}, \
                 over {over}, bound at stop {bound}, largest bound {}, seen exhausted at {at:.1?} s",
                limit.budget_micros,
                seen.get(id).map_or(0, |s| s.max_bound),
            );
        }
        result.over_pct.push(over as f64 / budget * 100.0);
        if demand.get(id.as_str()).copied().unwrap_or(0.0) >= budget {
            let under = limit.budget_micros.saturating_sub(spend);
            result.constrained += 1;
            result.under_pct.push(under as f64 / budget * 100.0);
            off += (over + under) as f64;
            short += under as f64;
            budgets += budget;
        }
    }
    let share = |micros: f64| {
        if budgets > 0.0 {
            micros / budgets * 100.0
        } else {
            0.0
        }
    };
    result.over_under_total_pct = share(off);
    result.under_total_pct = share(short);
    Ok(result)
}
