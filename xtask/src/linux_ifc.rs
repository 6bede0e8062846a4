//! `cargo xtask vendor --linux-extra`: `mlx5_ifc_<name>_bits` layouts that Linux's driver uses and that
//! `../shared/prm` does not carry, extracted mechanically from Linux 6.12's `include/linux/mlx5/mlx5_ifc.h`.
//!
//! The header comes from the same Debian source package `cargo xtask uml` builds from. Each requested struct (and
//! every struct it nests) is parsed from the header, its bit offsets and widths computed, and then every member is
//! checked against the C compiler: a generated C file includes the real header and asserts `offsetof`/`sizeof` on
//! the `_bits` struct, where each `u8` is one bit. As a check of the parser itself, every layout already vendored
//! in `core/prm/ifc_layouts.json` that the header defines is recomputed and must match. The result,
//! `core/prm/linux-extra-layouts.json` (with the kernel version and the header's sha256), has the shape the codegen
//! consumes; `codegen --check` keeps the generated code fresh. CI has no kernel source, so this runs only when asked.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::{json, Map, Value};

use crate::vendored::{read_json, VENDORED_C, VENDORED_EXTRA, VENDORED_EXTRA_C, VENDORED_IFC};
use crate::vfio_test::run;

/// The layouts to extract, by `<name>` of `mlx5_ifc_<name>_bits`, each with why the simulator needs it.
const EXTRA: &[(&str, &str)] = &[
    ("pvlc_reg", "ACCESS_REG PVLC (0x500f): mlx5_ib's IB port query reads vl_hw_cap"),
    ("create_rqt_in", "CREATE_RQT: mlx5e's RSS indirection tables (issue 35)"),
    ("create_rqt_out", "CREATE_RQT's reply"),
    ("modify_rqt_in", "MODIFY_RQT: mlx5e redirects its RQTs on open and close"),
    ("modify_rqt_out", "MODIFY_RQT's reply"),
    ("destroy_rqt_in", "DESTROY_RQT"),
    ("destroy_rqt_out", "DESTROY_RQT's reply"),
    ("modify_tir_in", "MODIFY_TIR: mlx5e updates its TIRs' LRO and hash fields"),
    ("modify_tir_out", "MODIFY_TIR's reply"),
    ("create_flow_table_in", "CREATE_FLOW_TABLE: fs_core's NIC RX tables"),
    ("create_flow_table_out", "CREATE_FLOW_TABLE's reply"),
    ("modify_flow_table_in", "MODIFY_FLOW_TABLE: fs_core chains a table's miss to the next priority"),
    ("modify_flow_table_out", "MODIFY_FLOW_TABLE's reply"),
    ("destroy_flow_table_in", "DESTROY_FLOW_TABLE"),
    ("destroy_flow_table_out", "DESTROY_FLOW_TABLE's reply"),
    ("set_flow_table_root_in", "SET_FLOW_TABLE_ROOT: fs_core's first NIC RX table"),
    ("set_flow_table_root_out", "SET_FLOW_TABLE_ROOT's reply"),
    ("query_vport_counter_in", "QUERY_VPORT_COUNTER: mlx5e's vport statistics"),
    ("query_vport_counter_out", "QUERY_VPORT_COUNTER's reply"),
    ("query_rq_in", "QUERY_RQ: mlx5e reads an RQ's state on recovery"),
    ("query_rq_out", "QUERY_RQ's reply"),
    ("query_sq_in", "QUERY_SQ: mlx5e reads an SQ's state on recovery"),
    ("query_sq_out", "QUERY_SQ's reply"),
    ("ppcnt_reg", "ACCESS_REG PPCNT (0x5008): mlx5e's port counters (ethtool -S)"),
    ("pfcc_reg", "ACCESS_REG PFCC (0x5007): mlx5e reads pause and PFC settings (ethtool -S, -a)"),
    ("modify_hca_vport_context_in", "MODIFY_HCA_VPORT_CONTEXT: mlx5_ib's set_port_caps_atomic (IsCM on the IB port)"),
    ("modify_hca_vport_context_out", "MODIFY_HCA_VPORT_CONTEXT's reply"),
    ("mad_ifc_in", "MAD_IFC: mlx5_ib hands the firmware's SMA the SMPs of QP0 and its own port queries (issue 36)"),
    ("mad_ifc_out", "MAD_IFC's reply: the response MAD"),
    ("create_uctx_in", "CREATE_UCTX: mlx5_ib opens a DevX user context (uid) for a ucontext that asks for one"),
    ("create_uctx_out", "CREATE_UCTX's reply: the uid"),
    ("destroy_uctx_in", "DESTROY_UCTX"),
    ("destroy_uctx_out", "DESTROY_UCTX's reply"),
    ("create_umem_in", "CREATE_UMEM: mlx5_ib registers a DevX user memory (its MTT list)"),
    ("create_umem_out", "CREATE_UMEM's reply: the umem id"),
    ("destroy_umem_in", "DESTROY_UMEM"),
    ("destroy_umem_out", "DESTROY_UMEM's reply"),
    ("alloc_memic_in", "ALLOC_MEMIC: mlx5_ib's device memory (ibv_alloc_dm) takes a range of the MEMIC BAR region"),
    ("alloc_memic_out", "ALLOC_MEMIC's reply: the allocation's BAR offset"),
    ("dealloc_memic_in", "DEALLOC_MEMIC: ibv_free_dm gives the range back"),
    ("dealloc_memic_out", "DEALLOC_MEMIC's reply"),
    ("set_pp_rate_limit_in", "SET_PP_RATE_LIMIT: mlx5_core's packet pacing table (mlx5dv_pp_alloc through mlx5_ib)"),
    ("set_pp_rate_limit_out", "SET_PP_RATE_LIMIT's reply"),
];

