//! Firmware side: `fw/cq.rs` (the CQ table and ring); EQEs through `fw/eq.rs`'s `EqPost`.
//!
//! CQE production: a CQE goes into its CQ's ring through the `pas[]` pages with the owner bit of its pass, after
//! the overrun check against the doorbell record's consumer index; an armed CQ then fires its completion EQE
//! (`mlx5_cq_completion` on the kernel side). The datapath's completions and [`crate::sim_device::SimDevice::post_cqe`] both
//! come here.
//!
//! A CQE is written through the checked DMA translation: its 64-byte `mlx5_cqe64` image without `op_own` first,
//! then, after a fence, `op_own`, so a driver that sees the new owner bit (and issues `dma_rmb`) reads a
//! complete entry.

use mlx5_core::prm::{c, consts};

use crate::dma::DmaFault;
use crate::events::SimEvent;
use crate::fw::cq::{Arm, PostCqeError, CQE64, OPCODE_SHIFT, OP_OWN, SOLICITED};
use crate::fw::eq::EQE_DATA_LEN;
use crate::wire::roce_map;

use super::common::*;
use super::srq::Srqs;
use crate::fw::caps::Caps;
use crate::fw::cq::CqTable;
use crate::fw::qp::QpTable;
use crate::fw::srq::SrqTable;

/// Whether a CQE satisfies a solicited-only arm: the solicited bit, or an error CQE.
fn is_solicited(op_own: u8) -> bool {
    let opcode = op_own >> OPCODE_SHIFT;
    op_own & SOLICITED != 0 || opcode == consts::MLX5_CQE_REQ_ERR || opcode == consts::MLX5_CQE_RESP_ERR
}

/// The event data of a CQ-error EQE (`struct mlx5_eqe_cq_err`).
fn cq_err_data(cqn: u32, synd: u8) -> [u8; EQE_DATA_LEN] {
    use c::mlx5_eqe_cq_err as e;
    let mut d = [0u8; EQE_DATA_LEN];
    d[e::CQN.off..e::CQN.end()].copy_from_slice(&cqn.to_be_bytes());
    d[e::SYNDROME.off] = synd;
    d
}

/// The event data of a completion EQE (`struct mlx5_eqe_comp`).
fn comp_data(cqn: u32) -> [u8; EQE_DATA_LEN] {
    let f = c::mlx5_eqe_comp::CQN;
    let mut d = [0u8; EQE_DATA_LEN];
    d[f.off..f.end()].copy_from_slice(&cqn.to_be_bytes());
    d
}

/// What writing a CQE borrows from the device: the CQ table, the capabilities (the device clock's frequency),
/// and what posting the completion or CQ-error EQE takes.
pub(crate) struct Cqs<'a> {
    pub(crate) cqs: &'a mut CqTable,
    pub(crate) caps: &'a Caps,
    pub(crate) eq: EqPost<'a>,
}

