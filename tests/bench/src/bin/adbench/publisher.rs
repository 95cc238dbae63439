//! The client crate's publisher (`adspend_client::Publisher`) into durable
//! JetStream: impressions/s from the first `publish` to the last ack, and
//! bytes per impression in `IMPRESSIONS`, per batch format. A fresh
//! nats-server (file storage) for each run; the publisher, its impressions'
//! making and NATS share this machine's cores.

use std::time::{Duration, Instant};

use adspend_bench::report::{Table, Target};
use adspend_client::{BatchFormat, Impression, Publisher, PublisherConfig};
use adspend_common::nats::{ensure_impressions, IMPRESSIONS_STREAM};
use adspend_harness::NatsServer;
use async_nats::jetstream;

use crate::{samples, Args};

/// What one run measured.
struct Run {
    per_sec: f64,
    bytes_per_impression: f64,
    messages: u64,
    retries: u64,
}

pub(crate) async fn publisher(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    for format in &args.publisher_formats {
        let format = match format.as_str() {
            "binary" => BatchFormat::Binary,
            "ndjson" => BatchFormat::Ndjson,
            other => anyhow::bail!("--publisher-formats: {other:?} is neither binary nor ndjson"),
        };
        let mut runs = Vec::new();
        for run in 1..=args.runs {
            let r = one_run(args, format).await?;
            println!(
                "bench: publisher {format:?} run {run}: {:.0} impressions/s, {:.1} bytes/impression, {} messages, {} retries",
                r.per_sec, r.bytes_per_impression, r.messages, r.retries
            );
            runs.push(r);
        }
        let name = format!("{format:?}").to_lowercase();
        table.add(
            format!("client publisher into durable NATS ({name})"),
            "impressions/s",
            samples(runs.iter().map(|r| r.per_sec)),
            Some(Target {
                text: ">= 600,000 (the end-to-end figure)",
                bound: 600_000.0,
                higher: true,
            }),
            format!(
                "{} impressions, {} a message; {:.1} bytes/impression in IMPRESSIONS",
                args.publisher_impressions,
                args.publisher_batch,
                runs.iter().map(|r| r.bytes_per_impression).sum::<f64>() / runs.len() as f64
            ),
        );
    }
    Ok(())
}

async fn one_run(args: &Args, format: BatchFormat) -> anyhow::Result<Run> {
    let nats = NatsServer::start().await;
    let client = async_nats::connect(nats.url()).await?;
    let js = jetstream::new(client.clone());
    ensure_impressions(&js, 1).await?;
    let publisher = Publisher::start(
        client,
        PublisherConfig {
            format,
            batch: args.publisher_batch,
            ..PublisherConfig::new("bench")
        },
    );
    let total = args.publisher_impressions;
    let ts_ms = adspend_common::now_ms();
    let started = Instant::now();
    let mut said = Instant::now();
    for n in 0..total {
        let impression = Impression {
            id: format!("bench-{n}"),
            ad_id: format!("ad-{}", n % 20_000),
            cost_micros: 1_000 + n % 5_000,
            ts_ms,
            lease_id: None,
        };
        publisher
            .publish(impression)
            .await
            .map_err(|_| anyhow::anyhow!("the publisher closed early"))?;
        if said.elapsed() >= Duration::from_secs(5) {
            said = Instant::now();
            println!("bench: publisher: {n} of {total} handed over");
        }
    }
    let report = publisher.close().await;
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(
        report.undelivered.is_empty() && report.delivered == total,
        "{} of {total} delivered, {} undelivered",
        report.delivered,
        report.undelivered.len()
    );
    let mut stream = js.get_stream(IMPRESSIONS_STREAM).await?;
    let bytes = stream.info().await?.state.bytes;
    Ok(Run {
        per_sec: total as f64 / secs,
        bytes_per_impression: bytes as f64 / total as f64,
        messages: report.messages,
        retries: report.retries,
    })
}
