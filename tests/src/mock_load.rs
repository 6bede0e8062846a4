//! Expectations for `mlx5_core::mock::MockDevice` loaded from recorded traces: the simulator's JSON lines
//! (`mlx5 --trace FILE`, [`from_trace_jsonl`]) and the Linux `mlx5_core` debug dump (`dump command NAME(0xOP)
//! INPUT|OUTPUT` followed by hex lines, [`from_linux_dump`]). The std side of the mock: it owns the recorded bytes,
//! and [`expectations`] lends them to the no_std expectations.

use mlx5_core::cmdq::{BLOCK_DATA, INLINE_LEN};
use mlx5_core::mock::{Expect, Reply};
use mlx5_core::prm::{c, consts, ifc, DeliveryStatus, MsgBuf, Opcode};

/// One recorded command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// The opcode.
    pub opcode: u16,
    /// Its `op_mod`.
    pub op_mod: u16,
    /// The input message (header included).
    pub input: Vec<u8>,
    /// The output message; `None` when the command never completed.
    pub output: Option<Vec<u8>>,
    /// The delivery status (0: delivered).
    pub delivery: u8,
}

impl Recorded {
    fn opcode(&self) -> Opcode {
        Opcode::from_raw(self.opcode)
    }
}

/// Commands from the simulator's trace.jsonl (`CmdRecord::write_json`: `opcode_raw`, `op_mod`, `input`, `output`
/// as hex, `delivery` by name). Errors name the line.
pub fn from_trace_jsonl(text: &str) -> Result<Vec<Recorded>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let n = i + 1;
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("line {n}: {e}"))?;
        let num = |k: &str| v.get(k).and_then(|x| x.as_u64()).ok_or_else(|| format!("line {n}: no number {k}"));
        let hex = |k: &str| -> Result<Option<Vec<u8>>, String> {
            match v.get(k) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => {
                    unhex(s).map(Some).ok_or_else(|| format!("line {n}: bad hex {k}"))
                }
                Some(_) => Err(format!("line {n}: {k} is not a hex string")),
            }
        };
        let delivery = match v.get("delivery").and_then(|d| d.as_str()) {
            None | Some("OK") => 0,
            Some(name) => (1..=0x10u8)
                .find(|&d| DeliveryStatus::from_raw(d).name() == Some(name))
                .ok_or_else(|| format!("line {n}: unknown delivery status {name}"))?,
        };
        out.push(Recorded {
            opcode: u16::try_from(num("opcode_raw")?).map_err(|_| format!("line {n}: opcode out of range"))?,
            op_mod: u16::try_from(num("op_mod")?).map_err(|_| format!("line {n}: op_mod out of range"))?,
            input: hex("input")?.ok_or_else(|| format!("line {n}: no input"))?,
            output: hex("output")?,
            delivery,
        });
    }
    Ok(out)
}

fn unhex(s: &str) -> Option<Vec<u8>> {
    if !s.len().is_multiple_of(2) {
        return None;
    }
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(s.get(i..i + 2)?, 16).ok()).collect()
}

/// Bytes of one mailbox block as Linux's `dump_command` prints it (`struct mlx5_cmd_prot_block`).
const DUMP_BLOCK: usize = c::mlx5_cmd_prot_block::SIZE;
/// Largest dump accepted (a MANAGE_PAGES of 16,384 pages is 257 blocks).
const MAX_DUMP: usize = 64 + 512 * DUMP_BLOCK;

/// One `dump command` section: its opcode, direction and the bytes at the printed offsets.
struct Dump {
    opcode: u16,
    output: bool,
    image: Vec<u8>,
}

