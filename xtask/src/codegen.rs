//! PRM code generation.
//!
//! Two steps keep hand-typed offsets out of the driver:
//! * `vendor` copies facts from `../shared/prm` (the compiler-verified extraction of the Linux 6.12 headers) into
//!   `core/prm/`, so a user's clone builds without the shared folder;
//! * `generate` turns the vendored facts into `core/src/prm/generated.rs`.
//!
//! `check` re-runs both in memory and fails when a checked-in file differs.

use serde_json::{json, Map, Value};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::vendored::{
    read_json, VENDORED_C, VENDORED_CONSTS, VENDORED_EXTRA, VENDORED_EXTRA_C, VENDORED_IFC, VENDORED_VECTORS,
};

/// The file the codegen writes, relative to the workspace root.
pub const GENERATED: &str = "core/src/prm/generated.rs";

/// C-level structures (from `c-layouts.md`) that the driver reads or writes.
const C_STRUCTS: &[&str] = &[
    "mlx5_init_seg",
    "health_buffer",
    "mlx5_cmd_layout",
    "mlx5_cmd_prot_block",
    "mlx5_eqe",
    "mlx5_eqe_comp",
    "mlx5_eqe_cmd",
    "mlx5_eqe_page_req",
    "mlx5_eqe_cq_err",
    "mlx5_eqe_qp_srq",
    "mlx5_eqe_port_state",
    "mlx5_cqe64",
    "mlx5_err_cqe",
    "mlx5_wqe_ctrl_seg",
    "mlx5_wqe_data_seg",
    "mlx5_wqe_raddr_seg",
    "mlx5_wqe_atomic_seg",
    "mlx5_wqe_inline_seg",
    "mlx5_av",
    "mlx5_wqe_datagram_seg",
    "mlx5_rwqe_sig",
    "mlx5_mtt",
    "mlx5_klm",
    "mlx5_wqe_srq_next_seg",
    "mlx5_wqe_eth_seg",
    "mlx5_wqe_umr_ctrl_seg",
    "mlx5_wqe_xrc_seg",
];

/// Constant families turned into enums that keep unknown values as `Unknown(n)`.
/// (enum name, constant prefix, suffix stripped from names, source file, repr)
const ENUMS: &[(&str, &str, &str, &str, &str)] = &[
    ("Opcode", "MLX5_CMD_OP_", "", "include/linux/mlx5/mlx5_ifc.h", "u16"),
    ("CmdStatus", "MLX5_CMD_STAT_", "_ERR", "include/linux/mlx5/device.h", "u8"),
    ("DeliveryStatus", "MLX5_CMD_DELIVERY_STAT_", "_ERR", "drivers/net/ethernet/mellanox/mlx5/core/cmd.c", "u8"),
    ("EventType", "MLX5_EVENT_TYPE_", "", "include/linux/mlx5/device.h", "u8"),
    ("HealthSyndrome", "MLX5_INITIAL_SEG_HEALTH_SYNDROME_", "", "include/linux/mlx5/mlx5_ifc.h", "u8"),
];

/// Names inside an enum family that are range markers or aliases, not values of their own.
const ENUM_SKIP: &[&str] = &[
    "MLX5_CMD_OP_GENERAL_START",
    "MLX5_CMD_OP_GENERAL_END",
    "MLX5_CMD_OP_MAX",
    "MLX5_EVENT_TYPE_NOTIFY_ANY",
    "MLX5_EVENT_TYPE_MAX",
];

fn to_pretty(v: &Value) -> String {
    let mut s = serde_json::to_string_pretty(v).expect("json values always serialise");
    s.push('\n');
    s
}

/// The vendored files as (relative path, contents), computed from the shared folder.
pub fn vendor(shared_prm: &Path) -> Result<Vec<(&'static str, String)>, String> {
    let layouts = read_json(&shared_prm.join("layouts.json"))?;
    let mut ifc = Map::new();
    let obj = layouts.as_object().ok_or("layouts.json is not an object")?;
    ifc.insert(
        "_meta".into(),
        json!({
            "source": obj.get("_meta").and_then(|m| m.get("source")).cloned().unwrap_or(Value::Null),
            "sha256": obj.get("_meta").and_then(|m| m.get("sha256")).cloned().unwrap_or(Value::Null),
            "vendored_from": "shared/prm/layouts.json (fields only; `flat` is derivable and dropped)",
            "convention": obj.get("_meta").and_then(|m| m.get("convention")).cloned().unwrap_or(Value::Null),
        }),
    );
    for (name, ty) in obj {
        if name == "_meta" {
            continue;
        }
        ifc.insert(
            name.clone(),
            json!({
                "size_bits": ty["size_bits"],
                "c_type": ty["c_type"],
                "fields": ty["fields"],
            }),
        );
    }

    let md =
        std::fs::read_to_string(shared_prm.join("c-layouts.md")).map_err(|e| format!("reading c-layouts.md: {e}"))?;
    let c = parse_c_layouts(&md)?;

    let consts = read_json(&shared_prm.join("constants.json"))?;
    let vectors = read_json(&shared_prm.join("vectors.json"))?;

    Ok(vec![
        (VENDORED_IFC, to_pretty(&Value::Object(ifc))),
        (VENDORED_C, to_pretty(&c)),
        (VENDORED_CONSTS, to_pretty(&consts)),
        (VENDORED_VECTORS, to_pretty(&vectors)),
    ])
}

