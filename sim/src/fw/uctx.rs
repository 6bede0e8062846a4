//! DevX user contexts: CREATE_UCTX / DESTROY_UCTX (Linux's `mlx5_ib_devx_create` / `mlx5_ib_devx_destroy`) and
//! the `uid` every command header carries.
//!
//! `log_max_uctx` > 0 makes mlx5_ib open a context for its DevX whitelist at probe and one for every user context
//! that asks (rdma-core's mlx5 provider always asks first); the objects created under one carry its `uid` in their
//! commands' header. The firmware records each object's owner and refuses:
//! * a header `uid` that is not a live context: `BAD_PARAM` [`syndrome::UID_INVALID`];
//! * a destroy, modify or query with a context's `uid` on an object another owner created: `BAD_PARAM`
//!   [`syndrome::UID_MISMATCH`]. `uid` 0 is the kernel's own (privileged) and may touch any object; an object
//!   created with `MLX5_SHARED_RESOURCE_UID` (0xffff: mlx5_ib's port Q counter, mlx5_core's EQs) is every
//!   context's;
//! * DESTROY_UCTX while objects it owns live: `BAD_RES_STATE` (mlx5_ib frees them first).

use std::collections::BTreeMap;

use mlx5_core::prm::{consts, ifc, CmdStatus, Field, MsgBuf};

use super::caps::Caps;
use super::ids::IdSet;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// `MLX5_SHARED_RESOURCE_UID`: an object every context may use.
const SHARED: u32 = consts::MLX5_SHARED_RESOURCE_UID;

/// The object number spaces a `uid` owns names in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Kind {
    Pd,
    Uar,
    Td,
    Xrcd,
    Cq,
    Qp,
    /// SRQs, XRC SRQs and RMPs share one number space.
    Srq,
    Mkey,
    QCounter,
    Tis,
    Tir,
    Rqt,
    Rq,
    Sq,
    Umem,
}

/// What a command does to the object it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Role {
    /// Creates one; its number is this output field.
    Create(Field),
    /// Modifies or queries one named by this input field.
    Use(Field),
    /// Destroys one named by this input field.
    Destroy(Field),
}

