//! `cargo xtask modcheck [--graph]`: no import cycle between sibling modules of `mlx5-core` or `mlx5-sim`.
//!
//! The rule: at every level of a crate's module tree (the crate's top-level modules, and the submodules of one
//! folder), the graph of references between sibling modules is acyclic, so a reader can follow the layers in one
//! direction. A reference from module `a::x` to module `b::y` (a path `crate::b::y`, `super::b`, `self::c`, or a
//! bare `sibling::Item` brought into scope by `use super::*`) is an edge `a -> b` at their lowest common level.
//! A module naming its own ancestors' items (`crate::SimDevice`, `super::Item`) or its own descendants is not an
//! edge: a parent owns its children. Method calls are not references. `#[cfg(test)]` modules inside a file are
//! left out: test code may use any helper without shaping the architecture.
//!
//! The parser is textual (comments and string literals stripped first), which is enough for this code base: it
//! never builds paths in macros across modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A module path from the crate root, e.g. `["fw", "cq"]`; the root is `[]`.
type ModPath = Vec<String>;

/// The crates whose module graphs must be acyclic, by their source folder.
const CRATES: &[(&str, &str)] = &[("mlx5-core", "core/src"), ("mlx5-sim", "sim/src")];

/// Runs the check over every crate in [`CRATES`]; `graph` also prints each level's edges.
pub fn run(root: &Path, graph: bool) -> Result<(), String> {
    let mut failures = Vec::new();
    for (name, dir) in CRATES {
        let report = check_crate(&root.join(dir))?;
        println!(
            "modcheck {name}: {} modules, {} sibling edges, {} cycles",
            report.modules,
            report.edges.len(),
            report.cycles.len()
        );
        if graph {
            for ((level, from, to), at) in &report.edges {
                let level = if level.is_empty() { "crate".to_string() } else { level.join("::") };
                println!("  [{level}] {from} -> {to}   ({at})");
            }
        }
        for c in &report.cycles {
            failures.push(format!("{name}: cycle {c}"));
        }
    }
    if failures.is_empty() {
        Ok(())
    } else {
        Err(format!("import cycles between sibling modules:\n  {}", failures.join("\n  ")))
    }
}

/// What one crate's check found.
#[derive(Debug, Default)]
pub struct Report {
    /// Modules (files) read.
    pub modules: usize,
    /// `(level, from, to)` sibling edges with one place that makes each.
    pub edges: BTreeMap<(ModPath, String, String), String>,
    /// Each cycle as `a -> b -> a` with the level it is at.
    pub cycles: Vec<String>,
}

/// Reads a crate's files under `src` and checks its sibling graph.
pub fn check_crate(src: &Path) -> Result<Report, String> {
    let mut files = Vec::new();
    collect(src, src, &mut files)?;
    let modules: BTreeSet<ModPath> = files.iter().map(|(m, _)| m.clone()).collect();
    let mut report = Report { modules: files.len(), ..Report::default() };
    for (module, path) in &files {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let code = drop_test_modules(&strip(&text));
        let rel = path.strip_prefix(src).unwrap_or(path).display().to_string();
        for (line, target) in references(module, &code, &modules) {
            if let Some(edge) = sibling_edge(module, &target) {
                report.edges.entry(edge).or_insert_with(|| format!("{rel}:{line}"));
            }
        }
    }
    report.cycles = cycles(&report.edges);
    Ok(report)
}

/// Every `.rs` file below `dir` with its module path (`lib.rs` is the root, `x/mod.rs` is `x`).
fn collect(src: &Path, dir: &Path, out: &mut Vec<(ModPath, PathBuf)>) -> Result<(), String> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .map_err(|e| format!("{}: {e}", dir.display()))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            collect(src, &p, out)?;
        } else if p.extension().is_some_and(|e| e == "rs") {
            let rel = p.strip_prefix(src).map_err(|e| e.to_string())?;
            let mut parts: Vec<String> = rel.iter().map(|c| c.to_string_lossy().into_owned()).collect();
            let file = parts.pop().unwrap_or_default();
            // Binaries under `src/bin` are crates of their own.
            if parts.first().is_some_and(|p| p == "bin") {
                continue;
            }
            let stem = file.trim_end_matches(".rs");
            if !(stem == "mod" || (parts.is_empty() && (stem == "lib" || stem == "main"))) {
                parts.push(stem.to_string());
            }
            out.push((parts, p));
        }
    }
    Ok(())
}

