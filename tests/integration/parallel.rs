//! A pipeline that uses more than one core: the limiter maps chunks on
//! several threads and still publishes them in the order it read them; a
//! single-machine aggregator with several writers applies its shards in
//! parallel, exact through a crash in one writer while the others commit,
//! refuses a data directory written with another number of writers, and
//! by default ("auto") follows the shards its data directory or etcd's
//! records hold.

use std::collections::HashMap;
use std::time::Duration;

use adspend_harness::{free_port, wait_until};
use adspend_wire::codec::decode_spend;
use adspend_wire::types::{MsgId, SpendMessage};
use async_nats::jetstream::{self, consumer::pull::OrderedConfig};
use futures::StreamExt;

use crate::support::{assert_exact, sim_config, Backends, Pipeline};

/// Every message of `stream` on `subject`, in stream order, with its
/// sequence.
async fn read_all(p: &Pipeline, stream: &str, subject: &str) -> Vec<(u64, bytes::Bytes)> {
    let js = jetstream::new(p.client().await);
    let stream = js.get_stream(stream).await.expect("stream");
    let last = stream.cached_info().state.last_sequence;
    let consumer = stream
        .create_consumer(OrderedConfig {
            filter_subject: subject.into(),
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut messages = consumer.messages().await.expect("messages");
    let mut all = Vec::new();
    loop {
        let next = tokio::time::timeout(Duration::from_secs(2), messages.next()).await;
        let Ok(Some(Ok(message))) = next else { break };
        let seq = message.info().expect("info").stream_sequence;
        all.push((seq, message.payload.clone()));
        if seq >= last {
            break;
        }
    }
    all
}

/// With four mapping threads and small chunks, every partition of `SPEND`
/// carries its tuples in the order their impressions were read from
/// `IMPRESSIONS`, each id once, and the totals are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn limiter_workers_keep_each_partitions_order_and_ids() {
    let mut p = Pipeline::start(Backends::default(), 60).await;
    let js = jetstream::new(p.client().await);
    adspend_common::nats::ensure_impressions(&js, 1)
        .await
        .expect("IMPRESSIONS");
    // A backlog, so that many chunks are mapped at once.
    let mut config = sim_config(20_000, 91);
    config.duplicate_rate = 0.0;
    let truth = p.publish(&config).await;
    // SPEND is read whole below: the shards keep it untrimmed.
    p.aggregator = Some(p.spawn_with("aggregator", free_port(), &[("ADSPEND_SPEND_TRIM", "off")]));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    p.limiter = Some(p.spawn_with(
        "limiter",
        free_port(),
        &[
            ("ADSPEND_LIMITER_WORKERS", "4"),
            ("ADSPEND_LIMITER_MAX_BATCH", "4"),
        ],
    ));
    assert_exact(&p.settle(&truth, Duration::from_secs(90)).await, &truth);
    let limiter = p.limiter.as_mut().expect("limiter");
    limiter
        .wait_for_log("workers=4", Duration::from_secs(5))
        .await
        .expect("four mapping threads");

    // Each (limit, impression) id → the sequence of the input message
    // that carried the impression.
    let catalog = adspend_wire::catalog::Catalog::parse(
        "test",
        &std::fs::read(&p.catalog_path).expect("catalog"),
    )
    .expect("catalog parses");
    let mut input_seq: HashMap<MsgId, u64> = HashMap::new();
    for (seq, payload) in read_all(&p, "IMPRESSIONS", "impressions.>").await {
        for line in payload.split(|&b| b == b'\n').filter(|l| !l.is_empty()) {
            let event: serde_json::Value = serde_json::from_slice(line).expect("a sim line");
            let id = event["id"].as_str().expect("id");
            let ad = event["ad_id"].as_str().expect("ad_id");
            for limit in catalog.limits_of_ad(ad).unwrap_or_default() {
                input_seq.insert(MsgId::derive(&limit.id, id), seq);
            }
        }
    }
    let mut seen = 0;
    let mut spend_messages = 0;
    for partition in 0..4 {
        let mut last_input = 0;
        let mut ids = std::collections::HashSet::new();
        for (seq, payload) in read_all(&p, "SPEND", &format!("spend.{partition}")).await {
            let SpendMessage::Batch(batch) = decode_spend(&payload).expect("decodes") else {
                continue;
            };
            spend_messages += 1;
            for tuple in &batch.tuples {
                let from = *input_seq
                    .get(&tuple.msg_id)
                    .unwrap_or_else(|| panic!("SPEND seq {seq}: a tuple of no input"));
                assert!(
                    from >= last_input,
                    "partition {partition}: SPEND seq {seq} carries input {from} after input {last_input}"
                );
                last_input = from;
                assert!(
                    ids.insert(tuple.msg_id),
                    "partition {partition}: an id twice"
                );
                seen += 1;
            }
        }
    }
    assert_eq!(seen, input_seq.len(), "every (limit, impression) once");
    println!(
        "limiter workers: {seen} tuples in {spend_messages} SPEND messages, in input order per partition"
    );
}

fn shard_dirs(p: &Pipeline) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(p.aggregator_dir())
        .expect("data dir")
        .flatten()
        .filter(|e| e.path().join("lmdb").is_dir())
        .map(|e| e.file_name().to_string_lossy().to_string())
        .collect();
    names.sort();
    names
}

