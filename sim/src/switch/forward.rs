//! What the switch does with one frame that came in on one port (IBTA vol. 1, 18.2.4): a LID-routed packet
//! goes out of the port its LinearForwardingTable names, as it is (only the Ethernet source becomes the output
//! port's); a packet to an unprogrammed LID, to a port that is not Active or back out of its input port is
//! dropped and counted. An SMP to the switch (its LID, or the permissive LID of a directed route) is put back
//! together, checked and handed to the SMA (`sma.rs`), or passed on along its directed route by the hop rules
//! of a switch (IBTA 14.2.2.2: C14-9 on the way out, C14-13 on the way back), which `ib_mad`'s `smi.c` applies
//! for a switch port. A LID probe (`link/vde_ib.rs`) is flooded to every other port, so ports with a configured
//! LID still find each other's. Every frame that cannot be handled is counted by why; nothing panics.
//!
//! This is pure state: frames in, `(output port, frame)` out. The threads and VDE cables are `switch/mod.rs`'s.

use crate::fw::mad_ifc::{Smp, CLASS_SUBN_DIRECTED_ROUTE, CLASS_SUBN_LID_ROUTED, MAX_PATH_HOPS, STATUS_DIRECTION};
use crate::link::vde::{lid_mac, ETHERTYPE_IB};
use crate::link::vde_ib::{self, emit, instance, Ident, Kind, Reasm, IB_FRAGMENT};
use crate::wire::frame::encode_packet;
use crate::wire::{is_unicast_lid, Body, Packet, RoceInfo, PERMISSIVE_LID};

use super::sma::{SwitchSma, UNPROGRAMMED};

/// Bytes of the Ethernet header, and where the LRH's DLID sits in a frame.
const ETH_HEADER: usize = 14;

/// What the switch counted (every frame lands in exactly one counter).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct SwitchCounters {
    /// LID-routed frames passed on by the LinearForwardingTable.
    pub forwarded: u64,
    /// Directed-route SMPs passed on to the next hop.
    pub dr_forwarded: u64,
    /// SMPs the switch's SMA answered.
    pub answered: u64,
    /// LID probes flooded to the other ports.
    pub flooded: u64,
    /// Frames to a LID the LinearForwardingTable does not name a port for.
    pub unprogrammed: u64,
    /// Frames whose output port is not Active, or is their input port.
    pub port_refused: u64,
    /// Frames that are not IB frames of the fabric, or do not add up (`vde_ib::parse`).
    pub malformed: u64,
    /// Packets to the switch that are no SMP on QP0 (a GMP: the switch has no GSI agent).
    pub not_smp: u64,
    /// SMPs dropped by the directed-route rules or as no SMP at all.
    pub bad_smp: u64,
    /// Fragments held until their message is whole (not yet a packet).
    pub partial: u64,
}

/// The switch: its SMA state and, per port, the messages to it being put back together.
#[derive(Debug)]
pub(crate) struct Switch {
    pub(crate) sma: SwitchSma,
    reasm: Vec<Reasm>,
    instance: u64,
    next_msg: u32,
    pub(crate) counters: SwitchCounters,
}

/// Where a directed-route SMP goes next.
#[derive(Debug, PartialEq, Eq)]
enum Dr {
    /// It ends here: the SMA answers.
    Here,
    /// On to the next hop, out of this port.
    Out(u8),
}

impl Switch {
    pub(crate) fn new(sma: SwitchSma) -> Switch {
        let n = usize::from(sma.external()) + 1;
        Switch {
            sma,
            reasm: (0..n).map(|_| Reasm::default()).collect(),
            instance: instance(),
            next_msg: 0,
            counters: SwitchCounters::default(),
        }
    }

    /// The Ethernet source of frames leaving port `p`: `02:49:53` ("IS"), the GUID's low 16 bits, the port, so
    /// no `vde_switch` learns an HCA's MAC on the switch's side.
    pub(crate) fn port_mac(&self, p: u8) -> [u8; 6] {
        let g = self.sma.node_guid.to_be_bytes();
        [0x02, 0x49, 0x53, g[6], g[7], p]
    }

