//! One budget across regions, the pacers' side (CONTRACT.md "Regions";
//! docs/REGIONS.md "Measured: allotments"): three pacers `east`, `west`,
//! `south` on one NATS that shares the stream `REGIONS` among them, one
//! catalog, demand only in east. East's allotment grows toward the budget
//! as the others give their unused shares; east's spend and leases never
//! pass its allotment; the allotments as each region reports its own never
//! add up past the budget; west, crashed just before a report and started
//! again, keeps what it gave (its own reports read back), which the sum
//! check sees at once if it did not.
//!
//! And of two pacers of one region only one publishes its reports; killed,
//! the other takes over within about 2 s and the reports' `seq` goes on.
//!
//! West and south run as a NATS user that can neither read the sums nor use
//! `LEASES`, so that on this one server they spend and lease nothing, as
//! regions of their own NATS with no demand would.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use adspend_harness::{free_port, NatsOptions};
use adspend_sim::{self as sim, Period};
use async_nats::jetstream::{self, stream};
use serde_json::{json, Value};

use crate::leases::{impressions, lease, limit, line, wait_field, wait_healthy, Pacer};
use crate::support::{Backends, Pipeline};

const BUDGET: u64 = 3_000_000;
const FIRST_SPEND: u64 = 150_000;
const REGIONS: &str = "east,west,south";
/// The users of the one NATS: the pipeline and east as `everyone`, west
/// and south as `region` (no sums, no `LEASES`).
const NATS_USERS: &str = r#"
authorization {
  users = [
    { user: everyone, password: everyone }
    { user: region, password: region, permissions: {
        publish: { deny: ["adspend.leases", "$JS.API.*.*.LEASES", "$JS.API.*.*.LEASES.>", "$JS.API.*.*.*.LEASES"] }
        subscribe: { deny: ["adspend.sums.>"] }
    } }
  ]
}
no_auth_user: everyone
"#;

pub(crate) fn catalog() -> sim::Catalog {
    sim::Catalog {
        limits: BTreeMap::from([(
            "global".into(),
            sim::Limit {
                budget_micros: BUDGET,
                period: Period::Lifetime,
                time_zone: "UTC".into(),
                parent: None,
            },
        )]),
        ads: BTreeMap::from([("e-1".into(), vec!["global".into()])]),
    }
}

fn spawn_region(p: &Pipeline, addr: &str, region: &str, extra: &[(&str, &str)]) -> Pacer {
    let mut settings = vec![
        ("ADSPEND_PACER_ADDR", addr),
        ("ADSPEND_REGION", region),
        ("ADSPEND_REGIONS", REGIONS),
    ];
    if region != "east" {
        settings.extend([
            ("ADSPEND_NATS_USER", "region"),
            ("ADSPEND_NATS_PASSWORD", "region"),
        ]);
    }
    settings.extend_from_slice(extra);
    let process = p.spawn_with("pacer", free_port(), &settings);
    Pacer {
        addr: addr.to_string(),
        process,
    }
}

/// A region's own allotment of `global` as its pacer serves it, once its
/// book has read the stream.
async fn allotment(addr: &str) -> Option<u64> {
    let response = reqwest::get(format!("http://{addr}/v1/limits/global"))
        .await
        .ok()?;
    let view: Value = response.json().await.ok()?;
    view["allotment_micros"].as_u64()
}

