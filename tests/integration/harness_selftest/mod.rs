//! The harness's own tests: every other test trusts that `kill()` really
//! crashes a server, that `restart()` brings back its data, and that nothing
//! outlives a test, so those claims are checked here against the real tools.
//!
//! `servers`: nats-server and the lifecycle every server shares; `stores`:
//! etcd and S3; `services`: the service processes. Here: ports, tools,
//! waits, and what those files share.

mod servers;
mod services;
mod stores;

use std::net::{Ipv4Addr, TcpListener, TcpStream};
use std::path::Path;
use std::time::Duration;

use adspend_harness::{free_port, tool_path, wait_until, wait_until_ok};
use anyhow::Context;

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
    // An attempt cut off at the deadline keeps the failure before it.
    let mut attempts = 0;
    let err = wait_until_ok(Duration::from_millis(300), POLL, || {
        attempts += 1;
        let first = attempts == 1;
        async move {
            if first {
                Err(anyhow::anyhow!("refused at first"))
            } else {
                futures::future::pending::<anyhow::Result<()>>().await
            }
        }
    })
    .await
    .unwrap_err();
    let message = format!("{err:#}");
    assert!(
        message.contains("refused at first") && message.contains("still running"),
        "{message}"
    );
    let value = wait_until_ok(SHORT, POLL, || async { Ok::<_, anyhow::Error>(42) })
        .await
        .context("an immediate success")
        .unwrap();
    assert_eq!(value, 42);
}
