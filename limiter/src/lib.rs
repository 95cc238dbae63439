//! The limiter: `IMPRESSIONS` → spend tuples on `SPEND`.
//!
//! [`run`] pulls input from a durable JetStream consumer in chunks; [`emit`]
//! parses each NDJSON line ([`validate`]), maps the ad to its limits through
//! the catalog and groups the tuples by partition; the chunk's output (spend
//! batches and dead letters) is published and acknowledged by JetStream before
//! the input is acknowledged. A timer injects a checkpoint marker into every
//! partition; it runs in the same loop, so markers are ordered with the
//! batches around them, as does a timer that sends the pacers a [`report`]
//! of how the input is shared among its sources.

mod chunk;
pub mod config;
pub mod dead_letter;
pub mod downstream;
pub mod emit;
pub mod error;
pub mod fair;
mod nats_store;
pub mod publish;
pub mod report;
mod set_aside;
pub(crate) mod telemetry;
pub mod validate;

use std::time::Duration;

use adspend_common::nats;
use adspend_common::service::{self, Context, Service};
use async_nats::jetstream;

use chunk::Limiter;
pub use config::{Config, Validated};
use downstream::Downstream;
pub use error::Error;
use publish::Publisher;

impl Service for Validated {
    const NAME: &'static str = "limiter";
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
    adspend_common::telemetry::describe(telemetry::DESCRIPTIONS);
    let catalog = catalog_source
        .clone()
        .watch(shutdown.clone(), &tasks)
        .await?;
    let client = nats::connect(&config.nats, "adspend-limiter").await?;
    let js = jetstream::new(client.clone());
    let replicas = config.streams.replicas();
    let impressions = nats::ensure_impressions(&js, replicas).await?;
    nats::ensure_spend(&js, replicas).await?;
    nats::ensure_deadletter(&js, replicas).await?;
    nats_store::watch(js.clone(), &tasks, shutdown.clone());

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
    let mut limiter = Limiter {
        publisher: Publisher::new(js, shutdown.clone()),
        catalog,
        partitions: config.partitions.partitions,
        tuples_per_message: chunk::tuples_per_message(config.tuples_per_message, max_payload),
        max_cost_micros: config.max_cost_micros,
        downstream,
        max_payload,
    };
    let mut markers = tokio::time::interval(config.checkpoint_interval());
    markers.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    markers.tick().await;
    let mut reporter = report::Reporter::new(&config.consumer, config.scheduling);
    let mut reports = tokio::time::interval(report::REPORT_EVERY);
    reports.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = shutdown.cancelled() => break,
            _ = markers.tick() => limiter.publish_markers().await,
            _ = reports.tick() => reporter.send(&client, input.report()).await,
            chunk = input.next() => match chunk {
                Some(chunk) => limiter.handle_chunk(chunk).await,
                None => {
                    tracing::warn!("impressions consumer ended");
                    break;
                }
            },
        }
    }
    tracing::info!("limiter stopped");
    Ok(())
}
