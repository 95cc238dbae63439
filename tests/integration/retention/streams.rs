//! Streams an older version made (no limits) get the limits at the
//! limiter's start, or a clear error naming the way forward; `ALERTS`
//! drops alerts past their retention but every limit's last.

use std::time::Duration;

use adspend_harness::{free_port, wait_until, wait_until_ok};
use async_nats::jetstream::{self, stream};

use super::{stream, POLL};
use crate::support::{Backends, Pipeline};

/// `IMPRESSIONS` and `DEADLETTER` as the previous version made them:
/// subjects and storage, NATS's defaults for the rest.
async fn old_streams(p: &Pipeline) {
    let js = jetstream::new(p.client().await);
    for (name, subjects) in [
        ("IMPRESSIONS", "impressions.>"),
        ("DEADLETTER", "deadletter.>"),
    ] {
        js.create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subjects.into()],
            storage: stream::StorageType::File,
            ..Default::default()
        })
        .await
        .expect("an old stream");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_an_older_version_made_get_the_limits_at_start() {
    let mut p = Pipeline::start(Backends::default(), 20).await;
    old_streams(&p).await;
    p.limiter = Some(p.spawn_with(
        "limiter",
        free_port(),
        &[
            ("ADSPEND_INPUT_MAX_BYTES", "1048576"),
            ("ADSPEND_DEADLETTER_RETENTION_MS", "86400000"),
            ("ADSPEND_DEADLETTER_MAX_BYTES", "2097152"),
        ],
    ));
    let config = |name: &'static str| {
        let p = &p;
        async move { stream(p, name).await.cached_info().config.clone() }
    };
    wait_until_ok(Duration::from_secs(30), POLL, || async {
        let input = config("IMPRESSIONS").await;
        anyhow::ensure!(
            input.max_bytes == 1_048_576 && input.discard == stream::DiscardPolicy::New,
            "IMPRESSIONS: max_bytes {}, discard {:?}",
            input.max_bytes,
            input.discard
        );
        let dead = config("DEADLETTER").await;
        anyhow::ensure!(
            dead.max_age == Duration::from_secs(86_400)
                && dead.max_bytes == 2_097_152
                && dead.discard == stream::DiscardPolicy::Old,
            "DEADLETTER: max_age {:?}, max_bytes {}",
            dead.max_age,
            dead.max_bytes
        );
        anyhow::ensure!(input.max_age.is_zero(), "input got an age limit");
        Ok(())
    })
    .await
    .expect("the old streams did not get the limits");
}

/// A cap NATS cannot reserve: the limiter stops with one error saying
/// what to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_nats_refuses_stops_the_limiter_naming_the_way_forward() {
    let p = Pipeline::start(Backends::default(), 20).await;
    old_streams(&p).await;
    let mut limiter = p.spawn_with(
        "limiter",
        free_port(),
        &[("ADSPEND_INPUT_MAX_BYTES", "1125899906842624")],
    );
    let status = limiter
        .wait_for_exit(Duration::from_secs(60))
        .await
        .expect("the limiter stops");
    assert!(!status.success(), "{status:?}");
    let log = std::fs::read_to_string(limiter.log_path()).expect("limiter log");
    assert!(
        log.contains("update stream IMPRESSIONS")
            && log.contains("max_file_store")
            && log.contains("nats stream edit IMPRESSIONS"),
        "{}",
        limiter.log_tail(20)
    );
}

/// Alerts older than the retention go, but each limit's last stays.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn alerts_past_their_retention_go_but_every_limit_keeps_its_last() {
    let mut p = Pipeline::start(Backends::default(), 20).await;
    let js = jetstream::new(p.client().await);
    adspend_common::nats::ensure_alerts(&js, 1)
        .await
        .expect("ALERTS");
    let mut last = std::collections::BTreeMap::new();
    for (limit, threshold) in [("old-1", 50), ("old-1", 75), ("old-1", 90), ("old-2", 50)] {
        let alert = serde_json::json!({
            "limit_id": limit, "period_start": null, "threshold_percent": threshold,
            "spend_micros": threshold, "budget_micros": 100, "at_ms": 1,
        });
        let ack = js
            .publish(format!("adspend.alerts.{limit}"), alert.to_string().into())
            .await
            .expect("publish")
            .await
            .expect("stored");
        last.insert(limit, ack.sequence);
    }
    p.pacer = Some(p.spawn_with(
        "pacer",
        free_port(),
        &[("ADSPEND_ALERTS_RETENTION_MS", "1000")],
    ));
    p.wait_pacer().await;
    wait_until(Duration::from_secs(30), POLL, || async {
        stream(&p, "ALERTS").await.cached_info().state.messages == 2
    })
    .await
    .expect("old alerts were not purged");
    let alerts = stream(&p, "ALERTS").await;
    for (limit, seq) in &last {
        let kept = alerts
            .get_last_raw_message_by_subject(&format!("adspend.alerts.{limit}"))
            .await
            .expect("the limit's last alert");
        assert_eq!(kept.sequence, *seq, "{limit}");
    }
    for seq in 1..last["old-1"] {
        assert!(
            alerts.get_raw_message(seq).await.is_err(),
            "alert {seq} kept"
        );
    }
}
