//! Named crash points for the failure-injection suite.
//!
//! Built only with the `failpoints` feature. A test arms points with
//! `ADSPEND_FAILPOINTS=name[,name...]` (optionally `name@N` to fire on the
//! N-th hit); the process prints `FAILPOINT FIRED: name` to stderr and aborts,
//! exactly like a crash at that line.

#[cfg(feature = "failpoints")]
mod armed {
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::OnceLock;

    fn points() -> &'static HashMap<String, (u64, AtomicU64)> {
        static POINTS: OnceLock<HashMap<String, (u64, AtomicU64)>> = OnceLock::new();
        POINTS.get_or_init(|| {
            let spec = std::env::var("ADSPEND_FAILPOINTS").unwrap_or_default();
            spec.split(',')
                .filter(|s| !s.is_empty())
                .map(|s| match s.split_once('@') {
                    Some((name, n)) => (
                        name.to_string(),
                        (n.parse().unwrap_or(1), AtomicU64::new(0)),
                    ),
                    None => (s.to_string(), (1, AtomicU64::new(0))),
                })
                .collect()
        })
    }

    pub fn hit(name: &str, damage: impl FnOnce()) {
        if let Some((fire_at, hits)) = points().get(name) {
            if hits.fetch_add(1, Ordering::SeqCst) + 1 == *fire_at {
                damage();
                eprintln!("FAILPOINT FIRED: {name}");
                std::process::abort();
            }
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
