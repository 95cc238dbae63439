//! Pacing simulator: many daily limits over simulated days of diurnal
//! traffic, with spend visible to the pacer only after a lag (swept 0..10
//! minutes) and a share of late events arriving later still. Our pacer (the
//! real `adspend_pacer` state, controller, shape and lag guard, fed the same
//! pushes the aggregator would send) against a LinkedIn-style baseline
//! (pass-through rate moved ±10% a minute towards an even plan, stop when the
//! visible spend reaches the budget) on the same traffic.
//!
//! cargo bench -p adspend-pacer --bench pacing_sim
//!
//! Day 1 warms up (the traffic shape is learned); figures are for day 2.

use adspend_pacer::pacing::{tick, verdict, SpendState};
use adspend_wire::catalog::Catalog;
use adspend_wire::types::{SumEntry, SumsUpdate};
use chrono::{DateTime, TimeZone, Utc};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Poisson};

const LIMITS: usize = 400;
const MINUTES: usize = 1440;
const LAGS_MIN: [usize; 5] = [0, 1, 2, 5, 10];
const LATE_SHARE: f64 = 0.05;
const WIN_RATE: f64 = 0.3;
const AVG_COST: f64 = 400_000.0;

/// Traffic by minute of day: a night trough, a morning bump, an evening peak.
fn diurnal(minute: usize) -> f64 {
    let h = minute as f64 / 60.0;
    let bump = |center: f64, width: f64| (-((h - center) / width).powi(2)).exp();
    0.25 + 0.6 * bump(9.0, 2.0) + 1.2 * bump(20.0, 2.5)
}

#[derive(Clone)]
struct LimitSpec {
    budget: u64,
    /// Opportunities per minute at diurnal 1.0.
    base_opps: f64,
}

fn limits(rng: &mut StdRng) -> Vec<LimitSpec> {
    let day_weight: f64 = (0..MINUTES).map(diurnal).sum();
    (0..LIMITS)
        .map(|_| {
            // Demand between half and four times the budget.
            let demand_ratio = rng.random_range(0.5..4.0);
            let budget = rng.random_range(50.0..2_000.0) * AVG_COST;
            let base_opps = budget * demand_ratio / (AVG_COST * WIN_RATE * day_weight);
            LimitSpec {
                budget: budget as u64,
                base_opps,
            }
        })
        .collect()
}

/// What the pacer can see at the start of a minute.
struct Visible<'a> {
    /// Minutes since the simulation started (day 2 starts at 1440).
    minute: usize,
    /// Spend of the current day, per limit.
    day: &'a [u64],
    /// Spend and events since the start, per limit.
    lifetime: &'a [u64],
    events: &'a [u64],
    /// Largest delay (minutes) among the spend that became visible now.
    delay: usize,
}

/// What one method decides each minute for one limit.
trait Pacer {
    /// Probability of bidding this minute, given what is visible.
    fn bid_probability(&mut self, i: usize) -> f64;
    fn observe(&mut self, visible: &Visible<'_>);
    /// The overspend bound the method states for limit `i` (None: states none).
    fn stated_bound(&self, i: usize) -> Option<u64>;
}

struct Baseline {
    budgets: Vec<u64>,
    pass: Vec<f64>,
    visible: Vec<u64>,
}

impl Pacer for Baseline {
    fn observe(&mut self, v: &Visible<'_>) {
        if v.minute.is_multiple_of(MINUTES) {
            self.pass.iter_mut().for_each(|p| *p = 1.0);
        }
        self.visible.copy_from_slice(v.day);
        let f = (v.minute % MINUTES) as f64 / MINUTES as f64;
        for i in 0..self.budgets.len() {
            let plan = self.budgets[i] as f64 * f;
            if (v.day[i] as f64) > plan {
                self.pass[i] *= 0.9;
            } else {
                self.pass[i] = (self.pass[i] * 1.1).clamp(0.01, 1.0);
            }
        }
    }

    fn bid_probability(&mut self, i: usize) -> f64 {
        if self.visible[i] >= self.budgets[i] {
            0.0
        } else {
            self.pass[i]
        }
    }

