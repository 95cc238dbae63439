//! `IMPRESSIONS`: acknowledged input goes after `ADSPEND_INPUT_RETENTION_MS`,
//! input not yet acknowledged stays whatever its age, and a byte cap turns a
//! full stream into refused publishes, never lost input.

use std::time::Duration;

use adspend_harness::{free_port, wait_until};
use adspend_sim::Truth;
use async_nats::jetstream;

use super::{holds, messages, state, stream, POLL, SETTLE};
use crate::support::{assert_exact, metric, try_metric, Backends, Pipeline};

/// The retention's window in these tests.
const WINDOW_MS: u64 = 1_500;

fn merged(truths: &[&Truth]) -> Truth {
    let mut merged = Truth::default();
    for truth in truths {
        merged.absorb(truth);
    }
    merged
}

/// The highest ack floor of `IMPRESSIONS`' consumers: nothing past it is
/// acknowledged by all of them.
async fn highest_ack_floor(p: &Pipeline) -> u64 {
    use futures::TryStreamExt;
    let infos: Vec<jetstream::consumer::Info> = stream(p, "IMPRESSIONS")
        .await
        .consumers()
        .try_collect()
        .await
        .expect("consumers");
    infos
        .iter()
        .filter(|i| i.config.durable_name.is_some())
        .map(|i| i.ack_floor.stream_sequence)
        .max()
        .unwrap_or(0)
}

