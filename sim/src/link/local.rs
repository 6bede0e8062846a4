//! Packets between devices of this process: joining two devices ([`connect`]), and the pump that runs a device's
//! datapath and carries what it sends to the destination devices, one device lock at a time ([`pump`],
//! [`carry`]); a packet for a device in another process is handed to its link. Between Ethernet ports a packet
//! reaches the other device as RoCEv2 frames (`State::receive_over_wire`).

use std::collections::VecDeque;
use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use super::{Packet, Port};
use crate::wire::Resp;
use crate::{lock, Shared};

/// The most packets one pump carries: a bound against a simulator bug ping-ponging forever.
const PUMP_BUDGET: usize = 1 << 20;

/// Joins two devices with a wire, both directions.
pub(crate) fn connect(a: &Arc<Shared>, b: &Arc<Shared>) {
    let (a_ref, a_addr) = {
        let st = lock(a);
        (st.wire.me.clone(), st.wire.addr)
    };
    let (b_ref, b_addr) = {
        let st = lock(b);
        (st.wire.me.clone(), st.wire.addr)
    };
    lock(a).wire.add_peer(b_ref, b_addr);
    lock(b).wire.add_peer(a_ref, a_addr);
}

/// Runs the datapath of `shared` and carries every packet it (and the devices it reaches) produce, holding one
/// device lock at a time.
pub(crate) fn pump(shared: &Arc<Shared>) {
    // The driver's stores (WQEs, doorbell records) before our reads, as the doorbell write orders them.
    fence(Ordering::SeqCst);
    let out = lock(shared).run_datapath();
    carry(out.into());
}

/// Carries packets to their devices until nothing is left: a device in this process gets the packet and runs
/// its datapath (what it sends joins the queue); a link takes a packet for another process.
pub(crate) fn carry(mut queue: VecDeque<Packet>) {
    for _ in 0..PUMP_BUDGET {
        let Some(p) = queue.pop_front() else { return };
        let gone = match &p.dst.port {
            Port::Local(weak) => match weak.upgrade() {
                Some(dev) => {
                    let out = {
                        let mut st = lock(&dev);
                        st.receive_over_wire(p);
                        st.run_datapath()
                    };
                    queue.extend(out);
                    continue;
                }
                None => "destination device gone",
            },
            Port::Remote(link) => match link.transmit(&p) {
                Ok(()) => continue,
                Err(why) => why,
            },
            Port::Guest(link) => match link.transmit(&p) {
                Ok(()) => continue,
                Err(why) => why,
            },
        };
        // The destination is unreachable: for an RC request the requester's timer starts.
        queue.extend(p.reply(Resp::Lost(gone)));
    }
}
