//! The aggregator's state on one core: applying tuples, and a checkpoint
//! taken while the writer keeps applying.

use adspend_bench::report::{number, Samples, Table, Target};
use adspend_bench::state;

use crate::{scratch, Args};

pub(crate) fn apply(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let cases = [
        (
            "100,000 limits, Zipf 1.0",
            100_000,
            state::Skew::Zipf(1.0),
            true,
        ),
        (
            "1,000,000 limits, uniform",
            1_000_000,
            state::Skew::Uniform,
            false,
        ),
    ];
    let mut bytes_per_id = Samples::default();
    for (name, limits, skew, targeted) in cases {
        if args.apply_skip_uniform && !targeted {
            continue;
        }
        let mut rates = Samples::default();
        for run in 0..args.runs {
            let dir = scratch(args, "apply")?;
            let (mut writer, store, dirty) = state::writer(dir.path())?;
            let mut feed = state::Feed::new(limits, skew, run as u64 + 1)?;
            // Warm-up: the limits' keys exist, the map has grown.
            state::apply_rate(&mut writer, &dirty, &mut feed, 5)?;
            let measured = state::apply_rate(&mut writer, &dirty, &mut feed, 25)?;
            println!(
                "bench:   apply {name}: {} tuples in {:.2}s, {} tuples/s",
                measured.tuples,
                measured.secs,
                number(measured.tuples_per_sec)
            );
            rates.push(measured.tuples_per_sec);
            if targeted {
                bytes_per_id.push(state::dedupe_bytes_per_id(&store, writer.dedupe_ids())?);
            }
        }
        let target = targeted.then_some(Target {
            text: ">= 2,000,000",
            bound: 2_000_000.0,
            higher: true,
        });
        table.add(
            format!("aggregator apply, one core, {name}"),
            "tuples/s",
            rates,
            target,
            "200,000 tuples per LMDB commit, every id new",
        );
    }
    table.add(
        "dedupe on disk",
        "bytes/id",
        bytes_per_id,
        Some(Target {
            text: "<= 32",
            bound: 32.0,
            higher: false,
        }),
        "pages of the dedupe log / ids in it",
    );
    Ok(())
}

pub(crate) async fn checkpoint(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let dir = scratch(args, "checkpoint")?;
    let (mut writer, store, dirty) = state::writer(&dir.path().join("lmdb"))?;
    let mut feed = state::Feed::new(args.state_limits, state::Skew::Uniform, 7)?;
    let groups = (args.state_ids / 200_000).max(1) as usize;
    let built = state::apply_rate(&mut writer, &dirty, &mut feed, groups)?;
    println!(
        "bench:   state: {} limits, {} dedupe ids ({} tuples/s while building)",
        number(feed.limits() as f64),
        number(writer.dedupe_ids() as f64),
        number(built.tuples_per_sec)
    );
    // What every aggregator start pays before it applies: the dedupe
    // window read from LMDB into memory.
    let mut load_ms = Samples::default();
    let (mut table_per_id, mut rss_per_id) = (Samples::default(), Samples::default());
    for run in 0..args.runs {
        let rss_before = state::rss_bytes();
        let started = std::time::Instant::now();
        let ids = adspend_aggregator::dedupe::load(&store)?;
        let ms = started.elapsed().as_secs_f64() * 1e3;
        // The set as loaded, sized for what it holds; and the resident
        // memory it added (the first run: later ones may reuse pages freed
        // by the one before).
        let n = ids.len().max(1) as f64;
        let table = ids.table_bytes() as f64 / n;
        let rss = match (rss_before, state::rss_bytes()) {
            (Some(before), Some(after)) if run == 0 => {
                Some(after.saturating_sub(before) as f64 / n)
            }
            _ => None,
        };
        println!(
            "bench:   dedupe window load {run}: {} ids in {ms:.0} ms ({:.0} ns/id), tables {table:.1} bytes/id, resident {}",
            number(ids.len() as f64),
            ms * 1e6 / n,
            rss.map_or("-".to_string(), |r| format!("{r:.1} bytes/id")),
        );
        load_ms.push(ms);
        table_per_id.push(table);
        if let Some(rss) = rss {
            rss_per_id.push(rss);
        }
    }
    // The writer's own set, grown by inserts and evictions, as it runs.
    println!(
        "bench:   writer's dedupe set: {} ids, tables {:.1} bytes/id",
        number(writer.dedupe_ids() as f64),
        writer.dedupe_table_bytes() as f64 / writer.dedupe_ids().max(1) as f64
    );
    table.add(
        "dedupe in memory, set as loaded",
        "bytes/id",
        table_per_id,
        None,
        "the set's hash tables (16-byte id + 1 control byte per bucket, at most 7/8 full) / ids",
    );
    table.add(
        "dedupe in memory, resident",
        "bytes/id",
        rss_per_id,
        None,
        "resident memory the first load added / ids",
    );
    table.add(
        "dedupe window load (every aggregator start)",
        "ms",
        load_ms,
        None,
        format!(
            "{} ids from LMDB into the in-memory set",
            number(writer.dedupe_ids() as f64)
        ),
    );
    let (mut secs, mut mb, mut share) =
        (Samples::default(), Samples::default(), Samples::default());
    let mut during = Samples::default();
    for run in 0..args.runs {
        let snap_dir = scratch(args, "snap")?;
        let (result, w, f) = state::checkpoint_under_load(
            writer,
            store.clone(),
            dirty.clone(),
            feed,
            snap_dir.path(),
            60,
        )
        .await?;
        writer = w;
        feed = f;
        println!(
            "bench:   checkpoint {run}: {:.2}s, {} MB, ingest {} tuples/s during vs {} before",
            result.secs,
            number(result.bytes as f64 / 1e6),
            number(result.ingest_during),
            number(result.ingest_before)
        );
        secs.push(result.secs);
        mb.push(result.bytes as f64 / 1e6);
        during.push(result.ingest_during);
        share.push(100.0 * result.ingest_during / result.ingest_before);
    }
    let state_note = format!(
        "{} limits, >= {} ids",
        number(args.state_limits as f64),
        number(args.state_ids as f64)
    );
    table.add(
        "checkpoint: snapshot (copy + upload to file:// + record)",
        "s",
        secs,
        Some(Target {
            text: "<= 2",
            bound: 2.0,
            higher: false,
        }),
        state_note.clone(),
    );
    table.add("checkpoint: snapshot size", "MB", mb, None, state_note);
    table.add(
        "checkpoint: ingest during snapshot",
        "tuples/s",
        during,
        None,
        "the writer applying 200,000-tuple groups meanwhile",
    );
    table.add(
        "checkpoint: ingest during / before",
        "%",
        share,
        Some(Target {
            text: ">= 80",
            bound: 80.0,
            higher: true,
        }),
        "the writer alone in the 2-3 s before",
    );
    Ok(())
}
