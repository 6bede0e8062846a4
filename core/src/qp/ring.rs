//! The QP itself ([`Qp`]): its buffer and host-only shadow bookkeeping, posting send and receive WQEs and ringing
//! the doorbell (rdma-core `mlx5_post_send` / `mlx5_post_recv`), and the WQE control segment.

use super::attr::{QpCap, QpState, QpType};
use super::size::{QpSizes, ATOMIC, BB, CTRL, DATA, DGRAM, DS, INL_HDR, RADDR};
use super::wr::{InlineData, PostError, PostErrorKind, RecvWr, RecvWrView, SendFlags, SendOp, SendWr, SendWrView, Sge};
use crate::buf::QueueBuf;
use crate::cq::{WcOpcode, WcStatus, WorkCompletion, WrTable};
use crate::dbr::DbRec;
use crate::hal::{DmaRegion, Mmio, Span};
use crate::prm::{c, consts, Bytes};
use crate::uar::BfReg;
use core::borrow::Borrow;

/// even if a device wrote over the array (it is DMA memory the device could reach).
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
struct SqSlot {
    wr_id: u64,
    /// `head` after this WQE: a completion of it retires every WQE before it (`wqe_head`).
    head_after: u32,
    /// `cur_post` after this WQE: where the next WQE starts (`w_list[].next`), so a software flush can walk the
    /// outstanding WQEs in order.
    next: u32,
}

/// The control segment's `fm_ce_se` for each combination of the send flags it carries (`SendFlags`' FENCE,
/// SIGNALED, SOLICITED: the low three bits), looked up instead of three tests per WQE.
const FM_CE_SE: [u8; 8] = {
    let mut t = [0u8; 8];
    let mut i = 0;
    while i < 8 {
        let f = i as u32;
        if f & SendFlags::FENCE.0 != 0 {
            t[i] |= consts::MLX5_WQE_CTRL_FENCE;
        }
        if f & SendFlags::SIGNALED.0 != 0 {
            t[i] |= consts::MLX5_WQE_CTRL_CQ_UPDATE;
        }
        if f & SendFlags::SOLICITED.0 != 0 {
            t[i] |= consts::MLX5_WQE_CTRL_SOLICITED;
        }
        i += 1;
    }
    t
};
const _: () = assert!((SendFlags::FENCE.0 | SendFlags::SIGNALED.0 | SendFlags::SOLICITED.0) == 7);

/// See [`Qp::sq_win`]. Lives only inside one `post_send` call, while the QP is borrowed. `Copy`: the rarer
/// segments' out-of-line writers take it by value, so the hot loop never needs it in memory.
#[derive(Clone, Copy)]
struct SqWin {
    flat: Option<core::ptr::NonNull<u8>>,
    ds_mask: usize,
    slots: *mut SqSlot,
    slot_mask: u32,
    max_send_wr: u32,
    max_send_sge: u32,
}

/// Alignment and length granule of a queue's shadow array: a CPU cache line, so the shadows of two queues used
/// from two threads never share one.
pub const SHADOW_ALIGN: usize = crate::buf::CACHE_LINE;

// `Qp` and `Cq` are aligned to the same line by `repr(align(64))`, which takes only a literal.
const _: () = assert!(core::mem::align_of::<Qp>() == SHADOW_ALIGN);

/// A created queue pair: its rings, doorbell record, BlueFlame register and work-request bookkeeping.
///
/// Aligned to a cache line ([`SHADOW_ALIGN`]), so its counters never share a line with another object, wherever
/// the caller keeps it (two QPs side by side in a `Vec`, each posted from its own thread).
#[derive(Debug)]
#[repr(align(64))]
pub struct Qp {
    pub(crate) buf: QueueBuf,
    pub(crate) dbrec: DbRec,
    /// Host-only shadow: `sq_wqe_cnt` `SqSlot`s, then `rq_wqe_cnt` receive wr_ids.
    pub(crate) shadow: DmaRegion,
    qpn: u32,
    ty: QpType,
    pub(crate) state: QpState,
    sizes: QpSizes,
    sq_offset: usize,
    /// SQ producer counter in BBs (`cur_post`); the low 16 bits go into WQEs and the doorbell record.
    sq_cur_post: u32,
    /// WQEs posted and retired (`sq.head`, `sq.tail`).
    sq_head: u32,
    sq_tail: u32,
    /// `cur_post` of the oldest outstanding WQE (`sq.last_poll`).
    sq_tail_bb: u32,
    rq_head: u32,
    rq_tail: u32,
    /// The CQs the send and receive queues complete on.
    cqn_snd: u32,
    cqn_rcv: u32,
    /// The protection domain, sent with every modify.
    pub(crate) pd: u32,
    /// The remote access rights and responder depth of the last modify that set them (`trans_qp.atomic_rd_en`,
    /// `trans_qp.resp_depth`): a modify that sets only one of them sends the other as stored.
    pub(crate) access: crate::mkey::Access,
    pub(crate) resp_depth: u8,
    /// The port the last modify with a port named (`qp->port`): every address path goes out on it.
    pub(crate) port: u8,
    bf: BfReg,
    sig_all: bool,
    /// The SQ as one region when it lies inside one fragment of `buf` (the usual case): a WQE segment's address
    /// is then a mask and an add instead of a fragment lookup. `None`: every access goes through `buf`.
    sq_flat: Option<Span>,
    /// The RQ likewise.
    rq_flat: Option<Span>,
    /// The SRQ the QP receives through (it then has no receive queue of its own).
    pub(crate) srqn: Option<u32>,
}

/// `len` bytes at `off` of `buf` as one span, when they lie inside one fragment. The QP keeps the span beside the
/// buffer it owns, so the fragment lives as long as the span is used.
fn flat_span(buf: &QueueBuf, off: usize, len: usize) -> Option<Span> {
    if len == 0 || off.checked_add(len)? > buf.len() {
        return None;
    }
    let (r, o) = buf.locate(off);
    r.slice(o, len).map(Span::of)
}

impl Qp {
    /// Bytes of the shadow array for `sizes`, rounded up to whole cache lines ([`SHADOW_ALIGN`]).
    pub fn shadow_len(sizes: &QpSizes) -> usize {
        let len = sizes.sq_wqe_cnt as usize * core::mem::size_of::<SqSlot>() + sizes.rq_wqe_cnt as usize * 8;
        // At least one line: a QP with neither queue still gets a region from the allocator.
        len.max(1).next_multiple_of(SHADOW_ALIGN)
    }

