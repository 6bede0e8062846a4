//! Queue counters (PRM ALLOC_Q_COUNTER / DEALLOC_Q_COUNTER / QUERY_Q_COUNTER; Linux mlx5_ib `counters.c`,
//! `mlx5_ib_alloc_counters`). mlx5_ib allocates one counter set per port when the device has any
//! (`max_qp_cnt`), and every QP names it in RST2INIT (`counter_set_id`), so the port's error and retry counts
//! (`rdma statistic`, `/sys/class/infiniband/*/ports/*/hw_counters`) cover its QPs.

use crate::cmd::Simple;
use crate::cmdq::write_header;
use crate::cmdq::{CmdError, Command};
use crate::prm::{consts, ifc, Field, MsgBuf, Opcode};

/// `ALLOC_Q_COUNTER`: the output is the counter set's 8-bit id. `uid` is `MLX5_SHARED_RESOURCE_UID` on a device
/// with user contexts (`log_max_uctx`), so every context may use it, else 0 (`mlx5_ib_alloc_counters`).
pub fn alloc_q_counter(shared: bool) -> Simple {
    let uid = if shared { consts::MLX5_SHARED_RESOURCE_UID } else { 0 };
    Simple::new(Opcode::AllocQCounter, ifc::alloc_q_counter_in::SIZE_BYTES, ifc::alloc_q_counter_out::SIZE_BYTES)
        .arg(ifc::alloc_q_counter_in::UID, uid)
        .result(ifc::alloc_q_counter_out::COUNTER_SET_ID)
}

/// `DEALLOC_Q_COUNTER`.
pub fn dealloc_q_counter(counter_set_id: u8) -> Simple {
    Simple::new(Opcode::DeallocQCounter, ifc::dealloc_q_counter_in::SIZE_BYTES, ifc::dealloc_q_counter_out::SIZE_BYTES)
        .arg(ifc::dealloc_q_counter_in::COUNTER_SET_ID, counter_set_id.into())
}

/// The counters of one set, named as Linux's `hw_counters` files name them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct QCounters {
    /// RDMA WRITE requests received.
    pub rx_write_requests: u32,
    /// RDMA READ requests received.
    pub rx_read_requests: u32,
    /// Atomic requests received.
    pub rx_atomic_requests: u32,
    /// Messages dropped for want of a receive WQE (an RNR NAK was sent).
    pub out_of_buffer: u32,
    /// Packets received out of sequence.
    pub out_of_sequence: u32,
    /// Duplicate requests received.
    pub duplicate_request: u32,
    /// RNR NAKs received past the retry count.
    pub rnr_nak_retry_err: u32,
    /// PSN sequence error NAKs received.
    pub packet_seq_err: u32,
    /// Implied NAK sequence errors.
    pub implied_nak_seq_err: u32,
    /// Times the ACK timer expired.
    pub local_ack_timeout_err: u32,
    /// Responder CQEs with an error.
    pub resp_cqe_error: u32,
    /// Requester CQEs with an error.
    pub req_cqe_error: u32,
    /// Responder CQEs flushed.
    pub resp_cqe_flush_error: u32,
    /// Requester CQEs flushed.
    pub req_cqe_flush_error: u32,
}

/// `QUERY_Q_COUNTER` of one set; `clear` zeroes it after reading.
#[derive(Debug, Clone, Copy)]
pub struct QueryQCounter {
    /// The set.
    pub counter_set_id: u8,
    /// Zero the counters after reading them.
    pub clear: bool,
}

impl Command for QueryQCounter {
    type In = ifc::query_q_counter_in::Bits;
    type Out = ifc::query_q_counter_out::Bits;
    type Output = QCounters;
    fn opcode(&self) -> Opcode {
        Opcode::QueryQCounter
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::query_q_counter_in as i;
        write_header(msg, Opcode::QueryQCounter, 0);
        msg.set(i::COUNTER_SET_ID, self.counter_set_id.into());
        msg.set(i::CLEAR, self.clear.into());
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<QCounters, CmdError> {
        use ifc::query_q_counter_out as o;
        let g = |f: Field| out.get(f);
        Ok(QCounters {
            rx_write_requests: g(o::RX_WRITE_REQUESTS),
            rx_read_requests: g(o::RX_READ_REQUESTS),
            rx_atomic_requests: g(o::RX_ATOMIC_REQUESTS),
            out_of_buffer: g(o::OUT_OF_BUFFER),
            out_of_sequence: g(o::OUT_OF_SEQUENCE),
            duplicate_request: g(o::DUPLICATE_REQUEST),
            rnr_nak_retry_err: g(o::RNR_NAK_RETRY_ERR),
            packet_seq_err: g(o::PACKET_SEQ_ERR),
            implied_nak_seq_err: g(o::IMPLIED_NAK_SEQ_ERR),
            local_ack_timeout_err: g(o::LOCAL_ACK_TIMEOUT_ERR),
            resp_cqe_error: g(o::RESP_CQE_ERROR),
            req_cqe_error: g(o::REQ_CQE_ERROR),
            resp_cqe_flush_error: g(o::RESP_CQE_FLUSH_ERROR),
            req_cqe_flush_error: g(o::REQ_CQE_FLUSH_ERROR),
        })
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn alloc_carries_the_shared_uid_only_with_user_contexts() {
        let mut buf = [0u8; 16];
        alloc_q_counter(true).encode(&mut buf[..]);
        assert_eq!(buf[..4], [0x07, 0x71, 0xff, 0xff]);
        alloc_q_counter(false).encode(&mut buf[..]);
        assert_eq!(buf[..4], [0x07, 0x71, 0x00, 0x00]);
    }

    #[test]
    fn query_names_the_set_and_reads_the_counters_back() {
        let mut inp = [0u8; ifc::query_q_counter_in::SIZE_BYTES];
        QueryQCounter { counter_set_id: 7, clear: true }.encode(&mut inp[..]);
        assert_eq!(inp[..2], [0x07, 0x73]);
        assert_eq!(inp[31], 7);
        assert_eq!(inp[24] & 0x80, 0x80);
        let mut out = [0u8; ifc::query_q_counter_out::SIZE_BYTES];
        out.set(ifc::query_q_counter_out::OUT_OF_BUFFER, 5);
        out.set(ifc::query_q_counter_out::REQ_CQE_FLUSH_ERROR, 9);
        let c = QueryQCounter { counter_set_id: 7, clear: false }.decode(&out[..]).unwrap();
        assert_eq!((c.out_of_buffer, c.req_cqe_flush_error, c.rx_write_requests), (5, 9, 0));
    }
}
