//! The fabric on a QEMU guest's NIC (or any peer speaking QEMU's `-netdev stream` framing) over a UNIX socket
//! (`wire=qemu`): a point-to-point stream of bare Ethernet frames (`stream.rs`) with the fabric's link on it
//! (`vde.rs`), as on a VDE switch: the port's packets cross as the RoCEv2 frames `wire::roce_map` makes, to the
//! MAC of a link-local GID or the one ARP resolved for an IPv4 GID (until the guest answers, the packet is lost and
//! the requester's timer sends it again, as a NIC waiting on neighbour resolution drops it); what the guest sends
//! goes through the port's receive side (`transport/roce_rx.rs`: ARP answered, RoCE reassembled and matched). No
//! hello: the guest is not ours. Tests can make the cable lose a RoCE frame either way or go slowly ([`Cable`]).
//!
//! QEMU 7.2 in client mode (`server=off`) connects once at start and never retries, so listen first
//! ([`listen`]) or let QEMU listen (`server=on`) and [`connect`] with retries.

use std::io;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::port::{log, Cable, Station, VdeLink};
use super::stream::{Sock, StreamConn};
use super::vde::plug_with;
use crate::events::SimEvent;

impl VdeLink {
    /// RoCE frames a cable sent and received so far (each counting the one lost on purpose); (0, 0) on a switch.
    pub(crate) fn frames(&self) -> (u64, u64) {
        self.cable.as_ref().map_or((0, 0), |c| (c.sent.load(Ordering::Acquire), c.received.load(Ordering::Acquire)))
    }

    /// Drops the `n`-th RoCE frame sent from now on (1 is the next one); on a cable only.
    pub(crate) fn drop_frame(&self, n: u64) {
        if let Some(c) = &self.cable {
            c.drop_nth.store(c.sent.load(Ordering::Acquire) + n, Ordering::Release);
        }
    }

    /// Drops the `n`-th RoCE frame received from now on (1 is the next one); on a cable only.
    pub(crate) fn drop_frame_in(&self, n: u64) {
        if let Some(c) = &self.cable {
            c.drop_in_nth.store(c.received.load(Ordering::Acquire) + n, Ordering::Release);
        }
    }

    /// Makes the writer put at most `per_ms` frames a millisecond on the stream (0: no limit); on a cable only.
    pub(crate) fn set_pace(&self, per_ms: u64) {
        if let Some(c) = &self.cable {
            c.pace.store(per_ms, Ordering::Release);
        }
    }

    /// The most frames that waited for the writer at once.
    pub(crate) fn backlog_peak(&self) -> u64 {
        self.count.peak()
    }
}

/// Listens on the UNIX socket `path` (replacing a stale socket file) for the guest NIC (QEMU with
/// `server=off`); the first connection is plugged in.
pub(crate) fn listen<S: Station>(station: &Arc<S>, path: &Path) -> io::Result<()> {
    let _ = std::fs::remove_file(path);
    let listener = UnixListener::bind(path)?;
    let weak = Arc::downgrade(station);
    std::thread::Builder::new().name("mlx5-sim-guest-listen".into()).spawn(move || {
        if let Ok((stream, _)) = listener.accept() {
            if let Some(station) = weak.upgrade() {
                if plug(&station, stream).is_err() {
                    log(&*station, SimEvent::FrameDropped { why: "the guest link could not be set up" });
                }
            }
        }
    })?;
    Ok(())
}

