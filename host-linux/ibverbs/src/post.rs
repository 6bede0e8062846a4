//! The datapath programs reach through function pointers: `ibv_context_ops` (post_send, post_recv,
//! post_srq_recv, poll_cq, req_notify_cq), the `ibv_cq_ex` poll functions and the `ibv_qp_ex` work-request
//! builders (`ibv_wr_*`).

use std::ffi::{c_int, c_uint, c_void};
use std::ptr;

use mlx5_core::cq::{CqeError, Notify, WcFlags, WcOpcode, WcOut, WcSink, WcStatus, WorkCompletion};
use mlx5_core::hal::Mmio;
use mlx5_core::qp::{
    InlineData, PostError, PostErrorKind, QpType, RecvWr, RecvWrView, SendFlags, SendOp, SendWr, SendWrView, Sge,
    UdDest,
};
use mlx5_verbs::{QpFn, QpFnOr};

use crate::abi::*;
use crate::errno_of;
use crate::queue::{cq_of, qp_of, srq_of, Ah, PendingWr, Qp, WrBatch};
use crate::uobject::lock;
use crate::{guard, guard_datapath};

/// SGEs one work request may carry here (mlx5's largest WQE holds fewer).
const MAX_SGE: usize = 64;
/// Inline bytes one send may carry here (mlx5's largest inline segment is smaller).
const MAX_INLINE: usize = 1024;
/// `IBV_SEND_INLINE`.
const SEND_INLINE: c_uint = 1 << 3;

unsafe extern "C" fn eopnotsupp_bind_mw(_: *mut ibv_qp, _: *mut c_void, _: *mut c_void) -> c_int {
    libc::EOPNOTSUPP
}

unsafe extern "C" fn eopnotsupp_dealloc_mw(_: *mut c_void) -> c_int {
    libc::EOPNOTSUPP
}

/// The context's ops: the datapath entries, memory windows as unsupported (`alloc_mw` NULL makes
/// `ibv_alloc_mw` fail with EOPNOTSUPP, as libibverbs documents). A context whose queues lock (not set
/// single-threaded) gets the posts that take the QP's lock without testing its mode.
pub(crate) fn context_ops(single_threaded: bool) -> ibv_context_ops {
    // SAFETY: every field is an Option of a function pointer: all None is valid.
    let mut o: ibv_context_ops = unsafe { std::mem::zeroed() };
    o.bind_mw = Some(eopnotsupp_bind_mw);
    o.dealloc_mw = Some(eopnotsupp_dealloc_mw);
    o.poll_cq = Some(poll_cq);
    o.req_notify_cq = Some(req_notify_cq);
    o.post_srq_recv = Some(post_srq_recv);
    if single_threaded {
        o.post_send = Some(post_send::<false>);
        o.post_recv = Some(post_recv::<false>);
    } else {
        o.post_send = Some(post_send::<true>);
        o.post_recv = Some(post_recv::<true>);
    }
    o
}

/// `ibv_wc_opcode` of a completion.
fn wc_opcode(o: WcOpcode) -> c_int {
    match o {
        WcOpcode::Send => 0,
        WcOpcode::RdmaWrite => 1,
        WcOpcode::RdmaRead => 2,
        WcOpcode::CompSwap | WcOpcode::MaskedCompSwap => 3,
        WcOpcode::FetchAdd | WcOpcode::MaskedFetchAdd => 4,
        WcOpcode::Recv => 128,
        WcOpcode::RecvRdmaWithImm => 129,
        WcOpcode::Unknown(n) => c_int::from(n),
    }
}

fn to_c(w: &WorkCompletion) -> ibv_wc {
    ibv_wc {
        wr_id: w.wr_id,
        status: w.status as c_int,
        opcode: wc_opcode(w.opcode),
        vendor_err: w.vendor_err,
        byte_len: w.byte_len,
        imm_data: if w.wc_flags.contains(WcFlags::WITH_INV) { w.invalidated_rkey } else { w.imm_data },
        qp_num: w.qp_num,
        src_qp: w.src_qp,
        wc_flags: w.wc_flags.0,
        pkey_index: w.pkey_index,
        slid: w.slid,
        sl: w.sl,
        dlid_path_bits: w.dlid_path_bits,
    }
}

/// One entry of the program's `ibv_wc` array, written by the core's decoder field by field from the CQE (no
/// completion built and converted in between). `ibv_wc` has no timestamp or VLAN field: those are dropped.
#[repr(transparent)]
struct CWcEntry(ibv_wc);

impl WcOut for CWcEntry {
    #[inline(always)]
    fn begin(&mut self, wr_id: u64, qp_num: u32, status: WcStatus, vendor_err: u32, _timestamp: u64) {
        self.0 = ibv_wc {
            wr_id,
            status: status as c_int,
            opcode: 0,
            vendor_err,
            byte_len: 0,
            imm_data: 0,
            qp_num,
            src_qp: 0,
            wc_flags: 0,
            pkey_index: 0,
            slid: 0,
            sl: 0,
            dlid_path_bits: 0,
        };
    }
    #[inline(always)]
    fn set_opcode(&mut self, op: WcOpcode) {
        self.0.opcode = wc_opcode(op);
    }
    #[inline(always)]
    fn add_flags(&mut self, flags: WcFlags) {
        self.0.wc_flags |= flags.0;
    }
    #[inline(always)]
    fn set_byte_len(&mut self, n: u32) {
        self.0.byte_len = n;
    }
    #[inline(always)]
    fn set_imm_data(&mut self, imm: u32) {
        self.0.imm_data = imm;
    }
    /// `ibv_wc` keeps the invalidated rkey where the immediate goes (`invalidated_rkey` shares its union).
    #[inline(always)]
    fn set_invalidated_rkey(&mut self, rkey: u32) {
        self.0.imm_data = rkey;
    }
    #[inline(always)]
    fn set_src(&mut self, src_qp: u32, dlid_path_bits: u8, pkey_index: u16, slid: u16, sl: u8) {
        self.0.src_qp = src_qp;
        self.0.dlid_path_bits = dlid_path_bits;
        self.0.pkey_index = pkey_index;
        self.0.slid = slid;
        self.0.sl = sl;
    }
    #[inline(always)]
    fn set_vlan_id(&mut self, _vlan: u16) {}
    #[inline(always)]
    fn set(&mut self, w: &WorkCompletion) {
        self.0 = to_c(w);
    }
    #[inline(always)]
    fn wants_timestamp(&self) -> bool {
        false
    }
}

