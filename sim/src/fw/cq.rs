//! Datapath side: `transport/cqe.rs` (CQE writes, overruns, completion events), `uar.rs` (the arm doorbell).
//!
//! Completion queues on the device side (c-layouts.md section 4): [`CqTable`] with CREATE/DESTROY/QUERY/MODIFY_CQ
//! (moderation, resize) over the narrow [`CqFw`] view, and the ring each CQ writes through its `pas[]` pages. CQE
//! production is `transport/cqe.rs`, the CQ arm doorbell `uar.rs`. Mirrors the kernel's `cq.c` from the device
//! side.

use mlx5_core::prm::{c, consts, ifc, CmdStatus, Field, MsgBuf};

use super::reply::{bad_param, err, rd, rd16, CmdErr};
use std::ops::{Deref, DerefMut};

use super::caps::Caps;
use super::ids::{alloc_id, IdSet};
use super::pas::check_pas;
use super::syndrome;
use crate::dma::{DmaFault, DmaSpace};
use crate::small::IdMap;

/// Bytes of the CQE image the device writes (`struct mlx5_cqe64`).
pub(crate) const CQE64: usize = c::mlx5_cqe64::SIZE;
/// `op_own`: opcode in bits 7:4, solicited event in bit 1, owner in bit 0 (c-layouts.md 4.4).
pub(crate) const OP_OWN: usize = c::mlx5_cqe64::OP_OWN.off;
/// The solicited-event bit of `op_own` (`mlx5dv_get_cqe_se`: `(op_own >> 1) & 1`).
pub(crate) const SOLICITED: u8 = 1 << 1;
/// The CQE opcode is the high nibble of `op_own` (`get_cqe_opcode`).
pub(crate) const OPCODE_SHIFT: u8 = 4;
/// Consumer and producer counters travel as 24 bits (doorbell record, CQ doorbell, cqc counters).
pub(crate) const CTR_MASK: u32 = 0xff_ffff;
/// Page sizes in a cqc are relative to 4 KiB (`log_page_size = page_shift - MLX5_ADAPTER_PAGE_SHIFT`).
pub(crate) const ADAPTER_PAGE_SHIFT: u32 = consts::MLX5_ADAPTER_PAGE_SHIFT;
/// MODIFY_CQ `op_mod` for moderation changes: Linux's `mlx5_core_modify_cq_moderation` leaves it 0, and only
/// `MLX5_CQ_OPMOD_RESIZE` has a name.
pub(crate) const OPMOD_MODIFY: u16 = 0;

/// What the next CQE does to an armed CQ.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Arm {
    /// Not armed: no completion event.
    None,
    /// `MLX5_CQ_DB_REQ_NOT`: any CQE fires.
    Next,
    /// `MLX5_CQ_DB_REQ_NOT_SOL`: only a solicited or error CQE fires.
    Solicited,
}

/// A completion queue: its buffer, indices, arm state and moderation.
#[derive(Debug)]
pub(crate) struct Cq {
    pub(crate) uar: u32,
    pub(crate) eqn: u32,
    /// 64 or 128 bytes.
    pub(crate) cqe_size: u64,
    /// `cqc.cqe_sz` as created or resized (128 bytes padded reads back as such).
    pub(crate) cqe_sz: u32,
    pub(crate) log_nent: u32,
    /// Bus addresses of the buffer pages, `1 << page_shift` bytes each.
    pub(crate) pas: Vec<u64>,
    pub(crate) page_shift: u32,
    pub(crate) dbr: u64,
    pub(crate) oi: bool,
    /// CQEs written (wrapping 32-bit counter; the resize CQE counts).
    pub(crate) pi: u32,
    pub(crate) arm: Arm,
    /// `MLX5_CQC_STATUS_*`.
    pub(crate) status: u8,
    /// Moderation (`cq_period` in microseconds, `cq_max_count`; 0 turns each off): an armed CQ's event waits
    /// until `max_count` CQEs would have fired it or `period` has passed since its last event
    /// (`cq_period_start_from_cqe` is not offered, so the period starts at the EQE).
    pub(crate) period: u32,
    pub(crate) max_count: u32,
    pub(crate) period_mode: u32,
    /// CQEs that would have fired the armed CQ's event and wait for the moderation.
    pub(crate) held: u32,
    /// Device time of the CQ's last completion event (0: none yet, so the first is never held for the period).
    pub(crate) last_event_ns: u64,
    /// The sequence number of the last accepted arm doorbell.
    pub(crate) arm_sn: u8,
    /// Counter value of the CQE that last fired an event.
    pub(crate) last_notified: u32,
    /// Counter value of the last solicited or error CQE.
    pub(crate) last_solicited: Option<u32>,
    pub(crate) events_fired: u64,
    /// CQEs that found the CQ full (with `oi` they were written anyway).
    pub(crate) overruns: u64,
}

/// Why [`crate::sim_device::SimDevice::post_cqe`] wrote nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PostCqeError {
    /// No CQ with this number.
    UnknownCq,
    /// The CQ is in error (`status` is a `MLX5_CQC_STATUS_*`) and takes no more CQEs.
    CqInError { status: u8 },
    /// The CQ was full and has no `oi`: it is now in overflow and a CQ-error EQE was posted.
    Overrun,
    /// The doorbell record or the CQE was not in live DMA memory: the CQ is now in write-fail.
    DmaFault(DmaFault),
    /// The firmware is dead or the device gone: nothing is written.
    Dead,
}

/// The state of one CQ, as [`crate::sim_device::SimDevice::cq_info`] reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqInfo {
    /// Number of entries (`1 << log_cq_size`).
    pub nent: u32,
    /// Bytes per CQE (64 or 128).
    pub cqe_size: u32,
    /// Producer index: CQEs written so far (wrapping 32-bit counter).
    pub pi: u32,
    /// Consumer index from the doorbell record (24 bits; 0 when the record is not mapped).
    pub ci: u32,
    /// `None`: not armed; `Some(solicited)`: armed for the next CQE, or for the next solicited one.
    pub armed: Option<bool>,
    /// `MLX5_CQC_STATUS_*`.
    pub status: u8,
    /// Completion events fired.
    pub events_fired: u64,
    /// CQEs that found the CQ full.
    pub overruns: u64,
    /// `cqc.log_page_size`: log2 of the buffer page size relative to 4 KiB.
    pub log_page_size: u32,
    /// Buffer pages (`pas[]` entries in use).
    pub npas: usize,
    pub cq_period: u16,
    pub cq_max_count: u16,
    /// Sequence number of the last accepted arm doorbell.
    pub arm_sn: u8,
    /// UAR page of the CQ doorbell.
    pub uar: u32,
    /// EQ receiving the completion events (`c_eqn`).
    pub eqn: u8,
}

/// The CQE size a `cqc.cqe_sz` encodes. 128 bytes padded (`cqe_128_always`) is a 128-byte CQE whose first half is
/// never written: the simulator scatters no data into CQEs, so it lays out CQEs as for plain 128 bytes.
fn cqe_bytes(caps: &Caps, code: u32) -> Result<u64, CmdErr> {
    match code {
        consts::CQE_STRIDE_64 => Ok(64),
        consts::CQE_STRIDE_128 => Ok(128),
        consts::CQE_STRIDE_128_PAD if caps.gen(ifc::cmd_hca_cap::CQE_128_ALWAYS) != 0 => Ok(128),
        _ => Err(bad_param(syndrome::CQE_SIZE)),
    }
}

/// CQE compression as CREATE_CQ asks for it. The device may merge CQEs into a mini-CQE array when several are
/// ready at once; it never has to, and a driver enabling `cqe_comp_en` must poll plain CQEs as ever (mlx5_ib and
/// rdma-core do). The simulator writes every CQE plain, so it only checks the request against its caps.
fn check_compression(caps: &Caps, inp: &[u8], cqe_size: u64) -> Result<(), CmdErr> {
    use ifc::cmd_hca_cap as g;
    use ifc::cqc as q;
    let ctx = ifc::create_cq_in::CQ_CONTEXT;
    let bad = Err(bad_param(syndrome::CQE_COMPRESSION));
    if rd(inp, q::CQE_COMP_EN.at(ctx)) == 0 {
        return Ok(());
    }
    let cap = if cqe_size == 128 { g::CQE_COMPRESSION_128 } else { g::CQE_COMPRESSION };
    if caps.gen(cap) == 0 {
        return bad;
    }
    // Hash (0) and checksum are the basic mini-CQE formats; checksum with stride index needs its cap.
    let stridx = caps.gen(g::MINI_CQE_RESP_STRIDE_INDEX) != 0;
    match rd(inp, q::MINI_CQE_RES_FORMAT.at(ctx)) {
        0 | consts::MLX5_CQE_FORMAT_CSUM => {}
        consts::MLX5_CQE_FORMAT_CSUM_STRIDX if stridx => {}
        _ => return bad,
    }
    let enhanced = caps.gen(g::ENHANCED_CQE_COMPRESSION) != 0;
    match rd(inp, q::CQE_COMPRESSION_LAYOUT.at(ctx)) {
        consts::MLX5_CQE_COMPRESS_LAYOUT_BASIC => Ok(()),
        consts::MLX5_CQE_COMPRESS_LAYOUT_ENHANCED if enhanced => Ok(()),
        _ => bad,
    }
}