impl Cqs<'_> {
    /// Writes `cqe` as the next CQE of CQ `cqn` (the device lock is held): the overrun check, the owner bit,
    /// and the completion event of an armed CQ. Returns the CQE's counter value.
    pub(crate) fn post_cqe(&mut self, cqn: u32, cqe: &[u8; CQE64]) -> Result<u32, PostCqeError> {
        if self.eq.regs.dead() {
            return Err(PostCqeError::Dead);
        }
        let cq = self.cqs.get_mut(&cqn).ok_or(PostCqeError::UnknownCq)?;
        if cq.status != consts::MLX5_CQC_STATUS_OK {
            return Err(PostCqeError::CqInError { status: cq.status });
        }
        let ci = match cq.read_ci(self.eq.dma) {
            Ok(ci) => ci,
            Err(f) => return Err(self.cq_write_fail(cqn, f)),
        };
        if cq.unconsumed(ci) >= cq.nent() {
            cq.overruns += 1;
            if !cq.oi {
                // Hardware never overwrites an unconsumed CQE of a CQ without `oi`: the CQ goes to error.
                self.cq_overflow(cqn);
                return Err(PostCqeError::Overrun);
            }
        }
        let n = cq.pi;
        if let Err(f) = cq.write_cqe(self.eq.dma, n, cqe) {
            return Err(self.cq_write_fail(cqn, f));
        }
        cq.pi = n.wrapping_add(1);
        let solicited = is_solicited(cqe[OP_OWN]);
        if solicited {
            cq.last_solicited = Some(n);
        }
        let fire = match cq.arm {
            Arm::None => false,
            Arm::Next => true,
            Arm::Solicited => solicited,
        };
        if fire {
            // Moderation: the event waits for `max_count` such CQEs or the period since the last event.
            cq.held = cq.held.saturating_add(1);
            if !cq.moderation_met(self.eq.clock.now_ns()) {
                self.cqs.set_held(cqn, true);
                return Ok(n);
            }
        }
        if fire {
            self.fire_completion(cqn);
        }
        Ok(n)
    }

    /// Fires the held events whose moderation period has passed (the datapath's runs call this).
    pub(crate) fn moderation_due(&mut self) {
        if !self.cqs.any_held() {
            return;
        }
        for cqn in self.cqs.held_due(self.eq.clock.now_ns()) {
            self.fire_completion(cqn);
        }
    }

    /// CQ `cqn` enters overflow: its status says so and a CQ-error EQE reports the overrun (the CQ takes no
    /// more CQEs). Returns whether the CQ existed and was not in error already.
    pub(crate) fn cq_overflow(&mut self, cqn: u32) -> bool {
        let Some(cq) = self.cqs.get_mut(&cqn) else { return false };
        if cq.status != consts::MLX5_CQC_STATUS_OK {
            return false;
        }
        cq.status = consts::MLX5_CQC_STATUS_CQ_OVERFLOW;
        self.eq.events.push(SimEvent::CqOverrun { cqn });
        let synd = consts::MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN;
        self.eq.post_eqe(consts::MLX5_EVENT_TYPE_CQ_ERROR, 0, &cq_err_data(cqn, synd));
        true
    }

    /// The CQ could not reach its memory: it enters write-fail and a CQ-error EQE reports the access violation.
    fn cq_write_fail(&mut self, cqn: u32, fault: DmaFault) -> PostCqeError {
        if let Some(cq) = self.cqs.get_mut(&cqn) {
            cq.status = consts::MLX5_CQC_STATUS_CQ_WRITE_FAIL;
        }
        self.eq.events.push(SimEvent::CqWriteFail { cqn });
        let synd = consts::MLX5_CQ_ERROR_SYNDROME_CQ_ACCESS_VIOLATION_ERROR;
        self.eq.post_eqe(consts::MLX5_EVENT_TYPE_CQ_ERROR, 0, &cq_err_data(cqn, synd));
        PostCqeError::DmaFault(fault)
    }

    /// An armed CQ fires: a completion EQE on its own EQ, and the CQ is disarmed.
    pub(crate) fn fire_completion(&mut self, cqn: u32) {
        let now = self.eq.clock.now_ns();
        let Some(cq) = self.cqs.get_mut(&cqn) else { return };
        cq.arm = Arm::None;
        cq.last_notified = cq.pi.wrapping_sub(1);
        cq.held = 0;
        cq.last_event_ns = now;
        let eqn = cq.eqn;
        self.cqs.set_held(cqn, false);
        if self.eq.post_eqe_to(eqn, consts::MLX5_EVENT_TYPE_COMP, 0, &comp_data(cqn)).is_some() {
            if let Some(cq) = self.cqs.get_mut(&cqn) {
                cq.events_fired += 1;
            }
            self.eq.events.push(SimEvent::CompletionEvent { cqn, eqn: eqn as u8 });
        }
    }

    #[inline]
    pub(super) fn post(&mut self, cqn: u32, mut cqe: CqeOut) {
        cqe.timestamp = self.device_clock();
        // A CQ that cannot take the CQE reports it itself (overrun, write failure); the WQE is done either way.
        let _ = self.post_cqe(cqn, &cqe.image());
    }

    /// The free-running device clock: the virtual time in ticks of the `device_frequency_khz` the capabilities
    /// report (what a ConnectX stamps into its CQEs).
    pub(crate) fn device_clock(&self) -> u64 {
        let khz = u128::from(self.caps.gen(mlx5_core::prm::ifc::cmd_hca_cap::DEVICE_FREQUENCY_KHZ));
        (u128::from(self.eq.clock.now_ns()) * khz / 1_000_000) as u64
    }
}

/// A CQE to write.
#[derive(Debug, Default, Clone, Copy)]
pub(super) struct CqeOut {
    pub(super) opcode: u8,
    pub(super) solicited: bool,
    pub(super) wqe_opcode: u8,
    pub(super) qpn: u32,
    pub(super) wqe_counter: u16,
    pub(super) byte_cnt: u32,
    pub(super) imm: [u8; 4],
    pub(super) flags_rqpn: u32,
    pub(super) slid: u16,
    pub(super) syndrome: u8,
    /// `srqn_uidx`: the QP's `user_index` (`cqe_version` 1; rdma-core's mlx5 provider finds the QP, and the
    /// SRQ a receive took its WQE from, through it).
    pub(super) srqn: u32,
    /// The device clock in ticks of `device_frequency_khz` (`timestamp_h:timestamp_l`, every CQE).
    pub(super) timestamp: u64,
}

