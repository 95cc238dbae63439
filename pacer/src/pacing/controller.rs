//! Per-limit pacing: a PI controller on the cumulative error against the
//! plan, with a rate term, bounded steps (stronger when over-pacing) and
//! anti-windup; and the lag guard, which caps the multiplier so that the
//! spend in flight but not yet visible cannot overrun the remaining budget.

/// Tuning of the controller; steps are per minute of elapsed time.
#[derive(Clone, Copy, Debug)]
pub struct Gains {
    pub(crate) kp: f64,
    pub(crate) ki: f64,
    pub(crate) kr: f64,
    /// Largest increase of the multiplier per minute (LinkedIn-style ±10%).
    pub(crate) max_up_per_min: f64,
    /// Largest decrease per minute: over-pacing is corrected faster.
    pub(crate) max_down_per_min: f64,
    /// Extra gain on corrections downwards.
    pub(crate) over_gain: f64,
}

impl Default for Gains {
    fn default() -> Self {
        Gains {
            kp: 2.0,
            ki: 0.2,
            kr: 0.05,
            max_up_per_min: 0.10,
            max_down_per_min: 0.30,
            over_gain: 2.0,
        }
    }
}

/// Which pacing the pacer serves (`ADSPEND_PACER_ALGORITHM`): its own, or
/// the LinkedIn-style baseline it is benchmarked against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Algorithm {
    /// The PI controller over the learned shape, the lag guard, exhaustion
    /// at one typical event.
    #[default]
    Adspend,
    /// A pass-through rate per daily limit, x0.9 a minute while the visible
    /// spend is ahead of an even plan, x1.1 (up to 1, at least 0.01)
    /// otherwise; no lag guard; stops when the visible spend reaches the
    /// budget.
    Baseline,
}

/// One baseline step of `dt_min` minutes: the new pass-through rate.
pub(crate) fn baseline_step(pass: f64, even_plan: f64, spent: f64, dt_min: f64) -> f64 {
    if spent > even_plan {
        pass * 0.9f64.powf(dt_min)
    } else {
        (pass * 1.1f64.powf(dt_min)).clamp(0.01, 1.0)
    }
}

/// What the controller sees, as shares of the budget.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Observation {
    /// Planned share spent by now.
    pub(crate) plan: f64,
    /// Share actually spent.
    pub(crate) spent: f64,
    /// Planned and observed spend rate, shares per minute.
    pub(crate) plan_rate: f64,
    pub(crate) rate: f64,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Controller {
    pub(crate) multiplier: f64,
    integral: f64,
}

impl Default for Controller {
    fn default() -> Self {
        Controller {
            multiplier: 1.0,
            integral: 0.0,
        }
    }
}

impl Controller {
    /// Advance by `dt_min` minutes; returns the new multiplier in [0, 1].
    pub(crate) fn step(&mut self, obs: &Observation, dt_min: f64, gains: &Gains) -> f64 {
        if dt_min <= 0.0 {
            return self.multiplier;
        }
        let error = obs.plan - obs.spent; // > 0: behind plan
        let rate_error = if obs.plan_rate > 0.0 {
            ((obs.plan_rate - obs.rate) / obs.plan_rate).clamp(-1.0, 1.0)
        } else {
            0.0
        };
        // Anti-windup: do not integrate into a saturated output.
        let saturated =
            (self.multiplier >= 1.0 && error > 0.0) || (self.multiplier <= 0.0 && error < 0.0);
        if !saturated {
            self.integral = (self.integral + error * dt_min).clamp(-1.0, 1.0);
        }
        let u = gains.kp * error + gains.ki * self.integral + gains.kr * rate_error;
        let step = if u >= 0.0 {
            (u * dt_min).min(gains.max_up_per_min * dt_min)
        } else {
            (u * gains.over_gain * dt_min).max(-gains.max_down_per_min * dt_min)
        };
        self.multiplier = (self.multiplier + step).clamp(0.0, 1.0);
        self.multiplier
    }
}

/// The lag guard's verdict for one limit.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Guard {
    /// Highest multiplier the lag allows.
    pub(crate) cap: f64,
    /// Most the limit can overspend if the lag stays within the measured
    /// p99: the spend already in flight beyond the remainder, plus one event.
    pub(crate) overspend_bound: u64,
}

