//! The host's half of subnet management on an InfiniBand port, as Linux's `ib_mad` and mlx5_ib's `process_mad` run
//! it for a kernel: [`SmiAgent`] owns the port's SMI QP (QP0, `QpType::Smi`), takes each SMP that arrives, hands
//! it to the firmware's subnet management agent through MAD_IFC and sends the response back on QP0 to the sender's
//! LID (the permissive LID when a subnet manager with no LID yet asked by directed route), with the directed
//! route's hop pointer moved back ([`mlx5_rdmacm::smp`]). With it running, a subnet manager on the fabric sweeps a
//! port this stack drives: it reads NodeInfo and PortInfo, assigns the LID and moves the port to ACTIVE.
//!
//! What is not an SMP for this port's agent (a truncated MAD, another class, a response, a route that does not end
//! here) is dropped and counted with its reason, as `ib_mad` drops it; nothing a peer sends makes the agent fail.

use std::time::{Duration, Instant};

use mlx5_core::ah::GRH_BYTES;
use mlx5_core::cq::{WcFlags, WcStatus, WorkCompletion};
use mlx5_core::mad_ifc::{MadIfcFlags, MAD_LEN};
use mlx5_core::qp::{QpCap, QpType};
use mlx5_rdmacm::smp::{self, SmpDrop};

use crate::context::Context;
use crate::cq::CompletionQueue;
use crate::error::{Result, VerbsError};
use crate::mr::MemoryRegion;
use crate::pd::ProtectionDomain;
use crate::qp::{QueuePair, Rts};
use crate::wr;

/// Receive slots kept posted on QP0; each answer is sent from its request's slot, which is posted again when the
/// send completes.
const SLOTS: usize = 16;
/// Bytes of one slot: the GRH room and a MAD, rounded up.
const SLOT_LEN: usize = 512;
/// Marks a send's `wr_id` (the low half is its slot).
const SEND: u64 = 1 << 32;
/// QP0's Q_Key (`ib_mad` brings QP0 to RTS with Q_Key 0).
const QP0_QKEY: u32 = 0;

/// What became of one SMP that arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SmiOutcome {
    /// The SMA answered and the response was posted back on QP0.
    Answered,
    /// The SMA took it and sends nothing back (TrapRepress).
    NoReply,
    /// Dropped before the SMA saw it, or its response could not be routed back.
    Dropped(SmpDrop),
    /// MAD_IFC itself failed (the command's error is logged): dropped, as `ib_mad` drops it.
    MadIfcFailed,
    /// The receive completed with an error.
    RecvError(WcStatus),
    /// The response could not be posted (no address handle, a full send queue): logged and dropped.
    SendFailed,
}

/// Counts of what the agent did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SmiStats {
    /// SMPs answered.
    pub answered: u64,
    /// SMPs taken without an answer (TrapRepress).
    pub no_reply: u64,
    /// SMPs dropped (malformed, not for this agent, no way back).
    pub dropped: u64,
    /// MAD_IFC failures.
    pub mad_ifc_failed: u64,
    /// Receives that completed with an error.
    pub recv_errors: u64,
    /// Responses that could not be posted or completed with an error.
    pub send_errors: u64,
}

/// The SMI QP of one port and what it serves. It borrows its PD, its own CQ (for QP0's sends and receives alone)
/// and a registered buffer of at least [`SmiAgent::BUF_LEN`] bytes.
#[derive(Debug)]
pub struct SmiAgent<'a> {
    ctx: &'a Context,
    pd: &'a ProtectionDomain<'a>,
    cq: &'a CompletionQueue<'a>,
    mr: &'a MemoryRegion<'a>,
    qp: QueuePair<'a, Rts>,
    port: u8,
    stats: SmiStats,
}

impl<'a> SmiAgent<'a> {
    /// Bytes the agent's memory region must hold.
    pub const BUF_LEN: usize = SLOTS * SLOT_LEN;

    /// Creates port 1's SMI QP (as mlx5_ib creates it for `ib_mad`), brings it to RTS with Q_Key 0 and posts every
    /// receive slot. Fails on an Ethernet port, which has no QP0.
    pub fn new(
        pd: &'a ProtectionDomain<'a>,
        cq: &'a CompletionQueue<'a>,
        mr: &'a MemoryRegion<'a>,
    ) -> Result<SmiAgent<'a>> {
        if mr.len() < Self::BUF_LEN {
            return Err(VerbsError::Invalid(format!(
                "the SMI agent's region holds {} bytes, it needs {}",
                mr.len(),
                Self::BUF_LEN
            )));
        }
        let cap = QpCap {
            max_send_wr: SLOTS as u32,
            max_recv_wr: SLOTS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = pd.create_qp(QpType::Smi, cq, cq, cap)?.activate_ud(QP0_QKEY)?;
        let agent = SmiAgent { ctx: pd.context(), pd, cq, mr, qp, port: 1, stats: SmiStats::default() };
        for slot in 0..SLOTS {
            agent.post_slot(slot)?;
        }
        Ok(agent)
    }

    /// The QP's number as firmware gave it (it sends and receives as QP 0 whatever it is).
    pub fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// What the agent did so far.
    pub fn stats(&self) -> SmiStats {
        self.stats
    }