    /// A QP over its created objects. `shadow` is zeroed host memory of [`Qp::shadow_len`] bytes, at least 8-byte aligned
    /// ([`SHADOW_ALIGN`] keeps it off other queues' cache lines);
    /// `cqns` are the send and receive CQs it was created with.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        buf: QueueBuf,
        dbrec: DbRec,
        shadow: DmaRegion,
        qpn: u32,
        ty: QpType,
        sizes: QpSizes,
        bf: BfReg,
        sig_all: bool,
        cqns: (u32, u32),
    ) -> Self {
        let sq_offset = sizes.rq_bytes();
        let sq_flat = flat_span(&buf, sq_offset, sizes.sq_bytes());
        let rq_flat = flat_span(&buf, 0, sizes.rq_bytes());
        Self {
            buf,
            dbrec,
            shadow,
            qpn,
            ty,
            state: QpState::Reset,
            sizes,
            sq_offset,
            sq_cur_post: 0,
            sq_head: 0,
            sq_tail: 0,
            sq_tail_bb: 0,
            rq_head: 0,
            rq_tail: 0,
            cqn_snd: cqns.0,
            cqn_rcv: cqns.1,
            pd: 0,
            access: crate::mkey::Access(0),
            resp_depth: 0,
            port: 1,
            bf,
            sig_all,
            sq_flat,
            rq_flat,
            srqn: None,
        }
    }

    /// The SRQ the QP receives through, if it was created attached to one.
    pub fn srqn(&self) -> Option<u32> {
        self.srqn
    }

    /// The QP number.
    pub fn qpn(&self) -> u32 {
        self.qpn
    }
    /// RC, UC or UD.
    pub fn qp_type(&self) -> QpType {
        self.ty
    }
    /// Every send WQE is signaled (`sq_sig_all` at creation).
    pub fn sq_sig_all(&self) -> bool {
        self.sig_all
    }
    /// The state the driver last moved the QP to.
    pub fn state(&self) -> QpState {
        self.state
    }
    /// The capabilities granted.
    pub fn cap(&self) -> QpCap {
        self.sizes.cap
    }
    /// The queue geometry.
    pub fn sizes(&self) -> &QpSizes {
        &self.sizes
    }
    /// The BlueFlame register the QP rings.
    pub fn bfreg(&self) -> &BfReg {
        &self.bf
    }
    /// The CPU addresses of the host-only shadow array (wr_ids and send slots), for layout checks.
    pub fn shadow_bytes(&self) -> core::ops::Range<usize> {
        let start = self.shadow.cpu().as_ptr() as usize;
        start..start + self.shadow.len()
    }
    /// The doorbell record.
    pub fn dbrec(&self) -> &DbRec {
        &self.dbrec
    }
    /// Send WQEs posted and not yet completed (unsignaled ones count until a later signaled one completes).
    pub fn sq_outstanding(&self) -> u32 {
        self.sq_head.wrapping_sub(self.sq_tail)
    }
    /// Receive work requests posted and not yet completed.
    pub fn rq_outstanding(&self) -> u32 {
        self.rq_head.wrapping_sub(self.rq_tail)
    }
    /// The SQ producer counter in BBs.
    pub fn sq_cur_post(&self) -> u32 {
        self.sq_cur_post
    }
    /// The CQs the send and receive queues complete on.
    pub fn cqns(&self) -> (u32, u32) {
        (self.cqn_snd, self.cqn_rcv)
    }

    /// Completes the oldest outstanding work request of the queues on CQ `cqn` in software (sends first): retired
    /// here, returned with [`WcStatus::WrFlushErr`]; `None` when nothing is outstanding. Only for work the device
    /// will never complete (`Hca::poll_cq` decides when): a CQE the device wrote later
    /// for it would be refused as naming nothing outstanding.
    pub fn flush_next(&mut self, cqn: u32) -> Option<WorkCompletion> {
        let mut wc = WorkCompletion {
            status: WcStatus::WrFlushErr,
            vendor_err: u32::from(consts::MLX5_CQE_SYNDROME_WR_FLUSH_ERR),
            qp_num: self.qpn,
            ..WorkCompletion::default()
        };
        if cqn == self.cqn_snd && self.sq_outstanding() > 0 {
            // SAFETY: inside the live shadow region, aligned; only the driver touches it.
            let slot = unsafe { self.sq_slot_ptr(self.sq_tail_bb).read() };
            // One WQE per completion, whatever the slot says: the count stays exact even over a damaged shadow.
            self.sq_tail = self.sq_tail.wrapping_add(1);
            self.sq_tail_bb = slot.next;
            wc.wr_id = slot.wr_id;
            return Some(wc);
        }
        if cqn == self.cqn_rcv && self.rq_outstanding() > 0 {
            // SAFETY: inside the live shadow region, aligned; only the driver touches it.
            wc.wr_id = unsafe { self.rq_wrid_ptr(self.rq_tail).read() };
            wc.opcode = WcOpcode::Recv;
            self.rq_tail = self.rq_tail.wrapping_add(1);
            return Some(wc);
        }
        None
    }

    /// Back to a fresh ring after a move to RESET (the device forgot its counters too).
    pub(crate) fn reset_rings(&mut self) {
        self.sq_cur_post = 0;
        self.sq_head = 0;
        self.sq_tail = 0;
        self.sq_tail_bb = 0;
        self.rq_head = 0;
        self.rq_tail = 0;
        self.dbrec.write_be32(consts::MLX5_RCV_DBR as usize, 0);
        self.dbrec.write_be32(consts::MLX5_SND_DBR as usize, 0);
    }

    #[inline]
    fn sq_slot_ptr(&self, idx: u32) -> *mut SqSlot {
        let i = (idx & (self.sizes.sq_wqe_cnt - 1)) as usize;
        let sz = core::mem::size_of::<SqSlot>();
        self.shadow.ptr_at(i * sz, sz).cast::<SqSlot>()
    }

    #[inline]
    fn rq_wrid_ptr(&self, idx: u32) -> *mut u64 {
        let i = (idx & (self.sizes.rq_wqe_cnt - 1)) as usize;
        let base = self.sizes.sq_wqe_cnt as usize * core::mem::size_of::<SqSlot>();
        self.shadow.ptr_at(base + i * 8, 8).cast::<u64>()
    }

    /// Writes `data` at byte `pos` of the SQ, wrapping at its end (a WQE continues at the start of the ring).
    fn sq_write(&self, pos: usize, data: &[u8]) {
        let sq = self.sizes.sq_bytes();
        let mut done = 0;
        while done < data.len() {
            let p = (pos + done) & (sq - 1);
            // Never cross the ring's end or a BB (fragments are whole numbers of BBs).
            let n = (data.len() - done).min(sq - p).min(BB - p % BB);
            let dst = self.buf.ptr(self.sq_offset + p, n);
            // SAFETY: `dst..dst + n` is inside one live fragment of the ring (QueueBuf::ptr checked it); software
            // owns SQ entries beyond the device's consumer counter, which the overflow check keeps us within.
            unsafe { core::ptr::copy_nonoverlapping(data[done..].as_ptr(), dst, n) };
            done += n;
        }
    }

    /// What `post_send` reads of the QP on every WQE, read once per call (the loop then keeps it in registers):
    /// the SQ's address when it is one region, its mask, the shadow slots (bounds-checked once) and the limits.
    #[inline(always)]
    fn sq_win(&self) -> SqWin {
        let cnt = self.sizes.sq_wqe_cnt;
        SqWin {
            flat: self.sq_flat.map(|r| r.cpu()),
            // A QP without a send queue has no mask (its queue is always full, so no WQE is built).
            ds_mask: self.sizes.sq_bytes().wrapping_sub(DS),
            slots: self.shadow.ptr_at(0, cnt as usize * core::mem::size_of::<SqSlot>()).cast::<SqSlot>(),
            slot_mask: cnt.wrapping_sub(1),
            max_send_wr: self.sizes.cap.max_send_wr,
            max_send_sge: self.sizes.cap.max_send_sge,
        }
    }

    /// Pointer to the 16 bytes (`DS`) at SQ byte `pos`, wrapping at the ring's end. Segments start on `DS`
    /// boundaries; the mask also rounds any other `pos` down to one, so the span is always inside the SQ.
    #[inline(always)]
    fn sq_ds_ptr(&self, w: &SqWin, pos: usize) -> *mut u8 {
        // The SQ is a power of two of at least one BB, so this mask keeps `p + DS <= sq_bytes`.
        let p = pos & w.ds_mask;
        match w.flat {
            // SAFETY: `p + DS <= sq_bytes`, the length of the one-fragment span `sq_win` took this address from
            // (mask above); the span lies inside a fragment of `buf`, which this QP owns.
            Some(base) => unsafe { base.as_ptr().add(p) },
            None => self.buf.ptr(self.sq_offset + p, DS),
        }
    }

    /// Writes whole 16-byte segments at SQ byte `pos` (a multiple of `DS`), wrapping at the ring's end between
    /// segments. Each segment goes as two 8-byte words: the BlueFlame copy reads the WQE back in 8-byte words
    /// right after, and a load that spans two narrower stores still in the store buffer cannot be forwarded
    /// from them (it waits for them to reach the cache); a segment left as a byte array is stored in its fields'
    /// 4-byte pieces.
    #[inline(always)]
    fn sq_put<const N: usize>(&self, w: &SqWin, pos: usize, seg: &[u8; N]) {
        const { assert!(N / DS * DS == N, "whole segments only") };
        for k in 0..N / DS {
            let dst = self.sq_ds_ptr(w, pos + k * DS);
            for h in 0..DS / 8 {
                let mut word = [0u8; 8];
                word.copy_from_slice(&seg[k * DS + h * 8..k * DS + h * 8 + 8]);
                // SAFETY: `dst..dst + DS` is inside the SQ (sq_ds_ptr), so word `h` of it is too; software owns
                // SQ entries beyond the device's consumer counter, which the overflow check keeps us within.
                unsafe { dst.add(h * 8).cast::<u64>().write_unaligned(u64::from_ne_bytes(word)) };
            }
        }
    }

    /// The basic block that holds SQ byte `pos` (wrapping at the ring's end), as the eight words it holds in
    /// memory order: what a BlueFlame copy sends.
    #[inline(always)]
    fn sq_bb(&self, pos: usize) -> &[u64; 8] {
        // The SQ is a power of two of at least one BB, so this mask keeps `p + BB <= sq_bytes`.
        let p = pos & (self.sizes.sq_bytes() - BB);
        let src = match &self.sq_flat {
            // SAFETY: `p + BB <= sq_bytes == r.len` (mask above), and `r` lies inside a fragment of `buf`, which
            // this QP owns.
            Some(r) => unsafe { r.cpu().as_ptr().add(p) },
            None => self.buf.ptr(self.sq_offset + p, BB),
        };
        // SAFETY: 64 bytes inside one live fragment of the SQ (a fragment is a whole number of BBs), 8-byte aligned
        // (fragments are at least 4 KiB aligned, BBs sit at multiples of 64 bytes). They are bytes this driver
        // wrote; the device only reads the SQ, and nothing writes them while the borrow of `self` lives.
        unsafe { &*src.cast::<[u64; 8]>() }
    }

    /// Writes a 16-byte receive segment at RQ byte `pos` (a multiple of `DS` below the RQ size).
    #[inline(always)]
    fn rq_put(&self, pos: usize, seg: &[u8; DS]) {
        let dst = match &self.rq_flat {
            Some(r) => {
                // The RQ is a power of two of at least one WQE of at least DS bytes: `p + DS <= rq_bytes`.
                let p = pos & (r.len() - DS);
                // SAFETY: `p + DS <= r.len` (mask above), and `r` lies inside a fragment of `buf`, which this QP owns.
                unsafe { r.cpu().as_ptr().add(p) }
            }
            None => self.buf.ptr(pos, DS),
        };
        // SAFETY: inside one live fragment (a receive WQE never crosses one); software owns unposted RQ entries.
        unsafe { dst.cast::<[u8; DS]>().write_unaligned(*seg) };
    }

    /// Copies the SQ bytes of the WQE that starts at basic block `wqe_index` (wrapping at the ring's end): what
    /// the device reads, for diagnostics and tests.
    pub fn read_sq(&self, wqe_index: u32, out: &mut [u8]) {
        for (k, chunk) in out.chunks_mut(8).enumerate() {
            let b = self.sq_read8(wqe_index as usize * BB + k * 8);
            chunk.copy_from_slice(&b[..chunk.len()]);
        }
    }

    /// Reads 8 bytes at SQ byte `pos` (for the BlueFlame copy).
    fn sq_read8(&self, pos: usize) -> [u8; 8] {
        let sq = self.sizes.sq_bytes();
        let p = pos & (sq - 1);
        let src = self.buf.ptr(self.sq_offset + p, 8);
        // SAFETY: 8 bytes inside a BB of a live fragment; these are bytes this function's caller just wrote.
        unsafe { src.cast::<[u8; 8]>().read() }
    }

    /// Posts send work requests (`mlx5_ib_post_send` / `_mlx5_post_send`) and rings the doorbell once.
    pub fn post_send<M: Mmio + ?Sized>(&mut self, mmio: &M, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        // The loop of [`SendBatch`] with its state in locals: through the batch a single WQE cost ~25 more
        // instructions (its fields live in memory across `push`).
        let w = self.sq_win();
        let mut nreq = 0usize;
        let mut last_ctrl = 0usize;
        let mut last_size_ds = 0usize;
        let mut result = Ok(());
        for (i, wr) in wrs.iter().enumerate() {
            match self.build_send(&w, wr) {
                Ok((pos, ds)) => {
                    last_ctrl = pos;
                    last_size_ds = ds;
                    nreq += 1;
                }
                Err(kind) => {
                    result = Err(PostError { index: i, kind });
                    break;
                }
            }
        }
        if nreq > 0 {
            self.ring_sq(mmio, last_ctrl, last_size_ds, nreq == 1);
        }
        result
    }

    /// Posts the work requests `wrs` yields, read in place through [`SendWrView`] (a C `ibv_send_wr` chain, with
    /// no [`SendWr`] built for each), and rings the doorbell once: BlueFlame for a single WQE that fits, as
    /// [`Qp::post_send`]. On a refused request the ones before it stay posted (and are rung) and the refused one
    /// is returned with why, as `bad_wr`.
    #[inline(always)]
    pub fn post_send_iter<M, I>(&mut self, mmio: &M, wrs: I) -> Result<(), (I::Item, PostErrorKind)>
    where
        M: Mmio + ?Sized,
        I: IntoIterator,
        I::Item: SendWrView,
    {
        // The loop of `post_send`, its state in locals.
        let w = self.sq_win();
        let mut nreq = 0usize;
        let mut last_ctrl = 0usize;
        let mut last_size_ds = 0usize;
        let mut result = Ok(());
        for wr in wrs {
            match self.build_send(&w, &wr) {
                Ok((pos, ds)) => {
                    last_ctrl = pos;
                    last_size_ds = ds;
                    nreq += 1;
                }
                Err(kind) => {
                    result = Err((wr, kind));
                    break;
                }
            }
        }
        if nreq > 0 {
            self.ring_sq(mmio, last_ctrl, last_size_ds, nreq == 1);
        }
        result
    }

    /// A list of sends built one work request at a time ([`SendBatch::push`]) and rung with one doorbell when
    /// the batch ends (dropped): what a caller translating its own list (a C `ibv_send_wr` chain) posts through,
    /// with no slice of [`SendWr`] to build first.
    #[inline(always)]
    pub fn send_batch<'q, M: Mmio + ?Sized>(&'q mut self, mmio: &'q M) -> SendBatch<'q, M> {
        let win = self.sq_win();
        SendBatch { qp: self, mmio, win, nreq: 0, last_ctrl: 0, last_size_ds: 0 }
    }

    /// Writes one send WQE at the producer counter. Returns (SQ byte offset of its ctrl segment, size in DS).
    // Inlined into the generic `post_send`: a call per WQE, with its result through memory, cost more than the
    // checks it makes.
    #[inline(always)]
    fn build_send<W: SendWrView + ?Sized>(&mut self, w: &SqWin, wr: &W) -> Result<(usize, usize), PostErrorKind> {
        use PostErrorKind as K;
        // IBA 10.8.2: sends may be posted in RTS, SQD and SQE, and in ERR, where the device completes them with a
        // flush error (as rdma-core's provider, the driver does not refuse them there).
        if !matches!(self.state, QpState::Rts | QpState::Sqd | QpState::Sqe | QpState::Err) {
            return Err(K::BadState { state: self.state });
        }
        let max_post = w.max_send_wr;
        if self.sq_outstanding() >= max_post {
            return Err(K::QueueFull { outstanding: self.sq_outstanding(), max: max_post });
        }
        let sg_list = wr.sg_list()?;
        let inline = wr.inline()?;
        if inline.is_some() && !sg_list.is_empty() {
            return Err(K::BadRequest { what: "inline data and a gather list in one work request" });
        }
        if sg_list.len() > w.max_send_sge as usize {
            return Err(K::TooManySge { sge: sg_list.len(), max: w.max_send_sge });
        }
        // Read once: the WQE's stores go through raw pointers, after which the fields would be loaded again.
        let (cur, head) = (self.sq_cur_post, self.sq_head);
        let start = (cur as usize) * BB;
        let mut off = CTRL;
        let datagram = self.ty.is_datagram();
        match (datagram, wr.ud(datagram)?) {
            (true, Some(d)) => {
                self.put_av(*w, start + off, &d);
                off += DGRAM;
            }
            (true, None) => return Err(K::BadRequest { what: "UD send without an address handle" }),
            (false, Some(_)) => return Err(K::BadRequest { what: "connected-QP send with a UD destination" }),
            (false, None) => {}
        }
        // By reference where the caller keeps it (a `SendWr`): a copy of the enum per WQE cost ~20 instructions.
        let op = wr.op()?;
        let op: &SendOp = op.borrow();
        let raddr = |addr: u64, rkey: u32| {
            let mut s = [0u8; RADDR];
            put64(&mut s, c::mlx5_wqe_raddr_seg::RADDR, addr);
            c::mlx5_wqe_raddr_seg::RKEY.put_be(&mut s, 0, rkey);
            s
        };
        let mut imm = 0u32;
        match *op {
            SendOp::Send => {}
            SendOp::SendImm { imm: v } => imm = v,
            SendOp::RdmaWrite { remote_addr, rkey } => {
                self.need_connected()?;
                self.sq_put(w, start + off, &raddr(remote_addr, rkey));
                off += RADDR;
            }
            SendOp::RdmaRead { remote_addr, rkey } => {
                self.need_rc()?;
                self.sq_put(w, start + off, &raddr(remote_addr, rkey));
                off += RADDR;
            }
            SendOp::RdmaWriteImm { remote_addr, rkey, imm: v } => {
                self.need_connected()?;
                imm = v;
                self.sq_put(w, start + off, &raddr(remote_addr, rkey));
                off += RADDR;
            }
            SendOp::AtomicCmpSwp { remote_addr, rkey, compare, swap } => {
                self.need_atomic(sg_list)?;
                self.put_atomic(*w, start + off, raddr(remote_addr, rkey), swap, Some(compare));
                off += RADDR + ATOMIC;
            }
            SendOp::AtomicFetchAdd { remote_addr, rkey, add } => {
                self.need_atomic(sg_list)?;
                self.put_atomic(*w, start + off, raddr(remote_addr, rkey), add, None);
                off += RADDR + ATOMIC;
            }
        }
        if let Some(data) = inline {
            off = self.put_inline(op, start, off, data)?;
        } else {
            for s in sg_list.iter().filter(|s| s.length > 0) {
                self.sq_put(w, start + off, &data_seg(s.length, s.lkey, s.addr));
                off += DATA;
            }
        }
        let ds = off / DS;
        let bbs = off.div_ceil(BB);
        let mut fm_ce_se = FM_CE_SE[(wr.flags().0 & 7) as usize];
        if self.sig_all {
            fm_ce_se |= consts::MLX5_WQE_CTRL_CQ_UPDATE;
        }
        let ctrl = ctrl_seg(cur as u16, op.mlx5_opcode(), self.qpn, ds as u8, fm_ce_se, imm);
        self.sq_put(w, start, &ctrl);
        let next = cur.wrapping_add(bbs as u32);
        let slot = SqSlot { wr_id: wr.wr_id(), head_after: head.wrapping_add(1), next };
        // SAFETY: the slot index is masked to `sq_wqe_cnt - 1`, inside the slots `sq_win` bounds-checked; aligned
        // (8-byte aligned region, 16-byte slots); only the driver touches it.
        unsafe { w.slots.add((cur & w.slot_mask) as usize).write(slot) };
        self.sq_cur_post = next;
        self.sq_head = head.wrapping_add(1);
        Ok((start, ds))
    }

    /// The UD address vector with its remote QPN and Q_Key (`set_datagram_seg`). Out of line, as the other
    /// rarer segments below: the connected-QP path keeps its registers.
    #[inline(never)]
    fn put_av(&self, w: SqWin, pos: usize, d: &super::wr::UdDest<'_>) {
        let w = &w;
        let mut seg = *d.ah.av();
        c::mlx5_av::DQP_DCT.put_be(&mut seg, 0, (d.remote_qpn & 0xff_ffff) | consts::MLX5_EXTENDED_UD_AV);
        c::mlx5_av::QKEY.put_be(&mut seg, 0, d.remote_qkey);
        self.sq_put(w, pos, &seg);
    }

    /// The remote address and atomic segments of an atomic (`set_atomic_seg`): `compare` for compare-and-swap.
    #[inline(never)]
    fn put_atomic(&self, w: SqWin, pos: usize, raddr: [u8; RADDR], swap_add: u64, compare: Option<u64>) {
        let w = &w;
        self.sq_put(w, pos, &raddr);
        let mut a = [0u8; ATOMIC];
        put64(&mut a, c::mlx5_wqe_atomic_seg::SWAP_ADD, swap_add);
        if let Some(cmp) = compare {
            put64(&mut a, c::mlx5_wqe_atomic_seg::COMPARE, cmp);
        }
        self.sq_put(w, pos + RADDR, &a);
    }

    /// The inline data segment at `off` of the WQE at `start` (`set_data_inl_seg`); returns the offset after it.
    #[inline(never)]
    fn put_inline(&self, op: &SendOp, start: usize, off: usize, data: InlineData<'_>) -> Result<usize, PostErrorKind> {
        use PostErrorKind as K;
        if matches!(*op, SendOp::RdmaRead { .. } | SendOp::AtomicCmpSwp { .. } | SendOp::AtomicFetchAdd { .. }) {
            return Err(K::BadRequest { what: "inline data on a READ or atomic" });
        }
        let total = data.len();
        if total > self.sizes.cap.max_inline_data as usize {
            return Err(K::InlineTooLong { bytes: total, max: self.sizes.cap.max_inline_data });
        }
        // No segment for no data (`set_data_inl_seg`): an empty one would not fit a WQE sized for none.
        if total == 0 {
            return Ok(off);
        }
        let mut hdr = [0u8; INL_HDR];
        c::mlx5_wqe_inline_seg::BYTE_COUNT.put_be(&mut hdr, 0, total as u32 | consts::MLX5_INLINE_SEG);
        self.sq_write(start + off, &hdr);
        match data {
            InlineData::Bytes(b) => self.sq_write(start + off + INL_HDR, b),
            InlineData::Gather(g) => {
                let mut at = start + off + INL_HDR;
                for s in g.sges().iter().filter(|s| s.length > 0) {
                    // SAFETY: `InlineData::gather`'s contract: the entry is readable host memory of `length` bytes
                    // for the data's lifetime; the total was checked against the queue's inline limit above.
                    let b = unsafe { core::slice::from_raw_parts(s.addr as usize as *const u8, s.length as usize) };
                    self.sq_write(at, b);
                    at += b.len();
                }
            }
        }
        Ok((off + INL_HDR + total).next_multiple_of(DS))
    }

    /// RDMA READ and atomics: RC only. rdma-core's `_mlx5_post_send` builds no remote-address segment for them on
    /// a UC QP and leaves the device to fail the WQE; the driver refuses them here instead.
    fn need_rc(&self) -> Result<(), PostErrorKind> {
        match self.ty {
            QpType::Rc => Ok(()),
            QpType::Uc => Err(PostErrorKind::BadRequest { what: "RDMA READ or atomic on a UC QP" }),
            QpType::Ud | QpType::Gsi | QpType::Smi => {
                Err(PostErrorKind::BadRequest { what: "RDMA or atomic on a UD QP" })
            }
        }
    }

    /// RDMA WRITE (with or without immediate): RC and UC.
    fn need_connected(&self) -> Result<(), PostErrorKind> {
        if self.ty.is_datagram() {
            return Err(PostErrorKind::BadRequest { what: "RDMA or atomic on a UD QP" });
        }
        Ok(())
    }

    fn need_atomic(&self, sg_list: &[Sge]) -> Result<(), PostErrorKind> {
        self.need_rc()?;
        if sg_list.len() != 1 || sg_list[0].length != 8 {
            return Err(PostErrorKind::BadRequest { what: "an atomic needs one 8-byte SGE for the result" });
        }
        Ok(())
    }

    /// The send doorbell (`mlx5r_ring_db` / rdma-core `post_send_db`). This function owns the SQ doorbell
    /// sequence. Inlined into the post loops: out of line, its frame and the reloads of what the loop had in
    /// registers cost the drop-in's 1-WR post ~19 instructions.
    #[inline(always)]
    fn ring_sq<M: Mmio + ?Sized>(&mut self, mmio: &M, last_ctrl: usize, size_ds: usize, single: bool) {
        // The WQEs must be visible in memory before the record that says they exist.
        mmio.dma_wmb();
        self.dbrec.write_be32(consts::MLX5_SND_DBR as usize, self.sq_cur_post & 0xffff);
        // The record must be visible before the doorbell write, and the write-combining burst must not merge with
        // anything earlier.
        mmio.wc_start();
        let reg = self.bf.next_offset();
        let bytes = size_ds * DS;
        if single && self.bf.bf && bytes <= self.bf.buf_size {
            // BlueFlame: the whole WQE through the write-combining window, one 64-byte chunk per basic block, so
            // the device can start without fetching it.
            for k in 0..bytes.div_ceil(BB) {
                mmio.write_bf64(reg + k * BB, self.sq_bb(last_ctrl + k * BB));
            }
        } else {
            // The first 8 bytes of the last control segment, as the value whose big-endian store writes them.
            mmio.write64(reg, u64::from_be(self.sq_bb(last_ctrl)[0]));
        }
        // Flush the write-combining buffer so the doorbell reaches the device now, as whole 64-byte chunks.
        mmio.wc_flush();
    }

    /// Posts receive work requests (`mlx5_ib_post_recv`): scatter entries, terminated with the invalid lkey when
    /// shorter than the queue's maximum, then the doorbell record.
    ///
    /// The loop of [`Qp::post_recv_iter`], whose state stays in registers: through [`RecvBatch::push`] each WQE
    /// reloaded the batch's fields from memory (about 3 % of the call's time).
    pub fn post_recv<M: Mmio + ?Sized>(&mut self, mmio: &M, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        self.post_recv_iter(mmio, wrs).map_err(|(wr, kind)| refused_at(wrs, wr, kind))
    }

    /// Posts the receives `wrs` yields, read in place through [`RecvWrView`] (a C `ibv_recv_wr` chain), and writes
    /// the doorbell record once: [`Qp::post_recv`]'s checks and WQEs, with what every WQE needs of the QP read
    /// once per call. On a refused request the ones before it stay posted and the refused one is returned.
    #[inline(always)]
    pub fn post_recv_iter<M, I>(&mut self, mmio: &M, wrs: I) -> Result<(), (I::Item, PostErrorKind)>
    where
        M: Mmio + ?Sized,
        I: IntoIterator,
        I::Item: RecvWrView,
    {
        use PostErrorKind as K;
        let cnt = self.sizes.rq_wqe_cnt;
        let start_outstanding = self.rq_outstanding();
        let base = self.sizes.sq_wqe_cnt as usize * core::mem::size_of::<SqSlot>();
        let reset = matches!(self.state, QpState::Reset);
        let head = self.rq_head;
        // No room in RESET: the first request is refused (as BadState below). Nor without a scatter entry per WQE
        // (no receive queue): the loop writes a request's one entry wherever there is room.
        let room = if reset || self.sizes.cap.max_recv_sge == 0 { 0 } else { cnt.saturating_sub(start_outstanding) };
        let w = RqWin {
            // Bounds-checked once; a slot index is masked to `cnt - 1`, so every access is inside.
            wrids: self.shadow.ptr_at(base, cnt as usize * 8).cast::<u64>(),
            mask: cnt.wrapping_sub(1),
            max_gs: self.sizes.cap.max_recv_sge as usize,
            shift: self.sizes.rq_wqe_shift,
            end: head.wrapping_add(room),
        };
        // The loop is built twice, for a one-region RQ (the usual case: a plain store per segment, at the RQ's
        // address under its byte mask) and for the rest, so neither carries the other's per-WQE work or
        // loop-invariant values.
        let rq_mask = self.sizes.rq_bytes().wrapping_sub(1);
        let (idx, stop) = match self.rq_flat.map(|r| (r.cpu(), r.len().wrapping_sub(DS))) {
            Some((base, mask)) => Self::recv_loops(&w, head, wrs.into_iter(), |pos, seg| {
                // SAFETY: `pos & mask + DS <= len`, inside the one-fragment span this QP owns (as `rq_put`);
                // software owns unposted RQ entries.
                unsafe { base.as_ptr().add(pos & mask).cast::<[u8; DS]>().write_unaligned(*seg) }
            }),
            None => Self::recv_loops(&w, head, wrs.into_iter(), |pos, seg| self.rq_put(pos & rq_mask, seg)),
        };
        if idx != head {
            self.rq_head = idx;
            // The receive WQEs must be visible before the record that hands them to the device.
            mmio.dma_wmb();
            self.dbrec.write_be32(consts::MLX5_RCV_DBR as usize, self.rq_head & 0xffff);
        }
        match stop {
            None => Ok(()),
            Some(wr) if idx == w.end && reset => Err((wr, K::BadState { state: self.state })),
            Some(wr) if idx == w.end => Err((
                wr,
                K::QueueFull { outstanding: start_outstanding.wrapping_add(idx.wrapping_sub(head)), max: cnt },
            )),
            Some(wr) => {
                let kind = refused_recv(&wr, w.max_gs);
                Err((wr, kind))
            }
        }
    }

    /// [`Qp::recv_loop`] built for this call's choice of terminator after a one-entry WQE.
    #[inline(always)]
    fn recv_loops<I, P>(w: &RqWin, head: u32, wrs: I, put: P) -> (u32, Option<I::Item>)
    where
        I: Iterator,
        I::Item: RecvWrView,
        P: Fn(usize, &[u8; DS]),
    {
        if w.max_gs > 1 {
            Self::recv_loop::<_, _, true>(w, head, wrs, put)
        } else {
            Self::recv_loop::<_, _, false>(w, head, wrs, put)
        }
    }

    /// The receive WQEs of [`Qp::post_recv_iter`], from ring index `head` until `wrs` ends or a request is refused
    /// (returned with the ring index reached: at `end` the ring had no room, else its scatter list was refused,
    /// which the caller reads again), each segment written by `put` at its RQ byte offset. Two words come back (in
    /// registers for a list of pointers), not the error itself. Out of line: in its own frame the loop's values
    /// stay in registers whatever its caller keeps live across it (inlined into the C ABI's entry, the counter and
    /// the list pointer went through the stack on every WQE).
    ///
    /// `TERM`: whether a one-entry WQE takes the terminator (`max_gs > 1`), decided once per call. The usual
    /// request then runs straight through, its only taken branch the loop's: with a branch to step over the
    /// terminator (or over cold code) in every WQE, a call of 16 had its loop exit mispredicted in some code
    /// layouts (0.4 ns a WQE more, BENCHMARKS.md "Twelfth pass").
    #[inline(never)]
    fn recv_loop<I, P, const TERM: bool>(w: &RqWin, head: u32, wrs: I, put: P) -> (u32, Option<I::Item>)
    where
        I: Iterator,
        I::Item: RecvWrView,
        P: Fn(usize, &[u8; DS]),
    {
        let RqWin { wrids, mask, max_gs, shift, end } = *w;
        let mut idx = head;
        for wr in wrs {
            if idx == end {
                return (idx, Some(wr));
            }
            // There is room, so the ring has at least one WQE and `mask` is its index mask. The offset wraps in
            // `put` (the RQ is `cnt << shift` bytes).
            let at = (idx as usize) << shift;
            match wr.one_sge() {
                // The usual one entry, without the loop's counter: a queue with room takes at least one.
                Some(s) if s.length != 0 => {
                    put(at, &data_seg(s.length, s.lkey, s.addr));
                    if TERM {
                        put(at + DATA, &recv_terminator());
                    }
                }
                _ => match wr.sg_list() {
                    Ok(sg) if sg.len() <= max_gs => recv_sges(at, sg, max_gs, &put),
                    _ => return (idx, Some(wr)),
                },
            }
            // SAFETY: `idx & mask < cnt`, inside the `cnt` wr_ids `ptr_at` checked in `post_recv_iter`, 8-byte
            // aligned (as in `recv_batch`); only the driver touches it, and the caller holds `&mut self`.
            unsafe { wrids.add((idx & mask) as usize).write(wr.wr_id()) };
            idx = idx.wrapping_add(1);
        }
        (idx, None)
    }

    /// A list of receives built one at a time ([`RecvBatch::push`]); the doorbell record is written once when the
    /// batch ends (dropped).
    #[inline(always)]
    pub fn recv_batch<'q, M: Mmio + ?Sized>(&'q mut self, mmio: &'q M) -> RecvBatch<'q, M> {
        let cnt = self.sizes.rq_wqe_cnt;
        let start_outstanding = self.rq_outstanding();
        // The receive wr_ids of the shadow, bounds-checked once for the whole batch; a slot index is masked to
        // `cnt - 1`, so every access is inside.
        let base = self.sizes.sq_wqe_cnt as usize * core::mem::size_of::<SqSlot>();
        let wrids = self.shadow.ptr_at(base, cnt as usize * 8).cast::<u64>();
        RecvBatch {
            mmio,
            wrids,
            // Room left in the ring; `cnt` is a power of two (or 0 without a receive queue: no room).
            room: cnt.saturating_sub(start_outstanding),
            mask: cnt.wrapping_sub(1),
            start_outstanding,
            nreq: 0,
            qp: self,
        }
    }
}

