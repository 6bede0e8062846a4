//! The extended CQ's polling model (`ibv_create_cq_ex` with `wc_flags`, `ibv_cq_ex`: `start_poll`, `next_poll`,
//! `end_poll` and the `ibv_wc_read_*` accessors), on top of the ordinary poll ([`Cq::poll`] or
//! [`poll_cq_with`](crate::hca::poll_cq_with), so flushes of a dead device come the same way).
//!
//! `start_poll` takes the oldest completion (or reports the CQ empty, rdma-core's `ENOENT`), `next_poll` the
//! next, and the `read_*` calls read the current one's fields. Each completion is taken with a one-entry poll,
//! which publishes the consumer index as it goes (rdma-core publishes it at `end_poll`; the device only sees the
//! entries freed earlier). A field outside the CQ's `wc_flags` reads as `None`: in C its accessor is absent.
//! No allocation.

use super::ring::Cq;
use super::wc::{CqeError, WcFlags, WcOpcode, WcStatus, WorkCompletion, WrTable};
use crate::hal::Mmio;

/// `ibv_create_cq_wc_flags` (`IBV_WC_EX_WITH_*`): the fields an extended CQ's completions carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WcExFlags(pub u64);

impl WcExFlags {
    /// `IBV_WC_EX_WITH_BYTE_LEN`.
    pub const BYTE_LEN: WcExFlags = WcExFlags(1 << 0);
    /// `IBV_WC_EX_WITH_IMM` (also the invalidated rkey).
    pub const IMM: WcExFlags = WcExFlags(1 << 1);
    /// `IBV_WC_EX_WITH_QP_NUM`.
    pub const QP_NUM: WcExFlags = WcExFlags(1 << 2);
    /// `IBV_WC_EX_WITH_SRC_QP`.
    pub const SRC_QP: WcExFlags = WcExFlags(1 << 3);
    /// `IBV_WC_EX_WITH_SLID`.
    pub const SLID: WcExFlags = WcExFlags(1 << 4);
    /// `IBV_WC_EX_WITH_SL`.
    pub const SL: WcExFlags = WcExFlags(1 << 5);
    /// `IBV_WC_EX_WITH_DLID_PATH_BITS`.
    pub const DLID_PATH_BITS: WcExFlags = WcExFlags(1 << 6);
    /// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP`: the CQE's raw device clock.
    pub const COMPLETION_TIMESTAMP: WcExFlags = WcExFlags(1 << 7);
    /// `IBV_WC_EX_WITH_CVLAN`.
    pub const CVLAN: WcExFlags = WcExFlags(1 << 8);
    /// `IBV_WC_EX_WITH_FLOW_TAG` (not supported here: no flow steering).
    pub const FLOW_TAG: WcExFlags = WcExFlags(1 << 9);
    /// `IBV_WC_EX_WITH_TM_INFO` (not supported here: no tag matching).
    pub const TM_INFO: WcExFlags = WcExFlags(1 << 10);
    /// `IBV_WC_EX_WITH_COMPLETION_TIMESTAMP_WALLCLOCK` (not supported here: needs the device's real-time clock).
    pub const COMPLETION_TIMESTAMP_WALLCLOCK: WcExFlags = WcExFlags(1 << 11);

    /// The `IBV_WC_STANDARD_FLAGS` set (`ibv_create_cq` gives every field of `ibv_wc`).
    pub const STANDARD: WcExFlags = WcExFlags(
        Self::BYTE_LEN.0
            | Self::IMM.0
            | Self::QP_NUM.0
            | Self::SRC_QP.0
            | Self::SLID.0
            | Self::SL.0
            | Self::DLID_PATH_BITS.0,
    );

    /// What this driver can report: the standard fields, the completion timestamp and the VLAN.
    pub const SUPPORTED: WcExFlags = WcExFlags(Self::STANDARD.0 | Self::COMPLETION_TIMESTAMP.0 | Self::CVLAN.0);

    /// Whether every flag of `o` is set.
    pub const fn contains(self, o: WcExFlags) -> bool {
        self.0 & o.0 == o.0
    }
}

impl core::ops::BitOr for WcExFlags {
    type Output = WcExFlags;
    fn bitor(self, o: WcExFlags) -> WcExFlags {
        WcExFlags(self.0 | o.0)
    }
}

/// What takes completions for an extended CQ: a one-entry poll (`Cq::poll`, `poll_cq_with`, or a host's locked
/// poll).
pub trait ExPoller: FnMut(&mut [WorkCompletion]) -> Result<usize, CqeError> {}

impl<F: FnMut(&mut [WorkCompletion]) -> Result<usize, CqeError>> ExPoller for F {}

/// `wc_flags` asks for fields this driver cannot report (`EOPNOTSUPP` from `ibv_create_cq_ex`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct UnsupportedWcFlags {
    /// The bits not supported.
    pub bits: u64,
}

