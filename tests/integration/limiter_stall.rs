//! No input stalls the limiter: a message of thousands of bad lines, a line
//! whose dead letter would pass the server's max payload, output NATS keeps
//! refusing while it answers, and random input of any size and bytes. Each
//! time the limiter goes on, and the good spend around it stays exact.

use std::time::{Duration, Instant};

use adspend_harness::free_port;
use async_nats::jetstream;
use futures::StreamExt;
use rand::{Rng, SeedableRng};

use crate::poison::{dead_letters, publish_raw};
use crate::support::{assert_exact, metric, sim_config, Backends, Pipeline};

/// The limiter's durable consumers hold nothing unacknowledged or pending;
/// otherwise what they hold, per consumer.
async fn input_all_taken(p: &Pipeline) -> Result<(), Vec<(String, u64, usize)>> {
    let js = jetstream::new(p.client().await);
    let stream = js.get_stream("IMPRESSIONS").await.expect("IMPRESSIONS");
    let names: Vec<String> = stream
        .consumer_names()
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .map(|n| n.expect("consumer name"))
        .collect();
    let mut held = Vec::new();
    for name in names {
        let mut consumer: jetstream::consumer::PullConsumer =
            stream.get_consumer(&name).await.expect("consumer");
        let info = consumer.info().await.expect("consumer info");
        if info.num_pending > 0 || info.num_ack_pending > 0 {
            held.push((name, info.num_pending, info.num_ack_pending));
        }
    }
    if held.is_empty() {
        Ok(())
    } else {
        Err(held)
    }
}

async fn start(ads: u32, limiter_env: &[(&str, &str)]) -> (Pipeline, u16) {
    let mut p = Pipeline::start(Backends::default(), ads).await;
    let limiter_metrics = free_port();
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn_with("limiter", limiter_metrics, limiter_env));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    (p, limiter_metrics)
}

/// Finding: 5,100 invalid lines in one message (about 45 KB) stopped the
/// limiter for every source: the chunk's dead letters, all sent before any
/// acknowledgement was awaited, passed the 5,000 the client allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_of_5100_bad_lines_does_not_stop_the_limiter() {
    let (p, limiter_metrics) = start(50, &[]).await;
    // The limiter makes IMPRESSIONS at its start; the pacer can be healthy
    // before it has.
    adspend_common::nats::ensure_impressions(&jetstream::new(p.client().await), 1)
        .await
        .expect("IMPRESSIONS");
    let bad = "{\"id\":\"x\",\"ad_id\":\n".repeat(5_100).into_bytes();
    let seq = publish_raw(&p, "impressions.attacker", bad).await;
    let truth = p.publish(&sim_config(3_000, 71)).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    let series = "adspend_rejected_total{reason=\"invalid_json\"}";
    assert_eq!(
        metric(limiter_metrics, series).await,
        5_100.0,
        "every line counted"
    );
    let per_message = adspend_wire::dead_letter::PER_MESSAGE as usize;
    let all = dead_letters(&p, "deadletter.>", per_message + 1).await;
    assert!(all.iter().all(|l| l["stream_seq"].as_u64() == Some(seq)));
    let reasons: Vec<&str> = all.iter().map(|l| l["reason"].as_str().unwrap()).collect();
    let summary = all.last().unwrap();
    assert_eq!(
        summary["reason"],
        adspend_wire::dead_letter::SUMMARY_REASON,
        "{reasons:?} {summary}"
    );
    assert_eq!(summary["reason"], adspend_wire::dead_letter::SUMMARY_REASON);
    assert!(
        summary["detail"]
            .as_str()
            .unwrap()
            .contains("5000 more rejected lines"),
        "{summary}"
    );
}

