//! The mock device: the initialization segment's registers and the command queue (through [`Mmio`]) over an
//! arena of device-visible memory it hands out itself (through [`Dma`]). A rung doorbell makes it read the entry
//! and its mailboxes, match the command against the next expectation, and write the expected reply.

use core::cell::{Cell, RefCell};
use core::fmt::Write;
use core::ptr::NonNull;

use crate::cmdq::{BLOCK_DATA, BLOCK_STRIDE, INLINE_LEN};
use crate::eq::{Eqe, Event, EQE_SIZE};
use crate::hal::{Dma, DmaError, DmaRegion, Mmio};
use crate::prm::{c, ifc, CmdStatus, DeliveryStatus, EventType, MsgBuf, Opcode};

use super::expect::{Ending, Expect, Reply};
use super::names::{command_layout, name_at, read_bits, resolve, write_bits};
use super::{op_str, Message, MockError};

use c::mlx5_cmd_layout as lay;
use c::mlx5_cmd_prot_block as blk;
use c::mlx5_init_seg as iseg;

/// Bus address of the arena's first aligned byte: above 4 GiB, so the queue's high address word is exercised, and
/// never equal to a CPU address, so a driver that hands the device a CPU address is caught.
pub const IOVA_BASE: u64 = 0x10_0000_0000;
/// The largest alignment the arena serves (the command queue page, EQ and firmware pages).
pub const MAX_ALIGN: usize = 4096;
/// Commands not named in the script that [`MockDevice::allow_any`] can answer.
pub const MAX_ALLOWED: usize = 8;
/// The syndrome of the `BAD_OP` status an unexpected command is answered with ("mock" in ASCII), so the code under
/// test fails fast instead of waiting.
pub const UNEXPECTED_SYNDROME: u32 = 0x6d6f_636b;
/// Commands that can wait for a page request to be served at once.
const MAX_PENDING: usize = 4;
/// Runs of contiguous firmware pages the mock remembers as given (the core gives pages in 64-page chunks).
pub const MAX_PAGE_RUNS: usize = 64;

/// The registers the mock device reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MockConfig {
    /// Firmware version (major, minor, subminor).
    pub fw_rev: (u16, u16, u16),
    /// log2 of the command queue's slots.
    pub log_cmdq_size: u8,
    /// log2 of the slot stride.
    pub log_cmdq_stride: u8,
    /// `cmd_exec_to` (and `cmd_q_init_to`) in milliseconds: how long the driver waits before a command times out.
    pub cmd_timeout_ms: u32,
}

impl Default for MockConfig {
    fn default() -> Self {
        Self { fw_rev: (16, 35, 1000), log_cmdq_size: 5, log_cmdq_stride: 6, cmd_timeout_ms: 1000 }
    }
}

/// The EQ that takes page requests (learned from CREATE_EQ), and how many EQEs the mock wrote to it.
#[derive(Debug, Clone, Copy)]
struct PagesEq {
    iova: u64,
    log_nent: u8,
    produced: u32,
}

struct State<'a, const N: usize> {
    script: heapless::Vec<Expect<'a>, N>,
    next: usize,
    allowed: heapless::Vec<(Opcode, Reply<'a>), MAX_ALLOWED>,
    first: Option<Message>,
    too_many: bool,
    cmdq_h: u32,
    cmdq: Option<u64>,
    pending: heapless::Vec<u8, MAX_PENDING>,
    pages_eq: Option<PagesEq>,
    /// Firmware pages given and not taken back, as (first bus address, pages) runs.
    held: heapless::Vec<(u64, u32), MAX_PAGE_RUNS>,
    commands: usize,
}

impl<const N: usize> State<'_, N> {
    /// Keeps the first problem: later ones are usually its consequences.
    fn note(&mut self, msg: Message) {
        if self.first.is_none() {
            self.first = Some(msg);
        }
    }
}

