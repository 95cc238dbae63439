//! HTTPS on the pacer binary's API port (`ADSPEND_PACER_TLS_CERT` and
//! `_KEY`) with bearer tokens, on a running pipeline: a client that trusts
//! the CA reads and decides with its tokens; a plaintext client and a client
//! that does not trust the certificate get no answer, and the pacer serves
//! on after them; the operations listener stays plain. (A certificate
//! without its key: `config_errors`.)

use std::time::Duration;

use adspend_harness::{free_port, wait_until, TestCa};
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::support::{sim_config, Backends, Pipeline};

const READ: &str = "dashboard-read-token-0123456789";
const DECIDE: &str = "bidder-decide-token-0123456789";

/// A client that trusts `ca` and nothing else.
fn trusting(ca: &std::path::Path) -> reqwest::Client {
    let pem = std::fs::read(ca).expect("read the CA");
    reqwest::Client::builder()
        .tls_built_in_root_certs(false)
        .add_root_certificate(reqwest::Certificate::from_pem(&pem).expect("the CA's PEM"))
        .timeout(Duration::from_secs(5))
        .build()
        .expect("an HTTPS client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_tokens_and_plaintext_refused() {
    let ca = TestCa::new("pacer");
    let pair = ca.server("pacer");
    let (cert, key) = (
        pair.cert.display().to_string(),
        pair.key.display().to_string(),
    );
    let mut p = Pipeline::start(Backends::default(), 10).await;
    let ops_addr = format!("127.0.0.1:{}", free_port());
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn_with(
        "pacer",
        free_port(),
        &[
            ("ADSPEND_PACER_TLS_CERT", &cert),
            ("ADSPEND_PACER_TLS_KEY", &key),
            ("ADSPEND_PACER_READ_TOKENS", READ),
            ("ADSPEND_PACER_DECIDE_TOKENS", DECIDE),
            ("ADSPEND_PACER_OPS_ADDR", &ops_addr),
        ],
    ));
    let https = trusting(&ca.ca());
    let url = format!("https://{}", p.pacer_addr);
    let health = format!("{url}/healthz");
    wait_until(Duration::from_secs(30), Duration::from_millis(100), || {
        let (https, health) = (https.clone(), health.clone());
        async move {
            https
                .get(&health)
                .send()
                .await
                .is_ok_and(|r| r.status().is_success())
        }
    })
    .await
    .expect("the pacer answers over HTTPS");
    p.publish(&sim_config(200, 3)).await;
    let ad = p.catalog.ads.keys().next().expect("an ad").clone();

    // Over HTTPS the scopes hold as over HTTP: 401 without a token, the
    // read token reads, the decide token decides.
    let limits = format!("{url}/v1/limits?limit=1000");
    assert_eq!(https.get(&limits).send().await.unwrap().status(), 401);
    let read = https.get(&limits).bearer_auth(READ).send().await.unwrap();
    assert_eq!(read.status(), 200);
    let page: Value = read.json().await.unwrap();
    assert!(page["limits"].is_array(), "{page}");
    let decided = https
        .post(format!("{url}/v1/decisions"))
        .bearer_auth(DECIDE)
        .json(&serde_json::json!({ "ad_ids": [ad] }))
        .send()
        .await
        .unwrap();
    assert_eq!(decided.status(), 200);

    // A plaintext client gets no HTTP answer: the pacer closes the
    // connection when its bytes are no TLS handshake.
    let plain = reqwest::Client::builder()
        .timeout(Duration::from_secs(5))
        .build()
        .unwrap();
    let refused = plain
        .get(format!("http://{}/v1/limits", p.pacer_addr))
        .bearer_auth(READ)
        .send()
        .await;
    assert!(refused.is_err(), "plain HTTP answered: {refused:?}");
    let mut raw = tokio::net::TcpStream::connect(&p.pacer_addr).await.unwrap();
    raw.write_all(
        format!("GET /v1/limits HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {READ}\r\n\r\n")
            .as_bytes(),
    )
    .await
    .unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), raw.read_to_end(&mut answer))
        .await
        .expect("the pacer closes a plaintext connection");
    assert!(
        !String::from_utf8_lossy(&answer).contains("HTTP/1.1"),
        "an HTTP answer in plaintext: {}",
        String::from_utf8_lossy(&answer)
    );

    // A client that does not trust the pacer's CA stops at the handshake.
    let other = TestCa::new("other");
    let untrusting = trusting(&other.ca());
    assert!(untrusting.get(&health).send().await.is_err());

    // The pacer serves on, and counted the refused handshakes.
    assert_eq!(https.get(&health).send().await.unwrap().status(), 200);
    let metrics = plain
        .get(format!("http://{ops_addr}/metrics"))
        .send()
        .await
        .expect("the operations listener is plain HTTP")
        .text()
        .await
        .unwrap();
    let handshakes = metrics
        .lines()
        .find(|l| l.starts_with("adspend_pacer_http_refused_total") && l.contains("tls_handshake"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(
        handshakes >= 3.0,
        "refused handshakes counted: {handshakes}"
    );
}
