//! Closed periods with real NATS: a daily sum whose period closed more than
//! ADSPEND_CLOSED_PERIOD_DAYS ago leaves the aggregator's store (and the
//! snapshots a cold restore reads); a late impression for that day still
//! counts toward the limit's lifetime spend, and is counted in the metric
//! and the log line an operator sees.

use std::collections::BTreeMap;
use std::time::Duration;

use adspend_aggregator::store::{parse_lifetime, parse_sum_key, Store};
use adspend_harness::{free_port, wait_until_ok, NatsOptions, ServiceProcess};
use adspend_sim::{self as sim, Period};

use crate::support::{try_metric, Backends, Pipeline};

const DAY_MS: i64 = 86_400_000;

/// `day`: a daily limit (UTC); `life`: a lifetime limit; `ad-1` spends on both.
fn catalog() -> sim::Catalog {
    let limit = |period| sim::Limit {
        budget_micros: 1_000_000_000,
        period,
        time_zone: "UTC".into(),
        parent: None,
    };
    sim::Catalog {
        limits: BTreeMap::from([
            ("day".to_string(), limit(Period::Daily)),
            ("life".to_string(), limit(Period::Lifetime)),
        ]),
        ads: BTreeMap::from([(
            "ad-1".to_string(),
            vec!["day".to_string(), "life".to_string()],
        )]),
    }
}

