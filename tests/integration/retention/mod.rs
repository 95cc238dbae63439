//! What each stream keeps (docs/RETENTION.md), against a real nats-server:
//! acknowledged input leaves `IMPRESSIONS` after its window while input not
//! yet acknowledged stays however old ([`input`]); a byte cap refuses
//! publishers and loses nothing ([`input`]); `SPEND` is trimmed below the
//! oldest kept checkpoint and a restore from that checkpoint is exact
//! ([`spend`]); a trim is told from a lost head ([`trims`]); streams an
//! older version made get their limits at start, and `ALERTS` keeps every
//! limit's last alert ([`streams`]).

mod input;
mod spend;
mod store;
mod streams;
mod trims;

use std::time::Duration;

use adspend_sim::SimConfig;
use async_nats::jetstream::{self, stream::Stream};

use crate::support::Pipeline;

/// One message of `events` impressions on `impressions.<source>`, no
/// duplicates.
fn messages(source: &str, events: u64, batch: usize, seed: u64) -> SimConfig {
    SimConfig {
        subject: format!("impressions.{source}"),
        events: Some(events),
        duplicate_rate: 0.0,
        batch,
        seed,
        ..SimConfig::default()
    }
}

async fn stream(p: &Pipeline, name: &str) -> Stream {
    let js = jetstream::new(p.client().await);
    js.get_stream(name).await.expect(name)
}

/// (first, last sequence, bytes) of stream `name`.
async fn state(p: &Pipeline, name: &str) -> (u64, u64, u64) {
    let mut stream = stream(p, name).await;
    let info = stream.info().await.expect("stream info");
    (
        info.state.first_sequence,
        info.state.last_sequence,
        info.state.bytes,
    )
}

/// Whether stream `name` still holds the message at `seq`.
async fn holds(p: &Pipeline, name: &str, seq: u64) -> bool {
    stream(p, name).await.get_raw_message(seq).await.is_ok()
}

const SETTLE: Duration = Duration::from_secs(90);
const POLL: Duration = Duration::from_millis(100);
