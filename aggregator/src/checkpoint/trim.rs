//! `SPEND` kept back to the oldest checkpoint a restore may use
//! (docs/RETENTION.md). Once a checkpoint is recorded and the snapshots no
//! kept chain needs are collected, each of the shard's partitions is
//! purged (subject filter and sequence, exact) below the position of the
//! oldest base still kept: a restore from any kept base, the oldest
//! included, replays from past its position, and finds every message it
//! needs.
//!
//! The message at that position stays (the purge stops below it). Before
//! each purge the trim's bound is written to `SPEND_TRIMS`, one subject per
//! partition (`all` for the only shard), the newest kept: the stream's
//! first sequence rises as the shards trim, past where a shard whose
//! partitions are quiet must replay from, and those marks, with the shard's
//! own last applied message, tell a trim from a real gap
//! (`shard::bounds`).

use std::time::Duration;

use adspend_common::nats::{spend_subject, spend_trim_subject, SPEND_SUBJECTS};
use async_nats::jetstream::{self, stream::Stream};

use crate::telemetry::{SPEND_TRIMMED_BELOW, SPEND_TRIMMED_TOTAL};

/// How long a trim waits for `SPEND_TRIMS` to take its mark.
const MARK_TIMEOUT: Duration = Duration::from_secs(5);

pub struct SpendTrim {
    stream: Stream,
    /// Where the marks go (`SPEND_TRIMS`).
    js: jetstream::Context,
    /// The shard's partitions; `None` for all of them (the only shard).
    partitions: Option<Vec<u32>>,
    /// Trimmed below this already (by this owner).
    below: u64,
}

impl SpendTrim {
    pub fn new(stream: Stream, js: jetstream::Context, partitions: Option<Vec<u32>>) -> SpendTrim {
        SpendTrim {
            stream,
            js,
            partitions,
            below: 0,
        }
    }

    /// Purge the shard's partitions below `oldest_kept`, the position of
    /// the oldest base snapshot kept. A failure is said and left to the
    /// next checkpoint: nothing depends on a trim.
    pub(crate) async fn trim(&mut self, shard: &str, oldest_kept: u64) {
        if oldest_kept <= self.below.max(1) {
            return;
        }
        // The mark first: a purge without one could read as a gap to a
        // shard with no checkpoint; a mark without its purge costs nothing.
        for part in trim_parts(self.partitions.as_deref()) {
            if let Err(e) = self.mark(&part, oldest_kept).await {
                tracing::warn!(
                    shard,
                    part,
                    below = oldest_kept,
                    error = %e,
                    "SPEND trim not marked, so not done; the next checkpoint tries again"
                );
                return;
            }
        }
        let filters: Vec<String> = match &self.partitions {
            Some(partitions) => partitions.iter().map(|p| spend_subject(*p)).collect(),
            None => vec![SPEND_SUBJECTS.to_string()],
        };
        let mut purged = 0;
        for filter in filters {
            match self
                .stream
                .purge()
                .filter(filter.clone())
                .sequence(oldest_kept)
                .await
            {
                Ok(response) => purged += response.purged,
                Err(e) => {
                    tracing::warn!(
                        shard,
                        filter,
                        below = oldest_kept,
                        error = %e,
                        "SPEND trim failed; the next checkpoint tries again"
                    );
                    return;
                }
            }
        }
        self.below = oldest_kept;
        metrics::counter!(SPEND_TRIMMED_TOTAL, "shard" => shard.to_string()).increment(purged);
        metrics::gauge!(SPEND_TRIMMED_BELOW, "shard" => shard.to_string()).set(oldest_kept as f64);
        tracing::debug!(shard, below = oldest_kept, purged, "SPEND trimmed");
    }
}

impl SpendTrim {
    /// Write to `SPEND_TRIMS` that `part` is trimmed below `below`.
    async fn mark(&self, part: &str, below: u64) -> Result<(), async_nats::Error> {
        let publish = async {
            self.js
                .publish(spend_trim_subject(part), below.to_string().into())
                .await?
                .await?;
            Ok::<(), async_nats::Error>(())
        };
        tokio::time::timeout(MARK_TIMEOUT, publish).await?
    }
}

/// The parts of `SPEND` a shard's trims are marked under: each partition,
/// or `all` for the only shard.
pub fn trim_parts(owned: Option<&[u32]>) -> Vec<String> {
    match owned {
        Some(partitions) => partitions.iter().map(|p| p.to_string()).collect(),
        None => vec!["all".to_string()],
    }
}

/// The position a base snapshot's name states
/// (`<shard>/<id:020>-<seq:020>-e<epoch>.mdb`).
pub(crate) fn base_seq(key: &str) -> Option<u64> {
    let name = key.rsplit('/').next()?;
    if !name.ends_with(".mdb") {
        return None;
    }
    name.get(21..41)?.parse().ok()
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_base_s_name_states_its_position() {
        assert_eq!(
            super::base_seq("p3/00000000000000000012-00000000000000004711-e2.mdb"),
            Some(4711)
        );
        assert_eq!(
            super::base_seq("p3/00000000000000000012-00000000000000004711-e2.delta"),
            None
        );
        assert_eq!(super::base_seq("p3/garbage.mdb"), None);
    }
}
