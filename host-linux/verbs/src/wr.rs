//! Builders for work requests: each returns a signaled request; chain [`WrExt`] methods to change flags.
//!
//! ```
//! use mlx5_verbs::{wr, wr::WrExt, RemoteBuf, Sge};
//! let sg = [Sge { addr: 0x1000, length: 64, lkey: 7 }];
//! let w = wr::rdma_write(9, &sg, RemoteBuf { addr: 0x2000, rkey: 8 }).unsignaled();
//! assert_eq!(w.wr_id, 9);
//! ```

use crate::mr::RemoteBuf;
use mlx5_core::qp::{RecvWr, SendFlags, SendOp, SendWr, Sge, UdDest};

fn base<'a>(wr_id: u64, op: SendOp, sg_list: &'a [Sge]) -> SendWr<'a> {
    SendWr { wr_id, op, sg_list, flags: SendFlags::SIGNALED, inline: None, ud: None }
}

pub fn send(wr_id: u64, sg: &[Sge]) -> SendWr<'_> {
    base(wr_id, SendOp::Send, sg)
}

pub fn send_imm(wr_id: u64, sg: &[Sge], imm: u32) -> SendWr<'_> {
    base(wr_id, SendOp::SendImm { imm }, sg)
}

/// A SEND whose payload travels inside the WQE: `data` may be reused as soon as the post returns.
pub fn send_inline(wr_id: u64, data: &[u8]) -> SendWr<'_> {
    SendWr { inline: Some(data), ..base(wr_id, SendOp::Send, &[]) }
}

/// A UD SEND to `dest`.
pub fn ud_send<'a>(wr_id: u64, sg: &'a [Sge], dest: UdDest<'a>) -> SendWr<'a> {
    SendWr { ud: Some(dest), ..base(wr_id, SendOp::Send, sg) }
}

pub fn rdma_write(wr_id: u64, sg: &[Sge], to: RemoteBuf) -> SendWr<'_> {
    base(wr_id, SendOp::RdmaWrite { remote_addr: to.addr, rkey: to.rkey }, sg)
}

pub fn rdma_write_imm(wr_id: u64, sg: &[Sge], to: RemoteBuf, imm: u32) -> SendWr<'_> {
    base(wr_id, SendOp::RdmaWriteImm { remote_addr: to.addr, rkey: to.rkey, imm }, sg)
}

pub fn rdma_read(wr_id: u64, sg: &[Sge], from: RemoteBuf) -> SendWr<'_> {
    base(wr_id, SendOp::RdmaRead { remote_addr: from.addr, rkey: from.rkey }, sg)
}

/// 8-byte fetch-and-add at `at`; the old value lands in `sg`.
pub fn fetch_add(wr_id: u64, sg: &[Sge], at: RemoteBuf, add: u64) -> SendWr<'_> {
    base(wr_id, SendOp::AtomicFetchAdd { remote_addr: at.addr, rkey: at.rkey, add }, sg)
}

/// 8-byte compare-and-swap at `at`; the old value lands in `sg`.
pub fn cmp_swap(wr_id: u64, sg: &[Sge], at: RemoteBuf, compare: u64, swap: u64) -> SendWr<'_> {
    base(wr_id, SendOp::AtomicCmpSwp { remote_addr: at.addr, rkey: at.rkey, compare, swap }, sg)
}

pub fn recv(wr_id: u64, sg: &[Sge]) -> RecvWr<'_> {
    RecvWr { wr_id, sg_list: sg }
}

/// Flag changes on a send request.
pub trait WrExt {
    /// No completion unless it fails (a later signaled one retires it).
    fn unsignaled(self) -> Self;
    fn solicited(self) -> Self;
    fn fenced(self) -> Self;
}

impl WrExt for SendWr<'_> {
    fn unsignaled(mut self) -> Self {
        self.flags = SendFlags(self.flags.0 & !SendFlags::SIGNALED.0);
        self
    }
    fn solicited(mut self) -> Self {
        self.flags = self.flags | SendFlags::SOLICITED;
        self
    }
    fn fenced(mut self) -> Self {
        self.flags = self.flags | SendFlags::FENCE;
        self
    }
}
