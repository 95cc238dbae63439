//! The pacer binary's API settings on a running pipeline: bearer tokens per
//! scope, the separate operations listener, and a shard whose aggregator
//! stops pushing (frozen with SIGSTOP) turning its limits stale and their
//! ads unservable until it pushes again; the dashboard (headless Chromium)
//! asks for the read token and, given it, marks the stale limits.

use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use adspend_harness::{free_port, wait_until, wait_until_ok};
use anyhow::{bail, Context};
use serde_json::Value;

use crate::support::{sim_config, try_metric, Backends, Pipeline};

const READ: &str = "dashboard-read-token-0123456789";
const DECIDE: &str = "bidder-decide-token-0123456789";
/// The smallest stale threshold the pacer accepts: the aggregator's 1 s
/// heartbeat keeps a live shard well inside it.
const STALE_AFTER_MS: &str = "2000";

async fn get(http: &reqwest::Client, url: &str, token: Option<&str>) -> reqwest::Response {
    let mut request = http.get(url);
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.expect("GET")
}

async fn decide(
    http: &reqwest::Client,
    url: &str,
    token: Option<&str>,
    ads: &[&str],
) -> reqwest::Response {
    let mut request = http
        .post(format!("{url}/v1/decisions"))
        .json(&serde_json::json!({ "ad_ids": ads }));
    if let Some(token) = token {
        request = request.bearer_auth(token);
    }
    request.send().await.expect("POST /v1/decisions")
}

/// Every limit of the API (one page is enough for this catalog).
async fn limits(http: &reqwest::Client, url: &str) -> anyhow::Result<Vec<Value>> {
    let response = get(http, &format!("{url}/v1/limits?limit=1000"), Some(READ)).await;
    if !response.status().is_success() {
        bail!("GET /v1/limits: {}", response.status());
    }
    let page: Value = response.json().await?;
    Ok(page["limits"].as_array().context("limits array")?.clone())
}

async fn all_stale(http: &reqwest::Client, url: &str, stale: bool) -> anyhow::Result<usize> {
    let limits = limits(http, url).await?;
    let wrong: Vec<&str> = limits
        .iter()
        .filter(|l| l["stale"].as_bool() != Some(stale))
        .filter_map(|l| l["limit_id"].as_str())
        .collect();
    if limits.is_empty() || !wrong.is_empty() {
        bail!("stale != {stale} for {wrong:?} of {} limits", limits.len());
    }
    Ok(limits.len())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_ops_listener_and_a_silent_shard_going_stale() {
    let mut p = Pipeline::start(Backends::default(), 20).await;
    let ops_port = free_port();
    let ops_addr = format!("127.0.0.1:{ops_port}");
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn_with(
        "pacer",
        free_port(),
        &[
            ("ADSPEND_PACER_READ_TOKENS", READ),
            ("ADSPEND_PACER_DECIDE_TOKENS", DECIDE),
            ("ADSPEND_PACER_OPS_ADDR", &ops_addr),
            ("ADSPEND_PACER_STALE_AFTER_MS", STALE_AFTER_MS),
        ],
    ));
    p.wait_pacer().await;
    let http = reqwest::Client::new();
    let url = p.pacer_url();
    let ops = format!("http://{ops_addr}");
    p.publish(&sim_config(500, 3)).await;
    let ad = p.catalog.ads.keys().next().expect("an ad").clone();

    // Tokens: each scope its own, 401 with a Bearer challenge without one.
    let refused = get(&http, &format!("{url}/v1/limits"), None).await;
    assert_eq!(refused.status(), 401);
    let challenge = refused.headers()["www-authenticate"].to_str().unwrap();
    assert!(challenge.starts_with("Bearer "), "{challenge}");
    let body: Value = refused.json().await.unwrap();
    assert!(body["error"].is_string(), "{body}");
    assert_eq!(
        get(&http, &format!("{url}/v1/limits"), Some(DECIDE))
            .await
            .status(),
        403
    );
    assert_eq!(decide(&http, &url, None, &[&ad]).await.status(), 401);
    assert_eq!(decide(&http, &url, Some(READ), &[&ad]).await.status(), 403);
    // The health check and metrics stay open on the API port.
    assert_eq!(
        get(&http, &format!("{url}/healthz"), None).await.status(),
        200
    );

    // Fresh: the aggregator's pushes (and heartbeats) keep every limit live.
    // Wait for its first push: before any, a young pacer's limits count as
    // fresh too, and a slow start would leave nothing to go stale below.
    wait_until_ok(
        Duration::from_secs(60),
        Duration::from_millis(200),
        || async {
            let shards: Value = get(&http, &format!("{url}/v1/shards"), Some(READ))
                .await
                .json()
                .await?;
            match shards["shards"].as_array() {
                Some(s) if !s.is_empty() && s.iter().all(|s| s["stale"] == false) => Ok(()),
                _ => bail!("no fresh shard yet: {shards}"),
            }
        },
    )
    .await
    .expect("the aggregator's pushes reach the pacer");
    let count = wait_until_ok(Duration::from_secs(30), Duration::from_millis(200), || {
        all_stale(&http, &url, false)
    })
    .await
    .expect("every limit fresh while the aggregator pushes");
    assert_eq!(count, p.catalog.limits.len());
    let fresh: Value = decide(&http, &url, Some(DECIDE), &[&ad])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(fresh["decisions"][0]["stale"], Value::Null, "{fresh}");

    // The operations listener: health and metrics only, no token.
    let health = get(&http, &format!("{ops}/healthz"), None).await;
    assert_eq!(health.status(), 200);
    assert_eq!(
        get(&http, &format!("{ops}/v1/limits"), Some(READ))
            .await
            .status(),
        404,
        "the operations port serves no API"
    );

    // The aggregator freezes: no push, no heartbeat. After the threshold
    // every limit is stale (its ads can no longer be bid on)...
    p.aggregator.as_mut().unwrap().pause().expect("SIGSTOP");
    wait_until_ok(Duration::from_secs(30), Duration::from_millis(200), || {
        all_stale(&http, &url, true)
    })
    .await
    .expect("every limit stale once the only shard went silent");
    let stopped: Value = decide(&http, &url, Some(DECIDE), &[&ad])
        .await
        .json()
        .await
        .unwrap();
    let decision = &stopped["decisions"][0];
    assert_eq!(
        (
            &decision["servable"],
            &decision["multiplier"],
            &decision["stale"]
        ),
        (
            &Value::Bool(false),
            &serde_json::json!(0.0),
            &Value::Bool(true)
        ),
        "{stopped}"
    );
    let shards: Value = get(&http, &format!("{url}/v1/shards"), Some(READ))
        .await
        .json()
        .await
        .unwrap();
    assert!(
        shards["shards"]
            .as_array()
            .is_some_and(|s| !s.is_empty() && s.iter().all(|s| s["stale"] == true)),
        "{shards}"
    );
    let page = dashboard_dom(&format!("{url}/#token={READ}")).await;
    let rows = rendered_rows(&page);
    assert_eq!(
        rows.matches("<tr data-limit=").count(),
        p.catalog.limits.len(),
        "one row per limit:\n{rows}"
    );
    assert_eq!(
        rows.matches("data-stale=\"true\"").count(),
        p.catalog.limits.len(),
        "every row marked stale:\n{rows}"
    );
    assert_eq!(
        rows.matches(">STALE</span>").count(),
        p.catalog.limits.len(),
        "a STALE badge on every row:\n{rows}"
    );
    assert!(!body_classes(&page).contains("needs-token"));
    let locked = dashboard_dom(&format!("{url}/")).await;
    assert!(
        body_classes(&locked).contains("needs-token"),
        "without a token the page asks for one: <body class=\"{}\">",
        body_classes(&locked)
    );
    assert!(
        !rendered_rows(&locked).contains("<tr data-limit="),
        "without a token no limit is shown"
    );

    wait_until(
        Duration::from_secs(10),
        Duration::from_millis(200),
        || async {
            try_metric(ops_port, "adspend_pacer_stale_shards")
                .await
                .is_ok_and(|v| v == 1.0)
        },
    )
    .await
    .expect("the stale-shards gauge on the operations port");

    // ...until it pushes again.
    p.aggregator.as_mut().unwrap().resume().expect("SIGCONT");
    wait_until_ok(Duration::from_secs(30), Duration::from_millis(200), || {
        all_stale(&http, &url, false)
    })
    .await
    .expect("every limit fresh again once the shard pushes");
    let again: Value = decide(&http, &url, Some(DECIDE), &[&ad])
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(again["decisions"][0]["stale"], Value::Null, "{again}");
}

