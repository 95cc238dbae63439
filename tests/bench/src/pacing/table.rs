//! The section's printed lines and tables: the day scenario's (the table
//! of `docs/PACING.md`) and the fast scenario's worst overspends.

use std::fmt::Write as _;

use adspend_sim::stats::quantile;
use adspend_sim::{LeaseCounts, ServeMode};

use super::RunResult;

/// The line printed after each run.
pub(crate) fn summary(r: &RunResult) -> String {
    let l = &r.leases;
    let leases = match r.mode {
        ServeMode::Decisions => String::new(),
        ServeMode::Leases(_) => format!(
            "; leases: {} calls ({} failed), {} asked, {} granted, {} zero, {:.2} of {:.2} asked \
             granted, {} released, {} requests refused for lack of a lease",
            l.calls,
            l.errors,
            l.asked,
            l.granted,
            l.zero,
            units(l.micros_granted),
            units(l.micros_asked),
            l.released,
            l.refused
        ),
    };
    format!(
        "bench: pacing {} by {} delay {}s: {} limits, {} over budget (worst {:.2}%), {} within the \
         stated bound, over+under {:.2}% (under {:.2}%) of the constrained budgets; {} served, \
         {} decision errors, exact {}{leases}",
        r.algorithm,
        r.mode.name(),
        r.delay.as_secs_f64(),
        r.limits,
        r.over_budget,
        quantile(&r.over_pct, 1.0),
        r.within_bound,
        r.over_under_total_pct,
        r.under_total_pct,
        r.served,
        r.decision_errors,
        r.exact
    )
}

fn units(micros: u64) -> f64 {
    micros as f64 / 1e6
}

/// `asked / granted / zero`, `micros asked / granted` (currency units) and
/// refused requests; dashes in decisions mode.
fn lease_cells(mode: ServeMode, l: &LeaseCounts) -> [String; 3] {
    match mode {
        ServeMode::Decisions => ["–".into(), "–".into(), "–".into()],
        ServeMode::Leases(_) => [
            format!("{} / {} / {}", l.asked, l.granted, l.zero),
            format!(
                "{:.0} / {:.0}",
                units(l.micros_asked),
                units(l.micros_granted)
            ),
            l.refused.to_string(),
        ],
    }
}

/// The day scenario's table (`docs/PACING.md`): a row per run, decisions
/// and leases side by side at each delay.
pub fn markdown(results: &[RunResult]) -> String {
    let mut out = String::from(
        "| pacer | mode | added delay | limits | within stated bound | over budget \
         | over % median / p99 / max | constrained limits | under % median / p99 / max \
         | over+under % of budget | under % of budget | served | leases asked / granted / zero \
         | units asked / granted | refused for lack of a lease | exact |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
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
        let [asked, micros, refused] = lease_cells(r.mode, &r.leases);
        let _ = writeln!(
            out,
            "| {} | {} | {} s | {} | {:.1}% | {} | {} | {} | {} | {:.2} | {:.2} | {} | {asked} \
             | {micros} | {refused} | {} |",
            r.algorithm,
            r.mode.name(),
            r.delay.as_secs_f64(),
            r.limits,
            r.within_bound as f64 / r.limits as f64 * 100.0,
            r.over_budget,
            q(&r.over_pct),
            r.constrained,
            q(&r.under_pct),
            r.over_under_total_pct,
            r.under_total_pct,
            r.served,
            if r.exact { "yes" } else { "NO" }
        );
    }
    out
}

/// The fast scenario's table: the worst overspend of any limit per run.
pub fn fast_markdown(results: &[RunResult]) -> String {
    let mut out = String::from(
        "| pacer | mode | reporting delay | limits over budget | worst over % | over % p99 \
         | under % median | served | leases asked / granted / zero | refused for lack of a lease \
         | exact |\n\
         |---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in results {
        let [asked, _, refused] = lease_cells(r.mode, &r.leases);
        let _ = writeln!(
            out,
            "| {} | {} | {} s | {} of {} | {:.2} | {:.2} | {:.2} | {} | {asked} | {refused} | {} |",
            r.algorithm,
            r.mode.name(),
            r.delay.as_secs_f64(),
            r.over_budget,
            r.limits,
            quantile(&r.over_pct, 1.0),
            quantile(&r.over_pct, 0.99),
            quantile(&r.under_pct, 0.5),
            r.served,
            if r.exact { "yes" } else { "NO" }
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use adspend_sim::LeaseMode;

    use super::*;

    fn result(mode: ServeMode, over_pct: Vec<f64>) -> RunResult {
        RunResult {
            algorithm: "adspend",
            mode,
            delay: Duration::from_secs(10),
            limits: over_pct.len(),
            constrained: 1,
            over_budget: over_pct.iter().filter(|&&o| o > 0.0).count(),
            within_bound: over_pct.len(),
            over_pct,
            under_pct: vec![3.0],
            over_under_total_pct: 4.0,
            under_total_pct: 3.0,
            served: 100,
            spent_micros: 100_000_000,
            decision_errors: 0,
            leases: LeaseCounts {
                asked: 7,
                granted: 5,
                zero: 2,
                micros_asked: 9_000_000,
                micros_granted: 4_000_000,
                refused: 11,
                ..LeaseCounts::default()
            },
            exact: true,
        }
    }

    #[test]
    fn a_row_per_run_with_the_lease_counters_in_lease_mode_only() {
        let results = [
            result(ServeMode::Decisions, vec![0.0, 12.5, 40.0]),
            result(ServeMode::Leases(LeaseMode::default()), vec![0.0, 0.0, 0.0]),
        ];
        let day = markdown(&results);
        let lines: Vec<&str> = day.lines().collect();
        assert_eq!(lines.len(), 4, "{day}");
        let columns = lines[0].matches('|').count();
        assert!(
            lines.iter().all(|l| l.matches('|').count() == columns),
            "{day}"
        );
        assert!(
            lines[2].contains("| decisions | 10 s |") && lines[2].contains("12.50 / 40.00 / 40.00")
        );
        assert!(lines[2].contains("| 4.00 | 3.00 | 100 |"), "{}", lines[2]);
        assert!(lines[2].contains("| – | – | – |"), "{}", lines[2]);
        assert!(
            lines[3].contains("| 7 / 5 / 2 | 9 / 4 | 11 |"),
            "{}",
            lines[3]
        );

        let fast = fast_markdown(&results);
        let lines: Vec<&str> = fast.lines().collect();
        assert_eq!(lines.len(), 4, "{fast}");
        assert!(lines[2].contains("| 2 of 3 | 40.00 |"), "{}", lines[2]);
        assert!(
            lines[3].contains("| leases | 10 s | 0 of 3 | 0.00 |"),
            "{}",
            lines[3]
        );
        assert!(summary(&results[1]).contains("5 granted, 2 zero"));
    }
}
