//! Recent usage of the limiter's capacity per source: a sliding window of
//! coarse buckets (a ring), so a share reflects the last few seconds and a
//! burst long past is forgotten.

use std::time::{Duration, Instant};

/// Buckets in the window.
const BUCKETS: usize = 10;

/// Usage (payload bytes handled) per lane over the last `window`.
#[derive(Debug)]
pub(super) struct UsageWindow {
    bucket_len: Duration,
    /// `rings[lane][bucket]`.
    rings: Vec<[u64; BUCKETS]>,
    /// Index of the current bucket and when it started.
    head: usize,
    head_started: Instant,
}

impl UsageWindow {
    pub(super) fn new(window: Duration, now: Instant) -> Self {
        Self {
            bucket_len: (window / BUCKETS as u32).max(Duration::from_millis(1)),
            rings: Vec::new(),
            head: 0,
            head_started: now,
        }
    }

    /// Move the head to `now`, clearing the buckets that fell out.
    fn advance(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.head_started);
        let steps = (elapsed.as_nanos() / self.bucket_len.as_nanos()) as usize;
        if steps == 0 {
            return;
        }
        for step in 1..=steps.min(BUCKETS) {
            let bucket = (self.head + step) % BUCKETS;
            for ring in &mut self.rings {
                ring[bucket] = 0;
            }
        }
        self.head = (self.head + steps) % BUCKETS;
        self.head_started += self.bucket_len * steps as u32;
    }

    pub(super) fn record(&mut self, lane: usize, amount: u64, now: Instant) {
        self.advance(now);
        if self.rings.len() <= lane {
            self.rings.resize(lane + 1, [0; BUCKETS]);
        }
        self.rings[lane][self.head] = self.rings[lane][self.head].saturating_add(amount);
    }

    /// Each lane's share of the window's total, for `lanes` lanes.
    pub(super) fn shares(&mut self, lanes: usize, now: Instant) -> Vec<f64> {
        self.advance(now);
        let sums: Vec<u64> = (0..lanes)
            .map(|i| self.rings.get(i).map_or(0, |r| r.iter().sum()))
            .collect();
        let total: u64 = sums.iter().sum();
        sums.iter()
            .map(|&s| {
                if total == 0 {
                    0.0
                } else {
                    s as f64 / total as f64
                }
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_follow_recent_usage_and_forget_old_usage() {
        let t0 = Instant::now();
        let mut w = UsageWindow::new(Duration::from_secs(1), t0);
        w.record(0, 900, t0);
        w.record(1, 100, t0);
        assert_eq!(w.shares(3, t0), vec![0.9, 0.1, 0.0]);
        // Half a window later lane 1 has used as much again.
        let t1 = t0 + Duration::from_millis(500);
        w.record(1, 800, t1);
        assert_eq!(w.shares(2, t1), vec![0.5, 0.5]);
        // A full window after the first burst only the second remains.
        let t2 = t0 + Duration::from_millis(1_050);
        assert_eq!(w.shares(2, t2), vec![0.0, 1.0]);
        // Long idle: everything forgotten.
        assert_eq!(w.shares(2, t0 + Duration::from_secs(60)), vec![0.0, 0.0]);
    }
}
