//! The run loop's datapath half: joining two devices of this process ([`connect`]), and the pump that runs a
//! device's datapath and carries what it sends to the destination devices, one device lock at a time, in order
//! per source ([`pump`]); a packet for a device in another process is handed to its link, which only carries it.
//! Between Ethernet ports a packet reaches the other device as RoCEv2 frames (`Device::receive_over_wire`).

use std::collections::VecDeque;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use super::state::{lock, Shared};
use crate::link::{Packet, Port};
use crate::wire::Resp;

/// The most device runs one pump makes: a bound against a simulator bug ping-ponging forever.
const PUMP_BUDGET: usize = 1 << 20;

/// Joins two devices with a wire, both directions.
pub(crate) fn connect(a: &Arc<Shared>, b: &Arc<Shared>) {
    let (a_ref, a_addr, a_lid) = {
        let st = lock(a);
        (st.wire.me.clone(), st.wire.addr, st.wire.lid_cell())
    };
    let (b_ref, b_addr, b_lid) = {
        let st = lock(b);
        (st.wire.me.clone(), st.wire.addr, st.wire.lid_cell())
    };
    lock(a).wire.add_local_peer(b_ref, b_addr, b_lid);
    lock(b).wire.add_local_peer(a_ref, a_addr, a_lid);
}

/// Runs the datapath of `shared` and carries every packet it (and the devices it reaches) produce, holding one
/// device lock at a time.
///
/// Delivery keeps order per source: a device's datapath runs, and what it produced is handed on, under its send
/// lock (`Shared::send`), so when two threads pump one device (its own thread, a peer's delivering to it, a link's
/// reader) the packets the first run produced reach every destination before those of the second, as a real
/// link keeps the order of one path. Deadlock-free: a thread holds at most one send lock, takes device locks
/// only under it and one at a time, and device locks are never held while waiting for anything.
pub(crate) fn pump(shared: &Arc<Shared>) {
    // The driver's stores (WQEs, doorbell records) before our reads, as the doorbell write orders them.
    fence(Ordering::SeqCst);
    // The devices to run next; empty (no allocation) until a packet reaches another device.
    let mut queue = VecDeque::new();
    let mut dev = shared.clone();
    for _ in 0..PUMP_BUDGET {
        {
            let _send = dev.send.lock().unwrap_or_else(|e| e.into_inner());
            let out = lock(&dev).datapath().run_datapath();
            for p in out {
                deliver(p, &mut queue);
            }
        }
        let Some(next) = queue.pop_front() else { return };
        dev = next;
    }
}

/// Hands a packet to its device (which then runs: it joins `queue`) or its link. An unreachable destination
/// answers an RC request as lost, so the requester's timer starts.
fn deliver(p: Packet, queue: &mut VecDeque<Arc<Shared>>) {
    let mut next = Some(p);
    // Bounded: a "lost" answer to a request whose own source is gone has nowhere to go and answers nothing.
    for _ in 0..2 {
        let Some(p) = next.take() else { return };
        let gone = match &p.dst.port {
            // A local port is always a device's `Shared` (the device layer makes every `Port::Local`).
            Port::Local(weak) => match weak.upgrade().and_then(|d| d.downcast::<Shared>().ok()) {
                Some(dev) => {
                    lock(&dev).datapath().receive_over_wire(p);
                    if !queue.iter().any(|d| Arc::ptr_eq(d, &dev)) {
                        queue.push_back(dev);
                    }
                    return;
                }
                None => "destination device gone",
            },
            Port::Vde(link, _) => match link.transmit(&p) {
                Ok(()) => return,
                Err(why) => why,
            },
        };
        next = p.reply(Resp::Lost(gone));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::config::SimConfig;
    use crate::mmio::SimMmio;
    use crate::testkit::submit::{Bell, QpSpec, Rdma, TAv, Wqe};
    use mlx5_core::hal::Mmio;
    use mlx5_core::prm::consts;
    use std::time::Duration;

    fn roce(mac_last: u8) -> SimConfig {
        let mut mac = SimConfig::default().mac;
        mac[5] = mac_last;
        SimConfig { mac, node_guid: 0x1000 + u64::from(mac_last), mode: Mode::Inline, ..SimConfig::default() }
    }

    /// The interleaving that swapped two datagrams of one UD QP: one thread has taken the first datagram out of
    /// the sender's datapath and not yet handed it on, while a doorbell on another thread runs the datapath
    /// again. The second datagram must not overtake the first: the second thread waits for the first's send.
    #[test]
    fn a_later_datagram_does_not_overtake_one_being_handed_on() {
        const SEND_IMM: u8 = consts::MLX5_OPCODE_SEND_IMM;
        let mut a = Rdma::new(roce(0x31));
        let mut b = Rdma::new(roce(0x32));
        a.h.dev.connect(&b.h.dev);
        let (mut a_cq, mut b_cq) = (a.cq(4), b.cq(4));
        let mut qa = a.qp(QpSpec::ud(), a_cq.cqn, a_cq.cqn);
        let mut qb = b.qp(QpSpec::ud(), b_cq.cqn, b_cq.cqn);
        a.ready_ud(&qa, 0x77);
        b.ready_ud(&qb, 0x77);
        let (ma, mb) = (a.mr(4096), b.mr(4096));
        for i in 0..2 {
            b.post_recv(&mut qb, &[(mb.addr() + i * 256, 256, mb.key)]);
        }
        let r = b.me(qb.qpn);
        let av = TAv { dqpn: qb.qpn, qkey: 0x77, grh: true, hop_limit: 1, rgid: r.gid, rmac: r.mac, ..TAv::default() };
        let wqe = |n: u32| Wqe::new(SEND_IMM).imm(n).av(&av).data(8, ma.key, ma.addr());
        let doorbell = |qp: &mut crate::testkit::submit::TQp, index: u16| {
            let v = u64::from_be_bytes(qp.sq_read(usize::from(index) * 64, 8).try_into().unwrap());
            let off = SimMmio::uar_offset(qp.uar) + qp.bf_off;
            qp.bf_off ^= 1 << 8;
            (off, v)
        };
        let sender = a.h.dev.shared.clone();

        // This thread takes datagram 0 out of A's datapath, as a pump does, and holds it.
        let first = a.post_send(&mut qa, &wqe(0), Bell::None);
        let send = sender.send.lock().unwrap();
        let (off, v) = doorbell(&mut qa, first);
        lock(&sender).uar_write64(off, v);
        let held = lock(&sender).datapath().run_datapath();
        assert_eq!(held.len(), 1);

        // Datagram 1's doorbell, on another thread, runs A's datapath too.
        let second = a.post_send(&mut qa, &wqe(1), Bell::None);
        let (off, v) = doorbell(&mut qa, second);
        let mmio = a.h.dev.mmio();
        let other = std::thread::spawn(move || mmio.write64(off, v));
        std::thread::sleep(Duration::from_millis(50));

        // Datagram 0 is handed on, then the other thread may send.
        let mut queue = VecDeque::new();
        for p in held {
            deliver(p, &mut queue);
        }
        drop(send);
        for dev in queue {
            pump(&dev);
        }
        other.join().unwrap();
        let got: Vec<u32> = b.drain(&mut b_cq).iter().map(|e| e.imm()).collect();
        assert_eq!(got, [0, 1], "datagrams in the order they were sent");
        assert_eq!(a.drain(&mut a_cq).len(), 2);
    }
}