/// Parses the "Layout of struct `X`" tables of `c-layouts.md` for the structures in [`C_STRUCTS`].
/// A second table with the same name (rdma-core's spelling of a kernel struct) gets the suffix `_dv`.
fn parse_c_layouts(md: &str) -> Result<Value, String> {
    let mut out = Map::new();
    let mut lines = md.lines().peekable();
    while let Some(line) = lines.next() {
        let Some(rest) = line.strip_prefix("Layout of ") else { continue };
        let Some(start) = rest.find('`') else { continue };
        let Some(end) = rest[start + 1..].find('`') else { continue };
        let mut name = rest[start + 1..start + 1 + end].to_string();
        let kind = if rest.starts_with("union") { "union" } else { "struct" };
        if out.contains_key(&name) {
            name.push_str("_dv");
        }
        let mut members = Vec::new();
        let mut size = 0u64;
        // Skip the blank line, header and separator, then read rows until the table ends.
        while let Some(&l) = lines.peek() {
            if l.trim().is_empty() || l.starts_with("| offset") || l.starts_with("|---") {
                lines.next();
                if !members.is_empty() && l.trim().is_empty() {
                    break;
                }
                continue;
            }
            if !l.starts_with('|') {
                break;
            }
            let row: Vec<&str> = l.trim_matches('|').split('|').map(str::trim).collect();
            lines.next();
            if row.len() < 4 || row[0].is_empty() {
                continue; // `union {` markers
            }
            let off = u64::from_str_radix(row[0].trim_start_matches("0x"), 16)
                .map_err(|e| format!("{name}: bad offset {:?}: {e}", row[0]))?;
            let len: u64 = row[1].parse().map_err(|e| format!("{name}: bad size {:?}: {e}", row[1]))?;
            let member = row[2].trim_matches('`');
            let (mname, count) = match member.find('[') {
                Some(i) => (&member[..i], member[i + 1..member.len() - 1].parse::<u64>().unwrap_or(0)),
                None => (member, 0),
            };
            size = size.max(off + len);
            members.push(json!({"name": mname, "offset": off, "size": len, "count": count, "type": row[3]}));
        }
        out.insert(name, json!({"kind": kind, "size": size, "members": members}));
    }
    let mut keep = Map::new();
    keep.insert(
        "_meta".into(),
        json!({"vendored_from": "shared/prm/c-layouts.md (gcc/pahole byte layouts of kernel and rdma-core C structs)"}),
    );
    for want in C_STRUCTS {
        let v = out.get(*want).ok_or_else(|| format!("c-layouts.md has no table for {want}"))?;
        keep.insert((*want).to_string(), v.clone());
        let dv = format!("{want}_dv");
        if let Some(v) = out.get(&dv) {
            keep.insert(dv, v.clone());
        }
    }
    Ok(Value::Object(keep))
}

fn rust_ident_upper(name: &str) -> String {
    // `a.b`: member `b` of an in-place struct `a` (see linux_ifc.rs).
    let mut s = name.to_ascii_uppercase().replace('.', "_");
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    s
}

fn rust_mod(name: &str) -> String {
    let mut s = name.to_string();
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        s.insert(0, '_');
    }
    match s.as_str() {
        "type" | "match" | "ref" | "mod" => format!("r#{s}"),
        _ => s,
    }
}

fn camel(name: &str) -> String {
    let mut out = String::new();
    let mut up = true;
    for ch in name.chars() {
        if ch == '_' {
            up = true;
        } else if up {
            out.push(ch.to_ascii_uppercase());
            up = false;
        } else {
            out.push(ch.to_ascii_lowercase());
        }
    }
    if out.starts_with(|c: char| c.is_ascii_digit()) {
        out.insert(0, 'X');
    }
    out
}

/// Generates `core/src/prm/generated.rs` from the vendored files under `root`.
pub fn generate(root: &Path) -> Result<String, String> {
    let mut ifc = read_json(&root.join(VENDORED_IFC))?;
    merge_linux_extra(root, &mut ifc)?;
    let mut c = read_json(&root.join(VENDORED_C))?;
    merge_json(root, VENDORED_EXTRA_C, VENDORED_C, &mut c)?;
    let consts = read_json(&root.join(VENDORED_CONSTS))?;
    let mut o = String::new();
    o.push_str(
        "// @generated by `cargo xtask codegen` from core/prm/*.json. Do not edit: change the generator or\n\
         // re-vendor the facts (`cargo xtask vendor`) and regenerate. `cargo xtask codegen --check` fails when stale.\n\n",
    );
    o.push_str("#![allow(clippy::all, dead_code, unused_imports, non_upper_case_globals)]\n\n");
    o.push_str("use super::{Array, Bytes, Field, Layout, Sub};\n\n");
    gen_ifc(&ifc, &mut o)?;
    gen_c(&c, &mut o)?;
    gen_enums(&consts, &mut o)?;
    gen_consts(&consts, &mut o)?;
    gen_names(&ifc, &mut o)?;
    Ok(o)
}

