//! The count behind the window, and the window's size, as pure state: what
//! this limiter published per partition that no report covers yet, and how
//! long the others' spend took (see the module above for the protocol).

use std::collections::VecDeque;
use std::time::Duration;

use adspend_common::nats::Progress;

/// Entries kept per partition; past it, a new message is merged into the
/// last entry (counted as applied only when the later sequence is), so
/// memory stays bounded while the aggregators are away for long.
const ENTRIES_PER_PARTITION: usize = 65_536;

/// The smallest the window gets when it follows the delay: a backlog still
/// moves while the aggregators are slow.
pub(crate) const MIN_WINDOW: u64 = 4_096;

/// Where the window starts when a backlog appears after none: a few
/// milliseconds of an aggregator's apply (1.5-3.6 million tuples/s on the
/// machines measured), not wherever it drifted while nothing competed; it
/// grows from there while the others' spend stays fresh.
pub(super) const ONSET_WINDOW: u64 = 16_384;

/// A backlog this soon after the last round that had one continues it
/// (unix ms): a source hovering about the lag threshold does not restart
/// the window at every crossing.
pub(super) const ONSET_AFTER_MS: i64 = 1_000;

/// The window: its bound, and when it follows the delay, its size now.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    /// The most tuples the backlogs may have unapplied; 0 turns it off.
    pub(crate) bound: u64,
    /// The delay the window keeps the oldest unapplied tuple under; `None`
    /// keeps the window at the bound.
    pub(crate) target: Option<Duration>,
}

impl Window {
    /// No window: nothing is held back.
    pub const OFF: Window = Window {
        bound: 0,
        target: None,
    };
}

/// Per-partition accounting; pure, so it is tested without NATS.
#[derive(Debug)]
pub(crate) struct Backlog {
    /// Per partition, published and not yet applied, in sequence order.
    published: Vec<VecDeque<Entry>>,
    /// Per partition: the highest applied sequence reported.
    applied: Vec<u64>,
    queued: u64,
    /// Tuples counted since the start.
    total: u64,
    heard: bool,
    window: Window,
    /// The window's size now (the bound unless it follows the delay).
    limit: u64,
    /// When the window last halved or grew (unix ms).
    last_change: Option<i64>,
    /// The current round's others' oldest input, stored at (unix ms).
    round_since: Option<i64>,
    /// When the last round with a backlog began (unix ms).
    last_backlog: Option<i64>,
}

/// One SPEND message (or several merged) not yet applied.
#[derive(Debug, Clone, Copy)]
struct Entry {
    seq: u64,
    tuples: u64,
    /// Since when its spend has waited (unix ms): its round's others'
    /// oldest input's stored time, or else its acknowledgement's time.
    since: i64,
    /// Whether `since` is the others' input (their delay, not the queue's).
    others: bool,
}

impl Backlog {
    pub(super) fn new(partitions: u32, window: Window) -> Self {
        Backlog {
            published: vec![VecDeque::new(); partitions as usize],
            applied: vec![0; partitions as usize],
            queued: 0,
            total: 0,
            heard: false,
            window,
            limit: window.bound,
            last_change: None,
            round_since: None,
            last_backlog: None,
        }
    }

    /// A round begins: `backlog` whether some source has a backlog in it,
    /// `others_since` when the oldest input message of the sources other
    /// than the backlogs in it was stored (unix ms); `None` when no source
    /// has a backlog, or the round has none of the others; `now` unix ms.
    /// A backlog after none for [`ONSET_AFTER_MS`] starts a window that
    /// follows the delay at [`ONSET_WINDOW`].
    pub(super) fn round(&mut self, backlog: bool, others_since: Option<i64>, now: i64) {
        if backlog {
            let onset = self
                .last_backlog
                .is_none_or(|last| now.saturating_sub(last) > ONSET_AFTER_MS);
            if onset && self.window.target.is_some() {
                self.limit =
                    ONSET_WINDOW.clamp(MIN_WINDOW.min(self.window.bound), self.window.bound);
                self.last_change = None;
            }
            self.last_backlog = Some(now);
        }
        self.round_since = others_since;
    }

    /// A SPEND message of `partition` acknowledged at `seq` (at `now`, unix
    /// ms), with `tuples`.
    pub(super) fn published(&mut self, partition: u32, seq: u64, tuples: u64, now: i64) {
        let Some(queue) = self.published.get_mut(partition as usize) else {
            return;
        };
        if seq <= self.applied[partition as usize] {
            return;
        }
        // Acknowledgements of one round arrive in order; a retried round
        // may repeat sequences already counted, which stay counted once.
        if queue.back().is_some_and(|last| last.seq >= seq) {
            return;
        }
        let entry = Entry {
            seq,
            tuples,
            since: self.round_since.unwrap_or(now),
            others: self.round_since.is_some(),
        };
        let full = queue.len() >= ENTRIES_PER_PARTITION;
        match queue.back_mut() {
            // The merged entry keeps the earlier time.
            Some(last) if full => {
                last.seq = seq;
                last.tuples += tuples;
                last.others |= entry.others;
            }
            _ => queue.push_back(entry),
        }
        self.queued += tuples;
        self.total += tuples;
    }

