//! What a RoCE port keeps between frames: messages in reassembly ([`Partial`]) and the ARP neighbours it
//! learned ([`RoceRx`]); `roce_rx.rs` is the receive side that fills them.

use std::collections::BTreeMap;

use crate::wire::roce::rc::psn_diff;

/// A message whose packets are arriving.
#[derive(Debug)]
pub(crate) struct Partial {
    pub(super) first_psn: u32,
    pub(super) next_psn: u32,
    pub(super) kind: PartialKind,
    pub(super) data: Vec<u8>,
    /// A sequence NAK went out for the gap at `next_psn` (one per gap, as a responder sends).
    pub(super) nak_sent: bool,
    /// The most bytes the message may bring: the scatter list of the receive it will take (SEND), the RETH's
    /// length (WRITE). What was posted or registered bounds the reassembly, never the peer.
    pub(super) limit: u64,
    /// What happens to the rest of the message's packets.
    pub(super) rest: Rest,
}

/// How a message in reassembly takes its next packets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Rest {
    /// Kept, up to `limit`.
    Keep,
    /// Dropped: the message was refused at its first packet or when it outgrew its receive (NAKed on RC,
    /// silently on UC), as a ConnectX drops the rest of a message it NAKed until a new FIRST or ONLY.
    Drop,
    /// A duplicate of a message already executed: nothing is kept, its LAST is acknowledged again.
    Duplicate,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PartialKind {
    Send { uc: bool },
    Write { uc: bool, raddr: u64, rkey: u32 },
    ReadResponse,
}

/// Where the port keeps messages in reassembly and what it learned from ARP.
#[derive(Debug, Default)]
pub(crate) struct RoceRx {
    /// Requests being reassembled, by responder QP.
    pub(super) requests: BTreeMap<u32, Partial>,
    /// READ responses being reassembled, by requester QP.
    pub(super) reads: BTreeMap<u32, Partial>,
    /// IPv4 neighbours (ARP): address and MAC.
    pub(crate) neighbours: Vec<([u8; 4], [u8; 6])>,
    /// Reassembly buffers of finished messages, for the next ones.
    pub(super) spare: Vec<Vec<u8>>,
}

/// Why a RoCE packet delivered to this port's MAC is dropped when it names another port's GID.
pub(super) const NOT_OUR_GID: &str = "destination GID is not in the port's GID table";

/// The most neighbours remembered (the oldest is forgotten first).
pub(super) const MAX_NEIGHBOURS: usize = 64;
/// Reassembly buffers kept for the next messages, and the largest kept (a bigger one is freed).
pub(super) const SPARE_BUFFERS: usize = 4;
pub(super) const SPARE_BYTES: usize = 1 << 20;

impl RoceRx {
    /// A reassembly buffer holding `first`, with room for `whole` bytes when that is known (and not huge): a
    /// spare one when there is one, so a stream of messages does not allocate and grow a buffer each.
    pub(super) fn buffer(&mut self, first: &[u8], whole: u64) -> Vec<u8> {
        let mut b = self.spare.pop().unwrap_or_default();
        b.reserve(usize::try_from(whole).unwrap_or(0).min(SPARE_BYTES));
        b.extend_from_slice(first);
        b
    }

    /// Bytes the messages in reassembly hold, and the capacity of their buffers.
    #[cfg(test)]
    pub(crate) fn held(&self) -> (usize, usize) {
        self.requests
            .values()
            .chain(self.reads.values())
            .fold((0, 0), |(n, c), p| (n + p.data.len(), c + p.data.capacity()))
    }

    /// Takes back a buffer whose message is done.
    pub(super) fn recycle(&mut self, mut b: Vec<u8>) {
        if self.spare.len() < SPARE_BUFFERS && b.capacity() <= SPARE_BYTES {
            b.clear();
            self.spare.push(b);
        }
    }

    /// Response packets of the outstanding READ of `qpn` (first PSN `first`) taken so far.
    pub(super) fn read_taken(&self, qpn: u32, first: u32) -> u32 {
        self.reads.get(&qpn).filter(|p| p.first_psn == first).map_or(0, |p| psn_diff(p.next_psn, first) as u32)
    }

    pub(super) fn learn(&mut self, ip: [u8; 4], mac: [u8; 6]) {
        remember(&mut self.neighbours, ip, mac);
        // The process's table too, as a host's neighbour table serves its every port.
        if let Ok(mut t) = PROCESS_NEIGHBOURS.lock() {
            remember(&mut t, ip, mac);
        }
    }
}

/// IPv4 neighbours any simulated port of this process learned from ARP: what a host's neighbour table holds,
/// for a driver resolving a RoCE destination MAC as the kernel's `ib_resolve_eth_dmac` does.
static PROCESS_NEIGHBOURS: std::sync::Mutex<Vec<([u8; 4], [u8; 6])>> = std::sync::Mutex::new(Vec::new());

pub(super) fn remember(table: &mut Vec<([u8; 4], [u8; 6])>, ip: [u8; 4], mac: [u8; 6]) {
    table.retain(|(a, _)| *a != ip);
    if table.len() == MAX_NEIGHBOURS {
        table.remove(0);
    }
    table.push((ip, mac));
}

/// The MAC a simulated port of this process learned from ARP for `ip`, if any.
pub fn arp_neighbour(ip: [u8; 4]) -> Option<[u8; 6]> {
    PROCESS_NEIGHBOURS.lock().ok()?.iter().find(|(a, _)| *a == ip).map(|(_, m)| *m)
}
