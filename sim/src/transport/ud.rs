//! Firmware side: `fw/qp.rs` (the QP table, its state and counters).
//!
//! UD: a send to the address vector's QP (dropped, completing successfully, when it cannot be delivered) and its
//! receive with the 40-byte GRH area in front of the payload.

use super::common::*;
use super::cqe::{flags_rqpn, CqeOut};
use super::requester::Requester;
use super::responder::Responder;
use super::wqe::SendWqe;
use crate::fw::mcg::is_multicast_gid;
use crate::fw::port::DEFAULT_PKEY;
use crate::fw::qp::SpecialQp;
use crate::wire::roce::frame::IpRepr;
use crate::wire::roce::ip::{Ipv4Repr, Ipv6Repr, IPV4_HEADER_LEN};
use crate::wire::{roce_map, PERMISSIVE_LID};

/// The UDP header of a RoCE v2 packet.
const UDP_BYTES: usize = 8;

/// The 40 bytes a UD receive gets before the payload, as a ConnectX writes them: on InfiniBand the GRH; on a
/// RoCE port (RoCE v2 on the simulated wire) the IPv6 header, next header UDP, or for IPv4 the IPv4 header in
/// the last 20 bytes and zeros before it (mlx5 CQE l3 header type IPv4; rdma-core's `ibv_init_ah_from_wc` and
/// Linux's `ib_init_ah_attr_from_wc` read it there).
pub(super) fn grh_image(grh: Option<&Grh>, payload: usize, imm: bool, ib: bool) -> [u8; GRH_BYTES] {
    let mut g = [0u8; GRH_BYTES];
    let Some(h) = grh else {
        // No GRH on the wire (IB): zeros with a valid IP version, as the brief allows.
        g[0] = (GRH_IP_VERSION as u8) << 4;
        return g;
    };
    let ib_len = BTH_BYTES + DETH_BYTES + if imm { IMMDT_BYTES } else { 0 } + payload + ICRC_BYTES;
    if !ib {
        // Lengths past what an IPv4 header holds are cut (a UD message is one MTU at most).
        let udp_len = u16::try_from(UDP_BYTES + ib_len).unwrap_or(u16::MAX).min(u16::MAX - IPV4_HEADER_LEN as u16);
        match roce_map::ip_header(&h.sgid, &h.dgid, h.tclass, h.hop_limit, h.flow_label) {
            IpRepr::V4(r) => Ipv4Repr { payload_len: udp_len, ..r }.emit(&mut g[GRH_BYTES - IPV4_HEADER_LEN..]),
            IpRepr::V6(r) => Ipv6Repr { payload_len: udp_len, ..r }.emit(&mut g),
        }
        return g;
    }
    let w0 = GRH_IP_VERSION << 28 | u32::from(h.tclass) << 20 | (h.flow_label & FLOW_LABEL_MASK);
    g[0..4].copy_from_slice(&w0.to_be_bytes());
    g[4..6].copy_from_slice(&u16::try_from(ib_len).unwrap_or(u16::MAX).to_be_bytes());
    g[6] = GRH_NEXT_BTH;
    g[7] = h.hop_limit;
    g[8..24].copy_from_slice(&h.sgid);
    g[24..40].copy_from_slice(&h.dgid);
    g
}

/// The destination QPN of a multicast packet (IBA 9.2: `0xFFFFFF`).
const MULTICAST_QPN: u32 = QPN_MASK;

