//! A recorded snapshot that is gone (DESIGN.md rules 4 and 8): the
//! checkpoint record names a base or a delta that the object store no longer
//! has (it restarted empty, its bucket was deleted), and the local LMDB
//! cannot serve. That is neither an outage to retry blindly nor a reason to
//! stop the pipeline: the shard takes the way out that is safe, and while
//! there is none it stays in a visible state.
//!
//! - `SPEND` still holds every message from sequence 1 (nothing removed, not
//!   recreated since the record, not below it): the shard is rebuilt from an
//!   empty state by replaying the whole stream. Exact: sums, dedupe ids and
//!   the last applied sequence are functions of the log, and the replay makes
//!   the first apply's decisions, as every restore's replay does.
//! - Otherwise nothing is guessed. An ERROR names the shard, the key and the
//!   way out, `adspend_aggregator_snapshot_missing{shard}` is 1, and the
//!   restore is tried again with backoff (the object may be put back). The
//!   operator's way out, [`ACCEPT_LOSS`](crate::config::ACCEPT_LOSS) naming
//!   the shard and the record's checkpoint, rebuilds it from the stream's
//!   first sequence, accepting that the spend before it is lost.
//!
//! Either way the next checkpoint copies a new base (a new lineage), recorded
//! under the shard's current owner epoch.

use std::path::Path;
use std::time::{Duration, Instant};

use async_nats::jetstream::stream::Stream;
use tokio_util::sync::CancellationToken;

use crate::checkpoint::record::{CheckpointRecord, CheckpointStore};
use crate::checkpoint::restore::{self, Start};
use crate::config::{AcceptLoss, ACCEPT_LOSS};
use crate::error::Error;
use crate::snapshot_store::SnapshotStore;
use crate::store::Store;
use crate::telemetry::{REBUILDS_TOTAL, SNAPSHOT_MISSING, SNAPSHOT_MISSING_TOTAL};

/// First wait before trying the restore again; doubled up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// What `SPEND` holds, as far as a rebuild is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StreamState {
    pub(crate) first_seq: u64,
    pub(crate) last_seq: u64,
    pub(crate) messages: u64,
    pub(crate) created_ms: i64,
}

/// How a shard whose recorded snapshot is gone goes on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum WayOut {
    /// Rebuild from empty, replaying the whole stream: exact.
    Replay,
    /// Rebuild from empty at the stream's first sequence (last applied
    /// `start_after`): the operator accepted the loss of what came before.
    AcceptLoss { start_after: u64 },
    /// No safe way out: stay visible and try again later.
    Wait { reason: String },
}

/// Why `stream` does not hold the whole history `record` was made from, or
/// `None` if it does: every message from sequence 1 still there, through the
/// record's sequence at least, in a stream created before the record.
pub(crate) fn missing_history(stream: &StreamState, record: &CheckpointRecord) -> Option<String> {
    if stream.first_seq > 1 {
        return Some(format!(
            "SPEND starts at sequence {}: sequences 1..={} are gone from it",
            stream.first_seq,
            stream.first_seq - 1
        ));
    }
    if stream.last_seq < record.seq {
        return Some(format!(
            "SPEND ends at sequence {}, below the record's {} (the log went backwards)",
            stream.last_seq, record.seq
        ));
    }
    if stream.messages != stream.last_seq {
        return Some(format!(
            "SPEND holds {} messages of sequences 1..={}: {} were deleted",
            stream.messages,
            stream.last_seq,
            stream.last_seq.saturating_sub(stream.messages)
        ));
    }
    if stream.created_ms > record.created_ms {
        return Some(format!(
            "SPEND was created at {} ms, after the record (at {} ms): it is not the log the record was made from",
            stream.created_ms, record.created_ms
        ));
    }
    None
}

/// The way out for `shard`, whose recorded snapshot is gone.
pub(crate) fn way_out(
    shard: &str,
    record: &CheckpointRecord,
    stream: &StreamState,
    accept_loss: &AcceptLoss,
) -> WayOut {
    let Some(reason) = missing_history(stream, record) else {
        return WayOut::Replay;
    };
    if accept_loss.covers(shard, record.checkpoint_id) {
        WayOut::AcceptLoss {
            start_after: stream.first_seq.saturating_sub(1),
        }
    } else {
        WayOut::Wait { reason }
    }
}

async fn stream_state(stream: &mut Stream) -> Result<StreamState, Error> {
    let info = stream
        .info()
        .await
        .map_err(Error::consumer("stream info"))?;
    Ok(StreamState {
        first_seq: info.state.first_sequence,
        last_seq: info.state.last_sequence,
        messages: info.state.messages,
        created_ms: (info.created.unix_timestamp_nanos() / 1_000_000) as i64,
    })
}

