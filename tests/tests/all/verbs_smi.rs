//! Subnet management of a port this stack drives: on a simulated InfiniBand pair waiting for a subnet manager (no
//! LID, state Init), device A plays the SM with a raw SMI QP (QP0) and device B runs the host's `SmiAgent` (QP0 ->
//! MAD_IFC -> QP0). A sweeps B by directed route as opensm does (NodeInfo, PortInfo, then Set(PortInfo) with the
//! LID, ARMED, ACTIVE), so B's port ends ACTIVE with the LID A gave it; a Set(PortInfo) with a multicast LID gets
//! the spec's status and changes nothing; a truncated MAD, another class and a response are dropped and counted.

use std::time::Duration;

use mlx5_rdmacm::smp::{off, SmpDrop, DIRECTION, PERMISSIVE_LID};
use mlx5_sim::{PortType, SimConfig};
use mlx5_verbs::{
    wr, Access, AhAttr, Context, QpCap, QpType, SmiAgent, SmiOutcome, WcStatus, WorkCompletion, GRH_BYTES, MAD_LEN,
};

const WAIT: Duration = Duration::from_secs(5);
/// IBTA 14.2.5: NodeInfo and PortInfo; PortInfo's state values (Table 148).
const NODE_INFO: u16 = 0x0011;
const PORT_INFO: u16 = 0x0015;
const INIT: u8 = 2;
const ARMED: u8 = 3;
const ACTIVE: u8 = 4;
/// PortInfo fields inside the SMP data: LID, MasterSMLID, the state nibble.
const PI_LID: usize = off::DATA + 16;
const PI_SM_LID: usize = off::DATA + 18;
const PI_STATE: usize = off::DATA + 32;