/// The program's `ibv_wc` array as a poll's sink: the decoder writes each entry in place.
struct CWc {
    wc: *mut ibv_wc,
    len: usize,
}

impl WcSink for CWc {
    type Out = CWcEntry;
    #[inline(always)]
    fn capacity(&self) -> usize {
        self.len
    }
    #[inline(always)]
    fn fill(
        &mut self,
        i: usize,
        decode: impl FnOnce(&mut CWcEntry) -> Result<bool, CqeError>,
    ) -> Result<bool, CqeError> {
        assert!(i < self.len, "completion {i} beyond the {} asked for", self.len);
        // SAFETY: the program's array holds `len` entries (ibv_poll_cq's contract), `i < len`, and `CWcEntry` is
        // `ibv_wc` (repr(transparent)) of integers only; the decoder's first write (`begin`) stores the whole entry
        // before any field is read, and an entry past the completions returned is the program's scratch.
        decode(unsafe { &mut *self.wc.add(i).cast::<CWcEntry>() })
    }
}

unsafe extern "C" fn poll_cq(cq: *mut ibv_cq, num: c_int, wc: *mut ibv_wc) -> c_int {
    guard_datapath("ibv_poll_cq", -libc::EIO, || {
        // SAFETY: the caller passes a live CQ.
        let Some((_, raw)) = (unsafe { cq_of(cq) }) else { return -libc::EINVAL };
        // libmlx5's poll loop runs while it has polled fewer than `num`: a negative count polls nothing.
        let Ok(want) = usize::try_from(num) else { return 0 };
        if want > 0 && wc.is_null() {
            return -libc::EINVAL;
        }
        // One call, one lock of the CQ: a bad CQE met after good completions is kept by the CQ and reported by
        // the next poll, so the completions before it are returned now.
        match raw.poll_into(&mut CWc { wc, len: want }) {
            Ok(n) => n as c_int,
            Err(e) => {
                log::warn!("poll_cq: {e}");
                -errno_of(&e)
            }
        }
    })
}

unsafe extern "C" fn req_notify_cq(cq: *mut ibv_cq, solicited_only: c_int) -> c_int {
    guard("ibv_req_notify_cq", libc::EIO, || {
        // SAFETY: the caller passes a live CQ.
        let Some((_, raw)) = (unsafe { cq_of(cq) }) else { return libc::EINVAL };
        let n = if solicited_only != 0 { Notify::Solicited } else { Notify::NextComp };
        match raw.req_notify(n) {
            Ok(()) => 0,
            Err(e) => errno_of(&e),
        }
    })
}

// A C scatter list is read in place as the core's: `Sge` is `repr(C)` with `ibv_sge`'s fields in its order.
const _: () = {
    assert!(std::mem::size_of::<Sge>() == std::mem::size_of::<ibv_sge>());
    assert!(std::mem::align_of::<Sge>() == std::mem::align_of::<ibv_sge>());
    assert!(std::mem::offset_of!(Sge, addr) == std::mem::offset_of!(ibv_sge, addr));
    assert!(std::mem::offset_of!(Sge, length) == std::mem::offset_of!(ibv_sge, length));
    assert!(std::mem::offset_of!(Sge, lkey) == std::mem::offset_of!(ibv_sge, lkey));
};

/// A C scatter list as the core's, in place (no copy): a negative count or a NULL list with entries is refused
/// (`EINVAL`), more than any mlx5 WQE holds (the slice is never made over memory the program did not give) is
/// `TooManySge` (libmlx5's `_mlx5_post_send` answers ENOMEM, `mlx5_post_recv` EINVAL). The core checks the count
/// against the queue's own maximum.
///
/// # Safety
/// `sg` holds `n` entries when `n > 0`, alive and unchanged for `'a`.
#[inline(always)]
unsafe fn sges<'a>(sg: *const ibv_sge, n: c_int) -> Result<&'a [Sge], PostErrorKind> {
    // One compare for the usual 1..=MAX_SGE entries (a negative count wraps past it).
    if (n as u32).wrapping_sub(1) < MAX_SGE as u32 && !sg.is_null() {
        // SAFETY: `n` entries (caller) of a type with the same layout (checked above at compile time).
        return Ok(unsafe { std::slice::from_raw_parts(sg.cast::<Sge>(), n as usize) });
    }
    sges_other(n)
}

/// [`sges`] with the usual single entry tested first, for the send loop: inlined after it, the core's send
/// loop then knows the length on that path (about 0.2 ns less per one-WR post here; the receive loop, out of
/// line in the core, was slower with it).
///
/// # Safety
/// As [`sges`].
#[inline(always)]
unsafe fn sges_one_first<'a>(sg: *const ibv_sge, n: c_int) -> Result<&'a [Sge], PostErrorKind> {
    if n == 1 && !sg.is_null() {
        // SAFETY: one entry (caller) of a type with the same layout (checked above at compile time).
        return Ok(unsafe { std::slice::from_raw_parts(sg.cast::<Sge>(), 1) });
    }
    // SAFETY: the caller's promise, passed on.
    unsafe { sges(sg, n) }
}

/// [`sges`] of an empty list, or one it refuses.
#[cold]
fn sges_other<'a>(n: c_int) -> Result<&'a [Sge], PostErrorKind> {
    match usize::try_from(n) {
        Err(_) => Err(PostErrorKind::BadRequest { what: "negative num_sge" }),
        Ok(0) => Ok(&[]),
        Ok(n) if n > MAX_SGE => Err(PostErrorKind::TooManySge { sge: n, max: MAX_SGE as u32 }),
        Ok(_) => Err(PostErrorKind::BadRequest { what: "NULL sg_list with entries" }),
    }
}

/// One of a program's `ibv_send_wr`s as the core's post loop reads it ([`SendWrView`]): each field read where the
/// program keeps it, the union member the opcode selects only, no `SendWr` built.
///
/// Invariant (made only by [`SendList`], whose maker vouches for it): the pointer is a valid work request whose
/// scatter list, inline data and address handle are as verbs requires of `ibv_post_send`, alive and unchanged
/// while the post runs.
struct CSendWr(*mut ibv_send_wr);

impl CSendWr {
    #[inline(always)]
    fn w(&self) -> &ibv_send_wr {
        // SAFETY: a valid work request for the post's duration (the type's invariant).
        unsafe { &*self.0 }
    }