    /// Takes one frame that came in on external port `in_port`: the frames to send, each with its output port.
    pub(crate) fn frame_in(&mut self, in_port: u8, frame: &[u8]) -> Vec<(u8, Vec<u8>)> {
        if in_port == 0 || in_port > self.sma.external() || !self.sma.linked(in_port) {
            self.counters.port_refused += 1;
            return Vec::new();
        }
        if frame.len() < ETH_HEADER || frame[12..14] != ETHERTYPE_IB.to_be_bytes() {
            self.counters.malformed += 1;
            return Vec::new();
        }
        let f = match vde_ib::parse(frame) {
            Ok(f) => f,
            Err(_) => {
                self.counters.malformed += 1;
                return Vec::new();
            }
        };
        if f.kind != Kind::Data {
            // Who holds a LID: every other port with its link up hears it.
            self.counters.flooded += 1;
            return (1..=self.sma.external())
                .filter(|&p| p != in_port && self.sma.linked(p))
                .map(|p| (p, frame.to_vec()))
                .collect();
        }
        let lid = self.sma.lid();
        if f.dlid != PERMISSIVE_LID && (f.dlid != lid || lid == 0) {
            return self.route(in_port, f.dlid, frame);
        }
        // For the switch itself: the whole message first.
        let mut given_up = 0;
        let body = if f.offset == 0 && f.fragment.len() == f.total {
            self.reasm[usize::from(in_port)].remember(f.instance, f.msg);
            Some(f.fragment.to_vec())
        } else {
            self.reasm[usize::from(in_port)].add(&f, &mut given_up)
        };
        self.counters.malformed += given_up;
        let Some(body) = body else {
            self.counters.partial += 1;
            return Vec::new();
        };
        let from = Ident { lid: f.slid, guid: f.guid, instance: f.instance };
        self.to_switch(in_port, &from, f.dlid, &body)
    }

    /// A LID-routed frame: out of the port the LFT names for `dlid`, with that port's MAC as its source.
    fn route(&mut self, in_port: u8, dlid: u16, frame: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let out = self.sma.lft.get(usize::from(dlid)).copied().unwrap_or(UNPROGRAMMED);
        if out == UNPROGRAMMED || out == 0 || out > self.sma.external() {
            self.counters.unprogrammed += 1;
            return Vec::new();
        }
        if out == in_port || !self.sma.forwards(out) {
            self.counters.port_refused += 1;
            return Vec::new();
        }
        self.counters.forwarded += 1;
        let mut g = frame.to_vec();
        g[6..12].copy_from_slice(&self.port_mac(out));
        vec![(out, g)]
    }

    /// A whole packet to the switch (its LID or the permissive LID) from `from`.
    fn to_switch(&mut self, in_port: u8, from: &Ident, dlid: u16, body: &[u8]) -> Vec<(u8, Vec<u8>)> {
        let p = match vde_ib::decode(body, ()) {
            Ok(p) => p,
            Err(_) => {
                self.counters.malformed += 1;
                return Vec::new();
            }
        };
        let (Body::Ud { qkey, pkey, data, .. }, 0) = (&p.body, p.dst_qpn) else {
            self.counters.not_smp += 1;
            return Vec::new();
        };
        let Ok(mut smp) = Smp::parse(data) else {
            self.counters.bad_smp += 1;
            return Vec::new();
        };
        let dr = smp.mgmt_class == CLASS_SUBN_DIRECTED_ROUTE;
        if !dr && smp.mgmt_class != CLASS_SUBN_LID_ROUTED {
            self.counters.bad_smp += 1;
            return Vec::new();
        }
        let reply = |s: &mut Switch, rsp: Smp, out: u8, dlid: u16| {
            let slid = if is_unicast_lid(s.sma.lid()) { s.sma.lid() } else { PERMISSIVE_LID };
            let me = Ident { lid: slid, guid: s.sma.node_guid, instance: s.instance };
            let pkt = smp_packet(&rsp, p.src_qpn, slid, p.sl, *pkey);
            s.counters.answered += 1;
            s.emit(out, dlid, &me, &pkt)
        };
        if !dr {
            // LID-routed: for this switch only by its LID; the answer goes back by the LFT to the sender's LID.
            if dlid != self.sma.lid() || !is_unicast_lid(from.lid) {
                self.counters.bad_smp += 1;
                return Vec::new();
            }
            let Some(rsp) = self.sma.answer(&smp, in_port) else { return Vec::new() };
            let out = self.sma.lft.get(usize::from(from.lid)).copied().unwrap_or(UNPROGRAMMED);
            if out == UNPROGRAMMED || out == 0 || out > self.sma.external() {
                self.counters.unprogrammed += 1;
                return Vec::new();
            }
            return reply(self, rsp, out, from.lid);
        }
        match dr_hop(&mut smp, in_port, self.sma.external()) {
            Err(_) => {
                self.counters.bad_smp += 1;
                Vec::new()
            }
            Ok(Dr::Out(out)) => {
                if !self.sma.linked(out) {
                    self.counters.port_refused += 1;
                    return Vec::new();
                }
                // On as it came (the sender's LRH identity kept), with the hop pointer and return path moved.
                let pkt = Packet {
                    body: Body::Ud { qkey: *qkey, pkey: *pkey, data: smp.emit().to_vec(), imm: None, solicited: false },
                    ..p.clone()
                };
                self.counters.dr_forwarded += 1;
                self.emit(out, PERMISSIVE_LID, from, &pkt)
            }
            Ok(Dr::Here) => {
                let Some(mut rsp) = self.sma.answer(&smp, in_port) else { return Vec::new() };
                // C14-13:1 (or :3 with hop count 0): back one hop, out of the port the request came in on.
                rsp.hop_ptr = rsp.hop_ptr.saturating_sub(1);
                reply(self, rsp, in_port, PERMISSIVE_LID)
            }
        }
    }