    fn stated_bound(&self, _i: usize) -> Option<u64> {
        None
    }
}

struct Ours {
    catalog: Catalog,
    ids: Vec<String>,
    state: SpendState,
    day_start: DateTime<Utc>,
    seq: u64,
    multipliers: Vec<f64>,
    exhausted: Vec<bool>,
    bounds: Vec<u64>,
}

impl Pacer for Ours {
    fn observe(&mut self, v: &Visible<'_>) {
        let now = self.day_start + chrono::Duration::minutes(v.minute as i64);
        let now_ms = now.timestamp_millis();
        if v.minute.is_multiple_of(MINUTES) {
            self.exhausted.iter_mut().for_each(|e| *e = false);
        }
        self.seq += 1;
        let bucket = self.catalog.limit(&self.ids[0]).unwrap().bucket_of(now_ms);
        let entries = self
            .ids
            .iter()
            .enumerate()
            .map(|(i, id)| SumEntry {
                limit: id.clone(),
                bucket,
                bucket_micros: v.day[i],
                lifetime_micros: v.lifetime[i],
                lifetime_events: v.events[i],
            })
            .collect();
        let lag_ms = v.delay as i64 * 60_000;
        let mut arrivals = Vec::new();
        self.state.apply_with_arrivals(
            &SumsUpdate {
                shard: "sim".into(),
                epoch: 1,
                seq: self.seq,
                push_seq: self.seq,
                full: false,
                watermark_ms: now_ms - lag_ms,
                source_ms: now_ms - lag_ms,
                entries,
            },
            now_ms,
            &mut arrivals,
        );
        for (_, n) in &arrivals {
            self.state.shape.observe(now_ms - lag_ms, *n as f64);
        }
        tick(
            &mut self.state,
            &self.catalog,
            now,
            1.0,
            false,
            &Default::default(),
        );
        for (i, id) in self.ids.iter().enumerate() {
            let verdict = verdict(self.catalog.limit(id).unwrap(), &self.state, now);
            self.multipliers[i] = verdict.multiplier;
            self.exhausted[i] |= verdict.exhausted;
            self.bounds[i] = verdict.overspend_bound;
        }
    }

    fn bid_probability(&mut self, i: usize) -> f64 {
        if self.exhausted[i] {
            0.0
        } else {
            self.multipliers[i]
        }
    }

    fn stated_bound(&self, i: usize) -> Option<u64> {
        Some(self.bounds[i])
    }
}

#[derive(Default)]
struct Outcome {
    over_pct: Vec<f64>,
    under_pct: Vec<f64>,
    live: Vec<f64>,
    rmse: Vec<f64>,
    volatility: Vec<f64>,
    bound_breaks: Option<usize>,
}

fn pct(v: &[f64], p: f64) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return 0.0;
    }
    v[((v.len() as f64 * p).ceil() as usize).clamp(1, v.len()) - 1]
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Simulate two days for one method; report day 2.
fn simulate(pacer: &mut dyn Pacer, specs: &[LimitSpec], lag_min: usize, seed: u64) -> Outcome {
    let mut rng = StdRng::seed_from_u64(seed);
    let n = specs.len();
    let mut out = Outcome::default();
    // Per limit: (minute it becomes visible, cost, delay).
    let mut pending: Vec<Vec<(usize, u64, usize)>> = vec![Vec::new(); n];
    let mut visible_lifetime = vec![0u64; n];
    let mut visible_events = vec![0u64; n];
    let shape_total: f64 = (0..MINUTES).map(diurnal).sum();
    for day in 0..2 {
        let mut spent = vec![0u64; n];
        let mut visible_day = vec![0u64; n];
        let mut by_hour = vec![[0u64; 24]; n];
        let mut last_imp = vec![0usize; n];
        let mut last_p = vec![1.0f64; n];
        let mut dp_sum = vec![0.0f64; n];
        let mut stated = vec![0u64; n];
        let mut stated_at_stop: Vec<Option<u64>> = vec![None; n];
        for minute in 0..MINUTES {
            let now = day * MINUTES + minute;
            let mut delay = 0;
            for i in 0..n {
                pending[i].retain(|&(at, cost, d)| {
                    if at > now {
                        return true;
                    }
                    visible_lifetime[i] += cost;
                    visible_events[i] += 1;
                    // Late spend from yesterday stays in yesterday's period.
                    if at - d >= day * MINUTES {
                        visible_day[i] += cost;
                    }
                    delay = delay.max(d);
                    false
                });
            }
            pacer.observe(&Visible {
                minute: now,
                day: &visible_day,
                lifetime: &visible_lifetime,
                events: &visible_events,
                // Spend made during a minute is seen at the next one: one
                // more minute of lag than the pipeline's.
                delay: delay.max(lag_min) + 1,
            });
            for i in 0..n {
                let p = pacer.bid_probability(i).clamp(0.0, 1.0);
                dp_sum[i] += (p - last_p[i]).abs();
                last_p[i] = p;
                if let Some(bound) = pacer.stated_bound(i) {
                    stated[i] = bound;
                    if p == 0.0 && stated_at_stop[i].is_none() && spent[i] > 0 {
                        stated_at_stop[i] = Some(bound);
                    }
                }
                let lambda = specs[i].base_opps * diurnal(minute) * WIN_RATE * p;
                if lambda <= 0.0 {
                    continue;
                }
                let k = Poisson::new(lambda)
                    .map(|d| d.sample(&mut rng) as u64)
                    .unwrap_or(0);
                for _ in 0..k {
                    let cost = rng.random_range(AVG_COST * 0.2..AVG_COST * 1.8) as u64;
                    spent[i] += cost;
                    by_hour[i][minute / 60] += cost;
                    last_imp[i] = minute;
                    let d = if lag_min > 0 && rng.random_bool(LATE_SHARE) {
                        rng.random_range(lag_min..=3 * lag_min)
                    } else {
                        lag_min
                    };
                    pending[i].push((now + d, cost, d));
                }
            }
        }
        if day == 0 {
            continue;
        }
        let mut breaks = 0;
        for i in 0..n {
            let budget = specs[i].budget as f64;
            let spend = spent[i] as f64;
            out.over_pct
                .push(((spend - budget) / budget * 100.0).max(0.0));
            out.under_pct
                .push(((budget - spend) / budget * 100.0).max(0.0));
            out.live
                .push((last_imp[i] + 1) as f64 / MINUTES as f64 * 100.0);
            let mut sq = 0.0;
            for (h, spent_h) in by_hour[i].iter().enumerate() {
                let planned =
                    budget * (0..60).map(|m| diurnal(h * 60 + m)).sum::<f64>() / shape_total;
                sq += ((*spent_h as f64 - planned) / (budget / 24.0)).powi(2);
            }
            out.rmse.push((sq / 24.0).sqrt());
            out.volatility.push(dp_sum[i] / MINUTES as f64);
            if pacer.stated_bound(i).is_some() {
                let overspend = spent[i].saturating_sub(specs[i].budget);
                if overspend > stated_at_stop[i].unwrap_or(stated[i]) {
                    breaks += 1;
                }
            }
        }
        if pacer.stated_bound(0).is_some() {
            out.bound_breaks = Some(breaks);
        }
    }
    out
}

