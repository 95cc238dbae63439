//! Following the ledger stream: every pacer folds every commit, from the
//! stream's first, in order, and grants only once it has read as far as
//! the stream went when it started.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_nats::jetstream::{self, consumer, stream};
use futures::StreamExt;
use tokio::sync::{watch, Notify};
use tokio_util::sync::CancellationToken;

use super::{Batch, Ledger, LEASES_STREAM, LEASES_SUBJECT, LEDGER_MAX_AGE};

/// Create `LEASES` if it is missing (an existing one is used as it is).
pub(super) async fn ensure_stream(
    js: &jetstream::Context,
    replicas: usize,
) -> Result<stream::Stream, String> {
    js.get_or_create_stream(stream::Config {
        name: LEASES_STREAM.into(),
        subjects: vec![LEASES_SUBJECT.into()],
        storage: stream::StorageType::File,
        num_replicas: replicas,
        max_age: LEDGER_MAX_AGE,
        max_message_size: 4 * 1024 * 1024,
        ..Default::default()
    })
    .await
    .map_err(|e| format!("create stream {LEASES_STREAM}: {e}"))
}

/// Fold every commit of the ledger stream, from its first, in order; mark
/// the ledger ready once it has reached the stream's end as it was when
/// this began. Starts over (from the first commit not folded) whenever
/// the consumer fails.
pub(super) async fn follow(
    js: jetstream::Context,
    replicas: usize,
    ledger: Arc<Mutex<Ledger>>,
    folded: Arc<Notify>,
    ready: watch::Sender<bool>,
    shutdown: CancellationToken,
) {
    let mut warned = false;
    loop {
        let followed = follow_once(&js, replicas, &ledger, &folded, &ready, &shutdown).await;
        if shutdown.is_cancelled() {
            return;
        }
        if let Err(e) = followed {
            if !warned {
                tracing::warn!(error = %e, "lease ledger unavailable: lease requests are answered 503 until it is; retrying");
                warned = true;
            } else {
                tracing::debug!(error = %e, "lease ledger still unavailable");
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(Duration::from_secs(2)) => {}
        }
    }
}

async fn follow_once(
    js: &jetstream::Context,
    replicas: usize,
    ledger: &Mutex<Ledger>,
    folded: &Notify,
    ready: &watch::Sender<bool>,
    shutdown: &CancellationToken,
) -> Result<(), String> {
    let mut stream = ensure_stream(js, replicas).await?;
    let state = stream
        .info()
        .await
        .map_err(|e| format!("stream {LEASES_STREAM} info: {e}"))?
        .state
        .clone();
    let last = state.last_sequence;
    // Commits older than the stream's first have aged out (an hour after
    // they were written: their leases are long retired); there is nothing
    // to fold before it, and the next commit must follow `last`.
    let from = {
        let mut ledger = ledger.lock().unwrap_or_else(|e| e.into_inner());
        ledger.skip_to(state.first_sequence.saturating_sub(1).min(last));
        ledger.folded_seq() + 1
    };
    let consumer = stream
        .create_consumer(consumer::pull::OrderedConfig {
            deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                start_sequence: from,
            },
            ..Default::default()
        })
        .await
        .map_err(|e| format!("ledger consumer: {e}"))?;
    let mut messages = consumer
        .messages()
        .await
        .map_err(|e| format!("ledger consumer: {e}"))?;
    if from > last {
        ready.send_replace(true);
    }
    loop {
        let message = tokio::select! {
            _ = shutdown.cancelled() => return Ok(()),
            m = messages.next() => m,
        };
        let Some(message) = message else {
            return Err("ledger consumer ended".into());
        };
        let message = message.map_err(|e| format!("ledger consumer: {e}"))?;
        let seq = message
            .info()
            .map_err(|e| format!("ledger message info: {e}"))?
            .stream_sequence;
        match serde_json::from_slice::<Batch>(&message.payload) {
            Ok(batch) => ledger
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .fold(seq, &batch),
            // Not ours: nothing to fold, but the sequence is taken.
            Err(e) => {
                tracing::warn!(seq, error = %e, "unreadable lease ledger message skipped");
                ledger
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .fold(seq, &Batch::default());
            }
        }
        folded.notify_waiters();
        if seq >= last {
            ready.send_replace(true);
        }
    }
}
