//! Spend lease grants: one run per number of pacers; prints the table of
//! `docs/LEASES.md`.

use adspend_bench::leases::{self, LeaseBench};
use adspend_bench::report::{Table, Target};

use crate::{samples, Args};

pub(crate) async fn grants(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let mut results = Vec::new();
    for &pacers in &args.leases_pacers {
        let result = leases::run(&LeaseBench {
            pacers,
            clients: args.leases_clients,
            ads: args.leases_ads,
            secs: args.leases_secs,
        })
        .await?;
        table.add(
            format!("leased ads/s, {pacers} pacer(s), {} ads a request", args.leases_ads),
            "ads/s",
            samples([result.leased_ads_per_sec]),
            Some(Target {
                text: ">= 20,000",
                bound: 20_000.0,
                higher: true,
            }),
            format!(
                "request p50 {:.2} ms, p99 {:.2} ms (target <= 10 ms); {:.0} races lost in {:.0} commits",
                result.p50_ms, result.p99_ms, result.races, result.commits
            ),
        );
        results.push(result);
    }
    println!("\n{}", leases::markdown(&results));
    Ok(())
}