impl core::fmt::Display for UnsupportedWcFlags {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "wc_flags {:#x} not supported", self.bits)
    }
}

impl core::error::Error for UnsupportedWcFlags {}

/// The creation-time model of an extended CQ: which fields its completions carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqEx {
    wc_flags: WcExFlags,
}

impl CqEx {
    /// Checks `wc_flags` (`mlx5_create_cq_ex`'s check against what the provider supports).
    pub fn new(wc_flags: WcExFlags) -> Result<Self, UnsupportedWcFlags> {
        let extra = wc_flags.0 & !WcExFlags::SUPPORTED.0;
        if extra != 0 {
            return Err(UnsupportedWcFlags { bits: extra });
        }
        Ok(Self { wc_flags })
    }

    /// The fields the completions carry.
    pub fn wc_flags(&self) -> WcExFlags {
        self.wc_flags
    }

    /// `ibv_start_poll` with `poll` taking completions (a one-entry slice each time): `Ok(None)` when the CQ is
    /// empty (`ENOENT`), else a cursor on the oldest completion.
    pub fn start_poll<P: ExPoller>(&self, mut poll: P) -> Result<Option<ExPoll<P>>, CqeError> {
        let mut one = [WorkCompletion::default()];
        if poll(&mut one)? == 0 {
            return Ok(None);
        }
        Ok(Some(ExPoll { flags: self.wc_flags, poll, cur: one[0] }))
    }

    /// [`CqEx::start_poll`] on a ring directly ([`Cq::poll`] with `wq` mapping CQEs to work requests).
    pub fn start_poll_cq<'a, M: Mmio + ?Sized, W: WrTable + ?Sized>(
        &self,
        cq: &'a mut Cq,
        mmio: &'a M,
        wq: &'a mut W,
    ) -> Result<Option<ExPoll<impl ExPoller + 'a>>, CqeError> {
        self.start_poll(move |wc: &mut [WorkCompletion]| cq.poll(mmio, wq, wc))
    }
}

/// An extended CQ between `start_poll` and `end_poll`: the current completion and the way to the next.
pub struct ExPoll<P> {
    flags: WcExFlags,
    poll: P,
    cur: WorkCompletion,
}

impl<P> core::fmt::Debug for ExPoll<P> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ExPoll").field("flags", &self.flags).field("cur", &self.cur).finish_non_exhaustive()
    }
}

impl<P: ExPoller> ExPoll<P> {
    /// `ibv_next_poll`: `Ok(false)` when the CQ is empty (`ENOENT`; the cursor stays on the last completion).
    pub fn next_poll(&mut self) -> Result<bool, CqeError> {
        let mut one = [WorkCompletion::default()];
        if (self.poll)(&mut one)? == 0 {
            return Ok(false);
        }
        self.cur = one[0];
        Ok(true)
    }

    /// `ibv_end_poll`: ends the poll (the poller is dropped with it).
    pub fn end_poll(self) {}

    /// Ends the poll and gives the poller back.
    pub fn into_poller(self) -> P {
        self.poll
    }
}

impl<P> ExPoll<P> {
    fn field<T>(&self, f: WcExFlags, v: T) -> Option<T> {
        self.flags.contains(f).then_some(v)
    }

    /// `ibv_cq_ex.wr_id`.
    pub fn wr_id(&self) -> u64 {
        self.cur.wr_id
    }

    /// `ibv_cq_ex.status`.
    pub fn status(&self) -> WcStatus {
        self.cur.status
    }

    /// `ibv_wc_read_opcode`.
    pub fn read_opcode(&self) -> WcOpcode {
        self.cur.opcode
    }

    /// `ibv_wc_read_vendor_err`.
    pub fn read_vendor_err(&self) -> u32 {
        self.cur.vendor_err
    }

    /// `ibv_wc_read_wc_flags` (`IBV_WC_*` bits).
    pub fn read_wc_flags(&self) -> WcFlags {
        self.cur.wc_flags
    }

    /// `ibv_wc_read_byte_len`.
    pub fn read_byte_len(&self) -> Option<u32> {
        self.field(WcExFlags::BYTE_LEN, self.cur.byte_len)
    }

    /// `ibv_wc_read_imm_data`, network byte order (valid with `WcFlags::WITH_IMM`).
    pub fn read_imm_data(&self) -> Option<u32> {
        self.field(WcExFlags::IMM, self.cur.imm_data)
    }

    /// `ibv_wc_read_invalidated_rkey` (valid with `WcFlags::WITH_INV`; carried under `IBV_WC_EX_WITH_IMM`).
    pub fn read_invalidated_rkey(&self) -> Option<u32> {
        self.field(WcExFlags::IMM, self.cur.invalidated_rkey)
    }

    /// `ibv_wc_read_qp_num`.
    pub fn read_qp_num(&self) -> Option<u32> {
        self.field(WcExFlags::QP_NUM, self.cur.qp_num)
    }