/// A: one message, handled and acknowledged. B: one message whose output
/// is published but whose acknowledgement the limiter holds (a failure
/// point stalls it there). A leaves once older than the window; B stays
/// while older than the window (the oldest message's age, exported every
/// round, says a round ran after it aged), and goes once acknowledged.
async fn acknowledged_input_leaves_and_unacknowledged_stays(scheduling: &str) {
    let mut p = Pipeline::start(Backends::default(), 50).await;
    let js = jetstream::new(p.client().await);
    adspend_common::nats::ensure_impressions(&js, 1)
        .await
        .expect("IMPRESSIONS");
    p.aggregator = Some(p.spawn("aggregator"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let port = free_port();
    let window = WINDOW_MS.to_string();
    p.limiter = Some(p.spawn_with(
        "limiter",
        port,
        &[
            ("ADSPEND_INPUT_RETENTION_MS", &window),
            ("ADSPEND_LIMITER_SCHEDULING", scheduling),
            ("ADSPEND_LIMITER_WORKERS", "1"),
            ("ADSPEND_WORKER_THREADS", "4"),
            // The second chunk (B) waits here, published, not acknowledged.
            ("ADSPEND_FAILPOINTS", "limiter.after_publish@2~40000"),
        ],
    ));
    let a = p.publish(&messages("a", 50, 50, 301)).await;
    assert_eq!(a.stats.messages_acked, 1);
    assert_exact(&p.settle(&a, SETTLE).await, &a);
    let a_seq = state(&p, "IMPRESSIONS").await.1;
    let b = p.publish(&messages("a", 50, 50, 302)).await;
    let b_seq = state(&p, "IMPRESSIONS").await.1;
    assert!(b_seq > a_seq);
    p.limiter
        .as_mut()
        .expect("limiter")
        .wait_for_log("FAILPOINT STALLED", Duration::from_secs(30))
        .await
        .expect("B's chunk held before its acknowledgement");

    wait_until(Duration::from_secs(30), POLL, || holds_not(&p, a_seq))
        .await
        .expect("acknowledged input older than the window was not removed");
    // A round after B aged past twice the window found B the oldest (the
    // limiter's log: its metrics endpoint shares the held runtime).
    let aged = (2 * WINDOW_MS) as f64 / 1000.0;
    let log = p
        .limiter
        .as_ref()
        .expect("limiter")
        .log_path()
        .to_path_buf();
    wait_until(Duration::from_secs(30), POLL, || async {
        oldest_logged(&log) > aged
    })
    .await
    .expect("no retention round reported B older than the window");
    assert!(
        holds(&p, "IMPRESSIONS", b_seq).await,
        "unacknowledged input was removed"
    );
    assert!(
        highest_ack_floor(&p).await < b_seq,
        "B was acknowledged before the check (the stall ended early)"
    );

    // Once the stall ends B is handled, acknowledged, and goes in turn.
    let both = merged(&[&a, &b]);
    assert_exact(&p.settle(&both, SETTLE).await, &both);
    wait_until(Duration::from_secs(60), POLL, || holds_not(&p, b_seq))
        .await
        .expect("B stayed after it was acknowledged and aged");
    let purged = metric(
        port,
        "adspend_limiter_input_purged_messages_total{reason=\"age\"}",
    )
    .await;
    assert!(purged >= 2.0, "purges counted: {purged}");
    println!(
        "retention::input ({scheduling}): A purged after the window, B kept while unacknowledged"
    );
}

/// The largest age of the oldest input any retention round logged.
fn oldest_logged(log: &std::path::Path) -> f64 {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("IMPRESSIONS retention round"))
        .filter_map(|l| {
            let at = l.find("oldest_seconds=")? + "oldest_seconds=".len();
            l[at..].split_whitespace().next()?.parse::<f64>().ok()
        })
        .fold(0.0, f64::max)
}

async fn holds_not(p: &Pipeline, seq: u64) -> bool {
    !holds(p, "IMPRESSIONS", seq).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_input_leaves_after_the_window_unacknowledged_stays_fair() {
    acknowledged_input_leaves_and_unacknowledged_stays("fair").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_input_leaves_after_the_window_unacknowledged_stays_fifo() {
    acknowledged_input_leaves_and_unacknowledged_stays("fifo").await;
}

/// With the limiter stopped, ad servers fill `IMPRESSIONS` to its cap and
/// are then refused (the simulator counts the refusals and leaves their
/// impressions out of the truth); started again, the limiter counts every
/// accepted impression exactly, purges acknowledged input while the cap
/// presses (long before its hour-long retention), and publishers are
/// accepted again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_input_stream_refuses_publishers_and_loses_nothing() {
    const CAP: u64 = 256 * 1024;
    let mut p = Pipeline::start(Backends::default(), 50).await;
    p.aggregator = Some(p.spawn("aggregator"));
    p.pacer = Some(p.spawn("pacer"));
    p.wait_pacer().await;
    let port = free_port();
    let cap = CAP.to_string();
    let mut limiter = p.spawn_with("limiter", port, &[("ADSPEND_INPUT_MAX_BYTES", &cap)]);
    wait_until(Duration::from_secs(30), POLL, || async {
        try_metric(
            port,
            "adspend_limiter_stream_max_bytes{stream=\"IMPRESSIONS\"}",
        )
        .await
        .is_ok_and(|max| max == CAP as f64)
    })
    .await
    .expect("the limiter did not cap IMPRESSIONS");
    limiter
        .terminate(Duration::from_secs(30))
        .expect("limiter stops");

    // About 6.5 kB a message: some 40 fit.
    let mut config = messages("full", 20_000, 50, 303);
    config.in_flight = 16;
    let accepted = p.publish(&config).await;
    assert!(
        accepted.stats.messages_failed > 0 && accepted.stats.messages_acked > 0,
        "publishes accepted {} and refused {}",
        accepted.stats.messages_acked,
        accepted.stats.messages_failed
    );
    let (_, _, bytes) = state(&p, "IMPRESSIONS").await;
    assert!(bytes <= CAP, "{bytes} bytes held under a cap of {CAP}");

    limiter.restart();
    assert_exact(&p.settle(&accepted, SETTLE).await, &accepted);
    wait_until(Duration::from_secs(30), POLL, || async {
        state(&p, "IMPRESSIONS").await.2 * 4 < CAP * 3
    })
    .await
    .expect("acknowledged input still holds the cap");
    let cap_purged = metric(
        port,
        "adspend_limiter_input_purged_messages_total{reason=\"cap\"}",
    )
    .await;
    assert!(cap_purged >= 1.0, "purged under the cap: {cap_purged}");
    let mut config = messages("full", 500, 50, 304);
    config.in_flight = 1;
    let later = p.publish(&config).await;
    assert_eq!(later.stats.messages_failed, 0, "publishes refused again");
    let all = merged(&[&accepted, &later]);
    assert_exact(&p.settle(&all, SETTLE).await, &all);
    println!(
        "retention::cap: {} messages accepted, {} refused at a {CAP}-byte cap, exact; {cap_purged} acknowledged purged under the cap",
        accepted.stats.messages_acked, accepted.stats.messages_failed
    );
    p.limiter = Some(limiter);
}