/// Connects to the guest NIC listening on `path` (QEMU with `server=on`), retrying until `timeout`.
pub(crate) fn connect<S: Station>(station: &Arc<S>, path: &Path, timeout: Duration) -> io::Result<()> {
    let end = Instant::now() + timeout;
    loop {
        match UnixStream::connect(path) {
            Ok(s) => return plug(station, s),
            Err(e) if Instant::now() >= end => return Err(e),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
}

fn plug<S: Station>(station: &Arc<S>, stream: UnixStream) -> io::Result<()> {
    let conn = StreamConn::new(Sock::Unix(stream))?;
    plug_with(station, Box::new(conn), "qemu-stream", None, Some(Cable::default())).map_err(io::Error::other)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::config::SimConfig;
    use crate::link::port::TxCount;
    use crate::link::stream::{read_frame, write_frame, MAX_STREAM_FRAME};
    use crate::testkit::submit::{Bell, QpSpec, RcParams, Rdma, TAv, Wqe};
    use crate::wire::roce::arp::{ArpRepr, Operation};
    use crate::wire::roce::ether::{EtherType, EthernetRepr, BROADCAST};
    use crate::wire::roce::frame::emit_arp;
    use crate::wire::roce::frame::{parse, Parsed};
    use mlx5_core::prm::consts;
    use std::io::Write;

    const SEND: u8 = consts::MLX5_OPCODE_SEND;
    const WAIT: Duration = Duration::from_secs(5);

    fn cfg(n: u8) -> SimConfig {
        let mut mac = SimConfig::default().mac;
        mac[5] = n;
        SimConfig { mac, node_guid: 0x4000 + u64::from(n), mode: Mode::Threaded, ..SimConfig::default() }
    }

    fn sock(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("mlx5-guest-{}-{name}.sock", std::process::id()))
    }

    /// Two devices joined the way a device and a QEMU guest NIC are: A listens on a UNIX socket, B connects.
    fn joined(name: &str) -> (Rdma, Rdma) {
        joined_with(name, cfg(1), cfg(2))
    }

    fn joined_with(name: &str, ca: SimConfig, cb: SimConfig) -> (Rdma, Rdma) {
        let (a, b) = (Rdma::new(ca), Rdma::new(cb));
        let path = sock(name);
        a.h.dev.guest_listen(&path).unwrap();
        b.h.dev.guest_connect(&path, WAIT).unwrap();
        let end = Instant::now() + WAIT;
        while !(a.h.dev.guest_plugged() && b.h.dev.guest_plugged()) {
            assert!(Instant::now() < end, "both ends plugged in");
            std::thread::sleep(Duration::from_millis(2));
        }
        let _ = std::fs::remove_file(&path);
        (a, b)
    }

    fn pattern(n: usize, seed: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect()
    }

    #[test]
    fn rc_and_ud_over_stream_framing_as_roce() {
        let (mut a, mut b) = joined("rc");
        let (mut a_cq, mut b_cq) = (a.cq(5), b.cq(5));
        let mut qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let mut qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (ra, rb) = (a.me(qa.qpn), b.me(qb.qpn));
        a.connect_rc(&qa, &rb, RcParams::default());
        b.connect_rc(&qb, &ra, RcParams::default());
        let (ma, mb) = (a.mr(1 << 16), b.mr(1 << 16));
        // Three packets at the 1024-byte MTU, each way.
        let msg = pattern(3000, 1);
        ma.write(0, &msg);
        b.post_recv(&mut qb, &[(mb.addr(), 4096, mb.key)]);
        a.post_send(&mut qa, &Wqe::new(SEND).data(3000, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.wait_cqe(&mut b_cq).expect("receive CQE");
        assert_eq!((e.opcode(), e.byte_cnt()), (consts::MLX5_CQE_RESP_SEND, 3000));
        assert!(mb.read(0, 3000) == msg);
        // A READ of three response packets, and an atomic.
        let remote = pattern(2500, 9);
        mb.write(8192, &remote);
        mb.write(16384, &41u64.to_be_bytes());
        let rd = Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(mb.addr() + 8192, mb.key).data(
            2500,
            ma.key,
            ma.addr() + 8192,
        );
        a.post_send(&mut qa, &rd, Bell::Db);
        let fa = Wqe::new(consts::MLX5_OPCODE_ATOMIC_FA).raddr(mb.addr() + 16384, mb.key).atomic(1, 0).data(
            8,
            ma.key,
            ma.addr() + 16384,
        );
        a.post_send(&mut qa, &fa, Bell::Db);
        for _ in 0..2 {
            assert_eq!(a.wait_cqe(&mut a_cq).expect("CQE").status(), (consts::MLX5_CQE_REQ, 0));
        }
        assert!(ma.read(8192, 2500) == remote);
        assert_eq!(
            (ma.read(16384, 8), mb.read(16384, 8)),
            (41u64.to_be_bytes().to_vec(), 42u64.to_be_bytes().to_vec())
        );
        // UD from B to A.
        let (mut ua, mut ub) = (a.qp(QpSpec::ud(), a_cq.cqn, a_cq.cqn), b.qp(QpSpec::ud(), b_cq.cqn, b_cq.cqn));
        a.ready_ud(&ua, 0x11);
        b.ready_ud(&ub, 0x11);
        a.post_recv(&mut ua, &[(ma.addr() + 32768, 256, ma.key)]);
        mb.write(32768, b"datagram");
        let dst = a.me(ua.qpn);
        let av =
            TAv { dqpn: ua.qpn, qkey: 0x11, grh: true, hop_limit: 1, rgid: dst.gid, rmac: dst.mac, ..TAv::default() };
        b.post_send(&mut ub, &Wqe::new(SEND).av(&av).data(8, mb.key, mb.addr() + 32768), Bell::Db);
        assert_eq!(b.wait_cqe(&mut b_cq).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = a.wait_cqe(&mut a_cq).expect("UD receive CQE");
        assert_eq!((e.byte_cnt(), e.flags_rqpn() & 0xff_ffff), (48, ub.qpn));
        assert_eq!(ma.read(32768 + 40, 8), b"datagram");
        assert_eq!(a.h.dev.frame_drops().total() + b.h.dev.frame_drops().total(), 0);
    }

    #[test]
    fn a_lost_middle_packet_draws_a_sequence_nak_and_a_lost_ack_a_retransmission() {
        let (mut a, mut b) = joined("loss");
        let (mut a_cq, mut b_cq) = (a.cq(5), b.cq(5));
        let mut qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let mut qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (ra, rb) = (a.me(qa.qpn), b.me(qb.qpn));
        a.connect_rc(&qa, &rb, RcParams { ack_timeout: 12, ..RcParams::default() });
        b.connect_rc(&qb, &ra, RcParams::default());
        let (ma, mb) = (a.mr(1 << 14), b.mr(1 << 14));
        let msg = pattern(3000, 3);
        ma.write(0, &msg);
        // The MIDDLE packet of A's SEND is lost: B sees LAST out of sequence and NAKs; A sends it all again.
        assert!(a.h.dev.guest_drop_frame(2));
        b.post_recv(&mut qb, &[(mb.addr(), 4096, mb.key)]);
        a.post_send(&mut qa, &Wqe::new(SEND).data(3000, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.wait_cqe(&mut b_cq).expect("receive CQE");
        assert_eq!(e.byte_cnt(), 3000);
        assert!(mb.read(0, 3000) == msg);
        assert!(a.h.dev.events().iter().any(|e| matches!(e, SimEvent::PsnSequenceNak { .. })));
        // B's ACK of the next SEND is lost: A's ACK timer resends, B answers the duplicate without a second
        // receive.
        assert!(b.h.dev.guest_drop_frame(1));
        b.post_recv(&mut qb, &[(mb.addr() + 4096, 4096, mb.key)]);
        a.post_send(&mut qa, &Wqe::new(SEND).data(100, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(b.wait_cqe(&mut b_cq).expect("receive CQE").byte_cnt(), 100);
        assert!(b.h.dev.events().iter().any(|e| matches!(e, SimEvent::DuplicateRequest { .. })));
        assert!(b.poll(&mut b_cq).is_none(), "the duplicate consumed no receive");
        // B loses A's FIRST packet on the way in: MIDDLE is ahead of what B expects, B NAKs, A sends it all again.
        let naks = |r: &Rdma| r.h.dev.events().iter().filter(|e| matches!(e, SimEvent::PsnSequenceNak { .. })).count();
        let before = naks(&a);
        assert!(b.h.dev.guest_drop_frame_in(1));
        b.post_recv(&mut qb, &[(mb.addr() + 8192, 4096, mb.key)]);
        a.post_send(&mut qa, &Wqe::new(SEND).data(3000, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(b.wait_cqe(&mut b_cq).expect("receive CQE").byte_cnt(), 3000);
        assert!(mb.read(8192, 3000) == msg);
        assert!(naks(&a) > before);
        assert_eq!(b.h.dev.qp_info(qb.qpn).unwrap().rq_ci, 3);
    }

    /// Two RC QPs connected across the guest link, A's ACK timer `ack_timeout`, a 64 KiB region each.
    struct Rc {
        a: Rdma,
        b: Rdma,
        qa: crate::testkit::submit::TQp,
        qb: crate::testkit::submit::TQp,
        a_cq: crate::testkit::submit::TCq,
        b_cq: crate::testkit::submit::TCq,
        ma: crate::testkit::submit::Mr,
        mb: crate::testkit::submit::Mr,
    }

    fn rc_joined(name: &str, ack_timeout: u32) -> Rc {
        let (mut a, mut b) = joined(name);
        let (a_cq, b_cq) = (a.cq(5), b.cq(5));
        let qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (ra, rb) = (a.me(qa.qpn), b.me(qb.qpn));
        a.connect_rc(&qa, &rb, RcParams { ack_timeout, ..RcParams::default() });
        b.connect_rc(&qb, &ra, RcParams::default());
        let (ma, mb) = (a.mr(1 << 16), b.mr(1 << 16));
        Rc { a, b, qa, qb, a_cq, b_cq, ma, mb }
    }

    /// Frames each side put on the cable since `before`.
    fn sent_since(r: &Rdma, before: (u64, u64)) -> u64 {
        r.h.dev.guest_frames().unwrap().0 - before.0
    }

    #[test]
    fn a_nak_inside_a_message_resends_only_the_packets_from_its_psn() {
        // The ACK timer is long (4.096 us << 20, 4.3 s): only the NAK can bring the retransmission in time.
        let mut t = rc_joined("resume-send", 20);
        for (op, what) in [(SEND, "SEND"), (consts::MLX5_OPCODE_RDMA_WRITE, "WRITE")] {
            // Five packets at the 1024-byte MTU; the third (PSN + 2) is lost. B NAKs PSN + 2 when PSN + 3 comes;
            // A sends PSN + 2, + 3 and + 4 again: 5 + 3 frames, not 5 + 5.
            let msg = pattern(4500, what.len() as u8);
            t.ma.write(0, &msg);
            t.mb.write(8192, &[0; 4500]);
            let (a0, b0) = (t.a.h.dev.guest_frames().unwrap(), t.b.h.dev.guest_frames().unwrap());
            assert!(t.a.h.dev.guest_drop_frame(3));
            let w = if op == SEND {
                t.b.post_recv(&mut t.qb, &[(t.mb.addr() + 8192, 8192, t.mb.key)]);
                Wqe::new(SEND).data(4500, t.ma.key, t.ma.addr())
            } else {
                Wqe::new(op).raddr(t.mb.addr() + 8192, t.mb.key).data(4500, t.ma.key, t.ma.addr())
            };
            let started = Instant::now();
            t.a.post_send(&mut t.qa, &w, Bell::Db);
            assert_eq!(t.a.wait_cqe(&mut t.a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0), "{what}");
            assert!(started.elapsed() < Duration::from_secs(4), "{what}: recovered by the NAK, not the timer");
            if op == SEND {
                assert_eq!(t.b.wait_cqe(&mut t.b_cq).expect("receive CQE").byte_cnt(), 4500);
            }
            assert!(t.mb.read(8192, 4500) == msg, "{what}: every byte at its offset");
            assert_eq!(sent_since(&t.a, a0), 8, "{what}: only the missing suffix went again");
            // B: one sequence NAK and one ACK.
            assert_eq!(sent_since(&t.b, b0), 2, "{what}");
        }
    }

    #[test]
    fn a_packet_lost_inside_a_pipelined_window_goes_back_to_it_and_completes_each_wqe_once() {
        // The ACK timer is long (4.096 us << 20, 4.3 s): only the NAK can bring the retransmission in time.
        let mut t = rc_joined("pipeline", 20);
        let src = pattern(8192, 21);
        t.ma.write(0, &src);
        for k in 0..8u64 {
            t.b.post_recv(&mut t.qb, &[(t.mb.addr() + k * 4096, 4096, t.mb.key)]);
        }
        // Eight SENDs of three packets behind one doorbell; the eighth frame (the third's MIDDLE) is lost.
        assert!(t.a.h.dev.guest_drop_frame(8));
        let started = Instant::now();
        for i in 0..8u64 {
            let w = Wqe::new(SEND).data(3000, t.ma.key, t.ma.addr() + i * 512);
            t.a.post_send(&mut t.qa, &w, if i == 7 { Bell::Db } else { Bell::None });
        }
        let mut sends = Vec::new();
        for _ in 0..8 {
            let e = t.a.wait_cqe(&mut t.a_cq).expect("send CQE");
            sends.push((e.status(), e.wqe_counter()));
        }
        assert_eq!(sends, (0..8u16).map(|i| ((consts::MLX5_CQE_REQ, 0), i)).collect::<Vec<_>>(), "once each, in order");
        assert!(started.elapsed() < Duration::from_secs(4), "recovered by the NAK, not the timer");
        for k in 0..8u16 {
            let e = t.b.wait_cqe(&mut t.b_cq).expect("receive CQE");
            assert_eq!((e.wqe_counter(), e.byte_cnt()), (k, 3000));
            let at = usize::from(k) * 512;
            assert!(t.mb.read(usize::from(k) * 4096, 3000) == src[at..at + 3000], "SEND {k}: every byte");
        }
        // B saw the gap. (How many frames crossed is not fixed: two threads carry A's frames, the doorbell's and
        // the one that took the NAK, so the retransmission may overtake frames of the first run, which then
        // arrive as duplicates.)
        assert!(t.b.h.dev.events().iter().any(|e| matches!(e, SimEvent::PsnSequenceError { .. })));
        let retry = |e: &SimEvent| {
            matches!(e, SimEvent::Retry { wqe_counter: 2, kind: crate::events::RetryKind::Transport, .. })
        };
        assert_eq!(t.a.h.dev.events().iter().filter(|e| retry(e)).count(), 1, "one go-back to the third");
        assert!(t.a.poll(&mut t.a_cq).is_none() && t.b.poll(&mut t.b_cq).is_none());
        assert_eq!(t.a.h.dev.qp_info(t.qa.qpn).unwrap().in_flight, 0);

        // B's ACK of the first of four SENDs is lost: the ACK of the second acknowledges both (cumulative), so
        // nothing is sent again.
        for k in 0..4u64 {
            t.b.post_recv(&mut t.qb, &[(t.mb.addr() + 40960 + k * 256, 256, t.mb.key)]);
        }
        assert!(t.b.h.dev.guest_drop_frame(1));
        let started = Instant::now();
        for i in 0..4u64 {
            let w = Wqe::new(SEND).data(100, t.ma.key, t.ma.addr() + i * 100);
            t.a.post_send(&mut t.qa, &w, if i == 3 { Bell::Db } else { Bell::None });
        }
        for i in 8..12u16 {
            let e = t.a.wait_cqe(&mut t.a_cq).expect("send CQE");
            assert_eq!((e.status(), e.wqe_counter()), ((consts::MLX5_CQE_REQ, 0), i));
        }
        for k in 0..4usize {
            assert_eq!(t.b.wait_cqe(&mut t.b_cq).expect("receive CQE").byte_cnt(), 100);
            assert!(t.mb.read(40960 + k * 256, 100) == src[k * 100..k * 100 + 100]);
        }
        assert!(started.elapsed() < Duration::from_secs(4), "not left to the ACK timer");
        assert!(!t.a.h.dev.events().iter().any(|e| matches!(e, SimEvent::Retry { wqe_counter: 8.., .. })));
    }

    #[test]
    fn a_read_response_lost_inside_a_pipelined_window_asks_again_and_completes_each_wqe_once() {
        // The ACK timer is long (4.3 s): only the gap in the READ's responses can bring the recovery in time.
        let mut t = rc_joined("pipeline-read", 20);
        let local = pattern(3000, 5);
        let remote = pattern(4096, 6);
        t.ma.write(0, &local);
        t.mb.write(8192, &remote);
        t.b.post_recv(&mut t.qb, &[(t.mb.addr() + 16384, 256, t.mb.key)]);
        // A WRITE of three packets, a READ of three response packets, a READ of one, a SEND: all in flight
        // together. B's third frame (the first READ's MIDDLE response) is lost.
        assert!(t.b.h.dev.guest_drop_frame(3));
        let (ma, mb) = (t.ma.addr(), t.mb.addr());
        let started = Instant::now();
        let write = Wqe::new(consts::MLX5_OPCODE_RDMA_WRITE).raddr(mb + 32768, t.mb.key).data(3000, t.ma.key, ma);
        t.a.post_send(&mut t.qa, &write, Bell::None);
        let read1 = Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(mb + 8192, t.mb.key).data(3000, t.ma.key, ma + 8192);
        t.a.post_send(&mut t.qa, &read1, Bell::None);
        let read2 = Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(mb + 12000, t.mb.key).data(96, t.ma.key, ma + 12288);
        t.a.post_send(&mut t.qa, &read2, Bell::None);
        t.a.post_send(&mut t.qa, &Wqe::new(SEND).data(100, t.ma.key, ma + 100), Bell::Db);
        let mut done = Vec::new();
        for _ in 0..4 {
            let e = t.a.wait_cqe(&mut t.a_cq).expect("CQE");
            done.push((e.status(), e.wqe_counter(), e.wqe_opcode()));
        }
        let ok = (consts::MLX5_CQE_REQ, 0);
        let ops = [consts::MLX5_OPCODE_RDMA_WRITE, consts::MLX5_OPCODE_RDMA_READ, consts::MLX5_OPCODE_RDMA_READ, SEND];
        assert_eq!(done, (0..4u16).map(|i| (ok, i, ops[usize::from(i)])).collect::<Vec<_>>(), "once each, in order");
        assert!(started.elapsed() < Duration::from_secs(4), "recovered at the gap, not by the timer");
        assert!(t.ma.read(8192, 3000) == remote[..3000], "the first READ, every byte");
        assert!(t.ma.read(12288, 96) == remote[12000 - 8192..12000 - 8192 + 96], "the second READ");
        assert!(t.mb.read(32768, 3000) == local, "the WRITE");
        assert_eq!(t.b.wait_cqe(&mut t.b_cq).expect("receive CQE").byte_cnt(), 100);
        assert!(t.mb.read(16384, 100) == local[100..200]);
        // The SEND went twice (behind the READ asked again) and was executed once.
        assert!(t.b.poll(&mut t.b_cq).is_none() && t.a.poll(&mut t.a_cq).is_none());
        assert_eq!(t.b.h.dev.qp_info(t.qb.qpn).unwrap().rq_ci, 1);
        assert!(t.b.h.dev.events().iter().any(|e| matches!(e, SimEvent::DuplicateRequest { .. })));
        let retry = |e: &SimEvent| {
            matches!(e, SimEvent::Retry { wqe_counter: 1, kind: crate::events::RetryKind::Transport, .. })
        };
        assert_eq!(t.a.h.dev.events().iter().filter(|e| retry(e)).count(), 1, "one go-back to the first READ");
    }

    #[test]
    fn a_lost_atomic_ack_inside_a_pipelined_window_is_answered_again_from_the_responders_results() {
        // The ACK timer is long (4.3 s): only the next atomic's ACK can bring the recovery in time.
        let mut t = rc_joined("pipeline-atomic", 20);
        t.mb.write(0, &100u64.to_be_bytes());
        // Four fetch-and-adds of 1 in flight together (log_sra_max 2); B's second atomic ACK is lost. The third's
        // ACK shows it: A sends the second, third and fourth again, and B answers each from the results it kept
        // without adding again.
        assert!(t.b.h.dev.guest_drop_frame(2));
        let started = Instant::now();
        for k in 0..4u64 {
            let fa = Wqe::new(consts::MLX5_OPCODE_ATOMIC_FA).raddr(t.mb.addr(), t.mb.key).atomic(1, 0).data(
                8,
                t.ma.key,
                t.ma.addr() + k * 8,
            );
            t.a.post_send(&mut t.qa, &fa, if k == 3 { Bell::Db } else { Bell::None });
        }
        for k in 0..4u16 {
            let e = t.a.wait_cqe(&mut t.a_cq).expect("atomic CQE");
            assert_eq!((e.status(), e.wqe_counter()), ((consts::MLX5_CQE_REQ, 0), k), "once each, in order");
        }
        assert!(started.elapsed() < Duration::from_secs(4), "recovered by the next ACK, not the timer");
        let originals: Vec<_> = (0..4).map(|k| t.ma.read(k * 8, 8)).collect();
        assert_eq!(originals, [100u64, 101, 102, 103].map(|v| v.to_be_bytes().to_vec()));
        assert_eq!(t.mb.read(0, 8), 104u64.to_be_bytes(), "each atomic executed once");
        assert!(t.b.h.dev.events().iter().any(|e| matches!(e, SimEvent::DuplicateRequest { .. })));
        let retry = |e: &SimEvent| {
            matches!(e, SimEvent::Retry { wqe_counter: 1, kind: crate::events::RetryKind::Transport, .. })
        };
        assert_eq!(t.a.h.dev.events().iter().filter(|e| retry(e)).count(), 1, "one go-back to the second");
        assert!(t.a.poll(&mut t.a_cq).is_none());
        let _ = &t.b_cq;
    }

    #[test]
    fn a_read_response_acknowledges_the_write_before_it_whose_ack_was_lost() {
        let mut t = rc_joined("implicit-ack", 20);
        let (local, remote) = (pattern(64, 8), pattern(64, 9));
        t.ma.write(0, &local);
        t.mb.write(4096, &remote);
        // B's ACK of the WRITE is lost; the READ's response after it acknowledges the WRITE (IBA 9.7.5.1.2), so
        // both complete in order with nothing sent again.
        assert!(t.b.h.dev.guest_drop_frame(1));
        let started = Instant::now();
        let write =
            Wqe::new(consts::MLX5_OPCODE_RDMA_WRITE).raddr(t.mb.addr(), t.mb.key).data(64, t.ma.key, t.ma.addr());
        t.a.post_send(&mut t.qa, &write, Bell::None);
        let read = Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(t.mb.addr() + 4096, t.mb.key).data(
            64,
            t.ma.key,
            t.ma.addr() + 4096,
        );
        t.a.post_send(&mut t.qa, &read, Bell::Db);
        for (k, op) in [consts::MLX5_OPCODE_RDMA_WRITE, consts::MLX5_OPCODE_RDMA_READ].into_iter().enumerate() {
            let e = t.a.wait_cqe(&mut t.a_cq).expect("CQE");
            assert_eq!((e.status(), e.wqe_counter(), e.wqe_opcode()), ((consts::MLX5_CQE_REQ, 0), k as u16, op));
        }
        assert!(started.elapsed() < Duration::from_secs(4), "not left to the ACK timer");
        assert!(t.mb.read(0, 64) == local && t.ma.read(4096, 64) == remote);
        assert!(!t.a.h.dev.events().iter().any(|e| matches!(e, SimEvent::Retry { .. })), "nothing sent again");
        assert!(t.a.poll(&mut t.a_cq).is_none());
        let _ = &t.b_cq;
    }

    #[test]
    fn a_lost_read_response_is_asked_again_from_its_psn() {
        let mut t = rc_joined("resume-read", 20);
        // Four response packets (3500 B at 1024); B's second is lost. A sees the third out of sequence and asks
        // again from PSN + 1 for the last 2476 bytes: B answers with three packets, not four.
        let remote = pattern(3500, 77);
        t.mb.write(0, &remote);
        let (a0, b0) = (t.a.h.dev.guest_frames().unwrap(), t.b.h.dev.guest_frames().unwrap());
        assert!(t.b.h.dev.guest_drop_frame(2));
        let rd = Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(t.mb.addr(), t.mb.key).data(3500, t.ma.key, t.ma.addr());
        let started = Instant::now();
        t.a.post_send(&mut t.qa, &rd, Bell::Db);
        assert_eq!(t.a.wait_cqe(&mut t.a_cq).expect("READ CQE").status(), (consts::MLX5_CQE_REQ, 0));
        assert!(started.elapsed() < Duration::from_secs(4), "asked again at the gap, not at the timer");
        assert!(t.ma.read(0, 3500) == remote);
        assert_eq!(sent_since(&t.a, a0), 2, "the READ request, then one from the missing PSN");
        assert_eq!(sent_since(&t.b, b0), 4 + 3);
        // The second request was a duplicate at B, answered from the adjusted RETH, not run as a new READ.
        assert!(t.b.h.dev.events().iter().any(|e| matches!(e, SimEvent::DuplicateRequest { .. })));
        let _ = &t.b_cq;
    }

    /// Two RC QPs across the guest link, A's parameters `pa`, regions of `len` bytes each, and A's frames captured
    /// to the file returned.
    fn rc_large(name: &str, pa: RcParams, len: usize) -> (Rc, std::path::PathBuf) {
        let path = std::env::temp_dir().join(format!("mlx5-guest-{}-{name}.pcap", std::process::id()));
        let sink = crate::pcap::PcapSink::create(&path).unwrap();
        let (mut a, mut b) = joined_with(name, SimConfig { pcap: Some(sink), ..cfg(1) }, cfg(2));
        let (a_cq, b_cq) = (a.cq(5), b.cq(5));
        let qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (ra, rb) = (a.me(qa.qpn), b.me(qb.qpn));
        a.connect_rc(&qa, &rb, pa);
        b.connect_rc(&qb, &ra, RcParams::default());
        let (ma, mb) = (a.mr(len), b.mr(len));
        (Rc { a, b, qa, qb, a_cq, b_cq, ma, mb }, path)
    }

    /// The packets of A's SENDs in the capture at `path` (removed), in the order A sent them, as offsets from
    /// PSN `base`.
    fn sent_psns(path: &std::path::Path, base: u32) -> Vec<u32> {
        use crate::wire::roce::ib::Opcode;
        let bytes = std::fs::read(path).unwrap();
        let _ = std::fs::remove_file(path);
        let frames = crate::pcap::read_frames(&bytes).unwrap();
        let send = |o: Opcode| matches!(o, Opcode::RcSendFirst | Opcode::RcSendMiddle | Opcode::RcSendLast);
        frames
            .iter()
            .filter_map(|(_, f)| match parse(f) {
                Ok(Parsed::Roce(r)) if send(r.bth.opcode) => Some(r.bth.psn.wrapping_sub(base) & 0xff_ffff),
                _ => None,
            })
            .collect()
    }

    /// Posts one SEND of `len` bytes (a pattern) from A to a receive of B, waits for both completions and checks
    /// them and every byte. Returns A's first PSN for it.
    fn large_send(t: &mut Rc, len: usize) -> u32 {
        let msg = pattern(len, 7);
        t.ma.write(0, &msg);
        t.b.post_recv(&mut t.qb, &[(t.mb.addr(), len as u32, t.mb.key)]);
        let base = t.a.h.dev.qp_info(t.qa.qpn).unwrap().next_send_psn;
        t.a.post_send(&mut t.qa, &Wqe::new(SEND).data(len as u32, t.ma.key, t.ma.addr()), Bell::Db);
        assert_eq!(t.a.wait_cqe(&mut t.a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        let e = t.b.wait_cqe(&mut t.b_cq).expect("receive CQE");
        assert_eq!((e.opcode(), e.byte_cnt()), (consts::MLX5_CQE_RESP_SEND, len as u32));
        assert!(t.mb.read(0, len) == msg, "every byte at its offset");
        base
    }

    fn retries(r: &Rdma) -> Vec<crate::events::RetryKind> {
        r.h.dev
            .events()
            .iter()
            .filter_map(|e| if let SimEvent::Retry { kind, .. } = e { Some(*kind) } else { None })
            .collect()
    }

    /// Issue 29: a message longer than the link carries within the requester's ACK timeouts failed with "transport
    /// retry counter exceeded": every frame was queued at once, the responder acknowledged only the last, and each
    /// timeout queued the whole message again. Now a window of packets is in flight, AckReq comes every 256
    /// packets, and each ACK lets more out and restarts the timer.
    #[test]
    fn a_message_the_link_carries_longer_than_the_ack_timers_completes_with_nothing_sent_twice() {
        const LEN: usize = 9 << 20;
        // 9,216 frames at 3 a millisecond take 3 s; the ACK timer is 4.096 us << 18 (1.07 s) with one retry,
        // 2.15 s in all. An ACK comes every 256 frames (85 ms), so only a stall of a second, far beyond what a
        // loaded test machine makes, could end the transfer early.
        let pa = RcParams { ack_timeout: 18, retry_count: 1, ..RcParams::default() };
        let (mut t, path) = rc_large("slow", pa, LEN);
        assert!(t.a.h.dev.guest_pace(3));
        let a0 = t.a.h.dev.guest_frames().unwrap();
        let started = Instant::now();
        large_send(&mut t, LEN);
        assert!(started.elapsed() > Duration::from_millis(2150), "the transfer outlasted the whole retry budget");
        assert_eq!(retries(&t.a), [], "nothing timed out");
        assert_eq!(sent_since(&t.a, a0), 9216, "each packet once");
        let peak = t.a.h.dev.guest_backlog_peak().unwrap();
        let window = u64::from(crate::fw::qp::MAX_PACKETS_IN_FLIGHT);
        assert!(peak <= window, "{peak} frames waited on the link (the window is {window})");
        let _ = std::fs::remove_file(path);
    }

    /// The same for a READ: its responses come as fast as the responder's link carries them, and each one that
    /// arrives in order is progress, which restarts the ACK timer (the READ was asked again at every timeout and
    /// failed once the retries ran out).
    #[test]
    fn a_read_the_link_carries_longer_than_the_ack_timers_completes_without_being_asked_again() {
        const LEN: usize = 9 << 20;
        let pa = RcParams { ack_timeout: 18, retry_count: 1, ..RcParams::default() };
        let (mut t, path) = rc_large("slow-read", pa, LEN);
        let _ = std::fs::remove_file(path);
        let remote = pattern(LEN, 11);
        t.mb.write(0, &remote);
        // B's 9,216 response frames at 3 a millisecond: 3 s, against 2.15 s of ACK timers.
        assert!(t.b.h.dev.guest_pace(3));
        let started = Instant::now();
        let rd = Wqe::new(consts::MLX5_OPCODE_RDMA_READ).raddr(t.mb.addr(), t.mb.key).data(
            LEN as u32,
            t.ma.key,
            t.ma.addr(),
        );
        t.a.post_send(&mut t.qa, &rd, Bell::Db);
        assert_eq!(t.a.wait_cqe(&mut t.a_cq).expect("READ CQE").status(), (consts::MLX5_CQE_REQ, 0));
        assert!(started.elapsed() > Duration::from_millis(2150), "the responses outlasted the whole retry budget");
        assert!(t.ma.read(0, LEN) == remote, "every byte at its offset");
        assert_eq!(retries(&t.a), [], "nothing timed out");
        let _ = (&t.b_cq, &mut t.qb);
    }

    #[test]
    fn a_frame_lost_inside_a_long_message_is_sent_again_from_its_psn_not_from_the_start() {
        const LEN: usize = 2 << 20;
        // The ACK timer is long (4.3 s): only B's sequence NAK can bring the retransmission in time.
        let (mut t, path) = rc_large("long-nak", RcParams { ack_timeout: 20, ..RcParams::default() }, LEN);
        // Packet 1499 of 2,048 is lost.
        assert!(t.a.h.dev.guest_drop_frame(1500));
        let started = Instant::now();
        let base = large_send(&mut t, LEN);
        assert!(started.elapsed() < Duration::from_secs(4), "recovered by the NAK, not the timer");
        assert_eq!(retries(&t.a), [crate::events::RetryKind::Transport], "one go-back");
        let psns = sent_psns(&path, base);
        // Every packet before the lost one went once; the first step back is to the lost one, which then went
        // once (its first attempt never reached the capture).
        let back = (1..psns.len()).find(|&i| psns[i] <= psns[i - 1]).expect("a retransmission");
        assert_eq!(psns[back], 1499, "{:?}", &psns[back.saturating_sub(3)..back + 3]);
        let times = |k: u32| psns.iter().filter(|&&p| p == k).count();
        assert!((0..1499).all(|k| times(k) == 1), "a packet before the lost one went twice");
        assert_eq!(times(1499), 1);
        assert!((1500..2048).all(|k| times(k) >= 1));
    }

    #[test]
    fn a_lost_last_packet_is_sent_again_by_the_ack_timer_from_the_first_packet_not_acknowledged() {
        const LEN: usize = 2 << 20;
        // The last of 2,048 packets is lost: nothing follows it, so no NAK; the ACK timer (1 s) sends again from
        // the first packet B did not acknowledge, 1,792 (B acknowledged the AckReq on packet 1,791).
        let (mut t, path) = rc_large("long-timer", RcParams { ack_timeout: 18, ..RcParams::default() }, LEN);
        assert!(t.a.h.dev.guest_drop_frame(2048));
        let a0 = t.a.h.dev.guest_frames().unwrap();
        let base = large_send(&mut t, LEN);
        assert_eq!(retries(&t.a), [crate::events::RetryKind::Transport], "one timeout");
        let timeouts =
            t.a.h
                .dev
                .events()
                .iter()
                .filter(|e| matches!(e, SimEvent::Unreachable { why, .. } if why.contains("ACK timeout")))
                .count();
        assert_eq!(timeouts, 1);
        assert_eq!(sent_since(&t.a, a0), 2048 + 256, "the message, then its last 256 packets");
        let psns = sent_psns(&path, base);
        let expected: Vec<u32> = (0..2047).chain(1792..2048).collect();
        assert!(
            psns == expected,
            "{} packets, the first step back to {:?}",
            psns.len(),
            (1..psns.len()).find(|&i| psns[i] <= psns[i - 1]).map(|i| psns[i])
        );
    }

    #[test]
    fn a_ud_receive_over_roce_v2_ipv4_gets_the_ipv4_header_as_a_connectx_writes_it() {
        use mlx5_core::ah::{init_ah_from_wc, SgidType};
        use mlx5_core::cq::{WcFlags, WorkCompletion};
        // The ports answer ARP for their addresses: A's first datagram asks for B's MAC and is lost, as on a
        // NIC whose neighbour entry is not resolved yet.
        let (mut a, mut b) = joined_with(
            "ud-v4",
            SimConfig { ipv4_addrs: &[[10, 0, 0, 1]], ..cfg(1) },
            SimConfig { ipv4_addrs: &[[10, 0, 0, 2]], ..cfg(2) },
        );
        let v4 = crate::wire::roce::frame::mapped;
        // Each port's GID entry 1 is its IPv4 address (RoCE v2 puts it in an IPv4 header).
        assert_eq!(a.h.set_roce_address(1, v4([10, 0, 0, 1])), (0, 0));
        assert_eq!(b.h.set_roce_address(1, v4([10, 0, 0, 2])), (0, 0));
        let (mut a_cq, mut b_cq) = (a.cq(5), b.cq(5));
        let ua = a.qp(QpSpec::ud(), a_cq.cqn, a_cq.cqn);
        let mut ub = b.qp(QpSpec::ud(), b_cq.cqn, b_cq.cqn);
        a.ready_ud(&ua, 0x11);
        b.ready_ud(&ub, 0x11);
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        ma.write(0, b"over IPv4");
        b.post_recv(&mut ub, &[(mb.addr(), 256, mb.key)]);
        let av = TAv {
            dqpn: ub.qpn,
            qkey: 0x11,
            grh: true,
            sgid_index: 1,
            hop_limit: 61,
            tclass: 0x68,
            rgid: v4([10, 0, 0, 2]),
            rmac: b.h.dev.config().mac,
            ..TAv::default()
        };
        let mut ua = ua;
        let mut got = None;
        for _ in 0..3 {
            a.post_send(&mut ua, &Wqe::new(SEND).av(&av).data(9, ma.key, ma.addr()), Bell::Db);
            assert_eq!(a.wait_cqe(&mut a_cq).expect("UD send CQE").status(), (consts::MLX5_CQE_REQ, 0));
            let end = Instant::now() + Duration::from_millis(500);
            while got.is_none() && Instant::now() < end {
                got = b.poll(&mut b_cq);
                std::thread::sleep(Duration::from_millis(1));
            }
            if got.is_some() {
                break;
            }
        }
        let e = got.expect("UD receive CQE");
        assert_eq!(e.byte_cnt(), 40 + 9);
        // GRH present, RoCE v2 (bit 27) with L3 header type IPv4 (bits 26:24), the sender's QPN.
        let l3 = 1 << 3 | consts::MLX5_CQE_ROCE_L3_HEADER_TYPE_IPV4;
        assert_eq!(e.flags_rqpn(), ua.qpn | 1 << 28 | l3 << 24);
        let grh: [u8; 40] = mb.read(0, 40).try_into().unwrap();
        assert_eq!(grh[..20], [0; 20], "the IPv4 header is in the last 20 bytes");
        let ip = &grh[20..];
        let total = 20 + 8 + 12 + 8 + 9 + 4;
        assert_eq!((ip[0], ip[1], u16::from_be_bytes([ip[2], ip[3]]), ip[8], ip[9]), (0x45, 0x68, total, 61, 17));
        assert_eq!((&ip[12..16], &ip[16..20]), (&[10, 0, 0, 1][..], &[10, 0, 0, 2][..]));
        assert_eq!(mlx5_core::ah::ipv4_checksum(ip), u16::from_be_bytes([ip[10], ip[11]]));
        assert_eq!(mb.read(40, 9), b"over IPv4");
        // rdma-core's reading of it, in the core: the reply goes to the sender's IPv4 GID from our v2 entry.
        let wc = WorkCompletion { wc_flags: WcFlags::GRH, src_qp: ua.qpn, ..WorkCompletion::default() };
        let ah = init_ah_from_wc(&wc, Some(&grh), 1, |gid, ty| {
            (*gid == v4([10, 0, 0, 2]) && ty == SgidType::RoceV2).then_some(1)
        })
        .unwrap();
        let g = ah.grh.expect("a routed reply");
        assert_eq!((g.dgid, g.sgid_index, g.hop_limit, g.traffic_class), (v4([10, 0, 0, 1]), 1, 61, 0x68));
    }

    #[test]
    fn rnr_and_remote_access_naks_cross_as_frames() {
        let (mut a, mut b) = joined("nak");
        let (mut a_cq, mut b_cq) = (a.cq(5), b.cq(5));
        let mut qa = a.qp(QpSpec::rc(), a_cq.cqn, a_cq.cqn);
        let mut qb = b.qp(QpSpec::rc(), b_cq.cqn, b_cq.cqn);
        let (ra, rb) = (a.me(qa.qpn), b.me(qb.qpn));
        // B's RNR timer code 1 (10 us); A retries RNR forever.
        a.connect_rc(&qa, &rb, RcParams { rnr_retry: 7, ..RcParams::default() });
        b.connect_rc(&qb, &ra, RcParams { min_rnr_nak: 1, ..RcParams::default() });
        let (ma, mb) = (a.mr(1 << 12), b.mr(1 << 12));
        ma.write(0, b"not yet");
        // No receive at B: RNR NAK; A waits the timer and sends again until B posts one.
        a.post_send(&mut qa, &Wqe::new(SEND).data(7, ma.key, ma.addr()), Bell::Db);
        let end = Instant::now() + WAIT;
        while !a.h.dev.events().iter().any(|e| matches!(e, SimEvent::RnrNak { .. })) {
            assert!(Instant::now() < end, "an RNR NAK came back");
            std::thread::sleep(Duration::from_millis(1));
        }
        b.post_recv(&mut qb, &[(mb.addr(), 64, mb.key)]);
        assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(b.wait_cqe(&mut b_cq).expect("receive CQE").byte_cnt(), 7);
        assert_eq!(mb.read(0, 7), b"not yet");
        // A WRITE with a key B does not have: a remote access NAK, and A's QP fails with REMOTE_ACCESS_ERR.
        let w = Wqe::new(consts::MLX5_OPCODE_RDMA_WRITE).raddr(mb.addr(), mb.key ^ 0x100).data(7, ma.key, ma.addr());
        a.post_send(&mut qa, &w, Bell::Db);
        let e = a.wait_cqe(&mut a_cq).expect("error CQE");
        assert_eq!(e.status(), (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_REMOTE_ACCESS_ERR));
    }

    fn arp_request(guest: [u8; 6], target: [u8; 4]) -> Vec<u8> {
        let arp = ArpRepr {
            operation: Operation::Request,
            sender_mac: guest,
            sender_ip: [10, 0, 0, 1],
            target_mac: [0; 6],
            target_ip: target,
        };
        let mut buf = [0u8; 64];
        let n =
            emit_arp(&EthernetRepr { dst: BROADCAST, src: guest, ethertype: EtherType::Arp }, &arp, &mut buf).unwrap();
        buf[..n].to_vec()
    }

    #[test]
    fn a_device_that_goes_away_lets_its_queued_frames_out_first() {
        // The rxe-interop hang: our last ACK was still queued for the writer when the process dropped its
        // device, the socket was shut at once, and rdma_rxe retransmitted its last SEND forever.
        let dev = crate::sim_device::SimDevice::new(SimConfig { ipv4_addrs: &[[10, 0, 0, 2]], ..cfg(1) });
        let path = sock("drain");
        dev.guest_listen(&path).unwrap();
        let mut s = UnixStream::connect(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let guest = [0x52, 0x54, 0, 0, 0, 1];
        // More answers than the socket buffers hold, so most are still queued for the writer at the end (and
        // fewer than the writer's queue holds: beyond it an ARP flood is dropped and counted).
        const N: u64 = crate::link::vde::TX_QUEUE as u64 * 3 / 4;
        let ask = arp_request(guest, [10, 0, 0, 2]);
        let mut w = std::io::BufWriter::new(s.try_clone().unwrap());
        for _ in 0..N {
            write_frame(&mut w, &ask).unwrap();
        }
        w.flush().unwrap();
        let end = Instant::now() + WAIT;
        while dev.frames_received() < N {
            assert!(Instant::now() < end, "the device took every request");
            std::thread::sleep(Duration::from_millis(1));
        }
        let reader = std::thread::spawn(move || {
            s.set_read_timeout(Some(WAIT)).unwrap();
            let mut buf = vec![0u8; MAX_STREAM_FRAME];
            let mut replies = 0u64;
            while let Ok(Some(n)) = read_frame(&mut s, &mut buf) {
                assert!(matches!(parse(&buf[..n]), Ok(Parsed::Arp(_, a)) if a.operation == Operation::Reply));
                replies += 1;
            }
            replies
        });
        // Gone as soon as the last request is taken, its answers mostly still queued.
        drop(dev);
        let replies = reader.join().unwrap();
        assert_eq!(replies, N, "every reply was written before the link closed");
    }

    #[test]
    fn the_writer_count_tells_when_everything_queued_is_written() {
        let c = TxCount::default();
        assert!(c.drain(|| true, Duration::ZERO));
        c.queued();
        c.queued();
        c.written(1);
        assert!(!c.drain(|| true, Duration::from_millis(5)), "one frame is still queued");
        assert!(!c.drain(|| false, WAIT), "a link that is down ends the wait at once");
        c.written(1);
        assert!(c.drain(|| true, Duration::ZERO));
    }

    #[test]
    fn arp_is_answered_for_the_port_address_and_bad_frames_are_counted() {
        let a = Rdma::new(SimConfig { ipv4_addrs: &[[10, 0, 0, 2]], ..cfg(1) });
        let path = sock("arp");
        a.h.dev.guest_listen(&path).unwrap();
        let mut s = UnixStream::connect(&path).unwrap();
        let _ = std::fs::remove_file(&path);
        let guest = [0x52, 0x54, 0, 0, 0, 1];
        let ask = |target: [u8; 4]| arp_request(guest, target);
        // Not ours: no answer. Ours: a reply from the port's MAC. A frame with a bad ICRC is dropped and counted.
        write_frame(&mut s, &ask([10, 0, 0, 9])).unwrap();
        // To the port's MAC (the link drops and counts a frame to another MAC before the port sees it).
        let mut bad = vec![0u8; 80];
        bad[..6].copy_from_slice(&a.h.dev.config().mac);
        bad[12] = 0x08;
        write_frame(&mut s, &bad).unwrap();
        write_frame(&mut s, &ask([10, 0, 0, 2])).unwrap();
        let mut buf = vec![0u8; MAX_STREAM_FRAME];
        s.set_read_timeout(Some(WAIT)).unwrap();
        let n = read_frame(&mut s, &mut buf).unwrap().expect("an ARP reply");
        let Ok(Parsed::Arp(eth, arp)) = parse(&buf[..n]) else { panic!("not ARP: {:?}", parse(&buf[..n])) };
        let mine = a.h.dev.config().mac;
        assert_eq!((eth.dst, eth.src), (guest, mine));
        assert_eq!(
            (arp.operation, arp.sender_mac, arp.sender_ip, arp.target_ip),
            (Operation::Reply, mine, [10, 0, 0, 2], [10, 0, 0, 1])
        );
        assert_eq!(a.h.dev.frame_drops().total(), 1);
        // The asker is now a neighbour of the process, as in a host's neighbour table (the drop-in library
        // resolves a RoCE destination MAC there).
        assert_eq!(crate::transport::reasm::arp_neighbour([10, 0, 0, 1]), Some(guest));
    }
}