/// An expectation mock of an mlx5 function's command interface, for `N` expected commands and `R` live DMA
/// regions. Use it by reference as both the [`Mmio`] and the [`Dma`] of the code under test:
/// `Hca::bring_up(&dev, &dev, (), &mut delay, cfg)`.
///
/// Its memory is an arena the caller lends for the rest of the program (`&'static mut`: a `static` buffer on a
/// microcontroller, a leaked one in a host test), so every region handed out stays valid as [`Dma`] requires;
/// [`MockDevice::release`] gives it back once every region was freed.
pub struct MockDevice<'a, const N: usize = 64, const R: usize = 128> {
    cfg: MockConfig,
    state: RefCell<State<'a, N>>,
    heartbeat: Cell<u32>,
    arena: NonNull<u8>,
    arena_len: usize,
    /// Offset of the first byte aligned to [`MAX_ALIGN`] (bus address [`IOVA_BASE`]).
    base: usize,
    /// Live regions as (offset, length), sorted by offset.
    live: RefCell<heapless::Vec<(usize, usize), R>>,
    allocs: Cell<usize>,
    /// Allocations left before the next one fails ([`MockDevice::limit_allocations`]); `None`: no limit.
    alloc_budget: Cell<Option<usize>>,
}

impl<const N: usize, const R: usize> core::fmt::Debug for MockDevice<'_, N, R> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        let st = self.state.borrow();
        f.debug_struct("MockDevice")
            .field("expected", &st.script.len())
            .field("matched", &st.next)
            .field("first_unexpected", &st.first)
            .field("live_regions", &self.live.borrow().len())
            .finish_non_exhaustive()
    }
}

impl<'a, const N: usize, const R: usize> MockDevice<'a, N, R> {
    /// A mock over `arena` with the default registers.
    pub fn new(arena: &'static mut [u8]) -> Self {
        Self::with_config(MockConfig::default(), arena)
    }

    /// A mock over `arena` with these registers.
    pub fn with_config(cfg: MockConfig, arena: &'static mut [u8]) -> Self {
        let len = arena.len();
        let ptr = NonNull::from(arena).cast::<u8>();
        let base = (MAX_ALIGN - (ptr.as_ptr() as usize) % MAX_ALIGN) % MAX_ALIGN;
        Self {
            cfg,
            state: RefCell::new(State {
                script: heapless::Vec::new(),
                next: 0,
                allowed: heapless::Vec::new(),
                first: None,
                too_many: false,
                cmdq_h: 0,
                cmdq: None,
                pending: heapless::Vec::new(),
                pages_eq: None,
                held: heapless::Vec::new(),
                commands: 0,
            }),
            heartbeat: Cell::new(0),
            arena: ptr,
            arena_len: len,
            base: base.min(len),
            live: RefCell::new(heapless::Vec::new()),
            allocs: Cell::new(0),
            alloc_budget: Cell::new(None),
        }
    }

    /// Appends an expected command to the script (usable while the code under test holds the mock).
    pub fn expect(&self, e: Expect<'a>) -> &Self {
        let mut st = self.state.borrow_mut();
        if st.script.push(e).is_err() {
            st.too_many = true;
        }
        self
    }

    /// Appends every expectation of `it`.
    pub fn expect_all(&self, it: impl IntoIterator<Item = Expect<'a>>) -> &Self {
        for e in it {
            self.expect(e);
        }
        self
    }

    /// Answers `opcode` with `reply` whenever the script's next expectation is another command. Only for commands
    /// a test does not care about: everything else not in the script is a mismatch.
    pub fn allow_any(&self, opcode: Opcode, reply: Reply<'a>) -> &Self {
        let mut st = self.state.borrow_mut();
        if let Some(slot) = st.allowed.iter_mut().find(|(o, _)| *o == opcode) {
            slot.1 = reply;
        } else if st.allowed.push((opcode, reply)).is_err() {
            st.too_many = true;
        }
        self
    }

    /// Ok when every expectation was met in order and nothing unexpected came; otherwise the first unexpected
    /// command (`CREATE_CQ: cq_context.log_cq_size expected 10, got 11`), or what was left
    /// (`2 expectations left: DESTROY_CQ, DEALLOC_PD`).
    pub fn done(&self) -> Result<(), MockError> {
        let st = self.state.borrow();
        if st.too_many {
            let mut m = Message::new();
            let _ = write!(m, "more than {N} expectations (or {MAX_ALLOWED} allowed commands) given");
            return Err(MockError::Unexpected(m));
        }
        if let Some(m) = &st.first {
            return Err(MockError::Unexpected(m.clone()));
        }
        let left = &st.script[st.next..];
        if left.is_empty() {
            return Ok(());
        }
        let mut names = Message::new();
        for (i, e) in left.iter().enumerate() {
            let sep = if i == 0 { "" } else { ", " };
            let before = names.len();
            if write!(names, "{sep}{}", op_str(e.opcode)).is_err() || names.len() + 5 > names.capacity() {
                names.truncate(before);
                let _ = names.push_str(", ...");
                break;
            }
        }
        Err(MockError::Left { count: left.len(), names })
    }

