//! The firmware command queue (`struct mlx5_cmd`, Linux `drivers/net/ethernet/mellanox/mlx5/core/cmd.c`).
//!
//! One 4 KiB page holds `1 << log_sz` entries of `1 << log_stride` bytes (`struct mlx5_cmd_layout`, 64 bytes
//! used). A command's first 16 input and output bytes travel inline in its entry; the rest goes through chains of
//! 576-byte mailbox blocks (`struct mlx5_cmd_prot_block`, 512 data bytes each), 1 KiB aligned, linked by `next`,
//! numbered by `block_num` and stamped with the entry's token. Software hands an entry to firmware by setting the
//! ownership bit and writing `1 << slot` to the doorbell; firmware hands it back by clearing the bit, with the
//! delivery status in the upper bits of the same byte and the command's own status in the output header.
//!
//! Commands are encoded straight into the entry and its mailboxes ([`ChainMsg`]), so nothing is staged or
//! allocated on the heap. The last slot is reserved for MANAGE_PAGES, as Linux reserves it, so page requests can
//! be answered while another command is outstanding on slot 0.

use core::mem::ManuallyDrop;

use crate::hal::{DelayNs, Dma, DmaError, DmaRegion, DmaView, Mmio};
use crate::prm::{c, consts, ifc, CmdStatus, DeliveryStatus, Layout, MsgBuf, Named, Opcode};
use crate::trace::{CmdOutcome, CmdRecord, CmdTrace};

use c::mlx5_cmd_layout as lay;
use c::mlx5_cmd_prot_block as blk;
use c::mlx5_init_seg as iseg;

/// Bytes of a message carried inline in the entry (`sizeof(lay->in)`).
pub const INLINE_LEN: usize = lay::IN.len;
/// Data bytes per mailbox block (`MLX5_CMD_DATA_BLOCK_SIZE`).
pub const BLOCK_DATA: usize = consts::MLX5_CMD_DATA_BLOCK_SIZE as usize;
/// Mailbox blocks are allocated 1 KiB apart: `roundup_pow_of_two(sizeof(struct mlx5_cmd_prot_block))`.
pub const BLOCK_STRIDE: usize = blk::SIZE.next_power_of_two();
/// The command interface revision this driver speaks (`CMD_IF_REV`).
pub const CMD_IF_REV: u32 = 5;
/// Linux's default command timeout when the init segment gives none (`tout_def_sw_val[MLX5_TO_CMD_MS]`).
pub const DEFAULT_CMD_TIMEOUT_MS: u32 = 60_000;
/// First wait between ownership polls; doubled each time up to [`POLL_MAX_US`].
const POLL_START_US: u32 = 10;
const POLL_MAX_US: u32 = 1_000;
/// Largest slot count (`MLX5_MAX_COMMANDS`).
pub const MAX_SLOTS: usize = consts::MLX5_MAX_COMMANDS as usize;
const CMDQ_PAGE: usize = 4096;

bitfield::bitfield! {
    /// `cmdq_addr_l_sz` as read (c-layouts.md §1): queue geometry and NIC interface state.
    #[derive(Clone, Copy)]
    struct CmdqAddrLSz(u32);
    u8;
    log_stride, _: 3, 0;
    log_sz, _: 7, 4;
    nic_interface, _: 10, 8;
}

bitfield::bitfield! {
    /// An init-segment timeout register (`cmd_exec_to`, `cmd_q_init_to`; Linux `tout_convert_iseg_to_ms`):
    /// a value and the unit it counts in.
    #[derive(Clone, Copy)]
    struct IsegTimeout(u32);
    u32;
    to_value, _: 19, 0;
    to_multiplier, _: 31, 29;
}

/// Milliseconds in an init-segment timeout register: the unit is ms, s, min or h (`to_multiplier & 3`).
pub fn iseg_timeout_ms(raw: u32) -> u64 {
    let t = IsegTimeout(raw);
    let unit_ms: u64 = match t.to_multiplier() & 3 {
        0 => 1,
        1 => 1_000,
        2 => 60_000,
        _ => 3_600_000,
    };
    u64::from(t.to_value()) * unit_ms
}

