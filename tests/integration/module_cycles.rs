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

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use adspend_harness::workspace_root;

const CRATES: [&str; 5] = ["wire", "common", "limiter", "aggregator", "pacer"];
/// The crate root's own code (lib.rs), as a node.
const ROOT: &str = "<crate root>";

/// The crate, or a folder of modules inside it.
struct Level {
    /// Module path from the crate root: `[]` for the crate, `["pacing"]`.
    path: Vec<String>,
    /// lib.rs, the folder's mod.rs, or the `name.rs` beside the folder.
    root: Option<PathBuf>,
    /// Child module name → its files (a folder child's files too).
    children: BTreeMap<String, Vec<PathBuf>>,
}

/// The crate and every folder of modules under `src`, deepest first.
fn levels(src: &Path) -> Vec<Level> {
    let lib = src.join("lib.rs");
    let mut out = Vec::new();
    collect(src, Vec::new(), lib.exists().then_some(lib), &mut out);
    out
}

fn collect(dir: &Path, path: Vec<String>, root: Option<PathBuf>, out: &mut Vec<Level>) {
    let mut children: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    let mut folders = Vec::new();
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read dir")
        .map(|entry| entry.expect("dir entry").path())
        .collect();
    entries.sort();
    for entry in entries {
        let name = entry.file_stem().unwrap().to_string_lossy().to_string();
        if entry.is_dir() {
            // `tests/` folders hold test-only code; `src/bin/` binaries.
            if name == "tests" || (path.is_empty() && name == "bin") {
                continue;
            }
            children
                .entry(name.clone())
                .or_default()
                .extend(rust_files(&entry));
            folders.push((name, entry));
        } else if entry.extension().is_some_and(|e| e == "rs") {
            let root_file = if path.is_empty() {
                matches!(name.as_str(), "lib" | "main")
            } else {
                name == "mod"
            };
            if !root_file {
                children.entry(name).or_default().push(entry);
            }
        }
    }
    for (name, folder) in folders {
        let root = [folder.join("mod.rs"), dir.join(format!("{name}.rs"))]
            .into_iter()
            .find(|file| file.exists());
        let mut inner = path.clone();
        inner.push(name);
        collect(&folder, inner, root, out);
    }
    out.push(Level {
        path,
        root,
        children,
    });
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

/// The module a file holds, as a path from the crate root.
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let relative = file
        .strip_prefix(src)
        .expect("under src")
        .with_extension("");
    let mut path: Vec<String> = relative
        .iter()
        .map(|part| part.to_string_lossy().to_string())
        .collect();
    if path.last().is_some_and(|last| last == "mod") || path == ["lib"] {
        path.pop();
    }
    path
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

/// Every path of `code` that starts at `crate`, `super` or `self`, each
/// leaf of a group apart: `use super::{a::B, c as d}` is `super::a::B` and
/// `super::c`.
fn module_paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    for keyword in ["crate::", "super::", "self::"] {
        for (at, _) in code.match_indices(keyword) {
            let before = code[..at].chars().next_back();
            // `some_crate::…`, `itself::…`, or the second `super` of a chain.
            if before.is_some_and(|c| is_ident(c) || c == ':') {
                continue;
            }
            let mut tree = Tree { code, at };
            tree.parse(Vec::new(), &mut out);
        }
    }
    out.into_iter().map(|(path, _)| path).collect()
}

/// What a folder's root file imports from its children, by the name the
/// import binds: `pub use verdict::{decide, Verdict as V}` binds `decide`
/// and `V` to `verdict`.
fn bindings(code: &str, level: &Level) -> BTreeMap<String, String> {
    let depth = level.path.len();
    let mut out = BTreeMap::new();
    for (at, _) in code.match_indices("use ") {
        if at > 0 && is_ident(code[..at].chars().next_back().unwrap()) {
            continue;
        }
        let mut leaves = Vec::new();
        Tree { code, at: at + 4 }.parse(Vec::new(), &mut leaves);
        for (path, alias) in leaves {
            let path = match path.first().map(String::as_str) {
                Some("crate" | "super" | "self") => absolute(&level.path, &path),
                Some(first) if level.children.contains_key(first) => {
                    Some(level.path.iter().chain(&path).cloned().collect())
                }
                _ => None,
            };
            let Some(path) =
                path.map(|p| p.into_iter().filter(|s| s != "self").collect::<Vec<_>>())
            else {
                continue;
            };
            if path.len() > depth + 1
                && path[..depth] == level.path[..]
                && level.children.contains_key(&path[depth])
            {
                let name = alias.unwrap_or_else(|| path[path.len() - 1].clone());
                out.insert(name, path[depth].clone());
            }
        }
    }
    out
}