/// Sends being posted to one QP: each [`SendBatch::push`] writes a WQE; dropping the batch rings the doorbell
/// once for all of them (BlueFlame when there is exactly one that fits), as `_mlx5_post_send` does at the end of
/// its list. Allocates nothing.
pub struct SendBatch<'q, M: Mmio + ?Sized> {
    qp: &'q mut Qp,
    mmio: &'q M,
    win: SqWin,
    nreq: usize,
    last_ctrl: usize,
    last_size_ds: usize,
}

impl<M: Mmio + ?Sized> core::fmt::Debug for SendBatch<'_, M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SendBatch").field("qpn", &self.qp.qpn).field("nreq", &self.nreq).finish()
    }
}

impl<M: Mmio + ?Sized> SendBatch<'_, M> {
    /// Writes one send WQE. On error nothing of it is posted; the WQEs pushed before stay posted (and are rung
    /// when the batch ends).
    #[inline(always)]
    pub fn push<W: SendWrView + ?Sized>(&mut self, wr: &W) -> Result<(), PostErrorKind> {
        let (pos, ds) = self.qp.build_send(&self.win, wr)?;
        self.last_ctrl = pos;
        self.last_size_ds = ds;
        self.nreq += 1;
        Ok(())
    }

    /// Work requests pushed so far.
    pub fn len(&self) -> usize {
        self.nreq
    }

    /// Nothing pushed yet.
    pub fn is_empty(&self) -> bool {
        self.nreq == 0
    }

    /// The QP the batch posts to (its capabilities, type).
    pub fn qp(&self) -> &Qp {
        self.qp
    }
}

