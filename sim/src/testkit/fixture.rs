//! The kit's fixtures: [`Node`], a brought-up simulated HCA with a PD and one registered buffer, RC QPs connected
//! RESET → RTS on it (or towards another node), and a teardown that checks nothing leaked; [`RcPair`], two nodes
//! joined by the simulated wire with one connected RC QP each. The datapath, flush and allocation tests and the
//! benchmarks build on them.
//!
//! Every function here is `#[inline]`, so the core's generic HCA code it calls is compiled in the crate that uses
//! the fixture rather than in the simulator: compiled into the simulator, it changed how the simulator's own
//! datapath was code-generated (and the simulator benchmark lost about 7%).

use mlx5_core::cq::{Cq, LinkLayer};
use mlx5_core::hal::{Dma, DmaRegion};
use mlx5_core::hca::{Config, Hca, TeardownReport};
use mlx5_core::hca::{CqAttr, Pd, QpInitAttr};
use mlx5_core::mkey::{Access, Mr};
use mlx5_core::qp::{required_attrs, AhAttr, Grh, Mtu, Qp, QpAttr, QpCap, QpState, QpType, Sge};

use crate::config::SimConfig;
use crate::delay::SimDelay;
use crate::dma_handle::SimDma;
use crate::mmio::SimMmio;
use crate::sim_device::SimDevice;

/// The core's HCA over the simulator.
pub type SimHca = Hca<SimMmio, SimDma>;

/// A brought-up simulated device with a PD and `mem_len` bytes of registered memory (every access right).
pub struct Node {
    pub dev: SimDevice,
    pub hca: SimHca,
    pub d: SimDelay,
    pub pd: Pd,
    pub mem: DmaRegion,
    pub mr: Mr,
}

/// The attributes of an RC connection (both sides use the same; send and receive PSNs are both 0, so they match).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RcOpts {
    pub access: Access,
    pub path_mtu: Mtu,
    pub rnr_retry: u8,
    pub retry_cnt: u8,
    pub min_rnr_timer: u8,
    /// Both `max_rd_atomic` and `max_dest_rd_atomic`.
    pub rd_atomic: u8,
}

impl Default for RcOpts {
    /// Remote read, write and atomics, 1024-byte MTU, retries 7/7, the shortest RNR timer, 4 reads in flight.
    #[inline]
    fn default() -> Self {
        Self {
            access: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC | Access::LOCAL_WRITE,
            path_mtu: Mtu::M1024,
            rnr_retry: 7,
            retry_cnt: 7,
            min_rnr_timer: 1,
            rd_atomic: 4,
        }
    }
}

impl std::fmt::Debug for Node {
    #[inline]
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("dev", &self.dev).field("mem", &self.mem).finish_non_exhaustive()
    }
}

