//! Shared receive queues of an HCA (mlx5_ib `srq.c` `mlx5_ib_create_srq` / `_modify_srq` / `_query_srq` /
//! `_destroy_srq` for a kernel consumer, `srq_cmd.c` for the commands): an RMP once ISSI 1 is agreed, an SRQ at
//! ISSI 0, and QPs that receive through one.

use crate::hal::{DelayNs, Dma, Mmio};
use crate::qp::{PostError, PostErrorKind, Qp, RecvWr};
use crate::srq::{
    destroy_rmp, destroy_srq, ArmSrq, CreateRmp, CreateSrq, ModifyRmpLwm, QueryRmp, QuerySrq, Srq, SrqContext, SrqKind,
    SrqSizes,
};
use crate::trace::CmdTrace;

use super::error::Error;
use super::objects::{DestroyError, Pd, QpInitAttr};
use super::queue_mem::QueueSpec;
use super::{Hca, HcaState, Tables};
use crate::cmd::Pas;
use crate::cq::Cq;

/// What a new SRQ should be, and what `ibv_query_srq` reports (`ibv_srq_attr`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SrqAttr {
    /// Work requests it holds at once.
    pub max_wr: u32,
    /// SGEs per work request.
    pub max_sge: u32,
    /// The limit: an `SrqLimitReached` event once fewer work requests than this are posted (0: none).
    pub srq_limit: u32,
}

impl<M: Mmio, D: Dma, T: CmdTrace, S: Tables> Hca<M, D, T, S> {
    /// Creates a shared receive queue (`mlx5_ib_create_srq` for a kernel consumer): sizes checked against
    /// `log_max_srq_sz` and `max_wqe_sz_rq`, the ring's WQEs linked into the free list, a doorbell record, then
    /// CREATE_RMP (ISSI 1) or CREATE_SRQ (ISSI 0). `attr.srq_limit` goes into the context's `lwm` (mlx5_ib
    /// always passes 0 there; verbs lets a create ignore the limit). Returns the SRQ; [`Srq::max_wr`] is what it
    /// holds, at least `attr.max_wr`.
    pub fn create_srq(&mut self, pd: &Pd, attr: SrqAttr, delay: &mut impl DelayNs) -> Result<Srq, Error> {
        let kind = SrqKind::for_issi(self.issi());
        self.check_state(kind.create_opcode())?;
        let g = &self.caps.general;
        let max_sge = u32::from(g.max_wqe_sz_rq) / crate::prm::c::mlx5_wqe_data_seg::SIZE as u32;
        let sizes = SrqSizes::new(attr.max_wr, attr.max_sge, g.log_max_srq_sz, g.max_wqe_sz_rq.into()).ok_or(
            if attr.max_sge > max_sge {
                Error::BadSize { what: "SRQ SGEs", requested: attr.max_sge.into(), max: max_sge.into() }
            } else {
                Error::BadSize {
                    what: "SRQ work requests",
                    requested: attr.max_wr.into(),
                    // WQE indices are 16 bits (`SrqSizes::new`), whatever the device allows.
                    max: ((1u64 << g.log_max_srq_sz) - 1).min(u64::from(u16::MAX)),
                }
            },
        )?;
        let lwm = u16::try_from(attr.srq_limit).ok().filter(|&l| u32::from(l) < sizes.max).ok_or(Error::BadSize {
            what: "SRQ limit",
            requested: attr.srq_limit.into(),
            max: u64::from(sizes.max) - 1,
        })?;
        let spec = QueueSpec { buf_len: sizes.buf_bytes(), shadow_len: Some(Srq::shadow_len(&sizes)) };
        let (srqn, mut mem) = self.create_queue(spec, |hca, mem| {
            Srq::init_buf(&mem.buf, &sizes);
            let pages = mem.buf.pages();
            let list = pages.list();
            let ctx = SrqContext {
                log_size: sizes.log_size(),
                wqe_shift: sizes.wqe_shift,
                log_page_size: pages.layout.log_page_size(),
                page_offset: 0,
                lwm,
                pd: pd.pdn(),
                dbr_addr: mem.dbrec.iova(),
            };
            match kind {
                SrqKind::Rmp => hca.exec(&mut CreateRmp { ctx, pas: Pas::Source(&list) }, delay),
                SrqKind::Srq => hca.exec(&mut CreateSrq { ctx, pas: Pas::Source(&list) }, delay),
            }
        })?;
        let shadow = mem.take_shadow();
        Ok(Srq::new(mem.buf, mem.dbrec, shadow, srqn, kind, sizes))
    }

