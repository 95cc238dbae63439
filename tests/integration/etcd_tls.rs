//! etcd over TLS with client-certificate auth (ADSPEND_ETCD_TLS_*): the
//! services with their own certificates read the catalog from and record
//! checkpoints in an etcd that accepts nothing else, and the pipeline stays
//! exact; a client without a certificate, with one from another CA, or
//! trusting another CA is refused with a clear error and exit code 1; a
//! wrong TLS setting is a config error naming it.

use std::time::Duration;

use adspend_common::config::EtcdArgs;
use adspend_harness::{free_port, CertPair, Etcd, EtcdTls, ServiceProcess, TestCa};

use crate::support::{assert_exact, sim_config, Backends, Pipeline, CATALOG_KEY};

/// What the services' `main` returns for a startup error.
const EXIT_ERROR: i32 = 1;
/// A bad setting (README, "Exit codes").
const EXIT_BAD_SETTING: i32 = 64;

/// A TLS etcd with client-certificate auth, and the CA that signs its
/// clients.
async fn tls_etcd() -> (TestCa, Etcd) {
    let ca = TestCa::new("etcd");
    let etcd = Etcd::start_tls(EtcdTls {
        ca: ca.ca(),
        server: ca.server("etcd-server"),
        client: ca.client("harness"),
    })
    .await;
    (ca, etcd)
}

/// A service's etcd settings, as an operator would give them.
fn etcd_env(etcd: &Etcd, ca: &TestCa, client: Option<&CertPair>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("ADSPEND_ETCD_ENDPOINTS", etcd.endpoints()),
        ("ADSPEND_ETCD_TLS_CA", ca.ca().display().to_string()),
        ("ADSPEND_CATALOG", format!("etcd://{CATALOG_KEY}")),
    ];
    if let Some(pair) = client {
        env.push(("ADSPEND_ETCD_TLS_CERT", pair.cert.display().to_string()));
        env.push(("ADSPEND_ETCD_TLS_KEY", pair.key.display().to_string()));
    }
    env
}

