//! The directed-route hop rules of a subnet management packet (IBTA vol. 1, 14.2.2.2: C14-9 on the way out,
//! C14-13 on the way back), as Linux's `ib_mad` (`smi.c`) applies them, for the port of a channel adapter (which
//! forwards nothing) and for a switch (which passes the SMP on between its ports). One place for both: the host
//! stack's QP0 agent (`mlx5-rdmacm`'s `smp.rs`) and the simulator's switch use these functions.
//!
//! The SMP is the IBTA's 256 bytes (14.2.1.2, `struct ib_smp`), read and changed in place; these are not PRM
//! layouts, so the few offsets are laid out here. Everything comes from a peer: a route that does not fit is a
//! [`DrError`], never a panic.

use crate::mad_ifc::MAD_LEN;

/// Byte offsets of the directed-route fields of an SMP and its attribute data (IBTA 14.2.1.2).
pub mod off {
    /// The status word (bit 15: the direction).
    pub const STATUS: usize = 4;
    /// The hop pointer.
    pub const HOP_PTR: usize = 6;
    /// The hop count.
    pub const HOP_CNT: usize = 7;
    /// DrSLID.
    pub const DR_SLID: usize = 32;
    /// DrDLID.
    pub const DR_DLID: usize = 34;
    /// The attribute data (64 bytes).
    pub const DATA: usize = 64;
    /// The initial path (64 port numbers).
    pub const INITIAL_PATH: usize = 128;
    /// The return path (64 port numbers).
    pub const RETURN_PATH: usize = 192;
}

/// The direction bit of the status word: set in responses.
pub const DIRECTION: u16 = 0x8000;
/// The permissive LID (IBA 4.1.3): "whoever is at the end of this link".
pub const PERMISSIVE_LID: u16 = 0xffff;
/// Hops a directed route holds (C14-6: hop counts 0 to 63).
pub const MAX_PATH_HOPS: u8 = 64;

/// Why a directed-route SMP does not fit the rules where it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum DrError {
    /// A hop count past 63 (C14-6).
    HopCount(u8),
    /// A hop pointer that does not fit its count here, or a path through a port the node lacks.
    Route {
        /// The hop pointer.
        ptr: u8,
        /// The hop count.
        cnt: u8,
        /// Whether the SMP was on its way back (direction bit set).
        returning: bool,
    },
}

/// Where an SMP that arrived goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Hop {
    /// It ends here: the node's SMA takes it.
    Here,
    /// A switch passes it on, out of this port.
    Out(u8),
}

fn be16(b: &[u8; MAD_LEN], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}

/// Applies the arrival rules to a directed-route SMP that came in on `port` of a channel adapter (`switch_ports`
/// `None`) or of a switch of that many external ports. Outbound: C14-9:2, an intermediate hop (switches only:
/// records `port` in the return path and moves on, out of the next initial-path port); C14-9:3, the end of the
/// directed part (records `port`, moves the pointer past the count, as `smi_handle_dr_smp_send` does before
/// `ib_mad` hands it on; only a permissive DrDLID ends it here); C14-9:4, reached by LID after it. Returning:
/// C14-13:2, an intermediate hop (switches only: back one hop, out of the return-path port); a returning SMP
/// that ends here is for an SM, which neither node runs.
pub fn arrive(smp: &mut [u8; MAD_LEN], port: u8, switch_ports: Option<u8>) -> Result<Hop, DrError> {
    let (ptr, cnt) = (smp[off::HOP_PTR], smp[off::HOP_CNT]);
    if cnt >= MAX_PATH_HOPS {
        return Err(DrError::HopCount(cnt));
    }
    let returning = be16(smp, off::STATUS) & DIRECTION != 0;
    let refuse = Err(DrError::Route { ptr, cnt, returning });
    // A port number of the switch (none on a channel adapter).
    let on = |p: u8| switch_ports.is_some_and(|n| (1..=n).contains(&p));
    if returning {
        if switch_ports.is_some() && ptr >= 2 && ptr <= cnt {
            let out = smp[off::RETURN_PATH + usize::from(ptr - 1)];
            if !on(out) {
                return refuse;
            }
            smp[off::HOP_PTR] = ptr - 1;
            return Ok(Hop::Out(out));
        }
        return refuse;
    }
    if switch_ports.is_some() && ptr > 0 && ptr < cnt {
        let out = smp[off::INITIAL_PATH + usize::from(ptr + 1)];
        if !on(out) {
            return refuse;
        }
        smp[off::RETURN_PATH + usize::from(ptr)] = port;
        smp[off::HOP_PTR] = ptr + 1;
        return Ok(Hop::Out(out));
    }
    if ptr == cnt {
        if be16(smp, off::DR_DLID) != PERMISSIVE_LID {
            return refuse;
        }
        if cnt != 0 {
            smp[off::RETURN_PATH + usize::from(ptr)] = port;
        }
        smp[off::HOP_PTR] = ptr + 1;
        return Ok(Hop::Here);
    }
    if ptr == cnt + 1 {
        return Ok(Hop::Here);
    }
    refuse
}

