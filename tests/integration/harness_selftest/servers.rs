//! nats-server, and through it the lifecycle every server shares: a kill
//! that really crashes, a restart that keeps the store, a pause that stalls,
//! and nothing left behind on drop.

use std::path::Path;
use std::time::Duration;

use adspend_harness::{NatsOptions, NatsServer};
use async_nats::jetstream::{self, stream::StorageType};
use bytes::Bytes;

use super::{get_json, process_exists, refuses_connections, wait_for_state, SHORT};

#[tokio::test]
async fn nats_jetstream_keeps_acknowledged_messages_across_kill_and_restart() {
    let mut nats = NatsServer::start().await;
    let url = nats.url();
    let first_pid = nats.pid().unwrap();

    let client = async_nats::connect(&url).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "SELFTEST".into(),
        subjects: vec!["selftest.>".into()],
        storage: StorageType::File,
        ..Default::default()
    })
    .await
    .unwrap();
    for payload in ["one", "two", "three"] {
        js.publish("selftest.a", Bytes::from(payload))
            .await
            .unwrap()
            .await
            .unwrap();
    }

    nats.kill();
    assert!(!nats.is_running());
    assert!(!process_exists(first_pid), "kill() left the process behind");
    assert!(refuses_connections(nats.port()));

    nats.restart().await;
    assert!(nats.is_running());
    assert_eq!(nats.url(), url, "restart moved the server");
    assert_ne!(nats.pid(), Some(first_pid));

    let client = async_nats::connect(&url).await.unwrap();
    let js = jetstream::new(client);
    let mut stream = js.get_stream("SELFTEST").await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 3);
    let second = stream.get_raw_message(2).await.unwrap();
    assert_eq!(second.payload, Bytes::from("two"));
    let ack = js
        .publish("selftest.a", Bytes::from("four"))
        .await
        .unwrap()
        .await
        .unwrap();
    assert_eq!(ack.sequence, 4, "the recovered stream lost its sequence");
}

#[tokio::test]
async fn nats_stop_is_graceful_and_restart_keeps_the_store() {
    let mut nats = NatsServer::start().await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "STOPPED".into(),
        subjects: vec!["stopped".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    js.publish("stopped", Bytes::from("kept"))
        .await
        .unwrap()
        .await
        .unwrap();

    nats.stop();
    assert!(!nats.is_running());
    assert!(
        nats.log_tail(20).contains("Shutdown"),
        "no graceful shutdown in the log:\n{}",
        nats.log_tail(20)
    );
    nats.restart().await;

    let client = async_nats::connect(nats.url()).await.unwrap();
    let stream = jetstream::new(client).get_stream("STOPPED").await.unwrap();
    let message = stream.get_raw_message(1).await.unwrap();
    assert_eq!(message.payload, Bytes::from("kept"));
}

#[tokio::test]
async fn nats_config_is_applied() {
    let nats = NatsServer::start().await;
    let varz = get_json(&format!("{}/varz", nats.monitor_url())).await;
    assert_eq!(varz["max_payload"], 8 * 1024 * 1024);
    assert_eq!(varz["jetstream"]["config"]["sync_always"], true);
    let store = varz["jetstream"]["config"]["store_dir"].as_str().unwrap();
    assert!(
        Path::new(store).starts_with(nats.store_dir()),
        "store {store} is not under {}",
        nats.store_dir().display()
    );

    // A payload over the 1 MB default only fits because of max_payload.
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = jetstream::new(client);
    js.create_stream(jetstream::stream::Config {
        name: "BIG".into(),
        subjects: vec!["big".into()],
        ..Default::default()
    })
    .await
    .unwrap();
    let big = Bytes::from(vec![7_u8; 5 * 1024 * 1024]);
    js.publish("big", big.clone()).await.unwrap().await.unwrap();
    let stored = js
        .get_stream("BIG")
        .await
        .unwrap()
        .get_raw_message(1)
        .await
        .unwrap();
    assert_eq!(stored.payload.len(), big.len());

    let lazy = NatsServer::start_with(NatsOptions {
        lazy_sync: true,
        ..NatsOptions::default()
    })
    .await;
    let varz = get_json(&format!("{}/varz", lazy.monitor_url())).await;
    // nats-server omits the field when it is false.
    assert_ne!(varz["jetstream"]["config"]["sync_always"], true);
    assert!(varz["jetstream"]["config"]["sync_interval"].is_u64());
}

#[tokio::test]
async fn nats_pause_stalls_and_resume_recovers() {
    let mut nats = NatsServer::start().await;
    let pid = nats.pid().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    // Any request the server itself must answer.
    let ask = || client.request("$JS.API.INFO", Bytes::new());
    tokio::time::timeout(SHORT, ask())
        .await
        .expect("no answer before pausing")
        .unwrap();

    nats.pause();
    wait_for_state(pid, true).await;
    let stalled = tokio::time::timeout(Duration::from_millis(500), ask()).await;
    assert!(stalled.is_err(), "a paused server answered: {stalled:?}");

    nats.resume();
    wait_for_state(pid, false).await;
    tokio::time::timeout(SHORT, ask())
        .await
        .expect("no answer after resume")
        .unwrap();
}

#[tokio::test]
#[should_panic(expected = "call kill() or stop() before restart()")]
async fn restarting_a_running_server_is_refused() {
    let mut nats = NatsServer::start().await;
    nats.restart().await;
}

#[tokio::test]
async fn dropping_a_server_kills_it_and_removes_its_directory() {
    let nats = NatsServer::start().await;
    let pid = nats.pid().unwrap();
    let scratch = nats.log_path().parent().unwrap().to_owned();
    assert!(scratch.is_dir());
    let port = nats.port();

    drop(nats);
    assert!(!process_exists(pid), "nats-server outlived its handle");
    assert!(!scratch.exists(), "{} was left behind", scratch.display());
    assert!(refuses_connections(port));
}
