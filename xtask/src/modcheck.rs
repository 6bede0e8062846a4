//! `cargo xtask modcheck [--graph] [--root DIR]`: the module rules of every crate of the workspace.
//!
//! The crates are read from the workspace: each member's `Cargo.toml` gives its library root (`[lib] path` or
//! `src/lib.rs`) and its binaries (`[[bin]] path`, `src/main.rs`, `src/bin/*.rs`, `src/bin/*/main.rs`). A crate's
//! modules are the files its `mod name;` declarations reach from the root (`name.rs` or `name/mod.rs`; a
//! `#[path]` attribute is not followed, and a declaration whose file is missing fails).
//!
//! Rules, each failure named with its file:line:
//! * `cycle` (every crate): at every level of a crate's module tree (the crate's top-level modules, and the
//!   submodules of one folder), the graph of references between sibling modules is acyclic, so a reader can
//!   follow the layers in one direction. A reference from module `a::x` to module `b::y` (a path `crate::b::y`,
//!   `super::b`, `self::c`, or a bare `sibling::Item` brought into scope by `use super::*`) is an edge `a -> b`
//!   at their lowest common level. A module naming its own ancestors or descendants is not an edge.
//! * `ancestor-item` (opt-in): a module names no item of an ancestor module: not `crate::Foo` when `Foo` is
//!   declared or re-exported in the crate root rather than being a module, not `super::syndrome` from `fw/qp.rs`
//!   when `syndrome` is declared in `fw/mod.rs`, and no glob (`use super::*`) of an ancestor. A child of a
//!   folder then depends on its siblings (leaf files), never on the folder's own file.
//! * `layer` (opt-in): the crate root's docs hold one line `//! Layers (bottom first): a b | c | d` (modules
//!   separated by spaces, layers by ` | `). Every top-level module is in it once; a module refers only to modules
//!   in its own layer or below (its own layer acyclically, by `cycle`); the crate root is above all.
//! * `impl-files` (opt-in): no type has `impl` blocks (`impl T`, `impl<..> T<..>`, `impl Trait for T`, keyed by
//!   the type's last path segment) in more than N files of the crate, test modules counted.
//!
//! Method calls are not references. Test code may use any helper without shaping the architecture:
//! `#[cfg(test)] mod name { .. }` blocks inside a file are left out of `cycle`, `ancestor-item` and `layer`;
//! module files declared under a `cfg` naming `test` (test kits, `tests.rs`) are judged by `cycle` only, and by
//! `layer` too when one is a top-level module the layer line lists. `impl-files` counts all test code.
//!
//! The parser is textual (comments and string literals stripped first), which is enough for this code base: it
//! never builds paths in macros across modules. `self::` and `super::` inside an inline `mod name { .. }` start
//! from it; an inline module is an item of its file, not a module of its own. Its limits: a bare `sibling::` path
//! is read from the file's module, and a name brought in by a glob is not traced to where it is declared (the
//! glob itself is judged).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};

/// A module path from the crate root, e.g. `["fw", "cq"]`; the root is `[]`.
type ModPath = Vec<String>;

/// The rules a crate follows beyond acyclic sibling modules.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rules {
    /// No reference to an item of an ancestor module (the crate root included).
    pub ancestor_items: bool,
    /// Top-level modules in the layers of the root's `//! Layers (bottom first):` line.
    pub layers: bool,
    /// The most files one type may have `impl` blocks in.
    pub max_impl_files: Option<usize>,
}

/// The libraries that follow more than acyclicity, by package name (issue 30: the simulator is a house of layers
/// that own their state).
const STRICT: &[(&str, Rules)] = &[("mlx5-sim", Rules { ancestor_items: true, layers: true, max_impl_files: Some(3) })];

/// The line of the crate root's docs that states the layer order.
const LAYER_LINE: &str = "//! Layers (bottom first):";

/// One crate of the workspace: a library or a binary.
#[derive(Debug)]
pub struct Target {
    /// The package, and the binary's root file when it is one.
    pub label: String,
    /// `lib.rs`, `main.rs` or a `src/bin` file.
    pub root_file: PathBuf,
    pub rules: Rules,
}

/// One rule broken at one place.
#[derive(Debug, Clone, PartialEq)]
pub struct Failure {
    pub rule: &'static str,
    /// `file:line`, relative to the workspace root.
    pub at: String,
    pub what: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}: {}", self.rule, self.at, self.what)
    }
}

/// The rule names, in the order they are counted and reported.
const RULE_NAMES: &[&str] = &["mod-file", "cycle", "ancestor-item", "layer", "impl-files"];