    /// The scatter list in place.
    #[inline(always)]
    fn sges(&self) -> Result<&[Sge], PostErrorKind> {
        let w = self.w();
        // SAFETY: the program's scatter list holds `num_sge` entries (the type's invariant).
        unsafe { sges_one_first(w.sg_list, w.num_sge) }
    }
}

impl SendWrView for CSendWr {
    type Op<'a> = SendOp;
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        self.w().wr_id
    }

    #[inline(always)]
    fn op(&self) -> Result<SendOp, PostErrorKind> {
        let w = self.w();
        // Only the member of the union the opcode selects is read.
        Ok(match w.opcode {
            2 => SendOp::Send,
            3 => SendOp::SendImm { imm: w.imm_data },
            0 | 1 | 4 => {
                // SAFETY: an RDMA operation's union member is `rdma`.
                let r = unsafe { w.wr.rdma };
                match w.opcode {
                    0 => SendOp::RdmaWrite { remote_addr: r.remote_addr, rkey: r.rkey },
                    1 => SendOp::RdmaWriteImm { remote_addr: r.remote_addr, rkey: r.rkey, imm: w.imm_data },
                    _ => SendOp::RdmaRead { remote_addr: r.remote_addr, rkey: r.rkey },
                }
            }
            5 | 6 => {
                // SAFETY: an atomic's union member is `atomic`.
                let a = unsafe { w.wr.atomic };
                if w.opcode == 5 {
                    SendOp::AtomicCmpSwp {
                        remote_addr: a.remote_addr,
                        rkey: a.rkey,
                        compare: a.compare_add,
                        swap: a.swap,
                    }
                } else {
                    SendOp::AtomicFetchAdd { remote_addr: a.remote_addr, rkey: a.rkey, add: a.compare_add }
                }
            }
            _ => return Err(PostErrorKind::BadRequest { what: "opcode this library does not post" }),
        })
    }

    #[inline(always)]
    fn flags(&self) -> SendFlags {
        SendFlags(self.w().send_flags & 7)
    }

    #[inline(always)]
    fn sg_list(&self) -> Result<&[Sge], PostErrorKind> {
        if self.w().send_flags & SEND_INLINE != 0 {
            return Ok(&[]);
        }
        self.sges()
    }

    #[inline(always)]
    fn inline(&self) -> Result<Option<InlineData<'_>>, PostErrorKind> {
        if self.w().send_flags & SEND_INLINE == 0 {
            return Ok(None);
        }
        let sg = self.sges()?;
        // SAFETY: each entry of an inline send's list is readable for its length while the post runs (verbs'
        // contract, the type's invariant); the core reads them while it builds the WQE.
        Ok(Some(unsafe { InlineData::gather(sg) }))
    }

    #[inline(always)]
    fn ud(&self, datagram: bool) -> Result<Option<UdDest<'_>>, PostErrorKind> {
        let w = self.w();
        // A connected QP's program leaves what it likes in the union: it is not read.
        if !datagram || !matches!(w.opcode, 2 | 3) {
            return Ok(None);
        }
        // SAFETY: a SEND on a UD QP: the union's `ud` member.
        let u = unsafe { w.wr.ud };
        // SAFETY: a UD work request names an address handle of this library (the type's invariant).
        let ah = unsafe { u.ah.cast_const().cast::<Ah>().as_ref() }
            .ok_or(PostErrorKind::BadRequest { what: "UD send with a NULL address handle" })?;
        Ok(Some(UdDest { ah: &ah.ah, remote_qpn: u.remote_qpn, remote_qkey: u.remote_qkey }))
    }
}

/// The errno `ibv_post_send` answers for a work request the core refused: as `errno_of`, but more gather entries
/// than the QP takes is `ENOMEM` there (libmlx5's `_mlx5_post_send`).
#[cold]
fn send_errno(kind: PostErrorKind) -> c_int {
    log::debug!("post_send: {kind:?}");
    match kind {
        PostErrorKind::TooManySge { .. } => libc::ENOMEM,
        k => recv_errno(k),
    }
}

/// The errno for a work request the core refused (`errno_of` of the same error).
fn recv_errno(kind: PostErrorKind) -> c_int {
    errno_of(&mlx5_verbs::VerbsError::Post(PostError { index: 0, kind }))
}

/// Stores `w` in the program's `bad_wr`, if it gave one.
///
/// # Safety
/// `bad` is NULL or writable.
#[inline(always)]
unsafe fn set_bad<T>(bad: *mut *mut T, w: *mut T) {
    if !bad.is_null() {
        // SAFETY: the caller's out pointer.
        unsafe { *bad = w };
    }
}

/// `ibv_post_send`; `LOCKED`: the context's queues lock (their lock's mode is then not tested).
unsafe extern "C" fn post_send<const LOCKED: bool>(
    qp: *mut ibv_qp,
    wr: *mut ibv_send_wr,
    bad: *mut *mut ibv_send_wr,
) -> c_int {
    guard_datapath("ibv_post_send", libc::EIO, || {
        // SAFETY: the caller passes a live QP.
        let Some(q) = (unsafe { qp_of(qp) }) else { return libc::EINVAL };
        // The whole list goes to the core's post loop, read in place: one doorbell for every WQE written
        // (BlueFlame for a single one). A list of one has its own copy of the loop, which runs once: with no
        // state kept for a next WR, about 30 instructions fewer a call (fewer values through the stack, no
        // loop count or exit).
        // SAFETY: the caller's work request, when not NULL (verbs' contract).
        let out = if !wr.is_null() && unsafe { (*wr).next }.is_null() {
            q.raw.post_each_or::<_, LOCKED>(SendOne(wr))
        } else {
            q.raw.post_each_or::<_, LOCKED>(SendList(wr))
        };
        match out {
            Ok(()) => 0,
            // SAFETY: the caller's out pointer.
            Err((w, e)) => unsafe { failed(bad, w, e) },
        }
    })
}

/// A program's `ibv_send_wr` list, posted by the core with the device's own register access. Made only from the
/// list `ibv_post_send` was given (verbs' contract: valid, unchanged while the call runs).
struct SendList(*mut ibv_send_wr);

impl Iterator for SendList {
    type Item = CSendWr;
    #[inline(always)]
    fn next(&mut self) -> Option<CSendWr> {
        if self.0.is_null() {
            return None;
        }
        let w = CSendWr(self.0);
        self.0 = w.w().next;
        Some(w)
    }
}

