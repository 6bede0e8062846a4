//! Subnet management packets (IBA 14.2.1) as a channel adapter's QP0 takes them: which SMPs go to the port's subnet
//! management agent (SMA), and the directed-route hop rules (IBA 14.2.2.2: C14-9 on the way out, C14-13 on the way
//! back) applied to a request on arrival and to its response before it is sent, as Linux's `ib_mad` (`smi.c`,
//! `handle_ib_smi`, `handle_outgoing_dr_smp`) applies them for a port of an HCA, which forwards nothing.
//!
//! The SMA itself is the device's firmware behind MAD_IFC; this module only decides what reaches it and how its
//! answer finds the way back. The hop rules are `mlx5_core::smp_route`'s, which the simulator's switch shares. Everything is read from bytes a peer sent: every failure is a typed [`SmpDrop`], never
//! a panic, and the caller drops and counts the packet (an SMA sends no answer to what it cannot route back).

use thiserror::Error;

use mlx5_core::smp_route::{self, DrError, Hop};

use crate::mad::{class, method, MadError, MadHdr, MAD_LEN};

pub use mlx5_core::smp_route::{off, DIRECTION, MAX_PATH_HOPS, PERMISSIVE_LID};

/// A request's `TrapRepress` method (IBA 13.4.5): the SMA takes it and sends nothing back.
pub const METHOD_TRAP_REPRESS: u8 = 0x07;

/// Why an SMP that arrived on QP0 is dropped instead of handed to the SMA.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum SmpDrop {
    /// Not a whole MAD, or not base version 1 (`ib_mad`'s `validate_mad`).
    #[error("not an SMP: {0}")]
    Mad(#[from] MadError),
    /// A class other than the two subnet management ones: QP0 carries SMPs only.
    #[error("management class {0:#04x} on QP0")]
    NotSubnetClass(u8),
    /// A response or trap: this port runs no SM, so nothing here waits for it.
    #[error("method {0:#04x} is no request an SMA answers")]
    NotRequest(u8),
    /// A hop count past 63 (C14-6).
    #[error("directed route with hop count {0}")]
    HopCount(u8),
    /// A hop pointer that does not end the route at this port (C14-9, C14-13): a channel adapter forwards nothing.
    #[error("directed route: hop pointer {ptr} of {cnt} ({dir}) does not end at this port")]
    Route {
        /// The hop pointer.
        ptr: u8,
        /// The hop count.
        cnt: u8,
        /// "outbound" or "returning".
        dir: &'static str,
    },
}

/// An SMP accepted for the SMA: its header and the MAD to hand to MAD_IFC (hop pointer and return path updated).
#[derive(Debug, Clone)]
pub struct SmaRequest {
    /// The request's header.
    pub hdr: MadHdr,
    /// The MAD as the SMA is to see it.
    pub mad: [u8; MAD_LEN],
}

impl From<DrError> for SmpDrop {
    fn from(e: DrError) -> SmpDrop {
        match e {
            DrError::HopCount(cnt) => SmpDrop::HopCount(cnt),
            DrError::Route { ptr, cnt, returning } => {
                SmpDrop::Route { ptr, cnt, dir: if returning { "returning" } else { "outbound" } }
            }
        }
    }
}

