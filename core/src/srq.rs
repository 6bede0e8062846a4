//! Shared receive queues (PRM CREATE/MODIFY/QUERY/DESTROY_RMP with ISSI 1; CREATE/QUERY/DESTROY_SRQ and ARM_RQ
//! with ISSI 0), as mlx5_ib makes them for a kernel consumer (`srq_cmd.c` `create_rmp_cmd`, `arm_rmp_cmd`,
//! `query_rmp_cmd`, `create_srq_cmd`, `arm_srq_cmd`; `srq.c` `mlx5_ib_create_srq`, `mlx5_ib_post_srq_recv`,
//! `mlx5_ib_free_srq_wqe`), and the ring ([`Srq`]).
//!
//! The ring is `max` WQEs of `1 << wqe_shift` bytes: an `mlx5_wqe_srq_next_seg` (the index of the next WQE of the
//! free list) then data segments. WQEs are a linked list: software posts at `head` and follows the next index,
//! a completion hands its WQE back at `tail`; `tail` is never posted, so `head == tail` means full and one WQE
//! of the ring is always spare (`max = roundup_pow_of_two(max_wr + 1)`). The device consumes WQEs along the same
//! list up to the counter in the doorbell record. The next indices software follows live in host-only memory
//! (the shadow array, with each WQE's `wr_id`), so nothing the device can write steers a post.

use crate::buf::QueueBuf;
use crate::cmd::{len_with_pas, write_pas, Pas, Simple};
use crate::cmdq::{write_header, CmdError, Command};
use crate::cq::{WorkCompletion, WrTable};
use crate::dbr::DbRec;
use crate::hal::{DmaRegion, Mmio};
use crate::prm::{c, consts, ifc, Array, Field, MsgBuf, Opcode, Sub, SubBuf};
use crate::qp::{PostError, PostErrorKind, RecvWr};

/// Bytes of the next segment that starts every SRQ WQE (`sizeof(struct mlx5_wqe_srq_next_seg)`).
pub const NEXT_SEG: usize = c::mlx5_wqe_srq_next_seg::SIZE;
/// Bytes of one data segment.
const DATA: usize = c::mlx5_wqe_data_seg::SIZE;
/// The smallest SRQ WQE mlx5_ib makes (`max_t(size_t, 32, desc_size)`).
const MIN_WQE: usize = 32;
/// Receive WQE strides count from 16 bytes (`log_rq_stride` of an srqc, `wqe_shift - 4` in mlx5_ib).
const STRIDE_SHIFT: u8 = 4;

/// Which firmware object carries a basic SRQ: an RMP once ISSI 1 is agreed, an SRQ at ISSI 0
/// (`create_srq_split`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum SrqKind {
    /// CREATE_RMP / MODIFY_RMP / QUERY_RMP / DESTROY_RMP.
    Rmp,
    /// CREATE_SRQ / ARM_RQ / QUERY_SRQ / DESTROY_SRQ.
    Srq,
}

impl SrqKind {
    /// The kind firmware with interface step `issi` takes.
    pub const fn for_issi(issi: u16) -> Self {
        if issi == 0 {
            SrqKind::Srq
        } else {
            SrqKind::Rmp
        }
    }

    /// The create command's opcode.
    pub const fn create_opcode(self) -> Opcode {
        match self {
            SrqKind::Rmp => Opcode::CreateRmp,
            SrqKind::Srq => Opcode::CreateSrq,
        }
    }
}

/// The context fields of a new SRQ (`struct mlx5_srq_attr` as `set_wq` / `set_srqc` write it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SrqContext {
    /// log2 of the WQEs in the ring.
    pub log_size: u8,
    /// log2 of the bytes of one WQE.
    pub wqe_shift: u8,
    /// `log_page_size` of `pas[]` (relative to 4 KiB).
    pub log_page_size: u8,
    /// Offset of the ring in its first page, in 64ths of a page.
    pub page_offset: u8,
    /// The limit: the device raises `SRQ_RQ_LIMIT` when fewer WQEs than this are posted.
    pub lwm: u16,
    /// The protection domain.
    pub pd: u32,
    /// Bus address of the doorbell record.
    pub dbr_addr: u64,
}

/// `pas[]` of the `wq` inside an `rmpc` inside a command at `ctx` (`MLX5_ADDR_OF(rmpc, rmpc, wq.pas)`).
const fn rmp_pas(ctx: Sub) -> Array {
    ifc::wq::PAS.at(ifc::rmpc::WQ).at(ctx)
}

/// A `wq` field of the `rmpc` at `ctx`.
const fn wq_field(f: Field, ctx: Sub) -> Field {
    f.at(ifc::rmpc::WQ).at(ctx)
}

/// `CREATE_RMP` (`create_rmp_cmd`): state RDY, a linked-list `wq`; the output is the RMP number.
#[derive(Debug, Clone, Copy)]
pub struct CreateRmp<'a> {
    /// The context.
    pub ctx: SrqContext,
    /// The ring's pages.
    pub pas: Pas<'a>,
}

