//! The memory a queue's create path takes (mlx5_ib `create_cq_kernel`, `_create_kernel_qp`, `create_srq_kernel`):
//! the ring, the host-only shadow array of a QP or SRQ, and the doorbell record, in that order, then the CREATE
//! command. [`Hca::create_queue`] is the one place that gives it back when the create fails, so the CQ, QP and SRQ
//! paths do not each unwind by hand.
//!
//! Two rules apply. Until the command is sent the device has seen none of it, so an allocation that fails frees
//! what came before it ([`DmaGuard`]). Once sent, only firmware's answer says what the device may still hold: a
//! status means it refused and holds nothing; any other failure (a timeout, a delivery error) may have left the
//! queue created, so its ring is kept until the function is disabled and its record stays marked in use.

use crate::buf::QueueBuf;
use crate::cmdq::CmdError;
use crate::dbr::DbRec;
use crate::hal::{Dma, DmaGuard, DmaRegion, Mmio};
use crate::trace::CmdTrace;

use super::error::Error;
use super::{Hca, Tables};

/// What a queue's memory is made of: ring bytes and, for a QP or SRQ, shadow-array bytes.
#[derive(Debug, Clone, Copy)]
pub(super) struct QueueSpec {
    /// Bytes of the ring buffer (the device's).
    pub(super) buf_len: usize,
    /// Bytes of the shadow array (the host's only), when the queue has one.
    pub(super) shadow_len: Option<usize>,
}

/// A queue's memory, allocated and handed to the CREATE command. Not freed on drop: once the command may have
/// reached the device, freeing needs its answer ([`Hca::create_queue`] decides), and a leak is the safe default.
#[derive(Debug)]
pub(super) struct QueueMem {
    /// The ring.
    pub(super) buf: QueueBuf,
    /// The shadow array, when [`QueueSpec::shadow_len`] asked for one.
    pub(super) shadow: Option<DmaRegion>,
    /// The doorbell record.
    pub(super) dbrec: DbRec,
}

impl QueueMem {
    /// The shadow array of a queue whose spec asked for one.
    pub(super) fn take_shadow(&mut self) -> DmaRegion {
        self.shadow.take().unwrap_or_else(|| unreachable!("the spec asked for a shadow array"))
    }
}

impl<M: Mmio, D: Dma, T: CmdTrace, S: Tables> Hca<M, D, T, S> {
    /// Allocates the memory of `spec` and runs `create` (which fills the ring and sends the CREATE command) over
    /// it. On success the memory comes back with the command's output, for the queue to own; on failure it is
    /// given back as the module's rules say, and the error is returned.
    pub(super) fn create_queue<R>(
        &mut self,
        spec: QueueSpec,
        create: impl FnOnce(&mut Self, &QueueMem) -> Result<R, Error>,
    ) -> Result<(R, QueueMem), Error> {
        let mem = self.alloc_queue_mem(spec)?;
        match create(self, &mem) {
            Ok(out) => Ok((out, mem)),
            Err(e) => {
                self.release_queue_mem(mem, &e);
                Err(e)
            }
        }
    }

    /// The ring, the shadow array and the doorbell record. A step that fails frees the earlier ones (their
    /// guards drop): the device has been shown none of them.
    fn alloc_queue_mem(&mut self, spec: QueueSpec) -> Result<QueueMem, Error> {
        let dma = self.cmdq.dma();
        let buf = QueueBuf::alloc(dma, spec.buf_len)?;
        // SAFETY: fresh from `dma`; the device learns of it only from the CREATE command, after `keep` below.
        let buf = unsafe { DmaGuard::new(dma, buf) };
        let shadow = match spec.shadow_len {
            Some(len) => {
                let r = dma.alloc(len, crate::qp::SHADOW_ALIGN)?;
                // SAFETY: fresh from `dma`; host-only, the device is never told of it.
                Some(unsafe { DmaGuard::new(dma, r) })
            }
            None => None,
        };
        let dbrec = self.dbr.alloc(dma).map_err(Error::Dbr)?;
        Ok(QueueMem { buf: buf.keep(), shadow: shadow.map(DmaGuard::keep), dbrec })
    }

    /// After the CREATE command (or what `create` did before it) failed with `e`: the ring is freed after a status,
    /// otherwise kept until the function is disabled (`drop_queue_buf`); the shadow array is always freed; the
    /// record is freed after a status, otherwise left in use until the pool is released after DISABLE_HCA.
    fn release_queue_mem(&mut self, mem: QueueMem, e: &Error) {
        let QueueMem { buf, shadow, dbrec } = mem;
        self.drop_queue_buf(buf, e);
        if let Some(shadow) = shadow {
            // SAFETY: the shadow array is host-only; the device never saw it.
            unsafe { self.cmdq.dma().free(shadow) };
        }
        if matches!(e, Error::Cmd(CmdError::Status { .. })) {
            // SAFETY: the create was refused, so no context holds the record.
            let _ = unsafe { self.dbr.free(self.cmdq.dma(), dbrec) };
        }
    }
}
