//! Noticing a new source as soon as its first message is in the stream.
//!
//! A lane reads only its own source, so nothing reads a message whose
//! source has no lane yet. The watch is an ordered consumer on the whole
//! stream (every impression subject) that receives headers only (no payload: a few dozen
//! bytes a message) and reports each source the first time it sees one.
//! It starts just past the stream's last sequence as of the listing the
//! scheduler opened its lanes from, so every source is either in that
//! listing or seen by the watch. The watch only says that a lane is
//! needed; the lane itself, a durable consumer reading its source from the
//! start of the stream, reads every message, so nothing depends on the
//! watch seeing a message exactly once.
//!
//! The periodic listing stays as a backstop (a watch that fell behind or
//! lost its server finds its way back by itself, meanwhile the listing
//! opens the lanes).

use std::collections::HashSet;
use std::time::Duration;

use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use async_nats::jetstream::stream::Stream as JsStream;
use futures::StreamExt;
use tokio::sync::mpsc;

use super::lanes::source_of;

/// The pause before the watch's consumer is created again after it ended
/// or could not be created.
const RETRY_AFTER: Duration = Duration::from_secs(1);
/// The pause after an error item from the watch's consumer.
const ERROR_PAUSE: Duration = Duration::from_millis(100);

/// New sources, in the order their first message was seen.
pub(super) struct Watch {
    rx: mpsc::Receiver<String>,
    task: tokio::task::JoinHandle<()>,
}

impl Watch {
    /// Watch the stream from sequence `from` on; `known` are the sources
    /// that already have a lane (not reported again). The consumer is
    /// named `<prefix>-watch-<unique>`: each limiter has its own, and a
    /// name keeps it within the limiter's `CONSUMER.CREATE.IMPRESSIONS.>`
    /// permission.
    pub(super) fn start(
        stream: &JsStream,
        prefix: &str,
        token: usize,
        from: u64,
        known: HashSet<String>,
    ) -> Watch {
        let (tx, rx) = mpsc::channel(64);
        let name = format!("{prefix}-watch-{:016x}", unique());
        let task = tokio::spawn(run(stream.clone(), name, token, from.max(1), known, tx));
        Watch { rx, task }
    }

    /// The next source not seen before. Cancel-safe; pending forever once
    /// the watch is gone (the listing still finds new sources).
    pub(super) async fn next(&mut self) -> String {
        match self.rx.recv().await {
            Some(source) => source,
            None => std::future::pending().await,
        }
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Different for every watch of every process (with overwhelming
/// probability): the process id and the time, hashed.
fn unique() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    xxhash_rust::xxh3::xxh3_64(format!("{}-{nanos}", std::process::id()).as_bytes())
}

async fn run(
    stream: JsStream,
    name: String,
    token: usize,
    mut from: u64,
    mut seen: HashSet<String>,
    tx: mpsc::Sender<String>,
) {
    loop {
        let consumer = stream
            .create_consumer(OrderedConfig {
                headers_only: true,
                deliver_policy: DeliverPolicy::ByStartSequence {
                    start_sequence: from,
                },
                name: Some(name.clone()),
                description: Some("adspend limiter: new sources".to_string()),
                ..Default::default()
            })
            .await;
        let messages = match consumer {
            Ok(consumer) => consumer.messages().await,
            Err(e) => {
                tracing::warn!(error = %e, from, "source watch could not start; retrying");
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            }
        };
        let mut messages = match messages {
            Ok(messages) => messages,
            Err(e) => {
                tracing::warn!(error = %e, from, "source watch could not start; retrying");
                tokio::time::sleep(RETRY_AFTER).await;
                continue;
            }
        };
        while let Some(message) = messages.next().await {
            let message = match message {
                Ok(message) => message,
                // The ordered consumer recreates itself after a gap or a
                // lost heartbeat; an error here is reported, and a pause
                // keeps a server that is away from making it spin.
                Err(e) => {
                    tracing::warn!(error = %e, "source watch error");
                    tokio::time::sleep(ERROR_PAUSE).await;
                    continue;
                }
            };
            if let Ok(info) = message.info() {
                from = info.stream_sequence + 1;
            }
            let source = source_of(&message.subject, token);
            if !seen.contains(source) {
                seen.insert(source.to_string());
                if tx.send(source.to_string()).await.is_err() {
                    return;
                }
            }
        }
        tracing::warn!(from, "source watch ended; restarting it");
        tokio::time::sleep(RETRY_AFTER).await;
    }
}
