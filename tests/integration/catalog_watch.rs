//! The catalog in etcd is watched: a budget change shows in the pacer at
//! once, an invalid update is refused and the last good catalog stays.

use std::time::{Duration, Instant};

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
    // The pacer says when it has read and refused the update; from then on,
    // and for a while after, it must keep serving the last good budget.
    p.pacer
        .as_mut()
        .unwrap()
        .wait_for_log("catalog update rejected", Duration::from_secs(10))
        .await
        .expect("the invalid catalog was not refused");
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_secs(1) {
        assert_eq!(budget().await.unwrap(), original + 12_345);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let missing = reqwest::get(format!("{}/v1/limits/no-such-limit", p.pacer_url()))
        .await
        .unwrap();
    assert_eq!(missing.status(), 404);
    let body: serde_json::Value = missing.json().await.unwrap();
    assert!(body["error"].as_str().unwrap().contains("no-such-limit"));
}

/// A watch that resumes after etcd has compacted its history past the last
/// revision it saw (a pacer frozen while etcd restarted, the catalog changed
/// and the history was compacted, as auto-compaction does in production) is
/// cancelled by etcd; the pacer must re-read the key, not go deaf to changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_watch_resumed_past_a_compaction_rereads_the_key() {
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
    let (limit_id, _) = p.catalog.limits.iter().next().unwrap();
    let url = format!("{}/v1/limits/{limit_id}", p.pacer_url());
    let budget = || async {
        let body: serde_json::Value = reqwest::get(&url).await?.json().await?;
        body["budget_micros"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("no budget in {body}"))
    };
    let original = budget().await.unwrap();

    // Frozen, the pacer keeps its watch's last revision; the restart of etcd
    // breaks its connection, so it will have to watch again from there.
    p.pacer.as_mut().unwrap().pause().unwrap();
    let etcd = p.etcd.as_mut().unwrap();
    etcd.kill();
    etcd.restart().await;
    let mut changed = p.catalog.clone();
    changed.limits.get_mut(limit_id).unwrap().budget_micros = original + 777;
    etcd.put(CATALOG_KEY, &serde_json::to_vec(&changed).unwrap())
        .await
        .unwrap();
    for i in 0..5 {
        etcd.put("/adspend/test/other", format!("{i}").as_bytes())
            .await
            .unwrap();
    }
    let compacted = etcd.compact().await.unwrap();
    p.pacer.as_mut().unwrap().resume().unwrap();

    p.pacer
        .as_mut()
        .unwrap()
        .wait_for_log("catalog watch cancelled by etcd", Duration::from_secs(15))
        .await
        .unwrap_or_else(|e| panic!("the watch never met the compaction at {compacted}: {e}"));
    wait_until_ok(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let now = budget().await?;
            anyhow::ensure!(now == original + 777, "budget still {now}");
            Ok(())
        },
    )
    .await
    .expect("the change made before the compaction never reached the pacer");

    // And the watch goes on from the re-read revision.
    let etcd = p.etcd.as_ref().unwrap();
    changed.limits.get_mut(limit_id).unwrap().budget_micros = original + 778;
    etcd.put(CATALOG_KEY, &serde_json::to_vec(&changed).unwrap())
        .await
        .unwrap();
    wait_until_ok(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let now = budget().await?;
            anyhow::ensure!(now == original + 778, "budget still {now}");
            Ok(())
        },
    )
    .await
    .expect("a change after the re-read never reached the pacer");
}
