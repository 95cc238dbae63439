//! Spend leases (CONTRACT.md "Spend leases", docs/LEASES.md) on the real
//! pipeline: two pacers granting at once never grant more than a limit has
//! left, a killed pacer's grants stay counted and a restarted one knows
//! them, spend reported under a lease is counted once through an
//! aggregator kill and frees what it covers, a lease retires after expiry
//! plus the grace, unknown, expired and reused lease ids are spend like
//! any other, and bad requests are refused naming the field, granting
//! nothing.

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use adspend_harness::{free_port, wait_until, NatsOptions, ServiceProcess, Signal};
use adspend_sim::{self as sim, Period};
use async_nats::jetstream;
use serde_json::{json, Value};

use crate::support::{Backends, Pipeline};

pub(crate) const BUDGET: u64 = 1_000_000;
pub(crate) const FIRST_SPEND: u64 = 100_000;

/// `camp-a` (ads a-1, a-2) and `camp-b` (ad b-1), lifetime, `BUDGET` each.
fn catalog() -> sim::Catalog {
    let limit = || sim::Limit {
        budget_micros: BUDGET,
        period: Period::Lifetime,
        time_zone: "UTC".into(),
        parent: None,
    };
    sim::Catalog {
        limits: BTreeMap::from([("camp-a".into(), limit()), ("camp-b".into(), limit())]),
        ads: BTreeMap::from([
            ("a-1".into(), vec!["camp-a".into()]),
            ("a-2".into(), vec!["camp-a".into()]),
            ("b-1".into(), vec!["camp-b".into()]),
        ]),
    }
}

pub(crate) async fn impressions(client: &async_nats::Client, lines: &[String]) {
    sim::ensure_stream(client).await.expect("IMPRESSIONS");
    let js = jetstream::new(client.clone());
    js.publish("impressions.leases", lines.join("\n").into())
        .await
        .expect("publish")
        .await
        .expect("impressions acknowledged");
}

pub(crate) fn line(id: &str, ad: &str, cost: u64, lease: Option<&str>) -> String {
    let mut event =
        json!({"id": id, "ad_id": ad, "cost_micros": cost, "ts": adspend_common::now_ms()});
    if let Some(lease) = lease {
        event["lease_id"] = lease.into();
    }
    event.to_string()
}

pub(crate) struct Pacer {
    pub(crate) addr: String,
    pub(crate) process: ServiceProcess,
}

pub(crate) fn spawn_pacer(p: &Pipeline, extra: &[(&str, &str)]) -> Pacer {
    let addr = format!("127.0.0.1:{}", free_port());
    let mut settings = vec![("ADSPEND_PACER_ADDR", addr.as_str())];
    settings.extend_from_slice(extra);
    let process = p.spawn_with("pacer", free_port(), &settings);
    Pacer { addr, process }
}

pub(crate) async fn lease(addr: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/leases"))
        .json(&body)
        .send()
        .await
        .expect("POST /v1/leases");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON answer"))
}

/// A lease request the pacer answers 200 (it answers 503 while it reads
/// the ledger after a start).
pub(crate) async fn granted(addr: &str, body: Value) -> Vec<Value> {
    let mut last = (0, Value::Null);
    for _ in 0..100 {
        last = lease(addr, body.clone()).await;
        if last.0 == 200 {
            return last.1["leases"].as_array().expect("leases").clone();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{addr}: no lease answer: {last:?}");
}

pub(crate) async fn limit(addr: &str, id: &str) -> Value {
    reqwest::get(format!("http://{addr}/v1/limits/{id}"))
        .await
        .expect("GET limit")
        .json()
        .await
        .expect("limit JSON")
}

/// Waits until `field` of limit `id` on the pacer at `addr` is `want`.
pub(crate) async fn wait_field(addr: &str, id: &str, field: &str, want: u64) {
    let reached = wait_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async { limit(addr, id).await[field].as_u64() == Some(want) },
    )
    .await;
    let seen = limit(addr, id).await;
    assert!(reached.is_ok(), "{addr}: {id}.{field} never {want}: {seen}");
}

pub(crate) async fn wait_healthy(addr: &str) {
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async {
            reqwest::get(format!("http://{addr}/healthz"))
                .await
                .is_ok_and(|r| r.status().is_success())
        },
    )
    .await
    .unwrap_or_else(|_| panic!("pacer at {addr} did not become healthy"));
}

