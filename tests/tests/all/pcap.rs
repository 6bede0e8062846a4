//! Captures of the simulated wire (`SimConfig::pcap`, the tool's `--pcap`): every frame parses with our own
//! checks (ICRC included), and tshark, a decoder nobody here wrote, reads each as RoCEv2 with no malformed packet
//! and no bad checksum. Without tshark (`apt-get install tshark`) the tshark half is skipped with a printed reason.

use std::path::{Path, PathBuf};
use std::process::Command;

use mlx5_sim::pcap::{read_frames, PcapSink};
use mlx5_sim::roce::frame::{parse, Parsed};
use mlx5_sim::roce::ib::Opcode;
use mlx5_sim::{SimConfig, SimDevice};
use mlx5_tool::perftest::{self, Options};
use mlx5_verbs::Context;

fn capture_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("mlx5-pcap-{}-{name}.pcap", std::process::id()))
}

/// A perftest run between two simulated devices on a simulated wire, captured.
fn bench(test: &str, size: &str, path: &Path) -> PcapSink {
    let sink = PcapSink::create(path).unwrap();
    let mut opts = Options::parse(&[test, "--size", size, "--iters", "4"]).unwrap();
    opts.pcap = Some(sink.clone());
    perftest::run(&opts, &mut |_: &str| Ok(())).unwrap();
    sink
}

/// Every frame of the capture, checked by our parser; returns the BTH opcodes in order.
fn our_opcodes(path: &Path, expect: u64) -> Vec<Opcode> {
    let bytes = std::fs::read(path).unwrap();
    let frames = read_frames(&bytes).expect("a pcap this side wrote");
    assert_eq!(frames.len() as u64, expect);
    frames
        .iter()
        .map(|(_, f)| match parse(f) {
            Ok(Parsed::Roce(r)) => r.bth.opcode,
            other => panic!("a captured frame fails our checks: {other:?}"),
        })
        .collect()
}

fn tshark_present() -> bool {
    Command::new("tshark").arg("--version").output().is_ok_and(|o| o.status.success())
}