/// The headers, relative to the source tree.
const HEADERS: &[&str] = &["include/linux/mlx5/mlx5_ifc.h", "include/linux/mlx5/mlx5_ifc_fpga.h"];

/// Plain C structures (byte layouts, big-endian members) of `qp.h` to extract, each with why the simulator needs
/// it. rdma-core spells the same layouts `mlx5_wqe_umr_repeat_block_seg` / `mlx5_wqe_umr_repeat_ent_seg`.
const C_EXTRA: &[(&str, &str)] = &[
    (
        "mlx5_stride_block_ctrl_seg",
        "the repeat block header of an interleaved UMR (rdma-core's mlx5dv_wr_mr_interleaved, issue 35)",
    ),
    ("mlx5_stride_block_entry", "one entry of a repeat block: key, address, bytes per cycle, stride"),
];

/// The header [`C_EXTRA`] comes from. It includes most of the kernel, so the check compiles the structures'
/// own text, cut from it, rather than the header.
const C_HEADER: &str = "include/linux/mlx5/qp.h";

#[derive(Debug, Clone)]
enum Tok {
    Ident(String),
    Num(u64),
    Punct(char),
}

fn tokenize(src: &str) -> Result<Vec<Tok>, String> {
    // Comments and preprocessor lines carry no layout.
    let mut text = String::with_capacity(src.len());
    let mut rest = src;
    while let Some(i) = rest.find("/*") {
        text.push_str(&rest[..i]);
        let end = rest[i..].find("*/").ok_or("an unterminated comment")?;
        rest = &rest[i + end + 2..];
    }
    text.push_str(rest);
    let mut toks = Vec::new();
    for line in text.lines() {
        let line = line.split("//").next().unwrap_or("");
        if line.trim_start().starts_with('#') {
            continue;
        }
        let b = line.as_bytes();
        let mut i = 0;
        while i < b.len() {
            let c = b[i] as char;
            if c.is_ascii_whitespace() {
                i += 1;
            } else if c.is_ascii_alphabetic() || c == '_' {
                let s = i;
                while i < b.len() && ((b[i] as char).is_ascii_alphanumeric() || b[i] == b'_') {
                    i += 1;
                }
                toks.push(Tok::Ident(line[s..i].to_string()));
            } else if c.is_ascii_digit() {
                let s = i;
                while i < b.len() && (b[i] as char).is_ascii_alphanumeric() {
                    i += 1;
                }
                let lit = line[s..i].trim_end_matches(['u', 'U', 'l', 'L']);
                let n = match lit.strip_prefix("0x").or_else(|| lit.strip_prefix("0X")) {
                    Some(h) => u64::from_str_radix(h, 16),
                    None => lit.parse(),
                };
                // Numbers outside struct bodies (enum values in other spellings) are not needed: keep a marker.
                toks.push(n.map_or(Tok::Punct('?'), Tok::Num));
            } else {
                toks.push(Tok::Punct(c));
                i += 1;
            }
        }
    }
    Ok(toks)
}

/// One member of a `_bits` struct or union as written in the header.
#[derive(Debug, Clone)]
enum Member {
    /// `u8 name[d0][d1]...;` (an empty or zero dimension is flexible, stored as 0).
    Bits { name: String, dims: Vec<u64> },
    /// `struct|union mlx5_ifc_<ty>_bits name[dims];`
    Ref { name: String, ty: String, union: bool, dims: Vec<u64> },
    /// An inline `struct { ... }` / `union { ... }`, anonymous when `name` is `None`.
    Inline { union: bool, members: Vec<Member>, name: Option<String> },
}

#[derive(Debug, Clone)]
struct Def {
    /// The C tag, `mlx5_ifc_<name>_bits` (one union lacks the suffix).
    tag: String,
    union: bool,
    members: Vec<Member>,
}

