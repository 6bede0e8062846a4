//! Command tracing: every executed command's opcode, op_mod, full input and output (inline bytes and mailbox
//! data), delivery status, command status and syndrome.
//!
//! Two renderings: JSON lines (one object per command, for tools) and the hexdump Linux prints with
//! `mlx5_core` command debugging (`dump_command` in data-only mode: `cmd[slot]: OFF: dw dw dw dw`), so a trace
//! taken here can be compared line by line with one taken from the kernel driver.

use core::fmt::{self, Write};

use crate::prm::{CmdStatus, DeliveryStatus, MsgBuf, Named, Opcode};

/// How a traced command ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CmdOutcome {
    /// Firmware ran it; `status` may still be an error.
    Completed {
        /// The output status.
        status: CmdStatus,
        /// The output syndrome.
        syndrome: u32,
    },
    /// Firmware rejected the entry (delivery status in `status_own`).
    Delivery(DeliveryStatus),
    /// The output signature did not verify.
    BadSignature,
    /// Firmware did not hand the entry back in time.
    Timeout,
}

/// One command as the queue saw it. `input`/`output` are views of the message in place.
pub struct CmdRecord<'a> {
    /// The command slot.
    pub slot: u8,
    /// The token written into the entry.
    pub token: u8,
    /// The opcode.
    pub opcode: Opcode,
    /// The header's `op_mod`.
    pub op_mod: u16,
    /// The input message.
    pub input: &'a dyn MsgBuf,
    /// `None` when the command timed out (firmware still owns the output).
    pub output: Option<&'a dyn MsgBuf>,
    /// How the command ended.
    pub outcome: CmdOutcome,
    /// Time spent waiting for firmware, in microseconds (as counted by the queue's backoff).
    pub waited_us: u64,
}

impl fmt::Debug for CmdRecord<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CmdRecord")
            .field("slot", &self.slot)
            .field("opcode", &self.opcode)
            .field("op_mod", &self.op_mod)
            .field("inlen", &self.input.len())
            .field("outlen", &self.output.map(|o| o.len()))
            .field("outcome", &self.outcome)
            .finish()
    }
}

/// Receives every command the queue finishes (or gives up on).
pub trait CmdTrace {
    /// Called once per finished (or timed-out) command.
    fn record(&mut self, rec: &CmdRecord<'_>);
}

/// No tracing.
impl CmdTrace for () {
    fn record(&mut self, _rec: &CmdRecord<'_>) {}
}

impl<T: CmdTrace + ?Sized> CmdTrace for &mut T {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        (**self).record(rec)
    }
}

fn write_hex(w: &mut dyn Write, msg: &dyn MsgBuf) -> fmt::Result {
    let mut off = 0;
    while off < msg.len() {
        let chunk = msg.chunk(off);
        let n = chunk.len().min(msg.len() - off);
        for b in &chunk[..n] {
            write!(w, "{b:02x}")?;
        }
        off += n;
    }
    Ok(())
}

fn opcode_name(w: &mut dyn Write, op: Opcode) -> fmt::Result {
    match op.name() {
        Some(n) => w.write_str(n),
        None => write!(w, "UNKNOWN_0x{:x}", op.raw()),
    }
}

impl CmdRecord<'_> {
    /// The command as one JSON object (no trailing newline):
    /// `{"slot","token","opcode","opcode_raw","op_mod","input","output","delivery","status","status_raw","syndrome","waited_us"}`.
    /// `input`/`output` are the hex of the full inbox/outbox including mailbox data; `output` is null on timeout.
    pub fn write_json(&self, w: &mut dyn Write) -> fmt::Result {
        write!(w, "{{\"slot\":{},\"token\":{},\"opcode\":\"", self.slot, self.token)?;
        opcode_name(w, self.opcode)?;
        write!(w, "\",\"opcode_raw\":{},\"op_mod\":{},\"input\":\"", self.opcode.raw(), self.op_mod)?;
        write_hex(w, self.input)?;
        w.write_str("\",\"output\":")?;
        match self.output {
            Some(o) if self.outcome != CmdOutcome::Timeout => {
                w.write_char('"')?;
                write_hex(w, o)?;
                w.write_char('"')?;
            }
            _ => w.write_str("null")?,
        }
        let (delivery, status, raw, syndrome) = match self.outcome {
            CmdOutcome::Completed { status, syndrome } => {
                ("OK", status.name().unwrap_or("UNKNOWN"), i32::from(status.raw()), syndrome)
            }
            CmdOutcome::Delivery(d) => (d.name().unwrap_or("UNKNOWN"), "NONE", -1, 0),
            CmdOutcome::BadSignature => ("BAD_SIGNATURE", "NONE", -1, 0),
            CmdOutcome::Timeout => ("TIMEOUT", "NONE", -1, 0),
        };
        write!(
            w,
            ",\"delivery\":\"{delivery}\",\"status\":\"{status}\",\"status_raw\":{raw},\"syndrome\":{syndrome},\"waited_us\":{}}}",
            self.waited_us
        )
    }

