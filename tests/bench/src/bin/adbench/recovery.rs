//! Recovery after a SIGKILL of the aggregator: warm from its LMDB, cold
//! from the snapshot in S3.

use adspend_bench::recovery;
use adspend_bench::report::{number, Table, Target};

use crate::{samples, Args};

pub(crate) async fn recover(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let result = recovery::run(args.ads, args.recovery_events, args.batch, args.runs).await?;
    let note = format!(
        "SIGKILL → pacer exact; {} ads; {} MB snapshot, {} dedupe ids, etcd + S3 (moto)",
        args.ads.min(recovery::MAX_ADS),
        number(result.snapshot_bytes as f64 / 1e6),
        number(result.dedupe_ids as f64)
    );
    table.add(
        "recovery, warm (local LMDB)",
        "s",
        samples(result.warm_secs),
        Some(Target {
            text: "<= 1",
            bound: 1.0,
            higher: false,
        }),
        note.clone(),
    );
    table.add(
        "recovery, cold (download from S3)",
        "s",
        samples(result.cold_secs),
        Some(Target {
            text: "<= 5",
            bound: 5.0,
            higher: false,
        }),
        note,
    );
    Ok(())
}