impl Command for CreateRmp<'_> {
    type In = ifc::create_rmp_in::Bits;
    type Out = ifc::create_rmp_out::Bits;
    type Output = u32;
    fn opcode(&self) -> Opcode {
        Opcode::CreateRmp
    }
    fn inlen(&self) -> usize {
        len_with_pas(rmp_pas(ifc::create_rmp_in::CTX), self.pas.len())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::wq as w;
        let ctx = ifc::create_rmp_in::CTX;
        let x = &self.ctx;
        write_header(msg, Opcode::CreateRmp, 0);
        msg.set(ifc::rmpc::STATE.at(ctx), consts::MLX5_RMPC_STATE_RDY);
        // `wq_type` stays 0, MLX5_WQ_TYPE_LINKED_LIST, as set_wq leaves it.
        msg.set(wq_field(w::WQ_TYPE, ctx), consts::MLX5_WQ_TYPE_LINKED_LIST);
        msg.set(wq_field(w::LOG_WQ_PG_SZ, ctx), x.log_page_size.into());
        msg.set(wq_field(w::LOG_WQ_STRIDE, ctx), x.wqe_shift.into());
        msg.set(wq_field(w::LOG_WQ_SZ, ctx), x.log_size.into());
        msg.set(wq_field(w::PAGE_OFFSET, ctx), x.page_offset.into());
        msg.set(wq_field(w::LWM, ctx), x.lwm.into());
        msg.set(wq_field(w::PD, ctx), x.pd);
        msg.set64(wq_field(w::DBR_ADDR, ctx), x.dbr_addr);
        write_pas(msg, rmp_pas(ctx), self.pas);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<u32, CmdError> {
        Ok(out.get(ifc::create_rmp_out::RMPN))
    }
}

/// `MODIFY_RMP` setting the limit (`arm_rmp_cmd`): `lwm` with its bitmask bit, the RMP staying RDY.
#[derive(Debug, Clone, Copy)]
pub struct ModifyRmpLwm {
    /// The RMP number.
    pub rmpn: u32,
    /// The new limit.
    pub lwm: u16,
}

impl Command for ModifyRmpLwm {
    type In = ifc::modify_rmp_in::Bits;
    type Out = ifc::modify_rmp_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::ModifyRmp
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::modify_rmp_in as m;
        write_header(msg, Opcode::ModifyRmp, 0);
        msg.set(m::RMP_STATE, consts::MLX5_RMPC_STATE_RDY);
        msg.set(m::RMPN, self.rmpn);
        msg.set(ifc::rmp_bitmask::LWM.at(m::BITMASK), 1);
        msg.set(ifc::rmpc::STATE.at(m::CTX), consts::MLX5_RMPC_STATE_RDY);
        msg.set(wq_field(ifc::wq::LWM, m::CTX), self.lwm.into());
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// What QUERY_RMP / QUERY_SRQ report (`get_wq` / `get_srqc`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SrqState {
    /// The limit armed now (0 once the limit event fired).
    pub lwm: u16,
    /// log2 of the WQEs in the ring.
    pub log_size: u8,
    /// log2 of the bytes of one WQE.
    pub wqe_shift: u8,
    /// `log_page_size` (relative to 4 KiB).
    pub log_page_size: u8,
    /// The protection domain.
    pub pd: u32,
    /// Bus address of the doorbell record.
    pub dbr_addr: u64,
    /// The object is not in its good state (RMP not RDY, SRQ not GOOD: `MLX5_SRQ_FLAG_ERR`).
    pub error: bool,
}

/// `QUERY_RMP` (`query_rmp_cmd`): the context, without the page list.
#[derive(Debug, Clone, Copy)]
pub struct QueryRmp {
    /// The RMP number.
    pub rmpn: u32,
}

impl Command for QueryRmp {
    type In = ifc::query_rmp_in::Bits;
    type Out = ifc::query_rmp_out::Bits;
    type Output = SrqState;
    fn opcode(&self) -> Opcode {
        Opcode::QueryRmp
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryRmp, 0);
        msg.set(ifc::query_rmp_in::RMPN, self.rmpn);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<SrqState, CmdError> {
        use ifc::wq as w;
        let ctx = ifc::query_rmp_out::RMP_CONTEXT;
        let at = |f: Field| out.get(wq_field(f, ctx));
        Ok(SrqState {
            lwm: at(w::LWM) as u16,
            log_size: at(w::LOG_WQ_SZ) as u8,
            wqe_shift: at(w::LOG_WQ_STRIDE) as u8,
            log_page_size: at(w::LOG_WQ_PG_SZ) as u8,
            pd: at(w::PD),
            dbr_addr: out.get64(wq_field(w::DBR_ADDR, ctx)),
            error: out.get(ifc::rmpc::STATE.at(ctx)) != consts::MLX5_RMPC_STATE_RDY,
        })
    }
}

/// `DESTROY_RMP`.
pub fn destroy_rmp(rmpn: u32) -> Simple {
    Simple::new(Opcode::DestroyRmp, ifc::destroy_rmp_in::SIZE_BYTES, ifc::destroy_rmp_out::SIZE_BYTES)
        .arg(ifc::destroy_rmp_in::RMPN, rmpn)
}

/// `CREATE_SRQ` with ISSI 0 (`create_srq_cmd` / `set_srqc`); the output is the SRQ number.
#[derive(Debug, Clone, Copy)]
pub struct CreateSrq<'a> {
    /// The context.
    pub ctx: SrqContext,
    /// The ring's pages.
    pub pas: Pas<'a>,
}

