//! The general services QP (QP1) through the verbs API on a simulated pair: created as mlx5_ib's hardware GSI QP
//! (`qpc.st` QP1), reached as QP 1 whatever QPN firmware gave it, answering as QP 1, on RoCE and InfiniBand; one
//! per port; a datagram with another Q_Key dropped and counted. And the IBTA CM of `mlx5-rdmacm` over those QPs:
//! REQ/REP/RTU connect two RC QPs that then carry data, DREQ/DREP end it.

use std::time::Duration;

use mlx5_rdmacm::engine::Engine;
use mlx5_sim::{PortType, SimConfig};
use mlx5_verbs::{wr, Access, AhAttr, Context, Grh, LinkLayer, QpCap, QpType, WcStatus, WorkCompletion, GRH_BYTES};

/// The GSI QP's well-known Q_Key (IBA 3.5.4 / `IB_QP1_QKEY`).
const QP1_QKEY: u32 = 0x8001_0000;
/// A MAD is 256 bytes (IBA 13.4.2).
const MAD: usize = 256;

fn wait(cq: &mlx5_verbs::CompletionQueue<'_>, n: usize) -> Vec<WorkCompletion> {
    let mut wc = vec![WorkCompletion::default(); n];
    let got = cq.poll_until(&mut wc, n, Duration::from_secs(5)).unwrap();
    wc.truncate(got);
    wc
}

fn gsi_pair(base: SimConfig) {
    let (a, b) = Context::open_sim_pair_with(base).unwrap();
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (pd_a, pd_b) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let (cq_a, cq_b) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
    let len = 2 * MAD + GRH_BYTES;
    let (mut buf_a, mut buf_b) = (a.alloc_buffer(len).unwrap(), b.alloc_buffer(len).unwrap());
    let mr_a = pd_a.register(&mut buf_a, Access::LOCAL_WRITE).unwrap();
    let mr_b = pd_b.register(&mut buf_b, Access::LOCAL_WRITE).unwrap();
    let ga = pd_a.create_qp(QpType::Gsi, &cq_a, &cq_a, cap).unwrap().activate_ud(QP1_QKEY).unwrap();
    let gb = pd_b.create_qp(QpType::Gsi, &cq_b, &cq_b, cap).unwrap().activate_ud(QP1_QKEY).unwrap();
    // A port has one GSI QP: firmware refuses a second.
    assert!(pd_b.create_qp(QpType::Gsi, &cq_b, &cq_b, cap).is_err(), "a second GSI QP on the port");
    let rb = b.remote_qp(&gb).unwrap();
    assert_ne!(rb.qpn, 1, "firmware gives the GSI QP an ordinary QPN");
    let to_b = match a.link_layer() {
        LinkLayer::Ethernet => AhAttr {
            grh: Some(Grh { dgid: rb.gid, hop_limit: 64, ..Grh::default() }),
            dmac: rb.mac,
            port_num: 1,
            ..AhAttr::default()
        },
        LinkLayer::InfiniBand => AhAttr { dlid: rb.lid, port_num: 1, ..AhAttr::default() },
    };
    let ah_to_b = pd_a.create_ah(&to_b).unwrap();
    let recv_len = (MAD + GRH_BYTES) as u32;
    // A GMP to QP 1: B's GSI QP takes it and sees it come from QP 1.
    let get: Vec<u8> = (0..MAD).map(|i| (i * 13) as u8).collect();
    mr_a.write(0, &get).unwrap();
    gb.post_recv(&[wr::recv(1, &[mr_b.sge(MAD, recv_len)])]).unwrap();
    ga.post_recv(&[wr::recv(1, &[mr_a.sge(MAD, recv_len)])]).unwrap();
    ga.post_send(&[wr::ud_send(2, &[mr_a.sge(0, MAD as u32)], ah_to_b.dest(1, QP1_QKEY))]).unwrap();
    let wc = wait(&cq_b, 1);
    assert_eq!((wc.len(), wc[0].status, wc[0].byte_len), (1, WcStatus::Success, recv_len));
    assert_eq!(wc[0].src_qp, 1, "a GSI QP sends as QP 1");
    assert_eq!(mr_b.read_vec(MAD + GRH_BYTES, MAD), get);
    // The answer goes back to QP 1 through the address the request came from.
    let grh: [u8; GRH_BYTES] = mr_b.read_vec(MAD, GRH_BYTES).try_into().unwrap();
    let has_grh = wc[0].wc_flags.contains(mlx5_verbs::WcFlags::GRH);
    let ah_to_a = pd_b.create_ah_from_wc(&wc[0], has_grh.then_some(&grh), 1).unwrap();
    let resp: Vec<u8> = get.iter().map(|b| !b).collect();
    mr_b.write(0, &resp).unwrap();
    gb.post_send(&[wr::ud_send(3, &[mr_b.sge(0, MAD as u32)], ah_to_a.dest(wc[0].src_qp, QP1_QKEY))]).unwrap();
    let wa = wait(&cq_a, 2);
    assert!(wa.iter().all(|w| w.status == WcStatus::Success), "{wa:?}");
    let got = wa.iter().find(|w| w.wr_id == 1).expect("the answer arrived");
    assert_eq!(got.src_qp, 1);
    assert_eq!(mr_a.read_vec(MAD + GRH_BYTES, MAD), resp);
    assert_eq!(wait(&cq_b, 1)[0].wr_id, 3);
    // A datagram to QP 1 with another Q_Key is dropped and counted, not delivered.
    gb.post_recv(&[wr::recv(4, &[mr_b.sge(MAD, recv_len)])]).unwrap();
    ga.post_send(&[wr::ud_send(5, &[mr_a.sge(0, MAD as u32)], ah_to_b.dest(1, 0x1234))]).unwrap();
    assert_eq!(wait(&cq_a, 1)[0].status, WcStatus::Success);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while b.query_port().unwrap().qkey_viol_cntr == 0 && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(b.query_port().unwrap().qkey_viol_cntr, 1);
    let mut none = [WorkCompletion::default()];
    assert_eq!(cq_b.poll(&mut none).unwrap(), 0, "nothing delivered");
    ah_to_a.destroy();
}

