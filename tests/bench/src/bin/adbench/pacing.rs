//! Pacing on the real pipeline: the closed loop for each pacing algorithm
//! and added delay; prints the table of `docs/PACING.md`.

use std::time::Duration;

use adspend_bench::pacing::{self, PacingBench};
use adspend_bench::report::Table;

use crate::{samples, Args};

pub(crate) async fn closed_loop(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let bench = PacingBench {
        ads: 1_000,
        day: Duration::from_secs(args.pacing_day_secs),
        peak_rate: args.pacing_peak_rate,
        delays: args
            .pacing_delays
            .iter()
            .map(|&s| Duration::try_from_secs_f64(s))
            .collect::<Result<_, _>>()?,
        algorithms: vec!["adspend", "baseline"],
        seed: 7,
    };
    let results = pacing::run(&bench).await?;
    println!("\n{}", pacing::markdown(&results));
    for r in &results {
        let note = format!(
            "{} limits, {} s day, peak {} requests/s",
            r.limits, args.pacing_day_secs, args.pacing_peak_rate
        );
        let name = format!("pacing {}, delay {} s", r.algorithm, r.delay.as_secs_f64());
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
            note,
        );
    }
    Ok(())
}
