//! What a test observes besides command results: [`ExecutedCmd`] (one completed command) and [`SimEvent`]
//! (everything else the device noticed), with [`RetryKind`].

/// One completed command, in completion order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutedCmd {
    pub slot: u8,
    pub opcode: u16,
    pub op_mod: u16,
    /// `mbox_out.status` (0 when delivery failed).
    pub status: u8,
    pub syndrome: u32,
    /// `MLX5_CMD_DELIVERY_STAT_*` written in `status_own >> 1`.
    pub delivery: u8,
}

/// A completed command with its messages ([`SimConfig::record_messages`](crate::SimConfig::record_messages)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CmdMessage {
    pub cmd: ExecutedCmd,
    /// The whole input (inline part and mailboxes), as delivered.
    pub input: Vec<u8>,
    /// The output as written back (`None` when delivery failed and nothing was executed).
    pub output: Option<Vec<u8>>,
}

/// Things the device noticed that are not command completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimEvent {
    /// `cmdq_addr_l_sz` was written: the command queue now lives at `iova`.
    CmdqAddress { iova: u64 },
    /// A doorbell rang before a command queue address was set.
    DoorbellNoQueue { mask: u32 },
    /// A doorbell bit beyond the queue size.
    DoorbellBadSlot { slot: u8 },
    /// A doorbell for a slot whose owner bit is software's: ignored.
    DoorbellNotOwned { slot: u8 },
    /// The entry of a rung slot was not in live DMA memory (also in `dma_faults`).
    EntryUnreadable { slot: u8, iova: u64 },
    /// Writing a completion failed on a DMA fault (also in `dma_faults`).
    CompletionUnwritable { slot: u8 },
    /// A command held by [`Fault::Hang`](crate::fault::Fault::Hang).
    Hung { slot: u8, opcode: u16 },
    /// A command postponed by [`Fault::Delay`](crate::fault::Fault::Delay).
    Delayed { slot: u8, opcode: u16, ms: u32 },
    /// A write to a register the simulator does not model (or beyond the BAR); it had no effect.
    IgnoredWrite { off: usize, val: u32 },
    /// A 32-bit write into a UAR page that is no doorbell.
    UarWrite { off: usize, val: u32 },
    /// A 64-bit write into a UAR page that is no doorbell (one access, as the bus carries it).
    UarWrite64 { off: usize, val: u64 },
    /// The host freed a region that still contained pages given to firmware.
    FreedDeviceOwned { iova: u64, len: usize, pages: usize },
    /// `Dma::free` of something that is not a live region (double free or a forged region); nothing was freed.
    BadFree { iova: u64, len: usize },
    /// TEARDOWN_HCA while objects were still alive; they were destroyed with it.
    TeardownWithObjects { objects: usize },
    /// DISABLE_HCA while firmware still owned pages; disabling the function released them.
    DisableWithPages { pages: usize },
    /// The SMA behind MAD_IFC answered an SMP with a MAD status other than success (IBTA 13.4.7: 0x0004 bad
    /// version, 0x0008 unsupported method, 0x000c unsupported method/attribute, 0x001c invalid field).
    SmpStatus { attr_id: u16, method: u8, status: u16 },
    /// An EQE was posted to EQ `eqn`.
    Eqe { eqn: u8, event_type: u8, sub_type: u8 },
    /// EQ `eqn` was armed and got an EQE (or was armed with unconsumed EQEs): the interrupt fired; now disarmed.
    EqInterrupt { eqn: u8 },
    /// An EQE for a full EQ (`pi - ci == nent`): nothing was overwritten and the firmware died with
    /// `MLX5_INITIAL_SEG_HEALTH_SYNDROME_ASYNCHRONOUS_EQ_BUF_OVERRUN`.
    EqOverrun { eqn: u8 },
    /// Writing an EQE failed on a DMA fault (the buffer is no longer mapped; also in `dma_faults`). The EQE is
    /// lost and the producer index does not move.
    EqeUnwritable { eqn: u8 },
    /// A valid EQ doorbell: the consumer index is now `ci` (the full 32-bit counter, reconstructed from the 24
    /// bits written), armed when `arm`.
    EqDoorbell { eqn: u8, ci: u32, arm: bool },
    /// An EQ doorbell that was ignored: UAR page not allocated, no such EQ, EQ on another UAR page, or a consumer
    /// index beyond the producer index.
    BadEqDoorbell { off: usize, val: u32, why: &'static str },
    /// A command held by [`Fault::NeedPages`](crate::fault::Fault::NeedPages) until the driver gives `pages` pages.
    WaitingForPages { slot: u8, opcode: u16, pages: u32 },
    /// A doorbell for a slot whose command is still waiting for pages: ignored.
    DoorbellBusy { slot: u8 },
    /// The firmware died (`synd` 0: a silent stall). Nothing completes any more.
    HealthFailure { synd: u8 },
    /// A doorbell rang after the firmware died: ignored.
    DoorbellWhileDead { slot: u8 },
    /// The device left the bus.
    DeviceGone,
    /// A function-level reset ([`SimDevice::function_reset`](crate::SimDevice::function_reset)): firmware, its
    /// registers and every object started over; the host's memory stayed.
    FunctionReset,
    /// A BAR write after the device left the bus: ignored.
    WriteWhileGone { off: usize, val: u32 },
    /// A valid CQ doorbell: CQ `cqn` is armed (for solicited CQEs only when `solicited`) with arm sequence
    /// number `sn` and consumer index `ci` (24 bits, as written).
    CqDoorbell { cqn: u32, sn: u8, solicited: bool, ci: u32 },
    /// A CQ doorbell that was ignored: half a doorbell (a 32-bit write), UAR page not allocated, no such CQ, CQ
    /// on another UAR page, an unknown arm command, or a consumer index beyond the producer index. `val` is the
    /// 64-bit value (a 32-bit write's value widened).
    BadCqDoorbell { off: usize, val: u64, why: &'static str },
    /// An armed CQ got a matching CQE (or was armed with one unconsumed): a completion EQE went to EQ `eqn` and
    /// the CQ is disarmed.
    CompletionEvent { cqn: u32, eqn: u8 },
    /// A CQE for a full CQ without `oi`: nothing was written, the CQ is in overflow and a CQ-error EQE was posted.
    CqOverrun { cqn: u32 },
    /// Firmware could not read the CQ's doorbell record or write a CQE (also in `dma_faults`): the CQ is in
    /// write-fail and a CQ-error EQE was posted.
    CqWriteFail { cqn: u32 },
    /// A send doorbell (a 64-bit write at offset 0 of a BlueFlame buffer) for QP `qpn`: the device will execute
    /// its send WQEs up to producer counter `pi`, read from the doorbell record.
    SqDoorbell { qpn: u32, pi: u16 },
    /// A write to a BlueFlame register that was ignored: no such QP, QP on another UAR page, in RST or without an
    /// SQ, unmapped doorbell record, a producer counter beyond the SQ, an unaligned write, or a BlueFlame copy
    /// with no doorbell before it.
    BadSqDoorbell { off: usize, val: u64, why: &'static str },
    /// 8 bytes of a BlueFlame copy of WQE `wqe_index` of QP `qpn` were written at byte `off` of the buffer.
    BlueFlameCopy { qpn: u32, wqe_index: u16, off: u16 },
    /// The BlueFlame bytes at `off` (0: the doorbell itself) differ from WQE `wqe_index` in memory.
    BlueFlameMismatch { qpn: u32, wqe_index: u16, off: u16 },
    /// The responder `remote_qpn` had no receive WQE for the RC request of WQE `wqe_counter` of QP `qpn`.
    RnrNak { qpn: u32, wqe_counter: u16, remote_qpn: u32 },
    /// The RC request of WQE `wqe_counter` of QP `qpn` reached no QP ready to take it; its ACK timer runs.
    Unreachable { qpn: u32, wqe_counter: u16, why: &'static str },
    /// The responder `remote_qpn` answered the RC request of WQE `wqe_counter` of QP `qpn` with a PSN sequence
    /// error NAK (the two QPs' PSNs do not match); the requester retransmits.
    PsnSequenceNak { qpn: u32, wqe_counter: u16, remote_qpn: u32 },
    /// Responder QP `qpn` expected PSN `expected` and got a request at `got`, ahead of it: not executed.
    PsnSequenceError { qpn: u32, expected: u32, got: u32 },
    /// Responder QP `qpn` got a request at `psn`, behind the PSN it expects: a retransmission of a message it
    /// executed, answered again without executing it twice.
    DuplicateRequest { qpn: u32, psn: u32 },
    /// XRC target QP `qpn` got a request naming XRC SRQ `xrc_srqn`, which is not an XRC SRQ of its domain: it
    /// answers with an invalid request NAK.
    XrcRefused { qpn: u32, xrc_srqn: u32 },
    /// A peer in another process plugged into this device's link (see [`SimDevice::wire_listen`](crate::sim_device::SimDevice::wire_listen)).
    LinkUp { peer: std::net::SocketAddr },
    /// The link's far end went away (closed, or a frame that could not be read); its address is unreachable.
    LinkDown { peer: std::net::SocketAddr, why: &'static str },
    /// The VDE fabric the port was plugged into went away (its switch ended); the port's link is down.
    FabricDown { why: &'static str },
    /// QP `qpn` sent WQE `wqe_counter` again after its RNR or ACK timer expired.
    Retry { qpn: u32, wqe_counter: u16, kind: RetryKind },
    /// A UD message from QP `qpn` to QP `dqpn` was dropped (noticed by the device recording this event).
    UdDropped { qpn: u32, dqpn: u32, why: &'static str },
    /// A UC message was dropped silently: at the requester (no route; `qpn` the remote QP) or at the responder
    /// `qpn` (not ready, no receive WQE, remote write refused). The requester completed it successfully.
    UcDropped { qpn: u32, why: &'static str },
    /// A frame from a link was dropped by the RoCE port (a failed check, or nothing to deliver it to).
    FrameDropped { why: &'static str },
    /// An Ethernet send WQE failed (an error CQE with `syndrome`); the SQ went to ERR.
    EthSendError { sqn: u32, wqe_counter: u16, syndrome: u8 },
    /// A received Ethernet frame took receive WQE `wqe_counter` of RQ `rqn` and failed (an error CQE with
    /// `syndrome`): `why` says what was wrong.
    EthRecvError { rqn: u32, wqe_counter: u16, syndrome: u8, why: &'static str },
    /// QP `qpn` moved to ERR after a completion with `syndrome` (`MLX5_CQE_SYNDROME_*`).
    QpError { qpn: u32, syndrome: u8 },
    /// QP `qpn` (in ERR) completed `sq` send and `rq` receive WQEs with `WR_FLUSH_ERR`.
    Flushed { qpn: u32, sq: u32, rq: u32 },
    /// The RQ head in the doorbell record of QP `qpn` is more than the RQ size ahead of the device: ignored.
    BadRqCounter { qpn: u32, head: u16 },
}

/// Why a retry happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryKind {
    /// The request reached no ready QP: the ACK timer expired.
    Transport,
    /// The responder had no receive WQE: the RNR timer expired.
    Rnr,
}

/// What a port recovered from on a lossy wire, counted from its event log: both halves of RC, named as rdma_rxe's
/// `hw_counters` name theirs so two sides' reports read alike. The log keeps its newest events only
/// (`EVENT_LOG_MAX`), so once it dropped some (`partial`) these are lower bounds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Recoveries {
    /// Go-back-N retransmissions, after an ACK timeout or a sequence NAK (rxe: `completer_retry_err`, which
    /// counts both).
    pub retransmissions: u64,
    /// Of what started them: ACK timeouts (or a request that reached no QP).
    pub ack_timeouts: u64,
    /// Requests sent again after an RNR NAK's timer (rxe: `rcvd_rnr_err`).
    pub rnr_retries: u64,
    /// Sequence NAKs received, each answered by sending again from the NAKed PSN (rxe: `rcvd_seq_err`).
    pub sequence_naks: u64,
    /// Requests that came after a gap, NAKed and not executed (rxe: `out_of_seq_request`).
    pub out_of_sequence: u64,
    /// Requests that came again, answered again without executing them twice (rxe: `duplicate_request`).
    pub duplicate_requests: u64,
    /// The log had dropped older events: every count is a lower bound.
    pub partial: bool,
}

impl Recoveries {
    /// Counts over an event log that dropped `dropped` events before these.
    pub fn count<'a>(events: impl IntoIterator<Item = &'a SimEvent>, dropped: u64) -> Recoveries {
        let mut r = Recoveries { partial: dropped > 0, ..Recoveries::default() };
        for e in events {
            match e {
                SimEvent::Retry { kind: RetryKind::Transport, .. } => r.retransmissions += 1,
                SimEvent::Unreachable { .. } => r.ack_timeouts += 1,
                SimEvent::Retry { kind: RetryKind::Rnr, .. } => r.rnr_retries += 1,
                SimEvent::PsnSequenceNak { .. } => r.sequence_naks += 1,
                SimEvent::PsnSequenceError { .. } => r.out_of_sequence += 1,
                SimEvent::DuplicateRequest { .. } => r.duplicate_requests += 1,
                _ => {}
            }
        }
        r
    }

    /// Whether anything was recovered from.
    pub fn any(&self) -> bool {
        self.retransmissions + self.rnr_retries + self.sequence_naks + self.out_of_sequence + self.duplicate_requests
            > 0
    }
}

impl std::fmt::Display for Recoveries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{}{} retransmissions ({} ACK timeouts), {} RNR retries, {} sequence NAKs received, {} out-of-sequence \
             requests NAKed, {} duplicate requests answered again",
            if self.partial { "at least: " } else { "" },
            self.retransmissions,
            self.ack_timeouts,
            self.rnr_retries,
            self.sequence_naks,
            self.out_of_sequence,
            self.duplicate_requests
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recoveries_count_each_kind_and_say_when_the_log_was_cut() {
        let log = [
            SimEvent::Unreachable { qpn: 1, wqe_counter: 0, why: "no response before the ACK timeout" },
            SimEvent::Retry { qpn: 1, wqe_counter: 0, kind: RetryKind::Transport },
            SimEvent::Retry { qpn: 1, wqe_counter: 1, kind: RetryKind::Transport },
            SimEvent::Retry { qpn: 1, wqe_counter: 2, kind: RetryKind::Rnr },
            SimEvent::PsnSequenceNak { qpn: 1, wqe_counter: 3, remote_qpn: 2 },
            SimEvent::PsnSequenceError { qpn: 2, expected: 5, got: 7 },
            SimEvent::DuplicateRequest { qpn: 2, psn: 4 },
            SimEvent::SqDoorbell { qpn: 1, pi: 4 },
        ];
        let r = Recoveries::count(&log, 0);
        assert_eq!(
            (
                r.retransmissions,
                r.ack_timeouts,
                r.rnr_retries,
                r.sequence_naks,
                r.out_of_sequence,
                r.duplicate_requests
            ),
            (2, 1, 1, 1, 1, 1)
        );
        assert!(r.any() && !r.partial);
        assert!(!r.to_string().starts_with("at least"));
        let none = Recoveries::count(&log[7..], 3);
        assert!(!none.any() && none.partial);
        assert!(none.to_string().starts_with("at least: 0 retransmissions (0 ACK timeouts)"));
    }
}
