//! Fair sharing among sources: per source freshness p50/p99 while steady
//! and while A floods (10x) or replays a backlog, with the limiter's `fair`
//! and `fifo` scheduling on the same traffic.

use std::time::Duration;

use adspend_bench::fair::{self, Scenario, Surge, SOURCES};
use adspend_bench::host;
use adspend_bench::report::{Samples, Table};
use adspend_sim::stats::quantile;

use crate::Args;

/// A's surge in the fair section (`--fair-surges`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum FairSurge {
    /// The control: A keeps its rate.
    None,
    Flood,
    Backlog,
}

/// The limiter's scheduling (`--fair-scheduling`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Scheduling {
    Fair,
    Fifo,
}

impl Scheduling {
    /// The value of `ADSPEND_LIMITER_SCHEDULING`.
    fn as_str(self) -> &'static str {
        match self {
            Scheduling::Fair => "fair",
            Scheduling::Fifo => "fifo",
        }
    }
}

pub(crate) async fn fair_sharing(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let surges = args.fair_surges.iter().map(|surge| match surge {
        FairSurge::None => ("none", Surge::None),
        FairSurge::Flood => ("flood 10x", Surge::Flood),
        FairSurge::Backlog => ("backlog", Surge::Backlog(args.fair_backlog)),
    });
    let mut lines = vec![
        "| A's surge | scheduling | source | steady p50 ms | steady p99 ms | surge p50 ms | surge p99 ms | surge p99 once A's backlog is stored, ms | into stream, steady p99 ms | into stream, surge p99 ms | stream to pacer, steady p99 ms | stream to pacer, surge p99 ms | events |".to_string(),
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |".to_string(),
    ];
    for (surge_name, surge) in surges {
        for scheduling in args.fair_scheduling.iter().map(|s| s.as_str()) {
            let (mut worst_ratio, mut drain) = (Samples::default(), Samples::default());
            let (mut after, mut backlog_drained) = (Samples::default(), Samples::default());
            let mut pipeline_ratio = Samples::default();
            for run in 0..args.runs {
                // Not while the run before's memory goes back to the
                // hypervisor (`host`).
                host::settle().await;
                let outcome = fair::run(&Scenario {
                    scheduling,
                    surge,
                    rate: args.fair_rate,
                    batch: 100,
                    steady: Duration::from_secs(5),
                    surge_for: Duration::from_secs(args.fair_secs),
                    limiter_env: args.fair_limiter_env.clone(),
                    max_unacked: args.fair_max_unacked,
                })
                .await?;
                anyhow::ensure!(
                    outcome.exact,
                    "fair sharing run ({surge_name}, {scheduling}) did not match what was published"
                );
                if let Some(dir) = &args.fair_csv {
                    std::fs::create_dir_all(dir)?;
                    let path = dir.join(format!(
                        "fair-{}-{scheduling}-{run}.csv",
                        surge_name.replace(' ', "-")
                    ));
                    let mut csv = String::from("source,kind,at_s,delay_ms\n");
                    for source in SOURCES {
                        csv.push_str(&outcome.sources[source].csv_lines(source));
                    }
                    std::fs::write(&path, csv)?;
                    println!("bench:   run {run}: delays written to {}", path.display());
                }
                let (mut ratio, mut after_ratio, mut from_stream): (f64, f64, f64) =
                    (0.0, 0.0, 0.0);
                for source in SOURCES {
                    let r = &outcome.sources[source];
                    let ms = |v: &[f64], q| quantile(v, q) * 1000.0;
                    let line = format!(
                        "| {surge_name} | {scheduling} | {source} | {:.0} | {:.0} | {:.0} | {:.0} | {} | {:.0} | {:.0} | {:.0} | {:.0} | {} |",
                        ms(&r.steady, 0.5),
                        ms(&r.steady, 0.99),
                        ms(&r.surge, 0.5),
                        ms(&r.surge, 0.99),
                        if r.after_stored.is_empty() {
                            "–".to_string()
                        } else {
                            format!("{:.0}", ms(&r.after_stored, 0.99))
                        },
                        ms(&r.ingest_steady, 0.99),
                        ms(&r.ingest_surge, 0.99),
                        ms(&r.pipeline_steady, 0.99),
                        ms(&r.pipeline_surge, 0.99),
                        r.events
                    );
                    println!("bench:   run {run}: {line}");
                    if run == 0 {
                        lines.push(line);
                    }
                    if source != "A" {
                        let steady = quantile(&r.steady, 0.99);
                        ratio = ratio.max(quantile(&r.surge, 0.99) / steady);
                        after_ratio = after_ratio.max(quantile(&r.after_stored, 0.99) / steady);
                        from_stream = from_stream.max(
                            quantile(&r.pipeline_surge, 0.99) / quantile(&r.pipeline_steady, 0.99),
                        );
                    }
                }
                println!(
                    "bench:   run {run}: {surge_name}, {scheduling}: A drained {:.1} s after publishing ended; worst B-E p99 surge/steady {ratio:.1}x, from the stream to the pacer {from_stream:.1}x",
                    outcome.a_drain_secs
                );
                pipeline_ratio.push(from_stream);
                if let (Some(stored), Some(drained)) =
                    (outcome.backlog_stored_secs, outcome.backlog_drained_secs)
                {
                    println!(
                        "bench:   run {run}: {surge_name}, {scheduling}: A's backlog stored {stored:.2} s and in the pacer {drained:.2} s into the surge; worst B-E p99 once stored/steady {after_ratio:.1}x"
                    );
                    after.push(after_ratio);
                    backlog_drained.push(drained);
                }
                worst_ratio.push(ratio);
                drain.push(outcome.a_drain_secs);
            }
            let mut note = format!(
                "A–E at {} events/s each, 100 events/message; A {surge_name}; limiter {scheduling}",
                args.fair_rate
            );
            for (name, value) in &args.fair_limiter_env {
                note.push_str(&format!(", {name}={value}"));
            }
            table.add(
                format!(
                    "fair sharing: B–E p99 freshness, surge / steady ({surge_name}, {scheduling})"
                ),
                "x",
                worst_ratio,
                None,
                note.clone(),
            );
            table.add(
                format!(
                    "fair sharing: B–E p99 from stored in IMPRESSIONS to the pacer, surge / steady ({surge_name}, {scheduling})"
                ),
                "x",
                pipeline_ratio,
                None,
                note.clone(),
            );
            if !after.values.is_empty() {
                table.add(
                    format!(
                        "fair sharing: B–E p99 freshness once A's backlog is stored / steady ({surge_name}, {scheduling})"
                    ),
                    "x",
                    after,
                    None,
                    note.clone(),
                );
                table.add(
                    format!(
                        "fair sharing: A's backlog in the pacer after the surge began ({surge_name}, {scheduling})"
                    ),
                    "s",
                    backlog_drained,
                    None,
                    note.clone(),
                );
            }
            table.add(
                format!(
                    "fair sharing: A drained after publishing ended ({surge_name}, {scheduling})"
                ),
                "s",
                drain,
                None,
                note,
            );
        }
    }
    println!(
        "\nbench: per-source freshness (first run):\n{}",
        lines.join("\n")
    );
    Ok(())
}
