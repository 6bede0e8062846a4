//! Firmware side: `fw/eq.rs` (EQ doorbell), `fw/cq.rs` (CQ arm), `fw/qp.rs` (send doorbell).
//!
//! The UAR pages of the BAR, decoded in one place: every write the driver makes into a UAR page (`mlx5_uar`,
//! after the initialization segment) is interpreted here, as the device's doorbell logic does: the EQ doorbell
//! (32-bit, `MLX5_EQ_DOORBELL_OFFSET`), the CQ arm doorbell (64-bit, `MLX5_CQ_DOORBELL`), and the BlueFlame
//! registers (`MLX5_BF_OFFSET`): the SQ doorbell at offset 0 of a buffer and the BlueFlame copy after it.
//!
//! A doorbell travels one way: `mmio.rs` (`SimMmio::write32` / `write64`, the BAR) calls
//! [`UarDecoder::uar_write32`] or [`UarDecoder::uar_write64`] here (the device builds the decoder over its
//! [`Datapath`] view), which update the EQ or CQ object (module `fw`) or, for
//! an accepted SQ doorbell, record the new producer counter and tell the caller the datapath has work; the
//! caller then runs `transport` (through `Shared::run`, in line or on the device thread).
//!
//! # Doorbells
//! A 64-bit write at offset 0 of a BlueFlame buffer (UAR + `MLX5_BF_OFFSET` + `n * bf_reg_size`, either half of
//! the register) is the send doorbell: its value is the first 8 bytes of the last WQE's control segment. The
//! device reads the SQ producer counter from the doorbell record (`MLX5_SND_DBR`) and will execute up to it.
//! Further 64-bit writes into the same buffer are a BlueFlame copy of that WQE: each is checked against the WQE
//! in memory (a mismatch is [`SimEvent::BlueFlameMismatch`](crate::events::SimEvent::BlueFlameMismatch)); the WQE executed is always the one in memory. The
//! RQ has no doorbell: its head is read from `MLX5_RCV_DBR` whenever a receive WQE is needed.
//!

use mlx5_core::prm::{c, consts, ifc, Bytes};

use crate::events::SimEvent;
use crate::fw::cq::{Arm, CTR_MASK};
use crate::fw::qp::{QpState, SEND_WQE_BB};
use crate::regs::PAGE;
use crate::transport::Datapath;

/// Offset in a UAR page of the EQ doorbell that updates the consumer index and arms.
pub(crate) const EQ_DB_ARM: usize = consts::MLX5_EQ_DOORBELL_OFFSET as usize;
/// Offset of the doorbell that only updates the consumer index: two dwords further (`eq_update_ci`, lib/eq.h:
/// `eq->doorbell + (arm ? 0 : 2)` on a `__be32 *`).
const EQ_DB_NOARM: usize = EQ_DB_ARM + 2 * 4;
/// The EQ doorbell value carries the consumer index in bits 23:0 and the EQ number in bits 31:24
/// (`eq_update_ci`).
const DB_CI_MASK: u32 = 0xff_ffff;
const DB_EQN_SHIFT: u32 = 24;
/// Offset in a UAR page of the CQ doorbell (one 64-bit write).
const CQ_DB: usize = consts::MLX5_CQ_DOORBELL as usize;
/// The arm command of a CQ doorbell: bits 27:24 of its first dword (`MLX5_CQ_DB_REQ_NOT*`).
const DB_CMD_MASK: u32 = 0xf << 24;
/// The arm sequence number: bits 29:28 (`mlx5_cq_arm`: `sn << 28`, `sn = arm_sn & 3`).
const DB_SN_SHIFT: u32 = 28;
const DB_SN_MASK: u32 = 3;
/// The BlueFlame registers start here in a UAR page.
const BF_OFFSET: usize = consts::MLX5_BF_OFFSET as usize;
const BFREGS_PER_UAR: usize = consts::MLX5_BFREGS_PER_UAR as usize;
const QPN_SHIFT: u32 = consts::MLX5_WQE_CTRL_QPN_SHIFT;
const IDX_SHIFT: u32 = consts::MLX5_WQE_CTRL_WQE_INDEX_SHIFT;
/// The send counter's offset in a QP's doorbell record.
const SND_DBR: u64 = consts::MLX5_SND_DBR as u64 * 4;
const CTR16: u32 = 0xffff;
const BB: u64 = SEND_WQE_BB;

/// Whether a UAR offset is one of the two 32-bit EQ doorbell registers.
fn is_eq_doorbell(off: usize) -> bool {
    matches!(off % PAGE, EQ_DB_ARM | EQ_DB_NOARM)
}