    /// [`MockDevice::done`] for tests: panics with its message, as embedded-hal-mock's `done()` does.
    #[track_caller]
    pub fn assert_done(&self) {
        if let Err(e) = self.done() {
            panic!("{e}");
        }
    }

    /// Expectations met so far (the script's position).
    pub fn matched(&self) -> usize {
        self.state.borrow().next
    }

    /// Commands the device received (expected or not).
    pub fn commands(&self) -> usize {
        self.state.borrow().commands
    }

    /// The first unexpected command's message, if any.
    pub fn first_unexpected(&self) -> Option<Message> {
        self.state.borrow().first.clone()
    }

    /// Firmware pages the mock holds (given by MANAGE_PAGES and not taken back).
    pub fn pages_held(&self) -> usize {
        self.state.borrow().held.iter().map(|&(_, k)| k as usize).sum()
    }

    /// DMA regions allocated and not freed.
    pub fn live_regions(&self) -> usize {
        self.live.borrow().len()
    }

    /// DMA regions allocated so far.
    pub fn allocations(&self) -> usize {
        self.allocs.get()
    }

    /// Lets `n` more allocations succeed and fails every one after them with [`DmaError::NoMemory`] (`None`: no
    /// limit, the default), so a test can fail each allocation of a create path in turn. An allocation refused for
    /// its alignment does not count.
    pub fn limit_allocations(&self, n: Option<usize>) {
        self.alloc_budget.set(n);
    }