impl Command for CreateSrq<'_> {
    type In = ifc::create_srq_in::Bits;
    type Out = ifc::create_srq_out::Bits;
    type Output = u32;
    fn opcode(&self) -> Opcode {
        Opcode::CreateSrq
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::create_srq_in::PAS, self.pas.len())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::srqc as q;
        let x = &self.ctx;
        write_header(msg, Opcode::CreateSrq, 0);
        {
            let mut c = SubBuf::new(msg, ifc::create_srq_in::SRQ_CONTEXT_ENTRY);
            c.set(q::LOG_PAGE_SIZE, x.log_page_size.into());
            // The srqc counts the stride from 16 bytes (`in->wqe_shift`, which is mlx5_ib's `wqe_shift - 4`).
            c.set(q::LOG_RQ_STRIDE, x.wqe_shift.saturating_sub(STRIDE_SHIFT).into());
            c.set(q::LOG_SRQ_SIZE, x.log_size.into());
            c.set(q::PAGE_OFFSET, x.page_offset.into());
            c.set(q::LWM, x.lwm.into());
            c.set(q::PD, x.pd);
            c.set64(q::DBR_ADDR, x.dbr_addr);
        }
        write_pas(msg, ifc::create_srq_in::PAS, self.pas);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<u32, CmdError> {
        Ok(out.get(ifc::create_srq_out::SRQN))
    }
}

/// `ARM_RQ` with op_mod SRQ (`arm_srq_cmd`): sets the limit of an ISSI 0 SRQ.
#[derive(Debug, Clone, Copy)]
pub struct ArmSrq {
    /// The SRQ number.
    pub srqn: u32,
    /// The new limit.
    pub lwm: u16,
}

impl Command for ArmSrq {
    type In = ifc::arm_rq_in::Bits;
    type Out = ifc::arm_rq_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::ArmRq
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::ArmRq, consts::MLX5_ARM_RQ_IN_OP_MOD_SRQ as u16);
        msg.set(ifc::arm_rq_in::SRQ_NUMBER, self.srqn);
        msg.set(ifc::arm_rq_in::LWM, self.lwm.into());
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// `QUERY_SRQ` with ISSI 0 (`query_srq_cmd`): the context, without the page list.
#[derive(Debug, Clone, Copy)]
pub struct QuerySrq {
    /// The SRQ number.
    pub srqn: u32,
}

impl Command for QuerySrq {
    type In = ifc::query_srq_in::Bits;
    type Out = ifc::query_srq_out::Bits;
    type Output = SrqState;
    fn opcode(&self) -> Opcode {
        Opcode::QuerySrq
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QuerySrq, 0);
        msg.set(ifc::query_srq_in::SRQN, self.srqn);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<SrqState, CmdError> {
        use ifc::srqc as q;
        let ctx = ifc::query_srq_out::SRQ_CONTEXT_ENTRY;
        let at = |f: Field| out.get(f.at(ctx));
        Ok(SrqState {
            lwm: at(q::LWM) as u16,
            log_size: at(q::LOG_SRQ_SIZE) as u8,
            wqe_shift: at(q::LOG_RQ_STRIDE) as u8 + STRIDE_SHIFT,
            log_page_size: at(q::LOG_PAGE_SIZE) as u8,
            pd: at(q::PD),
            dbr_addr: out.get64(q::DBR_ADDR.at(ctx)),
            error: at(q::STATE) != consts::MLX5_SRQC_STATE_GOOD,
        })
    }
}

/// `DESTROY_SRQ` with ISSI 0.
pub fn destroy_srq(srqn: u32) -> Simple {
    Simple::new(Opcode::DestroySrq, ifc::destroy_srq_in::SIZE_BYTES, ifc::destroy_srq_out::SIZE_BYTES)
        .arg(ifc::destroy_srq_in::SRQN, srqn)
}

/// The ring geometry of an SRQ (`mlx5_ib_create_srq`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SrqSizes {
    /// WQEs in the ring (a power of two; one more than can be posted).
    pub max: u32,
    /// SGEs a work request may carry (what the caller asked for: `max_gs`).
    pub max_gs: u32,
    /// Data segments a WQE has room for (`max_avail_gather`).
    pub max_avail_gather: u32,
    /// log2 of the bytes of one WQE.
    pub wqe_shift: u8,
}

impl SrqSizes {
    /// Sizes for `max_wr` work requests of `max_sge` SGEs, against `log_max_srq_sz` and `max_wqe_sz_rq`:
    /// `None` when the device cannot hold them (mlx5_ib's "Sanity check SRQ and sge size", `EINVAL`).
    pub fn new(max_wr: u32, max_sge: u32, log_max_srq_sz: u8, max_wqe_sz_rq: u32) -> Option<Self> {
        let max_srq_wqes = 1u64 << log_max_srq_sz.min(31);
        if u64::from(max_wr) >= max_srq_wqes || max_sge > max_wqe_sz_rq / DATA as u32 {
            return None;
        }
        // A completion names an SRQ WQE by a 16-bit `wqe_counter`: a larger ring could not be addressed.
        let max = (max_wr + 1).checked_next_power_of_two().filter(|&m| m <= 1 << 16)?;
        let desc = (NEXT_SEG + max_sge as usize * DATA).next_power_of_two().max(MIN_WQE);
        Some(Self {
            max,
            max_gs: max_sge,
            max_avail_gather: ((desc - NEXT_SEG) / DATA) as u32,
            wqe_shift: desc.trailing_zeros() as u8,
        })
    }

    /// Bytes of the ring.
    pub fn buf_bytes(&self) -> usize {
        (self.max as usize) << self.wqe_shift
    }

    /// log2 of the WQEs in the ring.
    pub fn log_size(&self) -> u8 {
        self.max.trailing_zeros() as u8
    }
}

/// A `wqe_counter` of a receive completion that names no outstanding WQE of the SRQ: the device wrote something
/// it should not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum SrqError {
    /// The index is past the ring.
    BadIndex {
        /// The index the completion named.
        wqe_counter: u16,
        /// WQEs in the ring.
        max: u32,
    },
    /// The WQE at the index is not posted (never was, or already completed).
    NotOutstanding {
        /// The index the completion named.
        wqe_counter: u16,
    },
}