impl<M: Mmio + ?Sized> Drop for SendBatch<'_, M> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.nreq > 0 {
            self.qp.ring_sq(self.mmio, self.last_ctrl, self.last_size_ds, self.nreq == 1);
        }
    }
}

/// Receives being posted to one QP: each [`RecvBatch::push`] writes a WQE; dropping the batch writes the doorbell
/// record once. Allocates nothing.
pub struct RecvBatch<'q, M: Mmio + ?Sized> {
    qp: &'q mut Qp,
    mmio: &'q M,
    wrids: *mut u64,
    room: u32,
    mask: u32,
    start_outstanding: u32,
    nreq: u32,
}

impl<M: Mmio + ?Sized> core::fmt::Debug for RecvBatch<'_, M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("RecvBatch").field("qpn", &self.qp.qpn).field("nreq", &self.nreq).finish()
    }
}

impl<M: Mmio + ?Sized> RecvBatch<'_, M> {
    /// Writes one receive WQE. On error nothing of it is posted; the WQEs pushed before stay posted.
    #[inline(always)]
    pub fn push(&mut self, wr: &RecvWr<'_>) -> Result<(), PostErrorKind> {
        use PostErrorKind as K;
        let qp = &mut *self.qp;
        // The state cannot change while the batch borrows the QP.
        if matches!(qp.state, QpState::Reset) {
            return Err(K::BadState { state: qp.state });
        }
        let max_gs = qp.sizes.cap.max_recv_sge as usize;
        if self.nreq >= self.room {
            let outstanding = self.start_outstanding.wrapping_add(self.nreq);
            return Err(K::QueueFull { outstanding, max: qp.sizes.rq_wqe_cnt });
        }
        if wr.sg_list.len() > max_gs {
            return Err(K::TooManySge { sge: wr.sg_list.len(), max: max_gs as u32 });
        }
        // There is room, so the ring has at least one WQE and `mask` is its index mask.
        let slot = qp.rq_head.wrapping_add(self.nreq) & self.mask;
        let at = (slot as usize) << qp.sizes.rq_wqe_shift;
        // A zero-length entry is skipped, as rdma-core's `mlx5_post_recv` skips it: to the device a byte_count of 0
        // means 2 GiB.
        let mut k = 0;
        for s in wr.sg_list {
            if s.length != 0 {
                qp.rq_put(at + k * DATA, &data_seg(s.length, s.lkey, s.addr));
                k += 1;
            }
        }
        if k < max_gs {
            qp.rq_put(at + k * DATA, &recv_terminator());
        }
        // SAFETY: `slot < cnt` (masked above), inside the `cnt` wr_ids `ptr_at` checked in `recv_batch`, 8-byte
        // aligned (the shadow region is 8-byte aligned and its send slots are 16 bytes each); only the driver
        // touches it, and the batch borrows the QP.
        unsafe { self.wrids.add(slot as usize).write(wr.wr_id) };
        self.nreq += 1;
        Ok(())
    }

    /// Work requests pushed so far.
    pub fn len(&self) -> usize {
        self.nreq as usize
    }

    /// Nothing pushed yet.
    pub fn is_empty(&self) -> bool {
        self.nreq == 0
    }
}

