//! InfiniBand ports on a VDE fabric (`vde.rs`). An IB port's packet crosses in Ethernet frames of ethertype
//! [`ETHERTYPE_IB`] (0x88B5, the first of IEEE 802's two local experimental ethertypes), so no Ethernet port
//! takes them for RoCE or ARP and an IB port takes nothing else. A frame holds:
//!
//! - the Ethernet header: to [`lid_mac`] of the destination LID (a switch learns where each LID's MAC is, so it
//!   forwards without flooding), from the port's own LID's MAC;
//! - the LRH (IBA 7.7, 8 bytes): VL 0, LVer 0, the SL, LNH 0 ("raw": what follows is not an IBA transport header),
//!   the DLID, the packet length in 4-byte words, the SLID;
//! - the simulator's header ([`HEADER`], 32 bytes): the frame kind (data, LID probe, LID in use), the port GUID,
//!   the port's instance number (random per plug-in, so two ports with one GUID still differ), and for data the
//!   message number, the fragment's offset and the message's length;
//! - a fragment of the packet in the simulator's own encoding (`wire/frame.rs`), as the TCP link carries IB
//!   packets: an IB packet here is a whole message, cut into fragments of at most [`IB_FRAGMENT`] bytes so each
//!   frame fits the switch's [`MAX_ETH_FRAME`], and put back together by the receiving
//!   link (bounded: [`MAX_PARTIAL`] messages in progress, [`MAX_IB_MESSAGE`] bytes each). A message missing a
//!   fragment is lost as a whole, and the requester's timer sends it again.
//!
//! LIDs: a port's LID is its configuration's (`mlx5-verbs`' `vde_identity` derives it from the process's identity,
//! as it derives MACs and GUIDs). Before a port joins, it broadcasts a probe for its LID [`PROBES`] times; a port
//! that holds the LID answers "in use", and the newcomer's plug-in fails with `VdeError::LidInUse` (two newcomers
//! probing one LID at once both fail). Every port remembers which port (by its instance number) holds each LID it
//! hears from: the last to probe for it or answer for it, else the first to send. A data frame from another port
//! with the receiver's own LID, or with a LID another port holds, is dropped and counted (`lid_conflicts`), so
//! a collision that got past the probes is never a silent misdelivery.

use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::datagrams::{Datagrams, ETH_HEADER, MAX_ETH_FRAME};
use crate::wire::frame::{decode_packet, encode_packet, FRAME_PACKET};
use crate::wire::roce::ether::BROADCAST;
use crate::wire::{is_unicast_lid, Packet, PERMISSIVE_LID};

/// The ethertype of an InfiniBand port's frames (IEEE 802 local experimental ethertype 1).
pub const ETHERTYPE_IB: u16 = 0x88b5;

/// The MAC of the IB port with LID `lid` on a VDE fabric: `02:49:42:00:` and the LID (locally administered;
/// 0x49 0x42 is "IB"). Ethernet ports' MACs from `vde_identity` are `02:4d:...`, so the two never meet.
pub fn lid_mac(lid: u16) -> [u8; 6] {
    let [hi, lo] = lid.to_be_bytes();
    [0x02, 0x49, 0x42, 0x00, hi, lo]
}

/// Bytes of the LRH.
const LRH: usize = 8;
/// Bytes of the simulator's header after the LRH.
pub const HEADER: usize = 32;
/// Where the fragment starts in a frame.
const PAYLOAD: usize = ETH_HEADER + LRH + HEADER;
/// The most bytes of a packet one frame carries: the rest of a `vde_switch`'s largest frame (a multiple of 4).
pub const IB_FRAGMENT: usize = MAX_ETH_FRAME - PAYLOAD;
/// The longest packet encoding a port takes: bounds what a hostile peer can make a port put together.
pub const MAX_IB_MESSAGE: usize = 64 << 20;
/// Messages put back together at once, at most (the oldest is given up for a new one).
pub const MAX_PARTIAL: usize = 16;
/// Bytes of the messages in progress at most (the oldest are given up beyond it).
const MAX_PARTIAL_BYTES: usize = 128 << 20;
/// Messages remembered as complete, so a duplicated fragment of one (a `wirefilter -D`) starts nothing.
const DONE_MEMORY: usize = 64;

