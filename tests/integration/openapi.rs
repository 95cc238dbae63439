//! The pacer binary against its own OpenAPI document (`pacer/openapi.json`,
//! served at `/v1/openapi.json`): schemathesis generates requests from it
//! and checks every answer (no 5xx, status, content type, headers and body
//! as documented), on a pacer with spend in it, open and with tokens (no
//! token, the read token, the decide token). Loaded from the live
//! document, schemathesis leaves out the operation that serves it (10 of
//! 11); `pacer/src/http/openapi.rs` tests that one.

use std::path::PathBuf;
use std::process::Command;

use adspend_harness::{free_port, workspace_root};

use crate::support::{sim_config, Backends, Pipeline};

const READ: &str = "openapi-read-token-0123456789";
const DECIDE: &str = "openapi-decide-token-0123456789";

fn schemathesis() -> PathBuf {
    let bin = workspace_root().join(".tools/venv/bin/schemathesis");
    assert!(
        bin.exists(),
        "{} missing: run scripts/install-deps.sh test",
        bin.display()
    );
    bin
}

/// One bounded, reproducible run; its summary printed, its exit asserted.
fn run(url: &str, token: Option<&str>, dir: &std::path::Path) {
    let mut command = Command::new(schemathesis());
    command.args([
        "run",
        &format!("{url}/v1/openapi.json"),
        "--url",
        url,
        "--checks",
        "all",
        // The one check left out: an ad id is at most 64 bytes, which JSON
        // Schema cannot say (its maxLength counts characters), so 64
        // multi-byte characters are schema-valid and rightly refused (422).
        "--exclude-checks",
        "positive_data_acceptance",
        "--phases",
        "examples,coverage,fuzzing",
        "--max-examples",
        "20",
        "--max-time",
        "20",
        "--seed",
        "30",
        "--no-color",
    ]);
    if let Some(token) = token {
        command.args(["--header", &format!("Authorization: Bearer {token}")]);
    }
    let output = command
        .env("SCHEMATHESIS_HOOKS", "")
        // Its example database and reports go there, not into the repo.
        .current_dir(dir)
        .output()
        .expect("run schemathesis");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let summary = stdout
        .find("SUMMARY")
        .map_or(&stdout[..], |at| &stdout[at..]);
    println!("schemathesis on {url} (token: {token:?}):\n{summary}");
    assert!(
        output.status.success(),
        "schemathesis found failures (token {token:?}):\n{stdout}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let count = |label: &str| {
        stdout
            .lines()
            .find_map(|l| l.trim().strip_prefix(label))
            .map(|rest| {
                rest.split('/')
                    .next()
                    .unwrap_or_default()
                    .trim()
                    .to_string()
            })
    };
    assert!(
        count("Tested:").is_some() && count("Tested:") == count("Selected:"),
        "not every operation was tested:\n{stdout}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pacer_conforms_to_its_openapi_document() {
    let mut p = Pipeline::start(Backends::default(), 20).await;
    p.spawn_all().await;
    let guarded_addr = format!("127.0.0.1:{}", free_port());
    let _guarded = p.spawn_with(
        "pacer",
        free_port(),
        &[
            ("ADSPEND_PACER_ADDR", &guarded_addr),
            ("ADSPEND_PACER_READ_TOKENS", READ),
            ("ADSPEND_PACER_DECIDE_TOKENS", DECIDE),
        ],
    );
    p.publish(&sim_config(500, 3)).await;
    let guarded = format!("http://{guarded_addr}");
    adspend_harness::wait_until(
        std::time::Duration::from_secs(30),
        std::time::Duration::from_millis(100),
        || {
            let url = format!("{guarded}/healthz");
            async move {
                reqwest::get(&url)
                    .await
                    .is_ok_and(|r| r.status().is_success())
            }
        },
    )
    .await
    .expect("the pacer with tokens did not become healthy");

    let open = p.pacer_url();
    // Spend in it: the limits' answers carry numbers, not just zeros.
    let limits = format!("{open}/v1/limits?limit=1000");
    adspend_harness::wait_until(
        std::time::Duration::from_secs(30),
        std::time::Duration::from_millis(200),
        || {
            let limits = limits.clone();
            async move {
                let Ok(response) = reqwest::get(&limits).await else {
                    return false;
                };
                let page: serde_json::Value = response.json().await.unwrap_or_default();
                page["limits"].as_array().is_some_and(|limits| {
                    limits
                        .iter()
                        .any(|l| l["spend_micros"].as_u64().is_some_and(|s| s > 0))
                })
            }
        },
    )
    .await
    .expect("the published spend reached the pacer");
    let dir = p.dir.path().to_path_buf();
    tokio::task::spawn_blocking(move || {
        run(&open, None, &dir);
        run(&guarded, None, &dir);
        run(&guarded, Some(READ), &dir);
        run(&guarded, Some(DECIDE), &dir);
    })
    .await
    .expect("schemathesis runs");
}