/// Why a command did not produce an output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum CmdError {
    /// Firmware did not hand the entry back within the command timeout. The slot stays reserved until firmware
    /// releases it (Linux leaks the entry the same way).
    Timeout {
        /// The command.
        opcode: Opcode,
        /// Milliseconds waited.
        waited_ms: u32,
    },
    /// Firmware rejected the entry itself (token, signature, block chain, lengths).
    Delivery {
        /// The command.
        opcode: Opcode,
        /// The delivery status firmware wrote.
        status: DeliveryStatus,
    },
    /// The command ran and failed: `status` and `syndrome` from the output header (`mlx5_cmd_check`).
    Status {
        /// The command.
        opcode: Opcode,
        /// Its `op_mod`.
        op_mod: u16,
        /// The output status.
        status: CmdStatus,
        /// The output syndrome.
        syndrome: u32,
    },
    /// The output is too short for what the command (or the device's own counts) says it holds.
    OutputTooShort {
        /// The command.
        opcode: Opcode,
        /// Bytes needed.
        needed: usize,
        /// Bytes there.
        got: usize,
    },
    /// A value in the output is outside what the PRM allows (checked before it is used).
    Malformed {
        /// The command.
        opcode: Opcode,
        /// What was wrong.
        what: &'static str,
        /// The value found.
        value: u64,
    },
    /// The output signature is wrong (checksums on).
    BadSignature {
        /// The command.
        opcode: Opcode,
    },
    /// The slot still belongs to firmware (an earlier command timed out and has not come back).
    SlotBusy {
        /// The slot.
        slot: u8,
    },
    /// The slot number is outside the queue.
    BadSlot {
        /// The slot.
        slot: u8,
    },
    /// The message does not fit a command (input or output shorter than its 8-byte header).
    BadLength {
        /// Input length.
        inlen: usize,
        /// Output length.
        outlen: usize,
    },
    /// The device speaks a different command interface revision.
    CmdIfRev {
        /// The revision the device reports.
        found: u32,
    },
    /// The queue geometry in `cmdq_addr_l_sz` is impossible (slots or stride do not fit one page).
    BadQueueGeometry {
        /// log2 of the slot count.
        log_sz: u8,
        /// log2 of the slot stride.
        log_stride: u8,
    },
    /// The device is gone or in internal error; no command was sent.
    DeviceDown {
        /// The command not sent.
        opcode: Opcode,
    },
    /// Mailbox memory could not be allocated.
    Dma(DmaError),
}

impl From<DmaError> for CmdError {
    fn from(e: DmaError) -> Self {
        CmdError::Dma(e)
    }
}

/// An opcode as the kernel prints it (`mlx5_command_str` + value).
fn op_name(op: Opcode) -> Named {
    Named(op.name(), op.raw().into())
}

impl core::fmt::Display for CmdError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            CmdError::Timeout { opcode, waited_ms } => write!(f, "{} timed out after {waited_ms} ms", op_name(opcode)),
            CmdError::Delivery { opcode, status } => {
                write!(f, "{} delivery error {}", op_name(opcode), Named(status.name(), status.raw().into()))
            }
            CmdError::Status { opcode, op_mod, status, syndrome } => write!(
                f,
                "{} op_mod(0x{op_mod:x}) failed, status {}, syndrome (0x{syndrome:x})",
                op_name(opcode),
                Named(status.name(), status.raw().into())
            ),
            CmdError::OutputTooShort { opcode, needed, got } => {
                write!(f, "{} output too short: needs {needed} bytes, has {got}", op_name(opcode))
            }
            CmdError::Malformed { opcode, what, value } => {
                write!(f, "{} returned an invalid {what}: 0x{value:x}", op_name(opcode))
            }
            CmdError::BadSignature { opcode } => write!(f, "{} output signature mismatch", op_name(opcode)),
            CmdError::SlotBusy { slot } => write!(f, "command slot {slot} is still owned by firmware"),
            CmdError::BadSlot { slot } => write!(f, "command slot {slot} does not exist"),
            CmdError::BadLength { inlen, outlen } => write!(f, "bad command lengths: in {inlen}, out {outlen}"),
            CmdError::CmdIfRev { found } => {
                write!(f, "driver speaks command interface revision {CMD_IF_REV}, device has {found}")
            }
            CmdError::BadQueueGeometry { log_sz, log_stride } => {
                write!(f, "impossible command queue geometry: log_sz {log_sz}, log_stride {log_stride}")
            }
            CmdError::DeviceDown { opcode } => write!(f, "{}: device is in internal error", op_name(opcode)),
            CmdError::Dma(e) => write!(f, "command mailbox allocation failed: {e}"),
        }
    }
}

