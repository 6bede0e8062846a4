//! Fields of a command by PRM name: a dotted path (`cq_context.log_cq_size`, `pas[0]`,
//! `capability.cmd_hca_cap.log_max_qp`) to its bit range, and back from a bit to the innermost named field, over
//! the generated name table ([`crate::prm::generated::names`]).

use core::fmt::Write;

use crate::prm::generated::names::{layout, Kind, Layout};
use crate::prm::{MsgBuf, Opcode};

/// Nesting followed at most (the deepest PRM layouts are far shallower).
const MAX_DEPTH: usize = 8;

/// The layout of an opcode's input (`suffix` `"in"`) or output (`"out"`): `<opcode name in lower case>_<suffix>`.
pub(crate) fn command_layout(op: Opcode, suffix: &str) -> Option<&'static Layout> {
    let name = op.name()?;
    // ACCESS_REG's layouts are named after the register, not the opcode.
    let name = if name == "ACCESS_REG" { "ACCESS_REGISTER" } else { name };
    let mut s: heapless::String<64> = heapless::String::new();
    for ch in name.chars() {
        s.push(ch.to_ascii_lowercase()).ok()?;
    }
    s.push('_').ok()?;
    s.push_str(suffix).ok()?;
    layout(&s)
}

/// `name[3]` as (`name`, `Some(3)`); `name` as (`name`, `None`).
fn split_index(part: &str) -> Option<(&str, Option<u32>)> {
    match part.find('[') {
        None => Some((part, None)),
        Some(i) => {
            let idx = part.get(i + 1..)?.strip_suffix(']')?.parse().ok()?;
            Some((&part[..i], Some(idx)))
        }
    }
}

/// The bit offset and width of the scalar at `path` inside `l`, or `None` when no scalar has that path.
pub(crate) fn resolve(mut l: &'static Layout, path: &str) -> Option<(u32, u32)> {
    let mut base = 0u32;
    let mut parts = path.split('.').peekable();
    while let Some(part) = parts.next() {
        let (name, idx) = split_index(part)?;
        let m = l.members.iter().find(|m| m.name == name)?;
        let off = base + m.off;
        let last = parts.peek().is_none();
        match (m.kind, idx) {
            (Kind::Scalar, None) if last => return Some((off, m.width)),
            (Kind::Struct(ty), None) if !last => {
                l = layout(ty)?;
                base = off;
            }
            (Kind::Array { count, elem_bits, elem }, Some(i)) if count == 0 || i < count => {
                let at = off + i * elem_bits;
                match elem {
                    None if last => return Some((at, elem_bits)),
                    Some(ty) if !last => {
                        l = layout(ty)?;
                        base = at;
                    }
                    _ => return None,
                }
            }
            _ => return None,
        }
    }
    None
}

/// Writes the path of the innermost scalar covering `bit` of `l` into `out` and returns its (offset, width).
/// Unions are looked into member by member, the first that names the bit wins.
pub(crate) fn name_at<const L: usize>(
    l: &'static Layout,
    bit: u32,
    out: &mut heapless::String<L>,
) -> Option<(u32, u32)> {
    name_in(l, 0, bit, out, 0)
}

fn name_in<const L: usize>(
    l: &'static Layout,
    base: u32,
    bit: u32,
    out: &mut heapless::String<L>,
    depth: usize,
) -> Option<(u32, u32)> {
    if depth > MAX_DEPTH {
        return None;
    }
    let mark = out.len();
    for m in l.members {
        let start = base + m.off;
        let width = match m.kind {
            Kind::Array { count: 0, .. } => u32::MAX - start,
            _ => m.width,
        };
        if bit < start || bit - start >= width {
            continue;
        }
        if mark > 0 {
            let _ = out.push('.');
        }
        let _ = out.push_str(m.name);
        let found = match m.kind {
            Kind::Scalar => Some((start, m.width)),
            Kind::Struct(ty) => layout(ty).and_then(|n| name_in(n, start, bit, out, depth + 1)),
            Kind::Array { elem_bits, elem, .. } if elem_bits > 0 => {
                let i = (bit - start) / elem_bits;
                let at = start + i * elem_bits;
                let _ = write!(out, "[{i}]");
                match elem {
                    None => Some((at, elem_bits)),
                    Some(ty) => layout(ty).and_then(|n| name_in(n, at, bit, out, depth + 1)),
                }
            }
            Kind::Array { .. } => None,
        };
        if found.is_some() {
            return found;
        }
        out.truncate(mark);
    }
    None
}

/// The value of the `width`-bit field at bit `off` (widths 1..=64), or `None` past the message's end.
pub(crate) fn read_bits<B: MsgBuf + ?Sized>(msg: &B, off: u32, width: u32) -> Option<u64> {
    if width == 0 || width > 64 {
        return None;
    }
    let first = (off / 8) as usize;
    let last = ((off + width - 1) / 8) as usize;
    if last >= msg.len() {
        return None;
    }
    let mut v: u128 = 0;
    let mut b = [0u8; 1];
    for i in first..=last {
        msg.read_bytes(i, &mut b);
        v = (v << 8) | u128::from(b[0]);
    }
    let trailing = (last as u32 + 1) * 8 - (off + width);
    let mask = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
    Some((v >> trailing) as u64 & mask)
}

/// Writes the `width`-bit field at bit `off`; returns false when it lies past the message's end.
pub(crate) fn write_bits<B: MsgBuf + ?Sized>(msg: &mut B, off: u32, width: u32, value: u64) -> bool {
    if width == 0 || width > 64 {
        return false;
    }
    let first = (off / 8) as usize;
    let last = ((off + width - 1) / 8) as usize;
    if last >= msg.len() {
        return false;
    }
    let n = last - first + 1;
    let mut buf = [0u8; 9];
    msg.read_bytes(first, &mut buf[..n]);
    let mut v: u128 = 0;
    for b in &buf[..n] {
        v = (v << 8) | u128::from(*b);
    }
    let trailing = (n as u32) * 8 - (off - first as u32 * 8) - width;
    let mask = if width == 64 { u64::MAX } else { (1u64 << width) - 1 };
    v = (v & !(u128::from(mask) << trailing)) | (u128::from(value & mask) << trailing);
    for (i, b) in buf[..n].iter_mut().enumerate() {
        *b = (v >> (8 * (n - 1 - i))) as u8;
    }
    msg.write_bytes(first, &buf[..n]);
    true
}