async fn impression(p: &Pipeline, id: &str, cost: u64, ts: i64) {
    let body = format!(r#"{{"id":"{id}","ad_id":"ad-1","cost_micros":{cost},"ts":{ts}}}"#);
    // Through JetStream, acknowledged, into a stream made if the limiter has
    // not made it yet: a plain publish before the stream exists is lost (seen
    // on a loaded machine, where the pacer answered before the limiter had
    // made IMPRESSIONS).
    let client = p.client().await;
    sim::ensure_stream(&client).await.expect("IMPRESSIONS");
    async_nats::jetstream::new(client)
        .publish("impressions.test", body.into())
        .await
        .expect("publish")
        .await
        .expect("impression acknowledged");
}

async fn wait_lifetime(p: &Pipeline, limit: &str, micros: u64) {
    wait_until_ok(
        Duration::from_secs(60),
        Duration::from_millis(100),
        || async {
            let lifetimes = p.lifetimes().await?;
            match lifetimes.get(limit) {
                Some(&m) if m == micros => Ok(()),
                other => anyhow::bail!("{limit}: {other:?}, want {micros}"),
            }
        },
    )
    .await
    .unwrap_or_else(|e| {
        let tail = |process: &Option<ServiceProcess>| {
            process
                .as_ref()
                .map_or_else(|| "not running".to_string(), |p| p.log_tail(25))
        };
        panic!(
            "the pacer does not show the lifetime spend: {e:#}\naggregator:\n{}\nlimiter:\n{}\npacer:\n{}",
            tail(&p.aggregator),
            tail(&p.limiter),
            tail(&p.pacer)
        )
    });
}

/// Period sums (limit, bucket) → micros and lifetime sums of the stopped
/// aggregator's store.
fn stored(p: &Pipeline) -> (BTreeMap<(String, u32), u64>, BTreeMap<String, u64>) {
    let store = Store::open(&p.aggregator_dir().join("lmdb"), 1 << 30).expect("open the store");
    let txn = store.read_txn().unwrap();
    let sums = store
        .sums
        .iter(&txn)
        .unwrap()
        .map(|e| {
            let (key, micros) = e.unwrap();
            let (limit, bucket) = parse_sum_key(key).unwrap();
            ((limit.to_string(), bucket), micros)
        })
        .collect();
    let lifetimes = store
        .lifetime
        .iter(&txn)
        .unwrap()
        .map(|e| {
            let (limit, value) = e.unwrap();
            (limit.to_string(), parse_lifetime(value).unwrap().0)
        })
        .collect();
    (sums, lifetimes)
}

fn stop(process: &mut Option<ServiceProcess>) {
    let mut process = process.take().expect("running");
    let status = process.terminate(Duration::from_secs(20)).expect("stops");
    assert!(status.success(), "{}", process.log_tail(30));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_period_leaves_the_store_and_late_spend_counts_in_lifetime() {
    let mut p = Pipeline::start_with(Backends::default(), NatsOptions::default(), catalog()).await;
    let now = adspend_common::now_ms();
    let old_ts = now - 40 * DAY_MS;
    let old_day = (old_ts / DAY_MS) as u32;
    let today = (now / DAY_MS) as u32;

    // Kept for 100 years: the 40-day-old day's sum is still open.
    p.aggregator = Some(p.spawn_with(
        "aggregator",
        free_port(),
        &[("ADSPEND_CLOSED_PERIOD_DAYS", "36500")],
    ));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    impression(&p, "old-1", 700, old_ts).await;
    impression(&p, "today-1", 5, now).await;
    wait_lifetime(&p, "day", 705).await;
    // A checkpoint (every 500 ms here) holds the old day's sum.
    p.aggregator
        .as_mut()
        .unwrap()
        .wait_for_log("checkpoint recorded", Duration::from_secs(30))
        .await
        .expect("a checkpoint");
    stop(&mut p.aggregator);
    let (sums, _) = stored(&p);
    assert_eq!(
        sums.get(&("day".to_string(), old_day)),
        Some(&700),
        "{sums:?}"
    );

    // The default, 35 days: the old day is closed. The first commit drops
    // its sum; a late impression for it counts in lifetime only.
    let metrics = free_port();
    p.aggregator = Some(p.spawn_with("aggregator", metrics, &[]));
    impression(&p, "old-2", 300, old_ts + 1).await;
    wait_lifetime(&p, "day", 1_005).await;
    wait_lifetime(&p, "life", 1_005).await;
    let late = "adspend_aggregator_closed_period_tuples_total{shard=\"all\"}";
    assert_eq!(try_metric(metrics, late).await.unwrap(), 1.0);
    let micros = "adspend_aggregator_closed_period_micros_total{shard=\"all\"}";
    assert_eq!(try_metric(metrics, micros).await.unwrap(), 300.0);
    let aggregator = p.aggregator.as_mut().unwrap();
    aggregator
        .wait_for_log("spend for closed periods", Duration::from_secs(10))
        .await
        .expect("the late spend is logged");
    aggregator
        .wait_for_log("checkpoint recorded", Duration::from_secs(30))
        .await
        .expect("a checkpoint after the drop");
    stop(&mut p.aggregator);
    let (sums, lifetimes) = stored(&p);
    assert_eq!(
        sums.keys().cloned().collect::<Vec<_>>(),
        vec![("day".to_string(), today)],
        "only today's period sum is left"
    );
    assert_eq!(sums[&("day".to_string(), today)], 5);
    assert_eq!(lifetimes["day"], 1_005);

    // A cold restore (the local store gone) reads the base that still held
    // the old day, then the deltas: the old day stays dropped, lifetimes
    // exact.
    std::fs::remove_dir_all(p.aggregator_dir().join("lmdb")).expect("remove the store");
    p.aggregator = Some(p.spawn("aggregator"));
    p.aggregator
        .as_mut()
        .unwrap()
        .wait_for_log("aggregator running", Duration::from_secs(30))
        .await
        .expect("restored");
    assert!(
        p.aggregator.as_ref().unwrap().log_tail(80).contains("cold"),
        "{}",
        p.aggregator.as_ref().unwrap().log_tail(80)
    );
    impression(&p, "today-2", 1, now).await;
    wait_lifetime(&p, "day", 1_006).await;
    stop(&mut p.aggregator);
    let (sums, lifetimes) = stored(&p);
    assert_eq!(sums.len(), 1, "{sums:?}");
    assert_eq!(sums[&("day".to_string(), today)], 6);
    assert_eq!((lifetimes["day"], lifetimes["life"]), (1_006, 1_006));
}
