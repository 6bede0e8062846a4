//! Reading a command trace back (`mlx5 trace decode FILE`): every command of a JSON-lines trace (as `--trace`
//! writes it) with its opcode, op_mod, status and syndrome, then its input and output field by field, by the names
//! the PRM layouts give them (`core::prm::generated::names`), nested structs by their dotted path
//! (`capability.cmd_hca_cap.log_max_qp`, `cq_context.log_cq_size`). Or, with `--hexdump`, the Linux command dump.
//!
//! Everything read from the file is untrusted: a bad line is one error naming the file and line, an opcode the
//! headers do not name is an `unknown opcode 0x...` line, and a message shorter than its layout shows the fields
//! it has. Nothing here panics on input.

use std::fmt::Write as _;
use std::path::Path;

use mlx5_core::prm::generated::names::{self, Kind, Layout, Member};
use mlx5_core::prm::{consts, CmdStatus, DeliveryStatus, MsgBuf, Named, Opcode};
use mlx5_core::trace::{CmdOutcome, CmdRecord};
use serde_json::Value;

/// How to print a trace.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Options {
    /// Show fields that are zero too.
    pub all: bool,
    /// Print the Linux-style hexdump instead of fields.
    pub hexdump: bool,
}

/// How a traced command ended, as the trace line says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// Firmware executed it; `status` may be an error.
    Completed {
        status: u8,
        syndrome: u32,
    },
    /// Firmware refused the entry (a `DeliveryStatus` name).
    Delivery(String),
    BadSignature,
    Timeout,
}

/// One command read back from a trace line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub slot: u8,
    pub token: u8,
    pub opcode: u16,
    pub op_mod: u16,
    pub input: Vec<u8>,
    /// `None` when the command timed out (the trace has `"output": null`).
    pub output: Option<Vec<u8>>,
    pub outcome: Outcome,
    pub waited_us: u64,
    /// The device that ran it, in traces of runs with two devices (`"device": "mlx5_1"`).
    pub device: Option<String>,
}

/// The longest trace line read: a command's input and output mailboxes in hex are far below it (the largest
/// command, with 4,096-byte mailbox blocks of page addresses, is a few MiB), and it bounds the memory a line
/// without an end (`/dev/zero`) can take.
pub const MAX_LINE: usize = 64 << 20;

