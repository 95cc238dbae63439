//! Every service that uses etcd reads its database size and compares it
//! with the quota (ADSPEND_ETCD_QUOTA_BYTES, etcd's 2 GiB by default),
//! against a real etcd: the gauges, and the WARN once it is near.

use std::time::Duration;

use adspend_harness::{free_port, wait_until_ok};

use crate::support::{metric_value, metrics_body, Backends, Pipeline};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_read_etcds_db_size_against_its_quota() {
    let mut p = Pipeline::start(
        Backends {
            etcd: true,
            s3: false,
        },
        20,
    )
    .await;
    let aggregator = free_port();
    let pacer = free_port();
    // A quota etcd's fresh database is already past.
    p.aggregator = Some(p.spawn_with(
        "aggregator",
        aggregator,
        &[("ADSPEND_ETCD_QUOTA_BYTES", "4096")],
    ));
    p.pacer = Some(p.spawn_with("pacer", pacer, &[]));
    p.wait_pacer().await;

    for (port, quota) in [(aggregator, 4096.0), (pacer, 2_147_483_648.0)] {
        let body = wait_until_ok(
            Duration::from_secs(30),
            Duration::from_millis(200),
            || async {
                let body = metrics_body(port).await?;
                anyhow::ensure!(
                    metric_value(&body, "adspend_etcd_db_size_bytes").is_some_and(|v| v > 0.0),
                    "no db size yet"
                );
                Ok(body)
            },
        )
        .await
        .expect("the db size is read");
        assert_eq!(metric_value(&body, "adspend_etcd_quota_bytes"), Some(quota));
        let in_use = metric_value(&body, "adspend_etcd_db_size_in_use_bytes").unwrap();
        let size = metric_value(&body, "adspend_etcd_db_size_bytes").unwrap();
        assert!(in_use > 0.0 && in_use <= size, "{in_use} of {size}");
        assert_eq!(metric_value(&body, "adspend_etcd_nospace_alarm"), Some(0.0));
    }
    p.aggregator
        .as_mut()
        .unwrap()
        .wait_for_log("etcd's database is near its quota", Duration::from_secs(10))
        .await
        .expect("the aggregator warns");
    assert!(
        !p.pacer
            .as_ref()
            .unwrap()
            .log_tail(200)
            .contains("near its quota"),
        "the pacer, at etcd's default quota, does not"
    );
}
