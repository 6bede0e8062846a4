//! Shared pieces of the fuzz targets: from the simulator's test kit, a BAR that is plain memory ([`RegFile`]) with
//! hooks that let a target play the device and heap DMA memory with bus addresses ([`HeapDma`], as a bounded pool:
//! `HeapDma::for_fuzzing`); here, a virtual-time delay ([`VDelay`]), a work-request table that records what the CQ
//! decoder asked ([`Table`]), and checks shared by several targets.
//!
//! Everything here is single-threaded and deterministic: one fuzz input always runs the same way.
#![deny(clippy::undocumented_unsafe_blocks)]

use mlx5_core::cq::{WcFlags, WcOpcode, WcStatus, WorkCompletion, WrTable};
use mlx5_core::hal::DelayNs;

pub use libfuzzer_sys::arbitrary::Unstructured;
pub use mlx5_sim::testkit::{HeapDma, RegFile, Write, BAR_LEN, UAR_OFF};

/// A delay that only counts (virtual time), so waits cost nothing and are measured exactly.
#[derive(Debug, Default)]
pub struct VDelay {
    pub ns: u64,
}

impl DelayNs for VDelay {
    fn delay_ns(&mut self, ns: u32) {
        self.ns += u64::from(ns);
    }
}

/// What the CQ decoder asked a [`Table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lookup {
    pub send: bool,
    pub qpn: u32,
    pub wqe_counter: u16,
    /// What the table answered.
    pub answer: Option<u64>,
}

/// A work-request table for the CQ decoder: QPs in `known` (all of them when `all_known`) answer with a fresh,
/// never-repeated `wr_id` per lookup; every lookup is recorded.
#[derive(Debug, Default)]
pub struct Table {
    pub known: Vec<u32>,
    pub all_known: bool,
    pub lookups: Vec<Lookup>,
    next: u64,
}

impl Table {
    /// Answers for the QPs in `known`, or for every QP when `all_known`.
    pub fn new(known: Vec<u32>, all_known: bool) -> Self {
        Self { known, all_known, lookups: Vec::new(), next: 0 }
    }

    fn answer(&mut self, send: bool, qpn: u32, wqe_counter: u16) -> Option<u64> {
        let answer = (self.all_known || self.known.contains(&qpn)).then(|| {
            self.next += 1;
            // Distinct from every small number a decoder could make up, and never repeated.
            0x5eed_0000_0000_0000 | self.next
        });
        self.lookups.push(Lookup { send, qpn, wqe_counter, answer });
        answer
    }
}

impl WrTable for Table {
    fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
        self.answer(true, qpn, wqe_counter)
    }
    fn recv_done(&mut self, qpn: u32, _srqn: u32, wqe_counter: u16) -> Option<u64> {
        self.answer(false, qpn, wqe_counter)
    }
    fn flush_one(&mut self, _cqn: u32, _dead: bool) -> Option<WorkCompletion> {
        // The targets decode CQEs; software completions are the soak's and the flush tests' business.
        None
    }
}

/// Every `ibv_wc_flags` bit the decoder may set.
pub const KNOWN_WC_FLAGS: u32 = WcFlags::GRH.0 | WcFlags::WITH_IMM.0 | WcFlags::WITH_INV.0 | WcFlags::IP_CSUM_OK.0;

/// Properties every work completion has, whatever CQE it came from.
pub fn assert_wc_well_formed(wc: &WorkCompletion) {
    assert!(wc.qp_num <= 0xff_ffff, "qp_num {:#x} wider than 24 bits", wc.qp_num);
    assert!(wc.src_qp <= 0xff_ffff, "src_qp {:#x} wider than 24 bits", wc.src_qp);
    assert_eq!(wc.wc_flags.0 & !KNOWN_WC_FLAGS, 0, "unknown wc_flags {:#x}", wc.wc_flags.0);
    assert!(wc.vlan_id.unwrap_or(0) <= 0xfff, "vlan_id {:?}", wc.vlan_id);
    assert!(wc.sl <= 0xf, "sl {}", wc.sl);
    assert_eq!(wc.pkey_index, 0);
    if wc.status != WcStatus::Success {
        // An error completion carries only wr_id, status, vendor_err and qp_num.
        assert_eq!(
            (wc.opcode, wc.byte_len, wc.wc_flags, wc.imm_data, wc.src_qp),
            (WcOpcode::default(), 0, WcFlags::default(), 0, 0),
            "error completion with data: {wc:?}"
        );
    } else {
        assert_eq!(wc.vendor_err, 0);
    }
    if !wc.wc_flags.contains(WcFlags::WITH_IMM) {
        assert_eq!(wc.imm_data, 0, "immediate data without WITH_IMM: {wc:?}");
    }
    if !wc.wc_flags.contains(WcFlags::WITH_INV) {
        assert_eq!(wc.invalidated_rkey, 0, "invalidated rkey without WITH_INV: {wc:?}");
    }
}

/// An integer in `range` from the input (the range's start when the input is used up).
pub fn int<T>(u: &mut Unstructured<'_>, range: std::ops::RangeInclusive<T>) -> T
where
    T: libfuzzer_sys::arbitrary::unstructured::Int + Copy,
{
    let lo = *range.start();
    u.int_in_range(range).unwrap_or(lo)
}

/// `n` bytes from the input, zero-padded when it runs out.
pub fn bytes<const N: usize>(u: &mut Unstructured<'_>) -> [u8; N] {
    let mut b = [0u8; N];
    let avail = u.len().min(N);
    if let Ok(s) = u.bytes(avail) {
        b[..avail].copy_from_slice(s);
    }
    b
}

pub fn flag(u: &mut Unstructured<'_>) -> bool {
    u.arbitrary::<bool>().unwrap_or(false)
}