impl CqeOut {
    pub(super) fn image(&self) -> [u8; c::mlx5_cqe64::SIZE] {
        use c::mlx5_cqe64 as f;
        use c::mlx5_err_cqe as e;
        let mut b = [0u8; c::mlx5_cqe64::SIZE];
        let error = self.opcode == consts::MLX5_CQE_REQ_ERR || self.opcode == consts::MLX5_CQE_RESP_ERR;
        // `sop_drop_qpn` and the error CQE's `s_wqe_opcode_qpn` are the same dword.
        f::SOP_DROP_QPN.put_be(&mut b, 0, u32::from(self.wqe_opcode) << 24 | (self.qpn & QPN_MASK));
        f::WQE_COUNTER.put_be(&mut b, 0, self.wqe_counter.into());
        // The error CQE has `srqn` at the same place.
        f::SRQN.put_be(&mut b, 0, self.srqn & QPN_MASK);
        if error {
            b[e::SYNDROME.off] = self.syndrome;
            b[e::VENDOR_ERR_SYND.off] = VENDOR_ERR_BIT | self.syndrome;
        } else {
            f::BYTE_CNT.put_be(&mut b, 0, self.byte_cnt);
            b[f::IMMEDIATE.off..f::IMMEDIATE.end()].copy_from_slice(&self.imm);
            f::FLAGS_RQPN.put_be(&mut b, 0, self.flags_rqpn);
            f::SLID.put_be(&mut b, 0, self.slid.into());
            // An error CQE's syndromes sit where the timestamp is.
            f::TIMESTAMP_H.put_be(&mut b, 0, (self.timestamp >> 32) as u32);
            f::TIMESTAMP_L.put_be(&mut b, 0, self.timestamp as u32);
        }
        b[f::OP_OWN.off] = self.opcode << CQE_OPCODE_SHIFT | if self.solicited { CQE_SE } else { 0 };
        b
    }
}

/// The RoCE packet type's "UDP header present" bit (bit 3 of the SL field): the PRM's responder CQE for RoCE puts
/// the packet type where InfiniBand has the SL, bit 3 set for a RoCE v2 frame and bits 2:0 its L3 header type
/// (as UCX's `uct_ib_mlx5_cqe_roce_gid_len` quotes it).
const ROCE_TYPE_UDP: u32 = 1 << 3;

/// `flags_rqpn` of a responder CQE: on InfiniBand the SL in bits 27:24, on a RoCE port the packet type there:
/// RoCE v2 (every frame of the simulated wire) with its L3 header, IPv4 or IPv6 (mlx5_ib `handle_responder` reads
/// bits 25:24, rdma-core's mlx5 reports all four as `wc.sl`).
pub(super) fn flags_rqpn(p: &Packet, ib: bool) -> u32 {
    let grh = u32::from(p.grh.is_some()) << CQE_GRH_SHIFT;
    let sl = match &p.grh {
        _ if ib => u32::from(p.sl & AV_SL_MASK),
        Some(g) if roce_map::is_ipv4(&g.sgid, &g.dgid) => ROCE_TYPE_UDP | consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV4,
        Some(_) => ROCE_TYPE_UDP | consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV6,
        None => 0,
    } << CQE_SL_SHIFT;
    (p.src_qpn & QPN_MASK) | grh | sl
}

/// What completing work requests borrows from the device: the QP and SRQ tables and the CQ writer. Built per
/// completion (`Datapath::completions`); `flush.rs` errors and flushes QPs on it too.
pub(super) struct Completions<'a> {
    pub(super) qps: &'a mut QpTable,
    pub(super) srqs: &'a mut SrqTable,
    pub(super) cq: Cqs<'a>,
}