impl<M: Mmio + ?Sized> Drop for RecvBatch<'_, M> {
    #[inline(always)]
    fn drop(&mut self) {
        if self.nreq > 0 {
            let qp = &mut *self.qp;
            qp.rq_head = qp.rq_head.wrapping_add(self.nreq);
            // The receive WQEs must be visible before the record that hands them to the device.
            self.mmio.dma_wmb();
            qp.dbrec.write_be32(consts::MLX5_RCV_DBR as usize, qp.rq_head & 0xffff);
        }
    }
}

/// A data segment (`mlx5_wqe_data_seg`: byte count, lkey, address, each big-endian) as its 16 bytes, built in
/// registers and written with one store.
#[inline(always)]
fn data_seg(length: u32, lkey: u32, addr: u64) -> [u8; DATA] {
    let mut d = [0u8; DATA];
    // Bit 31 of the byte count is the inline flag, so a length with it set cannot be written as it is (rdma-core
    // writes it unchanged, and the device then reads an inline segment). Every such length is past the largest
    // message a ConnectX takes (`log_max_msg` is at most 30), and 0 means 2 GiB: writing 0 makes the device
    // answer with the local length error such a length deserves instead of sending the lkey's bytes.
    let length = if length & consts::MLX5_INLINE_SEG != 0 { 0 } else { length };
    c::mlx5_wqe_data_seg::BYTE_COUNT.put_be(&mut d, 0, length);
    c::mlx5_wqe_data_seg::LKEY.put_be(&mut d, 0, lkey);
    put64(&mut d, c::mlx5_wqe_data_seg::ADDR, addr);
    d
}