struct Parser<'a> {
    t: &'a [Tok],
    i: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<&Tok> {
        self.t.get(self.i)
    }
    fn next(&mut self) -> Option<Tok> {
        let t = self.t.get(self.i).cloned();
        self.i += 1;
        t
    }
    fn punct(&mut self, c: char) -> Result<(), String> {
        match self.next() {
            Some(Tok::Punct(p)) if p == c => Ok(()),
            t => Err(format!("expected {c:?}, found {t:?}")),
        }
    }
    fn ident(&mut self) -> Result<String, String> {
        match self.next() {
            Some(Tok::Ident(s)) => Ok(s),
            t => Err(format!("expected a name, found {t:?}")),
        }
    }
    fn dims(&mut self) -> Result<Vec<u64>, String> {
        let mut d = Vec::new();
        while matches!(self.peek(), Some(Tok::Punct('['))) {
            self.next();
            match self.next() {
                Some(Tok::Num(n)) => {
                    d.push(n);
                    self.punct(']')?;
                }
                Some(Tok::Punct(']')) => d.push(0),
                t => return Err(format!("expected a dimension, found {t:?}")),
            }
        }
        Ok(d)
    }
    /// `<name>` of `mlx5_ifc_<name>_bits`; the header spells one union `mlx5_ifc_exe_aso_ctrl`, without `_bits`.
    fn bits_name(ty: &str) -> Result<String, String> {
        ty.strip_prefix("mlx5_ifc_")
            .map(|s| s.strip_suffix("_bits").unwrap_or(s).to_string())
            .ok_or_else(|| format!("member type {ty} is not an mlx5_ifc_*_bits type"))
    }
    /// Members up to the closing brace (consumed).
    fn members(&mut self) -> Result<Vec<Member>, String> {
        let mut out = Vec::new();
        loop {
            match self.next() {
                Some(Tok::Punct('}')) => return Ok(out),
                Some(Tok::Ident(k)) if k == "u8" => {
                    let name = self.ident()?;
                    let dims = self.dims()?;
                    self.punct(';')?;
                    out.push(Member::Bits { name, dims });
                }
                Some(Tok::Ident(k)) if k == "struct" || k == "union" => {
                    let union = k == "union";
                    if matches!(self.peek(), Some(Tok::Punct('{'))) {
                        self.next();
                        let members = self.members()?;
                        let name = match self.peek() {
                            Some(Tok::Ident(_)) => Some(self.ident()?),
                            _ => None,
                        };
                        self.punct(';')?;
                        out.push(Member::Inline { union, members, name });
                    } else {
                        let ty = Self::bits_name(&self.ident()?)?;
                        let name = self.ident()?;
                        let dims = self.dims()?;
                        self.punct(';')?;
                        out.push(Member::Ref { name, ty, union, dims });
                    }
                }
                Some(Tok::Ident(k)) if k == "DECLARE_FLEX_ARRAY" => {
                    self.punct('(')?;
                    let kw = self.ident()?;
                    let ty = Self::bits_name(&self.ident()?)?;
                    self.punct(',')?;
                    let name = self.ident()?;
                    self.punct(')')?;
                    self.punct(';')?;
                    out.push(Member::Ref { name, ty, union: kw == "union", dims: vec![0] });
                }
                t => return Err(format!("unsupported member starting with {t:?}")),
            }
        }
    }
}

/// The header's `_bits` types: the ones parsed, and the ones this parser cannot lay out (with why).
#[derive(Default)]
struct Defs {
    ok: BTreeMap<String, Def>,
    broken: BTreeMap<String, String>,
}

/// Every top-level `struct|union mlx5_ifc_<name>_bits { ... };` of the header, by `<name>`. A body this parser
/// cannot read (a dimension spelled as a macro, say) is recorded, and refused only if a requested layout needs it.
fn parse_defs(src: &str) -> Result<Defs, String> {
    let toks = tokenize(src)?;
    let mut defs = Defs::default();
    let mut p = Parser { t: &toks, i: 0 };
    while p.i + 2 < toks.len() {
        let here = (&toks[p.i], &toks[p.i + 1], &toks[p.i + 2]);
        if let (Tok::Ident(k), Tok::Ident(ty), Tok::Punct('{')) = here {
            if (k == "struct" || k == "union") && ty.starts_with("mlx5_ifc_") {
                let union = k == "union";
                let tag = ty.clone();
                let name = Parser::bits_name(ty)?;
                let body = p.i + 3;
                p.i = body;
                match p.members() {
                    Ok(members) => {
                        defs.ok.insert(name, Def { tag, union, members });
                    }
                    Err(e) => {
                        defs.broken.insert(name, e);
                        // Resynchronise after the body's closing brace.
                        let mut depth = 1usize;
                        p.i = body;
                        while depth > 0 {
                            match p.next() {
                                Some(Tok::Punct('{')) => depth += 1,
                                Some(Tok::Punct('}')) => depth -= 1,
                                Some(_) => {}
                                None => return Err(format!("{tag}: no closing brace")),
                            }
                        }
                    }
                }
                continue;
            }
        }
        p.i += 1;
    }
    Ok(defs)
}

