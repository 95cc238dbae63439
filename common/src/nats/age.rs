//! Where a stream's messages become younger than a given instant: the
//! sequence an age-bounded purge stops at. JetStream stamps each message
//! with its leader's clock as it stores it, so the stamps follow the
//! sequence (up to a leader change between skewed clocks, which moves the
//! bound by that skew at most) and a binary search over sequences finds it.

use async_nats::jetstream::stream::{RawMessageErrorKind, Stream};

use crate::error::{Error, Result};

/// The first sequence at or after `from` whose message on `subjects` was
/// stored at or after `cutoff_ms` (unix milliseconds); `last_seq + 1` when
/// every message up to the stream's `last_seq` is older. Each step reads
/// one message (`$JS.API.STREAM.MSG.GET`): about log2 of the range.
/// `from` is where the last search ended (the bound only moves forward),
/// or the stream's first sequence.
pub async fn first_newer_than(
    stream: &Stream,
    subjects: &str,
    from: u64,
    last_seq: u64,
    cutoff_ms: i64,
) -> Result<u64> {
    let (mut low, mut high) = (from.max(1), last_seq.saturating_add(1));
    while low < high {
        let middle = low + (high - low) / 2;
        match stream
            .get_first_raw_message_by_subject(subjects, middle)
            .await
        {
            Ok(message) => {
                let stored_ms = (message.time.unix_timestamp_nanos() / 1_000_000) as i64;
                if stored_ms < cutoff_ms {
                    low = message.sequence + 1;
                } else {
                    high = middle;
                }
            }
            // Nothing at or after `middle`: the answer is at or below it.
            Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => high = middle,
            Err(e) => {
                return Err(Error::jetstream(format!(
                    "read a message of {subjects} at or after sequence {middle}"
                ))(e))
            }
        }
    }
    Ok(low)
}
