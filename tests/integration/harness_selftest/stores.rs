//! etcd keeps its data across a crash; moto round-trips objects, lists
//! past a page, stalls when paused and forgets everything on a restart.

use std::time::Duration;

use adspend_harness::{Etcd, S3Server};
use bytes::Bytes;
use futures::stream::{self, StreamExt, TryStreamExt};

use super::{get_json, process_exists, refuses_connections};

#[tokio::test]
async fn etcd_keeps_its_data_across_kill_and_restart() {
    let mut etcd = Etcd::start().await;
    let endpoints = etcd.endpoints();
    assert!(etcd.is_healthy().await);
    let health = get_json(&format!("{endpoints}/health")).await;
    assert_eq!(health["health"], "true");

    etcd.put("selftest/key", b"value-1").await.unwrap();
    assert_eq!(
        etcd.get("selftest/key").await.unwrap().as_deref(),
        Some(&b"value-1"[..])
    );
    assert_eq!(etcd.get("selftest/absent").await.unwrap(), None);
    // Keys and values cross the JSON gateway as base64: every padding
    // length, bytes that are not UTF-8, and the empty value (which the
    // gateway leaves out of its answer) come back as they went in.
    let values: Vec<Vec<u8>> = (0..=7_u8)
        .map(|n| (0..n).map(|i| 0xF8 ^ i).collect())
        .collect();
    for (n, value) in values.iter().enumerate() {
        etcd.put(&format!("selftest/bytes/{n}"), value)
            .await
            .unwrap();
    }
    for (n, value) in values.iter().enumerate() {
        let key = format!("selftest/bytes/{n}");
        assert_eq!(etcd.get(&key).await.unwrap().as_ref(), Some(value), "{key}");
    }
    let listed = etcd.get_prefix("selftest/bytes/").await.unwrap();
    let listed: Vec<(String, Vec<u8>)> = listed.into_iter().map(|(k, v, _)| (k, v)).collect();
    let expected: Vec<(String, Vec<u8>)> = values
        .iter()
        .enumerate()
        .map(|(n, value)| (format!("selftest/bytes/{n}"), value.clone()))
        .collect();
    assert_eq!(listed, expected);

    let first_pid = etcd.pid().unwrap();
    etcd.kill();
    assert!(!etcd.is_running());
    assert!(!process_exists(first_pid));
    assert!(!etcd.is_healthy().await);

    etcd.restart().await;
    assert!(etcd.is_running());
    assert_eq!(etcd.endpoints(), endpoints);
    assert!(etcd.is_healthy().await);
    assert_eq!(
        etcd.get("selftest/key").await.unwrap().as_deref(),
        Some(&b"value-1"[..])
    );

    etcd.stop();
    assert!(!etcd.is_running());
    etcd.restart().await;
    etcd.put("selftest/key", b"value-2").await.unwrap();
    assert_eq!(
        etcd.get("selftest/key").await.unwrap().as_deref(),
        Some(&b"value-2"[..])
    );
}

#[tokio::test]
async fn s3_round_trips_objects_over_plain_http() {
    let s3 = S3Server::start().await;
    s3.create_bucket("selftest").await.unwrap();
    s3.create_bucket("selftest")
        .await
        .expect("creating an existing bucket must succeed");

    let body = Bytes::from_static(b"\x00binary\xffpayload");
    s3.put_object("selftest", "day=2024-01-01/part 1.bin", body.clone())
        .await
        .unwrap();
    s3.put_object("selftest", "other/x", "x").await.unwrap();
    // Characters a URL or the listing's XML must escape.
    let awkward = "other/a&b c?d=<e>";
    s3.put_object("selftest", awkward, "awkward").await.unwrap();
    assert_eq!(
        s3.get_object("selftest", awkward).await.unwrap(),
        Some(Bytes::from("awkward"))
    );
    assert_eq!(
        s3.list_keys("selftest", "other/a").await.unwrap(),
        [awkward]
    );
    s3.delete_object("selftest", awkward).await.unwrap();
    assert_eq!(s3.get_object("selftest", awkward).await.unwrap(), None);
    s3.delete_object("selftest", awkward)
        .await
        .expect("deleting a missing key succeeds, as in S3");
    assert_eq!(
        s3.get_object("selftest", "day=2024-01-01/part 1.bin")
            .await
            .unwrap(),
        Some(body)
    );
    assert_eq!(s3.get_object("selftest", "missing").await.unwrap(), None);
    assert!(s3.get_object("no-such-bucket", "x").await.is_err());
    assert_eq!(
        s3.list_keys("selftest", "day=").await.unwrap(),
        ["day=2024-01-01/part 1.bin"]
    );
    assert_eq!(s3.list_keys("selftest", "").await.unwrap().len(), 2);

    let env = s3.env();
    let endpoint = s3.endpoint();
    for (name, value) in [
        ("AWS_ENDPOINT", endpoint.as_str()),
        ("AWS_ENDPOINT_URL", endpoint.as_str()),
        ("AWS_ALLOW_HTTP", "true"),
        ("AWS_REGION", "us-east-1"),
    ] {
        assert!(
            env.iter().any(|(n, v)| n == name && v == value),
            "{name}={value} missing from {env:?}"
        );
    }
}

#[tokio::test]
async fn s3_list_keys_follows_continuation_tokens() {
    let s3 = S3Server::start().await;
    s3.create_bucket("many").await.unwrap();
    // More than one 1000-key page.
    let s3 = &s3;
    stream::iter(0..1001)
        .map(|index| async move {
            let key = format!("k/{index:05}");
            s3.put_object("many", &key, "").await
        })
        .buffer_unordered(16)
        .try_collect::<Vec<()>>()
        .await
        .unwrap();
    let keys = s3.list_keys("many", "k/").await.unwrap();
    assert_eq!(keys.len(), 1001);
    assert_eq!(keys.last().unwrap(), "k/01000");
}

#[tokio::test]
async fn s3_pause_keeps_data_and_restart_loses_it() {
    let mut s3 = S3Server::start().await;
    s3.create_bucket("volatile").await.unwrap();
    s3.put_object("volatile", "a", "kept while paused")
        .await
        .unwrap();

    s3.pause();
    let stalled =
        tokio::time::timeout(Duration::from_millis(500), s3.get_object("volatile", "a")).await;
    assert!(stalled.is_err(), "a paused server answered");
    s3.resume();
    assert_eq!(
        s3.get_object("volatile", "a").await.unwrap(),
        Some(Bytes::from("kept while paused"))
    );

    let endpoint = s3.endpoint();
    s3.kill();
    assert!(!s3.is_running());
    assert!(refuses_connections(s3.port()));
    s3.restart().await;
    assert_eq!(s3.endpoint(), endpoint);
    let lost = s3.get_object("volatile", "a").await;
    assert!(
        lost.as_ref()
            .is_err_and(|err| format!("{err:#}").contains("NoSuchBucket")),
        "moto kept data across a restart: {lost:?}"
    );
    s3.create_bucket("volatile").await.unwrap();
    assert_eq!(s3.get_object("volatile", "a").await.unwrap(), None);
}