/// Runs the check over every crate of the workspace at `root`; `graph` also prints each level's edges.
pub fn run(root: &Path, graph: bool) -> Result<(), String> {
    let mut failures = Vec::new();
    for t in workspace_targets(root)? {
        let report = check_crate(root, &t.root_file, t.rules)?;
        let mut counts = format!(
            "modcheck {}: {} modules, {} sibling edges, {} cycles",
            t.label,
            report.modules,
            report.edges.len(),
            report.cycles.len()
        );
        let enabled = [
            ("ancestor-item", t.rules.ancestor_items),
            ("layer", t.rules.layers),
            ("impl-files", t.rules.max_impl_files.is_some()),
            ("mod-file", report.failures.iter().any(|f| f.rule == "mod-file")),
        ];
        for (rule, on) in enabled {
            if on {
                counts += &format!(", {} {rule}", report.failures.iter().filter(|f| f.rule == rule).count());
            }
        }
        println!("{counts}");
        if graph {
            for ((level, from, to), at) in &report.edges {
                let level = if level.is_empty() { "crate".to_string() } else { level.join("::") };
                println!("  [{level}] {from} -> {to}   ({at})");
            }
        }
        failures.extend(report.failures.into_iter().map(|f| (t.label.clone(), f)));
    }
    if failures.is_empty() {
        return Ok(());
    }
    let mut by_rule = Vec::new();
    let mut lines = Vec::new();
    for rule in RULE_NAMES {
        let n = failures.iter().filter(|(_, f)| f.rule == *rule).count();
        if n > 0 {
            by_rule.push(format!("{n} {rule}"));
        }
        lines.extend(failures.iter().filter(|(_, f)| f.rule == *rule).map(|(c, f)| format!("{c}: {f}")));
    }
    Err(format!("modcheck: {} failures ({}):\n  {}", failures.len(), by_rule.join(", "), lines.join("\n  ")))
}

/// Every library and binary of the workspace members listed in `root/Cargo.toml`.
pub fn workspace_targets(root: &Path) -> Result<Vec<Target>, String> {
    let manifest = read(&root.join("Cargo.toml"))?;
    let mut out = Vec::new();
    for member in toml_members(&manifest) {
        let dirs: Vec<PathBuf> = match member.strip_suffix("/*") {
            Some(parent) => {
                let mut d: Vec<PathBuf> = std::fs::read_dir(root.join(parent))
                    .map_err(|e| format!("{parent}: {e}"))?
                    .filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| p.join("Cargo.toml").is_file())
                    .collect();
                d.sort();
                d
            }
            None => vec![root.join(&member)],
        };
        for dir in dirs {
            out.extend(package_targets(&dir)?);
        }
    }
    Ok(out)
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The strings of the `members = [ .. ]` array of a workspace manifest.
fn toml_members(manifest: &str) -> Vec<String> {
    let text: String = manifest.lines().map(|l| l.split('#').next().unwrap_or("")).collect::<Vec<_>>().join("\n");
    // The key at a line's start (not `default-members`).
    let Some(at) = text
        .match_indices("members")
        .map(|(k, _)| k)
        .find(|&k| text[..k].ends_with('\n') && text[k + "members".len()..].trim_start().starts_with('='))
    else {
        return Vec::new();
    };
    let Some(open) = text[at..].find('[').map(|k| k + at) else { return Vec::new() };
    let Some(close) = text[open..].find(']').map(|k| k + open) else { return Vec::new() };
    text[open + 1..close].split(',').map(|s| s.trim().trim_matches('"').to_string()).filter(|s| !s.is_empty()).collect()
}

/// One package's library and binaries, with the rules [`STRICT`] gives its library.
fn package_targets(dir: &Path) -> Result<Vec<Target>, String> {
    let manifest = read(&dir.join("Cargo.toml"))?;
    let (mut section, mut name, mut lib_path, mut bin_paths) = (String::new(), String::new(), None, Vec::new());
    for line in manifest.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.starts_with('[') {
            section = line.to_string();
            continue;
        }
        let Some((key, value)) = line.split_once('=') else { continue };
        let value = value.trim().trim_matches('"').to_string();
        match (section.as_str(), key.trim()) {
            ("[package]", "name") => name = value,
            ("[lib]", "path") => lib_path = Some(value),
            ("[[bin]]", "path") => bin_paths.push(value),
            _ => {}
        }
    }
    let rules = STRICT.iter().find(|(n, _)| *n == name).map(|(_, r)| *r).unwrap_or_default();
    let mut out = Vec::new();
    let lib = dir.join(lib_path.as_deref().unwrap_or("src/lib.rs"));
    if lib.is_file() {
        out.push(Target { label: name.clone(), root_file: lib, rules });
    }
    // The binaries cargo finds by itself, then the declared ones.
    let mut bins: Vec<PathBuf> = vec![dir.join("src/main.rs")];
    if let Ok(entries) = std::fs::read_dir(dir.join("src/bin")) {
        let mut found: Vec<PathBuf> = entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .map(|p| if p.is_dir() { p.join("main.rs") } else { p })
            .filter(|p| p.extension().is_some_and(|e| e == "rs"))
            .collect();
        found.sort();
        bins.extend(found);
    }
    bins.extend(bin_paths.iter().map(|p| dir.join(p)));
    let mut seen = BTreeSet::new();
    for bin in bins {
        if bin.is_file() && seen.insert(bin.clone()) {
            let rel = bin.strip_prefix(dir).unwrap_or(&bin).display().to_string();
            out.push(Target { label: format!("{name} ({rel})"), root_file: bin, rules: Rules::default() });
        }
    }
    Ok(out)
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
    /// Every rule broken, cycles included.
    pub failures: Vec<Failure>,
}

/// One module file of a crate.
#[derive(Debug)]
struct ModFile {
    path: ModPath,
    file: PathBuf,
    /// Declared under a `cfg` naming `test` (or inside such a module).
    test_only: bool,
    /// Where its `mod` declaration is (`file:line`); the root has none.
    declared: String,
    text: String,
}

