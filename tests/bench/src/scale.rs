//! How the pipeline scales with the machine: the two CPU stages without
//! NATS at a given number of threads (the limiter's mapping of chunks, the
//! aggregator's apply with one writer per shard), and the whole pipeline
//! with given numbers of limiter and aggregator processes, each run ending
//! exact, with the share of each process's CPU its hottest thread took.

use std::collections::HashMap;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use adspend_harness::pipeline::{Backends, Pipeline};
use adspend_harness::{free_port, NatsOptions, ServiceProcess};
use adspend_limiter::chunk::{Mapping, RawInput};
use adspend_sim::Catalog;

use crate::state::{self, Skew};

/// Each thread's name and CPU ticks, by thread id.
pub type Ticks = HashMap<u32, (String, u64)>;

/// One process's ticks: its role, its pid, its threads'.
pub type ProcessTicks = (String, u32, Ticks);

/// CPU ticks (user + system) of each thread of process `pid`, by thread id,
/// with the thread's name.
pub fn thread_ticks(pid: u32) -> Ticks {
    let mut threads = HashMap::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return threads;
    };
    for task in tasks.flatten() {
        let Ok(stat) = std::fs::read_to_string(task.path().join("stat")) else {
            continue;
        };
        // `tid (name) state ...`: the name may hold spaces, so split at
        // the last ')'; utime and stime are the 12th and 13th fields after.
        let (Some(open), Some(close)) = (stat.find('('), stat.rfind(')')) else {
            continue;
        };
        let name = stat[open + 1..close].to_string();
        let fields: Vec<&str> = stat[close + 2..].split_whitespace().collect();
        let ticks = |i: usize| {
            fields
                .get(i)
                .and_then(|f| f.parse::<u64>().ok())
                .unwrap_or(0)
        };
        if let Ok(tid) = task.file_name().to_string_lossy().parse() {
            threads.insert(tid, (name, ticks(11) + ticks(12)));
        }
    }
    threads
}

/// The hottest thread between two samples of one process: its name and
/// its share of the process's CPU time then (0..=1), and the process's CPU
/// time in ticks.
pub fn hottest(before: &Ticks, after: &Ticks) -> (String, f64, u64) {
    let mut total = 0;
    let mut top = (String::new(), 0u64);
    for (tid, (name, ticks)) in after {
        let spent = ticks - before.get(tid).map_or(0, |(_, t)| *t).min(*ticks);
        total += spent;
        if spent > top.1 {
            top = (name.clone(), spent);
        }
    }
    let share = if total == 0 {
        0.0
    } else {
        top.1 as f64 / total as f64
    };
    (top.0, share, total)
}

/// The limiter's mapping of `workload` over `catalog`, as a service maps.
pub fn mapping(catalog: &Catalog, dir: &Path, partitions: u32) -> anyhow::Result<Mapping> {
    let path = dir.join("catalog.json");
    catalog.save(&path)?;
    let parsed = adspend_wire::catalog::Catalog::parse("bench", &std::fs::read(&path)?)?;
    let (_tx, catalog) = tokio::sync::watch::channel(Arc::new(parsed));
    Ok(Mapping {
        catalog,
        partitions,
        tuples_per_message: 20_000,
        max_cost_micros: 1_000_000_000_000,
        max_payload: 8 << 20,
    })
}

/// Impressions per second the limiter's CPU path maps on `threads`
/// threads: each takes the next chunk of `chunk` of `messages` (a
/// workload's, in one format: [`crate::workload::Workload::messages_in`]),
/// maps it through the catalog and encodes its output, until none is left.
pub fn limiter_cpu(
    mapping: &Mapping,
    messages: &[bytes::Bytes],
    chunk: usize,
    threads: usize,
) -> f64 {
    let chunks: Vec<&[bytes::Bytes]> = messages.chunks(chunk.max(1)).collect();
    let next = AtomicUsize::new(0);
    let started = Instant::now();
    let impressions: u64 = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..threads.max(1))
            .map(|_| {
                scope.spawn(|| {
                    let mut mapped = 0;
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        let Some(messages) = chunks.get(i) else { break };
                        let inputs: Vec<RawInput<'_>> = messages
                            .iter()
                            .enumerate()
                            .map(|(j, payload)| RawInput {
                                stream_seq: (i * chunk + j) as u64 + 1,
                                published_ms: adspend_common::now_ms(),
                                delivered: 1,
                                payload,
                            })
                            .collect();
                        mapped += mapping.map_inputs(&inputs).out.impressions;
                    }
                    mapped
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap_or(0)).sum()
    });
    impressions as f64 / started.elapsed().as_secs_f64()
}

