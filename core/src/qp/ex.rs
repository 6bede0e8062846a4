//! The extended QP's work-request builder (`ibv_create_qp_ex` with `send_ops_flags`, `ibv_qp_ex`: `wr_start`,
//! `wr_send`, `wr_rdma_write`, `wr_set_sge`, `wr_set_inline_data`, `wr_complete`, `wr_abort`), on top of the
//! ordinary post path ([`Qp::post_send`]).
//!
//! rdma-core's mlx5 provider writes each WQE as the calls come and rolls the producer index back on `wr_abort`
//! or on an error found by `wr_complete`. Here a [`WrBatch`] keeps the requests (inline data copied at once, as
//! the caller may reuse its buffer when `wr_set_inline_data` returns) in fixed-capacity storage and
//! `wr_complete` hands them to one `post_send`, which builds the WQEs and rings the doorbell once; `wr_abort` drops
//! them, so nothing reaches the device. The first error a call meets is kept and returned by `wr_complete`, which
//! then posts nothing (the `ibv_wr_*` calls return nothing in C). No allocation.

use super::attr::QpType;
use super::ring::Qp;
use super::wr::{Ah, PostError, SendFlags, SendOp, SendWr, Sge, UdDest};
use crate::hal::Mmio;

/// `ibv_qp_create_send_ops_flags` (`IBV_QP_EX_WITH_*`): the operations an extended QP's builder may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SendOpsFlags(pub u64);

impl SendOpsFlags {
    /// `IBV_QP_EX_WITH_RDMA_WRITE`.
    pub const RDMA_WRITE: SendOpsFlags = SendOpsFlags(1 << 0);
    /// `IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM`.
    pub const RDMA_WRITE_WITH_IMM: SendOpsFlags = SendOpsFlags(1 << 1);
    /// `IBV_QP_EX_WITH_SEND`.
    pub const SEND: SendOpsFlags = SendOpsFlags(1 << 2);
    /// `IBV_QP_EX_WITH_SEND_WITH_IMM`.
    pub const SEND_WITH_IMM: SendOpsFlags = SendOpsFlags(1 << 3);
    /// `IBV_QP_EX_WITH_RDMA_READ`.
    pub const RDMA_READ: SendOpsFlags = SendOpsFlags(1 << 4);
    /// `IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP`.
    pub const ATOMIC_CMP_AND_SWP: SendOpsFlags = SendOpsFlags(1 << 5);
    /// `IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD`.
    pub const ATOMIC_FETCH_AND_ADD: SendOpsFlags = SendOpsFlags(1 << 6);
    /// `IBV_QP_EX_WITH_LOCAL_INV` (not supported here: no memory windows or fast registration).
    pub const LOCAL_INV: SendOpsFlags = SendOpsFlags(1 << 7);
    /// `IBV_QP_EX_WITH_BIND_MW` (not supported here).
    pub const BIND_MW: SendOpsFlags = SendOpsFlags(1 << 8);
    /// `IBV_QP_EX_WITH_SEND_WITH_INV` (not supported here).
    pub const SEND_WITH_INV: SendOpsFlags = SendOpsFlags(1 << 9);
    /// `IBV_QP_EX_WITH_TSO` (not supported here: no raw packet QPs).
    pub const TSO: SendOpsFlags = SendOpsFlags(1 << 10);
    /// `IBV_QP_EX_WITH_FLUSH` (not supported here).
    pub const FLUSH: SendOpsFlags = SendOpsFlags(1 << 11);
    /// `IBV_QP_EX_WITH_ATOMIC_WRITE` (not supported here).
    pub const ATOMIC_WRITE: SendOpsFlags = SendOpsFlags(1 << 12);

    /// What this driver's WQE builder can post on a QP of `qp_type`, as mlx5's `mlx5_qp_fill_wr_pfns` allows per
    /// type: RC everything it supports, UC sends and RDMA writes, UD sends.
    pub const fn supported(qp_type: QpType) -> SendOpsFlags {
        let sends = Self::SEND.0 | Self::SEND_WITH_IMM.0;
        let writes = Self::RDMA_WRITE.0 | Self::RDMA_WRITE_WITH_IMM.0;
        let rc_only = Self::RDMA_READ.0 | Self::ATOMIC_CMP_AND_SWP.0 | Self::ATOMIC_FETCH_AND_ADD.0;
        SendOpsFlags(match qp_type {
            QpType::Rc => sends | writes | rc_only,
            QpType::Uc => sends | writes,
            QpType::Ud | QpType::Gsi | QpType::Smi => sends,
        })
    }