#[test]
fn gsi_qps_exchange_mads_as_qp1_on_roce() {
    gsi_pair(SimConfig::default());
}

#[test]
fn gsi_qps_exchange_mads_as_qp1_on_infiniband() {
    gsi_pair(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
}

/// One side of a CM exchange over QP1: its GSI QP, the CQ it completes on, and a buffer with a receive area
/// (GRH room and a MAD at 0) and a send area (a MAD at `SEND_AT`).
struct Side<'a> {
    pd: &'a mlx5_verbs::ProtectionDomain<'a>,
    cq: &'a mlx5_verbs::CompletionQueue<'a>,
    gsi: &'a mlx5_verbs::QueuePair<'a, mlx5_verbs::Rts>,
    mr: &'a mlx5_verbs::MemoryRegion<'a>,
}

const SEND_AT: usize = 512;

/// Sends every MAD `ef` has over `from`'s GSI QP to the peer's QP 1 and hands each to `et` with the reply
/// address its completion gives; returns how many went.
fn carry(from: &Side, ef: &mut Engine<AhAttr>, to: &Side, et: &mut Engine<AhAttr>, now: u64) -> usize {
    let mut n = 0;
    while let Some((attr, mad)) = ef.poll_output() {
        to.gsi.post_recv(&[wr::recv(7, &[to.mr.sge(0, (MAD + GRH_BYTES) as u32)])]).unwrap();
        from.mr.write(SEND_AT, &mad).unwrap();
        let ah = from.pd.create_ah(&attr).unwrap();
        from.gsi.post_send(&[wr::ud_send(8, &[from.mr.sge(SEND_AT, MAD as u32)], ah.dest(1, QP1_QKEY))]).unwrap();
        assert_eq!(wait(from.cq, 1)[0].status, WcStatus::Success);
        let wc = wait(to.cq, 1)[0];
        assert_eq!((wc.status, wc.src_qp), (WcStatus::Success, 1));
        let grh: [u8; GRH_BYTES] = to.mr.read_vec(0, GRH_BYTES).try_into().unwrap();
        let has_grh = wc.wc_flags.contains(mlx5_verbs::WcFlags::GRH);
        let back = to.pd.create_ah_from_wc(&wc, has_grh.then_some(&grh), 1).unwrap().attr();
        et.recv(now, back, &to.mr.read_vec(GRH_BYTES, MAD)).unwrap();
        n += 1;
    }
    n
}