/// Tuples per second the aggregator applies with `writers` writers, each
/// a shard of its own (its own LMDB under `dir` and its own limits, as the
/// partitions split them), each applying `groups` transactions of 200,000
/// tuples, generated beforehand, after a warm-up. Only the writers are
/// timed, from the first group to the last writer's last commit.
pub fn aggregator_apply(
    dir: &Path,
    writers: usize,
    limits: usize,
    groups: usize,
) -> anyhow::Result<f64> {
    let writers = writers.max(1);
    let mut prepared = Vec::new();
    for w in 0..writers {
        let (mut writer, _store, dirty) = state::writer(&dir.join(format!("w{w}")))?;
        let mut feed = state::Feed::new(limits / writers, Skew::Zipf(1.0), w as u64 + 1)?;
        state::apply_rate(&mut writer, &dirty, &mut feed, 5)?;
        let work: Vec<_> = (0..groups).map(|_| feed.group()).collect();
        prepared.push((writer, dirty, work));
    }
    let started = Instant::now();
    let applied: anyhow::Result<Vec<u64>> = std::thread::scope(|scope| {
        let running: Vec<_> = prepared
            .iter_mut()
            .map(|(writer, dirty, work)| {
                scope.spawn(move || -> anyhow::Result<u64> {
                    let mut tuples = 0;
                    for group in work.iter() {
                        tuples += writer.apply_group(group)?.applied;
                        drop(dirty.take());
                    }
                    Ok(tuples)
                })
            })
            .collect();
        running
            .into_iter()
            .map(|r| r.join().map_err(|_| anyhow::anyhow!("a writer panicked"))?)
            .collect()
    });
    let tuples: u64 = applied?.iter().sum();
    Ok(tuples as f64 / started.elapsed().as_secs_f64())
}

/// A pipeline of `limiters` limiter processes sharing one consumer and
/// `aggregators` single-machine aggregators splitting the partitions round
/// robin (each its own data dir), one pacer; `env` on top of the
/// benchmark's service settings.
pub struct ProcessSet {
    pub pipeline: Pipeline,
    pub limiters: Vec<ServiceProcess>,
    pub aggregators: Vec<ServiceProcess>,
}

impl ProcessSet {
    pub async fn start(
        catalog: Catalog,
        limiters: usize,
        aggregators: usize,
        env: &[(String, String)],
    ) -> anyhow::Result<ProcessSet> {
        let options = NatsOptions {
            lazy_sync: false,
            ..NatsOptions::default()
        };
        let mut settings: Vec<(String, String)> = crate::e2e::SERVICE_ENV
            .iter()
            .filter(|(k, _)| !env.iter().any(|(e, _)| e == k))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        settings.extend(env.iter().cloned());
        let partitions: u32 = settings
            .iter()
            .find(|(k, _)| k == "ADSPEND_PARTITIONS")
            .and_then(|(_, v)| v.parse().ok())
            .unwrap_or(16);
        let mut pipeline = Pipeline::start_with(Backends::default(), options, catalog).await;
        let with = |extra: &[(String, String)]| -> Vec<(String, String)> {
            let mut all = settings.clone();
            all.retain(|(k, _)| !extra.iter().any(|(e, _)| e == k));
            all.extend(extra.iter().cloned());
            all
        };
        let spawn = |p: &Pipeline, service: &str, extra: &[(String, String)]| {
            let all = with(extra);
            let refs: Vec<(&str, &str)> =
                all.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            p.spawn_with(service, free_port(), &refs)
        };
        let mut aggregator_set = Vec::new();
        let aggregators = aggregators.max(1);
        for a in 0..aggregators {
            let owned: Vec<String> = (0..partitions)
                .filter(|p| *p as usize % aggregators == a)
                .map(|p| p.to_string())
                .collect();
            let dir = pipeline.aggregator_dir().join(format!("a{a}"));
            let extra = vec![
                ("ADSPEND_AGGREGATOR_PARTITIONS".to_string(), owned.join(",")),
                ("ADSPEND_DATA_DIR".to_string(), dir.display().to_string()),
            ];
            aggregator_set.push(spawn(&pipeline, "aggregator", &extra));
        }
        let mut limiter_set = Vec::new();
        for _ in 0..limiters.max(1) {
            limiter_set.push(spawn(&pipeline, "limiter", &[]));
        }
        pipeline.pacer = Some(spawn(&pipeline, "pacer", &[]));
        pipeline.wait_pacer().await;
        adspend_sim::ensure_stream(&pipeline.client().await).await?;
        Ok(ProcessSet {
            pipeline,
            limiters: limiter_set,
            aggregators: aggregator_set,
        })
    }