impl core::fmt::Display for SrqError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            SrqError::BadIndex { wqe_counter, max } => {
                write!(f, "SRQ completion names WQE {wqe_counter}, past the ring of {max}")
            }
            SrqError::NotOutstanding { wqe_counter } => {
                write!(f, "SRQ completion names WQE {wqe_counter}, which is not posted")
            }
        }
    }
}

impl core::error::Error for SrqError {}

/// One WQE's host-only bookkeeping: its `wr_id`, the next WQE of the free list, and whether it is posted.
#[derive(Debug, Clone, Copy, Default)]
#[repr(C)]
struct SrqSlot {
    wr_id: u64,
    next: u16,
    posted: u16,
    _pad: u32,
}

/// A created shared receive queue: its ring, doorbell record, free list and work-request bookkeeping.
#[derive(Debug)]
pub struct Srq {
    pub(crate) buf: QueueBuf,
    pub(crate) dbrec: DbRec,
    /// Host-only: one `SrqSlot` per WQE.
    pub(crate) shadow: DmaRegion,
    srqn: u32,
    kind: SrqKind,
    sizes: SrqSizes,
    /// The next WQE to post and the spare one at the end of the free list.
    head: u16,
    tail: u16,
    /// WQEs posted so far (`wqe_ctr`); its value is the doorbell record.
    counter: u16,
    /// WQEs posted and not yet completed.
    posted: u32,
}

impl Srq {
    /// Bytes of the shadow array for `sizes`.
    pub fn shadow_len(sizes: &SrqSizes) -> usize {
        (sizes.max as usize * core::mem::size_of::<SrqSlot>()).next_multiple_of(crate::qp::SHADOW_ALIGN)
    }

    /// Links every WQE of a new ring to the next (`create_srq_kernel`), before the device sees it.
    pub fn init_buf(buf: &QueueBuf, sizes: &SrqSizes) {
        for i in 0..sizes.max {
            let next = ((i + 1) & (sizes.max - 1)) as u16;
            Self::write_next(buf, sizes, i as u16, next);
        }
    }

    fn write_next(buf: &QueueBuf, sizes: &SrqSizes, index: u16, next: u16) {
        let off = (usize::from(index) & (sizes.max as usize - 1)) << sizes.wqe_shift;
        let mut seg = [0u8; NEXT_SEG];
        c::mlx5_wqe_srq_next_seg::NEXT_WQE_INDEX.put_be(&mut seg, 0, next.into());
        let dst = buf.ptr(off, NEXT_SEG);
        // SAFETY: `off + 16` is inside one fragment of the ring (QueueBuf::ptr checked it); the WQE is not posted,
        // so the device does not read it now.
        unsafe { dst.cast::<[u8; NEXT_SEG]>().write_unaligned(seg) };
    }

    /// An SRQ over its created objects. `buf` went through [`Srq::init_buf`]; `shadow` is host memory of
    /// [`Srq::shadow_len`] bytes, 8-byte aligned.
    pub fn new(buf: QueueBuf, dbrec: DbRec, shadow: DmaRegion, srqn: u32, kind: SrqKind, sizes: SrqSizes) -> Self {
        let srq = Self {
            buf,
            dbrec,
            shadow,
            srqn,
            kind,
            sizes,
            head: 0,
            tail: (sizes.max - 1) as u16,
            counter: 0,
            posted: 0,
        };
        for i in 0..sizes.max {
            let slot = SrqSlot { next: ((i + 1) & (sizes.max - 1)) as u16, ..SrqSlot::default() };
            // SAFETY: inside the live shadow region, aligned; only the driver touches it.
            unsafe { srq.slot_ptr(i as u16).write(slot) };
        }
        srq
    }

    /// The SRQ (or RMP) number.
    pub fn srqn(&self) -> u32 {
        self.srqn
    }
    /// Which firmware object it is.
    pub fn kind(&self) -> SrqKind {
        self.kind
    }
    /// The ring geometry.
    pub fn sizes(&self) -> &SrqSizes {
        &self.sizes
    }
    /// Work requests it holds at once (`max_wr` as `ibv_create_srq` returns it: `max - 1`).
    pub fn max_wr(&self) -> u32 {
        self.sizes.max - 1
    }
    /// Work requests posted and not yet completed.
    pub fn outstanding(&self) -> u32 {
        self.posted
    }
    /// The doorbell record.
    pub fn dbrec(&self) -> &DbRec {
        &self.dbrec
    }

    #[inline]
    fn slot_ptr(&self, index: u16) -> *mut SrqSlot {
        let i = usize::from(index) & (self.sizes.max as usize - 1);
        let sz = core::mem::size_of::<SrqSlot>();
        self.shadow.ptr_at(i * sz, sz).cast::<SrqSlot>()
    }

    #[inline]
    fn slot(&self, index: u16) -> SrqSlot {
        // SAFETY: inside the live shadow region, aligned; only the driver touches it.
        unsafe { self.slot_ptr(index).read() }
    }

    #[inline]
    fn set_slot(&self, index: u16, s: SrqSlot) {
        // SAFETY: inside the live shadow region, aligned; only the driver touches it.
        unsafe { self.slot_ptr(index).write(s) }
    }