impl Node {
    /// Brings up a device of `cfg` and registers `mem_len` bytes. Panics on any failure (a fixture).
    #[inline]
    pub fn new(cfg: SimConfig, mem_len: usize) -> Self {
        // The driver learns the port's addresses from its configuration, as a host learns them from its netdev.
        let hcfg = Config { ipv4_addrs: cfg.ipv4_addrs, ipv6_addrs: cfg.ipv6_addrs, ..Config::default() };
        let dev = SimDevice::new(cfg);
        let mut d = dev.delay();
        let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, hcfg).expect("bring-up");
        let pd = hca.alloc_pd(&mut d).expect("PD");
        let mem = dev.dma().alloc(mem_len, 4096).expect("buffer");
        let mr = hca.reg_mr(&pd, mem.cpu().as_ptr(), mem_len, Access::ALL, &mut d).expect("MR");
        Node { dev, hca, d, pd, mem, mr }
    }

    /// The address of byte `off` of the registered buffer.
    #[inline]
    pub fn addr(&self, off: usize) -> u64 {
        self.mem.cpu().as_ptr() as u64 + off as u64
    }

    #[inline]
    pub fn sge(&self, off: usize, len: u32) -> Sge {
        Sge { addr: self.addr(off), length: len, lkey: self.mr.lkey }
    }

    /// A copy of `len` bytes of the buffer at `off` (read after the work that wrote them completed).
    #[inline]
    pub fn bytes(&self, off: usize, len: usize) -> Vec<u8> {
        let p = self.mem.ptr_at(off, len);
        // SAFETY: inside the registered region (ptr_at checks); read after the device completed the work that
        // wrote it.
        unsafe { std::slice::from_raw_parts(p, len).to_vec() }
    }

    /// Writes `data` into the buffer at `off` (while no work request uses those bytes).
    #[inline]
    pub fn put(&self, off: usize, data: &[u8]) {
        let p = self.mem.ptr_at(off, data.len());
        // SAFETY: inside the registered region (ptr_at checks); no work request uses these bytes while we write.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
    }

    #[inline]
    pub fn cq(&mut self, cqe: u32) -> Cq {
        self.hca.create_cq(CqAttr { cqe, ..CqAttr::default() }, &mut self.d).expect("CQ")
    }

    /// A QP of `ty` with both queues on `cq`.
    #[inline]
    pub fn qp(&mut self, ty: QpType, cq: &Cq, cap: QpCap, sig_all: bool) -> Qp {
        let attr = QpInitAttr { qp_type: ty, cap, sq_sig_all: sig_all };
        self.hca.create_qp(&self.pd, cq, cq, attr, &mut self.d).expect("QP")
    }

    /// The address of this node's port as a peer sees it.
    #[inline]
    pub fn ah_attr(&mut self) -> AhAttr {
        let port = self.hca.query_port(&mut self.d).expect("query port");
        let gid = self.hca.query_gid(0, &mut self.d).expect("query GID");
        let roce = port.link_layer == LinkLayer::Ethernet;
        AhAttr {
            dlid: port.lid,
            grh: roce.then_some(Grh { dgid: gid, hop_limit: 64, ..Grh::default() }),
            dmac: self.dev.config().mac,
            port_num: 1,
            ..AhAttr::default()
        }
    }

    /// RESET → INIT → RTR → RTS for an RC QP towards QP `dest` at `ah`, with verbs' required attributes.
    #[inline]
    pub fn connect_rc(&mut self, qp: &mut Qp, dest: u32, ah: AhAttr, o: &RcOpts) {
        let a = QpAttr {
            qp_access_flags: o.access,
            path_mtu: o.path_mtu,
            dest_qp_num: dest,
            ah_attr: ah,
            rnr_retry: o.rnr_retry,
            retry_cnt: o.retry_cnt,
            min_rnr_timer: o.min_rnr_timer,
            max_dest_rd_atomic: o.rd_atomic,
            max_rd_atomic: o.rd_atomic,
            ..QpAttr::default()
        };
        for (f, s) in [(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr), (QpState::Rtr, QpState::Rts)] {
            let m = required_attrs(QpType::Rc, f, s).expect("an RC transition");
            self.hca.modify_qp(qp, &QpAttr { qp_state: s, ..a }, m, &mut self.d).expect("modify QP");
        }
    }

    /// A CQ of at least `cqe` entries and two RC QPs on it, connected to each other on the loopback and in RTS.
    #[inline]
    pub fn rc_pair(&mut self, cap: QpCap, cqe: u32, o: &RcOpts) -> (Cq, Qp, Qp) {
        let cq = self.cq(cqe);
        let mut a = self.qp(QpType::Rc, &cq, cap, false);
        let mut b = self.qp(QpType::Rc, &cq, cap, false);
        let ah = self.ah_attr();
        let (qa, qb) = (a.qpn(), b.qpn());
        self.connect_rc(&mut a, qb, ah, o);
        self.connect_rc(&mut b, qa, ah, o);
        (cq, a, b)
    }

    /// Destroys what [`rc_pair`](Self::rc_pair) made.
    #[inline]
    pub fn drop_pair(&mut self, cq: Cq, a: Qp, b: Qp) {
        self.hca.destroy_qp(a, &mut self.d).map_err(|e| e.error).expect("destroy QP");
        self.hca.destroy_qp(b, &mut self.d).map_err(|e| e.error).expect("destroy QP");
        self.hca.destroy_cq(cq, &mut self.d).map_err(|e| e.error).expect("destroy CQ");
    }

    /// Frees the MR, PD and buffer and tears the HCA down; checks that every DMA allocation came back.
    #[inline]
    pub fn finish(self) -> TeardownReport {
        self.finish_with_device().0
    }

    /// [`finish`](Self::finish), handing back the device for checks of its own.
    #[inline]
    pub fn finish_with_device(mut self) -> (TeardownReport, SimDevice) {
        self.hca.dereg_mr(self.mr, &mut self.d).map_err(|e| e.error).expect("dereg MR");
        self.hca.dealloc_pd(self.pd, &mut self.d).map_err(|e| e.error).expect("dealloc PD");
        // SAFETY: the memory key over the region is destroyed (or the device is dead), so the device no longer
        // reaches it.
        unsafe { self.dev.dma().free(self.mem) };
        let report = self.hca.teardown(&mut self.d).expect("teardown");
        assert_eq!(self.dev.dma_outstanding(), (0, 0), "every DMA allocation returned");
        (report, self.dev)
    }
}