/// Reads the `pas[]` entries covering `bytes` in pages of `1 << page_shift` (already checked by `check_pas`).
fn read_pas(inp: &[u8], pas: mlx5_core::prm::Array, bytes: u64, page_shift: u32) -> Vec<u64> {
    (0..bytes.div_ceil(1 << page_shift)).map(|k| inp.get64(pas.elem(k as u32))).collect()
}

impl Cq {
    /// Whether the events held so far may fire at `now_ns` (always, without moderation).
    pub(crate) fn moderation_met(&self, now_ns: u64) -> bool {
        let counted = self.max_count != 0 && self.held >= self.max_count;
        let timed = self.period != 0 && now_ns.saturating_sub(self.last_event_ns) >= u64::from(self.period) * 1000;
        (self.max_count == 0 && self.period == 0) || counted || timed
    }

    #[inline]
    pub(crate) fn nent(&self) -> u32 {
        1 << self.log_nent
    }

    /// Bus address of the `mlx5_cqe64` image of CQE `n`: entry `n mod nent`, in the second half of a 128-byte
    /// CQE (`struct mlx5_cqe128`: 64 bytes of `inl_grh`, then `cqe64`).
    #[inline]
    pub(crate) fn cqe64_iova(&self, n: u32) -> Option<u64> {
        let idx = u64::from(n & (self.nent() - 1));
        let off = idx * self.cqe_size + (self.cqe_size - CQE64 as u64);
        let page = usize::try_from(off >> self.page_shift).ok()?;
        self.pas.get(page)?.checked_add(off & ((1u64 << self.page_shift) - 1))
    }

    /// Writes CQE `n` with the owner bit of its pass: the image first, `op_own` last.
    #[inline]
    pub(crate) fn write_cqe(&self, dma: &mut DmaSpace, n: u32, cqe: &[u8; CQE64]) -> Result<(), DmaFault> {
        // `check_pas` guaranteed a page for every entry; a miss here would be a simulator bug, reported as a fault.
        let iova = self.cqe64_iova(n).ok_or(DmaFault { iova: 0, len: CQE64, write: true })?;
        let owner = ((n >> self.log_nent) & 1) as u8;
        // The entry must be visible before the byte that hands it to the driver (store before store: a release
        // fence, as the device's write ordering).
        dma.write_then_flag(iova, &cqe[..OP_OWN], (cqe[OP_OWN] & !consts::MLX5_CQE_OWNER_MASK) | owner)
    }

    /// The consumer index from the doorbell record (`db[0] = be32(cons_index & 0xffffff)`).
    #[inline]
    pub(crate) fn read_ci(&self, dma: &mut DmaSpace) -> Result<u32, DmaFault> {
        let mut b = [0u8; 4];
        dma.read(self.dbr, &mut b)?;
        Ok(u32::from_be_bytes(b) & CTR_MASK)
    }

    /// CQEs written and not consumed, for a 24-bit consumer index.
    #[inline]
    pub(crate) fn unconsumed(&self, ci: u32) -> u32 {
        (self.pi & CTR_MASK).wrapping_sub(ci) & CTR_MASK
    }

    /// Whether a solicited or error CQE is among the unconsumed ones. The last such CQE is the latest of them,
    /// so it is unconsumed exactly when any of them is.
    #[inline]
    pub(crate) fn solicited_unconsumed(&self, ci: u32) -> bool {
        self.last_solicited.is_some_and(|s| ((s & CTR_MASK).wrapping_sub(ci) & CTR_MASK) < self.unconsumed(ci))
    }
}

/// The CQ table: every CQ by number (the datapath looks CQs up here), and the number CREATE_CQ tries next.
#[derive(Debug)]
pub(crate) struct CqTable {
    map: IdMap<Cq>,
    next: u32,
    /// CQs whose completion event moderation holds: the datapath's runs look only at these for a due period.
    held: std::collections::BTreeSet<u32>,
}

impl CqTable {
    pub(crate) fn new() -> Self {
        CqTable { map: IdMap::new(), next: 1, held: Default::default() }
    }

    /// CQ `cqn`'s event is held by its moderation (or no longer, with `on` false).
    pub(crate) fn set_held(&mut self, cqn: u32, on: bool) {
        if on {
            self.held.insert(cqn);
        } else {
            self.held.remove(&cqn);
        }
    }

    /// The CQs whose held event is due at `now_ns`: their period has passed since their last event, or a
    /// MODIFY_CQ since lowered the count to what is held or turned moderation off.
    pub(crate) fn held_due(&self, now_ns: u64) -> Vec<u32> {
        self.held.iter().copied().filter(|n| self.map.get(n).is_some_and(|cq| cq.moderation_met(now_ns))).collect()
    }

    /// Whether any CQ holds an event (a run with none skips the check).
    pub(crate) fn any_held(&self) -> bool {
        !self.held.is_empty()
    }
}

impl Deref for CqTable {
    type Target = IdMap<Cq>;
    #[inline]
    fn deref(&self) -> &IdMap<Cq> {
        &self.map
    }
}

impl DerefMut for CqTable {
    #[inline]
    fn deref_mut(&mut self) -> &mut IdMap<Cq> {
        &mut self.map
    }
}

/// What the CQ commands need of the rest of the firmware, and nothing more.
pub(crate) struct CqFw<'a> {
    pub(crate) caps: &'a Caps,
    /// The allocated UAR pages.
    pub(crate) uars: &'a IdSet,
    /// Whether an EQ exists (a CQ's `c_eqn`).
    pub(crate) eq_exists: &'a dyn Fn(u32) -> bool,
    /// Whether a QP completes into a CQ (which then cannot be destroyed).
    pub(crate) in_use: &'a dyn Fn(u32) -> bool,
}

