//! Service processes: signals, logs, restarts, a clean environment, and
//! the workspace's binaries found where cargo put them.

use std::time::Duration;

use adspend_harness::{service_binary, ServiceProcess, Signal};

use super::{process_exists, wait_for_state, SHORT};

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