impl QpFnOr for SendList {
    #[inline(always)]
    fn unavailable(self, dead: bool) -> Self::Out {
        Err((self.0, unavailable_errno(dead)))
    }
}

impl QpFn for SendList {
    /// The refused work request and its errno: two words, where the core's error kind kept a larger result in
    /// memory on the hot path.
    type Out = Result<(), (*mut ibv_send_wr, c_int)>;
    #[inline(always)]
    fn run<M: Mmio + ?Sized>(self, qp: &mut mlx5_core::qp::Qp, m: &M) -> Self::Out {
        post_send_list(qp, m, self)
    }
}

/// The core's send loop over a list, in a frame of its own: what the entry keeps live around it (the lock's
/// guard, the panic guard's state) then does not change how the loop keeps its own state in registers (inlined,
/// a change to the lock alone cost the loop about five instructions per WQE).
#[inline(never)]
fn post_send_list<M: Mmio + ?Sized>(
    qp: &mut mlx5_core::qp::Qp,
    m: &M,
    list: SendList,
) -> Result<(), (*mut ibv_send_wr, c_int)> {
    qp.post_send_iter(m, list).map_err(|(w, kind)| (w.0, send_errno(kind)))
}

/// A list of one `ibv_send_wr` (not NULL, its `next` NULL), posted as [`SendList`] is. Made only by
/// `ibv_post_send` from the request it was given (verbs' contract: valid, unchanged while the call runs).
struct SendOne(*mut ibv_send_wr);

impl QpFnOr for SendOne {
    #[inline(always)]
    fn unavailable(self, dead: bool) -> Self::Out {
        Err((self.0, unavailable_errno(dead)))
    }
}

impl QpFn for SendOne {
    type Out = Result<(), (*mut ibv_send_wr, c_int)>;
    #[inline(always)]
    fn run<M: Mmio + ?Sized>(self, qp: &mut mlx5_core::qp::Qp, m: &M) -> Self::Out {
        qp.post_send_iter(m, core::iter::once(CSendWr(self.0))).map_err(|(w, kind)| (w.0, send_errno(kind)))
    }
}

/// A program's `ibv_recv_wr` list, posted by the core with the device's own register access. Made only from the
/// list `ibv_post_recv` was given (verbs' contract: valid, unchanged while the call runs).
///
/// The next pointer is read as each work request is handed out: the core's receive loop runs in a frame of its
/// own, where both pointers stay in registers (when the loop was inlined into this library's entry, the list
/// stepped lazily behind a flag, so that one pointer only was live across the body).
struct RecvList(*mut ibv_recv_wr);

/// One of a program's `ibv_recv_wr`s, read in place; the invariant of [`CSendWr`].
struct CRecvWr(std::ptr::NonNull<ibv_recv_wr>);

impl RecvWrView for CRecvWr {
    #[inline(always)]
    fn wr_id(&self) -> u64 {
        // SAFETY: a valid work request for the post's duration (the type's invariant).
        unsafe { self.0.as_ref().wr_id }
    }
    #[inline(always)]
    fn sg_list(&self) -> Result<&[Sge], PostErrorKind> {
        // SAFETY: as above.
        let w = unsafe { self.0.as_ref() };
        // SAFETY: its scatter list holds `num_sge` entries (as above).
        unsafe { sges(w.sg_list, w.num_sge) }
    }
    /// Exactly one entry, at a non-NULL list: two compares.
    #[inline(always)]
    fn one_sge(&self) -> Option<&Sge> {
        // SAFETY: as above.
        let w = unsafe { self.0.as_ref() };
        if w.num_sge == 1 && !w.sg_list.is_null() {
            // SAFETY: one entry (as above) of a type with `ibv_sge`'s layout (checked at compile time).
            return Some(unsafe { &*w.sg_list.cast::<Sge>() });
        }
        None
    }
}

impl Iterator for RecvList {
    type Item = CRecvWr;
    #[inline(always)]
    fn next(&mut self) -> Option<CRecvWr> {
        let w = std::ptr::NonNull::new(self.0)?;
        // SAFETY: a valid work request of the program's list (the type's invariant).
        self.0 = unsafe { w.as_ref().next };
        Some(CRecvWr(w))
    }
}

impl QpFnOr for RecvList {
    #[inline(always)]
    fn unavailable(self, dead: bool) -> Self::Out {
        Err((self.0, unavailable_errno(dead)))
    }
}

/// The errno of a post on a destroyed QP (as `errno_of` gives `VerbsError::Destroyed`) or a dead device (a post's
/// `DeviceError`).
#[inline(always)]
fn unavailable_errno(dead: bool) -> c_int {
    if dead {
        libc::EIO
    } else {
        libc::EINVAL
    }
}

impl QpFn for RecvList {
    type Out = Result<(), (*mut ibv_recv_wr, c_int)>;
    #[inline(always)]
    fn run<M: Mmio + ?Sized>(self, qp: &mut mlx5_core::qp::Qp, m: &M) -> Self::Out {
        qp.post_recv_iter(m, self).map_err(|(w, kind)| (w.0.as_ptr(), recv_errno(kind)))
    }
}

/// A post that stopped at `w`: `bad_wr` set, the errno returned. Out of line: the posting loop keeps its
/// registers.
///
/// # Safety
/// `bad` is NULL or writable.
#[cold]
#[inline(never)]
unsafe fn failed<T>(bad: *mut *mut T, w: *mut T, e: c_int) -> c_int {
    // SAFETY: the caller's out pointer.
    unsafe { set_bad(bad, w) };
    e
}

