//! The multipliers a limit was served at, as a step function of time: what
//! the lag guard needs to know about the spend it cannot see yet.
//!
//! The tick's sample alone is not enough: a limit the guard held at 0 when
//! the tick looked can be answered at 1 a moment later, as pushes arrive;
//! read as 0 until the next tick, that serving would be missing from the
//! in-flight estimate, and the cap would rise further on it. So decisions
//! note the largest multiplier they answer with, and the tick books that
//! for the interval it closes.
//!
//! Spend visible now was served about one lag ago, at the multiplier of
//! that time; the spend served since (at the multipliers since) is in
//! flight. The tick records each limit's multiplier once a second; the guard
//! reads back the multiplier of one lag ago (to turn the observed rate into
//! the rate at multiplier 1) and the multiplier's integral over the last lag
//! (to estimate the spend in flight).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Steps older than this are dropped (the first kept step still covers the
/// span): the guard looks back one lag, and the lag window is five minutes.
const KEEP_MS: i64 = 600_000;
/// Most steps kept per limit; past it the two oldest merge into one at the
/// larger multiplier (the in-flight estimate stays on the high side).
const STEPS_KEPT: usize = 128;
/// Smaller changes than this are not recorded.
const EPSILON: f64 = 1e-3;

#[derive(Debug, Default)]
pub(crate) struct Served {
    /// (from unix ms, multiplier), in time order; each holds until the next.
    steps: VecDeque<(i64, f64)>,
    /// Older steps were dropped: before the first kept step, its multiplier
    /// stands for what was served (rather than the caller's `before`).
    trimmed: bool,
    /// When the tick last recorded, unix ms; 0 = never.
    recorded_ms: i64,
    /// The largest multiplier answered since then, as f64 bits (the bits
    /// of non-negative floats order as the floats do).
    answered: AtomicU64,
}

impl Clone for Served {
    fn clone(&self) -> Self {
        Served {
            steps: self.steps.clone(),
            trimmed: self.trimmed,
            recorded_ms: self.recorded_ms,
            answered: AtomicU64::new(self.answered.load(Relaxed)),
        }
    }
}

impl Served {
    /// A decision answered with `multiplier` (decisions hold the state
    /// shared, hence the atomic).
    pub(crate) fn note(&self, multiplier: f64) {
        let bits = multiplier.clamp(0.0, 1.0).to_bits();
        self.answered.fetch_max(bits, Relaxed);
    }

    fn answered(&self) -> f64 {
        f64::from_bits(self.answered.load(Relaxed))
    }

    /// The tick at `now_ms`: the interval since the last tick was served at
    /// up to the largest multiplier answered in it; `multiplier` from now.
    pub(crate) fn record(&mut self, now_ms: i64, multiplier: f64) {
        let answered = f64::from_bits(self.answered.swap(0, Relaxed));
        if self.recorded_ms > 0 && answered > self.at(self.recorded_ms, 0.0) + EPSILON {
            self.push(self.recorded_ms, answered);
        }
        self.push(now_ms, multiplier);
        self.recorded_ms = now_ms;
    }

    fn push(&mut self, now_ms: i64, multiplier: f64) {
        let multiplier = multiplier.clamp(0.0, 1.0);
        if let Some(last) = self.steps.back_mut().filter(|(from, _)| *from == now_ms) {
            last.1 = last.1.max(multiplier);
            return;
        }
        if self
            .steps
            .back()
            .is_some_and(|&(_, m)| (m - multiplier).abs() < EPSILON)
        {
            return;
        }
        self.steps.push_back((now_ms, multiplier));
        while self.steps.len() >= 2 && self.steps[1].0 <= now_ms - KEEP_MS {
            self.steps.pop_front();
            self.trimmed = true;
        }
        if self.steps.len() > STEPS_KEPT {
            self.trimmed = true;
            let (from, first) = self.steps.pop_front().expect("more than one step");
            let second = self.steps.front_mut().expect("more than one step");
            *second = (from, first.max(second.1));
        }
    }

    /// The multiplier in force at `t_ms`; `before` ahead of the first step
    /// (what was served before anything was recorded).
    pub(crate) fn at(&self, t_ms: i64, before: f64) -> f64 {
        let before = self.before(before);
        self.steps_and_tail()
            .rev()
            .find(|&(from, _)| from <= t_ms)
            .map_or(before, |(_, m)| m)
    }