/// Probes a port sends for its LID before it joins, and the time it waits after each for an answer.
pub const PROBES: u32 = 3;
const PROBE_WAIT: Duration = Duration::from_millis(40);

/// What a frame is (the first byte of the header).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// A fragment of a packet.
    Data = 1,
    /// "Who has this LID?", broadcast by a port about to join.
    Probe = 2,
    /// "I have this LID", broadcast by its holder in answer to a probe.
    InUse = 3,
}

/// A checked IB frame.
#[derive(Debug)]
pub(crate) struct IbFrame<'a> {
    pub(crate) kind: Kind,
    pub(crate) dlid: u16,
    pub(crate) slid: u16,
    pub(crate) guid: u64,
    pub(crate) instance: u64,
    pub(crate) msg: u32,
    pub(crate) offset: usize,
    pub(crate) total: usize,
    pub(crate) fragment: &'a [u8],
}

/// What a frame says about who holds a LID.
pub(crate) struct Ident {
    pub(crate) lid: u16,
    pub(crate) guid: u64,
    pub(crate) instance: u64,
}

/// Builds one frame. `fragment` is at most [`IB_FRAGMENT`] bytes; the frame is padded to a whole number of
/// 4-byte words, as PktLen counts them.
#[allow(clippy::too_many_arguments)]
pub(crate) fn emit(
    dst: [u8; 6],
    src: [u8; 6],
    kind: Kind,
    sl: u8,
    dlid: u16,
    me: &Ident,
    msg: u32,
    offset: usize,
    total: usize,
    fragment: &[u8],
) -> Vec<u8> {
    let words = (LRH + HEADER + fragment.len()).div_ceil(4);
    let mut f = Vec::with_capacity(ETH_HEADER + words * 4);
    f.extend_from_slice(&dst);
    f.extend_from_slice(&src);
    f.extend_from_slice(&ETHERTYPE_IB.to_be_bytes());
    // LRH: VL 0 | LVer 0; SL | LNH 0 (raw); DLID; PktLen (11 bits); SLID.
    f.push(0);
    f.push((sl & 0xf) << 4);
    f.extend_from_slice(&dlid.to_be_bytes());
    f.extend_from_slice(&(words as u16 & 0x7ff).to_be_bytes());
    f.extend_from_slice(&me.lid.to_be_bytes());
    f.extend_from_slice(&[kind as u8, 0, 0, 0]);
    f.extend_from_slice(&me.guid.to_be_bytes());
    f.extend_from_slice(&me.instance.to_be_bytes());
    f.extend_from_slice(&msg.to_be_bytes());
    f.extend_from_slice(&(offset as u32).to_be_bytes());
    f.extend_from_slice(&(total as u32).to_be_bytes());
    f.extend_from_slice(fragment);
    f.resize(ETH_HEADER + words * 4, 0);
    f
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Checks an IB frame (its ethertype already is [`ETHERTYPE_IB`]). Trailing bytes past PktLen (Ethernet padding)
/// are allowed; anything that does not add up is an error.
pub(crate) fn parse(f: &[u8]) -> Result<IbFrame<'_>, &'static str> {
    parse_lids(f, true)
}

/// [`parse`], the LIDs checked to be unicast when `unicast` (on a switch, where a LID names a port; on a
/// point-to-point stream a subnet manager's SMPs go to the permissive LID, and from LID 0 before it assigns one).
pub(crate) fn parse_lids(f: &[u8], unicast: bool) -> Result<IbFrame<'_>, &'static str> {
    if f.len() < PAYLOAD {
        return Err("IB frame shorter than its headers");
    }
    let l = ETH_HEADER;
    if f[l] & 0xf != 0 {
        return Err("IB frame with an LRH version other than 0");
    }
    if f[l + 1] & 0x3 != 0 {
        return Err("IB frame whose LRH does not say raw (LNH 0)");
    }
    let (dlid, words, slid) = (be16(f, l + 2), usize::from(be16(f, l + 4) & 0x7ff), be16(f, l + 6));
    let h = l + LRH;
    let kind = match f[h] {
        1 => Kind::Data,
        2 => Kind::Probe,
        3 => Kind::InUse,
        _ => return Err("IB frame of an unknown kind"),
    };
    let (guid, instance) = (be64(f, h + 4), be64(f, h + 12));
    let (msg, offset, total) = (be32(f, h + 20), be32(f, h + 24) as usize, be32(f, h + 28) as usize);
    // A directed-route SMP goes to the permissive LID, and a port without a LID yet sends from it.
    let lid_ok = |l: u16| is_unicast_lid(l) || (l == PERMISSIVE_LID && kind == Kind::Data);
    if unicast && (!lid_ok(dlid) || !lid_ok(slid)) {
        return Err("IB frame without unicast LIDs");
    }
    // The fragment's length follows from where it is in its message: the last one takes the rest.
    let len = match kind {
        Kind::Data => {
            if total == 0 || total > MAX_IB_MESSAGE || offset >= total || offset % IB_FRAGMENT != 0 {
                return Err("IB fragment outside its message");
            }
            (total - offset).min(IB_FRAGMENT)
        }
        Kind::Probe | Kind::InUse => {
            if (msg, offset, total) != (0, 0, 0) {
                return Err("IB probe with a message");
            }
            0
        }
    };
    if words * 4 != (LRH + HEADER + len).div_ceil(4) * 4 || f.len() < l + words * 4 {
        return Err("IB frame whose PktLen is not its length");
    }
    Ok(IbFrame { kind, dlid, slid, guid, instance, msg, offset, total, fragment: &f[PAYLOAD..PAYLOAD + len] })
}

/// A message being put back together.
#[derive(Debug)]
struct Partial {
    instance: u64,
    msg: u32,
    buf: Vec<u8>,
    have: Vec<bool>,
    missing: usize,
}

/// The messages in progress at one port, oldest first, and those just completed.
#[derive(Debug, Default)]
pub(crate) struct Reasm {
    partial: Vec<Partial>,
    bytes: usize,
    done: std::collections::VecDeque<(u64, u32)>,
}

impl Reasm {
    /// Takes a checked data fragment: the whole packet encoding once its last fragment is in. `given_up` counts the
    /// messages dropped unfinished to make room.
    pub(crate) fn add(&mut self, f: &IbFrame<'_>, given_up: &mut u64) -> Option<Vec<u8>> {
        if self.done.contains(&(f.instance, f.msg)) {
            return None;
        }
        let at = match self.partial.iter().position(|p| p.instance == f.instance && p.msg == f.msg) {
            Some(i) => i,
            None => {
                while !self.partial.is_empty()
                    && (self.partial.len() >= MAX_PARTIAL || self.bytes + f.total > MAX_PARTIAL_BYTES)
                {
                    let old = self.partial.remove(0);
                    self.bytes -= old.buf.len();
                    *given_up += 1;
                }
                let n = f.total.div_ceil(IB_FRAGMENT);
                // Zeroed pages are not touched until a fragment lands there.
                self.partial.push(Partial {
                    instance: f.instance,
                    msg: f.msg,
                    buf: vec![0; f.total],
                    have: vec![false; n],
                    missing: n,
                });
                self.bytes += f.total;
                self.partial.len() - 1
            }
        };
        let p = &mut self.partial[at];
        // Another message under the same number (a port that restarted its count): not ours to mix.
        if p.buf.len() != f.total {
            return None;
        }
        let i = f.offset / IB_FRAGMENT;
        if !p.have[i] {
            p.have[i] = true;
            p.missing -= 1;
            p.buf[f.offset..f.offset + f.fragment.len()].copy_from_slice(f.fragment);
        }
        if p.missing > 0 {
            return None;
        }
        let p = self.partial.remove(at);
        self.bytes -= p.buf.len();
        self.remember(p.instance, p.msg);
        Some(p.buf)
    }

    /// Notes a message as complete (one of a single fragment never enters the table).
    pub(crate) fn remember(&mut self, instance: u64, msg: u32) {
        if self.done.len() >= DONE_MEMORY {
            self.done.pop_front();
        }
        self.done.push_back((instance, msg));
    }
}

/// An IB port's side of its VDE link.
#[derive(Debug)]
pub(crate) struct IbSide {
    /// The port's LID: its configuration's, or 0 until a subnet manager assigns one ([`IbSide::set_lid`]).
    lid: AtomicU16,
    pub(crate) guid: u64,
    /// Random per plug-in: tells two ports apart even when they share a GUID.
    pub(crate) instance: u64,
    next_msg: AtomicU32,
    pub(crate) reasm: Mutex<Reasm>,
    /// Which port (instance) holds each LID heard from, newest last, at most [`MAX_HOLDERS`].
    holders: Mutex<Vec<(u16, u64)>>,
}

/// LIDs whose holders a port remembers at most (the oldest is forgotten first).
const MAX_HOLDERS: usize = 1024;

impl IbSide {
    pub(crate) fn new(lid: u16, guid: u64) -> IbSide {
        IbSide {
            lid: AtomicU16::new(lid),
            guid,
            instance: instance(),
            next_msg: AtomicU32::new(0),
            reasm: Mutex::default(),
            holders: Mutex::default(),
        }
    }

    /// The port's LID (0: none assigned yet).
    pub(crate) fn lid(&self) -> u16 {
        self.lid.load(Ordering::Relaxed)
    }

    /// A subnet manager gave the port `lid`: its frames come from it and frames to it are taken from now on.
    pub(crate) fn set_lid(&self, lid: u16) {
        self.lid.store(lid, Ordering::Relaxed);
    }

    /// Whether a frame to the MAC `mac` is for this port: its LID's, or the permissive LID's (directed route).
    pub(crate) fn owns_mac(&self, mac: &[u8]) -> bool {
        mac == lid_mac(PERMISSIVE_LID) || mac == lid_mac(self.lid())
    }

    pub(crate) fn ident(&self) -> Ident {
        Ident { lid: self.lid(), guid: self.guid, instance: self.instance }
    }

    /// The frames of `p` to the port with LID `dlid`. On a point-to-point stream (`cable`) any DLID goes to the
    /// one port at the other end (the permissive LID of a subnet manager's directed-route SMP, the LID 0 of a
    /// port no SM has swept yet), from the port's LID as it is. On a switch a unicast LID names a port and the
    /// permissive LID the link partner; a port without a LID sends only to the permissive LID, from it, and its
    /// source MAC is then [`lid_mac`] of LID 0, never the permissive LID's, so a `vde_switch` between it and its
    /// partner does not learn the permissive MAC on its side and drop the partner's answers.
    pub(crate) fn frames<D>(&self, p: &Packet<D>, dlid: u16, cable: bool) -> Result<Vec<Vec<u8>>, &'static str> {
        let own = self.lid();
        if !cable && !is_unicast_lid(dlid) && dlid != PERMISSIVE_LID {
            return Err("unknown destination");
        }
        if !cable && !is_unicast_lid(own) && dlid != PERMISSIVE_LID {
            return Err("the port has no LID yet (it waits for a subnet manager)");
        }
        let body = encode_packet(p);
        if body.len() > MAX_IB_MESSAGE {
            return Err("message too large for the simulated link");
        }
        let msg = self.next_msg.fetch_add(1, Ordering::Relaxed);
        let (slid, src_lid) = if cable || is_unicast_lid(own) { (own, own) } else { (PERMISSIVE_LID, 0) };
        let me = Ident { lid: slid, ..self.ident() };
        let (dst, src) = (lid_mac(dlid), lid_mac(src_lid));
        Ok(body
            .chunks(IB_FRAGMENT)
            .enumerate()
            .map(|(i, c)| emit(dst, src, Kind::Data, p.sl, dlid, &me, msg, i * IB_FRAGMENT, body.len(), c))
            .collect())
    }

    /// A probe or its answer named `instance` as the holder of `lid`: a probe comes from a port about to join
    /// (a holder's answer, which then follows, puts the holder back), so a port that left and came back with
    /// the same LID is its holder again.
    pub(crate) fn claimed(&self, lid: u16, instance: u64) {
        let mut h = self.holders.lock().unwrap_or_else(|e| e.into_inner());
        h.retain(|(l, _)| *l != lid);
        if h.len() >= MAX_HOLDERS {
            h.remove(0);
        }
        h.push((lid, instance));
    }

    /// Whether a data frame from `lid` comes from the port known to hold it (the first heard from is taken as
    /// its holder): a second port with one LID would otherwise get the answers meant for the first.
    pub(crate) fn sender_holds(&self, lid: u16, instance: u64) -> bool {
        let known = self.holders.lock().unwrap_or_else(|e| e.into_inner()).iter().find(|(l, _)| *l == lid).map(|h| h.1);
        match known {
            Some(i) => i == instance,
            None => {
                self.claimed(lid, instance);
                true
            }
        }
    }

    /// The answer to a probe for this port's LID.
    pub(crate) fn in_use(&self) -> Vec<u8> {
        let me = self.ident();
        emit(BROADCAST, lid_mac(me.lid), Kind::InUse, 0, me.lid, &me, 0, 0, 0, &[])
    }
}

