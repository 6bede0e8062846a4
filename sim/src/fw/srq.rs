//! Datapath side: `transport/srq.rs` (receives through an SRQ, its limit and last-WQE events).
//!
//! Shared receive queues on the device side: [`SrqTable`] with CREATE/MODIFY/QUERY/DESTROY_RMP (ISSI 1) and
//! CREATE/ARM/QUERY/DESTROY_SRQ (ISSI 0, `ARM_RQ` with op_mod SRQ), checked over the narrow [`SrqFw`] view, and
//! the state the receive engine keeps per SRQ (the firmware side of mlx5_ib's `srq_cmd.c`).
//!
//! The ring is `1 << log_size` WQEs of `1 << log_stride` bytes, each an `mlx5_wqe_srq_next_seg` then data
//! segments, described by `pas[]` in pages of `4 KiB << log_page_size`. The device keeps the index of the next
//! WQE to take (`head`, from 0) and how many it has taken (`consumed`); the doorbell record at `dbr_addr` holds
//! the driver's count of posted WQEs. Taking a WQE follows its `next_wqe_index` to the next head, as a
//! linked-list WQ is walked. When fewer WQEs than an armed limit (`lwm`) remain posted, the device raises one
//! `SRQ_RQ_LIMIT` event and the limit goes back to 0.
//!
//! Refusals: an unknown PD (`PD_INVALID`), a size above `log_max_srq_sz` (`LOG_SIZE`), a WQE stride outside
//! 32 bytes ..= `max_wqe_sz_rq` (`SRQ_STRIDE`), a `wq_type` other than linked list or a state other than RDY
//! (`SRQ_CONTEXT`), a page list too short (for the ring after its `page_offset`), misaligned or unmapped
//! (`PAS_*`), a `page_offset` of a page or more (`PAGE_OFFSET`), an unmapped doorbell record
//! (`DBR_NOT_MAPPED`), more SRQs than `log_max_rmp` / `log_max_srq` (`NO_RESOURCES`), an unknown number (`SRQ_INVALID`), a limit not below the ring size (`SRQ_LWM`), a MODIFY_RMP
//! bitmask naming more than `lwm` (`FIELD_SELECT`), a command of the other ISSI's family (`BAD_OP`, `SRQ_ISSI`),
//! and destroying an SRQ a QP receives through (`BAD_RES_STATE`, `IN_USE`).

use std::collections::BTreeMap;

use mlx5_core::prm::{c, consts, ifc, CmdStatus, Field, MsgBuf, Sub};

use super::caps::Caps;
use super::ids::{alloc_id, IdSet};
use super::pas::{check_pas, read_paged};
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;
use crate::dma::{DmaFault, DmaSpace};

/// The first SRQ number handed out.
const SRQN_FIRST: u32 = 0x40;
/// SRQ numbers are 24 bits.
const SRQN_END: u32 = 1 << 24;
const ADAPTER_PAGE_SHIFT: u32 = consts::MLX5_ADAPTER_PAGE_SHIFT;
/// The smallest SRQ WQE: the next segment and one data segment.
const MIN_STRIDE_SHIFT: u32 = 5;
/// `page_offset` counts 1/64ths of a page (the `scale` mlx5_ib quantizes with).
const PAGE_OFFSET_QUANTA: u32 = 64;
/// An srqc counts the stride from 16 bytes.
const SRQC_STRIDE_SHIFT: u32 = 4;
/// The doorbell record holds the posted-WQE counter in its first be32.
const DBR_BYTES: usize = 4;
/// The counter is 16 bits.
const CTR16: u32 = 0xffff;

/// Which command family made the SRQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Family {
    Rmp,
    Srq,
    /// An XRC SRQ (CREATE/DESTROY_XRC_SRQ, either ISSI). Linux's mlx5_ib creates one at probe for its device
    /// resources, and one per `ibv_create_srq_ex` with an XRC domain; an XRC target QP of the same domain receives
    /// into it when a request's XRCETH names it.
    XrcSrq,
}

/// What an XRC SRQ adds: its domain, the CQ its receives complete to (not the target QP's), and the user index
/// those CQEs carry in `srqn_uidx` (CQE version 1: rdma-core's mlx5 provider finds the SRQ by it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct XrcSrq {
    pub(crate) xrcd: u32,
    pub(crate) cqn: u32,
    pub(crate) user_index: u32,
}

