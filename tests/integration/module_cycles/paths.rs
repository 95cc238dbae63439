//! Reading a source file: its shipped code, the module it holds, and the
//! paths it names from `crate`, `super` or `self`.

use std::path::Path;

/// The module a file holds, as a path from the crate root.
pub(super) fn module_of(src: &Path, file: &Path) -> Vec<String> {
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
pub(super) fn shipped_code(path: &Path) -> String {
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

pub(super) fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Every path of `code` that starts at `crate`, `super` or `self`, each
/// leaf of a group apart: `use super::{a::B, c as d}` is `super::a::B` and
/// `super::c`.
pub(super) fn module_paths(code: &str) -> Vec<Vec<String>> {
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

/// Every leaf of the `use` declarations of `code`, with the name it is
/// bound to when renamed.
pub(super) fn use_leaves(code: &str) -> Vec<(Vec<String>, Option<String>)> {
    let mut leaves = Vec::new();
    for (at, _) in code.match_indices("use ") {
        if at > 0 && is_ident(code[..at].chars().next_back().unwrap()) {
            continue;
        }
        Tree { code, at: at + 4 }.parse(Vec::new(), &mut leaves);
    }
    leaves
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
pub(super) fn absolute(module: &[String], path: &[String]) -> Option<Vec<String>> {
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