/// Walks a receive list, pushing each (translated in place) through `push`; returns the first refused and its
/// errno.
///
/// # Safety
/// The list is valid, as verbs requires of `ibv_post_recv`.
#[inline(always)]
unsafe fn push_recvs(
    wr: *mut ibv_recv_wr,
    mut push: impl FnMut(&RecvWr<'_>) -> Result<(), PostErrorKind>,
) -> Result<(), (*mut ibv_recv_wr, c_int)> {
    let mut w = wr;
    while !w.is_null() {
        // SAFETY: the program's list of work requests.
        let r = unsafe { &*w };
        // SAFETY: its scatter list.
        let res = unsafe { sges(r.sg_list, r.num_sge) }
            .and_then(|sg| push(&RecvWr { wr_id: r.wr_id, sg_list: sg }))
            .map_err(recv_errno);
        if let Err(e) = res {
            return Err((w, e));
        }
        w = r.next;
    }
    Ok(())
}

/// The result of a receive post: 0, or `bad_wr` set and the errno.
///
/// # Safety
/// `bad` is NULL or writable.
#[inline(always)]
unsafe fn recv_result(
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
    r: mlx5_verbs::Result<Result<(), (*mut ibv_recv_wr, c_int)>>,
) -> c_int {
    match r {
        Ok(Ok(())) => 0,
        // SAFETY: the caller's out pointer.
        Ok(Err((w, e))) => unsafe { failed(bad, w, e) },
        // SAFETY: as above.
        Err(e) => unsafe { failed(bad, wr, errno_of(&e)) },
    }
}

/// `ibv_post_recv`; `LOCKED` as for [`post_send`].
unsafe extern "C" fn post_recv<const LOCKED: bool>(
    qp: *mut ibv_qp,
    wr: *mut ibv_recv_wr,
    bad: *mut *mut ibv_recv_wr,
) -> c_int {
    guard_datapath("ibv_post_recv", libc::EIO, || {
        // SAFETY: the caller passes a live QP.
        let Some(q) = (unsafe { qp_of(qp) }) else { return libc::EINVAL };
        if !q.c.qp_base.srq.is_null() {
            // SAFETY: the caller's out pointer.
            unsafe { set_bad(bad, wr) };
            return libc::EINVAL;
        }
        // One doorbell record update for all of the list.
        match q.raw.post_recvs_or::<_, LOCKED>(RecvList(wr)) {
            Ok(()) => 0,
            // SAFETY: the caller's out pointer.
            Err((w, e)) => unsafe { failed(bad, w, e) },
        }
    })
}

unsafe extern "C" fn post_srq_recv(srq: *mut ibv_srq, wr: *mut ibv_recv_wr, bad: *mut *mut ibv_recv_wr) -> c_int {
    guard_datapath("ibv_post_srq_recv", libc::EIO, || {
        // SAFETY: the caller passes a live SRQ.
        let Some(s) = (unsafe { srq_of(srq) }) else { return libc::EINVAL };
        // SAFETY: the caller's list; one doorbell record update for all of it.
        let r = s.raw.post_recv_with(|b| unsafe { push_recvs(wr, |r| b.push(r)) });
        // SAFETY: the caller's out pointer.
        unsafe { recv_result(wr, bad, r) }
    })
}

/// Polls one completion into the extended CQ's public fields: 0, ENOENT when empty, or an errno.
///
/// # Safety
/// `cq` is a live CQ of this library.
unsafe fn ex_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: the caller's duty.
    let Some((c, raw)) = (unsafe { cq_of(cq.cast()) }) else { return libc::EINVAL };
    let mut w = [WorkCompletion::default()];
    match raw.poll(&mut w) {
        Ok(0) => libc::ENOENT,
        Ok(_) => {
            lock(&c.ex).cur = w[0];
            // SAFETY: the public fields of the program's ibv_cq_ex.
            unsafe {
                (*cq).status = w[0].status as c_int;
                (*cq).wr_id = w[0].wr_id;
            }
            0
        }
        Err(e) => errno_of(&e),
    }
}

unsafe extern "C" fn start_poll(cq: *mut ibv_cq_ex, _attr: *mut c_void) -> c_int {
    // SAFETY: forwarded.
    guard("ibv_start_poll", libc::EIO, || unsafe { ex_poll(cq) })
}
unsafe extern "C" fn next_poll(cq: *mut ibv_cq_ex) -> c_int {
    // SAFETY: forwarded.
    guard("ibv_next_poll", libc::EIO, || unsafe { ex_poll(cq) })
}
unsafe extern "C" fn end_poll(_cq: *mut ibv_cq_ex) {}

// Each reader takes the extended poll's lock once and reads its one field in place (no copy of the whole
// completion).
macro_rules! cq_read {
    ($name:ident, $t:ty, |$w:ident| $e:expr) => {
        unsafe extern "C" fn $name(cq: *mut ibv_cq_ex) -> $t {
            // SAFETY: the program passes the CQ it polls.
            match unsafe { cq_of(cq.cast()) } {
                Some((c, _)) => {
                    let g = lock(&c.ex);
                    let $w = &g.cur;
                    $e
                }
                None => {
                    let $w = &WorkCompletion::default();
                    $e
                }
            }
        }
    };
}

cq_read!(read_opcode, c_int, |w| wc_opcode(w.opcode));
cq_read!(read_vendor_err, u32, |w| w.vendor_err);
cq_read!(read_byte_len, u32, |w| w.byte_len);
cq_read!(read_imm_data, u32, |w| if w.wc_flags.contains(WcFlags::WITH_INV) { w.invalidated_rkey } else { w.imm_data });
cq_read!(read_qp_num, u32, |w| w.qp_num);
cq_read!(read_src_qp, u32, |w| w.src_qp);
cq_read!(read_wc_flags, c_uint, |w| w.wc_flags.0);
cq_read!(read_slid, u32, |w| u32::from(w.slid));
cq_read!(read_sl, u8, |w| w.sl);
cq_read!(read_dlid_path_bits, u8, |w| w.dlid_path_bits);
cq_read!(read_completion_ts, u64, |w| w.timestamp);
cq_read!(read_cvlan, u16, |w| w.vlan_id.unwrap_or(0));
cq_read!(read_flow_tag, u32, |_w| 0);
cq_read!(read_wallclock, u64, |_w| 0);

unsafe extern "C" fn read_tm_info(_cq: *mut ibv_cq_ex, info: *mut c_void) {
    if !info.is_null() {
        // SAFETY: struct ibv_wc_tm_info is 16 bytes (tag, priv); no tag matching here, so zero.
        unsafe { ptr::write_bytes(info.cast::<u8>(), 0, 16) };
    }
}