    /// The frames of `pkt` out of port `out` to `dlid`, from `from` (its LRH SLID, GUID and instance).
    fn emit(&mut self, out: u8, dlid: u16, from: &Ident, pkt: &Packet<()>) -> Vec<(u8, Vec<u8>)> {
        let body = encode_packet(pkt);
        let msg = self.next_msg;
        self.next_msg = self.next_msg.wrapping_add(1);
        // Forwarded frames keep the sender's message numbers apart from the switch's own by its instance.
        let msg = if from.instance == self.instance { msg } else { msg | 0x8000_0000 };
        let (dst, src) = (lid_mac(dlid), self.port_mac(out));
        body.chunks(IB_FRAGMENT)
            .enumerate()
            .map(|(i, c)| (out, emit(dst, src, Kind::Data, pkt.sl, dlid, from, msg, i * IB_FRAGMENT, body.len(), c)))
            .collect()
    }
}

/// A QP0 packet carrying `smp` to the QP `dqpn` (0) from `slid`.
fn smp_packet(smp: &Smp, dqpn: u32, slid: u16, sl: u8, pkey: u16) -> Packet<()> {
    Packet {
        src: (),
        dst: (),
        src_qpn: 0,
        dst_qpn: dqpn,
        slid,
        sl,
        grh: None,
        body: Body::Ud { qkey: 0, pkey, data: smp.emit().to_vec(), imm: None, solicited: false },
        roce: RoceInfo::default(),
    }
}

/// The directed-route rules at a switch for an SMP that came in on `in_port` (IBTA 14.2.2.2): updates the hop
/// pointer and the return path and says where it goes. Outbound (direction bit clear): C14-9:2, an intermediate
/// hop (records the input port, moves on, out of the next initial-path port); C14-9:3, the end of the directed
/// part (records the input port; only a permissive DrDLID ends it here); C14-9:4, reached by LID after it.
/// Returning: C14-13:2, back one hop out of the return-path port. The rest (C14-9:1 and C14-13:1/3 belong to
/// the SM's and the responder's own port; C14-9:5, C14-13:5) is refused.
fn dr_hop(smp: &mut Smp, in_port: u8, ports: u8) -> Result<Dr, &'static str> {
    let (ptr, cnt) = (smp.hop_ptr, smp.hop_cnt);
    if usize::from(cnt) >= MAX_PATH_HOPS {
        return Err("directed route with a hop count past 63");
    }
    let valid = |p: u8| (1..=ports).contains(&p);
    if smp.status & STATUS_DIRECTION == 0 {
        if ptr > 0 && ptr < cnt {
            smp.return_path[usize::from(ptr)] = in_port;
            smp.hop_ptr = ptr + 1;
            let out = smp.initial_path[usize::from(ptr + 1)];
            return if valid(out) { Ok(Dr::Out(out)) } else { Err("directed route through a port the switch lacks") };
        }
        if ptr == cnt {
            if smp.dr_dlid != PERMISSIVE_LID {
                return Err("directed route with a LID-routed end (not modelled)");
            }
            if cnt != 0 {
                smp.return_path[usize::from(ptr)] = in_port;
            }
            smp.hop_ptr = ptr + 1;
            return Ok(Dr::Here);
        }
        if ptr == cnt + 1 {
            return Ok(Dr::Here);
        }
        return Err("directed route whose hop pointer does not fit its count");
    }
    if ptr >= 2 && ptr <= cnt {
        smp.hop_ptr = ptr - 1;
        let out = smp.return_path[usize::from(ptr - 1)];
        return if valid(out) { Ok(Dr::Out(out)) } else { Err("return path through a port the switch lacks") };
    }
    Err("returning directed route that does not pass this switch")
}