    /// The arena back, when no region is live (so nothing can reach it any more); otherwise the mock itself.
    pub fn release(self) -> Result<&'static mut [u8], Self> {
        if !self.live.borrow().is_empty() {
            return Err(self);
        }
        // SAFETY: the pointer and length came from a `&'static mut [u8]` given to `with_config`, which this mock
        // held exclusively; no region into it is live, and the mock is consumed, so nothing else reaches it.
        Ok(unsafe { core::slice::from_raw_parts_mut(self.arena.as_ptr(), self.arena_len) })
    }

    /// The arena offset of `len` bytes at bus address `iova`, when they lie inside the arena.
    fn at(&self, iova: u64, len: usize) -> Option<usize> {
        let rel = usize::try_from(iova.checked_sub(IOVA_BASE)?).ok()?;
        let off = self.base.checked_add(rel)?;
        (off.checked_add(len)? <= self.arena_len).then_some(off)
    }

    fn read(&self, off: usize, out: &mut [u8]) {
        debug_assert!(off + out.len() <= self.arena_len);
        // SAFETY: the range is inside the arena (every caller gets `off` from `at` with this length). The driver
        // does not hold references into these bytes across the MMIO call that runs the device (single thread).
        unsafe { core::ptr::copy_nonoverlapping(self.arena.as_ptr().add(off), out.as_mut_ptr(), out.len()) };
    }

    fn write(&self, off: usize, data: &[u8]) {
        debug_assert!(off + data.len() <= self.arena_len);
        // SAFETY: as in `read`.
        unsafe { core::ptr::copy_nonoverlapping(data.as_ptr(), self.arena.as_ptr().add(off), data.len()) };
    }

    fn init_seg_word(&self, off: usize) -> u32 {
        let st = self.state.borrow();
        let (major, minor, sub) = self.cfg.fw_rev;
        let to = self.cfg.cmd_timeout_ms.min(0xf_ffff);
        match off {
            _ if off == iseg::FW_REV.off => {
                let mut w = [0u8; 4];
                w.set(ifc::initial_seg::FW_REV_MAJOR, major.into());
                w.set(ifc::initial_seg::FW_REV_MINOR, minor.into());
                u32::from_be_bytes(w)
            }
            _ if off == iseg::CMDIF_REV_FW_SUB.off => (crate::cmdq::CMD_IF_REV << 16) | u32::from(sub),
            _ if off == iseg::CMDQ_ADDR_H.off => st.cmdq_h,
            _ if off == iseg::CMDQ_ADDR_L_SZ.off => {
                let low = st.cmdq.map_or(0, |a| a as u32 & !0xfff);
                low | u32::from(self.cfg.log_cmdq_size & 0xf) << 4 | u32::from(self.cfg.log_cmdq_stride & 0xf)
            }
            _ if off == iseg::CMD_EXEC_TO.off || off == iseg::CMD_Q_INIT_TO.off => to,
            _ if off == iseg::HEALTH_COUNTER.off => {
                // The heartbeat moves on every read, so health polls during long waits (a timeout) never stall.
                let hb = self.heartbeat.get().wrapping_add(1);
                self.heartbeat.set(hb);
                hb & 0x00ff_ffff
            }
            // `initializing` clear, healthy, doorbell reads zero, UAR pages read zero.
            _ => 0,
        }
    }

    /// Runs the command of `slot` after its doorbell.
    fn ring(&self, slot: u8) {
        let mut st = self.state.borrow_mut();
        st.commands += 1;
        let Some(q) = st.cmdq else {
            st.note(msg(format_args!("doorbell for slot {slot} before the command queue address was written")));
            return;
        };
        if slot >= 1 << self.cfg.log_cmdq_size {
            st.note(msg(format_args!("doorbell for slot {slot}, past the queue")));
            return;
        }
        let Some(e) = self.at(q + (u64::from(slot) << self.cfg.log_cmdq_stride), lay::SIZE) else {
            st.note(msg(format_args!("command queue at {q:#x} is outside the mock's memory")));
            return;
        };
        let mut entry = [0u8; lay::SIZE];
        self.read(e, &mut entry);
        let own = e + lay::STATUS_OWN.off;
        if entry[lay::STATUS_OWN.off] & 1 == 0 {
            st.note(msg(format_args!("doorbell for slot {slot}, whose entry software still owns")));
            return;
        }
        let be32 = |b: crate::prm::Bytes| u32::from_be_bytes(entry[b.off..b.off + 4].try_into().unwrap_or([0; 4]));
        let be64 = |b: crate::prm::Bytes| u64::from_be_bytes(entry[b.off..b.off + 8].try_into().unwrap_or([0; 8]));
        let (inlen, outlen) = (be32(lay::INLEN) as usize, be32(lay::OUTLEN) as usize);
        let input = Chain { dev: self, inline: e + lay::IN.off, first: be64(lay::IN_PTR), len: inlen };
        let mut output = Chain { dev: self, inline: e + lay::OUT.off, first: be64(lay::OUT_PTR), len: outlen };
        let delivery = if inlen < 8 {
            Some(DeliveryStatus::InLength)
        } else if outlen < 8 {
            Some(DeliveryStatus::OutLength)
        } else if !input.valid() || !output.valid() {
            Some(DeliveryStatus::BadBlkNum)
        } else {
            None
        };
        if let Some(d) = delivery {
            st.note(msg(format_args!("slot {slot}: malformed entry (inlen {inlen}, outlen {outlen})")));
            self.write(own, &[d.raw() << 1]);
            return;
        }
        let opcode = Opcode::from_raw(input.get(ifc::mbox_in::OPCODE) as u16);
        let op_mod = input.get(ifc::mbox_in::OP_MOD) as u16;
        let reply = decide(&mut st, opcode, op_mod, &input);
        let earlier = core::mem::take(&mut st.pending);
        match reply.ending {
            Ending::Timeout => {}
            Ending::Delivery(d) => self.write(own, &[d.raw() << 1]),
            Ending::Complete => {
                write_reply(&mut st, opcode, &reply, &mut output);
                let ok = output.get(ifc::mbox_out::STATUS) == 0;
                let mut new_pages_eq = false;
                if opcode == Opcode::CreateEq && ok {
                    new_pages_eq = observe_eq(&mut st, &input);
                }
                if opcode == Opcode::ManagePages && ok {
                    manage_pages(&mut st, op_mod, reply.give_back, &input, &mut output);
                }
                match reply.page_request {
                    // The CREATE_EQ of the pages EQ itself completes at once: the driver learns of the EQ only
                    // from its answer, and drains it right after (Linux serves its regular pages then).
                    Some((func, num)) if self.post_page_request(&mut st, opcode, func, num) && !new_pages_eq => {
                        // Completes after the driver's next command (its MANAGE_PAGES answer).
                        let _ = st.pending.push(slot);
                    }
                    _ => self.write(own, &[0]),
                }
            }
        }
        for s in earlier {
            if let Some(e) = self.at(q + (u64::from(s) << self.cfg.log_cmdq_stride), lay::SIZE) {
                self.write(e + lay::STATUS_OWN.off, &[0]);
            }
        }
    }

    /// Writes a page-request EQE to the EQ that takes them; false when there is none.
    fn post_page_request(&self, st: &mut State<'a, N>, op: Opcode, func: u16, num: i32) -> bool {
        let Some(eq) = st.pages_eq.as_mut() else {
            st.note(msg(format_args!("{}: page request before an EQ takes page requests", op_str(op))));
            return false;
        };
        let idx = eq.produced & ((1 << eq.log_nent) - 1);
        let owner = ((eq.produced >> eq.log_nent) & 1) as u8;
        let Some(at) = self.at(eq.iova + u64::from(idx) * EQE_SIZE as u64, EQE_SIZE) else {
            st.note(msg(format_args!("{}: the pages EQ lies outside the mock's memory", op_str(op))));
            return false;
        };
        eq.produced = eq.produced.wrapping_add(1);
        let e = Eqe::emit(&Event::PageRequest { function_id: func, ec_function: false, num_pages: num });
        let own = c::mlx5_eqe::OWNER.off;
        self.write(at, &e.0[..own]);
        self.write(at + own + 1, &e.0[own + 1..]);
        // The owner byte last: it hands the entry to software.
        self.write(at + own, &[owner]);
        true
    }
}

