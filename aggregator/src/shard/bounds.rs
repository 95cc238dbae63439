//! The stream's bounds against a shard's position (DESIGN.md rule 4): a
//! `SPEND` that lost messages the shard still needs, or went back below
//! what it applied, is a loud stop, never a silent skip or double count.
//!
//! The shards' own trims ([`crate::checkpoint::trim`]) raise the stream's
//! first sequence past where a shard whose partitions are quiet must
//! replay from. Two things tell a trim from a lost head:
//! - each trim is marked first in `SPEND_TRIMS` (how far, per partition):
//!   a mark past the shard's position means its own messages that it still
//!   needs were trimmed (its checkpoint record was lost or is older than
//!   every base kept), a stop;
//! - where the stream's first sequence is past what the shard needs, a
//!   shard that has applied something finds its last applied message (one
//!   of its own) still there: a trim never reaches it, a loss of the
//!   stream's head does; a shard that has applied nothing (a partition
//!   never checkpointed) takes the raised head for the others' trims if
//!   any ran (its own are marked), for a loss if none did.

use std::time::{Duration, Instant};

use adspend_common::nats::spend_trim_subject;
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};

use crate::checkpoint::trim::trim_parts;
use crate::error::Error;
use crate::telemetry::STREAM_INTEGRITY_ERRORS_TOTAL;

/// How long a stream state below the applied sequence must last before the
/// log counts as gone backwards.
const BACKWARDS_CONFIRM: Duration = Duration::from_secs(5);

/// What a shard checks `SPEND` with.
#[derive(Clone)]
pub struct Bounds {
    pub stream: Stream,
    /// `SPEND_TRIMS`: how far each part of `SPEND` was trimmed.
    pub trims: Stream,
    /// The shard's partitions; `None` for all of them.
    pub owned: Option<Vec<u32>>,
}

impl Bounds {
    /// Refuse to go on where replay would silently skip or double count.
    /// Returns the stream's last sequence.
    pub async fn check(&mut self, last_applied: u64) -> Result<u64, Error> {
        let (mut first_seq, mut last_seq) = bounds(&mut self.stream).await?;
        // A JetStream cluster's stream leader that was just elected can
        // answer from a store still applying entries it has committed: a
        // view below what was already delivered. Only a shortfall that
        // lasts is real.
        let confirm_until = Instant::now() + BACKWARDS_CONFIRM;
        while last_seq < last_applied && Instant::now() < confirm_until {
            tracing::warn!(
                last_seq,
                last_applied,
                "SPEND reports less than was applied; reading its state again before stopping"
            );
            tokio::time::sleep(BACKWARDS_CONFIRM / 10).await;
            (first_seq, last_seq) = bounds(&mut self.stream).await?;
        }
        let needed = last_applied + 1;
        if last_seq < last_applied {
            metrics::counter!(STREAM_INTEGRITY_ERRORS_TOTAL, "kind" => "log_backwards")
                .increment(1);
            tracing::error!(
                last_seq,
                last_applied,
                "SPEND went back below what was applied; stopping"
            );
            return Err(Error::LogBackwards {
                last_seq,
                last_applied,
            });
        }
        // An empty stream reports first = last + 1; nothing is missing then
        // unless messages we still need were deleted.
        let trims_ran = self.trims_ran().await?;
        let own_trimmed_below = match trims_ran {
            true => trimmed_below(&self.trims, self.owned.as_deref()).await?,
            false => 0,
        };
        let head_lost = first_seq > needed
            && last_seq >= needed
            && !match last_applied {
                0 => trims_ran,
                applied => holds(&self.stream, applied).await?,
            };
        if head_lost || own_trimmed_below > needed {
            metrics::counter!(STREAM_INTEGRITY_ERRORS_TOTAL, "kind" => "retention_gap")
                .increment(1);
            let first_seq = match head_lost {
                true => first_seq,
                false => own_trimmed_below,
            };
            tracing::error!(
                first_seq,
                needed,
                last_applied,
                trimmed_below = own_trimmed_below,
                "SPEND lost messages not yet applied (retention gap); stopping"
            );
            return Err(Error::RetentionGap {
                first_seq,
                needed,
                last_applied,
            });
        }
        Ok(last_seq)
    }

    /// Whether any shard ever trimmed `SPEND` (and so marked it).
    async fn trims_ran(&mut self) -> Result<bool, Error> {
        let info = self
            .trims
            .info()
            .await
            .map_err(Error::consumer("SPEND_TRIMS info"))?;
        Ok(info.state.messages > 0)
    }
}

/// The highest sequence below which any of `owned`'s messages were
/// trimmed (0: never). The mark of `all` covers every partition (a shard
/// that ran alone before the partitions were shared out).
pub async fn trimmed_below(trims: &Stream, owned: Option<&[u32]>) -> Result<u64, Error> {
    let mut parts = trim_parts(owned);
    if owned.is_some() {
        parts.push("all".to_string());
    }
    let mut below = 0;
    for part in parts {
        match trims
            .get_last_raw_message_by_subject(&spend_trim_subject(&part))
            .await
        {
            Ok(message) => {
                let mark = std::str::from_utf8(&message.payload)
                    .ok()
                    .and_then(|s| s.trim().parse::<u64>().ok());
                // A mark that does not parse is read as the strictest.
                below = below.max(mark.unwrap_or(u64::MAX));
            }
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => {}
            Err(e) => return Err(Error::consumer("read SPEND_TRIMS")(e)),
        }
    }
    Ok(below)
}

/// Whether `stream` still holds the message at `seq` (an applied one;
/// never for 0, before anything was applied).
async fn holds(stream: &Stream, seq: u64) -> Result<bool, Error> {
    if seq == 0 {
        return Ok(false);
    }
    match stream.get_raw_message(seq).await {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(false),
        Err(e) => Err(Error::consumer("read the last applied message")(e)),
    }
}

/// The stream's first and last sequence.
pub(crate) async fn bounds(stream: &mut Stream) -> Result<(u64, u64), Error> {
    let info = stream
        .info()
        .await
        .map_err(Error::consumer("stream info"))?;
    Ok((info.state.first_sequence, info.state.last_sequence))
}
