//! NATS JetStream: connection and the streams every service agrees on.

use std::time::Duration;

use async_nats::jetstream::{self, stream};

use crate::error::{Error, Result};

pub const IMPRESSIONS_STREAM: &str = "IMPRESSIONS";
pub const IMPRESSIONS_SUBJECTS: &str = "impressions.>";
pub const SPEND_STREAM: &str = "SPEND";
pub const SPEND_SUBJECTS: &str = "spend.*";
pub const DEADLETTER_STREAM: &str = "DEADLETTER";
pub const DEADLETTER_SUBJECTS: &str = "deadletter.>";
/// Core NATS subject prefix for sum pushes (aggregator → pacer).
pub const SUMS_SUBJECT_PREFIX: &str = "adspend.sums";
/// Core NATS subject on which a pacer asks every aggregator for its full state.
pub const SUMS_RESYNC_SUBJECT: &str = "adspend.resync";

pub fn spend_subject(partition: u32) -> String {
    format!("spend.{partition}")
}

pub fn sums_subject(shard: &str) -> String {
    format!("{SUMS_SUBJECT_PREFIX}.{shard}")
}

/// Connect, failing with one clear error when the server cannot be reached.
/// Once connected, the client reconnects by itself forever: a NATS restart
/// must not stop the services.
pub async fn connect(url: &str, name: &str) -> Result<async_nats::Client> {
    let fail = |reason: String| Error::NatsConnect {
        url: url.to_string(),
        reason,
    };
    let options = async_nats::ConnectOptions::new()
        .name(name)
        .connection_timeout(Duration::from_secs(5))
        .max_reconnects(None)
        .request_timeout(Some(Duration::from_secs(10)));
    // A comma-separated list names several servers of one cluster.
    let servers: Vec<&str> = url
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let connect = options.connect(servers);
    match tokio::time::timeout(Duration::from_secs(10), connect).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(e)) => Err(fail(e.to_string())),
        Err(_) => Err(fail("timed out after 10s".into())),
    }
}

async fn ensure(js: &jetstream::Context, config: stream::Config) -> Result<stream::Stream> {
    let name = config.name.clone();
    js.get_or_create_stream(config)
        .await
        .map_err(|e| Error::jetstream(format!("create stream {name}"))(e.to_string()))
}

/// `IMPRESSIONS`: written by ad servers, read by the limiter. `replicas`
/// applies when the stream is created (a JetStream cluster keeps that many
/// copies); an existing stream is used as it is.
pub async fn ensure_impressions(
    js: &jetstream::Context,
    replicas: usize,
) -> Result<stream::Stream> {
    ensure(
        js,
        stream::Config {
            name: IMPRESSIONS_STREAM.into(),
            subjects: vec![IMPRESSIONS_SUBJECTS.into()],
            storage: stream::StorageType::File,
            num_replicas: replicas,
            ..Default::default()
        },
    )
    .await
}

/// `SPEND`: spend tuples and checkpoint markers, one subject per partition.
/// No acknowledgements are used on it; the aggregator tracks its position.
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
    )
    .await
}

/// `DEADLETTER`: rejected input with its reason.
pub async fn ensure_deadletter(js: &jetstream::Context, replicas: usize) -> Result<stream::Stream> {
    ensure(
        js,
        stream::Config {
            name: DEADLETTER_STREAM.into(),
            subjects: vec![DEADLETTER_SUBJECTS.into()],
            storage: stream::StorageType::File,
            num_replicas: replicas,
            ..Default::default()
        },
    )
    .await
}
