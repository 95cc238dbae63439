//! A soak: the whole pipeline at a steady rate for a long time, every store
//! and every process sampled at an interval, to show that nothing grows
//! without bound. A store that a retention setting bounds climbs during the
//! warm-up (its window filling) and then stays level; one that grows after
//! the warm-up is a leak, whatever the rate.
//!
//! What is sampled: each JetStream stream's bytes and messages (as NATS
//! reports them), NATS's store directory, every top-level entry of the
//! services' data directory (the aggregator's LMDB, the file object store's
//! snapshots, the pacer's data), and the resident memory of NATS and of each
//! service. What is judged: over the second half of the run (which starts
//! after the warm-up), the growth of each by a least-squares line through
//! its samples, so one noisy sample cannot make or break a verdict.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::TryStreamExt as _;
use tokio_util::sync::CancellationToken;

use adspend_harness::pipeline::Pipeline;
use adspend_sim::{self as sim, SimConfig};

/// One series: a name, its unit, and `(seconds since the start, value)`.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    pub unit: &'static str,
    pub points: Vec<(f64, f64)>,
}

/// A line fitted through points: `value = intercept + slope * t`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    pub intercept: f64,
    pub slope: f64,
}

impl Line {
    pub fn at(&self, t: f64) -> f64 {
        self.intercept + self.slope * t
    }
}

/// The least-squares line through `points`; `None` for fewer than two
/// distinct times.
pub fn fit(points: &[(f64, f64)]) -> Option<Line> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mean_t = points.iter().map(|p| p.0).sum::<f64>() / n;
    let mean_v = points.iter().map(|p| p.1).sum::<f64>() / n;
    let var_t: f64 = points.iter().map(|p| (p.0 - mean_t).powi(2)).sum();
    if var_t == 0.0 {
        return None;
    }
    let cov: f64 = points.iter().map(|p| (p.0 - mean_t) * (p.1 - mean_v)).sum();
    let slope = cov / var_t;
    Some(Line {
        intercept: mean_v - slope * mean_t,
        slope,
    })
}

/// How a series moved over the judged interval `[from, to]`.
#[derive(Debug, Clone, Copy)]
pub struct Growth {
    /// The fitted value at `from` and at `to`.
    pub start: f64,
    pub end: f64,
    /// Per hour, in the series' unit.
    pub slope_per_hour: f64,
    /// `end` over `start`, as a percentage change.
    pub percent: f64,
}

