//! `run_peer()` (the function the bare-metal image runs against a host process) between two simulated devices
//! joined by a wire, each in its own thread with the facts crossing on channels: both sides must finish the
//! 1,000 rounds with every byte checked, send the same commands in the same order (the page commands, given when
//! the firmware asks, in their own order), and leave nothing behind. A
//! missing peer and a silent one end in named errors after the same teardown; the facts' text round-trips and bad
//! text is refused by name.

use std::sync::mpsc::{channel, Receiver, Sender};

use mlx5_core::cq::LinkLayer;
use mlx5_core::prm::consts;
use mlx5_firmware_example::peer::{PEER_ITERS, PEER_MSG};
use mlx5_firmware_example::{run_peer, PeerInfo, PeerInfoError, PeerReport, Rendezvous, RunError};
use mlx5_sim::{Mode, PortType, SimConfig, SimDevice};

/// Facts over channels, as the xtask carries them between the host process and the image.
struct Chan {
    tx: Sender<PeerInfo>,
    rx: Receiver<PeerInfo>,
    /// Send this side's facts at `ready` (the image) rather than at `peer` (the host).
    at_ready: bool,
}

impl Rendezvous for Chan {
    fn peer(&mut self, mine: &PeerInfo) -> Option<PeerInfo> {
        if !self.at_ready {
            self.tx.send(*mine).ok()?;
        }
        self.rx.recv().ok()
    }
    fn ready(&mut self, mine: &PeerInfo) {
        if self.at_ready {
            let _ = self.tx.send(*mine);
        }
    }
}

fn config(port_type: PortType) -> SimConfig {
    SimConfig { mode: Mode::Threaded, port_type, ..SimConfig::default() }
}

fn clean(dev: &SimDevice) {
    assert!(dev.executed().iter().all(|c| c.status == 0 && c.delivery == 0), "every command OK");
    assert_eq!(dev.dma_outstanding(), (0, 0), "no DMA memory left");
    assert_eq!(dev.pages_owned(), 0, "firmware returned every page");
    assert!(dev.dma_faults().is_empty(), "{:?}", dev.dma_faults());
}

fn exchange(port_type: PortType) -> (PeerReport, PeerReport) {
    let a = SimDevice::new(config(port_type));
    let b = SimDevice::new(config(port_type).next_host());
    a.connect(&b);
    let (to_b, from_a) = channel();
    let (to_a, from_b) = channel();
    let (ra, rb) = std::thread::scope(|s| {
        let ta = s.spawn(|| {
            let mut rv = Chan { tx: to_b, rx: from_b, at_ready: false };
            run_peer(a.mmio(), a.dma(), (), &mut a.delay(), &mut rv, true, 30_000_000)
        });
        let tb = s.spawn(|| {
            let mut rv = Chan { tx: to_a, rx: from_a, at_ready: true };
            run_peer(b.mmio(), b.dma(), (), &mut b.delay(), &mut rv, false, 30_000_000)
        });
        (ta.join().expect("side A"), tb.join().expect("side B"))
    });
    let (ra, rb) = (ra.expect("side A's run"), rb.expect("side B's run"));
    let bytes = u64::from(PEER_ITERS) * 2 * PEER_MSG as u64;
    for r in [&ra, &rb] {
        assert_eq!(r.rounds, PEER_ITERS);
        assert_eq!(r.bytes_checked, bytes);
        assert!(r.pages_reclaimed > 0);
    }
    assert_eq!((ra.theirs, rb.theirs), (rb.mine, ra.mine), "each side connected to the other's facts");
    clean(&a);
    clean(&b);
    // Pages are given when the firmware asks (an event its own thread raises), so where MANAGE_PAGES falls among
    // the other commands is that thread's timing: the other commands must match in order, the page commands
    // among themselves.
    type Trace = Vec<(u16, u16)>;
    let trace = |d: &SimDevice| -> (Trace, Trace) {
        d.executed().iter().map(|c| (c.opcode, c.op_mod)).partition(|&(op, _)| op != consts::MLX5_CMD_OP_MANAGE_PAGES)
    };
    let ((a_cmds, a_pages), (b_cmds, b_pages)) = (trace(&a), trace(&b));
    assert_eq!(a_cmds, b_cmds, "the same commands in the same order on both sides");
    assert_eq!(a_pages, b_pages, "the same page commands in the same order on both sides");
    assert!(!a_pages.is_empty(), "pages were given and taken back");
    (ra, rb)
}

