//! The client crate's example bidder (`client/examples/adserver.rs`) against
//! the real pipeline: it bids only within its leases, publishes what it
//! serves, and at Ctrl-C releases the rest and flushes; the pacer's spend
//! then equals what it said it served.

use std::time::Duration;

use adspend_harness::{free_port, service_binary, wait_until_ok, ServiceProcess, Signal};
use serde_json::Value;

use crate::leases::{spawn_pacer, start, wait_field, wait_healthy, FIRST_SPEND};

async fn bid(http: &reqwest::Client, addr: &str, ad: &str, cost: u64) -> anyhow::Result<Value> {
    Ok(http
        .post(format!("http://{addr}/bid"))
        .json(&serde_json::json!({"ad_id": ad, "cost_micros": cost}))
        .send()
        .await?
        .error_for_status()?
        .json()
        .await?)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_example_bidder_serves_within_leases_and_the_pacer_counts_it() {
    let mut p = start().await;
    let pacer = spawn_pacer(&p, &[]);
    wait_healthy(&pacer.addr).await;
    wait_field(&pacer.addr, "camp-a", "spend_micros", FIRST_SPEND).await;

    let example = service_binary("limiter")
        .parent()
        .expect("a target directory")
        .join("examples/adserver");
    assert!(
        example.is_file(),
        "{} is not built: run `cargo build --workspace --bins --examples` (scripts/test.sh does)",
        example.display()
    );
    let addr = format!("127.0.0.1:{}", free_port());
    let nats_url = p.nats.url();
    let pacer_url = format!("http://{}", pacer.addr);
    let mut bidder = ServiceProcess::builder_at(&example)
        .env("ADSPEND_NATS_URL", &nats_url)
        .env("ADSPEND_PACER_URL", &pacer_url)
        .env("ADSERVER_ADDR", &addr)
        .env("ADSERVER_SOURCE", "example")
        .env("RUST_LOG", "info")
        .log_file(p.dir.path().join("adserver.log"))
        .spawn();
    bidder
        .wait_for_log("bidding on", Duration::from_secs(30))
        .await
        .expect("the example starts");

    // The first bids are refused (nothing leased yet) and ask for a lease;
    // within a few renewals the bidder serves.
    let http = reqwest::Client::new();
    const COST: u64 = 1_500;
    let mut served = 0u64;
    let mut refused = 0u64;
    wait_until_ok(Duration::from_secs(30), Duration::from_millis(20), || {
        let http = http.clone();
        let addr = addr.clone();
        async move {
            let answer = bid(&http, &addr, "a-1", COST).await?;
            anyhow::ensure!(answer["bid"] == true, "refused: {answer}");
            Ok(())
        }
    })
    .await
    .expect("a bid within a lease");
    for _ in 0..200 {
        let answer = bid(&http, &addr, "b-1", COST).await.expect("an answer");
        match answer["bid"].as_bool() {
            Some(true) => {
                assert!(answer["lease_id"].is_string(), "{answer}");
                served += 1;
            }
            _ => refused += 1,
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let stats: Value = http
        .get(format!("http://{addr}/stats"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let said = stats["served_micros"].as_u64().expect("served_micros");
    assert!(served > 0, "nothing served on b-1 ({refused} refused)");

    bidder.signal(Signal::SIGINT).unwrap();
    let status = bidder
        .wait_for_exit(Duration::from_secs(30))
        .await
        .expect("the example stops at Ctrl-C");
    assert!(status.success(), "{}", bidder.log_tail(20));
    let tail = bidder.log_tail(5);
    assert!(tail.contains("0 undelivered"), "{tail}");

    // What it served (every bid that said so, a-1's and b-1's) is what the
    // pacer counts on the two campaigns beyond their first spend.
    let a = said - served * COST;
    wait_field(
        &pacer.addr,
        "camp-a",
        "lifetime_spend_micros",
        FIRST_SPEND + a,
    )
    .await;
    wait_field(
        &pacer.addr,
        "camp-b",
        "lifetime_spend_micros",
        FIRST_SPEND + served * COST,
    )
    .await;
    println!("client_example: {served} served on b-1 ({refused} refused), {a} micros on a-1");
    p.pacer = Some(pacer.process);
}