/// Adds the layouts of `core/prm/linux-extra-layouts.json` (`cargo xtask vendor --linux-extra`) to the vendored
/// ones; a name in both is refused, so the two sources can never disagree silently.
fn merge_linux_extra(root: &Path, ifc: &mut Value) -> Result<(), String> {
    merge_json(root, VENDORED_EXTRA, VENDORED_IFC, ifc)
}

/// Adds the entries of `extra` (when the file exists) to `base` (read from `base_name`); a name in both is
/// refused.
fn merge_json(root: &Path, extra: &str, base_name: &str, base: &mut Value) -> Result<(), String> {
    let path = root.join(extra);
    if !path.exists() {
        return Ok(());
    }
    let more = read_json(&path)?;
    let base = base.as_object_mut().ok_or_else(|| format!("{base_name} is not an object"))?;
    for (name, ty) in more.as_object().ok_or_else(|| format!("{extra} is not an object"))? {
        if name == "_meta" {
            continue;
        }
        if base.insert(name.clone(), ty.clone()).is_some() {
            return Err(format!("{name} is in both {base_name} and {extra}"));
        }
    }
    Ok(())
}

fn gen_ifc(ifc: &Value, o: &mut String) -> Result<(), String> {
    o.push_str(
        "/// `mlx5_ifc_*_bits` layouts (PRM big-endian bit numbering, as `MLX5_SET`/`MLX5_GET`). One module per type.\n",
    );
    o.push_str("pub mod ifc {\n    use super::*;\n\n");
    let obj = ifc.as_object().ok_or("ifc layouts not an object")?;
    for (name, ty) in obj {
        if name == "_meta" {
            continue;
        }
        let size_bits = ty["size_bits"].as_u64().ok_or_else(|| format!("{name}: no size_bits"))?;
        let c_type = ty["c_type"].as_str().unwrap_or("");
        writeln!(o, "    /// `{c_type}`: {} bytes.", size_bits / 8).unwrap();
        writeln!(o, "    pub mod {} {{", rust_mod(name)).unwrap();
        writeln!(o, "        use super::*;").unwrap();
        writeln!(o, "        /// Size in bytes (`MLX5_ST_SZ_BYTES({name})`).").unwrap();
        writeln!(o, "        pub const SIZE_BYTES: usize = {};", size_bits / 8).unwrap();
        writeln!(o, "        /// `{c_type}` as a type: [`Layout::SIZE_BYTES`] is its size.").unwrap();
        writeln!(o, "        #[derive(Debug, Clone, Copy)]\n        pub struct Bits;").unwrap();
        writeln!(o, "        impl Layout for Bits {{\n            const SIZE_BYTES: usize = SIZE_BYTES;\n        }}")
            .unwrap();
        let mut seen = BTreeSet::new();
        for f in ty["fields"].as_array().ok_or_else(|| format!("{name}: no fields"))? {
            let fname = f["name"].as_str().unwrap_or("");
            if fname.starts_with("reserved") || fname.is_empty() {
                continue;
            }
            let mut ident = rust_ident_upper(fname);
            if !seen.insert(ident.clone()) {
                // A name promoted twice from anonymous unions: keep the first, name the rest by offset.
                ident = format!("{ident}_AT_{:X}", f["offset_bits"].as_u64().unwrap_or(0));
                seen.insert(ident.clone());
            }
            let off = f["offset_bits"].as_u64().unwrap();
            let width = f["width_bits"].as_u64().unwrap();
            match f["kind"].as_str().unwrap_or("") {
                "scalar" => {
                    writeln!(o, "        /// `{fname}`: {} at bit {off}.", plural(width, "bit")).unwrap();
                    if width <= 32 {
                        if off / 32 != (off + width - 1) / 32 {
                            return Err(format!("{name}.{fname} crosses a dword"));
                        }
                        writeln!(o, "        pub const {ident}: Field = Field::new({off}, {width});").unwrap();
                    } else if width == 64 && off % 64 == 0 {
                        writeln!(o, "        pub const {ident}: Field = Field::new({off}, 64);").unwrap();
                    } else if off % 8 == 0 && width % 8 == 0 {
                        writeln!(o, "        pub const {ident}: Bytes = Bytes::new({}, {});", off / 8, width / 8)
                            .unwrap();
                    } else {
                        return Err(format!("{name}.{fname}: unsupported width {width} at {off}"));
                    }
                }
                "struct" => {
                    let elem = f["elem_struct"].as_str().unwrap_or("?");
                    if off % 8 != 0 || width % 8 != 0 {
                        return Err(format!("{name}.{fname}: nested struct not byte aligned"));
                    }
                    writeln!(o, "        /// `{fname}`: nested `{elem}`, {} bytes at byte {}.", width / 8, off / 8)
                        .unwrap();
                    writeln!(o, "        pub const {ident}: Sub = Sub::new({}, {});", off / 8, width / 8).unwrap();
                }
                "array" => {
                    let elem_bits = f["elem_width_bits"].as_u64().unwrap_or(0);
                    let count = f["count"].as_u64().unwrap_or(0);
                    if count == 0 {
                        writeln!(o, "        /// `{fname}`: flexible array of {elem_bits}-bit elements at bit {off}.")
                            .unwrap();
                    } else {
                        writeln!(
                            o,
                            "        /// `{fname}`: {} of {elem_bits} bits at bit {off}.",
                            plural(count, "element")
                        )
                        .unwrap();
                    }
                    if let Some(elem) = f["elem_struct"].as_str() {
                        writeln!(o, "        /// Array of `{elem}`.").unwrap();
                    }
                    if f["flexible"].as_bool() == Some(true) {
                        writeln!(o, "        /// Flexible array: element `i` at `offset + i * elem_bits`.").unwrap();
                    }
                    writeln!(o, "        pub const {ident}: Array = Array::new({off}, {count}, {elem_bits});").unwrap();
                }
                k => return Err(format!("{name}.{fname}: unknown kind {k}")),
            }
        }
        o.push_str("    }\n");
    }
    o.push_str("}\n\n");
    Ok(())
}