/// A use tree (or a path in an expression) being read from `code[at..]`.
struct Tree<'a> {
    code: &'a str,
    at: usize,
}

impl Tree<'_> {
    fn rest(&self) -> &str {
        &self.code[self.at..]
    }

    fn skip_space(&mut self) {
        let rest = self.rest();
        self.at += rest.len() - rest.trim_start().len();
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_space();
        let found = self.rest().starts_with(token);
        if found {
            self.at += token.len();
        }
        found
    }

    /// A segment: an identifier, or the `*` of a glob.
    fn segment(&mut self) -> Option<String> {
        self.skip_space();
        if self.eat("*") {
            return Some("*".to_string());
        }
        let segment: String = self.rest().chars().take_while(|c| is_ident(*c)).collect();
        self.at += segment.len();
        (!segment.is_empty()).then_some(segment)
    }

    /// Each leaf's path, and the name it is bound to when renamed.
    fn parse(&mut self, mut path: Vec<String>, out: &mut Vec<(Vec<String>, Option<String>)>) {
        loop {
            if self.eat("{") {
                while !self.eat("}") {
                    let before = self.at;
                    self.parse(path.clone(), out);
                    if !self.eat(",") && self.at == before {
                        return; // not a use tree after all
                    }
                }
                return;
            }
            match self.segment() {
                Some(segment) => path.push(segment),
                None => break,
            }
            if !self.rest().starts_with("::") {
                break;
            }
            self.at += 2;
        }
        // `… as name`
        let rest = self.rest().trim_start();
        let mut alias = None;
        if rest.starts_with("as") && rest[2..].starts_with(|c: char| !is_ident(c)) {
            self.eat("as");
            alias = self.segment();
        }
        if !path.is_empty() {
            out.push((path, alias));
        }
    }
}

/// `path` (from `crate`, `super` or `self`), read in `module`, as a path
/// from the crate root; `None` past the crate root.
fn absolute(module: &[String], path: &[String]) -> Option<Vec<String>> {
    let mut segments = path.iter().peekable();
    let mut absolute = if path.first()? == "crate" {
        segments.next();
        Vec::new()
    } else {
        module.to_vec()
    };
    while let Some(segment) = segments.peek() {
        match segment.as_str() {
            "self" => {}
            "super" => {
                absolute.pop()?;
            }
            _ => break,
        }
        segments.next();
    }
    absolute.extend(segments.filter(|s| *s != "self").cloned());
    Some(absolute)
}

/// Module (or [`ROOT`]) → (module or [`ROOT`] it imports from → a file that does).
type Graph = BTreeMap<String, BTreeMap<String, PathBuf>>;

/// The imports among `level`'s children (and its root's, at the top).
fn graph(src: &Path, level: &Level) -> Graph {
    let depth = level.path.len();
    let top = depth == 0;
    let bindings = match &level.root {
        Some(root) if !top => bindings(&shipped_code(root), level),
        _ => BTreeMap::new(),
    };
    // The node of `level` an absolute path leads into, if it leads below it.
    let node = |absolute: &[String]| -> Option<String> {
        if absolute.len() <= depth || absolute[..depth] != level.path[..] {
            return None;
        }
        let child = &absolute[depth];
        if level.children.contains_key(child) {
            Some(child.clone())
        } else if let Some(child) = bindings.get(child) {
            Some(child.clone())
        } else {
            // The root's own item: below the top, the parent's.
            top.then(|| ROOT.to_string())
        }
    };
    let mut graph = Graph::new();
    let root = level.root.iter().filter(|_| top);
    let files = level
        .children
        .iter()
        .flat_map(|(name, files)| files.iter().map(move |file| (name.as_str(), file)))
        .chain(root.map(|file| (ROOT, file)));
    for (from, file) in files {
        let code = shipped_code(file);
        let module = module_of(src, file);
        let mut targets: Vec<String> = module_paths(&code)
            .iter()
            .filter_map(|path| absolute(&module, path))
            .filter_map(|path| node(&path))
            .collect();
        if from == ROOT {
            // The root file names its children without a prefix.
            targets.extend(
                level
                    .children
                    .keys()
                    .filter(|name| {
                        code.match_indices(&format!("{name}::")).any(|(at, _)| {
                            at == 0
                                || !is_ident(code[..at].chars().next_back().unwrap())
                                    && !code[..at].ends_with("::")
                        })
                    })
                    .cloned(),
            );
        }
        let edges = graph.entry(from.to_string()).or_default();
        for to in targets {
            if to != from {
                edges.entry(to).or_insert_with(|| file.clone());
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
