//! No import cycles between the modules of a product crate, at every level:
//! among the crate's top-level modules, and among the modules inside each
//! folder (`pacer/src/pacing/`: `state`, `controller`, `verdict`, …). A
//! module that imports from another never has that one (directly or
//! through others) import from it.
//!
//! The crate root is a facade: no module imports an item of it (`crate::Error`
//! rather than `crate::error::Error`) that the root's own code builds on. A
//! folder's `mod.rs` (or the `name.rs` beside it) is the parent its children
//! may build on (the struct its steps pass along, the metric names they
//! share); among the children, an item the parent re-exports from one of
//! them counts as that child's (`super::Verdict` from `pub use
//! verdict::Verdict` is an import from `verdict`).
//!
//! Read from the sources: the `crate::…`, `super::…` and `self::…` paths of
//! non-test code (every leaf of a `{…}` group apart), and a root file's
//! bare `child::…` paths and `use`s. Comments and `#[cfg(test)]` modules do
//! not count; an inline `mod x { … }` is read as part of its file.

mod graph;
mod paths;

use std::collections::BTreeSet;
use std::path::Path;

use adspend_harness::workspace_root;

use graph::{cycles, graph, levels, ROOT};
use paths::{absolute, module_paths};

const CRATES: [&str; 5] = ["wire", "common", "limiter", "aggregator", "pacer"];

/// Each cycle of the crate whose sources are `src`, at every level, with
/// the edges that close it; file names relative to `base`.
fn report(src: &Path, base: &Path) -> Vec<String> {
    let levels = levels(src);
    assert!(
        levels
            .iter()
            .any(|l| l.path.is_empty() && l.children.len() > 1),
        "{}: no modules found",
        src.display()
    );
    let mut report = Vec::new();
    for level in &levels {
        let graph = graph(src, level);
        for cycle in cycles(&graph) {
            let members: BTreeSet<&String> = cycle.iter().collect();
            let edges: Vec<String> = cycle
                .iter()
                .flat_map(|from| {
                    graph[from]
                        .iter()
                        .filter(|(to, _)| members.contains(to))
                        .map(move |(to, file)| {
                            let file = file.strip_prefix(base).unwrap_or(file);
                            format!("    {from} -> {to} ({})", file.display())
                        })
                })
                .collect();
            let at = match level.path.is_empty() {
                true => "crate root".to_string(),
                false => level.path.join("::"),
            };
            report.push(format!("{at}: {}\n{}", cycle.join(", "), edges.join("\n")));
        }
    }
    report
}

#[test]
fn the_product_crates_have_no_module_import_cycles() {
    let root = workspace_root();
    let mut found = Vec::new();
    for name in CRATES {
        let src = root.join(name).join("src");
        found.extend(
            report(&src, &root)
                .into_iter()
                .map(|cycle| format!("{name}: {cycle}")),
        );
    }
    assert!(found.is_empty(), "import cycles:\n{}", found.join("\n"));
}

#[test]
fn the_scan_sees_cycles_at_the_top_and_inside_a_folder() {
    // Made-up sources: a <-> b at the top level (a brace import, an
    // expression path), c importing the crate root's item while the root
    // uses c; inside folder a, x -> y through a renamed re-export of a's
    // mod.rs and y -> x, while both build on a's own item `A` (allowed).
    let dir = tempfile::tempdir().expect("tempdir");
    let src = dir.path().join("src");
    let files = [
        (
            "lib.rs",
            "mod a;\nmod b;\nmod c;\npub struct Error;\nfn f() { c::g() }\n",
        ),
        (
            "a/mod.rs",
            "mod x;\nmod y;\npub use y::Y as Why;\npub struct A;\npub fn f() { x::g() }\n",
        ),
        ("a/x.rs", "use super::{self, A, Why};\npub fn g() {}\n"),
        (
            "a/y.rs",
            "use super::{x::g, A};\npub struct Y;\nfn f() { crate::b::h() }\n",
        ),
        (
            "b.rs",
            "// crate::c\nuse crate::{a::{A, f}, self};\npub fn h() {}\n\
             #[cfg(test)]\nmod tests {\n    use crate::c;\n}\n",
        ),
        ("c.rs", "use crate::Error;\npub fn g() {}\n"),
        ("main.rs", "fn main() { crate::b::h() }\n"),
    ];
    for (path, code) in files {
        let path = src.join(path);
        std::fs::create_dir_all(path.parent().unwrap()).expect("mkdir");
        std::fs::write(&path, code).expect("write");
    }
    let level = |path: &[&str]| {
        let levels = levels(&src);
        let level = levels.into_iter().find(|l| l.path == named(path));
        graph(&src, &level.expect("level"))
    };
    let mut top = cycles(&level(&[]));
    top.sort();
    assert_eq!(top, vec![named(&[ROOT, "c"]), named(&["a", "b"])]);
    let a = level(&["a"]);
    assert_eq!(cycles(&a), vec![named(&["x", "y"])]);
    assert!(!a.contains_key(ROOT) && !a.values().any(|e| e.contains_key(ROOT)));
    let report = report(&src, dir.path());
    assert_eq!(report.len(), 3, "{report:#?}");
    assert!(
        report
            .iter()
            .any(|r| r.starts_with("a: x, y") && r.contains("x -> y (src/a/x.rs)")),
        "{report:#?}"
    );
}

#[test]
fn paths_are_read_as_the_compiler_resolves_them() {
    let read = |code: &str| {
        module_paths(code)
            .iter()
            .map(|path| path.join("::"))
            .collect::<Vec<_>>()
    };
    assert_eq!(
        read("use crate::{a::{b, c::D as E}, f::*};"),
        ["crate::a::b", "crate::a::c::D", "crate::f::*"]
    );
    assert_eq!(
        read("super::super::x::Y::<T>::new()"),
        ["super::super::x::Y"]
    );
    assert_eq!(read("$crate::m!(); my_crate::x; Self::y"), ["crate::m"]);
    let module = named(&["p", "q"]);
    let at = |path: &str| absolute(&module, &named(&path.split("::").collect::<Vec<_>>()));
    assert_eq!(at("super::x"), Some(named(&["p", "x"])));
    assert_eq!(at("self::x"), Some(named(&["p", "q", "x"])));
    assert_eq!(at("super::super::super::x"), None);
}

fn named(names: &[&str]) -> Vec<String> {
    names.iter().map(|n| n.to_string()).collect()
}
