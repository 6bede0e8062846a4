//! What the switch does with one frame that came in on one port (IBTA vol. 1, 18.2.4): a LID-routed packet
//! goes out of the port its LinearForwardingTable names, as it is (only the Ethernet source becomes the output
//! port's); a packet to an unprogrammed LID, to a port that is not Active or back out of its input port is
//! dropped and counted. An SMP to the switch (its LID, or the permissive LID of a directed route) is put back
//! together, checked and handed to the SMA (`sma.rs`), or passed on along its directed route by the hop rules
//! of a switch (IBTA 14.2.2.2: C14-9 on the way out, C14-13 on the way back, as `ib_mad`'s `smi.c` applies them
//! for a switch port): `mlx5_core::smp_route`, which the host stack's QP0 agent shares. A LID probe
//! (`link/vde_ib.rs`) is flooded to every other port, so ports with a configured LID still find each other's.
//! Every frame that cannot be handled is counted by why; nothing panics.
//!
//! This is pure state: frames in, `(output port, frame)` out. The threads and VDE cables are `switch/mod.rs`'s.

use mlx5_core::smp_route::{self, Hop};

use crate::fw::mad_ifc::{Smp, CLASS_SUBN_DIRECTED_ROUTE, CLASS_SUBN_LID_ROUTED, MAD_LEN};
use crate::link::vde::{lid_mac, ETHERTYPE_IB};
use crate::link::vde_ib::{self, emit, instance, Ident, Kind, Reasm, IB_FRAGMENT};
use crate::wire::frame::encode_packet;
use crate::wire::{is_unicast_lid, Body, Packet, RoceInfo, PERMISSIVE_LID};

use super::sma::{SwitchSma, UNPROGRAMMED};

/// Bytes of the Ethernet header (the LRH follows).
const ETH_HEADER: usize = 14;