/// Makes the SMA's response to a directed-route SMP that [`arrive`] took on `port` ready to send back out of it:
/// the direction bit set and, when its DrDLID is permissive, the hop pointer moved back by the returning rules
/// (C14-13:1, back one hop out of the port it came in on; C14-13:3, the SM at the other end of this link). A
/// response whose DrDLID is not permissive goes back by LID first and is left as it is.
pub fn depart(rsp: &mut [u8; MAD_LEN], port: u8) -> Result<(), DrError> {
    let status = be16(rsp, off::STATUS) | DIRECTION;
    rsp[off::STATUS..off::STATUS + 2].copy_from_slice(&status.to_be_bytes());
    if be16(rsp, off::DR_DLID) != PERMISSIVE_LID {
        return Ok(());
    }
    let (ptr, cnt) = (rsp[off::HOP_PTR], rsp[off::HOP_CNT]);
    if cnt >= MAX_PATH_HOPS {
        return Err(DrError::HopCount(cnt));
    }
    let ok = if cnt != 0 && ptr == cnt + 1 {
        rsp[off::HOP_PTR] = ptr - 1;
        rsp[off::RETURN_PATH + usize::from(ptr - 1)] == port
    } else if ptr == 1 {
        rsp[off::HOP_PTR] = 0;
        be16(rsp, off::DR_SLID) == PERMISSIVE_LID
    } else {
        // C14-13:4 (hop pointer 0) goes out as it is; C14-13:5 is unreasonable.
        ptr == 0
    };
    if ok {
        Ok(())
    } else {
        Err(DrError::Route { ptr, cnt, returning: true })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directed-route request along `path` (after the SM's own port) as it leaves the SM's port (C14-9:1).
    fn dr(path: &[u8]) -> [u8; MAD_LEN] {
        let mut m = [0u8; MAD_LEN];
        m[..4].copy_from_slice(&[1, 0x81, 1, 1]);
        m[off::HOP_PTR] = 1;
        m[off::HOP_CNT] = path.len() as u8;
        m[off::DR_SLID..off::DR_SLID + 2].copy_from_slice(&PERMISSIVE_LID.to_be_bytes());
        m[off::DR_DLID..off::DR_DLID + 2].copy_from_slice(&PERMISSIVE_LID.to_be_bytes());
        m[off::INITIAL_PATH + 1..off::INITIAL_PATH + 1 + path.len()].copy_from_slice(path);
        m
    }

    #[test]
    fn through_a_switch_to_a_channel_adapter_and_back() {
        // SM -> switch (in on 1, out on 3) -> CA.
        let mut m = dr(&[1, 3]);
        assert_eq!(arrive(&mut m, 1, Some(4)), Ok(Hop::Out(3)));
        assert_eq!((m[off::HOP_PTR], m[off::RETURN_PATH + 1]), (2, 1));
        assert_eq!(arrive(&mut m, 1, None), Ok(Hop::Here));
        assert_eq!((m[off::HOP_PTR], m[off::RETURN_PATH + 2]), (3, 1));
        // The CA's answer: back to pointer 2; the switch passes it out of port 1; the SM's port gets pointer 1.
        assert_eq!(depart(&mut m, 1), Ok(()));
        assert_eq!((m[off::HOP_PTR], be16(&m, off::STATUS)), (2, DIRECTION));
        assert_eq!(arrive(&mut m, 3, Some(4)), Ok(Hop::Out(1)));
        assert_eq!(m[off::HOP_PTR], 1);
        // The switch itself one hop out: it answers out of the port the request came in on.
        let mut s = dr(&[1]);
        assert_eq!(arrive(&mut s, 2, Some(4)), Ok(Hop::Here));
        assert_eq!(depart(&mut s, 2), Ok(()));
        assert_eq!(s[off::HOP_PTR], 1);
    }

    #[test]
    fn routes_that_do_not_fit_are_refused() {
        // A channel adapter forwards nothing; a switch lacks port 5; hop count 64; a pointer past the count.
        let mut m = dr(&[1, 3]);
        assert_eq!(arrive(&mut m, 1, None), Err(DrError::Route { ptr: 1, cnt: 2, returning: false }));
        let mut m = dr(&[1, 5]);
        assert!(arrive(&mut m, 1, Some(4)).is_err());
        assert_eq!(m[off::HOP_PTR], 1, "unchanged");
        let mut m = dr(&[1]);
        m[off::HOP_CNT] = 64;
        assert_eq!(arrive(&mut m, 1, Some(4)), Err(DrError::HopCount(64)));
        let mut m = dr(&[1]);
        m[off::HOP_PTR] = 5;
        assert!(arrive(&mut m, 1, Some(4)).is_err());
        // A LID-routed end is not this node's to take; a response that ends here is for an SM.
        let mut m = dr(&[1]);
        m[off::DR_DLID..off::DR_DLID + 2].copy_from_slice(&3u16.to_be_bytes());
        assert!(arrive(&mut m, 1, None).is_err());
        let mut m = dr(&[1]);
        m[off::STATUS] = 0x80;
        assert!(arrive(&mut m, 1, Some(4)).is_err());
        // A response whose return path does not name the port it leaves by.
        let mut m = dr(&[1, 3]);
        m[off::HOP_PTR] = 3;
        m[off::RETURN_PATH + 2] = 2;
        assert_eq!(depart(&mut m, 1), Err(DrError::Route { ptr: 3, cnt: 2, returning: true }));
    }
}
