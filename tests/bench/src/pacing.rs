//! Pacing on the real pipeline: the closed loop ([`adspend_sim::closed_loop`])
//! against NATS, limiter, aggregator and pacer processes, once per pacing
//! algorithm (`ADSPEND_PACER_ALGORITHM`) and added delay, each run on a
//! fresh pipeline with the same catalog, traffic and seeds.
//!
//! The added delay holds every served impression back before it is
//! published (its `ts` stays the serving instant): a slow path from ad
//! server to stream. The pacer measures its lag from the stream's publish
//! time, so this delay is spend it cannot see coming: the hard case.
//!
//! Budgets are lifetime budgets: the loop compresses a day of traffic into
//! minutes, but a daily limit's period (and the pacer's plan over it) is a
//! real day, so only lifetime budgets are spent within the run.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use crate::e2e::SERVICE_ENV;
use adspend_harness::pipeline::{Backends, Pipeline};
use adspend_harness::{free_port, NatsOptions};
use adspend_sim::check::wait_for_match;
use adspend_sim::stats::quantile;
use adspend_sim::{
    self as sim, loop_watch, run_closed_loop, Catalog, CatalogSpec, CostDistribution, LoopConfig,
    Period,
};

/// Settings of the section.
#[derive(Debug, Clone)]
pub struct PacingBench {
    pub ads: u32,
    pub day: Duration,
    pub peak_rate: f64,
    pub delays: Vec<Duration>,
    pub algorithms: Vec<&'static str>,
    pub seed: u64,
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
    pub served: u64,
    pub spent_micros: u64,
    pub decision_errors: u64,
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

pub async fn run(bench: &PacingBench) -> anyhow::Result<Vec<RunResult>> {
    let catalog = catalog(bench.ads, bench.seed)?;
    let mut results = Vec::new();
    for &delay in &bench.delays {
        for &algorithm in &bench.algorithms {
            let result = one_run(bench, &catalog, algorithm, delay).await?;
            println!("{}", summary(&result));
            results.push(result);
        }
    }
    Ok(results)
}

async fn one_run(
    bench: &PacingBench,
    catalog: &Catalog,
    algorithm: &'static str,
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
    p.aggregator = Some(p.spawn_with("aggregator", free_port(), SERVICE_ENV));
    p.limiter = Some(p.spawn_with("limiter", free_port(), SERVICE_ENV));
    p.pacer = Some(p.spawn_with("pacer", free_port(), &pacer_env));
    p.wait_pacer().await;
    let config = LoopConfig {
        pacer_url: p.pacer_url(),
        servers: 4,
        day: bench.day,
        duration: bench.day,
        peak_rate: bench.peak_rate,
        cost: COST,
        publish_delay: delay,
        seed: bench.seed,
        progress_interval: Duration::from_secs(15),
        ..LoopConfig::default()
    };
    let stop = CancellationToken::new();
    let watch = loop_watch::spawn(
        p.pacer_url(),
        None,
        Duration::from_millis(500),
        stop.clone(),
    );
    let client = p.client().await;
    let loop_start = std::time::Instant::now();
    let label = format!("{algorithm}, delay {}s", delay.as_secs_f64());
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
    let mean_cost = match COST {
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
        delay,
        limits: catalog.limits.len(),
        constrained: 0,
        over_budget: 0,
        within_bound: 0,
        over_pct: Vec::new(),
        under_pct: Vec::new(),
        over_under_total_pct: 0.0,
        served: outcome.progress.served,
        spent_micros: outcome.progress.served_micros,
        decision_errors: outcome.progress.decision_errors,
        exact: comparison.mismatches().is_empty(),
    };
    let (mut off, mut budgets) = (0.0, 0.0);
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
            budgets += budget;
        }
    }
    result.over_under_total_pct = if budgets > 0.0 {
        off / budgets * 100.0
    } else {
        0.0
    };
    Ok(result)
}

fn summary(r: &RunResult) -> String {
    format!(
        "bench: pacing {} delay {}s: {} limits, {} over budget, {} within the stated bound, \
         over+under {:.2}% of the constrained budgets; {} served, {} decision errors, exact {}",
        r.algorithm,
        r.delay.as_secs_f64(),
        r.limits,
        r.over_budget,
        r.within_bound,
        r.over_under_total_pct,
        r.served,
        r.decision_errors,
        r.exact
    )
}

/// The table of `docs/PACING.md`.
pub fn markdown(results: &[RunResult]) -> String {
    let mut out = String::from(
        "| pacer | added delay | limits | within stated bound | over budget | over % median / p99 / max \
         | constrained limits | under % median / p99 / max | over+under % of budget | served | exact |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let q = |v: &[f64]| {
            format!(
                "{:.2} / {:.2} / {:.2}",
                quantile(v, 0.5),
                quantile(v, 0.99),
                quantile(v, 1.0)
            )
        };
        let _ = writeln!(
            out,
            "| {} | {} s | {} | {:.1}% | {} | {} | {} | {} | {:.2} | {} | {} |",
            r.algorithm,
            r.delay.as_secs_f64(),
            r.limits,
            r.within_bound as f64 / r.limits as f64 * 100.0,
            r.over_budget,
            q(&r.over_pct),
            r.constrained,
            q(&r.under_pct),
            r.over_under_total_pct,
            r.served,
            if r.exact { "yes" } else { "NO" }
        );
    }
    out
}
