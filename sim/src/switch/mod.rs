//! A simulated InfiniBand switch: N external ports, each plugged into a VDE fabric of its own (a `vde_switch` with
//! two plugs is a cable: the switch's port and one simulated HCA port, `SimDevice::vde_plug`), and a management
//! port 0 with an SMA, so one subnet manager sweeps the switch and every channel adapter behind it, gives each a
//! LID and programs the switch's forwarding table. What the switch does with a frame is `forward.rs` (LFT
//! routing, the directed-route hop rules, drops counted by why); what its SMA answers is `sma.rs`.
//!
//! Each port has one reader thread: it takes a frame from its cable, runs it through the switch under one lock
//! and sends what comes out on the output ports' cables (libvdeplug sends never block for long: a full
//! `vde_switch` queue drops, as a congested link would). A cable that goes away takes its port Down
//! (PortStateChange set for the SM); the switch keeps running for the others.

mod forward;
mod sma;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::link::vde::{Conn, VdeError};
use crate::link::Datagrams;

pub use forward::SwitchCounters;

/// How long a reader waits in `poll` before it looks whether the switch is stopping.
const POLL_MS: i32 = 50;

/// What one external port looks like from outside: its state and physical state (PortInfo's codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwitchPort {
    /// 1 Down, 2 Init, 3 Armed, 4 Active.
    pub state: u8,
    /// 2 Polling, 5 LinkUp.
    pub phys: u8,
}

/// A snapshot of the switch: its LID (0: none yet), its ports, how many LIDs its LFT routes, and its counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchState {
    pub lid: u16,
    pub sm_lid: u16,
    pub ports: Vec<SwitchPort>,
    pub lft_entries: usize,
    pub counters: SwitchCounters,
    /// SMPs answered with a MAD status other than success: (method, attribute, status, how many).
    pub statuses: Vec<(u8, u16, u16, u64)>,
}

struct Inner {
    sw: Mutex<forward::Switch>,
    /// The cables of ports 1..=N, in order.
    conns: Vec<Conn>,
    stop: AtomicBool,
}

/// Why a switch did not start.
#[derive(Debug)]
pub enum SwitchError {
    /// A switch here has 1 to 15 external ports (one multicast port mask), one cable each.
    Ports { cables: usize },
    /// A cable could not be opened (no `vde_switch` at that URL, no libvdeplug), or the threads not started.
    Vde(VdeError),
}

impl std::fmt::Display for SwitchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SwitchError::Ports { cables } => write!(f, "{cables} cables: a simulated switch has 1 to 15 ports"),
            SwitchError::Vde(e) => write!(f, "a switch port: {e}"),
        }
    }
}

impl std::error::Error for SwitchError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            SwitchError::Vde(e) => Some(e),
            SwitchError::Ports { .. } => None,
        }
    }
}

/// A running switch (its reader threads end when it is dropped).
pub struct IbSwitch {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for IbSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbSwitch").field("state", &self.state()).finish()
    }
}

impl IbSwitch {
    /// Starts a switch with node GUID `node_guid` and NodeDescription `description`, one external port per
    /// libvdeplug URL in `cables` (1 to 15; port k is `cables[k-1]`).
    pub fn start(node_guid: u64, description: &str, cables: &[&str]) -> Result<IbSwitch, SwitchError> {
        if cables.is_empty() || cables.len() > 15 {
            return Err(SwitchError::Ports { cables: cables.len() });
        }
        let conns = cables.iter().map(|u| Conn::open(u)).collect::<Result<Vec<_>, _>>().map_err(SwitchError::Vde)?;
        let sw = forward::Switch::new(sma::SwitchSma::new(node_guid, cables.len() as u8, description));
        let inner = Arc::new(Inner { sw: Mutex::new(sw), conns, stop: AtomicBool::new(false) });
        let mut threads = Vec::new();
        for k in 0..cables.len() {
            let i = inner.clone();
            let t = std::thread::Builder::new()
                .name(format!("mlx5-sim-switch-{}", k + 1))
                .spawn(move || read_loop(&i, k as u8 + 1))
                .map_err(|source| SwitchError::Vde(VdeError::Threads { source }))?;
            threads.push(t);
        }
        Ok(IbSwitch { inner, threads })
    }

    /// The switch as it is now.
    pub fn state(&self) -> SwitchState {
        let sw = self.inner.sw.lock().unwrap_or_else(|e| e.into_inner());
        SwitchState {
            lid: sw.sma.lid(),
            sm_lid: sw.sma.ports[0].info.master_sm_lid,
            ports: sw.sma.ports[1..].iter().map(|p| SwitchPort { state: p.state, phys: p.phys }).collect(),
            lft_entries: sw.sma.lft.iter().filter(|&&p| p != sma::UNPROGRAMMED).count(),
            counters: sw.counters,
            statuses: sw.sma.statuses.clone(),
        }
    }
}

