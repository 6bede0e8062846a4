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