/// Why `trace decode` stopped.
#[derive(Debug, thiserror::Error)]
pub enum DecodeError {
    /// The trace cannot be opened or read.
    #[error("cannot read trace {file}: {}", io_why(.source))]
    Read {
        file: String,
        #[source]
        source: std::io::Error,
    },
    /// A line is not a trace line.
    #[error("{file}:{line}: {why}")]
    Line {
        file: String,
        line: usize,
        #[source]
        why: LineError,
    },
    /// Nothing but blank lines.
    #[error("{file}: no commands in the trace")]
    Empty { file: String },
    /// Standard output failed.
    #[error("failed to write output: {0}")]
    Output(#[source] std::io::Error),
    /// The decoded text of [`decode_file`] is not UTF-8.
    #[error("decoded text is not UTF-8")]
    NotUtf8(#[source] std::string::FromUtf8Error),
}

/// What is wrong with one trace line.
#[derive(Debug, thiserror::Error)]
pub enum LineError {
    #[error("not a trace line (expected JSON): {0}")]
    NotJson(#[source] serde_json::Error),
    #[error("not a trace line (expected a JSON object)")]
    NotObject,
    #[error("longer than {MAX_LINE} bytes: not a trace line")]
    TooLong,
    #[error("not UTF-8 text")]
    NotUtf8,
    #[error("no `input` (hex string) in the trace line")]
    NoInput,
    /// `input` or `output` holds something other than an even number of hex digits.
    #[error("`{0}` is not a hex string")]
    NotHex(&'static str),
    #[error("`output` is neither a hex string nor null")]
    BadOutput,
    #[error("no `opcode_raw` and the input is too short to hold an opcode")]
    NoOpcode,
    /// A string field holds another JSON value (shown).
    #[error("`{key}` is not a string: {value}")]
    NotString { key: &'static str, value: String },
    /// A number field holds another JSON value (shown), or one above its largest.
    #[error("`{key}` is not a number up to {max}: {value}")]
    NotNumber { key: &'static str, max: u64, value: String },
    #[error("`device` is not a string")]
    DeviceNotString,
}

/// Decodes the trace at `path` (`-`: standard input) onto `out`, line by line in bounded memory.
pub fn decode_path(path: &Path, opts: Options, out: &mut impl std::io::Write) -> Result<usize, DecodeError> {
    if path.as_os_str() == "-" {
        return decode_stream(std::io::stdin().lock(), "<stdin>", opts, out);
    }
    let file = path.display().to_string();
    let f = std::fs::File::open(path).map_err(|source| DecodeError::Read { file: file.clone(), source })?;
    decode_stream(std::io::BufReader::new(f), &file, opts, out)
}

/// An I/O error in words, without the OS's errno text where a plainer one exists.
fn io_why(e: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::NotFound => "no such file".into(),
        K::PermissionDenied => "permission denied".into(),
        K::IsADirectory => "it is a directory".into(),
        K::UnexpectedEof => "it ended early".into(),
        _ => e.to_string(),
    }
}

/// Decodes a trace read from `r` (named `file` in errors) onto `out`, one line at a time: memory stays bounded
/// by [`MAX_LINE`] whatever the input's size. Returns the number of commands.
pub fn decode_stream(
    mut r: impl std::io::BufRead,
    file: &str,
    opts: Options,
    out: &mut impl std::io::Write,
) -> Result<usize, DecodeError> {
    use std::io::{BufRead as _, Read as _};
    let mut line = Vec::new();
    let mut count = 0;
    for number in 1.. {
        line.clear();
        let read = (&mut r)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut line)
            .map_err(|source| DecodeError::Read { file: file.into(), source })?;
        if read == 0 {
            break;
        }
        let bad = |why: LineError| DecodeError::Line { file: file.into(), line: number, why };
        if line.len() > MAX_LINE {
            return Err(bad(LineError::TooLong));
        }
        let text = std::str::from_utf8(&line).map_err(|_| bad(LineError::NotUtf8))?;
        if text.trim().is_empty() {
            continue;
        }
        let e = Entry::parse(text).map_err(bad)?;
        let text = if opts.hexdump {
            e.hexdump()
        } else {
            let sep = if count > 0 { "\n" } else { "" };
            format!("{sep}{}", e.render(count, opts.all))
        };
        out.write_all(text.as_bytes()).map_err(DecodeError::Output)?;
        count += 1;
    }
    if count == 0 {
        return Err(DecodeError::Empty { file: file.into() });
    }
    out.flush().map_err(DecodeError::Output)?;
    Ok(count)
}

/// Reads and decodes the trace at `path` into a string; the error is one line naming the file (and line).
pub fn decode_file(path: &Path, opts: Options) -> Result<String, DecodeError> {
    let mut out = Vec::new();
    decode_path(path, opts, &mut out)?;
    String::from_utf8(out).map_err(DecodeError::NotUtf8)
}

/// Parses every non-blank line; the error is the 1-based line number and what is wrong with it.
pub fn parse_trace(text: &str) -> Result<Vec<Entry>, (usize, LineError)> {
    let mut v = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        v.push(Entry::parse(line).map_err(|e| (i + 1, e))?);
    }
    Ok(v)
}

/// Strict hex: an even number of hex digits, nothing else (no sign, blank or prefix).
fn hex_bytes(s: &str) -> Option<Vec<u8>> {
    let b = s.as_bytes();
    if !b.len().is_multiple_of(2) || !b.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    let nib = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    b.chunks(2).map(|p| Some(nib(p[0])? << 4 | nib(p[1])?)).collect()
}

/// A string field: absent is `None`; any other type is an error, not a default.
fn text<'v>(v: &'v Value, key: &'static str) -> Result<Option<&'v str>, LineError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(x) => Err(LineError::NotString { key, value: x.to_string() }),
    }
}

fn uint(v: &Value, key: &'static str, max: u64) -> Result<Option<u64>, LineError> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => match x.as_u64() {
            Some(n) if n <= max => Ok(Some(n)),
            _ => Err(LineError::NotNumber { key, max, value: x.to_string() }),
        },
    }
}