    /// A shard's report, received at `now` (unix ms): everything of its
    /// partitions up to `applied_seq` is applied.
    pub(super) fn progress(&mut self, progress: &Progress, now: i64) {
        self.heard = true;
        // The longest the others' spend applied now took.
        let mut took = None;
        match &progress.partitions {
            Some(partitions) => {
                for &p in partitions {
                    took = took.max(self.applied_through(p, progress.applied_seq, now));
                }
            }
            None => {
                for p in 0..self.published.len() as u32 {
                    took = took.max(self.applied_through(p, progress.applied_seq, now));
                }
            }
        }
        self.adapt(now, took);
    }

    /// Halve the window while the others' spend took (`took`, applied in
    /// this report), or the oldest unapplied tuple has waited, longer than
    /// the target; grow it by a quarter while both are under half of it;
    /// each at most once per half target.
    fn adapt(&mut self, now: i64, took: Option<i64>) {
        let Some(target) = self.window.target else {
            return;
        };
        let target = target.as_millis() as i64;
        if self
            .last_change
            .is_some_and(|at| now.saturating_sub(at) < target / 2)
        {
            return;
        }
        let waiting = self
            .published
            .iter()
            .filter_map(|q| q.front().map(|e| e.since))
            .min()
            .map_or(0, |since| now.saturating_sub(since));
        let waited = waiting.max(took.unwrap_or(0));
        let floor = MIN_WINDOW.min(self.window.bound);
        let limit = if waited > target {
            (self.limit / 2).max(floor)
        } else if waited <= target / 2 {
            (self.limit + self.limit / 4).clamp(floor, self.window.bound)
        } else {
            self.limit
        };
        if limit != self.limit {
            self.limit = limit;
            self.last_change = Some(now);
        }
    }

    /// Counts everything of `partition` up to `seq` as applied; returns
    /// the longest the others' spend among it took.
    fn applied_through(&mut self, partition: u32, seq: u64, now: i64) -> Option<i64> {
        let p = partition as usize;
        let (Some(applied), Some(queue)) = (self.applied.get_mut(p), self.published.get_mut(p))
        else {
            return None;
        };
        let mut took = None;
        // A shard restarting from a checkpoint reports a lower sequence
        // for a while; what was applied once stays counted as applied.
        *applied = (*applied).max(seq);
        while let Some(&entry) = queue.front() {
            if entry.seq > *applied {
                break;
            }
            queue.pop_front();
            self.queued -= entry.tuples;
            if entry.others {
                took = took.max(Some(now.saturating_sub(entry.since)));
            }
        }
        took
    }

    /// Tuples this limiter published that no report covers yet.
    pub(super) fn queued(&self) -> u64 {
        self.queued
    }

    /// The window's size now, in tuples.
    pub(super) fn limit(&self) -> u64 {
        self.limit
    }

    /// Whether any aggregator has reported.
    pub(super) fn heard(&self) -> bool {
        self.heard
    }

    /// Tuples counted since the start.
    pub(super) fn total(&self) -> u64 {
        self.total
    }
}

