//! How a service ends, one clear error line and never a panic: exit 64 for
//! a bad setting (one that does not parse as its type, is out of range, or
//! fails validation), exit 1 for a dependency that cannot be reached, exit
//! 0 after SIGTERM.

use std::time::Duration;

use adspend_harness::{free_port, TestCa};

use crate::support::{Backends, Pipeline};

/// A bad setting (`EX_USAGE`).
const EXIT_BAD_SETTING: i32 = 64;
/// An outage or any other failure.
const EXIT_FAILURE: i32 = 1;
/// Stopped by SIGTERM.
const EXIT_CLEAN: i32 = 0;

const SERVICES: [&str; 3] = ["limiter", "aggregator", "pacer"];

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

/// Exits with `code` and an error line holding `expected`; returns the line.
async fn fails_with(
    p: &Pipeline,
    service: &str,
    extra: &[(&str, &str)],
    code: i32,
    expected: &str,
) -> String {
    let log = exits_with(p, service, extra, code).await;
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
    last.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_dependencies_exit_1() {
    let p = Pipeline::start(Backends::default(), 10).await;
    let nowhere_nats = format!("nats://127.0.0.1:{}", free_port());
    let nowhere_etcd = format!("127.0.0.1:{}", free_port());
    for service in SERVICES {
        fails_with(
            &p,
            service,
            &[("ADSPEND_NATS_URL", &nowhere_nats)],
            EXIT_FAILURE,
            "cannot reach NATS",
        )
        .await;
    }
    fails_with(
        &p,
        "aggregator",
        &[("ADSPEND_ETCD_ENDPOINTS", &nowhere_etcd)],
        EXIT_FAILURE,
        "cannot reach etcd",
    )
    .await;
    // A catalog that cannot be read or does not hold together is not a
    // setting of ours: it is fixed where it is kept.
    fails_with(
        &p,
        "limiter",
        &[("ADSPEND_CATALOG", "/nonexistent/catalog.json")],
        EXIT_FAILURE,
        "/nonexistent/catalog.json",
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
        EXIT_FAILURE,
        "limit \"b\" is not in",
    )
    .await;
    // A port another process holds.
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    fails_with(
        &p,
        "pacer",
        &[("ADSPEND_PACER_ADDR", &taken)],
        EXIT_FAILURE,
        "cannot bind pacer API",
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_settings_exit_64_naming_the_setting() {
    let p = Pipeline::start(Backends::default(), 10).await;
    let nowhere_etcd = format!("127.0.0.1:{}", free_port());
    let ca = TestCa::new("pacer");
    let pair = ca.server("pacer");
    let (cert, key) = (
        pair.cert.display().to_string(),
        pair.key.display().to_string(),
    );
    // Refused by validation, before anything is bound or connected (the
    // etcd named here is never reached).
    for (service, extra, expected) in [
        (
            "aggregator",
            &[("ADSPEND_AGGREGATOR_PARTITIONS", "auto")][..],
            "set ADSPEND_ETCD_ENDPOINTS",
        ),
        (
            "aggregator",
            &[
                ("ADSPEND_AGGREGATOR_PARTITIONS", "auto"),
                ("ADSPEND_ETCD_ENDPOINTS", &nowhere_etcd),
                ("ADSPEND_AGGREGATOR_ID", "no/slashes"),
            ],
            "ADSPEND_AGGREGATOR_ID",
        ),
        (
            "aggregator",
            &[("ADSPEND_AGGREGATOR_PARTITIONS", "1,99")],
            "ADSPEND_AGGREGATOR_PARTITIONS",
        ),
        (
            "aggregator",
            &[("ADSPEND_OBJECT_STORE_URL", "ftp://x")],
            "ADSPEND_OBJECT_STORE_URL",
        ),
        (
            "pacer",
            &[("ADSPEND_PACER_ADDR", "not-an-address")],
            "ADSPEND_PACER_ADDR",
        ),
        (
            "pacer",
            &[("ADSPEND_PACER_TLS_CERT", &cert)],
            "ADSPEND_PACER_TLS_KEY",
        ),
        (
            "pacer",
            &[
                ("ADSPEND_PACER_TLS_CERT", &cert),
                ("ADSPEND_PACER_TLS_KEY", &cert),
            ],
            "ADSPEND_PACER_TLS_KEY",
        ),
        (
            "pacer",
            &[
                ("ADSPEND_PACER_TLS_CERT", "/nonexistent/pacer.pem"),
                ("ADSPEND_PACER_TLS_KEY", &key),
            ],
            "ADSPEND_PACER_TLS_CERT",
        ),
        (
            "limiter",
            &[("ADSPEND_METRICS_ADDR", "nowhere")],
            "ADSPEND_METRICS_ADDR",
        ),
        (
            "limiter",
            &[("ADSPEND_CATALOG", "etcd:///adspend/catalog")],
            "ADSPEND_ETCD_ENDPOINTS",
        ),
        (
            "aggregator",
            &[("ADSPEND_WORKER_THREADS", "0")],
            "ADSPEND_WORKER_THREADS",
        ),
        (
            "pacer",
            &[("ADSPEND_WORKER_THREADS", "many")],
            "ADSPEND_WORKER_THREADS",
        ),
        (
            "pacer",
            &[("ADSPEND_REGION", "East"), ("ADSPEND_REGIONS", "East")],
            "ADSPEND_REGION",
        ),
        (
            "pacer",
            &[
                ("ADSPEND_REGION", "east"),
                ("ADSPEND_REGIONS", "west,south"),
            ],
            "ADSPEND_REGIONS",
        ),
        ("pacer", &[("ADSPEND_REGIONS", "east")], "ADSPEND_REGIONS"),
    ] {
        let line = fails_with(&p, service, extra, EXIT_BAD_SETTING, expected).await;
        assert!(line.contains("invalid setting"), "{line}");
    }

    // Refused by the argument parser: not a number, or out of range. The
    // line names the flag and the variable.
    for (service, setting, value, flag) in [
        ("limiter", "ADSPEND_PARTITIONS", "abc", "--partitions"),
        ("limiter", "ADSPEND_PARTITIONS", "0", "--partitions"),
        (
            "aggregator",
            "ADSPEND_DEDUPE_WINDOW_MS",
            "-5",
            "--dedupe-window-ms",
        ),
        (
            "aggregator",
            "ADSPEND_LEASE_TTL_MS",
            "100",
            "--lease-ttl-ms",
        ),
        ("aggregator", "ADSPEND_AGGREGATOR_WRITERS", "0", "--writers"),
        ("limiter", "ADSPEND_LIMITER_WORKERS", "-1", "--workers"),
        (
            "pacer",
            "ADSPEND_PACER_STALE_AFTER_MS",
            "soon",
            "--stale-after-ms",
        ),
        (
            "pacer",
            "ADSPEND_PACER_MAX_CONNECTIONS",
            "0",
            "--max-connections",
        ),
        (
            "pacer",
            "ADSPEND_REGION_REPORT_INTERVAL_MS",
            "10",
            "--region-report-interval-ms",
        ),
    ] {
        let line = fails_with(
            &p,
            service,
            &[(setting, value)],
            EXIT_BAD_SETTING,
            &format!("invalid value '{value}' for '{flag}"),
        )
        .await;
        assert!(
            line.ends_with(&format!("({flag} or {setting})")),
            "{service} with {setting}={value}: the line does not name {setting}: {line}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_every_service_with_exit_0() {
    let p = Pipeline::start(Backends::default(), 10).await;
    for (service, running) in [
        ("aggregator", "aggregator running"),
        ("limiter", "limiter running"),
        ("pacer", "pacer serving"),
    ] {
        let mut process = p.spawn(service);
        process
            .wait_for_log(running, Duration::from_secs(30))
            .await
            .unwrap_or_else(|e| panic!("{service} did not start: {e}\n{}", process.log_tail(30)));
        let status = process
            .terminate(Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("{service} did not stop: {e}"));
        let log = process.log_tail(30);
        assert_eq!(
            status.code(),
            Some(EXIT_CLEAN),
            "{service} after SIGTERM: {status:?}\n{log}"
        );
        assert!(!log.contains(&format!("{service}: error")), "{log}");
    }
}