fn msg(args: core::fmt::Arguments<'_>) -> Message {
    let mut m = Message::new();
    let _ = m.write_fmt(args);
    m
}

/// The reply for a command: the next expectation's when the opcode matches (a field that differs is noted, the
/// scripted reply still goes back so the rest of the script lines up), an allowed command's, or `BAD_OP`.
fn decide<'a, const N: usize, B: MsgBuf + ?Sized>(
    st: &mut State<'a, N>,
    opcode: Opcode,
    op_mod: u16,
    input: &B,
) -> Reply<'a> {
    if let Some(exp) = st.script.get(st.next).filter(|e| e.opcode == opcode).cloned() {
        st.next += 1;
        if let Err(m) = check(&exp, op_mod, input) {
            st.note(m);
        }
        if exp.reply.overflow {
            st.note(msg(format_args!("{}: more than {} reply fields", op_str(opcode), super::MAX_FIELDS)));
        }
        return exp.reply;
    }
    if let Some((_, r)) = st.allowed.iter().find(|(o, _)| *o == opcode) {
        return r.clone();
    }
    let m = match st.script.get(st.next) {
        Some(exp) => msg(format_args!("expected {}, got {}", op_str(exp.opcode), op_str(opcode))),
        None => msg(format_args!("expected no more commands, got {}", op_str(opcode))),
    };
    st.note(m);
    Reply::ok().status(CmdStatus::BadOp, UNEXPECTED_SYNDROME)
}