    /// Writes a 16-byte segment `k` after the next segment of WQE `index`.
    #[inline]
    fn put_data(&self, index: u16, k: usize, seg: &[u8; DATA]) {
        let off = ((usize::from(index)) << self.sizes.wqe_shift) + NEXT_SEG + k * DATA;
        let dst = self.buf.ptr(off, DATA);
        // SAFETY: inside one live fragment (a WQE never crosses one, and k < max_avail_gather keeps the segment in
        // its WQE); software owns WQEs that are not posted.
        unsafe { dst.cast::<[u8; DATA]>().write_unaligned(*seg) };
    }

    /// Posts receive work requests (`mlx5_ib_post_srq_recv`): each takes the WQE at the head of the free list,
    /// gets its data segments (every SGE as given, then the invalid-lkey terminator when there is room), and the
    /// head moves to the next one; then a write barrier and the counter in the doorbell record.
    pub fn post_srq_recv<M: Mmio + ?Sized>(&mut self, mmio: &M, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        let mut b = self.recv_batch(mmio);
        for (index, wr) in wrs.iter().enumerate() {
            b.push(wr).map_err(|kind| PostError { index, kind })?;
        }
        Ok(())
    }

    /// Receives built one at a time ([`SrqRecvBatch::push`]); the doorbell record is written once when the batch
    /// ends (dropped).
    pub fn recv_batch<'q, M: Mmio + ?Sized>(&'q mut self, mmio: &'q M) -> SrqRecvBatch<'q, M> {
        SrqRecvBatch { srq: self, mmio, nreq: 0 }
    }

    /// The `wr_id` of the WQE a receive completion names by its `wqe_counter`, which goes back on the free list
    /// (`mlx5_ib_free_srq_wqe`: linked after the tail, and becomes the tail). An index past the ring or not
    /// posted is refused and changes nothing.
    pub fn srq_done(&mut self, wqe_counter: u16) -> Result<u64, SrqError> {
        if u32::from(wqe_counter) >= self.sizes.max {
            return Err(SrqError::BadIndex { wqe_counter, max: self.sizes.max });
        }
        let slot = self.slot(wqe_counter);
        if slot.posted == 0 {
            return Err(SrqError::NotOutstanding { wqe_counter });
        }
        self.set_slot(wqe_counter, SrqSlot { posted: 0, ..slot });
        let tail = self.slot(self.tail);
        self.set_slot(self.tail, SrqSlot { next: wqe_counter, ..tail });
        Self::write_next(&self.buf, &self.sizes, self.tail, wqe_counter);
        self.tail = wqe_counter;
        self.posted -= 1;
        Ok(slot.wr_id)
    }
}

fn data_seg(length: u32, lkey: u32, addr: u64) -> [u8; DATA] {
    use c::mlx5_wqe_data_seg as d;
    let mut b = [0u8; DATA];
    d::BYTE_COUNT.put_be(&mut b, 0, length);
    d::LKEY.put_be(&mut b, 0, lkey);
    b[d::ADDR.off..d::ADDR.off + 8].copy_from_slice(&addr.to_be_bytes());
    b
}

/// The QPs of a CQ and the SRQs some of them receive through, as one [`WrTable`] for `poll_cq`. A receive
/// completion of a QP attached to an SRQ is resolved through that SRQ by the CQE's `wqe_counter`, the QP's own
/// SRQ as mlx5_ib `handle_responder` uses it; everything else goes to `qps`. SRQ WQEs are not flushed in software:
/// like Linux's `sw_comp`, a flush covers the QPs' own queues only.
pub struct WithSrqs<'a, 'b, Q: WrTable + ?Sized> {
    /// The QPs.
    pub qps: &'a mut Q,
    /// The SRQs.
    pub srqs: &'a mut [&'b mut Srq],
}

impl<Q: WrTable + ?Sized> core::fmt::Debug for WithSrqs<'_, '_, Q> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("WithSrqs").field("srqs", &self.srqs.len()).finish_non_exhaustive()
    }
}

impl<Q: WrTable + ?Sized> WrTable for WithSrqs<'_, '_, Q> {
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        self.qps.send_done(qpn, wqe_counter)
    }
    fn recv_done(&mut self, qpn: u32, srqn: u32, wqe_counter: u16) -> Option<u64> {
        match self.qps.recv_srqn(qpn) {
            Some(s) => self.srqs.iter_mut().find(|q| q.srqn == s)?.srq_done(wqe_counter).ok(),
            None => self.qps.recv_done(qpn, srqn, wqe_counter),
        }
    }
    fn flush_one(&mut self, cqn: u32, dead: bool) -> Option<WorkCompletion> {
        self.qps.flush_one(cqn, dead)
    }
    fn recv_srqn(&self, qpn: u32) -> Option<u32> {
        self.qps.recv_srqn(qpn)
    }
}

/// Receives being posted to one SRQ: each [`SrqRecvBatch::push`] takes a WQE off the free list; dropping the batch
/// writes the doorbell record once. Allocates nothing.
pub struct SrqRecvBatch<'q, M: Mmio + ?Sized> {
    srq: &'q mut Srq,
    mmio: &'q M,
    nreq: u16,
}

impl<M: Mmio + ?Sized> core::fmt::Debug for SrqRecvBatch<'_, M> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SrqRecvBatch").field("nreq", &self.nreq).finish()
    }
}