impl Entry {
    /// One trace line (a JSON object as `CmdRecord::write_json` writes it). `input` is required; the opcode comes
    /// from `opcode_raw`, else from the input's first 16 bits.
    pub fn parse(line: &str) -> Result<Self, LineError> {
        let v: Value = serde_json::from_str(line).map_err(LineError::NotJson)?;
        if !v.is_object() {
            return Err(LineError::NotObject);
        }
        let input = match v.get("input") {
            Some(Value::String(s)) => hex_bytes(s).ok_or(LineError::NotHex("input"))?,
            _ => return Err(LineError::NoInput),
        };
        let output = match v.get("output") {
            Some(Value::String(s)) => Some(hex_bytes(s).ok_or(LineError::NotHex("output"))?),
            None | Some(Value::Null) => None,
            Some(_) => return Err(LineError::BadOutput),
        };
        let opcode = match uint(&v, "opcode_raw", 0xffff)? {
            Some(n) => n as u16,
            None if input.len() >= 2 => u16::from_be_bytes([input[0], input[1]]),
            None => return Err(LineError::NoOpcode),
        };
        let op_mod = match uint(&v, "op_mod", 0xffff)? {
            Some(n) => n as u16,
            None if input.len() >= 8 => u16::from_be_bytes([input[6], input[7]]),
            None => 0,
        };
        let delivery = text(&v, "delivery")?.unwrap_or("OK");
        let outcome = match delivery {
            "OK" => {
                let status = match uint(&v, "status_raw", 0xff)? {
                    Some(n) => n as u8,
                    // Older lines without status_raw: the output's first byte is the status.
                    None => output.as_ref().and_then(|o| o.first().copied()).unwrap_or(0),
                };
                let syndrome = uint(&v, "syndrome", u32::MAX.into())?.unwrap_or(0) as u32;
                Outcome::Completed { status, syndrome }
            }
            "BAD_SIGNATURE" => Outcome::BadSignature,
            "TIMEOUT" => Outcome::Timeout,
            d => Outcome::Delivery(d.to_string()),
        };
        Ok(Entry {
            slot: uint(&v, "slot", 0xff)?.unwrap_or(0) as u8,
            token: uint(&v, "token", 0xff)?.unwrap_or(0) as u8,
            opcode,
            op_mod,
            input,
            output,
            outcome,
            waited_us: uint(&v, "waited_us", u64::MAX)?.unwrap_or(0),
            device: match v.get("device") {
                None | Some(Value::Null) => None,
                Some(Value::String(d)) => Some(d.clone()),
                Some(_) => return Err(LineError::DeviceNotString),
            },
        })
    }

    /// The header line and the fields of input and output.
    pub fn render(&self, index: usize, all: bool) -> String {
        let op = Opcode::from_raw(self.opcode);
        let mut s = format!("#{index} ");
        if let Some(d) = &self.device {
            write!(s, "{}: ", d.escape_debug()).ok();
        }
        match op.name() {
            Some(name) => write!(s, "{name}(0x{:x})", self.opcode),
            None => write!(s, "unknown opcode 0x{:x}", self.opcode),
        }
        .ok();
        write!(s, " op_mod 0x{:x}", self.op_mod).ok();
        match &self.outcome {
            Outcome::Completed { status, syndrome } => {
                let st = CmdStatus::from_raw(*status);
                write!(s, " status {} syndrome 0x{syndrome:x}", Named(st.name(), (*status).into())).ok();
            }
            Outcome::Delivery(d) => {
                write!(s, " delivery {d} (firmware did not execute it)").ok();
            }
            Outcome::BadSignature => s.push_str(" output signature mismatch"),
            Outcome::Timeout => {
                write!(s, " timeout after {} us (no output)", self.waited_us).ok();
            }
        }
        s.push('\n');
        let (lin, lout) = layouts_of(op);
        let ctx = Ctx { op: self.opcode, op_mod: self.op_mod, input: &self.input, all };
        section(&mut s, "input", lin, &self.input, &ctx);
        if let Some(o) = &self.output {
            if !matches!(self.outcome, Outcome::Timeout) {
                section(&mut s, "output", lout, o, &ctx);
            }
        }
        s
    }