/// Compares a command with its expectation; the message names the first field that differs.
fn check<B: MsgBuf + ?Sized>(exp: &Expect<'_>, op_mod: u16, input: &B) -> Result<(), Message> {
    let op = op_str(exp.opcode);
    if exp.overflow {
        return Err(msg(format_args!("{op}: more than {} fields named", super::MAX_FIELDS)));
    }
    if let Some(want) = exp.op_mod.filter(|&m| m != op_mod) {
        return Err(msg(format_args!("{op}: op_mod expected {want}, got {op_mod}")));
    }
    let layout = command_layout(exp.opcode, "in");
    for &(path, want) in &exp.fields {
        let Some(l) = layout else {
            return Err(msg(format_args!("{op}: no input layout to find {path} in")));
        };
        let Some((off, width)) = resolve(l, path) else {
            return Err(msg(format_args!("{op}: {} has no field {path}", l.name)));
        };
        match read_bits(input, off, width) {
            Some(got) if got == want => {}
            Some(got) => return Err(msg(format_args!("{op}: {path} expected {want}, got {got}"))),
            None => return Err(msg(format_args!("{op}: {path} lies past the input's {} bytes", input.len()))),
        }
    }
    if let Some(want) = exp.input {
        if exp.prefix && want.len() > input.len() {
            return Err(msg(format_args!("{op}: input length expected at least {}, got {}", want.len(), input.len())));
        }
        if !exp.prefix && want.len() != input.len() {
            return Err(msg(format_args!("{op}: input length expected {}, got {}", want.len(), input.len())));
        }
        let mut got = [0u8; 64];
        for (k, w) in want.chunks(got.len()).enumerate() {
            let g = &mut got[..w.len()];
            input.read_bytes(k * 64, g);
            let mask = exp.mask.unwrap_or(&[]);
            let m = |j: usize| mask.get(k * 64 + j).copied().unwrap_or(0xff);
            let Some(i) = (0..w.len()).find(|&j| (w[j] ^ g[j]) & m(j) != 0) else { continue };
            let byte = k * 64 + i;
            let bit = byte as u32 * 8 + ((w[i] ^ g[i]) & m(i)).leading_zeros();
            let mut name: heapless::String<96> = heapless::String::new();
            if let Some((off, width)) = layout.and_then(|l| name_at(l, bit, &mut name)) {
                if let (Some(e), Some(v)) = (read_bits(want, off, width), read_bits(input, off, width)) {
                    return Err(msg(format_args!("{op}: {name} expected {e}, got {v}")));
                }
            }
            return Err(msg(format_args!("{op}: byte {byte:#x} expected {:#04x}, got {:#04x}", w[i], g[i])));
        }
    }
    Ok(())
}

/// Writes the reply into the output message: zeros, the whole recorded output, named fields, status, syndrome.
fn write_reply<const N: usize, B: MsgBuf + ?Sized>(st: &mut State<'_, N>, op: Opcode, r: &Reply<'_>, out: &mut B) {
    let zeros = [0u8; 64];
    let mut off = 0;
    while off < out.len() {
        let n = (out.len() - off).min(zeros.len());
        out.write_bytes(off, &zeros[..n]);
        off += n;
    }
    if let Some(bytes) = r.output {
        let n = bytes.len().min(out.len());
        out.write_bytes(0, &bytes[..n]);
    }
    let layout = command_layout(op, "out");
    for &(path, v) in &r.fields {
        let found = layout.and_then(|l| resolve(l, path));
        if !found.is_some_and(|(o, w)| write_bits(out, o, w, v)) {
            st.note(msg(format_args!("{}: no output field {path} to answer with", op_str(op))));
        }
    }
    if let Some(s) = r.status {
        out.set(ifc::mbox_out::STATUS, s.into());
    }
    if let Some(s) = r.syndrome {
        out.set(ifc::mbox_out::SYNDROME, s);
    }
}

/// Learns the EQ that takes page requests from a successful CREATE_EQ.
/// Returns whether it was one.
fn observe_eq<const N: usize, B: MsgBuf + ?Sized>(st: &mut State<'_, N>, input: &B) -> bool {
    let f = ifc::create_eq_in::EVENT_BITMASK.elem(0);
    let mask = read_bits(input, f.off, f.width).unwrap_or(0);
    if mask >> EventType::PageRequest.raw() & 1 == 0 {
        return false;
    }
    let pas = ifc::create_eq_in::PAS.elem(0);
    let log = ifc::eqc::LOG_EQ_SIZE.at(ifc::create_eq_in::EQ_CONTEXT_ENTRY);
    if let (Some(iova), Some(log_nent)) = (read_bits(input, pas.off, pas.width), read_bits(input, log.off, log.width)) {
        st.pages_eq = Some(PagesEq { iova, log_nent: log_nent as u8, produced: 0 });
        return true;
    }
    false
}

