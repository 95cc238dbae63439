//! A real simulator run against a nats-server whose stream is read back and
//! recomputed independently of the simulator's own bookkeeping. The
//! simulator's pure parts (catalog generator, truth, options) are unit-tested
//! beside them in `adspend_sim`.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use adspend_harness::{NatsOptions, NatsServer};
use adspend_sim::{
    self as sim, BadKind, Catalog, CatalogSpec, EventTime, Impression, LimitTruth, Period,
    SimConfig, Truth,
};
use async_nats::jetstream;
use chrono_tz::Tz;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;

/// A JetStream server whose fsync interval is nats-server's default: these
/// tests never crash it, and the pacing test measures the simulator.
async fn nats() -> NatsServer {
    NatsServer::start_with(NatsOptions {
        lazy_sync: true,
        ..Default::default()
    })
    .await
}

/// The contract's rules applied to one line, written independently of the
/// simulator: the reason a pipeline would reject it, or the impression.
fn classify(line: &[u8], catalog: &Catalog) -> Result<Impression, &'static str> {
    let value: serde_json::Value = serde_json::from_slice(line).map_err(|_| "invalid_json")?;
    let object = value.as_object().ok_or("invalid_json")?;
    let [Some(id), Some(ad_id), Some(cost), Some(ts)] =
        ["id", "ad_id", "cost_micros", "ts"].map(|f| object.get(f))
    else {
        return Err("missing_field");
    };
    let id = id.as_str().ok_or("invalid_json")?;
    if id.is_empty() || id.len() > 64 {
        return Err("id_too_long");
    }
    let cost_micros = match cost.as_u64() {
        Some(cost) => cost,
        None if cost.as_i64().is_some_and(|c| c < 0) => return Err("negative_cost"),
        None if cost.is_f64() => return Err("fractional_cost"),
        None => return Err("invalid_json"),
    };
    // The limiter's default ADSPEND_MAX_COST_MICROS.
    if cost_micros > 1_000_000_000_000 {
        return Err("cost_too_large");
    }
    let ad_id = ad_id.as_str().ok_or("invalid_json")?;
    if !catalog.ads.contains_key(ad_id) {
        return Err("unknown_ad");
    }
    Ok(Impression {
        id: id.into(),
        ad_id: ad_id.into(),
        cost_micros,
        ts: ts.as_i64().ok_or("invalid_json")?,
    })
}

/// What the stream holds, recomputed from scratch.
#[derive(Debug, Default)]
struct StreamContents {
    messages: u64,
    lines: u64,
    bad: BTreeMap<String, u64>,
    /// id → (impression, line bytes, sequence numbers of its messages)
    good: HashMap<String, (Impression, Vec<u8>, Vec<u64>)>,
}

async fn read_stream(client: &async_nats::Client, catalog: &Catalog) -> StreamContents {
    let js = jetstream::new(client.clone());
    let mut stream = js.get_stream(sim::STREAM).await.unwrap();
    let expected = stream.info().await.unwrap().state.messages;
    let consumer = stream
        .create_consumer(jetstream::consumer::pull::OrderedConfig::default())
        .await
        .unwrap();
    let mut messages = consumer.messages().await.unwrap();
    let mut contents = StreamContents::default();
    while contents.messages < expected {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .expect("stream read stalled")
            .unwrap()
            .unwrap();
        contents.messages += 1;
        let seq = message.info().unwrap().stream_sequence;
        for line in message.payload.split(|&b| b == b'\n') {
            contents.lines += 1;
            match classify(line, catalog) {
                Err(reason) => *contents.bad.entry(reason.to_owned()).or_default() += 1,
                Ok(event) => {
                    let entry = contents
                        .good
                        .entry(event.id.clone())
                        .or_insert_with(|| (event, line.to_vec(), Vec::new()));
                    assert_eq!(entry.1, line, "duplicate is not verbatim");
                    entry.2.push(seq);
                }
            }
        }
    }
    contents
}

/// Spend per limit and local date, by the contract, from the stream.
fn recompute(contents: &StreamContents, catalog: &Catalog) -> BTreeMap<String, LimitTruth> {
    let mut limits: BTreeMap<String, LimitTruth> = catalog
        .limits
        .keys()
        .map(|id| (id.clone(), LimitTruth::default()))
        .collect();
    for (event, _, _) in contents.good.values() {
        for id in &catalog.ads[&event.ad_id] {
            let limit = &catalog.limits[id];
            let spend = limits.get_mut(id).unwrap();
            spend.lifetime_micros += event.cost_micros;
            if limit.period == Period::Daily {
                let zone: Tz = limit.time_zone.parse().unwrap();
                let day = sim::local_date(zone, event.ts).unwrap();
                *spend.daily.entry(sim::day_key(day)).or_default() += event.cost_micros;
            }
        }
    }
    limits
}

