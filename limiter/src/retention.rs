//! What `IMPRESSIONS` keeps (docs/RETENTION.md): input the limiter has not
//! acknowledged, whatever its age, and acknowledged input for
//! `ADSPEND_INPUT_RETENTION_MS` (the replay window of set-aside input and
//! forensics). JetStream's own limits cannot say that: `max_age` removes
//! unacknowledged messages too, and interest or work-queue retention
//! deletes at the ack (no replay window) and has known losses with
//! sourcing. So every round the limiter purges each source's subjects
//! (`purge` with a subject filter and a sequence: exact, and cheap)
//! below the lesser of its reader's ack floor + 1 and the first message
//! younger than the retention; FIFO scheduling has one reader for all
//! subjects. Any other durable consumer that acknowledges holds the purge
//! below its own floor; while readers are handed over between the FIFO
//! consumer and the lanes, nothing is purged.
//!
//! `ADSPEND_INPUT_MAX_BYTES` caps the stream with `discard: new`: at the
//! cap NATS refuses ad servers' publishes (backpressure, nothing dropped).
//! Acknowledged input must not hold that cap: while the stream is over
//! [`PRESSING`] of it, acknowledged input goes before its retention ends.

use std::collections::HashMap;
use std::time::Duration;

use adspend_common::config::{NatsArgs, RetentionArgs};
use adspend_common::nats::{self, InputLimits, DEADLETTER_STREAM, IMPRESSIONS_SUBJECTS};
use async_nats::jetstream::{self, consumer, stream::Stream};
use futures::TryStreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::Error;
use crate::fair::lanes::{filters, SOURCE_KEY};
use crate::telemetry::{INPUT_OLDEST_SECONDS, INPUT_PURGED_TOTAL, STREAM_BYTES, STREAM_MAX_BYTES};

/// The share of the byte cap past which acknowledged input is purged
/// before its retention ends.
const PRESSING: f64 = 0.75;
/// The longest time between rounds while the stream has a byte cap.
const CAPPED_EVERY: Duration = Duration::from_secs(2);

/// A durable consumer on `IMPRESSIONS`, as the purge sees it.
#[derive(Debug, Clone, PartialEq)]
struct Reader {
    name: String,
    /// The source of a lane of this deployment.
    lane: Option<String>,
    /// It acknowledges (an ordered or no-ack consumer holds nothing).
    acks: bool,
    /// Every message of its subjects up to here is acknowledged.
    ack_floor: u64,
}

impl Reader {
    fn of(info: &consumer::Info) -> Option<Reader> {
        info.config.durable_name.as_ref()?;
        Some(Reader {
            name: info.name.clone(),
            lane: info.config.metadata.get(SOURCE_KEY).cloned(),
            acks: info.config.ack_policy != consumer::AckPolicy::None,
            ack_floor: info.ack_floor.stream_sequence,
        })
    }
}

/// The purges of one round: (subject filter, purge below this sequence).
/// `bound`: nothing at or past it goes (the retention's first young
/// message, or no bound while the cap presses).
fn plan(readers: &[Reader], prefix: &str, token: usize, bound: u64) -> Vec<(String, u64)> {
    let lane_prefix = format!("{prefix}-src-");
    let ours =
        |r: &Reader| r.name == prefix || (r.name.starts_with(&lane_prefix) && r.lane.is_some());
    // Another deployment's or a tool's reader keeps what it has not
    // acknowledged: the purge stops below its floor, on every subject.
    let bound = readers
        .iter()
        .filter(|r| r.acks && !ours(r))
        .map(|r| r.ack_floor + 1)
        .fold(bound, u64::min);
    let fifo = readers.iter().find(|r| r.name == prefix);
    let lanes: Vec<&Reader> = readers
        .iter()
        .filter(|r| r.name != prefix && ours(r))
        .collect();
    match (fifo, lanes.is_empty()) {
        (Some(fifo), true) => vec![(
            IMPRESSIONS_SUBJECTS.to_string(),
            bound.min(fifo.ack_floor + 1),
        )],
        (None, false) => lanes
            .iter()
            .flat_map(|lane| {
                let below = bound.min(lane.ack_floor + 1);
                let source = lane.lane.as_deref().unwrap_or_default();
                filters(source, token)
                    .into_iter()
                    .map(move |filter| (filter, below))
            })
            .collect(),
        // A hand-over between the FIFO consumer and the lanes, or no
        // reader yet: nothing is known to be acknowledged.
        _ => Vec::new(),
    }
}

