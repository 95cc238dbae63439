//! Checks of the simulator itself: the catalog generator, the truth, and a
//! real run against a nats-server whose stream is read back and recomputed
//! independently of the simulator's own bookkeeping.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use adspend_tests::sim::{
    self, BadKind, Catalog, CatalogSpec, EventTime, Impression, Limit, Period, Recorded, SimConfig,
    Truth, TruthBuilder, MAX_ID_BYTES,
};
use async_nats::jetstream;
use chrono::{DateTime, TimeZone, Utc};
use chrono_tz::Tz;
use futures::StreamExt;
use proptest::prelude::*;
use tokio_util::sync::CancellationToken;

// ---------------------------------------------------------------- catalog

/// What the pipeline and the tests rely on, checked without `validate()`.
fn assert_catalog_structure(catalog: &Catalog, spec: &CatalogSpec) {
    let count = |prefix: &str| {
        catalog
            .limits
            .keys()
            .filter(|id| id.starts_with(prefix))
            .count()
    };
    assert_eq!(count("account-"), spec.accounts as usize);
    assert_eq!(count("campaign-"), spec.campaigns as usize);
    assert_eq!(count("adset-"), spec.adsets as usize);
    assert_eq!(catalog.ads.len(), spec.ads as usize);
    for (id, limit) in &catalog.limits {
        assert!((1..=MAX_ID_BYTES).contains(&id.len()), "limit id {id:?}");
        assert!(limit.budget_micros > 0, "{id} has no budget");
        limit
            .time_zone
            .parse::<Tz>()
            .unwrap_or_else(|_| panic!("{id}: bad zone {:?}", limit.time_zone));
        // Parents exist and chains end at an account within three steps,
        // which also rules out cycles.
        let mut chain = vec![id.as_str()];
        while let Some(parent) = &catalog.limits[*chain.last().unwrap()].parent {
            assert!(catalog.limits.contains_key(parent), "{id}: parent {parent}");
            chain.push(parent);
            assert!(chain.len() <= 3, "{id}: parent chain {chain:?}");
        }
        assert!(chain.last().unwrap().starts_with("account-"), "{chain:?}");
    }
    for (ad, limits) in &catalog.ads {
        assert!((1..=MAX_ID_BYTES).contains(&ad.len()), "ad id {ad:?}");
        assert_eq!(limits.len(), 3, "{ad}: {limits:?}");
        for limit in limits {
            assert!(catalog.limits.contains_key(limit), "{ad}: {limit}");
        }
        let [adset, campaign, account] = &limits[..] else {
            unreachable!()
        };
        assert!(adset.starts_with("adset-"), "{ad}: {limits:?}");
        assert_eq!(catalog.limits[adset].parent.as_ref(), Some(campaign));
        assert_eq!(catalog.limits[campaign].parent.as_ref(), Some(account));
        assert_eq!(catalog.limits[account].parent, None);
    }
}

#[test]
fn default_catalog_is_valid_deterministic_and_mixed() {
    let spec = CatalogSpec::for_ads(1000);
    let catalog = sim::generate_catalog(&spec, 42).unwrap();
    catalog.validate().unwrap();
    assert_catalog_structure(&catalog, &spec);
    assert_eq!(catalog, sim::generate_catalog(&spec, 42).unwrap());
    assert_ne!(catalog, sim::generate_catalog(&spec, 43).unwrap());

    let zones: HashSet<&str> = catalog
        .limits
        .values()
        .map(|l| l.time_zone.as_str())
        .collect();
    for zone in [
        "UTC",
        "America/New_York",
        "Europe/Berlin",
        "Asia/Kolkata",
        "Asia/Kathmandu",
        "Australia/Adelaide",
    ] {
        assert!(zones.contains(zone), "{zone} unused: {zones:?}");
    }
    let periods: HashSet<Period> = catalog.limits.values().map(|l| l.period).collect();
    assert_eq!(periods.len(), 2, "periods: {periods:?}");
    // Every ad set has ads: no limit of the generated catalog is unreachable.
    let used: HashSet<&String> = catalog.ads.values().flatten().collect();
    assert_eq!(used.len(), catalog.limits.len());
}