    /// The command as Linux's `dump_command` prints it (rendered by the core, as a live `--hexdump` does).
    pub fn hexdump(&self) -> String {
        let outcome = match &self.outcome {
            Outcome::Completed { status, syndrome } => {
                CmdOutcome::Completed { status: CmdStatus::from_raw(*status), syndrome: *syndrome }
            }
            Outcome::Delivery(name) => CmdOutcome::Delivery(
                (0..=u8::MAX)
                    .map(DeliveryStatus::from_raw)
                    .find(|d| d.name() == Some(name.as_str()))
                    .unwrap_or(DeliveryStatus::Unknown(0xff)),
            ),
            Outcome::BadSignature => CmdOutcome::BadSignature,
            Outcome::Timeout => CmdOutcome::Timeout,
        };
        let input = Bytes(&self.input);
        let output = self.output.as_deref().map(Bytes);
        let rec = CmdRecord {
            slot: self.slot,
            token: self.token,
            opcode: Opcode::from_raw(self.opcode),
            op_mod: self.op_mod,
            input: &input,
            output: output.as_ref().map(|o| o as &dyn MsgBuf),
            outcome,
            waited_us: self.waited_us,
        };
        let mut s = String::new();
        // Formatting into a String cannot fail.
        let _ = rec.write_hexdump(&mut s);
        s
    }
}

/// A byte slice as a message, for the core's hexdump renderer.
struct Bytes<'a>(&'a [u8]);

impl MsgBuf for Bytes<'_> {
    fn len(&self) -> usize {
        self.0.len()
    }
    fn chunk(&self, off: usize) -> &[u8] {
        &self.0[off..]
    }
    fn chunk_mut(&mut self, _off: usize) -> &mut [u8] {
        unreachable!("a trace is only read")
    }
}

/// Names of commands whose layouts are not `<opcode in lower case>_in` / `_out`.
const LAYOUT_ALIASES: &[(&str, &str)] = &[
    ("2ERR_QP", "qp_2err"),
    ("2RST_QP", "qp_2rst"),
    ("ACCESS_REG", "access_register"),
    ("SET_FLOW_TABLE_ENTRY", "set_fte"),
    ("DELETE_FLOW_TABLE_ENTRY", "delete_fte"),
];

/// The input and output layouts of a command; `mbox_in`/`mbox_out` (the header every command has, from
/// `cmd.c`) when the opcode is unknown or its layouts are not among the vendored facts.
pub fn layouts_of(op: Opcode) -> (&'static Layout, &'static Layout) {
    let stem = op.name().map(|n| match LAYOUT_ALIASES.iter().find(|(k, _)| *k == n) {
        Some((_, v)) => (*v).to_string(),
        None => n.to_ascii_lowercase(),
    });
    let get = |suffix: &str, generic: &str| {
        stem.as_ref()
            .and_then(|s| names::layout(&format!("{s}_{suffix}")))
            .or_else(|| names::layout(generic))
            .expect("mbox_in and mbox_out are among the vendored layouts")
    };
    (get("in", "mbox_in"), get("out", "mbox_out"))
}

/// What union members and register layouts depend on.
struct Ctx<'a> {
    op: u16,
    op_mod: u16,
    /// The command's input (an output's register data is chosen by the input's `register_id`).
    input: &'a [u8],
    all: bool,
}

fn section(s: &mut String, what: &str, layout: &Layout, msg: &[u8], ctx: &Ctx<'_>) {
    let generic = layout.name.starts_with("mbox_");
    write!(s, "  {what} ({}, {} bytes", layout.name, msg.len()).ok();
    if generic {
        s.push_str("; no layout for this command, common header only");
    }
    s.push_str("):\n");
    let mut lines = Vec::new();
    fields(&mut lines, layout, msg, 0, "", ctx, 0);
    if lines.is_empty() {
        s.push_str("    (all fields zero)\n");
    }
    for (path, value) in lines {
        writeln!(s, "    {path} = {value}").ok();
    }
}

