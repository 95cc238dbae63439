//! The operators' Prometheus side: the alert rules and the scrape config
//! pass `promtool`'s checks, the rules' unit tests pass, every alert has its
//! annotations and a runbook section in docs/ALERTING.md, and every
//! service's live `/metrics`, with spend flowing, passes `promtool check
//! metrics` and exports what the rules read.

use std::io::Write;
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use adspend_harness::{free_port, tool_path, wait_until, workspace_root};
use adspend_sim::{BadKind, SimConfig};

use crate::support::{assert_exact, metric_value, try_metric, Backends, Pipeline};

/// `promtool` with `args`, run in the workspace root; its output.
fn promtool(args: &[&str], stdin: Option<&str>) -> Output {
    let mut child = Command::new(tool_path("promtool"))
        .args(args)
        .current_dir(workspace_root())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    let mut input = child.stdin.take().expect("promtool stdin");
    if let Some(text) = stdin {
        input.write_all(text.as_bytes()).expect("write to promtool");
    }
    drop(input);
    child.wait_with_output().expect("promtool output")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// `promtool` with `args` must succeed.
fn promtool_ok(args: &[&str]) -> String {
    let output = promtool(args, None);
    let text = text(&output);
    assert!(
        output.status.success(),
        "promtool {args:?}: {}\n{text}",
        output.status
    );
    text
}

#[test]
fn rules_and_scrape_config_pass_promtool() {
    let rules = promtool_ok(&["check", "rules", "deploy/prometheus/rules.yml"]);
    assert!(rules.contains("SUCCESS"), "{rules}");
    // The config names its rules relative to itself, so this checks the
    // rules file it would load at /etc/prometheus in the container too.
    let config = promtool_ok(&["check", "config", "deploy/prometheus/prometheus.yml"]);
    assert!(config.contains("1 rule files found"), "{config}");
    let config_text =
        std::fs::read_to_string(workspace_root().join("deploy/prometheus/prometheus.yml")).unwrap();
    for target in [
        "limiter1:9101",
        "limiter2:9101",
        "pacer1:9103",
        "pacer2:9103",
    ] {
        assert!(config_text.contains(&format!("\"{target}\"")), "{target}");
    }
    // Aggregators by DNS name (aggregator4 only while scaled out).
    for name in ["aggregator1", "aggregator2", "aggregator3", "aggregator4"] {
        assert!(config_text.contains(&format!("\"{name}\"")), "{name}");
    }
    let tests = promtool_ok(&["test", "rules", "deploy/prometheus/rules.test.yml"]);
    assert!(tests.contains("SUCCESS"), "{tests}");
}

/// The rules' unit tests are not vacuous: a rule file whose partition alert
/// never fires fails them.
#[test]
fn rule_unit_tests_fail_on_a_broken_rule() {
    let dir = tempfile::tempdir().unwrap();
    let root = workspace_root().join("deploy/prometheus");
    let rules = std::fs::read_to_string(root.join("rules.yml")).unwrap();
    let broken = rules.replace(
        "changes(adspend_aggregator_watermark_timestamp_seconds[2m]) == 0",
        "changes(adspend_aggregator_watermark_timestamp_seconds[2m]) < 0",
    );
    assert_ne!(broken, rules, "the partition alert's expression moved");
    std::fs::write(dir.path().join("rules.yml"), broken).unwrap();
    std::fs::copy(
        root.join("rules.test.yml"),
        dir.path().join("rules.test.yml"),
    )
    .unwrap();
    let test_file = dir.path().join("rules.test.yml");
    let output = promtool(&["test", "rules", test_file.to_str().unwrap()], None);
    let text = text(&output);
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("AdspendPartitionNotApplying"), "{text}");
}

/// `(alert, runbook)` of every rule in rules.yml, and whether each had a
/// summary and a description.
fn alerts(rules: &str) -> Vec<(String, String, bool)> {
    let mut found: Vec<(String, String, bool)> = Vec::new();
    let mut annotations = 0;
    for line in rules.lines().map(str::trim) {
        if let Some(name) = line.strip_prefix("- alert: ") {
            found.push((name.to_string(), String::new(), false));
            annotations = 0;
        } else if let Some(last) = found.last_mut() {
            if line.starts_with("summary: ") || line.starts_with("description: ") {
                annotations += 1;
                last.2 = annotations == 2;
            } else if let Some(runbook) = line.strip_prefix("runbook: ") {
                last.1 = runbook.to_string();
            }
        }
    }
    found
}