impl Drop for IbSwitch {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn read_loop(inner: &Inner, port: u8) {
    let conn = &inner.conns[usize::from(port - 1)];
    let (data, ctl) = conn.fds();
    let mut buf = vec![0u8; 1 << 16];
    while !inner.stop.load(Ordering::Relaxed) {
        let mut fds = [
            libc::pollfd { fd: data, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: ctl, events: libc::POLLIN, revents: 0 },
        ];
        let nfds = if ctl >= 0 { 2 } else { 1 };
        // SAFETY: `fds` holds `nfds` valid pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), nfds, POLL_MS) };
        if n <= 0 {
            continue;
        }
        // The control socket is readable only when the fabric went away.
        let gone = fds[1].revents != 0 && nfds == 2;
        let got = if fds[0].revents & libc::POLLIN != 0 { conn.recv(&mut buf) } else { 0 };
        if gone || (fds[0].revents != 0 && got <= 0) {
            inner.sw.lock().unwrap_or_else(|e| e.into_inner()).sma.set_link(port, false);
            return;
        }
        if got <= 0 {
            continue;
        }
        let out = inner.sw.lock().unwrap_or_else(|e| e.into_inner()).frame_in(port, &buf[..got as usize]);
        for (p, f) in out {
            if let Some(c) = inner.conns.get(usize::from(p).wrapping_sub(1)) {
                let _ = c.send(&f);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::forward::{test_dr_smp as dr, TEST_TID};
    use super::*;
    use crate::config::{Mode, PortType, SimConfig};
    use crate::fw::mad_ifc::{
        NodeInfo, PortInfo, Smp, ATTR_NODE_INFO, ATTR_PORT_INFO, CLASS_SUBN_LID_ROUTED, MAD_LEN, METHOD_GET,
        METHOD_GET_RESP, METHOD_SET, SMP_DATA_LEN, STATUS_DIRECTION,
    };
    use crate::link::vde::switch_url;
    use crate::testkit::submit::{Bell, Mr, QpSpec, Rdma, TAv, TCq, TQp, Wqe};
    use crate::wire::PERMISSIVE_LID;
    use mlx5_core::prm::{consts, ifc, MsgBuf};
    use std::path::PathBuf;

    const SEND: u8 = consts::MLX5_OPCODE_SEND;
    const GRH: usize = 40;

    /// A cable: a `vde_switch` of the test's own (started by the HCA that plugs in first), ended when dropped.
    struct Cable(PathBuf);

    impl Cable {
        fn new(name: &str) -> Cable {
            let dir = std::env::temp_dir().join(format!("mlx5-ibsw-{}-{name}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            Cable(dir)
        }
    }

    impl Drop for Cable {
        fn drop(&mut self) {
            let pid = std::fs::read_to_string(self.0.with_extension("pid")).ok().and_then(|p| p.trim().parse().ok());
            if let Some(pid) = pid {
                // SAFETY: kill has no memory preconditions; the pid is the vde_switch this test started.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            let _ = std::fs::remove_file(self.0.with_extension("pid"));
            let _ = std::fs::remove_file(self.0.with_extension("lock"));
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// An HCA port that waits for an SM, on `cable`, with its QP0 (send and receive CQs apart) and a buffer.
    struct Hca {
        r: Rdma,
        qp0: TQp,
        scq: TCq,
        rcq: TCq,
        m: Mr,
    }

    fn hca(guid: u64, cable: &Cable) -> Hca {
        let cfg = SimConfig {
            port_type: PortType::Ib,
            subnet_manager: true,
            node_guid: guid,
            mode: Mode::Threaded,
            ..SimConfig::default()
        };
        let mut r = Rdma::new(cfg);
        r.h.dev.vde_plug_dir(&cable.0).expect("plugged into the test's cable (Debian: vde2, libvdeplug2)");
        let (scq, rcq) = (r.cq(4), r.cq(4));
        let qp0 = r.qp(QpSpec { st: consts::MLX5_QP_ST_QP0, ..QpSpec::ud() }, scq.cqn, rcq.cqn);
        r.ready_ud(&qp0, 0);
        let m = r.mr(4096);
        Hca { r, qp0, scq, rcq, m }
    }

    impl Hca {
        /// Sends `smp` from QP0 to `rlid` (the permissive LID for a directed route).
        fn send(&mut self, smp: &Smp, rlid: u16) {
            self.m.write(0, &smp.emit());
            let av = TAv { dqpn: 0, qkey: 0, rlid, ..TAv::default() };
            let w = Wqe::new(SEND).av(&av).data(MAD_LEN as u32, self.m.key, self.m.addr());
            self.r.post_send(&mut self.qp0, &w, Bell::Db);
            assert_eq!(self.r.wait_cqe(&mut self.scq).expect("QP0 send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        }

        /// Posts one QP0 receive.
        fn expect(&mut self) {
            self.r.post_recv(&mut self.qp0, &[(self.m.addr() + 1024, (GRH + MAD_LEN) as u32, self.m.key)]);
        }

        /// The SMP the posted receive got, and the sender's LID.
        fn received(&mut self) -> (Smp, u16) {
            let e = self.r.wait_cqe(&mut self.rcq).expect("an SMP on QP0");
            (Smp::parse(&self.m.read(1024 + GRH, MAD_LEN)).expect("an SMP"), e.slid())
        }

        /// The port's own SMA through MAD_IFC, as `mlx5_ib`'s `process_mad` reaches it.
        fn mad_ifc(&mut self, smp: &Smp) -> Smp {
            use ifc::mad_ifc_in as i;
            let mut inp = vec![0u8; i::SIZE_BYTES];
            inp.set(i::OPCODE, consts::MLX5_CMD_OP_MAD_IFC.into());
            inp.set(i::OP_MOD, 3);
            inp.set(i::PORT, 1);
            inp[i::MAD.byte_off()..i::MAD.byte_off() + MAD_LEN].copy_from_slice(&smp.emit());
            let (s, _, out) = self.r.h.cmd(&inp, ifc::mad_ifc_out::SIZE_BYTES);
            assert_eq!(s, 0);
            let off = ifc::mad_ifc_out::RESPONSE_MAD_PACKET.byte_off();
            Smp::parse(&out[off..off + MAD_LEN]).expect("the SMA's answer")
        }

        /// Serves one directed-route SMP that ends at this port, as `ib_mad` does (C14-9:3 on arrival, the
        /// firmware SMA, C14-13:1 on the way back).
        fn serve(&mut self) {
            let (mut req, _) = self.received();
            assert_eq!(req.hop_ptr, req.hop_cnt, "the directed route ends here");
            req.return_path[usize::from(req.hop_ptr)] = 1;
            req.hop_ptr += 1;
            let mut rsp = self.mad_ifc(&req);
            rsp.hop_ptr -= 1;
            self.send(&rsp, PERMISSIVE_LID);
        }
    }

    #[test]
    fn a_switch_without_cables_or_with_one_nobody_serves_is_a_clear_error() {
        assert!(matches!(IbSwitch::start(1, "t", &[]), Err(SwitchError::Ports { cables: 0 })));
        assert!(matches!(IbSwitch::start(1, "t", &["vde:///x"; 16]), Err(SwitchError::Ports { cables: 16 })));
        let nobody = Cable::new("nobody");
        let e = IbSwitch::start(1, "t", &[&switch_url(&nobody.0)]).unwrap_err();
        assert!(matches!(e, SwitchError::Vde(VdeError::Open { .. })), "{e}");
    }

    #[test]
    fn a_hand_made_sm_sweeps_the_switch_and_two_hcas_and_they_talk_through_its_lft() {
        let (ca, cb) = (Cable::new("a"), Cable::new("b"));
        let (mut a, mut b) = (hca(0xa1, &ca), hca(0xb2, &cb));
        let urls = [switch_url(&ca.0), switch_url(&cb.0)];
        let sw =
            IbSwitch::start(0x5e, "test switch", &[&urls[0], &urls[1]]).expect("the switch plugs into both cables");
        // The SM (on A) asks for one hop out: the switch, from its port 1.
        let ask = |a: &mut Hca, smp: Smp| {
            a.expect();
            a.send(&smp, PERMISSIVE_LID);
            let (rsp, _) = a.received();
            assert_eq!(
                (rsp.method, rsp.status, rsp.tid, rsp.hop_ptr),
                (METHOD_GET_RESP, STATUS_DIRECTION, TEST_TID, 1)
            );
            rsp
        };
        let ni = NodeInfo::parse(&ask(&mut a, dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN])).data);
        assert_eq!((ni.node_type, ni.num_ports, ni.node_guid, ni.local_port_num), (2, 2, 0x5e, 1));
        // Two hops: through the switch's port 2 to B's QP0, B's SMA, and back.
        let through = |a: &mut Hca, b: &mut Hca, smp: Smp| {
            a.expect();
            b.expect();
            a.send(&smp, PERMISSIVE_LID);
            b.serve();
            let (rsp, _) = a.received();
            assert_eq!((rsp.method, rsp.status, rsp.hop_ptr), (METHOD_GET_RESP, STATUS_DIRECTION, 1));
            rsp
        };
        let nb = NodeInfo::parse(
            &through(&mut a, &mut b, dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1, 2], [0; SMP_DATA_LEN])).data,
        );
        assert_eq!((nb.node_type, nb.node_guid), (1, 0xb2));
        // LIDs: A 1 (its own SMA, locally), the switch 2, B 3; the SM at LID 1.
        let mut own = PortInfo::parse(&a.mad_ifc(&dr(METHOD_GET, ATTR_PORT_INFO, 0, &[], [0; SMP_DATA_LEN])).data);
        (own.lid, own.master_sm_lid, own.port_state) = (1, 1, 0);
        a.mad_ifc(&Smp { hop_ptr: 0, ..dr(METHOD_SET, ATTR_PORT_INFO, 0, &[], own.emit()) });
        let mut si = PortInfo::parse(&ask(&mut a, dr(METHOD_GET, ATTR_PORT_INFO, 0, &[1], [0; SMP_DATA_LEN])).data);
        (si.lid, si.master_sm_lid) = (2, 1);
        ask(&mut a, dr(METHOD_SET, ATTR_PORT_INFO, 0, &[1], si.emit()));
        let mut pb = PortInfo::parse(
            &through(&mut a, &mut b, dr(METHOD_GET, ATTR_PORT_INFO, 0, &[1, 2], [0; SMP_DATA_LEN])).data,
        );
        (pb.lid, pb.master_sm_lid, pb.port_state) = (3, 1, 0);
        through(&mut a, &mut b, dr(METHOD_SET, ATTR_PORT_INFO, 0, &[1, 2], pb.emit()));
        // Every port Armed, then Active.
        for state in [3, 4] {
            own.port_state = state;
            a.mad_ifc(&Smp { hop_ptr: 0, ..dr(METHOD_SET, ATTR_PORT_INFO, 0, &[], own.emit()) });
            for p in 1..=2 {
                let mut e =
                    PortInfo::parse(&ask(&mut a, dr(METHOD_GET, ATTR_PORT_INFO, p, &[1], [0; SMP_DATA_LEN])).data);
                e.port_state = state;
                let r = ask(&mut a, dr(METHOD_SET, ATTR_PORT_INFO, p, &[1], e.emit()));
                assert_eq!(PortInfo::parse(&r.data).port_state, state);
            }
            pb.port_state = state;
            let r = through(&mut a, &mut b, dr(METHOD_SET, ATTR_PORT_INFO, 0, &[1, 2], pb.emit()));
            assert_eq!(PortInfo::parse(&r.data).port_state, state);
        }
        // The LFT: LID 1 on port 1, 2 the switch itself, 3 on port 2.
        let mut lft = [0xffu8; SMP_DATA_LEN];
        (lft[1], lft[2], lft[3]) = (1, 0, 2);
        ask(&mut a, dr(METHOD_SET, sma::ATTR_LINEAR_FT, 0, &[1], lft));
        assert_eq!((a.r.h.dev.lid(), b.r.h.dev.lid()), (1, 3));
        // By LID now: a Get(NodeInfo) from A to B's LID 3 through the LFT, B answering to A's LID 1.
        let lr = Smp {
            mgmt_class: CLASS_SUBN_LID_ROUTED,
            hop_ptr: 0,
            hop_cnt: 0,
            ..dr(METHOD_GET, ATTR_NODE_INFO, 0, &[], [0; SMP_DATA_LEN])
        };
        a.expect();
        b.expect();
        a.send(&lr, 3);
        let (req, slid) = b.received();
        assert_eq!((req.tid, slid), (TEST_TID, 1));
        let rsp = b.mad_ifc(&req);
        b.send(&rsp, slid);
        let (back, from) = a.received();
        assert_eq!((NodeInfo::parse(&back.data).node_guid, from), (0xb2, 3));
        // And to the switch's own LID: its SMA answers by the LFT.
        a.expect();
        a.send(&Smp { attr_id: sma::ATTR_SWITCH_INFO, ..lr.clone() }, 2);
        let (si, from) = a.received();
        assert_eq!((si.status, from, u16::from_be_bytes([si.data[0], si.data[1]])), (0, 2, 0xc000));
        // A LID the SM did not program goes nowhere, and the switch counts it.
        a.send(&lr, 9);
        let s = sw.state();
        assert_eq!((s.lid, s.sm_lid, s.lft_entries), (2, 1, 3));
        assert_eq!(s.ports, [SwitchPort { state: 4, phys: 5 }; 2]);
        let c = s.counters;
        // Five round trips to B by directed route (two passes each), the LID-routed request and its answer.
        assert_eq!((c.dr_forwarded, c.forwarded, c.bad_smp, c.malformed), (2 * 5, 2, 0, 0));
        let t0 = std::time::Instant::now();
        while sw.state().counters.unprogrammed == 0 && t0.elapsed() < std::time::Duration::from_secs(5) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        assert_eq!(sw.state().counters.unprogrammed, 1);
        drop(sw);
    }
}