fn assert_stream_matches_truth(contents: &StreamContents, truth: &Truth, catalog: &Catalog) {
    let stats = &truth.stats;
    assert_eq!(stats.messages_failed, 0, "{stats:?}");
    assert_eq!(stats.messages_published, stats.messages_acked);
    assert_eq!(contents.messages, stats.messages_acked);
    assert_eq!(contents.lines, stats.events_acked);
    assert_eq!(contents.good.len() as u64, stats.unique_events);
    let bad_acked: BTreeMap<String, u64> = stats
        .bad_events_acked
        .iter()
        .filter(|(_, n)| **n > 0)
        .map(|(k, n)| (k.clone(), *n))
        .collect();
    assert_eq!(contents.bad, bad_acked);
    let expected = recompute(contents, catalog);
    assert_eq!(sim::differences(&expected, &truth.limits), None);
    // `differences` reads a missing limit as zeros: the truth must also
    // list every limit of the catalog.
    assert!(truth.limits.keys().eq(expected.keys()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_run_matches_what_the_stream_holds() {
    let server = nats().await;
    let client = async_nats::connect(server.url()).await.unwrap();
    let catalog = sim::generate_catalog(&CatalogSpec::for_ads(50), 3).unwrap();
    let config = SimConfig {
        events: Some(4000),
        batch: 7,
        duplicate_rate: 0.1,
        bad_rate: 0.05,
        event_time: EventTime::Last(Duration::from_secs(48 * 3600)),
        seed: 11,
        in_flight: 16,
        ..Default::default()
    };
    let truth = sim::run(&client, &config, &catalog, CancellationToken::new())
        .await
        .unwrap();
    let stats = &truth.stats;
    assert_eq!(stats.events_sent, 4000);
    assert_eq!(stats.messages_published, 4000_u64.div_ceil(7));
    let contents = read_stream(&client, &catalog).await;
    assert_stream_matches_truth(&contents, &truth, &catalog);

    // The run exercised what it claims to: duplicates, some in other
    // messages, every bad kind, events on several local days.
    assert!(stats.duplicates_sent > 200, "{stats:?}");
    assert_eq!(
        contents.good.len() as u64 + stats.duplicates_sent + contents.bad.values().sum::<u64>(),
        4000
    );
    assert!(contents
        .good
        .values()
        .any(|(_, _, seqs)| seqs.windows(2).any(|w| w[0] != w[1])));
    for kind in BadKind::ALL {
        assert!(
            contents.bad.get(kind.reason()).is_some_and(|&n| n > 0),
            "{kind} never sent"
        );
        assert_eq!(
            stats.bad_events_sent[kind.reason()],
            stats.bad_events_acked[kind.reason()]
        );
    }
    assert!(truth.limits.values().any(|l| l.daily.len() >= 2));

    // Same seed, another run id: the same events, by other ids, on top.
    let again = SimConfig {
        batch: 1,
        run_id: Some("second".into()),
        ..config.clone()
    };
    let second = sim::run(&client, &again, &catalog, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(second.stats.messages_acked, 4000);
    let both = read_stream(&client, &catalog).await;
    assert_eq!(both.messages, truth.stats.messages_acked + 4000);
    assert_eq!(
        both.good.len() as u64,
        truth.stats.unique_events + second.stats.unique_events
    );
    let second_ids = both.good.keys().filter(|id| id.starts_with("second-"));
    assert_eq!(second_ids.count() as u64, second.stats.unique_events);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_paces_to_the_rate_and_stops_on_cancel() {
    let server = nats().await;
    let client = async_nats::connect(server.url()).await.unwrap();
    let catalog = sim::generate_catalog(&CatalogSpec::for_ads(10), 1).unwrap();

    let paced = SimConfig {
        events: None,
        duration: Some(Duration::from_secs(1)),
        rate: 2000.0,
        batch: 10,
        ..Default::default()
    };
    let truth = sim::run(&client, &paced, &catalog, CancellationToken::new())
        .await
        .unwrap();
    let sent = truth.stats.events_sent;
    // The bucket holds 50 ms of events at most; the lower bound leaves room
    // for a loaded machine.
    assert!(
        (500..=2000 + 100 + 10).contains(&sent),
        "sent {sent} in 1 s at 2000/s"
    );

    let cancel = CancellationToken::new();
    let unbounded = SimConfig {
        events: None,
        rate: 5000.0,
        batch: 1,
        ..Default::default()
    };
    let canceller = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        canceller.cancel();
    });
    let started = Instant::now();
    let cancelled = sim::run(&client, &unbounded, &catalog, cancel)
        .await
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5));
    let stats = &cancelled.stats;
    assert!(stats.events_sent > 0);
    assert_eq!(
        stats.messages_acked + stats.messages_failed,
        stats.messages_published
    );
    let contents = read_stream(&client, &catalog).await;
    assert_eq!(
        contents.messages,
        truth.stats.messages_acked + stats.messages_acked
    );
}

#[tokio::test]
async fn sim_reports_an_unreachable_stream_as_failures_not_truth() {
    let server = nats().await;
    let client = async_nats::connect(server.url()).await.unwrap();
    let catalog = sim::generate_catalog(&CatalogSpec::for_ads(10), 1).unwrap();
    // Without the stream nobody acknowledges: every message fails.
    let config = SimConfig {
        events: Some(50),
        batch: 5,
        create_stream: false,
        ..Default::default()
    };
    let truth = sim::run(&client, &config, &catalog, CancellationToken::new())
        .await
        .unwrap();
    assert_eq!(truth.stats.messages_failed, 10, "{:?}", truth.stats);
    assert_eq!(truth.stats.messages_acked, 0);
    assert_eq!(truth.stats.unique_events, 0);
    assert!(truth
        .limits
        .values()
        .all(|l| l.lifetime_micros == 0 && l.daily.is_empty()));
}