impl<M: Mmio + ?Sized> SrqRecvBatch<'_, M> {
    /// Writes one receive WQE. On error nothing of it is posted; the WQEs pushed before stay posted.
    pub fn push(&mut self, wr: &RecvWr<'_>) -> Result<(), PostErrorKind> {
        use PostErrorKind as K;
        let s = &mut *self.srq;
        if wr.sg_list.len() > s.sizes.max_gs as usize {
            return Err(K::TooManySge { sge: wr.sg_list.len(), max: s.sizes.max_gs });
        }
        let head = s.slot(s.head);
        // The spare WQE at the tail is never posted; a posted head would mean the list is damaged.
        if s.head == s.tail || head.posted != 0 {
            return Err(K::QueueFull { outstanding: s.posted, max: s.max_wr() });
        }
        let index = s.head;
        for (k, g) in wr.sg_list.iter().enumerate() {
            s.put_data(index, k, &data_seg(g.length, g.lkey, g.addr));
        }
        if wr.sg_list.len() < s.sizes.max_avail_gather as usize {
            s.put_data(index, wr.sg_list.len(), &data_seg(0, consts::MLX5_INVALID_LKEY, 0));
        }
        s.set_slot(index, SrqSlot { wr_id: wr.wr_id, posted: 1, ..head });
        s.head = head.next & (s.sizes.max - 1) as u16;
        s.posted += 1;
        self.nreq += 1;
        Ok(())
    }
}

