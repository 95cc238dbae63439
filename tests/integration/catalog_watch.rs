//! The catalog in etcd is watched: a budget change shows in the pacer at
//! once, an invalid update is refused and the last good catalog stays.

use std::time::{Duration, Instant};

use adspend_harness::wait_until_ok;

use crate::support::{Backends, Pipeline, CATALOG_KEY};

/// A pipeline with etcd and a pacer reading the catalog from it; the first
/// limit's id and its pacer URL.
async fn pacer_on_etcd() -> (Pipeline, String, String) {
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
    let limit_id = p.catalog.limits.keys().next().unwrap().clone();
    let url = format!("{}/v1/limits/{limit_id}", p.pacer_url());
    (p, limit_id, url)
}

async fn budget(url: &str) -> anyhow::Result<u64> {
    let body: serde_json::Value = reqwest::get(url).await?.json().await?;
    body["budget_micros"]
        .as_u64()
        .ok_or_else(|| anyhow::anyhow!("no budget in {body}"))
}

async fn wait_for_budget(url: &str, expected: u64) -> anyhow::Result<()> {
    wait_until_ok(
        Duration::from_secs(10),
        Duration::from_millis(100),
        || async {
            let now = budget(url).await?;
            anyhow::ensure!(now == expected, "budget {now}, waiting for {expected}");
            Ok(())
        },
    )
    .await
}

/// The catalog with the budget of `limit_id` set to `micros`, written to etcd.
async fn put_budget(p: &Pipeline, limit_id: &str, micros: u64) {
    let mut changed = p.catalog.clone();
    changed.limits.get_mut(limit_id).unwrap().budget_micros = micros;
    p.etcd
        .as_ref()
        .unwrap()
        .put(CATALOG_KEY, &serde_json::to_vec(&changed).unwrap())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn etcd_catalog_changes_reach_the_pacer() {
    let (mut p, limit_id, url) = pacer_on_etcd().await;
    let original = budget(&url).await.unwrap();

    put_budget(&p, &limit_id, original + 12_345).await;
    wait_for_budget(&url, original + 12_345)
        .await
        .expect("budget change not applied");
    let etcd = p.etcd.as_ref().unwrap();

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
        assert_eq!(budget(&url).await.unwrap(), original + 12_345);
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
    let (mut p, limit_id, url) = pacer_on_etcd().await;
    let original = budget(&url).await.unwrap();

    // Frozen, the pacer keeps its watch's last revision; the restart of etcd
    // breaks its connection, so it will have to watch again from there.
    p.pacer.as_mut().unwrap().pause().unwrap();
    let etcd = p.etcd.as_mut().unwrap();
    etcd.kill();
    etcd.restart().await;
    put_budget(&p, &limit_id, original + 777).await;
    let etcd = p.etcd.as_ref().unwrap();
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
    wait_for_budget(&url, original + 777)
        .await
        .expect("the change made before the compaction never reached the pacer");

    // And the watch goes on from the re-read revision.
    put_budget(&p, &limit_id, original + 778).await;
    wait_for_budget(&url, original + 778)
        .await
        .expect("a change after the re-read never reached the pacer");
}
