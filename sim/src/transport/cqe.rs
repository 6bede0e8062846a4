//! CQE production: a CQE goes into its CQ's ring through the `pas[]` pages with the owner bit of its pass, after
//! the overrun check against the doorbell record's consumer index; an armed CQ then fires its completion EQE
//! (`mlx5_cq_completion` on the kernel side). The datapath's completions and [`crate::SimDevice::post_cqe`] both
//! come here.
//!
//! A CQE is written through the checked DMA translation: its 64-byte `mlx5_cqe64` image without `op_own` first,
//! then, after a fence, `op_own`, so a driver that sees the new owner bit (and issues `dma_rmb`) reads a
//! complete entry.

use mlx5_core::prm::{c, consts};

use crate::dma::DmaFault;
use crate::events::SimEvent;
use crate::fw::cq::{
    Arm, PostCqeError, CQE64, EVENT_COMP, EVENT_CQ_ERROR, OPCODE_SHIFT, OP_OWN, SOLICITED, STATUS_OK, STATUS_OVERFLOW,
    STATUS_WRITE_FAIL,
};
use crate::fw::eq::EQE_DATA_LEN;
use crate::State;

/// Whether a CQE satisfies a solicited-only arm: the solicited bit, or an error CQE.
fn is_solicited(op_own: u8) -> bool {
    let opcode = u32::from(op_own >> OPCODE_SHIFT);
    op_own & SOLICITED != 0 || opcode == consts::MLX5_CQE_REQ_ERR || opcode == consts::MLX5_CQE_RESP_ERR
}

/// The event data of a CQ-error EQE (`struct mlx5_eqe_cq_err`).
fn cq_err_data(cqn: u32, synd: u32) -> [u8; EQE_DATA_LEN] {
    use c::mlx5_eqe_cq_err as e;
    let mut d = [0u8; EQE_DATA_LEN];
    d[e::CQN.off..e::CQN.end()].copy_from_slice(&cqn.to_be_bytes());
    d[e::SYNDROME.off] = synd as u8;
    d
}

/// The event data of a completion EQE (`struct mlx5_eqe_comp`).
fn comp_data(cqn: u32) -> [u8; EQE_DATA_LEN] {
    let f = c::mlx5_eqe_comp::CQN;
    let mut d = [0u8; EQE_DATA_LEN];
    d[f.off..f.end()].copy_from_slice(&cqn.to_be_bytes());
    d
}

impl State {
    /// Writes `cqe` as the next CQE of CQ `cqn` (the device lock is held): the overrun check, the owner bit,
    /// and the completion event of an armed CQ. Returns the CQE's counter value.
    pub(crate) fn post_cqe(&mut self, cqn: u32, cqe: &[u8; CQE64]) -> Result<u32, PostCqeError> {
        if self.dead() {
            return Err(PostCqeError::Dead);
        }
        let cq = self.fw.cqs.get_mut(&cqn).ok_or(PostCqeError::UnknownCq)?;
        if cq.status != STATUS_OK {
            return Err(PostCqeError::CqInError { status: cq.status });
        }
        let ci = match cq.read_ci(&mut self.dma) {
            Ok(ci) => ci,
            Err(f) => return Err(self.cq_write_fail(cqn, f)),
        };
        if cq.unconsumed(ci) >= cq.nent() {
            cq.overruns += 1;
            if !cq.oi {
                // Hardware never overwrites an unconsumed CQE of a CQ without `oi`: the CQ goes to error.
                cq.status = STATUS_OVERFLOW;
                self.events.push(SimEvent::CqOverrun { cqn });
                self.post_eqe(EVENT_CQ_ERROR, 0, &cq_err_data(cqn, consts::MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN));
                return Err(PostCqeError::Overrun);
            }
        }
        let n = cq.pi;
        if let Err(f) = cq.write_cqe(&mut self.dma, n, cqe) {
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
            self.fire_completion(cqn);
        }
        Ok(n)
    }

    /// The CQ could not reach its memory: it enters write-fail and a CQ-error EQE reports the access violation.
    fn cq_write_fail(&mut self, cqn: u32, fault: DmaFault) -> PostCqeError {
        if let Some(cq) = self.fw.cqs.get_mut(&cqn) {
            cq.status = STATUS_WRITE_FAIL;
        }
        self.events.push(SimEvent::CqWriteFail { cqn });
        let synd = consts::MLX5_CQ_ERROR_SYNDROME_CQ_ACCESS_VIOLATION_ERROR;
        self.post_eqe(EVENT_CQ_ERROR, 0, &cq_err_data(cqn, synd));
        PostCqeError::DmaFault(fault)
    }

    /// An armed CQ fires: a completion EQE on its own EQ, and the CQ is disarmed.
    pub(crate) fn fire_completion(&mut self, cqn: u32) {
        let Some(cq) = self.fw.cqs.get_mut(&cqn) else { return };
        cq.arm = Arm::None;
        cq.last_notified = cq.pi.wrapping_sub(1);
        let eqn = cq.eqn;
        if self.post_eqe_to(eqn, EVENT_COMP, 0, &comp_data(cqn)).is_some() {
            if let Some(cq) = self.fw.cqs.get_mut(&cqn) {
                cq.events_fired += 1;
            }
            self.events.push(SimEvent::CompletionEvent { cqn, eqn: eqn as u8 });
        }
    }
}
