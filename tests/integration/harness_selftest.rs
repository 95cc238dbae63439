//! The harness's own tests: every other test trusts that `kill()` really
//! crashes a server, that `restart()` brings back its data, and that nothing
//! outlives a test, so those claims are checked here against the real tools.

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use adspend_tests::harness::{
    free_port, service_binary, tool_path, wait_until, wait_until_ok, Etcd, NatsOptions, NatsServer,
    S3Server, ServiceProcess, Signal,
};
use anyhow::Context;
use async_nats::jetstream::{self, stream::StorageType};
use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};

const SHORT: Duration = Duration::from_secs(10);
const POLL: Duration = Duration::from_millis(50);

/// Whether `pid` names a live (not yet reaped) process of ours or anyone's.
fn process_exists(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The state letter from `/proc/<pid>/stat`: `T` when stopped by SIGSTOP.
fn process_state(pid: u32) -> char {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The command name is in parentheses and may contain spaces.
    let after_name = &stat[stat.rfind(')').unwrap() + 2..];
    after_name.chars().next().unwrap()
}

/// Waits for the kernel to apply a SIGSTOP or SIGCONT, which is not
/// synchronous with `kill(2)` returning.
async fn wait_for_state(pid: u32, stopped: bool) {
    wait_until(SHORT, Duration::from_millis(10), || async move {
        (process_state(pid) == 'T') == stopped
    })
    .await
    .unwrap_or_else(|err| panic!("process {pid} never became stopped={stopped}: {err}"));
}

/// Proxies off: a developer's `HTTP_PROXY` must not see loopback requests.
async fn get_json(url: &str) -> serde_json::Value {
    reqwest::Client::builder()
        .no_proxy()
        .build()
        .unwrap()
        .get(url)
        .send()
        .await
        .unwrap_or_else(|err| panic!("GET {url}: {err}"))
        .json()
        .await
        .unwrap()
}

fn refuses_connections(port: u16) -> bool {
    TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err()
}

#[test]
fn free_ports_are_distinct_and_bindable() {
    let ports: Vec<u16> = (0..50).map(|_| free_port()).collect();
    let mut unique = ports.clone();
    unique.sort_unstable();
    unique.dedup();
    assert_eq!(unique.len(), ports.len(), "a port was handed out twice");
    for port in ports.iter().take(5) {
        TcpListener::bind((Ipv4Addr::LOCALHOST, *port))
            .unwrap_or_else(|err| panic!("port {port} is not free: {err}"));
    }
}

#[test]
fn tools_are_found() {
    for tool in ["nats-server", "etcd", "moto_server"] {
        let path = tool_path(tool);
        assert!(path.is_file(), "{tool} resolved to {}", path.display());
    }
}

#[test]
#[should_panic(expected = "scripts/install-deps.sh test")]
fn a_missing_tool_says_how_to_install_it() {
    tool_path("adspend-no-such-tool");
}

#[tokio::test]
async fn nats_jetstream_keeps_acknowledged_messages_across_kill_and_restart() {
    let mut nats = NatsServer::start().await;
    let url = nats.url();
    let first_pid = nats.pid().unwrap();

    let client = async_nats::connect(&url).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "SELFTEST".into(),
        subjects: vec!["selftest.>".into()],
        storage: StorageType::File,
        ..Default::default()
    })
    .await
    .unwrap();
    for payload in ["one", "two", "three"] {
        js.publish("selftest.a", Bytes::from(payload))
            .await
            .unwrap()
            .await
            .unwrap();
    }

    nats.kill();
    assert!(!nats.is_running());
    assert!(!process_exists(first_pid), "kill() left the process behind");
    assert!(refuses_connections(nats.port()));

    nats.restart().await;
    assert!(nats.is_running());
    assert_eq!(nats.url(), url, "restart moved the server");
    assert_ne!(nats.pid(), Some(first_pid));

    let client = async_nats::connect(&url).await.unwrap();
    let js = jetstream::new(client);
    let mut stream = js.get_stream("SELFTEST").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 3);
    let second = stream.get_raw_message(2).await.unwrap();
    assert_eq!(second.payload, Bytes::from("two"));
    let ack = js
        .publish("selftest.a", Bytes::from("four"))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(ack.sequence, 4, "the recovered stream lost its sequence");
}

