//! A lane's pull stream, forwarded by a task of its own into a small
//! channel, so that a round can see and take what is ready without polling
//! the stream out of its task.

use async_nats::jetstream::consumer::pull;
use futures::StreamExt;
use tokio::sync::mpsc;

use crate::chunk::PullMessage;

/// A lane's messages: the one looked at (`head`) and those behind it.
pub(super) struct Feed {
    head: Option<PullMessage>,
    rx: mpsc::Receiver<PullMessage>,
    pub(crate) closed: bool,
    task: tokio::task::JoinHandle<()>,
}

impl Feed {
    pub(super) fn new(mut messages: pull::Stream) -> Feed {
        let (tx, rx) = mpsc::channel(64);
        let task = tokio::spawn(async move {
            while let Some(message) = messages.next().await {
                if tx.send(message).await.is_err() {
                    break;
                }
            }
        });
        Feed {
            head: None,
            rx,
            closed: false,
            task,
        }
    }

    /// Until a message is ready (or the feed ended). Cancel-safe.
    pub(super) async fn wait(&mut self) {
        if self.head.is_none() && !self.closed {
            match self.rx.recv().await {
                Some(message) => self.head = Some(message),
                None => self.closed = true,
            }
        }
    }

    pub(super) fn head(&mut self) -> Option<&PullMessage> {
        if self.head.is_none() {
            match self.rx.try_recv() {
                Ok(message) => self.head = Some(message),
                Err(mpsc::error::TryRecvError::Disconnected) => self.closed = true,
                Err(mpsc::error::TryRecvError::Empty) => {}
            }
        }
        self.head.as_ref()
    }

    /// Messages in the channel behind the head.
    pub(super) fn queued(&self) -> usize {
        self.rx.len()
    }

    pub(super) fn pop(&mut self) -> Option<PullMessage> {
        self.head();
        self.head.take()
    }
}

impl Drop for Feed {
    fn drop(&mut self) {
        self.task.abort();
    }
}