/// Two writers (partitions 0 and 2, 1 and 3), each its own LMDB, record and
/// snapshots: a crash at a commit of whichever writer comes to it while the
/// other commits leaves both exact after the restart, and a start with one
/// writer on that data directory is refused with exit 64, naming the way
/// forward.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_writers_are_exact_through_a_crash_in_one_of_them() {
    let mut p = Pipeline::start(Backends::default(), 60).await;
    let writers = [("ADSPEND_AGGREGATOR_WRITERS", "2")];
    let mut armed = writers.to_vec();
    armed.push(("ADSPEND_FAILPOINTS", "aggregator.after_commit@25"));
    p.aggregator = Some(p.spawn_with("aggregator", free_port(), &armed));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let truth = p.publish(&sim_config(30_000, 92)).await;
    let aggregator = p.aggregator.as_mut().expect("aggregator");
    aggregator
        .wait_for_exit(Duration::from_secs(60))
        .await
        .expect("the failure point fired");
    assert!(
        std::fs::read_to_string(aggregator.log_path())
            .expect("log")
            .contains("FAILPOINT FIRED: aggregator.after_commit"),
        "{}",
        aggregator.log_tail(20)
    );
    assert_eq!(shard_dirs(&p), ["p0-2", "p1-3"]);

    // One writer on the two writers' data: refused, the way forward named.
    let mut one = p.spawn_with(
        "aggregator",
        free_port(),
        &[("ADSPEND_AGGREGATOR_WRITERS", "1")],
    );
    let status = one
        .wait_for_exit(Duration::from_secs(30))
        .await
        .expect("refused");
    assert_eq!(status.code(), Some(64), "{}", one.log_tail(5));
    let tail = one.log_tail(5);
    assert!(
        tail.contains("ADSPEND_AGGREGATOR_WRITERS") && tail.contains("p0-2, p1-3"),
        "{tail}"
    );

    // "auto" (the default) follows the two shards the data directory holds.
    let metrics = free_port();
    let mut auto = p.spawn_with(
        "aggregator",
        metrics,
        &[("ADSPEND_AGGREGATOR_WRITERS", "auto")],
    );
    auto.wait_for_log("as the data directory holds", Duration::from_secs(30))
        .await
        .expect("auto adopts the shards on disk");
    p.aggregator = Some(auto);
    assert_exact(&p.settle(&truth, Duration::from_secs(90)).await, &truth);
    // Both shards applied and checkpoint on their own.
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async move {
            let body = reqwest::get(format!("http://127.0.0.1:{metrics}/metrics"))
                .await
                .ok();
            let Some(body) = body else { return false };
            let body = body.text().await.unwrap_or_default();
            ["p0-2", "p1-3"].iter().all(|shard| {
                crate::support::metric_value(
                    &body,
                    &format!(
                        "adspend_aggregator_last_checkpoint_timestamp_seconds{{shard=\"{shard}\"}}"
                    ),
                )
                .is_some_and(|t| t > 0.0)
            })
        },
    )
    .await
    .expect("both shards checkpoint");
}

/// Two limiter processes on one source share its durable consumer, each
/// taking part of the input; a kill of one mid-run leaves the other to
/// take over what the dead one held (after the ack wait), exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_limiters_on_one_source_are_exact_through_a_kill_of_one() {
    let mut p = Pipeline::start(Backends::default(), 60).await;
    let (first, second) = (free_port(), free_port());
    p.aggregator = Some(p.spawn("aggregator"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let small = [("ADSPEND_LIMITER_MAX_BATCH", "2")];
    p.limiter = Some(p.spawn_with("limiter", first, &small));
    let mut other = p.spawn_with("limiter", second, &small);
    let client = p.client().await;
    let catalog = p.catalog.clone();
    let mut config = sim_config(30_000, 93);
    config.rate = 3_000.0;
    let publisher = tokio::spawn(async move {
        adspend_sim::run(
            &client,
            &config,
            &catalog,
            tokio_util::sync::CancellationToken::new(),
        )
        .await
    });
    let busy = |port: u16| async move {
        crate::support::try_metric(port, "adspend_limiter_impressions_total")
            .await
            .unwrap_or(0.0)
    };
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(100),
        || async { busy(first).await > 0.0 && busy(second).await > 0.0 },
    )
    .await
    .expect("both limiters take part of the input");
    other.kill();
    let truth = publisher.await.expect("publisher").expect("simulator");
    assert_exact(&p.settle(&truth, Duration::from_secs(120)).await, &truth);
    println!(
        "two limiters: the survivor counted {} impressions, exact",
        busy(first).await
    );
}

