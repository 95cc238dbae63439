//! Clean restarts (SIGTERM) of each service while events flow keep the totals
//! exact, and each service exits 0.

use std::time::Duration;

use adspend_sim::SimConfig;
use tokio_util::sync::CancellationToken;

use crate::support::{assert_exact, Backends, Pipeline};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_restart_of_each_service_mid_stream_keeps_totals_exact() {
    let mut p = Pipeline::start(Backends::default(), 300).await;
    p.spawn_all().await;
    let client = p.client().await;
    let catalog = p.catalog.clone();
    let config = SimConfig {
        events: Some(30_000),
        rate: 5_000.0,
        duplicate_rate: 0.1,
        batch: 25,
        seed: 9,
        ..SimConfig::default()
    };
    let publisher = tokio::spawn(async move {
        adspend_sim::run(&client, &config, &catalog, CancellationToken::new()).await
    });

    for service in ["limiter", "aggregator", "pacer"] {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let process = match service {
            "limiter" => p.limiter.as_mut(),
            "aggregator" => p.aggregator.as_mut(),
            _ => p.pacer.as_mut(),
        }
        .unwrap();
        let status = process
            .terminate(Duration::from_secs(20))
            .expect("stops on SIGTERM");
        assert!(
            status.success(),
            "{service} exited with {status:?}:\n{}",
            process.log_tail(20)
        );
        process.restart();
        if service == "aggregator" {
            process
                .wait_for_log("aggregator running", Duration::from_secs(20))
                .await
                .expect("aggregator restarted");
            assert!(
                process.log_tail(50).contains("start=\"warm\""),
                "{}",
                process.log_tail(50)
            );
        }
    }
    p.wait_pacer().await;
    let truth = publisher.await.unwrap().expect("simulator");
    assert_eq!(truth.stats.messages_failed, 0);
    let comparison = p.settle(&truth, Duration::from_secs(60)).await;
    assert_exact(&comparison, &truth);
}
