//! What one client can cost the pacer is bounded by its settings (issue 27,
//! DESIGN rule 9), each attack of the issue as a test over real TCP:
//! connections per address, ids per decisions batch (and so bytes per
//! answer), and a batch's time under the request timeout.

mod support;

use std::net::IpAddr;
use std::time::Duration;

use adspend_pacer::http::{Auth, HttpLimits, MAX_PAGE};
use adspend_wire::catalog::{MAX_LIMITS_ABOVE_AD, MAX_PARENT_DEPTH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use support::{
    closed_within, connect_from, parse_reply, request, request_on, start, start_with, JSON, LIMITS,
};

const ATTACKER: &str = "127.0.0.1";
const OTHER: &str = "127.0.0.2";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

/// A request head that never ends (a slowloris client's first bytes).
const SLOW_HEAD: &[u8] = b"GET /v1/limits/campaign HTTP/1.1\r\nHost: pacer\r\n";

#[tokio::test]
async fn one_address_at_its_cap_leaves_the_other_addresses_served() {
    const CAP: usize = 8;
    const PER_ADDR: usize = 4;
    let limits = HttpLimits {
        // Long enough that, without the per-address cap, the slow clients
        // would hold every place for the whole test.
        request_timeout: Duration::from_secs(60),
        idle_timeout: Duration::from_secs(60),
        max_connections: CAP,
        max_connections_per_addr: PER_ADDR,
    };
    let pacer = start(Auth::default(), limits).await;
    // One host opens as many slow connections as the whole cap.
    let mut slow = Vec::new();
    for _ in 0..CAP {
        let mut stream = connect_from(ip(ATTACKER), pacer.addr).await.unwrap();
        stream.write_all(SLOW_HEAD).await.unwrap();
        slow.push(stream);
    }
    // Another address is answered at all (without the cap it would wait
    // for the slow clients' 60 s deadline).
    let other = connect_from(ip(OTHER), pacer.addr).await.unwrap();
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        request_on(other, "GET", "/v1/limits/campaign", &[], ""),
    )
    .await
    .expect("another address starved by one address's slow connections");
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["limit_id"], "campaign");

    // The slow host kept PER_ADDR places; the rest were closed at once.
    let mut closed = 0;
    for stream in &mut slow {
        if closed_within(stream, Duration::from_millis(500)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, CAP - PER_ADDR, "connections past the cap closed");
    // One more from that host, sending nothing, reads why.
    let mut refused = connect_from(ip(ATTACKER), pacer.addr).await.unwrap();
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), refused.read_to_end(&mut raw)).await;
    let reply = parse_reply(&raw);
    reply.assert_json_error(429);
    let message = reply.json()["error"].as_str().unwrap().to_string();
    assert!(
        message.contains("ADSPEND_PACER_MAX_CONNECTIONS_PER_ADDR") && message.contains(ATTACKER),
        "{message}"
    );

    // Its places come back as its connections close.
    drop(slow);
    let served = async {
        loop {
            let stream = connect_from(ip(ATTACKER), pacer.addr).await.unwrap();
            let reply = request_on(stream, "GET", "/healthz", &[], "").await;
            if reply.status == 200 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(10), served)
        .await
        .expect("the host is served again once its connections closed");
}