fn main() {
    let mut rng = StdRng::seed_from_u64(7);
    let specs = limits(&mut rng);
    let day_start = Utc.with_ymd_and_hms(2026, 11, 20, 0, 0, 0).unwrap();
    let mut doc_limits = serde_json::Map::new();
    let ids: Vec<String> = (0..specs.len()).map(|i| format!("limit-{i}")).collect();
    for (i, id) in ids.iter().enumerate() {
        doc_limits.insert(
            id.clone(),
            serde_json::json!({"budget_micros": specs[i].budget, "period": "daily"}),
        );
    }
    let doc = serde_json::json!({"limits": doc_limits}).to_string();
    println!(
        "pacing simulator: {} daily limits, demand 0.5-4x budget, diurnal traffic, {}% late events (up to 3x the lag); day 2 of 2 reported",
        specs.len(),
        LATE_SHARE * 100.0
    );
    println!(
        "| method | lag min | over % mean | over % p99 | limits over budget | under % mean | live % of day | smoothness RMSE | multiplier volatility | bound breaks |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    for lag in LAGS_MIN {
        let mut baseline = Baseline {
            budgets: specs.iter().map(|s| s.budget).collect(),
            pass: vec![1.0; specs.len()],
            visible: vec![0; specs.len()],
        };
        let b = simulate(&mut baseline, &specs, lag, 100 + lag as u64);
        let mut ours = Ours {
            catalog: Catalog::parse("sim", doc.as_bytes()).unwrap(),
            ids: ids.clone(),
            state: SpendState::default(),
            day_start,
            seq: 0,
            multipliers: vec![1.0; specs.len()],
            exhausted: vec![false; specs.len()],
            bounds: vec![0; specs.len()],
        };
        let o = simulate(&mut ours, &specs, lag, 100 + lag as u64);
        for (name, r) in [("linkedin-style", &b), ("adspend", &o)] {
            let over_share = r.over_pct.iter().filter(|x| **x > 0.0).count() as f64
                / r.over_pct.len() as f64
                * 100.0;
            println!(
                "| {name} | {lag} | {:.2} | {:.2} | {:.1}% | {:.2} | {:.1} | {:.3} | {:.4} | {} |",
                mean(&r.over_pct),
                pct(&r.over_pct, 0.99),
                over_share,
                mean(&r.under_pct),
                mean(&r.live),
                mean(&r.rmse),
                mean(&r.volatility),
                r.bound_breaks.map_or("n/a".to_string(), |b| b.to_string()),
            );
        }
    }
}