/// A shared receive queue.
#[derive(Debug)]
pub(crate) struct Srq {
    pub(crate) family: Family,
    /// The XRC part of an XRC SRQ.
    pub(crate) xrc: Option<XrcSrq>,
    pub(crate) pd: u32,
    pub(crate) dbr: u64,
    pas: Vec<u64>,
    page_shift: u32,
    /// Where the ring starts in the first page, in bytes (`page_offset` counts 1/64ths of a page).
    buf_off: u64,
    log_size: u32,
    log_stride: u32,
    pub(crate) lwm: u32,
    /// The next WQE the device takes.
    pub(crate) head: u16,
    /// WQEs the device has taken.
    pub(crate) consumed: u16,
}

impl Srq {
    /// WQEs in the ring.
    pub(crate) fn size(&self) -> u32 {
        1 << self.log_size
    }

    /// Bytes of one WQE.
    pub(crate) fn stride(&self) -> usize {
        1 << self.log_stride
    }

    /// The ring's start in its first page as the context gives it (1/64ths of a page).
    fn page_offset(&self) -> u32 {
        (self.buf_off >> (self.page_shift - PAGE_OFFSET_QUANTA.trailing_zeros())) as u32
    }

    /// Reads `out.len()` bytes of WQE `index` (taken modulo the ring) at byte `off` of it, page by page.
    pub(crate) fn read_wqe(&self, dma: &mut DmaSpace, index: u16, off: usize, out: &mut [u8]) -> Result<(), DmaFault> {
        let base = self.buf_off + (u64::from(u32::from(index) & (self.size() - 1)) << self.log_stride) + off as u64;
        read_paged(dma, &self.pas, self.page_shift, base, out)
    }

    /// The driver's count of posted WQEs, from the doorbell record; `None` when it cannot be read.
    pub(crate) fn counter(&self, dma: &mut DmaSpace) -> Option<u16> {
        let mut rec = [0u8; DBR_BYTES];
        dma.read(self.dbr, &mut rec).ok()?;
        Some((u32::from_be_bytes(rec) & CTR16) as u16)
    }

    /// Takes the WQE at the head: the head follows its next index. Returns the WQEs still posted after it.
    pub(crate) fn take(&mut self, dma: &mut DmaSpace, pending: u16) -> u16 {
        let mut next = [0u8; 2];
        let f = c::mlx5_wqe_srq_next_seg::NEXT_WQE_INDEX;
        // An unreadable WQE leaves the head where it is; the driver's list is then damaged anyway.
        if self.read_wqe(dma, self.head, f.off, &mut next).is_ok() {
            self.head = (u32::from(u16::from_be_bytes(next)) & (self.size() - 1)) as u16;
        }
        self.consumed = self.consumed.wrapping_add(1);
        pending.saturating_sub(1)
    }
}

/// Every SRQ by number, and the number CREATE tries next.
#[derive(Debug, Default)]
pub(crate) struct SrqTable {
    pub(crate) map: BTreeMap<u32, Srq>,
    next: u32,
}

/// What the SRQ commands need of the rest of the firmware.
pub(crate) struct SrqFw<'a> {
    pub(crate) caps: &'a Caps,
    pub(crate) pds: &'a IdSet,
    /// The ISSI agreed on.
    pub(crate) issi: u16,
    /// Whether a QP receives through the SRQ.
    pub(crate) in_use: &'a dyn Fn(u32) -> bool,
    /// Whether an XRC domain / a CQ exists (an XRC SRQ names both).
    pub(crate) xrcd_exists: &'a dyn Fn(u32) -> bool,
    pub(crate) cq_exists: &'a dyn Fn(u32) -> bool,
}

/// The context of a create, decoded from either family's layout.
struct NewSrq {
    log_size: u32,
    log_stride: u32,
    log_page_size: u32,
    page_offset: u32,
    lwm: u32,
    pd: u32,
    dbr: u64,
}

fn family_err() -> CmdErr {
    err(CmdStatus::BadOp, syndrome::SRQ_ISSI)
}

impl SrqTable {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(crate) fn clear(&mut self) {
        self.map.clear();
    }

    pub(crate) fn get(&self, srqn: &u32) -> Option<&Srq> {
        self.map.get(srqn)
    }

    pub(crate) fn get_mut(&mut self, srqn: &u32) -> Option<&mut Srq> {
        self.map.get_mut(srqn)
    }