/// The 16-byte control segment (`mlx5_wqe_ctrl_seg`). `imm` is in network byte order (`__be32`, as
/// `ibv_send_wr.imm_data`): its bytes go into the segment unchanged, as rdma-core's `mlx5_post_send` copies them.
#[inline]
pub fn ctrl_seg(wqe_index: u16, opcode: u8, qpn: u32, ds: u8, fm_ce_se: u8, imm: u32) -> [u8; CTRL] {
    use c::mlx5_wqe_ctrl_seg as s;
    let mut b = [0u8; CTRL];
    s::OPMOD_IDX_OPCODE.put_be(&mut b, 0, u32::from(wqe_index) << 8 | u32::from(opcode));
    s::QPN_DS.put_be(&mut b, 0, (qpn & 0xff_ffff) << 8 | u32::from(ds & 0x3f));
    b[s::FM_CE_SE.off] = fm_ce_se;
    b[s::IMM.off..s::IMM.off + 4].copy_from_slice(&imm.to_ne_bytes());
    b
}

#[inline]
fn put64(buf: &mut [u8], m: Bytes, v: u64) {
    buf[m.off..m.off + 8].copy_from_slice(&v.to_be_bytes());
}

impl WrTable for Qp {
    #[inline]
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        if qpn != self.qpn {
            return None;
        }
        // The counter names the WQE by its first BB (16 bits of `cur_post`).
        // SAFETY: inside the live shadow region, aligned; only the driver touches it.
        let slot = unsafe { self.sq_slot_ptr(wqe_counter.into()).read() };
        // A completion for a slot with nothing outstanding is a device fault.
        let retired = slot.head_after.wrapping_sub(self.sq_tail);
        if retired == 0 || retired > self.sq_outstanding() {
            return None;
        }
        self.sq_tail = slot.head_after;
        self.sq_tail_bb = slot.next;
        Some(slot.wr_id)
    }

    #[inline]
    fn recv_done(&mut self, qpn: u32, _srqn: u32, _wqe_counter: u16) -> Option<u64> {
        if qpn != self.qpn || self.rq_outstanding() == 0 {
            return None;
        }
        // SAFETY: inside the live shadow region, aligned; only the driver touches it.
        let id = unsafe { self.rq_wrid_ptr(self.rq_tail).read() };
        self.rq_tail = self.rq_tail.wrapping_add(1);
        Some(id)
    }

    #[inline]
    fn recv_needs_index(&self) -> bool {
        // Receives complete in posting order (`recv_done` takes the oldest).
        false
    }

    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion> {
        if !dead && self.state != QpState::Err {
            return None;
        }
        self.flush_next(cqn)
    }

    fn recv_srqn(&self, qpn: u32) -> Option<u32> {
        if qpn == self.qpn {
            self.srqn
        } else {
            None
        }
    }
}