impl CqTable {
    pub(crate) fn create(&mut self, fw: &CqFw, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::cqc as q;
        use ifc::create_cq_in as i;
        let ctx = i::CQ_CONTEXT;
        // A CQ on a UMEM (DevX) names it in `cq_umem_id` and `cqc.dbr_umem_id`, fields only rdma-core's
        // layouts carry (Linux 6.12's do not): not modelled, refused rather than read as a `pas[]` CQ.
        if rd(inp, i::CQ_UMEM_VALID) != 0 || rd(inp, q::DBR_UMEM_VALID.at(ctx)) != 0 {
            return Err(bad_param(syndrome::CQ_UMEM));
        }
        let cqe_sz = rd(inp, q::CQE_SZ.at(ctx));
        let cqe_size = cqe_bytes(fw.caps, cqe_sz)?;
        let log_size = rd(inp, q::LOG_CQ_SIZE.at(ctx));
        if log_size > fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_CQ_SZ) {
            return Err(bad_param(syndrome::LOG_SIZE));
        }
        let uar = rd(inp, q::UAR_PAGE.at(ctx));
        if !fw.uars.contains(uar) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        if rd(inp, q::APU_CQ.at(ctx)) != 0 {
            return Err(bad_param(syndrome::APU_CQ));
        }
        if rd(inp, q::CC.at(ctx)) != 0 {
            return Err(bad_param(syndrome::CQ_FEATURE));
        }
        check_compression(fw.caps, inp, cqe_size)?;
        let oi = rd(inp, q::OI.at(ctx)) != 0;
        if oi && fw.caps.gen(ifc::cmd_hca_cap::CQ_OI) == 0 {
            return Err(bad_param(syndrome::CAP_NOT_SET));
        }
        let eqn = rd(inp, q::C_EQN_OR_APU_ELEMENT.at(ctx));
        if !(fw.eq_exists)(eqn) {
            return Err(bad_param(syndrome::EQ_INVALID));
        }
        if rd(inp, q::PAGE_OFFSET.at(ctx)) != 0 {
            return Err(bad_param(syndrome::PAGE_OFFSET));
        }
        let page_shift = ADAPTER_PAGE_SHIFT + rd(inp, q::LOG_PAGE_SIZE.at(ctx));
        let bytes = (1u64 << log_size) * cqe_size;
        check_pas(dma, inp, i::PAS, bytes, 1 << page_shift)?;
        // The doorbell record is two big-endian dwords (update_ci, arm).
        let dbr = inp.get64(q::DBR_ADDR.at(ctx));
        if !dma.is_mapped(dbr, 8) {
            return Err(bad_param(syndrome::DBR_NOT_MAPPED));
        }
        let max = 1u32 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_CQ).min(24);
        let cqn =
            alloc_id(&self.map, &mut self.next, 1, max.max(2)).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        let cq = Cq {
            uar,
            eqn,
            cqe_size,
            cqe_sz,
            log_nent: log_size,
            pas: read_pas(inp, i::PAS, bytes, page_shift),
            page_shift,
            dbr,
            oi,
            pi: 0,
            arm: Arm::None,
            status: consts::MLX5_CQC_STATUS_OK,
            period: rd(inp, q::CQ_PERIOD.at(ctx)),
            max_count: rd(inp, q::CQ_MAX_COUNT.at(ctx)),
            period_mode: rd(inp, q::CQ_PERIOD_MODE.at(ctx)),
            held: 0,
            last_event_ns: 0,
            arm_sn: 0,
            last_notified: 0,
            last_solicited: None,
            events_fired: 0,
            overruns: 0,
        };
        self.map.insert(cqn, cq);
        out.set(ifc::create_cq_out::CQN, cqn);
        Ok(())
    }

    pub(crate) fn destroy(&mut self, fw: &CqFw, inp: &[u8]) -> Result<(), CmdErr> {
        let cqn = rd(inp, ifc::destroy_cq_in::CQN);
        if !self.map.contains_key(&cqn) {
            return Err(bad_param(syndrome::CQ_INVALID));
        }
        // A QP completes into it: firmware refuses, as for an EQ a CQ still uses.
        if (fw.in_use)(cqn) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.map.remove(&cqn);
        self.held.remove(&cqn);
        Ok(())
    }

    /// QUERY_CQ: the context (with the live counters) and as many `pas[]` entries as `outlen` holds (Linux
    /// queries with the bare `query_cq_out` and reads none).
    pub(crate) fn query(&self, dma: &mut DmaSpace, inp: &[u8], out: &mut [u8], outlen: usize) -> Result<(), CmdErr> {
        use ifc::cqc as q;
        use ifc::query_cq_out as o;
        let cqn = rd(inp, ifc::query_cq_in::CQN);
        let cq = self.map.get(&cqn).ok_or(bad_param(syndrome::CQ_INVALID))?;
        let ctx = o::CQ_CONTEXT;
        let st = match cq.arm {
            Arm::None => consts::MLX5_CQC_ST_FIRED,
            Arm::Next => consts::MLX5_CQC_ST_NOTIFICATION_REQUEST_ARMED,
            Arm::Solicited => consts::MLX5_CQC_ST_SOLICITED_NOTIFICATION_REQUEST_ARMED,
        };
        let cqe_sz = cq.cqe_sz;
        // A doorbell record the driver unmapped reads as consumer index 0 (the miss is in `dma_faults`).
        let ci = cq.read_ci(dma).unwrap_or(0);
        let fields = [
            (q::STATUS, u32::from(cq.status)),
            (q::CQE_SZ, cqe_sz),
            (q::OI, cq.oi.into()),
            (q::CQ_PERIOD_MODE, cq.period_mode),
            (q::ST, st),
            (q::LOG_CQ_SIZE, cq.log_nent),
            (q::UAR_PAGE, cq.uar),
            (q::CQ_PERIOD, cq.period),
            (q::CQ_MAX_COUNT, cq.max_count),
            (q::C_EQN_OR_APU_ELEMENT, cq.eqn),
            (q::LOG_PAGE_SIZE, cq.page_shift - ADAPTER_PAGE_SHIFT),
            (q::LAST_NOTIFIED_INDEX, cq.last_notified & CTR_MASK),
            (q::LAST_SOLICIT_INDEX, cq.last_solicited.unwrap_or(0) & CTR_MASK),
            (q::CONSUMER_COUNTER, ci),
            (q::PRODUCER_COUNTER, cq.pi & CTR_MASK),
        ];
        for (f, v) in fields {
            out.set(f.at(ctx), v);
        }
        out.set64(q::DBR_ADDR.at(ctx), cq.dbr);
        let room = outlen.saturating_sub(o::PAS.byte_off()) / (o::PAS.elem_bits / 8) as usize;
        for (k, &pa) in cq.pas.iter().take(room).enumerate() {
            out.set64(o::PAS.elem(k as u32), pa);
        }
        Ok(())
    }

    /// MODIFY_CQ: moderation (op_mod 0) or resize (`MLX5_CQ_OPMOD_RESIZE`).
    pub(crate) fn modify(&mut self, fw: &CqFw, dma: &mut DmaSpace, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::modify_cq_in as i;
        let cqn = rd(inp, i::CQN);
        if !self.map.contains_key(&cqn) {
            return Err(bad_param(syndrome::CQ_INVALID));
        }
        // field_select is a union: the moderation and the resize views are the same dword.
        let sel = ifc::modify_field_select_resize_field_select_auto::MODIFY_FIELD_SELECT
            .at(i::MODIFY_FIELD_SELECT_RESIZE_FIELD_SELECT);
        let resize_sel = ifc::modify_field_select_resize_field_select_auto::RESIZE_FIELD_SELECT
            .at(i::MODIFY_FIELD_SELECT_RESIZE_FIELD_SELECT);
        match rd16(inp, ifc::mbox_in::OP_MOD) {
            OPMOD_MODIFY => self.moderate(fw, cqn, inp, rd(inp, ifc::modify_field_select::MODIFY_FIELD_SELECT.at(sel))),
            consts::MLX5_CQ_OPMOD_RESIZE => {
                let bits = rd(inp, ifc::resize_field_select::RESIZE_FIELD_SELECT.at(resize_sel));
                self.resize(fw, dma, cqn, inp, bits)
            }
            _ => Err(bad_param(syndrome::BAD_OP_MOD)),
        }
    }

    fn moderate(&mut self, fw: &CqFw, cqn: u32, inp: &[u8], sel: u32) -> Result<(), CmdErr> {
        use ifc::cqc as q;
        let ctx = ifc::modify_cq_in::CQ_CONTEXT;
        let known = consts::MLX5_CQ_MODIFY_PERIOD
            | consts::MLX5_CQ_MODIFY_COUNT
            | consts::MLX5_CQ_MODIFY_OVERRUN
            | consts::MLX5_CQ_MODIFY_PERIOD_MODE;
        if sel & !known != 0 {
            return Err(bad_param(syndrome::FIELD_SELECT));
        }
        let cap = |f: Field| fw.caps.gen(f) != 0;
        let needs = [
            (consts::MLX5_CQ_MODIFY_PERIOD | consts::MLX5_CQ_MODIFY_COUNT, ifc::cmd_hca_cap::CQ_MODERATION),
            (consts::MLX5_CQ_MODIFY_OVERRUN, ifc::cmd_hca_cap::CQ_OI),
            (consts::MLX5_CQ_MODIFY_PERIOD_MODE, ifc::cmd_hca_cap::CQ_PERIOD_MODE_MODIFY),
        ];
        if needs.iter().any(|&(bits, f)| sel & bits != 0 && !cap(f)) {
            return Err(bad_param(syndrome::CAP_NOT_SET));
        }
        let cq = self.map.get_mut(&cqn).ok_or(bad_param(syndrome::CQ_INVALID))?;
        if sel & consts::MLX5_CQ_MODIFY_PERIOD != 0 {
            cq.period = rd(inp, q::CQ_PERIOD.at(ctx));
        }
        if sel & consts::MLX5_CQ_MODIFY_COUNT != 0 {
            cq.max_count = rd(inp, q::CQ_MAX_COUNT.at(ctx));
        }
        if sel & consts::MLX5_CQ_MODIFY_OVERRUN != 0 {
            cq.oi = rd(inp, q::OI.at(ctx)) != 0;
        }
        if sel & consts::MLX5_CQ_MODIFY_PERIOD_MODE != 0 {
            cq.period_mode = rd(inp, q::CQ_PERIOD_MODE.at(ctx));
        }
        Ok(())
    }

    /// Resize: the new buffer must hold the unconsumed CQEs; firmware writes a resize CQE at the old buffer's
    /// next index and continues one index further in the new buffer, where the driver has copied the
    /// unconsumed CQEs `c..r-1` to `c+1..r` (rdma-core `mlx5_cq_resize_copy_cqes`). The CQE size is the one
    /// the context gives, as Linux always sets `cqe_sz` for a resize. The resize CQE fires no completion
    /// event: the driver looks for it synchronously.
    fn resize(&mut self, fw: &CqFw, dma: &mut DmaSpace, cqn: u32, inp: &[u8], sel: u32) -> Result<(), CmdErr> {
        use ifc::cqc as q;
        use ifc::modify_cq_in as i;
        let ctx = i::CQ_CONTEXT;
        if fw.caps.gen(ifc::cmd_hca_cap::CQ_RESIZE) == 0 {
            return Err(bad_param(syndrome::CAP_NOT_SET));
        }
        let known = consts::MLX5_MODIFY_CQ_MASK_LOG_SIZE
            | consts::MLX5_MODIFY_CQ_MASK_PG_OFFSET
            | consts::MLX5_MODIFY_CQ_MASK_PG_SIZE;
        if sel & !known != 0 || sel & consts::MLX5_MODIFY_CQ_MASK_LOG_SIZE == 0 {
            return Err(bad_param(syndrome::FIELD_SELECT));
        }
        let log_size = rd(inp, q::LOG_CQ_SIZE.at(ctx));
        if log_size > fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_CQ_SZ) {
            return Err(bad_param(syndrome::LOG_SIZE));
        }
        if sel & consts::MLX5_MODIFY_CQ_MASK_PG_OFFSET != 0 && rd(inp, q::PAGE_OFFSET.at(ctx)) != 0 {
            return Err(bad_param(syndrome::PAGE_OFFSET));
        }
        let cqe_sz = rd(inp, q::CQE_SZ.at(ctx));
        let cqe_size = cqe_bytes(fw.caps, cqe_sz)?;
        let cq = self.map.get(&cqn).ok_or(bad_param(syndrome::CQ_INVALID))?;
        let page_shift = if sel & consts::MLX5_MODIFY_CQ_MASK_PG_SIZE != 0 {
            ADAPTER_PAGE_SHIFT + rd(inp, q::LOG_PAGE_SIZE.at(ctx))
        } else {
            cq.page_shift
        };
        if cq.status != consts::MLX5_CQC_STATUS_OK {
            return Err(err(CmdStatus::BadResState, syndrome::CQ_IN_ERROR));
        }
        let bytes = (1u64 << log_size) * cqe_size;
        check_pas(dma, inp, i::PAS, bytes, 1 << page_shift)?;
        let ci = cq.read_ci(dma).map_err(|_| err(CmdStatus::BadResState, syndrome::CQ_IN_ERROR))?;
        let pending = cq.unconsumed(ci);
        if pending >= 1 << log_size {
            return Err(bad_param(syndrome::CQ_TOO_SMALL));
        }
        if pending >= cq.nent() {
            return Err(err(CmdStatus::BadResState, syndrome::CQ_FULL));
        }
        let mut resize = [0u8; CQE64];
        resize[OP_OWN] = consts::MLX5_CQE_RESIZE_CQ << OPCODE_SHIFT;
        cq.write_cqe(dma, cq.pi, &resize).map_err(|_| err(CmdStatus::BadResState, syndrome::CQ_IN_ERROR))?;
        let pas = read_pas(inp, i::PAS, bytes, page_shift);
        let cq = self.map.get_mut(&cqn).ok_or(bad_param(syndrome::CQ_INVALID))?;
        // The unconsumed CQEs move one index up in the new buffer, the last solicited one with them.
        let (old_pi, start) = (cq.pi, ci);
        if let Some(s) = cq.last_solicited.filter(|s| ((s & CTR_MASK).wrapping_sub(start) & CTR_MASK) < pending) {
            cq.last_solicited = Some(s.wrapping_add(1));
        }
        cq.pi = old_pi.wrapping_add(1);
        cq.pas = pas;
        cq.page_shift = page_shift;
        cq.log_nent = log_size;
        cq.cqe_size = cqe_size;
        cq.cqe_sz = cqe_sz;
        Ok(())
    }
}