/// A data directory lost under "auto": the shards etcd holds records of
/// (two writers' `p0-2` and `p1-3`) restore from their snapshots, whatever
/// the cores of this machine would have chosen, and the sums are exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn auto_writers_restore_the_shards_etcd_records_after_the_disk_is_lost() {
    let backends = Backends {
        etcd: true,
        s3: true,
    };
    let mut p = Pipeline::start(backends, 60).await;
    let writers = [("ADSPEND_AGGREGATOR_WRITERS", "2")];
    p.aggregator = Some(p.spawn_with("aggregator", free_port(), &writers));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let mut truth = p.publish(&sim_config(20_000, 94)).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(90)).await, &truth);
    let etcd = p.etcd.as_ref().expect("etcd");
    wait_until(
        Duration::from_secs(30),
        Duration::from_millis(200),
        || async {
            let mut recorded = 0;
            for shard in ["p0-2", "p1-3"] {
                let key = format!("/adspend/shards/{shard}/checkpoint");
                if etcd.get(&key).await.ok().flatten().is_some() {
                    recorded += 1;
                }
            }
            recorded == 2
        },
    )
    .await
    .expect("both shards record a checkpoint");

    p.aggregator.as_mut().expect("aggregator").kill();
    let dir = p.aggregator_dir();
    std::fs::remove_dir_all(&dir).expect("lose the data directory");
    truth.absorb(&p.publish(&sim_config(10_000, 95)).await);
    let mut auto = p.spawn_with(
        "aggregator",
        free_port(),
        &[("ADSPEND_AGGREGATOR_WRITERS", "auto")],
    );
    auto.wait_for_log(
        "as the checkpoint records in etcd hold",
        Duration::from_secs(30),
    )
    .await
    .expect("auto follows etcd's records");
    p.aggregator = Some(auto);
    assert_exact(&p.settle(&truth, Duration::from_secs(90)).await, &truth);
    assert_eq!(shard_dirs(&p), ["p0-2", "p1-3"]);
}

/// Idle after a run, a shard whose partitions did not get the stream's
/// last message neither takes its consumer for stalled (the head it sees
/// is the other shard's) nor falls behind in the pacer: every shard's lag
/// stays within the pushes' heartbeat.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_shard_stays_fresh_while_the_streams_head_is_another_shards() {
    let mut p = Pipeline::start(Backends::default(), 60).await;
    let writers = [("ADSPEND_AGGREGATOR_WRITERS", "2")];
    p.aggregator = Some(p.spawn_with("aggregator", free_port(), &writers));
    // Markers at the default interval, not the harness's 500 ms: between
    // them an idle partition gets no message for seconds.
    let markers = [("ADSPEND_CHECKPOINT_INTERVAL_MS", "10000")];
    p.limiter = Some(p.spawn_with("limiter", free_port(), &markers));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let truth = p.publish(&sim_config(5_000, 96)).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);

    let http = reqwest::Client::new();
    let mut worst: HashMap<String, u64> = HashMap::new();
    for _ in 0..40 {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let body: serde_json::Value = http
            .get(format!("{}/v1/shards", p.pacer_url()))
            .send()
            .await
            .expect("GET /v1/shards")
            .json()
            .await
            .expect("shards as JSON");
        for shard in body["shards"].as_array().expect("shards") {
            let name = shard["shard"].as_str().unwrap_or_default().to_string();
            let lag = shard["lag_ms"].as_u64().unwrap_or(u64::MAX);
            let entry = worst.entry(name).or_insert(0);
            *entry = (*entry).max(lag);
        }
    }
    assert_eq!(worst.len(), 2, "{worst:?}");
    assert!(
        worst.values().all(|lag| *lag < 3_000),
        "a shard fell behind while idle: worst lag_ms {worst:?}"
    );
    let log = std::fs::read_to_string(p.aggregator.as_ref().expect("aggregator").log_path())
        .expect("aggregator log");
    assert!(
        !log.contains("stalled; recreating"),
        "an idle consumer was taken for stalled:\n{}",
        log.lines()
            .filter(|l| l.contains("stalled"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