impl Completions<'_> {
    /// The view SRQ events take, borrowed from this one.
    #[inline]
    pub(super) fn srqs(&mut self) -> Srqs<'_> {
        Srqs { srqs: self.srqs, qps: self.qps, post: self.cq.eq.reborrow() }
    }

    /// A send WQE completed: the consumer counter moves past it, and a signaled WQE gets its CQE. A UC or UD
    /// message moves the send PSN on here; an RC message moved it when it was sent, and a NOP sends nothing.
    pub(super) fn complete_send(&mut self, qpn: u32, w: WqeId, len: u64) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        qp.sq_ci = qp.sq_ci.wrapping_add(w.nbb);
        if qp.st != QpType::Rc {
            qp.next_send_psn = qp.next_send_psn.wrapping_add(packets(len, qp.mtu)) & PSN_MASK;
        }
        let cqn = qp.cqn_snd;
        if w.signaled {
            let byte_cnt = u32::try_from(len).unwrap_or(u32::MAX);
            let cqe = CqeOut {
                opcode: consts::MLX5_CQE_REQ,
                wqe_opcode: w.opcode,
                qpn,
                wqe_counter: w.index,
                byte_cnt,
                srqn: qp.cqe_srqn_uidx(0),
                ..CqeOut::default()
            };
            self.cq.post(cqn, cqe);
        }
    }

    /// A send WQE failed: an error CQE (signaled or not) and the QP goes to ERR.
    pub(super) fn send_error(&mut self, qpn: u32, index: u16, opcode: u8, nbb: u16, syndrome: u8) {
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        qp.sq_ci = qp.sq_ci.wrapping_add(nbb);
        // The WQE that failed is the oldest; the flush completes the ones sent after it from the ring.
        if qp.reqs.front().is_some_and(|r| r.wqe.index == index) {
            qp.reqs.pop_front();
        }
        if qp.reqs.is_empty() {
            qp.sq_next = qp.sq_ci;
        }
        let cqn = qp.cqn_snd;
        let cqe = CqeOut {
            opcode: consts::MLX5_CQE_REQ_ERR,
            wqe_opcode: opcode,
            qpn,
            wqe_counter: index,
            syndrome,
            srqn: qp.cqe_srqn_uidx(0),
            ..CqeOut::default()
        };
        self.cq.post(cqn, cqe);
        self.qp_error(qpn, syndrome);
    }

    /// Where an XRC target's receive completes: the XRC SRQ's CQ, and the `srqn_uidx` its CQE carries (the
    /// SRQ's user index, which rdma-core's mlx5 provider looks up in version 1, `get_resp_ctx_v1`; the SRQ number
    /// in version 0, asked for with `MLX5_IB_DEFAULT_UIDX`). `None` for any other receive.
    fn xrc_srq(&self, qpn: u32) -> Option<(u32, u32)> {
        let n = self.qps.get(&qpn)?.xrc_rx?;
        let x = self.srqs.get(&n)?.xrc?;
        Some((x.cqn, if x.user_index == consts::MLX5_IB_DEFAULT_UIDX { n } else { x.user_index }))
    }

    /// A receive WQE consumed successfully.
    #[inline]
    pub(super) fn recv_complete(&mut self, qpn: u32, index: u16, len: u64, mut cqe: CqeOut) {
        let xrc = self.xrc_srq(qpn);
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let srqn = qp.recv_srq();
        if srqn.is_none() {
            qp.rq_ci = qp.rq_ci.wrapping_add(1);
        }
        qp.next_rcv_psn = qp.next_rcv_psn.wrapping_add(packets(len, qp.mtu)) & PSN_MASK;
        qp.msn = qp.msn.wrapping_add(1) & PSN_MASK;
        cqe.qpn = qpn;
        cqe.wqe_counter = index;
        let (cqn, uidx) = xrc.unwrap_or((qp.cqn_rcv, qp.cqe_srqn_uidx(srqn.unwrap_or(0))));
        cqe.srqn = uidx;
        // The CQE names the SRQ WQE; the SRQ moves on (and may raise its limit event) after it.
        self.cq.post(cqn, cqe);
        if let Some(n) = srqn {
            self.srqs().srq_take(n);
        }
    }

    /// A receive WQE failed: an error CQE and the QP goes to ERR.
    pub(super) fn recv_error(&mut self, qpn: u32, index: u16, syndrome: u8) {
        let xrc = self.xrc_srq(qpn);
        let Some(qp) = self.qps.get_mut(&qpn) else { return };
        let srqn = qp.recv_srq();
        if srqn.is_none() {
            qp.rq_ci = qp.rq_ci.wrapping_add(1);
        }
        let (cqn, uidx) = xrc.unwrap_or((qp.cqn_rcv, qp.cqe_srqn_uidx(srqn.unwrap_or(0))));
        let cqe = CqeOut {
            opcode: consts::MLX5_CQE_RESP_ERR,
            qpn,
            wqe_counter: index,
            syndrome,
            srqn: uidx,
            ..CqeOut::default()
        };
        self.cq.post(cqn, cqe);
        if let Some(n) = srqn {
            self.srqs().srq_take(n);
        }
        self.qp_error(qpn, syndrome);
    }
}
