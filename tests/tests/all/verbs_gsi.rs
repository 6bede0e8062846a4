//! The general services QP (QP1) through the verbs API on a simulated pair: created as mlx5_ib's hardware GSI QP
//! (`qpc.st` QP1), reached as QP 1 whatever QPN firmware gave it, answering as QP 1, on RoCE and InfiniBand; one
//! per port; a datagram with another Q_Key dropped and counted.

use std::time::Duration;

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
