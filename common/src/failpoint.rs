//! Named crash points for the failure-injection suite.
//!
//! Built only with the `failpoints` feature. A test arms points with
//! `ADSPEND_FAILPOINTS=name[,name...]` (optionally `name@N` to fire on the
//! N-th hit); the process prints `FAILPOINT FIRED: name` to stderr and aborts,
//! exactly like a crash at that line. `name~MS` (or `name@N~MS`) stalls the
//! thread for MS milliseconds instead, as a stopped VM or a long pause
//! would, prints `FAILPOINT STALLED: name` and goes on.

#[cfg(feature = "failpoints")]
mod armed {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    use std::time::Duration;

    struct Point {
        fire_at: u64,
        /// Stall this long instead of aborting.
        stall: Option<Duration>,
        hits: AtomicU64,
        /// `name=VALUE`: armed for this value only ([`armed_for`]).
        value: Option<String>,
    }

    /// `name[@N][~MS]` or `name=VALUE`
    fn parse(spec: &str) -> (String, Point) {
        if let Some((name, value)) = spec.split_once('=') {
            let point = Point {
                fire_at: 1,
                stall: None,
                hits: AtomicU64::new(0),
                value: Some(value.to_string()),
            };
            return (name.to_string(), point);
        }
        let (rest, stall) = match spec.split_once('~') {
            Some((rest, ms)) => (rest, ms.parse().ok().map(Duration::from_millis)),
            None => (spec, None),
        };
        let (name, fire_at) = match rest.split_once('@') {
            Some((name, n)) => (name, n.parse().unwrap_or(1)),
            None => (rest, 1),
        };
        let point = Point {
            fire_at,
            stall,
            hits: AtomicU64::new(0),
            value: None,
        };
        (name.to_string(), point)
    }

    fn points() -> &'static HashMap<String, Point> {
        static POINTS: OnceLock<HashMap<String, Point>> = OnceLock::new();
        POINTS.get_or_init(|| {
            let spec = std::env::var(crate::env::FAILPOINTS).unwrap_or_default();
            spec.split(',')
                .filter(|s| !s.is_empty())
                .map(parse)
                .collect()
        })
    }

    pub(super) fn armed_for(name: &str, value: u64) -> bool {
        points()
            .get(name)
            .is_some_and(|p| p.value.as_deref() == Some(value.to_string().as_str()))
    }

    pub(super) fn hit(name: &str, damage: impl FnOnce()) {
        if let Some(point) = points().get(name).filter(|p| p.value.is_none()) {
            if point.hits.fetch_add(1, Ordering::SeqCst) + 1 == point.fire_at {
                if let Some(stall) = point.stall {
                    eprintln!("FAILPOINT STALLED: {name} for {} ms", stall.as_millis());
                    std::thread::sleep(stall);
                    return;
                }
                damage();
                eprintln!("FAILPOINT FIRED: {name}");
                std::process::abort();
            }
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn specs_parse_with_and_without_count_and_stall() {
            let (name, p) = parse("aggregator.before_join@2~3000");
            assert_eq!(name, "aggregator.before_join");
            assert_eq!((p.fire_at, p.stall), (2, Some(Duration::from_secs(3))));
            let (name, p) = parse("aggregator.after_commit");
            assert_eq!(name, "aggregator.after_commit");
            assert_eq!((p.fire_at, p.stall), (1, None));
            let (name, p) = parse("x~250");
            assert_eq!(name, "x");
            assert_eq!((p.fire_at, p.stall), (1, Some(Duration::from_millis(250))));
            let (name, p) = parse("limiter.oversized_output=17");
            assert_eq!(name, "limiter.oversized_output");
            assert_eq!(p.value.as_deref(), Some("17"));
        }
    }
}

/// Crash here if the test armed `name`. Compiles to nothing without the
/// `failpoints` feature.
#[inline(always)]
pub fn hit(_name: &str) {
    #[cfg(feature = "failpoints")]
    armed::hit(_name, || {});
}

/// Like [`hit`], running `damage` first: leaves on disk what a crash at this
/// point would (e.g. a half-written file) when the crash itself cannot be
/// placed inside a library call.
#[inline(always)]
pub fn hit_after(_name: &str, _damage: impl FnOnce()) {
    #[cfg(feature = "failpoints")]
    armed::hit(_name, _damage);
}

/// Whether the test armed `name=VALUE` for this `value` (a fault meant for
/// one item, such as one input message). Always false without the
/// `failpoints` feature.
#[inline(always)]
pub fn armed_for(_name: &str, _value: u64) -> bool {
    #[cfg(feature = "failpoints")]
    return armed::armed_for(_name, _value);
    #[cfg(not(feature = "failpoints"))]
    false
}
