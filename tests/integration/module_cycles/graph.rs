//! The levels of a crate's modules and the imports among each level's
//! modules, as a graph, and its cycles.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use super::paths::{absolute, is_ident, module_of, module_paths, shipped_code, use_leaves};

/// The crate root's own code (lib.rs), as a node.
pub(super) const ROOT: &str = "<crate root>";

/// The crate, or a folder of modules inside it.
pub(super) struct Level {
    /// Module path from the crate root: `[]` for the crate, `["pacing"]`.
    pub(super) path: Vec<String>,
    /// lib.rs, the folder's mod.rs, or the `name.rs` beside the folder.
    root: Option<PathBuf>,
    /// Child module name → its files (a folder child's files too).
    pub(super) children: BTreeMap<String, Vec<PathBuf>>,
}

/// The crate and every folder of modules under `src`, deepest first.
pub(super) fn levels(src: &Path) -> Vec<Level> {
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

/// What a folder's root file imports from its children, by the name the
/// import binds: `pub use verdict::{decide, Verdict as V}` binds `decide`
/// and `V` to `verdict`.
fn bindings(code: &str, level: &Level) -> BTreeMap<String, String> {
    let depth = level.path.len();
    let mut out = BTreeMap::new();
    for (path, alias) in use_leaves(code) {
        let path = match path.first().map(String::as_str) {
            Some("crate" | "super" | "self") => absolute(&level.path, &path),
            Some(first) if level.children.contains_key(first) => {
                Some(level.path.iter().chain(&path).cloned().collect())
            }
            _ => None,
        };
        let Some(path) = path.map(|p| p.into_iter().filter(|s| s != "self").collect::<Vec<_>>())
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
    out
}

/// Module (or [`ROOT`]) → (module or [`ROOT`] it imports from → a file that does).
pub(super) type Graph = BTreeMap<String, BTreeMap<String, PathBuf>>;

/// The imports among `level`'s children (and its root's, at the top).
pub(super) fn graph(src: &Path, level: &Level) -> Graph {
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
pub(super) fn cycles(graph: &Graph) -> Vec<Vec<String>> {
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
