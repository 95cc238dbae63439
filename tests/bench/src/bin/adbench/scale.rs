//! How the pipeline scales: the limiter's CPU path and the aggregator's
//! apply at each of `--scale-threads`, then the whole pipeline with each
//! process set of `--scale-sets` (limiters x aggregators), every run exact,
//! with the share of its process's CPU the hottest thread of each service
//! took, and each set draining a backlog (`--scale-backlog`), where no
//! thread should carry more than 60% of its service. The same command runs
//! unchanged on any number of cores.

use std::time::{Duration, Instant};

use adspend_bench::report::{number, Samples, Table, Target};
use adspend_bench::scale::{self, ProcessSet};
use adspend_bench::workload::{Workload, WorkloadSpec};
use adspend_bench::{e2e, host};

use crate::{samples, scratch, Args};

/// `LxA`: limiter and aggregator processes; `none` for none.
pub(crate) fn process_set(text: &str) -> Result<Option<(usize, usize)>, String> {
    if text.trim() == "none" {
        return Ok(None);
    }
    let (l, a) = text
        .split_once('x')
        .ok_or_else(|| format!("{text:?}: LIMITERSxAGGREGATORS, e.g. 2x2"))?;
    let parse = |n: &str| n.trim().parse::<usize>().ok().filter(|&n| n >= 1);
    match (parse(l), parse(a)) {
        (Some(l), Some(a)) => Ok(Some((l, a))),
        _ => Err(format!("{text:?}: counts of 1 or more")),
    }
}

pub(crate) async fn scaling(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    if !args.scale_skip_stages {
        stages(args, table)?;
    }
    for &(limiters, aggregators) in args.scale_sets.iter().flatten() {
        pipeline(args, table, limiters, aggregators).await?;
        if args.scale_backlog > 0 {
            backlog(args, table, limiters, aggregators).await?;
        }
    }
    Ok(())
}

/// The two CPU stages without NATS, at each thread count.
fn stages(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let spec = WorkloadSpec {
        ads: args.ads,
        events: args.scale_events,
        batch: args.batch,
        duplicate_rate: 0.05,
        seed: 11,
    };
    println!(
        "bench: scale: generating {} events for the limiter's CPU path",
        number(spec.events as f64)
    );
    let workload = Workload::generate(&spec)?;
    let dir = scratch(args, "scale-catalog")?;
    let mapping = scale::mapping(&workload.catalog, dir.path(), 16)?;
    let base_threads = args.scale_threads.first().copied().unwrap_or(1);
    let (mut limiter_base, mut apply_base) = (None, None);
    let inputs: Vec<_> = args
        .input_formats
        .iter()
        .map(|&format| (format, workload.messages_in(format)))
        .collect();
    for (format, messages) in &inputs {
        let bytes: usize = messages.iter().map(bytes::Bytes::len).sum();
        println!(
            "bench:   {format}: {:.1} bytes per impression ({} bytes, {} events)",
            bytes as f64 / workload.events as f64,
            number(bytes as f64),
            number(workload.events as f64)
        );
    }
    for &threads in &args.scale_threads {
        // The formats back to back, run by run.
        let mut rates: Vec<Samples> = inputs.iter().map(|_| Samples::default()).collect();
        for _ in 0..args.runs {
            for ((format, messages), rates) in inputs.iter().zip(&mut rates) {
                let rate = scale::limiter_cpu(&mapping, messages, args.scale_chunk, threads);
                println!(
                    "bench:   limiter CPU path, {format}, {threads} thread(s): {} impressions/s",
                    number(rate)
                );
                rates.push(rate);
            }
        }
        for ((format, _), rates) in inputs.iter().zip(rates) {
            let median = rates.median();
            let name = if inputs.len() > 1 {
                format!("limiter CPU path ({format})")
            } else {
                "limiter CPU path".to_string()
            };
            table.add(
                format!("{name}, {threads} thread(s)"),
                "impressions/s",
                rates,
                None,
                format!(
                    "decode, validate, map, encode; chunks of {} messages of {} events ({format}), no NATS",
                    args.scale_chunk, args.batch
                ),
            );
            if inputs.len() == 1 {
                speedup(
                    table,
                    "limiter CPU path",
                    threads,
                    base_threads,
                    median,
                    &mut limiter_base,
                );
            }
        }

        let mut rates = Samples::default();
        for _ in 0..args.runs {
            let dir = scratch(args, "scale-apply")?;
            let rate = scale::aggregator_apply(dir.path(), threads, 100_000, 20)?;
            println!(
                "bench:   aggregator apply, {threads} writer(s): {} tuples/s",
                number(rate)
            );
            rates.push(rate);
        }
        let median = rates.median();
        table.add(
            format!("aggregator apply, {threads} writer(s)"),
            "tuples/s",
            rates,
            None,
            "a shard per writer, its own LMDB; 100,000 limits (Zipf 1.0) split among them; 200,000 tuples per commit",
        );
        speedup(
            table,
            "aggregator apply",
            threads,
            base_threads,
            median,
            &mut apply_base,
        );
    }
    machine(args, table, base_threads);
    Ok(())
}