pub(crate) fn fill_cq_ex(c: &mut ibv_cq_ex) {
    c.start_poll = Some(start_poll);
    c.next_poll = Some(next_poll);
    c.end_poll = Some(end_poll);
    c.read_opcode = Some(read_opcode);
    c.read_vendor_err = Some(read_vendor_err);
    c.read_byte_len = Some(read_byte_len);
    c.read_imm_data = Some(read_imm_data);
    c.read_qp_num = Some(read_qp_num);
    c.read_src_qp = Some(read_src_qp);
    c.read_wc_flags = Some(read_wc_flags);
    c.read_slid = Some(read_slid);
    c.read_sl = Some(read_sl);
    c.read_dlid_path_bits = Some(read_dlid_path_bits);
    c.read_completion_ts = Some(read_completion_ts);
    c.read_cvlan = Some(read_cvlan);
    c.read_flow_tag = Some(read_flow_tag);
    c.read_tm_info = Some(read_tm_info);
    c.read_completion_wallclock_ns = Some(read_wallclock);
}

/// The QP and its batch.
///
/// # Safety
/// `qp` is a live QP of this library.
unsafe fn batch<'a>(qp: *mut ibv_qp_ex) -> Option<(&'a Qp, std::sync::MutexGuard<'a, WrBatch>)> {
    // SAFETY: the caller's duty.
    let q = unsafe { qp_of(qp.cast()) }?;
    Some((q, lock(&q.wr)))
}

/// Starts a new work request of `op` (allowed by `need`, an `IBV_QP_EX_WITH_*` bit).
///
/// # Safety
/// `qp` is a live QP of this library.
unsafe fn wr_op(qp: *mut ibv_qp_ex, need: u64, op: SendOp) {
    // SAFETY: the caller's duty.
    let Some((q, mut b)) = (unsafe { batch(qp) }) else { return };
    if b.ops & need == 0 {
        b.err = libc::EOPNOTSUPP;
        return;
    }
    let (wr_id, flags) = (q.c.wr_id, q.c.wr_flags);
    let at = b.sges.len();
    b.wrs.push(PendingWr { wr_id, flags, op, sg: at..at, inline: None, ud: None });
}

unsafe extern "C" fn wr_start(qp: *mut ibv_qp_ex) {
    // SAFETY: the program passes its QP.
    if let Some((_, mut b)) = unsafe { batch(qp) } {
        clear(&mut b);
    }
}

unsafe extern "C" fn wr_abort(qp: *mut ibv_qp_ex) {
    // SAFETY: as wr_start.
    unsafe { wr_start(qp) }
}

unsafe extern "C" fn wr_complete(qp: *mut ibv_qp_ex) -> c_int {
    guard("ibv_wr_complete", libc::EIO, || {
        // SAFETY: the program passes its QP.
        let Some((q, mut b)) = (unsafe { batch(qp) }) else { return libc::EINVAL };
        let err = std::mem::take(&mut b.err);
        if err != 0 {
            clear(&mut b);
            return err;
        }
        // The whole batch goes to the core as one list: one doorbell, BlueFlame for a single small WQE.
        let r = q.raw.post_send_with(|sb| {
            for p in &b.wrs {
                let ud = match (q.qp_type, p.ud) {
                    (QpType::Ud | QpType::Gsi | QpType::Smi, Some((ah, qpn, qkey))) => {
                        // SAFETY: the program's address handle, created by this library.
                        let Some(ah) = (unsafe { ah.as_ref() }) else { return libc::EINVAL };
                        Some(UdDest { ah: &ah.ah, remote_qpn: qpn, remote_qkey: qkey })
                    }
                    (QpType::Ud | QpType::Gsi | QpType::Smi, None) => return libc::EINVAL,
                    _ => None,
                };
                let inline = p.inline.clone().map(|r| &b.bytes[r]);
                let wr = SendWr {
                    wr_id: p.wr_id,
                    op: p.op,
                    sg_list: if inline.is_some() { &[] } else { &b.sges[p.sg.clone()] },
                    flags: SendFlags(p.flags & 7),
                    inline,
                    ud,
                };
                if let Err(kind) = sb.push(&wr) {
                    return send_errno(kind);
                }
            }
            0
        });
        clear(&mut b);
        r.unwrap_or_else(|e| errno_of(&e))
    })
}

/// Empties a batch, keeping its storage.
fn clear(b: &mut WrBatch) {
    b.wrs.clear();
    b.sges.clear();
    b.bytes.clear();
    b.err = 0;
}

unsafe extern "C" fn wr_send(qp: *mut ibv_qp_ex) {
    // SAFETY: the program passes its QP.
    unsafe { wr_op(qp, 1 << 2, SendOp::Send) }
}
unsafe extern "C" fn wr_send_imm(qp: *mut ibv_qp_ex, imm: u32) {
    // SAFETY: as wr_send.
    unsafe { wr_op(qp, 1 << 3, SendOp::SendImm { imm }) }
}
unsafe extern "C" fn wr_rdma_write(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: as wr_send.
    unsafe { wr_op(qp, 1 << 0, SendOp::RdmaWrite { remote_addr, rkey }) }
}
unsafe extern "C" fn wr_rdma_write_imm(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64, imm: u32) {
    // SAFETY: as wr_send.
    unsafe { wr_op(qp, 1 << 1, SendOp::RdmaWriteImm { remote_addr, rkey, imm }) }
}
unsafe extern "C" fn wr_rdma_read(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64) {
    // SAFETY: as wr_send.
    unsafe { wr_op(qp, 1 << 4, SendOp::RdmaRead { remote_addr, rkey }) }
}
unsafe extern "C" fn wr_atomic_cmp_swp(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64, compare: u64, swap: u64) {
    // SAFETY: as wr_send.
    unsafe { wr_op(qp, 1 << 5, SendOp::AtomicCmpSwp { remote_addr, rkey, compare, swap }) }
}
unsafe extern "C" fn wr_atomic_fetch_add(qp: *mut ibv_qp_ex, rkey: u32, remote_addr: u64, add: u64) {
    // SAFETY: as wr_send.
    unsafe { wr_op(qp, 1 << 6, SendOp::AtomicFetchAdd { remote_addr, rkey, add }) }
}

/// Marks the batch failed: an operation this library does not build.
unsafe fn wr_unsupported(qp: *mut ibv_qp_ex) {
    // SAFETY: the program passes its QP.
    if let Some((_, mut b)) = unsafe { batch(qp) } {
        b.err = libc::EOPNOTSUPP;
    }
}
unsafe extern "C" fn wr_bind_mw(qp: *mut ibv_qp_ex, _: *mut c_void, _: u32, _: *const c_void) {
    // SAFETY: as wr_unsupported.
    unsafe { wr_unsupported(qp) }
}
unsafe extern "C" fn wr_u32_unsupported(qp: *mut ibv_qp_ex, _: u32) {
    // SAFETY: as wr_unsupported.
    unsafe { wr_unsupported(qp) }
}
unsafe extern "C" fn wr_send_tso(qp: *mut ibv_qp_ex, _: *mut c_void, _: u16, _: u16) {
    // SAFETY: as wr_unsupported.
    unsafe { wr_unsupported(qp) }
}
unsafe extern "C" fn wr_atomic_write(qp: *mut ibv_qp_ex, _: u32, _: u64, _: *const c_void) {
    // SAFETY: as wr_unsupported.
    unsafe { wr_unsupported(qp) }
}