/// Commands from a Linux `mlx5_core` debug log (`dyndbg="module mlx5_core +p"`): each `dump command NAME(0xOP)
/// INPUT` section (the 64-byte entry, then each mailbox block as `struct mlx5_cmd_prot_block`) paired with the
/// `OUTPUT` section of the same opcode that follows it. An input without an output is a command that never
/// completed.
pub fn from_linux_dump(text: &str) -> Result<Vec<Recorded>, String> {
    let mut dumps: Vec<Dump> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if let Some(at) = line.find("dump command ") {
            let rest = line[at..].trim_end();
            let output = match rest.rsplit(' ').next() {
                Some("INPUT") => false,
                Some("OUTPUT") => true,
                _ => return Err(format!("line {n}: dump without INPUT or OUTPUT")),
            };
            let open = rest.rfind("(0x").ok_or_else(|| format!("line {n}: no (0xOPCODE)"))?;
            let close = rest[open..].find(')').ok_or_else(|| format!("line {n}: no (0xOPCODE)"))? + open;
            let opcode =
                u16::from_str_radix(&rest[open + 3..close], 16).map_err(|_| format!("line {n}: bad opcode"))?;
            dumps.push(Dump { opcode, output, image: Vec::new() });
            continue;
        }
        // `[ +0.000001] 010: 01040000 00000000 00000000 00000000`
        let body = line.rsplit_once("] ").map_or(line, |(_, b)| b).trim();
        let Some((off, words)) = body.split_once(": ") else { continue };
        let Ok(off) = usize::from_str_radix(off, 16) else { continue };
        let Some(d) = dumps.last_mut() else { continue };
        if off >= MAX_DUMP {
            return Err(format!("line {n}: offset {off:#x} past any command"));
        }
        let mut bytes = Vec::with_capacity(16);
        for w in words.split_whitespace() {
            let w = u32::from_str_radix(w, 16).map_err(|_| format!("line {n}: bad word {w}"))?;
            bytes.extend_from_slice(&w.to_be_bytes());
        }
        if d.image.len() < off + bytes.len() {
            d.image.resize(off + bytes.len(), 0);
        }
        d.image[off..off + bytes.len()].copy_from_slice(&bytes);
    }
    let mut out: Vec<Recorded> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    for d in dumps {
        use c::mlx5_cmd_layout as lay;
        if d.image.len() < lay::SIZE {
            return Err(format!("{:#x}: dump shorter than a command entry", d.opcode));
        }
        let be32 = |b: mlx5_core::prm::Bytes| u32::from_be_bytes(d.image[b.off..b.off + 4].try_into().unwrap());
        if !d.output {
            let input = message(&d.image, lay::IN.off, be32(lay::INLEN) as usize)?;
            let op_mod = MsgBuf::get(&input[..], ifc::mbox_in::OP_MOD) as u16;
            open.push(out.len());
            out.push(Recorded { opcode: d.opcode, op_mod, input, output: None, delivery: 0 });
        } else {
            let k = open
                .iter()
                .rposition(|&k| out[k].opcode == d.opcode)
                .ok_or_else(|| format!("{:#x}: OUTPUT without its INPUT", d.opcode))?;
            let rec = &mut out[open.remove(k)];
            rec.output = Some(message(&d.image, lay::OUT.off, be32(lay::OUTLEN) as usize)?);
            rec.delivery = d.image[lay::STATUS_OWN.off] >> 1;
        }
    }
    Ok(out)
}

/// A message of `len` bytes: 16 inline at `inline` of the entry, the rest in the dumped blocks' data. Blocks the
/// log does not hold read as zeros: Linux prints an input's mailboxes only for some commands (the ConnectX-4's
/// MANAGE_PAGES inputs come without their page lists).
fn message(image: &[u8], inline: usize, len: usize) -> Result<Vec<u8>, String> {
    if !(8..=MAX_DUMP).contains(&len) {
        return Err(format!("impossible message length {len}"));
    }
    let mut m = image[inline..inline + INLINE_LEN.min(len)].to_vec();
    let mut k = 0;
    while m.len() < len {
        let at = c::mlx5_cmd_layout::SIZE + k * DUMP_BLOCK;
        let n = (len - m.len()).min(BLOCK_DATA);
        match image.get(at..at + n) {
            Some(block) => m.extend_from_slice(block),
            None => m.resize(m.len() + n, 0),
        }
        k += 1;
    }
    Ok(m)
}

/// One expectation per recorded command: its opcode and `op_mod`, answered with the recorded output (status and
/// syndrome included), a timeout or the recorded delivery error. Inputs are not compared whole: they carry the
/// recording run's bus addresses and tokens. Two things a recording holds only implicitly become explicit:
/// a MANAGE_PAGES take is answered with the pages the replay gave ([`Reply::give_back_pages`]), since the
/// recorded addresses were another run's; and a MANAGE_PAGES give that no QUERY_PAGES asked for was a page
/// request, so the command before it posts one ([`Reply::page_request`]) with the count it gave.
pub fn expectations(recs: &[Recorded]) -> Vec<Expect<'_>> {
    let mut v: Vec<Expect<'_>> = Vec::with_capacity(recs.len());
    let mut asked = false;
    for r in recs {
        let mut reply = match &r.output {
            None => Reply::ok().timeout(),
            Some(_) if r.delivery != 0 => Reply::ok().delivery(DeliveryStatus::from_raw(r.delivery)),
            Some(o) => Reply::ok().output(o),
        };
        if r.opcode() == Opcode::ManagePages {
            if r.op_mod == consts::MLX5_PAGES_TAKE {
                reply = reply.give_back_pages();
            } else if r.op_mod == consts::MLX5_PAGES_GIVE && !asked {
                let (num, func) = if r.input.len() >= ifc::manage_pages_in::SIZE_BYTES {
                    let i = &r.input[..];
                    (
                        MsgBuf::get(i, ifc::manage_pages_in::INPUT_NUM_ENTRIES),
                        MsgBuf::get(i, ifc::manage_pages_in::FUNCTION_ID) as u16,
                    )
                } else {
                    (0, 0)
                };
                if let Some(prev) = v.pop() {
                    let prev_reply = prev.reply_of().clone().page_request(func, num as i32);
                    v.push(prev.reply(prev_reply));
                }
            }
            asked = false;
        }
        if r.opcode() == Opcode::QueryPages {
            asked = true;
        }
        v.push(Expect::cmd(r.opcode()).op_mod(r.op_mod).reply(reply));
    }
    v
}