/// The machine's own speedups at the same thread counts: the ceiling the
/// stages' speedups are read against (threads that share a core's caches,
/// memory bandwidth or a hypervisor's scheduling give less than n times).
fn machine(args: &Args, table: &mut Table, base_threads: usize) {
    let (mut compute_base, mut reads_base) = (None, None);
    for &threads in &args.scale_threads {
        let (compute, reads) = scale::machine(threads);
        println!(
            "bench:   machine, {threads} thread(s): {} arithmetic ops/s, {} random reads/s",
            number(compute),
            number(reads)
        );
        for (what, rate, base) in [
            ("machine: integer arithmetic", compute, &mut compute_base),
            ("machine: random reads of 32 MiB", reads, &mut reads_base),
        ] {
            match *base {
                None => *base = Some(rate),
                Some(b) => table.add(
                    format!("{what}: speedup {base_threads} → {threads} threads"),
                    "x",
                    samples([rate / b]),
                    None,
                    "the machine's ceiling for the stages above",
                ),
            }
        }
    }
}

/// A row "speedup, 1 → n threads" once the base is known.
fn speedup(
    table: &mut Table,
    what: &str,
    threads: usize,
    base_threads: usize,
    median: f64,
    base: &mut Option<f64>,
) {
    match *base {
        None => *base = Some(median),
        Some(base) if threads > base_threads => {
            let target = (threads == 2 * base_threads).then_some(Target {
                text: ">= 1.8",
                bound: 1.8,
                higher: true,
            });
            table.add(
                format!("{what}: speedup {base_threads} → {threads} threads"),
                "x",
                samples([median / base]),
                target,
                "medians",
            );
        }
        Some(_) => {}
    }
}

/// One process set end to end: sustained throughput (exact), and the
/// hottest thread's share of each process's CPU meanwhile.
async fn pipeline(
    args: &Args,
    table: &mut Table,
    limiters: usize,
    aggregators: usize,
) -> anyhow::Result<()> {
    let catalog = adspend_sim::generate_catalog(&adspend_sim::CatalogSpec::for_ads(args.ads), 3)?;
    let mut rates = Samples::default();
    let mut shares: Vec<(String, Samples)> = Vec::new();
    for run in 0..args.runs {
        host::settle().await;
        let set = ProcessSet::start(
            catalog.clone(),
            limiters,
            aggregators,
            &args.e2e_service_env,
        )
        .await?;
        let before = scale::sample(&set);
        let started = Instant::now();
        let result = e2e::sustained(
            &set.pipeline,
            Duration::from_secs(args.scale_secs),
            args.batch,
            300 + run as u64,
            adspend_sim::InputFormat::Ndjson,
        )
        .await?;
        let cpu = scale::cpu_since(&before, started.elapsed());
        anyhow::ensure!(
            result.exact,
            "{limiters}x{aggregators} run {run} did not match the truth"
        );
        println!(
            "bench:   {limiters} limiter(s) x {aggregators} aggregator(s): {} events in {:.1}s = {} events/s, exact",
            result.events,
            result.secs,
            number(result.events_per_sec)
        );
        rates.push(result.events_per_sec);
        add_shares(&mut shares, cpu);
    }
    let mut note = format!(
        "{} s sustained, durable NATS, {} events/message, 5% duplicates",
        args.scale_secs, args.batch
    );
    with_service_env(&mut note, args);
    table.add(
        format!("end to end, {limiters} limiter(s) x {aggregators} aggregator(s)"),
        "impressions/s",
        rates,
        None,
        note,
    );
    for (role, share) in shares {
        table.add(
            format!("  {limiters}x{aggregators}: hottest thread of {role}"),
            "% of its CPU",
            share,
            None,
            "from /proc/<pid>/task/*/stat over the sustained run",
        );
    }
    Ok(())
}

