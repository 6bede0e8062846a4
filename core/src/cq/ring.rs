//! The CQ ring ([`Cq`]): CQE ownership by the owner bit, the consumer index in the doorbell record, arming
//! (`mlx5_cq_arm`) and polling.

use super::cmd::CqeSize;
use super::cqe::{field, CqeFieldsRead, CqeOpcode, CqeRef, CQE64_SIZE, CQE_INIT_OP_OWN};
use super::wc::{decode_into, CqeError, LinkLayer, WcSink, WorkCompletion, WrTable};
use crate::buf::QueueBuf;
use crate::dbr::DbRec;
use crate::hal::{DmaView, Mmio};
use crate::prm::consts;

/// Offset of the CQ doorbell in a UAR page (`MLX5_CQ_DOORBELL`).
pub const CQ_DOORBELL: usize = consts::MLX5_CQ_DOORBELL as usize;

/// Which completions raise the next event (`ib_cq_notify_flags`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Notify {
    /// The next completion of any kind (`MLX5_CQ_DB_REQ_NOT`).
    NextComp,
    /// The next solicited or error completion (`MLX5_CQ_DB_REQ_NOT_SOL`).
    Solicited,
}

/// The arm doorbell value: `sn << 28 | cmd | ci` (`mlx5_cq_arm`).
pub const fn arm_value(arm_sn: u32, notify: Notify, cons_index: u32) -> u32 {
    let cmd = match notify {
        Notify::NextComp => consts::MLX5_CQ_DB_REQ_NOT,
        Notify::Solicited => consts::MLX5_CQ_DB_REQ_NOT_SOL,
    };
    ((arm_sn & 3) << 28) | cmd | (cons_index & 0xff_ffff)
}

/// Doorbell-record dwords (`set_ci_db`, `arm_db`).
const DBR_SET_CI: usize = 0;
const DBR_ARM: usize = 1;

/// See [`Cq::walk_of`].
struct Walk<'a> {
    flat: Option<DmaView<'a>>,
    mask: u32,
    log_nent: u8,
    /// log2 of the entry size.
    shift: u32,
    /// Offset of the 64-byte image in an entry.
    image: usize,
}

/// A created completion queue: its ring, doorbell record and consumer index.
///
/// Aligned to a cache line ([`CACHE_LINE`](crate::buf::CACHE_LINE)), so its consumer index never shares a line with another object,
/// wherever the caller keeps it.
#[derive(Debug)]
#[repr(align(64))]
pub struct Cq {
    pub(crate) buf: QueueBuf,
    pub(crate) dbrec: DbRec,
    cqn: u32,
    log_nent: u8,
    cqe_size: CqeSize,
    cons_index: u32,
    /// BAR offset of the CQ doorbell of the UAR page the CQ was created with.
    doorbell: usize,
    link: LinkLayer,
}

/// Copies one CQE of `stride` bytes from `sp` to `dp` with volatile accesses, its owner bit set to `owner`.
///
/// # Safety
/// Both spans are whole entries in live memory, and the device writes neither while they are copied.
unsafe fn copy_cqe(sp: *const u8, dp: *mut u8, stride: usize, owner: u8) {
    for k in 0..stride {
        // SAFETY: `k < stride`, inside both spans (the caller's duty).
        unsafe {
            let mut b = sp.add(k).read_volatile();
            if k == stride - 1 {
                b = (b & !1) | owner;
            }
            dp.add(k).write_volatile(b);
        }
    }
}

impl Cq {
    /// Pre-sets every CQE of `buf` to invalid with owner 1 (`op_own` 0xF1), so nothing is software-owned until the
    /// device writes it.
    pub fn init_buf(buf: &QueueBuf, log_nent: u8, cqe_size: CqeSize) {
        let stride = cqe_size.bytes();
        let own = stride - CQE64_SIZE + field::OP_OWN.off;
        for i in 0..(1usize << log_nent) {
            let (r, o) = buf.locate(i * stride);
            r.write_volatile_u8(o + own, CQE_INIT_OP_OWN);
        }
    }

    /// A ring over an initialised buffer, for CQ `cqn` whose doorbell is in the UAR page at BAR offset `uar_off`.
    pub fn new(
        buf: QueueBuf,
        dbrec: DbRec,
        cqn: u32,
        log_nent: u8,
        cqe_size: CqeSize,
        uar_off: usize,
        link: LinkLayer,
    ) -> Self {
        Self { buf, dbrec, cqn, log_nent, cqe_size, cons_index: 0, doorbell: uar_off + CQ_DOORBELL, link }
    }

    /// The CQ number.
    pub fn cqn(&self) -> u32 {
        self.cqn
    }

    /// CQEs in the ring.
    pub fn nent(&self) -> u32 {
        1 << self.log_nent
    }