/// An RC connection made by the IBTA CM over the GSI QPs, as rdma_cm makes one: REQ (A's QPN, PSN and GID),
/// REP (B's), RTU, then a SEND over the connected QPs, then DREQ/DREP; nothing is left on either side.
fn cm_connects_rc_qps_over_qp1(base: SimConfig) {
    use mlx5_rdmacm::cm::{private_len, CmPath, Rep, Req};
    use mlx5_rdmacm::engine::{EngineConfig, Event};
    use mlx5_rdmacm::ip::{ps, service_id, CmaHdr};
    use mlx5_verbs::{InitAttr, RemoteQp, RtrAttr, RtsAttr};
    // rdma_cm's name for TCP-space port 20000, and its header in the REQ: who connects from where to where.
    const SVC: u64 = 0x0106_4e20;
    assert_eq!(service_id(ps::TCP, 20000), SVC);
    let hdr = CmaHdr { src_port: 40000, src: "10.0.0.1".parse().unwrap(), dst: "10.0.0.2".parse().unwrap() };
    let mut private_data = [0; private_len::REQ];
    hdr.write(&mut private_data).unwrap();
    let (a, b) = Context::open_sim_pair_with(base).unwrap();
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (pd_a, pd_b) = (a.alloc_pd().unwrap(), b.alloc_pd().unwrap());
    let (cq_a, cq_b) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
    let (rcq_a, rcq_b) = (a.create_cq(16).unwrap(), b.create_cq(16).unwrap());
    let (mut buf_a, mut buf_b) = (a.alloc_buffer(1024).unwrap(), b.alloc_buffer(1024).unwrap());
    let mr_a = pd_a.register(&mut buf_a, Access::LOCAL_WRITE).unwrap();
    let mr_b = pd_b.register(&mut buf_b, Access::LOCAL_WRITE).unwrap();
    let ga = pd_a.create_qp(QpType::Gsi, &cq_a, &cq_a, cap).unwrap().activate_ud(QP1_QKEY).unwrap();
    let gb = pd_b.create_qp(QpType::Gsi, &cq_b, &cq_b, cap).unwrap().activate_ud(QP1_QKEY).unwrap();
    let sa = Side { pd: &pd_a, cq: &cq_a, gsi: &ga, mr: &mr_a };
    let sb = Side { pd: &pd_b, cq: &cq_b, gsi: &gb, mr: &mr_b };
    let init = || InitAttr::rc(Access::LOCAL_WRITE);
    let rca = pd_a.create_qp(QpType::Rc, &rcq_a, &rcq_a, cap).unwrap().to_init(init()).map_err(|e| e.error).unwrap();
    let rcb = pd_b.create_qp(QpType::Rc, &rcq_b, &rcq_b, cap).unwrap().to_init(init()).map_err(|e| e.error).unwrap();
    let (mut ea, mut eb) = (Engine::new(0xa, EngineConfig::default()), Engine::new(0xb, EngineConfig::default()));
    eb.listen(SVC).unwrap();
    // What address resolution gives A: B's port (GID, LID and, on RoCE, MAC).
    let rb = b.remote_qp(&gb).unwrap();
    let to_b = match a.link_layer() {
        LinkLayer::Ethernet => AhAttr {
            grh: Some(Grh { dgid: rb.gid, hop_limit: 64, ..Grh::default() }),
            dmac: rb.mac,
            port_num: 1,
            ..AhAttr::default()
        },
        LinkLayer::InfiniBand => AhAttr { dlid: rb.lid, port_num: 1, ..AhAttr::default() },
    };
    let (psn_a, psn_b) = (0x00_1234, 0x00_5678);
    let la = a.query_port().unwrap().lid;
    let req = Req {
        local_comm_id: 0,
        service_id: SVC,
        local_ca_guid: 0,
        local_qkey: 0,
        local_qpn: rca.qpn(),
        responder_resources: 1,
        initiator_depth: 1,
        remote_cm_response_timeout: 20,
        transport_service_type: 0,
        end_to_end_flow_control: true,
        starting_psn: psn_a,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xffff,
        path_mtu: 3,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        path: CmPath {
            local_lid: la,
            remote_lid: rb.lid,
            local_gid: a.query_gid(0).unwrap(),
            remote_gid: rb.gid,
            hop_limit: 64,
            ..CmPath::default()
        },
        private_data,
    };
    let ca = ea.connect(0, to_b, req);
    assert_eq!(carry(&sa, &mut ea, &sb, &mut eb, 0), 1, "the REQ");
    let Some(Event::ConnectRequest { id: cb, req }) = eb.poll_event() else { panic!("no connect request") };
    assert_eq!(CmaHdr::parse(&req.private_data), Ok(hdr));
    // B connects its QP from the REQ alone (and the MAC its completion showed).
    let mac_a = eb.peer(cb).unwrap().dmac;
    let from_a = RemoteQp {
        qpn: req.local_qpn,
        psn: req.starting_psn,
        lid: req.path.local_lid,
        gid: req.path.local_gid,
        mac: mac_a,
    };
    let rcb = rcb.to_rtr(RtrAttr::rc(from_a)).map_err(|e| e.error).unwrap();
    let rcb = rcb.to_rts(RtsAttr::rc(psn_b)).map_err(|e| e.error).unwrap();
    let rep = Rep {
        local_comm_id: 0,
        remote_comm_id: 0,
        local_qkey: 0,
        local_qpn: rcb.qpn(),
        starting_psn: psn_b,
        responder_resources: 1,
        initiator_depth: 1,
        target_ack_delay: 15,
        failover_accepted: 0,
        end_to_end_flow_control: true,
        rnr_retry_count: 7,
        srq: false,
        local_ca_guid: 0,
        private_data: [0; private_len::REP],
    };
    eb.accept(1, cb, rep).unwrap();
    assert_eq!(carry(&sb, &mut eb, &sa, &mut ea, 1), 1, "the REP");
    let Some(Event::Established { id, rep: Some(rep) }) = ea.poll_event() else { panic!("A not established") };
    assert_eq!((id, rep.local_qpn, rep.starting_psn), (ca, rcb.qpn(), psn_b));
    let to_b_rc = RemoteQp { qpn: rep.local_qpn, psn: rep.starting_psn, ..rb };
    let rca = rca.to_rtr(RtrAttr::rc(to_b_rc)).map_err(|e| e.error).unwrap();
    let rca = rca.to_rts(RtsAttr::rc(psn_a)).map_err(|e| e.error).unwrap();
    assert_eq!(carry(&sa, &mut ea, &sb, &mut eb, 2), 1, "the RTU");
    assert_eq!(eb.poll_event(), Some(Event::Established { id: cb, rep: None }));
    // The connection carries data.
    let msg = b"over a connection the CM made";
    mr_a.write(SEND_AT, msg).unwrap();
    rcb.post_recv(&[wr::recv(1, &[mr_b.sge(SEND_AT, 64)])]).unwrap();
    rca.post_send(&[wr::send(2, &[mr_a.sge(SEND_AT, msg.len() as u32)])]).unwrap();
    assert_eq!(wait(&rcq_b, 1)[0].status, WcStatus::Success);
    assert_eq!(wait(&rcq_a, 1)[0].status, WcStatus::Success);
    assert_eq!(mr_b.read_vec(SEND_AT, msg.len()), msg);
    ea.disconnect(3, ca).unwrap();
    assert_eq!(carry(&sa, &mut ea, &sb, &mut eb, 3), 1, "the DREQ");
    assert_eq!(eb.poll_event(), Some(Event::Disconnected { id: cb }));
    assert_eq!(carry(&sb, &mut eb, &sa, &mut ea, 4), 1, "the DREP");
    assert_eq!(ea.poll_event(), Some(Event::Disconnected { id: ca }));
    assert_eq!((ea.connections(), eb.connections()), (0, 0));
}

