//! Protection domains (`ibv_pd`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use mlx5_core::hca::Pd;

use crate::context::{Context, ContextShared};
use crate::error::{Result, VerbsError};
use crate::event::lock;

/// A protection domain without borrows. `users` counts the memory regions and QPs made in it; it changes only
/// under the control mutex, so a dealloc sees every object made before it.
#[derive(Debug)]
pub(crate) struct PdObj {
    pub(crate) ctx: Arc<ContextShared>,
    pdn: u32,
    /// The PD until deallocated.
    pub(crate) pd: Mutex<Option<Pd>>,
    pub(crate) users: AtomicUsize,
}

impl PdObj {
    pub(crate) fn alloc(ctx: &Arc<ContextShared>) -> Result<Arc<PdObj>> {
        let pd = {
            let mut c = ctx.dev.control();
            let (hca, delay) = c.parts();
            hca.alloc_pd(delay)?
        };
        Ok(Arc::new(PdObj { ctx: ctx.clone(), pdn: pd.pdn(), pd: Mutex::new(Some(pd)), users: AtomicUsize::new(0) }))
    }

    pub(crate) fn pdn(&self) -> u32 {
        self.pdn
    }

    /// `ibv_dealloc_pd`: refused with [`VerbsError::Busy`] (`EBUSY`) while memory regions or QPs use it.
    pub(crate) fn dealloc(&self) -> Result<()> {
        let mut c = self.ctx.dev.control();
        let users = self.users.load(Ordering::Acquire);
        if users > 0 {
            return Err(VerbsError::Busy { what: "protection domain", users });
        }
        let Some(pd) = lock(&self.pd).take() else { return Ok(()) };
        let (hca, delay) = c.parts();
        hca.dealloc_pd(pd, delay).map_err(|e| VerbsError::Destroy(e.error))
    }
}

/// A protection domain (`ibv_pd`). Memory regions and QPs borrow it, so it outlives them.
#[derive(Debug)]
pub struct ProtectionDomain<'ctx> {
    ctx: &'ctx Context,
    pub(crate) obj: Arc<PdObj>,
}

impl Context {
    /// `ibv_alloc_pd`.
    pub fn alloc_pd(&self) -> Result<ProtectionDomain<'_>> {
        Ok(ProtectionDomain { ctx: self, obj: PdObj::alloc(&self.shared)? })
    }
}

impl<'ctx> ProtectionDomain<'ctx> {
    pub fn pdn(&self) -> u32 {
        self.obj.pdn()
    }

    pub fn context(&self) -> &'ctx Context {
        self.ctx
    }

    /// `ibv_dealloc_pd`, returning firmware's error.
    pub fn destroy(self) -> Result<()> {
        self.obj.dealloc()
    }
}

impl Drop for ProtectionDomain<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.obj.dealloc() {
            log::error!("dealloc PD: {e}");
        }
    }
}
