//! The traffic shape: when in the local day impressions arrive, learned from
//! the arrivals the pacer sees, blended with a uniform spread until enough has
//! been seen. Plans follow it so that budgets are spent when the traffic is.

/// 15-minute slots of the local day.
pub(crate) const SLOTS: usize = 96;
const SLOT_MS: f64 = 86_400_000.0 / SLOTS as f64;
/// Arrivals after which the learned shape gets its full weight.
const CONFIDENT_AFTER: f64 = 50_000.0;
/// Weight of the learned shape at full confidence; the rest stays uniform, so
/// a quiet slot in yesterday's data never plans zero spend.
const LEARNED_WEIGHT: f64 = 0.7;

#[derive(Clone, Debug)]
pub struct TrafficShape {
    slots: [f64; SLOTS],
    total: f64,
}

impl Default for TrafficShape {
    fn default() -> Self {
        TrafficShape {
            slots: [0.0; SLOTS],
            total: 0.0,
        }
    }
}

impl TrafficShape {
    /// Count `weight` arrivals at local time-of-day `local_ms` (0..86.4M).
    pub fn observe(&mut self, local_ms: i64, weight: f64) {
        let slot = ((local_ms.rem_euclid(86_400_000) as f64 / SLOT_MS) as usize).min(SLOTS - 1);
        self.slots[slot] += weight;
        self.total += weight;
    }

    /// Forget old traffic gradually (called periodically).
    pub(crate) fn decay(&mut self, factor: f64) {
        for s in &mut self.slots {
            *s *= factor;
        }
        self.total *= factor;
    }

    fn weight(&self) -> f64 {
        LEARNED_WEIGHT * (self.total / CONFIDENT_AFTER).min(1.0)
    }

    /// Share of a day's traffic before day fraction `f` (0..=1), learned.
    fn learned_cumulative(&self, f: f64) -> f64 {
        if self.total <= 0.0 {
            return f;
        }
        let pos = f.clamp(0.0, 1.0) * SLOTS as f64;
        let whole = pos.floor() as usize;
        let mut sum: f64 = self.slots[..whole.min(SLOTS)].iter().sum();
        if whole < SLOTS {
            sum += self.slots[whole] * (pos - whole as f64);
        }
        sum / self.total
    }

    /// Planned share of the budget spent by day fraction `f`: blended, so
    /// monotonic, 0 at the start and 1 at the end.
    pub(crate) fn plan_fraction(&self, f: f64) -> f64 {
        let f = f.clamp(0.0, 1.0);
        let w = self.weight();
        w * self.learned_cumulative(f) + (1.0 - w) * f
    }

    /// Planned share of the budget per unit of day fraction at `f`.
    pub(crate) fn plan_density(&self, f: f64) -> f64 {
        let w = self.weight();
        let learned = if self.total > 0.0 {
            let slot = ((f.clamp(0.0, 1.0) * SLOTS as f64) as usize).min(SLOTS - 1);
            self.slots[slot] / self.total * SLOTS as f64
        } else {
            1.0
        };
        w * learned + (1.0 - w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uniform_until_learned_then_follows_traffic() {
        let mut shape = TrafficShape::default();
        assert!((shape.plan_fraction(0.25) - 0.25).abs() < 1e-12);
        // All traffic in the second half of the day.
        for slot in SLOTS / 2..SLOTS {
            shape.observe(
                (slot as f64 * SLOT_MS) as i64,
                CONFIDENT_AFTER / (SLOTS / 2) as f64,
            );
        }
        let half = shape.plan_fraction(0.5);
        assert!((half - 0.3 * 0.5).abs() < 1e-9, "{half}");
        assert!((shape.plan_fraction(1.0) - 1.0).abs() < 1e-9);
        assert!(shape.plan_density(0.75) > 1.0 && shape.plan_density(0.25) < 1.0);
        let mut last = 0.0;
        for i in 0..=1000 {
            let p = shape.plan_fraction(i as f64 / 1000.0);
            assert!(p >= last - 1e-12);
            last = p;
        }
    }
}