    /// `ibv_wc_read_src_qp`.
    pub fn read_src_qp(&self) -> Option<u32> {
        self.field(WcExFlags::SRC_QP, self.cur.src_qp)
    }

    /// `ibv_wc_read_slid`.
    pub fn read_slid(&self) -> Option<u16> {
        self.field(WcExFlags::SLID, self.cur.slid)
    }

    /// `ibv_wc_read_sl`.
    pub fn read_sl(&self) -> Option<u8> {
        self.field(WcExFlags::SL, self.cur.sl)
    }

    /// `ibv_wc_read_dlid_path_bits`.
    pub fn read_dlid_path_bits(&self) -> Option<u8> {
        self.field(WcExFlags::DLID_PATH_BITS, self.cur.dlid_path_bits)
    }

    /// `ibv_wc_read_completion_ts`: the CQE's raw device clock (0 for an error CQE or a software flush).
    pub fn read_completion_ts(&self) -> Option<u64> {
        self.field(WcExFlags::COMPLETION_TIMESTAMP, self.cur.timestamp)
    }

    /// `ibv_wc_read_cvlan`: the VLAN tag of a tagged RoCE receive, 0 when untagged.
    pub fn read_cvlan(&self) -> Option<u16> {
        self.field(WcExFlags::CVLAN, self.cur.vlan_id.unwrap_or(0))
    }

    /// The whole current completion, as `ibv_poll_cq` would have returned it.
    pub fn completion(&self) -> &WorkCompletion {
        &self.cur
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    fn wcs() -> [WorkCompletion; 2] {
        let a = WorkCompletion {
            wr_id: 1,
            opcode: WcOpcode::Recv,
            byte_len: 64,
            qp_num: 0x12,
            src_qp: 0x34,
            slid: 5,
            sl: 2,
            dlid_path_bits: 1,
            timestamp: 999,
            vlan_id: Some(7),
            ..WorkCompletion::default()
        };
        let b =
            WorkCompletion { wr_id: 2, status: WcStatus::WrFlushErr, vendor_err: 0x99, ..WorkCompletion::default() };
        [a, b]
    }

    #[test]
    fn start_next_end_walk_the_completions_in_order() {
        let src = wcs();
        let mut i = 0;
        let poll = |wc: &mut [WorkCompletion]| {
            assert_eq!(wc.len(), 1);
            Ok(match src.get(i) {
                Some(w) => {
                    wc[0] = *w;
                    i += 1;
                    1
                }
                None => 0,
            })
        };
        let ex = CqEx::new(WcExFlags::STANDARD | WcExFlags::COMPLETION_TIMESTAMP).unwrap();
        let mut p = ex.start_poll(poll).unwrap().expect("a completion");
        assert_eq!((p.wr_id(), p.status(), p.read_opcode()), (1, WcStatus::Success, WcOpcode::Recv));
        assert_eq!((p.read_byte_len(), p.read_qp_num(), p.read_src_qp()), (Some(64), Some(0x12), Some(0x34)));
        assert_eq!((p.read_slid(), p.read_sl(), p.read_dlid_path_bits()), (Some(5), Some(2), Some(1)));
        assert_eq!(p.read_completion_ts(), Some(999));
        // Not asked for at creation: absent, as the C accessor would be.
        assert_eq!(p.read_cvlan(), None);
        assert!(p.next_poll().unwrap());
        assert_eq!((p.wr_id(), p.status(), p.read_vendor_err()), (2, WcStatus::WrFlushErr, 0x99));
        assert!(!p.next_poll().unwrap());
        let mut poll = p.into_poller();
        assert_eq!(poll(&mut [WorkCompletion::default()]), Ok(0));
        // An empty CQ: ENOENT at start_poll.
        assert!(ex.start_poll(|_: &mut [WorkCompletion]| Ok(0)).unwrap().is_none());
    }

    #[test]
    fn unsupported_flags_are_refused_at_create() {
        assert_eq!(CqEx::new(WcExFlags::FLOW_TAG), Err(UnsupportedWcFlags { bits: WcExFlags::FLOW_TAG.0 }));
        assert!(CqEx::new(WcExFlags::COMPLETION_TIMESTAMP_WALLCLOCK | WcExFlags::BYTE_LEN).is_err());
        assert!(CqEx::new(WcExFlags::SUPPORTED).is_ok());
    }

    #[test]
    fn a_bad_cqe_is_an_error_of_the_poll_that_met_it() {
        let e = CqeError::BadOpcode { cqn: 1, op_own: 0xff, index: 0 };
        let ex = CqEx::new(WcExFlags::STANDARD).unwrap();
        match ex.start_poll(|_: &mut [WorkCompletion]| Err(e)) {
            Err(got) => assert_eq!(got, e),
            Ok(_) => panic!("the bad CQE must be reported"),
        }
    }
}
