//! Firmware side: `fw/sq.rs`, `fw/rq.rs` (the rings and their counters), `fw/port.rs` (the NIC counters).
//!
//! The Ethernet engine: an SQ's doorbell (decoded in `uar.rs`) leaves its WQEs here, each executed in order
//! (parsed by `send.rs`, gathered through the data segments' keys, checksummed or cut by LSO) and put on the
//! wire as [`Body::Eth`] frames, routed by destination MAC; a WQE asking for a CQE (`CQ_UPDATE`) gets one on the
//! SQ's CQ, a malformed one an error CQE and the SQ goes to ERR. A frame that is not RoCE, on a port whose NIC
//! receive steering has a root, goes through steering (`classify.rs`) into its RQ's next cyclic WQE, with the
//! CQE `rx_cqe.rs` builds; no entry, no RQ ready, or no WQE posted is a counted drop.

use super::super::common::*;
use super::super::cqe::CqeOut;
use super::super::keys::Keys;
use super::classify::rx_target;
use super::rx_cqe::rx_cqe;
use super::send::{self, EthWqeError};
use crate::link::DevRef;

/// The largest frame an SQ builds before LSO cuts it: mlx5e's `max_lso_cap` is 2^18 bytes of payload.
const MAX_SEND: u64 = (1 << 18) + 1024;
/// The largest WQE: 63 16-byte units, 16 basic blocks.
const MAX_WQE_BBS: usize = 16;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const ETH_HLEN: usize = 14;
const VLAN_HLEN: usize = 4;
const IPPROTO_UDP: u8 = 17;
/// RoCEv2's UDP port (IANA): these frames belong to the RDMA engine.
const ROCE_V2_PORT: u16 = 4791;

/// Whether `frame` is RoCEv2 (UDP to port 4791 over untagged IPv4 or IPv6).
pub(crate) fn is_roce_v2(frame: &[u8]) -> bool {
    let at = |o: usize| frame.get(o..o + 2).map(|b| u16::from_be_bytes([b[0], b[1]]));
    match at(12) {
        Some(ETH_P_IP) => {
            let ihl = usize::from(frame.get(14).copied().unwrap_or(0) & 0xf) * 4;
            frame.get(23) == Some(&IPPROTO_UDP) && at(14 + ihl + 2) == Some(ROCE_V2_PORT)
        }
        Some(ETH_P_IPV6) => frame.get(20) == Some(&IPPROTO_UDP) && at(14 + 40 + 2) == Some(ROCE_V2_PORT),
        _ => false,
    }
}

/// Why a send WQE failed, with the CQE syndrome a ConnectX gives.
fn wqe_syndrome(e: EthWqeError) -> u8 {
    match e {
        EthWqeError::SegmentCount { .. }
        | EthWqeError::Opcode(_)
        | EthWqeError::LsoWithoutHeader
        | EthWqeError::MssZero
        | EthWqeError::InlineTooLong { .. } => consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR,
    }
}

