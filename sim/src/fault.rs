//! Faults on the objects the datapath runs, injected by tests at any moment: a QP's catastrophic error.

use mlx5_core::prm::{c, consts};

use crate::eq::EQE_DATA_LEN;
use crate::qp::QpState;
use crate::{lock, SimDevice};

impl SimDevice {
    /// A catastrophic error on QP `qpn`, as firmware reports a work-queue fault it found: the QP moves to ERR (the
    /// datapath then flushes its outstanding work requests, as for any QP in ERR) and a `WQ_CATAS_ERROR` event
    /// naming it goes to the EQ subscribed to that event. Returns `false`, changing nothing, when there is no such
    /// QP or the device is dead or gone.
    pub fn fail_qp(&self, qpn: u32) -> bool {
        {
            let mut st = lock(&self.shared);
            if st.dead() {
                return false;
            }
            let Some(qp) = st.fw.qps.get_mut(&qpn) else { return false };
            qp.state = QpState::Err;
            let q = c::mlx5_eqe_qp_srq::QP_SRQ_N;
            let mut data = [0u8; EQE_DATA_LEN];
            data[c::mlx5_eqe_qp_srq::TYPE.off] = consts::MLX5_EVENT_QUEUE_TYPE_QP;
            data[q.off..q.off + q.len].copy_from_slice(&(qpn & 0xff_ffff).to_be_bytes());
            // No EQ subscribed (or a full one, which kills the firmware): the QP is in ERR all the same.
            let _ = st.post_eqe(consts::MLX5_EVENT_TYPE_WQ_CATAS_ERROR as u8, 0, &data);
        }
        // The device runs now, as after any state change: in-line mode flushes the QP at once.
        self.shared.run(true);
        true
    }
}

#[cfg(test)]
mod tests {
    use crate::{SimDevice, SimEvent};

    #[test]
    fn failing_an_unknown_qp_or_on_a_dead_device_changes_nothing() {
        let dev = SimDevice::default();
        assert!(!dev.fail_qp(0x1234));
        dev.stall_health();
        assert!(!dev.fail_qp(0x1234));
        assert!(!dev.events().iter().any(|e| matches!(e, SimEvent::Eqe { .. })));
    }
}