#[test]
fn catalog_json_is_the_contract_document() {
    let catalog = sim::generate_catalog(&CatalogSpec::for_ads(20), 7).unwrap();
    let json = serde_json::to_value(&catalog).unwrap();
    let root = json.as_object().unwrap();
    assert_eq!(root.keys().collect::<Vec<_>>(), ["ads", "limits"]);
    for (id, limit) in json["limits"].as_object().unwrap() {
        let limit = limit.as_object().unwrap();
        assert!(limit["budget_micros"].is_u64(), "{id}");
        assert!(["daily", "lifetime"].contains(&limit["period"].as_str().unwrap()));
        assert!(limit["time_zone"].is_string(), "{id}");
        assert_eq!(limit.contains_key("parent"), !id.starts_with("account-"));
        for key in limit.keys() {
            assert!(
                ["budget_micros", "period", "time_zone", "parent"].contains(&key.as_str()),
                "{id}: unexpected field {key}"
            );
        }
    }
    for (ad, limits) in json["ads"].as_object().unwrap() {
        assert!(
            limits.as_array().unwrap().iter().all(|l| l.is_string()),
            "{ad}"
        );
    }
    // The contract's own example parses, with the zone defaulting to UTC.
    let example: Catalog = serde_json::from_str(
        r#"{"limits": {
              "campaign-1": {"budget_micros": 100000000, "period": "daily", "time_zone": "America/New_York"},
              "adset-7": {"budget_micros": 20000000, "period": "lifetime", "parent": "campaign-1"}},
            "ads": {"ad-1": ["adset-7", "campaign-1"]}}"#,
    )
    .unwrap();
    example.validate().unwrap();
    assert_eq!(example.limits["adset-7"].time_zone, "UTC");
    let back: Catalog = serde_json::from_value(json).unwrap();
    assert_eq!(back, catalog);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn generated_catalogs_are_valid(
        ads in 1u32..300,
        extra_adsets in 0u32..4,
        seed in any::<u64>(),
        custom in any::<bool>(),
    ) {
        let mut spec = CatalogSpec::for_ads(ads);
        if custom {
            // Levels that outnumber the level below leave childless parents.
            spec.adsets += extra_adsets;
            spec.campaigns += extra_adsets;
            spec.accounts += extra_adsets;
        }
        let catalog = sim::generate_catalog(&spec, seed).unwrap();
        prop_assert!(catalog.validate().is_ok());
        assert_catalog_structure(&catalog, &spec);
    }
}

fn limit(budget_micros: u64, period: Period, zone: &str, parent: Option<&str>) -> Limit {
    Limit {
        budget_micros,
        period,
        time_zone: zone.to_owned(),
        parent: parent.map(str::to_owned),
    }
}

/// Turns the valid catalog of the test below into an invalid one.
type Breakage = fn(&mut Catalog);

#[test]
fn validate_rejects_broken_catalogs() {
    let good = || {
        let mut c = Catalog::default();
        c.limits
            .insert("a".into(), limit(1, Period::Daily, "UTC", None));
        c.limits
            .insert("b".into(), limit(1, Period::Lifetime, "UTC", Some("a")));
        c.ads.insert("ad".into(), vec!["b".into(), "a".into()]);
        c
    };
    good().validate().unwrap();
    let broken: [(&str, Breakage); 8] = [
        ("cycle", |c| {
            c.limits.get_mut("a").unwrap().parent = Some("b".into())
        }),
        ("unknown parent", |c| {
            c.limits.get_mut("a").unwrap().parent = Some("z".into())
        }),
        ("zero budget", |c| {
            c.limits.get_mut("a").unwrap().budget_micros = 0
        }),
        ("bad zone", |c| {
            c.limits.get_mut("a").unwrap().time_zone = "Mars/Olympus".into()
        }),
        ("unknown limit", |c| {
            c.ads.get_mut("ad").unwrap().push("z".into())
        }),
        ("limit twice", |c| {
            c.ads.get_mut("ad").unwrap().push("a".into())
        }),
        ("long ad id", |c| drop(c.ads.insert("x".repeat(65), vec![]))),
        ("empty limit id", |c| {
            drop(
                c.limits
                    .insert(String::new(), limit(1, Period::Daily, "UTC", None)),
            )
        }),
    ];
    for (what, breaks) in broken {
        let mut catalog = good();
        breaks(&mut catalog);
        assert!(catalog.validate().is_err(), "{what} accepted");
    }
}