/// The object a command creates, uses or destroys, for the opcodes whose objects a user context can own.
pub(crate) fn role(op: u16) -> Option<(Kind, Role)> {
    use consts::*;
    use ifc::*;
    use Kind::*;
    use Role::*;
    Some(match op {
        MLX5_CMD_OP_ALLOC_PD => (Pd, Create(alloc_pd_out::PD)),
        MLX5_CMD_OP_DEALLOC_PD => (Pd, Destroy(dealloc_pd_in::PD)),
        MLX5_CMD_OP_ALLOC_UAR => (Uar, Create(alloc_uar_out::UAR)),
        MLX5_CMD_OP_DEALLOC_UAR => (Uar, Destroy(dealloc_uar_in::UAR)),
        MLX5_CMD_OP_ALLOC_TRANSPORT_DOMAIN => (Td, Create(alloc_transport_domain_out::TRANSPORT_DOMAIN)),
        MLX5_CMD_OP_DEALLOC_TRANSPORT_DOMAIN => (Td, Destroy(dealloc_transport_domain_in::TRANSPORT_DOMAIN)),
        MLX5_CMD_OP_ALLOC_XRCD => (Xrcd, Create(alloc_xrcd_out::XRCD)),
        MLX5_CMD_OP_DEALLOC_XRCD => (Xrcd, Destroy(dealloc_xrcd_in::XRCD)),
        MLX5_CMD_OP_CREATE_CQ => (Cq, Create(create_cq_out::CQN)),
        MLX5_CMD_OP_DESTROY_CQ => (Cq, Destroy(destroy_cq_in::CQN)),
        MLX5_CMD_OP_QUERY_CQ => (Cq, Use(query_cq_in::CQN)),
        MLX5_CMD_OP_MODIFY_CQ => (Cq, Use(modify_cq_in::CQN)),
        MLX5_CMD_OP_CREATE_QP => (Qp, Create(create_qp_out::QPN)),
        MLX5_CMD_OP_DESTROY_QP => (Qp, Destroy(destroy_qp_in::QPN)),
        MLX5_CMD_OP_QUERY_QP => (Qp, Use(query_qp_in::QPN)),
        MLX5_CMD_OP_RST2INIT_QP => (Qp, Use(rst2init_qp_in::QPN)),
        MLX5_CMD_OP_INIT2INIT_QP => (Qp, Use(init2init_qp_in::QPN)),
        MLX5_CMD_OP_INIT2RTR_QP => (Qp, Use(init2rtr_qp_in::QPN)),
        MLX5_CMD_OP_RTR2RTS_QP => (Qp, Use(rtr2rts_qp_in::QPN)),
        MLX5_CMD_OP_RTS2RTS_QP => (Qp, Use(rts2rts_qp_in::QPN)),
        MLX5_CMD_OP_2ERR_QP => (Qp, Use(qp_2err_in::QPN)),
        MLX5_CMD_OP_2RST_QP => (Qp, Use(qp_2rst_in::QPN)),
        MLX5_CMD_OP_CREATE_SRQ => (Srq, Create(create_srq_out::SRQN)),
        MLX5_CMD_OP_DESTROY_SRQ => (Srq, Destroy(destroy_srq_in::SRQN)),
        MLX5_CMD_OP_QUERY_SRQ => (Srq, Use(query_srq_in::SRQN)),
        MLX5_CMD_OP_ARM_RQ => (Srq, Use(arm_rq_in::SRQ_NUMBER)),
        MLX5_CMD_OP_CREATE_XRC_SRQ => (Srq, Create(create_xrc_srq_out::XRC_SRQN)),
        MLX5_CMD_OP_DESTROY_XRC_SRQ => (Srq, Destroy(destroy_xrc_srq_in::XRC_SRQN)),
        MLX5_CMD_OP_CREATE_RMP => (Srq, Create(create_rmp_out::RMPN)),
        MLX5_CMD_OP_DESTROY_RMP => (Srq, Destroy(destroy_rmp_in::RMPN)),
        MLX5_CMD_OP_QUERY_RMP => (Srq, Use(query_rmp_in::RMPN)),
        MLX5_CMD_OP_MODIFY_RMP => (Srq, Use(modify_rmp_in::RMPN)),
        MLX5_CMD_OP_CREATE_MKEY => (Mkey, Create(create_mkey_out::MKEY_INDEX)),
        MLX5_CMD_OP_DESTROY_MKEY => (Mkey, Destroy(destroy_mkey_in::MKEY_INDEX)),
        MLX5_CMD_OP_ALLOC_Q_COUNTER => (QCounter, Create(alloc_q_counter_out::COUNTER_SET_ID)),
        MLX5_CMD_OP_DEALLOC_Q_COUNTER => (QCounter, Destroy(dealloc_q_counter_in::COUNTER_SET_ID)),
        MLX5_CMD_OP_QUERY_Q_COUNTER => (QCounter, Use(query_q_counter_in::COUNTER_SET_ID)),
        MLX5_CMD_OP_CREATE_TIS => (Tis, Create(create_tis_out::TISN)),
        MLX5_CMD_OP_DESTROY_TIS => (Tis, Destroy(destroy_tis_in::TISN)),
        MLX5_CMD_OP_CREATE_TIR => (Tir, Create(create_tir_out::TIRN)),
        MLX5_CMD_OP_MODIFY_TIR => (Tir, Use(modify_tir_in::TIRN)),
        MLX5_CMD_OP_DESTROY_TIR => (Tir, Destroy(destroy_tir_in::TIRN)),
        MLX5_CMD_OP_CREATE_RQT => (Rqt, Create(create_rqt_out::RQTN)),
        MLX5_CMD_OP_MODIFY_RQT => (Rqt, Use(modify_rqt_in::RQTN)),
        MLX5_CMD_OP_DESTROY_RQT => (Rqt, Destroy(destroy_rqt_in::RQTN)),
        MLX5_CMD_OP_CREATE_RQ => (Rq, Create(create_rq_out::RQN)),
        MLX5_CMD_OP_MODIFY_RQ => (Rq, Use(modify_rq_in::RQN)),
        MLX5_CMD_OP_QUERY_RQ => (Rq, Use(query_rq_in::RQN)),
        MLX5_CMD_OP_DESTROY_RQ => (Rq, Destroy(destroy_rq_in::RQN)),
        MLX5_CMD_OP_CREATE_SQ => (Sq, Create(create_sq_out::SQN)),
        MLX5_CMD_OP_MODIFY_SQ => (Sq, Use(modify_sq_in::SQN)),
        MLX5_CMD_OP_QUERY_SQ => (Sq, Use(query_sq_in::SQN)),
        MLX5_CMD_OP_DESTROY_SQ => (Sq, Destroy(destroy_sq_in::SQN)),
        MLX5_CMD_OP_CREATE_UMEM => (Umem, Create(create_umem_out::UMEM_ID)),
        MLX5_CMD_OP_DESTROY_UMEM => (Umem, Destroy(destroy_umem_in::UMEM_ID)),
        _ => return None,
    })
}

