//! Per-limit pacing: a PI controller on the cumulative error against the
//! plan, with a rate term, bounded steps (stronger when over-pacing) and
//! anti-windup; and the lag guard, which caps the multiplier so that the
//! spend in flight but not yet visible cannot overrun the remaining budget.

/// Tuning of the controller; steps are per minute of elapsed time.
#[derive(Clone, Copy, Debug)]
pub struct Gains {
    pub kp: f64,
    pub ki: f64,
    pub kr: f64,
    /// Largest increase of the multiplier per minute (LinkedIn-style ±10%).
    pub max_up_per_min: f64,
    /// Largest decrease per minute: over-pacing is corrected faster.
    pub max_down_per_min: f64,
    /// Extra gain on corrections downwards.
    pub over_gain: f64,
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
pub enum Algorithm {
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
pub fn baseline_step(pass: f64, even_plan: f64, spent: f64, dt_min: f64) -> f64 {
    if spent > even_plan {
        pass * 0.9f64.powf(dt_min)
    } else {
        (pass * 1.1f64.powf(dt_min)).clamp(0.01, 1.0)
    }
}

/// What the controller sees, as shares of the budget.
#[derive(Clone, Copy, Debug)]
pub struct Observation {
    /// Planned share spent by now.
    pub plan: f64,
    /// Share actually spent.
    pub spent: f64,
    /// Planned and observed spend rate, shares per minute.
    pub plan_rate: f64,
    pub rate: f64,
}

#[derive(Clone, Copy, Debug)]
pub struct Controller {
    pub multiplier: f64,
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
    pub fn step(&mut self, obs: &Observation, dt_min: f64, gains: &Gains) -> f64 {
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
pub struct Guard {
    /// Highest multiplier the lag allows.
    pub cap: f64,
    /// Most the limit can overspend if the lag stays within the measured p99.
    pub overspend_bound: u64,
}

/// `rate_per_ms` is the spend rate observed at `multiplier`; `lag_ms` the
/// measured p99 freshness lag; `max_cost` the largest single event seen.
///
/// Spend in flight during the lag is at most `full_rate · cap · lag`; the cap
/// keeps that within the remaining budget less one event. What can still
/// exceed the budget is the in-flight spend beyond the remainder (0 while the
/// cap holds) plus one event that is already committed when the last visible
/// sum arrives.
pub fn lag_guard(
    remaining: u64,
    rate_per_ms: f64,
    multiplier: f64,
    lag_ms: f64,
    max_cost: u64,
) -> Guard {
    let full_rate = if multiplier > 0.05 {
        rate_per_ms / multiplier
    } else {
        rate_per_ms / 0.05
    };
    let in_flight_at_full = full_rate * lag_ms.max(0.0);
    let usable = remaining.saturating_sub(max_cost) as f64;
    let cap = if in_flight_at_full > 0.0 {
        (usable / in_flight_at_full).clamp(0.0, 1.0)
    } else {
        1.0
    };
    let in_flight = in_flight_at_full * multiplier.min(cap);
    let beyond = (in_flight - remaining as f64).max(0.0).ceil() as u64;
    Guard {
        cap,
        overspend_bound: beyond.saturating_add(max_cost),
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

    #[test]
    fn lag_guard_caps_in_flight_spend_to_the_remainder() {
        // 10 micros/ms at full rate, 10 s of lag: 100_000 in flight at m = 1.
        let g = lag_guard(50_000, 10.0, 1.0, 10_000.0, 1_000);
        assert!((g.cap - 0.49).abs() < 1e-9, "{g:?}");
        assert_eq!(g.overspend_bound, 1_000);
        // No lag: no cap.
        assert_eq!(lag_guard(50_000, 10.0, 1.0, 0.0, 1_000).cap, 1.0);
        // Nothing usable left: cap 0.
        assert_eq!(lag_guard(500, 10.0, 1.0, 1_000.0, 1_000).cap, 0.0);
    }
}
