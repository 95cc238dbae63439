//! One round: every lane's view, the plan (`drr`), and taking the planned
//! messages from the lanes into one chunk.

use std::time::{Duration, Instant};

use adspend_common::now_ms;

use super::drr::{self, LaneView};
use super::{sources, Scheduler, BACKLOG_ROUND_BYTES, ROUND_BYTES};
use crate::chunk::PullMessage;

impl Scheduler {
    pub(super) fn take_round(&mut self) -> Vec<PullMessage> {
        let now = Instant::now();
        let views = self.refresh(now);
        // The window in payload bytes, at the bytes per tuple seen so far
        // (none before anything was published), less what is handed out
        // and not yet published, and no more than a short round's worth.
        let in_flight = self.downstream.in_flight_bytes();
        let window = self.downstream.window().and_then(|(tuples, total)| {
            (total > 0).then(|| {
                let per_tuple = self.bytes_taken as f64 / total as f64;
                ((tuples as f64 * per_tuple) as u64)
                    .saturating_sub(in_flight)
                    .min(BACKLOG_ROUND_BYTES)
            })
        });
        let plan = drr::plan(
            &views,
            ROUND_BYTES,
            self.lag_threshold,
            window,
            &mut self.deficits,
        );
        if (0..views.len()).any(|i| plan.held[i] && plan.held_back(i, &views[i])) {
            metrics::counter!(crate::telemetry::LIMITER_CONGESTED_ROUNDS_TOTAL).increment(1);
        }
        let mut chunk = Vec::new();
        let mut chunk_bytes = 0;
        // While some source has a backlog: when the oldest message the
        // other sources have in this round was stored (the window follows
        // how long their spend takes, `crate::downstream`).
        let backlogs = &plan.backlogs;
        let windowed = backlogs.iter().any(|&b| b);
        let mut others_since: Option<i64> = None;
        let mut note = |i: usize, taken: &[PullMessage]| {
            if windowed && !backlogs[i] {
                let oldest = taken
                    .iter()
                    .filter_map(|m| m.as_ref().ok()?.info().ok())
                    .map(|info| (info.published.unix_timestamp_nanos() / 1_000_000) as i64)
                    .min();
                others_since = match (others_since, oldest) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                };
            }
        };
        for &(i, n) in &plan.takes {
            let before = chunk.len();
            chunk_bytes += self.take(i, n, &mut chunk, now);
            note(i, &chunk[before..]);
        }
        // The estimates may fall short of what is ready, and messages may
        // have arrived since the views were taken: fill the chunk, victims
        // first and offenders last.
        let mut fill: Vec<usize> = (0..self.lanes.len()).filter(|&i| !plan.held[i]).collect();
        fill.sort_by_key(|&i| (plan.classes[i], std::cmp::Reverse(views[i].lag), i));
        for i in fill {
            let room = ROUND_BYTES.saturating_sub(chunk_bytes);
            if room == 0 {
                break;
            }
            let before = chunk.len();
            chunk_bytes += self.take(i, room, &mut chunk, now);
            note(i, &chunk[before..]);
        }
        self.downstream.round(windowed, others_since);
        self.bytes_taken += chunk_bytes;
        for (i, lane) in self.lanes.iter_mut().enumerate() {
            lane.held_back = plan.held_back(i, &views[i]);
        }
        self.intervening = plan.intervening;
        if now.duration_since(self.published) >= sources::PUBLISH_EVERY {
            self.published = now;
            let stats = self.stats();
            sources::publish(&stats);
        }
        chunk
    }

    /// Every lane's view as of `now`: its usage share over the window, and
    /// what waits (from the head message) with its lag.
    pub(super) fn refresh(&mut self, now: Instant) -> Vec<LaneView> {
        let wall_ms = now_ms();
        let shares = self.usage.shares(self.lanes.len(), now);
        for (lane, share) in self.lanes.iter_mut().zip(shares) {
            lane.view = LaneView {
                usage_share: share,
                ..Default::default()
            };
            let Some(messages) = lane.messages.as_mut() else {
                continue;
            };
            // Already here: pending on the server does not count what was
            // delivered before, or redelivered.
            let here = messages.queued() as u64;
            lane.pending_messages = 0;
            match messages.head() {
                Some(Ok(head)) => {
                    // Planned in payload bytes: the head's size stands for
                    // the messages behind it.
                    let size = (head.payload.len() as u64).max(1);
                    let (pending, published_ms) = match head.info() {
                        Ok(info) => (
                            info.pending + 1,
                            (info.published.unix_timestamp_nanos() / 1_000_000) as i64,
                        ),
                        Err(_) => (1, wall_ms),
                    };
                    lane.pending_messages = pending + here;
                    lane.view.pending = (pending + here).saturating_mul(size);
                    lane.view.lag =
                        Duration::from_millis(wall_ms.saturating_sub(published_ms) as u64);
                }
                // An error item (a missed heartbeat and the like) is handed
                // over like a message; the handler logs it.
                Some(Err(_)) => {
                    lane.view.pending = 1;
                    lane.pending_messages = 1;
                }
                None => {}
            }
            if lane.messages.as_ref().is_some_and(|m| m.closed) {
                tracing::warn!(source = lane.source, "source lane ended; reopening it");
                lane.messages = None;
                self.seen.push(lane.source.clone());
            }
        }
        self.lanes.iter().map(|l| l.view).collect()
    }

    /// Take ready messages from lane `i` until `allotted` payload bytes
    /// (the last one may go past it) or `max_batch` messages in the chunk;
    /// record the lane's usage and return the bytes taken.
    fn take(&mut self, i: usize, allotted: u64, chunk: &mut Vec<PullMessage>, now: Instant) -> u64 {
        let lane = &mut self.lanes[i];
        let Some(messages) = lane.messages.as_mut() else {
            return 0;
        };
        let mut bytes = 0u64;
        while bytes < allotted && chunk.len() < self.max_batch as usize {
            match messages.pop() {
                Some(message) => {
                    if let Ok(m) = &message {
                        bytes += m.payload.len() as u64;
                        lane.messages_total += 1;
                    }
                    chunk.push(message);
                }
                _ => break,
            }
        }
        lane.bytes_total += bytes;
        if bytes > 0 {
            self.usage.record(i, bytes, now);
        }
        bytes
    }
}
