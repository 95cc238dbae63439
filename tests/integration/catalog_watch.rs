//! The catalog in etcd is watched: a budget change shows in the pacer at
//! once, an invalid update is refused and the last good catalog stays.

use std::time::Duration;

use adspend_tests::harness::wait_until_ok;

use crate::support::{Backends, Pipeline, CATALOG_KEY};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_catalog_changes_reach_the_pacer() {
    let mut p = Pipeline::start(
        Backends {
            etcd: true,
            s3: false,
        },
        20,
    )
    .await;
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let etcd = p.etcd.as_ref().unwrap();
    let (limit_id, _) = p.catalog.limits.iter().next().unwrap();
    let url = format!("{}/v1/limits/{limit_id}", p.pacer_url());
    let budget = || async {
        let body: serde_json::Value = reqwest::get(&url).await?.json().await?;
        body["budget_micros"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("no budget in {body}"))
    };
    let original = budget().await.unwrap();

    let mut changed = p.catalog.clone();
    changed.limits.get_mut(limit_id).unwrap().budget_micros = original + 12_345;
    etcd.put(CATALOG_KEY, &serde_json::to_vec(&changed).unwrap())
        .await
        .unwrap();
    wait_until_ok(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let now = budget().await?;
            anyhow::ensure!(now == original + 12_345, "budget still {now}");
            Ok(())
        },
    )
    .await
    .expect("budget change not applied");

    etcd.put(CATALOG_KEY, b"{not a catalog").await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(budget().await.unwrap(), original + 12_345);
    let log = p.pacer.as_ref().unwrap().log_tail(20);
    assert!(log.contains("catalog update rejected"), "{log}");
    let missing = reqwest::get(format!("{}/v1/limits/no-such-limit", p.pacer_url()))
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let body: serde_json::Value = missing.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("no-such-limit"));
}
