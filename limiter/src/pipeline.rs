//! From read to published: the chunks the loop reads are mapped (decoded,
//! validated, mapped through the catalog, encoded) and then published in
//! the order they were read, either in the loop itself (one worker) or on
//! up to `ADSPEND_LIMITER_WORKERS` threads of the blocking pool while one
//! task publishes the mapped chunks in turn.

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::chunk::{Limiter, Mapped, Mapping, PullMessage};
use crate::fair::ROUND_BYTES;

/// What the publisher does next, in the order the loop read it.
pub(crate) enum Step {
    /// A chunk's mapping, and its input's payload bytes (in flight for the
    /// downstream window until it is done with).
    Chunk(Pending, u64),
    /// A checkpoint marker to every partition.
    Markers,
}

/// A chunk being mapped on a thread of its own, or mapped already.
pub(crate) enum Pending {
    Thread(JoinHandle<Option<Mapped>>),
    Done(Option<Box<Mapped>>),
}

/// Where the loop's steps go: performed in the loop itself, one after the
/// other, with one worker (a thread of its own would only add hand-offs
/// there), or queued for the task that publishes them in order while
/// further chunks are mapped.
pub(crate) enum Sink {
    Inline(Box<Limiter>),
    Queue(mpsc::Sender<Step>),
}

/// Room for one step: in the loop itself, or a place in the queue.
pub(crate) enum Room {
    Inline,
    Queue(mpsc::OwnedPermit<Step>),
}

impl Sink {
    /// With more than one worker, the task that publishes the queue and
    /// the sink that feeds it; with one, the loop publishes. The queue
    /// holds one step fewer than there are workers: with the one the
    /// publisher waits on, `workers` chunks are mapped at once, and input
    /// read meanwhile joins what the loop holds.
    pub(crate) fn new(
        workers: usize,
        limiter: Limiter,
        tasks: &tokio_util::task::TaskTracker,
    ) -> (Sink, Option<JoinHandle<()>>) {
        if workers > 1 {
            let (steps, queued) = mpsc::channel(workers - 1);
            let publishing = tasks.spawn(publish_in_order(limiter, queued));
            (Sink::Queue(steps), Some(publishing))
        } else {
            (Sink::Inline(Box::new(limiter)), None)
        }
    }

    /// Map `chunk` as this sink does it.
    pub(crate) fn map(&self, mapping: &Mapping, chunk: Vec<PullMessage>) -> Pending {
        match self {
            Sink::Inline(_) => Pending::Done(mapping.map_chunk(chunk).map(Box::new)),
            Sink::Queue(_) => {
                let mapping = mapping.clone();
                Pending::Thread(tokio::task::spawn_blocking(move || {
                    mapping.map_chunk(chunk)
                }))
            }
        }
    }

    /// Wait for room for one step (cancel safe; owns what it waits on, so
    /// the sink stays free meanwhile). `Err` once the publisher is gone.
    pub(crate) fn room(&self) -> impl std::future::Future<Output = Result<Room, ()>> + 'static {
        let steps = match self {
            Sink::Inline(_) => None,
            Sink::Queue(steps) => Some(steps.clone()),
        };
        async move {
            match steps {
                None => Ok(Room::Inline),
                Some(steps) => steps.reserve_owned().await.map(Room::Queue).map_err(|_| ()),
            }
        }
    }

    /// Map `chunk` and perform or queue it in `room`.
    pub(crate) async fn hand_on(
        &mut self,
        room: Room,
        mapping: &Mapping,
        chunk: Vec<PullMessage>,
        bytes: u64,
    ) {
        let step = Step::Chunk(self.map(mapping, chunk), bytes);
        match (self, room) {
            (_, Room::Queue(permit)) => {
                permit.send(step);
            }
            (Sink::Inline(limiter), Room::Inline) => perform(limiter, step).await,
            (Sink::Queue(_), Room::Inline) => unreachable!("a queue gives queue room"),
        }
    }

    /// Perform or queue `step`; false once the publisher is gone or
    /// shutdown came while it waited for room.
    pub(crate) async fn put(&mut self, step: Step, shutdown: &CancellationToken) -> bool {
        match self {
            Sink::Inline(limiter) => {
                perform(limiter, step).await;
                true
            }
            Sink::Queue(steps) => tokio::select! {
                sent = steps.send(step) => sent.is_ok(),
                _ = shutdown.cancelled() => false,
            },
        }
    }
}

/// Publish one step's output (and acknowledge its input).
async fn perform(limiter: &mut Limiter, step: Step) {
    match step {
        Step::Markers => limiter.publish_markers().await,
        Step::Chunk(pending, bytes) => {
            let mapped = match pending {
                Pending::Done(mapped) => mapped.map(|mapped| *mapped),
                Pending::Thread(mapping) => mapping.await.unwrap_or_else(|e| {
                    // Its input stays unacknowledged and is redelivered.
                    tracing::error!(error = %e, "mapping a chunk failed");
                    None
                }),
            };
            if let Some(mapped) = mapped {
                limiter.complete(mapped).await;
            }
            limiter.downstream.completed(bytes);
        }
    }
}

/// Publish each step's output in turn: the per-partition order of `SPEND`
/// is the order the chunks were read in, whatever thread mapped them.
async fn publish_in_order(mut limiter: Limiter, mut steps: mpsc::Receiver<Step>) {
    while let Some(step) = steps.recv().await {
        perform(&mut limiter, step).await;
    }
}

/// Input read and not yet handed on, in the order it was read: the chunks
/// that arrived while the sink had no room, joined into one, up to
/// `max_messages` messages or [`ROUND_BYTES`] of payload (a chunk's bound;
/// one chunk alone may be larger, as it was read).
pub(crate) struct Held {
    messages: Vec<PullMessage>,
    bytes: u64,
    max_messages: usize,
}

impl Held {
    pub(crate) fn new(max_messages: usize) -> Held {
        Held {
            messages: Vec::new(),
            bytes: 0,
            max_messages,
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// Whether more input may join.
    pub(crate) fn has_room(&self) -> bool {
        self.messages.len() < self.max_messages && self.bytes < ROUND_BYTES
    }

    pub(crate) fn add(&mut self, chunk: Vec<PullMessage>, bytes: u64) {
        if self.messages.is_empty() {
            self.messages = chunk;
        } else {
            self.messages.extend(chunk);
        }
        self.bytes += bytes;
    }

    /// What is held, and its payload bytes; `None` when nothing is.
    pub(crate) fn take(&mut self) -> Option<(Vec<PullMessage>, u64)> {
        if self.messages.is_empty() {
            return None;
        }
        let bytes = std::mem::take(&mut self.bytes);
        Some((std::mem::take(&mut self.messages), bytes))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(n: usize) -> Vec<PullMessage> {
        (0..n)
            .map(|_| Err(async_nats::jetstream::consumer::pull::MessagesErrorKind::Pull.into()))
            .collect()
    }

    #[test]
    fn held_input_joins_in_order_up_to_a_chunks_bound() {
        let mut held = Held::new(5);
        assert!(held.is_empty() && held.has_room() && held.take().is_none());
        held.add(chunk(3), 10);
        assert!(held.has_room());
        held.add(chunk(3), 20);
        assert!(!held.has_room(), "six messages are past five");
        let (messages, bytes) = held.take().expect("held");
        assert_eq!((messages.len(), bytes), (6, 30));
        assert!(held.is_empty() && held.has_room());
        held.add(chunk(1), ROUND_BYTES);
        assert!(!held.has_room(), "a round's bytes are the bound");
    }
}