pub(crate) struct Retention {
    js: jetstream::Context,
    stream: Stream,
    replicas: usize,
    /// `ADSPEND_LIMITER_CONSUMER`: the FIFO consumer and the lanes' prefix.
    prefix: String,
    token: usize,
    args: RetentionArgs,
    /// Where the last search for the retention's bound ended.
    searched: u64,
    /// Per subject filter, the sequence it was last purged below: a lane
    /// whose floor and bound did not move costs no call (thousands of
    /// sources, two filters each).
    purged_below: HashMap<String, u64>,
    /// The stream's last sequence at the last round (a stream made again
    /// starts over).
    last_seen: u64,
}

/// What the retention's thread needs from the limiter's settings.
pub(crate) struct Settings {
    pub(crate) nats: NatsArgs,
    pub(crate) replicas: usize,
    pub(crate) prefix: String,
    pub(crate) token: usize,
    pub(crate) args: RetentionArgs,
}

/// Run the rounds on a thread of their own, with a runtime and a NATS
/// connection of their own, until `cancel`: a limiter whose loop is busy
/// or held (a publish that hangs, a stopped mapping thread) is exactly
/// when its input must keep being bounded. `tasks` waits for the thread.
pub(crate) fn start(settings: Settings, tasks: &TaskTracker, cancel: CancellationToken) {
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("adspend-retention".into())
        .spawn(move || {
            let runtime = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(runtime) => runtime,
                Err(e) => {
                    tracing::error!(error = %e, "IMPRESSIONS retention cannot start its runtime");
                    return;
                }
            };
            runtime.block_on(async move {
                tokio::select! {
                    _ = cancel.cancelled() => {}
                    _ = run(settings) => {}
                }
            });
            let _ = done_tx.send(());
        });
    match spawned {
        Ok(_) => {
            tasks.spawn(async move {
                let _ = done_rx.await;
            });
        }
        Err(e) => tracing::error!(error = %e, "IMPRESSIONS retention cannot start its thread"),
    }
}