/// The live user contexts (their `uid` and `cap`) and the owner of every object created with a `uid`.
#[derive(Debug)]
pub(crate) struct UctxTable {
    uids: IdSet,
    caps: BTreeMap<u32, u32>,
    owners: BTreeMap<(Kind, u32), u16>,
}

impl UctxTable {
    pub(crate) fn new() -> Self {
        Self { uids: IdSet::new(1), caps: BTreeMap::new(), owners: BTreeMap::new() }
    }

    pub(crate) fn len(&self) -> usize {
        self.uids.len()
    }

    /// The `cap` a live context was opened with.
    #[cfg(test)]
    pub(crate) fn cap(&self, uid: u16) -> Option<u32> {
        self.caps.get(&u32::from(uid)).copied()
    }

    pub(super) fn create(&mut self, caps: &Caps, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        let log_max = caps.gen(ifc::cmd_hca_cap::LOG_MAX_UCTX);
        if log_max == 0 {
            return Err(err(CmdStatus::BadOp, syndrome::BAD_OPCODE));
        }
        let cap = rd(inp, ifc::uctx::CAP.at(ifc::create_uctx_in::UCTX));
        if cap & !caps.gen(ifc::cmd_hca_cap::UCTX_CAP) != 0 {
            return Err(bad_param(syndrome::UCTX_CAP));
        }
        // uid is 16 bits: 0 is the kernel's and 0xffff means shared.
        let limit = (1u32 << log_max.min(16)).min(SHARED);
        let uid = self.uids.take(1, limit).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.caps.insert(uid, cap);
        out.set(ifc::create_uctx_out::UID, uid);
        Ok(())
    }

    pub(super) fn destroy(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let uid = rd(inp, ifc::destroy_uctx_in::UID);
        if uid == 0 || !self.uids.contains(uid) {
            return Err(bad_param(syndrome::UID_INVALID));
        }
        if self.owners.values().any(|&o| u32::from(o) == uid) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.uids.give_back(uid);
        self.caps.remove(&uid);
        Ok(())
    }

    /// Whether a command's header `uid` may be used: 0 (the kernel) or a live context.
    pub(super) fn check_uid(&self, uid: u16) -> Result<(), CmdErr> {
        if uid == 0 || u32::from(uid) == SHARED || self.uids.contains(uid.into()) {
            Ok(())
        } else {
            Err(bad_param(syndrome::UID_INVALID))
        }
    }