fn gen_c(c: &Value, o: &mut String) -> Result<(), String> {
    o.push_str("/// C-level structures (byte offsets as gcc lays them out; all multi-byte members big endian).\n");
    o.push_str("pub mod c {\n    use super::*;\n\n");
    for (name, st) in c.as_object().ok_or("c layouts not an object")? {
        if name == "_meta" {
            continue;
        }
        writeln!(o, "    /// `{} {}`.", st["kind"].as_str().unwrap_or("struct"), name.trim_end_matches("_dv")).unwrap();
        writeln!(o, "    pub mod {} {{", rust_mod(name)).unwrap();
        writeln!(o, "        use super::*;").unwrap();
        writeln!(o, "        /// `sizeof` the structure, in bytes.").unwrap();
        writeln!(o, "        pub const SIZE: usize = {};", st["size"]).unwrap();
        let mut seen = BTreeSet::new();
        for m in st["members"].as_array().unwrap() {
            let mname = m["name"].as_str().unwrap();
            if mname.starts_with("rsvd") || mname.starts_with("reserved") {
                continue;
            }
            let ident = rust_ident_upper(mname);
            if !seen.insert(ident.clone()) {
                continue;
            }
            writeln!(
                o,
                "        /// `{mname}` (`{}`): {} at byte {}.",
                m["type"].as_str().unwrap_or(""),
                plural(m["size"].as_u64().unwrap_or(0), "byte"),
                m["offset"]
            )
            .unwrap();
            writeln!(o, "        pub const {ident}: Bytes = Bytes::new({}, {});", m["offset"], m["size"]).unwrap();
        }
        o.push_str("    }\n");
    }
    o.push_str("}\n\n");
    Ok(())
}

