//! Logging and metrics: `tracing` to stderr, `metrics` exported for
//! Prometheus. The metric names here are only those more than one service
//! exports through this crate: the NATS connection's (every service), the
//! catalog watcher's (the limiter and the pacer) and etcd's status (every
//! service that uses etcd). Each service names its
//! own in its `telemetry` module, with their `# HELP` texts and the bucket
//! bounds of its histograms.
//!
//! Names follow one rule: `adspend_<component>_<thing>_<unit>`, where the
//! component is the service that exports it (`limiter`, `aggregator`,
//! `pacer`), `catalog` for the catalog watcher the limiter and the pacer
//! both run, `nats` for the NATS connection every service makes, or `etcd`
//! for etcd's state as every service that uses it reads it; the
//! unit is `total` (counters), `seconds` or `bytes`; gauges of a count or a
//! state carry no unit. The one exception is the limiter's
//! `adspend_rejected_total`, whose name the external contract fixes.
//! Every histogram has bucket bounds in its service's `HISTOGRAMS`, which
//! the recorder is built with ([`crate::service::Service::HISTOGRAMS`]), so
//! none is exported as a summary.

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tracing_subscriber::EnvFilter;

/// 1 when the NATS server this service connected to lets clients in without
/// authentication (anyone reaching it may publish anything), else 0.
pub(crate) const NATS_UNAUTHENTICATED: &str = "adspend_nats_unauthenticated";
/// Operations the NATS server refused this service for lack of permission
/// (`kind`: `publish` or `subscribe`); any increase is a missing grant in
/// the server's config or a call the service should not make.
pub(crate) const NATS_PERMISSION_VIOLATIONS_TOTAL: &str =
    "adspend_nats_permission_violations_total";
/// etcd's database file, as the maintenance status reports it (every
/// service that uses etcd, [`crate::etcd`]).
pub(crate) const ETCD_DB_SIZE_BYTES: &str = "adspend_etcd_db_size_bytes";
/// What of it is in use (compaction frees space, defragmentation returns it).
pub(crate) const ETCD_DB_SIZE_IN_USE_BYTES: &str = "adspend_etcd_db_size_in_use_bytes";
/// `ADSPEND_ETCD_QUOTA_BYTES`: etcd's quota, which its API does not report.
pub(crate) const ETCD_QUOTA_BYTES: &str = "adspend_etcd_quota_bytes";
/// 1 while etcd has a `NOSPACE` alarm raised (it refuses writes), else 0.
pub(crate) const ETCD_NOSPACE_ALARM: &str = "adspend_etcd_nospace_alarm";
pub(crate) const CATALOG_RELOADS_TOTAL: &str = "adspend_catalog_reloads_total";
pub(crate) const CATALOG_ERRORS_TOTAL: &str = "adspend_catalog_errors_total";

/// Histograms with their bucket bounds, as a service declares its own.
pub type Histograms = &'static [(&'static str, &'static [f64])];

/// The `# HELP` text of every metric named here, one line each: Prometheus
/// tooling (`promtool check metrics`) wants one for every metric.
pub(crate) const DESCRIPTIONS: &[(&str, &str)] = &[
    (
        NATS_UNAUTHENTICATED,
        "1 when the NATS server this service connected to lets clients in without authentication, else 0.",
    ),
    (
        NATS_PERMISSION_VIOLATIONS_TOTAL,
        "Operations the NATS server refused this service for lack of permission, by kind (publish, subscribe).",
    ),
    (
        ETCD_DB_SIZE_BYTES,
        "Size of etcd's database file (maintenance status db_size).",
    ),
    (
        ETCD_DB_SIZE_IN_USE_BYTES,
        "Bytes of etcd's database in use (raft_used_db_size): the rest is freed by compaction, returned by defragmentation.",
    ),
    (
        ETCD_QUOTA_BYTES,
        "etcd's quota as ADSPEND_ETCD_QUOTA_BYTES says (default etcd's 2 GiB); past it etcd refuses writes.",
    ),
    (
        ETCD_NOSPACE_ALARM,
        "1 while etcd has a NOSPACE alarm raised (it refuses writes), else 0.",
    ),
    (CATALOG_RELOADS_TOTAL, "Catalog versions loaded."),
    (
        CATALOG_ERRORS_TOTAL,
        "Catalog versions refused or unreadable (the previous catalog stays in force).",
    ),
];

/// Give every metric of `descriptions` its `# HELP` text, in the installed
/// recorder. Its kind follows from the naming rule: `_total` a counter, a
/// name of `histograms` a histogram, else a gauge.
pub fn describe(descriptions: &[(&'static str, &'static str)], histograms: Histograms) {
    for &(name, help) in descriptions {
        if name.ends_with("_total") {
            metrics::describe_counter!(name, help);
        } else if histograms.iter().any(|(n, _)| *n == name) {
            metrics::describe_histogram!(name, help);
        } else {
            metrics::describe_gauge!(name, help);
        }
    }
}

