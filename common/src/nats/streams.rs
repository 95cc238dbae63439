//! The streams every service agrees on, with the limits that bound them
//! (docs/RETENTION.md). A stream is created when missing; the service that
//! owns a stream's limits also brings an existing one up to date at its
//! start (a stream an older version made had none), changing only those
//! limits: subjects, storage, replicas and placement stay as they are.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use super::{
    ALERTS_DUPLICATE_WINDOW, ALERTS_PER_LIMIT, ALERTS_STREAM, ALERTS_SUBJECTS, DEADLETTER_STREAM,
    DEADLETTER_SUBJECTS, IMPRESSIONS_STREAM, IMPRESSIONS_SUBJECTS, SPEND_STREAM, SPEND_SUBJECTS,
    SPEND_TRIMS_STREAM, SPEND_TRIMS_SUBJECTS,
};
use crate::config::RetentionArgs;
use crate::error::{Error, Result};

/// The byte cap of `IMPRESSIONS` (`ADSPEND_INPUT_MAX_BYTES`). Its age bound
/// is not a stream limit: JetStream's `max_age` would remove input not yet
/// acknowledged, so the limiter purges what is acknowledged instead.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct InputLimits {
    /// 0: no cap of its own.
    pub max_bytes: u64,
}

impl InputLimits {
    pub fn from_args(args: &RetentionArgs) -> Self {
        InputLimits {
            max_bytes: args.input_max_bytes,
        }
    }
}

/// What `DEADLETTER` keeps: dead letters younger than `max_age`, the
/// newest `max_bytes` of them (the oldest go first at the cap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeadletterLimits {
    pub max_age: Duration,
    pub max_bytes: u64,
}

impl Default for DeadletterLimits {
    fn default() -> Self {
        DeadletterLimits {
            max_age: Duration::from_millis(604_800_000),
            max_bytes: 1 << 30,
        }
    }
}

impl DeadletterLimits {
    pub fn from_args(args: &RetentionArgs) -> Self {
        DeadletterLimits {
            max_age: Duration::from_millis(args.deadletter_retention_ms),
            max_bytes: args.deadletter_max_bytes,
        }
    }
}

/// The limits adspend sets on a stream, as the server states them (no cap
/// is -1, no age is zero).
#[derive(Clone, Debug, PartialEq)]
struct Managed {
    max_bytes: i64,
    max_age: Duration,
    discard: stream::DiscardPolicy,
}

impl Managed {
    fn of(config: &stream::Config) -> Self {
        Managed {
            max_bytes: if config.max_bytes > 0 {
                config.max_bytes
            } else {
                -1
            },
            max_age: config.max_age,
            discard: config.discard,
        }
    }

    fn set_on(&self, config: &mut stream::Config) {
        config.max_bytes = self.max_bytes;
        config.max_age = self.max_age;
        config.discard = self.discard;
    }

    /// How to set them by hand with the `nats` CLI.
    fn cli(&self, name: &str) -> String {
        let discard = match self.discard {
            stream::DiscardPolicy::New => "new",
            _ => "old",
        };
        format!(
            "nats stream edit {name} --max-bytes={} --max-age={}s --discard={discard}",
            self.max_bytes,
            self.max_age.as_secs()
        )
    }
}

/// Whether `ensure` brings an existing stream's limits up to date.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Existing {
    Keep,
    Update,
}