impl CqTable {
    /// The state of CQ `cqn`, reading the doorbell record without recording a fault.
    pub(crate) fn info(&self, dma: &DmaSpace, cqn: u32) -> Option<CqInfo> {
        let cq = self.get(&cqn)?;
        let mut b = [0u8; 4];
        let ci = if dma.peek(cq.dbr, &mut b) { u32::from_be_bytes(b) & CTR_MASK } else { 0 };
        Some(CqInfo {
            nent: cq.nent(),
            cqe_size: cq.cqe_size as u32,
            pi: cq.pi,
            ci,
            armed: match cq.arm {
                Arm::None => None,
                Arm::Next => Some(false),
                Arm::Solicited => Some(true),
            },
            status: cq.status,
            events_fired: cq.events_fired,
            overruns: cq.overruns,
            log_page_size: cq.page_shift - ADAPTER_PAGE_SHIFT,
            npas: cq.pas.len(),
            cq_period: cq.period as u16,
            cq_max_count: cq.max_count as u16,
            arm_sn: cq.arm_sn,
            uar: cq.uar,
            eqn: cq.eqn as u8,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::device::lock;
    use crate::events::SimEvent;
    use crate::mmio::SimMmio;
    use crate::testkit::submit::{get_view, put, put_view, Harness};

    /// Offset in a UAR page of the CQ doorbell.
    const CQ_DB: usize = consts::MLX5_CQ_DOORBELL as usize;
    /// The arm sequence number's shift in a CQ doorbell.
    const DB_SN_SHIFT: u32 = 28;
    use mlx5_core::hal::{Dma, DmaError, DmaRegion, Mmio};

    /// The driver initialises every CQE with an invalid opcode (`init_cq_frag_buf`).
    const INVALID_OP_OWN: u8 = consts::MLX5_CQE_INVALID << OPCODE_SHIFT;
    const WQE_COUNTER: mlx5_core::prm::Bytes = c::mlx5_cqe64::WQE_COUNTER;

    /// How a test CQ is laid out.
    #[derive(Clone, Copy)]
    struct Spec {
        log_size: u32,
        cqe_128: bool,
        /// `cqc.log_page_size` (relative to 4 KiB).
        log_page: u32,
        /// One DMA region per page (never adjacent: every region has a guard page) instead of one block.
        scattered: bool,
        oi: bool,
    }

    const SMALL: Spec = Spec { log_size: 2, cqe_128: false, log_page: 0, scattered: false, oi: false };

    /// A CQ buffer as the test sees it: page `k` is `regions[pages[k].0]` at offset `pages[k].1`.
    struct Buf {
        regions: Vec<DmaRegion>,
        pages: Vec<(usize, usize)>,
        page_bytes: usize,
        cqe_size: usize,
        nent: u32,
    }

    impl Buf {
        fn alloc(h: &Harness, log_size: u32, cqe_size: usize, log_page: u32, scattered: bool) -> Self {
            let page_bytes = 4096usize << log_page;
            let nent = 1u32 << log_size;
            let npages = (nent as usize * cqe_size).div_ceil(page_bytes);
            let (regions, pages): (Vec<DmaRegion>, Vec<(usize, usize)>) = if scattered {
                let regions: Vec<DmaRegion> =
                    (0..npages).map(|_| h.dma.alloc(page_bytes, page_bytes).unwrap()).collect();
                (regions, (0..npages).map(|k| (k, 0)).collect())
            } else {
                let r = h.dma.alloc(npages * page_bytes, page_bytes).unwrap();
                (vec![r], (0..npages).map(|k| (0, k * page_bytes)).collect())
            };
            let buf = Self { regions, pages, page_bytes, cqe_size, nent };
            for n in 0..nent {
                let (r, off) = buf.at(n);
                put_view(r, off + OP_OWN, &[INVALID_OP_OWN]);
            }
            buf
        }

        /// Region and offset of the `mlx5_cqe64` of CQE `n`.
        fn at(&self, n: u32) -> (mlx5_core::hal::DmaView<'_>, usize) {
            let off = (n & (self.nent - 1)) as usize * self.cqe_size + self.cqe_size - CQE64;
            let (r, base) = self.pages[off / self.page_bytes];
            (self.regions[r].view(), base + off % self.page_bytes)
        }

        fn cqe(&self, n: u32) -> [u8; CQE64] {
            let (r, off) = self.at(n);
            let mut e = [0u8; CQE64];
            get_view(r, off, &mut e);
            e
        }

        fn iovas(&self) -> Vec<u64> {
            self.pages.iter().map(|&(r, off)| self.regions[r].iova() + off as u64).collect()
        }
    }

    struct TestCq {
        cqn: u32,
        buf: Buf,
        dbr: DmaRegion,
        uar: u32,
    }

    impl TestCq {
        /// Writes the consumer index into the doorbell record, as `mlx5_cq_set_ci` does.
        fn set_ci(&self, ci: u32) {
            put(&self.dbr, 0, &(ci & CTR_MASK).to_be_bytes());
        }

        fn cqe(&self, n: u32) -> [u8; CQE64] {
            self.buf.cqe(n)
        }
    }

    /// Brought up, with a UAR, a completion EQ that subscribes to nothing (completion events are routed by
    /// `c_eqn`) and an EQ for CQ errors.
    struct Env {
        h: Harness,
        uar: u32,
        comp: u8,
        comp_buf: DmaRegion,
        errq: u8,
        err_buf: DmaRegion,
    }

    fn env_with(cfg: SimConfig) -> Env {
        let mut h = Harness::new(cfg);
        h.bring_up();
        let uar = h.alloc_uar();
        let (s, comp, comp_buf) = h.create_eq(uar, 4, 0);
        assert_eq!(s, 0);
        let (s, errq, err_buf) = h.create_eq(uar, 3, 1 << consts::MLX5_EVENT_TYPE_CQ_ERROR);
        assert_eq!(s, 0);
        Env { h, uar, comp, comp_buf, errq, err_buf }
    }

    fn env() -> Env {
        env_with(SimConfig::default())
    }

    fn create_cq_in(env: &Env, spec: Spec, buf: &Buf, dbr: &DmaRegion) -> Vec<u8> {
        use ifc::cqc as q;
        use ifc::create_cq_in as i;
        let ctx = i::CQ_CONTEXT;
        let pas = buf.iovas();
        let mut inp = vec![0u8; i::PAS.byte_off() + 8 * pas.len()];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_CQ.into());
        let cqe_sz = if spec.cqe_128 { consts::CQE_STRIDE_128 } else { consts::CQE_STRIDE_64 };
        inp.set(q::CQE_SZ.at(ctx), cqe_sz);
        inp.set(q::OI.at(ctx), spec.oi.into());
        inp.set(q::LOG_CQ_SIZE.at(ctx), spec.log_size);
        inp.set(q::UAR_PAGE.at(ctx), env.uar);
        inp.set(q::C_EQN_OR_APU_ELEMENT.at(ctx), env.comp.into());
        inp.set(q::LOG_PAGE_SIZE.at(ctx), spec.log_page);
        inp.set64(q::DBR_ADDR.at(ctx), dbr.iova());
        for (k, pa) in pas.iter().enumerate() {
            inp.set64(i::PAS.elem(k as u32), *pa);
        }
        inp
    }

    fn create(env: &mut Env, spec: Spec) -> TestCq {
        let buf = Buf::alloc(&env.h, spec.log_size, if spec.cqe_128 { 128 } else { 64 }, spec.log_page, spec.scattered);
        let dbr = env.h.dma.alloc(64, 64).unwrap();
        let inp = create_cq_in(env, spec, &buf, &dbr);
        let (s, syn, out) = env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0), "CREATE_CQ");
        TestCq { cqn: rd(&out, ifc::create_cq_out::CQN), buf, dbr, uar: env.uar }
    }