/// Where a shard's state lives and how it is restored.
pub(crate) struct Local<'a> {
    pub(crate) shard: &'a str,
    pub(crate) lmdb_dir: &'a Path,
    pub(crate) tmp_dir: &'a Path,
    pub(crate) map_size: usize,
    pub(crate) accept_loss: &'a AcceptLoss,
}

/// A shard's store, opened.
pub(crate) struct Opened {
    pub(crate) store: Store,
    pub(crate) lineage: String,
    pub(crate) start: Start,
    /// The record read for it.
    pub(crate) record: Option<CheckpointRecord>,
}

/// [`restore::open_or_restore`], with the ways out of a recorded snapshot
/// that is gone. `None` when `stop` came first (the shard never opened).
pub(crate) async fn open(
    local: &Local<'_>,
    records: &mut CheckpointStore,
    snapshots: &SnapshotStore,
    stream: &mut Stream,
    stop: &CancellationToken,
) -> Result<Option<Opened>, Error> {
    let shard = local.shard;
    let mut missing_since: Option<Instant> = None;
    let mut backoff = FIRST_BACKOFF;
    loop {
        let (record, error) = match attempt(local, records, snapshots).await {
            Ok(Attempt::Opened(opened)) => {
                if let Some(since) = missing_since {
                    metrics::gauge!(SNAPSHOT_MISSING, "shard" => shard.to_string()).set(0.0);
                    tracing::warn!(
                        shard,
                        start = opened.start.as_str(),
                        missing_for_s = since.elapsed().as_secs(),
                        "the recorded snapshot is back (or the record changed); shard restored"
                    );
                }
                return Ok(Some(opened));
            }
            Ok(Attempt::Missing(record, error)) => (record, error),
            // In the visible state already: an outage on the way (NATS,
            // etcd, the store) is waited out, not a reason to leave it.
            Err(e) if missing_since.is_some() && e.is_retryable() => {
                tracing::warn!(shard, error = %e, "retrying the restore of a shard whose snapshot is gone failed; trying again");
                if !sleep(stop, &mut backoff).await {
                    return Ok(stopped(shard));
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        if missing_since.is_none() {
            missing_since = Some(Instant::now());
            metrics::counter!(SNAPSHOT_MISSING_TOTAL, "shard" => shard.to_string()).increment(1);
            metrics::gauge!(SNAPSHOT_MISSING, "shard" => shard.to_string()).set(1.0);
        }
        let state = match stream_state(stream).await {
            Ok(state) => state,
            Err(e) => {
                tracing::warn!(shard, error = %e, "reading SPEND's state for a shard whose snapshot is gone failed; trying again");
                if !sleep(stop, &mut backoff).await {
                    return Ok(stopped(shard));
                }
                continue;
            }
        };
        let Some((start_after, way)) =
            announce(shard, &record, &state, &error, local.accept_loss, backoff)
        else {
            if !sleep(stop, &mut backoff).await {
                return Ok(stopped(shard));
            }
            continue;
        };
        return rebuild(local, record, start_after, way).map(Some);
    }
}

/// Says which way out `way_out` chose, as an ERROR even on the automatic
/// one: the store lost data (it may not be durable), and until the rebuilt
/// shard records its first checkpoint nothing restorable stands behind it.
/// `(start after, way)` to rebuild from, or `None` to wait.
fn announce(
    shard: &str,
    record: &CheckpointRecord,
    state: &StreamState,
    error: &Error,
    accept_loss: &AcceptLoss,
    backoff: Duration,
) -> Option<(u64, &'static str)> {
    match way_out(shard, record, state, accept_loss) {
        WayOut::Replay => {
            tracing::error!(
                shard,
                error = %error,
                checkpoint = record.checkpoint_id,
                record_seq = record.seq,
                stream_last_seq = state.last_seq,
                "the recorded snapshot is gone; SPEND still holds every message from \
                 sequence 1, so the shard is rebuilt exactly by replaying all of it"
            );
            Some((0, "replay"))
        }
        WayOut::AcceptLoss { start_after } => {
            tracing::error!(
                shard,
                error = %error,
                checkpoint = record.checkpoint_id,
                record_seq = record.seq,
                stream_first_seq = state.first_seq,
                "the recorded snapshot is gone and {ACCEPT_LOSS} accepts the loss of checkpoint \
                 {shard}@{}: the shard starts again empty at SPEND's first sequence; \
                 the spend of sequences up to {start_after} is not counted",
                record.checkpoint_id
            );
            Some((start_after, "accept_loss"))
        }
        WayOut::Wait { reason } => {
            tracing::error!(
                shard,
                error = %error,
                reason,
                retry_in_s = backoff.as_secs(),
                "the recorded snapshot is gone and SPEND no longer holds this shard's whole \
                 history: the shard is not applied. Ways out (docs/RECOVERY.md): put the \
                 object back (retried by itself), or accept the loss of what SPEND no longer \
                 holds by restarting the aggregators with {ACCEPT_LOSS}={shard}@{}",
                record.checkpoint_id
            );
            None
        }
    }
}

/// The shard's local store made anew and empty, to replay SPEND after
/// `start_after`; `record` stays the one recorded (the next checkpoint
/// commits over it).
fn rebuild(
    local: &Local<'_>,
    record: CheckpointRecord,
    start_after: u64,
    way: &'static str,
) -> Result<Opened, Error> {
    let shard = local.shard;
    let started = Instant::now();
    let (store, lineage, start) = restore::rebuild(local.lmdb_dir, local.map_size, start_after)?;
    metrics::counter!(REBUILDS_TOTAL, "shard" => shard.to_string(), "way" => way).increment(1);
    metrics::gauge!(SNAPSHOT_MISSING, "shard" => shard.to_string()).set(0.0);
    tracing::info!(
        shard,
        way,
        lineage,
        start_after,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "shard rebuilt empty; replaying SPEND, the next checkpoint copies a new base"
    );
    Ok(Opened {
        store,
        lineage,
        start,
        record: Some(record),
    })
}

enum Attempt {
    Opened(Opened),
    Missing(CheckpointRecord, Error),
}

/// One restore: the record as it stands now, the store opened or restored.
async fn attempt(
    local: &Local<'_>,
    records: &mut CheckpointStore,
    snapshots: &SnapshotStore,
) -> Result<Attempt, Error> {
    let record = records.load().await?;
    match restore::open_or_restore(
        local.lmdb_dir,
        local.tmp_dir,
        record.as_ref(),
        snapshots,
        local.map_size,
    )
    .await
    {
        Ok((store, lineage, start)) => Ok(Attempt::Opened(Opened {
            store,
            lineage,
            start,
            record,
        })),
        Err(e @ Error::SnapshotMissing { .. }) => Ok(Attempt::Missing(
            record.expect("only a record names a snapshot"),
            e,
        )),
        Err(e) => Err(e),
    }
}

/// Wait `backoff` (then double it), or until `stop`: false if stopped.
async fn sleep(stop: &CancellationToken, backoff: &mut Duration) -> bool {
    let wait = *backoff;
    *backoff = (*backoff * 2).min(MAX_BACKOFF);
    tokio::select! {
        _ = stop.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}

/// Stopped while waiting: this process no longer holds the shard, so its
/// gauge no longer says anything about it.
fn stopped(shard: &str) -> Option<Opened> {
    metrics::gauge!(SNAPSHOT_MISSING, "shard" => shard.to_string()).set(0.0);
    tracing::info!(
        shard,
        "stopped while its recorded snapshot is gone; the next owner finds the same"
    );
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(seq: u64, created_ms: i64) -> CheckpointRecord {
        CheckpointRecord {
            checkpoint_id: 17,
            seq,
            snapshot_key: "p3/x.mdb".into(),
            checksum: "x".into(),
            size_bytes: 1,
            epoch: 4,
            lineage: "l".into(),
            created_ms,
            deltas: Vec::new(),
        }
    }

    fn stream(first_seq: u64, last_seq: u64, messages: u64) -> StreamState {
        StreamState {
            first_seq,
            last_seq,
            messages,
            created_ms: 1_000,
        }
    }

    #[test]
    fn a_whole_stream_is_replayed_and_anything_less_waits_unless_accepted() {
        let record = record(500, 2_000);
        let none = AcceptLoss::default();
        let accepted = AcceptLoss::parse("p3@17").unwrap();
        let whole = stream(1, 600, 600);
        assert_eq!(way_out("p3", &record, &whole, &none), WayOut::Replay);
        assert_eq!(way_out("p3", &record, &whole, &accepted), WayOut::Replay);
        // At the record exactly is enough.
        assert_eq!(
            way_out("p3", &record, &stream(1, 500, 500), &none),
            WayOut::Replay
        );

        let cases = [
            (stream(101, 600, 500), "starts at sequence 101", 100),
            (stream(1, 400, 400), "below the record's 500", 0),
            (stream(1, 600, 599), "1 were deleted", 0),
            (
                StreamState {
                    created_ms: 2_001,
                    ..whole
                },
                "created at 2001 ms, after the record",
                0,
            ),
        ];
        for (state, why, start_after) in cases {
            match way_out("p3", &record, &state, &none) {
                WayOut::Wait { reason } => assert!(reason.contains(why), "{reason}"),
                other => panic!("{state:?}: {other:?}"),
            }
            // Another shard's or another checkpoint's acceptance is not this one's.
            for other in ["p4@17", "p3@16"] {
                let other = AcceptLoss::parse(other).unwrap();
                assert!(matches!(
                    way_out("p3", &record, &state, &other),
                    WayOut::Wait { .. }
                ));
            }
            assert_eq!(
                way_out("p3", &record, &state, &accepted),
                WayOut::AcceptLoss { start_after },
                "{state:?}"
            );
        }
    }
}
