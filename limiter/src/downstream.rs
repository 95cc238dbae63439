//! How much of what this limiter published to `SPEND` the aggregators have
//! not applied yet: the fair scheduler's view of the queue *behind* it.
//!
//! Fair rounds alone cannot keep a source's spend fresh when the limiter is
//! faster than the aggregators: a flooding source's tuples then pile up in
//! `SPEND`, which the aggregators apply in stream order, and every other
//! source's tuples wait behind them however fairly the limiter chose. So the
//! limiter counts, per partition, the tuples it published (stream sequence
//! from each publish acknowledgement) that no aggregator has reported as
//! applied (`adspend.progress.<shard>`, [`Progress`], sent by each shard on
//! every push tick and every 10 ms it moved). The bound is a window: sources
//! with a backlog may together take only what is left of it (bound minus
//! that count, in payload bytes at the bytes per tuple seen so far), and
//! nothing once it is spent, while the other sources go through (see
//! `fair::drr`); the flooding source goes on at the rate the aggregators
//! apply.
//!
//! Only this limiter's own tuples are counted, and only once some aggregator
//! has reported: without reports (an aggregator that does not send them, or
//! none running yet) nothing is held back. Reports are at most once; a lost
//! one is replaced by the next, and a stale count only holds an offender a
//! little longer, never loses or repeats anything (the input stays in
//! `IMPRESSIONS` until it is pulled).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use adspend_common::nats::{Progress, PROGRESS_SUBJECT_PREFIX};
use adspend_common::telemetry::LIMITER_DOWNSTREAM_QUEUED_TUPLES;
use futures::StreamExt;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::Error;

/// Entries kept per partition; past it, a new message is merged into the
/// last entry (counted as applied only when the later sequence is), so
/// memory stays bounded while the aggregators are away for long.
const ENTRIES_PER_PARTITION: usize = 65_536;

/// Per-partition accounting; pure, so it is tested without NATS.
#[derive(Debug, Default)]
pub struct Backlog {
    /// Per partition: `(stream seq, tuples)` published and not yet applied,
    /// in sequence order.
    published: Vec<VecDeque<(u64, u64)>>,
    /// Per partition: the highest applied sequence reported.
    applied: Vec<u64>,
    queued: u64,
    /// Tuples counted since the start.
    total: u64,
    heard: bool,
}

impl Backlog {
    pub fn new(partitions: u32) -> Self {
        Backlog {
            published: vec![VecDeque::new(); partitions as usize],
            applied: vec![0; partitions as usize],
            queued: 0,
            total: 0,
            heard: false,
        }
    }

    /// A SPEND message of `partition` acknowledged at `seq`, with `tuples`.
    pub fn published(&mut self, partition: u32, seq: u64, tuples: u64) {
        let Some(queue) = self.published.get_mut(partition as usize) else {
            return;
        };
        if seq <= self.applied[partition as usize] {
            return;
        }
        // Acknowledgements of one round arrive in order; a retried round
        // may repeat sequences already counted, which stay counted once.
        if queue.back().is_some_and(|&(last, _)| last >= seq) {
            return;
        }
        let full = queue.len() >= ENTRIES_PER_PARTITION;
        match queue.back_mut() {
            Some(last) if full => *last = (seq, last.1 + tuples),
            _ => queue.push_back((seq, tuples)),
        }
        self.queued += tuples;
        self.total += tuples;
    }

    /// A shard's report: everything of its partitions up to `applied_seq`
    /// is applied.
    pub fn progress(&mut self, progress: &Progress) {
        self.heard = true;
        match &progress.partitions {
            Some(partitions) => {
                for &p in partitions {
                    self.applied_through(p, progress.applied_seq);
                }
            }
            None => {
                for p in 0..self.published.len() as u32 {
                    self.applied_through(p, progress.applied_seq);
                }
            }
        }
    }

    fn applied_through(&mut self, partition: u32, seq: u64) {
        let p = partition as usize;
        let (Some(applied), Some(queue)) = (self.applied.get_mut(p), self.published.get_mut(p))
        else {
            return;
        };
        // A shard restarting from a checkpoint reports a lower sequence
        // for a while; what was applied once stays counted as applied.
        *applied = (*applied).max(seq);
        while let Some(&(s, tuples)) = queue.front() {
            if s > *applied {
                break;
            }
            queue.pop_front();
            self.queued -= tuples;
        }
    }

    /// Tuples this limiter published that no report covers yet.
    pub fn queued(&self) -> u64 {
        self.queued
    }

    /// Whether any aggregator has reported.
    pub fn heard(&self) -> bool {
        self.heard
    }

    /// Tuples counted since the start.
    pub fn total(&self) -> u64 {
        self.total
    }
}

/// The backlog shared between the publish path, the reports' subscriber
/// and the scheduler.
#[derive(Clone)]
pub struct Downstream {
    backlog: Arc<Mutex<Backlog>>,
    changed: Arc<Notify>,
    /// The window: tuples this limiter may have published and not yet
    /// applied before backlogs wait; 0 turns it off.
    bound: u64,
}

impl Downstream {
    pub fn new(partitions: u32, bound: u64) -> Self {
        Downstream {
            backlog: Arc::new(Mutex::new(Backlog::new(partitions))),
            changed: Arc::new(Notify::new()),
            bound,
        }
    }

