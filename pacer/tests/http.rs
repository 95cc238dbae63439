//! The pacer's HTTP surface over real TCP: a router on a port-0 listener,
//! served exactly as `run` serves it, driven by hand-written HTTP/1.1 so
//! that a test can also be the slow, stuck or malformed client.

mod support;

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use adspend_pacer::http::{self, serve, Auth, HttpLimits, MAX_BODY_BYTES};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio_util::sync::CancellationToken;

use support::{closed_within, parse_reply, request, start, Reply, DECIDE, JSON, LIMITS, READ};

#[tokio::test]
async fn every_error_is_json_with_its_status() {
    let pacer = start(Auth::default(), LIMITS).await;
    let a = pacer.addr;
    request(a, "GET", "/no/such/thing", &[], "")
        .await
        .assert_json_error(404);
    request(a, "GET", "/v1/limits/nope", &[], "")
        .await
        .assert_json_error(404);
    let wrong_method = request(a, "DELETE", "/v1/decisions", &[], "").await;
    wrong_method.assert_json_error(405);
    assert!(
        wrong_method
            .header("allow")
            .is_some_and(|v| v.contains("POST")),
        "{wrong_method:?}"
    );
    request(a, "POST", "/v1/limits", &[], "")
        .await
        .assert_json_error(405);
    request(a, "POST", "/v1/decisions", &[JSON], "{not json")
        .await
        .assert_json_error(400);
    request(a, "POST", "/v1/decisions", &[], r#"{"ad_ids":[]}"#)
        .await
        .assert_json_error(415);
    request(a, "POST", "/v1/decisions", &[JSON], r#"{"ad_ids":5}"#)
        .await
        .assert_json_error(422);
    request(a, "GET", "/v1/limits?limit=many", &[], "")
        .await
        .assert_json_error(400);
    request(a, "GET", "/v1/limits?limit=0", &[], "")
        .await
        .assert_json_error(400);
    let too_big = format!(r#"{{"ad_ids":["{}"]}}"#, "a".repeat(MAX_BODY_BYTES + 1));
    request(a, "POST", "/v1/decisions", &[JSON], &too_big)
        .await
        .assert_json_error(413);

    // And the successes are untouched.
    let ok = request(
        a,
        "POST",
        "/v1/decisions",
        &[JSON],
        r#"{"ad_ids":["ad-1"]}"#,
    )
    .await;
    assert_eq!(ok.status, 200, "{ok:?}");
    assert_eq!(ok.json()["decisions"][0]["servable"], true);
    let limit = request(a, "GET", "/v1/limits/campaign", &[], "").await;
    assert_eq!(limit.status, 200, "{limit:?}");
    assert_eq!(limit.json()["stale"], false);
    assert_eq!(limit.json()["remaining_micros"], 5000);
}

#[tokio::test]
async fn tokens_guard_their_own_scope_only() {
    let auth = Auth::new(vec![READ.into()], vec![DECIDE.into()]);
    let pacer = start(auth, LIMITS).await;
    let a = pacer.addr;
    let read = format!("Bearer {READ}");
    let decide = format!("Bearer {DECIDE}");
    let body = r#"{"ad_ids":["ad-1"]}"#;

    for path in [
        "/v1/limits",
        "/v1/limits/campaign",
        "/v1/shards",
        "/v1/sources",
    ] {
        let none = request(a, "GET", path, &[], "").await;
        none.assert_json_error(401);
        assert!(
            none.header("www-authenticate")
                .is_some_and(|v| v.starts_with("Bearer ")),
            "{none:?}"
        );
        let ok = request(a, "GET", path, &[("Authorization", &read)], "").await;
        assert_eq!(ok.status, 200, "{path}: {ok:?}");
        // A decide token does not read.
        let other = request(a, "GET", path, &[("Authorization", &decide)], "").await;
        other.assert_json_error(403);
        assert!(
            other
                .header("www-authenticate")
                .is_some_and(|v| v.contains("insufficient_scope")),
            "{other:?}"
        );
    }
    let none = request(a, "POST", "/v1/decisions", &[JSON], body).await;
    none.assert_json_error(401);
    let wrong = request(
        a,
        "POST",
        "/v1/decisions",
        &[JSON, ("Authorization", "Bearer not-the-token-0123456789")],
        body,
    )
    .await;
    wrong.assert_json_error(401);
    assert!(
        wrong
            .header("www-authenticate")
            .is_some_and(|v| v.starts_with("Bearer ") && v.contains("invalid_token")),
        "{wrong:?}"
    );
    assert!(!wrong.body.contains("not-the-token"), "{wrong:?}");
    request(
        a,
        "POST",
        "/v1/decisions",
        &[JSON, ("Authorization", &read)],
        body,
    )
    .await
    .assert_json_error(403);
    let decided = request(
        a,
        "POST",
        "/v1/decisions",
        &[JSON, ("Authorization", &decide)],
        body,
    )
    .await;
    assert_eq!(decided.status, 200, "{decided:?}");
    assert_eq!(decided.json()["decisions"][0]["ad_id"], "ad-1");

    // Never behind a token: the page itself, its script, health and metrics.
    assert_eq!(request(a, "GET", "/", &[], "").await.status, 200);
    let script = request(a, "GET", "/dashboard/sources.js", &[], "").await;
    assert_eq!(script.status, 200, "{script:?}");
    assert!(
        script
            .header("content-type")
            .is_some_and(|v| v.starts_with("text/javascript")),
        "{script:?}"
    );
    assert_eq!(request(a, "GET", "/healthz", &[], "").await.status, 200);
    let metrics = request(a, "GET", "/metrics", &[], "").await;
    assert!(
        metrics.status != 401 && metrics.status != 403,
        "{metrics:?}"
    );
}

#[tokio::test]
async fn the_ops_router_serves_health_and_metrics_only() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    tokio::spawn(serve(
        listener,
        http::ops_router(),
        LIMITS,
        None,
        shutdown.clone(),
    ));
    let health = request(addr, "GET", "/healthz", &[], "").await;
    assert_eq!((health.status, health.body.as_str()), (200, "ok"));
    request(addr, "GET", "/v1/limits", &[], "")
        .await
        .assert_json_error(404);
    request(addr, "POST", "/healthz", &[], "")
        .await
        .assert_json_error(405);
    shutdown.cancel();
}

async fn decide(addr: SocketAddr) -> Reply {
    request(
        addr,
        "POST",
        "/v1/decisions",
        &[JSON],
        r#"{"ad_ids":["ad-1"]}"#,
    )
    .await
}

#[tokio::test]
async fn a_slow_client_does_not_delay_a_decision_on_another_connection() {
    let pacer = start(Auth::default(), LIMITS).await;
    let mut loris = TcpStream::connect(pacer.addr).await.unwrap();
    loris
        .write_all(b"POST /v1/decisions HTTP/1.1\r\nHost: pacer\r\nX-Slow: ")
        .await
        .unwrap();
    let reply = decide(pacer.addr).await;
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["decisions"][0]["servable"], true);
    // Answered while the slow one is still open (its deadline is 10 s away).
    assert!(!closed_within(&mut loris, Duration::from_millis(100)).await);
}

#[tokio::test]
async fn at_the_connection_cap_stuck_clients_are_closed_and_decisions_answer() {
    const CAP: usize = 2;
    let limits = HttpLimits {
        request_timeout: Duration::from_millis(1_000),
        idle_timeout: Duration::from_secs(60),
        max_connections: CAP,
        max_connections_per_addr: CAP,
    };
    let pacer = start(Auth::default(), limits).await;
    // CAP slow-loris clients trickling heads that never end, taking every
    // place under the cap.
    let mut stuck = Vec::new();
    for _ in 0..CAP {
        let mut stream = TcpStream::connect(pacer.addr).await.unwrap();
        stream
            .write_all(b"POST /v1/decisions HTTP/1.1\r\n")
            .await
            .unwrap();
        stuck.push(stream);
    }
    let trickle = async {
        let start = Instant::now();
        let mut closed = vec![false; CAP];
        while closed.iter().any(|c| !c) && start.elapsed() < Duration::from_secs(30) {
            for (stream, closed) in stuck.iter_mut().zip(&mut closed) {
                if *closed {
                    continue;
                }
                if stream.write_all(b"X-Slow: a\r\n").await.is_err()
                    || closed_within(stream, Duration::from_millis(100)).await
                {
                    *closed = true;
                }
            }
        }
        closed
    };
    let started = Instant::now();
    let decision = tokio::time::timeout(Duration::from_secs(30), decide(pacer.addr));
    let (closed, reply) = tokio::join!(trickle, decision);
    let reply = reply.expect("no decision within 30 s: starved by the stuck clients");
    assert_eq!(reply.status, 200, "{reply:?}");
    assert_eq!(reply.json()["decisions"][0]["ad_id"], "ad-1");
    assert_eq!(
        closed,
        vec![true; CAP],
        "the server must close clients that never finish their head"
    );
    // Bounded by the request timeout, not by the stuck clients' patience
    // (generous: only a starved decision would take this long).
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
}

#[tokio::test]
async fn a_trickled_body_gets_408_and_the_connection_closes() {
    let limits = HttpLimits {
        request_timeout: Duration::from_millis(500),
        ..LIMITS
    };
    let pacer = start(Auth::default(), limits).await;
    let mut stream = TcpStream::connect(pacer.addr).await.unwrap();
    stream
        .write_all(
            b"POST /v1/decisions HTTP/1.1\r\nHost: pacer\r\nContent-Type: application/json\r\n\
              Content-Length: 100\r\n\r\n{\"ad_ids\":",
        )
        .await
        .unwrap();
    let mut response = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(20), async {
        let mut buf = [0u8; 1024];
        loop {
            // Keep trickling; ignore a write refused once the server closes.
            let _ = stream.write_all(b" ").await;
            match tokio::time::timeout(Duration::from_millis(100), stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return,
                Ok(Ok(n)) => response.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
    })
    .await;
    assert!(read.is_ok(), "the connection was never closed");
    let reply = parse_reply(&response);
    reply.assert_json_error(408);
    assert_eq!(reply.header("connection"), Some("close"));
}