#[test]
fn the_cm_connects_rc_qps_over_qp1_on_roce() {
    cm_connects_rc_qps_over_qp1(SimConfig::default());
}

#[test]
fn the_cm_connects_rc_qps_over_qp1_on_infiniband() {
    cm_connects_rc_qps_over_qp1(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
}

/// General management packets with timeouts and retries from the host's `GsiClient` (QP1, the well-known Q_Key): a
/// peer's QP1 that drops the first try of a request answers the second, which ends the call with its response (one
/// retry); a peer that answers nothing more makes the next call time out after its retries, each try counted at
/// the peer.
#[test]
fn a_gmp_request_is_sent_again_until_answered_and_times_out_when_nobody_answers() {
    use mlx5_verbs::{GmpReply, GsiClient};
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    use std::sync::Barrier;
    let cfg = SimConfig { port_type: PortType::Ib, ..SimConfig::default() };
    let (a, b) = Context::open_sim_pair_with(cfg).unwrap();
    let to_b = AhAttr { dlid: b.query_port().unwrap().lid, port_num: 1, ..AhAttr::default() };
    let (stop, ready, seen) = (AtomicBool::new(false), Barrier::new(2), AtomicU32::new(0));
    std::thread::scope(|s| {
        // B: a QP1 that answers only the second request it sees.
        let peer = s.spawn(|| {
            let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
            let (pd, cq) = (b.alloc_pd().unwrap(), b.create_cq(16).unwrap());
            let mut buf = b.alloc_buffer(4096).unwrap();
            let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
            let qp = pd.create_qp(QpType::Gsi, &cq, &cq, cap).unwrap().activate_ud(QP1_QKEY).unwrap();
            let recv_len = (MAD + GRH_BYTES) as u32;
            // Every receive posted up front (each is posted again when used): a try that comes while this thread
            // is slow (under QEMU) finds one, instead of being dropped as a UD packet to an empty RQ.
            for _ in 0..cap.max_recv_wr {
                qp.post_recv(&[wr::recv(0, &[mr.sge(0, recv_len)])]).unwrap();
            }
            ready.wait();
            let mut wc = [WorkCompletion::default()];
            while !stop.load(Ordering::Relaxed) {
                if cq.poll(&mut wc).unwrap() == 0 {
                    std::thread::sleep(Duration::from_millis(1));
                    continue;
                }
                if wc[0].wr_id != 0 {
                    continue;
                }
                assert_eq!((wc[0].status, wc[0].src_qp), (WcStatus::Success, 1));
                if seen.fetch_add(1, Ordering::Relaxed) + 1 == 2 {
                    let mut rsp = mr.read_vec(GRH_BYTES, MAD);
                    rsp[3] = 0x81;
                    mr.write(1024, &rsp).unwrap();
                    let ah = pd.create_ah_from_wc(&wc[0], None, 1).unwrap();
                    qp.post_send(&[wr::ud_send(1, &[mr.sge(1024, MAD as u32)], ah.dest(1, QP1_QKEY))]).unwrap();
                }
                qp.post_recv(&[wr::recv(0, &[mr.sge(0, recv_len)])]).unwrap();
            }
        });
        let (pd, cq) = (a.alloc_pd().unwrap(), a.create_cq(32).unwrap());
        let mut buf = a.alloc_buffer(GsiClient::BUF_LEN).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        let mut client = GsiClient::new(&pd, &cq, &mr, 0x0042_0000_0000_0001).unwrap();
        ready.wait();
        // Get(ClassPortInfo) of the performance class.
        let mut get = [0u8; MAD];
        get[..4].copy_from_slice(&[1, 0x04, 1, 0x01]);
        get[16..18].copy_from_slice(&1u16.to_be_bytes());
        // A try's timeout long enough that B's answer to the second comes before a third, however busy the machine.
        let got = client.call(&to_b, &get, Duration::from_millis(500), 3).unwrap();
        let GmpReply::Response { mad, from } = got else { panic!("{got:?}") };
        assert_eq!((mad[3], &mad[8..16]), (0x81, &0x0042_0000_0000_0001u64.to_be_bytes()[..]), "GetResp, our TID");
        assert_eq!(from.dlid, to_b.dlid, "from B's LID");
        let c = client.counters();
        assert_eq!((c.requests, c.retries, c.responses, c.timeouts), (1, 1, 1, 0));
        // Nobody answers now: the first try and two retries, then the timeout.
        assert_eq!(client.call(&to_b, &get, Duration::from_millis(50), 2).unwrap(), GmpReply::TimedOut);
        let c = client.counters();
        assert_eq!((c.requests, c.retries, c.responses, c.timeouts), (2, 3, 1, 1));
        // Every try reaches B: 2 of the first request and 3 of the second.
        let end = std::time::Instant::now() + Duration::from_secs(5);
        while seen.load(Ordering::Relaxed) < 5 && std::time::Instant::now() < end {
            std::thread::sleep(Duration::from_millis(5));
        }
        stop.store(true, Ordering::Relaxed);
        peer.join().unwrap();
        assert_eq!(seen.load(Ordering::Relaxed), 5, "B saw 2 tries of the first request and 3 of the second");
    });
}