#[tokio::test]
async fn nats_stop_is_graceful_and_restart_keeps_the_store() {
    let mut nats = NatsServer::start().await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "STOPPED".into(),
        subjects: vec!["stopped".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.publish("stopped", Bytes::from("kept"))
        .await
        .unwrap()
        .await
        .unwrap();

    nats.stop();
    assert!(!nats.is_running());
    assert!(
        nats.log_tail(20).contains("Shutdown"),
        "no graceful shutdown in the log:\n{}",
        nats.log_tail(20)
    );
    nats.restart().await;

    let client = async_nats::connect(nats.url()).await.unwrap();
    let stream = jetstream::new(client).get_stream("STOPPED").await.unwrap();
    let message = stream.get_raw_message(1).await.unwrap();
    assert_eq!(message.payload, Bytes::from("kept"));
}

#[tokio::test]
async fn nats_config_is_applied() {
    let nats = NatsServer::start().await;
    let varz = get_json(&format!("{}/varz", nats.monitor_url())).await;
    assert_eq!(varz["max_payload"], 8 * 1024 * 1024);
    assert_eq!(varz["jetstream"]["config"]["sync_always"], true);
    let store = varz["jetstream"]["config"]["store_dir"].as_str().unwrap();
    assert!(
        Path::new(store).starts_with(nats.store_dir()),
        "store {store} is not under {}",
        nats.store_dir().display()
    );

    // A payload over the 1 MB default only fits because of max_payload.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "BIG".into(),
        subjects: vec!["big".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let big = Bytes::from(vec![7_u8; 5 * 1024 * 1024]);
    js.publish("big", big.clone()).await.unwrap().await.unwrap();
    let stored = js
        .get_stream("BIG")
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    assert_eq!(stored.payload.len(), big.len());

    let lazy = NatsServer::start_with(NatsOptions {
        lazy_sync: true,
        ..NatsOptions::default()
    })
    .await;
    let varz = get_json(&format!("{}/varz", lazy.monitor_url())).await;
    // nats-server omits the field when it is false.
    assert_ne!(varz["jetstream"]["config"]["sync_always"], true);
    assert!(varz["jetstream"]["config"]["sync_interval"].is_u64());
}

#[tokio::test]
async fn nats_pause_stalls_and_resume_recovers() {
    let mut nats = NatsServer::start().await;
    let pid = nats.pid().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    // Any request the server itself must answer.
    let ask = || client.request("$JS.API.INFO", Bytes::new());
    tokio::time::timeout(SHORT, ask())
        .await
        .expect("no answer before pausing")
        .unwrap();

    nats.pause();
    wait_for_state(pid, true).await;
    let stalled = tokio::time::timeout(Duration::from_millis(500), ask()).await;
    assert!(stalled.is_err(), "a paused server answered: {stalled:?}");

    nats.resume();
    wait_for_state(pid, false).await;
    tokio::time::timeout(SHORT, ask())
        .await
        .expect("no answer after resume")
        .unwrap();
}

#[tokio::test]
#[should_panic(expected = "call kill() or stop() before restart()")]
async fn restarting_a_running_server_is_refused() {
    let mut nats = NatsServer::start().await;
    nats.restart().await;
}

#[tokio::test]
async fn dropping_a_server_kills_it_and_removes_its_directory() {
    let nats = NatsServer::start().await;
    let pid = nats.pid().unwrap();
    let scratch = nats.log_path().parent().unwrap().to_owned();
    assert!(scratch.is_dir());
    let port = nats.port();

    drop(nats);
    assert!(!process_exists(pid), "nats-server outlived its handle");
    assert!(!scratch.exists(), "{} was left behind", scratch.display());
    assert!(refuses_connections(port));
}

#[tokio::test]
async fn etcd_keeps_its_data_across_kill_and_restart() {
    let mut etcd = Etcd::start().await;
    let endpoints = etcd.endpoints();
    assert!(etcd.is_healthy().await);
    let health = get_json(&format!("{endpoints}/health")).await;
    assert_eq!(health["health"], "true");

    etcd.put("selftest/key", b"value-1").await.unwrap();
    assert_eq!(
        etcd.get("selftest/key").await.unwrap().as_deref(),
        Some(&b"value-1"[..])
    );
    assert_eq!(etcd.get("selftest/absent").await.unwrap(), None);

    let first_pid = etcd.pid().unwrap();
    etcd.kill();
    assert!(!etcd.is_running());
    assert!(!process_exists(first_pid));
    assert!(!etcd.is_healthy().await);

    etcd.restart().await;
    assert!(etcd.is_running());
    assert_eq!(etcd.endpoints(), endpoints);
    assert!(etcd.is_healthy().await);
    assert_eq!(
        etcd.get("selftest/key").await.unwrap().as_deref(),
        Some(&b"value-1"[..])
    );

    etcd.stop();
    assert!(!etcd.is_running());
    etcd.restart().await;
    etcd.put("selftest/key", b"value-2").await.unwrap();
    assert_eq!(
        etcd.get("selftest/key").await.unwrap().as_deref(),
        Some(&b"value-2"[..])
    );
}

#[tokio::test]
async fn s3_round_trips_objects_over_plain_http() {
    let s3 = S3Server::start().await;
    s3.create_bucket("selftest").await.unwrap();
    s3.create_bucket("selftest")
        .await
        .expect("creating an existing bucket must succeed");

    let body = Bytes::from_static(b"\x00binary\xffpayload");
    s3.put_object("selftest", "day=2024-01-01/part 1.bin", body.clone())
        .await
        .unwrap();
    s3.put_object("selftest", "other/x", "x").await.unwrap();
    assert_eq!(
        s3.get_object("selftest", "day=2024-01-01/part 1.bin")
            .await
            .unwrap(),
        Some(body)
    );
    assert_eq!(s3.get_object("selftest", "missing").await.unwrap(), None);
    assert!(s3.get_object("no-such-bucket", "x").await.is_err());
    assert_eq!(
        s3.list_keys("selftest", "day=").await.unwrap(),
        ["day=2024-01-01/part 1.bin"]
    );
    assert_eq!(s3.list_keys("selftest", "").await.unwrap().len(), 2);

    let env = s3.env();
    let endpoint = s3.endpoint();
    for (name, value) in [
        ("AWS_ENDPOINT", endpoint.as_str()),
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_REGION", "us-east-1"),
    ] {
        assert!(
            env.iter().any(|(n, v)| n == name && v == value),
            "{name}={value} missing from {env:?}"
        );
    }
}

#[tokio::test]
async fn s3_list_keys_follows_continuation_tokens() {
    let s3 = S3Server::start().await;
    s3.create_bucket("many").await.unwrap();
    // More than one 1000-key page.
    let s3 = &s3;
    stream::iter(0..1001)
        .map(|index| async move {
            let key = format!("k/{index:05}");
            s3.put_object("many", &key, "").await
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await
        .unwrap();
    let keys = s3.list_keys("many", "k/").await.unwrap();
    assert_eq!(keys.len(), 1001);
    assert_eq!(keys.last().unwrap(), "k/01000");
}

#[tokio::test]
async fn s3_pause_keeps_data_and_restart_loses_it() {
    let mut s3 = S3Server::start().await;
    s3.create_bucket("volatile").await.unwrap();
    s3.put_object("volatile", "a", "kept while paused")
        .await
        .unwrap();

    s3.pause();
    let stalled =
        tokio::time::timeout(Duration::from_millis(500), s3.get_object("volatile", "a")).await;
    assert!(stalled.is_err(), "a paused server answered");
    s3.resume();
    assert_eq!(
        s3.get_object("volatile", "a").await.unwrap(),
        Some(Bytes::from("kept while paused"))
    );

    let endpoint = s3.endpoint();
    s3.kill();
    assert!(!s3.is_running());
    assert!(refuses_connections(s3.port()));
    s3.restart().await;
    assert_eq!(s3.endpoint(), endpoint);
    let lost = s3.get_object("volatile", "a").await;
    assert!(
        lost.as_ref()
            .is_err_and(|err| format!("{err:#}").contains("NoSuchBucket")),
        "moto kept data across a restart: {lost:?}"
    );
    s3.create_bucket("volatile").await.unwrap();
    assert_eq!(s3.get_object("volatile", "a").await.unwrap(), None);
}

/// A stand-in service: exits 7 on SIGTERM, otherwise runs. It logs its pid
/// only once the trap is set, so a test that waits for that line cannot
/// signal it before the trap exists.
const FAKE_SERVICE: &str = "trap 'echo got term; exit 7' TERM; \
     echo \"run $$\"; \
     while true; do sleep 0.05; done";

fn fake_service() -> ServiceProcess {
    ServiceProcess::builder_at("/bin/sh")
        .args(["-c", FAKE_SERVICE])
        .spawn()
}

#[tokio::test]
async fn service_process_signals_logs_and_restarts() {
    let mut service = fake_service();
    let first_pid = service.pid();
    service
        .wait_for_log(&format!("run {first_pid}"), SHORT)
        .await
        .unwrap();

    service.pause().unwrap();
    wait_for_state(first_pid, true).await;
    service.resume().unwrap();
    wait_for_state(first_pid, false).await;

    let status = service.terminate(SHORT).unwrap();
    assert_eq!(status.code(), Some(7), "SIGTERM did not reach the trap");
    assert!(service.log_tail(5).contains("got term"));
    assert!(!service.is_running());
    assert!(service.signal(Signal::SIGTERM).is_err());

    service.restart();
    let second_pid = service.pid();
    assert_ne!(second_pid, first_pid);
    service
        .wait_for_log(&format!("run {second_pid}"), SHORT)
        .await
        .unwrap();
    // The first run's lines are in the file but not this run's output.
    let stale = service
        .wait_for_log(&format!("run {first_pid}"), Duration::from_millis(300))
        .await;
    assert!(stale.is_err(), "wait_for_log matched a previous run");
    assert!(service.log_tail(10).contains(&format!("run {first_pid}")));

    let status = service.kill();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(Signal::SIGKILL as i32)
    );
    assert!(!process_exists(second_pid));
}

/// Variables the harness passes through, plus those a shell sets itself.
const PASSED_THROUGH: &[&str] = &[
    "PATH",
    "HOME",
    "USER",
    "TMPDIR",
    "LANG",
    "LC_ALL",
    "RUST_LOG",
    "RUST_BACKTRACE",
    "RUST_LIB_BACKTRACE",
    "PWD",
    "OLDPWD",
    "SHLVL",
    "_",
];

/// A variable of this test process that must not reach a child: one of the
/// developer's `ADSPEND_*` if there is one, else cargo's, else any.
fn variable_to_leak() -> String {
    let names: Vec<String> = std::env::vars_os()
        .filter_map(|(name, _)| name.into_string().ok())
        .filter(|name| !PASSED_THROUGH.contains(&name.as_str()))
        .collect();
    ["ADSPEND_", "CARGO_", ""]
        .iter()
        .find_map(|prefix| names.iter().find(|name| name.starts_with(prefix)))
        .cloned()
        .expect("the test process has no variable outside the allow-list to check with")
}

#[tokio::test]
async fn service_process_gets_a_clean_environment() {
    let leaked = variable_to_leak();
    let mut service = ServiceProcess::builder_at("/bin/sh")
        .args([
            "-c",
            "echo \"inherited=$(printenv \"$1\" || echo none) \
             explicit=${ADSPEND_EXPLICIT:-none} path=${PATH:+set}\"",
            "sh",
            &leaked,
        ])
        .env("ADSPEND_EXPLICIT", "yes")
        .spawn();
    service.wait_for_exit(SHORT).await.unwrap();
    let log = service.log_tail(5);
    assert!(
        log.contains("inherited=none"),
        "{leaked} leaked from the test process: {log}"
    );
    assert!(log.contains("explicit=yes"), "explicit env lost: {log}");
    assert!(log.contains("path=set"), "PATH not passed through: {log}");
}

#[tokio::test]
async fn wait_for_log_reports_an_exit_without_the_line() {
    let mut service = ServiceProcess::builder_at("/bin/sh")
        .args(["-c", "echo about to crash; exit 3"])
        .spawn();
    let err = service
        .wait_for_log("never printed", SHORT)
        .await
        .unwrap_err();
    let message = format!("{err:#}");
    assert!(message.contains("exit code 3"), "{message}");
    assert!(message.contains("about to crash"), "{message}");
    // The last line before a crash still counts.
    service.restart();
    service.wait_for_log("about to crash", SHORT).await.unwrap();
}

#[tokio::test]
async fn dropping_a_service_kills_it() {
    let service = fake_service();
    let pid = service.pid();
    assert!(process_exists(pid));
    drop(service);
    assert!(!process_exists(pid), "the service outlived its handle");
}

#[tokio::test]
async fn workspace_binaries_are_found_and_run() {
    let path = service_binary("adsim");
    assert!(path.is_file());
    let mut adsim = ServiceProcess::builder("adsim").arg("--help").spawn();
    let status = adsim.wait_for_exit(SHORT).await.unwrap();
    assert!(status.success(), "adsim --help: {status}");
    assert!(
        adsim.log_tail(50).contains("Usage"),
        "{}",
        adsim.log_tail(50)
    );
}

#[test]
#[should_panic(expected = "cargo build --workspace --bins")]
fn an_unbuilt_service_says_how_to_build_it() {
    service_binary("adspend-no-such-binary");
}

#[tokio::test]
async fn wait_until_succeeds_late_and_times_out_clearly() {
    let started = tokio::time::Instant::now();
    wait_until(SHORT, POLL, || async {
        started.elapsed() > Duration::from_millis(200)
    })
    .await
    .unwrap();

    let err = wait_until(Duration::from_millis(200), POLL, || async { false })
        .await
        .unwrap_err();
    assert!(format!("{err}").contains("200ms"), "{err}");

    // A condition that never returns still ends at the deadline.
    let hung = tokio::time::timeout(
        SHORT,
        wait_until(Duration::from_millis(200), POLL, || {
            futures::future::pending::<bool>()
        }),
    )
    .await;
    assert!(matches!(hung, Ok(Err(_))), "wait_until ignored its timeout");

    let mut attempts = 0;
    let err = wait_until_ok(Duration::from_millis(200), POLL, || {
        attempts += 1;
        let attempt = attempts;
        async move { Err::<(), _>(anyhow::anyhow!("attempt {attempt} refused")) }
    })
    .await
    .unwrap_err();
    assert!(
        format!("{err:#}").contains(&format!("attempt {attempts} refused")),
        "the last error is missing: {err:#}"
    );
    let value = wait_until_ok(SHORT, POLL, || async { Ok::<_, anyhow::Error>(42) })
        .await
        .context("an immediate success")
        .unwrap();
    assert_eq!(value, 42);
}