/// Constant families typed by the field they are written into, so no user needs `X as u8` / `X as u16`. The rule:
/// a family takes the type of the field its values go into: `u8` for a byte of a C structure the driver reads and
/// writes as raw bytes (`mlx5_cqe64`, `mlx5_err_cqe`, `mlx5_wqe_ctrl_seg`, `mlx5_eqe`, `mlx5_cmd_layout`, the
/// health buffer) and for the narrow `ifc` fields the driver models as a byte (command status, CQ / QP state, MTU);
/// `u16` for 16-bit fields (`op_mod`, `opcode`, `register_id`). Every other constant is `u32`, the type
/// `MsgBuf::set` / `get` take (`i64` when negative, `u64` when wider); a typed value written through `MsgBuf::set`
/// is widened with `u32::from` at the call. Each entry: name patterns (a prefix when it ends in `_`, else an exact
/// name), the Rust type, and the field the values go into; the longest matching pattern wins, so an entry typed
/// `u32` carves a constant that is not a field value (a count, a bound) out of a wider family. A value that does
/// not fit its family's type fails generation.
const TYPED_CONSTS: &[(&[&str], &str, &str)] = &[
    (
        &[
            "MLX5_CQE_REQ",
            "MLX5_CQE_RESP_WR_IMM",
            "MLX5_CQE_RESP_SEND",
            "MLX5_CQE_RESP_SEND_IMM",
            "MLX5_CQE_RESP_SEND_INV",
            "MLX5_CQE_RESIZE_CQ",
            "MLX5_CQE_SIG_ERR",
            "MLX5_CQE_REQ_ERR",
            "MLX5_CQE_RESP_ERR",
            "MLX5_CQE_INVALID",
        ],
        "u8",
        "`mlx5_cqe64.op_own`, bits 7:4 (1 byte)",
    ),
    (&["MLX5_COMPRESSED"], "u8", "`mlx5_cqe64.op_own`, bits 3:2 (1 byte)"),
    (&["MLX5_CQE_OWNER_MASK"], "u8", "`mlx5_cqe64.op_own`, bit 0 (1 byte)"),
    (&["MLX5_CQE_SYNDROME_"], "u8", "`mlx5_err_cqe.syndrome` (1 byte)"),
    (&["MLX5_CQE_VENDOR_SYNDROME_"], "u8", "`mlx5_err_cqe.vendor_err_synd` (1 byte)"),
    (
        &["MLX5_OPCODE_"],
        "u8",
        "`mlx5_wqe_ctrl_seg.opmod_idx_opcode`, bits 7:0, and `mlx5_cqe64.sop_drop_qpn` bits 31:24",
    ),
    (
        &[
            "MLX5_WQE_CTRL_CQ_UPDATE",
            "MLX5_WQE_CTRL_CQ_UPDATE_AND_EQE",
            "MLX5_WQE_CTRL_SOLICITED",
            "MLX5_WQE_CTRL_INITIATOR_SMALL_FENCE",
            "MLX5_WQE_CTRL_FENCE",
        ],
        "u8",
        "`mlx5_wqe_ctrl_seg.fm_ce_se` (1 byte)",
    ),
    (&["MLX5_PCI_CMD_XPORT"], "u8", "`mlx5_cmd_layout.type` (1 byte)"),
    (&["CMD_OWNER_"], "u8", "`mlx5_cmd_layout.status_own`, bit 0 (1 byte)"),
    (&["MLX5_CMD_STAT_"], "u8", "`mbox_out.status` (8 bits) and `mlx5_cmd_layout.status_own` bits 7:1"),
    (&["MLX5_CMD_OP_"], "u16", "`mbox_in.opcode` (16 bits)"),
    (&["MLX5_CMD_OP_MAX", "MLX5_CMD_OP_GENERAL_END"], "u32", "bounds of the opcode space, not opcodes"),
    (&["MLX5_EVENT_TYPE_"], "u8", "`mlx5_eqe.type` (1 byte)"),
    (&["MLX5_EVENT_TYPE_MAX"], "u32", "the number of event types (256), not an event type"),
    (&["MLX5_EQE_OWNER_INIT_VAL"], "u8", "`mlx5_eqe.owner` (1 byte)"),
    (&["MLX5_PORT_CHANGE_SUBTYPE_"], "u8", "`mlx5_eqe.sub_type` (1 byte)"),
    (&["MLX5_EVENT_QUEUE_TYPE_"], "u8", "`mlx5_eqe_qp_srq.type` (1 byte)"),
    (&["MLX5_CQ_ERROR_SYNDROME_"], "u8", "`mlx5_eqe_cq_err.syndrome` (1 byte)"),
    (&["MLX5_INITIAL_SEG_HEALTH_SYNDROME_"], "u8", "`health_buffer.synd` (1 byte)"),
    (&["MLX5_SEVERITY_"], "u8", "`health_buffer.rfr_severity` (1 byte)"),
    (&["MLX5_CQC_STATUS_"], "u8", "`cqc.status` (4 bits)"),
    (&["MLX5_QP_STATE_"], "u8", "`qpc.state` (4 bits)"),
    (&["IB_MTU_"], "u8", "`qpc.mtu` (3 bits) and `pmtu_reg.*_mtu`"),
    (&["MLX5_MAX_LOG_PKEY_TABLE"], "u8", "`cmd_hca_cap.pkey_table_size` (4 bits)"),
    (&["MLX5_SET_HOST_ENDIANNESS"], "u8", "`host_endianness_reg.he` (8 bits)"),
    (&["MLX5_CAP_"], "u16", "`query_hca_cap_in.op_mod` bits 15:1 / `set_hca_cap_in.op_mod` (16 bits)"),
    (&["MLX5_CAP_PORT_TYPE_"], "u32", "`cmd_hca_cap.port_type`, written with `MsgBuf::set`"),
    (&["MLX5_CAP_UMR_FENCE_"], "u32", "`cmd_hca_cap.umr_fence`, written with `MsgBuf::set`"),
    (&["MLX5_CAP_NUM"], "u32", "the number of capability types, not an `op_mod`"),
    (&["MLX5_PAGES_"], "u16", "`manage_pages_in.op_mod` (16 bits)"),
    (&["MLX5_QUERY_PAGES_IN_OP_MOD_"], "u16", "`query_pages_in.op_mod` (16 bits)"),
    (&["MLX5_CQ_OPMOD_"], "u16", "`modify_cq_in.op_mod` (16 bits)"),
    (&["MLX5_VPORT_STATE_OP_MOD_"], "u16", "`query_vport_state_in.op_mod` (16 bits)"),
    (&["MLX5_REG_"], "u16", "`access_register_in.register_id` (16 bits)"),
];

