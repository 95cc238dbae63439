//! Simulator traffic through the cluster, and the exactness check at the end.

use std::time::Duration;

use anyhow::{ensure, Context};
use async_nats::jetstream;
use tokio_util::sync::CancellationToken;

use super::compose::nats_args;
use super::compose::{pacer, pacer_client};
use adspend_sim::check::{wait_for_match_with, Comparison};
use adspend_sim::stream_truth::truth_from_stream;
use adspend_sim::{self as sim, Catalog, SimConfig, Truth};

/// nats1's client port as the compose file publishes it (TLS, users).
pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A client of the cluster's NATS as `role`, over TLS with the role's
/// generated password (deploy/.secrets/<role>.env).
pub async fn connect_as(role: &str) -> anyhow::Result<async_nats::Client> {
    let args = nats_args(role)?;
    adspend_common::nats::connect(&args, &format!("adspend-test-{role}"))
        .await
        .with_context(|| format!("connecting to {} as {role}", args.nats_url))
}

/// A simulator run in the background (10% duplicates), publishing into the
/// `IMPRESSIONS` stream the limiters created with three replicas, as an ad
/// server does: user `adserver`, which may publish impressions only.
pub struct Traffic {
    task: tokio::task::JoinHandle<anyhow::Result<Truth>>,
    cancel: CancellationToken,
}

impl Traffic {
    /// Starts `events` events at `rate` per second.
    pub async fn start(
        catalog: &Catalog,
        events: u64,
        rate: f64,
        seed: u64,
    ) -> anyhow::Result<Traffic> {
        Self::start_on(catalog, "impressions.sim", Some(events), rate, seed).await
    }

    /// Starts publishing to `subject` (one source): `events` events, or
    /// until [`Traffic::stop`] when `None`.
    pub async fn start_on(
        catalog: &Catalog,
        subject: &str,
        events: Option<u64>,
        rate: f64,
        seed: u64,
    ) -> anyhow::Result<Traffic> {
        let client = connect_as("adserver").await?;
        // The limiters create the stream; the simulator must not create a
        // single-replica one first. The ad server may not look at streams:
        // the read-only `auditor` user checks.
        let js = jetstream::new(connect_as("auditor").await?);
        let mut stream = adspend_harness::wait_until_ok(
            Duration::from_secs(60),
            Duration::from_millis(250),
            || {
                let js = js.clone();
                async move { Ok(js.get_stream(sim::STREAM).await?) }
            },
        )
        .await
        .context("the limiters did not create IMPRESSIONS")?;
        let replicas = stream.info().await?.config.num_replicas;
        ensure!(
            replicas == 3,
            "IMPRESSIONS has {replicas} replicas, expected 3"
        );
        let config = SimConfig {
            subject: subject.to_owned(),
            events,
            rate,
            duplicate_rate: 0.1,
            batch: 50,
            seed,
            create_stream: false,
            ..SimConfig::default()
        };
        let catalog = catalog.clone();
        let cancel = CancellationToken::new();
        let token = cancel.clone();
        let task = tokio::spawn(async move {
            let truth = sim::run(&client, &config, &catalog, token).await?;
            client.flush().await?;
            Ok(truth)
        });
        Ok(Traffic { task, cancel })
    }

    /// Waits for the run to publish everything and returns its truth.
    pub async fn finish(self) -> anyhow::Result<Truth> {
        self.task.await.context("simulator task")?
    }

    /// Stops publishing early (whatever was acknowledged is in the truth).
    pub async fn stop(self) -> anyhow::Result<Truth> {
        self.cancel.cancel();
        self.finish().await
    }
}

/// Settles the pipeline and requires exact totals. The truth is read back
/// from `IMPRESSIONS` (a publish whose ack was lost to a fault may still
/// have been stored); every acknowledged event must be in it, and without
/// failed publishes it must equal the simulator's own truth. Then the pacer
/// must equal it for every limit. Returns the comparison and a summary line.
pub async fn settle_exact(
    catalog: &Catalog,
    acked: &Truth,
    timeout: Duration,
) -> anyhow::Result<(Comparison, String)> {
    let client = connect_as("auditor").await?;
    let stream = truth_from_stream(&client, catalog).await?;
    ensure!(acked.stats.unique_events > 0, "the run published nothing");
    for (limit, t) in &acked.limits {
        let in_stream = stream.limits.get(limit).map_or(0, |s| s.lifetime_micros);
        ensure!(
            in_stream >= t.lifetime_micros,
            "acknowledged spend missing from IMPRESSIONS for {limit}: acked {} > stream {in_stream}",
            t.lifetime_micros
        );
    }
    if acked.stats.messages_failed == 0 {
        ensure!(
            stream.limits == acked.limits,
            "IMPRESSIONS holds other spend than the simulator's acknowledged truth"
        );
    }
    let http = pacer_client(Duration::from_secs(10));
    let (comparison, took) = wait_for_match_with(&http, &pacer().url, &stream, timeout).await?;
    let mismatches = comparison.mismatches().len();
    ensure!(
        mismatches == 0,
        "{mismatches} limits differ from the truth after {timeout:?}:\n{}",
        comparison.render(20)
    );
    let summary = format!(
        "exact: {} limits, 0 mismatches, total {} micros; {} events sent ({} duplicates), \
         {} unique acknowledged; {} publishes failed (outcome read back from the stream); settled {:.1}s after the run",
        comparison.rows.len(),
        comparison.total_truth(),
        acked.stats.events_sent,
        acked.stats.duplicates_sent,
        acked.stats.unique_events,
        acked.stats.messages_failed,
        took.as_secs_f64()
    );
    Ok((comparison, summary))
}