    /// The input and output as Linux's `dump_command` prints them with `MLX5_CMD_DATA` debugging: a heading per
    /// direction, then rows of four big-endian dwords with their byte offset within the message.
    pub fn write_hexdump(&self, w: &mut dyn Write) -> fmt::Result {
        self.dump_one(w, self.input, "INPUT")?;
        if let (Some(o), false) = (self.output, self.outcome == CmdOutcome::Timeout) {
            self.dump_one(w, o, "OUTPUT")?;
        }
        match self.outcome {
            CmdOutcome::Completed { status, syndrome } if status != CmdStatus::Ok => writeln!(
                w,
                "{} op_mod(0x{:x}) failed, status {}, syndrome (0x{syndrome:x})",
                Named(self.opcode.name(), self.opcode.raw().into()),
                self.op_mod,
                Named(status.name(), status.raw().into())
            ),
            CmdOutcome::Delivery(d) => {
                writeln!(w, "cmd[{}]: delivery status {}", self.slot, Named(d.name(), d.raw().into()))
            }
            CmdOutcome::BadSignature => writeln!(w, "cmd[{}]: output signature mismatch", self.slot),
            CmdOutcome::Timeout => writeln!(w, "cmd[{}]: timeout after {} us", self.slot, self.waited_us),
            CmdOutcome::Completed { .. } => Ok(()),
        }
    }

    fn dump_one(&self, w: &mut dyn Write, msg: &dyn MsgBuf, dir: &str) -> fmt::Result {
        write!(w, "cmd[{}]: dump command data ", self.slot)?;
        opcode_name(w, self.opcode)?;
        writeln!(w, "(0x{:x}) {dir}", self.opcode.raw())?;
        let mut off = 0;
        while off < msg.len() {
            write!(w, "cmd[{}]: {off:03x}:", self.slot)?;
            for d in 0..4 {
                let mut b = [0u8; 4];
                for (i, byte) in b.iter_mut().enumerate() {
                    let at = off + d * 4 + i;
                    if at < msg.len() {
                        *byte = msg.chunk(at)[0];
                    }
                }
                write!(w, " {:08x}", u32::from_be_bytes(b))?;
            }
            w.write_char('\n')?;
            off += 16;
        }
        Ok(())
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;
    use heapless::String;

    fn rec<'a>(input: &'a dyn MsgBuf, output: &'a dyn MsgBuf, outcome: CmdOutcome) -> CmdRecord<'a> {
        CmdRecord {
            slot: 0,
            token: 1,
            opcode: Opcode::from_raw((input.read_u32(0) >> 16) as u16),
            op_mod: 0,
            input,
            output: Some(output),
            outcome,
            waited_us: 0,
        }
    }

    #[test]
    fn json_line_names_the_opcode_and_status() {
        let input = [0x08u8, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let output = [0x03u8, 0, 0, 0, 0x12, 0x34, 0x56, 0x78, 0, 0, 0, 0, 0, 0, 0, 0];
        let mut s: String<512> = String::new();
        rec(&input, &output, CmdOutcome::Completed { status: CmdStatus::BadParam, syndrome: 0x12345678 })
            .write_json(&mut s)
            .unwrap();
        assert_eq!(
            s.as_str(),
            "{\"slot\":0,\"token\":1,\"opcode\":\"ALLOC_PD\",\"opcode_raw\":2048,\"op_mod\":0,\
             \"input\":\"08000000000000000000000000000000\",\"output\":\"03000000123456780000000000000000\",\
             \"delivery\":\"OK\",\"status\":\"BAD_PARAM\",\"status_raw\":3,\"syndrome\":305419896,\"waited_us\":0}"
        );
    }

    #[test]
    fn hexdump_matches_kernel_rows() {
        let mut input = [0u8; 20];
        input[..4].copy_from_slice(&[0x01, 0x04, 0, 0]);
        input[16..20].copy_from_slice(&[0xde, 0xad, 0xbe, 0xef]);
        let output = [0u8; 16];
        let mut s: String<1024> = String::new();
        rec(&input, &output, CmdOutcome::Completed { status: CmdStatus::Ok, syndrome: 0 })
            .write_hexdump(&mut s)
            .unwrap();
        let lines: heapless::Vec<&str, 8> = s.lines().collect();
        assert_eq!(lines[0], "cmd[0]: dump command data ENABLE_HCA(0x104) INPUT");
        assert_eq!(lines[1], "cmd[0]: 000: 01040000 00000000 00000000 00000000");
        assert_eq!(lines[2], "cmd[0]: 010: deadbeef 00000000 00000000 00000000");
        assert_eq!(lines[3], "cmd[0]: dump command data ENABLE_HCA(0x104) OUTPUT");
        assert_eq!(lines.len(), 5);
    }

    #[test]
    fn failed_command_line_matches_mlx5_cmd_check() {
        let input = [0x04u8, 0x00, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0];
        let output = [0x03u8, 0, 0, 0, 0, 0, 0, 0x2a, 0, 0, 0, 0, 0, 0, 0, 0];
        let mut s: String<1024> = String::new();
        rec(&input, &output, CmdOutcome::Completed { status: CmdStatus::BadParam, syndrome: 0x2a })
            .write_hexdump(&mut s)
            .unwrap();
        assert!(s.ends_with("CREATE_CQ(0x400) op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0x2a)\n"), "{s}");
    }
}