/// Reads the crate whose root file is `root_file` and checks it; file names are shown relative to `ws`.
pub fn check_crate(ws: &Path, root_file: &Path, rules: Rules) -> Result<Report, String> {
    let show = |p: &Path| p.strip_prefix(ws).unwrap_or(p).display().to_string();
    let mut report = Report::default();
    let mut files = Vec::new();
    let dir = root_file.parent().unwrap_or(Path::new(".")).to_path_buf();
    collect(ws, root_file, Vec::new(), &dir, false, String::new(), &mut files, &mut report.failures)?;
    let modules: BTreeSet<ModPath> = files.iter().map(|m| m.path.clone()).collect();
    report.modules = files.len();

    // The layer of each top-level module, when the crate keeps layers.
    let layers = if rules.layers { layer_map(&files, &show, &mut report.failures) } else { BTreeMap::new() };

    let mut seen = BTreeSet::new();
    for m in &files {
        let code = drop_test_modules(&strip(&m.text));
        let rel = show(&m.file);
        let judged = !m.test_only;
        // A test file inside a layer is a test of it, judged by no layer; a test kit at the top is judged when
        // the layer line lists it.
        let kit = files.iter().any(|t| t.path.len() == 1 && t.path.first() == m.path.first() && t.test_only);
        let top_layer = m.path.first().filter(|_| judged || kit).and_then(|t| layers.get(t));
        for (line, full) in raw_references(&m.path, &code, &modules) {
            let target = deepest_module(&full, &modules);
            if let Some(edge) = sibling_edge(&m.path, &target) {
                report.edges.entry(edge).or_insert_with(|| format!("{rel}:{line}"));
            }
            if !seen.insert((rel.clone(), line, full.clone())) {
                continue;
            }
            let at = format!("{rel}:{line}");
            let ancestor = target.len() < m.path.len() && m.path.starts_with(&target);
            if rules.ancestor_items && judged && ancestor && full.len() > target.len() {
                let whose = if target.is_empty() {
                    "the crate root".to_string()
                } else {
                    format!("its ancestor module `{}`", target.join("::"))
                };
                let what = if full.last().is_some_and(|s| s == "*") {
                    format!("a glob of {whose}'s items")
                } else {
                    format!("an item of {whose}")
                };
                report.failures.push(Failure {
                    rule: "ancestor-item",
                    at: at.clone(),
                    what: format!("`{}` names `crate::{}`, {what}", m.path.join("::"), full.join("::")),
                });
            }
            let to_layer = target.first().filter(|t| Some(*t) != m.path.first()).and_then(|t| layers.get(t));
            if let (Some(&from), Some(&to)) = (top_layer, to_layer) {
                if to > from {
                    report.failures.push(Failure {
                        rule: "layer",
                        at,
                        what: format!(
                            "`{}` (layer {}) refers to `crate::{}` in `{}`, a higher layer ({})",
                            m.path.join("::"),
                            from + 1,
                            full.join("::"),
                            target[0],
                            to + 1
                        ),
                    });
                }
            }
        }
    }
    report.cycles = cycles(&report.edges);
    for c in &report.cycles {
        // Named at its first edge's place (each edge shows its own `(file:line)`).
        let at = c.split_once(" (").and_then(|(_, r)| r.split_once(')')).map(|(at, _)| at.to_string());
        report.failures.push(Failure { rule: "cycle", at: at.unwrap_or_else(|| show(root_file)), what: c.clone() });
    }

    if let Some(max) = rules.max_impl_files {
        // Every file's first `impl` block of each type, test modules included.
        let mut spread: BTreeMap<String, Vec<String>> = BTreeMap::new();
        for m in &files {
            let mut firsts = BTreeMap::new();
            for (line, ty) in impl_types(&strip(&m.text)) {
                firsts.entry(ty).or_insert(line);
            }
            for (ty, line) in firsts {
                spread.entry(ty).or_default().push(format!("{}:{line}", show(&m.file)));
            }
        }
        for (ty, places) in spread {
            if places.len() > max {
                report.failures.push(Failure {
                    rule: "impl-files",
                    at: places[0].clone(),
                    what: format!(
                        "`{ty}` has impl blocks in {} files (at most {max}): {}",
                        places.len(),
                        places.join(", ")
                    ),
                });
            }
        }
    }
    Ok(report)
}

/// Each top-level module's layer (0 at the bottom) from the root's layer line; what is wrong with it goes to
/// `failures`.
fn layer_map(
    files: &[ModFile],
    show: &dyn Fn(&Path) -> String,
    failures: &mut Vec<Failure>,
) -> BTreeMap<String, usize> {
    let root = files.iter().find(|m| m.path.is_empty()).expect("the root is read first");
    let root_at = show(&root.file);
    let mut map = BTreeMap::new();
    let found = root.text.lines().enumerate().find_map(|(n, l)| l.trim().strip_prefix(LAYER_LINE).map(|r| (n + 1, r)));
    let Some((line, rest)) = found else {
        failures.push(Failure {
            rule: "layer",
            at: format!("{root_at}:1"),
            what: format!("no `{LAYER_LINE} a b | c | ..` line in the crate root's docs"),
        });
        return map;
    };
    let at = format!("{root_at}:{line}");
    for (k, layer) in rest.split('|').enumerate() {
        for name in layer.split_whitespace() {
            if map.insert(name.to_string(), k).is_some() {
                failures.push(Failure {
                    rule: "layer",
                    at: at.clone(),
                    what: format!("`{name}` is in the layer line twice"),
                });
            }
        }
    }
    let tops: BTreeMap<&str, &ModFile> =
        files.iter().filter(|m| m.path.len() == 1).map(|m| (m.path[0].as_str(), m)).collect();
    for name in map.keys() {
        if !tops.contains_key(name.as_str()) {
            failures.push(Failure {
                rule: "layer",
                at: at.clone(),
                what: format!("`{name}` in the layer line is no top-level module"),
            });
        }
    }
    for (name, m) in &tops {
        // A test kit not listed is left out of the layers; listed, it is judged like the rest.
        if !m.test_only && !map.contains_key(*name) {
            failures.push(Failure {
                rule: "layer",
                at: m.declared.clone(),
                what: format!("top-level module `{name}` is not in the layer line ({at})"),
            });
        }
    }
    map
}

