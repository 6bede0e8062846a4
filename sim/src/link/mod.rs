//! How packets travel between devices: port addresses and routing (loopback or a connected peer) in `port.rs`;
//! the fabric (`vde.rs`) is the link to devices in other processes and to QEMU guests. Links only carry frames:
//! what they receive goes to [`Station`], which the device layer implements, and the pump that runs a device and
//! hands its packets on is the device layer's (`device/pump.rs`).
//!
//! A packet (module `wire`) is a whole message (one request or one response); between Ethernet ports, of this
//! process (`device/pump.rs`) or on the fabric, it crosses as the RoCEv2 frames it stands for. Routing is by the
//! sender's path or address vector: the IB destination LID, or on Ethernet the destination MAC, as an Ethernet
//! segment delivers; the receiving port then takes a RoCE packet only for one of its own GIDs (its link-local GID
//! or any entry of its GID table, IPv4-mapped ones included: `Datapath::owns_gid`). The device's own address is
//! loopback (the packet goes to its own inbox and is handled under the same lock); an address of a peer joined by
//! [`crate::sim_device::SimDevice::connect`] goes out on the wire; any other goes to the fabric if the port is
//! plugged into one, else it is unreachable.
//!
//! One fabric logic, two kinds of frame transport. The fabric (`vde.rs`, with `vde_ib.rs` for InfiniBand ports'
//! frames) addresses Ethernet frames (MACs from link-local GIDs or ARP, an IB port's from its LID), counts and
//! bounds what it sends and takes, and reports a fabric that went away; it reads and writes frames through
//! `datagrams::Datagrams`, of which there are two:
//!
//! - a libvdeplug plug (`vde.rs`): `wire=vde[:URL]`, any number of ports on a `vde_switch` (with `direct.rs`, a
//!   path past the switch between ports of one machine) or any libvdeplug URL;
//! - a point-to-point stream in QEMU's `-netdev stream` framing (`stream.rs`: a 4-byte length before each
//!   frame), plain sockets with no libvdeplug: TCP to another process (`tcp.rs`: `wire=listen` / `wire=connect`,
//!   a hello each way, connect retries, a bounded number of pending handshakes) or a UNIX socket to a QEMU
//!   guest's NIC (`guest.rs`: `wire=qemu`). On a stream an IB port's frames may name any LID (the permissive
//!   LID of a subnet manager's SMPs, LID 0 before it assigned one), and its LID follows the one the SMA sets.
//!
//! Frame size: the fabric sends and takes frames of at most `MAX_ETH_FRAME` (1518) bytes on both transports, as a
//! `vde_switch` carries no more (it truncates longer ones). A stream could carry up to `MAX_STREAM_FRAME` (64
//! KiB), but one limit keeps one behaviour: a path MTU above 1024 does not cross any fabric, and a longer frame
//! from a peer is dropped and counted (`rx_oversize`), whichever transport it came on.
//!
//! Locking: a device only ever holds its own lock. The pump (`device/pump.rs`) runs one device's datapath, takes the packets it
//! produced for other devices, then locks each destination in turn, hands it the packet and runs its datapath,
//! and so on until nothing is left to carry. No two device locks are held at once, so two devices sending to
//! each other from two threads cannot deadlock.

mod datagrams;
mod direct;
pub(crate) mod guest;
mod port;
pub mod stream;
pub(crate) mod tcp;
pub(crate) mod vde;
pub(crate) mod vde_ib;

pub(crate) use port::*;

#[cfg(test)]
mod tests {
    use crate::config::Mode;
    use crate::config::PortType;
    use crate::config::SimConfig;
    use crate::events::RetryKind;
    use crate::events::SimEvent;
    use crate::sim_device::SimDevice;
    use crate::testkit::submit::{Bell, QpSpec, RcParams, Rdma, TAv, Wqe};
    use mlx5_core::prm::consts;

    const SEND: u8 = consts::MLX5_OPCODE_SEND;

    fn roce(mac_last: u8, mode: Mode) -> SimConfig {
        let mut mac = SimConfig::default().mac;
        mac[5] = mac_last;
        SimConfig { mac, node_guid: 0x1000 + u64::from(mac_last), mode, ..SimConfig::default() }
    }

    fn ib(lid: u16, mode: Mode) -> SimConfig {
        SimConfig { port_type: PortType::Ib, lid, node_guid: 0x2000 + u64::from(lid), mode, ..SimConfig::default() }
    }