/// A firmware command: its lengths, how it encodes, how its output decodes.
///
/// `encode` writes the whole input, header included (opcode, op_mod), into a zeroed message of `inlen()` bytes.
/// `decode` reads an output of `outlen()` bytes whose header status is already known to be OK; it must validate
/// every device-provided count or index before using it.
pub trait Command {
    /// The input layout (`ifc::<cmd>_in::Bits`); [`inlen`](Command::inlen) defaults to its size.
    type In: Layout;
    /// The output layout (`ifc::<cmd>_out::Bits`); [`outlen`](Command::outlen) defaults to its size.
    type Out: Layout;
    /// What [`decode`](Command::decode) returns.
    type Output;
    /// The opcode `encode` writes (it picks the slot before anything is encoded).
    fn opcode(&self) -> Opcode;
    /// Input message length; a command with a `pas[]` (or other variable) tail overrides it.
    fn inlen(&self) -> usize {
        Self::In::SIZE_BYTES
    }
    /// Output message length; a command that reads only part of its output overrides it.
    fn outlen(&self) -> usize {
        Self::Out::SIZE_BYTES
    }
    /// Writes the input message.
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B);
    /// Reads the output message (its status already OK).
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<Self::Output, CmdError>;
}

/// Writes the `mbox_in` header every command starts with.
pub fn write_header<B: MsgBuf + ?Sized>(msg: &mut B, opcode: Opcode, op_mod: u16) {
    msg.set(ifc::mbox_in::OPCODE, opcode.raw().into());
    msg.set(ifc::mbox_in::OP_MOD, op_mod.into());
}

/// A command message in place: `len` bytes, the first [`INLINE_LEN`] in the entry, the rest in mailbox blocks.
#[derive(Debug)]
pub struct ChainMsg<'a> {
    entry: DmaView<'a>,
    inline_off: usize,
    blocks: Option<DmaView<'a>>,
    len: usize,
}

impl<'a> ChainMsg<'a> {
    #[inline]
    fn locate(&self, off: usize) -> (DmaView<'a>, usize, usize) {
        assert!(off < self.len, "command message access past its length");
        if off < INLINE_LEN {
            (self.entry, self.inline_off + off, INLINE_LEN.min(self.len) - off)
        } else {
            let rel = off - INLINE_LEN;
            let (block, within) = (rel / BLOCK_DATA, rel % BLOCK_DATA);
            let run = (BLOCK_DATA - within).min(self.len - off);
            let blocks = self.blocks.expect("messages longer than the inline part have mailboxes");
            (blocks, block * BLOCK_STRIDE + blk::DATA.off + within, run)
        }
    }
}