/// Computes layouts (sizes and the JSON field lists), memoised.
struct Layouts<'a> {
    defs: &'a Defs,
    sizes: BTreeMap<String, u64>,
}

impl Layouts<'_> {
    fn def(&self, name: &str) -> Result<Def, String> {
        if let Some(why) = self.defs.broken.get(name) {
            return Err(format!("mlx5_ifc_{name}_bits: {why}"));
        }
        self.defs.ok.get(name).cloned().ok_or_else(|| format!("the header defines no mlx5_ifc_{name}_bits"))
    }
    fn size(&mut self, name: &str) -> Result<u64, String> {
        if let Some(s) = self.sizes.get(name) {
            return Ok(*s);
        }
        let def = self.def(name)?;
        let s = self.members_size(def.union, &def.members)?;
        self.sizes.insert(name.to_string(), s);
        Ok(s)
    }
    fn member_size(&mut self, m: &Member) -> Result<u64, String> {
        Ok(match m {
            Member::Bits { dims, .. } => dims.iter().product(),
            Member::Ref { ty, dims, .. } => self.size(ty)? * dims.iter().product::<u64>(),
            Member::Inline { union, members, .. } => self.members_size(*union, members)?,
        })
    }
    fn members_size(&mut self, union: bool, members: &[Member]) -> Result<u64, String> {
        let mut s = 0;
        for m in members {
            let w = self.member_size(m)?;
            s = if union { s.max(w) } else { s + w };
        }
        Ok(s)
    }
    /// The JSON fields of `members` starting at bit `base`; anonymous inline members are promoted.
    fn fields(&mut self, union: bool, members: &[Member], base: u64, out: &mut Vec<Value>) -> Result<(), String> {
        let mut off = base;
        for m in members {
            let at = if union { base } else { off };
            match m {
                Member::Bits { name, dims } => match dims.as_slice() {
                    [w] => out.push(json!({"name": name, "offset_bits": at, "width_bits": w, "kind": "scalar"})),
                    [n, w] => {
                        let mut f = json!({"name": name, "offset_bits": at, "width_bits": n * w, "kind": "array",
                                           "count": n, "elem_width_bits": w});
                        if *n == 0 {
                            f["flexible"] = json!(true);
                        }
                        out.push(f);
                    }
                    _ => return Err(format!("{name}: {} dimensions", dims.len())),
                },
                Member::Ref { name, ty, union: u, dims } => {
                    let w = self.size(ty)?;
                    match dims.as_slice() {
                        [] => {
                            let mut f = json!({"name": name, "offset_bits": at, "width_bits": w, "kind": "struct",
                                               "elem_struct": ty});
                            if *u {
                                f["union"] = json!(true);
                            }
                            out.push(f);
                        }
                        [n] => {
                            let mut f = json!({"name": name, "offset_bits": at, "width_bits": n * w, "kind": "array",
                                               "count": n, "elem_width_bits": w, "elem_struct": ty});
                            if *u {
                                f["union"] = json!(true);
                            }
                            if *n == 0 {
                                f["flexible"] = json!(true);
                            }
                            out.push(f);
                        }
                        _ => return Err(format!("{name}: a multi-dimensional array of structs")),
                    }
                }
                Member::Inline { union: u, members, name: None } => self.fields(*u, members, at, out)?,
                // A named struct or union declared in place (`struct { ... } sws;`) has no `_bits` type to refer
                // to: its members are laid out where it sits, named `sws.member` (a C member designator, which
                // `offsetof` accepts, so the compiler still checks them; the codegen spells the dot `_`).
                Member::Inline { union: u, members, name: Some(n) } => {
                    let mut inner = Vec::new();
                    self.fields(*u, members, at, &mut inner)?;
                    for mut f in inner {
                        let m = f["name"].as_str().unwrap_or_default().to_string();
                        f["name"] = json!(format!("{n}.{m}"));
                        out.push(f);
                    }
                }
            }
            off += self.member_size(m)?;
        }
        Ok(())
    }
    fn layout(&mut self, name: &str) -> Result<Value, String> {
        let def = self.def(name)?;
        let mut fields = Vec::new();
        self.fields(def.union, &def.members, 0, &mut fields).map_err(|e| format!("mlx5_ifc_{name}_bits: {e}"))?;
        let kw = if def.union { "union" } else { "struct" };
        Ok(json!({"size_bits": self.size(name)?, "c_type": format!("{kw} {}", def.tag), "fields": fields}))
    }
}

