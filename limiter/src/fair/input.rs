//! The limiter's input as the loop sees it: the FIFO consumer's chunks
//! (leaving out what a lane handled before it took over), or the fair
//! scheduler's rounds.

use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::stream::Stream as JsStream;
use futures::stream::ReadyChunks;
use futures::StreamExt;

use super::{lanes, pull_stream, Scheduler, SourceStat};
use crate::chunk::PullMessage;
use crate::config::{Config, Scheduling};
use crate::downstream::Downstream;
use crate::error::Error;

/// The limiter's input: chunks of messages, each acknowledged by the caller.
pub(crate) enum Input {
    /// The FIFO consumer's chunks; messages its metadata says a lane
    /// handled before it took over are acknowledged and left out.
    Fifo {
        chunks: Box<ReadyChunks<pull::Stream>>,
        handled: lanes::Handled,
        token: usize,
    },
    Fair(Box<Scheduler>),
}

impl Input {
    pub(crate) async fn open(
        stream: &JsStream,
        config: &Config,
        downstream: Downstream,
    ) -> Result<Input, Error> {
        let token = config.source_token as usize;
        match config.scheduling {
            Scheduling::Fifo => {
                let (consumer, handled) = lanes::open_fifo(stream, &config.consumer, token).await?;
                let messages =
                    pull_stream(&consumer, &config.consumer, config.max_batch, None).await?;
                Ok(Input::Fifo {
                    chunks: Box::new(messages.ready_chunks(config.max_batch as usize)),
                    handled,
                    token,
                })
            }
            Scheduling::Fair => Ok(Input::Fair(Box::new(
                Scheduler::start(stream, config, downstream).await?,
            ))),
        }
    }

    /// The next chunk; `None` when the input ended.
    pub(crate) async fn next(&mut self) -> Option<Vec<PullMessage>> {
        match self {
            Input::Fifo {
                chunks,
                handled,
                token,
            } => loop {
                let mut chunk = chunks.next().await?;
                if !handled.is_empty() {
                    let (done, new): (Vec<_>, Vec<_>) = chunk.into_iter().partition(|m| {
                        m.as_ref()
                            .is_ok_and(|m| handled_by_lane(m, handled, *token))
                    });
                    for message in done.into_iter().flatten() {
                        // A lost ack only means this check runs again.
                        let _ = message.ack().await;
                    }
                    chunk = new;
                }
                if !chunk.is_empty() {
                    return Some(chunk);
                }
            },
            Input::Fair(scheduler) => Some(scheduler.next_chunk().await),
        }
    }

    /// Per source as of now, and whether the last round intervened; `None`
    /// with FIFO scheduling (one consumer, no sources).
    pub(crate) fn report(&mut self) -> Option<(Vec<SourceStat>, bool)> {
        match self {
            Input::Fifo { .. } => None,
            Input::Fair(scheduler) => Some(scheduler.report()),
        }
    }
}

fn handled_by_lane(
    message: &async_nats::jetstream::Message,
    handled: &lanes::Handled,
    token: usize,
) -> bool {
    let source = lanes::source_of(&message.subject, token);
    let seq = message.info().map_or(0, |i| i.stream_sequence);
    handled.get(source).is_some_and(|&floor| seq <= floor)
}
