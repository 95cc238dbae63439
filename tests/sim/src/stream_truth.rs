//! Ground truth recomputed from what actually reached `IMPRESSIONS`.
//!
//! When NATS is killed mid-run, some publishes have an unknown outcome: the
//! simulator could not tell whether they were stored. Reading the stream back
//! settles it: the truth is the spend of every unique good impression that is
//! in the stream, whoever thought what about its acknowledgement.
//!
//! A campaign settles after every round, so [`StreamTruth`] keeps its place
//! and reads only what was stored since: reading the whole stream each time
//! made the rounds slow down as the stream grew (2.4 million events after
//! 200 rounds), which measured the harness, not the pipeline.

use std::time::Duration;

use anyhow::Context;
use async_nats::jetstream::{
    self,
    consumer::{pull::OrderedConfig, DeliverPolicy},
};
use futures::StreamExt;

use crate::{Catalog, Impression, Stats, Truth, TruthBuilder};

/// The whole stream's truth, read once.
pub async fn truth_from_stream(
    client: &async_nats::Client,
    catalog: &Catalog,
) -> anyhow::Result<Truth> {
    StreamTruth::new(catalog)?.catch_up(client).await
}

/// The truth of `IMPRESSIONS` up to where it was last read; the stream is
/// append-only, so what was read stays true.
pub struct StreamTruth {
    builder: TruthBuilder,
    stats: Stats,
    /// First stream sequence not read yet.
    next: u64,
}

impl StreamTruth {
    pub fn new(catalog: &Catalog) -> anyhow::Result<Self> {
        Ok(Self {
            builder: TruthBuilder::new(catalog)?,
            stats: Stats::default(),
            next: 1,
        })
    }

    /// Reads what was stored since the last call and returns the truth of
    /// the whole stream so far.
    pub async fn catch_up(&mut self, client: &async_nats::Client) -> anyhow::Result<Truth> {
        let js = jetstream::new(client.clone());
        let mut stream = js
            .get_stream("IMPRESSIONS")
            .await
            .context("IMPRESSIONS stream")?;
        let state = stream.info().await.context("stream info")?.state.clone();
        if state.first_sequence > self.next && self.next > 1 {
            anyhow::bail!(
                "IMPRESSIONS lost messages {}..{} before they were read back",
                self.next,
                state.first_sequence
            );
        }
        let last = state.last_sequence;
        if last >= self.next {
            self.read(&mut stream, last).await?;
        }
        Ok(self.builder.current(self.stats.clone()))
    }

    async fn read(
        &mut self,
        stream: &mut jetstream::stream::Stream,
        last: u64,
    ) -> anyhow::Result<()> {
        let consumer = stream
            .create_consumer(OrderedConfig {
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: self.next,
                },
                ..OrderedConfig::default()
            })
            .await
            .context("ordered consumer on IMPRESSIONS")?;
        let mut messages = consumer.messages().await.context("reading IMPRESSIONS")?;
        while self.next <= last {
            let message = tokio::time::timeout(Duration::from_secs(10), messages.next())
                .await
                .context("IMPRESSIONS read stalled")?
                .context("IMPRESSIONS ended early")??;
            let sequence = message
                .info()
                .map_err(|e| anyhow::anyhow!("IMPRESSIONS message without info: {e}"))?
                .stream_sequence;
            self.stats.messages_acked += 1;
            for line in message
                .payload
                .split(|&b| b == b'\n')
                .filter(|l| !l.is_empty())
            {
                self.stats.events_acked += 1;
                // Lines that do not parse (bad JSON, negative or fractional
                // cost, missing fields) are bad input: no spend.
                if let Ok(impression) = serde_json::from_slice::<Impression>(line) {
                    self.builder.record(&impression)?;
                }
            }
            self.next = sequence + 1;
        }
        Ok(())
    }
}