/// A big-endian field of a doorbell's bytes.
fn be(m: Bytes, b: &[u8], base: usize) -> u32 {
    m.get_be(b, base)
}

/// The UAR decoder: doorbell writes interpreted against the datapath's view of the device (the EQ, CQ and QP
/// tables it updates, DMA for doorbell records and WQEs, the event log).
pub(crate) struct UarDecoder<'a>(pub(crate) Datapath<'a>);

impl UarDecoder<'_> {
    /// A 32-bit write into a UAR page: the EQ doorbells are interpreted, half a CQ doorbell is refused, anything
    /// else is recorded.
    pub(crate) fn uar_write32(&mut self, off: usize, val: u32) {
        let arm = match off % PAGE {
            EQ_DB_ARM => true,
            EQ_DB_NOARM => false,
            o if o == CQ_DB || o == CQ_DB + 4 => {
                // The CQ doorbell is one 64-bit access; a 32-bit half could pair with a stale other half.
                self.0.events.push(SimEvent::BadCqDoorbell { off, val: val.into(), why: "half a CQ doorbell" });
                return;
            }
            _ => {
                self.0.events.push(SimEvent::UarWrite { off, val });
                return;
            }
        };
        let bad = |why| SimEvent::BadEqDoorbell { off, val, why };
        let uar = u32::try_from(off / PAGE).unwrap_or(u32::MAX);
        let eqn = val >> DB_EQN_SHIFT;
        let ci24 = val & DB_CI_MASK;
        if !self.0.fw.uars.contains(uar) {
            self.0.events.push(bad("UAR page not allocated"));
            return;
        }
        let dead = self.0.dead();
        let Some(eq) = self.0.fw.eqs.get_mut(&eqn) else {
            self.0.events.push(bad("no such EQ"));
            return;
        };
        if eq.uar != uar {
            self.0.events.push(bad("EQ uses another UAR page"));
            return;
        }
        // The doorbell carries 24 bits of the consumer index: advance by the 24-bit distance, which must not
        // pass the producer index.
        let step = ci24.wrapping_sub(eq.ci) & DB_CI_MASK;
        if step > eq.pi.wrapping_sub(eq.ci) {
            self.0.events.push(bad("consumer index beyond producer index"));
            return;
        }
        eq.ci = eq.ci.wrapping_add(step);
        let eqn8 = eqn as u8;
        self.0.events.push(SimEvent::EqDoorbell { eqn: eqn8, ci: eq.ci, arm });
        if arm {
            if eq.ci != eq.pi && !dead {
                // EQEs are already waiting: the interrupt fires at once.
                eq.interrupts += 1;
                eq.armed = false;
                self.0.events.push(SimEvent::EqInterrupt { eqn: eqn8 });
            } else {
                eq.armed = true;
            }
        }
    }

    /// A 64-bit write into a UAR page, seen as one access: the CQ doorbell, or a BlueFlame register (send
    /// doorbell or BlueFlame copy). A 64-bit write straddling the CQ doorbell, or covering an EQ doorbell (a
    /// 32-bit register), is refused; any other is recorded as one [`SimEvent::UarWrite64`]. Returns whether the
    /// datapath has new work.
    pub(crate) fn uar_write64(&mut self, off: usize, v: u64) -> bool {
        if off % PAGE == CQ_DB {
            self.cq_doorbell(off, v);
            return false;
        }
        if let Some(kick) = self.blueflame_write(off, v) {
            return kick;
        }
        for (at, half) in [(off, (v >> 32) as u32), (off + 4, v as u32)] {
            if at % PAGE == CQ_DB || at % PAGE == CQ_DB + 4 {
                self.0.events.push(SimEvent::BadCqDoorbell { off: at, val: v, why: "half a CQ doorbell" });
                return false;
            }
            if is_eq_doorbell(at) {
                let why = "64-bit write to a 32-bit EQ doorbell";
                self.0.events.push(SimEvent::BadEqDoorbell { off: at, val: half, why });
                return false;
            }
        }
        self.0.events.push(SimEvent::UarWrite64 { off, val: v });
        false
    }

    /// The CQ doorbell: `v` = `(sn << 28 | cmd | ci) << 32 | cqn` (`mlx5_cq_arm`).
    fn cq_doorbell(&mut self, off: usize, v: u64) {
        let bad = |why| SimEvent::BadCqDoorbell { off, val: v, why };
        let (word, cqn) = ((v >> 32) as u32, v as u32);
        let uar = u32::try_from(off / PAGE).unwrap_or(u32::MAX);
        if !self.0.fw.uars.contains(uar) {
            self.0.events.push(bad("UAR page not allocated"));
            return;
        }
        let dead = self.0.dead();
        let Some(cq) = self.0.fw.cqs.get_mut(&cqn) else {
            self.0.events.push(bad("no such CQ"));
            return;
        };
        if cq.uar != uar {
            self.0.events.push(bad("CQ uses another UAR page"));
            return;
        }
        let solicited = match word & DB_CMD_MASK {
            consts::MLX5_CQ_DB_REQ_NOT => false,
            consts::MLX5_CQ_DB_REQ_NOT_SOL => true,
            _ => {
                self.0.events.push(bad("unknown arm command"));
                return;
            }
        };
        let ci = word & CTR_MASK;
        if !cq.oi && cq.unconsumed(ci) > cq.nent() {
            self.0.events.push(bad("consumer index beyond producer index"));
            return;
        }
        let sn = ((word >> DB_SN_SHIFT) & DB_SN_MASK) as u8;
        cq.arm_sn = sn;
        // A request for the next CQE already covers a solicited one.
        cq.arm = if solicited && cq.arm != Arm::Next { Arm::Solicited } else { Arm::Next };
        self.0.events.push(SimEvent::CqDoorbell { cqn, sn, solicited, ci });
        let waiting = match cq.arm {
            Arm::Next => cq.unconsumed(ci) > 0,
            _ => cq.solicited_unconsumed(ci),
        };
        if waiting && cq.status == consts::MLX5_CQC_STATUS_OK && !dead {
            // Matching CQEs are already there: the event fires at once.
            self.0.cqs().fire_completion(cqn);
        }
    }

    /// A 64-bit write into a UAR page: `None` when it is not in a BlueFlame register; otherwise whether the
    /// datapath has new work (a send doorbell was accepted).
    pub(crate) fn blueflame_write(&mut self, off: usize, v: u64) -> Option<bool> {
        let in_page = off % PAGE;
        let reg = 1usize << self.0.fw.caps.gen(ifc::cmd_hca_cap::LOG_BF_REG_SIZE).clamp(1, 10);
        let end = (BF_OFFSET + BFREGS_PER_UAR * reg).min(PAGE);
        if !(BF_OFFSET..end).contains(&in_page) {
            return None;
        }
        // Each register is two buffers of half its size that the driver alternates between.
        let half = reg / 2;
        let (buf, inner) = ((in_page - BF_OFFSET) / half, (in_page - BF_OFFSET) % half);
        let uar = u32::try_from(off / PAGE).unwrap_or(u32::MAX);
        if self.0.dead() {
            return Some(false);
        }
        if inner % 8 != 0 {
            self.0.events.push(SimEvent::BadSqDoorbell { off, val: v, why: "unaligned BlueFlame write" });
            return Some(false);
        }
        if inner == 0 {
            return Some(self.sq_doorbell(off, uar, buf, v));
        }
        self.blueflame_copy(off, uar, buf, inner, v);
        Some(false)
    }

    /// The send doorbell: `v.to_be_bytes()` = `opmod_idx_opcode`, `qpn_ds` of the last WQE posted.
    fn sq_doorbell(&mut self, off: usize, uar: u32, buf: usize, v: u64) -> bool {
        use c::mlx5_wqe_ctrl_seg as cs;
        let bytes = v.to_be_bytes();
        let qpn = be(cs::QPN_DS, &bytes, 0) >> QPN_SHIFT;
        let wqe_index = (be(cs::OPMOD_IDX_OPCODE, &bytes, 0) >> IDX_SHIFT) as u16;
        let bad = |why| SimEvent::BadSqDoorbell { off, val: v, why };
        if !self.0.fw.uars.contains(uar) {
            self.0.events.push(bad("UAR page not allocated"));
            return false;
        }
        let Some(qp) = self.0.fw.qps.get(&qpn) else {
            // SQs and QPs share one number space: an Ethernet SQ's doorbell names its SQN.
            if self.0.fw.sqs.map.contains_key(&qpn) {
                return self.eth_sq_doorbell(off, uar, buf, v);
            }
            self.0.events.push(bad("no such QP"));
            return false;
        };
        let why = if qp.uar != uar {
            Some("QP uses another UAR page")
        } else if qp.sq_bbs() == 0 {
            Some("QP has no send queue")
        } else if qp.state == QpState::Rst {
            Some("QP in RST")
        } else {
            None
        };
        if let Some(why) = why {
            self.0.events.push(bad(why));
            return false;
        }
        let mut rec = [0u8; 4];
        if self.0.dma.read(qp.dbr + SND_DBR, &mut rec).is_err() {
            self.0.events.push(bad("doorbell record not mapped"));
            return false;
        }
        let pi = (u32::from_be_bytes(rec) & CTR16) as u16;
        if u32::from(pi.wrapping_sub(qp.sq_ci)) > qp.sq_bbs() {
            self.0.events.push(bad("producer counter beyond the send queue"));
            return false;
        }
        let mut mem = [0u8; 8];
        let same = qp.read_sq(self.0.dma, u64::from(wqe_index) * BB, &mut mem).is_ok() && mem == bytes;
        if let Some(qp) = self.0.fw.qps.get_mut(&qpn) {
            qp.sq_pi = pi;
        }
        // An idle QP left the datapath's walk: work posted brings it back.
        self.0.fw.qps.activate(qpn);
        self.0.events.push(SimEvent::SqDoorbell { qpn, pi });
        if !same {
            self.0.events.push(SimEvent::BlueFlameMismatch { qpn, wqe_index, off: 0 });
        }
        self.0.dp.bf.insert((uar, buf), (qpn, wqe_index));
        true
    }

    /// The send doorbell of an Ethernet SQ (`v` as for a QP): the producer counter from the doorbell record; the
    /// SQ joins the datapath's walk.
    fn eth_sq_doorbell(&mut self, off: usize, uar: u32, buf: usize, v: u64) -> bool {
        use c::mlx5_wqe_ctrl_seg as cs;
        let bytes = v.to_be_bytes();
        let sqn = be(cs::QPN_DS, &bytes, 0) >> QPN_SHIFT;
        let wqe_index = (be(cs::OPMOD_IDX_OPCODE, &bytes, 0) >> IDX_SHIFT) as u16;
        let bad = |why| SimEvent::BadSqDoorbell { off, val: v, why };
        let Some(sq) = self.0.fw.sqs.map.get(&sqn) else { return false };
        let why = if sq.wq.uar_page != uar {
            Some("SQ uses another UAR page")
        } else if sq.state != consts::MLX5_SQC_STATE_RDY {
            Some("SQ not ready")
        } else {
            None
        };
        if let Some(why) = why {
            self.0.events.push(bad(why));
            return false;
        }
        let mut rec = [0u8; 4];
        if self.0.dma.read(sq.wq.dbr_addr + SND_DBR, &mut rec).is_err() {
            self.0.events.push(bad("doorbell record not mapped"));
            return false;
        }
        let pi = (u32::from_be_bytes(rec) & CTR16) as u16;
        if u64::from(pi.wrapping_sub(sq.ci)) > sq.wq.bytes() / BB {
            self.0.events.push(bad("producer counter beyond the send queue"));
            return false;
        }
        let mut mem = [0u8; 8];
        let same = sq.wq.read(self.0.dma, u64::from(wqe_index) * BB % sq.wq.bytes(), &mut mem).is_ok() && mem == bytes;
        if let Some(sq) = self.0.fw.sqs.map.get_mut(&sqn) {
            sq.pi = pi;
        }
        self.0.dp.eth_sqs.insert(sqn);
        self.0.events.push(SimEvent::SqDoorbell { qpn: sqn, pi });
        if !same {
            self.0.events.push(SimEvent::BlueFlameMismatch { qpn: sqn, wqe_index, off: 0 });
        }
        self.0.dp.bf.insert((uar, buf), (sqn, wqe_index));
        true
    }

    /// A BlueFlame copy chunk at byte `inner` of buffer `buf`: checked against the WQE in memory.
    fn blueflame_copy(&mut self, off: usize, uar: u32, buf: usize, inner: usize, v: u64) {
        let Some(&(qpn, wqe_index)) = self.0.dp.bf.get(&(uar, buf)) else {
            self.0.events.push(SimEvent::BadSqDoorbell { off, val: v, why: "BlueFlame copy without a doorbell" });
            return;
        };
        let mut mem = [0u8; 8];
        let at = u64::from(wqe_index) * BB + inner as u64;
        let same = if let Some(qp) = self.0.fw.qps.get(&qpn) {
            qp.read_sq(self.0.dma, at, &mut mem).is_ok() && mem == v.to_be_bytes()
        } else if let Some(sq) = self.0.fw.sqs.map.get(&qpn) {
            sq.wq.read(self.0.dma, at % sq.wq.bytes(), &mut mem).is_ok() && mem == v.to_be_bytes()
        } else {
            self.0.events.push(SimEvent::BadSqDoorbell { off, val: v, why: "BlueFlame copy for a destroyed QP" });
            return;
        };
        let off16 = inner as u16;
        self.0.events.push(SimEvent::BlueFlameCopy { qpn, wqe_index, off: off16 });
        if !same {
            self.0.events.push(SimEvent::BlueFlameMismatch { qpn, wqe_index, off: off16 });
        }
    }
}