    /// The steps, then (when decisions answered higher since the last
    /// tick) a step at the last tick to the highest answer.
    fn steps_and_tail(&self) -> impl DoubleEndedIterator<Item = (i64, f64)> + '_ {
        let answered = self.answered();
        let tail = match self.steps.back() {
            Some(&(_, last)) if self.recorded_ms > 0 && answered > last + EPSILON => {
                Some((self.recorded_ms, answered))
            }
            _ => None,
        };
        self.steps.iter().copied().chain(tail)
    }

    fn before(&self, before: f64) -> f64 {
        match self.steps.front() {
            Some(&(_, first)) if self.trimmed => first,
            _ => before,
        }
    }

    /// The integral of the multiplier over `[from_ms, to_ms]`, in
    /// multiplier-milliseconds; `before` ahead of the first step.
    pub(crate) fn integral(&self, from_ms: i64, to_ms: i64, before: f64) -> f64 {
        if to_ms <= from_ms {
            return 0.0;
        }
        let mut total = 0.0;
        let mut cursor = from_ms;
        let mut current = self.before(before);
        for (start, m) in self.steps_and_tail() {
            if start > cursor {
                let end = start.min(to_ms);
                total += current * (end - cursor) as f64;
                cursor = end;
                if cursor >= to_ms {
                    return total;
                }
            }
            current = m;
        }
        total + current * (to_ms - cursor) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_multiplier_in_force_and_its_integral() {
        let mut served = Served::default();
        assert_eq!(served.at(5, 0.7), 0.7);
        assert_eq!(served.integral(0, 1_000, 0.7), 700.0);
        served.record(1_000, 1.0);
        served.record(2_000, 0.5);
        served.record(2_500, 0.5); // no change: not a step
        served.record(3_000, 0.0);
        assert_eq!(served.at(999, 0.7), 0.7);
        assert_eq!(served.at(1_000, 0.7), 1.0);
        assert_eq!(served.at(2_999, 0.7), 0.5);
        assert_eq!(served.at(10_000, 0.7), 0.0);
        // 0.7 for 500 ms, 1.0 for 1 s, 0.5 for 1 s, then 0.
        assert_eq!(served.integral(500, 4_000, 0.7), 350.0 + 1_000.0 + 500.0);
        assert_eq!(served.integral(1_500, 2_200, 0.7), 500.0 + 100.0);
        assert_eq!(served.integral(4_000, 5_000, 0.7), 0.0);
    }

    #[test]
    fn answers_above_the_tick_s_sample_count_for_the_interval() {
        let mut served = Served::default();
        served.record(1_000, 0.0);
        // Between ticks, decisions are answered at 1.
        served.note(0.5);
        served.note(1.0);
        assert_eq!(served.at(1_500, 0.0), 1.0);
        assert_eq!(served.integral(1_000, 1_500, 0.0), 500.0);
        // The next tick books the interval at 1, and samples 0 again.
        served.record(2_000, 0.0);
        assert_eq!(served.at(1_500, 0.0), 1.0);
        assert_eq!(served.at(2_000, 0.0), 0.0);
        assert_eq!(served.integral(0, 3_000, 0.0), 1_000.0);
        // Answers at or below the sample add nothing.
        served.note(0.0);
        served.record(3_000, 0.0);
        assert_eq!(served.integral(0, 4_000, 0.0), 1_000.0);
    }

    #[test]
    fn old_steps_go_but_the_span_stays_covered() {
        let mut served = Served::default();
        served.record(0, 1.0);
        served.record(1_000, 0.5);
        served.record(1_000 + KEEP_MS, 0.25);
        // The step from 1 s still covers the oldest instant asked about,
        // and stands for what came before it.
        assert_eq!(served.at(KEEP_MS, 0.0), 0.5);
        assert_eq!(served.at(0, 0.0), 0.5);
        let mut served = Served::default();
        for i in 0..(STEPS_KEPT as i64 + 10) {
            served.record(i, if i % 2 == 0 { 1.0 } else { 0.0 });
        }
        assert_eq!(served.steps.len(), STEPS_KEPT);
        // Merged steps keep the larger multiplier.
        assert_eq!(served.at(0, 0.0), 1.0);
    }
}
