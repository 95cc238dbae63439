//! The pacer binary's bounds on what one client can cost (issue 27, DESIGN
//! rule 9), through its settings: one address holding slow connections
//! while another address is answered (ADSPEND_PACER_MAX_CONNECTIONS_PER_ADDR),
//! a decisions batch past ADSPEND_PACER_MAX_DECISION_IDS, and catalogs past
//! the shape bounds (deeper than 16 parents, more than 64 limits above an
//! ad, cyclic) refused at start and on reload.

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use adspend_harness::{free_port, wait_until};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpSocket, TcpStream};

use crate::support::{Backends, Pipeline};

// Neither is 127.0.0.1, which the harness's health checks come from: a
// check's connection the pacer has not yet seen closed would hold one of
// that address's places and leave the attacker one fewer.
const ATTACKER: &str = "127.0.0.3";
const OTHER: &str = "127.0.0.2";

async fn connect_from(from: &str, to: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from.parse().unwrap(), 0))?;
    socket.connect(to).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_address_cannot_take_every_connection() {
    const CAP: usize = 16;
    const PER_ADDR: usize = 4;
    let mut p = Pipeline::start(Backends::default(), 20).await;
    p.pacer = Some(p.spawn_with(
        "pacer",
        free_port(),
        &[
            ("ADSPEND_PACER_MAX_CONNECTIONS", &CAP.to_string()),
            (
                "ADSPEND_PACER_MAX_CONNECTIONS_PER_ADDR",
                &PER_ADDR.to_string(),
            ),
            // The slow clients' places are held for the whole test unless
            // the per-address cap closes them.
            ("ADSPEND_PACER_REQUEST_TIMEOUT_MS", "120000"),
        ],
    ));
    p.wait_pacer().await;
    let addr: SocketAddr = p.pacer_addr.parse().unwrap();
    let limit = p.catalog.limits.keys().next().unwrap().clone();

    // One host: as many slow connections as the whole cap, each a head
    // that never ends.
    let mut slow = Vec::new();
    for _ in 0..CAP {
        let mut stream = connect_from(ATTACKER, addr).await.unwrap();
        stream
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: pacer\r\n")
            .await
            .unwrap();
        slow.push(stream);
    }
    // Another address is answered.
    let other = reqwest::Client::builder()
        .local_address(OTHER.parse::<IpAddr>().unwrap())
        .timeout(Duration::from_secs(20))
        .build()
        .unwrap();
    for _ in 0..5 {
        let response = other
            .get(format!("{}/v1/limits/{limit}", p.pacer_url()))
            .send()
            .await
            .expect("another address answered while one holds slow connections");
        assert_eq!(response.status(), 200);
        let body: Value = response.json().await.unwrap();
        assert_eq!(body["limit_id"], limit.as_str());
    }
    // The host kept PER_ADDR of its connections; the rest were closed.
    let mut closed = 0;
    for stream in &mut slow {
        let mut buf = [0u8; 512];
        let read = tokio::time::timeout(Duration::from_millis(500), stream.read(&mut buf)).await;
        if matches!(read, Ok(Ok(_)) | Ok(Err(_))) {
            closed += 1;
        }
    }
    assert_eq!(closed, CAP - PER_ADDR);
    // One more from it, sending nothing, is told why.
    let mut refused = connect_from(ATTACKER, addr).await.unwrap();
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), refused.read_to_end(&mut raw)).await;
    let text = String::from_utf8_lossy(&raw);
    assert!(text.starts_with("HTTP/1.1 429 "), "{text}");
    assert!(
        text.contains("ADSPEND_PACER_MAX_CONNECTIONS_PER_ADDR"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decisions_batch_past_the_id_cap_is_413() {
    let mut p = Pipeline::start(Backends::default(), 20).await;
    p.pacer = Some(p.spawn_with(
        "pacer",
        free_port(),
        &[("ADSPEND_PACER_MAX_DECISION_IDS", "50")],
    ));
    p.wait_pacer().await;
    let http = reqwest::Client::new();
    let ad = p.catalog.ads.keys().next().unwrap().clone();
    let decide = |count: usize| {
        http.post(format!("{}/v1/decisions", p.pacer_url()))
            .json(&serde_json::json!({ "ad_ids": vec![ad.as_str(); count] }))
            .send()
    };
    let over = decide(51).await.unwrap();
    assert_eq!(over.status(), 413);
    let body: Value = over.json().await.unwrap();
    let message = body["error"].as_str().unwrap_or_default();
    assert!(
        message.contains("ADSPEND_PACER_MAX_DECISION_IDS") && message.contains("50"),
        "{body}"
    );
    let full = decide(50).await.unwrap();
    assert_eq!(full.status(), 200);
    let body: Value = full.json().await.unwrap();
    assert_eq!(body["decisions"].as_array().map(Vec::len), Some(50));
}

/// `{"limits": ...}` with `limits` as (id, parent) and `ads` as (ad, listed).
fn catalog_doc(limits: &[(String, Option<String>)], ads: &[(&str, Vec<String>)]) -> Vec<u8> {
    let limits: serde_json::Map<String, Value> = limits
        .iter()
        .map(|(id, parent)| {
            let mut spec = serde_json::json!({"budget_micros": 1_000_000, "period": "lifetime"});
            if let Some(parent) = parent {
                spec["parent"] = parent.as_str().into();
            }
            (id.clone(), spec)
        })
        .collect();
    let ads: serde_json::Map<String, Value> = ads
        .iter()
        .map(|(ad, listed)| (ad.to_string(), serde_json::json!(listed)))
        .collect();
    serde_json::to_vec(&serde_json::json!({"limits": limits, "ads": ads})).unwrap()
}

/// `p-0` at the top down to `p-n`, which has `n` parents.
fn chain(prefix: &str, n: usize) -> Vec<(String, Option<String>)> {
    (0..=n)
        .map(|i| {
            let parent = i.checked_sub(1).map(|p| format!("{prefix}-{p:05}"));
            (format!("{prefix}-{i:05}"), parent)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn catalogs_past_the_shape_bounds_are_refused() {
    let mut p = Pipeline::start(Backends::default(), 20).await;
    // The 20,000-deep chain.
    let deep = catalog_doc(&chain("d", 20_000), &[("ad", vec!["d-20000".into()])]);
    // An ad listing 65 limits.
    let flat: Vec<(String, Option<String>)> = (0..65).map(|i| (format!("f-{i}"), None)).collect();
    let listed = flat.iter().map(|(id, _)| id.clone()).collect();
    let wide = catalog_doc(&flat, &[("wide", listed)]);
    // An ad under five 13-limit chains: 65 limits above it.
    let mut tall_limits = Vec::new();
    for c in 0..5 {
        tall_limits.extend(chain(&format!("t{c}"), 12));
    }
    let tall_ad = (0..5).map(|c| format!("t{c}-00012")).collect();
    let tall = catalog_doc(&tall_limits, &[("tall", tall_ad)]);
    let mut cycle_limits = chain("c", 3);
    cycle_limits[0].1 = Some("c-00003".into());
    let cyclic = catalog_doc(&cycle_limits, &[]);

    let cases: [(&str, &[u8], &str); 4] = [
        ("deep", &deep, "parents above it, more than the 16 allowed"),
        ("wide", &wide, "lists 65 limits, more than the 64 allowed"),
        (
            "tall",
            &tall,
            "65 limits above it (its own and their parents), more than the 64 allowed",
        ),
        ("cyclic", &cyclic, "parent chain has a cycle"),
    ];
    for (name, doc, reason) in cases {
        let path = p.dir.path().join(format!("{name}.json"));
        std::fs::write(&path, doc).unwrap();
        let mut pacer = p.spawn_with(
            "pacer",
            free_port(),
            &[("ADSPEND_CATALOG", path.to_str().unwrap())],
        );
        let status = pacer
            .wait_for_exit(Duration::from_secs(30))
            .await
            .unwrap_or_else(|_| panic!("the pacer started with the {name} catalog"));
        let log = pacer.log_tail(20);
        assert_eq!(status.code(), Some(1), "{name}: {status:?}\n{log}");
        let line = log
            .lines()
            .rev()
            .find(|l| l.starts_with("pacer: error: "))
            .unwrap_or_default();
        assert!(
            line.contains("invalid catalog") && line.contains(reason),
            "{name}: no error line with {reason:?} in:\n{log}"
        );
    }

    // Running on a good catalog, a reload past the bounds is rejected and
    // the previous catalog kept.
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let good = std::fs::read(&p.catalog_path).unwrap();
    std::fs::write(&p.catalog_path, &deep).unwrap();
    let pacer = p.pacer.as_mut().unwrap();
    pacer
        .wait_for_log("catalog update rejected", Duration::from_secs(30))
        .await
        .expect("the deep catalog's reload rejected");
    assert!(pacer.log_tail(50).contains("parents above it"));
    let limit = p.catalog.limits.keys().next().unwrap().clone();
    let answered = wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        let url = format!("{}/v1/limits/{limit}", p.pacer_url());
        async move { reqwest::get(&url).await.is_ok_and(|r| r.status() == 200) }
    })
    .await;
    assert!(answered.is_ok(), "the previous catalog still served");
    std::fs::write(&p.catalog_path, good).unwrap();
}