    fn check_family(fw: &SrqFw, family: Family) -> Result<(), CmdErr> {
        match (family, fw.issi) {
            (Family::Srq, 0) => Ok(()),
            (Family::Rmp, 1..) => Ok(()),
            (Family::XrcSrq, _) => Ok(()),
            _ => Err(family_err()),
        }
    }

    /// The checks both creates share, then the new SRQ.
    fn create(
        &mut self,
        fw: &SrqFw,
        dma: &DmaSpace,
        inp: &[u8],
        pas: mlx5_core::prm::Array,
        family: Family,
        x: NewSrq,
    ) -> Result<u32, CmdErr> {
        use ifc::cmd_hca_cap as g;
        if !fw.pds.contains(x.pd) {
            return Err(bad_param(syndrome::PD_INVALID));
        }
        if x.log_size > fw.caps.gen(g::LOG_MAX_SRQ_SZ) {
            return Err(bad_param(syndrome::LOG_SIZE));
        }
        if x.log_stride < MIN_STRIDE_SHIFT || 1u64 << x.log_stride > u64::from(fw.caps.gen(g::MAX_WQE_SZ_RQ)) {
            return Err(bad_param(syndrome::SRQ_STRIDE));
        }
        if x.lwm >= 1 << x.log_size {
            return Err(bad_param(syndrome::SRQ_LWM));
        }
        // mlx5_ib sends the offset of a user ring in its first page (`mlx5_umem_find_best_quantized_pgoff`, 64
        // quanta a page): a ring in memory a parent domain's allocator aligned below a page starts there (found
        // with rdma-core's test_parent_domain under UML, refused as PAGE_OFFSET). The pages cover it too.
        if x.page_offset >= PAGE_OFFSET_QUANTA {
            return Err(bad_param(syndrome::PAGE_OFFSET));
        }
        let page_shift = ADAPTER_PAGE_SHIFT + x.log_page_size;
        let buf_off = u64::from(x.page_offset) << page_shift >> PAGE_OFFSET_QUANTA.trailing_zeros();
        let bytes = buf_off + (1u64 << (x.log_size + x.log_stride));
        check_pas(dma, inp, pas, bytes, 1 << page_shift)?;
        if !dma.is_mapped(x.dbr, DBR_BYTES) {
            return Err(bad_param(syndrome::DBR_NOT_MAPPED));
        }
        let log_max = match family {
            Family::Rmp => fw.caps.gen(g::LOG_MAX_RMP),
            Family::Srq | Family::XrcSrq => fw.caps.gen(g::LOG_MAX_SRQ),
        };
        if self.map.len() >= 1usize << log_max.min(24) {
            return Err(err(CmdStatus::NoRes, syndrome::NO_RESOURCES));
        }
        let srqn = alloc_id(&self.map, &mut self.next, SRQN_FIRST, SRQN_END)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        let pas = (0..bytes.div_ceil(1 << page_shift)).map(|k| inp.get64(pas.elem(k as u32))).collect();
        let srq = Srq {
            family,
            xrc: None,
            pd: x.pd,
            dbr: x.dbr,
            pas,
            page_shift,
            buf_off,
            log_size: x.log_size,
            log_stride: x.log_stride,
            lwm: x.lwm,
            head: 0,
            consumed: 0,
        };
        self.map.insert(srqn, srq);
        Ok(srqn)
    }

    /// CREATE_RMP (`create_rmp_cmd`): state RDY, a linked-list `wq`.
    pub(crate) fn create_rmp(&mut self, fw: &SrqFw, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::wq as w;
        Self::check_family(fw, Family::Rmp)?;
        let ctx = ifc::create_rmp_in::CTX;
        let wq = |f: Field| rd(inp, f.at(ifc::rmpc::WQ).at(ctx));
        if rd(inp, ifc::rmpc::STATE.at(ctx)) != consts::MLX5_RMPC_STATE_RDY
            || wq(w::WQ_TYPE) != consts::MLX5_WQ_TYPE_LINKED_LIST
            || rd(inp, ifc::rmpc::BASIC_CYCLIC_RCV_WQE.at(ctx)) != 0
        {
            return Err(bad_param(syndrome::SRQ_CONTEXT));
        }
        let x = NewSrq {
            log_size: wq(w::LOG_WQ_SZ),
            log_stride: wq(w::LOG_WQ_STRIDE),
            log_page_size: wq(w::LOG_WQ_PG_SZ),
            page_offset: wq(w::PAGE_OFFSET),
            lwm: wq(w::LWM),
            pd: wq(w::PD),
            dbr: inp.get64(w::DBR_ADDR.at(ifc::rmpc::WQ).at(ctx)),
        };
        let pas = ifc::wq::PAS.at(ifc::rmpc::WQ).at(ctx);
        let rmpn = self.create(fw, dma, inp, pas, Family::Rmp, x)?;
        out.set(ifc::create_rmp_out::RMPN, rmpn);
        Ok(())
    }

