//! The whole pipeline on real processes: sustained throughput, then
//! freshness at half that rate.

use std::time::Duration;

use adspend_bench::report::{number, Samples, Table, Target};
use adspend_bench::{e2e, host};
use adspend_harness::pipeline::Backends;

use crate::Args;

/// A NATS sync setting of the end-to-end runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum NatsSync {
    /// `sync_interval: always`: an fsync per stored message.
    Durable,
    /// NATS's default (a sync every two minutes).
    Default,
}

pub(crate) async fn end_to_end(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let catalog = adspend_sim::generate_catalog(&adspend_sim::CatalogSpec::for_ads(args.ads), 3)?;
    for sync in [NatsSync::Durable, NatsSync::Default] {
        if !args.e2e_syncs.contains(&sync) {
            continue;
        }
        let durable = sync == NatsSync::Durable;
        let setting = if durable {
            "sync_interval always"
        } else {
            "NATS default sync (2 min)"
        };
        let (mut p50, mut p99) = (Samples::default(), Samples::default());
        // One series a format; the formats run back to back, run by run.
        let mut rates: Vec<Samples> = args
            .input_formats
            .iter()
            .map(|_| Samples::default())
            .collect();
        // A pipeline of the contract's defaults and `--e2e-service-env`,
        // once the machine is done with the memory the last one freed.
        let start = || async {
            host::settle().await;
            e2e::start_with_ports(
                catalog.clone(),
                durable,
                Backends::default(),
                &args.e2e_service_env,
            )
            .await
            .map(|(p, _)| p)
        };
        for run in 0..args.runs {
            let half = match args.e2e_fresh_rate {
                Some(rate) => rate,
                None => {
                    let mut half = None;
                    for (&format, rates) in args.input_formats.iter().zip(&mut rates) {
                        let p = start().await?;
                        let result = e2e::sustained(
                            &p,
                            Duration::from_secs(args.e2e_secs),
                            args.batch,
                            100 + run as u64,
                            format,
                        )
                        .await?;
                        drop(p);
                        anyhow::ensure!(
                            result.exact,
                            "end-to-end run {run} ({setting}, {format}) did not match the truth"
                        );
                        println!(
                            "bench:   e2e {setting}, {format}: {} events in {:.1}s = {} events/s, exact",
                            result.events,
                            result.secs,
                            number(result.events_per_sec)
                        );
                        rates.push(result.events_per_sec);
                        half.get_or_insert(result.events_per_sec / 2.0);
                    }
                    half.unwrap_or(0.0)
                }
            };
            // A fresh pipeline, so the state (and each checkpoint's size) is
            // what the half-rate run builds, not what the full-rate run left.
            let p = start().await?;
            let fresh = e2e::freshness(
                &p,
                half,
                Duration::from_secs(30),
                args.batch,
                200 + run as u64,
            )
            .await?;
            println!(
                "bench:   freshness at {} events/s ({} achieved): p50 {:.0} ms, p99 {:.0} ms over {} pushes",
                number(half),
                number(fresh.events_per_sec),
                fresh.p50_ms,
                fresh.p99_ms,
                fresh.pushes
            );
            println!(
                "bench:     into IMPRESSIONS (oldest ts -> stored): {}",
                fresh.stages.impressions.summary()
            );
            println!(
                "bench:     into SPEND (source -> stored): {}",
                fresh.stages.spend.summary()
            );
            println!(
                "bench:     pushes (source -> received beside the pacer): {}",
                fresh.stages.pushes.summary()
            );
            if let Some(dir) = &args.e2e_stages_csv {
                std::fs::create_dir_all(dir)?;
                let kind = if durable { "durable" } else { "default-sync" };
                let path = dir.join(format!("freshness-{kind}-{run}.csv"));
                std::fs::write(&path, fresh.stages.csv())?;
                println!("bench:     delays written to {}", path.display());
            }
            p50.push(fresh.p50_ms);
            p99.push(fresh.p99_ms);
        }
        let notes: Vec<String> = args
            .input_formats
            .iter()
            .map(|format| {
                let mut note = format!(
                    "{} s sustained, {format} {} events/message, 5% duplicates, {setting}",
                    args.e2e_secs, args.batch
                );
                for (name, value) in &args.e2e_service_env {
                    note.push_str(&format!(", {name}={value}"));
                }
                note
            })
            .collect();
        // Issue 10's targets: the rate durable, the freshness in both sync
        // settings.
        let rate_target = || {
            durable.then_some(Target {
                text: ">= 600,000",
                bound: 600_000.0,
                higher: true,
            })
        };
        // The freshness target is at half the sustained rate.
        let p99_target = args.e2e_fresh_rate.is_none().then_some(Target {
            text: "<= 150",
            bound: 150.0,
            higher: false,
        });
        let at = match args.e2e_fresh_rate {
            Some(rate) => format!("at {} events/s", number(rate)),
            None => {
                let formats = args.input_formats.iter().zip(rates).zip(notes);
                for ((format, rates), note) in formats {
                    let name = if args.input_formats.len() > 1 {
                        format!("end to end ({setting}, {format})")
                    } else {
                        format!("end to end ({setting})")
                    };
                    table.add(name, "impressions/s", rates, rate_target(), note);
                }
                "at half rate (the first format's)".to_string()
            }
        };
        table.add(
            format!("freshness p50 {at} ({setting})"),
            "ms",
            p50,
            None,
            "published → in the pacer",
        );
        table.add(
            format!("freshness p99 {at} ({setting})"),
            "ms",
            p99,
            p99_target,
            "published → in the pacer",
        );
    }
    Ok(())
}
