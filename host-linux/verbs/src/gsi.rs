//! General management packets from a port this stack drives: [`GsiClient`] owns the port's GSI QP (QP1,
//! `QpType::Gsi`, the well-known Q_Key 0x80010000) and runs one request at a time to a peer's QP1 through
//! [`mlx5_rdmacm::gmp::Transactions`]: the response matched by transaction ID, the request sent again after its
//! timeout and given up after its retries, as `ib_mad`'s send agents do. What arrives and answers nothing is dropped
//! and counted.

use std::time::{Duration, Instant};

use mlx5_core::ah::GRH_BYTES;
use mlx5_core::cq::{WcFlags, WcStatus, WorkCompletion};
use mlx5_core::mad_ifc::MAD_LEN;
use mlx5_core::qp::{AhAttr, QpCap, QpType};
use mlx5_rdmacm::gmp::{GmpCounters, GmpEvent, Transactions};
use mlx5_rdmacm::mad::QP1_QKEY;

use crate::cq::CompletionQueue;
use crate::error::{Result, VerbsError};
use crate::mr::MemoryRegion;
use crate::pd::ProtectionDomain;
use crate::qp::{QueuePair, Rts};
use crate::wr;

/// Receive slots kept posted (GRH room and a MAD each).
const RECV_SLOTS: usize = 8;
/// Send slots after them (a MAD each): a request and its retries.
const SEND_SLOTS: usize = 4;
const SLOT_LEN: usize = 512;
/// Marks a send's `wr_id`.
const SEND: u64 = 1 << 32;
/// How long a send slot may stay busy before the client gives up on the device.
const SEND_WAIT: Duration = Duration::from_secs(5);

/// What a request came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GmpReply {
    /// The response, and who sent it.
    Response {
        /// The response MAD.
        mad: Box<[u8; MAD_LEN]>,
        /// Its sender's address (reply to it with this).
        from: AhAttr,
    },
    /// No response after the retries.
    TimedOut,
}

/// The GSI QP of port 1 as a requester of general management packets. It borrows its PD, its own CQ and a
/// registered buffer of at least [`GsiClient::BUF_LEN`] bytes.
#[derive(Debug)]
pub struct GsiClient<'a> {
    pd: &'a ProtectionDomain<'a>,
    cq: &'a CompletionQueue<'a>,
    mr: &'a MemoryRegion<'a>,
    qp: QueuePair<'a, Rts>,
    t: Transactions<AhAttr>,
    busy: [bool; SEND_SLOTS],
    next_send: usize,
    epoch: Instant,
    recv_errors: u64,
}

impl<'a> GsiClient<'a> {
    /// Bytes the client's memory region must hold.
    pub const BUF_LEN: usize = (RECV_SLOTS + SEND_SLOTS) * SLOT_LEN;