    /// Whether every flag of `o` is set.
    pub const fn contains(self, o: SendOpsFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

impl core::ops::BitOr for SendOpsFlags {
    type Output = SendOpsFlags;
    fn bitor(self, o: SendOpsFlags) -> SendOpsFlags {
        SendOpsFlags(self.0 | o.0)
    }
}

/// Why an extended QP could not be made or a batch not posted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum QpExError {
    /// `send_ops_flags` asks for operations this QP type or driver cannot do (`EOPNOTSUPP` at create time, as
    /// rdma-core refuses them rather than leaving a builder entry empty).
    UnsupportedSendOps {
        /// The bits not supported.
        bits: u64,
    },
    /// An operation the QP was not created with (`send_ops_flags`).
    OpNotEnabled {
        /// The `ibv_wr_*` call.
        op: &'static str,
    },
    /// A `wr_set_*` call with no work request begun since `wr_start`.
    NoWorkRequest {
        /// The call.
        call: &'static str,
    },
    /// More work requests in one batch than it holds.
    BatchFull {
        /// Its capacity.
        max: usize,
    },
    /// More scatter/gather entries than a batch entry holds.
    TooManySge {
        /// Entries given.
        sge: usize,
        /// Entries held.
        max: usize,
    },
    /// More inline bytes than the batch's inline storage has left.
    InlineFull {
        /// Bytes given.
        bytes: usize,
        /// Bytes left.
        left: usize,
    },
    /// The post itself failed (`PostError::index` is the position within the batch; the requests before it
    /// were posted, as with `ibv_post_send`).
    Post(PostError),
}

impl core::fmt::Display for QpExError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Self::UnsupportedSendOps { bits } => write!(f, "send_ops_flags {bits:#x} not supported on this QP"),
            Self::OpNotEnabled { op } => write!(f, "{op}: not among the QP's send_ops_flags"),
            Self::NoWorkRequest { call } => write!(f, "{call}: no work request begun"),
            Self::BatchFull { max } => write!(f, "more than {max} work requests between wr_start and wr_complete"),
            Self::TooManySge { sge, max } => write!(f, "{sge} scatter/gather entries, at most {max}"),
            Self::InlineFull { bytes, left } => write!(f, "{bytes} inline bytes, {left} left in the batch"),
            Self::Post(e) => write!(f, "{e}"),
        }
    }
}

impl core::error::Error for QpExError {}

/// The creation-time model of an extended QP (`ibv_qp_init_attr_ex.send_ops_flags`): the operations its
/// builder may use, checked against the QP type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpEx {
    qp_type: QpType,
    send_ops: SendOpsFlags,
}

impl QpEx {
    /// Checks `send_ops` for a QP of `qp_type` (`mlx5_create_qp_ex`'s `send_ops_flags` check).
    pub fn new(qp_type: QpType, send_ops: SendOpsFlags) -> Result<Self, QpExError> {
        let extra = send_ops.0 & !SendOpsFlags::supported(qp_type).0;
        if extra != 0 {
            return Err(QpExError::UnsupportedSendOps { bits: extra });
        }
        Ok(Self { qp_type, send_ops })
    }

    /// The QP type.
    pub fn qp_type(&self) -> QpType {
        self.qp_type
    }

    /// The operations the builder may use.
    pub fn send_ops(&self) -> SendOpsFlags {
        self.send_ops
    }

    /// `ibv_wr_start`: an empty batch (16 requests of up to 4 SGEs, 1 KiB of inline data).
    pub fn wr_start(&self) -> WrBatch {
        WrBatch::new(*self)
    }

    /// `ibv_wr_start` with chosen capacities: `N` requests of up to `S` SGEs, `I` bytes of inline data.
    pub fn wr_start_with<const N: usize, const S: usize, const I: usize>(&self) -> WrBatch<N, S, I> {
        WrBatch::new(*self)
    }
}