/// The `_Static_assert`s that pin `layout` (named `name`) to what the C compiler makes of the header.
fn c_asserts(name: &str, layout: &Value, out: &mut String) {
    use std::fmt::Write as _;
    let ty = layout["c_type"].as_str().unwrap_or_default();
    let size = layout["size_bits"].as_u64().unwrap_or_default();
    writeln!(out, "_Static_assert(sizeof({ty}) == {size}, \"{name}: size\");").unwrap();
    for f in layout["fields"].as_array().into_iter().flatten() {
        let m = f["name"].as_str().unwrap_or_default();
        let off = f["offset_bits"].as_u64().unwrap_or_default();
        let w = f["width_bits"].as_u64().unwrap_or_default();
        writeln!(out, "_Static_assert(offsetof({ty}, {m}) == {off}, \"{name}.{m}: offset\");").unwrap();
        if f["flexible"].as_bool() != Some(true) {
            writeln!(out, "_Static_assert(sizeof((({ty} *)0)->{m}) == {w}, \"{name}.{m}: width\");").unwrap();
        }
    }
}

/// Compiles `asserts` against the real header in `include_dir` (each `u8` one bit, so `offsetof` is in bits).
fn c_check(work: &Path, include_dir: &Path, asserts: &str) -> Result<(), String> {
    let src = format!(
        "#include <stddef.h>\n\
         typedef unsigned char u8;\n\
         typedef unsigned short u16;\n\
         typedef unsigned int u32;\n\
         typedef unsigned long long u64;\n\
         typedef u16 __be16;\n\
         typedef u32 __be32;\n\
         typedef u64 __be64;\n\
         #define BIT(n) (1UL << (n))\n\
         #define BIT_ULL(n) (1ULL << (n))\n\
         #define DECLARE_FLEX_ARRAY(T, n) struct {{ struct {{ }} __empty_##n; T n[]; }}\n\
         #include \"mlx5_ifc.h\"\n{asserts}"
    );
    let c = work.join("ifc_check.c");
    std::fs::write(&c, src).map_err(|e| format!("{}: {e}", c.display()))?;
    let out = Command::new("cc")
        .args(["-std=gnu11", "-fsyntax-only", "-I"])
        .arg(include_dir)
        .arg(&c)
        .output()
        .map_err(|e| format!("cc: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the C compiler disagrees with the extracted layouts:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// The text of `struct name { ... };` in `src` (comments removed), as the header writes it.
fn c_struct_text(src: &str, name: &str) -> Result<String, String> {
    let open = format!("struct {name} {{");
    let at = src.find(&open).ok_or_else(|| format!("{C_HEADER} defines no struct {name}"))?;
    let end = src[at..].find("};").ok_or_else(|| format!("struct {name}: no end"))?;
    let body = &src[at..at + end + 2];
    if body[open.len()..].contains('{') {
        return Err(format!("struct {name}: nested structures are not extracted"));
    }
    Ok(body.to_string())
}

/// Bytes (and alignment) of a scalar member type a plain C structure of `qp.h` uses.
fn c_scalar(ty: &str) -> Option<u64> {
    match ty {
        "u8" | "__u8" => Some(1),
        "u16" | "__u16" | "__be16" => Some(2),
        "u32" | "__u32" | "__be32" => Some(4),
        "u64" | "__u64" | "__be64" => Some(8),
        _ => None,
    }
}

/// Lays out a plain C structure (scalar members and fixed arrays of them, natural alignment, as gcc does) in the
/// shape of `core/prm/c_layouts.json`. Anything else is refused rather than guessed.
fn c_struct_layout(name: &str, text: &str) -> Result<Value, String> {
    let toks = tokenize(text)?;
    let mut p = Parser { t: &toks, i: 0 };
    let head = (p.ident()?, p.ident()?);
    if head.0 != "struct" || head.1 != name {
        return Err(format!("struct {name}: unexpected start {head:?}"));
    }
    p.punct('{')?;
    let (mut off, mut align, mut members) = (0u64, 1u64, Vec::new());
    while !matches!(p.peek(), Some(Tok::Punct('}'))) {
        let ty = p.ident()?;
        let size = c_scalar(&ty).ok_or_else(|| format!("struct {name}: member type {ty} is not extracted"))?;
        let m = p.ident()?;
        let dims = p.dims()?;
        p.punct(';')?;
        let count = match dims.as_slice() {
            [] => 0,
            [n] if *n > 0 => *n,
            _ => return Err(format!("struct {name}.{m}: only fixed one-dimensional arrays are extracted")),
        };
        off = off.next_multiple_of(size);
        align = align.max(size);
        let bytes = size * count.max(1);
        members.push(json!({"name": m, "offset": off, "size": bytes, "count": count, "type": ty}));
        off += bytes;
    }
    Ok(json!({"kind": "struct", "size": off.next_multiple_of(align), "members": members}))
}

/// The `_Static_assert`s that pin a plain C layout to what the C compiler makes of the structure.
fn c_plain_asserts(name: &str, layout: &Value, out: &mut String) {
    use std::fmt::Write as _;
    let size = layout["size"].as_u64().unwrap_or_default();
    writeln!(out, "_Static_assert(sizeof(struct {name}) == {size}, \"{name}: size\");").unwrap();
    for m in layout["members"].as_array().into_iter().flatten() {
        let f = m["name"].as_str().unwrap_or_default();
        let (off, w) = (m["offset"].as_u64().unwrap_or_default(), m["size"].as_u64().unwrap_or_default());
        writeln!(out, "_Static_assert(offsetof(struct {name}, {f}) == {off}, \"{name}.{f}: offset\");").unwrap();
        writeln!(out, "_Static_assert(sizeof(((struct {name} *)0)->{f}) == {w}, \"{name}.{f}: width\");").unwrap();
    }
}

/// Compiles the structures' text with `asserts` (the kernel's scalar types, as `linux/types.h` defines them).
fn c_plain_check(work: &Path, structs: &str, asserts: &str) -> Result<(), String> {
    let src = format!(
        "#include <stddef.h>\n\
         typedef unsigned char u8;\n\
         typedef unsigned short u16;\n\
         typedef unsigned int u32;\n\
         typedef unsigned long long u64;\n\
         typedef u16 __be16;\n\
         typedef u32 __be32;\n\
         typedef u64 __be64;\n\
         {structs}\n{asserts}"
    );
    let c = work.join("qp_check.c");
    std::fs::write(&c, src).map_err(|e| format!("{}: {e}", c.display()))?;
    let out =
        Command::new("cc").args(["-std=gnu11", "-fsyntax-only"]).arg(&c).output().map_err(|e| format!("cc: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the C compiler disagrees with the extracted qp.h layouts:\n{}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

/// Extracts [`C_EXTRA`] from `qp.h` in `inc`, checked by the C compiler, as the document
/// `core/prm/linux-extra-c-layouts.json` holds.
fn vendor_c_extra(root: &Path, inc: &Path, deb_name: &str, version: &str) -> Result<usize, String> {
    let path = inc.join(Path::new(C_HEADER).file_name().unwrap_or_default());
    let raw = std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
    // Comments carry no layout (and one could hide a brace).
    let mut src = String::with_capacity(raw.len());
    let mut rest = raw.as_str();
    while let Some(i) = rest.find("/*") {
        src.push_str(&rest[..i]);
        let end = rest[i..].find("*/").ok_or("qp.h: an unterminated comment")?;
        rest = &rest[i + end + 2..];
    }
    src.push_str(rest);
    let (mut texts, mut asserts) = (String::new(), String::new());
    let known = read_json(&root.join(VENDORED_C))?;
    let mut doc = Map::new();
    doc.insert(
        "_meta".into(),
        json!({
            "source": format!("Linux {version} (Debian {deb_name}): {C_HEADER}"),
            "sha256": {C_HEADER: sha256(&path)?},
            "extracted_by": "cargo xtask vendor --linux-extra (xtask/src/linux_ifc.rs)",
            "checked": "sizeof and every member's offsetof/sizeof asserted by the C compiler on the structures' text from the header",
            "why": C_EXTRA.iter().map(|(n, w)| (n.to_string(), json!(w))).collect::<Map<_, _>>(),
        }),
    );
    for (name, _) in C_EXTRA {
        if known.get(*name).is_some() {
            return Err(format!("{name} is already in {VENDORED_C}"));
        }
        let text = c_struct_text(&src, name)?;
        let l = c_struct_layout(name, &text)?;
        texts.push_str(&text);
        texts.push('\n');
        c_plain_asserts(name, &l, &mut asserts);
        doc.insert((*name).to_string(), l);
    }
    c_plain_check(&root.join("target/uml/ifc"), &texts, &asserts)?;
    let out = root.join(VENDORED_EXTRA_C);
    let mut text = serde_json::to_string_pretty(&Value::Object(doc)).map_err(|e| e.to_string())?;
    text.push('\n');
    std::fs::write(&out, text).map_err(|e| format!("{}: {e}", out.display()))?;
    Ok(C_EXTRA.len())
}

fn sha256(p: &Path) -> Result<String, String> {
    run(Command::new("sha256sum").arg(p))?
        .split_whitespace()
        .next()
        .map(str::to_string)
        .ok_or_else(|| format!("sha256sum {} printed nothing", p.display()))
}

/// The headers from the source package, extracted once into `target/uml/ifc/<package file name>/`.
fn headers(root: &Path) -> Result<(PathBuf, String), String> {
    let base = root.join("target/uml");
    let deb = crate::uml::source_deb(&base.join("dl"))?;
    let deb_name = deb.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
    let dir = base.join("ifc").join(&deb_name);
    let inc = dir.join("include/linux/mlx5");
    if !HEADERS.iter().chain([&C_HEADER]).all(|h| dir.join(h).exists()) {
        let x = dir.join("x");
        let tarball = crate::uml::source_tarball(&deb, &x)?;
        let mut tar = Command::new("tar");
        tar.arg("xf").arg(&tarball).arg("-C").arg(&dir).arg("--strip-components=1");
        for h in HEADERS.iter().chain([&C_HEADER]) {
            tar.arg(format!("{}/{h}", crate::uml::SOURCE_PKG));
        }
        run(&mut tar)?;
        let _ = std::fs::remove_dir_all(&x);
    }
    Ok((inc, deb_name))
}

/// `cargo xtask vendor --linux-extra`.
pub fn run_vendor_extra(root: &Path) -> Result<(), String> {
    let (inc, deb_name) = headers(root)?;
    let paths: Vec<PathBuf> = HEADERS.iter().map(|h| inc.join(Path::new(h).file_name().unwrap_or_default())).collect();
    let mut src = String::new();
    for p in &paths {
        src.push_str(&std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?);
    }
    let defs = parse_defs(&src)?;
    let mut lay = Layouts { defs: &defs, sizes: BTreeMap::new() };

    // The parser against the layouts vendored from ../shared/prm (an independent extraction).
    let known = read_json(&root.join(VENDORED_IFC))?;
    // Every layout the header defines is also asserted to the C compiler below.
    let mut asserts = String::new();
    let (mut same, mut differ) = (0, Vec::new());
    for (name, v) in known.as_object().ok_or("ifc_layouts.json is not an object")? {
        if name == "_meta" || !defs.ok.contains_key(name) {
            continue;
        }
        let ours = lay.layout(name)?;
        c_asserts(name, &ours, &mut asserts);
        if ours["size_bits"] == v["size_bits"] && ours["fields"] == v["fields"] {
            same += 1;
        } else {
            let (a, b) = (ours["fields"].as_array(), v["fields"].as_array());
            let first = a.into_iter().flatten().zip(b.into_iter().flatten()).find(|(x, y)| x != y);
            differ.push(format!("{name} (first difference: {first:?})"));
        }
    }
    if !differ.is_empty() {
        return Err(format!("the extractor disagrees with core/prm/ifc_layouts.json on: {}", differ.join(", ")));
    }

    // The requested layouts and everything they nest.
    let mut out = Map::new();
    let mut todo: Vec<String> = EXTRA.iter().map(|(n, _)| (*n).to_string()).collect();
    while let Some(name) = todo.pop() {
        if out.contains_key(&name) || known.get(&name).is_some() {
            continue;
        }
        let l = lay.layout(&name)?;
        for f in l["fields"].as_array().into_iter().flatten() {
            if let Some(e) = f["elem_struct"].as_str() {
                todo.push(e.to_string());
            }
        }
        out.insert(name, l);
    }
    for (name, l) in &out {
        c_asserts(name, l, &mut asserts);
    }
    let work = root.join("target/uml/ifc");
    c_check(&work, &inc, &asserts)?;

    let mut sha = Map::new();
    for (h, p) in HEADERS.iter().zip(&paths) {
        sha.insert((*h).to_string(), json!(sha256(p)?));
    }
    let version = deb_name.split('_').nth(1).unwrap_or("?").to_string();
    let mut doc = Map::new();
    doc.insert(
        "_meta".into(),
        json!({
            "source": format!("Linux {} (Debian {deb_name}): include/linux/mlx5/mlx5_ifc.h", version.split('-').next().unwrap_or("?")),
            "sha256": sha,
            "extracted_by": "cargo xtask vendor --linux-extra (xtask/src/linux_ifc.rs)",
            "checked": "every member's offsetof/sizeof asserted by the C compiler on the header's _bits structs (one u8 = one bit); the same extractor reproduces every layout of ifc_layouts.json the header defines",
            "why": EXTRA.iter().map(|(n, w)| (n.to_string(), json!(w))).collect::<Map<_, _>>(),
            "convention": known["_meta"]["convention"],
        }),
    );
    let mut names: Vec<_> = out.keys().cloned().collect();
    names.sort();
    for n in names {
        doc.insert(n.clone(), out[&n].clone());
    }
    let path = root.join(VENDORED_EXTRA);
    let mut text = serde_json::to_string_pretty(&Value::Object(doc)).map_err(|e| e.to_string())?;
    text.push('\n');
    std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    let n_c = vendor_c_extra(root, &inc, &deb_name, version.split('-').next().unwrap_or("?"))?;
    println!(
        "vendor --linux-extra: {} layout(s) into {VENDORED_EXTRA}, {n_c} C structure(s) into {VENDORED_EXTRA_C}; \
         the extractor reproduces {same} vendored layouts; the C compiler agrees on every member",
        out.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nested_unions_arrays_and_flexible_members_are_laid_out_like_c() {
        let h = "struct mlx5_ifc_a_bits { u8 x[0x8]; u8 y[0x18]; };\n\
                 union mlx5_ifc_u_bits { struct mlx5_ifc_a_bits a; u8 raw[0x40]; };\n\
                 struct mlx5_ifc_t_bits {\n\
                   u8 op[0x10]; /* a comment */\n\
                   u8 reserved_at_10[0x10];\n\
                   union { struct { u8 p[0x20]; }; u8 q[0x20]; };\n\
                   union mlx5_ifc_u_bits u;\n\
                   u8 gid[2][0x8];\n\
                   struct mlx5_ifc_a_bits pas[];\n\
                 };";
        let defs = parse_defs(h).unwrap();
        assert!(defs.broken.is_empty());
        let mut l = Layouts { defs: &defs, sizes: BTreeMap::new() };
        let t = l.layout("t").unwrap();
        assert_eq!(t["size_bits"], 0x10 + 0x10 + 0x20 + 0x40 + 0x10);
        let f = t["fields"].as_array().unwrap();
        let at = |n: &str| f.iter().find(|x| x["name"] == n).unwrap().clone();
        assert_eq!(at("p")["offset_bits"], 0x20);
        assert_eq!(at("q")["offset_bits"], 0x20);
        assert_eq!(at("u")["offset_bits"], 0x40);
        assert_eq!(at("u")["union"], true);
        assert_eq!(at("gid")["count"], 2);
        assert_eq!(at("gid")["offset_bits"], 0x80);
        assert_eq!(at("pas")["flexible"], true);
        assert_eq!(at("pas")["elem_width_bits"], 0x20);
        assert_eq!(at("pas")["offset_bits"], 0x90);
    }

    #[test]
    fn constructs_it_cannot_lay_out_are_refused() {
        let defs = parse_defs("struct mlx5_ifc_b_bits { int x; }; struct mlx5_ifc_d_bits { u8 y[0x8]; };").unwrap();
        assert!(defs.broken.contains_key("b"));
        assert!(Layouts { defs: &defs, sizes: BTreeMap::new() }.layout("b").is_err());
        assert!(Layouts { defs: &defs, sizes: BTreeMap::new() }.layout("d").is_ok());
    }

    #[test]
    fn plain_c_structs_are_laid_out_with_natural_alignment_and_odd_ones_refused() {
        let src =
            "struct other { u8 x; };\nstruct s {\n\t__be16 a; /* a comment */\n\tu8 b[3];\n\t__be32 c;\n\tu8 d;\n};\n";
        let text = c_struct_text(src, "s").unwrap();
        let l = c_struct_layout("s", &text).unwrap();
        // `d` follows `c` (4 bytes at 8) at 12, and the size rounds up to the 4-byte alignment.
        assert_eq!(l["size"], 16);
        let got: Vec<(String, u64, u64, u64)> = l["members"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                let n = |k: &str| m[k].as_u64().unwrap();
                (m["name"].as_str().unwrap().to_string(), n("offset"), n("size"), n("count"))
            })
            .collect();
        let want = [("a", 0, 2, 0), ("b", 2, 3, 3), ("c", 8, 4, 0), ("d", 12, 1, 0)];
        let want: Vec<(String, u64, u64, u64)> = want.iter().map(|(a, b, c, d)| (a.to_string(), *b, *c, *d)).collect();
        assert_eq!(got, want);
        for bad in ["struct t { int x; };", "struct t { u8 x[]; };", "struct t { struct { u8 y; } x; };"] {
            let r = c_struct_text(bad, "t").and_then(|t| c_struct_layout("t", &t));
            assert!(r.is_err(), "{bad}");
        }
        assert!(c_struct_text(src, "missing").is_err());
    }

    #[test]
    fn a_named_in_place_struct_is_laid_out_with_dotted_member_names() {
        // flow_table_context's `union { struct { ... } sws; struct { ... } hws; }`.
        let h = "struct mlx5_ifc_c_bits { u8 a[0x8]; union { struct { u8 x[0x8]; u8 y[0x8]; } sws; \
                 struct { u8 z[0x10]; } hws; }; };";
        let defs = parse_defs(h).unwrap();
        let l = Layouts { defs: &defs, sizes: BTreeMap::new() }.layout("c").unwrap();
        let names: Vec<(&str, u64)> = l["fields"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| (f["name"].as_str().unwrap(), f["offset_bits"].as_u64().unwrap()))
            .collect();
        assert_eq!(names, [("a", 0), ("sws.x", 8), ("sws.y", 16), ("hws.z", 8)]);
        assert_eq!(l["size_bits"], 24);
    }
}