/// Several QPs sharing a CQ: completions are routed by QP number.
impl WrTable for [&mut Qp] {
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        self.iter_mut().find(|q| q.qpn == qpn)?.send_done(qpn, wqe_counter)
    }
    fn recv_done(&mut self, qpn: u32, srqn: u32, wqe_counter: u16) -> Option<u64> {
        self.iter_mut().find(|q| q.qpn == qpn)?.recv_done(qpn, srqn, wqe_counter)
    }
    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion> {
        self.iter_mut().find_map(|q| WrTable::flush_one(&mut **q, cqn, dead))
    }
    fn recv_srqn(&self, qpn: u32) -> Option<u32> {
        self.iter().find(|q| q.qpn == qpn)?.srqn
    }
    fn recv_needs_index(&self) -> bool {
        false
    }
}

/// Why the receive loop refused `wr` with room in the ring: its scatter list, read again (the cold path).
#[cold]
fn refused_recv<W: RecvWrView>(wr: &W, max_gs: usize) -> PostErrorKind {
    match wr.sg_list() {
        Err(e) => e,
        Ok(sg) => PostErrorKind::TooManySge { sge: sg.len(), max: max_gs as u32 },
    }
}

/// The entry that ends a receive WQE's scatter list shorter than the queue's maximum (length 0, the invalid lkey).
#[inline(always)]
fn recv_terminator() -> [u8; DATA] {
    data_seg(0, consts::MLX5_INVALID_LKEY, 0)
}