async fn ensure(
    js: &jetstream::Context,
    config: stream::Config,
    existing: Existing,
) -> Result<stream::Stream> {
    let name = config.name.clone();
    let mut stream = match js.get_or_create_stream(config.clone()).await {
        Ok(stream) => stream,
        // Another service made it between this one's look and its create,
        // with other limits (the limiter's settings, where an aggregator
        // creates with the defaults): use it as it is.
        Err(e) if made_meanwhile(&e) => js
            .get_stream(&name)
            .await
            .map_err(Error::jetstream(format!("stream info {name}")))?,
        Err(e) => return Err(Error::jetstream(format!("create stream {name}"))(e)),
    };
    if existing == Existing::Keep {
        return Ok(stream);
    }
    let info = stream.cached_info();
    let (have, want) = (Managed::of(&info.config), Managed::of(&config));
    if have == want {
        return Ok(stream);
    }
    // A cap below what the stream holds would make NATS remove its oldest
    // messages to fit, whatever the discard policy: never for input that
    // may not be acknowledged yet. The limiter tries again as it purges.
    if want.discard == stream::DiscardPolicy::New
        && want.max_bytes > 0
        && info.state.bytes > want.max_bytes as u64
    {
        tracing::warn!(
            stream = name,
            bytes = info.state.bytes,
            max_bytes = want.max_bytes,
            "the stream holds more than its byte cap: the cap is set once the limiter has \
             purged below it"
        );
        return Ok(stream);
    }
    let mut updated = info.config.clone();
    want.set_on(&mut updated);
    js.update_stream(updated)
        .await
        .map_err(Error::jetstream(format!(
            "update stream {name} (made by an older version, or with other limits) to \
         {want:?}: a NATS user without $JS.API.STREAM.UPDATE.{name} gets no answer (grant it \
         as deploy/nats-auth.conf does), and a server whose store cannot reserve the cap \
         refuses it (lower the cap or raise jetstream max_file_store); or set the limits \
         by hand: `{}` (docs/RETENTION.md)",
            want.cli(&name)
        )))?;
    tracing::info!(stream = name, was = ?have, now = ?want, "stream limits updated");
    stream
        .info()
        .await
        .map_err(Error::jetstream(format!("stream info {name}")))?;
    Ok(stream)
}

fn made_meanwhile(e: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NAME_EXIST
    )
}

/// `IMPRESSIONS`: written by ad servers, read by the limiter. `replicas`
/// applies when the stream is created (a JetStream cluster keeps that many
/// copies); an existing stream is used as it is.
pub async fn ensure_impressions(
    js: &jetstream::Context,
    replicas: usize,
) -> Result<stream::Stream> {
    ensure(js, impressions(replicas, None), Existing::Keep).await
}

/// [`ensure_impressions`] by its owner, the limiter: an existing stream
/// gets `limits` too. Capped, a full stream refuses publishers
/// (`discard: new`): backpressure on the ad servers, never input dropped.
pub async fn ensure_impressions_with(
    js: &jetstream::Context,
    replicas: usize,
    limits: &InputLimits,
) -> Result<stream::Stream> {
    ensure(js, impressions(replicas, Some(limits)), Existing::Update).await
}

fn impressions(replicas: usize, limits: Option<&InputLimits>) -> stream::Config {
    let capped = limits.is_some_and(|l| l.max_bytes > 0);
    stream::Config {
        name: IMPRESSIONS_STREAM.into(),
        subjects: vec![IMPRESSIONS_SUBJECTS.into()],
        storage: stream::StorageType::File,
        num_replicas: replicas,
        max_bytes: match limits {
            Some(l) if capped => l.max_bytes.min(i64::MAX as u64) as i64,
            _ => -1,
        },
        discard: if capped {
            stream::DiscardPolicy::New
        } else {
            stream::DiscardPolicy::Old
        },
        ..Default::default()
    }
}

/// `SPEND`: spend tuples and checkpoint markers, one subject per partition.
/// No acknowledgements are used on it; the aggregator tracks its position
/// and trims each of its partitions below the oldest checkpoint it keeps.
pub async fn ensure_spend(js: &jetstream::Context, replicas: usize) -> Result<stream::Stream> {
    ensure(
        js,
        stream::Config {
            name: SPEND_STREAM.into(),
            subjects: vec![SPEND_SUBJECTS.into()],
            storage: stream::StorageType::File,
            num_replicas: replicas,
            max_message_size: 8 * 1024 * 1024,
            ..Default::default()
        },
        Existing::Keep,
    )
    .await
}

