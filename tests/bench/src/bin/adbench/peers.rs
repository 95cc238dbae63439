//! adspend next to the peers on one generated workload.

use adspend_bench::report::{number, Samples, Table, Target};
use adspend_bench::workload::{Workload, WorkloadSpec};
use adspend_bench::{e2e, peers};
use adspend_harness::pipeline::Backends;

use crate::{samples, Args};

pub(crate) async fn side_by_side(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let workload = Workload::generate(&WorkloadSpec {
        ads: args.ads,
        events: args.peer_events,
        batch: args.batch,
        duplicate_rate: 0.05,
        seed: 42,
    })?;
    println!(
        "bench:   workload: {} events ({} unique, {} tuples), {} messages, {} MB",
        workload.events,
        workload.unique_events,
        workload.unique_tuples,
        workload.messages.len(),
        number(workload.bytes() as f64 / 1e6)
    );
    for durable in [true, false] {
        let setting = if durable { "durable" } else { "not durable" };
        let mut ours = Samples::default();
        let mut redis = Samples::default();
        let mut jetstream = Samples::default();
        // Per-message fsync makes the JetStream peer slow; a prefix keeps its
        // runs to tens of seconds.
        let js_events = if durable { 50_000 } else { 300_000 }.min(workload.events);
        for run in 0..args.runs {
            let p = e2e::start(workload.catalog.clone(), durable, Backends::default()).await?;
            let result = e2e::workload(&p, &workload).await?;
            drop(p);
            anyhow::ensure!(
                result.exact,
                "adspend run {run} ({setting}) did not match the truth"
            );
            println!(
                "bench:   adspend ({setting}): {} events/s",
                number(result.events_per_sec)
            );
            ours.push(result.events_per_sec);
            let peer = peers::redis_lua(&workload, durable).await?;
            anyhow::ensure!(
                peer.exact,
                "Redis-Lua peer run {run} ({setting}) did not match the truth: {}",
                peer.detail
            );
            println!(
                "bench:   redis-lua ({setting}): {} events/s",
                number(peer.events_per_sec)
            );
            redis.push(peer.events_per_sec);
            let peer = peers::jetstream_dedupe(&workload, js_events, durable).await?;
            anyhow::ensure!(
                peer.exact,
                "JetStream-dedupe peer run {run} ({setting}) did not match: {}",
                peer.detail
            );
            println!(
                "bench:   jetstream-dedupe ({setting}): {} events/s",
                number(peer.events_per_sec)
            );
            jetstream.push(peer.events_per_sec);
        }
        let ratio =
            |peer: &Samples| samples(ours.values.iter().zip(&peer.values).map(|(a, b)| a / b));
        let what = format!(
            "{} events, {} per message, 5% duplicates",
            number(workload.events as f64),
            args.batch
        );
        table.add(
            format!("same workload: adspend ({setting})"),
            "impressions/s",
            ours.clone(),
            None,
            what.clone(),
        );
        table.add(
            format!("same workload: Redis-Lua peer ({setting})"),
            "impressions/s",
            redis.clone(),
            None,
            what.clone(),
        );
        table.add(
            format!("same workload: JetStream-dedupe peer ({setting})"),
            "impressions/s",
            jetstream.clone(),
            None,
            format!("first {} events, one per message", number(js_events as f64)),
        );
        let (redis_target, js_target) = if durable {
            (
                Some(Target {
                    text: ">= 5",
                    bound: 5.0,
                    higher: true,
                }),
                Some(Target {
                    text: ">= 2",
                    bound: 2.0,
                    higher: true,
                }),
            )
        } else {
            (None, None)
        };
        table.add(
            format!("ratio adspend / Redis-Lua ({setting})"),
            "x",
            ratio(&redis),
            redis_target,
            "per run",
        );
        table.add(
            format!("ratio adspend / JetStream-dedupe ({setting})"),
            "x",
            ratio(&jetstream),
            js_target,
            "per run",
        );
    }
    Ok(())
}