impl<M: Mmio + ?Sized> Drop for SrqRecvBatch<'_, M> {
    fn drop(&mut self) {
        if self.nreq > 0 {
            let s = &mut *self.srq;
            s.counter = s.counter.wrapping_add(self.nreq);
            // The WQEs must be in memory before the record that hands them to the device.
            self.mmio.dma_wmb();
            s.dbrec.write_be32(0, s.counter.into());
        }
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;
    use crate::hal::tests::TestDma;
    use crate::hal::Dma;
    use crate::qp::Sge;

    fn g(b: &[u8], f: Field) -> u32 {
        MsgBuf::get(b, f)
    }

    #[test]
    fn sizes_follow_mlx5_ib_create_srq() {
        // 100 WRs of 3 SGEs: 128 WQEs of 16 + 3 * 16 = 64 bytes, room for 3 data segments.
        let s = SrqSizes::new(100, 3, 15, 512).unwrap();
        assert_eq!((s.max, s.max_gs, s.max_avail_gather, s.wqe_shift), (128, 3, 3, 6));
        // 127 WRs still fit 128 WQEs (one spare); 128 need 256.
        assert_eq!(SrqSizes::new(127, 1, 15, 512).unwrap().max, 128);
        assert_eq!(SrqSizes::new(128, 1, 15, 512).unwrap().max, 256);
        // One SGE: 32 bytes, the smallest WQE, with room for one more segment than asked.
        let one = SrqSizes::new(1, 1, 15, 512).unwrap();
        assert_eq!((one.wqe_shift, one.max_avail_gather, one.buf_bytes()), (5, 1, 64));
        let zero = SrqSizes::new(1, 0, 15, 512).unwrap();
        assert_eq!((zero.wqe_shift, zero.max_avail_gather), (5, 1));
        // max_wr must stay below 2^log_max_srq_sz; SGEs within max_wqe_sz_rq.
        assert_eq!(SrqSizes::new(1 << 4, 1, 4, 512), None);
        assert!(SrqSizes::new((1 << 4) - 1, 1, 4, 512).is_some());
        assert_eq!(SrqSizes::new(1, 33, 15, 512), None);
        // WQE indices are 16 bits, whatever the device allows.
        assert_eq!(SrqSizes::new(1 << 16, 1, 20, 512), None);
        assert_eq!(SrqSizes::new((1 << 16) - 1, 1, 20, 512).map(|s| s.max), Some(1 << 16));
    }

    fn ctx() -> SrqContext {
        SrqContext {
            log_size: 7,
            wqe_shift: 6,
            log_page_size: 1,
            page_offset: 0,
            lwm: 0x20,
            pd: 0x12_3456,
            dbr_addr: 0x1122_3344_5566_7780,
        }
    }

    #[test]
    fn create_rmp_writes_the_rmpc_and_its_wq_as_create_rmp_cmd() {
        use ifc::wq as w;
        let pages = [0x10_0000u64, 0x20_0000];
        let cmd = CreateRmp { ctx: ctx(), pas: Pas::from(&pages) };
        let mut b = [0u8; 512];
        let n = cmd.inlen();
        assert_eq!(n, ifc::create_rmp_in::SIZE_BYTES + 16, "the wq's pas[] follows the rmpc");
        cmd.encode(&mut b[..n]);
        let ctx = ifc::create_rmp_in::CTX;
        let wq = |f: Field| g(&b[..], f.at(ifc::rmpc::WQ).at(ctx));
        assert_eq!(g(&b[..], ifc::mbox_in::OPCODE), u32::from(consts::MLX5_CMD_OP_CREATE_RMP));
        assert_eq!(g(&b[..], ifc::rmpc::STATE.at(ctx)), consts::MLX5_RMPC_STATE_RDY);
        assert_eq!(g(&b[..], ifc::rmpc::BASIC_CYCLIC_RCV_WQE.at(ctx)), 0);
        assert_eq!(wq(w::WQ_TYPE), consts::MLX5_WQ_TYPE_LINKED_LIST);
        assert_eq!((wq(w::LOG_WQ_SZ), wq(w::LOG_WQ_STRIDE), wq(w::LOG_WQ_PG_SZ)), (7, 6, 1));
        assert_eq!((wq(w::LWM), wq(w::PD), wq(w::PAGE_OFFSET)), (0x20, 0x12_3456, 0));
        assert_eq!(b[..].get64(w::DBR_ADDR.at(ifc::rmpc::WQ).at(ctx)), 0x1122_3344_5566_7780);
        let pas = ifc::create_rmp_in::SIZE_BYTES;
        assert_eq!(&b[pas..pas + 16], &[0, 0, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0, 0x20, 0, 0]);
        // Golden dwords: wq starts at byte 32 + 48 = 80; lwm is the low half of its dword 1, pd dword 2.
        assert_eq!(&b[84..88], &[0, 0, 0, 0x20]);
        assert_eq!(&b[88..92], &[0, 0x12, 0x34, 0x56]);
    }

    #[test]
    fn arm_rmp_sets_lwm_with_its_bitmask_and_keeps_the_state_rdy() {
        let mut b = [0u8; ifc::modify_rmp_in::SIZE_BYTES];
        ModifyRmpLwm { rmpn: 0x77, lwm: 9 }.encode(&mut b[..]);
        use ifc::modify_rmp_in as m;
        assert_eq!(g(&b[..], ifc::mbox_in::OPCODE), u32::from(consts::MLX5_CMD_OP_MODIFY_RMP));
        assert_eq!((g(&b[..], m::RMPN), g(&b[..], m::RMP_STATE)), (0x77, consts::MLX5_RMPC_STATE_RDY));
        assert_eq!(g(&b[..], ifc::rmp_bitmask::LWM.at(m::BITMASK)), 1);
        assert_eq!(g(&b[..], ifc::wq::LWM.at(ifc::rmpc::WQ).at(m::CTX)), 9);
        assert_eq!(g(&b[..], ifc::rmpc::STATE.at(m::CTX)), consts::MLX5_RMPC_STATE_RDY);
    }

    #[test]
    fn issi_0_commands_use_the_srqc() {
        use ifc::srqc as q;
        let pages = [0x30_0000u64];
        let cmd = CreateSrq { ctx: ctx(), pas: Pas::from(&pages) };
        let mut b = [0u8; 512];
        let n = cmd.inlen();
        assert_eq!(n, ifc::create_srq_in::SIZE_BYTES + 8);
        cmd.encode(&mut b[..n]);
        let c = ifc::create_srq_in::SRQ_CONTEXT_ENTRY;
        let get = |f: Field| g(&b[..], f.at(c));
        assert_eq!(g(&b[..], ifc::mbox_in::OPCODE), u32::from(consts::MLX5_CMD_OP_CREATE_SRQ));
        // The stride counts from 16 bytes: 64-byte WQEs are 2.
        assert_eq!((get(q::LOG_SRQ_SIZE), get(q::LOG_RQ_STRIDE), get(q::LOG_PAGE_SIZE)), (7, 2, 1));
        assert_eq!((get(q::LWM), get(q::PD)), (0x20, 0x12_3456));
        assert_eq!(b[..].get64(q::DBR_ADDR.at(c)), 0x1122_3344_5566_7780);
        assert_eq!(b[..].get64(ifc::create_srq_in::PAS.elem(0)), 0x30_0000);

        let mut a = [0u8; ifc::arm_rq_in::SIZE_BYTES];
        ArmSrq { srqn: 0x55, lwm: 3 }.encode(&mut a[..]);
        assert_eq!(g(&a[..], ifc::mbox_in::OPCODE), u32::from(consts::MLX5_CMD_OP_ARM_RQ));
        assert_eq!(g(&a[..], ifc::mbox_in::OP_MOD), consts::MLX5_ARM_RQ_IN_OP_MOD_SRQ);
        assert_eq!((g(&a[..], ifc::arm_rq_in::SRQ_NUMBER), g(&a[..], ifc::arm_rq_in::LWM)), (0x55, 3));

        // QUERY_SRQ decodes the srqc back, the stride in bytes again.
        let mut out = [0u8; ifc::query_srq_out::SIZE_BYTES];
        let oc = ifc::query_srq_out::SRQ_CONTEXT_ENTRY;
        out[..].set(q::LOG_SRQ_SIZE.at(oc), 7);
        out[..].set(q::LOG_RQ_STRIDE.at(oc), 2);
        out[..].set(q::LWM.at(oc), 4);
        out[..].set(q::STATE.at(oc), consts::MLX5_SRQC_STATE_ERROR);
        let st = QuerySrq { srqn: 1 }.decode(&out[..]).unwrap();
        assert_eq!((st.log_size, st.wqe_shift, st.lwm, st.error), (7, 6, 4, true));
        assert_eq!(destroy_srq(0x55).arg, Some((ifc::destroy_srq_in::SRQN, 0x55)));
        assert_eq!(destroy_rmp(0x56).arg, Some((ifc::destroy_rmp_in::RMPN, 0x56)));
    }

    #[test]
    fn query_rmp_reads_the_wq() {
        let mut out = [0u8; ifc::query_rmp_out::SIZE_BYTES];
        let c = ifc::query_rmp_out::RMP_CONTEXT;
        out[..].set(ifc::rmpc::STATE.at(c), consts::MLX5_RMPC_STATE_RDY);
        out[..].set(wq_field(ifc::wq::LWM, c), 17);
        out[..].set(wq_field(ifc::wq::LOG_WQ_SZ, c), 5);
        out[..].set(wq_field(ifc::wq::LOG_WQ_STRIDE, c), 6);
        out[..].set(wq_field(ifc::wq::PD, c), 3);
        let st = QueryRmp { rmpn: 1 }.decode(&out[..]).unwrap();
        assert_eq!((st.lwm, st.log_size, st.wqe_shift, st.pd, st.error), (17, 5, 6, 3, false));
    }

    struct NoMmio;
    impl Mmio for NoMmio {
        fn read32(&self, _: usize) -> u32 {
            0
        }
        fn write32(&self, _: usize, _: u32) {}
        fn read64(&self, _: usize) -> u64 {
            0
        }
        fn write64(&self, _: usize, _: u64) {}
    }

    fn srq(dma: &TestDma, max_wr: u32, max_sge: u32) -> Srq {
        let sizes = SrqSizes::new(max_wr, max_sge, 15, 512).unwrap();
        let buf = QueueBuf::alloc(dma, sizes.buf_bytes()).unwrap();
        Srq::init_buf(&buf, &sizes);
        let shadow = dma.alloc(Srq::shadow_len(&sizes), 8).unwrap();
        // The test allocator frees nothing on drop: the record stays valid after its pool goes.
        let mut pool = crate::dbr::DbrPool::<1>::new(64);
        let rec = pool.alloc(dma).unwrap();
        Srq::new(buf, rec, shadow, 0x42, SrqKind::Rmp, sizes)
    }

    fn wqe_bytes(s: &Srq, index: u16) -> [u8; 64] {
        let mut b = [0u8; 64];
        let n = 1usize << s.sizes.wqe_shift;
        let p = s.buf.ptr(usize::from(index) << s.sizes.wqe_shift, n);
        // SAFETY: one WQE inside the live ring; no device.
        unsafe { core::ptr::copy_nonoverlapping(p, b.as_mut_ptr(), n.min(64)) };
        b
    }

    #[test]
    fn posts_follow_the_free_list_and_completions_return_their_wqes() {
        let dma = TestDma::default();
        let mut s = srq(&dma, 3, 1);
        assert_eq!((s.sizes.max, s.max_wr()), (4, 3));
        let sge = [Sge { addr: 0x1000, length: 64, lkey: 7 }];
        let wr = |id| RecvWr { wr_id: id, sg_list: &sge };
        s.post_srq_recv(&NoMmio, &[wr(10), wr(11), wr(12)]).unwrap();
        assert_eq!((s.outstanding(), s.dbrec.read_be32(0)), (3, 3));
        // WQE 0 links to 1 and holds the SGE; the terminator has no room in a 1-SGE WQE of 32 bytes.
        let w0 = wqe_bytes(&s, 0);
        assert_eq!(c::mlx5_wqe_srq_next_seg::NEXT_WQE_INDEX.get_be(&w0, 0), 1);
        assert_eq!(c::mlx5_wqe_data_seg::LKEY.get_be(&w0, NEXT_SEG), 7);
        // Full: the spare WQE 3 is never posted.
        let e = s.post_srq_recv(&NoMmio, &[wr(13)]).unwrap_err();
        assert_eq!(e, PostError { index: 0, kind: PostErrorKind::QueueFull { outstanding: 3, max: 3 } });
        // Completions in any order: 1 goes back after the spare 3, and becomes the spare.
        assert_eq!(s.srq_done(1), Ok(11));
        assert_eq!(c::mlx5_wqe_srq_next_seg::NEXT_WQE_INDEX.get_be(&wqe_bytes(&s, 3), 0), 1);
        assert_eq!(s.srq_done(1), Err(SrqError::NotOutstanding { wqe_counter: 1 }));
        assert_eq!(s.srq_done(4), Err(SrqError::BadIndex { wqe_counter: 4, max: 4 }));
        // The next post takes 3 (the old spare), and the one after finds the list full again.
        s.post_srq_recv(&NoMmio, &[wr(14)]).unwrap();
        assert_eq!(s.srq_done(3), Ok(14));
        assert_eq!((s.srq_done(0), s.srq_done(2)), (Ok(10), Ok(12)));
        assert_eq!(s.outstanding(), 0);
        // Many more posts than WQEs, each completed: the list never loses or repeats a WQE.
        for k in 0..100u64 {
            s.post_srq_recv(&NoMmio, &[wr(1000 + k)]).unwrap();
            let idx = (0..4u16).find(|&i| s.slot(i).posted != 0).unwrap();
            assert_eq!(s.srq_done(idx), Ok(1000 + k));
        }
        assert_eq!(s.dbrec.read_be32(0), 3 + 1 + 100);
    }

    #[test]
    fn too_many_sges_stop_the_list_at_that_request_and_short_lists_are_terminated() {
        let dma = TestDma::default();
        let mut s = srq(&dma, 7, 2);
        let two = [Sge { addr: 1, length: 2, lkey: 3 }, Sge { addr: 4, length: 0, lkey: 6 }];
        let three = [Sge::default(); 3];
        let one = [Sge { addr: 9, length: 9, lkey: 9 }];
        let wrs = [
            RecvWr { wr_id: 1, sg_list: &two },
            RecvWr { wr_id: 2, sg_list: &one },
            RecvWr { wr_id: 3, sg_list: &three },
        ];
        let e = s.post_srq_recv(&NoMmio, &wrs).unwrap_err();
        assert_eq!(e, PostError { index: 2, kind: PostErrorKind::TooManySge { sge: 3, max: 2 } });
        assert_eq!((s.outstanding(), s.dbrec.read_be32(0)), (2, 2));
        // A zero-length SGE is written as given (mlx5_ib and rdma-core do not skip it in an SRQ).
        let w0 = wqe_bytes(&s, 0);
        assert_eq!(c::mlx5_wqe_data_seg::LKEY.get_be(&w0, NEXT_SEG + DATA), 6);
        // 64-byte WQEs hold 3 segments: a 1-SGE request is terminated with the invalid lkey.
        let w1 = wqe_bytes(&s, 1);
        assert_eq!(c::mlx5_wqe_data_seg::LKEY.get_be(&w1, NEXT_SEG + DATA), consts::MLX5_INVALID_LKEY);
    }
}
