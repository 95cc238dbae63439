//! One server in lease mode against a stand-in pacer on a local socket:
//! what it sends is the contract's request, and what it serves stays
//! within the grants. The stand-in speaks just enough HTTP/1.1 for
//! reqwest: one request at a time per connection, bodies by length.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

use super::*;
use crate::loop_publish::Served;
use crate::{generate_catalog, CatalogSpec};

const UNIT: u64 = 1_000_000;
/// What the stand-in grants per ad over a run.
const BUDGET_PER_AD: u64 = 10 * UNIT;

/// What the stand-in pacer saw and granted.
#[derive(Default)]
struct Pacer {
    /// (path, authorization header, body) of every request.
    requests: Vec<(String, Option<String>, serde_json::Value)>,
    /// Lease id → (granted micros, expires_at_ms).
    grants: HashMap<String, (u64, i64)>,
    left: HashMap<String, u64>,
    /// Lease id → served micros, as released.
    released: HashMap<String, u64>,
    /// Answer this status with an error body instead of grants.
    fail_with: Option<u16>,
    /// Grant one micro more than asked (breaking the contract).
    over_grant: bool,
}

impl Pacer {
    /// `POST /v1/leases/release`: each lease one this stand-in granted,
    /// released once, never said to have served more than its grant.
    fn release(&mut self, body: &serde_json::Value) -> serde_json::Value {
        let answers = body["leases"]
            .as_array()
            .expect("leases")
            .iter()
            .map(|r| {
                let id = r["lease_id"].as_str().expect("lease_id").to_owned();
                let served = r["served_micros"].as_u64().expect("served_micros");
                assert!(served <= self.grants[&id].0, "{r}");
                assert!(self.released.insert(id.clone(), served).is_none(), "{r}");
                serde_json::json!({"lease_id": id, "released": true, "held_micros": 0})
            })
            .collect::<Vec<_>>();
        serde_json::json!({ "leases": answers })
    }

    fn answer(&mut self, body: &serde_json::Value) -> serde_json::Value {
        let ttl = body["ttl_ms"].as_i64().expect("ttl_ms");
        let expires_at_ms = unix_ms() + ttl;
        let leases = body["ads"]
            .as_array()
            .expect("ads")
            .iter()
            .map(|ask| {
                let ad = ask["ad_id"].as_str().expect("ad_id").to_owned();
                let micros = ask["micros"].as_u64().expect("micros");
                let left = self.left.entry(ad.clone()).or_insert(BUDGET_PER_AD);
                let granted = micros.min(*left);
                *left -= granted;
                let granted = granted + u64::from(self.over_grant);
                if granted == 0 {
                    return serde_json::json!({
                        "ad_id": ad, "granted_micros": 0, "expires_at_ms": expires_at_ms
                    });
                }
                let id = format!("lease-{}", self.grants.len());
                self.grants.insert(id.clone(), (granted, expires_at_ms));
                serde_json::json!({
                    "ad_id": ad, "lease_id": id, "granted_micros": granted,
                    "expires_at_ms": expires_at_ms
                })
            })
            .collect::<Vec<_>>();
        serde_json::json!({ "leases": leases })
    }
}

async fn serve_connection(mut stream: TcpStream, pacer: Arc<Mutex<Pacer>>) {
    let mut buf = Vec::new();
    loop {
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i + 4;
            }
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        };
        let head = String::from_utf8_lossy(&buf[..head_end]).into_owned();
        let header = |name: &str| {
            head.lines().find_map(|l| {
                let (k, v) = l.split_once(':')?;
                k.eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
            })
        };
        let length: usize = header("content-length").map_or(0, |v| v.parse().unwrap());
        while buf.len() < head_end + length {
            let mut chunk = [0u8; 4096];
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        let body: serde_json::Value =
            serde_json::from_slice(&buf[head_end..head_end + length]).expect("JSON body");
        buf.drain(..head_end + length);
        let path = head.split_whitespace().nth(1).unwrap_or("").to_owned();
        let (status, answer) = {
            let mut p = pacer.lock().unwrap();
            p.requests
                .push((path.clone(), header("authorization"), body.clone()));
            match p.fail_with {
                Some(status) => (status, serde_json::json!({"error": "unavailable"})),
                None if path == "/v1/leases/release" => (200, p.release(&body)),
                None => (200, p.answer(&body)),
            }
        };
        let answer = answer.to_string();
        let response = format!(
            "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{answer}",
            answer.len()
        );
        if stream.write_all(response.as_bytes()).await.is_err() {
            return;
        }
    }
}