    /// CREATE_SRQ (`create_srq_cmd`).
    pub(crate) fn create_srq(&mut self, fw: &SrqFw, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::srqc as q;
        Self::check_family(fw, Family::Srq)?;
        let ctx = ifc::create_srq_in::SRQ_CONTEXT_ENTRY;
        let get = |f: Field| rd(inp, f.at(ctx));
        if get(q::STATE) != consts::MLX5_SRQC_STATE_GOOD {
            return Err(bad_param(syndrome::SRQ_CONTEXT));
        }
        let x = NewSrq {
            log_size: get(q::LOG_SRQ_SIZE),
            log_stride: get(q::LOG_RQ_STRIDE) + SRQC_STRIDE_SHIFT,
            log_page_size: get(q::LOG_PAGE_SIZE),
            page_offset: get(q::PAGE_OFFSET),
            lwm: get(q::LWM),
            pd: get(q::PD),
            dbr: inp.get64(q::DBR_ADDR.at(ctx)),
        };
        let srqn = self.create(fw, dma, inp, ifc::create_srq_in::PAS, Family::Srq, x)?;
        out.set(ifc::create_srq_out::SRQN, srqn);
        Ok(())
    }

    /// CREATE_XRC_SRQ (`create_xrc_srq_cmd`): an SRQ in an XRC domain, completing to `cqn`.
    pub(crate) fn create_xrc_srq(
        &mut self,
        fw: &SrqFw,
        dma: &DmaSpace,
        inp: &[u8],
        out: &mut [u8],
    ) -> Result<(), CmdErr> {
        use ifc::xrc_srqc as q;
        Self::check_family(fw, Family::XrcSrq)?;
        let ctx = ifc::create_xrc_srq_in::XRC_SRQ_CONTEXT_ENTRY;
        let get = |f: Field| rd(inp, f.at(ctx));
        // A ring on a UMEM (DevX) is not modelled for XRC SRQs.
        let umem = get(q::DBR_UMEM_VALID) != 0 || rd(inp, ifc::create_xrc_srq_in::XRC_SRQ_UMEM_VALID) != 0;
        if get(q::STATE) != consts::MLX5_SRQC_STATE_GOOD || umem {
            return Err(bad_param(syndrome::SRQ_CONTEXT));
        }
        if !(fw.xrcd_exists)(get(q::XRCD)) {
            return Err(bad_param(syndrome::XRCD_INVALID));
        }
        if !(fw.cq_exists)(get(q::CQN)) {
            return Err(bad_param(syndrome::CQ_INVALID));
        }
        // The doorbell record address: bits 63:32, then bits 31:2.
        let dbr_lo_shift = 32 - q::DB_RECORD_ADDR_L.width;
        let dbr = (u64::from(get(q::DB_RECORD_ADDR_H)) << 32) | (u64::from(get(q::DB_RECORD_ADDR_L)) << dbr_lo_shift);
        let x = NewSrq {
            log_size: get(q::LOG_XRC_SRQ_SIZE),
            log_stride: get(q::LOG_RQ_STRIDE) + SRQC_STRIDE_SHIFT,
            log_page_size: get(q::LOG_PAGE_SIZE),
            page_offset: get(q::PAGE_OFFSET),
            lwm: get(q::LWM),
            pd: get(q::PD),
            dbr,
        };
        let n = self.create(fw, dma, inp, ifc::create_xrc_srq_in::PAS, Family::XrcSrq, x)?;
        let xrc = XrcSrq { xrcd: get(q::XRCD), cqn: get(q::CQN), user_index: get(q::USER_INDEX) };
        if let Some(s) = self.map.get_mut(&n) {
            s.xrc = Some(xrc);
        }
        out.set(ifc::create_xrc_srq_out::XRC_SRQN, n);
        Ok(())
    }

    fn set_lwm(&mut self, n: u32, family: Family, lwm: u32) -> Result<(), CmdErr> {
        let srq = self.map.get_mut(&n).filter(|s| s.family == family).ok_or(bad_param(syndrome::SRQ_INVALID))?;
        if lwm >= srq.size() {
            return Err(bad_param(syndrome::SRQ_LWM));
        }
        srq.lwm = lwm;
        Ok(())
    }