    /// Before a command runs: a context may use or destroy only the objects it owns.
    pub(super) fn check_access(&self, uid: u16, kind: Kind, role: Role, inp: &[u8]) -> Result<(), CmdErr> {
        let (Role::Use(f) | Role::Destroy(f)) = role else { return Ok(()) };
        let owner = self.owners.get(&(kind, rd(inp, f))).copied().unwrap_or(0);
        if uid != 0 && owner != uid && u32::from(owner) != SHARED {
            return Err(bad_param(syndrome::UID_MISMATCH));
        }
        Ok(())
    }

    /// After a command succeeded: records the owner of what it created, forgets what it destroyed.
    pub(super) fn record(&mut self, uid: u16, kind: Kind, role: Role, inp: &[u8], out: &[u8]) {
        match role {
            Role::Create(f) if uid != 0 => {
                self.owners.insert((kind, rd(out, f)), uid);
            }
            // A number a kernel command created may have been owned before and freed by a reset path.
            Role::Create(f) => {
                self.owners.remove(&(kind, rd(out, f)));
            }
            Role::Destroy(f) => {
                self.owners.remove(&(kind, rd(inp, f)));
            }
            Role::Use(_) => {}
        }
    }

    /// TEARDOWN_HCA: every context and object goes.
    pub(crate) fn clear(&mut self) {
        *self = Self::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::submit::Harness;

    fn create_uctx(h: &mut Harness, cap: u32) -> (u8, u32, u16) {
        let mut inp = vec![0u8; ifc::create_uctx_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_UCTX.into());
        inp.set(ifc::uctx::CAP.at(ifc::create_uctx_in::UCTX), cap);
        let (s, syn, out) = h.cmd(&inp, ifc::create_uctx_out::SIZE_BYTES);
        (s, syn, MsgBuf::get(&out[..], ifc::create_uctx_out::UID) as u16)
    }

    fn destroy_uctx(h: &mut Harness, uid: u16) -> (u8, u32) {
        let mut inp = vec![0u8; ifc::destroy_uctx_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_DESTROY_UCTX.into());
        inp.set(ifc::destroy_uctx_in::UID, uid.into());
        let (s, syn, _) = h.cmd(&inp, ifc::destroy_uctx_out::SIZE_BYTES);
        (s, syn)
    }

    fn alloc_pd(h: &mut Harness, uid: u16) -> (u8, u32, u32) {
        let mut inp = vec![0u8; ifc::alloc_pd_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_ALLOC_PD.into());
        inp.set(ifc::mbox_in::UID, uid.into());
        let (s, syn, out) = h.cmd(&inp, ifc::alloc_pd_out::SIZE_BYTES);
        (s, syn, MsgBuf::get(&out[..], ifc::alloc_pd_out::PD))
    }

    fn dealloc_pd(h: &mut Harness, uid: u16, pd: u32) -> (u8, u32) {
        let mut inp = vec![0u8; ifc::dealloc_pd_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_DEALLOC_PD.into());
        inp.set(ifc::mbox_in::UID, uid.into());
        inp.set(ifc::dealloc_pd_in::PD, pd);
        let (s, syn, _) = h.cmd(&inp, ifc::dealloc_pd_out::SIZE_BYTES);
        (s, syn)
    }

    const BAD_PARAM: u8 = consts::MLX5_CMD_STAT_BAD_PARAM_ERR;

    #[test]
    fn contexts_get_distinct_uids_and_go_once() {
        let mut h = Harness::inline();
        h.bring_up();
        let (s, syn, a) = create_uctx(&mut h, 0);
        assert_eq!((s, syn), (0, 0));
        let (_, _, b) = create_uctx(&mut h, 0);
        assert!(a != 0 && b != 0 && a != b, "uids {a} {b}");
        assert_eq!(h.dev.with_fw(|fw| fw.uctxs.cap(a)), Some(0));
        assert_eq!(h.dev.with_fw(|fw| fw.uctxs.len()), 2);
        assert_eq!(destroy_uctx(&mut h, a), (0, 0));
        // Destroyed once: again, the kernel's uid 0, or one never handed out are refused.
        assert_eq!(destroy_uctx(&mut h, a), (BAD_PARAM, syndrome::UID_INVALID));
        assert_eq!(destroy_uctx(&mut h, 0), (BAD_PARAM, syndrome::UID_INVALID));
        assert_eq!(destroy_uctx(&mut h, 0x7777), (BAD_PARAM, syndrome::UID_INVALID));
        assert_eq!(h.dev.with_fw(|fw| fw.uctxs.len()), 1);
    }

    #[test]
    fn a_general_command_runs_with_a_live_uid_only() {
        // DevX's general commands (mlx5_ib's MLX5_IB_METHOD_DEVX_OTHER) reach the firmware with the context's uid.
        let mut h = Harness::inline();
        h.bring_up();
        let (_, _, uid) = create_uctx(&mut h, 0);
        let mut q = vec![0u8; ifc::query_hca_cap_in::SIZE_BYTES];
        q.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_CAP.into());
        q.set(ifc::mbox_in::OP_MOD, consts::HCA_CAP_OPMOD_GET_CUR);
        q.set(ifc::mbox_in::UID, uid.into());
        let (s, syn, out) = h.cmd(&q, ifc::query_hca_cap_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0));
        let log_max_uctx = ifc::cmd_hca_cap::LOG_MAX_UCTX.at(ifc::query_hca_cap_out::CAPABILITY);
        assert_ne!(MsgBuf::get(&out[..], log_max_uctx), 0);
        assert_eq!(destroy_uctx(&mut h, uid), (0, 0));
        let (s, syn, _) = h.cmd(&q, ifc::query_hca_cap_out::SIZE_BYTES);
        assert_eq!((s, syn), (BAD_PARAM, syndrome::UID_INVALID));
    }

    #[test]
    fn a_cap_the_device_does_not_offer_is_refused() {
        let mut h = Harness::inline();
        h.bring_up();
        let (s, syn, _) = create_uctx(&mut h, consts::MLX5_UCTX_CAP_INTERNAL_DEV_RES);
        assert_eq!((s, syn), (BAD_PARAM, syndrome::UCTX_CAP));
        assert_eq!(h.dev.with_fw(|fw| fw.uctxs.len()), 0);
    }

    #[test]
    fn objects_belong_to_their_uid() {
        let mut h = Harness::inline();
        h.bring_up();
        let (_, _, a) = create_uctx(&mut h, 0);
        let (_, _, b) = create_uctx(&mut h, 0);
        // A header uid that is no live context creates nothing.
        let (s, syn, _) = alloc_pd(&mut h, 0x7777);
        assert_eq!((s, syn), (BAD_PARAM, syndrome::UID_INVALID));
        let (s, syn, pd) = alloc_pd(&mut h, a);
        assert_eq!((s, syn), (0, 0));
        // Another context may not free it, nor may its owner go while it lives.
        assert_eq!(dealloc_pd(&mut h, b, pd), (BAD_PARAM, syndrome::UID_MISMATCH));
        let in_use = consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR;
        assert_eq!(destroy_uctx(&mut h, a), (in_use, syndrome::IN_USE));
        assert_eq!(dealloc_pd(&mut h, a, pd), (0, 0));
        assert_eq!(destroy_uctx(&mut h, a), (0, 0));
        // The kernel's objects are not a context's either.
        let (_, _, kpd) = alloc_pd(&mut h, 0);
        assert_eq!(dealloc_pd(&mut h, b, kpd), (BAD_PARAM, syndrome::UID_MISMATCH));
        assert_eq!(dealloc_pd(&mut h, 0, kpd), (0, 0));
        // A shared object is every context's.
        let (s, syn, spd) = alloc_pd(&mut h, 0xffff);
        assert_eq!((s, syn), (0, 0));
        assert_eq!(dealloc_pd(&mut h, b, spd), (0, 0));
    }
}