/// Starts the stand-in; returns its base URL.
async fn stand_in(pacer: Arc<Mutex<Pacer>>) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve_connection(stream, pacer.clone()));
        }
    });
    url
}

/// Renewed two of the test's 20 ms ticks ahead.
const MODE: LeaseMode = LeaseMode {
    policy: adspend_client::LeasePolicy {
        ttl: Duration::from_millis(1_000),
        margin: Duration::from_millis(300),
        ask_share: 0.5,
        lead: Duration::from_millis(40),
    },
    release: true,
};

/// One server in lease mode for `run_for` against `pacer`; what it served
/// and the counters.
async fn run_server(
    pacer: Arc<Mutex<Pacer>>,
    run_for: Duration,
) -> (Vec<Served>, Arc<Counters>, Arc<CatalogIndex>) {
    let catalog = generate_catalog(&CatalogSpec::for_ads(20), 3).unwrap();
    let index = Arc::new(CatalogIndex::new(&catalog).unwrap());
    let config = LoopConfig {
        pacer_url: stand_in(pacer).await,
        pacer_token: Some("decide-token".into()),
        servers: 1,
        peak_rate: 400.0,
        decision_batch: 8,
        tick: Duration::from_millis(20),
        traffic: crate::closed_loop::Traffic::Flat,
        cost: CostDistribution::Uniform {
            min: UNIT / 2,
            max: UNIT,
        },
        mode: ServeMode::Leases(MODE),
        ..LoopConfig::default()
    };
    config.validate().unwrap();
    let counters = Arc::new(Counters::default());
    let (tx, mut rx) = mpsc::unbounded_channel();
    let http = reqwest::Client::builder().no_proxy().build().unwrap();
    let server = Server::new(0, &config, &index, http, counters.clone(), tx).unwrap();
    let stop = CancellationToken::new();
    let task = tokio::spawn(server.run(Instant::now(), stop.clone()));
    tokio::time::sleep(run_for).await;
    stop.cancel();
    task.await.unwrap();
    let mut served = Vec::new();
    while let Ok(s) = rx.try_recv() {
        served.push(s);
    }
    (served, counters, index)
}