/// One request of a batch: the operation, its data (SGEs by value, inline bytes as a range of the batch's
/// inline storage) and a UD destination by value.
#[derive(Debug, Clone, Copy)]
struct Pending<const S: usize> {
    wr_id: u64,
    flags: SendFlags,
    op: SendOp,
    sge: [Sge; S],
    nsge: usize,
    inline: Option<(usize, usize)>,
    ud: Option<(Ah, u32, u32)>,
}

/// The requests between `wr_start` and `wr_complete` / `wr_abort` (`ibv_qp_ex` in its started state). `wr_id` and
/// `wr_flags` are read by each operation call, as `ibv_qp_ex.wr_id` / `wr_flags` are.
#[derive(Debug)]
pub struct WrBatch<const N: usize = 16, const S: usize = 4, const I: usize = 1024> {
    /// `ibv_qp_ex.wr_id`: the next operation's `wr_id`.
    pub wr_id: u64,
    /// `ibv_qp_ex.wr_flags`: the next operation's send flags.
    pub wr_flags: SendFlags,
    ex: QpEx,
    pending: heapless::Vec<Pending<S>, N>,
    inline: [u8; I],
    inline_used: usize,
    err: Option<QpExError>,
}

impl<const N: usize, const S: usize, const I: usize> WrBatch<N, S, I> {
    fn new(ex: QpEx) -> Self {
        Self {
            wr_id: 0,
            wr_flags: SendFlags::default(),
            ex,
            pending: heapless::Vec::new(),
            inline: [0; I],
            inline_used: 0,
            err: None,
        }
    }

    /// Requests in the batch.
    pub fn len(&self) -> usize {
        self.pending.len()
    }

