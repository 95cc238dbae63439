//! Pacing on the real pipeline: the closed loop for each pacing algorithm,
//! serving mode and added delay; prints the table of `docs/PACING.md` (the
//! day scenario) or the fast scenario's worst overspends.

use std::time::Duration;

use adspend_bench::pacing::{self, fast, PacingBench, RunResult, Scenario};
use adspend_bench::report::Table;
use adspend_sim::cli::ModeArg;
use adspend_sim::{LeaseMode, ServeMode};

use crate::{samples, Args};

pub(crate) async fn closed_loop(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let delays = if args.pacing_delays.is_empty() {
        match args.pacing_scenario {
            Scenario::Day => vec![0.0, 1.0, 10.0, 30.0],
            Scenario::Fast => fast::DELAYS_SECS.to_vec(),
        }
    } else {
        args.pacing_delays.clone()
    };
    let lease = LeaseMode {
        release: args.pacing_lease_release,
        ..LeaseMode::with_ttl(Duration::from_millis(args.pacing_lease_ttl_ms))
    };
    let bench = PacingBench {
        scenario: args.pacing_scenario,
        ads: 1_000,
        day: Duration::from_secs(args.pacing_day_secs),
        peak_rate: args.pacing_peak_rate,
        delays: delays
            .iter()
            .map(|&s| Duration::try_from_secs_f64(s))
            .collect::<Result<_, _>>()?,
        algorithms: args
            .pacing_algorithms
            .iter()
            .map(|a| match a.as_str() {
                "adspend" => Ok("adspend"),
                "baseline" => Ok("baseline"),
                other => anyhow::bail!("--pacing-algorithms: {other:?} is not adspend or baseline"),
            })
            .collect::<anyhow::Result<_>>()?,
        modes: args
            .pacing_modes
            .iter()
            .map(|m| match m {
                ModeArg::Decisions => ServeMode::Decisions,
                ModeArg::Leases => ServeMode::Leases(lease),
            })
            .collect(),
        seed: 7,
        lease_grace_margin: Duration::from_millis(args.pacing_lease_grace_margin_ms),
        pacers: args.pacing_pacers,
    };
    for mode in &bench.modes {
        mode.validate()?;
    }
    let results = pacing::run(&bench).await?;
    match bench.scenario {
        Scenario::Day => println!("\n{}", pacing::markdown(&results)),
        Scenario::Fast => println!("\n{}", pacing::fast_markdown(&results)),
    }
    for r in &results {
        add_rows(args, &bench, r, table);
    }
    Ok(())
}

fn add_rows(args: &Args, bench: &PacingBench, r: &RunResult, table: &mut Table) {
    let (name, note) = match bench.scenario {
        Scenario::Day => (
            format!(
                "pacing {} by {}, delay {} s",
                r.algorithm,
                r.mode.name(),
                r.delay.as_secs_f64()
            ),
            format!(
                "{} limits, {} s day, peak {} requests/s",
                r.limits, args.pacing_day_secs, args.pacing_peak_rate
            ),
        ),
        Scenario::Fast => (
            format!(
                "pacing fast exhaustion, {} by {}, delay {} s",
                r.algorithm,
                r.mode.name(),
                r.delay.as_secs_f64()
            ),
            format!(
                "{} budgets of {} impressions, {} requests/s",
                r.limits,
                fast::BUDGET_IMPRESSIONS,
                fast::RATE
            ),
        ),
    };
    let worst = r.over_pct.iter().copied().fold(0.0, f64::max);
    table.add(
        format!("{name}: worst overspend"),
        "% of budget",
        samples([worst]),
        None,
        note.clone(),
    );
    if bench.scenario == Scenario::Fast {
        return;
    }
    table.add(
        format!("{name}: limits within the stated bound"),
        "%",
        samples([r.within_bound as f64 / r.limits as f64 * 100.0]),
        None,
        note.clone(),
    );
    table.add(
        format!("{name}: over+under delivery"),
        "% of budget",
        samples([r.over_under_total_pct]),
        None,
        note.clone(),
    );
    table.add(
        format!("{name}: underdelivery"),
        "% of budget",
        samples([r.under_total_pct]),
        None,
        note,
    );
}
