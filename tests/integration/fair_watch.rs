//! A new source's lane opens at the source's first message: the fair
//! scheduler's watch reports it, without waiting for a listing of the
//! stream's subjects. A source that first appears while no limiter runs is
//! found at the next start. Every message is read once.

use std::collections::BTreeMap;
use std::time::Duration;

use adspend_harness::NatsServer;
use adspend_limiter::downstream::{Downstream, Window};
use adspend_limiter::fair::Scheduler;
use adspend_limiter::Config;
use async_nats::jetstream;
use clap::Parser;

/// Long enough that no listing happens during the test: a lane opened
/// after the start was opened by the watch.
const NO_LISTING: Duration = Duration::from_secs(3_600);
/// A bound on the test, not a measurement.
const PATIENCE: Duration = Duration::from_secs(60);

/// Publish `n` messages to `impressions.<source>`; their stream sequences.
async fn publish(js: &jetstream::Context, source: &str, n: usize) -> Vec<u64> {
    let mut seqs = Vec::with_capacity(n);
    for i in 0..n {
        let ack = js
            .publish(
                format!("impressions.{source}"),
                format!("{source} {i}").into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        seqs.push(ack.sequence);
    }
    seqs
}

/// Take chunks until `expected` messages were read; each acknowledged.
/// Returns the stream sequences read, per source, in reading order.
/// A scheduler with no listing and no window: only the watch finds sources.
async fn start(stream: &jetstream::stream::Stream, config: &Config) -> Scheduler {
    Scheduler::start_with_listing(stream, config, NO_LISTING, Downstream::new(16, Window::OFF))
        .await
        .unwrap()
}

async fn read(scheduler: &mut Scheduler, expected: usize) -> BTreeMap<String, Vec<u64>> {
    let mut read: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    let mut count = 0;
    while count < expected {
        let chunk = tokio::time::timeout(PATIENCE, scheduler.next_chunk())
            .await
            .unwrap_or_else(|_| panic!("{count} of {expected} messages read: {read:?}"));
        for message in chunk {
            let message = message.expect("a message");
            let source = message
                .subject
                .trim_start_matches("impressions.")
                .to_string();
            read.entry(source)
                .or_default()
                .push(message.info().unwrap().stream_sequence);
            message.double_ack().await.unwrap();
            count += 1;
        }
    }
    read
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_source_is_read_without_waiting_for_a_listing() {
    let nats = NatsServer::start().await;
    let js = jetstream::new(async_nats::connect(nats.url()).await.unwrap());
    let stream = adspend_common::nats::ensure_impressions(&js, 1)
        .await
        .unwrap();
    let config = Config::parse_from(["limiter", "--consumer=watched"]);

    let early = publish(&js, "early", 5).await;
    let mut scheduler = start(&stream, &config).await;
    assert_eq!(scheduler.sources(), ["early"]);

    // Two sources that appear after the start, and more of the first.
    let late = publish(&js, "late-1", 3).await;
    let later = publish(&js, "late-2", 4).await;
    let more = publish(&js, "early", 2).await;
    let got = read(&mut scheduler, 14).await;
    assert_eq!(scheduler.sources(), ["early", "late-1", "late-2"]);
    assert_eq!(got["early"], [early, more].concat());
    assert_eq!(got["late-1"], late);
    assert_eq!(got["late-2"], later);

    // A source that first appears while the limiter is down is found at
    // the next start; what the first scheduler acknowledged is not read
    // again.
    drop(scheduler);
    let down = publish(&js, "while-down", 3).await;
    let after = publish(&js, "late-1", 1).await;
    let mut scheduler = start(&stream, &config).await;
    assert_eq!(
        scheduler.sources(),
        ["early", "late-1", "late-2", "while-down"]
    );
    let got = read(&mut scheduler, 4).await;
    assert_eq!(got.len(), 2, "{got:?}");
    assert_eq!(got["while-down"], down);
    assert_eq!(got["late-1"], after);

    // And a source new to this scheduler again goes through the watch.
    let newest = publish(&js, "newest", 2).await;
    let got = read(&mut scheduler, 2).await;
    assert_eq!(got["newest"], newest);
    assert_eq!(got.len(), 1, "{got:?}");
}