/// What the lag guard knows of one limit.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct GuardInput {
    /// Budget left as far as the visible spend goes, micros.
    pub(crate) remaining: u64,
    /// Spend rate as it arrives now, micros per ms: served about one lag
    /// ago, at `served_then`. The cap's estimate (a windowed average).
    pub(crate) rate_per_ms: f64,
    /// The same on the high side (a recent peak), for the stated bound.
    pub(crate) bound_rate_per_ms: f64,
    /// The multiplier served one lag ago.
    pub(crate) served_then: f64,
    /// The integral of the multiplier served over the last lag,
    /// multiplier-milliseconds: the serving whose spend is in flight.
    pub(crate) served_over_lag: f64,
    /// The integral of the multiplier served over the longest lag seen
    /// (at least the last lag): what the stated bound counts as in flight.
    pub(crate) served_over_max_lag: f64,
    /// The measured p99 freshness lag, ms.
    pub(crate) lag_ms: f64,
    /// Cost of a typical event, micros: the guard aims to leave half of
    /// one, so that serving goes on until the remainder cannot pay one
    /// (exhausted) rather than stalling just above it.
    pub(crate) typical_cost: f64,
    /// The largest single event seen, micros.
    pub(crate) max_cost: u64,
}

/// The guard estimates the spend in flight, served within the last lag but
/// not visible yet, as the rate at multiplier 1 (`rate_per_ms` over
/// `served_then`) times what was served since (`served_over_lag`), and
/// caps the multiplier so that the budget left after it, less half a
/// typical event, is spent no faster than over one more lag. Counting the spend
/// already in flight is what keeps the guard from overshooting: a cap from
/// the visible remainder alone keeps serving at the higher multipliers of
/// one lag ago until their spend shows up, and stops only after it does.
///
/// What can still exceed the budget is the in-flight spend beyond the
/// remainder (estimated at `bound_rate_per_ms`, the high side, over the
/// longest lag seen) plus one event that is already committed when the
/// last visible sum arrives.
pub(crate) fn lag_guard(input: GuardInput) -> Guard {
    let full_rate = input.rate_per_ms / input.served_then.max(0.05);
    let in_flight = full_rate * input.served_over_lag.max(0.0);
    let next_lag = full_rate * input.lag_ms.max(0.0);
    let usable = input.remaining as f64 - in_flight - input.typical_cost.max(0.0) / 2.0;
    let cap = if next_lag > 0.0 {
        (usable / next_lag).clamp(0.0, 1.0)
    } else if usable > 0.0 || full_rate == 0.0 {
        1.0
    } else {
        0.0
    };
    // The bound is a promise: it reads the in-flight spend at the high rate.
    let served_then = input.served_then.max(0.05);
    let high_rate = input.bound_rate_per_ms.max(input.rate_per_ms) / served_then;
    let in_flight_high = high_rate
        * input
            .served_over_max_lag
            .max(input.served_over_lag)
            .max(0.0);
    let beyond = (in_flight_high - input.remaining as f64).max(0.0).ceil() as u64;
    Guard {
        cap,
        overspend_bound: beyond.saturating_add(input.max_cost),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obs(plan: f64, spent: f64) -> Observation {
        Observation {
            plan,
            spent,
            plan_rate: 0.001,
            rate: 0.001,
        }
    }

    #[test]
    fn over_pacing_lowers_faster_than_under_pacing_raises() {
        let g = Gains::default();
        let mut c = Controller::default();
        let m = c.step(&obs(0.5, 0.6), 1.0, &g);
        assert!((1.0 - m - 0.30).abs() < 1e-9, "capped at 30%/min down: {m}");
        let before = c.multiplier;
        let m = c.step(&obs(0.5, 0.3), 1.0, &g);
        assert!(
            m - before <= 0.10 + 1e-9,
            "at most 10%/min up: {before} -> {m}"
        );
        assert!(m > before);
    }

    #[test]
    fn no_windup_while_saturated() {
        let g = Gains::default();
        let mut c = Controller::default();
        // Far behind plan for a long time at multiplier 1.
        for _ in 0..600 {
            c.step(&obs(0.9, 0.1), 1.0, &g);
        }
        assert_eq!(c.multiplier, 1.0);
        // Now ahead of plan: the multiplier must come down at once.
        let m = c.step(&obs(0.5, 0.6), 1.0, &g);
        assert!(m < 1.0, "{m}");
    }

    #[test]
    fn baseline_moves_ten_percent_a_minute_towards_an_even_plan() {
        assert!((baseline_step(1.0, 0.5, 0.6, 1.0) - 0.9).abs() < 1e-12);
        assert!((baseline_step(0.5, 0.5, 0.4, 1.0) - 0.55).abs() < 1e-12);
        assert_eq!(baseline_step(1.0, 0.5, 0.4, 1.0), 1.0);
        // Sixty one-second steps make one minute's step.
        let mut pass = 1.0;
        for _ in 0..60 {
            pass = baseline_step(pass, 0.5, 0.6, 1.0 / 60.0);
        }
        assert!((pass - 0.9).abs() < 1e-9, "{pass}");
    }

    fn input(remaining: u64, rate: f64, then: f64, over_lag: f64, lag: f64) -> GuardInput {
        GuardInput {
            remaining,
            rate_per_ms: rate,
            bound_rate_per_ms: rate,
            served_then: then,
            served_over_lag: over_lag,
            served_over_max_lag: over_lag,
            lag_ms: lag,
            typical_cost: 2_000.0,
            max_cost: 1_000,
        }
    }

    #[test]
    fn lag_guard_leaves_room_for_the_spend_in_flight() {
        // 10 micros/ms at full rate, 10 s of lag; nothing served in the last
        // lag yet: the next lag at full rate (100_000) would overrun.
        let g = lag_guard(input(50_000, 10.0, 1.0, 0.0, 10_000.0));
        assert!((g.cap - 0.49).abs() < 1e-9, "{g:?}");
        assert_eq!(g.overspend_bound, 1_000);
        // Served at 0.2 for the last lag: 20_000 in flight leaves 29_000.
        let g = lag_guard(input(50_000, 2.0, 0.2, 2_000.0, 10_000.0));
        assert!((g.cap - 0.29).abs() < 1e-9, "{g:?}");
        // No lag: no cap while anything is usable.
        assert_eq!(lag_guard(input(50_000, 10.0, 1.0, 0.0, 0.0)).cap, 1.0);
        // Nothing usable left: cap 0.
        assert_eq!(lag_guard(input(500, 10.0, 1.0, 0.0, 1_000.0)).cap, 0.0);
        // No rate seen yet: nothing to cap with.
        assert_eq!(lag_guard(input(500, 0.0, 1.0, 0.0, 1_000.0)).cap, 1.0);
    }

    #[test]
    fn the_bound_covers_what_was_served_within_the_lag() {
        // Seen at 10 micros/ms while served at full rate, for all of a 10 s
        // lag, with 5_000 left: about 100_000 in flight, 95_000 beyond the
        // remainder. A bound of one event (what a cap of 0 alone implies)
        // would be broken by the spend served before the stop.
        let g = lag_guard(input(5_000, 10.0, 1.0, 10_000.0, 10_000.0));
        assert_eq!(g.cap, 0.0);
        assert_eq!(g.overspend_bound, 95_000 + 1_000);
        // The rate seen was served at 0.5: full rate 20 micros/ms, but only
        // a quarter of the lag's serving in flight (served at 0.25).
        let g = lag_guard(input(5_000, 10.0, 0.5, 2_500.0, 10_000.0));
        assert_eq!(g.overspend_bound, 45_000 + 1_000);
        // The bound reads the in-flight spend at the high rate; the cap
        // does not.
        let high = GuardInput {
            bound_rate_per_ms: 20.0,
            ..input(5_000, 10.0, 1.0, 10_000.0, 10_000.0)
        };
        assert_eq!(lag_guard(high).overspend_bound, 195_000 + 1_000);
        let low = GuardInput {
            bound_rate_per_ms: 20.0,
            ..input(150_000, 10.0, 1.0, 0.0, 10_000.0)
        };
        assert!((lag_guard(low).cap - 1.0).abs() < 1e-9);
        // Serving within the longest lag seen, beyond the p99, counts too.
        let longer = GuardInput {
            served_over_max_lag: 20_000.0,
            ..input(5_000, 10.0, 1.0, 10_000.0, 10_000.0)
        };
        assert_eq!(lag_guard(longer).overspend_bound, 195_000 + 1_000);
    }

    #[test]
    fn a_cap_from_a_throttled_rate_does_not_rise_back() {
        // Full rate 10 micros/ms, 10 s lag, 60_000 left: served at m, the
        // observed rate is 10·m; the cap must not read that as a lower full
        // rate (the old guard divided by the controller's 1.0, not by what
        // was served, and let the cap climb back to 1 once the throttled
        // spend arrived).
        let first = lag_guard(input(60_000, 10.0, 1.0, 0.0, 10_000.0)).cap;
        let throttled = lag_guard(input(60_000, 10.0 * first, first, 0.0, 10_000.0)).cap;
        assert!((throttled - first).abs() < 1e-9, "{first} -> {throttled}");
    }
}
