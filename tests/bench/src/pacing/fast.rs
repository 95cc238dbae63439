//! The fast-exhaustion scenario: budgets that flat demand spends within
//! seconds, so that the reporting delay, not the pacer's plan, decides how
//! far a limit goes over.
//!
//! [`LIMITS`] lifetime limits of [`BUDGET_IMPRESSIONS`] impressions at one
//! fixed [`COST`], [`ADS_PER_LIMIT`] ads under each (every ad under one
//! limit), requested uniformly at [`RATE`] requests a second in all: each
//! budget would last [`SECONDS_OF_BUDGET`] at full demand.

use std::time::Duration;

use adspend_sim::{Catalog, CostDistribution, Limit, LoopConfig, Period, ServeMode, Traffic};

pub const LIMITS: usize = 20;
pub const ADS_PER_LIMIT: usize = 5;
pub const BUDGET_IMPRESSIONS: u64 = 2_000;
/// One currency unit, every impression.
pub const COST: u64 = 1_000_000;
/// Ad requests a second, all servers and limits together.
pub const RATE: f64 = 8_000.0;
pub const SECONDS_OF_BUDGET: f64 = BUDGET_IMPRESSIONS as f64 / (RATE / LIMITS as f64);
/// Serving goes on this long after the reporting delay: long enough for
/// the pacer to have seen every budget run out and stopped it.
pub const TAIL: Duration = Duration::from_secs(15);
/// The reporting delays the scenario runs by default.
pub const DELAYS_SECS: [f64; 4] = [1.0, 5.0, 10.0, 30.0];

/// `fast-N` (lifetime, UTC) and its ads `fast-N-ad-M`.
pub fn catalog() -> anyhow::Result<Catalog> {
    let mut catalog = Catalog::default();
    for l in 1..=LIMITS {
        let limit = format!("fast-{l}");
        catalog.limits.insert(
            limit.clone(),
            Limit {
                budget_micros: BUDGET_IMPRESSIONS * COST,
                period: Period::Lifetime,
                time_zone: "UTC".to_owned(),
                parent: None,
            },
        );
        for a in 1..=ADS_PER_LIMIT {
            catalog
                .ads
                .insert(format!("{limit}-ad-{a}"), vec![limit.clone()]);
        }
    }
    catalog.validate()?;
    Ok(catalog)
}

/// The loop of one run: flat traffic, uniform over the ads, fixed cost,
/// serving for the delay plus [`TAIL`].
pub fn loop_config(pacer_url: String, mode: ServeMode, delay: Duration, seed: u64) -> LoopConfig {
    let duration = delay + TAIL;
    LoopConfig {
        pacer_url,
        servers: 4,
        day: duration,
        duration,
        peak_rate: RATE,
        traffic: Traffic::Flat,
        zipf_exponent: 0.0,
        cost: CostDistribution::Uniform {
            min: COST,
            max: COST,
        },
        mode,
        publish_delay: delay,
        seed,
        progress_interval: Duration::from_secs(5),
        ..LoopConfig::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_budget_lasts_seconds_and_every_ad_books_to_one_limit() {
        let catalog = catalog().unwrap();
        assert_eq!(catalog.limits.len(), LIMITS);
        assert_eq!(catalog.ads.len(), LIMITS * ADS_PER_LIMIT);
        assert!(catalog.ads.values().all(|limits| limits.len() == 1));
        assert!(catalog
            .limits
            .values()
            .all(|l| l.period == Period::Lifetime && l.budget_micros == 2_000 * COST));
        assert!(
            (1.0..=10.0).contains(&SECONDS_OF_BUDGET),
            "{SECONDS_OF_BUDGET}"
        );
        let config = loop_config(
            "http://x".into(),
            ServeMode::Decisions,
            Duration::from_secs(5),
            1,
        );
        config.validate().unwrap();
        assert_eq!(config.duration, Duration::from_secs(20));
    }
}