impl MsgBuf for ChainMsg<'_> {
    fn len(&self) -> usize {
        self.len
    }
    fn chunk(&self, off: usize) -> &[u8] {
        let (region, at, run) = self.locate(off);
        let p = region.ptr_at(at, run);
        // SAFETY: `p..p+run` is inside the region (ptr_at checks). The ChainMsg borrows the queue, and it is only
        // built for a slot that software owns (before the doorbell, or after firmware released it), so the device
        // does not write these bytes while the slice lives.
        unsafe { core::slice::from_raw_parts(p, run) }
    }
    fn chunk_mut(&mut self, off: usize) -> &mut [u8] {
        let (region, at, run) = self.locate(off);
        let p = region.ptr_at(at, run);
        // SAFETY: as in `chunk`; `&mut self` makes this the only live view of these bytes.
        unsafe { core::slice::from_raw_parts_mut(p, run) }
    }
    // A field never straddles a block in practice: one copy of known length then (a `pas[]` entry is one 8-byte
    // store), the chunk loop otherwise.
    #[inline]
    fn read_bytes(&self, off: usize, out: &mut [u8]) {
        if out.is_empty() {
            return;
        }
        let (region, at, run) = self.locate(off);
        if out.len() > run {
            return read_chunks(self, off, out);
        }
        let p = region.ptr_at(at, out.len());
        // SAFETY: inside the region (ptr_at); the slot is software-owned while its message is read (see `chunk`).
        unsafe { core::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
    }
    #[inline]
    fn write_bytes(&mut self, off: usize, data: &[u8]) {
        if data.is_empty() {
            return;
        }
        let (region, at, run) = self.locate(off);
        if data.len() > run {
            return write_chunks(self, off, data);
        }
        let p = region.ptr_at(at, data.len());
        // SAFETY: inside the region (ptr_at); the slot is software-owned while its message is built (see `chunk`).
        unsafe { core::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
    }
}

/// [`MsgBuf::read_bytes`] across chunks.
fn read_chunks(msg: &ChainMsg<'_>, mut off: usize, out: &mut [u8]) {
    let mut done = 0;
    while done < out.len() {
        let c = msg.chunk(off);
        let n = c.len().min(out.len() - done);
        out[done..done + n].copy_from_slice(&c[..n]);
        done += n;
        off += n;
    }
}

/// [`MsgBuf::write_bytes`] across chunks.
fn write_chunks(msg: &mut ChainMsg<'_>, mut off: usize, data: &[u8]) {
    let mut done = 0;
    while done < data.len() {
        let c = msg.chunk_mut(off);
        let n = c.len().min(data.len() - done);
        c[..n].copy_from_slice(&data[done..done + n]);
        done += n;
        off += n;
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Posted {
    opcode: u16,
    op_mod: u16,
    inlen: usize,
    outlen: usize,
    token: u8,
}

#[derive(Debug, Default)]
struct Slot {
    /// Input and output mailbox chains, grown on demand and reused.
    in_mb: Option<DmaRegion>,
    out_mb: Option<DmaRegion>,
    /// The command firmware owns (posted, not yet finished).
    posted: Option<Posted>,
    /// Time already waited for the posted command, in microseconds.
    waited_us: u64,
}

/// Which slot a command goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotKind {
    /// Ordinary commands (slot 0).
    Regular,
    /// The reserved last slot, for MANAGE_PAGES.
    Pages,
}

/// The command queue of one function.
pub struct CmdQueue<M: Mmio, D: Dma, T: CmdTrace = ()> {
    mmio: M,
    dma: D,
    trace: T,
    /// The entry page; `ManuallyDrop` only so that `drop` can move it into `Dma::free`.
    page: ManuallyDrop<DmaRegion>,
    log_sz: u8,
    log_stride: u8,
    slots: [Slot; MAX_SLOTS],
    token: u8,
    checksum: bool,
    timeout_ms: u32,
    down: bool,
}

impl<M: Mmio, D: Dma, T: CmdTrace> core::fmt::Debug for CmdQueue<M, D, T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("CmdQueue")
            .field("iova", &self.page.iova())
            .field("slots", &self.num_slots())
            .field("checksum", &self.checksum)
            .field("timeout_ms", &self.timeout_ms)
            .finish_non_exhaustive()
    }
}

fn xor8(region: &DmaView<'_>, off: usize, len: usize) -> u8 {
    let p = region.ptr_at(off, len);
    // SAFETY: the range is inside the region (ptr_at) and belongs to a slot software owns.
    let s = unsafe { core::slice::from_raw_parts(p, len) };
    s.iter().fold(0, |a, b| a ^ b)
}

fn nblocks(len: usize) -> usize {
    len.saturating_sub(INLINE_LEN).div_ceil(BLOCK_DATA)
}

impl<M: Mmio, D: Dma, T: CmdTrace> CmdQueue<M, D, T> {
    /// Sets up the queue as `mlx5_cmd_enable` does: check the interface revision, read the geometry, allocate the
    /// 4 KiB-aligned queue page and give its address to the device (high word first, then low word).
    pub fn new(mmio: M, dma: D, trace: T) -> Result<Self, CmdError> {
        let rev = mmio.read32(iseg::CMDIF_REV_FW_SUB.off) >> 16;
        if rev != CMD_IF_REV {
            return Err(CmdError::CmdIfRev { found: rev });
        }
        let geo = CmdqAddrLSz(mmio.read32(iseg::CMDQ_ADDR_L_SZ.off));
        let (log_sz, log_stride) = (geo.log_sz(), geo.log_stride());
        let fits = (1usize << log_sz) <= MAX_SLOTS
            && (1usize << log_stride) >= lay::SIZE
            && (1usize << (log_sz + log_stride)) <= CMDQ_PAGE
            && log_sz >= 1;
        if !fits {
            return Err(CmdError::BadQueueGeometry { log_sz, log_stride });
        }
        let page = dma.alloc(CMDQ_PAGE, CMDQ_PAGE)?;
        mmio.write32(iseg::CMDQ_ADDR_H.off, (page.iova() >> 32) as u32);
        mmio.write32(iseg::CMDQ_ADDR_L_SZ.off, page.iova() as u32);
        // The address must reach the device before anything that depends on it.
        mmio.wmb();
        // A non-zero `cmd_q_init_to` says the init-segment timeouts are valid (`tout_is_supported`).
        let to = if mmio.read32(iseg::CMD_Q_INIT_TO.off) != 0 {
            iseg_timeout_ms(mmio.read32(iseg::CMD_EXEC_TO.off)).min(u64::from(u32::MAX)) as u32
        } else {
            0
        };
        Ok(Self {
            mmio,
            dma,
            trace,
            page: ManuallyDrop::new(page),
            log_sz,
            log_stride,
            slots: Default::default(),
            token: 0,
            checksum: false,
            timeout_ms: if to == 0 { DEFAULT_CMD_TIMEOUT_MS } else { to },
            down: false,
        })
    }