fn spawn(p: &Pipeline, service: &str, env: &[(&'static str, String)]) -> ServiceProcess {
    let extra: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    p.spawn_with(service, free_port(), &extra)
}

/// Runs until the service exits; asserts exit code 1, no panic, and an
/// error line about etcd that names `setting`; returns that line.
async fn refused(mut process: ServiceProcess, service: &str, setting: &str) -> String {
    let status = process
        .wait_for_exit(Duration::from_secs(60))
        .await
        .unwrap_or_else(|_| panic!("the {service} kept running"));
    let log = process.log_tail(30);
    assert_eq!(status.code(), Some(EXIT_ERROR), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    let prefix = format!("{service}: error: ");
    let line = log
        .lines()
        .rev()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no error line in:\n{log}"))
        .to_string();
    assert!(line.contains("etcd"), "not an etcd error: {line}");
    assert!(line.contains(setting), "{line:?} does not name {setting}");
    line
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn services_with_client_certificates_are_exact_against_tls_etcd() {
    let (ca, etcd) = tls_etcd().await;
    let mut p = Pipeline::start(Backends::default(), 200).await;
    let catalog = std::fs::read(&p.catalog_path).expect("read catalog");
    etcd.put(CATALOG_KEY, &catalog)
        .await
        .expect("the harness writes the catalog with its client certificate");

    for service in ["aggregator", "limiter", "pacer"] {
        let pair = ca.client(service);
        let process = spawn(&p, service, &etcd_env(&etcd, &ca, Some(&pair)));
        match service {
            "aggregator" => p.aggregator = Some(process),
            "limiter" => p.limiter = Some(process),
            _ => p.pacer = Some(process),
        }
    }
    p.wait_pacer().await;
    let truth = p.publish(&sim_config(3_000, 5)).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);

    // The aggregator recorded its checkpoints in that etcd.
    let record = adspend_harness::wait_until_ok(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            match etcd.get("/adspend/shards/all/checkpoint").await {
                Ok(Some(bytes)) => Ok(bytes),
                Ok(None) => Err(anyhow::anyhow!("no checkpoint record yet")),
                Err(e) => Err(e),
            }
        },
    )
    .await
    .expect("the aggregator recorded no checkpoint in TLS etcd");
    assert!(!record.is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_without_the_right_certificate_are_refused() {
    let (ca, etcd) = tls_etcd().await;
    let p = Pipeline::start(Backends::default(), 10).await;
    let other = TestCa::new("other");

    // Control: the same settings with the right certificate connect, so
    // each refusal below is about what it changes.
    let mut good = etcd.client_args();
    adspend_common::etcd::connect(&good, &adspend_common::etcd::Background::own())
        .await
        .expect("the harness's certificate is accepted");

    // The server asks for a certificate; a client without one is turned
    // away during or right after the handshake.
    let aggregator = spawn(&p, "aggregator", &etcd_env(&etcd, &ca, None));
    let line = refused(aggregator, "aggregator", "ADSPEND_ETCD_TLS_CERT").await;
    println!("without a client certificate: {line}");

    // A certificate signed by another CA.
    let stranger = other.client("aggregator");
    let aggregator = spawn(&p, "aggregator", &etcd_env(&etcd, &ca, Some(&stranger)));
    let line = refused(aggregator, "aggregator", "ADSPEND_ETCD_TLS_CERT").await;
    println!("with a certificate from another CA: {line}");

    // The client's own check: a server certificate from a CA it does not
    // trust is refused before the client shows its certificate.
    good.etcd_tls_ca = Some(other.ca());
    let err = adspend_common::etcd::connect(&good, &adspend_common::etcd::Background::own())
        .await
        .err()
        .expect("a server certificate from another CA was trusted")
        .to_string();
    assert!(
        err.contains("ADSPEND_ETCD_TLS_CA"),
        "not a server certificate failure: {err}"
    );
    println!("trusting another CA: {err}");

    // Plain HTTP/2 to the TLS port: no answer to a plaintext client.
    let plain = EtcdArgs::plain(etcd.endpoints().replace("https://", "http://"));
    let err = adspend_common::etcd::connect(&plain, &adspend_common::etcd::Background::own())
        .await
        .err()
        .expect("a plaintext client was served by the TLS etcd");
    println!("plaintext: {err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_etcd_tls_settings_are_config_errors_naming_them() {
    let ca = TestCa::new("settings");
    let pair = ca.client("limiter");
    let dir = tempfile::tempdir().expect("tempdir");
    let not_pem = dir.path().join("ca.txt");
    std::fs::write(&not_pem, "hello").expect("write");
    let missing = dir.path().join("missing.pem");
    let tls = |endpoints: &str| EtcdArgs {
        etcd_tls_ca: Some(ca.ca()),
        etcd_tls_cert: Some(pair.cert.clone()),
        etcd_tls_key: Some(pair.key.clone()),
        ..EtcdArgs::plain(endpoints)
    };
    // The complete settings pass, so each case fails for its one change.
    tls("https://127.0.0.1:2379,127.0.0.1:2380")
        .validate()
        .expect("valid TLS settings");
    let cases = [
        (
            EtcdArgs {
                etcd_tls_key: None,
                ..tls("https://127.0.0.1:2379")
            },
            "ADSPEND_ETCD_TLS_CERT",
        ),
        (
            EtcdArgs {
                etcd_tls_cert: None,
                ..tls("https://127.0.0.1:2379")
            },
            "ADSPEND_ETCD_TLS_KEY",
        ),
        (
            EtcdArgs {
                etcd_tls_ca: None,
                ..tls("127.0.0.1:2379")
            },
            "ADSPEND_ETCD_TLS_CERT",
        ),
        (tls("http://127.0.0.1:2379"), "ADSPEND_ETCD_ENDPOINTS"),
        (
            EtcdArgs::plain("https://127.0.0.1:2379"),
            "ADSPEND_ETCD_ENDPOINTS",
        ),
        (
            EtcdArgs {
                etcd_tls_ca: Some(missing.clone()),
                ..tls("https://127.0.0.1:2379")
            },
            "ADSPEND_ETCD_TLS_CA",
        ),
        (
            EtcdArgs {
                etcd_tls_ca: Some(not_pem),
                ..tls("https://127.0.0.1:2379")
            },
            "ADSPEND_ETCD_TLS_CA",
        ),
        (
            EtcdArgs {
                etcd_tls_key: Some(missing),
                ..tls("https://127.0.0.1:2379")
            },
            "ADSPEND_ETCD_TLS_KEY",
        ),
    ];
    for (args, setting) in cases {
        let err = args
            .validate()
            .err()
            .unwrap_or_else(|| panic!("{args:?} accepted"))
            .to_string();
        assert!(
            err.contains(setting),
            "{args:?}: {err:?} does not name {setting}"
        );
        // The connect path checks the same before dialling.
        let err = adspend_common::etcd::connect(&args, &adspend_common::etcd::Background::own())
            .await
            .err()
            .unwrap_or_else(|| panic!("{args:?} connected"))
            .to_string();
        assert!(
            err.contains(setting),
            "connect: {err:?} does not name {setting}"
        );
    }

    // A service ends with that error at startup, before connecting.
    let p = Pipeline::start(Backends::default(), 10).await;
    let mut limiter = p.spawn_with(
        "limiter",
        free_port(),
        &[
            ("ADSPEND_ETCD_ENDPOINTS", "https://127.0.0.1:2379"),
            ("ADSPEND_ETCD_TLS_CA", &ca.ca().display().to_string()),
            ("ADSPEND_ETCD_TLS_CERT", &pair.cert.display().to_string()),
        ],
    );
    let status = limiter
        .wait_for_exit(Duration::from_secs(30))
        .await
        .expect("the limiter kept running with a certificate but no key");
    let log = limiter.log_tail(20);
    assert_eq!(status.code(), Some(EXIT_BAD_SETTING), "{log}");
    assert!(!log.contains("panicked"), "{log}");
    assert!(log.contains("ADSPEND_ETCD_TLS_CERT"), "{log}");
}