/// The type [`TYPED_CONSTS`] gives `name` and the field it goes into (the longest matching pattern), if any.
fn typed_const(name: &str) -> Option<(&'static str, &'static str)> {
    TYPED_CONSTS
        .iter()
        .flat_map(|&(pats, ty, field)| pats.iter().map(move |&p| (p, ty, field)))
        .filter(|(p, _, _)| if p.ends_with('_') { name.starts_with(p) } else { name == *p })
        .max_by_key(|(p, _, _)| p.len())
        .map(|(_, ty, field)| (ty, field))
}

/// `1 bit`, `2 bits`.
fn plural(n: u64, unit: &str) -> String {
    if n == 1 {
        format!("1 {unit}")
    } else {
        format!("{n} {unit}s")
    }
}

fn const_value(v: &Value) -> Option<i128> {
    match v {
        Value::Number(n) => n.as_i64().map(i128::from).or_else(|| n.as_u64().map(i128::from)),
        Value::Object(m) => m.get("value").and_then(const_value),
        _ => None,
    }
}

fn gen_enums(consts: &Value, o: &mut String) -> Result<(), String> {
    for (ename, prefix, strip, file, repr) in ENUMS {
        let table = consts[*file].as_object().ok_or_else(|| format!("no constants for {file}"))?;
        // Values ordered as in the source; the first name for a value wins (later ones are aliases).
        let mut by_value: BTreeMap<i128, String> = BTreeMap::new();
        let mut order: Vec<(String, i128, String)> = Vec::new();
        for (k, v) in table {
            if !k.starts_with(prefix) || ENUM_SKIP.contains(&k.as_str()) {
                continue;
            }
            let val = const_value(v).ok_or_else(|| format!("{k}: not a number"))?;
            if by_value.contains_key(&val) {
                continue;
            }
            let short = k[prefix.len()..].to_string();
            let short = if !strip.is_empty() { short.strip_suffix(strip).unwrap_or(&short).to_string() } else { short };
            by_value.insert(val, short.clone());
            order.push((short, val, k.clone()));
        }
        writeln!(o, "/// `{prefix}*` ({file}); values the table does not name decode to `Unknown(n)`.").unwrap();
        o.push_str("#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]\n");
        o.push_str("#[cfg_attr(feature = \"defmt\", derive(defmt::Format))]\n");
        writeln!(o, "pub enum {ename} {{").unwrap();
        for (short, val, key) in &order {
            writeln!(o, "    /// `{key}` = {val:#x}").unwrap();
            writeln!(o, "    {},", camel(short)).unwrap();
        }
        writeln!(o, "    /// A value the headers do not name.\n    Unknown({repr}),").unwrap();
        o.push_str("}\n\n");
        writeln!(o, "impl {ename} {{").unwrap();
        writeln!(o, "    /// The value as read from the device; values the headers do not name become `Unknown`.")
            .unwrap();
        writeln!(o, "    pub const fn from_raw(v: {repr}) -> Self {{\n        match v {{").unwrap();
        for (short, val, _) in &order {
            writeln!(o, "            {val:#x} => Self::{},", camel(short)).unwrap();
        }
        o.push_str("            n => Self::Unknown(n),\n        }\n    }\n\n");
        writeln!(o, "    /// The value as the device encodes it.").unwrap();
        writeln!(o, "    pub const fn raw(self) -> {repr} {{\n        match self {{").unwrap();
        for (short, val, _) in &order {
            writeln!(o, "            Self::{} => {val:#x},", camel(short)).unwrap();
        }
        o.push_str("            Self::Unknown(n) => n,\n        }\n    }\n\n");
        o.push_str(
            "    /// The kernel's name without its prefix, e.g. `CREATE_CQ`, `BAD_PARAM`; `None` when unknown.\n",
        );
        o.push_str("    pub const fn name(self) -> Option<&'static str> {\n        match self {\n");
        for (short, _, _) in &order {
            writeln!(o, "            Self::{} => Some(\"{short}\"),", camel(short)).unwrap();
        }
        o.push_str("            Self::Unknown(_) => None,\n        }\n    }\n}\n\n");
    }
    Ok(())
}