impl Requester<'_> {
    pub(super) fn execute_ud(&mut self, qpn: u32, w: &SendWqe) {
        let Some(qp) = self.qps.get(&qpn) else { return };
        let (pd, own_qkey, max_msg, psn) = (qp.pd, qp.q_key, qp.max_msg, qp.next_send_psn);
        // The BTH carries the P_Key at the QP's index in the port's table (the GSI QP's too: mlx5's hardware QP1
        // sends with its own index, whatever the work request names).
        let pkey = self.port.pkeys.get(usize::from(qp.route.pkey_index)).copied().unwrap_or(DEFAULT_PKEY);
        // The SMI and GSI QPs send as QP0 and QP1 (IBA 3.5.4): that is the source QPN a receiver sees.
        let src_qpn = qp.special.and_then(SpecialQp::wire_qpn).unwrap_or(qpn);
        let Some(av) = w.av else {
            return self.completions().send_error(
                qpn,
                w.index,
                w.opcode,
                w.nbb,
                consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR,
            );
        };
        let data = match self.keys().gather(pd, max_msg, w) {
            Ok(d) => d,
            Err(s) => return self.completions().send_error(qpn, w.index, w.opcode, w.nbb, s),
        };
        let addr = self.wire.addr;
        // On a RoCE port every packet has a GRH, so libmlx5 leaves the AV's GRH bit clear there ("reserved for
        // RoCE", `mlx5_create_ah`) and fills the GRH fields all the same; mlx5_ib's kernel AVs set it. Reading
        // the bit on Ethernet dropped every user-space UD send ("RoCE address vector without a GRH").
        let grh = if av.grh || !addr.ib {
            let Some(sgid) = self.source_gid(av.sgid_index) else {
                return self.completions().send_error(
                    qpn,
                    w.index,
                    w.opcode,
                    w.nbb,
                    consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR,
                );
            };
            let (tclass, flow_label, hop_limit) = (av.tclass, av.flow_label, av.hop_limit);
            Some(Grh { sgid, dgid: av.rgid, tclass, flow_label, hop_limit })
        } else {
            None
        };
        let dest = if addr.ib { Dest::Lid(av.rlid) } else { Dest::Gid { gid: av.rgid, mac: av.rmac } };
        let len = data.len() as u64;
        // A send to a multicast GID goes to the port's own members and to every peer's (IBA 10.5.2: the QPN
        // is the multicast one; each receiving port finds its attached QPs by the GRH's destination GID).
        if grh.as_ref().is_some_and(|g| is_multicast_gid(&g.dgid)) {
            let qkey = if av.qkey & QKEY_FROM_QP != 0 { own_qkey } else { av.qkey };
            let roce = RoceInfo { psn, ..RoceInfo::default() };
            let (me, slid) = (self.wire.me_here(), addr.lid);
            let sl = if addr.ib { av.sl } else { 0 };
            for dst in self.wire.route_multicast() {
                let body = Body::Ud { qkey, pkey, data: data.clone(), imm: w.imm, solicited: w.solicited };
                let src = me.clone();
                self.wire.send(Packet { src, dst, src_qpn, dst_qpn: MULTICAST_QPN, slid, sl, grh, body, roce });
            }
            return self.completions().complete_send(qpn, w.id(), len);
        }
        match self.route(&dest) {
            Ok(dst) => {
                let qkey = if av.qkey & QKEY_FROM_QP != 0 { own_qkey } else { av.qkey };
                let body = Body::Ud { qkey, pkey, data, imm: w.imm, solicited: w.solicited };
                let sl = if addr.ib { av.sl } else { 0 };
                let me = self.wire.me_here();
                let roce = RoceInfo { psn, ..RoceInfo::default() };
                // A directed-route SMP's LRH carries the permissive LID both ways (IBA 14.2.2): the responder's
                // reply (ib_mad answers to the SLID it received) then finds its way back before any LID exists.
                let slid = if addr.ib && av.rlid == PERMISSIVE_LID { PERMISSIVE_LID } else { addr.lid };
                let p = Packet { src: me, dst, src_qpn, dst_qpn: av.dqpn, slid, sl, grh, body, roce };
                self.wire.send(p);
            }
            Err(why) => self.events.push(SimEvent::UdDropped { qpn, dqpn: av.dqpn, why }),
        }
        // UD is unreliable: the send completes once it is on the wire, delivered or not.
        self.completions().complete_send(qpn, w.id(), len);
    }
}