    /// Sets the SRQ limit (`mlx5_ib_modify_srq` with `IB_SRQ_LIMIT`): MODIFY_RMP of `lwm` (ISSI 1) or ARM_RQ
    /// (ISSI 0). The device raises one `SrqLimitReached` event when fewer work requests than the limit are
    /// posted, then the limit is 0 until set again. A limit at or above the ring size is refused, as is resizing
    /// (mlx5_ib does not support it).
    pub fn modify_srq(&mut self, srq: &mut Srq, srq_limit: u32, delay: &mut impl DelayNs) -> Result<(), Error> {
        let max = srq.sizes().max;
        let lwm = u16::try_from(srq_limit).ok().filter(|&l| u32::from(l) < max).ok_or(Error::BadSize {
            what: "SRQ limit",
            requested: srq_limit.into(),
            max: u64::from(max) - 1,
        })?;
        match srq.kind() {
            SrqKind::Rmp => self.exec(&mut ModifyRmpLwm { rmpn: srq.srqn(), lwm }, delay),
            SrqKind::Srq => self.exec(&mut ArmSrq { srqn: srq.srqn(), lwm }, delay),
        }
    }

    /// `ibv_query_srq` (`mlx5_ib_query_srq`): the limit from QUERY_RMP / QUERY_SRQ, `max_wr` and `max_sge` from
    /// the SRQ as created.
    pub fn query_srq(&mut self, srq: &Srq, delay: &mut impl DelayNs) -> Result<SrqAttr, Error> {
        let state = match srq.kind() {
            SrqKind::Rmp => self.exec(&mut QueryRmp { rmpn: srq.srqn() }, delay)?,
            SrqKind::Srq => self.exec(&mut QuerySrq { srqn: srq.srqn() }, delay)?,
        };
        Ok(SrqAttr { max_wr: srq.max_wr(), max_sge: srq.sizes().max_gs, srq_limit: state.lwm.into() })
    }

    /// DESTROY_RMP / DESTROY_SRQ, then the ring, record and bookkeeping are freed. Firmware refuses it while a
    /// QP receives through the SRQ; the SRQ then comes back.
    #[allow(clippy::result_large_err)]
    pub fn destroy_srq(&mut self, mut srq: Srq, delay: &mut impl DelayNs) -> Result<(), DestroyError<Srq>> {
        let cmd = match srq.kind() {
            SrqKind::Rmp => destroy_rmp(srq.srqn()),
            SrqKind::Srq => destroy_srq(srq.srqn()),
        };
        match self.exec_destroy(cmd, delay) {
            Ok(()) => {
                // SAFETY: the SRQ is destroyed (or the device dead): the device no longer reads its ring or record;
                // the shadow array was never the device's.
                unsafe {
                    srq.buf.free(self.cmdq.dma());
                    let _ = self.dbr.free(self.cmdq.dma(), srq.dbrec);
                    self.cmdq.dma().free(srq.shadow);
                }
                Ok(())
            }
            Err(error) => Err(DestroyError { obj: srq, error }),
        }
    }

    /// Posts receive work requests to an SRQ (`ibv_post_srq_recv`).
    pub fn post_srq_recv(&self, srq: &mut Srq, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        if !matches!(self.state(), HcaState::Up) {
            return Err(PostError { index: 0, kind: PostErrorKind::DeviceError });
        }
        srq.post_srq_recv(self.cmdq.mmio(), wrs)
    }

    /// Creates a QP that receives through `srq` (`ibv_create_qp` with `init_attr.srq`): `rq_type` SRQ and the
    /// SRQ's number in the qpc, no receive queue of its own (`max_recv_wr` and `max_recv_sge` are granted as 0).
    /// Its receive completions are resolved through the SRQ ([`crate::srq::WithSrqs`]).
    pub fn create_qp_with_srq(
        &mut self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        attr: QpInitAttr,
        srq: &Srq,
        delay: &mut impl DelayNs,
    ) -> Result<Qp, Error> {
        self.create_qp_on(pd, send_cq, recv_cq, attr, Some(srq.srqn()), delay)
    }
}
