//! Incremental checkpoints as the state grows: per dedupe-id count, the
//! delta checkpoint of a fixed change (1% of the limits, 1% of the largest
//! id count) under load, the full base copy beside it, and a cold restore
//! of base + deltas.

use adspend_bench::checkpoint::{DeltaBench, DeltaRow};
use adspend_bench::report::{number, Samples, Table, Target};

use crate::{scratch, Args};

pub(crate) async fn deltas(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let sizes = args.delta_ids.clone();
    let largest = *sizes.iter().max().unwrap_or(&10_000_000);
    let bench = DeltaBench {
        limits: args.state_limits,
        sizes: sizes.clone(),
        hot_limits: (args.state_limits / 100).max(1),
        interval_ids: (largest / 100).max(1),
    };
    let mut runs: Vec<Vec<DeltaRow>> = Vec::new();
    for run in 0..args.runs {
        let dir = scratch(args, "deltas")?;
        let rows = bench
            .run(dir.path(), |row| {
                println!(
                    "bench:   deltas run {run}: {} ids: delta {:.3}s {} MB ({} tuples in the interval), \
                     ingest {} vs {} tuples/s; base {:.2}s {} MB; cold restore {:.2}s",
                    number(row.ids as f64),
                    row.delta_secs,
                    number(row.delta_bytes as f64 / 1e6),
                    number(row.interval_tuples as f64),
                    number(row.ingest_during),
                    number(row.ingest_before),
                    row.base_secs,
                    number(row.base_bytes as f64 / 1e6),
                    row.restore_secs,
                )
            })
            .await?;
        runs.push(rows);
    }
    let column = |i: usize, f: &dyn Fn(&DeltaRow) -> f64| -> Samples {
        let mut samples = Samples::default();
        for rows in &runs {
            samples.push(f(&rows[i]));
        }
        samples
    };
    for (i, size) in sizes.iter().enumerate() {
        // The store holds more than the size it was grown to by the time
        // the delta is taken (the warm-up and the interval add ids).
        let held = column(i, &|r| r.ids as f64).median();
        let note = format!(
            "{} limits, {} ids held (grown to {}); per interval {} limits and {} new ids change",
            number(args.state_limits as f64),
            number(held),
            number(*size as f64),
            number(bench.hot_limits as f64),
            number(bench.interval_ids as f64)
        );
        let at = format!("at {} ids", number(*size as f64));
        table.add(
            format!("checkpoint delta {at}"),
            "s",
            column(i, &|r| r.delta_secs),
            Some(Target {
                text: "<= 0.2",
                bound: 0.2,
                higher: false,
            }),
            note.clone(),
        );
        table.add(
            format!("checkpoint delta size {at}"),
            "MB",
            column(i, &|r| r.delta_bytes as f64 / 1e6),
            None,
            note.clone(),
        );
        table.add(
            format!("ingest during the delta / before {at}"),
            "%",
            column(i, &|r| 100.0 * r.ingest_during / r.ingest_before),
            Some(Target {
                text: ">= 95",
                bound: 95.0,
                higher: true,
            }),
            "the writer applying 200,000-tuple groups of the hot limits, during vs the interval before",
        );
        table.add(
            format!("full base copy {at}"),
            "s",
            column(i, &|r| r.base_secs),
            None,
            "compacted copy + upload + record: what every checkpoint cost before",
        );
        table.add(
            format!("full base size {at}"),
            "MB",
            column(i, &|r| r.base_bytes as f64 / 1e6),
            None,
            "",
        );
        table.add(
            format!("cold restore of base + delta {at}"),
            "s",
            column(i, &|r| r.restore_secs),
            Some(Target {
                text: "<= 5",
                bound: 5.0,
                higher: false,
            }),
            "download from file://, verify, apply; in process, no stream replay",
        );
    }
    Ok(())
}