/// Reads `file` (module `path`, its children in `dir`) and every module file its `mod name;` declarations reach.
#[allow(clippy::too_many_arguments)]
fn collect(
    ws: &Path,
    file: &Path,
    path: ModPath,
    dir: &Path,
    test_only: bool,
    declared: String,
    out: &mut Vec<ModFile>,
    failures: &mut Vec<Failure>,
) -> Result<(), String> {
    let text = read(file)?;
    let decls = mod_decls(&strip(&text));
    out.push(ModFile { path: path.clone(), file: file.to_path_buf(), test_only, declared, text });
    let here = file.strip_prefix(ws).unwrap_or(file).display().to_string();
    for (line, name, test) in decls {
        let (flat, nested) = (dir.join(format!("{name}.rs")), dir.join(&name).join("mod.rs"));
        let (child, child_dir) = if flat.is_file() {
            (flat, dir.join(&name))
        } else if nested.is_file() {
            (nested, dir.join(&name))
        } else {
            failures.push(Failure {
                rule: "mod-file",
                at: format!("{here}:{line}"),
                what: format!("`mod {name};` has neither {name}.rs nor {name}/mod.rs beside it"),
            });
            continue;
        };
        let mut child_path = path.clone();
        child_path.push(name);
        let declared = format!("{here}:{line}");
        collect(ws, &child, child_path, &child_dir, test_only || test, declared, out, failures)?;
    }
    Ok(())
}

/// The file's top-level `mod name;` declarations: `(line, name, declared under a cfg naming test)`.
fn mod_decls(code: &str) -> Vec<(usize, String, bool)> {
    let b = code.as_bytes();
    let (mut out, mut attrs, mut depth, mut line, mut i) = (Vec::new(), String::new(), 0usize, 1, 0);
    while i < b.len() {
        match b[i] {
            b'\n' => line += 1,
            b'#' if depth == 0 && matches!(b.get(i + 1), Some(b'[') | Some(b'!')) => {
                let inner = b[i + 1] == b'!';
                let open = if inner { i + 2 } else { i + 1 };
                let end = matching(b, open, b'[', b']');
                if !inner {
                    attrs.push_str(&code[open..end]);
                }
                line += code[i..end].matches('\n').count();
                i = end;
                continue;
            }
            b'{' => depth += 1,
            b'}' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    attrs.clear();
                }
            }
            b';' if depth == 0 => attrs.clear(),
            c if depth == 0 && c.is_ascii_alphabetic() && !ident_before(b, i) => {
                let start = i;
                while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                if &code[start..i] == "mod" {
                    let rest = code[i..].trim_start();
                    let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    if !name.is_empty() && rest[name.len()..].trim_start().starts_with(';') {
                        out.push((line, name, cfg_names_test(&attrs)));
                    }
                }
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The index just past the bracket closing the one at `open` (or the end).
fn matching(b: &[u8], open: usize, o: u8, c: u8) -> usize {
    let mut depth = 0;
    for (k, &x) in b.iter().enumerate().skip(open) {
        if x == o {
            depth += 1;
        } else if x == c {
            depth -= 1;
            if depth == 0 {
                return k + 1;
            }
        }
    }
    b.len()
}

/// Whether attributes hold a `cfg(..)` naming `test` other than under `not(..)`.
fn cfg_names_test(attrs: &str) -> bool {
    let b = attrs.as_bytes();
    attrs.match_indices("cfg(").any(|(at, _)| {
        if ident_before(b, at) {
            return false;
        }
        let end = matching(b, at + 3, b'(', b')');
        let inner = &attrs[at + 3..end];
        !inner.contains("not(") && has_word(inner, "test")
    })
}

fn has_word(text: &str, word: &str) -> bool {
    let b = text.as_bytes();
    text.match_indices(word).any(|(at, _)| {
        let after = b.get(at + word.len()).copied().unwrap_or(b' ');
        !(ident_before(b, at) || after.is_ascii_alphanumeric() || after == b'_')
    })
}

/// The self type of every `impl` block, by its last path segment, with the block's line. Blanket impls over a
/// type parameter (`impl<T: X> Y for T`) and impls for slices, arrays, tuples or macro fragments are left out.
fn impl_types(code: &str) -> Vec<(usize, String)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    for (at, _) in code.match_indices("impl") {
        let after = b.get(at + 4).copied().unwrap_or(b' ');
        if ident_before(b, at) || !(after.is_ascii_whitespace() || after == b'<') {
            continue;
        }
        // An item starts here (not `-> impl Trait` or `x: impl Trait`).
        let before = code[..at].trim_end();
        let item = before.is_empty()
            || before.ends_with(['}', ';', '{', ']'])
            || ["unsafe", "default"].iter().any(|w| before.ends_with(w) && !ident_before(b, before.len() - w.len()));
        if !item {
            continue;
        }
        let mut i = at + 4;
        let mut params = BTreeSet::new();
        i = skip_ws(b, i);
        if b.get(i) == Some(&b'<') {
            let end = angle_end(b, i);
            params = generic_params(&code[i + 1..end.saturating_sub(1)]);
            i = end;
        }
        let (first, j) = type_key(code, i);
        let j = skip_ws(b, j);
        let ty =
            if code[j..].starts_with("for") && !b.get(j + 3).is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_') {
                type_key(code, j + 3).0
            } else {
                first
            };
        if let Some(ty) = ty.filter(|t| !params.contains(t)) {
            out.push((code[..at].matches('\n').count() + 1, ty));
        }
    }
    out
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while b.get(i).is_some_and(u8::is_ascii_whitespace) {
        i += 1;
    }
    i
}

