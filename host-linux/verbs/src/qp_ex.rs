//! Extended QPs (`ibv_create_qp_ex` with `send_ops_flags`, `ibv_qp_ex`): work requests built call by call
//! (`wr_start`, `wr_send`, `wr_rdma_write`, `wr_set_sge`, `wr_set_inline_data`, `wr_complete` / `wr_abort`) over
//! the core's [`QpEx`] / [`WrBatch`] model and posted with one doorbell by `wr_complete`.

use std::ops::{Deref, DerefMut};

use mlx5_core::qp::{QpEx, SendOpsFlags, WrBatch};

use crate::error::{Result, VerbsError};
use crate::pd::ProtectionDomain;
use crate::qp::{CanSend, QpInitAttr, QpObj, QueuePair, Reset};

impl<'ctx> ProtectionDomain<'ctx> {
    /// `ibv_create_qp_ex` with `IBV_QP_INIT_ATTR_SEND_OPS_FLAGS`: a QP whose sends may also be built with
    /// [`QueuePair::wr_start`]. Operations the QP type or this driver cannot do are refused before anything is
    /// created (`EOPNOTSUPP`): UD takes sends only, UC sends and RDMA writes, RC also reads and atomics.
    ///
    /// ```
    /// use mlx5_verbs::{Context, QpCap, QpInitAttr, QpType, SendOpsFlags};
    /// let ctx = Context::open_sim()?;
    /// let pd = ctx.alloc_pd()?;
    /// let cq = ctx.create_cq(16)?;
    /// let attr = QpInitAttr::new(QpType::Ud, &cq, &cq, QpCap { max_send_wr: 4, max_send_sge: 1, ..QpCap::default() });
    /// assert!(pd.create_qp_ex(attr, SendOpsFlags::RDMA_WRITE).is_err());
    /// let qp = pd.create_qp_ex(attr, SendOpsFlags::SEND)?;
    /// assert_eq!(qp.send_ops(), Some(SendOpsFlags::SEND));
    /// # Ok::<(), mlx5_verbs::VerbsError>(())
    /// ```
    pub fn create_qp_ex<'a>(
        &'a self,
        attr: QpInitAttr<'a, 'ctx>,
        send_ops: SendOpsFlags,
    ) -> Result<QueuePair<'a, Reset>> {
        let ex = QpEx::new(attr.qp_type, send_ops).map_err(VerbsError::QpEx)?;
        let qp = self.create_qp_with(attr)?;
        // A fresh QP: nothing has set it yet.
        let _ = qp.obj().ex.set(ex);
        Ok(qp)
    }
}

impl<S> QueuePair<'_, S> {
    /// The `send_ops_flags` of a QP made by [`ProtectionDomain::create_qp_ex`] (`None` for `create_qp`).
    pub fn send_ops(&self) -> Option<SendOpsFlags> {
        self.obj().ex.get().map(QpEx::send_ops)
    }
}

impl<S: CanSend> QueuePair<'_, S> {
    /// `ibv_wr_start` (on `ibv_qp_to_qp_ex` of this QP): an empty batch of work requests. Only a QP made by
    /// [`ProtectionDomain::create_qp_ex`] has the builder (`EOPNOTSUPP` otherwise).
    pub fn wr_start(&self) -> Result<QpWrBatch<'_>> {
        let ex = self.obj().ex.get().ok_or_else(|| {
            VerbsError::Invalid("wr_start: the QP was not created with create_qp_ex send_ops_flags".into())
        })?;
        Ok(QpWrBatch { qp: self.obj(), batch: ex.wr_start() })
    }
}

/// The work requests between `wr_start` and `wr_complete` / `wr_abort` of one QP: the core's [`WrBatch`] (its
/// `wr_*` calls, `wr_id` and `wr_flags`) bound to the QP it posts to.
#[derive(Debug)]
pub struct QpWrBatch<'q> {
    qp: &'q QpObj,
    batch: WrBatch,
}

impl Deref for QpWrBatch<'_> {
    type Target = WrBatch;
    fn deref(&self) -> &WrBatch {
        &self.batch
    }
}

impl DerefMut for QpWrBatch<'_> {
    fn deref_mut(&mut self) -> &mut WrBatch {
        &mut self.batch
    }
}

impl QpWrBatch<'_> {
    /// `ibv_wr_complete`: posts the batch with one doorbell (the QP's lock only). The first error a `wr_*` call
    /// met is returned instead and nothing is posted; a post error names the first request not posted, as with
    /// `post_send`.
    pub fn wr_complete(self) -> Result<()> {
        let qp = self.qp;
        let mut post_err = None;
        let r = self.batch.wr_complete_with(|wrs| match qp.post_send(wrs) {
            Ok(()) => Ok(()),
            Err(VerbsError::Post(e)) => Err(e),
            Err(e) => {
                post_err = Some(e);
                Ok(())
            }
        });
        if let Some(e) = post_err {
            return Err(e);
        }
        r.map_err(|e| match e {
            mlx5_core::qp::QpExError::Post(p) => VerbsError::Post(p),
            e => VerbsError::Invalid(format!("wr_complete: {e}")),
        })
    }

    /// `ibv_wr_abort`: nothing of the batch is posted.
    pub fn wr_abort(self) {
        self.batch.wr_abort();
    }
}