/// A backlog of `--scale-backlog` events published while the limiters are
/// paused (SIGSTOP), then drained: its rate from the limiters' resumption
/// until the pacer equals the truth, and each process's hottest thread
/// over the drain.
async fn backlog(
    args: &Args,
    table: &mut Table,
    limiters: usize,
    aggregators: usize,
) -> anyhow::Result<()> {
    let catalog = adspend_sim::generate_catalog(&adspend_sim::CatalogSpec::for_ads(args.ads), 3)?;
    let mut rates = Samples::default();
    let mut shares: Vec<(String, Samples)> = Vec::new();
    for run in 0..args.runs {
        host::settle().await;
        let mut set = ProcessSet::start(
            catalog.clone(),
            limiters,
            aggregators,
            &args.e2e_service_env,
        )
        .await?;
        for limiter in &mut set.limiters {
            limiter.pause()?;
        }
        let truth = e2e::backlog(
            &set.pipeline,
            args.scale_backlog,
            args.batch,
            400 + run as u64,
        )
        .await?;
        let before = scale::sample(&set);
        let started = Instant::now();
        for limiter in &mut set.limiters {
            limiter.resume()?;
        }
        let events = truth.stats.events_acked;
        let result = e2e::settle(&set.pipeline, &truth, events, started).await?;
        let cpu = scale::cpu_since(&before, started.elapsed());
        anyhow::ensure!(
            result.exact,
            "{limiters}x{aggregators} backlog run {run} did not match the truth"
        );
        println!(
            "bench:   {limiters}x{aggregators} drained a backlog of {events} events in {:.1}s = {} events/s, exact",
            result.secs,
            number(result.events_per_sec)
        );
        rates.push(result.events_per_sec);
        add_shares(&mut shares, cpu);
    }
    let mut note = format!(
        "{} events published while the limiters were paused, durable NATS",
        number(args.scale_backlog as f64)
    );
    with_service_env(&mut note, args);
    table.add(
        format!("backlog drain, {limiters} limiter(s) x {aggregators} aggregator(s)"),
        "impressions/s",
        rates,
        None,
        note,
    );
    for (role, share) in shares {
        table.add(
            format!("  {limiters}x{aggregators} drain: hottest thread of {role}"),
            "% of its CPU",
            share,
            // The bound is on the services whose work one thread used to
            // carry: the limiter and the aggregator.
            (!role.starts_with("pacer")).then_some(Target {
                text: "<= 60",
                bound: 60.0,
                higher: false,
            }),
            "from /proc/<pid>/task/*/stat over the drain",
        );
    }
    Ok(())
}

/// Print each process's CPU over a run and add its hottest thread's share
/// to that role's samples.
fn add_shares(shares: &mut Vec<(String, Samples)>, cpu: Vec<scale::ProcessCpu>) {
    for process in cpu {
        println!(
            "bench:     {}: {:.2} cores, hottest thread {} at {:.0}% of it",
            process.role,
            process.cores,
            process.hottest,
            process.share * 100.0
        );
        match shares.iter_mut().find(|(role, _)| *role == process.role) {
            Some((_, s)) => s.push(process.share * 100.0),
            None => shares.push((process.role, samples([process.share * 100.0]))),
        }
    }
}

/// The services' settings of the run, appended to a row's note.
fn with_service_env(note: &mut String, args: &Args) {
    for (name, value) in &args.e2e_service_env {
        note.push_str(&format!(", {name}={value}"));
    }
}
