//! The closed loop's publisher: takes the impressions the ad servers
//! served, holds each until its due time (`publish_delay` after it was
//! served), publishes them to JetStream as NDJSON messages, and books the
//! impressions of every acknowledged message into the truth. An impression
//! served under a spend lease carries its `lease_id`; the truth books it
//! like any other.

use std::collections::VecDeque;
use std::fmt::Write as _;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::context::{PublishAckFuture, PublishError};
use async_nats::jetstream::{self, publish::PublishAck};
use async_nats::Subject;
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::sync::mpsc;

use super::closed_loop::{Counters, LoopConfig};
use super::truth::{CatalogIndex, Stats, Truth, TruthBuilder};

/// Most messages awaiting their ack.
const IN_FLIGHT: usize = 256;

/// One served impression on its way to the stream.
#[derive(Debug, Clone)]
pub(crate) struct Served {
    pub(crate) ad: u32,
    pub(crate) cost: u64,
    /// When it was served, unix ms: the impression's `ts`.
    pub(crate) ts: i64,
    /// When it may be published.
    pub(crate) due: Instant,
    /// The id of the lease it was served under (lease mode only).
    pub(crate) lease: Option<Arc<str>>,
}

/// Appends the impression `<run id>-c<seq>` of `s` as one NDJSON line:
/// the contract's fields, and `lease_id` when it was served under a lease.
pub(crate) fn write_impression(
    out: &mut String,
    run_id: &str,
    seq: u64,
    ad_json: &str,
    s: &Served,
) {
    let _ = write!(
        out,
        r#"{{"id":"{run_id}-c{seq}","ad_id":{ad_json},"cost_micros":{},"ts":{}"#,
        s.cost, s.ts
    );
    if let Some(lease) = &s.lease {
        out.push_str(r#","lease_id":"#);
        out.push_str(&serde_json::to_string(&**lease).expect("a string"));
    }
    out.push_str("}\n");
}

/// (sequence number, impression) of a published message.
type Sent = Vec<(u64, Served)>;

async fn await_ack(ack: PublishAckFuture, sent: Sent) -> (Result<PublishAck, PublishError>, Sent) {
    (ack.await, sent)
}

/// Publishes until the servers hang up and nothing is held back, then
/// waits for every ack and returns the truth of the acknowledged ones.
pub(crate) async fn run(
    client: async_nats::Client,
    config: LoopConfig,
    index: Arc<CatalogIndex>,
    run_id: String,
    counters: Arc<Counters>,
    mut rx: mpsc::UnboundedReceiver<Served>,
) -> anyhow::Result<Truth> {
    if config.create_stream {
        super::ensure_stream(&client).await?;
    }
    let js = jetstream::ContextBuilder::new()
        .timeout(Duration::from_secs(10))
        .max_ack_inflight(IN_FLIGHT)
        .build(client);
    let subject = Subject::from(config.subject.as_str());
    let mut truth = TruthBuilder::from_index(index.clone());
    let mut held: VecDeque<Served> = VecDeque::new();
    let mut in_flight = FuturesUnordered::new();
    let mut next_seq = 0u64;
    let (mut published, mut acked_messages, mut failed) = (0u64, 0u64, 0u64);
    let start = Instant::now();
    let mut open = true;
    let mut on_ack = |result: Result<PublishAck, PublishError>,
                      sent: Sent,
                      truth: &mut TruthBuilder|
     -> anyhow::Result<()> {
        match result {
            Ok(_) => {
                acked_messages += 1;
                counters.acked.fetch_add(sent.len() as u64, Relaxed);
                for (seq, s) in sent {
                    truth.record_seq(seq, s.ad, s.cost, s.ts)?;
                }
            }
            Err(e) => {
                if failed == 0 {
                    tracing::warn!(error = %e, "publish not acknowledged; its impressions are left out of the truth");
                }
                failed += 1;
                counters.messages_failed.fetch_add(1, Relaxed);
            }
        }
        Ok(())
    };
    loop {
        let due = held.front().map(|s| s.due);
        tokio::select! {
            received = rx.recv(), if open => match received {
                Some(served) => {
                    held.push_back(served);
                    while let Ok(more) = rx.try_recv() {
                        held.push_back(more);
                    }
                }
                None => open = false,
            },
            _ = tokio::time::sleep_until(due.unwrap_or_else(Instant::now).into()), if due.is_some() => {
                let now = Instant::now();
                while held.front().is_some_and(|s| s.due <= now) {
                    let mut sent: Sent = Vec::with_capacity(config.batch);
                    let mut payload = String::with_capacity(config.batch * 96);
                    while sent.len() < config.batch && held.front().is_some_and(|s| s.due <= now) {
                        let s = held.pop_front().expect("checked");
                        let ad = &index.ad_json[s.ad as usize];
                        write_impression(&mut payload, &run_id, next_seq, ad, &s);
                        sent.push((next_seq, s));
                        next_seq += 1;
                    }
                    while in_flight.len() >= IN_FLIGHT {
                        let (result, sent) = in_flight.next().await.expect("not empty");
                        on_ack(result, sent, &mut truth)?;
                    }
                    published += 1;
                    match js.publish(subject.clone(), payload.into()).await {
                        Ok(ack) => in_flight.push(await_ack(ack, sent)),
                        Err(e) => on_ack(Err(e), sent, &mut truth)?,
                    }
                }
            },
            Some((result, sent)) = in_flight.next(), if !in_flight.is_empty() => {
                on_ack(result, sent, &mut truth)?;
            },
            else => break,
        }
        if !open && held.is_empty() {
            break;
        }
    }
    while let Some((result, sent)) = in_flight.next().await {
        on_ack(result, sent, &mut truth)?;
    }
    let elapsed = start.elapsed();
    let served = counters.served.load(Relaxed);
    let stats = Stats {
        run_id,
        seed: config.seed,
        messages_published: published,
        messages_acked: acked_messages,
        messages_failed: failed,
        events_sent: served,
        events_acked: counters.acked.load(Relaxed),
        elapsed_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        events_per_sec: served as f64 / elapsed.as_secs_f64().max(1e-9),
        ..Stats::default()
    };
    Ok(truth.finish(stats))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn served(lease: Option<&str>) -> Served {
        Served {
            ad: 0,
            cost: 1_500_000,
            ts: 1_800_000_000_123,
            due: Instant::now(),
            lease: lease.map(Into::into),
        }
    }

    fn line(s: &Served) -> serde_json::Value {
        let mut out = String::new();
        write_impression(&mut out, "loop-ab12cd", 7, r#""ad-\"1""#, s);
        assert!(
            out.ends_with('\n') && out.matches('\n').count() == 1,
            "{out:?}"
        );
        serde_json::from_str(&out).unwrap()
    }

    #[test]
    fn an_impression_carries_the_contract_s_fields_and_no_lease_outside_lease_mode() {
        assert_eq!(
            line(&served(None)),
            serde_json::json!({
                "id": "loop-ab12cd-c7",
                "ad_id": "ad-\"1",
                "cost_micros": 1_500_000,
                "ts": 1_800_000_000_123_i64
            })
        );
    }

    #[test]
    fn an_impression_served_under_a_lease_carries_its_lease_id() {
        assert_eq!(
            line(&served(Some("01J9Z-\"x"))),
            serde_json::json!({
                "id": "loop-ab12cd-c7",
                "ad_id": "ad-\"1",
                "cost_micros": 1_500_000,
                "ts": 1_800_000_000_123_i64,
                "lease_id": "01J9Z-\"x"
            })
        );
    }
}