    #[test]
    fn gids_and_lids() {
        // fe80::/64 + the MAC's modified EUI-64: b8:ce:f6:12:34:56 -> bace:f6ff:fe12:3456.
        let eth = SimDevice::default();
        let want = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0xba, 0xce, 0xf6, 0xff, 0xfe, 0x12, 0x34, 0x56];
        assert_eq!((eth.gid(0), eth.gid(1), eth.lid()), (Some(want), None, 0));
        let dev = SimDevice::new(ib(9, Mode::Inline));
        let mut g = [0u8; 16];
        g[..2].copy_from_slice(&[0xfe, 0x80]);
        g[8..].copy_from_slice(&0x2009u64.to_be_bytes());
        assert_eq!((dev.gid(0), dev.lid()), (Some(g), 9));
    }

    #[test]
    fn ud_over_a_wire_between_two_roce_devices() {
        let mut a = Rdma::new(roce(0x01, Mode::Inline));
        let mut b = Rdma::new(roce(0x02, Mode::Inline));
        let (mut a_cq, mut b_cq) = (a.cq(4), b.cq(4));
        let mut qa = a.qp(QpSpec::ud(), a_cq.cqn, a_cq.cqn);
        let mut qb = b.qp(QpSpec::ud(), b_cq.cqn, b_cq.cqn);
        a.ready_ud(&qa, 0x77);
        b.ready_ud(&qb, 0x77);
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        ma.write(0, b"across the wire");
        b.post_recv(&mut qb, &[(mb.addr(), 100, mb.key)]);
        let dst = b.me(qb.qpn);
        let av =
            TAv { dqpn: qb.qpn, qkey: 0x77, grh: true, hop_limit: 1, rgid: dst.gid, rmac: dst.mac, ..TAv::default() };
        let w = Wqe::new(SEND).av(&av).data(15, ma.key, ma.addr());
        // Not connected yet: dropped.
        a.post_send(&mut qa, &w, Bell::Db);
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert!(b.poll(&mut b_cq).is_none());
        a.h.dev.connect(&b.h.dev);
        a.post_send(&mut qa, &w, Bell::Db);
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.poll(&mut b_cq).expect("delivered over the wire");
        // GRH present, RoCE v2 (bit 27) over IPv6 (the L3 header type in bits 26:24).
        let ipv6 = (1 << 3 | consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV6) << 24;
        assert_eq!(
            (e.opcode(), e.byte_cnt(), e.flags_rqpn()),
            (consts::MLX5_CQE_RESP_SEND, 55, qa.qpn | 1 << 28 | ipv6)
        );
        // The GRH names A as the source and B as the destination.
        let grh = mb.read(0, 40);
        assert_eq!((&grh[8..24], &grh[24..40]), (&a.h.dev.gid(0).unwrap()[..], &dst.gid[..]));
        assert_eq!(mb.read(40, 15), b"across the wire");
        // Between two Ethernet ports of one process the datagram crossed as one RoCEv2 frame.
        assert_eq!((b.h.dev.frames_received(), b.h.dev.frame_drops().total()), (1, 0));
        // The right GID with the wrong MAC goes nowhere.
        let mut wrong = av;
        wrong.rmac[0] ^= 0x10;
        a.post_send(&mut qa, &Wqe::new(SEND).av(&wrong).data(15, ma.key, ma.addr()), Bell::Db);
        let dropped = SimEvent::UdDropped { qpn: qa.qpn, dqpn: qb.qpn, why: "destination MAC is not the GID's port" };
        assert!(a.h.dev.events().contains(&dropped));
        // A GID nobody on the wire owns, behind B's MAC: the wire delivers it, B's port drops it.
        let mut nobody = av;
        nobody.rgid[9] ^= 0x40;
        a.post_send(&mut qa, &Wqe::new(SEND).av(&nobody).data(15, ma.key, ma.addr()), Bell::Db);
        let not_b = SimEvent::FrameDropped { why: "destination GID is not in the port's GID table" };
        assert!(b.h.dev.events().contains(&not_b));
        // Behind a MAC nobody has.
        nobody.rmac[5] ^= 0x40;
        a.post_send(&mut qa, &Wqe::new(SEND).av(&nobody).data(15, ma.key, ma.addr()), Bell::Db);
        assert!(a.h.dev.events().contains(&SimEvent::UdDropped {
            qpn: qa.qpn,
            dqpn: qb.qpn,
            why: "unknown destination"
        }));
        assert_eq!(a.drain(&mut a_cq).len(), 3);
        assert!(b.poll(&mut b_cq).is_none());
    }

    #[test]
    fn roce_reaches_every_gid_of_the_receiving_port() {
        use crate::wire::roce::frame::mapped;
        let mut a = Rdma::new(SimConfig { ipv4_addrs: &[[10, 0, 0, 1]], ..roce(0x01, Mode::Inline) });
        let mut b = Rdma::new(SimConfig { ipv4_addrs: &[[10, 0, 0, 2]], ..roce(0x02, Mode::Inline) });
        a.h.dev.connect(&b.h.dev);
        // A's IPv4 GID at index 1; B's table holds, besides its default GID, an address only its driver gave it.
        assert_eq!(a.h.set_roce_address(1, mapped([10, 0, 0, 1])), (0, 0));
        assert_eq!(b.h.set_roce_address(1, mapped([10, 0, 0, 2])), (0, 0));
        assert_eq!(b.h.set_roce_address(2, mapped([10, 9, 9, 9])), (0, 0));
        let (mut a_cq, mut b_cq) = (a.cq(8), b.cq(8));
        let mut qa = a.qp(QpSpec::ud(), a_cq.cqn, a_cq.cqn);
        let mut qb = b.qp(QpSpec::ud(), b_cq.cqn, b_cq.cqn);
        a.ready_ud(&qa, 0x77);
        b.ready_ud(&qb, 0x77);
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        ma.write(0, b"to any address");
        let (b_mac, b_qpn) = (b.me(qb.qpn).mac, qb.qpn);
        let av = |sgid_index, rgid| TAv {
            dqpn: b_qpn,
            qkey: 0x77,
            grh: true,
            hop_limit: 64,
            sgid_index,
            rgid,
            rmac: b_mac,
            ..TAv::default()
        };
        // The link-local GID (IPv6 frames), the IPv4 address (IPv4 frames), a GID only in B's table: delivered.
        let to = [(0, b.me(qb.qpn).gid), (1, mapped([10, 0, 0, 2])), (1, mapped([10, 9, 9, 9]))];
        for (i, (sgid_index, rgid)) in to.into_iter().enumerate() {
            let at = 256 * i;
            b.post_recv(&mut qb, &[(mb.addr() + at as u64, 100, mb.key)]);
            a.post_send(&mut qa, &Wqe::new(SEND).av(&av(sgid_index, rgid)).data(14, ma.key, ma.addr()), Bell::Db);
            assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
            let e = b.poll(&mut b_cq).unwrap_or_else(|| panic!("not delivered to {rgid:x?}"));
            assert_eq!((e.opcode(), e.byte_cnt()), (consts::MLX5_CQE_RESP_SEND, 40 + 14));
            // The 40 bytes before the data name the address the frame was sent to: an IPv6 header's destination,
            // or, for an IPv4 frame, the IPv4 header (version 4, IHL 5) in the last 20 bytes.
            if rgid[..12] == mapped([0; 4])[..12] {
                assert_eq!(mb.read(at + 20, 1), [0x45]);
                assert_eq!(mb.read(at + 36, 4), rgid[12..]);
            } else {
                assert_eq!(mb.read(at + 24, 16), rgid);
            }
            assert_eq!(mb.read(at + 40, 14), b"to any address");
        }
        assert_eq!(b.h.dev.frame_drops().total(), 0);
        // An IPv4 address B does not hold, behind B's MAC: dropped by B's port.
        b.post_recv(&mut qb, &[(mb.addr() + 1024, 100, mb.key)]);
        a.post_send(&mut qa, &Wqe::new(SEND).av(&av(1, mapped([10, 0, 0, 3]))).data(14, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert!(b.poll(&mut b_cq).is_none());
        let dropped = SimEvent::FrameDropped { why: "destination GID is not in the port's GID table" };
        assert!(b.h.dev.events().contains(&dropped));
        // RC between the two IPv4 addresses: a SEND and its ACK cross as IPv4 frames.
        let (mut a_rc, mut b_rc) = (a.cq(4), b.cq(4));
        let mut ra = a.qp(QpSpec::rc(), a_rc.cqn, a_rc.cqn);
        let mut rb = b.qp(QpSpec::rc(), b_rc.cqn, b_rc.cqn);
        let to_b = crate::testkit::submit::Remote { gid: mapped([10, 0, 0, 2]), ..b.me(rb.qpn) };
        let to_a = crate::testkit::submit::Remote { gid: mapped([10, 0, 0, 1]), ..a.me(ra.qpn) };
        a.connect_rc(&ra, &to_b, RcParams::default());
        b.connect_rc(&rb, &to_a, RcParams::default());
        b.post_recv(&mut rb, &[(mb.addr() + 2048, 64, mb.key)]);
        a.post_send(&mut ra, &Wqe::new(SEND).data(14, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.poll(&mut a_rc).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(b.poll(&mut b_rc).unwrap().byte_cnt(), 14);
        assert_eq!(mb.read(2048, 14), b"to any address");
    }

    #[test]
    fn loopback_to_the_ports_own_ipv4_gid() {
        use crate::wire::roce::frame::mapped;
        let mut r = Rdma::new(SimConfig { ipv4_addrs: &[[10, 0, 0, 7]], ..roce(0x07, Mode::Inline) });
        let cq = r.cq(4);
        let (mut a, mut b) = (r.qp(QpSpec::rc(), cq.cqn, cq.cqn), r.qp(QpSpec::rc(), cq.cqn, cq.cqn));
        let me = |q: &crate::testkit::submit::TQp| crate::testkit::submit::Remote {
            gid: mapped([10, 0, 0, 7]),
            ..r.me(q.qpn)
        };
        let (to_b, to_a) = (me(&b), me(&a));
        r.connect_rc(&a, &to_b, RcParams::default());
        r.connect_rc(&b, &to_a, RcParams::default());
        let m = r.mr(4096);
        m.write(0, b"self");
        r.post_recv(&mut b, &[(m.addr() + 512, 64, m.key)]);
        r.post_send(&mut a, &Wqe::new(SEND).data(4, m.key, m.addr()), Bell::Db);
        let mut cq = cq;
        // The receive completes before the ACK reaches the sender.
        let st: Vec<_> = r.drain(&mut cq).iter().map(|e| e.status()).collect();
        assert_eq!(st, [(consts::MLX5_CQE_RESP_SEND, 0), (consts::MLX5_CQE_REQ, 0)]);
        assert_eq!(m.read(512, 4), b"self");
    }

    /// An RC QP on each of two devices, connected to each other.
    fn rc_across(
        ca: SimConfig,
        cb: SimConfig,
        pa: RcParams,
    ) -> (Rdma, Rdma, [crate::testkit::submit::TQp; 2], [crate::testkit::submit::TCq; 2]) {
        let mut a = Rdma::new(ca);
        let mut b = Rdma::new(cb);
        a.h.dev.connect(&b.h.dev);
        let (a_cq, b_cq) = (a.cq(5), b.cq(5));
        let qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (ra, rb) = (a.me(qa.qpn), b.me(qb.qpn));
        a.connect_rc(&qa, &rb, pa);
        b.connect_rc(&qb, &ra, RcParams { min_rnr_nak: 1, ..RcParams::default() });
        (a, b, [qa, qb], [a_cq, b_cq])
    }

    #[test]
    fn rc_between_two_ib_devices_by_lid() {
        let (mut a, mut b, [mut qa, mut qb], [mut a_cq, mut b_cq]) =
            rc_across(ib(1, Mode::Inline), ib(2, Mode::Inline), RcParams::default());
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        ma.write(0, b"by lid");
        b.post_recv(&mut qb, &[(mb.addr(), 64, mb.key)]);
        a.post_send(&mut qa, &Wqe::new(SEND).solicited().data(6, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.poll(&mut b_cq).unwrap();
        // IB without a GRH: no GRH flag, the SL in bits 27:24, the sender's LID.
        assert_eq!(
            (e.opcode(), e.flags_rqpn(), e.slid(), e.solicited()),
            (consts::MLX5_CQE_RESP_SEND, qa.qpn | 3 << 24, 1, true)
        );
        assert_eq!(mb.read(0, 6), b"by lid");
        // READ and an atomic on the other device's memory.
        mb.write(1024, &0x10u64.to_be_bytes());
        mb.write(2048, b"remote bytes");
        let rd =
            Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(mb.addr() + 2048, mb.key).data(12, ma.key, ma.addr() + 100);
        a.post_send(&mut qa, &rd, Bell::Db);
        let fa = Wqe::new(consts::MLX5_OPCODE_ATOMIC_FA).raddr(mb.addr() + 1024, mb.key).atomic(5, 0).data(
            8,
            ma.key,
            ma.addr() + 200,
        );
        a.post_send(&mut qa, &fa, Bell::Db);
        let done: Vec<_> = a.drain(&mut a_cq).iter().map(|e| e.status()).collect();
        assert_eq!(done, [(consts::MLX5_CQE_REQ, 0); 2]);
        assert_eq!(ma.read(100, 12), b"remote bytes");
        assert_eq!(
            (ma.read(200, 8), mb.read(1024, 8)),
            (0x10u64.to_be_bytes().to_vec(), 0x15u64.to_be_bytes().to_vec())
        );
        // An RNR across the wire: the requester's clock drives the retry.
        a.post_send(&mut qa, &Wqe::new(SEND).data(6, ma.key, ma.addr()), Bell::Db);
        assert!(a
            .h
            .dev
            .events()
            .iter()
            .any(|e| matches!(e, SimEvent::RnrNak { remote_qpn, .. } if *remote_qpn == qb.qpn)));
        b.post_recv(&mut qb, &[(mb.addr() + 64, 64, mb.key)]);
        a.h.dev.advance_ns(20_000);
        assert!(a.h.dev.events().iter().any(|e| matches!(e, SimEvent::Retry { kind: RetryKind::Rnr, .. })));
        assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(b.poll(&mut b_cq).unwrap().byte_cnt(), 6);
    }

    #[test]
    fn a_peer_that_goes_away_stops_answering() {
        let pa = RcParams { retry_count: 1, ack_timeout: 1, ..RcParams::default() };
        let (mut a, b, [mut qa, _qb], [mut a_cq, _]) = rc_across(roce(1, Mode::Inline), roce(2, Mode::Inline), pa);
        let ma = a.mr(64);
        b.h.dev.fail_health(1);
        a.post_send(&mut qa, &Wqe::new(SEND).data(8, ma.key, ma.addr()), Bell::Db);
        let lost = SimEvent::Unreachable { qpn: qa.qpn, wqe_counter: 0, why: "destination device dead" };
        assert!(a.h.dev.events().contains(&lost));
        drop(b);
        a.h.dev.advance_ns(10_000);
        assert!(a.h.dev.events().contains(&SimEvent::Unreachable {
            qpn: qa.qpn,
            wqe_counter: 0,
            why: "destination device gone"
        }));
        let e = a.poll(&mut a_cq).unwrap();
        assert_eq!(e.status(), (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_TRANSPORT_RETRY_EXC_ERR));
    }

    #[test]
    fn threaded_devices_run_doorbells_on_their_own_threads() {
        let (mut a, mut b, [mut qa, mut qb], [mut a_cq, mut b_cq]) =
            rc_across(roce(1, Mode::Threaded), roce(2, Mode::Threaded), RcParams::default());
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        ma.write(0, &[0xab; 256]);
        for k in 0..8u64 {
            b.post_recv(&mut qb, &[(mb.addr() + k * 256, 256, mb.key)]);
        }
        for _ in 0..8 {
            a.post_send(&mut qa, &Wqe::new(SEND).data(256, ma.key, ma.addr()), Bell::Db);
        }
        for k in 0..8u16 {
            let e = a.wait_cqe(&mut a_cq).expect("requester CQE");
            assert_eq!((e.status(), e.wqe_counter()), ((consts::MLX5_CQE_REQ, 0), k));
            let e = b.wait_cqe(&mut b_cq).expect("responder CQE");
            assert_eq!((e.byte_cnt(), e.wqe_counter()), (256, k));
        }
        assert_eq!(mb.read(0, 2048), vec![0xab; 2048]);
        // A receive posted after the send it is for: the device thread retries on its own after the RNR timer.
        a.post_send(&mut qa, &Wqe::new(SEND).data(16, ma.key, ma.addr()), Bell::Db);
        std::thread::sleep(std::time::Duration::from_millis(5));
        b.post_recv(&mut qb, &[(mb.addr() + 3000, 64, mb.key)]);
        assert_eq!(a.wait_cqe(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(b.wait_cqe(&mut b_cq).unwrap().byte_cnt(), 16);
    }
}