#[tokio::test]
async fn a_leasing_server_asks_as_the_contract_says_and_serves_only_within_its_grants() {
    let pacer = Arc::new(Mutex::new(Pacer::default()));
    let (served, counters, index) = run_server(pacer.clone(), Duration::from_millis(2_500)).await;
    let p = pacer.lock().unwrap();
    assert!(!p.requests.is_empty());
    let mut lease_calls = 0;
    for (path, auth, body) in &p.requests {
        assert_eq!(auth.as_deref(), Some("Bearer decide-token"));
        if path == "/v1/leases/release" {
            let fields: Vec<&String> = body.as_object().unwrap().keys().collect();
            assert_eq!(fields, ["leases"], "{body}");
            let n = body["leases"].as_array().unwrap().len();
            assert!((1..=8).contains(&n), "{body}");
            continue;
        }
        assert_eq!(path, "/v1/leases");
        lease_calls += 1;
        let fields: Vec<&str> = body
            .as_object()
            .unwrap()
            .keys()
            .map(|k| k.as_str())
            .collect();
        assert_eq!(fields, ["ads", "ttl_ms"], "{body}");
        assert_eq!(body["ttl_ms"], 1_000);
        let ads = body["ads"].as_array().unwrap();
        assert!((1..=8).contains(&ads.len()), "{body}");
        for ask in ads {
            assert_eq!(ask.as_object().unwrap().len(), 2, "{ask}");
            assert!(index.ad_by_id.contains_key(ask["ad_id"].as_str().unwrap()));
            assert!(
                ask["micros"].as_u64().unwrap() >= UNIT,
                "at least the highest cost"
            );
        }
    }
    // Every impression under a lease, within its grant, before its expiry
    // less the margin.
    let mut spent: HashMap<String, u64> = HashMap::new();
    for s in &served {
        let lease = s.lease.as_deref().expect("a lease id on every impression");
        let (granted, expires) = p.grants[lease];
        assert!(
            s.ts < expires - 300,
            "served at {} under {lease} expiring {expires}",
            s.ts
        );
        let total = spent.entry(lease.to_owned()).or_default();
        *total += s.cost;
        assert!(*total <= granted, "{total} of {granted}");
    }
    // Leases let go with something left were released, each saying what
    // was served under it, all of it.
    assert!(!p.released.is_empty(), "no lease released");
    for (lease, &said) in &p.released {
        let served = spent.get(lease).copied().unwrap_or(0);
        assert_eq!(said, served, "{lease}");
        assert!(
            said < p.grants[lease].0,
            "{lease} released with nothing left"
        );
    }
    let c = counters.progress(Duration::ZERO, &LoopConfig::default());
    eprintln!("{:?}", c.leases);
    assert_eq!(c.served, served.len() as u64);
    assert_eq!(c.leases.calls, lease_calls);
    assert_eq!(c.leases.released as usize, p.released.len());
    assert_eq!(
        c.leases.release_calls as usize,
        p.requests.len() - lease_calls as usize
    );
    assert_eq!(c.leases.granted as usize, p.grants.len());
    assert_eq!(
        c.leases.micros_granted,
        p.grants.values().map(|g| g.0).sum::<u64>()
    );
    // The budgets run out within the run: zero grants, refusals, and
    // leases asked again after running low or expiring (more than one
    // grant for some ad).
    assert!(c.leases.zero > 0 && c.leases.refused > 0, "{:?}", c.leases);
    assert!(
        p.grants.len() > index.ad_ids.len(),
        "{} grants",
        p.grants.len()
    );
    assert_eq!(c.leases.errors, 0);
}

#[tokio::test]
async fn a_server_that_cannot_lease_serves_nothing_and_backs_off() {
    let pacer = Arc::new(Mutex::new(Pacer {
        fail_with: Some(503),
        ..Pacer::default()
    }));
    let (served, counters, _) = run_server(pacer.clone(), Duration::from_millis(1_000)).await;
    assert!(served.is_empty());
    let c = counters.progress(Duration::ZERO, &LoopConfig::default());
    assert!(c.leases.errors > 0 && c.requests > 0);
    assert_eq!(c.leases.errors, c.leases.calls);
    assert_eq!(counters.unasked.load(Relaxed), c.requests);
    // Backing off: 200, 400, 800 ms after the first failures, not a call
    // every 20 ms tick.
    assert!(c.leases.calls <= 5, "{} calls in a second", c.leases.calls);
}

#[tokio::test]
async fn a_server_uses_nothing_of_an_answer_that_breaks_the_contract() {
    let pacer = Arc::new(Mutex::new(Pacer {
        over_grant: true,
        ..Pacer::default()
    }));
    let (served, counters, _) = run_server(pacer.clone(), Duration::from_millis(1_000)).await;
    let p = pacer.lock().unwrap();
    assert!(!p.grants.is_empty(), "the stand-in granted");
    // Every grant is one micro above its ask: none is installed, nothing is
    // served, and nothing is released (the server holds no lease).
    assert!(served.is_empty());
    let c = counters.progress(Duration::ZERO, &LoopConfig::default());
    assert!(c.leases.calls > 0 && c.requests > 0);
    assert_eq!(c.leases.errors, c.leases.calls);
    assert_eq!((c.leases.granted, c.leases.release_calls), (0, 0));
    assert_eq!(counters.unasked.load(Relaxed), c.requests);
}
