//! Queue counter sets: ALLOC_Q_COUNTER / DEALLOC_Q_COUNTER / QUERY_Q_COUNTER (what mlx5_ib's
//! `mlx5_ib_alloc_counters` allocates per port and every QP names in RST2INIT). The transport counts into the
//! set of the QP a packet concerns.

use std::collections::BTreeMap;

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf};

use super::caps::Caps;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// What one set counts (a subset of `query_q_counter_out`, the ones the simulated transport sees happen).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct QCounterValues {
    /// RDMA WRITE requests executed as a responder.
    pub(crate) rx_write_requests: u32,
    /// RDMA READ requests executed as a responder.
    pub(crate) rx_read_requests: u32,
    /// Atomic requests executed as a responder.
    pub(crate) rx_atomic_requests: u32,
    /// SENDs answered with an RNR NAK: no receive WQE was posted.
    pub(crate) out_of_buffer: u32,
    /// Requests NAKed for a PSN ahead of the expected one.
    pub(crate) out_of_sequence: u32,
    /// Duplicate requests answered again.
    pub(crate) duplicate_request: u32,
}

/// The allocated counter sets by id (1 up to `max_qp_cnt`; 0 is no set).
#[derive(Debug, Default)]
pub(crate) struct QCounterTable {
    sets: BTreeMap<u8, QCounterValues>,
}

impl QCounterTable {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Whether a QP may name `id`: 0 (no set) or an allocated one.
    pub(crate) fn valid(&self, id: u8) -> bool {
        id == 0 || self.sets.contains_key(&id)
    }

    /// Counts into set `id` when it exists (a QP without a set counts nowhere).
    pub(crate) fn count(&mut self, id: u8, f: impl FnOnce(&mut QCounterValues)) {
        if let Some(v) = self.sets.get_mut(&id) {
            f(v);
        }
    }

    pub(crate) fn alloc(&mut self, caps: &Caps, out: &mut [u8]) -> Result<(), CmdErr> {
        let max = caps.gen(ifc::cmd_hca_cap::MAX_QP_CNT).min(255) as u8;
        let id = (1..=max).find(|i| !self.sets.contains_key(i)).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.sets.insert(id, QCounterValues::default());
        out.set(ifc::alloc_q_counter_out::COUNTER_SET_ID, id.into());
        Ok(())
    }

    /// Firmware refuses to free a set a QP still names.
    pub(crate) fn dealloc(&mut self, in_use: &dyn Fn(u8) -> bool, inp: &[u8]) -> Result<(), CmdErr> {
        let id = rd(inp, ifc::dealloc_q_counter_in::COUNTER_SET_ID) as u8;
        if !self.sets.contains_key(&id) {
            return Err(bad_param(syndrome::Q_COUNTER_INVALID));
        }
        if in_use(id) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.sets.remove(&id);
        Ok(())
    }

    pub(crate) fn query(&mut self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::query_q_counter_out as o;
        let id = rd(inp, ifc::query_q_counter_in::COUNTER_SET_ID) as u8;
        if rd(inp, ifc::query_q_counter_in::OTHER_VPORT) != 0 || rd(inp, ifc::query_q_counter_in::AGGREGATE) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let v = self.sets.get_mut(&id).ok_or(bad_param(syndrome::Q_COUNTER_INVALID))?;
        out.set(o::RX_WRITE_REQUESTS, v.rx_write_requests);
        out.set(o::RX_READ_REQUESTS, v.rx_read_requests);
        out.set(o::RX_ATOMIC_REQUESTS, v.rx_atomic_requests);
        out.set(o::OUT_OF_BUFFER, v.out_of_buffer);
        out.set(o::OUT_OF_SEQUENCE, v.out_of_sequence);
        out.set(o::DUPLICATE_REQUEST, v.duplicate_request);
        if rd(inp, ifc::query_q_counter_in::CLEAR) != 0 {
            *v = QCounterValues::default();
        }
        Ok(())
    }
}