/// The growth of `series` over `[from, to]` by the line through its points
/// in that interval; `None` with fewer than two points there.
pub fn growth(series: &Series, from: f64, to: f64) -> Option<Growth> {
    let inside: Vec<(f64, f64)> = series
        .points
        .iter()
        .copied()
        .filter(|(t, _)| *t >= from && *t <= to)
        .collect();
    let line = fit(&inside)?;
    let (start, end) = (line.at(from), line.at(to));
    let percent = if start.abs() < f64::EPSILON {
        if end.abs() < f64::EPSILON {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        (end - start) / start * 100.0
    };
    Some(Growth {
        start,
        end,
        slope_per_hour: line.slope * 3600.0,
        percent,
    })
}

/// What a soak runs.
#[derive(Debug, Clone)]
pub struct SoakConfig {
    pub rate: f64,
    pub duration: Duration,
    pub interval: Duration,
    pub batch: usize,
    /// Share of events published malformed (they go to `DEADLETTER`).
    pub bad_rate: f64,
    pub seed: u64,
}

/// Everything a soak sampled, and how it ended.
#[derive(Debug)]
pub struct Soak {
    pub series: Vec<Series>,
    pub events: u64,
    pub events_per_sec: f64,
    pub exact: bool,
    /// Seconds from the end of publishing until the pacer equalled the truth.
    pub settle_secs: f64,
}

/// Runs the simulator at `config.rate` for `config.duration` against `p`,
/// sampling every `config.interval` (and printing each sample), then waits
/// until the pacer equals the truth.
pub async fn run(p: &Pipeline, config: &SoakConfig) -> anyhow::Result<Soak> {
    let client = p.client().await;
    let sim_config = SimConfig {
        subject: "impressions.soak".into(),
        events: None,
        duration: Some(config.duration),
        rate: config.rate,
        batch: config.batch,
        duplicate_rate: 0.05,
        bad_rate: config.bad_rate,
        seed: config.seed,
        in_flight: 64,
        progress_interval: Duration::from_secs(3600),
        create_stream: false,
        ..SimConfig::default()
    };
    let started = Instant::now();
    let publishing = {
        let client = client.clone();
        let catalog = p.catalog.clone();
        tokio::spawn(async move {
            sim::run(&client, &sim_config, &catalog, CancellationToken::new()).await
        })
    };
    let mut samples: BTreeMap<String, Series> = BTreeMap::new();
    let mut next = started;
    while !publishing.is_finished() {
        let t = started.elapsed().as_secs_f64();
        let sample = sample(p, &client).await?;
        print_sample(t, &sample);
        for (name, unit, value) in sample {
            samples
                .entry(name.clone())
                .or_insert_with(|| Series {
                    name,
                    unit,
                    points: Vec::new(),
                })
                .points
                .push((t, value));
        }
        next += config.interval;
        tokio::select! {
            _ = tokio::time::sleep_until(next.into()) => {}
            _ = wait_finished(&publishing) => {}
        }
    }
    let truth = publishing.await.context("simulator task")??;
    anyhow::ensure!(
        truth.stats.messages_failed == 0,
        "{} publishes failed",
        truth.stats.messages_failed
    );
    let published = Instant::now();
    let run = super::e2e::settle(p, &truth, truth.stats.events_acked, started).await?;
    Ok(Soak {
        series: samples.into_values().collect(),
        events: truth.stats.events_acked,
        events_per_sec: truth.stats.events_per_sec,
        exact: run.exact,
        settle_secs: published.elapsed().as_secs_f64(),
    })
}

async fn wait_finished<T>(handle: &tokio::task::JoinHandle<T>) {
    while !handle.is_finished() {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

type Sample = Vec<(String, &'static str, f64)>;

/// One reading of every store and process.
async fn sample(p: &Pipeline, client: &async_nats::Client) -> anyhow::Result<Sample> {
    let mut out = Sample::new();
    let js = async_nats::jetstream::new(client.clone());
    let mut streams = js.streams();
    while let Some(info) = streams.try_next().await.context("listing streams")? {
        let name = info.config.name.clone();
        out.push((format!("stream {name}"), "MB", mb(info.state.bytes)));
        out.push((
            format!("stream {name} messages"),
            "msgs",
            info.state.messages as f64,
        ));
    }
    out.push((
        "NATS store dir".into(),
        "MB",
        mb(dir_bytes(p.nats.store_dir())),
    ));
    if let Ok(entries) = std::fs::read_dir(p.dir.path()) {
        let mut dirs: Vec<_> = entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .collect();
        dirs.sort_by_key(|e| e.file_name());
        for entry in dirs {
            // The data directory of the services, and each of its parts.
            let top = entry.file_name().to_string_lossy().into_owned();
            for part in std::fs::read_dir(entry.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let name = part.file_name().to_string_lossy().into_owned();
                let bytes = if part.file_type().is_ok_and(|t| t.is_dir()) {
                    dir_bytes(&part.path())
                } else {
                    part.metadata().map_or(0, |m| m.len())
                };
                out.push((format!("dir {top}/{name}"), "MB", mb(bytes)));
            }
        }
    }
    let processes = [
        ("nats-server", p.nats.pid()),
        ("limiter", p.limiter.as_ref().map(|s| s.pid())),
        ("aggregator", p.aggregator.as_ref().map(|s| s.pid())),
        ("pacer", p.pacer.as_ref().map(|s| s.pid())),
    ];
    for (name, pid) in processes {
        if let Some(kib) = pid.and_then(rss_kib) {
            out.push((format!("RSS {name}"), "MB", kib as f64 / 1024.0));
        }
    }
    Ok(out)
}

fn print_sample(t: f64, sample: &Sample) {
    let line: Vec<String> = sample
        .iter()
        .filter(|(name, _, _)| !name.ends_with(" messages"))
        .map(|(name, unit, value)| format!("{name} {value:.1} {unit}"))
        .collect();
    println!("bench:   soak {t:>6.0}s  {}", line.join(" | "));
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1_000_000.0
}

/// The bytes on disk of every file under `dir`, by allocated blocks as
/// `du` counts (LMDB's map file is sparse: its length is not its size).
pub fn dir_bytes(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt as _;
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                stack.push(entry.path());
            } else {
                total += meta.blocks() * 512;
            }
        }
    }
    total
}

/// A process's resident set, KiB, from `/proc`.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_line_through_level_points_has_no_growth() {
        let s = Series {
            name: "x".into(),
            unit: "MB",
            points: vec![(0.0, 10.0), (10.0, 10.0), (20.0, 10.0)],
        };
        let g = growth(&s, 0.0, 20.0).unwrap();
        assert!(g.percent.abs() < 1e-9);
        assert!(g.slope_per_hour.abs() < 1e-9);
    }

    #[test]
    fn growth_is_read_off_the_fitted_line_not_the_last_point() {
        // 100 -> 110 over 100 s, with one outlier that the fit averages out.
        let mut points: Vec<(f64, f64)> = (0..=10)
            .map(|i| (i as f64 * 10.0, 100.0 + i as f64))
            .collect();
        points[10].1 = 150.0;
        let s = Series {
            name: "x".into(),
            unit: "MB",
            points,
        };
        let g = growth(&s, 0.0, 100.0).unwrap();
        assert!(g.percent > 10.0 && g.percent < 30.0, "{g:?}");
        let exact = fit(&[(0.0, 1.0), (1.0, 3.0)]).unwrap();
        assert_eq!(
            exact,
            Line {
                intercept: 1.0,
                slope: 2.0
            }
        );
    }

    #[test]
    fn points_outside_the_interval_are_left_out() {
        let s = Series {
            name: "x".into(),
            unit: "MB",
            points: vec![(0.0, 0.0), (5.0, 50.0), (10.0, 100.0), (20.0, 100.0)],
        };
        let g = growth(&s, 10.0, 20.0).unwrap();
        assert!(g.percent.abs() < 1e-9);
        assert!(growth(&s, 30.0, 40.0).is_none());
    }
}