/// Checks the bytes that arrived on QP0 of `port` (the payload after the GRH room) and, for a directed-route SMP,
/// applies the receive rules of a port that forwards nothing: an outbound SMP must end its directed part here with
/// a permissive DrDLID (the return path then records `port` and the hop pointer moves past the count, as
/// `smi_handle_dr_smp_send` moves it before `ib_mad` hands the SMP on), or have arrived by LID after it (C14-9:4).
pub fn accept(bytes: &[u8], port: u8) -> Result<SmaRequest, SmpDrop> {
    let hdr = MadHdr::parse(bytes)?;
    if bytes.len() < MAD_LEN {
        return Err(MadError::Truncated { len: bytes.len(), need: MAD_LEN }.into());
    }
    if !matches!(hdr.mgmt_class, class::SUBN_LID_ROUTED | class::SUBN_DIRECTED_ROUTE) {
        return Err(SmpDrop::NotSubnetClass(hdr.mgmt_class));
    }
    // `mlx5_ib_process_mad` passes Get, Set and TrapRepress to MAD_IFC; anything else has no agent here.
    if !matches!(hdr.method, method::GET | method::SET | METHOD_TRAP_REPRESS) {
        return Err(SmpDrop::NotRequest(hdr.method));
    }
    let mut mad = [0u8; MAD_LEN];
    mad.copy_from_slice(&bytes[..MAD_LEN]);
    if hdr.mgmt_class == class::SUBN_DIRECTED_ROUTE {
        // A channel adapter's port: the route must end here (a returning SMP is for an SM on this port; there is
        // none).
        let (ptr, cnt) = (mad[off::HOP_PTR], mad[off::HOP_CNT]);
        if smp_route::arrive(&mut mad, port, None)? != Hop::Here {
            return Err(SmpDrop::Route { ptr, cnt, dir: "outbound" });
        }
    }
    Ok(SmaRequest { hdr, mad })
}

