//! `--sections soak`: the pipeline at a steady rate for a long time; every
//! store and process sampled; a row per series with its growth over the
//! second half of the run (after the warm-up) and its slope.

use std::time::Duration;

use adspend_bench::report::{Table, Target};
use adspend_bench::soak::{self, SoakConfig};
use adspend_harness::pipeline::Backends;

use crate::{samples, Args};

/// Settings of the soak's services, on top of the benchmark defaults:
/// windows short enough that a run of half an hour sees each fill and
/// level off (`--soak-service-env` overrides them; the docs give the
/// defaults' run too).
const SHORT_WINDOWS: &[(&str, &str)] = &[
    ("ADSPEND_INPUT_RETENTION_MS", "300000"),
    ("ADSPEND_DEDUPE_WINDOW_MS", "300000"),
    ("ADSPEND_DEADLETTER_RETENTION_MS", "300000"),
    ("ADSPEND_CHECKPOINT_INTERVAL_MS", "2000"),
    ("ADSPEND_SPEND_TRIM", "checkpoint"),
];

pub(crate) async fn soak(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    anyhow::ensure!(
        args.soak_secs >= 4 * args.soak_interval_secs,
        "--soak-secs must be at least four sampling intervals (--soak-interval-secs)"
    );
    let mut env: Vec<(String, String)> = if args.soak_default_windows {
        Vec::new()
    } else {
        SHORT_WINDOWS
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    };
    for (k, v) in &args.soak_service_env {
        env.retain(|(e, _)| e != k);
        env.push((k.clone(), v.clone()));
    }
    let settings: Vec<String> = env.iter().map(|(k, v)| format!("{k}={v}")).collect();
    println!(
        "bench: soak at {} events/s for {} s, sampled every {} s, durable NATS; settings: {}",
        args.soak_rate,
        args.soak_secs,
        args.soak_interval_secs,
        if settings.is_empty() {
            "the defaults".to_string()
        } else {
            settings.join(" ")
        }
    );
    let catalog = adspend_sim::generate_catalog(&adspend_sim::CatalogSpec::for_ads(args.ads), 11)?;
    let (p, _) =
        adspend_bench::e2e::start_with_ports(catalog, true, Backends::default(), &env).await?;
    let result = soak::run(
        &p,
        &SoakConfig {
            rate: args.soak_rate,
            duration: Duration::from_secs(args.soak_secs),
            interval: Duration::from_secs(args.soak_interval_secs),
            batch: args.batch,
            bad_rate: args.soak_bad_rate,
            seed: 7,
        },
    )
    .await?;
    let (half, end) = (args.soak_secs as f64 / 2.0, args.soak_secs as f64);
    println!(
        "bench: soak published {} events ({:.0}/s); exact at the end: {} ({:.1} s after the last publish)",
        result.events, result.events_per_sec, result.exact, result.settle_secs
    );
    anyhow::ensure!(result.exact, "the soak did not end exact");
    // Message counts are printed with every sample; the table judges sizes.
    for series in result.series.iter().filter(|s| s.unit == "MB") {
        let Some(g) = soak::growth(series, half, end) else {
            continue;
        };
        let level = series.points.last().map_or(0.0, |p| p.1);
        // A series that stays tiny (an empty stream, a few kB of files)
        // has a percentage that means nothing; it is shown, not judged.
        let judged = g.start.max(g.end) >= 1.0;
        table.add(
            format!("soak: {} growth over the second half", series.name),
            "%",
            samples([g.percent]),
            judged.then_some(Target {
                text: "<= 5%",
                bound: 5.0,
                higher: false,
            }),
            format!(
                "{:.1} -> {:.1} {unit} (fitted), {:+.1} {unit}/h; last sample {:.1} {unit}",
                g.start,
                g.end,
                g.slope_per_hour,
                level,
                unit = series.unit
            ),
        );
    }
    Ok(())
}