/// `SPEND_TRIMS`: below which sequence each part of `SPEND` was trimmed,
/// the newest message of each subject only (one per partition at most).
pub async fn ensure_spend_trims(
    js: &jetstream::Context,
    replicas: usize,
) -> Result<stream::Stream> {
    ensure(
        js,
        stream::Config {
            name: SPEND_TRIMS_STREAM.into(),
            subjects: vec![SPEND_TRIMS_SUBJECTS.into()],
            storage: stream::StorageType::File,
            num_replicas: replicas,
            max_messages_per_subject: 1,
            discard: stream::DiscardPolicy::Old,
            ..Default::default()
        },
        Existing::Keep,
    )
    .await
}

/// `DEADLETTER`: rejected input with its reason; made with the default
/// limits when missing, an existing stream used as it is.
pub async fn ensure_deadletter(js: &jetstream::Context, replicas: usize) -> Result<stream::Stream> {
    ensure(
        js,
        deadletter(replicas, &DeadletterLimits::default()),
        Existing::Keep,
    )
    .await
}

/// [`ensure_deadletter`] by its owner, the limiter: an existing stream
/// gets `limits` too.
pub async fn ensure_deadletter_with(
    js: &jetstream::Context,
    replicas: usize,
    limits: &DeadletterLimits,
) -> Result<stream::Stream> {
    ensure(js, deadletter(replicas, limits), Existing::Update).await
}

fn deadletter(replicas: usize, limits: &DeadletterLimits) -> stream::Config {
    stream::Config {
        name: DEADLETTER_STREAM.into(),
        subjects: vec![DEADLETTER_SUBJECTS.into()],
        storage: stream::StorageType::File,
        num_replicas: replicas,
        max_age: limits.max_age,
        max_bytes: limits.max_bytes.min(i64::MAX as u64) as i64,
        // Bad input must never stop the pipeline: at the cap the oldest
        // dead letters go, the limiter's publishes still succeed.
        discard: stream::DiscardPolicy::Old,
        ..Default::default()
    }
}

/// `ALERTS`: budget alerts, one subject per limit, each crossing once (its
/// message id dedupes re-announcements; docs/BUDGET-ALERTS.md). No age
/// limit: the last alert of a limit must stay to be compared with, so the
/// pacer purges old alerts but each subject's last (docs/RETENTION.md).
pub async fn ensure_alerts(js: &jetstream::Context, replicas: usize) -> Result<stream::Stream> {
    ensure(
        js,
        stream::Config {
            name: ALERTS_STREAM.into(),
            subjects: vec![ALERTS_SUBJECTS.into()],
            storage: stream::StorageType::File,
            num_replicas: replicas,
            duplicate_window: ALERTS_DUPLICATE_WINDOW,
            max_messages_per_subject: ALERTS_PER_LIMIT,
            max_message_size: 4 * 1024,
            ..Default::default()
        },
        Existing::Keep,
    )
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_cap_makes_input_refuse_publishers() {
        let open = impressions(1, Some(&InputLimits { max_bytes: 0 }));
        assert_eq!(Managed::of(&open), Managed::of(&impressions(1, None)));
        assert_eq!(open.discard, stream::DiscardPolicy::Old);
        let capped = impressions(1, Some(&InputLimits { max_bytes: 4096 }));
        assert_eq!(capped.max_bytes, 4096);
        assert_eq!(capped.discard, stream::DiscardPolicy::New);
        assert_eq!(capped.max_age, Duration::ZERO, "input has no age limit");
    }

    #[test]
    fn the_server_s_unlimited_and_ours_compare_equal() {
        let mut server = impressions(1, None);
        server.max_bytes = 0;
        assert_eq!(Managed::of(&server), Managed::of(&impressions(1, None)));
        let limits = DeadletterLimits::default();
        let dead = deadletter(3, &limits);
        assert_eq!(dead.max_age, Duration::from_secs(7 * 24 * 3600));
        assert!(Managed::of(&dead)
            .cli("DEADLETTER")
            .contains("--max-age=604800s"));
    }
}