/// Makes the SMA's response to `req` ready to send back on QP0 of `port`: `None` for a TrapRepress (no response),
/// else the response with the direction bit set on a directed-route SMP (as `mlx5_ib_process_mad` sets it) and,
/// when its DrDLID is permissive, the hop pointer moved back by the returning rules (C14-13), as
/// `handle_outgoing_dr_smp` does before `ib_mad` posts it.
pub fn respond(req: &SmaRequest, mut rsp: [u8; MAD_LEN], port: u8) -> Result<Option<[u8; MAD_LEN]>, SmpDrop> {
    if req.hdr.method == METHOD_TRAP_REPRESS {
        return Ok(None);
    }
    if req.hdr.mgmt_class != class::SUBN_DIRECTED_ROUTE {
        return Ok(Some(rsp));
    }
    smp_route::depart(&mut rsp, port)?;
    Ok(Some(rsp))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mad::{be16, set_be16};

    /// A directed-route Get(NodeInfo) as opensm sends it to a port `cnt` hops away, as it arrives there.
    fn dr_get(cnt: u8) -> [u8; MAD_LEN] {
        let mut m = [0u8; MAD_LEN];
        m[..4].copy_from_slice(&[1, class::SUBN_DIRECTED_ROUTE, 1, method::GET]);
        m[off::HOP_PTR] = cnt;
        m[off::HOP_CNT] = cnt;
        m[8..16].copy_from_slice(&0x1234_u64.to_be_bytes());
        m[16..18].copy_from_slice(&0x0011_u16.to_be_bytes());
        set_be16(&mut m, off::DR_SLID, PERMISSIVE_LID);
        set_be16(&mut m, off::DR_DLID, PERMISSIVE_LID);
        for h in 1..=cnt {
            m[off::INITIAL_PATH + usize::from(h)] = 1;
        }
        m
    }

    /// What MAD_IFC gives back: the request as GetResp, the rest kept.
    fn sma(req: &SmaRequest) -> [u8; MAD_LEN] {
        let mut r = req.mad;
        r[3] = method::GET_RESP;
        r
    }

    #[test]
    fn one_hop_from_the_sm_the_pointer_goes_past_the_count_and_back_to_zero() {
        let req = accept(&dr_get(1), 1).expect("ours");
        assert_eq!((req.mad[off::HOP_PTR], req.mad[off::RETURN_PATH + 1]), (2, 1));
        let rsp = respond(&req, sma(&req), 1).unwrap().expect("a response");
        assert_eq!((rsp[off::HOP_PTR], be16(&rsp, off::STATUS)), (1, DIRECTION));
        // Two hops away (behind a switch): back to the switch's hop, out of the port it came in on.
        let req = accept(&dr_get(2), 1).unwrap();
        let rsp = respond(&req, sma(&req), 1).unwrap().unwrap();
        assert_eq!(rsp[off::HOP_PTR], 2);
        // The SM's own port (hop count 0): handed on with pointer 1, returned with 0.
        let req = accept(&dr_get(0), 1).unwrap();
        assert_eq!(req.mad[off::HOP_PTR], 1);
        assert_eq!(respond(&req, sma(&req), 1).unwrap().unwrap()[off::HOP_PTR], 0);
    }

    #[test]
    fn a_route_that_does_not_end_here_is_dropped_with_its_reason() {
        // The sender did not move the pointer; an intermediate hop; a pointer past the end; a hop count past 63.
        let mut m = dr_get(2);
        m[off::HOP_PTR] = 0;
        assert!(matches!(accept(&m, 1), Err(SmpDrop::Route { ptr: 0, cnt: 2, .. })));
        m[off::HOP_PTR] = 1;
        assert!(matches!(accept(&m, 1), Err(SmpDrop::Route { ptr: 1, .. })));
        m[off::HOP_PTR] = 4;
        assert!(matches!(accept(&m, 1), Err(SmpDrop::Route { ptr: 4, .. })));
        m[off::HOP_CNT] = 64;
        assert_eq!(accept(&m, 1).unwrap_err(), SmpDrop::HopCount(64));
        // The end of the directed part without a permissive DrDLID belongs to a switch's LID-routed leg.
        let mut m = dr_get(1);
        set_be16(&mut m, off::DR_DLID, 7);
        assert!(matches!(accept(&m, 1), Err(SmpDrop::Route { dir: "outbound", .. })));
        // A returning SMP: no SM here.
        let mut m = dr_get(1);
        set_be16(&mut m, off::STATUS, DIRECTION);
        assert!(matches!(accept(&m, 1), Err(SmpDrop::Route { dir: "returning", .. })));
        // A response whose return path names another port is not sent.
        let req = accept(&dr_get(1), 1).unwrap();
        let mut rsp = sma(&req);
        rsp[off::RETURN_PATH + 1] = 2;
        assert!(respond(&req, rsp, 1).is_err());
        // C14-13:3 with a DrSLID that is not permissive: the SM is not at this link's end.
        let mut rsp = sma(&accept(&dr_get(0), 1).unwrap());
        set_be16(&mut rsp, off::DR_SLID, 5);
        assert!(respond(&req, rsp, 1).is_err());
    }

    #[test]
    fn truncated_foreign_and_unanswerable_mads_are_typed_drops() {
        let m = dr_get(1);
        assert_eq!(accept(&m[..100], 1).unwrap_err(), SmpDrop::Mad(MadError::Truncated { len: 100, need: MAD_LEN }));
        assert_eq!(accept(&m[..10], 1).unwrap_err(), SmpDrop::Mad(MadError::Truncated { len: 10, need: 24 }));
        assert_eq!(accept(&[], 1).unwrap_err(), SmpDrop::Mad(MadError::Truncated { len: 0, need: 24 }));
        let mut v = m;
        v[0] = 2;
        assert_eq!(accept(&v, 1).unwrap_err(), SmpDrop::Mad(MadError::BadBaseVersion(2)));
        let mut pm = m;
        pm[1] = class::PERF_MGMT;
        assert_eq!(accept(&pm, 1).unwrap_err(), SmpDrop::NotSubnetClass(class::PERF_MGMT));
        let mut resp = m;
        resp[3] = method::GET_RESP;
        assert_eq!(accept(&resp, 1).unwrap_err(), SmpDrop::NotRequest(method::GET_RESP));
        // A LID-routed Set goes to the SMA as it came; TrapRepress is taken and not answered.
        let mut lr = m;
        lr[1] = class::SUBN_LID_ROUTED;
        lr[3] = method::SET;
        let req = accept(&lr, 1).unwrap();
        assert_eq!(req.mad, lr);
        assert_eq!(respond(&req, sma(&req), 1).unwrap().unwrap()[off::STATUS], 0);
        lr[3] = METHOD_TRAP_REPRESS;
        let req = accept(&lr, 1).unwrap();
        assert_eq!(respond(&req, sma(&req), 1).unwrap(), None);
        // Every byte pattern is an answer or a drop, never a panic.
        let mut x = m;
        for i in 0..4096u32 {
            let k = (i.wrapping_mul(2_654_435_761) >> 8) as usize % MAD_LEN;
            x[k] = (i * 31) as u8;
            x[0] = 1;
            if let Ok(r) = accept(&x, 1) {
                let _ = respond(&r, sma(&r), 1);
            }
        }
    }
}