    /// MODIFY_RMP (`arm_rmp_cmd`): only the limit, with the RMP staying RDY.
    pub(crate) fn modify_rmp(&mut self, fw: &SrqFw, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::modify_rmp_in as m;
        Self::check_family(fw, Family::Rmp)?;
        // The whole bitmask as one word, and the word with only `lwm` set: the limit is all MODIFY_RMP changes.
        let whole = Field::new(0, (ifc::rmp_bitmask::SIZE_BYTES * 8) as u32);
        let mut only_lwm = [0u8; ifc::rmp_bitmask::SIZE_BYTES];
        only_lwm[..].set(ifc::rmp_bitmask::LWM, 1);
        if inp.get64(whole.at(m::BITMASK)) != only_lwm[..].get64(whole) {
            return Err(bad_param(syndrome::FIELD_SELECT));
        }
        if rd(inp, m::RMP_STATE) != consts::MLX5_RMPC_STATE_RDY
            || rd(inp, ifc::rmpc::STATE.at(m::CTX)) != consts::MLX5_RMPC_STATE_RDY
        {
            return Err(bad_param(syndrome::SRQ_CONTEXT));
        }
        let lwm = rd(inp, ifc::wq::LWM.at(ifc::rmpc::WQ).at(m::CTX));
        self.set_lwm(rd(inp, m::RMPN), Family::Rmp, lwm)
    }

    /// ARM_RQ with op_mod SRQ (`arm_srq_cmd`).
    pub(crate) fn arm_rq(&mut self, fw: &SrqFw, inp: &[u8]) -> Result<(), CmdErr> {
        Self::check_family(fw, Family::Srq)?;
        if rd(inp, ifc::mbox_in::OP_MOD) != consts::MLX5_ARM_RQ_IN_OP_MOD_SRQ {
            return Err(bad_param(syndrome::BAD_OP_MOD));
        }
        self.set_lwm(rd(inp, ifc::arm_rq_in::SRQ_NUMBER), Family::Srq, rd(inp, ifc::arm_rq_in::LWM))
    }

    fn find(&self, n: u32, family: Family) -> Result<&Srq, CmdErr> {
        self.map.get(&n).filter(|s| s.family == family).ok_or(bad_param(syndrome::SRQ_INVALID))
    }

    /// QUERY_RMP: the `rmpc` with its `wq` (the limit as it stands, 0 once fired).
    pub(crate) fn query_rmp(&self, fw: &SrqFw, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::wq as w;
        Self::check_family(fw, Family::Rmp)?;
        let s = self.find(rd(inp, ifc::query_rmp_in::RMPN), Family::Rmp)?;
        let ctx: Sub = ifc::query_rmp_out::RMP_CONTEXT;
        let at = |f: Field| f.at(ifc::rmpc::WQ).at(ctx);
        out.set(ifc::rmpc::STATE.at(ctx), consts::MLX5_RMPC_STATE_RDY);
        for (f, v) in [
            (w::WQ_TYPE, consts::MLX5_WQ_TYPE_LINKED_LIST),
            (w::LOG_WQ_SZ, s.log_size),
            (w::LOG_WQ_STRIDE, s.log_stride),
            (w::LOG_WQ_PG_SZ, s.page_shift - ADAPTER_PAGE_SHIFT),
            (w::PAGE_OFFSET, s.page_offset()),
            (w::LWM, s.lwm),
            (w::PD, s.pd),
            (w::HW_COUNTER, s.consumed.into()),
        ] {
            out.set(at(f), v);
        }
        out.set64(at(w::DBR_ADDR), s.dbr);
        Ok(())
    }

    /// QUERY_SRQ: the `srqc`.
    pub(crate) fn query_srq(&self, fw: &SrqFw, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::srqc as q;
        Self::check_family(fw, Family::Srq)?;
        let s = self.find(rd(inp, ifc::query_srq_in::SRQN), Family::Srq)?;
        let ctx = ifc::query_srq_out::SRQ_CONTEXT_ENTRY;
        for (f, v) in [
            (q::STATE, consts::MLX5_SRQC_STATE_GOOD),
            (q::LOG_SRQ_SIZE, s.log_size),
            (q::LOG_RQ_STRIDE, s.log_stride - SRQC_STRIDE_SHIFT),
            (q::LOG_PAGE_SIZE, s.page_shift - ADAPTER_PAGE_SHIFT),
            (q::PAGE_OFFSET, s.page_offset()),
            (q::LWM, s.lwm),
            (q::PD, s.pd),
            (q::WQE_CNT, s.consumed.into()),
        ] {
            out.set(f.at(ctx), v);
        }
        out.set64(q::DBR_ADDR.at(ctx), s.dbr);
        Ok(())
    }