/// Connect (again and again while NATS is away), then run rounds forever.
async fn run(settings: Settings) {
    let mut retention = loop {
        match Retention::open(&settings).await {
            Ok(retention) => break retention,
            Err(e) => {
                tracing::warn!(error = %e, "IMPRESSIONS retention cannot reach NATS; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    };
    let mut tick = tokio::time::interval(retention.every());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        match retention.round().await {
            Ok(()) => failing = false,
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "IMPRESSIONS retention round failed; retrying");
            }
            Err(_) => {}
        }
    }
}

impl Retention {
    async fn open(settings: &Settings) -> Result<Retention, Error> {
        let client = nats::connect(&settings.nats, "adspend-limiter-retention").await?;
        let js = jetstream::new(client);
        let stream = js
            .get_stream(adspend_common::nats::IMPRESSIONS_STREAM)
            .await
            .map_err(err("(stream info)"))?;
        Ok(Retention {
            js,
            stream,
            replicas: settings.replicas,
            prefix: settings.prefix.clone(),
            token: settings.token,
            args: settings.args.clone(),
            searched: 0,
            purged_below: HashMap::new(),
            last_seen: 0,
        })
    }

    /// How often a round runs: a quarter of the retention, between a
    /// quarter second and a minute; every [`CAPPED_EVERY`] at most under a
    /// cap, so that acknowledged input makes room before publishers wait.
    fn every(&self) -> Duration {
        let every = (self.args.input_retention() / 4)
            .clamp(Duration::from_millis(250), Duration::from_secs(60));
        if self.args.input_max_bytes > 0 {
            every.min(CAPPED_EVERY)
        } else {
            every
        }
    }

    /// One round: export the streams' fill, apply a cap that had to wait,
    /// purge what may go.
    pub(crate) async fn round(&mut self) -> Result<(), Error> {
        let info = self
            .stream
            .info()
            .await
            .map_err(err("(stream info)"))?
            .clone();
        export("IMPRESSIONS", info.state.bytes, info.config.max_bytes);
        let oldest = if info.state.messages == 0 {
            0.0
        } else {
            let first_ms = (info.state.first_timestamp.unix_timestamp_nanos() / 1_000_000) as i64;
            (adspend_common::now_ms() - first_ms).max(0) as f64 / 1000.0
        };
        metrics::gauge!(INPUT_OLDEST_SECONDS).set(oldest);
        tracing::debug!(
            oldest_seconds = oldest,
            messages = info.state.messages,
            bytes = info.state.bytes,
            "IMPRESSIONS retention round"
        );
        self.export_deadletter().await;
        let cap = self.args.input_max_bytes;
        // A cap deferred at the start (the stream held more) is set once
        // the stream is under it; the start said so once.
        if cap > 0 && info.config.max_bytes != cap as i64 && info.state.bytes <= cap {
            let limits = InputLimits::from_args(&self.args);
            self.stream = nats::ensure_impressions_with(&self.js, self.replicas, &limits).await?;
        }
        if info.state.messages == 0 {
            return Ok(());
        }
        let pressing = cap > 0 && info.state.bytes as f64 >= PRESSING * cap as f64;
        let (bound, reason) = if pressing {
            (u64::MAX, "cap")
        } else {
            let cutoff_ms = adspend_common::now_ms() - self.args.input_retention_ms as i64;
            let from = if self.searched > info.state.last_sequence + 1 {
                info.state.first_sequence
            } else {
                self.searched.max(info.state.first_sequence)
            };
            let bound = nats::first_newer_than(
                &self.stream,
                IMPRESSIONS_SUBJECTS,
                from,
                info.state.last_sequence,
                cutoff_ms,
            )
            .await?;
            self.searched = bound;
            (bound, "age")
        };
        let readers: Vec<Reader> = self
            .stream
            .consumers()
            .try_collect::<Vec<consumer::Info>>()
            .await
            .map_err(err("(list)"))?
            .iter()
            .filter_map(Reader::of)
            .collect();
        if info.state.last_sequence < self.last_seen {
            self.purged_below.clear();
        }
        self.last_seen = info.state.last_sequence;
        for (filter, below) in plan(&readers, &self.prefix, self.token, bound) {
            let done = self.purged_below.get(&filter).copied().unwrap_or(0);
            if below <= info.state.first_sequence || below <= done {
                continue;
            }
            let purged = self
                .stream
                .purge()
                .filter(filter.clone())
                .sequence(below)
                .await
                .map_err(err("(purge)"))?
                .purged;
            self.purged_below.insert(filter.clone(), below);
            if purged > 0 {
                metrics::counter!(INPUT_PURGED_TOTAL, "reason" => reason).increment(purged);
                tracing::debug!(filter, below, purged, reason, "acknowledged input purged");
            }
        }
        Ok(())
    }

    async fn export_deadletter(&self) {
        if let Ok(stream) = self.js.get_stream(DEADLETTER_STREAM).await {
            let info = stream.cached_info();
            export(DEADLETTER_STREAM, info.state.bytes, info.config.max_bytes);
        }
    }
}

fn export(stream: &'static str, bytes: u64, max_bytes: i64) {
    metrics::gauge!(STREAM_BYTES, "stream" => stream).set(bytes as f64);
    metrics::gauge!(STREAM_MAX_BYTES, "stream" => stream).set(max_bytes.max(0) as f64);
}

fn err<E>(what: &'static str) -> impl FnOnce(E) -> Error
where
    E: std::error::Error + Send + Sync + 'static,
{
    move |e| Error::Consumer {
        stream: adspend_common::nats::IMPRESSIONS_STREAM,
        consumer: what.to_string(),
        source: Box::new(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(name: &str, lane: Option<&str>, acks: bool, ack_floor: u64) -> Reader {
        Reader {
            name: name.into(),
            lane: lane.map(Into::into),
            acks,
            ack_floor,
        }
    }

    #[test]
    fn each_lane_is_purged_below_its_floor_and_the_bound() {
        let readers = [
            reader("limiter-src-aa", Some("a"), true, 10),
            reader("limiter-src-bb", Some("b"), true, 90),
            // An ordered consumer (the source watch) holds nothing.
            reader("watch", None, false, 0),
        ];
        assert_eq!(
            plan(&readers, "limiter", 1, 50),
            vec![
                ("impressions.a.>".to_string(), 11),
                ("impressions.a".to_string(), 11),
                ("impressions.b.>".to_string(), 50),
                ("impressions.b".to_string(), 50),
            ]
        );
    }

    #[test]
    fn fifo_reads_all_and_anothers_reader_holds_everything_back() {
        let fifo = reader("limiter", None, true, 40);
        assert_eq!(
            plan(std::slice::from_ref(&fifo), "limiter", 1, u64::MAX),
            vec![("impressions.>".to_string(), 41)]
        );
        let audit = reader("audit", None, true, 7);
        assert_eq!(
            plan(&[fifo.clone(), audit], "limiter", 1, u64::MAX),
            vec![("impressions.>".to_string(), 8)]
        );
        // Mid hand-over, or nobody reading: nothing goes.
        let lane = reader("limiter-src-aa", Some("a"), true, 30);
        assert!(plan(&[fifo, lane], "limiter", 1, 100).is_empty());
        assert!(plan(&[], "limiter", 1, 100).is_empty());
    }
}