/// The index past the `>` closing the `<` at `open` (`->` inside does not close).
fn angle_end(b: &[u8], open: usize) -> usize {
    let mut depth = 0;
    for k in open..b.len() {
        match b[k] {
            b'<' => depth += 1,
            b'>' if k == 0 || b[k - 1] != b'-' => {
                depth -= 1;
                if depth == 0 {
                    return k + 1;
                }
            }
            _ => {}
        }
    }
    b.len()
}

/// The names of a generic parameter list's types and consts (lifetimes left out).
fn generic_params(list: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let (mut depth, mut start) = (0i32, 0);
    let mut parts = Vec::new();
    for (k, c) in list.char_indices() {
        match c {
            '<' | '(' | '[' => depth += 1,
            '>' if k > 0 && list.as_bytes()[k - 1] == b'-' => {}
            '>' | ')' | ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..k]);
                start = k + 1;
            }
            _ => {}
        }
    }
    parts.push(&list[start..]);
    for p in parts {
        let p = p.trim();
        let p = p.strip_prefix("const ").unwrap_or(p).trim_start();
        let name: String = p.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if !name.is_empty() {
            out.insert(name);
        }
    }
    out
}

/// The last path segment of the type starting at `i` (references, `dyn`, `mut` and leading `::` skipped;
/// generics ignored) and the index past the type; `None` for a type that is not a path.
fn type_key(code: &str, mut i: usize) -> (Option<String>, usize) {
    let b = code.as_bytes();
    loop {
        i = skip_ws(b, i);
        match b.get(i) {
            Some(b'&' | b'!' | b'*') => i += 1,
            Some(b'\'') => {
                i += 1;
                while b.get(i).is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_') {
                    i += 1;
                }
            }
            _ => {
                let word: String = code[i..].chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                if matches!(word.as_str(), "dyn" | "mut" | "const") {
                    i += word.len();
                } else {
                    break;
                }
            }
        }
    }
    let mut last = None;
    loop {
        if code[i..].starts_with("::") {
            i += 2;
        }
        let start = i;
        while b.get(i).is_some_and(|c| c.is_ascii_alphanumeric() || *c == b'_') {
            i += 1;
        }
        if start == i || !b[start].is_ascii_alphabetic() && b[start] != b'_' {
            return (last, i);
        }
        last = Some(code[start..i].to_string());
        let j = skip_ws(b, i);
        if b.get(j) == Some(&b'<') {
            i = angle_end(b, j);
        }
        if !code[skip_ws(b, i)..].starts_with("::") {
            return (last, i);
        }
        i = skip_ws(b, i);
    }
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
#[cfg(test)]
fn references(module: &ModPath, code: &str, modules: &BTreeSet<ModPath>) -> Vec<(usize, ModPath)> {
    raw_references(module, code, modules).into_iter().map(|(l, p)| (l, deepest_module(&p, modules))).collect()
}