impl Datapath<'_> {
    /// Whether a netdev owns the port: its NIC receive steering has a root table. Then ARP and every other frame
    /// that is not RoCE go to steering, and the built-in ARP answer steps aside.
    pub(crate) fn netdev_owns_port(&self) -> bool {
        self.fw.flows.root.is_some()
    }

    /// Runs every Ethernet SQ with WQEs posted; whether any executed.
    pub(crate) fn eth_sqs_step(&mut self) -> bool {
        let mut any = false;
        let mut from = 0;
        while let Some(&sqn) = self.dp.eth_sqs.range(from..).next() {
            any |= self.eth_sq_step(sqn);
            let Some(next) = sqn.checked_add(1) else { break };
            from = next;
        }
        any
    }

    /// Executes the WQEs of SQ `sqn` up to its producer counter; it leaves the walk when done or not ready.
    fn eth_sq_step(&mut self, sqn: u32) -> bool {
        let mut any = false;
        let mut wqe = [0u8; MAX_WQE_BBS * BB as usize];
        // Bounded: every step moves the counter by at least one basic block, or stops.
        for _ in 0..=u16::MAX {
            let Some(sq) = self.fw.sqs.map.get(&sqn) else { break };
            if sq.state != consts::MLX5_SQC_STATE_RDY || sq.ci == sq.pi {
                break;
            }
            let index = sq.ci;
            let bbs = (sq.wq.bytes() / BB).max(1);
            let at = u64::from(index) % bbs * BB;
            if sq.wq.read(self.dma, at, &mut wqe[..BB as usize]).is_err() {
                self.events.push(SimEvent::FrameDropped { why: "SQ ring not mapped" });
                self.eth_sq_error(sqn, index, 0, 1, consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR);
                break;
            }
            let ctrl = &wqe[..CTRL];
            let ds = (be(c::mlx5_wqe_ctrl_seg::QPN_DS, ctrl, 0) & DS_MASK) as usize;
            let opcode = (be(c::mlx5_wqe_ctrl_seg::OPMOD_IDX_OPCODE, ctrl, 0) & OPCODE_MASK) as u8;
            let signaled = wqe[c::mlx5_wqe_ctrl_seg::FM_CE_SE.off] & consts::MLX5_WQE_CTRL_CQ_UPDATE != 0;
            let nbb = (ds * DS).div_ceil(BB as usize).clamp(1, MAX_WQE_BBS);
            let len = nbb * BB as usize;
            if nbb > 1 && sq.wq.read(self.dma, at + BB, &mut wqe[BB as usize..len]).is_err() {
                self.eth_sq_error(sqn, index, opcode, nbb as u16, consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR);
                break;
            }
            let pd = sq.wq.pd;
            any = true;
            match self.eth_build(&wqe[..len], pd) {
                Ok(frames) => {
                    if let Some(sq) = self.fw.sqs.map.get_mut(&sqn) {
                        sq.ci = index.wrapping_add(nbb as u16);
                    }
                    // The transport domain of the SQ's TIS: a looped-back frame never reaches its own domain.
                    let td = self.fw.sqs.map.get(&sqn).and_then(|s| self.fw.tises.map.get(&s.tisn)).map(|t| t.td);
                    for f in frames {
                        self.eth_transmit(f, td);
                    }
                    if signaled {
                        let Some((cqn, uidx)) = self.fw.sqs.map.get(&sqn).map(|s| (s.cqn, s.user_index)) else {
                            break;
                        };
                        // `srqn_uidx` is the SQ's user index: libmlx5 (`cqe_version` 1) finds a raw packet
                        // QP by it; mlx5e reads no such field.
                        let cqe = CqeOut {
                            opcode: consts::MLX5_CQE_REQ,
                            wqe_opcode: opcode,
                            qpn: sqn,
                            wqe_counter: index,
                            srqn: uidx,
                            ..CqeOut::default()
                        };
                        self.cqs().post(cqn, cqe);
                    }
                }
                Err(syndrome) => {
                    self.eth_sq_error(sqn, index, opcode, nbb as u16, syndrome);
                    break;
                }
            }
        }
        let idle = self.fw.sqs.map.get(&sqn).is_none_or(|s| s.state != consts::MLX5_SQC_STATE_RDY || s.ci == s.pi);
        if idle {
            self.dp.eth_sqs.remove(&sqn);
        }
        any
    }

    /// A send WQE failed: an error CQE (signaled or not, as on an RDMA SQ) and the SQ goes to ERR, where it
    /// stays until the driver moves it back through RST (mlx5e's SQ recovery).
    fn eth_sq_error(&mut self, sqn: u32, index: u16, opcode: u8, nbb: u16, syndrome: u8) {
        let Some(sq) = self.fw.sqs.map.get_mut(&sqn) else { return };
        sq.ci = index.wrapping_add(nbb);
        sq.state = consts::MLX5_SQC_STATE_ERR;
        let (cqn, uidx) = (sq.cqn, sq.user_index);
        self.events.push(SimEvent::EthSendError { sqn, wqe_counter: index, syndrome });
        let cqe = CqeOut {
            opcode: consts::MLX5_CQE_REQ_ERR,
            wqe_opcode: opcode,
            qpn: sqn,
            wqe_counter: index,
            syndrome,
            srqn: uidx,
            ..CqeOut::default()
        };
        self.cqs().post(cqn, cqe);
    }

    /// The frames one send WQE puts on the wire, or the CQE syndrome it fails with.
    fn eth_build(&mut self, wqe: &[u8], pd: u32) -> Result<Vec<Vec<u8>>, u8> {
        let s = send::parse(wqe).map_err(wqe_syndrome)?;
        if s.opcode == consts::MLX5_OPCODE_NOP {
            return Ok(Vec::new());
        }
        // A data segment of byte count 0 stands for 2 GiB: far past any frame, refused before reading.
        let total = s.data.iter().map(|d| if d.0 == 0 { ZERO_COUNT_BYTES } else { u64::from(d.0) }).sum::<u64>();
        if total + s.inline.len() as u64 > MAX_SEND {
            return Err(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
        }
        let mut frame = s.inline;
        let mut keys = Keys { mkeys: &self.fw.mkeys, dma: self.dma, inline: &mut self.dp.inline, qpn: None };
        for &(bc, lkey, addr) in &s.data {
            keys.key_read_into(lkey, pd, addr, u64::from(bc), MkeyAccess::LOCAL_READ, &mut frame)
                .map_err(|()| consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR)?;
        }
        if let Some(tag) = s.insert_vlan {
            // A tag to insert needs the MAC addresses it goes after.
            send::insert_vlan(&mut frame, tag).ok_or(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR)?;
        }
        if s.opcode == consts::MLX5_OPCODE_TSO {
            // LSO of something that is not IPv4/TCP with its whole header inline: the WQE is malformed.
            return send::segment(&frame, s.mss).ok_or(consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR);
        }
        send::checksum(&mut frame, s.cs_flags);
        Ok(vec![frame])
    }

    /// Puts a frame on the wire: to this port (its own MAC), the peers whose MAC it names, or every peer for a
    /// broadcast or multicast destination. A unicast frame for a MAC nobody on the wire has goes nowhere.
    ///
    /// A broadcast or multicast frame from an SQ (`src_td`, its TIS's transport domain) also loops back into
    /// this port's NIC receive steering, as the vport's local loopback does on a ConnectX (always on here: the
    /// simulator offers no `disable_local_lb` capability), for TIRs of other transport domains only: a raw
    /// packet QP's frame reaches another context's flow rule (rdma-core's test_flow), mlx5e never sees its own.
    fn eth_transmit(&mut self, frame: Vec<u8>, src_td: Option<u32>) {
        if !self.fw.port.oper_up() {
            self.events.push(SimEvent::FrameDropped { why: "port down" });
            return;
        }
        self.fw.port.eth.count(true, &frame);
        let mut dst = [0u8; 6];
        dst.copy_from_slice(&frame[..6]);
        let looped = dst[0] & 1 != 0 && src_td.is_some() && self.netdev_owns_port() && !is_roce_v2(&frame);
        if looped {
            self.eth_receive_from(&frame, src_td);
        }
        let to = self.wire.route_mac(dst);
        if to.is_empty() && looped {
            return;
        }
        if to.is_empty() {
            self.events.push(SimEvent::FrameDropped { why: "no port on the wire has the destination MAC" });
            if self.wire.pcap.is_some() {
                self.wire.capture_raw(&frame);
            }
            return;
        }
        let n = to.len();
        let mut frame = Some(frame);
        for (k, d) in to.into_iter().enumerate() {
            // The last destination takes the frame itself; the others a copy.
            let f = if k + 1 == n { frame.take().unwrap_or_default() } else { frame.clone().unwrap_or_default() };
            let p = Packet {
                src: self.wire.me_here(),
                dst: d,
                src_qpn: 0,
                dst_qpn: 0,
                slid: 0,
                sl: 0,
                grh: None,
                body: Body::Eth { frame: f },
                roce: RoceInfo::default(),
            };
            self.wire.send(p);
        }
    }

    /// An Ethernet frame from another device of this process (or loopback), as a link hands one in: RoCE and
    /// the built-in ARP answer when no netdev owns the port, NIC receive steering otherwise. An ARP answer goes
    /// back out.
    pub(crate) fn eth_frame_in(&mut self, frame: &[u8], from: &DevRef) {
        if let Some(reply) = self.receive_frame(frame, from) {
            self.eth_transmit(reply, None);
        }
    }

    /// NIC receive: steering picks the RQ, its next WQE takes the frame, its CQ gets the CQE.
    pub(crate) fn eth_receive(&mut self, frame: &[u8]) {
        self.eth_receive_from(frame, None)
    }

    /// [`eth_receive`](Self::eth_receive) of a frame this port sent from transport domain `src_td` (local
    /// loopback): a TIR of that domain does not take it.
    fn eth_receive_from(&mut self, frame: &[u8], src_td: Option<u32>) {
        if !self.fw.port.oper_up() {
            self.events.push(SimEvent::FrameDropped { why: "port down" });
            return;
        }
        let Some(t) = rx_target(&self.fw.flows, &self.fw.tirs, &self.fw.rqts, frame) else {
            self.fw.port.eth.rx_steer_missed += 1;
            self.events.push(SimEvent::FrameDropped { why: "no flow entry steers the frame to an RQ" });
            return;
        };
        if src_td.is_some() && self.fw.tirs.map.get(&t.tirn).map(|t| t.td) == src_td {
            self.events.push(SimEvent::FrameDropped { why: "local loopback into the sender's transport domain" });
            return;
        }
        let Some(rq) = self.fw.rqs.map.get(&t.rqn) else {
            self.fw.port.eth.rx_steer_missed += 1;
            self.events.push(SimEvent::FrameDropped { why: "steered to an RQ that does not exist" });
            return;
        };
        if rq.state != consts::MLX5_RQC_STATE_RDY {
            self.fw.port.eth.rx_steer_missed += 1;
            self.events.push(SimEvent::FrameDropped { why: "steered to an RQ not ready" });
            return;
        }
        let mut rec = [0u8; 4];
        let head = match self.dma.read(rq.wq.dbr_addr + RCV_DBR, &mut rec) {
            Ok(()) => (u32::from_be_bytes(rec) & CTR16) as u16,
            Err(_) => rq.ci,
        };
        if head == rq.ci {
            self.fw.port.eth.out_of_buffer += 1;
            self.events.push(SimEvent::FrameDropped { why: "no receive WQE posted (out of buffer)" });
            return;
        }
        let (index, cqn, pd, strip, uidx) = (rq.ci, rq.cqn, rq.wq.pd, !rq.vsd, rq.user_index);
        let stride = 1usize << rq.wq.log_stride;
        let mut wqe = [0u8; 4096];
        let slot = (u64::from(index) & ((1u64 << rq.wq.log_size) - 1)) << rq.wq.log_stride;
        let read = rq.wq.read(self.dma, slot, &mut wqe[..stride]);
        if let Some(rq) = self.fw.rqs.map.get_mut(&t.rqn) {
            rq.ci = index.wrapping_add(1);
        }
        // An RQ that strips VLAN tags writes a tagged frame without its tag (the CQE carries it).
        let tagged = frame.len() >= ETH_HLEN + VLAN_HLEN && frame[12..14] == send::ETH_P_8021Q.to_be_bytes();
        let status = match read {
            Ok(()) if strip && tagged => {
                let mut untagged = Vec::with_capacity(frame.len() - VLAN_HLEN);
                untagged.extend_from_slice(&frame[..12]);
                untagged.extend_from_slice(&frame[12 + VLAN_HLEN..]);
                self.eth_scatter(&wqe[..stride], pd, &untagged)
            }
            Ok(()) => self.eth_scatter(&wqe[..stride], pd, frame),
            Err(_) => Err((consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR, "RQ ring not mapped")),
        };
        match status {
            Ok(()) => {
                self.fw.port.eth.count(false, frame);
                let mut cqe = rx_cqe(frame, &t, index, strip);
                // The RQ's user index, by which libmlx5 finds a raw packet QP's receive (mlx5e ignores it).
                c::mlx5_cqe64::SRQN.put_be(&mut cqe, 0, uidx & QPN_MASK);
                let ts = self.cqs().device_clock();
                c::mlx5_cqe64::TIMESTAMP_H.put_be(&mut cqe, 0, (ts >> 32) as u32);
                c::mlx5_cqe64::TIMESTAMP_L.put_be(&mut cqe, 0, ts as u32);
                let _ = self.cqs().post_cqe(cqn, &cqe);
            }
            Err((syndrome, why)) => {
                self.events.push(SimEvent::EthRecvError { rqn: t.rqn, wqe_counter: index, syndrome, why });
                let cqe = CqeOut {
                    opcode: consts::MLX5_CQE_RESP_ERR,
                    qpn: t.rqn,
                    wqe_counter: index,
                    syndrome,
                    srqn: uidx,
                    ..CqeOut::default()
                };
                self.cqs().post(cqn, cqe);
            }
        }
    }

    /// Writes `frame` into the data segments of receive WQE `wqe` (up to the first with the invalid lkey), or
    /// the CQE syndrome: a frame longer than the WQE's buffers, or a key that does not allow the write.
    fn eth_scatter(&mut self, wqe: &[u8], pd: u32, frame: &[u8]) -> Result<(), (u8, &'static str)> {
        use c::mlx5_wqe_data_seg as d;
        let mut keys = Keys { mkeys: &self.fw.mkeys, dma: self.dma, inline: &mut self.dp.inline, qpn: None };
        let mut at = 0usize;
        for seg in wqe.chunks_exact(DATA_SEG) {
            if at == frame.len() {
                break;
            }
            let lkey = be(d::LKEY, seg, 0);
            if lkey == INVALID_LKEY {
                break;
            }
            let bc = be(d::BYTE_COUNT, seg, 0) as usize;
            let addr = be64(seg, d::ADDR.off);
            let n = bc.min(frame.len() - at);
            keys.key_write(lkey, pd, addr, &frame[at..at + n], MkeyAccess::LOCAL_WRITE)
                .map_err(|()| (consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR, "the data segment's key refuses the write"))?;
            at += n;
        }
        if at < frame.len() {
            return Err((consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR, "frame longer than the WQE's buffers"));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::eth::{Eth, TWq};
    use c::mlx5_wqe_ctrl_seg as cs;
    use c::mlx5_wqe_eth_seg as es;

    const MAC_A: [u8; 6] = [0x02, 0, 0, 0, 0, 0xa];
    const MAC_B: [u8; 6] = [0x02, 0, 0, 0, 0, 0xb];
    /// Where the inline headers start in a send WQE.
    const INLINE_AT: usize = CTRL + es::START.off;

    /// An IPv4/UDP frame from A to `dst` with `payload` bytes (checksums left zero for the device).
    fn udp_frame(dst: [u8; 6], payload: usize) -> Vec<u8> {
        let mut f = vec![0u8; 42 + payload];
        f[..6].copy_from_slice(&dst);
        f[6..12].copy_from_slice(&MAC_A);
        f[12..14].copy_from_slice(&ETH_P_IP.to_be_bytes());
        f[14] = 0x45;
        f[16..18].copy_from_slice(&((28 + payload) as u16).to_be_bytes());
        f[22] = 64;
        f[23] = IPPROTO_UDP;
        f[26..30].copy_from_slice(&[10, 0, 0, 1]);
        f[30..34].copy_from_slice(&[10, 0, 0, 2]);
        f[34..36].copy_from_slice(&5000u16.to_be_bytes());
        f[36..38].copy_from_slice(&5001u16.to_be_bytes());
        f[38..40].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
        for (k, b) in f[42..].iter_mut().enumerate() {
            *b = k as u8;
        }
        f
    }

    /// A send WQE as mlx5e builds it: `hdr` inline in the Ethernet segment, then one data segment; `ds` as
    /// given (0: the right count).
    fn send_wqe(opcode: u8, cs_flags: u8, mss: u16, hdr: &[u8], data: Option<(u32, u32, u64)>, ds: u32) -> Vec<u8> {
        let data_at = (INLINE_AT + hdr.len()).next_multiple_of(DS);
        let end = data_at + if data.is_some() { DATA_SEG } else { 0 };
        let mut w = vec![0u8; end.next_multiple_of(64)];
        cs::OPMOD_IDX_OPCODE.put_be(&mut w, 0, opcode.into());
        let ds = if ds == 0 { (end / DS) as u32 } else { ds };
        cs::QPN_DS.put_be(&mut w, 0, ds);
        w[cs::FM_CE_SE.off] = consts::MLX5_WQE_CTRL_CQ_UPDATE;
        w[CTRL + es::CS_FLAGS.off] = cs_flags;
        es::MSS.put_be(&mut w, CTRL, mss.into());
        es::SZ.put_be(&mut w, CTRL, hdr.len() as u32);
        w[INLINE_AT..INLINE_AT + hdr.len()].copy_from_slice(hdr);
        if let Some((bc, lkey, addr)) = data {
            c::mlx5_wqe_data_seg::BYTE_COUNT.put_be(&mut w, data_at, bc);
            c::mlx5_wqe_data_seg::LKEY.put_be(&mut w, data_at, lkey);
            w[data_at + 8..data_at + 16].copy_from_slice(&addr.to_be_bytes());
        }
        w
    }

    /// Two netdev devices on one wire: A with a ready SQ, B with a ready RQ that steering fills.
    fn pair() -> (Eth, TWq, Eth, TWq) {
        let mut a = Eth::with_mac(MAC_A);
        let mut b = Eth::with_mac(MAC_B);
        a.r.h.dev.connect(&b.r.h.dev);
        let sq = a.ready_sq();
        let rq = b.ready_rq_steered();
        (a, sq, b, rq)
    }

    fn sum_ok(f: &[u8]) -> bool {
        // The IPv4 header, and UDP over its pseudo-header, each sum to all ones.
        let mut pseudo = [0u8; 12];
        pseudo[..8].copy_from_slice(&f[26..34]);
        pseudo[9] = IPPROTO_UDP;
        pseudo[10..].copy_from_slice(&f[38..40]);
        send::csum_add(0, &f[14..34]) == 0xffff && send::csum_add(send::csum_add(0, &pseudo), &f[34..]) == 0xffff
    }

    #[test]
    fn an_sq_doorbell_sends_a_frame_that_steering_puts_in_the_peer_s_rq() {
        let (mut a, mut sq, mut b, mut rq) = pair();
        let frame = udp_frame(MAC_B, 300);
        let src = a.r.mr(4096);
        src.write(0, &frame[42..]);
        let dst = b.r.mr(4096);
        b.post_rx(&mut rq, 2048, dst.key, dst.addr());
        let flags = (consts::MLX5_ETH_WQE_L3_CSUM | consts::MLX5_ETH_WQE_L4_CSUM) as u8;
        let w = send_wqe(consts::MLX5_OPCODE_SEND, flags, 0, &frame[..42], Some((300, src.key, src.addr())), 0);
        let index = a.post_tx(&mut sq, &w);
        // A's send CQE names the SQ and the WQE.
        let e = a.r.poll(&mut a.cq).expect("send CQE");
        assert_eq!((e.status(), e.qpn(), e.wqe_counter()), ((consts::MLX5_CQE_REQ, 0), sq.n, index));
        // B received it whole, checksums filled in by A's offload.
        let e = b.r.poll(&mut b.cq).expect("receive CQE");
        assert_eq!((e.status(), e.byte_cnt(), e.wqe_counter()), ((consts::MLX5_CQE_RESP_SEND, 0), 342, 0));
        let got = dst.read(0, 342);
        assert_eq!((&got[..14], &got[42..]), (&frame[..14], &frame[42..]));
        assert!(sum_ok(&got), "checksums of the frame received");
        let (ca, cb) = (a.r.h.dev.with_fw(|fw| fw.port.eth), b.r.h.dev.with_fw(|fw| fw.port.eth));
        assert_eq!((ca.transmitted_eth_unicast.packets, ca.transmitted_eth_unicast.octets), (1, 342));
        assert_eq!((cb.received_eth_unicast.packets, cb.received_eth_unicast.octets), (1, 342));
        // What mlx5e reads: QUERY_VPORT_COUNTER and the PPCNT IEEE 802.3 group.
        let (s, _, out) = b.r.h.simple(
            consts::MLX5_CMD_OP_QUERY_VPORT_COUNTER,
            0,
            ifc::query_vport_counter_in::SIZE_BYTES,
            ifc::query_vport_counter_out::SIZE_BYTES,
        );
        let rx = ifc::query_vport_counter_out::RECEIVED_ETH_UNICAST;
        let got = (out.get64(ifc::traffic_counter::PACKETS.at(rx)), out.get64(ifc::traffic_counter::OCTETS.at(rx)));
        assert_eq!((s, got), (0, (1, 342)));
        let data = ifc::access_register_in::REGISTER_DATA.byte_off();
        let mut inp = vec![0u8; data + ifc::ppcnt_reg::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_ACCESS_REG.into());
        inp.set(ifc::mbox_in::OP_MOD, consts::MLX5_ACCESS_REGISTER_IN_OP_MOD_READ);
        inp.set(ifc::access_register_in::REGISTER_ID, consts::MLX5_REG_PPCNT.into());
        inp[data..].set(ifc::ppcnt_reg::LOCAL_PORT, 1);
        let out_data = ifc::access_register_out::REGISTER_DATA.byte_off();
        let (s, _, out) = a.r.h.cmd(&inp, out_data + ifc::ppcnt_reg::SIZE_BYTES);
        let set = ifc::ppcnt_reg::COUNTER_SET;
        let reg = &out[out_data..];
        use ifc::eth_802_3_cntrs_grp_data_layout as g;
        let word = |f: mlx5_core::prm::Field| MsgBuf::get(reg, f.at(set));
        let tx = (word(g::A_FRAMES_TRANSMITTED_OK_LOW), word(g::A_OCTETS_TRANSMITTED_OK_LOW));
        assert_eq!((s, tx), (0, (1, 342)));
        // No receive WQE left: the next frame is dropped and counted, A still completes its send.
        a.post_tx(&mut sq, &w);
        assert_eq!(a.r.poll(&mut a.cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert!(b.r.poll(&mut b.cq).is_none());
        assert_eq!(b.r.h.dev.with_fw(|fw| fw.port.eth.out_of_buffer), 1);
        // A frame for a MAC nobody has leaves no trace on B.
        let lost = udp_frame([0x02, 9, 9, 9, 9, 9], 0);
        a.post_tx(&mut sq, &send_wqe(consts::MLX5_OPCODE_SEND, 0, 0, &lost, None, 0));
        assert_eq!(a.r.poll(&mut a.cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert_eq!(b.r.h.dev.with_fw(|fw| fw.port.eth.received_eth_unicast.packets), 1);
    }

    #[test]
    fn rings_that_start_inside_their_first_page_send_and_receive_from_there() {
        // mlx5_ib's raw packet QP gives its RQ the QP's `page_offset` and its SQ the user buffer's: a quarter
        // page here, so every WQE sits 1 KiB further into the pages `pas[]` lists.
        let mut a = Eth::with_mac(MAC_A);
        let mut b = Eth::with_mac(MAC_B);
        a.r.h.dev.connect(&b.r.h.dev);
        (a.page_offset, b.page_offset) = (16, 16);
        let (mut sq, mut rq) = (a.ready_sq(), b.ready_rq_steered());
        assert_eq!((sq.off, rq.off), (1024, 1024));
        let frame = udp_frame(MAC_B, 100);
        let dst = b.r.mr(4096);
        for k in 0..2u16 {
            b.post_rx(&mut rq, 2048, dst.key, dst.addr() + 1024 * u64::from(k));
            let index = a.post_tx(&mut sq, &send_wqe(consts::MLX5_OPCODE_SEND, 0, 0, &frame, None, 0));
            let e = a.r.poll(&mut a.cq).expect("send CQE");
            assert_eq!((e.status(), e.wqe_counter()), ((consts::MLX5_CQE_REQ, 0), index));
            let e = b.r.poll(&mut b.cq).expect("receive CQE");
            assert_eq!((e.status(), e.byte_cnt(), e.wqe_counter()), ((consts::MLX5_CQE_RESP_SEND, 0), 142, k));
            assert_eq!(dst.read(1024 * usize::from(k), 142), frame);
        }
    }

    #[test]
    fn a_multicast_frame_loops_back_into_steering_for_other_transport_domains_only() {
        // rdma-core's test_flow: a raw packet QP of one context sends to a multicast MAC, a flow rule of another
        // context's raw packet QP takes it; each context has its own transport domain. No peer on the wire.
        let mut e = Eth::with_mac(MAC_A);
        // Each queue with the user index of its raw packet QP, by which libmlx5 finds the QP of a CQE.
        e.user_index = 0x12;
        let mut rq = e.ready_rq_steered();
        e.user_index = 0x34;
        let (s, _, out) = e.r.h.simple(
            consts::MLX5_CMD_OP_ALLOC_TRANSPORT_DOMAIN,
            0,
            ifc::alloc_transport_domain_in::SIZE_BYTES,
            ifc::alloc_transport_domain_out::SIZE_BYTES,
        );
        assert_eq!(s, 0);
        let (own_td, other_td) = (e.td, MsgBuf::get(&out[..], ifc::alloc_transport_domain_out::TRANSPORT_DOMAIN));
        e.td = other_td;
        let mut other = e.ready_sq();
        e.td = own_td;
        let mut same = e.ready_sq();
        let dst = e.r.mr(4096);
        let frame = udp_frame([0x01, 0x50, 0x56, 0x19, 0x20, 0xa7], 64);
        let wqe = send_wqe(consts::MLX5_OPCODE_SEND, 0, 0, &frame, None, 0);
        e.post_rx(&mut rq, 2048, dst.key, dst.addr());
        e.post_tx(&mut other, &wqe);
        let cqes = e.r.drain(&mut e.cq);
        let got: Vec<_> = cqes.iter().map(|c| (c.opcode(), c.qpn(), c.srqn_uidx())).collect();
        assert_eq!(got, [(consts::MLX5_CQE_RESP_SEND, 0, 0x12), (consts::MLX5_CQE_REQ, other.n, 0x34)]);
        assert_eq!(dst.read(0, frame.len()), frame);
        // From the RQ's own transport domain (mlx5e's own multicast) it does not come back.
        e.post_tx(&mut same, &wqe);
        let got: Vec<_> = e.r.drain(&mut e.cq).iter().map(|c| (c.opcode(), c.qpn())).collect();
        assert_eq!(got, [(consts::MLX5_CQE_REQ, same.n)]);
        let why = "local loopback into the sender's transport domain";
        assert!(e.r.h.dev.events().contains(&SimEvent::FrameDropped { why }));
    }

    #[test]
    fn lso_cuts_a_tcp_send_into_mss_segments_each_received_with_its_own_cqe() {
        let (mut a, mut sq, mut b, mut rq) = pair();
        let dst = b.r.mr(16 * 1024);
        for k in 0..4 {
            b.post_rx(&mut rq, 2048, dst.key, dst.addr() + k * 2048);
        }
        // An IPv4/TCP header (20 + 20 bytes) and 3000 bytes of payload at mss 1000.
        let mut hdr = udp_frame(MAC_B, 0)[..34].to_vec();
        hdr[23] = 6;
        hdr.extend_from_slice(&[0x13, 0x88, 0x13, 0x89, 0, 0, 0, 1, 0, 0, 0, 0, 0x50, 0x18, 0xff, 0xff, 0, 0, 0, 0]);
        let src = a.r.mr(4096);
        src.write(0, &[7u8; 3000]);
        let w = send_wqe(consts::MLX5_OPCODE_TSO, 0, 1000, &hdr, Some((3000, src.key, src.addr())), 0);
        a.post_tx(&mut sq, &w);
        assert_eq!(a.r.poll(&mut a.cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        let lens: Vec<u32> = b.r.drain(&mut b.cq).iter().map(|e| e.byte_cnt()).collect();
        assert_eq!(lens, [1054, 1054, 1054]);
        // The second segment's TCP sequence number moved on by one mss.
        assert_eq!(dst.read(2048 + 38, 4), 1001u32.to_be_bytes());
    }

    #[test]
    fn malformed_send_wqes_complete_with_an_error_cqe_and_the_sq_goes_to_err() {
        let hdr = udp_frame(MAC_B, 0);
        let tso = consts::MLX5_OPCODE_TSO;
        let cases: [(&str, Vec<u8>); 4] = [
            ("bad segment count", send_wqe(consts::MLX5_OPCODE_SEND, 0, 0, &[], None, 1)),
            ("LSO with no header", send_wqe(tso, 0, 1000, &[], Some((100, 1, 0)), 0)),
            ("mss 0", send_wqe(tso, 0, 0, &hdr, None, 0)),
            ("inline header longer than the WQE", send_wqe(tso, 0, 1000, &hdr, None, 3)),
        ];
        for (what, w) in cases {
            let (mut a, mut sq, _b, _rq) = pair();
            let index = a.post_tx(&mut sq, &w);
            let e = a.r.poll(&mut a.cq).unwrap_or_else(|| panic!("{what}: no CQE"));
            let want = (consts::MLX5_CQE_REQ_ERR, consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR);
            assert_eq!((e.status(), e.wqe_counter()), (want, index), "{what}");
            let state = a.r.h.dev.with_fw(|fw| fw.sqs.map[&sq.n].state);
            assert_eq!(state, consts::MLX5_SQC_STATE_ERR, "{what}");
            // An SQ in ERR takes no doorbell; mlx5e's recovery moves it through RST back to RDY.
            a.post_tx(&mut sq, &send_wqe(consts::MLX5_OPCODE_NOP, 0, 0, &[], None, 1));
            assert!(a.r.poll(&mut a.cq).is_none(), "{what}");
        }
    }

    #[test]
    fn vlan_tags_are_inserted_on_send_and_stripped_into_the_cqe_unless_the_rq_disables_it() {
        use c::mlx5_cqe64 as q;
        let (mut a, mut sq, mut b, mut rq) = pair();
        let frame = udp_frame(MAC_B, 100);
        let src = a.r.mr(4096);
        src.write(0, &frame);
        let dst = b.r.mr(8192);
        let flags = (consts::MLX5_ETH_WQE_L3_CSUM | consts::MLX5_ETH_WQE_L4_CSUM) as u8;
        // Priority 3, VLAN 0x023: the whole TCI comes back in the CQE.
        let tci = 3 << 13 | 0x023;
        // `insert.type` with INSERT_VLAN where `inline_hdr.sz` would be, no inline headers (mlx5e with inline
        // mode none), the frame from the data segment.
        let mut w = send_wqe(consts::MLX5_OPCODE_SEND, flags, 0, &[], Some((142, src.key, src.addr())), 0);
        es::TYPE.put_be(&mut w, CTRL, consts::MLX5_ETH_WQE_INSERT_VLAN);
        es::VLAN_TCI.put_be(&mut w, CTRL, tci);
        b.post_rx(&mut rq, 2048, dst.key, dst.addr());
        a.post_tx(&mut sq, &w);
        assert_eq!(a.r.poll(&mut a.cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        // B's RQ strips (vsd clear, as mlx5e opens it with rxvlan on): the frame as sent, the tag in the CQE.
        let e = b.r.poll(&mut b.cq).expect("receive CQE");
        assert_eq!((e.status(), e.byte_cnt()), ((consts::MLX5_CQE_RESP_SEND, 0), 142));
        assert_eq!((e.0[q::L4_L3_HDR_TYPE.off] & 1, q::VLAN_INFO.get_be(&e.0, 0)), (1, tci));
        let got = dst.read(0, 142);
        assert_eq!((&got[..14], &got[42..]), (&frame[..14], &frame[42..]));
        assert!(sum_ok(&got), "checksums filled in behind the inserted tag");
        // The tag in the inline headers (mlx5e's L2 inline mode puts it there), checksum offload behind it.
        let mut tagged = frame[..12].to_vec();
        tagged.extend_from_slice(&send::ETH_P_8021Q.to_be_bytes());
        tagged.extend_from_slice(&(tci as u16).to_be_bytes());
        tagged.extend_from_slice(&frame[12..]);
        let w = send_wqe(consts::MLX5_OPCODE_SEND, flags, 0, &tagged[..46], Some((100, src.key, src.addr() + 42)), 0);
        b.post_rx(&mut rq, 2048, dst.key, dst.addr() + 2048);
        a.post_tx(&mut sq, &w);
        assert_eq!(a.r.poll(&mut a.cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.r.poll(&mut b.cq).expect("receive CQE");
        assert_eq!((e.byte_cnt(), e.0[q::L4_L3_HDR_TYPE.off] & 1, q::VLAN_INFO.get_be(&e.0, 0)), (142, 1, tci));
        assert!(sum_ok(&dst.read(2048, 142)), "checksums of a tagged frame from inline headers");
        // rxvlan off: MODIFY_RQ sets vsd (the bitmask names it); the tag stays in the frame, none in the CQE.
        let mut m = vec![0u8; ifc::modify_rq_in::SIZE_BYTES];
        m.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_MODIFY_RQ.into());
        m.set(ifc::modify_rq_in::RQN, rq.n);
        m.set(ifc::modify_rq_in::RQ_STATE, consts::MLX5_RQC_STATE_RDY);
        m.set(ifc::rqc::STATE.at(ifc::modify_rq_in::CTX), consts::MLX5_RQC_STATE_RDY);
        m.set64(ifc::modify_rq_in::MODIFY_BITMASK, consts::MLX5_MODIFY_RQ_IN_MODIFY_BITMASK_VSD.into());
        m.set(ifc::rqc::VSD.at(ifc::modify_rq_in::CTX), 1);
        assert_eq!(b.r.h.cmd(&m, ifc::modify_rq_out::SIZE_BYTES).1, 0);
        b.post_rx(&mut rq, 2048, dst.key, dst.addr() + 4096);
        a.post_tx(&mut sq, &w);
        assert_eq!(a.r.poll(&mut a.cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        let e = b.r.poll(&mut b.cq).expect("receive CQE");
        assert_eq!((e.byte_cnt(), e.0[q::L4_L3_HDR_TYPE.off] & 1, q::VLAN_INFO.get_be(&e.0, 0)), (146, 0, 0));
        assert_eq!(dst.read(4096 + 12, 4), tagged[12..16]);
    }

    #[test]
    fn a_frame_no_entry_matches_is_dropped_and_counted() {
        let (mut a, mut sq, mut b, mut rq) = pair();
        // Replace B's catch-all root with a table that only takes IPv6.
        let (_, _, t) = b.table(0, 1, None);
        let (_, _, g) = b.group(t, 0, 0, |c| MsgBuf::set(c, ifc_l2::ETHERTYPE, 0xffff));
        let tirn = b.r.h.dev.with_fw(|fw| *fw.tirs.map.keys().next().unwrap());
        let to_tir = consts::MLX5_IFC_FLOW_DESTINATION_TYPE_TIR;
        assert_eq!(b.fte(t, g, 0, &[(to_tir, tirn)], |v| MsgBuf::set(v, ifc_l2::ETHERTYPE, 0x86dd)), (0, 0));
        assert_eq!(b.set_root(t), (0, 0));
        let dst = b.r.mr(4096);
        b.post_rx(&mut rq, 2048, dst.key, dst.addr());
        a.post_tx(&mut sq, &send_wqe(consts::MLX5_OPCODE_SEND, 0, 0, &udp_frame(MAC_B, 0), None, 0));
        assert_eq!(a.r.poll(&mut a.cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        assert!(b.r.poll(&mut b.cq).is_none());
        assert_eq!(b.r.h.dev.with_fw(|fw| fw.port.eth.rx_steer_missed), 1);
    }

    #[test]
    fn frames_cross_a_tcp_cable_between_two_processes_ports_broadcast_included() {
        let mut a = Eth::with_mac(MAC_A);
        let mut b = Eth::with_mac(MAC_B);
        let at = b.r.h.dev.wire_listen("127.0.0.1:0").unwrap();
        a.r.h.dev.wire_connect(&at.to_string(), std::time::Duration::from_secs(5)).unwrap();
        let mut sq = a.ready_sq();
        let mut rq = b.ready_rq_steered();
        let dst = b.r.mr(8192);
        // Room for the gratuitous ARP each end of a TCP stream announces its address with as it plugs in.
        for k in 0..4 {
            b.post_rx(&mut rq, 2048, dst.key, dst.addr() + k * 2048);
        }
        // A unicast frame to B's MAC and a broadcast (an ARP request's shape) both reach B's RQ.
        let uni = udp_frame(MAC_B, 100);
        let mut bcast = udp_frame([0xff; 6], 0);
        bcast[12..14].copy_from_slice(&0x0806u16.to_be_bytes());
        for f in [&uni, &bcast] {
            a.post_tx(&mut sq, &send_wqe(consts::MLX5_OPCODE_SEND, 0, 0, f, None, 0));
            assert_eq!(a.r.poll(&mut a.cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
        }
        // The link's reader thread delivers: wait for both CQEs.
        let start = std::time::Instant::now();
        let mut got = Vec::new();
        let mut at = 0usize;
        let (mut uni_seen, mut bcast_seen, mut announced) = (false, false, 0u64);
        while !(uni_seen && bcast_seen) && start.elapsed() < std::time::Duration::from_secs(10) {
            match b.r.poll(&mut b.cq) {
                Some(e) => {
                    let n = e.byte_cnt() as usize;
                    let f = dst.read(at * 2048, n);
                    at += 1;
                    if f == uni {
                        uni_seen = true;
                    } else if f == bcast {
                        bcast_seen = true;
                    } else {
                        // Anything else is ARP for the ports' one default address: A's announcement (broadcast),
                        // or A's unicast answer to B's own announcement (which may arrive without A's, when that
                        // came before B's RQ had room), so only broadcast ones are counted as such.
                        assert_eq!((n, &f[12..14], f[28..32] == f[38..42]), (42, &[0x08, 0x06][..], true), "{f:02x?}");
                        announced += u64::from(f[..6] == [0xff; 6]);
                    }
                    got.push(n);
                }
                None => std::thread::sleep(std::time::Duration::from_millis(1)),
            }
        }
        assert!(uni_seen && bcast_seen, "frames received: {got:?}");
        let c = b.r.h.dev.with_fw(|fw| fw.port.eth);
        // Unicast: the frame above, and possibly A's answer to B's own announcement (both ports have the default
        // IPv4 address, so B's gratuitous ARP asks for A's address too).
        assert!((1..=2).contains(&c.received_eth_unicast.packets), "{c:?}");
        assert_eq!(c.received_eth_broadcast.packets, 1 + announced);
    }

    use mlx5_core::prm::ifc;
    use mlx5_core::prm::ifc::fte_match_set_lyr_2_4 as ifc_l2;
    use mlx5_core::prm::MsgBuf;
}

#[cfg(test)]
mod wc_tests {
    use super::*;
    use crate::testkit::eth::Eth;
    use mlx5_core::hal::Mmio;
    use mlx5_core::prm::{ifc, MsgBuf};

    /// mlx5_core's write-combining test (`wc.c`): an SQ without a TIS, 255 NOPs each rung through BlueFlame (the
    /// copy with CQ_UPDATE, memory without it but for the last), the CQ polled, the SQ destroyed.
    #[test]
    fn the_write_combining_test_completes_its_last_nop_and_destroys_its_sq() {
        let mut e = Eth::new();
        let (s, y, sqn) = e.sq_with(0, |i| MsgBuf::set(&mut i[..], ifc::sqc::TIS_LST_SZ.at(ifc::create_sq_in::CTX), 0));
        assert_eq!((s, y), (0, 0));
        let dbr = e.mem.pop().unwrap();
        let ring = e.mem.pop().unwrap();
        assert_eq!(e.modify_wq(true, sqn, consts::MLX5_SQC_STATE_RST, consts::MLX5_SQC_STATE_RDY), (0, 0));
        let base = crate::mmio::SimMmio::uar_offset(e.r.uar) + consts::MLX5_BF_OFFSET as usize;
        let mut off = 0;
        for pc in 0..255u16 {
            let mut w = [0u8; 64];
            c::mlx5_wqe_ctrl_seg::OPMOD_IDX_OPCODE.put_be(
                &mut w,
                0,
                u32::from(pc) << 8 | u32::from(consts::MLX5_OPCODE_NOP),
            );
            c::mlx5_wqe_ctrl_seg::QPN_DS.put_be(&mut w, 0, sqn << 8 | 1);
            if pc == 254 {
                w[c::mlx5_wqe_ctrl_seg::FM_CE_SE.off] = consts::MLX5_WQE_CTRL_CQ_UPDATE;
            }
            // 64 entries in the fixture's ring.
            crate::testkit::submit::put(&ring, usize::from(pc % 64) * 64, &w);
            crate::testkit::submit::put(&dbr, 4, &u32::from(pc + 1).to_be_bytes());
            let mut copy = w;
            copy[c::mlx5_wqe_ctrl_seg::FM_CE_SE.off] |= consts::MLX5_WQE_CTRL_CQ_UPDATE;
            for k in 0..8 {
                let v = u64::from_be_bytes(copy[8 * k..8 * k + 8].try_into().unwrap());
                e.r.h.mmio.write64(base + off + 8 * k, v);
            }
            off ^= 256;
        }
        let cqe = e.r.poll(&mut e.cq);
        assert_eq!(cqe.map(|c| c.wqe_counter()), Some(254));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_SQ, ifc::destroy_sq_in::SQN, sqn), (0, 0));
    }
}