/// A report covering every partition up to `seq`.
#[cfg(test)]
pub(super) fn all(seq: u64) -> Progress {
    Progress {
        partitions: None,
        applied_seq: seq,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FIXED: Window = Window {
        bound: 1_000_000,
        target: None,
    };

    /// A window of 100,000 tuples that follows a 20 ms target.
    const FOLLOWING: Window = Window {
        bound: 100_000,
        target: Some(Duration::from_millis(20)),
    };

    /// A backlog whose times all are `at`.
    struct At {
        b: Backlog,
        at: i64,
    }

    impl At {
        fn new(partitions: u32) -> Self {
            At {
                b: Backlog::new(partitions, FIXED),
                at: 1_000,
            }
        }
        fn published(&mut self, partition: u32, seq: u64, tuples: u64) {
            self.b.published(partition, seq, tuples, self.at);
        }
        fn progress(&mut self, progress: &Progress) {
            self.b.progress(progress, self.at);
        }
        fn queued(&self) -> u64 {
            self.b.queued()
        }
        fn heard(&self) -> bool {
            self.b.heard()
        }
    }

    #[test]
    fn published_tuples_stay_queued_until_their_partition_reports_them() {
        let mut b = At::new(2);
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
        let mut b = At::new(1);
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
        let mut b = At::new(1);
        let n = ENTRIES_PER_PARTITION as u64 + 1_000;
        for seq in 1..=n {
            b.published(0, seq, 2);
        }
        assert_eq!(b.b.published[0].len(), ENTRIES_PER_PARTITION);
        assert_eq!(b.queued(), 2 * n);
        // The merged tail counts as applied only once all of it is.
        b.progress(&all(n - 1));
        assert_eq!(b.queued(), 2_002);
        b.progress(&all(n));
        assert_eq!(b.queued(), 0);
    }

    #[test]
    fn unknown_partitions_are_ignored() {
        let mut b = At::new(1);
        b.published(3, 5, 10);
        b.progress(&Progress {
            partitions: Some(vec![7]),
            applied_seq: 9,
        });
        assert_eq!(b.queued(), 0);
    }

    #[test]
    fn the_window_follows_the_delay_of_the_oldest_unapplied_tuple() {
        let ms = |n: i64| 1_000_000 + n;
        let mut b = Backlog::new(1, FOLLOWING);
        assert_eq!(b.limit(), 100_000, "starts at the bound");
        // Acknowledged at 0 and 5 ms, still unapplied at 30 ms: past the
        // target.
        b.published(0, 1, 50_000, ms(0));
        b.published(0, 2, 50_000, ms(5));
        b.progress(&all(0), ms(30));
        assert_eq!(b.limit(), 50_000);
        // Once per half target: a report 5 ms later changes nothing.
        b.progress(&all(0), ms(35));
        assert_eq!(b.limit(), 50_000);
        b.progress(&all(0), ms(40));
        assert_eq!(b.limit(), 25_000);
        // Halving stops at the floor.
        for n in 1..20 {
            b.progress(&all(0), ms(40 + 10 * n));
        }
        assert_eq!(b.limit(), MIN_WINDOW);
        // Applied: nothing waits, so the window grows back by quarters.
        b.progress(&all(2), ms(300));
        assert_eq!(b.limit(), MIN_WINDOW + MIN_WINDOW / 4);
        // Under the target but over half of it: it stays.
        b.published(0, 3, 10, ms(300));
        b.progress(&all(2), ms(315));
        assert_eq!(b.limit(), MIN_WINDOW + MIN_WINDOW / 4);
        b.progress(&all(3), ms(330));
        for n in 1..100 {
            b.progress(&all(3), ms(330 + 10 * n));
        }
        assert_eq!(b.limit(), 100_000, "grows back to the bound, not past it");
    }

    #[test]
    fn the_window_halves_when_the_others_spend_took_too_long() {
        let ms = |n: i64| 1_000_000 + n;
        let mut b = Backlog::new(1, FOLLOWING);
        // A backlog appears: the window starts at the onset size. A round
        // whose other sources' oldest input was stored at 0 ms, published
        // at 10 ms and applied at 12 ms: it took 12 ms, under the target
        // though over half of it, so the window stays.
        b.round(true, Some(ms(0)), ms(0));
        assert_eq!(b.limit(), ONSET_WINDOW);
        b.published(0, 1, 1_000, ms(10));
        b.progress(&all(1), ms(12));
        assert_eq!(b.limit(), ONSET_WINDOW);
        // Input stored at 20 ms, applied at 50 ms: 30 ms, past the target,
        // although its SPEND message waited only 5 ms.
        b.round(true, Some(ms(20)), ms(40));
        b.published(0, 2, 1_000, ms(45));
        b.progress(&all(2), ms(50));
        assert_eq!(b.limit(), ONSET_WINDOW / 2);
        // A round of the backlog alone is timed from its acknowledgement.
        b.round(true, None, ms(100));
        b.published(0, 3, 1_000, ms(100));
        b.progress(&all(3), ms(101));
        assert_eq!(b.limit(), ONSET_WINDOW / 2 + ONSET_WINDOW / 8);
    }

    #[test]
    fn a_backlog_after_none_starts_the_window_small() {
        let ms = |n: i64| 1_000_000 + n;
        let mut b = Backlog::new(1, FOLLOWING);
        // While nothing competes the window sits at the bound.
        b.round(false, None, ms(0));
        assert_eq!(b.limit(), 100_000);
        b.round(true, Some(ms(0)), ms(0));
        assert_eq!(b.limit(), ONSET_WINDOW, "a backlog starts small");
        // It grows while the others' spend is fresh, and a continuing
        // backlog does not start it again.
        for n in 1..=3 {
            b.round(true, Some(ms(10 * n)), ms(10 * n));
            b.published(0, n as u64, 10, ms(10 * n));
            b.progress(&all(n as u64), ms(10 * n + 1));
        }
        let grown = b.limit();
        assert!(grown > ONSET_WINDOW, "{grown}");
        b.round(true, None, ms(40));
        assert_eq!(b.limit(), grown);
        // A round without it, then the backlog again within a second: the
        // same backlog, hovering about the threshold; it goes on.
        b.round(false, None, ms(50));
        assert_eq!(b.limit(), grown);
        b.round(true, None, ms(40 + ONSET_AFTER_MS));
        assert_eq!(b.limit(), grown);
        // Over a second without one: the next starts small again.
        let last = ms(40 + ONSET_AFTER_MS);
        b.round(false, None, last + 500);
        b.round(true, None, last + ONSET_AFTER_MS + 1);
        assert_eq!(b.limit(), ONSET_WINDOW);
        // A fixed window is not moved by backlogs.
        let mut fixed = Backlog::new(1, FIXED);
        fixed.round(true, None, ms(0));
        assert_eq!(fixed.limit(), FIXED.bound);
    }

    #[test]
    fn a_fixed_window_stays_at_its_bound() {
        let mut b = Backlog::new(1, FIXED);
        b.published(0, 1, 10, 1_000);
        b.progress(&all(0), 61_000);
        assert_eq!(b.limit(), FIXED.bound);
    }
}
