//! Where the limiter's input comes from: the single FIFO consumer, or one
//! lane per source pulled by the fair scheduler.
//!
//! - `lanes`: a durable consumer per source (`filter_subjects`), and the
//!   handover to and from the FIFO consumer.
//! - `watch`: reports a new source at its first message, so that its lane
//!   opens at once; the stream's subjects are also listed at the start and
//!   every [`LISTING_EVERY`].
//! - `input`: what the limiter's loop reads: the FIFO consumer or the
//!   scheduler below.
//! - `feed`: a lane's messages as a round sees them.
//! - `usage`: each source's usage of the limiter over a sliding window.
//! - `drr`: one round's decision (victims, offenders, deficit round robin).
//! - `round`: taking that round's messages from the lanes.
//!
//! A round gathers at most one chunk ([`ROUND_BYTES`] of payload, at most
//! `max_batch` messages) from the lanes
//! and hands it to the limiter as the FIFO loop did: one chunk, one round of
//! publishes, then the input acks. Markers keep their order with the
//! batches because chunks and markers still alternate in one loop.

mod drr;
mod feed;
mod input;
pub mod lanes;
mod round;
mod sources;
mod usage;
mod watch;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::pull;
use async_nats::jetstream::stream::Stream as JsStream;
use futures::FutureExt;

use crate::chunk::PullMessage;
use crate::config::Config;
use crate::downstream::Downstream;
use crate::error::Error;
use drr::{Deficits, LaneView};
use feed::Feed;
pub(crate) use input::Input;
pub(crate) use sources::SourceStat;

/// How often the stream's subjects are listed, to find a new source the
/// watch has not reported (it normally reports one at its first message).
pub(crate) const LISTING_EVERY: Duration = Duration::from_secs(5);
/// The usage window the shares are measured over.
pub(crate) const USAGE_WINDOW: Duration = Duration::from_secs(5);
/// Payload bytes one round takes at most (and `max_batch` messages): short
/// rounds, so a waiting source is never behind one huge chunk.
pub(crate) const ROUND_BYTES: u64 = 4 * 1024 * 1024;
/// Payload bytes the backlogs may take together in one round while other
/// sources compete (and the window is on): a round is what a newly arrived
/// message of another source may wait behind, so while a backlog drains the
/// rounds stay short (about 6,500 of the benchmark's events, a few
/// milliseconds of the limiter), and the backlog goes on round after round.
pub(crate) const BACKLOG_ROUND_BYTES: u64 = 512 * 1024;
/// While only held sources have messages, how often the scheduler looks
/// again (besides every progress report).
const HELD_RECHECK: Duration = Duration::from_millis(10);

async fn pull_stream(
    consumer: &async_nats::jetstream::consumer::PullConsumer,
    name: &str,
    max_batch: u32,
    max_bytes: Option<u64>,
) -> Result<pull::Stream, Error> {
    let mut builder = consumer.stream().max_messages_per_batch(max_batch as usize);
    if let Some(max_bytes) = max_bytes {
        builder = builder.max_bytes_per_batch(max_bytes as usize);
    }
    builder
        .heartbeat(Duration::from_secs(5))
        .messages()
        .await
        .map_err(|e| Error::Consumer {
            stream: adspend_common::nats::IMPRESSIONS_STREAM,
            consumer: name.to_string(),
            source: Box::new(e),
        })
}

/// How a lane's source was found.
#[derive(Debug, Clone, Copy)]
enum Found {
    Start,
    Watch,
    Listing,
}

impl Found {
    fn as_str(self) -> &'static str {
        match self {
            Found::Start => "start",
            Found::Watch => "watch",
            Found::Listing => "listing",
        }
    }
}

struct Lane {
    source: String,
    messages: Option<Feed>,
    view: LaneView,
    held_back: bool,
    /// Messages waiting at the last look (the view counts bytes).
    pending_messages: u64,
    /// Taken since the limiter started.
    messages_total: u64,
    bytes_total: u64,
}