    /// log2 of the ring's entry count.
    pub fn log_nent(&self) -> u8 {
        self.log_nent
    }

    /// CQE size.
    pub fn cqe_size(&self) -> CqeSize {
        self.cqe_size
    }

    /// The consumer index (CQEs consumed so far).
    pub fn cons_index(&self) -> u32 {
        self.cons_index
    }

    /// The doorbell record.
    pub fn dbrec(&self) -> &DbRec {
        &self.dbrec
    }

    /// The ring buffer.
    pub fn buf(&self) -> &QueueBuf {
        &self.buf
    }

    /// The ring's geometry for a walk over its entries, computed once per call: the ring as one region when the
    /// buffer is a single fragment (the usual case; an entry's address is then a mask, a shift and an add; `None`:
    /// entries are found through the fragment table), the index mask and the entry size. It borrows only the
    /// buffer, so a poll loop can advance the consumer index while it holds it.
    #[inline]
    fn walk_of(buf: &QueueBuf, log_nent: u8, cqe_size: CqeSize) -> Walk<'_> {
        let stride = cqe_size.bytes();
        let bytes = stride << log_nent;
        Walk {
            flat: buf.frag(0).filter(|r| buf.nfrags() == 1 && r.len() >= bytes),
            mask: (1u32 << log_nent) - 1,
            log_nent,
            shift: stride.trailing_zeros(),
            image: stride - CQE64_SIZE,
        }
    }

    /// The 64-byte CQE image of entry `n` (the second half of a 128-byte CQE).
    #[inline(always)]
    fn cqe_ptr(&self, w: &Walk<'_>, n: u32) -> *mut u8 {
        let off = (((n & w.mask) as usize) << w.shift) + w.image;
        match &w.flat {
            // SAFETY: `off + 64 <= nent * stride <= r.len` (Cq::walk_of checked the length), inside a live fragment.
            Some(r) => unsafe { r.cpu().as_ptr().add(off) },
            None => self.buf.ptr(off, CQE64_SIZE),
        }
    }

    /// Entry `n` if software owns it (`get_sw_cqe`): a view that reads it in place, after the read barrier.
    #[inline]
    fn sw_cqe<M: Mmio + ?Sized>(&self, mmio: &M, w: &Walk<'_>, n: u32) -> Option<CqeRef> {
        let p = self.cqe_ptr(w, n);
        // SAFETY: p points at 64 bytes inside a live fragment of the ring (QueueBuf::ptr checks the bounds).
        // Volatile: the device writes the byte concurrently.
        let op_own = unsafe { p.add(field::OP_OWN.off).read_volatile() };
        let owner = (n >> w.log_nent) & 1;
        if op_own >> 4 == consts::MLX5_CQE_INVALID || u32::from(op_own & 1) != owner {
            return None;
        }
        // The ownership byte said the entry is ours: the rest must be loaded after it.
        mmio.dma_rmb();
        // SAFETY: 64 bytes inside a live fragment of the ring, which `self` owns and keeps while the view (used
        // only inside this poll) lives; 8-byte aligned, as fragments are at least 4 KiB aligned and entries sit at
        // multiples of 64 bytes. The device does not write an entry software owns.
        Some(unsafe { CqeRef::new(p, op_own) })
    }

    /// Whether the entry at the consumer index is software-owned: a poll now would find an entry. Reads only
    /// the ownership byte (a host can then decide what to lock before polling), through the fragment table
    /// rather than the poll's per-call ring geometry, which would cost more than the one entry.
    #[inline]
    pub fn ready(&self) -> bool {
        let n = self.cons_index;
        let stride = self.cqe_size.bytes();
        let off = ((n & (self.nent() - 1)) as usize) * stride + stride - CQE64_SIZE;
        let p = self.buf.ptr(off, CQE64_SIZE);
        // SAFETY: p points at 64 bytes inside a live fragment of the ring (QueueBuf::ptr checks the bounds).
        // Volatile: the device writes the byte concurrently.
        let op_own = unsafe { p.add(field::OP_OWN.off).read_volatile() };
        // As `sw_cqe`: a valid opcode and the owner bit of the pass over the ring that `n` is in.
        op_own >> 4 != consts::MLX5_CQE_INVALID && u32::from(op_own & 1) == (n >> self.log_nent) & 1
    }

    /// Polls up to `wc.len()` completions, oldest first (`ibv_poll_cq`), and publishes the new consumer index.
    /// A CQE the driver cannot accept is consumed and returned as an error on a call of its own, so completions
    /// before it are never lost.
    pub fn poll<M: Mmio + ?Sized>(
        &mut self,
        mmio: &M,
        wq: &mut (impl WrTable + ?Sized),
        wc: &mut [WorkCompletion],
    ) -> Result<usize, CqeError> {
        // Its own loop, decoding in place: through `poll_into` the Rust API paid ~9 instructions more per CQE.
        let mut n = 0;
        let start = self.cons_index;
        let mut ci = start;
        let mut result = Ok(());
        let walk = Self::walk_of(&self.buf, self.log_nent, self.cqe_size);
        while n < wc.len() {
            let Some(cqe) = self.sw_cqe(mmio, &walk, ci) else { break };
            match decode_into(&cqe, self.cqn, ci, self.link, wq, &mut wc[n]) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    if n > 0 {
                        break;
                    }
                    result = Err(e);
                    ci = ci.wrapping_add(1);
                    break;
                }
            }
            ci = ci.wrapping_add(1);
        }
        if ci != start {
            self.cons_index = ci;
            self.update_ci(mmio);
        }
        result.map(|()| n)
    }

    /// [`Cq::poll`] into any [`WcSink`] (a host's own completion layout, written as each CQE is decoded).
    #[inline]
    pub fn poll_into<M: Mmio + ?Sized, S: WcSink + ?Sized>(
        &mut self,
        mmio: &M,
        wq: &mut (impl WrTable + ?Sized),
        wc: &mut S,
    ) -> Result<usize, CqeError> {
        let mut n = 0;
        let cap = wc.capacity();
        let start = self.cons_index;
        // The consumer index moves in a local and is stored once: the loop then writes nothing of `self`, so
        // the ring's geometry stays in registers.
        let mut ci = start;
        let mut result = Ok(());
        let walk = Self::walk_of(&self.buf, self.log_nent, self.cqe_size);
        // Read once: a sink writing through a raw pointer (the C ABI's `ibv_wc` array) made them loads per CQE.
        let (cqn, link) = (self.cqn, self.link);
        while n < cap {
            let Some(cqe) = self.sw_cqe(mmio, &walk, ci) else { break };
            match wc.fill(n, |w| decode_into(&cqe, cqn, ci, link, wq, w)) {
                Ok(true) => n += 1,
                Ok(false) => {}
                Err(e) => {
                    if n > 0 {
                        // Leave it for the next call so these completions are returned first.
                        break;
                    }
                    result = Err(e);
                    ci = ci.wrapping_add(1);
                    break;
                }
            }
            ci = ci.wrapping_add(1);
        }
        if ci != start {
            self.cons_index = ci;
            self.update_ci(mmio);
        }
        result.map(|()| n)
    }

    /// Publishes the consumer index in the doorbell record (`mlx5_cq_set_ci`). Inlined: once per poll, but out
    /// of line its call and frame cost the drop-in's poll ~15 instructions per call.
    #[inline]
    fn update_ci<M: Mmio + ?Sized>(&self, mmio: &M) {
        // The CQE loads must be complete before the store that lets the device reuse those entries.
        mmio.dma_rmb();
        self.dbrec.write_be32(DBR_SET_CI, self.cons_index & 0xff_ffff);
    }

    /// Requests an event for the next (or next solicited) completion (`mlx5_cq_arm`). This function owns the CQ
    /// arm doorbell sequence; `arm_sn` counts the completion events received for this CQ.
    pub fn arm<M: Mmio + ?Sized>(&self, mmio: &M, arm_sn: u32, notify: Notify) {
        let v = arm_value(arm_sn, notify, self.cons_index);
        self.dbrec.write_be32(DBR_ARM, v);
        // The arm record must be in host memory before the doorbell that makes the device read it.
        mmio.wmb();
        // One 64-bit store: the device must never see the command without its CQ number.
        mmio.write64(self.doorbell, u64::from(v) << 32 | u64::from(self.cqn));
    }

    /// Removes the software-owned, unpolled CQEs of QP `qpn`, moving later ones down over them (libmlx5's
    /// `__mlx5_cq_clean`, run when a QP moves to RESET: its old completions must never reach the reset QP, whose
    /// work request tables start over). `on_recv` gets the WQE counter of each removed receive completion (a QP
    /// on an SRQ gives those WQEs back). Returns how many were removed.
    pub fn clean<M: Mmio + ?Sized>(&mut self, mmio: &M, qpn: u32, mut on_recv: impl FnMut(u16)) -> u32 {
        let walk = Self::walk_of(&self.buf, self.log_nent, self.cqe_size);
        let (nent, stride, start) = (self.nent(), self.cqe_size.bytes(), self.cons_index);
        // The entries software owns from the consumer on (at most a ring of them), as they are now.
        let mut owned = 0;
        while owned < nent && self.sw_cqe(mmio, &walk, start.wrapping_add(owned)).is_some() {
            owned += 1;
        }
        let mut freed = 0u32;
        // Newest first, so every kept entry moves once, by the number of removed entries before it.
        for k in (0..owned).rev() {
            let i = start.wrapping_add(k);
            let Some(cqe) = self.sw_cqe(mmio, &walk, i) else { continue };
            if cqe.sop_drop_qpn() & 0xff_ffff == qpn {
                if cqe.opcode().is_receive() {
                    on_recv(cqe.wqe_counter());
                }
                freed += 1;
            } else if freed > 0 {
                let dst = i.wrapping_add(freed);
                let sp = self.buf.ptr(((i & (nent - 1)) as usize) * stride, stride);
                let dp = self.buf.ptr(((dst & (nent - 1)) as usize) * stride, stride);
                // The destination keeps the owner bit of its index's pass over the ring (software owns it).
                let owner = ((dst >> self.log_nent) & 1) as u8;
                // SAFETY: both spans are whole entries inside live fragments (QueueBuf::ptr checked them), and
                // both are software-owned (below the producer seen above), so the device writes neither.
                unsafe { copy_cqe(sp, dp, stride, owner) };
            }
        }
        if freed > 0 {
            self.cons_index = start.wrapping_add(freed);
            // The moves must be in memory before the consumer index gives the freed entries back.
            mmio.wmb();
            self.update_ci(mmio);
        }
        freed
    }

    /// After a resize: moves the CQEs not yet polled from the old ring to `new` (at indices one past their old
    /// ones, as the device counts the resize CQE), skips the resize CQE and switches to `new`
    /// (`mlx5_cq_resize_copy_cqes`). Returns the old buffer. `Err` with the old buffer when the resize CQE is not
    /// within one ring of software-owned entries; the switch happens anyway since the device writes `new` now.
    // The buffers are returned by value because the core has no heap to box them in.
    #[allow(clippy::result_large_err)]
    pub fn switch_buffers<M: Mmio + ?Sized>(
        &mut self,
        mmio: &M,
        new: QueueBuf,
        log_nent: u8,
    ) -> Result<QueueBuf, QueueBuf> {
        let stride = self.cqe_size.bytes();
        let new_mask = (1u32 << log_nent) - 1;
        let mut i = self.cons_index;
        let mut found = false;
        let walk = Self::walk_of(&self.buf, self.log_nent, self.cqe_size);
        for _ in 0..self.nent() {
            let Some(cqe) = self.sw_cqe(mmio, &walk, i) else { break };
            if cqe.opcode() == CqeOpcode::Resize {
                found = true;
                break;
            }
            let dst = i.wrapping_add(1);
            let owner = ((dst >> log_nent) & 1) as u8;
            // The whole entry moves (a 128-byte CQE carries inline data in its first half).
            let src_off = ((i & (self.nent() - 1)) as usize) * stride;
            let dst_off = ((dst & new_mask) as usize) * stride;
            let sp = self.buf.ptr(src_off, stride);
            let dp = new.ptr(dst_off, stride);
            // SAFETY: both spans are whole entries inside live fragments (QueueBuf::ptr checked them); the old
            // entry is software-owned, and the new ring entry is not yet visible to software or written by the
            // device (it writes from the resize index on).
            unsafe { copy_cqe(sp, dp, stride, owner) };
            i = i.wrapping_add(1);
        }
        let old = core::mem::replace(&mut self.buf, new);
        self.log_nent = log_nent;
        self.cons_index = self.cons_index.wrapping_add(1);
        self.update_ci(mmio);
        if found {
            Ok(old)
        } else {
            Err(old)
        }
    }
}

// The line `repr(align(64))` names as a literal.
const _: () = assert!(core::mem::align_of::<Cq>() == crate::buf::CACHE_LINE);

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn arm_value_packs_sequence_command_and_index() {
        let v = arm_value(1, Notify::NextComp, 0x12_3456);
        assert_eq!(v >> 28, 1);
        assert_eq!(v & 0xff_ffff, 0x12_3456);
        assert_eq!(v & 0x0f00_0000, consts::MLX5_CQ_DB_REQ_NOT);
    }

    #[test]
    fn arm_value_masks_sequence_to_two_bits_and_index_to_24() {
        // The arm sequence number wraps at 4; the consumer counter wraps at 2^24 in the doorbell.
        assert_eq!(arm_value(5, Notify::NextComp, 0), arm_value(1, Notify::NextComp, 0));
        assert_eq!(arm_value(0, Notify::Solicited, 0x0100_0002), arm_value(0, Notify::Solicited, 2));
        assert_ne!(arm_value(0, Notify::Solicited, 0), arm_value(0, Notify::NextComp, 0));
        assert_eq!(arm_value(0, Notify::Solicited, 0) & 0x0f00_0000, consts::MLX5_CQ_DB_REQ_NOT_SOL);
    }
}