    /// Number of command slots.
    pub fn num_slots(&self) -> usize {
        1 << self.log_sz
    }

    /// The slot a kind of command uses.
    pub fn slot(&self, kind: SlotKind) -> u8 {
        match kind {
            SlotKind::Regular => 0,
            SlotKind::Pages => (self.num_slots() - 1) as u8,
        }
    }

    /// The register access the queue uses (shared with the rest of the driver).
    pub fn mmio(&self) -> &M {
        &self.mmio
    }

    /// The DMA allocator.
    pub fn dma(&self) -> &D {
        &self.dma
    }

    /// The command tracer.
    pub fn tracer(&mut self) -> &mut T {
        &mut self.trace
    }

    /// Bus address of the queue page.
    pub fn iova(&self) -> u64 {
        self.page.iova()
    }

    /// Turns block signatures on or off (`cmd_hca_cap.cmdif_checksum`). The entry signature is always written.
    pub fn set_checksum(&mut self, on: bool) {
        self.checksum = on;
    }

    /// The command execution timeout (from `cmd_exec_to`, or Linux's 60 s default).
    pub fn timeout_ms(&self) -> u32 {
        self.timeout_ms
    }

    /// Sets the command timeout.
    pub fn set_timeout_ms(&mut self, ms: u32) {
        self.timeout_ms = ms.max(1);
    }

    /// Marks the device gone or in internal error: new commands fail at once with [`CmdError::DeviceDown`].
    pub fn set_device_down(&mut self, down: bool) {
        self.down = down;
    }

    /// Whether the device was found down.
    pub fn device_down(&self) -> bool {
        self.down
    }

