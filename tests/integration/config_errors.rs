//! A bad setting or an unreachable dependency ends a service with one clear
//! error line and exit code 1, never a panic. A value that does not even
//! parse as its setting's type is refused earlier, by the argument parser,
//! which exits 2 and names the setting's flag.

use std::time::Duration;

use adspend_tests::harness::free_port;

use crate::support::{Backends, Pipeline};

/// What the services' `main` returns for an error from validation or
/// startup (`ExitCode::FAILURE`).
const EXIT_ERROR: i32 = 1;
/// What clap exits with when a value does not parse as its setting's type.
const EXIT_USAGE: i32 = 2;

/// Runs `service` with `extra` settings until it exits, checks the exit code
/// and that it did not panic, and returns its log.
async fn exits_with(p: &Pipeline, service: &str, extra: &[(&str, &str)], code: i32) -> String {
    let mut process = p.spawn_with(service, free_port(), extra);
    let status = process
        .wait_for_exit(Duration::from_secs(30))
        .await
        .unwrap_or_else(|_| panic!("{service} with {extra:?} kept running"));
    let log = process.log_tail(30);
    assert_eq!(
        status.code(),
        Some(code),
        "{service} with {extra:?} ended with {status:?}, not exit code {code}:\n{log}"
    );
    assert!(!log.contains("panicked"), "{service} panicked:\n{log}");
    log
}

async fn fails_with(p: &Pipeline, service: &str, extra: &[(&str, &str)], expected: &str) {
    let log = exits_with(p, service, extra, EXIT_ERROR).await;
    // The error line is the service's last word; the NATS client's own
    // "closed" event may still be logged after it, from a background task.
    let prefix = format!("{service}: error: ");
    let last = log
        .lines()
        .rev()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_default();
    assert!(
        last.contains(expected),
        "{service} with {extra:?}: no error line with {expected:?} in:\n{log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_and_unreachable_dependencies_fail_clearly() {
    let p = Pipeline::start(Backends::default(), 10).await;
    let nowhere_nats = format!("nats://127.0.0.1:{}", free_port());
    let nowhere_etcd = format!("127.0.0.1:{}", free_port());
    fails_with(
        &p,
        "limiter",
        &[("ADSPEND_NATS_URL", &nowhere_nats)],
        "cannot reach NATS",
    )
    .await;
    fails_with(
        &p,
        "pacer",
        &[("ADSPEND_NATS_URL", &nowhere_nats)],
        "cannot reach NATS",
    )
    .await;
    fails_with(
        &p,
        "aggregator",
        &[("ADSPEND_ETCD_ENDPOINTS", &nowhere_etcd)],
        "cannot reach etcd",
    )
    .await;
    fails_with(
        &p,
        "aggregator",
        &[("ADSPEND_AGGREGATOR_PARTITIONS", "auto")],
        "set ADSPEND_ETCD_ENDPOINTS",
    )
    .await;
    fails_with(
        &p,
        "aggregator",
        &[
            ("ADSPEND_AGGREGATOR_PARTITIONS", "auto"),
            ("ADSPEND_ETCD_ENDPOINTS", &nowhere_etcd),
            ("ADSPEND_AGGREGATOR_ID", "no/slashes"),
        ],
        "ADSPEND_AGGREGATOR_ID",
    )
    .await;
    fails_with(
        &p,
        "aggregator",
        &[("ADSPEND_OBJECT_STORE_URL", "ftp://x")],
        "ADSPEND_OBJECT_STORE_URL",
    )
    .await;
    fails_with(
        &p,
        "pacer",
        &[("ADSPEND_PACER_ADDR", "not-an-address")],
        "ADSPEND_PACER_ADDR",
    )
    .await;
    fails_with(
        &p,
        "limiter",
        &[("ADSPEND_CATALOG", "/nonexistent/catalog.json")],
        "/nonexistent/catalog.json",
    )
    .await;
    fails_with(
        &p,
        "limiter",
        &[("ADSPEND_CATALOG", "etcd:///adspend/catalog")],
        "ADSPEND_ETCD_ENDPOINTS",
    )
    .await;
    let bad_catalog = p.dir.path().join("bad.json");
    std::fs::write(
        &bad_catalog,
        r#"{"limits":{"a":{"budget_micros":1,"period":"daily"}},"ads":{"x":["b"]}}"#,
    )
    .unwrap();
    fails_with(
        &p,
        "pacer",
        &[("ADSPEND_CATALOG", bad_catalog.to_str().unwrap())],
        "limit \"b\" is not in",
    )
    .await;

    for (service, setting, value, flag) in [
        ("limiter", "ADSPEND_PARTITIONS", "abc", "--partitions"),
        ("limiter", "ADSPEND_PARTITIONS", "0", "--partitions"),
        (
            "aggregator",
            "ADSPEND_DEDUPE_WINDOW_MS",
            "-5",
            "--dedupe-window-ms",
        ),
    ] {
        let log = exits_with(&p, service, &[(setting, value)], EXIT_USAGE).await;
        assert!(
            log.contains(&format!("invalid value '{value}' for '{flag}")),
            "{service} with {setting}={value}: no parse error naming {flag} in:\n{log}"
        );
    }
}