// ---------------------------------------------------------------- truth

fn zoned_catalog() -> Catalog {
    let mut c = Catalog::default();
    let daily = |zone: &str| limit(1_000_000, Period::Daily, zone, None);
    c.limits.insert("ny".into(), daily("America/New_York"));
    c.limits.insert("ktm".into(), daily("Asia/Kathmandu"));
    c.limits.insert("adl".into(), daily("Australia/Adelaide"));
    c.limits.insert("utc".into(), daily("UTC"));
    c.limits.insert(
        "life".into(),
        limit(5, Period::Lifetime, "Asia/Kolkata", None),
    );
    c.ads.insert(
        "ad-all".into(),
        ["ny", "ktm", "adl", "utc", "life"]
            .map(String::from)
            .to_vec(),
    );
    c.ads.insert("ad-ny".into(), vec!["ny".into()]);
    c
}

fn at(rfc3339: &str) -> i64 {
    DateTime::parse_from_rfc3339(rfc3339)
        .unwrap()
        .timestamp_millis()
}

fn impression(id: &str, ad: &str, cost: u64, ts: i64) -> Impression {
    Impression {
        id: id.into(),
        ad_id: ad.into(),
        cost_micros: cost,
        ts,
    }
}

fn daily<'t>(truth: &'t Truth, limit: &str) -> Vec<(&'t str, u64)> {
    truth.limits[limit]
        .daily
        .iter()
        .map(|(d, n)| (d.as_str(), *n))
        .collect()
}

