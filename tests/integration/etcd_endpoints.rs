//! An etcd endpoint that goes away must not fail a share of every request.
//!
//! The services list every etcd member (`ADSPEND_ETCD_ENDPOINTS`), and the
//! client balances over them. With a member down, its endpoint used to fail
//! each request sent to it while the others served: after an etcd leader
//! kill in the compose cluster about one request in three failed, and a
//! partition start (several etcd calls in a row) looped claim → fail →
//! release for up to minutes. The client now probes each endpoint and
//! takes a dead one out of the balance until it answers again.
//!
//! Here two endpoints reach one real etcd: directly, and through a TCP
//! relay the test can stop (connections refused, as for a killed member).

use std::time::{Duration, Instant};

use adspend_common::config::EtcdArgs;
use adspend_harness::Etcd;
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinSet;

/// Forwards 127.0.0.1:<port> to `target` until dropped; dropping it closes
/// the listener and every relayed connection.
struct Relay {
    port: u16,
    /// Dropped with the relay: aborts the accept loop and its connections.
    _tasks: JoinSet<()>,
}

impl Relay {
    async fn start(target: String, port: u16) -> Relay {
        let listener = TcpListener::bind(("127.0.0.1", port))
            .await
            .expect("bind relay");
        let port = listener.local_addr().unwrap().port();
        let mut tasks = JoinSet::new();
        tasks.spawn(async move {
            let mut conns = JoinSet::new();
            while let Ok((mut inbound, _)) = listener.accept().await {
                let target = target.clone();
                conns.spawn(async move {
                    if let Ok(mut outbound) = TcpStream::connect(&target).await {
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound).await;
                    }
                });
            }
        });
        Relay {
            port,
            _tasks: tasks,
        }
    }
}

/// Sends `n` gets, one each 50 ms; returns how many failed.
async fn failures(client: &mut etcd_client::Client, n: usize) -> usize {
    let mut failed = 0;
    for _ in 0..n {
        let get = tokio::time::timeout(Duration::from_secs(2), client.get("/adspend/probe", None));
        if !matches!(get.await, Ok(Ok(_))) {
            failed += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    failed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_endpoint_leaves_the_balance_and_comes_back() {
    let etcd = Etcd::start().await;
    let direct = etcd.endpoints();
    let target = direct.trim_start_matches("http://").to_owned();
    let relay = Relay::start(target.clone(), 0).await;
    let relay_port = relay.port;
    let endpoints = format!("{direct},http://127.0.0.1:{relay_port}");
    // The prober lives as long as this: the whole test.
    let background = adspend_common::etcd::Background::own();
    let mut client = adspend_common::etcd::connect(&EtcdArgs::plain(endpoints), &background)
        .await
        .expect("connect over both endpoints");
    assert_eq!(failures(&mut client, 20).await, 0, "both endpoints up");

    // The relay goes: its endpoint refuses every connection from now on.
    drop(relay);
    let cut = Instant::now();
    // Give the probes their two failed rounds, then nothing may fail.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let failed = failures(&mut client, 60).await;
    assert_eq!(
        failed,
        0,
        "{failed} of 60 requests failed in the {:.1}s after the first 4s once one of two \
         endpoints went away",
        cut.elapsed().as_secs_f64() - 4.0
    );

    // It comes back on the same port and rejoins the balance: nothing fails.
    let _relay = Relay::start(target, relay_port).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert_eq!(failures(&mut client, 20).await, 0, "relay back");
}

/// A service that starts while one etcd endpoint is down (a member being
/// restarted, a name Docker does not resolve yet) connects through the
/// others: it used to exit at its first status request if that went to
/// the dead endpoint. One endpoint alone still fails at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_starts_while_one_endpoint_is_down() {
    let etcd = Etcd::start().await;
    let closed = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dead = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let endpoints = format!("{dead},{}", etcd.endpoints());
    for attempt in 1..=10 {
        let started = Instant::now();
        adspend_common::etcd::connect(
            &EtcdArgs::plain(endpoints.clone()),
            &adspend_common::etcd::Background::own(),
        )
        .await
        .unwrap_or_else(|e| panic!("connect {attempt} with one dead endpoint of two: {e}"));
        assert!(started.elapsed() < Duration::from_secs(10));
    }
    let alone = adspend_common::etcd::connect(
        &EtcdArgs::plain(dead),
        &adspend_common::etcd::Background::own(),
    )
    .await;
    assert!(alone.is_err(), "a dead endpoint alone connected");
}

/// The endpoint prober (and etcd's status reader) runs on the tracker it
/// is given and ends with its token, as a service's shutdown waits for it; a client of its own
/// (`Background::own`) takes its prober with it when dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_prober_runs_on_the_services_tracker_and_ends_with_it() {
    let etcd = Etcd::start().await;
    let endpoints = format!("{0},{0}", etcd.endpoints());
    let tasks = tokio_util::task::TaskTracker::new();
    let stop = tokio_util::sync::CancellationToken::new();
    let background = adspend_common::etcd::Background::on(&tasks, stop.clone());
    let _client = adspend_common::etcd::connect(&EtcdArgs::plain(endpoints), &background)
        .await
        .expect("connect");
    // The prober, and the reader of etcd's status (one per background).
    assert_eq!(tasks.len(), 2, "the prober is on the tracker");
    let _second = adspend_common::etcd::connect(&EtcdArgs::plain(etcd.endpoints()), &background)
        .await
        .expect("connect");
    assert_eq!(tasks.len(), 2, "one status reader per background");
    stop.cancel();
    tasks.close();
    tokio::time::timeout(Duration::from_secs(5), tasks.wait())
        .await
        .expect("the prober ends with its token");
}
