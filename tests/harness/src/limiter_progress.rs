//! How far the limiter has acknowledged `IMPRESSIONS`, whichever way it
//! reads it: one FIFO consumer (`ADSPEND_LIMITER_SCHEDULING=fifo`, named
//! `limiter`) or one lane per source (`fair`, the default: `limiter-src-…`).
//! Tests and the campaign ask this instead of naming one consumer.

use anyhow::Context;
use async_nats::jetstream::{self, consumer};
use futures::TryStreamExt;

/// The default `ADSPEND_LIMITER_CONSUMER`: the FIFO consumer's name and the
/// lanes' prefix.
pub const LIMITER_CONSUMER: &str = "limiter";

/// Every consumer of the limiter on `IMPRESSIONS` (FIFO and lanes).
pub async fn limiter_consumers(client: &async_nats::Client) -> anyhow::Result<Vec<consumer::Info>> {
    let js = jetstream::new(client.clone());
    let stream = js
        .get_stream("IMPRESSIONS")
        .await
        .context("IMPRESSIONS stream")?;
    let lanes = format!("{LIMITER_CONSUMER}-src-");
    let all: Vec<consumer::Info> = stream
        .consumers()
        .try_collect()
        .await
        .context("listing IMPRESSIONS consumers")?;
    Ok(all
        .into_iter()
        .filter(|c| c.name == LIMITER_CONSUMER || c.name.starts_with(&lanes))
        .collect())
}

/// Whether every `IMPRESSIONS` message through stream sequence `seq` has
/// been handled and acknowledged: each consumer has its ack floor at `seq`
/// or beyond, or holds nothing unacknowledged and nothing pending (a lane
/// whose source sent nothing since).
pub async fn limiter_acked_through(client: &async_nats::Client, seq: u64) -> anyhow::Result<bool> {
    let consumers = limiter_consumers(client).await?;
    Ok(!consumers.is_empty()
        && consumers.iter().all(|c| {
            c.ack_floor.stream_sequence >= seq || (c.num_pending == 0 && c.num_ack_pending == 0)
        }))
}

/// Messages not yet delivered and delivered but not acknowledged, summed
/// over the limiter's consumers; `None` while it has none.
pub async fn limiter_backlog(client: &async_nats::Client) -> anyhow::Result<Option<(u64, usize)>> {
    let consumers = limiter_consumers(client).await?;
    if consumers.is_empty() {
        return Ok(None);
    }
    Ok(Some(consumers.iter().fold((0, 0), |(p, a), c| {
        (p + c.num_pending, a + c.num_ack_pending)
    })))
}