    /// Every service process with its role, for CPU samples.
    pub fn processes(&self) -> Vec<(String, u32)> {
        let mut all = Vec::new();
        for (i, l) in self.limiters.iter().enumerate() {
            all.push((format!("limiter{}", i + 1), l.pid()));
        }
        for (i, a) in self.aggregators.iter().enumerate() {
            all.push((format!("aggregator{}", i + 1), a.pid()));
        }
        if let Some(pacer) = &self.pipeline.pacer {
            all.push(("pacer".to_string(), pacer.pid()));
        }
        all
    }
}

/// One process's CPU over a run: its hottest thread and that thread's
/// share, and the cores it used on average.
#[derive(Debug, Clone)]
pub struct ProcessCpu {
    pub role: String,
    pub hottest: String,
    pub share: f64,
    pub cores: f64,
}

/// Sample every process of `set` now; [`cpu_since`] reads them again.
pub fn sample(set: &ProcessSet) -> Vec<ProcessTicks> {
    set.processes()
        .into_iter()
        .map(|(role, pid)| (role, pid, thread_ticks(pid)))
        .collect()
}

/// Each process's CPU since `before`, `elapsed` apart.
pub fn cpu_since(before: &[ProcessTicks], elapsed: Duration) -> Vec<ProcessCpu> {
    // The kernel's clock ticks per second (USER_HZ), 100 on Linux.
    const HZ: f64 = 100.0;
    before
        .iter()
        .map(|(role, pid, ticks)| {
            let (hottest, share, total) = hottest(ticks, &thread_ticks(*pid));
            ProcessCpu {
                role: role.clone(),
                hottest,
                share,
                cores: total as f64 / HZ / elapsed.as_secs_f64().max(1e-9),
            }
        })
        .collect()
}

/// What the machine itself gives from more threads, as a floor under the
/// stage speedups: operations per second on `threads` threads at once of
/// (a) integer arithmetic touching no memory, and (b) dependent-free random
/// 8-byte reads from a 32 MiB table per thread, beyond the caches as the
/// catalog lookups, dedupe set and B-trees of the stages are.
pub fn machine(threads: usize) -> (f64, f64) {
    fn compute(n: u64) -> u64 {
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        for i in 0..n {
            x = x.rotate_left(7) ^ i.wrapping_mul(0x2545_f491_4f6c_dd1d);
        }
        x
    }
    fn reads(n: u64, seed: u64) -> u64 {
        const SIZE: usize = 1 << 22;
        let table: Vec<u64> = (0..SIZE as u64).map(|i| i ^ seed).collect();
        let (mut x, mut sum) = (seed, 0u64);
        for _ in 0..n {
            x = x
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            sum = sum.wrapping_add(table[(x >> 20) as usize & (SIZE - 1)]);
        }
        sum
    }
    let run = |work: &(dyn Fn(u64) -> u64 + Sync), n: u64| -> f64 {
        let started = Instant::now();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..threads.max(1))
                .map(|i| scope.spawn(move || std::hint::black_box(work(n + i as u64 % 2))))
                .collect();
            for h in handles {
                let _ = h.join();
            }
        });
        (threads.max(1) as u64 * n) as f64 / started.elapsed().as_secs_f64()
    };
    let compute_rate = run(&|n| compute(n), 1_000_000_000);
    let read_rate = run(&|n| reads(n, n), 60_000_000);
    (compute_rate, read_rate)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hottest_thread_is_read_from_proc() {
        let me = std::process::id();
        assert!(!thread_ticks(me).is_empty(), "this process has threads");
        let before = thread_ticks(me);
        let until = Instant::now() + Duration::from_millis(300);
        let mut x = 0u64;
        while Instant::now() < until {
            x = x.wrapping_mul(31).wrapping_add(7);
        }
        assert!(x != 1);
        let (_, share, total) = hottest(&before, &thread_ticks(me));
        assert!(total > 0, "ticks counted");
        assert!(share > 0.5, "one busy thread dominates: {share}");
    }
}