/// What the sampler saw.
#[derive(Default, Debug)]
struct Samples {
    count: u64,
    max_sum: u64,
    east_max: u64,
    west_before_kill: Option<u64>,
    west_after_restart_max: u64,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unused_shares_flow_to_demand_and_allotments_never_pass_the_budget() {
    let started = Instant::now();
    let options = NatsOptions {
        extra_config: NATS_USERS.into(),
        ..NatsOptions::default()
    };
    let mut p = Pipeline::start_with(Backends::default(), options, catalog()).await;
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    let client = p.client().await;
    impressions(&client, &[line("first", "e-1", FIRST_SPEND, None)]).await;
    jetstream::new(client.clone())
        .create_stream(stream::Config {
            name: "REGIONS".into(),
            subjects: vec!["adspend.regions.>".into()],
            max_messages_per_subject: 16,
            ..Default::default()
        })
        .await
        .expect("create REGIONS");

    let addrs: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    let east = spawn_region(&p, &addrs[0], "east", &[]);
    // West crashes just before its 12th report (about 6 s in).
    let mut west = spawn_region(
        &p,
        &addrs[1],
        "west",
        &[("ADSPEND_FAILPOINTS", "pacer.before_region_report@12")],
    );
    let south = spawn_region(&p, &addrs[2], "south", &[]);
    for pacer in [&east, &west, &south] {
        wait_healthy(&pacer.addr).await;
    }
    wait_field(&east.addr, "global", "spend_micros", FIRST_SPEND).await;
    let initial = allotment_within(&east.addr).await;
    assert_eq!(initial, BUDGET / 3, "east starts from its initial share");

    // East asks for leases until the end; west and south ask nothing. The
    // end: east at 95% of the budget and 5 s of samples since west came
    // back, or 30 s.
    let demand_from = Instant::now();
    let deadline = demand_from + Duration::from_secs(30);
    let stop = tokio_util::sync::CancellationToken::new();
    let asking = tokio::spawn({
        let (addr, stop) = (east.addr.clone(), stop.clone());
        async move {
            let mut granted = 0u64;
            while !stop.is_cancelled() {
                let body = json!({"ads": [{"ad_id": "e-1", "micros": 60_000}], "ttl_ms": 600_000});
                let (status, answer) = lease(&addr, body).await;
                if status == 200 {
                    granted += answer["leases"][0]["granted_micros"].as_u64().unwrap_or(0);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            granted
        }
    });

    let mut samples = Samples::default();
    let mut restarted = false;
    let mut east_at_95 = None;
    let mut back_since: Option<Instant> = None;
    while Instant::now() < deadline {
        if east_at_95.is_some() && back_since.is_some_and(|t| t.elapsed() > Duration::from_secs(5))
        {
            break;
        }
        // The receiver first, then the givers: a gift is debited at the
        // giver before the receiver can credit it, so in this order the
        // sum read is never more than the sum at any one instant.
        let view = limit(&east.addr, "global").await;
        let east_allotment = view["allotment_micros"].as_u64().expect("east's allotment");
        let own = &view["regions"]["east"];
        let used = own["spend_micros"].as_u64().unwrap() + view["leased_micros"].as_u64().unwrap();
        assert!(
            used <= east_allotment,
            "east spent and leased {used}, over its allotment {east_allotment}: {view}"
        );
        let mut sum = east_allotment;
        if !west.process.is_running() && !restarted {
            assert!(
                west.process
                    .log_tail(50)
                    .contains("FAILPOINT FIRED: pacer.before_region_report"),
                "west stopped without its failpoint: {}",
                west.process.log_tail(20)
            );
            println!("west crashed before a report at {:?}", started.elapsed());
            west = spawn_region(&p, &addrs[1], "west", &[]);
            restarted = true;
        }
        let west_allotment = allotment(&addrs[1]).await;
        let south_allotment = allotment(&addrs[2]).await;
        match (west_allotment, restarted) {
            (Some(a), false) => samples.west_before_kill = Some(a),
            (Some(a), true) => {
                back_since.get_or_insert_with(Instant::now);
                samples.west_after_restart_max = samples.west_after_restart_max.max(a)
            }
            (None, _) => {}
        }
        // West down or still reading its reports back counts 0 in this
        // sample; once it answers, what it gave must not have come back.
        sum += west_allotment.unwrap_or(0) + south_allotment.unwrap_or(0);
        assert!(
            sum <= BUDGET,
            "allotments east {east_allotment} west {west_allotment:?} south {south_allotment:?} add up to {sum}, over the budget {BUDGET}"
        );
        samples.count += 1;
        samples.max_sum = samples.max_sum.max(sum);
        samples.east_max = samples.east_max.max(east_allotment);
        if east_at_95.is_none() && east_allotment >= BUDGET * 95 / 100 {
            east_at_95 = Some(demand_from.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    stop.cancel();
    let granted = asking.await.expect("the asking client");
    assert!(restarted, "west's failpoint never fired");
    assert!(
        back_since.is_some(),
        "west never answered after its restart"
    );
    let before = samples
        .west_before_kill
        .expect("west's allotment before the crash");
    assert!(
        samples.west_after_restart_max <= before,
        "west restarted at an allotment of {} above the {before} it had: it forgot what it gave",
        samples.west_after_restart_max
    );
    let view = limit(&east.addr, "global").await;
    let leased = view["leased_micros"].as_u64().unwrap();
    let final_allotment = view["allotment_micros"].as_u64().unwrap();
    println!(
        "regions_pacer: {} samples over {:?}; east's allotment {initial} -> {final_allotment} (max {}), \
         granted {granted}, leased {leased}, spend {FIRST_SPEND}; west {before} before its crash, \
         at most {} after; south {:?}; largest sum of allotments {} of {BUDGET}; \
         east at 95% of the budget {east_at_95:?} after its demand began",
        samples.count,
        started.elapsed(),
        samples.east_max,
        samples.west_after_restart_max,
        allotment(&addrs[2]).await,
        samples.max_sum,
    );
    assert!(
        final_allotment >= BUDGET * 95 / 100,
        "east's allotment reached only {final_allotment} of {BUDGET}: {view}"
    );
    assert!(
        FIRST_SPEND + leased >= BUDGET * 90 / 100,
        "east used only {} of its allotment {final_allotment}",
        FIRST_SPEND + leased
    );
    assert_eq!(view["budget_micros"].as_u64(), Some(BUDGET));
    assert_eq!(
        view["spend_micros"].as_u64(),
        Some(FIRST_SPEND),
        "global spend: {view}"
    );
    assert_eq!(
        view["remaining_micros"].as_u64(),
        Some(BUDGET - FIRST_SPEND),
        "{view}"
    );
    for region in ["east", "west", "south"] {
        assert!(
            view["regions"][region]["as_of_ms"].as_i64().is_some(),
            "east has not heard {region}: {view}"
        );
    }
    let metrics = reqwest::get(format!("http://{}/metrics", east.addr))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics text");
    for region in ["east", "west", "south"] {
        let heard = format!("adspend_pacer_region_heard{{region=\"{region}\"}} 1");
        assert!(metrics.contains(&heard), "no `{heard}` in east's metrics");
    }
}

/// A region's allotment once its book has read the stream.
async fn allotment_within(addr: &str) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some(a) = allotment(addr).await {
            return a;
        }
        assert!(Instant::now() < deadline, "{addr} served no allotment");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The `seq` of every report of `region` the shared stream still holds, in
/// stream order.
async fn report_seqs(client: &async_nats::Client, region: &str) -> Vec<u64> {
    use adspend_wire::regions::RegionReport;
    use futures::StreamExt;
    let stream = jetstream::new(client.clone())
        .get_stream("REGIONS")
        .await
        .expect("REGIONS");
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig {
            filter_subject: format!("adspend.regions.{region}"),
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut seqs = Vec::new();
    while let Ok(Some(Ok(message))) =
        tokio::time::timeout(Duration::from_millis(500), messages.next()).await
    {
        let report = RegionReport::decode(&message.payload).expect("a region report");
        seqs.push(report.seq);
        if message.info().expect("info").pending == 0 {
            break;
        }
    }
    seqs
}

const PUBLISHES: &str = "this pacer publishes its region's reports";

/// Two pacers of east (one LEASES, one spend, as replicas of one region
/// are) and one of west on one NATS: one east pacer publishes east's
/// reports at a time; killed, the other takes over, and the reports' `seq`
/// never goes back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn one_pacer_of_a_region_publishes_and_another_takes_over() {
    let p = Pipeline::start_with(Backends::default(), NatsOptions::default(), catalog()).await;
    let client = p.client().await;
    jetstream::new(client.clone())
        .create_stream(stream::Config {
            name: "REGIONS".into(),
            subjects: vec!["adspend.regions.>".into()],
            max_messages_per_subject: 16,
            ..Default::default()
        })
        .await
        .expect("create REGIONS");
    let spawn = |region: &str| {
        let addr = format!("127.0.0.1:{}", free_port());
        let settings = [
            ("ADSPEND_PACER_ADDR", addr.as_str()),
            ("ADSPEND_REGION", region),
            ("ADSPEND_REGIONS", "east,west"),
        ];
        Pacer {
            process: p.spawn_with("pacer", free_port(), &settings),
            addr,
        }
    };
    let mut east = [spawn("east"), spawn("east")];
    let west = spawn("west");
    for pacer in east.iter().chain([&west]) {
        wait_healthy(&pacer.addr).await;
    }
    tokio::time::sleep(Duration::from_secs(3)).await;
    let publishing: Vec<usize> = (0..2)
        .filter(|&i| east[i].process.log_tail(200).contains(PUBLISHES))
        .collect();
    assert_eq!(
        publishing.len(),
        1,
        "east pacers publishing: {publishing:?}"
    );
    let (one, other) = (publishing[0], 1 - publishing[0]);
    let before = report_seqs(&client, "east").await;
    assert!(before.len() >= 4, "east's reports: {before:?}");
    assert!(
        before.windows(2).all(|w| w[0] < w[1]),
        "east's report seqs not increasing: {before:?}"
    );
    east[one].process.kill();
    let killed = Instant::now();
    east[other]
        .process
        .wait_for_log(PUBLISHES, Duration::from_secs(10))
        .await
        .expect("the other east pacer takes over");
    let took_over = killed.elapsed();
    tokio::time::sleep(Duration::from_secs(2)).await;
    let after = report_seqs(&client, "east").await;
    assert!(
        after.windows(2).all(|w| w[0] < w[1]),
        "east's report seqs not increasing across the hand-over: {after:?}"
    );
    assert!(
        after.last() > before.last(),
        "no new report of east: {before:?} then {after:?}"
    );
    let view = limit(&west.addr, "global").await;
    let as_of = view["regions"]["east"]["as_of_ms"]
        .as_i64()
        .expect("west hears east");
    assert!(
        adspend_common::now_ms() - as_of < 2_000,
        "west's latest of east is {} ms old",
        adspend_common::now_ms() - as_of
    );
    println!(
        "regions_pacer hand-over: the other east pacer published {took_over:?} after the \
         publisher was killed; east's seqs {:?} -> {:?}",
        before.last(),
        after.last()
    );
}
