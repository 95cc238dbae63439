//! The checkpoint record in etcd never goes back within one owner epoch.
//!
//! The compose fault campaign once saw records of nine partitions drop by
//! about 2,000 stream sequences and come back. Two things can do that, and
//! the record store now guards against both:
//! - a commit whose answer was lost (client timeout during an etcd leader
//!   pause) applied by etcd after a newer one: every commit is also fenced by
//!   the record's own revision;
//! - a read answered by an etcd member that a pause left behind (etcd 3.4
//!   serves such stale reads, etcd-io/etcd#20418): reads after taking
//!   ownership must be answered at the revision that took it or later.
//!
//! All against a real etcd.

use std::time::{Duration, Instant};

use adspend_aggregator::record::{read_at_least, CheckpointRecord, CheckpointStore};
use adspend_common::error::Error;
use adspend_harness::Etcd;

fn record(epoch: u64, seq: u64) -> CheckpointRecord {
    CheckpointRecord {
        checkpoint_id: seq,
        seq,
        snapshot_key: format!("snapshots/p0/{seq}"),
        checksum: "c".into(),
        size_bytes: 1,
        epoch,
        lineage: "l".into(),
        created_ms: 0,
        deltas: Vec::new(),
    }
}

async fn owner(etcd: &Etcd) -> (CheckpointStore, u64) {
    let client = etcd_client::Client::connect([etcd.endpoints()], None)
        .await
        .expect("connect to etcd");
    let mut store = CheckpointStore::etcd(client, "p0");
    let epoch = store.acquire_epoch().await.expect("acquire");
    assert!(store.load().await.expect("load").is_none());
    (store, epoch)
}

/// An earlier commit of this owner that lands after its answer was lost
/// moves the record under the owner: the next commit, newer, is recorded
/// over it instead of failing forever.
#[tokio::test]
async fn a_commit_that_landed_unseen_is_recorded_over() {
    let etcd = Etcd::start().await;
    let (mut store, epoch) = owner(&etcd).await;
    store.commit(&record(epoch, 10)).await.unwrap();
    // What a commit whose answer was lost leaves behind.
    let late = serde_json::to_vec(&record(epoch, 20)).unwrap();
    etcd.put("/adspend/shards/p0/checkpoint", &late)
        .await
        .unwrap();
    store.commit(&record(epoch, 30)).await.unwrap();
    assert_eq!(store.load().await.unwrap(), Some(record(epoch, 30)));
}

/// A commit carrying a record older than the one etcd holds under the same
/// epoch (what a late-applied earlier commit would be) is refused, and the
/// newer record stays.
#[tokio::test]
async fn an_older_record_never_replaces_a_newer_one() {
    let etcd = Etcd::start().await;
    let (mut store, epoch) = owner(&etcd).await;
    store.commit(&record(epoch, 10)).await.unwrap();
    // A second handle on the same epoch, reading the record before the
    // newer commit: its commit stands for the one that applies late.
    let client = etcd_client::Client::connect([etcd.endpoints()], None)
        .await
        .unwrap();
    let mut late = CheckpointStore::etcd(client, "p0");
    assert_eq!(late.load().await.unwrap(), Some(record(epoch, 10)));
    store.commit(&record(epoch, 30)).await.unwrap();
    let err = late.commit(&record(epoch, 20)).await.unwrap_err();
    assert!(matches!(err, Error::Fenced { .. }), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("sequence 30") && text.contains("20"),
        "{text}"
    );
    assert_eq!(store.load().await.unwrap(), Some(record(epoch, 30)));
    // The owner itself carries on.
    store.commit(&record(epoch, 40)).await.unwrap();
    assert_eq!(store.load().await.unwrap(), Some(record(epoch, 40)));
}

/// A read that must see revision R waits while etcd answers from before R,
/// and names the revisions when it gives up.
#[tokio::test]
async fn a_read_waits_for_the_revision_it_needs() {
    let etcd = Etcd::start().await;
    let mut client = etcd_client::Client::connect([etcd.endpoints()], None)
        .await
        .unwrap();
    let now = client
        .get("/adspend/anything", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();

    // Nothing moves etcd past `now`: a clear error after the patience.
    let started = Instant::now();
    let err = read_at_least(&mut client, "/k", now + 1, Duration::from_millis(600))
        .await
        .unwrap_err();
    assert!(started.elapsed() >= Duration::from_millis(600));
    let text = err.to_string();
    assert!(
        text.contains(&format!("revision {} or later", now + 1))
            && text.contains(&format!("stays at {now}")),
        "{text}"
    );

    // A write elsewhere moves it: the read returns once it can.
    let mut writer = client.clone();
    let write = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(400)).await;
        writer.put("/k", "v", None).await.unwrap();
    });
    let got = read_at_least(&mut client, "/k", now + 1, Duration::from_secs(20))
        .await
        .unwrap();
    write.await.unwrap();
    assert!(got.header().unwrap().revision() > now);
    assert_eq!(got.kvs()[0].value(), b"v");
}