/// `builder` with the bucket bounds of `histograms`.
fn with_histogram_buckets(
    mut builder: PrometheusBuilder,
    histograms: Histograms,
) -> Result<PrometheusBuilder, metrics_exporter_prometheus::BuildError> {
    for (name, buckets) in histograms {
        builder = builder.set_buckets_for_metric(
            metrics_exporter_prometheus::Matcher::Full((*name).to_string()),
            buckets,
        )?;
    }
    Ok(builder)
}

static HANDLE: std::sync::OnceLock<PrometheusHandle> = std::sync::OnceLock::new();

/// The installed recorder's handle, for services that also serve `/metrics`
/// on their own port; `None` when no recorder was installed (in-process tests).
pub fn metrics_handle() -> Option<&'static PrometheusHandle> {
    HANDLE.get()
}

/// Log to stderr; `RUST_LOG` overrides the default `info`.
pub fn init_tracing() {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Install the global Prometheus recorder, with the bucket bounds of the
/// service's `histograms` (none of this crate's metrics is one). Returns the
/// handle whose `render()` the services serve as `/metrics` on listeners
/// they bound themselves ([`crate::service`]).
pub(crate) fn install_metrics(histograms: Histograms) -> PrometheusHandle {
    let recorder = with_histogram_buckets(PrometheusBuilder::new(), histograms)
        .expect("every bucket list is non-empty")
        .build_recorder();
    let handle = recorder.handle();
    // Once per process; a second install keeps the first recorder.
    if metrics::set_global_recorder(recorder).is_ok() {
        let _ = HANDLE.set(handle.clone());
        describe(DESCRIPTIONS, &[]);
    }
    HANDLE.get().cloned().unwrap_or(handle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// The crates that name metrics in their `src/telemetry.rs`.
    const CRATES: [&str; 4] = ["common", "limiter", "aggregator", "pacer"];

    /// A histogram of these tests, with its bounds.
    const TEST_HISTOGRAMS: Histograms = &[("adspend_test_seconds", &[0.1, 0.25, 0.5])];

    /// `krate`'s `src/telemetry.rs`.
    fn telemetry_source(krate: &str) -> String {
        let path = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(krate)
            .join("src/telemetry.rs");
        std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
    }

    /// `(const name, metric name)` of every metric name a telemetry module
    /// declares (its tests left out).
    fn declared(source: &str) -> Vec<(String, String)> {
        let code = source.split("#[cfg(test)]").next().unwrap();
        code.split(';')
            .filter_map(|item| {
                // One line however rustfmt wrapped it.
                let item = item.split_whitespace().collect::<Vec<_>>().join(" ");
                let rest = item
                    .split_once("pub const ")
                    .or_else(|| item.split_once("pub(crate) const "))?
                    .1;
                let (ident, value) = rest.split_once(": &str = \"")?;
                let value = value.strip_suffix('"')?;
                Some((ident.to_string(), value.to_string()))
            })
            .collect()
    }

    /// The text of the table `const <name>` of `source`, up to its `];`.
    fn table<'a>(source: &'a str, name: &str) -> &'a str {
        let start = source
            .find(&format!("const {name}: "))
            .unwrap_or_else(|| panic!("no const {name}"));
        let rest = &source[start..];
        &rest[..rest.find("];").unwrap_or(rest.len())]
    }

    /// Whether `text` names `ident` as a whole word.
    fn mentions(text: &str, ident: &str) -> bool {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .any(|word| word == ident)
    }

    #[test]
    fn every_name_follows_the_rule() {
        let names: Vec<(String, String)> = CRATES
            .iter()
            .flat_map(|krate| declared(&telemetry_source(krate)))
            .collect();
        assert!(names.len() >= 60, "found only {} names", names.len());
        assert!(names
            .iter()
            .any(|(i, _)| i == "CHECKPOINT_UPLOADED_BYTES_TOTAL"));
        let mut metrics: Vec<&str> = names.iter().map(|(_, n)| n.as_str()).collect();
        metrics.sort_unstable();
        assert!(
            metrics.windows(2).all(|w| w[0] != w[1]),
            "a metric name declared twice"
        );
        for (ident, name) in names {
            if name == "adspend_rejected_total" {
                continue;
            }
            let rest = ["limiter", "aggregator", "pacer", "catalog", "nats", "etcd"]
                .iter()
                .find_map(|c| name.strip_prefix(&format!("adspend_{c}_")));
            let thing = rest.unwrap_or_else(|| panic!("{ident} = {name}: no component"));
            assert!(
                !thing.is_empty() && thing.bytes().all(|b| b.is_ascii_lowercase() || b == b'_'),
                "{ident} = {name}"
            );
            if ident.ends_with("_TOTAL") {
                assert!(name.ends_with("_total"), "{ident} = {name}");
            }
            if ident.ends_with("_SECONDS") || ident.ends_with("_BYTES") {
                let unit = ident.rsplit('_').next().unwrap().to_ascii_lowercase();
                assert!(name.ends_with(&format!("_{unit}")), "{ident} = {name}");
            }
        }
    }

    #[test]
    fn every_name_has_help() {
        let names = declared(include_str!("telemetry.rs"));
        assert!(names.len() >= 3, "{names:?}");
        for (ident, name) in &names {
            assert!(
                DESCRIPTIONS
                    .iter()
                    .any(|(n, help)| n == name && !help.trim().is_empty()),
                "{ident} = {name} has no description in DESCRIPTIONS"
            );
        }
        for (name, _) in DESCRIPTIONS {
            assert!(
                names.iter().any(|(_, n)| n == name),
                "{name} is described but not declared here"
            );
        }
        // The services' tables, by the names of their consts.
        for krate in &CRATES[1..] {
            let source = telemetry_source(krate);
            let descriptions = table(&source, "DESCRIPTIONS");
            for (ident, name) in declared(&source) {
                assert!(
                    mentions(descriptions, &ident),
                    "{krate}: {ident} = {name} has no description in its DESCRIPTIONS"
                );
            }
        }
    }

    #[test]
    fn descriptions_render_as_help_lines() {
        let recorder = with_histogram_buckets(PrometheusBuilder::new(), TEST_HISTOGRAMS)
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        let test_seconds = TEST_HISTOGRAMS[0].0;
        let test_help = "A histogram of the tests.";
        metrics::with_local_recorder(&recorder, || {
            describe(DESCRIPTIONS, &[]);
            describe(&[(test_seconds, test_help)], TEST_HISTOGRAMS);
            metrics::counter!(CATALOG_ERRORS_TOTAL).increment(1);
            metrics::gauge!(NATS_UNAUTHENTICATED).set(1.0);
            metrics::histogram!(test_seconds).record(0.2);
        });
        let text = handle.render();
        let help = |name: &str| DESCRIPTIONS.iter().find(|(n, _)| *n == name).unwrap().1;
        for (name, help, kind) in [
            (CATALOG_ERRORS_TOTAL, help(CATALOG_ERRORS_TOTAL), "counter"),
            (NATS_UNAUTHENTICATED, help(NATS_UNAUTHENTICATED), "gauge"),
            (test_seconds, test_help, "histogram"),
        ] {
            assert!(
                text.contains(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n")),
                "{name}: {text}"
            );
        }
    }

    /// The name consts that `histogram!` calls in `krate`'s sources use.
    fn histograms_used(krate: &str) -> Vec<String> {
        fn walk(dir: &Path, out: &mut Vec<String>) {
            for entry in std::fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    walk(&path, out);
                } else if path.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&path).unwrap();
                    for (i, m) in text.match_indices("histogram!(") {
                        let after = &text[i + m.len()..];
                        let ident: String = after
                            .trim_start()
                            .chars()
                            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                            .collect();
                        out.push(ident);
                    }
                }
            }
        }
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut used = Vec::new();
        walk(&root.join(krate).join("src"), &mut used);
        // Names that are not consts (this module's own tests) are left out.
        used.retain(|ident| {
            !ident.is_empty() && ident.bytes().all(|b| b.is_ascii_uppercase() || b == b'_')
        });
        used.sort();
        used.dedup();
        used
    }

    /// Every histogram a crate records has bucket bounds in the `HISTOGRAMS`
    /// of its telemetry module, which its `Service` impl hands to the
    /// recorder.
    #[test]
    fn every_histogram_has_buckets() {
        let mut found = 0;
        for krate in CRATES {
            let source = telemetry_source(krate);
            for ident in histograms_used(krate) {
                found += 1;
                assert!(
                    mentions(table(&source, "HISTOGRAMS"), &ident),
                    "{krate}: histogram {ident} has no buckets in its HISTOGRAMS"
                );
            }
        }
        assert!(found >= 4, "found only {found} histograms");
    }

    #[test]
    fn histograms_render_as_buckets_not_quantiles() {
        let recorder = with_histogram_buckets(PrometheusBuilder::new(), TEST_HISTOGRAMS)
            .unwrap()
            .build_recorder();
        let handle = recorder.handle();
        metrics::with_local_recorder(&recorder, || {
            for (name, _) in TEST_HISTOGRAMS {
                metrics::histogram!(*name).record(0.2);
            }
        });
        let text = handle.render();
        assert!(!text.contains("quantile="), "{text}");
        for (name, buckets) in TEST_HISTOGRAMS {
            assert!(
                text.contains(&format!("# TYPE {name} histogram")),
                "{name}: {text}"
            );
            // 0.2 s falls in every bucket from the first bound at or above it.
            for bound in buckets.iter() {
                let count = u64::from(*bound >= 0.2);
                let line = format!("{name}_bucket{{le=\"{bound}\"}} {count}");
                assert!(text.contains(&line), "missing {line}: {text}");
            }
            assert!(text.contains(&format!("{name}_count 1")), "{name}: {text}");
        }
    }
}