/// Two simulated devices joined by the wire (the second at [`SimConfig::next_host`] of the first), each a [`Node`]
/// with one CQ and one RC QP, the QPs connected to each other RESET → RTS with the same PSNs.
#[derive(Debug)]
pub struct RcPair {
    pub a: Node,
    pub b: Node,
    pub cq_a: Cq,
    pub cq_b: Cq,
    pub qp_a: Qp,
    pub qp_b: Qp,
}

impl RcPair {
    /// Brings both devices up from `cfg`, each with `mem_len` bytes registered, a CQ of at least `cqe` entries and
    /// an RC QP of `cap` on it, and connects the QPs with `o`.
    #[inline]
    pub fn new(cfg: SimConfig, mem_len: usize, cap: QpCap, cqe: u32, o: &RcOpts) -> Self {
        let next = cfg.next_host();
        let mut a = Node::new(cfg, mem_len);
        let mut b = Node::new(next, mem_len);
        a.dev.connect(&b.dev);
        let (cq_a, cq_b) = (a.cq(cqe), b.cq(cqe));
        let mut qp_a = a.qp(QpType::Rc, &cq_a, cap, false);
        let mut qp_b = b.qp(QpType::Rc, &cq_b, cap, false);
        let (ah_a, ah_b) = (a.ah_attr(), b.ah_attr());
        let (qa, qb) = (qp_a.qpn(), qp_b.qpn());
        a.connect_rc(&mut qp_a, qb, ah_b, o);
        b.connect_rc(&mut qp_b, qa, ah_a, o);
        RcPair { a, b, cq_a, cq_b, qp_a, qp_b }
    }

    /// Destroys the QPs and CQs and finishes both nodes (every DMA allocation of each device came back).
    #[inline]
    pub fn finish(self) -> (TeardownReport, TeardownReport) {
        let RcPair { mut a, mut b, cq_a, cq_b, qp_a, qp_b } = self;
        for (n, qp, cq) in [(&mut a, qp_a, cq_a), (&mut b, qp_b, cq_b)] {
            n.hca.destroy_qp(qp, &mut n.d).map_err(|e| e.error).expect("destroy QP");
            n.hca.destroy_cq(cq, &mut n.d).map_err(|e| e.error).expect("destroy CQ");
        }
        (a.finish(), b.finish())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx5_core::cq::{WcOpcode, WcStatus, WorkCompletion};
    use mlx5_core::qp::{RecvWr, SendFlags, SendOp, SendWr};

    #[test]
    fn an_rc_pair_across_the_wire_carries_a_send_and_leaks_nothing() {
        let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
        let mut p = RcPair::new(SimConfig::default(), 1 << 16, cap, 15, &RcOpts::default());
        p.a.put(0, b"over the wire");
        let rsge = [p.b.sge(0x100, 64)];
        p.b.hca.post_recv(&mut p.qp_b, &[RecvWr { wr_id: 2, sg_list: &rsge }]).unwrap();
        let ssge = [p.a.sge(0, 13)];
        let wr =
            SendWr { wr_id: 1, op: SendOp::Send, sg_list: &ssge, flags: SendFlags::SIGNALED, inline: None, ud: None };
        p.a.hca.post_send(&mut p.qp_a, &[wr]).unwrap();
        let mut wc = [WorkCompletion::default(); 2];
        let (mut sent, mut got) = (None, None);
        for _ in 0..1000 {
            if sent.is_none() && p.cq_a.poll(p.a.hca.mmio(), &mut p.qp_a, &mut wc).unwrap() == 1 {
                sent = Some(wc[0]);
            }
            if got.is_none() && p.cq_b.poll(p.b.hca.mmio(), &mut p.qp_b, &mut wc).unwrap() == 1 {
                got = Some(wc[0]);
            }
            if sent.is_some() && got.is_some() {
                break;
            }
        }
        let (sent, got) = (sent.expect("send completion"), got.expect("receive completion"));
        assert_eq!((sent.wr_id, sent.status, sent.opcode), (1, WcStatus::Success, WcOpcode::Send));
        assert_eq!((got.wr_id, got.status, got.byte_len), (2, WcStatus::Success, 13));
        assert_eq!(p.b.bytes(0x100, 13), b"over the wire");
        p.finish();
    }
}