/// Nested layouts deeper than this are not followed (the vendored layouts nest at most a few levels).
const MAX_DEPTH: usize = 8;

fn fields(
    out: &mut Vec<(String, String)>,
    l: &Layout,
    msg: &[u8],
    base: u64,
    prefix: &str,
    ctx: &Ctx<'_>,
    depth: usize,
) {
    if depth > MAX_DEPTH {
        return;
    }
    if l.union {
        if let Some(m) = union_member(l, ctx) {
            member(out, l, m, msg, base, prefix, ctx, depth);
        }
        return;
    }
    for m in l.members {
        member(out, l, m, msg, base, prefix, ctx, depth);
    }
}

#[allow(clippy::too_many_arguments)]
fn member(
    out: &mut Vec<(String, String)>,
    parent: &Layout,
    m: &Member,
    msg: &[u8],
    base: u64,
    prefix: &str,
    ctx: &Ctx<'_>,
    depth: usize,
) {
    let at = base + u64::from(m.off);
    let path = if prefix.is_empty() { m.name.to_string() } else { format!("{prefix}.{}", m.name) };
    match m.kind {
        Kind::Scalar => scalar(out, path, msg, at, m.width, ctx.all),
        Kind::Struct(ty) => {
            if let Some(nested) = names::layout(ty) {
                fields(out, nested, msg, at, &path, ctx, depth + 1);
            }
        }
        Kind::Array { count, elem_bits, elem } => {
            if let Some(reg) = register_layout(parent, m, ctx) {
                fields(out, reg, msg, at, &format!("{path}.{}", reg.name), ctx, depth + 1);
                return;
            }
            let msg_bits = msg.len() as u64 * 8;
            if elem_bits == 0 || at >= msg_bits {
                return;
            }
            if elem_bits == 8 && count > 0 && elem.is_none() {
                // A byte array (a driver version, a name): one value, with its text when printable.
                return byte_string(out, path, msg, at, count * 8, ctx.all);
            }
            // A flexible array runs to the end of the message.
            let n = if count == 0 { (msg_bits - at) / u64::from(elem_bits) } else { u64::from(count) };
            for i in 0..n {
                let eat = at + i * u64::from(elem_bits);
                let epath = format!("{path}[{i}]");
                match elem.and_then(names::layout) {
                    Some(nested) => fields(out, nested, msg, eat, &epath, ctx, depth + 1),
                    None => scalar(out, epath, msg, eat, elem_bits, ctx.all),
                }
            }
        }
    }
}

/// A value of `width` bits at bit `at`, in hex. Members wider than 64 bits (GIDs, MAC addresses, strings) are byte
/// strings. Fields the message does not reach are left out.
fn scalar(out: &mut Vec<(String, String)>, path: String, msg: &[u8], at: u64, width: u32, all: bool) {
    if width > 64 {
        return byte_string(out, path, msg, at, width, all);
    }
    if let Some(v) = bits(msg, at, width) {
        if all || v != 0 {
            out.push((path, format!("0x{v:x}")));
        }
    }
}

/// `width / 8` bytes at bit `at` as hex bytes, or as text when they are printable ASCII padded with zeros (a
/// driver version).
fn byte_string(out: &mut Vec<(String, String)>, path: String, msg: &[u8], at: u64, width: u32, all: bool) {
    if !at.is_multiple_of(8) || !width.is_multiple_of(8) {
        return;
    }
    let (start, len) = ((at / 8) as usize, (width / 8) as usize);
    let Some(b) = msg.get(start..start + len) else { return };
    if !all && b.iter().all(|&x| x == 0) {
        return;
    }
    let text: &[u8] = match b.iter().position(|&x| x == 0) {
        Some(end) if b[end..].iter().all(|&x| x == 0) => &b[..end],
        Some(_) => &[],
        None => b,
    };
    if !text.is_empty() && text.iter().all(|c| c.is_ascii_graphic() || *c == b' ') {
        out.push((path, format!("\"{}\" ({len} bytes)", String::from_utf8_lossy(text))));
        return;
    }
    let mut v = String::from("0x");
    for x in b {
        write!(v, "{x:02x}").ok();
    }
    out.push((path, v));
}