#[test]
fn truth_books_each_impression_once_in_each_limits_local_day() {
    let mut truth = TruthBuilder::new(&zoned_catalog()).unwrap();
    let events = [
        // 01:30 EST in New York, the night clocks go forward.
        impression("e1", "ad-all", 1, at("2026-03-08T06:30:00Z")),
        // 23:59:59.999 EST on the 7th.
        impression("e2", "ad-ny", 10, at("2026-03-08T04:59:59.999Z")),
        // 23:59 EDT on the 8th: the offset changed during the day.
        impression("e3", "ad-ny", 100, at("2026-03-09T03:59:00Z")),
        impression("e4", "ad-ny", 1000, at("2026-03-09T04:00:00Z")),
        // Kathmandu (+05:45) and Adelaide (+10:30 in January) midnights.
        impression("k1", "ad-all", 10_000, at("2026-01-14T18:14:59.999Z")),
        impression("k2", "ad-all", 100_000, at("2026-01-14T18:15:00Z")),
        impression("a1", "ad-all", 1_000_000, at("2026-01-14T13:29:59Z")),
    ];
    for event in &events {
        assert_eq!(truth.record(event).unwrap(), Recorded::Counted, "{event:?}");
    }
    // A verbatim duplicate and a same-id re-send with other values both
    // count once, as the first.
    assert_eq!(truth.record(&events[0]).unwrap(), Recorded::Duplicate);
    let imposter = impression("e1", "ad-ny", 7, at("2026-03-10T12:00:00Z"));
    assert_eq!(truth.record(&imposter).unwrap(), Recorded::Duplicate);
    // Bad ones are not booked.
    let unknown = impression("u1", "ad-missing", 5, at("2026-03-08T06:30:00Z"));
    assert_eq!(
        truth.record(&unknown).unwrap(),
        Recorded::Rejected(BadKind::UnknownAd)
    );
    let long = impression(&"x".repeat(65), "ad-ny", 5, at("2026-03-08T06:30:00Z"));
    assert_eq!(
        truth.record(&long).unwrap(),
        Recorded::Rejected(BadKind::IdTooLong)
    );
    let empty = impression("", "ad-ny", 5, at("2026-03-08T06:30:00Z"));
    assert_eq!(
        truth.record(&empty).unwrap(),
        Recorded::Rejected(BadKind::IdTooLong)
    );
    assert_eq!(truth.unique_events(), 7);

    let truth = truth.finish(Default::default());
    assert_eq!(truth.stats.unique_events, 7);
    assert_eq!(
        daily(&truth, "ny"),
        [
            ("2026-01-14", 1_110_000), // k1, k2, a1 are all on the 14th in New York
            ("2026-03-07", 10),
            ("2026-03-08", 101),
            ("2026-03-09", 1000),
        ]
    );
    assert_eq!(
        daily(&truth, "ktm"),
        [
            ("2026-01-14", 1_010_000),
            ("2026-01-15", 100_000),
            ("2026-03-08", 1)
        ]
    );
    // 13:29:59 UTC is 23:59:59 in Adelaide; the Kathmandu midnights are after
    // Adelaide's, on the 15th.
    assert_eq!(
        daily(&truth, "adl"),
        [
            ("2026-01-14", 1_000_000),
            ("2026-01-15", 110_000),
            ("2026-03-08", 1)
        ]
    );
    assert_eq!(
        daily(&truth, "utc"),
        [("2026-01-14", 1_110_000), ("2026-03-08", 1)]
    );
    assert_eq!(truth.limits["ny"].lifetime_micros, 1_111_111);
    assert_eq!(truth.limits["life"].lifetime_micros, 1_110_001);
    assert!(truth.limits["life"].daily.is_empty());

    let json = serde_json::to_value(&truth).unwrap();
    assert!(json["limits"]["life"].get("daily").is_none(), "{json}");
    assert_eq!(json["limits"]["ny"]["daily"]["2026-03-08"], 101);
    assert_eq!(serde_json::from_value::<Truth>(json).unwrap(), truth);
}

#[test]
fn truth_overflow_is_an_error_and_books_nothing() {
    let mut truth = TruthBuilder::new(&zoned_catalog()).unwrap();
    let ts = at("2026-03-08T06:30:00Z");
    truth
        .record(&impression("a", "ad-all", u64::MAX - 1, ts))
        .unwrap();
    // "life" is listed last: the earlier limits must not have been changed.
    assert!(truth.record(&impression("b", "ad-all", 2, ts)).is_err());
    let truth = truth.finish(Default::default());
    assert_eq!(truth.limits["ny"].lifetime_micros, u64::MAX - 1);
    assert_eq!(truth.stats.unique_events, 1);
}