/// What the switch counted: frames passed on, SMPs answered, and every frame dropped, by why.
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
        self.for_switch(in_port, &from, f.dlid, &body)
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
    fn for_switch(&mut self, in_port: u8, from: &Ident, dlid: u16, body: &[u8]) -> Vec<(u8, Vec<u8>)> {
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
        let Ok(smp) = Smp::parse(data) else {
            self.counters.bad_smp += 1;
            return Vec::new();
        };
        let dr = smp.mgmt_class == CLASS_SUBN_DIRECTED_ROUTE;
        if !dr && smp.mgmt_class != CLASS_SUBN_LID_ROUTED {
            self.counters.bad_smp += 1;
            return Vec::new();
        }
        let reply = |s: &mut Switch, rsp: [u8; MAD_LEN], out: u8, dlid: u16| {
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
            return reply(self, rsp.emit(), out, from.lid);
        }
        let mut bytes = smp.emit();
        match smp_route::arrive(&mut bytes, in_port, Some(self.sma.external())) {
            Err(_) => {
                self.counters.bad_smp += 1;
                Vec::new()
            }
            Ok(Hop::Out(out)) => {
                if !self.sma.linked(out) {
                    self.counters.port_refused += 1;
                    return Vec::new();
                }
                // On as it came (the sender's LRH identity kept), with the hop pointer and return path moved.
                let pkt = Packet {
                    body: Body::Ud { qkey: *qkey, pkey: *pkey, data: bytes.to_vec(), imm: None, solicited: false },
                    ..p.clone()
                };
                self.counters.dr_forwarded += 1;
                self.emit(out, PERMISSIVE_LID, from, &pkt)
            }
            Ok(Hop::Here) => {
                let Ok(req) = Smp::parse(&bytes) else { return Vec::new() };
                let Some(rsp) = self.sma.answer(&req, in_port) else { return Vec::new() };
                // Back one hop, out of the port the request came in on (C14-13:1, or :3 with hop count 0).
                let mut rsp = rsp.emit();
                if smp_route::depart(&mut rsp, in_port).is_err() {
                    self.counters.bad_smp += 1;
                    return Vec::new();
                }
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
fn smp_packet(smp: &[u8; MAD_LEN], dqpn: u32, slid: u16, sl: u8, pkey: u16) -> Packet<()> {
    Packet {
        src: (),
        dst: (),
        src_qpn: 0,
        dst_qpn: dqpn,
        slid,
        sl,
        grh: None,
        body: Body::Ud { qkey: 0, pkey, data: smp.to_vec(), imm: None, solicited: false },
        roce: RoceInfo::default(),
    }
}

/// The tests' transaction id of a directed-route SMP ([`test_dr_smp`]).
#[cfg(test)]
pub(super) const TEST_TID: u64 = 0x42;

/// A directed-route request as the tests' SM's HCA sends it onto the cable: hop pointer 1 (C14-9:1 moved it),
/// `path` after the SM's own port (this file's tests and the switch's own).
#[cfg(test)]
pub(super) fn test_dr_smp(
    method: u8,
    attr_id: u16,
    attr_mod: u32,
    path: &[u8],
    data: [u8; crate::fw::mad_ifc::SMP_DATA_LEN],
) -> Smp {
    use crate::fw::mad_ifc::MAX_PATH_HOPS;
    let mut initial_path = [0u8; MAX_PATH_HOPS];
    initial_path[1..=path.len()].copy_from_slice(path);
    Smp {
        base_version: 1,
        mgmt_class: CLASS_SUBN_DIRECTED_ROUTE,
        class_version: 1,
        method,
        status: 0,
        hop_ptr: 1,
        hop_cnt: path.len() as u8,
        tid: TEST_TID,
        attr_id,
        attr_mod,
        m_key: 0,
        dr_slid: PERMISSIVE_LID,
        dr_dlid: PERMISSIVE_LID,
        data,
        initial_path,
        return_path: [0; MAX_PATH_HOPS],
    }
}

#[cfg(test)]
mod tests {
    use super::test_dr_smp as dr;
    use super::*;
    use crate::fw::mad_ifc::{
        MadStatus, NodeInfo, PortInfo, ATTR_NODE_INFO, ATTR_PORT_INFO, METHOD_GET, METHOD_GET_RESP, METHOD_SET,
        SMP_DATA_LEN, STATUS_DIRECTION,
    };
    use crate::switch::sma::{ATTR_LINEAR_FT, ATTR_MULTICAST_FT, ATTR_SWITCH_INFO};

    const SW_GUID: u64 = 0xb8ce_f603_00ff_0001;
    /// The HCA the SM runs on, on switch port 1, and its instance on the fabric.
    const SM: Ident = Ident { lid: PERMISSIVE_LID, guid: 0xa1, instance: 11 };

    fn switch() -> Switch {
        Switch::new(SwitchSma::new(SW_GUID, 3, "test switch"))
    }

    /// A QP0 packet from `from` to `dlid` carrying `smp`, as an HCA's VDE link frames it.
    fn smp_frame(from: &Ident, dlid: u16, smp: &Smp) -> Vec<u8> {
        ud_frame(from, dlid, 0, smp.emit().to_vec())
    }

    fn ud_frame(from: &Ident, dlid: u16, dqpn: u32, data: Vec<u8>) -> Vec<u8> {
        let p = Packet {
            src: (),
            dst: (),
            src_qpn: dqpn,
            dst_qpn: dqpn,
            slid: from.lid,
            sl: 0,
            grh: None,
            body: Body::Ud { qkey: 0, pkey: 0xffff, data, imm: None, solicited: false },
            roce: RoceInfo::default(),
        };
        let body = encode_packet(&p);
        assert!(body.len() <= IB_FRAGMENT);
        emit(lid_mac(dlid), lid_mac(from.lid), Kind::Data, 0, dlid, from, 7, 0, body.len(), &body)
    }

    /// The one frame the switch sent: its port, LRH DLID and SLID, and the SMP it carries.
    fn one_smp(out: Vec<(u8, Vec<u8>)>) -> (u8, u16, u16, Smp) {
        assert_eq!(out.len(), 1, "one frame out");
        let (port, f) = out.into_iter().next().unwrap();
        let r = vde_ib::parse(&f).expect("a good frame");
        let p = vde_ib::decode(r.fragment, ()).expect("a packet");
        let Body::Ud { data, .. } = p.body else { panic!("not UD") };
        (port, r.dlid, r.slid, Smp::parse(&data).expect("an SMP"))
    }

    /// Asks the switch one hop out (path `1`) from port 1; the response, which must come back on port 1.
    fn ask(sw: &mut Switch, method: u8, attr_id: u16, attr_mod: u32, data: [u8; SMP_DATA_LEN]) -> Smp {
        let out = sw.frame_in(1, &smp_frame(&SM, PERMISSIVE_LID, &dr(method, attr_id, attr_mod, &[1], data)));
        let (port, dlid, _, rsp) = one_smp(out);
        assert_eq!((port, dlid, rsp.method, rsp.hop_ptr), (1, PERMISSIVE_LID, METHOD_GET_RESP, 1));
        rsp
    }

    #[test]
    fn a_hand_made_sm_sweeps_the_switch_and_two_hcas_behind_it_and_programs_its_lft() {
        let mut sw = switch();
        // NodeInfo one hop out: a switch of 3 ports, the SMP came in on port 1.
        let rsp = ask(&mut sw, METHOD_GET, ATTR_NODE_INFO, 0, [0; SMP_DATA_LEN]);
        let ni = NodeInfo::parse(&rsp.data);
        assert_eq!(rsp.status, STATUS_DIRECTION);
        assert_eq!(
            (ni.node_type, ni.num_ports, ni.node_guid, ni.port_guid, ni.local_port_num),
            (2, 3, SW_GUID, SW_GUID, 1)
        );
        // Two hops: through port 2 to the HCA there, the return path recording port 1.
        let req = dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1, 2], [0; SMP_DATA_LEN]);
        let (port, dlid, slid, fwd) = one_smp(sw.frame_in(1, &smp_frame(&SM, PERMISSIVE_LID, &req)));
        assert_eq!((port, dlid, slid, fwd.hop_ptr, fwd.return_path[1]), (2, PERMISSIVE_LID, PERMISSIVE_LID, 2, 1));
        // The HCA's answer (its SMA ran C14-13:1: hop pointer back to 2) returns through the switch to port 1.
        let hca = Ident { lid: PERMISSIVE_LID, guid: 0xb2, instance: 22 };
        let mut back = Smp { method: METHOD_GET_RESP, status: STATUS_DIRECTION, hop_ptr: 2, ..fwd.clone() };
        back.return_path[2] = 1;
        let (port, _, _, rsp) = one_smp(sw.frame_in(2, &smp_frame(&hca, PERMISSIVE_LID, &back)));
        assert_eq!((port, rsp.hop_ptr, rsp.tid), (1, 1, TEST_TID));
        assert_eq!(sw.counters.dr_forwarded, 2);

        // The SM gives the switch LID 5 (its SM at LID 1) and brings ports 1-3 to Active through Armed.
        let mut pi = PortInfo::parse(&ask(&mut sw, METHOD_GET, ATTR_PORT_INFO, 0, [0; SMP_DATA_LEN]).data);
        assert_eq!((pi.lid, pi.port_state, pi.local_port_num), (0, 4, 1));
        (pi.lid, pi.master_sm_lid) = (5, 1);
        assert_eq!(ask(&mut sw, METHOD_SET, ATTR_PORT_INFO, 0, pi.emit()).status, STATUS_DIRECTION);
        assert_eq!(sw.sma.lid(), 5);
        for p in 1..=3 {
            let mut e = PortInfo::parse(&ask(&mut sw, METHOD_GET, ATTR_PORT_INFO, p, [0; SMP_DATA_LEN]).data);
            assert_eq!((e.port_state, e.port_phys_state, e.lid), (2, 5, 5));
            // Active straight from Init is refused and changes nothing.
            e.port_state = 4;
            let bad = ask(&mut sw, METHOD_SET, ATTR_PORT_INFO, p, e.emit());
            assert_eq!(bad.status, STATUS_DIRECTION | MadStatus::InvalidField as u16);
            for s in [3, 4] {
                e.port_state = s;
                let r = ask(&mut sw, METHOD_SET, ATTR_PORT_INFO, p, e.emit());
                assert_eq!((r.status, PortInfo::parse(&r.data).port_state), (STATUS_DIRECTION, s));
            }
        }
        // SwitchInfo: LinearFDBCap 0xc000, MulticastFDBCap 1024; the SM sets LinearFDBTop and the life time.
        let si = ask(&mut sw, METHOD_GET, ATTR_SWITCH_INFO, 0, [0; SMP_DATA_LEN]).data;
        assert_eq!((&si[0..2], &si[4..6]), (&[0xc0, 0][..], &[0x04, 0][..]));
        let mut set = si;
        set[6..8].copy_from_slice(&5u16.to_be_bytes());
        set[11] = 18 << 3 | 0x04;
        let si = ask(&mut sw, METHOD_SET, ATTR_SWITCH_INFO, 0, set).data;
        assert_eq!((u16::from_be_bytes([si[6], si[7]]), si[11] >> 3), (5, 18));
        // LFT block 0: LIDs 1-3 on ports 1-3, the switch's own LID 5 on port 0.
        let mut lft = [UNPROGRAMMED; SMP_DATA_LEN];
        (lft[1], lft[2], lft[3], lft[5]) = (1, 2, 3, 0);
        assert_eq!(ask(&mut sw, METHOD_SET, ATTR_LINEAR_FT, 0, lft).data, lft);
        assert_eq!(ask(&mut sw, METHOD_GET, ATTR_LINEAR_FT, 0, [0; SMP_DATA_LEN]).data, lft);
        // Past LinearFDBCap: status 0x1c.
        let past = ask(&mut sw, METHOD_GET, ATTR_LINEAR_FT, 768, [0; SMP_DATA_LEN]);
        assert_eq!(past.status, STATUS_DIRECTION | MadStatus::InvalidField as u16);
        // The MFT takes a Set and gives it back; a second port-mask position does not exist (15 ports at most).
        let mut mft = [0u8; SMP_DATA_LEN];
        mft[0..2].copy_from_slice(&0b1110u16.to_be_bytes());
        assert_eq!(ask(&mut sw, METHOD_SET, ATTR_MULTICAST_FT, 0, mft).data, mft);
        let pos1 = ask(&mut sw, METHOD_GET, ATTR_MULTICAST_FT, 1 << 28, [0; SMP_DATA_LEN]);
        assert_eq!(pos1.status, STATUS_DIRECTION | MadStatus::InvalidField as u16);

        // A LID-routed Get(SwitchInfo) from the SM's new LID 1 to the switch's LID 5: answered back by the LFT.
        let sm = Ident { lid: 1, ..SM };
        let lr = Smp {
            mgmt_class: CLASS_SUBN_LID_ROUTED,
            hop_ptr: 0,
            hop_cnt: 0,
            ..dr(METHOD_GET, ATTR_SWITCH_INFO, 0, &[], [0; SMP_DATA_LEN])
        };
        let (port, dlid, slid, rsp) = one_smp(sw.frame_in(1, &smp_frame(&sm, 5, &lr)));
        assert_eq!((port, dlid, slid, rsp.status, u16::from_be_bytes([rsp.data[6], rsp.data[7]])), (1, 1, 5, 0, 5));
        // A directed-route SMP from an SM that has a LID: answered from the switch's LID now.
        let (_, dlid, slid, _) =
            one_smp(sw.frame_in(
                1,
                &smp_frame(&sm, PERMISSIVE_LID, &dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN])),
            ));
        assert_eq!((dlid, slid), (PERMISSIVE_LID, 5));
    }

    /// A switch whose ports 1-3 are Active and whose LFT routes LIDs 1-3 to them.
    fn routed() -> Switch {
        let mut sw = switch();
        for p in &mut sw.sma.ports[1..] {
            p.state = 4;
        }
        (sw.sma.lft[1], sw.sma.lft[2], sw.sma.lft[3]) = (1, 2, 3);
        sw
    }

    #[test]
    fn lid_routed_packets_follow_the_lft_and_the_rest_is_dropped_and_counted() {
        let mut sw = routed();
        let a = Ident { lid: 1, guid: 0xa1, instance: 11 };
        let data = ud_frame(&a, 2, 9, b"to LID 2".to_vec());
        let out = sw.frame_in(1, &data);
        // Out of port 2 as it came, the source MAC now the switch port's.
        assert_eq!(out.len(), 1);
        let (port, f) = &out[0];
        assert_eq!((*port, &f[..6], &f[6..12], &f[12..]), (2, &data[..6], &sw.port_mac(2)[..], &data[12..]));
        // A LID no SM programmed.
        assert!(sw.frame_in(1, &ud_frame(&a, 9, 9, vec![1])).is_empty());
        // Back out of its input port; to a port that is not Active.
        assert!(sw.frame_in(2, &ud_frame(&a, 2, 9, vec![1])).is_empty());
        sw.sma.ports[3].state = 2;
        assert!(sw.frame_in(1, &ud_frame(&a, 3, 9, vec![1])).is_empty());
        // A cable that went away: its port is Down and takes nothing; the SM hears of it by PortStateChange.
        sw.sma.set_link(2, false);
        assert!(sw.sma.info.port_state_change);
        assert!(sw.frame_in(2, &ud_frame(&a, 1, 9, vec![1])).is_empty());
        assert!(sw.frame_in(1, &ud_frame(&a, 2, 9, vec![1])).is_empty());
        let c = sw.counters;
        assert_eq!((c.forwarded, c.unprogrammed, c.port_refused), (1, 1, 4));
        // A multi-fragment message passes fragment by fragment, never reassembled by the switch.
        let big: Vec<u8> = (0..3 * IB_FRAGMENT).map(|i| i as u8).collect();
        let frames = {
            let mut s = routed();
            let _ = &mut s;
            let p = Packet {
                src: (),
                dst: (),
                src_qpn: 9,
                dst_qpn: 9,
                slid: 1,
                sl: 0,
                grh: None,
                body: Body::Ud { qkey: 1, pkey: 0xffff, data: big, imm: None, solicited: false },
                roce: RoceInfo::default(),
            };
            let body = encode_packet(&p);
            body.chunks(IB_FRAGMENT)
                .enumerate()
                .map(|(i, c)| emit(lid_mac(3), lid_mac(1), Kind::Data, 0, 3, &a, 8, i * IB_FRAGMENT, body.len(), c))
                .collect::<Vec<_>>()
        };
        let mut sw = routed();
        let n: usize = frames.iter().map(|f| sw.frame_in(1, f).len()).sum();
        assert_eq!((n, sw.counters.forwarded), (frames.len(), frames.len() as u64));
    }

    #[test]
    fn bad_smps_and_bad_frames_are_dropped_and_counted_or_get_a_mad_status_never_a_panic() {
        let mut sw = routed();
        // Not an IB frame; a runt; a frame whose LRH does not add up.
        assert!(sw.frame_in(1, &[0u8; 60]).is_empty());
        assert!(sw.frame_in(1, &[1, 2, 3]).is_empty());
        let mut f = smp_frame(&SM, PERMISSIVE_LID, &dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN]));
        f[19] ^= 0x10;
        assert!(sw.frame_in(1, &f).is_empty());
        assert_eq!(sw.counters.malformed, 3);
        // A truncated SMP; a GMP to QP1 of the switch; a performance class MAD on QP0.
        assert!(sw.frame_in(1, &ud_frame(&SM, PERMISSIVE_LID, 0, vec![1, 0x81, 1, 1])).is_empty());
        assert!(sw.frame_in(1, &ud_frame(&SM, PERMISSIVE_LID, 1, vec![0; 256])).is_empty());
        let mut perf = dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN]).emit();
        perf[1] = 0x04;
        assert!(sw.frame_in(1, &ud_frame(&SM, PERMISSIVE_LID, 0, perf.to_vec())).is_empty());
        // Directed routes that do not fit: hop count 64, a pointer past the count, a port the switch lacks, a
        // response that does not pass here, a LID-routed end.
        let mut hops = dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN]);
        hops.hop_cnt = 64;
        let mut past = dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN]);
        past.hop_ptr = 3;
        let nine = dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1, 9], [0; SMP_DATA_LEN]);
        let stray = Smp { status: STATUS_DIRECTION, hop_ptr: 1, ..nine.clone() };
        let lid_end = Smp { dr_dlid: 3, ..dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN]) };
        for s in [hops, past, nine, stray, lid_end] {
            assert!(sw.frame_in(1, &smp_frame(&SM, PERMISSIVE_LID, &s)).is_empty(), "{s:?}");
        }
        let c = sw.counters;
        assert_eq!((c.bad_smp, c.not_smp, c.answered), (7, 1, 0));
        // What the SMA does not serve gets the status a switch gives: SMInfo, RandomForwardingTable, Mellanox's
        // ExtendedPortInfo (0x000c); a GetResp as a request (0x0008); class version 2 (0x0004); a PortInfo of
        // port 4 and a Set of NodeInfo.
        let mut sw = switch();
        for (method, attr, want) in [
            (METHOD_GET, 0x0020, MadStatus::UnsupportedMethodAttr),
            (METHOD_GET, 0x001a, MadStatus::UnsupportedMethodAttr),
            (METHOD_GET, 0xff90, MadStatus::UnsupportedMethodAttr),
            (METHOD_SET, ATTR_NODE_INFO, MadStatus::UnsupportedMethodAttr),
            (0x05, ATTR_NODE_INFO, MadStatus::UnsupportedMethod),
        ] {
            assert_eq!(ask(&mut sw, method, attr, 0, [0; SMP_DATA_LEN]).status, STATUS_DIRECTION | want as u16);
        }
        assert_eq!(ask(&mut sw, METHOD_GET, ATTR_PORT_INFO, 4, [0; SMP_DATA_LEN]).status, STATUS_DIRECTION | 0x1c);
        let v2 = Smp { class_version: 2, ..dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN]) };
        let (_, _, _, rsp) = one_smp(sw.frame_in(1, &smp_frame(&SM, PERMISSIVE_LID, &v2)));
        assert_eq!(rsp.status, STATUS_DIRECTION | MadStatus::BadVersion as u16);
        // A Set(PortInfo) with a multicast LID: 0x1c and no change.
        let mut pi = PortInfo::parse(&ask(&mut sw, METHOD_GET, ATTR_PORT_INFO, 0, [0; SMP_DATA_LEN]).data);
        pi.lid = 0xc001;
        assert_eq!(ask(&mut sw, METHOD_SET, ATTR_PORT_INFO, 0, pi.emit()).status, STATUS_DIRECTION | 0x1c);
        assert_eq!(sw.sma.lid(), 0);
        // Arbitrary bytes after a good header, on every port: never a panic.
        let mut x = 0x1234_5678u32;
        for i in 0..2000 {
            let mut s = dr(METHOD_GET, ATTR_NODE_INFO, 0, &[1], [0; SMP_DATA_LEN]).emit();
            for b in s.iter_mut().take(if i % 2 == 0 { 40 } else { 256 }) {
                x ^= x << 13;
                x ^= x >> 17;
                x ^= x << 5;
                *b = x as u8;
            }
            let _ = sw.frame_in((i % 4) as u8, &ud_frame(&SM, PERMISSIVE_LID, 0, s.to_vec()));
        }
    }
}