/// `width` (1..=64) bits at bit `off` of `msg` in PRM numbering (bit 0 is the most significant bit of byte 0, the
/// dwords big endian: the message is one big-endian bit string); `None` past the end of the message.
pub fn bits(msg: &[u8], off: u64, width: u32) -> Option<u64> {
    let end = off.checked_add(u64::from(width))?;
    if width == 0 || width > 64 || end > msg.len() as u64 * 8 {
        return None;
    }
    let (first, last) = ((off / 8) as usize, ((end - 1) / 8) as usize);
    let acc = msg[first..=last].iter().fold(0u128, |a, &b| (a << 8) | u128::from(b));
    let shift = (last - first + 1) as u64 * 8 - off % 8 - u64::from(width);
    let mask = if width == 64 { u128::from(u64::MAX) } else { (1u128 << width) - 1 };
    Some(((acc >> shift) & mask) as u64)
}

/// The member of a union this command means. HCA capabilities: the capability type in `op_mod >> 1`
/// (`MLX5_SET_HCA_CAP_OP_MOD_*`, `mlx5_cap_type`); MODIFY_CQ: `op_mod` says modify or resize. Other unions: the
/// first member.
fn union_member(l: &Layout, ctx: &Ctx<'_>) -> Option<&'static Member> {
    let want = match l.name {
        "hca_cap_union" => {
            let ty = ctx.op_mod >> 1;
            CAP_TYPES.iter().find(|(t, _)| *t == ty).map(|(_, name)| *name)
        }
        "modify_field_select_resize_field_select_auto" => {
            Some(if ctx.op_mod == consts::MLX5_CQ_OPMOD_RESIZE { "resize_field_select" } else { "modify_field_select" })
        }
        _ => None,
    };
    let members = names::layout(l.name)?.members;
    match want {
        Some(w) => members.iter().find(|m| m.name == w),
        None => members.first(),
    }
}

/// `mlx5_cap_type` → the member of `hca_cap_union` that type's capabilities fill.
const CAP_TYPES: &[(u16, &str)] = &[
    (consts::MLX5_CAP_GENERAL, "cmd_hca_cap"),
    (consts::MLX5_CAP_GENERAL_2, "cmd_hca_cap_2"),
    (consts::MLX5_CAP_ETHERNET_OFFLOADS, "per_protocol_networking_offload_caps"),
    (consts::MLX5_CAP_ODP, "odp_cap"),
    (consts::MLX5_CAP_ATOMIC, "atomic_caps"),
    (consts::MLX5_CAP_ROCE, "roce_cap"),
    (consts::MLX5_CAP_FLOW_TABLE, "flow_table_nic_cap"),
    (consts::MLX5_CAP_ESWITCH_FLOW_TABLE, "flow_table_eswitch_cap"),
    (consts::MLX5_CAP_ESWITCH, "e_switch_cap"),
    (consts::MLX5_CAP_QOS, "qos_cap"),
    (consts::MLX5_CAP_DEBUG, "debug_cap"),
    (consts::MLX5_CAP_DEV_MEM, "device_mem_cap"),
    (consts::MLX5_CAP_TLS, "tls_cap"),
    (consts::MLX5_CAP_VDPA_EMULATION, "virtio_emulation_cap"),
    (consts::MLX5_CAP_IPSEC, "ipsec_cap"),
    (consts::MLX5_CAP_CRYPTO, "crypto_cap"),
    (consts::MLX5_CAP_MACSEC, "macsec_cap"),
    (consts::MLX5_CAP_PORT_SELECTION, "port_selection_cap"),
];

/// Registers whose layouts are vendored, by `register_id`.
const REGISTERS: &[(u16, &str)] =
    &[(consts::MLX5_REG_PMTU, "pmtu_reg"), (consts::MLX5_REG_PAOS, "paos_reg"), (consts::MLX5_REG_PTYS, "ptys_reg")];

/// ACCESS_REGISTER's `register_data` read as the register the input names, when its layout is known.
fn register_layout(parent: &Layout, m: &Member, ctx: &Ctx<'_>) -> Option<&'static Layout> {
    if m.name != "register_data" || !parent.name.starts_with("access_register_") {
        return None;
    }
    if ctx.op != Opcode::AccessReg.raw() {
        return None;
    }
    let id_field = names::layout("access_register_in")?.members.iter().find(|f| f.name == "register_id")?;
    let id = bits(ctx.input, u64::from(id_field.off), id_field.width)? as u16;
    REGISTERS.iter().find(|(r, _)| *r == id).and_then(|(_, name)| names::layout(name))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx5_core::prm::{ifc, Field};

    fn member(layout: &str, name: &str) -> Member {
        *names::layout(layout).unwrap().members.iter().find(|m| m.name == name).unwrap()
    }

    #[test]
    fn name_table_agrees_with_the_field_constants() {
        let m = member("cqc", "log_cq_size");
        assert_eq!(Field::new(m.off, m.width), ifc::cqc::LOG_CQ_SIZE);
        let m = member("cmd_hca_cap", "log_max_qp");
        assert_eq!(Field::new(m.off, m.width), ifc::cmd_hca_cap::LOG_MAX_QP);
        let m = member("create_cq_in", "cq_context");
        assert_eq!(m.kind, Kind::Struct("cqc"));
        assert_eq!(m.off as usize / 8, ifc::create_cq_in::CQ_CONTEXT.off);
        assert!(names::layout("hca_cap_union").unwrap().union);
        assert!(names::layout("no_such_layout").is_none());
        assert!(names::LAYOUTS.windows(2).all(|w| w[0].name < w[1].name), "sorted for binary search");
    }

    #[test]
    fn bits_match_mlx5_get() {
        let mut b = [0u8; ifc::create_cq_in::SIZE_BYTES];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i as u8).wrapping_mul(37).wrapping_add(11);
        }
        for f in [ifc::cqc::LOG_CQ_SIZE, ifc::cqc::UAR_PAGE, ifc::cqc::OI, ifc::cqc::C_EQN_OR_APU_ELEMENT] {
            let f = f.at(ifc::create_cq_in::CQ_CONTEXT);
            assert_eq!(bits(&b, f.off.into(), f.width), Some(u64::from(b.get(f))), "{f:?}");
        }
        let f = ifc::cqc::DBR_ADDR.at(ifc::create_cq_in::CQ_CONTEXT);
        assert_eq!(bits(&b, f.off.into(), 64), Some(b.get64(f)));
        assert_eq!(bits(&b, (b.len() * 8 - 4) as u64, 8), None, "past the end");
        assert_eq!(bits(&b, u64::MAX, 8), None);
    }

    #[test]
    fn nested_fields_by_dotted_path_and_zero_fields_hidden() {
        let mut input = vec![0u8; ifc::create_cq_in::SIZE_BYTES + 8];
        input.set(ifc::create_cq_in::OPCODE, Opcode::CreateCq.raw().into());
        input.set(ifc::cqc::LOG_CQ_SIZE.at(ifc::create_cq_in::CQ_CONTEXT), 8);
        input.set64(ifc::create_cq_in::PAS.elem(0), 0x1234_5000);
        let line = format!(
            "{{\"opcode_raw\":1024,\"op_mod\":0,\"input\":\"{}\",\"output\":\"0000000000000000000000420000000000\",\
             \"delivery\":\"OK\",\"status_raw\":0,\"syndrome\":0}}",
            input.iter().map(|b| format!("{b:02x}")).collect::<String>()
        );
        let e = Entry::parse(&line).unwrap();
        let text = e.render(3, false);
        assert!(text.starts_with("#3 CREATE_CQ(0x400) op_mod 0x0 status OK(0x0) syndrome 0x0\n"), "{text}");
        assert!(text.contains("    cq_context.log_cq_size = 0x8\n"), "{text}");
        assert!(text.contains("    pas[0] = 0x12345000\n"), "{text}");
        assert!(text.contains("    cqn = 0x42\n"), "{text}");
        assert!(!text.contains("uar_page"), "zero fields are hidden: {text}");
        assert!(e.render(3, true).contains("    cq_context.uar_page = 0x0\n"));
    }

    #[test]
    fn bad_lines_are_errors_not_panics() {
        for (line, want) in [
            ("not json", "not a trace line"),
            ("[1,2]", "JSON object"),
            ("{}", "no `input`"),
            ("{\"input\":\"0g\"}", "not a hex string"),
            ("{\"input\":\"010\"}", "not a hex string"),
            ("{\"input\":\"01\"}", "too short"),
            ("{\"input\":\"0104\",\"opcode_raw\":70000}", "opcode_raw"),
            ("{\"input\":\"0104\",\"output\":5}", "neither"),
            ("{\"input\":\"0104\",\"status_raw\":999}", "status_raw"),
            ("{\"input\":\"0104\",\"device\":1}", "`device` is not a string"),
        ] {
            let e = Entry::parse(line).unwrap_err().to_string();
            assert!(e.contains(want), "{line}: {e}");
        }
        assert_eq!(parse_trace("\n{\"input\":\"01040000\"}\nnope\n").unwrap_err().0, 3);
    }

    #[test]
    fn unknown_opcodes_and_short_messages_decode_what_they_can() {
        let e =
            Entry::parse("{\"opcode_raw\":30583,\"input\":\"7777000000000005\",\"output\":\"05\",\"status_raw\":5}")
                .unwrap();
        let text = e.render(0, false);
        assert!(text.starts_with("#0 unknown opcode 0x7777 op_mod 0x5 status BAD_RES(0x5)"), "{text}");
        assert!(text.contains("mbox_in") && text.contains("opcode = 0x7777"), "{text}");
        assert!(text.contains("status = 0x5"), "{text}");
        // Delivery failures and timeouts render, and so does their hexdump.
        let t =
            Entry::parse("{\"input\":\"01040000\",\"output\":null,\"delivery\":\"TIMEOUT\",\"waited_us\":9}").unwrap();
        assert!(t.render(1, false).contains("timeout after 9 us"));
        assert!(t.hexdump().contains("timeout after 9 us"));
        let d = Entry::parse("{\"input\":\"01040000\",\"output\":\"00\",\"delivery\":\"TOK\"}").unwrap();
        assert!(d.render(1, false).contains("delivery TOK"));
        assert!(d.hexdump().contains("delivery status TOK(0x2)"), "{}", d.hexdump());
    }

    #[test]
    fn every_named_command_with_layouts_finds_them() {
        for op in [Opcode::QueryHcaCap, Opcode::AccessReg, Opcode::X2errQp, Opcode::Rst2initQp, Opcode::ManagePages] {
            let (i, o) = layouts_of(op);
            assert!(!i.name.starts_with("mbox") && !o.name.starts_with("mbox"), "{op:?}");
        }
        assert_eq!(layouts_of(Opcode::Unknown(0x7777)).0.name, "mbox_in");
    }

    #[test]
    fn a_line_naming_its_device_shows_it_in_the_header() {
        let line = "{\"device\":\"mlx5_1\",\"opcode_raw\":260,\"input\":\"0104000000000000\",\"status_raw\":0}";
        let e = Entry::parse(line).unwrap();
        assert_eq!(e.device.as_deref(), Some("mlx5_1"));
        assert!(e.render(7, false).starts_with("#7 mlx5_1: ENABLE_HCA(0x104) op_mod 0x0 status OK(0x0)"));
        let e = Entry::parse("{\"opcode_raw\":260,\"input\":\"0104000000000000\"}").unwrap();
        assert!(e.device.is_none() && e.render(0, false).starts_with("#0 ENABLE_HCA(0x104)"));
    }
}
