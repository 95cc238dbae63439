//! Statistics and time helpers shared by the tools and tests.

use std::time::{SystemTime, UNIX_EPOCH};

/// The nearest-rank percentile `p` (0..=100) of ascending `sorted`; the
/// default (0) when empty.
pub fn percentile<T: Copy + Default>(sorted: &[T], p: f64) -> T {
    if sorted.is_empty() {
        return T::default();
    }
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// The nearest-rank quantile `q` (0..=1) of `values`, in any order; NaN
/// when empty.
pub fn quantile(values: &[f64], q: f64) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((sorted.len() as f64 * q).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// The `q` quantile of cumulative buckets, interpolated linearly inside the
/// bucket it falls in (Prometheus's `histogram_quantile`).
pub fn histogram_quantile(buckets: &[(f64, u64)], q: f64) -> f64 {
    let Some(&(_, total)) = buckets.last() else {
        return f64::NAN;
    };
    if total == 0 {
        return f64::NAN;
    }
    let rank = q * total as f64;
    let mut lower = (0.0, 0u64);
    for &(le, count) in buckets {
        if count as f64 >= rank {
            if le.is_infinite() {
                return lower.0;
            }
            let inside = (count - lower.1) as f64;
            let share = if inside == 0.0 {
                1.0
            } else {
                (rank - lower.1 as f64) / inside
            };
            return lower.0 + (le - lower.0) * share;
        }
        lower = (le, count);
    }
    lower.0
}

/// Milliseconds since the Unix epoch by the wall clock.
pub fn unix_ms() -> i64 {
    unix_ms_at(SystemTime::now())
}

/// Milliseconds since the Unix epoch of `t`; 0 before it.
pub fn unix_ms_at(t: SystemTime) -> i64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), 50);
        assert_eq!(percentile(&v, 99.0), 99);
        assert_eq!(percentile(&v, 100.0), 100);
        assert_eq!(percentile(&[7], 99.0), 7);
        assert_eq!(percentile::<u64>(&[], 50.0), 0);
        assert!(unix_ms() > 1_700_000_000_000);
        assert_eq!(
            unix_ms_at(UNIX_EPOCH + std::time::Duration::from_millis(7)),
            7
        );
        let values: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(quantile(&values, 0.5), 50.0);
        assert_eq!(quantile(&values, 0.99), 99.0);
        assert_eq!(quantile(&values, 1.0), 100.0);
        assert!(quantile(&[], 0.5).is_nan());
        assert_eq!(percentile(&[-3i64, 5], 50.0), -3);
    }

    #[test]
    fn histogram_quantile_interpolates_inside_the_bucket() {
        let buckets = [(0.1, 50), (0.2, 100), (f64::INFINITY, 100)];
        assert!((histogram_quantile(&buckets, 0.5) - 0.1).abs() < 1e-9);
        assert!((histogram_quantile(&buckets, 0.75) - 0.15).abs() < 1e-9);
        assert!((histogram_quantile(&buckets, 0.99) - 0.198).abs() < 1e-9);
        assert!(histogram_quantile(&[(0.1, 0), (f64::INFINITY, 0)], 0.5).is_nan());
    }
}