/// The code with comments and string/char literals blanked (newlines kept, so line numbers stay right).
fn strip(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
            let mut depth = 0;
            while i < b.len() {
                if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                    depth += 1;
                    i += 2;
                } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if b[i] == b'\n' {
                        out.push('\n');
                    }
                    i += 1;
                }
            }
        } else if c == b'r' && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#')) && !ident_before(b, i) {
            // A raw string: r"..." or r#"..."#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push(c as char);
                i += 1;
                continue;
            }
            j += 1;
            loop {
                match b.get(j) {
                    None => break,
                    Some(b'"') if (0..hashes).all(|k| b.get(j + 1 + k) == Some(&b'#')) => {
                        j += 1 + hashes;
                        break;
                    }
                    Some(b'\n') => out.push('\n'),
                    _ => {}
                }
                j += 1;
            }
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                } else if b[i] == b'\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 1;
        } else if c == b'\'' && is_char_literal(b, i) {
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
        } else {
            out.push(c as char);
            i += 1;
        }
    }
    out
}

fn ident_before(b: &[u8], i: usize) -> bool {
    i > 0 && (b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')
}

/// `'x'` or `'\n'` rather than a lifetime `'a`.
fn is_char_literal(b: &[u8], i: usize) -> bool {
    matches!((b.get(i + 1), b.get(i + 2)), (Some(b'\\'), _) | (Some(_), Some(b'\'')))
}

/// The code without `#[cfg(test)] mod name { ... }` blocks (blanked, newlines kept).
fn drop_test_modules(code: &str) -> String {
    let mut out = code.to_string();
    let mut from = 0;
    while let Some(at) = out[from..].find("#[cfg(test)]").map(|k| k + from) {
        let after = at + "#[cfg(test)]".len();
        let rest = out[after..].trim_start();
        let rest = rest.strip_prefix("pub(crate) ").or_else(|| rest.strip_prefix("pub ")).unwrap_or(rest);
        if !rest.starts_with("mod ") {
            from = after;
            continue;
        }
        let Some(open) = out[after..].find(['{', ';']).map(|k| k + after) else { break };
        if out.as_bytes()[open] == b';' {
            // `#[cfg(test)] mod testutil;`: a test-only file, found and judged on its own.
            from = open;
            continue;
        }
        let mut depth = 0;
        let mut end = open;
        for (k, ch) in out[open..].char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        end = open + k + 1;
                        break;
                    }
                }
                _ => {}
            }
        }
        let blank: String = out[at..end].chars().map(|c| if c == '\n' { '\n' } else { ' ' }).collect();
        out.replace_range(at..end, &blank);
        from = end;
    }
    out
}

/// Every module path `module`'s code refers to, with its line: `crate::`, `super::`, `self::` paths (including
/// `use` trees with braces) and bare `sibling::` paths.
fn references(module: &ModPath, code: &str, modules: &BTreeSet<ModPath>) -> Vec<(usize, ModPath)> {
    let parent: ModPath = module.iter().take(module.len().saturating_sub(1)).cloned().collect();
    let siblings: BTreeSet<String> = modules
        .iter()
        .filter(|m| m.len() == module.len() && m.starts_with(&parent))
        .filter_map(|m| m.last().cloned())
        .collect();
    let mut out = Vec::new();
    let b = code.as_bytes();
    let mut line = 1;
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\n' {
            line += 1;
            i += 1;
            continue;
        }
        if !(b[i].is_ascii_alphabetic() || b[i] == b'_') || ident_before(b, i) || (i >= 2 && &b[i - 2..i] == b"::") {
            i += 1;
            continue;
        }
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        let word = &code[start..i];
        if !code[i..].starts_with("::") {
            continue;
        }
        let base: Option<ModPath> = match word {
            "crate" => Some(Vec::new()),
            "self" => Some(module.clone()),
            "super" => Some(parent.clone()),
            w if siblings.contains(w) && module.last().map(String::as_str) != Some(w) => {
                let mut p = parent.clone();
                p.push(w.to_string());
                // The path continues after the sibling's name.
                for t in path_tree(&code[i..], p) {
                    out.push((line, t));
                }
                continue;
            }
            _ => None,
        };
        if let Some(base) = base {
            for t in path_tree(&code[i..], base) {
                out.push((line, t));
            }
        }
    }
    out.into_iter().map(|(l, p)| (l, deepest_module(&p, modules))).collect()
}

