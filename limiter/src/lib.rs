//! The limiter: `IMPRESSIONS` → spend tuples on `SPEND`.
//!
//! [`run`] pulls input from a durable JetStream consumer in chunks and hands
//! each on (`pipeline`): to a thread of its own ([`chunk::Mapping`], up to
//! `ADSPEND_LIMITER_WORKERS` at once; with one, the loop itself), where
//! [`emit`] parses each NDJSON line (`adspend_wire::impression`), maps the
//! ad to its limits through the catalog, groups the tuples by partition and
//! encodes them, and turns the lines it rejects into dead letters
//! (`adspend_wire::dead_letter`). The mapped chunks are published in the
//! order they were read: a chunk's output
//! (spend batches and dead letters) is published and acknowledged by
//! JetStream before its input is acknowledged. A timer injects a checkpoint
//! marker into every partition through the same ordered queue, so markers
//! are ordered with the batches around them, as does a timer that sends the
//! pacers a [`report`] of how the input is shared among its sources.

pub mod chunk;
mod config;
pub mod downstream;
pub mod emit;
mod error;
pub mod fair;
mod nats_store;
mod pipeline;
mod publish;
mod report;
mod retention;
mod set_aside;
pub mod telemetry;

use std::time::Duration;

use adspend_common::nats;
use adspend_common::service::{self, Context, Service};
use async_nats::jetstream;

use chunk::{Limiter, Mapping};
pub use config::{Config, Validated};
use downstream::Downstream;
pub use error::Error;
use pipeline::{Held, Sink, Step};
use publish::Publisher;

impl Service for Validated {
    const NAME: &'static str = "limiter";
    const HISTOGRAMS: adspend_common::telemetry::Histograms = &[];
    type Config = Config;
    type Listeners = ();
    type Error = Error;

    fn validate(config: Config) -> Result<Self, Error> {
        Ok(config.validate()?)
    }

    fn metrics_addr(&self) -> std::net::SocketAddr {
        self.metrics_addr
    }

    async fn bind(&self) -> Result<(), Error> {
        Ok(())
    }

    async fn run(self, _: (), context: Context) -> Result<(), Error> {
        run(self, context).await
    }
}

impl service::Failure for Error {
    fn common(&self) -> Option<&adspend_common::Error> {
        match self {
            Error::Common(e) => Some(e),
            _ => None,
        }
    }
}

/// Run until `context.shutdown`; on shutdown the chunk in hand is finished
/// first.
pub async fn run(validated: Validated, context: Context) -> Result<(), Error> {
    let Validated {
        config,
        catalog: catalog_source,
        ..
    } = validated;
    let Context { shutdown, tasks } = context;
    adspend_common::telemetry::describe(telemetry::DESCRIPTIONS, &[]);
    let catalog = catalog_source
        .clone()
        .watch(shutdown.clone(), &tasks)
        .await?;
    let client = nats::connect(&config.nats, "adspend-limiter").await?;
    let js = jetstream::new(client.clone());
    let replicas = config.streams.replicas();
    let input_limits = nats::InputLimits::from_args(&config.retention);
    let impressions = nats::ensure_impressions_with(&js, replicas, &input_limits).await?;
    nats::ensure_spend(&js, replicas).await?;
    let deadletter_limits = nats::DeadletterLimits::from_args(&config.retention);
    nats::ensure_deadletter_with(&js, replicas, &deadletter_limits).await?;
    nats_store::watch(js.clone(), &tasks, shutdown.clone());
    retention::start(
        retention::Settings {
            nats: config.nats.clone(),
            replicas,
            prefix: config.consumer.clone(),
            token: config.source_token as usize,
            args: config.retention.clone(),
        },
        &tasks,
        shutdown.clone(),
    );

    // FIFO scheduling holds nobody back: nothing to count.
    let fair = config.scheduling == config::Scheduling::Fair;
    let bound = if fair {
        config.downstream_max_tuples
    } else {
        0
    };
    let downstream = Downstream::new(
        config.partitions.partitions,
        downstream::Window {
            bound,
            target: (config.downstream_target_ms > 0)
                .then(|| Duration::from_millis(config.downstream_target_ms)),
        },
    );
    if bound > 0 {
        downstream.follow(&client, &tasks, shutdown.clone()).await?;
    }
    let mut input = fair::Input::open(&impressions, &config, downstream.clone()).await?;

    tracing::info!(
        catalog = catalog_source.describe(),
        partitions = config.partitions.partitions,
        scheduling = ?config.scheduling,
        checkpoint_interval_ms = config.checkpoint_interval_ms,
        "limiter running"
    );
    let max_payload = client.server_info().max_payload;
    let mapping = Mapping {
        catalog,
        partitions: config.partitions.partitions,
        tuples_per_message: chunk::tuples_per_message(config.tuples_per_message, max_payload),
        max_cost_micros: config.max_cost_micros,
        max_payload,
    };
    let limiter = Limiter {
        publisher: Publisher::new(js, shutdown.clone()),
        mapping: mapping.clone(),
        downstream: downstream.clone(),
    };
    let workers = config.workers();
    let (mut sink, publishing) = Sink::new(workers, limiter, &tasks);
    let mut markers = tokio::time::interval(config.checkpoint_interval());
    markers.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    markers.tick().await;
    let mut reporter = report::Reporter::new(&config.consumer, config.scheduling);
    let mut reports = tokio::time::interval(report::REPORT_EVERY);
    reports.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tracing::info!(workers, "limiter mapping");
    // What was read and waits for room in the sink: while the publisher is
    // behind, further input joins it (up to one chunk's bound), so the
    // output goes in fewer, fuller messages rather than queueing up in
    // small ones.
    let mut held = Held::new(config.max_batch as usize);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = markers.tick() => {
                // Markers follow every tuple read before them.
                if let Some((chunk, bytes)) = held.take() {
                    let step = Step::Chunk(sink.map(&mapping, chunk), bytes);
                    if !sink.put(step, &shutdown).await {
                        break;
                    }
                }
                if !sink.put(Step::Markers, &shutdown).await {
                    break;
                }
            }
            _ = reports.tick() => reporter.send(&client, input.report()).await,
            room = sink.room(), if !held.is_empty() => {
                let (Ok(room), Some((chunk, bytes))) = (room, held.take()) else {
                    break;
                };
                sink.hand_on(room, &mapping, chunk, bytes).await;
            }
            chunk = input.next(), if held.has_room() => match chunk {
                Some(chunk) => {
                    let bytes: u64 = chunk
                        .iter()
                        .flatten()
                        .map(|m| m.payload.len() as u64)
                        .sum();
                    downstream.dispatched(bytes);
                    held.add(chunk, bytes);
                }
                None => {
                    tracing::warn!("impressions consumer ended");
                    break;
                }
            },
        }
    }
    // What is held or queued is abandoned by the publisher (shutdown) and
    // redelivered to the next limiter, as a chunk in hand would be.
    drop(sink);
    if let Some(publishing) = publishing {
        let _ = publishing.await;
    }
    tracing::info!("limiter stopped");
    Ok(())
}