fn gen_consts(consts: &Value, o: &mut String) -> Result<(), String> {
    o.push_str(
        "/// Every extracted `enum` / `#define` value, by name. Where two headers define one name, the first wins.\n",
    );
    o.push_str("pub mod consts {\n");
    let mut seen = BTreeSet::new();
    for (file, table) in consts.as_object().ok_or("constants not an object")? {
        if file == "_meta" {
            continue;
        }
        for (k, v) in table.as_object().ok_or_else(|| format!("{file}: not an object"))? {
            let Some(val) = const_value(v) else { continue };
            if !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') || !seen.insert(k.clone()) {
                continue;
            }
            if let Some((ty, field)) = typed_const(k) {
                let max: i128 = match ty {
                    "u8" => u8::MAX.into(),
                    "u16" => u16::MAX.into(),
                    "u32" => u32::MAX.into(),
                    _ => return Err(format!("{k}: no range for type {ty}")),
                };
                if !(0..=max).contains(&val) {
                    return Err(format!("{k} = {val} does not fit {ty} ({field})"));
                }
                // A `u32` entry carves a non-field constant out of a family; its text says what the value is.
                let what = if ty == "u32" { field.to_string() } else { format!("goes into {field}") };
                writeln!(o, "    /// {file}; `{ty}`: {what}\n    pub const {}: {ty} = {val};", rust_ident_upper(k))
                    .unwrap();
                continue;
            }
            let ty = if val < 0 {
                "i64"
            } else if val <= u32::MAX as i128 {
                "u32"
            } else {
                "u64"
            };
            writeln!(o, "    /// {file}\n    pub const {}: {ty} = {val};", rust_ident_upper(k)).unwrap();
        }
    }
    o.push_str("}\n");
    Ok(())
}

/// The `ifc` layouts as data: every member's name, place and kind, so tools can print a message field by field
/// (`mlx5 trace decode`). The driver itself never looks names up; a firmware image that does not use the table
/// does not link it.
fn gen_names(ifc: &Value, o: &mut String) -> Result<(), String> {
    o.push_str(
        "\n/// Every `mlx5_ifc_*_bits` layout as data (member names, bit offsets, widths, nesting), sorted by name, for\n\
         /// tools that print a message by field name. The same facts as [`ifc`]; reserved members are left out.\n",
    );
    o.push_str("pub mod names {\n");
    o.push_str(
        "    /// What a member is.\n\
         #[derive(Clone, Copy, Debug, PartialEq, Eq)]\n\
         pub enum Kind {\n\
             /// A value of `width` bits: a scalar up to 32 bits, a 64-bit word, or a wider big-endian byte string.\n\
             Scalar,\n\
             /// A nested struct or union, described by the layout of that name.\n\
             Struct(&'static str),\n\
             /// `count` elements of `elem_bits` each (`count == 0`: a flexible array that runs to the end of the\n\
             /// message), scalars or, with a name, nested layouts.\n\
             Array {\n\
                 /// Elements (0: flexible).\n\
                 count: u32,\n\
                 /// Bits per element.\n\
                 elem_bits: u32,\n\
                 /// The element layout, for arrays of structs.\n\
                 elem: Option<&'static str>,\n\
             },\n\
         }\n\n\
         /// One member: `width` bits at bit `off` of its layout (PRM numbering, bit 0 = MSB of dword 0).\n\
         #[derive(Clone, Copy, Debug, PartialEq, Eq)]\n\
         pub struct Member {\n\
             /// The PRM field name.\n\
             pub name: &'static str,\n\
             /// Bit offset from the start of the layout.\n\
             pub off: u32,\n\
             /// Width in bits.\n\
             pub width: u32,\n\
             /// Scalar, nested layout or array.\n\
             pub kind: Kind,\n\
         }\n\n\
         /// A layout: `mlx5_ifc_<name>_bits`.\n\
         #[derive(Clone, Copy, Debug, PartialEq, Eq)]\n\
         pub struct Layout {\n\
             /// The name without `mlx5_ifc_` and `_bits`.\n\
             pub name: &'static str,\n\
             /// Size in bytes.\n\
             pub size_bytes: usize,\n\
             /// A C `union`: every member starts at bit 0 and only one is meant at a time.\n\
             pub union: bool,\n\
             /// Members in order, reserved ones left out.\n\
             pub members: &'static [Member],\n\
         }\n\n\
         const fn s(name: &'static str, off: u32, width: u32) -> Member {\n\
             Member { name, off, width, kind: Kind::Scalar }\n\
         }\n\n\
         const fn n(name: &'static str, off: u32, width: u32, ty: &'static str) -> Member {\n\
             Member { name, off, width, kind: Kind::Struct(ty) }\n\
         }\n\n\
         const fn a(name: &'static str, off: u32, width: u32, count: u32, elem_bits: u32, elem: Option<&'static str>) -> Member {\n\
             Member { name, off, width, kind: Kind::Array { count, elem_bits, elem } }\n\
         }\n\n\
         /// The layout named `name` (`\"query_hca_cap_out\"`, `\"cqc\"`).\n\
         pub fn layout(name: &str) -> Option<&'static Layout> {\n\
             LAYOUTS.binary_search_by(|l| l.name.cmp(name)).ok().map(|i| &LAYOUTS[i])\n\
         }\n\n",
    );
    let obj = ifc.as_object().ok_or("ifc layouts not an object")?;
    let mut names: Vec<&String> = obj.keys().filter(|k| *k != "_meta").collect();
    names.sort();
    o.push_str("    /// Every layout, sorted by name.\n    pub static LAYOUTS: &[Layout] = &[\n");
    for name in names {
        let ty = &obj[name.as_str()];
        let size_bits = ty["size_bits"].as_u64().ok_or_else(|| format!("{name}: no size_bits"))?;
        let union = ty["c_type"].as_str().unwrap_or("").starts_with("union ");
        writeln!(o, "        Layout {{ name: \"{name}\", size_bytes: {}, union: {union}, members: &[", size_bits / 8)
            .unwrap();
        for f in ty["fields"].as_array().ok_or_else(|| format!("{name}: no fields"))? {
            let fname = f["name"].as_str().unwrap_or("");
            if fname.starts_with("reserved") || fname.is_empty() {
                continue;
            }
            let off = f["offset_bits"].as_u64().ok_or_else(|| format!("{name}.{fname}: no offset"))?;
            let width = f["width_bits"].as_u64().ok_or_else(|| format!("{name}.{fname}: no width"))?;
            match f["kind"].as_str().unwrap_or("") {
                "scalar" => writeln!(o, "            s(\"{fname}\", {off}, {width}),").unwrap(),
                "struct" => {
                    let elem = f["elem_struct"].as_str().ok_or_else(|| format!("{name}.{fname}: no elem_struct"))?;
                    writeln!(o, "            n(\"{fname}\", {off}, {width}, \"{elem}\"),").unwrap();
                }
                "array" => {
                    let count = f["count"].as_u64().unwrap_or(0);
                    let elem_bits = f["elem_width_bits"].as_u64().unwrap_or(0);
                    let elem = match f["elem_struct"].as_str() {
                        Some(e) => format!("Some(\"{e}\")"),
                        None => "None".to_string(),
                    };
                    writeln!(o, "            a(\"{fname}\", {off}, {width}, {count}, {elem_bits}, {elem}),").unwrap();
                }
                k => return Err(format!("{name}.{fname}: unknown kind {k}")),
            }
        }
        o.push_str("        ]},\n");
    }
    o.push_str("    ];\n}\n");
    Ok(())
}