#[test]
fn option_parsers_accept_documented_forms_and_reject_others() {
    assert_eq!(sim::parse_duration("250ms"), Ok(Duration::from_millis(250)));
    assert_eq!(sim::parse_duration("1.5"), Ok(Duration::from_millis(1500)));
    assert_eq!(sim::parse_duration("2h"), Ok(Duration::from_secs(7200)));
    assert!(sim::parse_duration("2 weeks").is_err());
    assert_eq!(
        "100..=5_000_000".parse(),
        Ok(sim::CostDistribution::Uniform {
            min: 100,
            max: 5_000_000
        })
    );
    assert_eq!(
        "log-uniform:1..=9".parse(),
        Ok(sim::CostDistribution::LogUniform { min: 1, max: 9 })
    );
    assert!("9..=1".parse::<sim::CostDistribution>().is_err());
    assert!("log-uniform:0..=9"
        .parse::<sim::CostDistribution>()
        .is_err());
    assert_eq!(
        "last:36h".parse(),
        Ok(EventTime::Last(Duration::from_secs(36 * 3600)))
    );
    assert_eq!(
        "range:2026-03-08T00:00:00Z..1772985600001".parse(),
        Ok(EventTime::Range {
            start_ms: 1_772_928_000_000,
            end_ms: 1_772_985_600_001
        })
    );
    assert!("range:5..5".parse::<EventTime>().is_err());
    for kind in BadKind::ALL {
        assert_eq!(kind.reason().parse(), Ok(kind));
    }
    assert!("garbage".parse::<BadKind>().is_err());

    let bad_configs = [
        SimConfig {
            subject: "other.subject".into(),
            ..Default::default()
        },
        SimConfig {
            subject: "impressions.>".into(),
            ..Default::default()
        },
        SimConfig {
            duplicate_rate: 1.5,
            ..Default::default()
        },
        SimConfig {
            batch: 0,
            ..Default::default()
        },
        SimConfig {
            run_id: Some("has space".into()),
            ..Default::default()
        },
        SimConfig {
            run_id: Some("r".repeat(41)),
            ..Default::default()
        },
    ];
    SimConfig::default().validate().unwrap();
    for config in bad_configs {
        assert!(config.validate().is_err(), "{config:?}");
    }
}

// ---------------------------------------------------------------- NATS

/// A nats-server with JetStream on a free port, killed on drop.
struct NatsServer {
    child: Child,
    url: String,
    _store: tempfile::TempDir,
}

impl NatsServer {
    async fn start() -> Self {
        let binary = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/bin/nats-server");
        assert!(
            binary.exists(),
            "{} is missing: run `bash scripts/install-deps.sh test`",
            binary.display()
        );
        let store = tempfile::tempdir().unwrap();
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let child = Command::new(&binary)
            .args(["-js", "-a", "127.0.0.1", "-p", &port.to_string(), "-sd"])
            .arg(store.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let server = Self {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            _store: store,
        };
        let deadline = Instant::now() + Duration::from_secs(20);
        while async_nats::connect(&server.url).await.is_err() {
            assert!(
                Instant::now() < deadline,
                "nats-server did not start on {port}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        server
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
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

/// Limit → (lifetime spend, local date → spend).
type Spend = BTreeMap<String, (u64, BTreeMap<String, u64>)>;

/// Spend per limit and local date, by the contract, from the stream.
fn recompute(contents: &StreamContents, catalog: &Catalog) -> Spend {
    let mut limits: Spend = catalog
        .limits
        .keys()
        .map(|id| (id.clone(), Default::default()))
        .collect();
    for (event, _, _) in contents.good.values() {
        for id in &catalog.ads[&event.ad_id] {
            let limit = &catalog.limits[id];
            let (lifetime, daily) = limits.get_mut(id).unwrap();
            *lifetime += event.cost_micros;
            if limit.period == Period::Daily {
                let zone: Tz = limit.time_zone.parse().unwrap();
                let local = Utc
                    .timestamp_millis_opt(event.ts)
                    .unwrap()
                    .with_timezone(&zone);
                *daily
                    .entry(local.format("%Y-%m-%d").to_string())
                    .or_default() += event.cost_micros;
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
    let actual: Spend = truth
        .limits
        .iter()
        .map(|(id, l)| (id.clone(), (l.lifetime_micros, l.daily.clone())))
        .collect();
    assert_eq!(actual, expected);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sim_run_matches_what_the_stream_holds() {
    let server = NatsServer::start().await;
    let client = async_nats::connect(&server.url).await.unwrap();
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
    let server = NatsServer::start().await;
    let client = async_nats::connect(&server.url).await.unwrap();
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
    let server = NatsServer::start().await;
    let client = async_nats::connect(&server.url).await.unwrap();
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