/// The segments of a receive WQE other than the usual one entry (none, several, or zero-length ones, which are
/// skipped as in `RecvBatch::push`), and the terminator when they leave room: the cold side of `Qp::recv_loop`.
#[cold]
#[inline(never)]
fn recv_sges<P: Fn(usize, &[u8; DS])>(at: usize, sg: &[Sge], max_gs: usize, put: &P) {
    let mut k = 0;
    for s in sg {
        if s.length != 0 {
            put(at + k * DATA, &data_seg(s.length, s.lkey, s.addr));
            k += 1;
        }
    }
    if k < max_gs {
        put(at + k * DATA, &recv_terminator());
    }
}

/// What [`Qp::post_recv_iter`]'s loop reads of the QP, read once per call.
#[derive(Clone, Copy)]
struct RqWin {
    /// The receive wr_ids of the shadow (`mask + 1` of them, bounds-checked).
    wrids: *mut u64,
    mask: u32,
    max_gs: usize,
    shift: u8,
    /// The ring index the loop stops at: no room beyond it.
    end: u32,
}

/// The error of a slice post that stopped at `wr`, one of `wrs`: its index, found by address (the cold path).
#[cold]
fn refused_at<T>(wrs: &[T], wr: &T, kind: PostErrorKind) -> PostError {
    let index = wrs.iter().position(|w| core::ptr::eq(w, wr)).unwrap_or(wrs.len());
    PostError { index, kind }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn ctrl_seg_packs_index_opcode_qpn_and_ds_big_endian() {
        use c::mlx5_wqe_ctrl_seg as s;
        let b = ctrl_seg(0x1234, 0x0a, 0x00ab_cdef, 3, consts::MLX5_WQE_CTRL_CQ_UPDATE, 0xdead_beef_u32.to_be());
        assert_eq!(s::OPMOD_IDX_OPCODE.get_be(&b, 0), 0x0012_340a);
        assert_eq!(&b[s::OPMOD_IDX_OPCODE.off..s::OPMOD_IDX_OPCODE.off + 4], &[0x00, 0x12, 0x34, 0x0a]);
        assert_eq!(s::QPN_DS.get_be(&b, 0), 0xabcd_ef03);
        assert_eq!(b[s::FM_CE_SE.off], consts::MLX5_WQE_CTRL_CQ_UPDATE);
        assert_eq!(s::IMM.get_be(&b, 0), 0xdead_beef);
    }

    #[test]
    fn ctrl_seg_keeps_qpn_to_24_bits_and_ds_to_6() {
        use c::mlx5_wqe_ctrl_seg as s;
        let b = ctrl_seg(0, 0, 0xff12_3456, 0xff, 0, 0);
        assert_eq!(s::QPN_DS.get_be(&b, 0), 0x1234_563f);
    }

    #[test]
    fn put64_writes_big_endian() {
        let mut b = [0u8; 16];
        put64(&mut b, Bytes::new(8, 8), 0x0102_0304_0506_0708);
        assert_eq!(b, [0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
    }
}