    /// A CQE image: `opcode`, the solicited bit, a marker in `wqe_counter`, and a wrong owner bit that the
    /// device must replace.
    fn cqe(opcode: u8, solicited: bool, marker: u16) -> [u8; CQE64] {
        let mut e = [0u8; CQE64];
        e[WQE_COUNTER.off..WQE_COUNTER.end()].copy_from_slice(&marker.to_be_bytes());
        e[c::mlx5_cqe64::BYTE_CNT.off] = 0xab;
        e[OP_OWN] = opcode << OPCODE_SHIFT | if solicited { SOLICITED } else { 0 } | 1;
        e
    }

    fn plain(marker: u16) -> [u8; CQE64] {
        cqe(consts::MLX5_CQE_REQ, false, marker)
    }

    fn marker(e: &[u8; CQE64]) -> u16 {
        u16::from_be_bytes([e[WQE_COUNTER.off], e[WQE_COUNTER.off + 1]])
    }

    fn owner(e: &[u8; CQE64]) -> u8 {
        e[OP_OWN] & consts::MLX5_CQE_OWNER_MASK
    }

    fn opcode(e: &[u8; CQE64]) -> u8 {
        e[OP_OWN] >> OPCODE_SHIFT
    }

    /// The 64-bit CQ doorbell, as `mlx5_cq_arm` writes it.
    fn arm(h: &Harness, uar: u32, cqn: u32, sn: u32, solicited: bool, ci: u32) {
        let cmd = if solicited { consts::MLX5_CQ_DB_REQ_NOT_SOL } else { consts::MLX5_CQ_DB_REQ_NOT };
        let word = sn << DB_SN_SHIFT | cmd | (ci & CTR_MASK);
        h.mmio.write64(SimMmio::uar_offset(uar) + CQ_DB, u64::from(word) << 32 | u64::from(cqn));
    }

    fn completions(h: &Harness, cqn: u32) -> usize {
        h.dev.events().iter().filter(|e| matches!(e, SimEvent::CompletionEvent { cqn: c, .. } if *c == cqn)).count()
    }