    /// Whether the batch holds no request.
    pub fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }

    /// The first error a call met, which `wr_complete` will return.
    pub fn error(&self) -> Option<QpExError> {
        self.err
    }

    fn fail(&mut self, e: QpExError) {
        self.err.get_or_insert(e);
    }

    /// Begins a request of `op`, which needs `need` among the QP's send ops.
    fn begin(&mut self, op: SendOp, need: SendOpsFlags, name: &'static str) {
        if self.err.is_some() {
            return;
        }
        if !self.ex.send_ops.contains(need) {
            return self.fail(QpExError::OpNotEnabled { op: name });
        }
        let p = Pending {
            wr_id: self.wr_id,
            flags: self.wr_flags,
            op,
            sge: [Sge::default(); S],
            nsge: 0,
            inline: None,
            ud: None,
        };
        if self.pending.push(p).is_err() {
            self.fail(QpExError::BatchFull { max: N });
        }
    }

    /// The request the `wr_set_*` calls apply to: the last one begun.
    fn last(&mut self, call: &'static str) -> Option<&mut Pending<S>> {
        if self.err.is_some() {
            return None;
        }
        if self.pending.is_empty() {
            self.fail(QpExError::NoWorkRequest { call });
            return None;
        }
        self.pending.last_mut()
    }

    /// `ibv_wr_send`.
    pub fn wr_send(&mut self) {
        self.begin(SendOp::Send, SendOpsFlags::SEND, "wr_send");
    }

    /// `ibv_wr_send_imm`: `imm` in network byte order, as `ibv_send_wr.imm_data`.
    pub fn wr_send_imm(&mut self, imm: u32) {
        self.begin(SendOp::SendImm { imm }, SendOpsFlags::SEND_WITH_IMM, "wr_send_imm");
    }

    /// `ibv_wr_rdma_write`.
    pub fn wr_rdma_write(&mut self, rkey: u32, remote_addr: u64) {
        self.begin(SendOp::RdmaWrite { remote_addr, rkey }, SendOpsFlags::RDMA_WRITE, "wr_rdma_write");
    }

    /// `ibv_wr_rdma_write_imm`.
    pub fn wr_rdma_write_imm(&mut self, rkey: u32, remote_addr: u64, imm: u32) {
        let op = SendOp::RdmaWriteImm { remote_addr, rkey, imm };
        self.begin(op, SendOpsFlags::RDMA_WRITE_WITH_IMM, "wr_rdma_write_imm");
    }

    /// `ibv_wr_rdma_read`.
    pub fn wr_rdma_read(&mut self, rkey: u32, remote_addr: u64) {
        self.begin(SendOp::RdmaRead { remote_addr, rkey }, SendOpsFlags::RDMA_READ, "wr_rdma_read");
    }

    /// `ibv_wr_atomic_cmp_swp`: the original value lands in the request's 8-byte SGE.
    pub fn wr_atomic_cmp_swp(&mut self, rkey: u32, remote_addr: u64, compare: u64, swap: u64) {
        let op = SendOp::AtomicCmpSwp { remote_addr, rkey, compare, swap };
        self.begin(op, SendOpsFlags::ATOMIC_CMP_AND_SWP, "wr_atomic_cmp_swp");
    }

    /// `ibv_wr_atomic_fetch_add`.
    pub fn wr_atomic_fetch_add(&mut self, rkey: u32, remote_addr: u64, add: u64) {
        let op = SendOp::AtomicFetchAdd { remote_addr, rkey, add };
        self.begin(op, SendOpsFlags::ATOMIC_FETCH_AND_ADD, "wr_atomic_fetch_add");
    }

    /// `ibv_wr_set_sge`: the last request's data is one buffer.
    pub fn wr_set_sge(&mut self, lkey: u32, addr: u64, length: u32) {
        self.wr_set_sge_list(&[Sge { addr, length, lkey }]);
    }

    /// `ibv_wr_set_sge_list`: the last request's data is these buffers (replacing any set before).
    pub fn wr_set_sge_list(&mut self, sges: &[Sge]) {
        let Some(p) = self.last("wr_set_sge_list") else { return };
        match p.sge.get_mut(..sges.len()) {
            Some(dst) => {
                dst.copy_from_slice(sges);
                p.nsge = sges.len();
                p.inline = None;
            }
            None => self.fail(QpExError::TooManySge { sge: sges.len(), max: S }),
        }
    }

    /// `ibv_wr_set_inline_data`: the last request carries these bytes in its WQE. They are copied now, so the
    /// buffer is free again when the call returns.
    pub fn wr_set_inline_data(&mut self, data: &[u8]) {
        let used = self.inline_used;
        let left = I - used;
        if self.err.is_none() && data.len() > left {
            return self.fail(QpExError::InlineFull { bytes: data.len(), left });
        }
        let Some(p) = self.last("wr_set_inline_data") else { return };
        p.inline = Some((used, data.len()));
        p.nsge = 0;
        self.inline[used..used + data.len()].copy_from_slice(data);
        self.inline_used = used + data.len();
    }

    /// `ibv_wr_set_ud_addr`: the last request goes to QP `remote_qpn` at `ah` (the handle is copied).
    pub fn wr_set_ud_addr(&mut self, ah: &Ah, remote_qpn: u32, remote_qkey: u32) {
        let Some(p) = self.last("wr_set_ud_addr") else { return };
        p.ud = Some((*ah, remote_qpn, remote_qkey));
    }

    /// `ibv_wr_abort`: drops every request of the batch; nothing was posted.
    pub fn wr_abort(self) {}

    /// `ibv_wr_complete` through `post`, which receives the batch as ordinary send work requests (one call, one
    /// doorbell). An error met by an earlier call is returned and nothing is posted.
    pub fn wr_complete_with(self, post: impl FnOnce(&[SendWr<'_>]) -> Result<(), PostError>) -> Result<(), QpExError> {
        if let Some(e) = self.err {
            return Err(e);
        }
        let mut wrs: heapless::Vec<SendWr<'_>, N> = heapless::Vec::new();
        for p in &self.pending {
            let wr = SendWr {
                wr_id: p.wr_id,
                op: p.op,
                sg_list: &p.sge[..p.nsge],
                flags: p.flags,
                inline: p.inline.map(|(off, len)| &self.inline[off..off + len]),
                ud: p.ud.as_ref().map(|(ah, remote_qpn, remote_qkey)| UdDest {
                    ah,
                    remote_qpn: *remote_qpn,
                    remote_qkey: *remote_qkey,
                }),
            };
            // Capacity N, as the pending list: never full here.
            let _ = wrs.push(wr);
        }
        if wrs.is_empty() {
            return Ok(());
        }
        post(&wrs).map_err(QpExError::Post)
    }

    /// `ibv_wr_complete` on `qp` directly (one [`Qp::post_send`]).
    pub fn wr_complete<M: Mmio + ?Sized>(self, qp: &mut Qp, mmio: &M) -> Result<(), QpExError> {
        self.wr_complete_with(|wrs| qp.post_send(mmio, wrs))
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn send_ops_are_checked_per_qp_type_at_create_time() {
        let all_rc = SendOpsFlags::supported(QpType::Rc);
        assert!(QpEx::new(QpType::Rc, all_rc).is_ok());
        assert_eq!(
            QpEx::new(QpType::Ud, SendOpsFlags::SEND | SendOpsFlags::RDMA_WRITE),
            Err(QpExError::UnsupportedSendOps { bits: SendOpsFlags::RDMA_WRITE.0 })
        );
        assert_eq!(
            QpEx::new(QpType::Uc, SendOpsFlags::RDMA_READ),
            Err(QpExError::UnsupportedSendOps { bits: SendOpsFlags::RDMA_READ.0 })
        );
        assert!(QpEx::new(QpType::Rc, SendOpsFlags::BIND_MW).is_err());
    }

    #[test]
    fn the_batch_becomes_one_post_of_ordinary_work_requests() {
        let ex = QpEx::new(QpType::Rc, SendOpsFlags::SEND | SendOpsFlags::RDMA_WRITE).unwrap();
        let mut b = ex.wr_start();
        b.wr_id = 7;
        b.wr_flags = SendFlags::SIGNALED;
        b.wr_rdma_write(0x55, 0x1000);
        b.wr_set_sge(0x11, 0x2000, 64);
        b.wr_id = 8;
        b.wr_flags = SendFlags::default();
        b.wr_send();
        let mut data = [1u8, 2, 3];
        b.wr_set_inline_data(&data);
        // The caller may reuse the buffer at once.
        data[0] = 9;
        assert_eq!(data, [9, 2, 3]);
        let mut calls = 0;
        b.wr_complete_with(|wrs| {
            calls += 1;
            assert_eq!(wrs.len(), 2);
            assert_eq!(
                (wrs[0].wr_id, wrs[0].flags, wrs[0].op),
                (7, SendFlags::SIGNALED, SendOp::RdmaWrite { remote_addr: 0x1000, rkey: 0x55 })
            );
            assert_eq!(wrs[0].sg_list, &[Sge { addr: 0x2000, length: 64, lkey: 0x11 }]);
            assert_eq!(
                (wrs[1].wr_id, wrs[1].op, wrs[1].inline, wrs[1].sg_list.len()),
                (8, SendOp::Send, Some(&[1u8, 2, 3][..]), 0)
            );
            Ok(())
        })
        .unwrap();
        assert_eq!(calls, 1);
    }

    #[test]
    fn errors_are_kept_and_nothing_is_posted() {
        let ex = QpEx::new(QpType::Rc, SendOpsFlags::SEND).unwrap();
        let mut b = ex.wr_start();
        b.wr_send();
        b.wr_rdma_read(1, 2);
        b.wr_send();
        assert_eq!(b.error(), Some(QpExError::OpNotEnabled { op: "wr_rdma_read" }));
        let r = b.wr_complete_with(|_| panic!("nothing may be posted after an error"));
        assert_eq!(r, Err(QpExError::OpNotEnabled { op: "wr_rdma_read" }));

        let mut b = ex.wr_start();
        b.wr_set_sge(1, 2, 3);
        assert_eq!(b.error(), Some(QpExError::NoWorkRequest { call: "wr_set_sge_list" }));

        let mut b = ex.wr_start_with::<2, 1, 4>();
        b.wr_send();
        b.wr_set_sge_list(&[Sge::default(); 2]);
        assert_eq!(b.error(), Some(QpExError::TooManySge { sge: 2, max: 1 }));
        let mut b = ex.wr_start_with::<2, 1, 4>();
        b.wr_send();
        b.wr_set_inline_data(&[0; 5]);
        assert_eq!(b.error(), Some(QpExError::InlineFull { bytes: 5, left: 4 }));
        let mut b = ex.wr_start_with::<2, 1, 4>();
        b.wr_send();
        b.wr_send();
        b.wr_send();
        assert_eq!(b.error(), Some(QpExError::BatchFull { max: 2 }));
        // An aborted or empty batch posts nothing.
        ex.wr_start().wr_abort();
        ex.wr_start().wr_complete_with(|_| panic!("empty")).unwrap();
    }
}