/// `{"ad_ids": [...]}` of `count` copies of `id`.
fn batch(id: &str, count: usize) -> String {
    let quoted = format!("\"{id}\"");
    format!(r#"{{"ad_ids":[{}]}}"#, vec![quoted; count].join(","))
}

#[tokio::test]
async fn a_decisions_batch_past_the_id_cap_is_413_naming_the_setting() {
    const MAX_IDS: usize = 100;
    let pacer = start_with(Auth::default(), LIMITS, support::CATALOG, MAX_IDS).await;
    let a = pacer.addr;

    let over = request(
        a,
        "POST",
        "/v1/decisions",
        &[JSON],
        &batch("ad-1", MAX_IDS + 1),
    )
    .await;
    over.assert_json_error(413);
    let message = over.json()["error"].as_str().unwrap().to_string();
    assert!(
        message.contains("ADSPEND_PACER_MAX_DECISION_IDS") && message.contains("100"),
        "{message}"
    );
    // The issue's batch: about 2 MB of empty ids (just under the body
    // limit), which used to be decided one by one into a 47.5 MB answer.
    let flood = batch("", 650_000);
    assert!(flood.len() < adspend_pacer::http::MAX_BODY_BYTES);
    request(a, "POST", "/v1/decisions", &[JSON], &flood)
        .await
        .assert_json_error(413);

    // At the cap: decided, and the answer is bounded by it (the longest ad
    // ids the contract allows, unknown here).
    let longest = "x".repeat(64);
    let full = request(
        a,
        "POST",
        "/v1/decisions",
        &[JSON],
        &batch(&longest, MAX_IDS),
    )
    .await;
    assert_eq!(full.status, 200, "{full:?}");
    let decisions = full.json()["decisions"].as_array().unwrap().len();
    assert_eq!(decisions, MAX_IDS);
    assert!(
        full.body.len() <= MAX_IDS * 160,
        "{} bytes",
        full.body.len()
    );
    // Longer than an ad id can be: refused, not echoed back.
    let too_long = request(
        a,
        "POST",
        "/v1/decisions",
        &[JSON],
        &batch(&"x".repeat(65), 1),
    )
    .await;
    too_long.assert_json_error(422);
    assert!(!too_long.body.contains(&"x".repeat(65)), "{too_long:?}");
}

/// Four chains of 16 limits (the deepest 15 parents down), an ad under
/// each chain's bottom: [`MAX_LIMITS_ABOVE_AD`] verdicts per decision.
fn widest_catalog() -> String {
    const { assert!(MAX_LIMITS_ABOVE_AD == 4 * 16 && 15 <= MAX_PARENT_DEPTH) };
    let mut limits = serde_json::Map::new();
    for chain in 0..4 {
        for level in 0..16 {
            let mut spec = serde_json::json!({"budget_micros": 1_000_000, "period": "daily"});
            if level > 0 {
                spec["parent"] = format!("c{chain}-{}", level - 1).into();
            }
            limits.insert(format!("c{chain}-{level}"), spec);
        }
    }
    let leaves: Vec<String> = (0..4).map(|c| format!("c{c}-15")).collect();
    serde_json::json!({"limits": limits, "ads": {"wide": leaves}}).to_string()
}

#[tokio::test]
async fn the_request_timeout_ends_a_decisions_batch_that_runs_long() {
    let limits = HttpLimits {
        request_timeout: Duration::from_millis(200),
        ..LIMITS
    };
    // The largest batch the setting allows, of the costliest ad: 6.4
    // million verdicts, seconds of work. Decided in one go, it answers 200
    // long after the timeout (an async handler that never yields cannot be
    // timed out); decided a chunk at a time, the timeout ends it.
    const MAX_IDS: usize = 100_000;
    let catalog = widest_catalog();
    let pacer = start_with(Auth::default(), limits, catalog.as_bytes(), MAX_IDS).await;
    let body = batch("wide", MAX_IDS);
    assert!(body.len() < adspend_pacer::http::MAX_BODY_BYTES);
    let reply = request(pacer.addr, "POST", "/v1/decisions", &[JSON], &body).await;
    reply.assert_json_error(408);
    assert_eq!(reply.header("connection"), Some("close"));
    // And a batch that fits is answered in full.
    let small = request(
        pacer.addr,
        "POST",
        "/v1/decisions",
        &[JSON],
        &batch("wide", 10),
    )
    .await;
    assert_eq!(small.status, 200, "{small:?}");
    assert_eq!(small.json()["decisions"][0]["servable"], true);
}

#[tokio::test]
async fn pages_of_limits_are_bounded_and_walk_the_catalog_in_order() {
    let mut limits = serde_json::Map::new();
    for i in 0..2_500 {
        limits.insert(
            format!("l-{i:05}"),
            serde_json::json!({"budget_micros": 1, "period": "lifetime"}),
        );
    }
    let catalog = serde_json::json!({"limits": limits}).to_string();
    let pacer = start_with(Auth::default(), LIMITS, catalog.as_bytes(), 1_000).await;
    let a = pacer.addr;
    request(
        a,
        "GET",
        &format!("/v1/limits?limit={}", MAX_PAGE + 1),
        &[],
        "",
    )
    .await
    .assert_json_error(400);
    let mut seen = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let path = match &after {
            Some(after) => format!("/v1/limits?limit={MAX_PAGE}&after={after}"),
            None => format!("/v1/limits?limit={MAX_PAGE}"),
        };
        let page = request(a, "GET", &path, &[], "").await;
        assert_eq!(page.status, 200, "{page:?}");
        let page = page.json();
        let ids = page["limits"].as_array().unwrap();
        assert!(ids.len() <= MAX_PAGE);
        seen.extend(
            ids.iter()
                .map(|l| l["limit_id"].as_str().unwrap().to_string()),
        );
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_string()),
            None => break,
        }
    }
    let expected: Vec<String> = (0..2_500).map(|i| format!("l-{i:05}")).collect();
    assert_eq!(seen, expected);
}