    fn post_slot(&self, slot: usize) -> Result<()> {
        let sge = self.mr.sge(slot * SLOT_LEN, (GRH_BYTES + MAD_LEN) as u32);
        self.qp.post_recv(&[wr::recv(slot as u64, &[sge])])
    }

    /// Serves QP0 until one SMP was dealt with or `timeout` passed: `Ok(None)` when nothing arrived. Completions of
    /// earlier responses are taken on the way (their slots posted again).
    pub fn serve(&mut self, timeout: Duration) -> Result<Option<SmiOutcome>> {
        let deadline = Instant::now() + timeout;
        let mut wc = [WorkCompletion::default()];
        loop {
            if self.cq.poll(&mut wc)? == 1 {
                if let Some(o) = self.complete(&wc[0])? {
                    return Ok(Some(o));
                }
                continue;
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// One completion: a response's send (`None`, its slot posted again) or an arrival (its outcome).
    fn complete(&mut self, w: &WorkCompletion) -> Result<Option<SmiOutcome>> {
        let slot = (w.wr_id & 0xffff_ffff) as usize;
        if slot >= SLOTS {
            return Err(VerbsError::Invalid(format!("QP0 completed an unknown work request {:#x}", w.wr_id)));
        }
        if w.wr_id & SEND != 0 {
            if w.status != WcStatus::Success {
                self.stats.send_errors += 1;
                log::warn!("smi: a response on QP0 completed with {:?}", w.status);
            }
            self.post_slot(slot)?;
            return Ok(None);
        }
        if w.status != WcStatus::Success {
            self.stats.recv_errors += 1;
            // A flushed receive means the QP left RTS: posting again would only flush again.
            if w.status != WcStatus::WrFlushErr {
                self.post_slot(slot)?;
            }
            return Ok(Some(SmiOutcome::RecvError(w.status)));
        }
        let outcome = self.answer(slot, w)?;
        match outcome {
            SmiOutcome::Answered => {
                self.stats.answered += 1;
                return Ok(Some(outcome));
            }
            SmiOutcome::NoReply => self.stats.no_reply += 1,
            SmiOutcome::Dropped(e) => {
                self.stats.dropped += 1;
                log::debug!("smi: dropped an SMP: {e}");
            }
            SmiOutcome::MadIfcFailed => self.stats.mad_ifc_failed += 1,
            SmiOutcome::SendFailed => self.stats.send_errors += 1,
            SmiOutcome::RecvError(_) => {}
        }
        // Nothing was sent from the slot: it takes the next SMP.
        self.post_slot(slot)?;
        Ok(Some(outcome))
    }

    /// The SMP in `slot` through the checks, MAD_IFC and back out (`process_mad`, then `agent_send_response`).
    fn answer(&mut self, slot: usize, w: &WorkCompletion) -> Result<SmiOutcome> {
        let base = slot * SLOT_LEN;
        let len = (w.byte_len as usize).saturating_sub(GRH_BYTES).min(MAD_LEN);
        let mut bytes = [0u8; MAD_LEN];
        self.mr.read(base + GRH_BYTES, &mut bytes[..len])?;
        let req = match smp::accept(&bytes[..len], self.port) {
            Ok(r) => r,
            Err(e) => return Ok(SmiOutcome::Dropped(e)),
        };
        // From the wire, with a completion to answer: both key checks stay on (`mlx5_MAD_IFC` with `in_wc`).
        let reply = match self.ctx.mad_ifc(self.port, MadIfcFlags::default(), &req.mad) {
            Ok(r) => r,
            Err(e) => {
                log::warn!("smi: MAD_IFC failed: {e}");
                return Ok(SmiOutcome::MadIfcFailed);
            }
        };
        let rsp = match smp::respond(&req, reply.mad, self.port) {
            Ok(Some(rsp)) => rsp,
            Ok(None) => return Ok(SmiOutcome::NoReply),
            Err(e) => return Ok(SmiOutcome::Dropped(e)),
        };
        self.mr.write(base + GRH_BYTES, &rsp)?;
        // Back to where it came from: the completion's SLID and SL (`ib_create_ah_from_wc`), QP 0, Q_Key 0.
        let mut grh = [0u8; GRH_BYTES];
        let has_grh = w.wc_flags.contains(WcFlags::GRH);
        if has_grh {
            self.mr.read(base, &mut grh)?;
        }
        let ah = match self.pd.create_ah_from_wc(w, has_grh.then_some(&grh), self.port) {
            Ok(ah) => ah,
            Err(e) => {
                log::warn!("smi: no address back to LID {:#x}: {e}", w.slid);
                return Ok(SmiOutcome::SendFailed);
            }
        };
        let sge = [self.mr.sge(base + GRH_BYTES, MAD_LEN as u32)];
        match self.qp.post_send(&[wr::ud_send(SEND | slot as u64, &sge, ah.dest(0, QP0_QKEY))]) {
            Ok(()) => Ok(SmiOutcome::Answered),
            Err(e) => {
                log::warn!("smi: the response was not posted: {e}");
                Ok(SmiOutcome::SendFailed)
            }
        }
    }
}