/// A number no other plug-in of any process is likely to have: the clock, the process id and a count.
pub(crate) fn instance() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    static COUNT: AtomicU32 = AtomicU32::new(0);
    // RandomState is seeded from the OS's random source once per process.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u32(std::process::id());
    h.write_u32(COUNT.fetch_add(1, Ordering::Relaxed));
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// The packet in a whole encoding (the type byte first), or why not.
pub(crate) fn decode<D: Clone>(body: &[u8], nobody: D) -> Result<Packet<D>, &'static str> {
    match body.split_first() {
        Some((&FRAME_PACKET, rest)) => decode_packet(rest, nobody),
        _ => Err("IB message that is not a packet"),
    }
}

/// Whether another port holds `lid` on the fabric `conn` reaches: broadcasts a probe [`PROBES`] times and listens
/// after each. The holder's GUID if one answered (or probed the same LID at the same time).
pub(crate) fn probe(conn: &dyn Datagrams, me: &IbSide, src: [u8; 6]) -> Result<Option<u64>, std::io::Error> {
    let frame = emit(BROADCAST, src, Kind::Probe, 0, me.lid(), &me.ident(), 0, 0, 0, &[]);
    let (fd, _) = conn.fds();
    let mut buf = vec![0u8; 1 << 16];
    for _ in 0..PROBES {
        if conn.send(&frame) < 0 {
            return Err(std::io::Error::other("the VDE fabric went away while probing the LID"));
        }
        let end = Instant::now() + PROBE_WAIT;
        loop {
            let left = end.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd.
            let n = unsafe { libc::poll(&mut p, 1, left.as_millis().max(1) as libc::c_int) };
            if n <= 0 {
                continue;
            }
            let got = conn.recv(&mut buf);
            if got <= 0 {
                return Err(std::io::Error::other("the VDE fabric went away while probing the LID"));
            }
            let f = &buf[..got as usize];
            if f.len() < ETH_HEADER || f[12..14] != ETHERTYPE_IB.to_be_bytes() {
                continue;
            }
            if let Ok(r) = parse(f) {
                if r.kind != Kind::Data && r.dlid == me.lid() && r.instance != me.instance {
                    return Ok(Some(r.guid));
                }
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn me() -> Ident {
        Ident { lid: 0x12, guid: 0xaabb, instance: 7 }
    }

    #[test]
    fn a_frame_parses_back_to_what_was_emitted_and_every_bad_one_is_refused() {
        let f = emit([2, 0, 0, 0, 0, 1], [2, 0, 0, 0, 0, 2], Kind::Data, 3, 0x34, &me(), 9, 0, 5, b"hello");
        // Padded to whole words: 14 + 8 + 32 + 8.
        assert_eq!(f.len(), 62);
        let r = parse(&f).unwrap();
        assert_eq!(
            (f[15] >> 4, r.kind, r.dlid, r.slid, r.guid, r.instance, r.msg, r.offset, r.total, r.fragment),
            (3, Kind::Data, 0x34, 0x12, 0xaabb, 7, 9, 0, 5, &b"hello"[..])
        );
        // Ethernet padding after PktLen is allowed.
        let mut padded = f.clone();
        padded.resize(70, 0);
        assert!(parse(&padded).is_ok());
        let bad = |at: usize, v: u8| {
            let mut g = f.clone();
            g[at] = v;
            parse(&g).unwrap_err()
        };
        assert_eq!(bad(14, 1), "IB frame with an LRH version other than 0");
        assert_eq!(bad(15, 0x32), "IB frame whose LRH does not say raw (LNH 0)");
        assert_eq!(bad(16, 0xc0), "IB frame without unicast LIDs");
        assert_eq!(bad(19, 3), "IB frame whose PktLen is not its length");
        assert_eq!(bad(22, 9), "IB frame of an unknown kind");
        // An offset that is no fragment's; a total above the limit.
        assert_eq!(bad(49, 8), "IB fragment outside its message");
        assert_eq!(bad(50, 0x7f), "IB fragment outside its message");
        assert_eq!(parse(&f[..f.len() - 4]).unwrap_err(), "IB frame whose PktLen is not its length");
        assert_eq!(parse(&f[..40]).unwrap_err(), "IB frame shorter than its headers");
    }

    #[test]
    fn a_port_without_a_lid_sends_directed_route_smps_only_from_the_permissive_lid() {
        use crate::wire::{Body, RoceInfo};
        let p = Packet {
            src: (),
            dst: (),
            src_qpn: 0,
            dst_qpn: 0,
            slid: PERMISSIVE_LID,
            sl: 0,
            grh: None,
            body: Body::Ud { qkey: 0, pkey: 0xffff, data: vec![1; 256], imm: None, solicited: false },
            roce: RoceInfo::default(),
        };
        let side = IbSide::new(0, 0xaa);
        // To a LID: refused until an SM gives the port one.
        assert!(side.frames(&p, 5, false).is_err());
        // To the permissive LID: from it in the LRH, from LID 0's MAC, to the permissive LID's MAC.
        let f = side.frames(&p, PERMISSIVE_LID, false).unwrap().remove(0);
        let r = parse(&f).unwrap();
        assert_eq!(
            (r.dlid, r.slid, &f[..6], &f[6..12]),
            (PERMISSIVE_LID, PERMISSIVE_LID, &lid_mac(PERMISSIVE_LID)[..], &lid_mac(0)[..])
        );
        assert!(side.owns_mac(&lid_mac(PERMISSIVE_LID)) && !side.owns_mac(&lid_mac(5)));
        // The SM's LID: frames from it, and the port takes frames to it.
        side.set_lid(5);
        let r = side.frames(&p, 7, false).unwrap().remove(0);
        assert_eq!((parse(&r).unwrap().slid, &r[6..12]), (5, &lid_mac(5)[..]));
        assert!(side.owns_mac(&lid_mac(5)));
        // A probe never names the permissive LID.
        let probe = emit(BROADCAST, lid_mac(1), Kind::Probe, 0, PERMISSIVE_LID, &me(), 0, 0, 0, &[]);
        assert_eq!(parse(&probe).unwrap_err(), "IB frame without unicast LIDs");
    }

    #[test]
    fn fragments_in_any_order_and_twice_make_one_message_and_the_table_stays_bounded() {
        let msg: Vec<u8> = (0..3 * IB_FRAGMENT + 10).map(|i| i as u8).collect();
        let frames: Vec<Vec<u8>> = msg
            .chunks(IB_FRAGMENT)
            .enumerate()
            .map(|(i, c)| emit(lid_mac(1), lid_mac(2), Kind::Data, 0, 1, &me(), 4, i * IB_FRAGMENT, msg.len(), c))
            .collect();
        let mut r = Reasm::default();
        let mut lost = 0;
        for i in [2, 0, 2, 3] {
            assert_eq!(r.add(&parse(&frames[i]).unwrap(), &mut lost), None);
        }
        assert_eq!(r.add(&parse(&frames[1]).unwrap(), &mut lost), Some(msg.clone()));
        // A duplicate after completion starts nothing.
        assert_eq!(r.add(&parse(&frames[0]).unwrap(), &mut lost), None);
        assert!(r.partial.is_empty());
        // Messages that never complete: at most MAX_PARTIAL are kept, the oldest given up and counted.
        for m in 0..MAX_PARTIAL as u32 + 5 {
            let f = emit(lid_mac(1), lid_mac(2), Kind::Data, 0, 1, &me(), 100 + m, 0, msg.len(), &msg[..IB_FRAGMENT]);
            assert_eq!(r.add(&parse(&f).unwrap(), &mut lost), None);
        }
        assert_eq!((r.partial.len(), lost), (MAX_PARTIAL, 5));
        assert_eq!(r.bytes, MAX_PARTIAL * msg.len());
    }
}