/// Remembers the pages a MANAGE_PAGES give handed over, and answers a take that asks for them back.
fn manage_pages<const N: usize, B: MsgBuf + ?Sized, O: MsgBuf + ?Sized>(
    st: &mut State<'_, N>,
    op_mod: u16,
    give_back: bool,
    input: &B,
    out: &mut O,
) {
    use ifc::{manage_pages_in as mi, manage_pages_out as mo};
    if op_mod == crate::prm::consts::MLX5_PAGES_GIVE {
        let n = input.get(mi::INPUT_NUM_ENTRIES);
        for i in 0..n {
            let f = mi::PAS.elem(i);
            let Some(addr) = read_bits(input, f.off, f.width) else { break };
            match st.held.last_mut() {
                Some((a, k)) if *a + u64::from(*k) * 4096 == addr => *k += 1,
                _ => {
                    if st.held.push((addr, 1)).is_err() {
                        st.note(msg(format_args!("MANAGE_PAGES: more than {MAX_PAGE_RUNS} runs of pages held")));
                        return;
                    }
                }
            }
        }
    } else if give_back {
        let room = (out.len().saturating_sub(mo::PAS.byte_off()) / 8) as u32;
        let want = input.get(mi::INPUT_NUM_ENTRIES).min(room);
        let mut n = 0;
        while n < want {
            let Some((a, k)) = st.held.last_mut() else { break };
            *k -= 1;
            let addr = *a + u64::from(*k) * 4096;
            if *k == 0 {
                st.held.pop();
            }
            let f = mo::PAS.elem(n);
            write_bits(out, f.off, f.width, addr);
            n += 1;
        }
        out.set(mo::OUTPUT_NUM_ENTRIES, n);
    }
}

/// A command message in the mock's memory: the entry's inline part, then the mailbox chain from `first`.
struct Chain<'d, 'a, const N: usize, const R: usize> {
    dev: &'d MockDevice<'a, N, R>,
    inline: usize,
    first: u64,
    len: usize,
}

impl<const N: usize, const R: usize> Chain<'_, '_, N, R> {
    fn blocks(&self) -> usize {
        self.len.saturating_sub(INLINE_LEN).div_ceil(BLOCK_DATA)
    }

    /// Arena offset of block `k`, following `next` pointers from the first (each checked to lie in the arena).
    fn block(&self, k: usize) -> Option<usize> {
        let mut at = self.dev.at(self.first, blk::SIZE)?;
        for _ in 0..k {
            let mut next = [0u8; 8];
            self.dev.read(at + blk::NEXT.off, &mut next);
            at = self.dev.at(u64::from_be_bytes(next), blk::SIZE)?;
        }
        Some(at)
    }

    /// Every block the length needs is reachable.
    fn valid(&self) -> bool {
        let n = self.blocks();
        n == 0 || self.block(n - 1).is_some()
    }

    /// Arena offset and contiguous run of message byte `off`.
    fn locate(&self, off: usize) -> (usize, usize) {
        assert!(off < self.len, "mock command message access past its length");
        if off < INLINE_LEN {
            return (self.inline + off, INLINE_LEN.min(self.len) - off);
        }
        let rel = off - INLINE_LEN;
        let (k, within) = (rel / BLOCK_DATA, rel % BLOCK_DATA);
        // `valid` was checked before any access, so every block is reachable.
        let at = self.block(k).unwrap_or(self.inline);
        (at + blk::DATA.off + within, (BLOCK_DATA - within).min(self.len - off))
    }
}

const _: () = assert!(BLOCK_STRIDE >= blk::SIZE);

impl<const N: usize, const R: usize> MsgBuf for Chain<'_, '_, N, R> {
    fn len(&self) -> usize {
        self.len
    }
    fn chunk(&self, off: usize) -> &[u8] {
        let (at, run) = self.locate(off);
        // SAFETY: `at..at + run` is inside the arena (`locate` only returns offsets `at` checked for a whole
        // entry or block). The slice lives while the device handles one doorbell, during which the driver, on
        // this one thread, is inside `Mmio::write32` and touches no device memory.
        unsafe { core::slice::from_raw_parts(self.dev.arena.as_ptr().add(at), run) }
    }
    fn chunk_mut(&mut self, off: usize) -> &mut [u8] {
        let (at, run) = self.locate(off);
        // SAFETY: as in `chunk`; `&mut self` makes this the only slice of these bytes the mock holds.
        unsafe { core::slice::from_raw_parts_mut(self.dev.arena.as_ptr().add(at), run) }
    }
}