/// The rendered table body (the page's script holds row templates too).
fn rendered_rows(dom: &str) -> &str {
    let start = dom.find("<tbody id=\"rows\"").expect("the rows' tbody");
    let end = start + dom[start..].find("</tbody>").expect("</tbody>");
    &dom[start..end]
}

/// The class attribute of the rendered `<body>` tag.
fn body_classes(dom: &str) -> &str {
    let tag = &dom[dom.find("<body").expect("<body")..];
    let tag = &tag[..tag.find('>').expect("end of <body>")];
    tag.split_once("class=\"")
        .and_then(|(_, rest)| rest.split_once('"'))
        .map_or("", |(classes, _)| classes)
}

/// The dashboard's DOM after a few seconds of its own polling, rendered by
/// headless Chromium (as `dashboard::chromium` does for the dashboard test).
async fn dashboard_dom(url: &str) -> String {
    let url = url.to_owned();
    tokio::task::spawn_blocking(move || {
        let dir = tempfile::tempdir().expect("tempdir");
        let out = dir.path().join("dom.html");
        let mut child = Command::new("chromium")
            .args([
                "--headless=new",
                "--no-sandbox",
                "--disable-gpu",
                "--no-first-run",
                "--disable-extensions",
                "--virtual-time-budget=3000",
                "--dump-dom",
            ])
            .arg(format!(
                "--user-data-dir={}",
                dir.path().join("profile").display()
            ))
            .arg(&url)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).expect("output file"))
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .expect("chromium (scripts/install-deps.sh test installs it)");
        let deadline = Instant::now() + Duration::from_secs(120);
        while child.try_wait().expect("wait").is_none() {
            if Instant::now() > deadline {
                let pid = nix::unistd::Pid::from_raw(child.id() as i32);
                let _ = nix::sys::signal::killpg(pid, nix::sys::signal::Signal::SIGKILL);
                let _ = child.wait();
                panic!("chromium did not render {url} within 120 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        std::fs::read_to_string(&out).expect("chromium output")
    })
    .await
    .expect("chromium runner")
}