/// Finding: a line of 1.4 MB of NUL bytes became an 8.4 MB dead letter once
/// escaped, over the server's 8 MB max payload, retried forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_line_whose_escaped_dead_letter_passes_the_max_payload_is_cut() {
    let (p, _) = start(50, &[]).await;
    let line = vec![0u8; 1_400_000];
    let seq = publish_raw(&p, "impressions.attacker", line.clone()).await;
    let truth = p.publish(&sim_config(3_000, 72)).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    let letter = &dead_letters(&p, "deadletter.invalid_json", 1).await[0];
    assert_eq!(letter["stream_seq"].as_u64(), Some(seq));
    assert_eq!(letter["truncated"], true);
    assert_eq!(letter["line_bytes"].as_u64(), Some(1_400_000));
    assert_eq!(
        letter["line"].as_str().unwrap().len(),
        adspend_wire::dead_letter::LINE_BYTES
    );
    let hash = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(&line));
    assert_eq!(letter["line_xxh3"].as_str(), Some(hash.as_str()));
}

/// Output NATS keeps refusing while it answers (here one message over the
/// server's max payload, put into one input's output by a failure point):
/// the input message is set aside by its sequence, counted, and the rest of
/// its chunk and everything after it are counted exactly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn input_whose_output_nats_refuses_is_set_aside_and_the_rest_goes_on() {
    let p = Pipeline::start(Backends::default(), 50).await;
    let js = jetstream::new(p.client().await);
    adspend_common::nats::ensure_impressions(&js, 1)
        .await
        .expect("IMPRESSIONS");
    let poisoned = publish_raw(&p, "impressions.poisoned", b"not json at all".to_vec()).await;
    // Good spend before the limiter starts lands in the poisoned message's chunk.
    let mut truth = p.publish(&sim_config(2_000, 73)).await;
    let mut p = p;
    let limiter_metrics = free_port();
    let armed = format!("limiter.oversized_output={poisoned}");
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn_with(
        "limiter",
        limiter_metrics,
        &[("ADSPEND_FAILPOINTS", armed.as_str())],
    ));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    truth.absorb(&p.publish(&sim_config(2_000, 74)).await);
    assert_exact(&p.settle(&truth, Duration::from_secs(90)).await, &truth);
    let record = &dead_letters(&p, "deadletter.set_aside", 1).await[0];
    assert_eq!(record["stream_seq"].as_u64(), Some(poisoned));
    assert_eq!(record["subject"], "impressions.poisoned");
    assert_eq!(record["payload_bytes"].as_u64(), Some(15));
    assert!(
        record["detail"].as_str().unwrap().contains("publish"),
        "{record}"
    );
    assert_eq!(
        metric(limiter_metrics, "adspend_limiter_set_aside_total").await,
        1.0
    );
    let limiter = p.limiter.as_mut().unwrap();
    assert!(limiter.is_running(), "{}", limiter.log_tail(20));
    // Exact comes before the last acknowledgements: they follow the
    // output's publish acks.
    let started = Instant::now();
    while let Err(held) = input_all_taken(&p).await {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "input left unacknowledged (consumer, pending, unacknowledged): {held:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// One random input message: any bytes, any size up to near the server's
/// max payload, any number of lines, JSON that almost fits the contract.
/// Its ad ids are never the catalog's, so it adds no spend.
fn random_input(rng: &mut rand::rngs::StdRng, max_payload: usize) -> Vec<u8> {
    let junk_line = |rng: &mut rand::rngs::StdRng| -> Vec<u8> {
        match rng.random_range(0..6) {
            0 => (0..rng.random_range(0..200))
                .map(|_| rng.random())
                .collect(),
            1 => format!(
                "{{\"id\":\"{}\",\"ad_id\":\"fuzz-{}\",\"cost_micros\":{},\"ts\":{}}}",
                "i".repeat(rng.random_range(0..80)),
                rng.random::<u32>(),
                rng.random::<u64>(),
                rng.random::<i64>()
            )
            .into_bytes(),
            2 => format!(
                "{{\"id\":{},\"ad_id\":null,\"cost_micros\":-{}.5,\"ts\":\"x\"}}",
                rng.random::<u16>(),
                rng.random::<u8>()
            )
            .into_bytes(),
            3 => "\u{fffd}é\u{0}\"\\"
                .repeat(rng.random_range(1..50))
                .into_bytes(),
            4 => b"{\"id\":\"a\",\"ad_id\":\"b\"".to_vec(),
            _ => Vec::new(),
        }
    };
    match rng.random_range(0..80) {
        // A huge single line of one byte (NUL escapes to six).
        0 => vec![
            [0u8, b'"', b'a', 0xff][rng.random_range(0..4)];
            rng.random_range(max_payload / 16..max_payload - 1024)
        ],
        // Very many short lines.
        1..=4 => b"x\n".repeat(rng.random_range(1_000..100_000)),
        // Random bytes.
        5..=9 => (0..rng.random_range(0..65_536))
            .map(|_| rng.random())
            .collect(),
        // A mix of junk lines.
        _ => {
            let lines = rng.random_range(1..1_000);
            let mut out = Vec::new();
            for _ in 0..lines {
                out.extend(junk_line(rng));
                out.push(if rng.random_bool(0.9) { b'\n' } else { b'\r' });
            }
            out
        }
    }
}

/// The limiter's whole chunk path (pull, parse, map, dead letters, publish,
/// ack) against real NATS, fed random input between good spend for a
/// bounded time (`ADSPEND_CHUNK_FUZZ_SECS`, 20 s by default; the seed is
/// printed, `ADSPEND_CHUNK_FUZZ_SEED` repeats a run): the limiter keeps
/// running, takes every message, and the good spend stays exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_chunk_path_takes_random_input_of_any_size_without_stalling() {
    let seconds: u64 = std::env::var("ADSPEND_CHUNK_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let seed: u64 = std::env::var("ADSPEND_CHUNK_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| adspend_common::now_ms() as u64);
    println!("chunk fuzz: seed {seed} (ADSPEND_CHUNK_FUZZ_SEED), {seconds} s");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let (mut p, limiter_metrics) = start(100, &[]).await;
    let max_payload = p.client().await.server_info().max_payload;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut truth = p.publish(&sim_config(500, seed)).await;
    // The extremes first: a line as long as the server takes, and a message
    // of the most lines that fit.
    publish_raw(&p, "impressions.fuzz0", vec![0u8; max_payload - 1024]).await;
    publish_raw(
        &p,
        "impressions.fuzz1",
        b"\n\"\n".repeat(max_payload / 3 - 1024),
    )
    .await;
    let (mut messages, mut bytes, mut round) = (2u64, 2 * max_payload, 0u64);
    while Instant::now() < deadline {
        for _ in 0..rng.random_range(1..6) {
            let input = random_input(&mut rng, max_payload);
            bytes += input.len();
            messages += 1;
            let source = rng.random_range(0..4);
            publish_raw(&p, &format!("impressions.fuzz{source}"), input).await;
        }
        round += 1;
        truth.absorb(&p.publish(&sim_config(200, seed.wrapping_add(round))).await);
    }
    println!("chunk fuzz: {messages} random messages, {bytes} bytes, {round} rounds");
    assert_exact(&p.settle(&truth, Duration::from_secs(120)).await, &truth);
    let limiter = p.limiter.as_mut().unwrap();
    assert!(limiter.is_running(), "{}", limiter.log_tail(30));
    let started = Instant::now();
    while let Err(held) = input_all_taken(&p).await {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "the limiter left random input unacknowledged (consumer, pending, unacknowledged): {held:?}\n{}",
            p.limiter.as_ref().unwrap().log_tail(30)
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    println!(
        "chunk fuzz: every input taken {} ms after the good spend settled",
        started.elapsed().as_millis()
    );
    let set_aside = metric(limiter_metrics, "adspend_limiter_set_aside_total").await;
    assert_eq!(
        set_aside, 0.0,
        "random input is rejected line by line, never set aside whole"
    );
}