/// GitHub's anchor of a Markdown heading.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || *c == '-' || *c == ' ' || *c == '_')
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn every_alert_has_annotations_and_a_runbook_section() {
    let root = workspace_root();
    let rules = std::fs::read_to_string(root.join("deploy/prometheus/rules.yml")).unwrap();
    let guide = std::fs::read_to_string(root.join("docs/ALERTING.md")).unwrap();
    let anchors: Vec<String> = guide
        .lines()
        .filter_map(|l| l.strip_prefix("## ").or_else(|| l.strip_prefix("### ")))
        .map(anchor)
        .collect();
    let alerts = alerts(&rules);
    assert!(alerts.len() >= 15, "{alerts:?}");
    for (alert, runbook, annotated) in &alerts {
        assert!(annotated, "{alert}: no summary and description");
        let section = runbook
            .strip_prefix("docs/ALERTING.md#")
            .unwrap_or_else(|| panic!("{alert}: runbook {runbook:?} is not in docs/ALERTING.md"));
        assert_eq!(section, alert.to_lowercase(), "{alert}: runbook {runbook}");
        assert!(
            anchors.iter().any(|a| a == section),
            "{alert}: docs/ALERTING.md has no section #{section}"
        );
    }
    let operations = std::fs::read_to_string(root.join("docs/OPERATIONS.md")).unwrap();
    assert!(operations.contains("ALERTING.md"), "OPERATIONS.md");
}

/// `promtool check metrics` on `exposition`: its complaints, or `Ok`.
fn check_metrics(exposition: &str) -> Result<(), String> {
    let output = promtool(&["check", "metrics"], Some(exposition));
    let text = text(&output);
    if output.status.success() && text.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("{}: {text}", output.status))
    }
}

/// The metrics lint is live: what it must refuse, it refuses.
#[test]
fn promtool_check_metrics_refuses_what_it_should() {
    let unhelpful = "# TYPE adspend_x_total counter\nadspend_x_total 1\n";
    assert!(check_metrics(unhelpful).is_err());
    let counter_without_total = "# HELP adspend_x X.\n# TYPE adspend_x counter\nadspend_x 1\n";
    assert!(check_metrics(counter_without_total).is_err());
    let fine = "# HELP adspend_x_total X.\n# TYPE adspend_x_total counter\nadspend_x_total 1\n";
    check_metrics(fine).unwrap();
}

async fn scrape(port: u16) -> String {
    reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .expect("metrics endpoint")
        .text()
        .await
        .expect("metrics body")
}

const WATERMARK: &str = "adspend_aggregator_watermark_timestamp_seconds";
const LAST_CHECKPOINT: &str = "adspend_aggregator_last_checkpoint_timestamp_seconds";
const OWNED: &str = "adspend_aggregator_owned_partitions";

/// `(shard, value)` of every series of the gauge `name` labelled `shard`.
fn by_shard(body: &str, name: &str) -> Vec<(String, f64)> {
    let prefix = format!("{name}{{shard=\"");
    body.lines()
        .filter_map(|line| {
            let (shard, value) = line.strip_prefix(&prefix)?.split_once("\"} ")?;
            Some((shard.to_string(), value.trim().parse().ok()?))
        })
        .collect()
}