    /// Whether `slot` can take a new command: nothing is posted on it. A slot whose command timed out stays taken
    /// (firmware may still write its entry), and so does one whose command completed but was not finished yet.
    pub fn slot_free(&self, slot: u8) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.posted.is_none()) && (slot as usize) < self.num_slots()
    }

    /// Whether firmware still owns `slot`.
    pub fn is_posted(&self, slot: u8) -> bool {
        self.slots.get(slot as usize).is_some_and(|s| s.posted.is_some())
    }

    fn entry_off(&self, slot: u8) -> usize {
        (slot as usize) << self.log_stride
    }

    fn next_token(&mut self) -> u8 {
        // `alloc_token`: a per-queue counter, pre-incremented, never 0.
        self.token = self.token.wrapping_add(1);
        if self.token == 0 {
            self.token = 1;
        }
        self.token
    }

    /// Makes sure a chain of `n` blocks exists in `which` (grown by reallocating; old contents are not kept).
    fn ensure_blocks(&mut self, slot: usize, n: usize, output: bool) -> Result<(), CmdError> {
        let s = &mut self.slots[slot];
        let cur = if output { &mut s.out_mb } else { &mut s.in_mb };
        if n == 0 || cur.as_ref().is_some_and(|r| r.len() >= n * BLOCK_STRIDE) {
            return Ok(());
        }
        let want = n.next_power_of_two() * BLOCK_STRIDE;
        let region = self.dma.alloc(want, CMDQ_PAGE)?;
        if let Some(old) = cur.replace(region) {
            // SAFETY: the old chain came from this allocator and the slot is software-owned (checked by the caller
            // before any post), so firmware no longer reads it.
            unsafe { self.dma.free(old) };
        }
        Ok(())
    }

    /// Zeroes `n` blocks and links them: `next`, `block_num` and `token` in each (`mlx5_alloc_cmd_msg`).
    fn link_blocks(region: &DmaView<'_>, n: usize, token: u8) {
        for i in 0..n {
            let base = i * BLOCK_STRIDE;
            region.zero(base, blk::SIZE);
            let next = if i + 1 < n { region.iova() + ((i + 1) * BLOCK_STRIDE) as u64 } else { 0 };
            let p = region.ptr_at(base + blk::NEXT.off, blk::NEXT.len);
            // SAFETY: inside the region (ptr_at); the slot is software-owned while a command is being built.
            unsafe { p.cast::<[u8; 8]>().write_unaligned(next.to_be_bytes()) };
            let p = region.ptr_at(base + blk::BLOCK_NUM.off, blk::BLOCK_NUM.len);
            // SAFETY: as above.
            unsafe { p.cast::<[u8; 4]>().write_unaligned((i as u32).to_be_bytes()) };
            let p = region.ptr_at(base + blk::TOKEN.off, 1);
            // SAFETY: as above.
            unsafe { p.write(token) };
        }
    }

    /// Block signatures (`calc_block_sig`): `ctrl_sig` over the control part, then `sig` over the whole block.
    fn sign_blocks(region: &DmaView<'_>, n: usize) {
        for i in 0..n {
            let base = i * BLOCK_STRIDE;
            let ctrl = !xor8(region, base + blk::DATA.end(), blk::CTRL_SIG.off - blk::DATA.end());
            region.write_volatile_u8(base + blk::CTRL_SIG.off, ctrl);
            let sig = !xor8(region, base, blk::SIG.off);
            region.write_volatile_u8(base + blk::SIG.off, sig);
        }
    }

    fn blocks_ok(region: &DmaView<'_>, n: usize) -> bool {
        (0..n).all(|i| {
            let base = i * BLOCK_STRIDE;
            xor8(region, base + blk::DATA.end(), blk::SIG.off - blk::DATA.end()) == 0xff
                && xor8(region, base, blk::SIZE) == 0xff
        })
    }

    fn write_be(region: &DmaView<'_>, off: usize, bytes: &[u8]) {
        let p = region.ptr_at(off, bytes.len());
        // SAFETY: inside the region (ptr_at); the entry is software-owned while it is being written.
        unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), p, bytes.len()) };
    }

    /// Builds `cmd` in `slot` and hands it to firmware: encode into the entry and mailboxes, fill the entry, sign
    /// it, then ring the doorbell. This function owns the command doorbell sequence.
    pub fn post<C: Command>(&mut self, slot: u8, cmd: &C) -> Result<(), CmdError> {
        let (inlen, outlen) = (cmd.inlen(), cmd.outlen());
        // Both directions need at least their 8-byte header (opcode/op_mod in, status/syndrome out); several
        // outputs are only 12 bytes long (`enable_hca_out`).
        if inlen < 8 || outlen < 8 {
            return Err(CmdError::BadLength { inlen, outlen });
        }
        let si = slot as usize;
        if si >= self.num_slots() {
            return Err(CmdError::BadSlot { slot });
        }
        let eoff = self.entry_off(slot);
        if self.slots[si].posted.is_some() {
            // A command that timed out may have come back since; only then is the slot free again.
            if self.page.read_volatile_u8(eoff + lay::STATUS_OWN.off) & consts::CMD_OWNER_HW != 0 {
                return Err(CmdError::SlotBusy { slot });
            }
            self.slots[si].posted = None;
        }
        let (nin, nout) = (nblocks(inlen), nblocks(outlen));
        self.ensure_blocks(si, nin, false)?;
        self.ensure_blocks(si, nout, true)?;
        let token = self.next_token();
        let page = self.page.view();
        page.zero(eoff, lay::SIZE);
        let (in_mb, out_mb) =
            (self.slots[si].in_mb.as_ref().map(DmaRegion::view), self.slots[si].out_mb.as_ref().map(DmaRegion::view));
        if let Some(r) = in_mb.filter(|_| nin > 0) {
            Self::link_blocks(&r, nin, token);
        }
        if let Some(r) = out_mb.filter(|_| nout > 0) {
            Self::link_blocks(&r, nout, token);
        }
        let mut msg = ChainMsg { entry: page, inline_off: eoff + lay::IN.off, blocks: in_mb, len: inlen };
        cmd.encode(&mut msg);
        let opcode = msg.get(ifc::mbox_in::OPCODE) as u16;
        let op_mod = msg.get(ifc::mbox_in::OP_MOD) as u16;
        if self.down {
            return Err(CmdError::DeviceDown { opcode: Opcode::from_raw(opcode) });
        }

        page.write_volatile_u8(eoff + lay::TYPE.off, consts::MLX5_PCI_CMD_XPORT);
        Self::write_be(&page, eoff + lay::INLEN.off, &(inlen as u32).to_be_bytes());
        Self::write_be(&page, eoff + lay::OUTLEN.off, &(outlen as u32).to_be_bytes());
        if let Some(r) = in_mb.filter(|_| nin > 0) {
            Self::write_be(&page, eoff + lay::IN_PTR.off, &r.iova().to_be_bytes());
        }
        if let Some(r) = out_mb.filter(|_| nout > 0) {
            Self::write_be(&page, eoff + lay::OUT_PTR.off, &r.iova().to_be_bytes());
        }
        page.write_volatile_u8(eoff + lay::TOKEN.off, token);
        if self.checksum {
            if let Some(r) = in_mb.filter(|_| nin > 0) {
                Self::sign_blocks(&r, nin);
            }
            if let Some(r) = out_mb.filter(|_| nout > 0) {
                Self::sign_blocks(&r, nout);
            }
        }
        page.write_volatile_u8(eoff + lay::STATUS_OWN.off, consts::CMD_OWNER_HW);
        // `set_signature`: always, with `sig` still zero, so the XOR of the whole entry comes out 0xff.
        let sig = !xor8(&page, eoff, lay::SIZE);
        page.write_volatile_u8(eoff + lay::SIG.off, sig);

        self.slots[si].posted = Some(Posted { opcode, op_mod, inlen, outlen, token });
        self.slots[si].waited_us = 0;
        // The entry and every mailbox block must be visible to the device before the doorbell hands them over.
        self.mmio.wmb();
        // Only this slot's bit: the doorbell is write-only, never read-modify-written.
        self.mmio.write32(iseg::CMD_DBELL.off, 1u32 << slot);
        Ok(())
    }

    /// Whether firmware has handed `slot` back. Never blocks.
    pub fn poll(&self, slot: u8) -> bool {
        let si = slot as usize;
        if si >= self.num_slots() || self.slots[si].posted.is_none() {
            return false;
        }
        let own = self.page.read_volatile_u8(self.entry_off(slot) + lay::STATUS_OWN.off);
        if own & consts::CMD_OWNER_HW != 0 {
            return false;
        }
        // Ownership came back: the output must be read only after this load.
        self.mmio.dma_rmb();
        true
    }

    /// Reads the result of a command firmware has handed back (after [`CmdQueue::poll`] returned true).
    pub fn finish<C: Command>(&mut self, slot: u8, cmd: &mut C) -> Result<C::Output, CmdError> {
        let si = slot as usize;
        let posted = self.slots.get(si).and_then(|s| s.posted).ok_or(CmdError::BadSlot { slot })?;
        if !self.poll(slot) {
            return Err(CmdError::SlotBusy { slot });
        }
        self.slots[si].posted = None;
        let eoff = self.entry_off(slot);
        let page = self.page.view();
        let (in_mb, out_mb) =
            (self.slots[si].in_mb.as_ref().map(DmaRegion::view), self.slots[si].out_mb.as_ref().map(DmaRegion::view));
        let opcode = Opcode::from_raw(posted.opcode);
        let delivery = DeliveryStatus::from_raw(page.read_volatile_u8(eoff + lay::STATUS_OWN.off) >> 1);
        let sig_ok = !self.checksum
            || (xor8(&page, eoff, lay::SIZE) == 0xff
                && out_mb.is_none_or(|r| Self::blocks_ok(&r, nblocks(posted.outlen))));
        let input = ChainMsg { entry: page, inline_off: eoff + lay::IN.off, blocks: in_mb, len: posted.inlen };
        let output = ChainMsg { entry: page, inline_off: eoff + lay::OUT.off, blocks: out_mb, len: posted.outlen };
        let (status, syndrome) = (output.get(ifc::mbox_out::STATUS) as u8, output.get(ifc::mbox_out::SYNDROME));
        let outcome = if delivery != DeliveryStatus::Ok {
            CmdOutcome::Delivery(delivery)
        } else if !sig_ok {
            CmdOutcome::BadSignature
        } else {
            CmdOutcome::Completed { status: CmdStatus::from_raw(status), syndrome }
        };
        self.trace.record(&CmdRecord {
            slot,
            token: posted.token,
            opcode,
            op_mod: posted.op_mod,
            input: &input,
            output: Some(&output),
            outcome,
            waited_us: self.slots[si].waited_us,
        });
        match outcome {
            CmdOutcome::Delivery(status) => Err(CmdError::Delivery { opcode, status }),
            CmdOutcome::BadSignature => Err(CmdError::BadSignature { opcode }),
            CmdOutcome::Completed { status, syndrome } if status != CmdStatus::Ok => {
                Err(CmdError::Status { opcode, op_mod: posted.op_mod, status, syndrome })
            }
            _ => cmd.decode(&output),
        }
    }

    /// Waits a little for `slot` (one backoff step) and reports whether the timeout has passed.
    /// Backoff starts at 10 µs and doubles up to 1 ms, so a fast firmware answers fast and a slow one is not hammered.
    pub fn wait_step(&mut self, slot: u8, delay: &mut impl DelayNs) -> Result<(), CmdError> {
        let si = slot as usize;
        let Some(posted) = self.slots.get(si).and_then(|s| s.posted) else {
            return Err(CmdError::BadSlot { slot });
        };
        let waited = self.slots[si].waited_us;
        if waited >= u64::from(self.timeout_ms) * 1000 {
            let opcode = Opcode::from_raw(posted.opcode);
            self.trace_timeout(slot, posted);
            return Err(CmdError::Timeout { opcode, waited_ms: (waited / 1000) as u32 });
        }
        let step = (POLL_START_US as u64).max(waited).min(POLL_MAX_US as u64) as u32;
        delay.delay_us(step);
        self.slots[si].waited_us = waited + u64::from(step);
        Ok(())
    }

    fn trace_timeout(&mut self, slot: u8, posted: Posted) {
        let page = self.page.view();
        let eoff = self.entry_off(slot);
        let in_mb = self.slots[slot as usize].in_mb.as_ref().map(DmaRegion::view);
        let input = ChainMsg { entry: page, inline_off: eoff + lay::IN.off, blocks: in_mb, len: posted.inlen };
        self.trace.record(&CmdRecord {
            slot,
            token: posted.token,
            opcode: Opcode::from_raw(posted.opcode),
            op_mod: posted.op_mod,
            input: &input,
            output: None,
            outcome: CmdOutcome::Timeout,
            waited_us: self.slots[slot as usize].waited_us,
        });
    }

    /// Runs `cmd` to completion on `slot`, calling `on_wait` between polls (to serve page requests from the EQ
    /// on the pages slot while this command waits, as a physical function must).
    pub fn exec_on<C: Command>(
        &mut self,
        slot: u8,
        cmd: &mut C,
        delay: &mut impl DelayNs,
        on_wait: &mut dyn FnMut(&mut Self, &mut dyn DelayNs) -> Result<(), CmdError>,
    ) -> Result<C::Output, CmdError> {
        self.post(slot, cmd)?;
        while !self.poll(slot) {
            on_wait(self, delay)?;
            if self.poll(slot) {
                break;
            }
            self.wait_step(slot, delay)?;
        }
        self.finish(slot, cmd)
    }

    /// Runs `cmd` to completion: MANAGE_PAGES on the reserved last slot, everything else on slot 0.
    pub fn exec<C: Command>(&mut self, cmd: &mut C, delay: &mut impl DelayNs) -> Result<C::Output, CmdError> {
        let kind = if cmd.opcode() == Opcode::ManagePages { SlotKind::Pages } else { SlotKind::Regular };
        let slot = self.slot(kind);
        self.exec_on(slot, cmd, delay, &mut |_, _| Ok(()))
    }
}