/// Applies `f` to the last work request of the batch (a setter without one fails the batch).
///
/// # Safety
/// `qp` is a live QP of this library.
unsafe fn with_last(qp: *mut ibv_qp_ex, f: impl FnOnce(&mut WrBatch)) {
    // SAFETY: the caller's duty.
    let Some((_, mut b)) = (unsafe { batch(qp) }) else { return };
    if b.wrs.is_empty() {
        if b.err == 0 {
            b.err = libc::EINVAL;
        }
        return;
    }
    f(&mut b)
}

/// Sets the last work request's gather list to `sg` (a later setter replaces an earlier one).
fn set_sg(b: &mut WrBatch, sg: impl Iterator<Item = Sge>) {
    let at = b.sges.len();
    b.sges.extend(sg);
    let end = b.sges.len();
    if let Some(w) = b.wrs.last_mut() {
        w.sg = at..end;
    }
}

/// Sets the last work request's inline bytes to the concatenation of `parts`.
fn set_inline<'a>(b: &mut WrBatch, parts: impl Iterator<Item = &'a [u8]>) {
    let at = b.bytes.len();
    for p in parts {
        b.bytes.extend_from_slice(p);
    }
    let end = b.bytes.len();
    if let Some(w) = b.wrs.last_mut() {
        w.inline = Some(at..end);
    }
}

unsafe extern "C" fn wr_set_ud_addr(qp: *mut ibv_qp_ex, ah: *mut ibv_ah, qpn: u32, qkey: u32) {
    // SAFETY: the program passes its QP.
    unsafe {
        with_last(qp, |b| {
            if let Some(w) = b.wrs.last_mut() {
                w.ud = Some((ah.cast_const().cast(), qpn, qkey));
            }
        })
    }
}
unsafe extern "C" fn wr_set_sge(qp: *mut ibv_qp_ex, lkey: u32, addr: u64, length: u32) {
    // SAFETY: the program passes its QP.
    unsafe { with_last(qp, |b| set_sg(b, std::iter::once(Sge { addr, length, lkey }))) }
}
unsafe extern "C" fn wr_set_sge_list(qp: *mut ibv_qp_ex, n: usize, list: *const ibv_sge) {
    let n = if list.is_null() { 0 } else { n };
    if n > MAX_SGE {
        // More than any WQE holds (libmlx5 answers ENOMEM past the QP's max_send_sge); nothing is read.
        // SAFETY: the program passes its QP.
        unsafe { fail_batch(qp, libc::ENOMEM) };
        return;
    }
    // SAFETY: the program's list holds n entries, of the core's layout (checked at compile time above).
    let sg = unsafe { std::slice::from_raw_parts(list.cast::<Sge>(), n) };
    // SAFETY: the program passes its QP.
    unsafe { with_last(qp, |b| set_sg(b, sg.iter().copied())) }
}
/// Fails the batch with `e` unless it already failed.
///
/// # Safety
/// `qp` is a live QP of this library.
unsafe fn fail_batch(qp: *mut ibv_qp_ex, e: c_int) {
    // SAFETY: the caller's duty.
    if let Some((_, mut b)) = unsafe { batch(qp) } {
        if b.err == 0 {
            b.err = e;
        }
    }
}

/// Whether `len` inline bytes fit the QP's `max_inline_data`; if not the batch fails with `ENOMEM` and nothing
/// is copied, as libmlx5's `_mlx5_send_wr_set_inline_data` answers.
///
/// # Safety
/// `qp` is a live QP of this library.
unsafe fn inline_fits(qp: *mut ibv_qp_ex, len: usize) -> bool {
    // SAFETY: the caller's duty.
    let Some((q, mut b)) = (unsafe { batch(qp) }) else { return false };
    let fits = len <= q.raw.cap().max_inline_data as usize;
    if !fits && b.err == 0 {
        b.err = libc::ENOMEM;
    }
    fits
}

unsafe extern "C" fn wr_set_inline_data(qp: *mut ibv_qp_ex, addr: *mut c_void, len: usize) {
    // SAFETY: the program passes its QP.
    if !unsafe { inline_fits(qp, len) } {
        return;
    }
    let data: &[u8] = if addr.is_null() || len == 0 {
        &[]
    } else {
        // SAFETY: the program's buffer holds len bytes; inline data is copied now, as verbs specifies.
        unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }
    };
    // SAFETY: the program passes its QP.
    unsafe { with_last(qp, |b| set_inline(b, std::iter::once(data))) }
}
unsafe extern "C" fn wr_set_inline_data_list(qp: *mut ibv_qp_ex, n: usize, list: *const ibv_data_buf) {
    let n = if list.is_null() { 0 } else { n };
    if n > MAX_INLINE {
        // More buffers than inline bytes fit a WQE; nothing is read.
        // SAFETY: the program passes its QP.
        unsafe { fail_batch(qp, libc::ENOMEM) };
        return;
    }
    // SAFETY: the program's list holds n buffers.
    let bufs = unsafe { std::slice::from_raw_parts(list, n) };
    let total = bufs.iter().fold(0usize, |t, b| t.saturating_add(b.length));
    // SAFETY: the program passes its QP.
    if !unsafe { inline_fits(qp, total) } {
        return;
    }
    let parts = bufs.iter().filter(|b| !b.addr.is_null() && b.length > 0).map(|b| {
        // SAFETY: each buffer is readable for its length (the program's duty).
        unsafe { std::slice::from_raw_parts(b.addr.cast::<u8>(), b.length) }
    });
    // SAFETY: the program passes its QP.
    unsafe { with_last(qp, |b| set_inline(b, parts)) }
}

