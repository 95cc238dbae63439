//! Ground truth recomputed from what actually reached `IMPRESSIONS`.
//!
//! When NATS is killed mid-run, some publishes have an unknown outcome: the
//! simulator could not tell whether they were stored. Reading the stream back
//! settles it: the truth is the spend of every unique good impression that is
//! in the stream, whoever thought what about its acknowledgement.

use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::{self, consumer::pull::OrderedConfig};
use futures::StreamExt;

use crate::sim::{Catalog, Impression, Stats, Truth, TruthBuilder};

pub async fn truth_from_stream(
    client: &async_nats::Client,
    catalog: &Catalog,
) -> anyhow::Result<Truth> {
    let js = jetstream::new(client.clone());
    let mut stream = js
        .get_stream("IMPRESSIONS")
        .await
        .context("IMPRESSIONS stream")?;
    let last = stream
        .info()
        .await
        .context("stream info")?
        .state
        .last_sequence;
    let mut builder = TruthBuilder::new(catalog)?;
    let mut stats = Stats::default();
    if last == 0 {
        return Ok(builder.finish(stats));
    }
    let consumer = stream
        .create_consumer(OrderedConfig::default())
        .await
        .context("ordered consumer on IMPRESSIONS")?;
    let mut messages = consumer.messages().await.context("reading IMPRESSIONS")?;
    loop {
        let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
            .await
            .context("IMPRESSIONS read stalled")?
            .context("IMPRESSIONS ended early")??;
        stats.messages_acked += 1;
        for line in message
            .payload
            .split(|&b| b == b'\n')
            .filter(|l| !l.is_empty())
        {
            stats.events_acked += 1;
            // Lines that do not parse (bad JSON, negative or fractional cost,
            // missing fields) are bad input: no spend.
            if let Ok(impression) = serde_json::from_slice::<Impression>(line) {
                builder.record(&impression)?;
            }
        }
        if message.info().map(|i| i.stream_sequence).unwrap_or(0) >= last {
            break;
        }
    }
    Ok(builder.finish(stats))
}