    /// Creates port 1's GSI QP, brings it to RTS with the well-known Q_Key and posts its receives. Transaction IDs
    /// start at `first_tid`.
    pub fn new(
        pd: &'a ProtectionDomain<'a>,
        cq: &'a CompletionQueue<'a>,
        mr: &'a MemoryRegion<'a>,
        first_tid: u64,
    ) -> Result<GsiClient<'a>> {
        if mr.len() < Self::BUF_LEN {
            return Err(VerbsError::Invalid(format!(
                "the GSI client's region holds {} bytes, it needs {}",
                mr.len(),
                Self::BUF_LEN
            )));
        }
        let cap = QpCap {
            max_send_wr: SEND_SLOTS as u32,
            max_recv_wr: RECV_SLOTS as u32,
            max_send_sge: 1,
            max_recv_sge: 1,
            max_inline_data: 0,
        };
        let qp = pd.create_qp(QpType::Gsi, cq, cq, cap)?.activate_ud(QP1_QKEY)?;
        let c = GsiClient {
            pd,
            cq,
            mr,
            qp,
            t: Transactions::new(first_tid, SEND_SLOTS),
            busy: [false; SEND_SLOTS],
            next_send: 0,
            epoch: Instant::now(),
            recv_errors: 0,
        };
        for slot in 0..RECV_SLOTS {
            c.post_recv(slot)?;
        }
        Ok(c)
    }

    /// What the transactions came to so far.
    pub fn counters(&self) -> GmpCounters {
        self.t.counters()
    }

    /// Receives that completed with an error.
    pub fn recv_errors(&self) -> u64 {
        self.recv_errors
    }

    fn post_recv(&self, slot: usize) -> Result<()> {
        self.qp.post_recv(&[wr::recv(slot as u64, &[self.mr.sge(slot * SLOT_LEN, (GRH_BYTES + MAD_LEN) as u32)])])
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64
    }

    /// Sends request `mad` to QP1 at `to` and waits for its response: `timeout` per try, `retries` more tries.
    /// The transaction ID is the client's (whatever `mad` holds there).
    pub fn call(&mut self, to: &AhAttr, mad: &[u8; MAD_LEN], timeout: Duration, retries: u8) -> Result<GmpReply> {
        let timeout_ns = timeout.as_nanos() as u64;
        let tid = self
            .t
            .request(self.now_ns(), *to, mad, timeout_ns, retries)
            .map_err(|e| VerbsError::Invalid(format!("GMP request: {e}")))?;
        let mut wc = [WorkCompletion::default()];
        loop {
            while let Some((to, m)) = self.t.poll_output() {
                self.send(&to, &m)?;
            }
            if self.cq.poll(&mut wc)? == 1 {
                self.complete(&wc[0])?;
            } else {
                std::thread::sleep(Duration::from_millis(1));
            }
            self.t.tick(self.now_ns());
            while let Some(ev) = self.t.poll_event() {
                match ev {
                    GmpEvent::Response { tid: t, from, mad } if t == tid => {
                        return Ok(GmpReply::Response { mad, from });
                    }
                    GmpEvent::TimedOut { tid: t, .. } if t == tid => return Ok(GmpReply::TimedOut),
                    // One request at a time: no other transaction is waiting.
                    _ => {}
                }
            }
        }
    }

    /// One MAD out of a free send slot (waiting for one if all are in flight).
    fn send(&mut self, to: &AhAttr, mad: &[u8; MAD_LEN]) -> Result<()> {
        let end = Instant::now() + SEND_WAIT;
        let mut wc = [WorkCompletion::default()];
        while self.busy[self.next_send] {
            if Instant::now() > end {
                return Err(VerbsError::Invalid("QP1's sends did not complete".into()));
            }
            if self.cq.poll(&mut wc)? == 1 {
                self.complete(&wc[0])?;
            }
        }
        let slot = self.next_send;
        self.next_send = (slot + 1) % SEND_SLOTS;
        let off = (RECV_SLOTS + slot) * SLOT_LEN;
        self.mr.write(off, mad)?;
        let ah = self.pd.create_ah(to)?;
        self.qp.post_send(&[wr::ud_send(
            SEND | slot as u64,
            &[self.mr.sge(off, MAD_LEN as u32)],
            ah.dest(1, QP1_QKEY),
        )])?;
        self.busy[slot] = true;
        Ok(())
    }

    fn complete(&mut self, w: &WorkCompletion) -> Result<()> {
        let slot = (w.wr_id & 0xffff_ffff) as usize;
        if w.wr_id & SEND != 0 {
            if let Some(b) = self.busy.get_mut(slot) {
                *b = false;
            }
            return Ok(());
        }
        if slot >= RECV_SLOTS {
            return Err(VerbsError::Invalid(format!("QP1 completed an unknown work request {:#x}", w.wr_id)));
        }
        if w.status != WcStatus::Success {
            self.recv_errors += 1;
            if w.status != WcStatus::WrFlushErr {
                self.post_recv(slot)?;
            }
            return Ok(());
        }
        let base = slot * SLOT_LEN;
        let len = (w.byte_len as usize).saturating_sub(GRH_BYTES).min(MAD_LEN);
        let mut bytes = [0u8; MAD_LEN];
        self.mr.read(base + GRH_BYTES, &mut bytes[..len])?;
        let mut grh = [0u8; GRH_BYTES];
        let has_grh = w.wc_flags.contains(WcFlags::GRH);
        if has_grh {
            self.mr.read(base, &mut grh)?;
        }
        let from = self.pd.context().init_ah_from_wc(1, w, has_grh.then_some(&grh));
        self.post_recv(slot)?;
        match from {
            Ok(from) => self.t.recv(from, &bytes[..len]),
            // No way back to the sender: nothing of ours waits for it.
            Err(e) => log::debug!("gsi: a MAD from an address with no way back: {e}"),
        }
        Ok(())
    }
}