/// Fills the `ibv_wr_*` table: every pointer is a function (an operation not in `ops` fails the batch with
/// EOPNOTSUPP at `ibv_wr_complete`).
pub(crate) fn fill_qp_ex(q: &mut ibv_qp_ex, ops: u64) {
    q.comp_mask = 0;
    q.wr_atomic_cmp_swp = Some(wr_atomic_cmp_swp);
    q.wr_atomic_fetch_add = Some(wr_atomic_fetch_add);
    q.wr_bind_mw = Some(wr_bind_mw);
    q.wr_local_inv = Some(wr_u32_unsupported);
    q.wr_rdma_read = Some(wr_rdma_read);
    q.wr_rdma_write = Some(wr_rdma_write);
    q.wr_rdma_write_imm = Some(wr_rdma_write_imm);
    q.wr_send = Some(wr_send);
    q.wr_send_imm = Some(wr_send_imm);
    q.wr_send_inv = Some(wr_u32_unsupported);
    q.wr_send_tso = Some(wr_send_tso);
    q.wr_set_ud_addr = Some(wr_set_ud_addr);
    q.wr_set_xrc_srqn = Some(wr_u32_unsupported);
    q.wr_set_inline_data = Some(wr_set_inline_data);
    q.wr_set_inline_data_list = Some(wr_set_inline_data_list);
    q.wr_set_sge = Some(wr_set_sge);
    q.wr_set_sge_list = Some(wr_set_sge_list);
    q.wr_start = Some(wr_start);
    q.wr_complete = Some(wr_complete);
    q.wr_abort = Some(wr_abort);
    q.wr_atomic_write = Some(wr_atomic_write);
    let _ = ops;
}

/// Records the operations a QP's batches may use (called once the QP is boxed).
pub(crate) fn set_ops(q: &Qp, ops: u64) {
    lock(&q.wr).ops = ops;
}

#[cfg(test)]
mod wc_out_tests {
    use super::*;

    /// [`WcOut`] as a trait object, so one closure drives both.
    trait WcOutDyn {
        fn begin(&mut self, wr_id: u64, qp_num: u32, status: WcStatus, vendor_err: u32, ts: u64);
        fn set_opcode(&mut self, op: WcOpcode);
        fn add_flags(&mut self, f: WcFlags);
        fn set_byte_len(&mut self, n: u32);
        fn set_imm_data(&mut self, v: u32);
        fn set_invalidated_rkey(&mut self, v: u32);
        fn set_src(&mut self, src_qp: u32, bits: u8, pkey: u16, slid: u16, sl: u8);
        fn set_vlan_id(&mut self, v: u16);
    }

    impl<T: WcOut> WcOutDyn for T {
        fn begin(&mut self, wr_id: u64, qp_num: u32, status: WcStatus, vendor_err: u32, ts: u64) {
            WcOut::begin(self, wr_id, qp_num, status, vendor_err, ts);
        }
        fn set_opcode(&mut self, op: WcOpcode) {
            WcOut::set_opcode(self, op);
        }
        fn add_flags(&mut self, f: WcFlags) {
            WcOut::add_flags(self, f);
        }
        fn set_byte_len(&mut self, n: u32) {
            WcOut::set_byte_len(self, n);
        }
        fn set_imm_data(&mut self, v: u32) {
            WcOut::set_imm_data(self, v);
        }
        fn set_invalidated_rkey(&mut self, v: u32) {
            WcOut::set_invalidated_rkey(self, v);
        }
        fn set_src(&mut self, src_qp: u32, bits: u8, pkey: u16, slid: u16, sl: u8) {
            WcOut::set_src(self, src_qp, bits, pkey, slid, sl);
        }
        fn set_vlan_id(&mut self, v: u16) {
            WcOut::set_vlan_id(self, v);
        }
    }

    /// The same writes into the core's completion (converted by `to_c`, the conversion the poll used before) and
    /// into a program's `ibv_wc` in place must give the same entry, whatever the entry held before.
    fn run(write: impl Fn(&mut dyn WcOutDyn)) {
        let mut core = WorkCompletion::default();
        let stale = ibv_wc { wr_id: !0, status: -1, imm_data: 0xdead, wc_flags: !0, sl: 9, ..Default::default() };
        let mut c = CWcEntry(stale);
        write(&mut core);
        write(&mut c);
        // `ibv_wc` has no `PartialEq`: its Debug text names every field.
        assert_eq!(format!("{:?}", c.0), format!("{:?}", to_c(&core)));
    }

    #[test]
    fn ibv_wc_written_in_place_matches_the_converted_completion() {
        // A send requester completion with immediate data.
        run(|w| {
            w.begin(7, 0x11, WcStatus::Success, 0, 123);
            w.set_opcode(WcOpcode::Send);
            w.add_flags(WcFlags::WITH_IMM);
        });
        // An RDMA READ and an atomic (byte counts).
        run(|w| {
            w.begin(8, 0x11, WcStatus::Success, 0, 0);
            w.set_opcode(WcOpcode::RdmaRead);
            w.set_byte_len(4096);
        });
        run(|w| {
            w.begin(9, 0x11, WcStatus::Success, 0, 0);
            w.set_opcode(WcOpcode::MaskedFetchAdd);
            w.set_byte_len(8);
        });
        // Receives: with immediate, with an invalidated rkey (the same `ibv_wc` word), with GRH and VLAN.
        run(|w| {
            w.begin(10, 0x12, WcStatus::Success, 0, 5);
            w.set_byte_len(64);
            w.set_opcode(WcOpcode::RecvRdmaWithImm);
            w.add_flags(WcFlags::WITH_IMM);
            w.set_imm_data(0x0102_0304);
            w.add_flags(WcFlags::GRH);
            w.set_src(0x33, 1, 0, 0x44, 0xa);
            w.set_vlan_id(100);
        });
        run(|w| {
            w.begin(11, 0x12, WcStatus::Success, 0, 5);
            w.set_byte_len(0);
            w.set_opcode(WcOpcode::Recv);
            w.add_flags(WcFlags::WITH_INV);
            w.set_invalidated_rkey(0xabcd);
            w.set_src(0x33, 0, 0, 0, 0);
        });
        run(|w| {
            w.begin(12, 0x12, WcStatus::Success, 0, 0);
            w.set_opcode(WcOpcode::Recv);
            w.add_flags(WcFlags::IP_CSUM_OK);
            w.set_src(0, 0, 0, 0, 0);
        });
        // An error completion: status and vendor syndrome, the rest zero.
        run(|w| w.begin(13, 0x13, WcStatus::RemAccessErr, 0x88, 0));
    }
}