pub struct Scheduler {
    stream: JsStream,
    prefix: String,
    token: usize,
    max_batch: u32,
    lag_threshold: Duration,
    lanes: Vec<Lane>,
    by_source: HashMap<String, usize>,
    usage: usage::UsageWindow,
    deficits: Deficits,
    watch: watch::Watch,
    /// Sources the watch reported whose lane is not open yet (an opening
    /// interrupted by the caller is finished on the next call).
    seen: Vec<String>,
    listing: tokio::time::Interval,
    published: Instant,
    /// Whether the last round enforced the fair order.
    intervening: bool,
    /// What the aggregators have not applied of this limiter's output.
    downstream: Downstream,
    /// Payload bytes taken since the start.
    bytes_taken: u64,
}

/// What woke the scheduler up.
enum Wake {
    Ready,
    Seen(String),
    Listing,
}

impl Scheduler {
    /// Open a lane for every source in the stream and watch for new ones;
    /// when a FIFO consumer is found (an older limiter, or `fifo`
    /// scheduling before), the lanes take over from its ack floor and it is
    /// deleted afterwards.
    pub(crate) async fn start(
        stream: &JsStream,
        config: &Config,
        downstream: Downstream,
    ) -> Result<Scheduler, Error> {
        Self::start_with_listing(stream, config, LISTING_EVERY, downstream).await
    }

    /// [`Scheduler::start`] with the stream's subjects listed every
    /// `listing_every` (the backstop of the watch).
    pub async fn start_with_listing(
        stream: &JsStream,
        config: &Config,
        listing_every: Duration,
        downstream: Downstream,
    ) -> Result<Scheduler, Error> {
        let now = Instant::now();
        let token = config.source_token as usize;
        // Everything up to `last` is in the first listing; the watch
        // reports sources from the next message on.
        let last = stream
            .clone()
            .info()
            .await
            .map_err(|e| Error::Consumer {
                stream: adspend_common::nats::IMPRESSIONS_STREAM,
                consumer: "(stream info)".to_string(),
                source: Box::new(e),
            })?
            .state
            .last_sequence;
        let initial = lanes::sources(stream, token).await?;
        let mut listing =
            tokio::time::interval_at(tokio::time::Instant::now() + listing_every, listing_every);
        listing.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut scheduler = Scheduler {
            stream: stream.clone(),
            prefix: config.consumer.clone(),
            token,
            max_batch: config.max_batch,
            lag_threshold: Duration::from_millis(config.fair_lag_ms),
            lanes: Vec::new(),
            by_source: HashMap::new(),
            usage: usage::UsageWindow::new(USAGE_WINDOW, now),
            deficits: Deficits::default(),
            watch: watch::Watch::start(
                stream,
                &config.consumer,
                token,
                last + 1,
                initial.iter().cloned().collect(),
            ),
            seen: Vec::new(),
            listing,
            published: now,
            intervening: false,
            downstream,
            bytes_taken: 0,
        };
        let takeover = lanes::takeover_from_fifo(stream, &config.consumer).await;
        for source in initial {
            scheduler.open(source, takeover, Found::Start).await?;
        }
        if let Some(start) = takeover {
            lanes::retire_fifo(stream, &config.consumer).await?;
            tracing::info!(
                start,
                lanes = scheduler.lanes.len(),
                "source lanes took over from the FIFO consumer"
            );
        }
        Ok(scheduler)
    }

    /// Open lanes for the sources in the stream that have none (and reopen
    /// ended ones).
    async fn list(&mut self) -> Result<(), Error> {
        for source in lanes::sources(&self.stream, self.token).await? {
            self.open(source, None, Found::Listing).await?;
        }
        Ok(())
    }

    /// Open the lanes of the sources the watch reported.
    async fn open_seen(&mut self) {
        while let Some(source) = self.seen.last().cloned() {
            match self.open(source, None, Found::Watch).await {
                Ok(()) => {
                    self.seen.pop();
                }
                Err(e) => {
                    // The listing finds the source again.
                    tracing::warn!(error = %e, "opening a new source's lane failed; the next listing retries");
                    self.seen.clear();
                }
            }
        }
    }

