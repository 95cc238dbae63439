//! No import cycles between the top-level modules of a product crate: a
//! module that imports from another never has that one (directly or
//! through others) import from it, and no module imports an item of the
//! crate root (`crate::Error` rather than `crate::error::Error`) that the
//! root's own code builds on. Read from the sources, as `crate::…` paths in
//! non-test code; comments and `#[cfg(test)]` modules do not count.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use adspend_harness::workspace_root;

const CRATES: [&str; 5] = ["wire", "common", "limiter", "aggregator", "pacer"];
/// The crate root's own code (lib.rs), as a node.
const ROOT: &str = "<crate root>";

/// Top-level module name → its files (a directory module's files too).
fn modules(src: &Path) -> BTreeMap<String, Vec<PathBuf>> {
    let mut out: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(src).expect("read src") {
        let path = entry.expect("dir entry").path();
        let name = path.file_stem().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            out.entry(name).or_default().extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs")
            && !matches!(name.as_str(), "lib" | "main")
        {
            out.entry(name).or_default().push(path);
        }
    }
    out
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            // `tests/` directories under a module hold test-only code.
            if path.file_name().is_some_and(|n| n != "tests") {
                files.extend(rust_files(&path));
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The code of a file that ships: no comments, no `#[cfg(test)]` module
/// (by convention the last item of a file), nothing from a test-only file.
fn shipped_code(path: &Path) -> String {
    let stem = path.file_stem().unwrap().to_string_lossy();
    if stem.ends_with("tests") {
        return String::new();
    }
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let text = match text.find("#[cfg(test)]\nmod ") {
        Some(at) => &text[..at],
        None => &text[..],
    };
    text.lines()
        .map(|line| match line.find("//") {
            Some(at) => &line[..at],
            None => line,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// First path segments after every `crate::` (each of a `crate::{a, b}`).
fn crate_refs(code: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (at, _) in code.match_indices("crate::") {
        if at > 0 && is_ident(code[..at].chars().next_back().unwrap()) {
            continue; // `some_crate::…`, not `crate::`
        }
        let rest = &code[at + "crate::".len()..];
        if let Some(group) = rest.strip_prefix('{') {
            let group = &group[..group.find('}').unwrap_or(group.len())];
            for item in group.split(',') {
                let first: String = item.trim().chars().take_while(|c| is_ident(*c)).collect();
                if !first.is_empty() && first != "self" {
                    out.insert(first);
                }
            }
        } else {
            let first: String = rest.chars().take_while(|c| is_ident(*c)).collect();
            if !first.is_empty() {
                out.insert(first);
            }
        }
    }
    out
}

/// Module → (module or [`ROOT`] it imports from → a file that does).
type Graph = BTreeMap<String, BTreeMap<String, PathBuf>>;

fn graph(crate_dir: &Path) -> Graph {
    let src = crate_dir.join("src");
    let modules = modules(&src);
    let mut graph = Graph::new();
    for (name, files) in &modules {
        let edges = graph.entry(name.clone()).or_default();
        for file in files {
            for target in crate_refs(&shipped_code(file)) {
                let node = if modules.contains_key(&target) {
                    target
                } else {
                    ROOT.to_string()
                };
                if &node != name {
                    edges.entry(node).or_insert_with(|| file.clone());
                }
            }
        }
    }
    let lib = src.join("lib.rs");
    if lib.exists() {
        let code = shipped_code(&lib);
        let edges = graph.entry(ROOT.to_string()).or_default();
        for name in modules.keys() {
            let used = code.match_indices(&format!("{name}::")).any(|(at, _)| {
                at == 0
                    || !is_ident(code[..at].chars().next_back().unwrap())
                        && !code[..at].ends_with("::")
            });
            if used {
                edges.insert(name.clone(), lib.clone());
            }
        }
    }
    graph
}

/// The strongly connected components with more than one node (Tarjan).
fn cycles(graph: &Graph) -> Vec<Vec<String>> {
    struct Tarjan<'a> {
        graph: &'a Graph,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Tarjan<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.graph.get(v).into_iter().flat_map(|e| e.keys()) {
                let w = w.as_str();
                if !self.graph.contains_key(w) {
                    continue;
                }
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                loop {
                    let w = self.stack.pop().expect("on the stack");
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut t = Tarjan {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.found
}

#[test]
fn the_product_crates_have_no_module_import_cycles() {
    let root = workspace_root();
    let root = root.as_path();
    let mut report = Vec::new();
    for name in CRATES {
        let graph = graph(&root.join(name));
        assert!(graph.len() > 1, "{name}: no modules found");
        for cycle in cycles(&graph) {
            let members: BTreeSet<&String> = cycle.iter().collect();
            let edges: Vec<String> = cycle
                .iter()
                .flat_map(|from| {
                    graph[from]
                        .iter()
                        .filter(|(to, _)| members.contains(to))
                        .map(move |(to, file)| {
                            let file = file.strip_prefix(root).unwrap_or(file);
                            format!("    {from} -> {to} ({})", file.display())
                        })
                })
                .collect();
            report.push(format!(
                "{name}: {}\n{}",
                cycle.join(", "),
                edges.join("\n")
            ));
        }
    }
    assert!(report.is_empty(), "import cycles:\n{}", report.join("\n"));
}

#[test]
fn the_scan_sees_a_cycle_and_a_root_import() {
    // The checker itself, on made-up modules: a ↔ b through a brace import,
    // and c importing the root's item while the root uses c.
    let mut graph = Graph::new();
    let file = PathBuf::from("x.rs");
    for (from, code) in [
        ("a", "use crate::{b::Thing, self};"),
        ("b", "fn f() { crate::a::g() }"),
        ("c", "use crate::Error;"),
    ] {
        let edges = graph.entry(from.to_string()).or_default();
        for target in crate_refs(code) {
            let node = if ["a", "b", "c"].contains(&target.as_str()) {
                target
            } else {
                ROOT.to_string()
            };
            edges.insert(node, file.clone());
        }
    }
    graph
        .entry(ROOT.to_string())
        .or_default()
        .insert("c".to_string(), file.clone());
    let mut found = cycles(&graph);
    found.sort();
    let named = |names: &[&str]| names.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    assert_eq!(found, vec![named(&[ROOT, "c"]), named(&["a", "b"])]);
    assert!(crate_refs("// crate::z\nuse crate::y;").contains("z"));
    assert!(crate_refs(&shipped_code_of("// crate::z\nuse crate::y;")).len() == 1);
}

/// [`shipped_code`] of a text rather than a file.
fn shipped_code_of(text: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir");
    let path = dir.path().join("m.rs");
    std::fs::write(&path, text).expect("write");
    shipped_code(&path)
}