/// Expands `::a::b::{c, d::e}` after a base path into the full paths it names (`super` steps up).
fn path_tree(rest: &str, base: ModPath) -> Vec<ModPath> {
    let mut out = Vec::new();
    let mut cur = base;
    let b = rest.as_bytes();
    let mut i = 0;
    loop {
        if !rest[i..].starts_with("::") {
            out.push(cur);
            return out;
        }
        i += 2;
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if b.get(i) == Some(&b'{') {
            // A use tree: split the top-level items and expand each.
            let mut depth = 0;
            let mut item_start = i + 1;
            for (k, ch) in rest[i..].char_indices() {
                let k = i + k;
                match ch {
                    '{' => depth += 1,
                    '}' | ',' if depth == 1 => {
                        let item = rest[item_start..k].trim();
                        if !item.is_empty() {
                            out.extend(path_tree(&format!("::{item}"), cur.clone()));
                        }
                        item_start = k + 1;
                        if ch == '}' {
                            return out;
                        }
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            return out;
        }
        let start = i;
        while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
            i += 1;
        }
        let seg = &rest[start..i];
        match seg {
            "" | "*" => {
                out.push(cur);
                return out;
            }
            "super" => {
                cur.pop();
            }
            "self" => {}
            s => cur.push(s.to_string()),
        }
    }
}

/// The longest prefix of `p` that is a module of the crate (items are not modules).
fn deepest_module(p: &ModPath, modules: &BTreeSet<ModPath>) -> ModPath {
    (0..=p.len()).rev().map(|n| p[..n].to_vec()).find(|m| modules.contains(m)).unwrap_or_default()
}

/// The sibling edge a reference from `from` to `to` makes: `(level, child of level holding from, child holding
/// to)`, or `None` when one contains the other (a module and its own ancestors or descendants).
fn sibling_edge(from: &ModPath, to: &ModPath) -> Option<(ModPath, String, String)> {
    let common = from.iter().zip(to).take_while(|(a, b)| a == b).count();
    if common == from.len() || common == to.len() {
        return None;
    }
    Some((from[..common].to_vec(), from[common].clone(), to[common].clone()))
}

/// Cycles among the siblings of each level (strongly connected components of more than one module).
fn cycles(edges: &BTreeMap<(ModPath, String, String), String>) -> Vec<String> {
    let mut levels: BTreeMap<&ModPath, BTreeMap<&str, Vec<&str>>> = BTreeMap::new();
    for (level, a, b) in edges.keys() {
        levels.entry(level).or_default().entry(a.as_str()).or_default().push(b.as_str());
    }
    let mut out = Vec::new();
    for (level, graph) in levels {
        for scc in components(&graph) {
            let name = if level.is_empty() { "crate".to_string() } else { level.join("::") };
            let shown: Vec<String> = scc
                .iter()
                .flat_map(|a| {
                    graph[a].iter().filter(|b| scc.contains(b)).map(move |b| {
                        let at = &edges[&(level.clone(), a.to_string(), b.to_string())];
                        format!("{a} -> {b} ({at})")
                    })
                })
                .collect();
            out.push(format!("[{name}] {}", shown.join("; ")));
        }
    }
    out
}

/// Strongly connected components with more than one node (Tarjan's algorithm).
fn components<'a>(graph: &BTreeMap<&'a str, Vec<&'a str>>) -> Vec<Vec<&'a str>> {
    struct State<'a> {
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        out: Vec<Vec<&'a str>>,
    }
    fn visit<'a>(v: &'a str, g: &BTreeMap<&'a str, Vec<&'a str>>, s: &mut State<'a>) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on.insert(v);
        for &w in g.get(v).map(Vec::as_slice).unwrap_or(&[]) {
            if !s.index.contains_key(w) {
                visit(w, g, s);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(lw);
            } else if s.on.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).expect("visited");
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on.remove(w);
                comp.push(w);
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort_unstable();
                s.out.push(comp);
            }
        }
    }
    let mut s =
        State { index: BTreeMap::new(), low: BTreeMap::new(), stack: Vec::new(), on: BTreeSet::new(), out: Vec::new() };
    for &v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(v, graph, &mut s);
        }
    }
    s.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mods(list: &[&str]) -> BTreeSet<ModPath> {
        list.iter().map(|m| if m.is_empty() { Vec::new() } else { m.split("::").map(String::from).collect() }).collect()
    }

    fn p(s: &str) -> ModPath {
        s.split("::").map(String::from).collect()
    }

    #[test]
    fn use_trees_and_relative_paths_resolve_to_modules() {
        let m = mods(&["", "fw", "fw::cq", "fw::qp", "wire", "link"]);
        let code = "use crate::{wire::Packet, link::{Link, tcp::X}};\nuse super::qp::QpTable;\nfn f() { super::super::wire::emit(); }";
        let refs: Vec<ModPath> = references(&p("fw::cq"), &strip(code), &m).into_iter().map(|(_, t)| t).collect();
        assert!(refs.contains(&p("wire")));
        assert!(refs.contains(&p("link")));
        assert!(refs.contains(&p("fw::qp")));
        assert_eq!(refs.iter().filter(|r| **r == p("wire")).count(), 2);
    }

    #[test]
    fn bare_sibling_paths_count_and_comments_strings_and_tests_do_not() {
        let m = mods(&["", "a", "b", "c"]);
        let code = "use super::*;\n// c::x in a comment\nconst S: &str = \"c::y\";\nfn f() { b::go(); }\n#[cfg(test)]\nmod tests { use crate::c::Z; }\n";
        let code = drop_test_modules(&strip(code));
        let refs: Vec<(usize, ModPath)> = references(&p("a"), &code, &m);
        assert!(refs.contains(&(4, p("b"))), "{refs:?}");
        assert!(!refs.iter().any(|(_, t)| *t == p("c")), "{refs:?}");
    }

    #[test]
    fn ancestors_and_descendants_are_not_edges_and_siblings_are() {
        assert_eq!(sibling_edge(&p("fw::cq"), &Vec::new()), None);
        assert_eq!(sibling_edge(&p("fw"), &p("fw::cq")), None);
        assert_eq!(sibling_edge(&p("fw::cq"), &p("fw::qp")), Some((p("fw"), "cq".into(), "qp".into())));
        assert_eq!(sibling_edge(&p("fw::cq"), &p("wire")), Some((Vec::new(), "fw".into(), "wire".into())));
    }

    #[test]
    fn a_cycle_is_found_and_a_chain_is_not() {
        let mut e = BTreeMap::new();
        e.insert((Vec::new(), "a".to_string(), "b".to_string()), "a.rs:1".to_string());
        e.insert((Vec::new(), "b".to_string(), "c".to_string()), "b.rs:1".to_string());
        assert!(cycles(&e).is_empty());
        e.insert((Vec::new(), "c".to_string(), "a".to_string()), "c.rs:9".to_string());
        let c = cycles(&e);
        assert_eq!(c.len(), 1);
        assert!(c[0].contains("c -> a (c.rs:9)"), "{c:?}");
    }
}