/// The pipeline without a pacer, with `FIRST_SPEND` already on both
/// campaigns.
pub(crate) async fn start() -> Pipeline {
    let mut p = Pipeline::start_with(Backends::default(), NatsOptions::default(), catalog()).await;
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    let client = p.client().await;
    impressions(
        &client,
        &[
            line("first-a", "a-1", FIRST_SPEND, None),
            line("first-b", "b-1", FIRST_SPEND, None),
        ],
    )
    .await;
    p
}

pub(crate) fn micros(leases: &[Value]) -> u64 {
    leases
        .iter()
        .map(|l| l["granted_micros"].as_u64().unwrap())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pacers_granting_at_once_and_one_killed_never_grant_more_than_is_left() {
    let p = start().await;
    let one = spawn_pacer(&p, &[]);
    let two = spawn_pacer(&p, &[]);
    for pacer in [&one, &two] {
        wait_healthy(&pacer.addr).await;
        wait_field(&pacer.addr, "camp-a", "spend_micros", FIRST_SPEND).await;
    }
    // Eight clients on each pacer ask for camp-a's ads until nothing is
    // granted; what is left is BUDGET - FIRST_SPEND.
    let mut clients = tokio::task::JoinSet::new();
    for addr in [&one.addr, &two.addr] {
        for _ in 0..8 {
            let addr = addr.clone();
            clients.spawn(async move {
                let mut all = Vec::new();
                loop {
                    let body = json!({"ads": [{"ad_id": "a-1", "micros": 30_000}, {"ad_id": "a-2", "micros": 20_000}]});
                    let got = granted(&addr, body).await;
                    if micros(&got) == 0 {
                        return all;
                    }
                    all.extend(got);
                }
            });
        }
    }
    let mut all: Vec<Value> = Vec::new();
    while let Some(got) = clients.join_next().await {
        all.extend(got.expect("a client"));
    }
    let left = BUDGET - FIRST_SPEND;
    assert_eq!(micros(&all), left, "granted in all");
    let ids: HashSet<&str> = all.iter().filter_map(|l| l["lease_id"].as_str()).collect();
    assert_eq!(
        ids.len(),
        all.iter().filter(|l| l["granted_micros"] != 0).count(),
        "lease ids unique"
    );
    for pacer in [&one, &two] {
        wait_field(&pacer.addr, "camp-a", "leased_micros", left).await;
    }

    // camp-b: the first pacer grants most of it, then is killed.
    let first = granted(
        &one.addr,
        json!({"ads": [{"ad_id": "b-1", "micros": 600_000}]}),
    )
    .await;
    assert_eq!(micros(&first), 600_000);
    let mut one = one;
    one.process.signal(Signal::SIGKILL).expect("kill");
    wait_field(&two.addr, "camp-b", "leased_micros", 600_000).await;
    let rest = granted(
        &two.addr,
        json!({"ads": [{"ad_id": "b-1", "micros": 1_000_000}]}),
    )
    .await;
    assert_eq!(
        micros(&rest),
        left - 600_000,
        "the survivor grants only the rest"
    );
    // A pacer started now reads every grant before it grants.
    let three = spawn_pacer(&p, &[]);
    wait_healthy(&three.addr).await;
    let none = granted(&three.addr, json!({"ads": [{"ad_id": "b-1", "micros": 1}]})).await;
    assert_eq!(micros(&none), 0);
    assert!(
        none[0].get("lease_id").is_none(),
        "no id without a grant: {none:?}"
    );
    wait_field(&three.addr, "camp-b", "leased_micros", left).await;
    drop(two);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spend_under_a_lease_counts_once_through_an_aggregator_kill_and_frees_it() {
    let mut p = start().await;
    let pacer = spawn_pacer(&p, &[("ADSPEND_PACER_LEASE_GRACE_MS", "1000")]);
    wait_healthy(&pacer.addr).await;
    wait_field(&pacer.addr, "camp-a", "spend_micros", FIRST_SPEND).await;
    let client = p.client().await;
    let got = granted(
        &pacer.addr,
        json!({"ads": [{"ad_id": "a-1", "micros": 500_000}], "ttl_ms": 120_000}),
    )
    .await;
    let id = got[0]["lease_id"].as_str().expect("a lease id").to_string();
    assert_eq!(micros(&got), 500_000);
    // 30 impressions of 10,000 under the lease, each sent twice, the
    // aggregator killed halfway; one under an id that is no lease and one
    // under a lease nobody granted: spend like any other.
    let under: Vec<String> = (0..30)
        .map(|i| line(&format!("leased-{i}"), "a-1", 10_000, Some(&id)))
        .collect();
    impressions(&client, &under[..15]).await;
    impressions(&client, &under[..15]).await;
    p.aggregator.as_mut().unwrap().kill();
    impressions(&client, &under[15..]).await;
    impressions(
        &client,
        &[
            line("not-a-lease", "a-1", 1_000, Some("garbage")),
            line("unknown-lease", "a-1", 2_000, Some("zzzz.99.0")),
        ],
    )
    .await;
    p.aggregator = Some(p.spawn("aggregator"));
    impressions(&client, &under[15..]).await;
    let spent = FIRST_SPEND + 300_000 + 3_000;
    wait_field(&pacer.addr, "camp-a", "spend_micros", spent).await;
    wait_field(&pacer.addr, "camp-a", "leased_micros", 200_000).await;
    let view: Value = reqwest::get(format!("http://{}/v1/leases/{id}", pacer.addr))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view["reported_micros"], 300_000, "{view}");
    assert_eq!(view["held_micros"], 200_000, "{view}");
    // What is left for new grants is the budget less the spend and what the
    // lease still holds.
    let more = granted(
        &pacer.addr,
        json!({"ads": [{"ad_id": "a-2", "micros": 10_000_000}]}),
    )
    .await;
    assert_eq!(micros(&more), BUDGET - spent - 200_000);

    // Reused beyond its grant: the spend counts, the lease holds nothing.
    let beyond: Vec<String> = (0..25)
        .map(|i| line(&format!("beyond-{i}"), "a-1", 10_000, Some(&id)))
        .collect();
    impressions(&client, &beyond).await;
    wait_field(&pacer.addr, "camp-a", "spend_micros", spent + 250_000).await;
    wait_field(
        &pacer.addr,
        "camp-a",
        "leased_micros",
        BUDGET - spent - 200_000,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_grant_nothing_and_a_lease_retires_after_expiry_and_grace() {
    let p = start().await;
    let pacer = spawn_pacer(
        &p,
        &[
            ("ADSPEND_PACER_LEASE_GRACE_MS", "1000"),
            ("ADSPEND_PACER_MAX_DECISION_IDS", "3"),
        ],
    );
    wait_healthy(&pacer.addr).await;
    wait_field(&pacer.addr, "camp-b", "spend_micros", FIRST_SPEND).await;
    let ok = json!({"ad_id": "b-1", "micros": 5});
    for (body, status, names) in [
        (
            json!({"ads": [ok, {"ad_id": "nope", "micros": 5}]}),
            422,
            "ads[1].ad_id",
        ),
        (
            json!({"ads": [{"ad_id": "b-1", "micros": 0}]}),
            422,
            "ads[0].micros",
        ),
        (
            json!({"ads": [{"ad_id": "b-1", "micros": 1.5}]}),
            422,
            "ads[0].micros",
        ),
        (
            json!({"ads": [{"ad_id": "b-1", "micros": -3}]}),
            422,
            "ads[0].micros",
        ),
        (json!({"ads": [{"ad_id": "b-1"}]}), 422, "ads[0].micros"),
        (json!({"ads": [{"micros": 3}]}), 422, "ads[0].ad_id"),
        (json!({"ads": [ok], "ttl_ms": 999}), 422, "ttl_ms"),
        (json!({"ads": [ok], "ttl_ms": 600_001}), 422, "ttl_ms"),
        (json!({"ads": [ok, ok, ok, ok]}), 413, "ads"),
        (json!({"ad": []}), 422, "ads"),
    ] {
        let (got, answer) = lease(&pacer.addr, body.clone()).await;
        assert_eq!(got, status, "{body}: {answer}");
        let error = answer["error"].as_str().unwrap_or_default();
        assert!(
            error.contains(names),
            "{body}: {error:?} does not name {names}"
        );
    }
    assert_eq!(limit(&pacer.addr, "camp-b").await["leased_micros"], 0);

    // A one-second lease: held, then retired a second after it expires,
    // once the pipeline's pushes have caught up past that.
    let got = granted(
        &pacer.addr,
        json!({"ads": [{"ad_id": "b-1", "micros": 200_000}], "ttl_ms": 1000}),
    )
    .await;
    let id = got[0]["lease_id"].as_str().expect("a lease id").to_string();
    let expires = got[0]["expires_at_ms"].as_i64().unwrap();
    let now = adspend_common::now_ms();
    assert!(
        (now..=now + 1_000).contains(&expires),
        "expires at {expires}, now {now}"
    );
    assert_eq!(limit(&pacer.addr, "camp-b").await["leased_micros"], 200_000);
    wait_field(&pacer.addr, "camp-b", "leased_micros", 0).await;
    assert!(
        adspend_common::now_ms() >= expires + 1_000,
        "retired before expiry plus grace"
    );
    let gone = reqwest::get(format!("http://{}/v1/leases/{id}", pacer.addr))
        .await
        .unwrap();
    assert_eq!(gone.status(), 404);
    // Spend reported under the expired, retired lease is spend like any
    // other: counted once, and it holds nothing.
    let late = line("after-expiry", "b-1", 30_000, Some(&id));
    let client = p.client().await;
    impressions(&client, std::slice::from_ref(&late)).await;
    impressions(&client, &[late]).await;
    wait_field(&pacer.addr, "camp-b", "spend_micros", FIRST_SPEND + 30_000).await;
    assert_eq!(limit(&pacer.addr, "camp-b").await["leased_micros"], 0);
    let all = granted(
        &pacer.addr,
        json!({"ads": [{"ad_id": "b-1", "micros": 5_000_000}]}),
    )
    .await;
    assert_eq!(micros(&all), BUDGET - FIRST_SPEND - 30_000);
}

/// The ledger's compare-and-set holds from the stream's first commit: a
/// commit that expects the empty stream is refused once another landed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_expecting_an_empty_ledger_is_refused_once_one_landed() {
    let nats = adspend_harness::NatsServer::start().await;
    let client = async_nats::connect(nats.url()).await.expect("connect");
    let js = jetstream::new(client);
    js.get_or_create_stream(jetstream::stream::Config {
        name: "LEASES".into(),
        subjects: vec!["adspend.leases".into()],
        ..Default::default()
    })
    .await
    .expect("LEASES");
    let commit = |expected: u64| {
        let js = js.clone();
        async move {
            let publish = jetstream::message::PublishMessage::build()
                .payload("{}".into())
                .expected_last_sequence(expected);
            js.send_publish("adspend.leases", publish).await?.await
        }
    };
    assert_eq!(commit(0).await.expect("the first commit").sequence, 1);
    let second = commit(0).await;
    assert!(
        second.is_err(),
        "a second commit expecting the empty ledger was stored: {second:?}"
    );
}
