//! The account store limit our NATS configs set (deploy/nats-auth.conf) is
//! what `AdspendNatsStoreNearFull` measures: with one, the limiter exports
//! the limit and the store's fill, and the alert's expression holds once
//! the account's streams pass 85% of it (the rule itself is unit-tested by
//! promtool, deploy/prometheus/rules.test.yml).

use std::time::Duration;

use adspend_harness::{free_port, wait_until, NatsOptions};

use super::{messages, state, POLL};
use crate::support::{try_metric, Backends, Pipeline};

const LIMIT: u64 = 4 * 1024 * 1024;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_account_store_limit_is_exported_and_its_fill_reaches_the_alert() {
    let nats = NatsOptions {
        extra_config: format!(
            "no_auth_user: svc\n\
             accounts {{\n  ADSPEND {{\n    jetstream: {{ max_file: {LIMIT}, max_mem: 1M }}\n    \
             users: [ {{ user: svc, password: not-secret-in-a-test }} ]\n  }}\n}}\n"
        ),
        ..NatsOptions::default()
    };
    let catalog =
        adspend_sim::generate_catalog(&adspend_sim::CatalogSpec::for_ads(20), 11).expect("catalog");
    let mut p = Pipeline::start_with(Backends::default(), nats, catalog).await;
    let port = free_port();
    // DEADLETTER's cap is reserved from the account: it must fit.
    p.limiter = Some(p.spawn_with(
        "limiter",
        port,
        &[("ADSPEND_DEADLETTER_MAX_BYTES", "262144")],
    ));
    let metric = |name: &'static str| async move { try_metric(port, name).await.unwrap_or(0.0) };
    wait_until(Duration::from_secs(45), POLL, || async {
        metric("adspend_limiter_nats_storage_limit_bytes").await == LIMIT as f64
    })
    .await
    .expect("the account's store limit was not exported");
    // No aggregator: the input and SPEND stay. Fill past 85%.
    let mut config = messages("fill", 40_000, 50, 321);
    config.in_flight = 8;
    let sent = p.publish(&config).await;
    assert!(sent.stats.messages_acked > 0);
    wait_until(Duration::from_secs(45), POLL, || async {
        metric("adspend_limiter_nats_storage_bytes").await
            / metric("adspend_limiter_nats_storage_limit_bytes").await
            > 0.85
    })
    .await
    .expect("the store's fill never reached the alert's threshold");
    // What an event costs each stream (the footprint of docs/RETENTION.md):
    // every event the limiter published spend for is in both.
    let events = metric("adspend_limiter_impressions_total").await;
    let tuples = metric("adspend_limiter_tuples_emitted_total").await;
    let (_, _, input_bytes) = state(&p, "IMPRESSIONS").await;
    let (_, _, spend_bytes) = state(&p, "SPEND").await;
    let stored_events = (sent.stats.messages_acked * 50) as f64;
    println!(
        "retention::store: {} messages stored, {} refused at a {LIMIT}-byte account limit; \
         IMPRESSIONS {:.0} bytes/event (batches of 50), SPEND {:.0} bytes/event \
         ({:.1} limits per event, {events} events published)",
        sent.stats.messages_acked,
        sent.stats.messages_failed,
        input_bytes as f64 / stored_events,
        spend_bytes as f64 / events.max(1.0),
        tuples / events.max(1.0),
    );
}
