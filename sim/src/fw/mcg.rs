//! Multicast groups: ATTACH_TO_MCG / DETACH_FROM_MCG (`transport/ud.rs` delivers a UD send to a multicast GID
//! to every QP attached to it on the port). mlx5_ib attaches a UD QP for `ibv_attach_mcast`, where rdma_cm's
//! multicast join ends; a group is its GID, and lives while a QP is attached to it.

use std::collections::BTreeMap;

use mlx5_core::prm::{ifc, CmdStatus};

use super::caps::Caps;
use super::qp::QpType;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// The GID's first byte of a multicast group (IBA 4.1.1: `FF`, as an IPv6 multicast address).
const MULTICAST_PREFIX: u8 = 0xff;
/// The prefix of an IPv4-mapped GID (`::ffff:a.b.c.d`), RoCE v2's form of an IPv4 address.
const V4_MAPPED: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// Whether `gid` names a multicast group: an IPv6 multicast address (IBA's `FF` prefix), or an IPv4-mapped
/// class D address, which rdma_cm joins on a RoCE v2 port (`cma_iboe_set_mgid` maps 224.0.0.0/4 so).
pub(crate) fn is_multicast_gid(gid: &[u8; 16]) -> bool {
    gid[0] == MULTICAST_PREFIX || (gid[..12] == V4_MAPPED && gid[12] & 0xf0 == 0xe0)
}

/// What an MCG command checks in the rest of the firmware.
pub(crate) struct McgFw<'a> {
    pub(crate) caps: &'a Caps,
    /// The type of QP `qpn`, `None` when there is none.
    pub(crate) qp_type: &'a dyn Fn(u32) -> Option<QpType>,
}

/// The port's multicast groups: each GID with its attached QPs, in attach order.
#[derive(Debug, Default)]
pub(crate) struct McgTable {
    groups: BTreeMap<[u8; 16], Vec<u32>>,
}

/// `multicast_gid` of an ATTACH_TO_MCG or DETACH_FROM_MCG input (the two share their layout).
fn gid_of(inp: &[u8]) -> [u8; 16] {
    let at = ifc::attach_to_mcg_in::MULTICAST_GID.byte_off();
    let mut gid = [0u8; 16];
    if let Some(b) = inp.get(at..at + 16) {
        gid.copy_from_slice(b);
    }
    gid
}

impl McgTable {
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The QPs attached to `gid`, none for a GID without a group.
    pub(crate) fn members(&self, gid: &[u8; 16]) -> &[u32] {
        self.groups.get(gid).map_or(&[], Vec::as_slice)
    }