    /// DESTROY_RMP / DESTROY_SRQ: refused while a QP receives through it.
    pub(crate) fn destroy(&mut self, fw: &SrqFw, family: Family, inp: &[u8]) -> Result<(), CmdErr> {
        Self::check_family(fw, family)?;
        let n = match family {
            Family::Rmp => rd(inp, ifc::destroy_rmp_in::RMPN),
            Family::Srq => rd(inp, ifc::destroy_srq_in::SRQN),
            Family::XrcSrq => rd(inp, ifc::destroy_xrc_srq_in::XRC_SRQN),
        };
        self.find(n, family)?;
        if (fw.in_use)(n) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.map.remove(&n);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::submit::Rdma;
    use mlx5_core::hal::Dma;

    /// A CREATE_SRQ (ISSI 0) input for a 16-WQE ring of 32-byte WQEs in one page.
    fn create_srq_in(r: &Rdma, page: u64, dbr: u64) -> Vec<u8> {
        use ifc::srqc as q;
        let c = ifc::create_srq_in::SRQ_CONTEXT_ENTRY;
        let mut inp = vec![0u8; ifc::create_srq_in::SIZE_BYTES + 8];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_SRQ.into());
        inp.set(q::LOG_SRQ_SIZE.at(c), 4);
        inp.set(q::LOG_RQ_STRIDE.at(c), 1);
        inp.set(q::PD.at(c), r.pd);
        inp.set64(q::DBR_ADDR.at(c), dbr);
        inp.set64(ifc::create_srq_in::PAS.elem(0), page);
        inp
    }

    fn arm(r: &mut Rdma, op_mod: u32, srqn: u32, lwm: u32) -> (u8, u32) {
        let mut inp = vec![0u8; ifc::arm_rq_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_ARM_RQ.into());
        inp.set(ifc::mbox_in::OP_MOD, op_mod);
        inp.set(ifc::arm_rq_in::SRQ_NUMBER, srqn);
        inp.set(ifc::arm_rq_in::LWM, lwm);
        let (s, syn, _) = r.h.cmd(&inp, ifc::arm_rq_out::SIZE_BYTES);
        (s, syn)
    }