/// Formats Rust source with rustfmt (read from stdin), so the checked-in file is stable and readable.
pub fn rustfmt(src: &str, root: &Path) -> Result<String, String> {
    use std::io::Write;
    use std::process::{Command, Stdio};
    let mut child = Command::new("rustfmt")
        .args(["--edition", "2021", "--emit", "stdout", "--config-path"])
        .arg(root.join("rustfmt.toml"))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("running rustfmt: {e}"))?;
    child
        .stdin
        .take()
        .expect("stdin was piped")
        .write_all(src.as_bytes())
        .map_err(|e| format!("writing to rustfmt: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("rustfmt: {e}"))?;
    if !out.status.success() {
        return Err(format!("rustfmt failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    String::from_utf8(out.stdout).map_err(|e| format!("rustfmt output: {e}"))
}

pub fn shared_prm(root: &Path) -> PathBuf {
    root.join("..").join("shared").join("prm")
}

/// `cargo xtask vendor`: refresh `core/prm` and the test vectors from `../shared/prm`.
pub fn run_vendor(root: &Path) -> Result<(), String> {
    for (rel, text) in vendor(&shared_prm(root))? {
        let path = root.join(rel);
        std::fs::create_dir_all(path.parent().unwrap()).map_err(|e| e.to_string())?;
        std::fs::write(&path, text).map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("vendored {rel}");
    }
    Ok(())
}

/// `cargo xtask codegen [--check]`.
pub fn run_codegen(root: &Path, check: bool) -> Result<(), String> {
    let src = rustfmt(&generate(root)?, root)?;
    let path = root.join(GENERATED);
    if check {
        let mut stale = Vec::new();
        let current = std::fs::read_to_string(&path).unwrap_or_default();
        if current != src {
            stale.push(GENERATED.to_string());
        }
        let shared = shared_prm(root);
        if shared.join("layouts.json").exists() {
            for (rel, text) in vendor(&shared)? {
                if std::fs::read_to_string(root.join(rel)).unwrap_or_default() != text {
                    stale.push(format!("{rel} (differs from ../shared/prm)"));
                }
            }
        } else {
            println!("note: ../shared/prm not present; checked generated code against the vendored facts only");
        }
        if !stale.is_empty() {
            return Err(format!(
                "stale PRM files: {}; run `cargo xtask vendor && cargo xtask codegen`",
                stale.join(", ")
            ));
        }
        println!("codegen: {GENERATED} and vendored PRM facts are current");
    } else {
        std::fs::write(&path, src).map_err(|e| format!("writing {}: {e}", path.display()))?;
        println!("wrote {GENERATED}");
    }
    Ok(())
}