impl<const N: usize, const R: usize> Mmio for MockDevice<'_, N, R> {
    fn read32(&self, off: usize) -> u32 {
        self.init_seg_word(off)
    }
    fn write32(&self, off: usize, v: u32) {
        if off == iseg::CMDQ_ADDR_H.off {
            self.state.borrow_mut().cmdq_h = v;
        } else if off == iseg::CMDQ_ADDR_L_SZ.off {
            let mut st = self.state.borrow_mut();
            st.cmdq = Some(u64::from(st.cmdq_h) << 32 | u64::from(v & !0xfff));
        } else if off == iseg::CMD_DBELL.off {
            for slot in 0..32u8 {
                if v >> slot & 1 != 0 {
                    self.ring(slot);
                }
            }
        }
        // Everything else (EQ doorbells in the UAR pages) is accepted and ignored: the mock checks commands.
    }
    fn read64(&self, _off: usize) -> u64 {
        0
    }
    fn write64(&self, _off: usize, _v: u64) {}
}

// SAFETY: regions lie inside the arena, a `&'static mut [u8]` this mock holds exclusively, so they stay valid for
// as long as anyone can hold them (the arena comes back only through `release`, when none is live). Live regions
// never overlap (first fit over the sorted list of live ranges), are zeroed here, and are aligned at both
// addresses: offsets are aligned relative to `base`, which is `MAX_ALIGN`-aligned in CPU space and maps to
// `IOVA_BASE`. The arena is ordinary memory the mock device reads and writes on the same thread: coherent.
unsafe impl<const N: usize, const R: usize> Dma for MockDevice<'_, N, R> {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        if !align.is_power_of_two() || align > MAX_ALIGN {
            return Err(DmaError::BadAlignment { align });
        }
        if self.alloc_budget.get() == Some(0) {
            return Err(DmaError::NoMemory { len });
        }
        let size = len.max(1);
        let mut live = self.live.borrow_mut();
        let mut cursor = self.base;
        let mut pos = live.len();
        for (i, &(o, l)) in live.iter().enumerate() {
            let start = self.base + (cursor - self.base).next_multiple_of(align);
            if start.checked_add(size).is_some_and(|end| end <= o) {
                pos = i;
                break;
            }
            cursor = cursor.max(o + l);
        }
        let start = self.base + (cursor - self.base).next_multiple_of(align);
        let fits = start.checked_add(size).is_some_and(|end| end <= self.arena_len);
        if pos == live.len() && !fits {
            return Err(DmaError::NoMemory { len });
        }
        if live.insert(pos, (start, size)).is_err() {
            return Err(DmaError::NoMemory { len });
        }
        self.allocs.set(self.allocs.get() + 1);
        self.alloc_budget.set(self.alloc_budget.get().map(|n| n - 1));
        let zeros = [0u8; 256];
        let mut off = 0;
        while off < size {
            let n = (size - off).min(zeros.len());
            self.write(start + off, &zeros[..n]);
            off += n;
        }
        // SAFETY: `start < arena_len` (checked above), so the pointer stays inside the arena.
        let cpu = unsafe { self.arena.add(start) };
        let iova = IOVA_BASE + (start - self.base) as u64;
        // SAFETY: see the impl's comment: inside the arena, live until freed, overlapping no other region.
        Ok(unsafe { DmaRegion::from_raw_parts(cpu, iova, len) })
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        let off = (cpu as usize).checked_sub(self.arena.as_ptr() as usize)?;
        let live = self.live.borrow();
        live.iter()
            .any(|&(o, l)| off >= o && off.checked_add(len).is_some_and(|e| e <= o + l))
            .then(|| IOVA_BASE + (off - self.base) as u64)
    }

    unsafe fn free(&self, region: DmaRegion) {
        let off = (region.cpu().as_ptr() as usize).wrapping_sub(self.arena.as_ptr() as usize);
        let mut live = self.live.borrow_mut();
        match live.iter().position(|&(o, _)| o == off) {
            Some(i) => {
                live.remove(i);
            }
            None => {
                drop(live);
                self.state.borrow_mut().note(msg(format_args!("free of a region this mock did not allocate")));
            }
        }
    }
}