    /// Follow the aggregators' reports until `cancel`.
    pub async fn follow(
        &self,
        client: &async_nats::Client,
        cancel: CancellationToken,
    ) -> Result<(), Error> {
        let subject = format!("{PROGRESS_SUBJECT_PREFIX}.>");
        let mut reports =
            client
                .subscribe(subject.clone())
                .await
                .map_err(|e| Error::Subscribe {
                    subject,
                    source: Box::new(e),
                })?;
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                let message = tokio::select! {
                    _ = cancel.cancelled() => return,
                    m = reports.next() => m,
                };
                let Some(message) = message else { return };
                match Progress::decode(&message.payload) {
                    Ok(progress) => {
                        this.backlog
                            .lock()
                            .expect("backlog lock")
                            .progress(&progress);
                        this.changed.notify_waiters();
                    }
                    Err(e) => tracing::debug!(
                        subject = %message.subject,
                        error = %e,
                        "progress report not understood; ignored"
                    ),
                }
            }
        });
        Ok(())
    }

    pub fn published(&self, partition: u32, seq: u64, tuples: u64) {
        if self.bound == 0 {
            return;
        }
        self.backlog
            .lock()
            .expect("backlog lock")
            .published(partition, seq, tuples);
    }

    /// What is left of the window, in tuples, and the tuples published
    /// since the start (for the scheduler's bytes per tuple); `None` when
    /// there is no window (turned off, or no aggregator has reported).
    pub fn window(&self) -> Option<(u64, u64)> {
        let backlog = self.backlog.lock().expect("backlog lock");
        metrics::gauge!(LIMITER_DOWNSTREAM_QUEUED_TUPLES).set(backlog.queued() as f64);
        (self.bound > 0 && backlog.heard())
            .then(|| (self.bound.saturating_sub(backlog.queued()), backlog.total()))
    }

    /// Resolves at the next report.
    pub async fn changed(&self) {
        self.changed.notified().await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all(seq: u64) -> Progress {
        Progress {
            partitions: None,
            applied_seq: seq,
        }
    }

    #[test]
    fn published_tuples_stay_queued_until_their_partition_reports_them() {
        let mut b = Backlog::new(2);
        b.published(0, 10, 100);
        b.published(1, 11, 50);
        b.published(0, 12, 7);
        assert_eq!(b.queued(), 157);
        assert!(!b.heard());
        // Partition 1's shard is past 11; partition 0's is not past 10.
        b.progress(&Progress {
            partitions: Some(vec![1]),
            applied_seq: 11,
        });
        assert_eq!(b.queued(), 107);
        assert!(b.heard());
        b.progress(&Progress {
            partitions: Some(vec![0]),
            applied_seq: 10,
        });
        assert_eq!(b.queued(), 7);
        b.progress(&all(12));
        assert_eq!(b.queued(), 0);
    }

    #[test]
    fn a_restarted_shard_reporting_less_does_not_count_tuples_again() {
        let mut b = Backlog::new(1);
        b.published(0, 5, 10);
        b.progress(&all(5));
        b.progress(&all(3));
        assert_eq!(b.queued(), 0);
        // Acknowledged at or below what is applied: already in the sums.
        b.published(0, 4, 10);
        assert_eq!(b.queued(), 0);
        b.published(0, 9, 10);
        // A retried round acknowledged again is counted once.
        b.published(0, 9, 10);
        assert_eq!(b.queued(), 10);
    }

    #[test]
    fn a_long_outage_is_counted_in_bounded_memory() {
        let mut b = Backlog::new(1);
        let n = ENTRIES_PER_PARTITION as u64 + 1_000;
        for seq in 1..=n {
            b.published(0, seq, 2);
        }
        assert_eq!(b.published[0].len(), ENTRIES_PER_PARTITION);
        assert_eq!(b.queued(), 2 * n);
        // The merged tail counts as applied only once all of it is.
        b.progress(&all(n - 1));
        assert_eq!(b.queued(), 2_002);
        b.progress(&all(n));
        assert_eq!(b.queued(), 0);
    }

    #[test]
    fn unknown_partitions_are_ignored() {
        let mut b = Backlog::new(1);
        b.published(3, 5, 10);
        b.progress(&Progress {
            partitions: Some(vec![7]),
            applied_seq: 9,
        });
        assert_eq!(b.queued(), 0);
    }

    #[test]
    fn the_window_needs_a_report_and_a_bound() {
        let d = Downstream::new(1, 1_000);
        d.published(0, 1, 300);
        assert_eq!(d.window(), None, "no aggregator has reported yet");
        d.backlog.lock().unwrap().progress(&all(0));
        assert_eq!(d.window(), Some((700, 300)));
        d.published(0, 2, 900);
        assert_eq!(d.window(), Some((0, 1_200)), "spent, not negative");
        d.backlog.lock().unwrap().progress(&all(1));
        assert_eq!(d.window(), Some((100, 1_200)));
        let off = Downstream::new(1, 0);
        off.published(0, 1, 500);
        off.backlog.lock().unwrap().progress(&all(0));
        assert_eq!(off.window(), None, "a bound of 0 turns it off");
    }
}