/// The compose cluster's shape on one machine: two aggregator members in
/// cluster mode (etcd, S3), the second joining after the first took every
/// partition, so a handover happens; a limiter and a pacer; spend with bad
/// lines and duplicates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_exports_clean_metrics_with_spend_flowing() {
    let started_s = adspend_common::now_ms() as f64 / 1000.0;
    let backends = Backends {
        etcd: true,
        s3: true,
    };
    let mut p = Pipeline::start(backends, 100).await;
    let (limiter, pacer) = (free_port(), free_port());
    let member = |p: &Pipeline, id: &str, port: u16| {
        let data_dir = p.dir.path().join(id).display().to_string();
        let env = [
            ("ADSPEND_AGGREGATOR_PARTITIONS", "auto"),
            ("ADSPEND_AGGREGATOR_ID", id),
            ("ADSPEND_LEASE_TTL_MS", "2000"),
            ("ADSPEND_DATA_DIR", data_dir.as_str()),
        ];
        p.spawn_with("aggregator", port, &env)
    };
    let owned = |members: Vec<(u16, f64)>| async move {
        wait_until(Duration::from_secs(60), Duration::from_millis(100), || {
            let members = members.clone();
            async move {
                for (port, want) in members {
                    if try_metric(port, OWNED).await.ok() != Some(want) {
                        return false;
                    }
                }
                true
            }
        })
        .await
        .expect("partitions did not settle");
    };
    let (a, b) = (free_port(), free_port());
    let _a = member(&p, "a", a);
    owned(vec![(a, 4.0)]).await;
    p.limiter = Some(p.spawn_with("limiter", limiter, &[]));
    p.pacer = Some(p.spawn_with("pacer", pacer, &[]));
    p.wait_pacer().await;
    let _b = member(&p, "b", b);
    owned(vec![(a, 2.0), (b, 2.0)]).await;

    let truth = p
        .publish(&SimConfig {
            events: Some(4_000),
            duplicate_rate: 0.05,
            bad_rate: 0.05,
            bad_kinds: BadKind::ALL.to_vec(),
            batch: 20,
            seed: 30,
            ..SimConfig::default()
        })
        .await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    let ads: Vec<String> = p.catalog.ads.keys().take(5).cloned().collect();
    let decided = reqwest::Client::new()
        .post(format!("{}/v1/decisions", p.pacer_url()))
        .json(&serde_json::json!({ "ad_ids": ads }))
        .send()
        .await
        .unwrap();
    assert!(decided.status().is_success(), "{}", decided.status());
    // Checkpoints after the spend (markers every 500 ms here).
    tokio::time::sleep(Duration::from_secs(2)).await;

    for (service, port, wanted) in [
        (
            "limiter",
            limiter,
            &[
                "adspend_limiter_impressions_total",
                "adspend_rejected_total{reason=\"unknown_ad\"}",
                "adspend_nats_unauthenticated",
            ][..],
        ),
        (
            "aggregator a",
            a,
            &[
                "adspend_aggregator_tuples_applied_total",
                "adspend_aggregator_rebalances_total",
                "adspend_aggregator_handover_seconds_count{side=\"release\"}",
                OWNED,
            ][..],
        ),
        (
            "aggregator b",
            b,
            &[
                "adspend_aggregator_tuples_applied_total",
                "adspend_aggregator_handover_seconds_count{side=\"take\"}",
                OWNED,
            ][..],
        ),
        (
            "pacer",
            pacer,
            &[
                "adspend_pacer_updates_total",
                "adspend_pacer_stale_limits",
                "adspend_pacer_decisions_total",
            ][..],
        ),
    ] {
        let body = scrape(port).await;
        if let Err(complaints) = check_metrics(&body) {
            panic!("{service}'s /metrics: promtool check metrics: {complaints}\n{body}");
        }
        for series in wanted {
            assert!(
                metric_value(&body, series).is_some(),
                "{service} does not export {series}:\n{body}"
            );
        }
    }

    // What the partition and checkpoint-age alerts read: each partition's
    // times are recent on its owner and 0 on the member that released it.
    let (body_a, body_b) = (scrape(a).await, scrape(b).await);
    let now_s = adspend_common::now_ms() as f64 / 1000.0;
    let watermarks: Vec<(String, f64)> =
        [by_shard(&body_a, WATERMARK), by_shard(&body_b, WATERMARK)].concat();
    let checkpoints: Vec<(String, f64)> = [
        by_shard(&body_a, LAST_CHECKPOINT),
        by_shard(&body_b, LAST_CHECKPOINT),
    ]
    .concat();
    for partition in 0..4 {
        let shard = format!("p{partition}");
        let live: Vec<f64> = watermarks
            .iter()
            .filter(|(s, v)| *s == shard && *v != 0.0)
            .map(|(_, v)| *v)
            .collect();
        assert!(
            live.len() == 1 && live[0] > now_s - 10.0 && live[0] <= now_s + 1.0,
            "{shard}: watermarks {watermarks:?}, now {now_s}"
        );
        let live: Vec<f64> = checkpoints
            .iter()
            .filter(|(s, v)| *s == shard && *v != 0.0)
            .map(|(_, v)| *v)
            .collect();
        assert!(
            live.len() == 1 && live[0] > started_s && live[0] <= now_s + 1.0,
            "{shard}: last checkpoints {checkpoints:?}, test started {started_s}, now {now_s}"
        );
    }
    let released = by_shard(&body_a, WATERMARK)
        .iter()
        .filter(|(_, v)| *v == 0.0)
        .count();
    assert_eq!(released, 2, "a released two partitions: {body_a}");

    // An idle, caught-up shard's watermark keeps moving: what tells it
    // from a stuck one.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let later = [
        by_shard(&scrape(a).await, WATERMARK),
        by_shard(&scrape(b).await, WATERMARK),
    ]
    .concat();
    for (shard, before) in watermarks.iter().filter(|(_, v)| *v != 0.0) {
        let after = later.iter().find(|(s, v)| s == shard && *v != 0.0);
        assert!(
            after.is_some_and(|(_, after)| after > before),
            "{shard}: watermark {before}, then {after:?}"
        );
    }
}