/// tshark's verbose decode of `path` (UDP checksums validated) and its per-frame BTH opcodes.
fn tshark(path: &Path) -> (String, Vec<u8>) {
    let run = |extra: &[&str]| {
        let o = Command::new("tshark")
            .arg("-r")
            .arg(path)
            .args(["-o", "udp.check_checksum:TRUE"])
            .args(extra)
            .output()
            .expect("tshark runs");
        assert!(o.status.success(), "tshark failed: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let verbose = run(&["-V"]);
    let ops = run(&["-T", "fields", "-e", "infiniband.bth.opcode"])
        .lines()
        .map(|l| l.trim().parse::<u8>().unwrap_or_else(|_| panic!("frame without a BTH opcode: {l:?}")))
        .collect();
    (verbose, ops)
}

fn check_with_tshark(path: &Path, ours: &[Opcode]) {
    if !tshark_present() {
        eprintln!("pcap: tshark half skipped: tshark is not installed (apt-get install tshark)");
        return;
    }
    let (verbose, ops) = tshark(path);
    assert!(verbose.contains("InfiniBand"), "tshark does not see RoCE");
    assert!(!verbose.contains("Malformed"), "tshark finds a malformed packet");
    assert!(!verbose.contains("[Checksum Status: Bad]"), "tshark finds a bad checksum");
    let ours: Vec<u8> = ours.iter().map(|&o| o.into()).collect();
    assert_eq!(ops, ours, "tshark and our parser disagree on the opcodes");
}

#[test]
fn a_captured_send_write_and_read_decode_as_roce() {
    for (test, size, want) in [
        // 3000 bytes at the 1024-byte path MTU of a 1500-byte Ethernet port: three packets, one ACK.
        ("send_bw", "3000", [Opcode::RcSendFirst, Opcode::RcSendMiddle, Opcode::RcSendLast, Opcode::RcAck]),
        ("write_bw", "3000", [Opcode::RcWriteFirst, Opcode::RcWriteMiddle, Opcode::RcWriteLast, Opcode::RcAck]),
        (
            "read_bw",
            "3000",
            [
                Opcode::RcReadRequest,
                Opcode::RcReadResponseFirst,
                Opcode::RcReadResponseMiddle,
                Opcode::RcReadResponseLast,
            ],
        ),
    ] {
        let path = capture_path(test);
        let sink = bench(test, size, &path);
        assert_eq!(sink.error(), None);
        let ours = our_opcodes(&path, sink.frames());
        for op in want {
            assert!(ours.contains(&op), "{test}: no {op:?} in {ours:?}");
        }
        check_with_tshark(&path, &ours);
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
fn a_captured_ud_pingpong_carries_deth() {
    let path = capture_path("ud");
    let sink = PcapSink::create(&path).unwrap();
    let ctx = Context::open_sim_device_with(
        SimDevice::new(SimConfig { pcap: Some(sink.clone()), ..SimConfig::default() }),
        None,
    )
    .unwrap();
    let report = mlx5_tool::ud_pingpong::run(&ctx, Some(512), 3).unwrap();
    assert!(report.verified);
    drop(ctx);
    let ours = our_opcodes(&path, sink.frames());
    assert!(!ours.is_empty() && ours.iter().all(|&o| o == Opcode::UdSendOnly), "{ours:?}");
    check_with_tshark(&path, &ours);
    let _ = std::fs::remove_file(&path);
}

/// RESET → INIT → RTR → RTS of a UC QP towards `dest` at `ah`, with the attributes verbs requires for UC.
fn uc_connect(n: &mut mlx5_sim::testkit::Node, qp: &mut mlx5_core::qp::Qp, dest: u32, ah: mlx5_core::qp::AhAttr) {
    use mlx5_core::mkey::Access;
    use mlx5_core::qp::{required_attrs, Mtu, QpAttr, QpState, QpType};
    let a = QpAttr {
        qp_access_flags: Access::REMOTE_WRITE | Access::LOCAL_WRITE,
        path_mtu: Mtu::M1024,
        dest_qp_num: dest,
        ah_attr: ah,
        rq_psn: 0x100,
        sq_psn: 0x100,
        ..QpAttr::default()
    };
    for (f, s) in [(QpState::Reset, QpState::Init), (QpState::Init, QpState::Rtr), (QpState::Rtr, QpState::Rts)] {
        let m = required_attrs(QpType::Uc, f, s).unwrap();
        n.hca.modify_qp(qp, &QpAttr { qp_state: s, ..a }, m, &mut n.d).unwrap();
    }
}

#[test]
fn a_uc_message_between_two_devices_crosses_as_uc_frames() {
    use mlx5_core::cq::{WcStatus, WorkCompletion};
    use mlx5_core::qp::{QpCap, QpType, RecvWr, SendFlags, SendOp, SendWr};
    use mlx5_sim::testkit::Node;
    let path = capture_path("uc");
    let sink = PcapSink::create(&path).unwrap();
    let cfg = SimConfig { pcap: Some(sink.clone()), ..SimConfig::default() };
    let (mut a, mut b) = (Node::new(cfg.clone(), 1 << 16), Node::new(cfg.next_host(), 1 << 16));
    a.dev.connect(&b.dev);
    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let (mut a_cq, mut b_cq) = (a.cq(8), b.cq(8));
    let mut qa = a.qp(QpType::Uc, &a_cq, cap, false);
    let mut qb = b.qp(QpType::Uc, &b_cq, cap, false);
    let (ah_a, ah_b) = (a.ah_attr(), b.ah_attr());
    let (na, nb) = (qa.qpn(), qb.qpn());
    uc_connect(&mut a, &mut qa, nb, ah_b);
    uc_connect(&mut b, &mut qb, na, ah_a);
    let data: Vec<u8> = (0..2500u32).map(|k| (k * 11) as u8).collect();
    a.put(0, &data);
    let r = [b.sge(0x4000, 4096)];
    b.hca.post_recv(&mut qb, &[RecvWr { wr_id: 7, sg_list: &r }]).unwrap();
    let s = [a.sge(0, 2500)];
    let wr = SendWr { wr_id: 1, op: SendOp::Send, sg_list: &s, flags: SendFlags::SIGNALED, inline: None, ud: None };
    a.hca.post_send(&mut qa, &[wr]).unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    let mut got = 0;
    for _ in 0..10_000 {
        got += b_cq.poll(b.hca.mmio(), &mut [&mut qb][..], &mut wc).unwrap();
        if got == 1 {
            break;
        }
    }
    assert_eq!(got, 1, "the UC receive completed");
    assert_eq!((wc[0].status, wc[0].wr_id, wc[0].byte_len), (WcStatus::Success, 7, 2500));
    assert_eq!(b.bytes(0x4000, 2500), data);
    // Three UC SEND packets at the 1024-byte MTU, nothing acknowledged; B took them through its port.
    let ours = our_opcodes(&path, sink.frames());
    assert_eq!(ours, [Opcode::UcSendFirst, Opcode::UcSendMiddle, Opcode::UcSendLast]);
    assert_eq!(b.dev.frames_received(), 3);
    check_with_tshark(&path, &ours);
    let _ = a_cq.poll(a.hca.mmio(), &mut [&mut qa][..], &mut wc);
    let _ = std::fs::remove_file(&path);
}