impl Responder<'_> {
    /// A UD packet arrives: checked, then scattered with its 40-byte GRH into the next receive.
    pub(super) fn ud_receive(&mut self, p: Packet) {
        let drop =
            |st: &mut Responder, why| st.events.push(SimEvent::UdDropped { qpn: p.src_qpn, dqpn: p.dst_qpn, why });
        // The multicast QPN: every QP attached to the destination GID's group gets its own copy.
        if p.dst_qpn == MULTICAST_QPN {
            let Some(dgid) = p.grh.as_ref().map(|g| g.dgid) else { return drop(self, "multicast without a GRH") };
            let mcgs = self.mcgs;
            let members = mcgs.members(&dgid);
            if members.is_empty() {
                return drop(self, "no QP attached to the multicast group");
            }
            for &qpn in members {
                self.ud_deliver(&p, qpn, None);
            }
            return;
        }
        // QPNs 0 and 1 name the port's SMI and GSI QPs, whatever their QPNs in the device.
        let special = SpecialQp::of_wire_qpn(p.dst_qpn);
        let dst = match special {
            Some(sp) => {
                let found = self.qps.iter().find(|(_, q)| q.special == Some(sp)).map(|(n, _)| n);
                match found {
                    Some(n) => n,
                    None => return drop(self, "no SMI/GSI QP at the destination"),
                }
            }
            None => p.dst_qpn,
        };
        self.ud_deliver(&p, dst, special);
    }

    /// Delivers UD packet `p` to QP `dst` (`special` when the wire named QP0 or QP1): checked, then scattered
    /// with its 40-byte GRH into the next receive.
    fn ud_deliver(&mut self, p: &Packet, dst: u32, special: Option<SpecialQp>) {
        let Body::Ud { qkey, pkey, data, imm, solicited } = &p.body else { return };
        let drop =
            |st: &mut Responder, why| st.events.push(SimEvent::UdDropped { qpn: p.src_qpn, dqpn: p.dst_qpn, why });
        let ready = self
            .qps
            .get(&dst)
            .filter(|q| q.st == QpType::Ud && q.special != Some(SpecialQp::RegUmr))
            .filter(|q| matches!(q.state, QpState::Rtr | QpState::Rts));
        let Some(qp) = ready else { return drop(self, "no UD QP in RTR/RTS at the destination") };
        // Subnet management packets carry no Q_Key check (IBA 10.2.4: QP0 ignores it).
        if qp.special != Some(SpecialQp::Qp0) && qp.q_key != *qkey {
            self.port.qkey_viol_cntr = self.port.qkey_viol_cntr.saturating_add(1);
            return drop(self, "qkey mismatch");
        }
        let pd = qp.pd;
        let mut sges = Sges::new();
        let Some(index) = self.wqes().next_recv(dst, &mut sges) else { return drop(self, "receive queue empty") };
        let mut msg = Vec::with_capacity(GRH_BYTES + data.len());
        msg.extend_from_slice(&grh_image(p.grh.as_ref(), data.len(), imm.is_some(), self.wire.addr.ib));
        msg.extend_from_slice(data);
        match self.keys().scatter(pd, &sges, &msg) {
            Ok(()) => {
                // A GSI receive's CQE has the packet's P_Key where the immediate goes (`mlx5_cqe64.pkey`):
                // mlx5_ib looks it up in its P_Key cache for the work completion's `pkey_index`, which ib_cm
                // answers a REQ with.
                let field = match special {
                    Some(SpecialQp::Qp1) => u32::from(*pkey).to_be_bytes(),
                    _ => imm.unwrap_or_default(),
                };
                let cqe = CqeOut {
                    opcode: if imm.is_some() { consts::MLX5_CQE_RESP_SEND_IMM } else { consts::MLX5_CQE_RESP_SEND },
                    solicited: *solicited,
                    byte_cnt: msg.len() as u32,
                    imm: field,
                    flags_rqpn: flags_rqpn(p, self.wire.addr.ib),
                    slid: p.slid,
                    ..CqeOut::default()
                };
                self.completions().recv_complete(dst, index, data.len() as u64, cqe);
            }
            Err(s) => self.completions().recv_error(dst, index, s),
        }
    }
}