/// Every path from the crate root `module`'s code names, with its line: modules and the items after them (a glob
/// ends in `*`).
fn raw_references(module: &ModPath, code: &str, modules: &BTreeSet<ModPath>) -> Vec<(usize, ModPath)> {
    let parent: ModPath = module.iter().take(module.len().saturating_sub(1)).cloned().collect();
    let siblings: BTreeSet<String> = modules
        .iter()
        .filter(|m| m.len() == module.len() && m.starts_with(&parent))
        .filter_map(|m| m.last().cloned())
        .collect();
    let inline = inline_modules(code);
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
        // `self` and `super` inside an inline `mod name { .. }` start from that module.
        let mut here = module.clone();
        here.extend(inline.iter().filter(|(from, to, _)| (*from..*to).contains(&start)).map(|(_, _, n)| n.clone()));
        let base: Option<ModPath> = match word {
            "crate" => Some(Vec::new()),
            "self" => Some(here),
            "super" => Some(here[..here.len().saturating_sub(1)].to_vec()),
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
    out
}

/// The inline modules of a file, outermost first: `(from, to, name)` with the byte range of each body.
fn inline_modules(code: &str) -> Vec<(usize, usize, String)> {
    let b = code.as_bytes();
    let mut out = Vec::new();
    for (at, _) in code.match_indices("mod") {
        if ident_before(b, at) || !b.get(at + 3).is_some_and(u8::is_ascii_whitespace) {
            continue;
        }
        let rest = code[at + 3..].trim_start();
        let name: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        let open = code.len() - rest.len() + name.len();
        let open = skip_ws(b, open);
        if !name.is_empty() && b.get(open) == Some(&b'{') {
            out.push((open, matching(b, open, b'{', b'}'), name));
        }
    }
    out
}

/// Expands `::a::b::{c, d::e}` after a base path into the full paths it names (`super` steps up; a glob is a last
/// segment `*`).
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
            "" if b.get(i) == Some(&b'*') => {
                cur.push("*".to_string());
                out.push(cur);
                return out;
            }
            "" => {
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

    /// A crate written under a fresh temporary folder: `(relative path, text)` pairs.
    struct Fixture(PathBuf);

    impl Fixture {
        fn new<S: AsRef<str>>(name: &str, files: &[(&str, S)]) -> Fixture {
            let dir = std::env::temp_dir().join(format!("modcheck-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            for (path, text) in files {
                let p = dir.join(path);
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(p, text.as_ref()).unwrap();
            }
            Fixture(dir)
        }

        fn check(&self, root: &str, rules: Rules) -> Report {
            check_crate(&self.0, &self.0.join(root), rules).unwrap()
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn fired(r: &Report, rule: &str) -> Vec<String> {
        r.failures.iter().filter(|f| f.rule == rule).map(ToString::to_string).collect()
    }

    const STRICT_RULES: Rules = Rules { ancestor_items: true, layers: true, max_impl_files: Some(3) };

    #[test]
    fn every_workspace_crate_and_binary_is_found_with_its_rules() {
        let f = Fixture::new(
            "ws",
            &[
                (
                    "Cargo.toml",
                    concat!(
                        "[workspace]\n",
                        "default-members = [\"b\"]\n",
                        "members = [\n",
                        "    \"a\", # the library\n",
                        "    \"b\",\n",
                        "]\n",
                        "exclude = [\"c\"]\n",
                    ),
                ),
                ("a/Cargo.toml", "[package]\nname = \"mlx5-sim\"\n[dependencies]\nname = \"x\"\n"),
                ("a/src/lib.rs", ""),
                ("a/src/main.rs", ""),
                ("b/Cargo.toml", "[package]\nname = \"tool\"\n[[bin]]\nname = \"t\"\npath = \"src/bin/t.rs\"\n"),
                ("b/src/lib.rs", ""),
                ("b/src/bin/t.rs", ""),
                ("b/src/bin/big/main.rs", "mod helper;\n"),
                ("b/src/bin/big/helper.rs", ""),
            ],
        );
        let t = workspace_targets(&f.0).unwrap();
        let labels: Vec<&str> = t.iter().map(|t| t.label.as_str()).collect();
        assert_eq!(
            labels,
            ["mlx5-sim", "mlx5-sim (src/main.rs)", "tool", "tool (src/bin/big/main.rs)", "tool (src/bin/t.rs)"]
        );
        assert_eq!(t[0].rules, STRICT_RULES);
        assert_eq!(t[1].rules, Rules::default(), "a binary keeps the default rules");
        assert_eq!(t[2].rules, Rules::default());
        let big = t.iter().find(|t| t.label.ends_with("big/main.rs)")).unwrap();
        assert_eq!(check_crate(&f.0, &big.root_file, big.rules).unwrap().modules, 2);
    }

    #[test]
    fn the_real_workspace_lists_every_member_and_the_simulator_is_strict() {
        let t = workspace_targets(&crate::root()).unwrap();
        for want in [
            "mlx5-core",
            "mlx5-sim",
            "mlx5-verbs",
            "mlx5-ibverbs",
            "xtask (src/main.rs)",
            "mlx5-tool (src/bin/mlx5.rs)",
        ] {
            assert!(t.iter().any(|t| t.label == want), "{want} missing from {t:?}");
        }
        assert!(t.iter().filter(|t| t.rules != Rules::default()).all(|t| t.label == "mlx5-sim"));
    }

    #[test]
    fn xtask_has_no_import_cycle() {
        let root = crate::root();
        let r = check_crate(&root, &root.join("xtask/src/main.rs"), Rules::default()).unwrap();
        assert!(r.modules > 10);
        assert!(r.cycles.is_empty(), "{:?}", r.cycles);
    }

    #[test]
    fn mod_declarations_are_followed_and_test_kits_marked() {
        let code = concat!(
            "#![no_std]\n",
            "mod a;\n",
            "#[cfg(test)]\n",
            "mod t;\n",
            "#[cfg(any(test, feature = \"k\"))]\n",
            "pub mod kit;\n",
            "#[cfg(not(test))]\n",
            "pub(crate) mod b;\n",
            "mod inline { mod nested; }\n",
            "#[cfg(test)]\n",
            "fn f() {}\n",
            "mod c;\n",
        );
        let d = mod_decls(&strip(code));
        let want: Vec<(usize, String, bool)> = vec![
            (2, "a".into(), false),
            (4, "t".into(), true),
            (6, "kit".into(), true),
            (8, "b".into(), false),
            (12, "c".into(), false),
        ];
        assert_eq!(d, want);
        let f = Fixture::new(
            "missing",
            &[("src/lib.rs", "mod gone;\nmod x;\n"), ("src/x/mod.rs", "mod y;\n"), ("src/x/y.rs", "")],
        );
        let r = f.check("src/lib.rs", Rules::default());
        assert_eq!(r.modules, 3);
        assert_eq!(fired(&r, "mod-file").len(), 1, "{:?}", r.failures);
        assert!(fired(&r, "mod-file")[0].contains("src/lib.rs:1"));
    }

    #[test]
    fn a_cycle_in_a_binary_crate_fails_and_a_chain_passes() {
        let f = Fixture::new(
            "bincycle",
            &[
                ("src/main.rs", "mod a;\nmod b;\nfn main() {}\n"),
                ("src/a.rs", "use crate::b::B;\n"),
                ("src/b.rs", "pub struct B;\nfn f() { super::a::go(); }\n"),
            ],
        );
        let r = f.check("src/main.rs", Rules::default());
        let c = fired(&r, "cycle");
        assert_eq!(c.len(), 1, "{:?}", r.failures);
        assert!(c[0].contains("a -> b (src/a.rs:1)") && c[0].contains("b -> a (src/b.rs:2)"), "{c:?}");
        let f = Fixture::new(
            "binchain",
            &[("src/main.rs", "mod a;\nmod b;\n"), ("src/a.rs", "use crate::b::B;\n"), ("src/b.rs", "pub struct B;\n")],
        );
        assert!(f.check("src/main.rs", Rules::default()).failures.is_empty());
    }

    /// The root and a folder: `State` and `lock` in lib.rs, `syndrome` in fw/mod.rs, leaf helpers in fw/ids.rs.
    const HOUSE_ROOT: &str = concat!(
        "//! Layers (bottom first): wire | fw\n",
        "mod fw;\n",
        "mod wire;\n",
        "pub struct State;\n",
        "pub use fw::qp::QpFw;\n",
        "fn f() { fw::qp::go(); crate::fw::syndrome(); }\n",
    );
    const HOUSE_FW: &str =
        "mod ids;\npub(crate) mod qp;\npub fn syndrome() {}\nfn g() { qp::go(); self::ids::alloc(); }\n";

    #[test]
    fn ancestor_items_fail_from_children_and_descendants_siblings_pass() {
        let qp = concat!(
            "use super::syndrome;\n",
            "use crate::State;\n",
            "use crate::{wire::Packet, lock};\n",
            "use super::*;\n",
            "fn f() { crate::fw::syndrome(); super::ids::alloc(); }\n",
            "impl super::super::State {}\n",
            "#[cfg(test)]\n",
            "mod tests { use super::*; use crate::State; }\n",
        );
        let f = Fixture::new(
            "ancestor",
            &[
                ("src/lib.rs", HOUSE_ROOT),
                ("src/fw/mod.rs", HOUSE_FW),
                ("src/fw/qp.rs", qp),
                ("src/fw/ids.rs", "pub fn alloc() {}\n"),
                ("src/wire.rs", "pub struct Packet;\nfn f() -> crate::State { todo!() }\n"),
            ],
        );
        let r = f.check("src/lib.rs", Rules { ancestor_items: true, ..Rules::default() });
        let a = fired(&r, "ancestor-item");
        let lines: Vec<&str> = a.iter().map(|s| s.split(": ").next().unwrap()).collect();
        assert_eq!(
            lines,
            [
                "[ancestor-item] src/fw/qp.rs:1",
                "[ancestor-item] src/fw/qp.rs:2",
                "[ancestor-item] src/fw/qp.rs:3",
                "[ancestor-item] src/fw/qp.rs:4",
                "[ancestor-item] src/fw/qp.rs:5",
                "[ancestor-item] src/fw/qp.rs:6",
                "[ancestor-item] src/wire.rs:2"
            ],
            "{a:#?}"
        );
        assert!(a[0].contains("`crate::fw::syndrome`, an item of its ancestor module `fw`"), "{a:?}");
        assert!(a[1].contains("`crate::State`, an item of the crate root"), "{a:?}");
        assert!(a[2].contains("crate::lock") && !a[2].contains("Packet"), "{a:?}");
        assert!(a[3].contains("a glob of its ancestor module `fw`'s items"), "{a:?}");
        // Without the rule the same tree passes.
        assert!(f.check("src/lib.rs", Rules::default()).failures.is_empty());

        let f = Fixture::new(
            "ancestor-ok",
            &[
                ("src/lib.rs", HOUSE_ROOT),
                ("src/fw/mod.rs", HOUSE_FW),
                (
                    "src/fw/qp.rs",
                    "use super::ids::alloc;\nuse crate::wire::Packet;\nuse crate::fw;\npub fn go() { alloc(); }\n",
                ),
                ("src/fw/ids.rs", "pub fn alloc() {}\n"),
                ("src/wire.rs", "pub struct Packet;\n"),
            ],
        );
        let r = f.check("src/lib.rs", STRICT_RULES);
        assert!(r.failures.is_empty(), "{:#?}", r.failures);
    }

    #[test]
    fn references_to_higher_layers_and_an_incomplete_layer_line_fail() {
        let decls = "mod fw;\nmod link;\nmod wire;\n#[cfg(test)]\nmod kit;\nmod dev;\n";
        let tree = |line: &str, wire: &str| {
            vec![
                ("src/lib.rs", format!("//! The device.\n//!\n{line}\n{decls}")),
                ("src/fw.rs", "use crate::wire::Packet;\nuse crate::link::Link;\npub fn go() {}\n".to_string()),
                ("src/link.rs", "pub struct Link;\n".to_string()),
                ("src/wire.rs", format!("pub struct Packet;\n{wire}\n#[cfg(test)]\nmod tests;\n")),
                ("src/wire/tests.rs", "use crate::dev::Dev;\n".to_string()),
                ("src/dev.rs", "pub struct Dev;\n".to_string()),
                ("src/kit.rs", "use crate::fw;\nuse crate::State;\n".to_string()),
            ]
        };
        let good = "//! Layers (bottom first): wire link | fw | dev";
        let f = Fixture::new("layers-ok", &tree(good, "fn f() { crate::link::Link; }"));
        let r = f.check("src/lib.rs", STRICT_RULES);
        assert!(r.failures.is_empty(), "a test file inside a layer is judged by none: {:#?}", r.failures);

        let f = Fixture::new("layers-up", &tree(good, "fn f() { crate::fw::go(); }"));
        let l = fired(&f.check("src/lib.rs", STRICT_RULES), "layer");
        assert_eq!(
            l,
            ["[layer] src/wire.rs:2: `wire` (layer 1) refers to `crate::fw::go` in `fw`, a higher layer (2)"],
            "{l:?}"
        );

        let f = Fixture::new("layers-kit", &tree("//! Layers (bottom first): kit | wire link | fw | dev", ""));
        let l = fired(&f.check("src/lib.rs", STRICT_RULES), "layer");
        assert_eq!(l.len(), 1, "a listed test kit is judged: {l:?}");
        assert!(l[0].starts_with("[layer] src/kit.rs:1: `kit` (layer 1) refers to `crate::fw`"), "{l:?}");

        let f = Fixture::new("layers-short", &tree("//! Layers (bottom first): wire | fw gone | wire dev", ""));
        let l = fired(&f.check("src/lib.rs", STRICT_RULES), "layer");
        assert!(l.iter().any(|s| s.contains("`wire` is in the layer line twice")), "{l:?}");
        assert!(l.iter().any(|s| s.contains("`gone` in the layer line is no top-level module")), "{l:?}");
        let missing = "[layer] src/lib.rs:5: top-level module `link` is not in the layer line (src/lib.rs:3)";
        assert!(l.iter().any(|s| s == missing), "{l:?}");
        assert!(!l.iter().any(|s| s.contains("`kit`")), "an unlisted test kit is left out: {l:?}");

        let f = Fixture::new("layers-none", &tree("//! Layers, bottom first: wire link | fw | dev", ""));
        let l = fired(&f.check("src/lib.rs", STRICT_RULES), "layer");
        assert_eq!(l.len(), 1, "{l:?}");
        assert!(l[0].contains("src/lib.rs:1: no `//! Layers (bottom first):"), "{l:?}");
        let r = f.check("src/lib.rs", Rules::default());
        assert!(r.failures.is_empty(), "only a crate that opts in needs the line: {:?}", r.failures);
    }

    #[test]
    fn self_and_super_in_an_inline_module_start_from_it() {
        let m = mods(&["", "fw", "fw::qp", "wire"]);
        let code = concat!(
            "use super::Top;\n",
            "mod field {\n",
            "    use super::Own;\n",
            "    mod deep { use super::super::Own2; use self::x::Y; }\n",
            "}\n",
            "mod field2 { use super::super::FwItem; }\n",
        );
        let refs = raw_references(&p("fw::qp"), &strip(code), &m);
        let got: Vec<(usize, String)> = refs.into_iter().map(|(l, t)| (l, t.join("::"))).collect();
        let want: Vec<(usize, String)> = [
            (1, "fw::Top"),
            (3, "fw::qp::Own"),
            (4, "fw::qp::Own2"),
            (4, "fw::qp::field::deep::x::Y"),
            (6, "fw::FwItem"),
        ]
        .iter()
        .map(|(l, t)| (*l, t.to_string()))
        .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn impl_blocks_are_keyed_by_their_self_type() {
        let code = concat!(
            "impl State {}\n",
            "impl<'a> EqFw<'a> {}\n",
            "impl fmt::Display for crate::fw::Qp<u8> {}\n",
            "unsafe impl Send for Sim {}\n",
            "#[cfg(test)]\n",
            "impl<T: Into<u8>> From<T> for Wrap<T> where T: Fn() -> u8 {}\n",
            "impl<T: X> Y for T {}\n",
            "impl<const N: usize> Z for [u8; N] {}\n",
            "fn f(x: impl Fn()) -> impl Iterator<Item = u8> {}\n",
            "impl !Sync for Raw {}\n",
            "impl<F> Trait for &mut F {}\n",
        );
        let got: Vec<(usize, String)> = impl_types(&strip(code));
        let want: Vec<(usize, String)> = [(1, "State"), (2, "EqFw"), (3, "Qp"), (4, "Sim"), (6, "Wrap"), (10, "Raw")]
            .iter()
            .map(|(l, t)| (*l, t.to_string()))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_type_with_impl_blocks_in_more_than_three_files_fails() {
        let four = [
            (
                "src/lib.rs",
                "//! Layers (bottom first): a b c\nmod a;\nmod b;\nmod c;\npub struct State;\nimpl State {}\n",
            ),
            ("src/a.rs", "impl crate::State { fn x() {} }\n"),
            ("src/b.rs", "impl Default for crate::State { fn default() -> Self { todo!() } }\n"),
            ("src/c.rs", "fn f() {}\n#[cfg(test)]\nmod tests {\n    impl crate::State {}\n}\n"),
        ];
        let f = Fixture::new("impl-four", &four);
        let r = f.check("src/lib.rs", Rules { max_impl_files: Some(3), ..Rules::default() });
        let i = fired(&r, "impl-files");
        let want =
            "[impl-files] src/lib.rs:6: `State` has impl blocks in 4 files (at most 3): src/lib.rs:6, src/a.rs:1, \
                    src/b.rs:1, src/c.rs:4";
        assert_eq!(i, [want]);
        let mut three = four;
        three[3].1 = "fn f() {}\n";
        let f = Fixture::new("impl-three", &three);
        assert!(f.check("src/lib.rs", Rules { max_impl_files: Some(3), ..Rules::default() }).failures.is_empty());
    }
}