    /// ATTACH_TO_MCG: only a UD QP joins, only a multicast GID. Attaching a member again changes nothing, as
    /// ConnectX firmware before it (mlx4's MGM) did. A full group, or a new group past `log_max_mcg`, is out
    /// of resources.
    pub(super) fn attach(&mut self, fw: &McgFw, inp: &[u8]) -> Result<(), CmdErr> {
        let (qpn, gid) = (rd(inp, ifc::attach_to_mcg_in::QPN), gid_of(inp));
        Self::check(fw, qpn, &gid)?;
        let max_groups = 1usize << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_MCG).min(24);
        let max_qps = fw.caps.gen(ifc::cmd_hca_cap::MAX_QP_MCG) as usize;
        if !self.groups.contains_key(&gid) && self.groups.len() >= max_groups {
            return Err(err(CmdStatus::NoRes, syndrome::NO_RESOURCES));
        }
        let members = self.groups.entry(gid).or_default();
        if members.contains(&qpn) {
            return Ok(());
        }
        if members.len() >= max_qps {
            return Err(err(CmdStatus::NoRes, syndrome::NO_RESOURCES));
        }
        members.push(qpn);
        Ok(())
    }

    /// DETACH_FROM_MCG: the QP leaves the group; the last one out ends the group. A QP not attached is refused.
    pub(super) fn detach(&mut self, fw: &McgFw, inp: &[u8]) -> Result<(), CmdErr> {
        let (qpn, gid) = (rd(inp, ifc::detach_from_mcg_in::QPN), gid_of(inp));
        Self::check(fw, qpn, &gid)?;
        let members = self.groups.get_mut(&gid).ok_or(bad_param(syndrome::MCG_NOT_ATTACHED))?;
        let at = members.iter().position(|&q| q == qpn).ok_or(bad_param(syndrome::MCG_NOT_ATTACHED))?;
        members.remove(at);
        if members.is_empty() {
            self.groups.remove(&gid);
        }
        Ok(())
    }

    /// A destroyed QP leaves every group (uverbs detaches first; a kernel consumer may not).
    pub(super) fn forget_qp(&mut self, qpn: u32) {
        self.groups.retain(|_, m| {
            m.retain(|&q| q != qpn);
            !m.is_empty()
        });
    }

    fn check(fw: &McgFw, qpn: u32, gid: &[u8; 16]) -> Result<(), CmdErr> {
        match (fw.qp_type)(qpn) {
            None => return Err(bad_param(syndrome::QP_INVALID)),
            Some(QpType::Ud) => {}
            Some(_) => return Err(bad_param(syndrome::QP_TYPE)),
        }
        if !is_multicast_gid(gid) {
            return Err(bad_param(syndrome::MCG_GID));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::testkit::submit::{QpSpec, Rdma};
    use consts::MLX5_CMD_STAT_BAD_PARAM_ERR as BAD_PARAM;
    use mlx5_core::prm::{consts, MsgBuf};

    const GROUP: [u8; 16] = [0xff, 0x0e, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xe0, 0, 0, 1];

    /// ATTACH_TO_MCG (`attach` true) or DETACH_FROM_MCG of `qpn` to `gid`: (status, syndrome).
    fn mcg(r: &mut Rdma, attach: bool, qpn: u32, gid: &[u8; 16]) -> (u8, u32) {
        use ifc::attach_to_mcg_in as i;
        let op = if attach { consts::MLX5_CMD_OP_ATTACH_TO_MCG } else { consts::MLX5_CMD_OP_DETACH_FROM_MCG };
        let mut inp = vec![0u8; i::SIZE_BYTES];
        inp.set(i::OPCODE, op.into());
        inp.set(i::QPN, qpn);
        let at = i::MULTICAST_GID.byte_off();
        inp[at..at + 16].copy_from_slice(gid);
        let (s, syn, _) = r.h.cmd(&inp, ifc::attach_to_mcg_out::SIZE_BYTES);
        (s, syn)
    }

    #[test]
    fn ud_qps_attach_to_and_detach_from_a_multicast_gid_with_the_syndromes_of_each_refusal() {
        let mut r = Rdma::new(SimConfig::default());
        let (scq, rcq) = (r.cq(5), r.cq(5));
        let (ua, ub) = (r.qp(QpSpec::ud(), scq.cqn, rcq.cqn), r.qp(QpSpec::ud(), scq.cqn, rcq.cqn));
        let rc = r.qp(QpSpec::rc(), scq.cqn, rcq.cqn);
        let members = |r: &Rdma| r.h.dev.with_fw(|fw| fw.mcgs.members(&GROUP).to_vec());
        assert_eq!(mcg(&mut r, true, ua.qpn, &GROUP), (0, 0));
        assert_eq!(mcg(&mut r, true, ub.qpn, &GROUP), (0, 0));
        // A member attached again stays one member.
        assert_eq!(mcg(&mut r, true, ua.qpn, &GROUP), (0, 0));
        assert_eq!(members(&r), [ua.qpn, ub.qpn]);
        // Only a UD QP, only a multicast GID, only an existing QP.
        assert_eq!(mcg(&mut r, true, rc.qpn, &GROUP), (BAD_PARAM, syndrome::QP_TYPE));
        let mut unicast = GROUP;
        unicast[0] = 0xfe;
        assert_eq!(mcg(&mut r, true, ua.qpn, &unicast), (BAD_PARAM, syndrome::MCG_GID));
        // RoCE v2's IPv4 form: 224.0.0.0/4 mapped is a group, 10.36.0.1 mapped is not.
        let v4 = |a: u8| [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, a, 1, 2, 3];
        assert_eq!(mcg(&mut r, true, ua.qpn, &v4(10)), (BAD_PARAM, syndrome::MCG_GID));
        assert_eq!(mcg(&mut r, true, ua.qpn, &v4(239)), (0, 0));
        assert_eq!(mcg(&mut r, false, ua.qpn, &v4(239)), (0, 0));
        assert_eq!(mcg(&mut r, true, 0xabcd, &GROUP), (BAD_PARAM, syndrome::QP_INVALID));
        // Detaching: a QP not in the group is refused; the last one out ends the group.
        assert_eq!(mcg(&mut r, false, ua.qpn, &GROUP), (0, 0));
        assert_eq!(mcg(&mut r, false, ua.qpn, &GROUP), (BAD_PARAM, syndrome::MCG_NOT_ATTACHED));
        assert_eq!(members(&r), [ub.qpn]);
        // A destroyed QP leaves its groups.
        let mut inp = vec![0u8; ifc::destroy_qp_in::SIZE_BYTES];
        inp.set(ifc::destroy_qp_in::OPCODE, consts::MLX5_CMD_OP_DESTROY_QP.into());
        inp.set(ifc::destroy_qp_in::QPN, ub.qpn);
        assert_eq!(r.h.cmd(&inp, ifc::destroy_qp_out::SIZE_BYTES).0, 0);
        assert!(members(&r).is_empty());
        assert_eq!(mcg(&mut r, false, ua.qpn, &GROUP), (BAD_PARAM, syndrome::MCG_NOT_ATTACHED));
    }

    #[test]
    fn a_group_holds_max_qp_mcg_qps_and_the_next_is_out_of_resources() {
        use ifc::attach_to_mcg_in as i;
        let caps = Caps::new(&SimConfig::default());
        let fw = McgFw { caps: &caps, qp_type: &|_| Some(QpType::Ud) };
        let mut t = McgTable::new();
        let input = |qpn: u32| {
            let mut inp = vec![0u8; i::SIZE_BYTES];
            inp.set(i::QPN, qpn);
            let at = i::MULTICAST_GID.byte_off();
            inp[at..at + 16].copy_from_slice(&GROUP);
            inp
        };
        let max = caps.gen(ifc::cmd_hca_cap::MAX_QP_MCG);
        for qpn in 0..max {
            assert!(t.attach(&fw, &input(0x100 + qpn)).is_ok());
        }
        let e = t.attach(&fw, &input(0x100 + max)).unwrap_err();
        assert_eq!((e.status, e.syndrome), (CmdStatus::NoRes, syndrome::NO_RESOURCES));
        assert_eq!(t.members(&GROUP).len(), max as usize);
    }
}