    #[test]
    fn an_srq_ring_starts_at_its_page_offset() {
        // Found with rdma-core's test_parent_domain under UML: a ring a parent domain's allocator placed inside a
        // page comes with `page_offset` (1/64ths of a page), which the simulator refused.
        let mut r = Rdma::inline();
        let page = r.h.dma.alloc(4096, 4096).unwrap();
        let dbr = r.h.dma.alloc(64, 64).unwrap();
        let c = ifc::create_srq_in::SRQ_CONTEXT_ENTRY;
        // 16 WQEs of 32 bytes from half the page on.
        let mut inp = create_srq_in(&r, page.iova(), dbr.iova());
        inp.set(ifc::srqc::PAGE_OFFSET.at(c), 32);
        let (s, syn, out) = r.h.cmd(&inp, ifc::create_srq_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0));
        let n = rd(&out, ifc::create_srq_out::SRQN);
        crate::testkit::submit::put(&page, 2048 + 32, &[0xab; 4]);
        let mut got = [0u8; 4];
        let shared = &r.h.dev.shared;
        let mut dev = crate::device::lock(shared);
        let st = &mut *dev;
        st.fw.srqs.get(&n).unwrap().read_wqe(&mut st.dma, 1, 0, &mut got).unwrap();
        assert_eq!(got, [0xab; 4], "WQE 1 is 32 bytes after the offset");
        drop(dev);
        let mut q = vec![0u8; ifc::query_srq_in::SIZE_BYTES];
        q.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_SRQ.into());
        q.set(ifc::query_srq_in::SRQN, n);
        let (s, _, out) = r.h.cmd(&q, ifc::query_srq_out::SIZE_BYTES);
        assert_eq!((s, rd(&out, ifc::srqc::PAGE_OFFSET.at(ifc::query_srq_out::SRQ_CONTEXT_ENTRY))), (0, 32));
        // A ring that no longer fits its one page after the offset is short of pages.
        let mut inp = create_srq_in(&r, page.iova(), dbr.iova());
        inp.set(ifc::srqc::PAGE_OFFSET.at(c), 63);
        inp.set(ifc::srqc::LOG_SRQ_SIZE.at(c), 7);
        let (s, syn, _) = r.h.cmd(&inp, ifc::create_srq_out::SIZE_BYTES);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::PAS_TOO_FEW));
    }

    #[test]
    fn xrc_srq_needs_its_domain_and_cq_and_is_destroyed_once() {
        // mlx5_ib creates one at probe (mlx5_ib_dev_res_srq_init); the simulator lacked the command (found under UML).
        use ifc::xrc_srqc as q;
        let mut r = Rdma::inline();
        let cq = r.cq(4);
        let xrcd = r.h.alloc_xrcd();
        let page = r.h.dma.alloc(4096, 4096).unwrap();
        let dbr = r.h.dma.alloc(64, 64).unwrap();
        let c = ifc::create_xrc_srq_in::XRC_SRQ_CONTEXT_ENTRY;
        let make = |xrcd: u32, cqn: u32| {
            let mut inp = vec![0u8; ifc::create_xrc_srq_in::SIZE_BYTES + 8];
            inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_XRC_SRQ.into());
            inp.set(q::LOG_XRC_SRQ_SIZE.at(c), 4);
            inp.set(q::LOG_RQ_STRIDE.at(c), 1);
            inp.set(q::PD.at(c), r.pd);
            inp.set(q::XRCD.at(c), xrcd);
            inp.set(q::CQN.at(c), cqn);
            inp.set(q::USER_INDEX.at(c), 0x42);
            inp.set(q::DB_RECORD_ADDR_H.at(c), (dbr.iova() >> 32) as u32);
            inp.set(q::DB_RECORD_ADDR_L.at(c), (dbr.iova() as u32) >> 2);
            inp.set64(ifc::create_xrc_srq_in::PAS.elem(0), page.iova());
            inp
        };
        let outlen = ifc::create_xrc_srq_out::SIZE_BYTES;
        let bad = consts::MLX5_CMD_STAT_BAD_PARAM_ERR;
        assert_eq!(r.h.cmd(&make(xrcd + 1, cq.cqn), outlen).1, syndrome::XRCD_INVALID);
        assert_eq!(r.h.cmd(&make(xrcd, cq.cqn + 1), outlen).1, syndrome::CQ_INVALID);
        let (s, syn, out) = r.h.cmd(&make(xrcd, cq.cqn), outlen);
        assert_eq!((s, syn), (0, 0));
        let n = rd(&out, ifc::create_xrc_srq_out::XRC_SRQN);
        assert_eq!(
            crate::device::lock(&r.h.dev.shared).fw.srqs.get(&n).map(|s| (s.family, s.dbr, s.xrc)),
            Some((Family::XrcSrq, dbr.iova(), Some(XrcSrq { xrcd, cqn: cq.cqn, user_index: 0x42 })))
        );
        let mut d = vec![0u8; ifc::destroy_xrc_srq_in::SIZE_BYTES];
        d.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_DESTROY_XRC_SRQ.into());
        d.set(ifc::destroy_xrc_srq_in::XRC_SRQN, n);
        assert_eq!(r.h.cmd(&d, ifc::destroy_xrc_srq_out::SIZE_BYTES).0, 0);
        let (s, syn, _) = r.h.cmd(&d, ifc::destroy_xrc_srq_out::SIZE_BYTES);
        assert_eq!((s, syn), (bad, syndrome::SRQ_INVALID));
    }

    #[test]
    fn srq_commands_check_their_family_context_limit_and_count() {
        let mut r = Rdma::inline();
        let page = r.h.dma.alloc(4096, 4096).unwrap();
        let dbr = r.h.dma.alloc(64, 64).unwrap();
        let bad = consts::MLX5_CMD_STAT_BAD_PARAM_ERR;
        // The harness stays at ISSI 0: an RMP command is the other family's.
        let mut rmp = vec![0u8; ifc::create_rmp_in::SIZE_BYTES + 8];
        rmp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_RMP.into());
        let (s, syn, _) = r.h.cmd(&rmp, ifc::create_rmp_out::SIZE_BYTES);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_OP_ERR, syndrome::SRQ_ISSI));
        // An SRQ not created GOOD is refused.
        let mut inp = create_srq_in(&r, page.iova(), dbr.iova());
        inp.set(ifc::srqc::STATE.at(ifc::create_srq_in::SRQ_CONTEXT_ENTRY), consts::MLX5_SRQC_STATE_ERROR);
        let (s, syn, _) = r.h.cmd(&inp, ifc::create_srq_out::SIZE_BYTES);
        assert_eq!((s, syn), (bad, syndrome::SRQ_CONTEXT));
        // Only one SRQ when log_max_srq is 0.
        crate::device::lock(&r.h.dev.shared).fw.caps.force_gen(ifc::cmd_hca_cap::LOG_MAX_SRQ, 0);
        let inp = create_srq_in(&r, page.iova(), dbr.iova());
        let (s, _, out) = r.h.cmd(&inp, ifc::create_srq_out::SIZE_BYTES);
        assert_eq!(s, 0);
        let srqn = rd(&out, ifc::create_srq_out::SRQN);
        let (s, syn, _) = r.h.cmd(&inp, ifc::create_srq_out::SIZE_BYTES);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_NO_RES_ERR, syndrome::NO_RESOURCES));
        // ARM_RQ: op_mod SRQ only, a known SRQ, a limit below the ring.
        assert_eq!(arm(&mut r, consts::MLX5_ARM_RQ_IN_OP_MOD_XRQ, srqn, 1), (bad, syndrome::BAD_OP_MOD));
        assert_eq!(arm(&mut r, consts::MLX5_ARM_RQ_IN_OP_MOD_SRQ, srqn + 1, 1), (bad, syndrome::SRQ_INVALID));
        assert_eq!(arm(&mut r, consts::MLX5_ARM_RQ_IN_OP_MOD_SRQ, srqn, 16), (bad, syndrome::SRQ_LWM));
        assert_eq!(arm(&mut r, consts::MLX5_ARM_RQ_IN_OP_MOD_SRQ, srqn, 15), (0, 0));
        assert_eq!(crate::device::lock(&r.h.dev.shared).fw.srqs.get(&srqn).map(|s| s.lwm), Some(15));
        // At ISSI 1, MODIFY_RMP changes the limit only: another bitmask bit, or a state other than RDY, is refused.
        crate::device::lock(&r.h.dev.shared).fw.issi = 1;
        assert_eq!(
            arm(&mut r, consts::MLX5_ARM_RQ_IN_OP_MOD_SRQ, srqn, 1),
            (consts::MLX5_CMD_STAT_BAD_OP_ERR, syndrome::SRQ_ISSI)
        );
        use ifc::modify_rmp_in as m;
        let modify = |r: &mut Rdma, f: &dyn Fn(&mut Vec<u8>)| {
            let mut inp = vec![0u8; m::SIZE_BYTES];
            inp.set(m::OPCODE, consts::MLX5_CMD_OP_MODIFY_RMP.into());
            inp.set(m::RMP_STATE, consts::MLX5_RMPC_STATE_RDY);
            inp.set(ifc::rmpc::STATE.at(m::CTX), consts::MLX5_RMPC_STATE_RDY);
            inp.set(ifc::rmp_bitmask::LWM.at(m::BITMASK), 1);
            f(&mut inp);
            let (s, syn, _) = r.h.cmd(&inp, ifc::modify_rmp_out::SIZE_BYTES);
            (s, syn)
        };
        let whole = Field::new(0, (ifc::rmp_bitmask::SIZE_BYTES * 8) as u32).at(m::BITMASK);
        let other_bit = |i: &mut Vec<u8>| i.set64(whole, u64::MAX);
        assert_eq!(modify(&mut r, &other_bit), (bad, syndrome::FIELD_SELECT));
        let err_state = |i: &mut Vec<u8>| i.set(m::RMP_STATE, consts::MLX5_RMPC_STATE_ERR);
        assert_eq!(modify(&mut r, &err_state), (bad, syndrome::SRQ_CONTEXT));
        // The SRQ made at ISSI 0 is not an RMP.
        let this = |i: &mut Vec<u8>| i.set(m::RMPN, srqn);
        assert_eq!(modify(&mut r, &this), (bad, syndrome::SRQ_INVALID));
        // SAFETY: only the SRQ names them, and no QP receives through it, so the device never touches them again.
        unsafe {
            r.h.dma.free(page);
            r.h.dma.free(dbr);
        }
    }
}
