//! docs/CONFIGURATION.md and the code's settings in step: every setting a
//! service has (a flag with an `ADSPEND_*` environment variable, or an
//! `ADSPEND_*` variable it reads another way) has a row there, with its
//! flag, its services and its default, and every row is a setting the code
//! has. No servers: the settings come from the services' own clap
//! definitions and a scan of their sources.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use adspend_harness::workspace_root;
use clap::CommandFactory;

/// What the code says about one environment variable.
#[derive(Debug, Default)]
struct Setting {
    /// `--flag`, when it is a clap argument.
    flag: Option<String>,
    /// Service → its default as `--help` shows it (absent: none).
    services: BTreeMap<&'static str, Option<String>>,
}

/// The settings of the three services' clap definitions.
fn clap_settings() -> BTreeMap<String, Setting> {
    let commands = [
        ("limiter", adspend_limiter::Config::command()),
        ("aggregator", adspend_aggregator::Config::command()),
        ("pacer", adspend_pacer::Config::command()),
    ];
    let mut settings: BTreeMap<String, Setting> = BTreeMap::new();
    for (service, command) in commands {
        for arg in command.get_arguments() {
            let Some(env) = arg.get_env() else { continue };
            let env = env.to_string_lossy().to_string();
            let flag = arg.get_long().map(|l| format!("--{l}"));
            let default = arg
                .get_default_values()
                .first()
                .map(|d| d.to_string_lossy().to_string())
                .filter(|d| !d.is_empty());
            let setting = settings.entry(env.clone()).or_default();
            if let (Some(known), Some(flag)) = (&setting.flag, &flag) {
                assert_eq!(known, flag, "{env} has two flags");
            }
            setting.flag = setting.flag.take().or(flag);
            setting.services.insert(service, default);
        }
    }
    settings
}

/// Every `"ADSPEND_…"` string literal in the services' and common's
/// non-test sources: the names of `common/src/env.rs`, and variables read
/// without clap (`std::env::var("ADSPEND_FAILPOINTS")`).
fn source_names(root: &Path) -> BTreeSet<String> {
    fn walk(dir: &Path, out: &mut BTreeSet<String>) {
        for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let path = entry.expect("dir entry").path();
            if path.is_dir() {
                walk(&path, out);
                continue;
            }
            if path.extension().is_none_or(|e| e != "rs")
                || path.file_name().is_some_and(|n| n == "tests.rs")
            {
                continue;
            }
            let text = std::fs::read_to_string(&path).expect("read source");
            // A file's unit tests come last, after `#[cfg(test)]`.
            let code = text.split("#[cfg(test)]").next().unwrap_or_default();
            for (at, _) in code.match_indices("\"ADSPEND_") {
                let name: String = code[at + 1..]
                    .chars()
                    .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
                    .collect();
                if code[at + 1 + name.len()..].starts_with('"') {
                    out.insert(name);
                }
            }
        }
    }
    let mut names = BTreeSet::new();
    for krate in ["common", "limiter", "aggregator", "pacer"] {
        walk(&root.join(krate).join("src"), &mut names);
    }
    names
}

/// One row of a settings table in docs/CONFIGURATION.md.
#[derive(Debug)]
struct Row {
    flag: String,
    services: BTreeSet<String>,
    default: String,
}

/// The rows of docs/CONFIGURATION.md's tables, by environment variable:
/// `| `ADSPEND_X` | `--flag` | services | default | meaning |`.
fn documented(doc: &str) -> BTreeMap<String, Row> {
    let mut rows = BTreeMap::new();
    for line in doc.lines().filter(|l| l.starts_with("| `ADSPEND_")) {
        let cells: Vec<&str> = line.trim_matches('|').split(" | ").map(str::trim).collect();
        assert!(
            cells.len() >= 5,
            "not env | flag | services | default | meaning: {line}"
        );
        let env = cells[0].trim_matches('`').to_string();
        let row = Row {
            flag: cells[1].trim_matches('`').to_string(),
            services: cells[2].split(',').map(|s| s.trim().to_string()).collect(),
            default: cells[3].to_string(),
        };
        assert!(
            rows.insert(env.clone(), row).is_none(),
            "{env} has two rows in docs/CONFIGURATION.md"
        );
    }
    rows
}

#[test]
fn configuration_doc_names_every_setting_and_only_those() {
    let root = workspace_root();
    let doc = std::fs::read_to_string(root.join("docs/CONFIGURATION.md"))
        .expect("read docs/CONFIGURATION.md");
    let rows = documented(&doc);
    let clap = clap_settings();
    let sources = source_names(&root);
    assert!(clap.len() >= 40, "found only {} clap settings", clap.len());
    assert!(
        sources.contains("ADSPEND_FAILPOINTS"),
        "the source scan found {sources:?}"
    );

    let in_code: BTreeSet<&String> = clap.keys().chain(sources.iter()).collect();
    let missing: Vec<&&String> = in_code
        .iter()
        .filter(|name| !rows.contains_key(name.as_str()))
        .collect();
    assert!(
        missing.is_empty(),
        "settings of the code missing from docs/CONFIGURATION.md: {missing:?}"
    );
    let unknown: Vec<&String> = rows.keys().filter(|name| !in_code.contains(name)).collect();
    assert!(
        unknown.is_empty(),
        "docs/CONFIGURATION.md names settings the code lacks: {unknown:?}"
    );

    for (env, setting) in &clap {
        let row = &rows[env];
        let flag = setting.flag.as_deref().unwrap_or("none");
        assert_eq!(row.flag, flag, "{env}: the flag");
        let services: BTreeSet<String> = setting.services.keys().map(|s| s.to_string()).collect();
        assert_eq!(row.services, services, "{env}: the services");
        for (service, default) in &setting.services {
            if let Some(default) = default {
                assert!(
                    row.default.contains(&format!("`{default}`")),
                    "{env}: the {service}'s default is `{default}`; the doc says {:?}",
                    row.default
                );
            }
        }
    }
}