/// A directed-route SMP to the port at the other end of A's cable, as it leaves A (hop pointer already 1).
fn dr_smp(method: u8, attr_id: u16, tid: u64, data: Option<&[u8]>) -> [u8; MAD_LEN] {
    let mut m = [0u8; MAD_LEN];
    m[..4].copy_from_slice(&[1, 0x81, 1, method]);
    m[off::HOP_PTR] = 1;
    m[off::HOP_CNT] = 1;
    m[8..16].copy_from_slice(&tid.to_be_bytes());
    m[16..18].copy_from_slice(&attr_id.to_be_bytes());
    m[off::DR_SLID..off::DR_SLID + 2].copy_from_slice(&PERMISSIVE_LID.to_be_bytes());
    m[off::DR_DLID..off::DR_DLID + 2].copy_from_slice(&PERMISSIVE_LID.to_be_bytes());
    m[off::INITIAL_PATH + 1] = 1;
    if let Some(d) = data {
        m[off::DATA..off::DATA + 64].copy_from_slice(d);
    }
    m
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

#[test]
fn a_subnet_manager_sweeps_a_host_driven_port_to_active_through_qp0_and_mad_ifc() {
    let cfg = SimConfig { port_type: PortType::Ib, subnet_manager: true, ..SimConfig::default() };
    let (a, b) = Context::open_sim_pair_with(cfg).unwrap();
    let before = b.query_port().unwrap();
    assert_eq!((before.lid, before.state), (0, INIT), "B waits for an SM: no LID, Init");

    // B: the host's agent on its own PD, CQ and buffer.
    let (pd_b, cq_b) = (b.alloc_pd().unwrap(), b.create_cq(64).unwrap());
    let mut buf_b = b.alloc_buffer(SmiAgent::BUF_LEN).unwrap();
    let mr_b = pd_b.register(&mut buf_b, Access::LOCAL_WRITE).unwrap();
    let mut agent = SmiAgent::new(&pd_b, &cq_b, &mr_b).unwrap();

    // A: the SM's QP0, sending to the permissive LID (whoever is at the other end of the cable).
    let (pd_a, cq_a) = (a.alloc_pd().unwrap(), a.create_cq(16).unwrap());
    let mut buf_a = a.alloc_buffer(4096).unwrap();
    let mr_a = pd_a.register(&mut buf_a, Access::LOCAL_WRITE).unwrap();
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let sm = pd_a.create_qp(QpType::Smi, &cq_a, &cq_a, cap).unwrap().activate_ud(0).unwrap();
    let to_b = pd_a.create_ah(&AhAttr { dlid: PERMISSIVE_LID, port_num: 1, ..AhAttr::default() }).unwrap();
    let send = |bytes: &[u8]| {
        mr_a.write(0, bytes).unwrap();
        sm.post_send(&[wr::ud_send(1, &[mr_a.sge(0, bytes.len() as u32)], to_b.dest(0, 0))]).unwrap();
    };
    let ask = |agent: &mut SmiAgent<'_>, req: &[u8; MAD_LEN]| -> [u8; MAD_LEN] {
        let mut wc = [WorkCompletion::default(); 2];
        sm.post_recv(&[wr::recv(2, &[mr_a.sge(1024, (GRH_BYTES + MAD_LEN) as u32)])]).unwrap();
        send(req);
        assert_eq!(agent.serve(WAIT).unwrap(), Some(SmiOutcome::Answered));
        let n = cq_a.poll_until(&mut wc, 2, WAIT).unwrap();
        assert_eq!(n, 2, "A's send and the answer: {:?}", &wc[..n]);
        let got = wc.iter().find(|w| w.wr_id == 2).expect("the answer reached A's QP0");
        assert_eq!((got.status, got.src_qp), (WcStatus::Success, 0), "from QP 0");
        let rsp: [u8; MAD_LEN] = mr_a.read_vec(1024 + GRH_BYTES, MAD_LEN).try_into().unwrap();
        assert_eq!((rsp[3], &rsp[8..16]), (0x81, &req[8..16]), "GetResp with the request's TID");
        // The way back: the direction bit, and the hop pointer one hop back from B (C14-13:1); the SM's own
        // receive rules take it to 0 (C14-13:3).
        assert_eq!((be16(&rsp, off::STATUS) & DIRECTION, rsp[off::HOP_PTR]), (DIRECTION, 1));
        rsp
    };

    let ni = ask(&mut agent, &dr_smp(1, NODE_INFO, 1, None));
    assert_eq!(be16(&ni, off::STATUS), DIRECTION, "status success");
    let guid = u64::from_be_bytes(ni[off::DATA + 12..off::DATA + 20].try_into().unwrap());
    assert_eq!(guid, b.node_guid().unwrap(), "B's port GUID, as its firmware knows it");

    let pi = ask(&mut agent, &dr_smp(1, PORT_INFO, 2, None));
    assert_eq!((be16(&pi, PI_LID), pi[PI_STATE] & 0xf), (0, INIT));

    // The LID and the SM's LID, no state change; then ARMED, then ACTIVE, each a Set of what the Get returned.
    let mut data: [u8; 64] = pi[off::DATA..off::DATA + 64].try_into().unwrap();
    data[16..18].copy_from_slice(&0x0021u16.to_be_bytes());
    data[18..20].copy_from_slice(&0x0020u16.to_be_bytes());
    data[32] &= 0xf0;
    let r = ask(&mut agent, &dr_smp(2, PORT_INFO, 3, Some(&data)));
    assert_eq!((be16(&r, off::STATUS), be16(&r, PI_LID), be16(&r, PI_SM_LID)), (DIRECTION, 0x21, 0x20));
    for (tid, state) in [(4, ARMED), (5, ACTIVE)] {
        data[32] = (data[32] & 0xf0) | state;
        let r = ask(&mut agent, &dr_smp(2, PORT_INFO, tid, Some(&data)));
        assert_eq!((be16(&r, off::STATUS), r[PI_STATE] & 0xf), (DIRECTION, state));
    }
    let now = b.query_port().unwrap();
    assert_eq!((now.lid, now.sm_lid, now.state), (0x21, 0x20, ACTIVE), "B's own verbs see what the SM set");

    // A multicast LID is no port's: status 0x1c (invalid attribute value), and the port keeps its LID.
    data[16..18].copy_from_slice(&0xc001u16.to_be_bytes());
    data[32] &= 0xf0;
    let r = ask(&mut agent, &dr_smp(2, PORT_INFO, 6, Some(&data)));
    assert_eq!(be16(&r, off::STATUS), DIRECTION | 0x1c);
    assert_eq!(b.query_port().unwrap().lid, 0x21);

    // What is no SMP for B's agent is dropped and counted, and the agent keeps serving.
    let mut wc = [WorkCompletion::default(); 2];
    let wait_send = |wc: &mut [WorkCompletion; 2]| {
        assert_eq!(cq_a.poll_until(&mut wc[..1], 1, WAIT).unwrap(), 1);
        assert_eq!(wc[0].status, WcStatus::Success);
    };
    let good = dr_smp(1, NODE_INFO, 7, None);
    send(&good[..100]);
    wait_send(&mut wc);
    let o = agent.serve(WAIT).unwrap();
    assert!(matches!(o, Some(SmiOutcome::Dropped(SmpDrop::Mad(_)))), "{o:?}");
    let mut perf = good;
    perf[1] = 0x04;
    send(&perf);
    wait_send(&mut wc);
    assert_eq!(agent.serve(WAIT).unwrap(), Some(SmiOutcome::Dropped(SmpDrop::NotSubnetClass(0x04))));
    let mut resp = good;
    resp[3] = 0x81;
    send(&resp);
    wait_send(&mut wc);
    assert_eq!(agent.serve(WAIT).unwrap(), Some(SmiOutcome::Dropped(SmpDrop::NotRequest(0x81))));
    let s = agent.stats();
    assert_eq!((s.answered, s.dropped, s.mad_ifc_failed, s.recv_errors, s.send_errors), (6, 3, 0, 0, 0));
    // Still serving after the drops: every slot went back.
    let ni = ask(&mut agent, &dr_smp(1, NODE_INFO, 8, None));
    assert_eq!(be16(&ni, off::STATUS), DIRECTION);
}

#[test]
fn an_ethernet_port_has_no_smi_qp() {
    let ctx = Context::open_sim().unwrap();
    let (pd, cq) = (ctx.alloc_pd().unwrap(), ctx.create_cq(16).unwrap());
    let mut buf = ctx.alloc_buffer(SmiAgent::BUF_LEN).unwrap();
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
    let e = SmiAgent::new(&pd, &cq, &mr).unwrap_err();
    assert!(e.to_string().contains("QP0"), "{e}");
}