#[test]
fn two_sides_exchange_a_thousand_sends_and_writes_over_roce_with_every_byte_checked() {
    let (a, b) = exchange(PortType::Eth);
    assert_eq!(a.link_layer, LinkLayer::Ethernet);
    assert_ne!(a.mine.gid, b.mine.gid, "RoCE: each side addressed by its own GID");
    assert_ne!(a.mine.mac, [0; 6]);
}

#[test]
fn two_sides_exchange_over_infiniband_addressed_by_lid() {
    let (a, b) = exchange(PortType::Ib);
    assert_eq!(a.link_layer, LinkLayer::InfiniBand);
    assert_ne!(a.mine.lid, b.mine.lid);
}

/// No facts: the QP is never connected, and everything is still destroyed.
struct Nobody;

impl Rendezvous for Nobody {
    fn peer(&mut self, _: &PeerInfo) -> Option<PeerInfo> {
        None
    }
    fn ready(&mut self, _: &PeerInfo) {}
}

#[test]
fn no_facts_from_the_other_side_is_named_and_everything_is_torn_down() {
    let dev = SimDevice::new(config(PortType::Eth));
    let r = run_peer(dev.mmio(), dev.dma(), (), &mut dev.delay(), &mut Nobody, true, 1000);
    assert_eq!(r, Err(RunError::NoPeer));
    clean(&dev);
}

/// Facts of a QP nobody runs (this port's address, a QPN beside its own): the first wait ends at the timeout,
/// not in a hang.
struct Silent;

impl Rendezvous for Silent {
    fn peer(&mut self, mine: &PeerInfo) -> Option<PeerInfo> {
        Some(PeerInfo { qpn: mine.qpn + 1, ..*mine })
    }
    fn ready(&mut self, _: &PeerInfo) {}
}

#[test]
fn a_peer_that_never_answers_times_out_in_round_zero_and_everything_is_torn_down() {
    let a = SimDevice::new(config(PortType::Eth));
    // The side that answers waits for a SEND that never comes.
    let r = run_peer(a.mmio(), a.dma(), (), &mut a.delay(), &mut Silent, false, 200_000);
    assert_eq!(r, Err(RunError::PeerTimeout { round: 0 }));
    clean(&a);
}

#[test]
fn the_facts_round_trip_as_text_and_bad_text_is_named() {
    let p = PeerInfo {
        qpn: 0x12_3456,
        lid: 0x17,
        gid: core::array::from_fn(|i| i as u8 * 17),
        mac: [0xb8, 0xce, 0xf6, 1, 2, 3],
        rkey: 0xdead_beef,
        addr: 0x1234_5678_9abc,
    };
    let text = p.to_string();
    assert!(!text.contains(' '), "one token: {text}");
    assert_eq!(text.parse::<PeerInfo>(), Ok(p));
    let without = |key: &str| text.split(',').filter(|kv| !kv.starts_with(key)).collect::<Vec<_>>().join(",");
    assert_eq!(without("rkey=").parse::<PeerInfo>(), Err(PeerInfoError::Missing("rkey")));
    assert_eq!(text.replace("qpn=123456", "qpn=1234567").parse::<PeerInfo>(), Err(PeerInfoError::Bad("qpn")));
    assert_eq!(text.replace("mac=b8cef6010203", "mac=b8cef60102").parse::<PeerInfo>(), Err(PeerInfoError::Bad("mac")));
    assert_eq!(text.replace("lid=17", "lid=zz").parse::<PeerInfo>(), Err(PeerInfoError::Bad("lid")));
    assert_eq!("".parse::<PeerInfo>(), Err(PeerInfoError::Missing("qpn")));
}