    #[test]
    fn owner_bits_follow_the_pass_over_three_wraps_for_every_layout() {
        // (log_size, 128-byte CQEs, log_page_size, scattered): every layout spans at least two pages.
        let layouts = [
            (8, false, 0, false),
            (8, true, 0, false),
            (8, false, 0, true),
            (8, true, 0, true),
            (12, false, 4, true),
            (11, true, 4, false),
            (11, true, 4, true),
        ];
        for (log_size, cqe_128, log_page, scattered) in layouts {
            let mut env = env();
            let cq = create(&mut env, Spec { log_size, cqe_128, log_page, scattered, oi: false });
            assert!(cq.buf.pages.len() >= 2);
            let nent = 1u32 << log_size;
            for n in 0..3 * nent {
                cq.set_ci(n);
                assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(n as u16)), Ok(n));
                let e = cq.cqe(n);
                assert_eq!(owner(&e), ((n >> log_size) & 1) as u8, "layout {log_size}/{cqe_128}/{log_page}, n {n}");
                assert_eq!((marker(&e), opcode(&e)), (n as u16, consts::MLX5_CQE_REQ));
                assert_eq!(e[..OP_OWN], plain(n as u16)[..OP_OWN]);
            }
            if cqe_128 {
                // The first half of a 128-byte CQE (`inl_grh`) is not written.
                let (r, off) = cq.buf.at(5);
                let mut first = [0xffu8; 64];
                get_view(r, off - 64, &mut first);
                assert_eq!(first, [0u8; 64]);
            }
            let info = env.h.dev.cq_info(cq.cqn).unwrap();
            assert_eq!((info.pi, info.ci, info.nent, info.npas), (3 * nent, 3 * nent - 1, nent, cq.buf.pages.len()));
            assert_eq!((info.cqe_size, info.log_page_size), (if cqe_128 { 128 } else { 64 }, log_page));
            assert!(env.h.dev.dma_faults().is_empty());
        }
    }

    #[test]
    fn overrun_raises_one_cq_error_and_stops_the_cq() {
        let mut env = env();
        let cq = create(&mut env, SMALL);
        for n in 0..4 {
            assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(n)), Ok(n.into()));
        }
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(4)), Err(PostCqeError::Overrun));
        // Nothing was overwritten.
        assert_eq!((marker(&cq.cqe(0)), owner(&cq.cqe(0))), (0, 0));
        let status = consts::MLX5_CQC_STATUS_CQ_OVERFLOW;
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(5)), Err(PostCqeError::CqInError { status }));
        // Even after the driver catches up, the CQ stays in error.
        cq.set_ci(4);
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(6)), Err(PostCqeError::CqInError { status }));
        let info = env.h.dev.cq_info(cq.cqn).unwrap();
        assert_eq!((info.status, info.pi, info.overruns), (status, 4, 1));
        // Exactly one CQ-error EQE, on the EQ subscribed to CQ errors, naming the CQ and the overrun.
        assert_eq!(env.h.dev.eq_info(env.errq).unwrap().pi, 1);
        let e = Harness::eqe(&env.err_buf, 0);
        assert_eq!(e[c::mlx5_eqe::TYPE.off], consts::MLX5_EVENT_TYPE_CQ_ERROR);
        let d = c::mlx5_eqe::DATA.off;
        assert_eq!(e.read_u32(d + c::mlx5_eqe_cq_err::CQN.off), cq.cqn);
        let synd = e[d + c::mlx5_eqe_cq_err::SYNDROME.off];
        assert_eq!(synd, consts::MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN);
        let overruns = env.h.dev.events().iter().filter(|e| **e == SimEvent::CqOverrun { cqn: cq.cqn }).count();
        assert_eq!(overruns, 1);
        assert_eq!(env.h.dev.eq_info(env.comp).unwrap().pi, 0);
    }

    #[test]
    fn overrun_ignore_overwrites_without_an_error() {
        let mut env = env();
        let cq = create(&mut env, Spec { oi: true, ..SMALL });
        for n in 0..6u16 {
            assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(n)), Ok(n.into()));
        }
        // CQEs 4 and 5 overwrote entries 0 and 1 with the second pass's owner bit.
        assert_eq!((marker(&cq.cqe(4)), owner(&cq.cqe(4))), (4, 1));
        assert_eq!((marker(&cq.cqe(5)), owner(&cq.cqe(5))), (5, 1));
        let info = env.h.dev.cq_info(cq.cqn).unwrap();
        assert_eq!((info.status, info.pi, info.overruns), (consts::MLX5_CQC_STATUS_OK, 6, 2));
        assert_eq!(env.h.dev.eq_info(env.errq).unwrap().pi, 0);
        assert!(!env.h.dev.events().iter().any(|e| matches!(e, SimEvent::CqOverrun { .. })));
    }

    #[test]
    fn arm_next_fires_once_on_the_cqs_own_eq() {
        let mut env = env();
        let cq = create(&mut env, Spec { log_size: 4, ..SMALL });
        // Not armed: no event.
        env.h.dev.post_cqe(cq.cqn, plain(0)).unwrap();
        assert_eq!((completions(&env.h, cq.cqn), env.h.dev.eq_info(env.comp).unwrap().pi), (0, 0));
        cq.set_ci(1);
        arm(&env.h, cq.uar, cq.cqn, 1, false, 1);
        let ev = SimEvent::CqDoorbell { cqn: cq.cqn, sn: 1, solicited: false, ci: 1 };
        assert!(env.h.dev.events().contains(&ev));
        let info = env.h.dev.cq_info(cq.cqn).unwrap();
        assert_eq!((info.armed, info.arm_sn), (Some(false), 1));
        assert_eq!(completions(&env.h, cq.cqn), 0, "nothing unconsumed: no event yet");
        env.h.dev.post_cqe(cq.cqn, plain(1)).unwrap();
        assert!(env.h.dev.events().contains(&SimEvent::CompletionEvent { cqn: cq.cqn, eqn: env.comp }));
        // The completion EQE went to c_eqn although that EQ subscribes to nothing.
        assert_eq!(env.h.dev.eq_info(env.comp).unwrap().pi, 1);
        let e = Harness::eqe(&env.comp_buf, 0);
        assert_eq!(e[c::mlx5_eqe::TYPE.off], consts::MLX5_EVENT_TYPE_COMP);
        assert_eq!(e.read_u32(c::mlx5_eqe::DATA.off + c::mlx5_eqe_comp::CQN.off), cq.cqn);
        // Disarmed: the next CQE fires nothing.
        env.h.dev.post_cqe(cq.cqn, plain(2)).unwrap();
        let info = env.h.dev.cq_info(cq.cqn).unwrap();
        assert_eq!((info.armed, info.events_fired, completions(&env.h, cq.cqn)), (None, 1, 1));
        // Arming while CQEs 1 and 2 are unconsumed fires at once.
        arm(&env.h, cq.uar, cq.cqn, 2, false, 1);
        assert_eq!((completions(&env.h, cq.cqn), env.h.dev.cq_info(cq.cqn).unwrap().armed), (2, None));
        assert_eq!(env.h.dev.eq_info(env.comp).unwrap().pi, 2);
    }

    #[test]
    fn arm_solicited_fires_only_on_solicited_or_error_cqes() {
        let mut env = env();
        let cq = create(&mut env, Spec { log_size: 4, ..SMALL });
        arm(&env.h, cq.uar, cq.cqn, 0, true, 0);
        assert_eq!(env.h.dev.cq_info(cq.cqn).unwrap().armed, Some(true));
        env.h.dev.post_cqe(cq.cqn, plain(0)).unwrap();
        assert_eq!(completions(&env.h, cq.cqn), 0, "a plain CQE does not satisfy a solicited arm");
        env.h.dev.post_cqe(cq.cqn, cqe(consts::MLX5_CQE_RESP_SEND, true, 1)).unwrap();
        assert_eq!(completions(&env.h, cq.cqn), 1);
        // The solicited bit stays in the CQE the driver reads.
        assert_ne!(cq.cqe(1)[OP_OWN] & SOLICITED, 0);
        for (k, op) in [consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_RESP_ERR].into_iter().enumerate() {
            // Everything so far is consumed: the arm waits for the next matching CQE.
            let ci = 2 + 2 * k as u32;
            cq.set_ci(ci);
            arm(&env.h, cq.uar, cq.cqn, 1, true, ci);
            env.h.dev.post_cqe(cq.cqn, plain(10)).unwrap();
            assert_eq!(completions(&env.h, cq.cqn), 1 + k);
            env.h.dev.post_cqe(cq.cqn, cqe(op, false, 11)).unwrap();
            assert_eq!(completions(&env.h, cq.cqn), 2 + k, "error CQE {op}");
        }
        // pi = 6. Arming solicited-only with only a plain CQE unconsumed does not fire; with a solicited one
        // unconsumed it fires at once.
        env.h.dev.post_cqe(cq.cqn, plain(20)).unwrap();
        arm(&env.h, cq.uar, cq.cqn, 2, true, 6);
        assert_eq!((completions(&env.h, cq.cqn), env.h.dev.cq_info(cq.cqn).unwrap().armed), (3, Some(true)));
        arm(&env.h, cq.uar, cq.cqn, 3, true, 5);
        assert_eq!((completions(&env.h, cq.cqn), env.h.dev.cq_info(cq.cqn).unwrap().armed), (4, None));
        // A "next" request over a solicited one wins, and a solicited request does not weaken a "next" one.
        arm(&env.h, cq.uar, cq.cqn, 0, true, 7);
        arm(&env.h, cq.uar, cq.cqn, 0, false, 7);
        arm(&env.h, cq.uar, cq.cqn, 0, true, 7);
        assert_eq!(env.h.dev.cq_info(cq.cqn).unwrap().armed, Some(false));
        env.h.dev.post_cqe(cq.cqn, plain(21)).unwrap();
        assert_eq!(completions(&env.h, cq.cqn), 5);
    }

    #[test]
    fn bad_cq_doorbells_are_refused() {
        let mut env = env();
        let cq = create(&mut env, SMALL);
        let uar2 = env.h.alloc_uar();
        let why = |h: &Harness| match h.dev.events().last() {
            Some(SimEvent::BadCqDoorbell { why, .. }) => *why,
            other => panic!("expected a refused CQ doorbell, got {other:?}"),
        };
        arm(&env.h, uar2, cq.cqn, 0, false, 0);
        assert_eq!(why(&env.h), "CQ uses another UAR page");
        arm(&env.h, uar2 + 5, cq.cqn, 0, false, 0);
        assert_eq!(why(&env.h), "UAR page not allocated");
        arm(&env.h, cq.uar, cq.cqn + 1, 0, false, 0);
        assert_eq!(why(&env.h), "no such CQ");
        arm(&env.h, cq.uar, cq.cqn, 0, false, 1);
        assert_eq!(why(&env.h), "consumer index beyond producer index");
        let db = SimMmio::uar_offset(cq.uar) + CQ_DB;
        env.h.mmio.write64(db, u64::from(2u32 << 24) << 32 | u64::from(cq.cqn));
        assert_eq!(why(&env.h), "unknown arm command");
        // Half a doorbell, either half, is not a doorbell.
        env.h.mmio.write32(db, 0);
        assert_eq!(
            env.h.dev.events().last(),
            Some(&SimEvent::BadCqDoorbell { off: db, val: 0, why: "half a CQ doorbell" })
        );
        env.h.mmio.write32(db + 4, cq.cqn);
        assert_eq!(why(&env.h), "half a CQ doorbell");
        assert_eq!(env.h.dev.cq_info(cq.cqn).unwrap().armed, None);
        assert!(!env.h.dev.events().iter().any(|e| matches!(e, SimEvent::CqDoorbell { .. })));
        // A 64-bit write at a BlueFlame buffer is a send doorbell, seen whole: this one names no QP.
        let bf = SimMmio::uar_offset(cq.uar) + consts::MLX5_BF_OFFSET as usize;
        env.h.mmio.write64(bf, 0x1122_3344_5566_7788);
        let refused = SimEvent::BadSqDoorbell { off: bf, val: 0x1122_3344_5566_7788, why: "no such QP" };
        assert_eq!(env.h.dev.events().last(), Some(&refused));
        // Other 64-bit UAR writes are one access too; one straddling the CQ doorbell is half a doorbell.
        let other = SimMmio::uar_offset(cq.uar) + 0x100;
        env.h.mmio.write64(other, 0x1122_3344_5566_7788);
        assert_eq!(env.h.dev.events().last(), Some(&SimEvent::UarWrite64 { off: other, val: 0x1122_3344_5566_7788 }));
        env.h.mmio.write64(db - 4, 7);
        assert_eq!(why(&env.h), "half a CQ doorbell");
        assert_eq!(env.h.dev.cq_info(cq.cqn).unwrap().armed, None);
    }

    #[test]
    fn post_cqe_errors() {
        let mut env = env();
        let cq = create(&mut env, SMALL);
        assert_eq!(env.h.dev.post_cqe(cq.cqn + 7, plain(0)), Err(PostCqeError::UnknownCq));
        // A doorbell record the driver freed: the CQ fails with an access violation.
        let dbr = cq.dbr;
        let dbr_iova = dbr.iova();
        // SAFETY: the region came from this allocator; the device faults on it rather than touching freed memory.
        unsafe { env.h.dma.free(dbr) };
        assert!(
            matches!(env.h.dev.post_cqe(cq.cqn, plain(0)), Err(PostCqeError::DmaFault(DmaFault { iova, .. })) if iova == dbr_iova)
        );
        let status = consts::MLX5_CQC_STATUS_CQ_WRITE_FAIL;
        assert_eq!(env.h.dev.cq_info(cq.cqn).unwrap().status, status);
        assert!(env.h.dev.events().contains(&SimEvent::CqWriteFail { cqn: cq.cqn }));
        let e = Harness::eqe(&env.err_buf, 0);
        let synd = e[c::mlx5_eqe::DATA.off + c::mlx5_eqe_cq_err::SYNDROME.off];
        assert_eq!(synd, consts::MLX5_CQ_ERROR_SYNDROME_CQ_ACCESS_VIOLATION_ERROR);
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(1)), Err(PostCqeError::CqInError { status }));
        env.h.dev.stall_health();
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(2)), Err(PostCqeError::Dead));
    }

    fn query(h: &mut Harness, cqn: u32, npas: usize) -> (u8, u32, Vec<u8>) {
        let mut inp = vec![0u8; ifc::query_cq_in::SIZE_BYTES];
        inp.set(ifc::query_cq_in::OPCODE, consts::MLX5_CMD_OP_QUERY_CQ.into());
        inp.set(ifc::query_cq_in::CQN, cqn);
        h.cmd(&inp, ifc::query_cq_out::PAS.byte_off() + 8 * npas)
    }

    #[test]
    fn a_padded_128_byte_cq_writes_the_cqe_in_the_second_half_and_reads_back_padded() {
        use ifc::cqc as q;
        let mut env = env();
        let spec = Spec { log_size: 2, cqe_128: true, log_page: 0, scattered: false, oi: false };
        let buf = Buf::alloc(&env.h, spec.log_size, 128, spec.log_page, false);
        let dbr = env.h.dma.alloc(64, 64).unwrap();
        let mut inp = create_cq_in(&env, spec, &buf, &dbr);
        let ctx = ifc::create_cq_in::CQ_CONTEXT;
        // A size code no ConnectX has is refused; padded 128 bytes is accepted (`cqe_128_always`).
        inp.set(q::CQE_SZ.at(ctx), 3);
        assert_eq!(env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES).1, syndrome::CQE_SIZE);
        inp.set(q::CQE_SZ.at(ctx), consts::CQE_STRIDE_128_PAD);
        let (s, syn, out) = env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0));
        let cq = TestCq { cqn: rd(&out, ifc::create_cq_out::CQN), buf, dbr, uar: env.uar };
        env.h.dev.post_cqe(cq.cqn, plain(7)).unwrap();
        let e = cq.buf.cqe(0);
        assert_eq!(e[WQE_COUNTER.off..WQE_COUNTER.end()], 7u16.to_be_bytes());
        // The first half of the entry (the padding) is left as the driver wrote it.
        let mut pad = [0xffu8; 64];
        get_view(cq.buf.regions[0].view(), 0, &mut pad);
        assert_eq!(pad, [0u8; 64]);
        let (s, syn, out) = query(&mut env.h, cq.cqn, cq.buf.pages.len());
        assert_eq!((s, syn), (0, 0));
        assert_eq!(rd(&out, q::CQE_SZ.at(ifc::query_cq_out::CQ_CONTEXT)), consts::CQE_STRIDE_128_PAD);
    }

    #[test]
    fn cqe_compression_is_checked_against_the_caps_and_the_cq_still_writes_plain_cqes() {
        use ifc::cqc as q;
        let ctx = ifc::create_cq_in::CQ_CONTEXT;
        let mut env = env();
        let spec = Spec { log_size: 2, cqe_128: false, log_page: 0, scattered: false, oi: false };
        let buf = Buf::alloc(&env.h, spec.log_size, 64, spec.log_page, false);
        let dbr = env.h.dma.alloc(64, 64).unwrap();
        let mut inp = create_cq_in(&env, spec, &buf, &dbr);
        inp.set(q::CQE_COMP_EN.at(ctx), 1);
        // Format 2 is none the PRM defines; an enhanced layout needs `enhanced_cqe_compression` (not offered).
        for (fmt, layout) in [(2, 0), (0, consts::MLX5_CQE_COMPRESS_LAYOUT_ENHANCED), (0, 3)] {
            inp.set(q::MINI_CQE_RES_FORMAT.at(ctx), fmt);
            inp.set(q::CQE_COMPRESSION_LAYOUT.at(ctx), layout);
            assert_eq!(env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES).1, syndrome::CQE_COMPRESSION);
        }
        inp.set(q::CQE_COMPRESSION_LAYOUT.at(ctx), 0);
        for fmt in [0, consts::MLX5_CQE_FORMAT_CSUM, consts::MLX5_CQE_FORMAT_CSUM_STRIDX] {
            inp.set(q::MINI_CQE_RES_FORMAT.at(ctx), fmt);
            let (s, syn, out) = env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES);
            assert_eq!((s, syn), (0, 0), "format {fmt}");
            let cqn = rd(&out, ifc::create_cq_out::CQN);
            // Compression is the device's option: every CQE arrives whole, with its own opcode.
            let mark = 9 + fmt as u16;
            env.h.dev.post_cqe(cqn, plain(mark)).unwrap();
            let e = buf.cqe(0);
            assert_eq!(marker(&e), mark);
            assert_ne!((e[OP_OWN] >> 2) & 3, consts::MLX5_COMPRESSED);
            let mut d = vec![0u8; ifc::destroy_cq_in::SIZE_BYTES];
            d.set(ifc::destroy_cq_in::OPCODE, consts::MLX5_CMD_OP_DESTROY_CQ.into());
            d.set(ifc::destroy_cq_in::CQN, cqn);
            assert_eq!(env.h.cmd(&d, ifc::destroy_cq_out::SIZE_BYTES).0, 0);
        }
        // Without the cap for its CQE size the request is refused.
        lock(&env.h.dev.shared).fw.caps.force_gen(ifc::cmd_hca_cap::CQE_COMPRESSION, 0);
        inp.set(q::MINI_CQE_RES_FORMAT.at(ctx), 0);
        assert_eq!(env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES).1, syndrome::CQE_COMPRESSION);
    }

    #[test]
    fn a_cq_on_a_umem_is_refused_not_read_as_a_pas_cq() {
        let env = &mut env();
        let buf = Buf::alloc(&env.h, SMALL.log_size, 64, 0, false);
        let dbr = env.h.dma.alloc(64, 64).unwrap();
        for f in [ifc::create_cq_in::CQ_UMEM_VALID, ifc::cqc::DBR_UMEM_VALID.at(ifc::create_cq_in::CQ_CONTEXT)] {
            let mut inp = create_cq_in(env, SMALL, &buf, &dbr);
            inp.set(f, 1);
            let (s, syn, _) = env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES);
            assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::CQ_UMEM));
        }
        assert_eq!(env.h.dev.object_counts().3, 0);
    }

    #[test]
    fn query_cq_round_trip() {
        use ifc::cqc as q;
        let mut env = env();
        let spec = Spec { log_size: 7, cqe_128: true, log_page: 1, scattered: true, oi: true };
        let buf = Buf::alloc(&env.h, spec.log_size, 128, spec.log_page, true);
        let dbr = env.h.dma.alloc(64, 64).unwrap();
        let mut inp = create_cq_in(&env, spec, &buf, &dbr);
        let ctx = ifc::create_cq_in::CQ_CONTEXT;
        inp.set(q::CQ_PERIOD.at(ctx), 16);
        inp.set(q::CQ_MAX_COUNT.at(ctx), 32);
        let (s, _, out) = env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES);
        assert_eq!(s, 0);
        let cq = TestCq { cqn: rd(&out, ifc::create_cq_out::CQN), buf, dbr, uar: env.uar };
        for n in 0..5 {
            env.h.dev.post_cqe(cq.cqn, cqe(consts::MLX5_CQE_RESP_SEND, n == 3, n)).unwrap();
        }
        cq.set_ci(2);
        arm(&env.h, cq.uar, cq.cqn, 1, true, 4);
        let (s, syn, out) = query(&mut env.h, cq.cqn, cq.buf.pages.len());
        assert_eq!((s, syn), (0, 0));
        let ctx = ifc::query_cq_out::CQ_CONTEXT;
        let got = |f: Field| rd(&out, f.at(ctx));
        assert_eq!(got(q::STATUS), consts::MLX5_CQC_STATUS_OK.into());
        assert_eq!((got(q::CQE_SZ), got(q::OI), got(q::LOG_CQ_SIZE)), (consts::CQE_STRIDE_128, 1, 7));
        assert_eq!((got(q::UAR_PAGE), got(q::C_EQN_OR_APU_ELEMENT)), (env.uar, u32::from(env.comp)));
        assert_eq!((got(q::LOG_PAGE_SIZE), got(q::CQ_PERIOD), got(q::CQ_MAX_COUNT)), (1, 16, 32));
        assert_eq!((got(q::PRODUCER_COUNTER), got(q::CONSUMER_COUNTER)), (5, 2));
        assert_eq!(
            (got(q::LAST_SOLICIT_INDEX), got(q::ST)),
            (3, consts::MLX5_CQC_ST_SOLICITED_NOTIFICATION_REQUEST_ARMED)
        );
        assert_eq!(out.get64(q::DBR_ADDR.at(ctx)), cq.dbr.iova());
        let pas: Vec<u64> = (0..cq.buf.pages.len()).map(|k| out.get64(ifc::query_cq_out::PAS.elem(k as u32))).collect();
        assert_eq!(pas, cq.buf.iovas());
        // Linux's bare query (no room for pas[]) works too.
        let (s, _, out) = query(&mut env.h, cq.cqn, 0);
        assert_eq!((s, rd(&out, q::PRODUCER_COUNTER.at(ctx))), (0, 5));
        assert_eq!(query(&mut env.h, cq.cqn + 1, 0).0, consts::MLX5_CMD_STAT_BAD_PARAM_ERR);
        assert_eq!(query(&mut env.h, cq.cqn + 1, 0).1, syndrome::CQ_INVALID);
    }

    fn modify_in(cqn: u32, op_mod: u16, select: u32, npas: usize) -> Vec<u8> {
        use ifc::modify_cq_in as i;
        let mut inp = vec![0u8; i::PAS.byte_off() + 8 * npas];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_MODIFY_CQ.into());
        inp.set(i::OP_MOD, op_mod.into());
        inp.set(i::CQN, cqn);
        let sel = ifc::modify_field_select_resize_field_select_auto::MODIFY_FIELD_SELECT
            .at(i::MODIFY_FIELD_SELECT_RESIZE_FIELD_SELECT);
        inp.set(ifc::modify_field_select::MODIFY_FIELD_SELECT.at(sel), select);
        inp
    }

    #[test]
    fn modify_cq_moderation() {
        use ifc::cqc as q;
        let mut env = env();
        let cq = create(&mut env, SMALL);
        let ctx = ifc::modify_cq_in::CQ_CONTEXT;
        let mut inp = modify_in(cq.cqn, OPMOD_MODIFY, consts::MLX5_CQ_MODIFY_PERIOD | consts::MLX5_CQ_MODIFY_COUNT, 0);
        inp.set(q::CQ_PERIOD.at(ctx), 100);
        inp.set(q::CQ_MAX_COUNT.at(ctx), 64);
        assert_eq!(env.h.cmd(&inp, 16).0, 0);
        let info = env.h.dev.cq_info(cq.cqn).unwrap();
        assert_eq!((info.cq_period, info.cq_max_count), (100, 64));
        // Only the selected field changes.
        inp.set(
            ifc::modify_field_select::MODIFY_FIELD_SELECT
                .at(ifc::modify_cq_in::MODIFY_FIELD_SELECT_RESIZE_FIELD_SELECT),
            consts::MLX5_CQ_MODIFY_COUNT,
        );
        inp.set(q::CQ_PERIOD.at(ctx), 1);
        inp.set(q::CQ_MAX_COUNT.at(ctx), 8);
        assert_eq!(env.h.cmd(&inp, 16).0, 0);
        let info = env.h.dev.cq_info(cq.cqn).unwrap();
        assert_eq!((info.cq_period, info.cq_max_count), (100, 8));
        let bad = modify_in(cq.cqn, OPMOD_MODIFY, 0x100, 0);
        assert_eq!(env.h.cmd(&bad, 16).1, syndrome::FIELD_SELECT);
        let unknown = modify_in(cq.cqn + 1, OPMOD_MODIFY, consts::MLX5_CQ_MODIFY_PERIOD, 0);
        assert_eq!(env.h.cmd(&unknown, 16).1, syndrome::CQ_INVALID);
        lock(&env.h.dev.shared).fw.caps.force_gen(ifc::cmd_hca_cap::CQ_MODERATION, 0);
        assert_eq!(env.h.cmd(&inp, 16).1, syndrome::CAP_NOT_SET);
    }

    /// A MODIFY_CQ(resize) input for a new buffer of `2^log_size` 64-byte CQEs.
    fn resize_in(cq: &TestCq, log_size: u32, buf: &Buf) -> Vec<u8> {
        use ifc::cqc as q;
        let sel = consts::MLX5_MODIFY_CQ_MASK_LOG_SIZE
            | consts::MLX5_MODIFY_CQ_MASK_PG_OFFSET
            | consts::MLX5_MODIFY_CQ_MASK_PG_SIZE;
        let pas = buf.iovas();
        let mut inp = modify_in(cq.cqn, consts::MLX5_CQ_OPMOD_RESIZE, sel, pas.len());
        let ctx = ifc::modify_cq_in::CQ_CONTEXT;
        inp.set(q::LOG_CQ_SIZE.at(ctx), log_size);
        inp.set(q::LOG_PAGE_SIZE.at(ctx), (buf.page_bytes / 4096).trailing_zeros());
        inp.set(q::CQE_SZ.at(ctx), consts::CQE_STRIDE_64);
        for (k, pa) in pas.iter().enumerate() {
            inp.set64(ifc::modify_cq_in::PAS.elem(k as u32), *pa);
        }
        inp
    }

    #[test]
    fn modify_cq_resize_writes_the_resize_cqe_and_continues_one_further() {
        let mut env = env();
        let mut cq = create(&mut env, SMALL);
        // Six CQEs through four entries; the driver consumed three (CQEs 3, 4, 5 are pending, 3 solicited).
        for n in 0..6u16 {
            cq.set_ci(n.saturating_sub(2).into());
            env.h.dev.post_cqe(cq.cqn, cqe(consts::MLX5_CQE_REQ, n == 3, n)).unwrap();
        }
        cq.set_ci(3);
        // Too small: three pending CQEs do not fit in two entries.
        let small = Buf::alloc(&env.h, 1, 64, 0, true);
        let (s, syn, _) = env.h.cmd(&resize_in(&cq, 1, &small), 16);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::CQ_TOO_SMALL));
        let huge = resize_in(&cq, 23, &small);
        assert_eq!(env.h.cmd(&huge, 16).1, syndrome::LOG_SIZE);
        let mut no_log = resize_in(&cq, 3, &small);
        let sel = ifc::resize_field_select::RESIZE_FIELD_SELECT
            .at(ifc::modify_cq_in::MODIFY_FIELD_SELECT_RESIZE_FIELD_SELECT);
        no_log.set(sel, consts::MLX5_MODIFY_CQ_MASK_PG_SIZE);
        assert_eq!(env.h.cmd(&no_log, 16).1, syndrome::FIELD_SELECT);
        // The failed attempts changed nothing.
        assert_eq!(env.h.dev.cq_info(cq.cqn).unwrap().pi, 6);

        let new = Buf::alloc(&env.h, 3, 64, 0, true);
        assert_eq!(env.h.cmd(&resize_in(&cq, 3, &new), 16).0, 0);
        // The resize CQE sits at old index 6 & 3 = 2, with the second pass's owner bit.
        let r = cq.cqe(6);
        assert_eq!((opcode(&r), owner(&r)), (consts::MLX5_CQE_RESIZE_CQ, 1));
        let info = env.h.dev.cq_info(cq.cqn).unwrap();
        assert_eq!((info.pi, info.nent, info.npas), (7, 8, new.pages.len()));
        assert_eq!(completions(&env.h, cq.cqn), 0, "the resize CQE raises no event");
        cq.buf = new;
        // The driver copies CQEs 3..5 to 4..6 of the new buffer and continues at 4; the device writes CQE 7.
        cq.set_ci(4);
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(7)), Ok(7));
        let e = cq.cqe(7);
        assert_eq!((marker(&e), owner(&e)), (7, 0));
        assert_eq!(cq.buf.cqe(0)[OP_OWN], INVALID_OP_OWN);
        // The solicited CQE (old 3) moved to 4, the next to consume: a solicited arm fires at once.
        arm(&env.h, cq.uar, cq.cqn, 0, true, 4);
        assert_eq!(completions(&env.h, cq.cqn), 1);
        // Wrapping the new size: CQE 8 is the second pass at index 0.
        cq.set_ci(8);
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(8)), Ok(8));
        assert_eq!((marker(&cq.cqe(8)), owner(&cq.cqe(8))), (8, 1));
        lock(&env.h.dev.shared).fw.caps.force_gen(ifc::cmd_hca_cap::CQ_RESIZE, 0);
        let again = Buf::alloc(&env.h, 4, 64, 0, false);
        assert_eq!(env.h.cmd(&resize_in(&cq, 4, &again), 16).1, syndrome::CAP_NOT_SET);
    }

    #[test]
    fn resize_takes_the_cqe_size_from_the_context() {
        let mut env = env();
        let mut cq = create(&mut env, Spec { cqe_128: true, ..SMALL });
        env.h.dev.post_cqe(cq.cqn, plain(0)).unwrap();
        cq.set_ci(1);
        // `resize_in` asks for 64-byte CQEs, as `mlx5_ib_resize_cq` does for a kernel CQ.
        let new = Buf::alloc(&env.h, 3, 64, 0, false);
        assert_eq!(env.h.cmd(&resize_in(&cq, 3, &new), 16).0, 0);
        // The resize CQE is in the old 128-byte layout (second half of entry 1), the rest in the new one.
        assert_eq!((opcode(&cq.cqe(1)), owner(&cq.cqe(1))), (consts::MLX5_CQE_RESIZE_CQ, 0));
        assert_eq!(env.h.dev.cq_info(cq.cqn).unwrap().cqe_size, 64);
        cq.buf = new;
        cq.set_ci(2);
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(2)), Ok(2));
        assert_eq!((marker(&cq.cqe(2)), owner(&cq.cqe(2))), (2, 0));
        assert!(env.h.dev.dma_faults().is_empty());
    }

    #[test]
    fn resize_of_a_full_cq_or_a_cq_in_error_is_refused() {
        let mut env = env();
        let cq = create(&mut env, SMALL);
        for n in 0..4 {
            env.h.dev.post_cqe(cq.cqn, plain(n)).unwrap();
        }
        let new = Buf::alloc(&env.h, 4, 64, 0, false);
        let (s, syn, _) = env.h.cmd(&resize_in(&cq, 4, &new), 16);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR, syndrome::CQ_FULL));
        assert_eq!(env.h.dev.post_cqe(cq.cqn, plain(4)), Err(PostCqeError::Overrun));
        let (s, syn, _) = env.h.cmd(&resize_in(&cq, 4, &new), 16);
        assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR, syndrome::CQ_IN_ERROR));
    }

    #[test]
    fn config_limits_cq_size_and_contiguous_dma() {
        let cfg = SimConfig { log_max_cq_sz: 10, dma_max_contig: Some(64 << 10), ..SimConfig::default() };
        let mut env = env_with(cfg);
        assert_eq!(env.h.dma.alloc((64 << 10) + 1, 4096), Err(DmaError::NoMemory { len: (64 << 10) + 1 }));
        let ok = env.h.dma.alloc(64 << 10, 4096).unwrap();
        // The largest CQ fits in 64 KiB of scattered pages; one entry more is refused.
        let cq = create(&mut env, Spec { log_size: 10, scattered: true, ..SMALL });
        assert_eq!(env.h.dev.cq_info(cq.cqn).unwrap().nent, 1024);
        let buf = Buf::alloc(&env.h, 10, 64, 0, true);
        let inp = create_cq_in(&env, Spec { log_size: 11, ..SMALL }, &buf, &cq.dbr);
        assert_eq!(env.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES).1, syndrome::LOG_SIZE);
        // SAFETY: the region came from this allocator and the device was never told about it.
        unsafe { env.h.dma.free(ok) };
    }
}