    /// Open `source`'s lane unless it is open: new, or reopened after it
    /// ended.
    async fn open(
        &mut self,
        source: String,
        start: Option<u64>,
        found: Found,
    ) -> Result<(), Error> {
        if lanes::filters(&source, self.token).is_empty() {
            return Ok(());
        }
        let index = self.by_source.get(&source).copied();
        if index.is_some_and(|i| self.lanes[i].messages.is_some()) {
            return Ok(());
        }
        let consumer =
            lanes::open_lane(&self.stream, &self.prefix, &source, self.token, start).await?;
        let name = lanes::lane_name(&self.prefix, &source);
        // A lane buffers about two rounds: a source that is held back
        // does not sit on much input (its ack wait runs meanwhile).
        let messages = pull_stream(&consumer, &name, self.max_batch, Some(2 * ROUND_BYTES)).await?;
        let messages = Some(Feed::new(messages));
        match index {
            Some(i) => self.lanes[i].messages = messages,
            None => {
                tracing::info!(
                    source,
                    consumer = name,
                    found = found.as_str(),
                    "new source lane"
                );
                self.by_source.insert(source.clone(), self.lanes.len());
                self.lanes.push(Lane {
                    source,
                    messages,
                    view: LaneView::default(),
                    held_back: false,
                    pending_messages: 0,
                    messages_total: 0,
                    bytes_total: 0,
                });
            }
        }
        Ok(())
    }

    /// Sources with a lane, in the order their lanes were opened.
    pub fn sources(&self) -> Vec<String> {
        self.lanes.iter().map(|l| l.source.clone()).collect()
    }

    /// Wait until some lane has a message, then take one round's chunk.
    /// Cancel-safe: messages are only taken after the last await, and a
    /// source the watch reported is kept until its lane is open.
    pub async fn next_chunk(&mut self) -> Vec<PullMessage> {
        self.open_seen().await;
        loop {
            let wake = {
                let mut waits: Vec<_> = self
                    .lanes
                    .iter_mut()
                    .filter_map(|l| l.messages.as_mut())
                    .filter(|m| !m.closed)
                    .map(|m| m.wait().boxed())
                    .collect();
                if waits.is_empty() {
                    waits.push(futures::future::pending().boxed());
                }
                let any = futures::future::select_all(waits);
                tokio::select! {
                    biased;
                    source = self.watch.next() => Wake::Seen(source),
                    _ = self.listing.tick() => Wake::Listing,
                    _ = any => Wake::Ready,
                }
            };
            match wake {
                Wake::Ready => {
                    let chunk = self.take_round();
                    if !chunk.is_empty() {
                        return chunk;
                    }
                    if self.lanes.iter().any(|l| l.held_back) {
                        // Only held sources have messages: wait for the
                        // aggregators (or a moment, for another source).
                        tokio::select! {
                            _ = self.downstream.changed() => {}
                            _ = tokio::time::sleep(HELD_RECHECK) => {}
                        }
                    }
                }
                Wake::Seen(source) => {
                    self.seen.push(source);
                    self.open_seen().await;
                }
                Wake::Listing => {
                    if let Err(e) = self.list().await {
                        tracing::warn!(error = %e, "source listing failed; retrying");
                    }
                }
            }
        }
    }

    /// Per source, as of the last round.
    pub(crate) fn stats(&self) -> Vec<SourceStat> {
        self.lanes
            .iter()
            .map(|l| SourceStat {
                source: l.source.clone(),
                usage_share: l.view.usage_share,
                lag_seconds: l.view.lag.as_secs_f64(),
                pending_bytes: l.view.pending,
                pending_messages: l.pending_messages,
                held_back: l.held_back,
                messages_total: l.messages_total,
                bytes_total: l.bytes_total,
            })
            .collect()
    }
}
