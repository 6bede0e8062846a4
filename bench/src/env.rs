//! A brought-up simulated HCA with a PD and one registered buffer, and connected RC QP pairs on its loopback: the
//! objects every benchmark runs on (as `tests/datapath.rs` and the `pingpong` tool set them up).

use mlx5_core::cq::{Cq, LinkLayer};
use mlx5_core::hal::{Dma, DmaRegion};
use mlx5_core::hca::{Config, Hca};
use mlx5_core::hca::{CqAttr, Pd, QpInitAttr};
use mlx5_core::mkey::{Access, Mr};
use mlx5_core::qp::{required_attrs, AhAttr, Grh, Mtu, Qp, QpAttr, QpCap, QpState, QpType, Sge};
use mlx5_sim::{Mode, SimConfig, SimDelay, SimDevice, SimDma, SimMmio};

pub type SimHca = Hca<SimMmio, SimDma>;

/// Bytes of the registered buffer.
pub const MEM: usize = 1 << 20;

pub struct Env {
    pub dev: SimDevice,
    pub hca: SimHca,
    pub d: SimDelay,
    pub pd: Pd,
    pub mem: DmaRegion,
    pub mr: Mr,
}

impl Env {
    pub fn new(mode: Mode) -> Self {
        let dev = SimDevice::new(SimConfig { mode, ..SimConfig::default() });
        let mut d = dev.delay();
        let mut hca: SimHca = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).expect("bring-up");
        let pd = hca.alloc_pd(&mut d).expect("PD");
        let mem = dev.dma().alloc(MEM, 4096).expect("buffer");
        let mr = hca.reg_mr(&pd, mem.cpu.as_ptr(), MEM, Access::ALL, &mut d).expect("MR");
        Env { dev, hca, d, pd, mem, mr }
    }

    pub fn sge(&self, off: usize, len: u32) -> Sge {
        Sge { addr: self.mem.cpu.as_ptr() as u64 + off as u64, length: len, lkey: self.mr.lkey }
    }

    /// A CQ of at least `cqe` entries and two RC QPs on it, connected to each other on the loopback and in RTS.
    pub fn pair(&mut self, cap: QpCap, cqe: u32) -> (Cq, Qp, Qp) {
        let cq = self.hca.create_cq(CqAttr { cqe, ..CqAttr::default() }, &mut self.d).expect("CQ");
        let attr = QpInitAttr { qp_type: QpType::Rc, cap, sq_sig_all: false };
        let mut a = self.hca.create_qp(&self.pd, &cq, &cq, attr, &mut self.d).expect("QP");
        let mut b = self.hca.create_qp(&self.pd, &cq, &cq, attr, &mut self.d).expect("QP");
        let ah = self.ah_attr();
        let (qa, qb) = (a.qpn(), b.qpn());
        self.connect(&mut a, qb, ah);
        self.connect(&mut b, qa, ah);
        (cq, a, b)
    }

    pub fn drop_pair(&mut self, cq: Cq, a: Qp, b: Qp) {
        self.hca.destroy_qp(a, &mut self.d).map_err(|e| e.error).expect("destroy QP");
        self.hca.destroy_qp(b, &mut self.d).map_err(|e| e.error).expect("destroy QP");
        self.hca.destroy_cq(cq, &mut self.d).map_err(|e| e.error).expect("destroy CQ");
    }

    fn ah_attr(&mut self) -> AhAttr {
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

    /// RESET → INIT → RTR → RTS towards `dest`.
    fn connect(&mut self, qp: &mut Qp, dest: u32, ah: AhAttr) {
        let a = QpAttr {
            qp_access_flags: Access::REMOTE_READ | Access::REMOTE_WRITE | Access::LOCAL_WRITE,
            path_mtu: Mtu::M1024,
            dest_qp_num: dest,
            ah_attr: ah,
            rnr_retry: 7,
            retry_cnt: 7,
            min_rnr_timer: 1,
            max_dest_rd_atomic: 4,
            max_rd_atomic: 4,
            ..QpAttr::default()
        };
        for (f, s) in [(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr), (QpState::Rtr, QpState::Rts)] {
            let m = required_attrs(QpType::Rc, f, s).expect("an RC transition");
            self.hca.modify_qp(qp, &QpAttr { qp_state: s, ..a }, m, &mut self.d).expect("modify QP");
        }
    }

    /// Frees everything and checks that nothing is left.
    pub fn finish(mut self) {
        self.hca.dereg_mr(self.mr, &mut self.d).map_err(|e| e.error).expect("dereg MR");
        self.hca.dealloc_pd(self.pd, &mut self.d).map_err(|e| e.error).expect("dealloc PD");
        // SAFETY: the memory key over the region is destroyed, so the device no longer reaches it.
        unsafe { self.dev.dma().free(self.mem) };
        self.hca.teardown(&mut self.d).expect("teardown");
        assert_eq!(self.dev.dma_outstanding(), (0, 0), "every DMA allocation returned");
    }
}