impl<M: Mmio, D: Dma, T: CmdTrace> Drop for CmdQueue<M, D, T> {
    fn drop(&mut self) {
        // Memory firmware may still write is leaked rather than freed: a late completion would otherwise land in
        // memory that belongs to someone else.
        if self.slots.iter().any(|s| s.posted.is_some()) && !self.down {
            return;
        }
        for s in &mut self.slots {
            for r in [s.in_mb.take(), s.out_mb.take()].into_iter().flatten() {
                // SAFETY: allocated by this allocator; no command is outstanding, so firmware does not touch it.
                unsafe { self.dma.free(r) };
            }
        }
        // SAFETY: `drop` runs once and nothing reads `self.page` after this, so taking it out is sound.
        let page = unsafe { ManuallyDrop::take(&mut self.page) };
        // SAFETY: as above; the caller disables the function (or the device is gone) before dropping the queue.
        unsafe { self.dma.free(page) };
    }
}

impl core::error::Error for CmdError {}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::iseg_timeout_ms;

    #[test]
    fn iseg_timeouts_carry_their_unit() {
        assert_eq!(iseg_timeout_ms(1234), 1234);
        assert_eq!(iseg_timeout_ms((1 << 29) | 60), 60_000);
        assert_eq!(iseg_timeout_ms((2 << 29) | 2), 120_000);
        assert_eq!(iseg_timeout_ms((3 << 29) | 1), 3_600_000);
        // Bits 20..28 are not part of the value; the multiplier is taken modulo 4.
        assert_eq!(iseg_timeout_ms((7 << 29) | (1 << 20) | 5), 5 * 3_600_000);
    }
}
