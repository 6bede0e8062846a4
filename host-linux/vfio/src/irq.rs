//! Interrupts: MSI-X (or MSI) vectors of a VFIO device delivered into eventfds (`VFIO_DEVICE_SET_IRQS` with
//! `DATA_EVENTFD | ACTION_TRIGGER`), and the blocking wait that turns an EQ interrupt into a verbs-style
//! completion-channel wakeup.

use std::sync::Arc;
use std::time::{Duration, Instant};

use mlx5_core::hal::{DelayNs, Dma, Mmio};
use mlx5_core::hca::{Error as HcaError, Hca, Tables};
use mlx5_core::trace::CmdTrace;

use super::abi::{self, Pod};
use super::sys::{Arg, RawFd, Sys};
use super::{ioctl_pod, sys_err, Fd, Result, VfioDevice, VfioError};

/// Which interrupt mechanism the vectors use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IrqKind {
    Msix,
    Msi,
}

impl IrqKind {
    fn index(self) -> u32 {
        match self {
            IrqKind::Msix => abi::VFIO_PCI_MSIX_IRQ_INDEX,
            IrqKind::Msi => abi::VFIO_PCI_MSI_IRQ_INDEX,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            IrqKind::Msix => "MSI-X",
            IrqKind::Msi => "MSI",
        }
    }
}

/// Interrupt vectors wired to eventfds. Dropping it disables the vectors, then closes the eventfds.
#[derive(Debug)]
pub struct Interrupts {
    sys: Arc<dyn Sys>,
    device: Arc<Fd>,
    kind: IrqKind,
    fds: Vec<Fd>,
}

impl Interrupts {
    /// Enables up to `want` vectors: MSI-X when the function has it, else MSI.
    pub fn enable(dev: &VfioDevice, want: u32) -> Result<Interrupts> {
        let msix = irq_count(dev, IrqKind::Msix)?;
        let kind = if msix > 0 { IrqKind::Msix } else { IrqKind::Msi };
        Self::enable_kind(dev, kind, want)
    }

    /// Enables `min(want, available)` vectors of `kind`, each signalling its own eventfd.
    pub fn enable_kind(dev: &VfioDevice, kind: IrqKind, want: u32) -> Result<Interrupts> {
        let sys = dev.sys().clone();
        let have = irq_count(dev, kind)?;
        let n = want.min(have);
        if n == 0 {
            return Err(VfioError::NoInterrupts { bdf: dev.bdf, kind: kind.name() });
        }
        let mut fds = Vec::with_capacity(n as usize);
        for _ in 0..n {
            let fd = sys.eventfd().map_err(sys_err("create an eventfd"))?;
            fds.push(Fd { sys: sys.clone(), fd });
        }
        let me = Interrupts { sys, device: dev.fd().clone(), kind, fds };
        let raw: Vec<RawFd> = me.fds.iter().map(Fd::raw).collect();
        me.set_irqs(abi::VFIO_IRQ_SET_DATA_EVENTFD | abi::VFIO_IRQ_SET_ACTION_TRIGGER, &raw).map_err(|e| match e {
            VfioError::Sys { source, .. } => {
                VfioError::Sys { what: format!("enable {n} {} vectors", kind.name()), source }
            }
            e => e,
        })?;
        Ok(me)
    }

    fn set_irqs(&self, flags: u32, fds: &[RawFd]) -> Result<()> {
        let hdr = abi::vfio_irq_set {
            argsz: (std::mem::size_of::<abi::vfio_irq_set>() + 4 * fds.len()) as u32,
            flags,
            index: self.kind.index(),
            start: 0,
            count: fds.len() as u32,
        };
        let mut b = hdr.as_bytes().to_vec();
        for fd in fds {
            b.extend_from_slice(&fd.to_ne_bytes());
        }
        // SAFETY: VFIO_DEVICE_SET_IRQS takes an argsz-led vfio_irq_set followed by its eventfds, which b holds.
        unsafe { self.sys.ioctl(self.device.raw(), abi::VFIO_DEVICE_SET_IRQS, Arg::Buf(&mut b)) }
            .map_err(sys_err("set IRQs"))?;
        Ok(())
    }

    pub fn kind(&self) -> IrqKind {
        self.kind
    }

    pub fn count(&self) -> usize {
        self.fds.len()
    }

    /// The eventfd of `vector`, to hand to an event loop (epoll, tokio's AsyncFd).
    pub fn eventfd(&self, vector: usize) -> Option<RawFd> {
        self.fds.get(vector).map(Fd::raw)
    }

    /// Blocks until `vector` fires or `timeout` passes; returns how many interrupts arrived (0 on timeout).
    pub fn wait(&self, vector: usize, timeout: Duration) -> Result<u64> {
        let fd = self.eventfd(vector).ok_or(VfioError::Sys {
            what: format!("wait for vector {vector}"),
            source: std::io::ErrorKind::InvalidInput.into(),
        })?;
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        match self.sys.wait_readable(&[fd], ms).map_err(sys_err("wait for an interrupt"))? {
            Some(_) => self.sys.read_eventfd(fd).map_err(sys_err("read an interrupt eventfd")),
            None => Ok(0),
        }
    }

    /// Blocks until any vector fires; returns `(vector, count)`, or `None` on timeout.
    pub fn wait_any(&self, timeout: Duration) -> Result<Option<(usize, u64)>> {
        let raw: Vec<RawFd> = self.fds.iter().map(Fd::raw).collect();
        let ms = timeout.as_millis().min(i32::MAX as u128) as i32;
        match self.sys.wait_readable(&raw, ms).map_err(sys_err("wait for an interrupt"))? {
            Some(i) => Ok(Some((i, self.sys.read_eventfd(raw[i]).map_err(sys_err("read an interrupt eventfd"))?))),
            None => Ok(None),
        }
    }
}

impl Drop for Interrupts {
    fn drop(&mut self) {
        // DATA_NONE | ACTION_TRIGGER with count 0 disables the whole index before the eventfds close.
        if let Err(e) = self.set_irqs(abi::VFIO_IRQ_SET_DATA_NONE | abi::VFIO_IRQ_SET_ACTION_TRIGGER, &[]) {
            log::warn!("disabling {} vectors failed: {e}", self.kind.name());
        }
    }
}

fn irq_count(dev: &VfioDevice, kind: IrqKind) -> Result<u32> {
    let i = abi::vfio_irq_info {
        argsz: std::mem::size_of::<abi::vfio_irq_info>() as u32,
        index: kind.index(),
        ..Default::default()
    };
    // SAFETY: VFIO_DEVICE_GET_IRQ_INFO takes an argsz-led vfio_irq_info.
    let i = unsafe { ioctl_pod(&**dev.sys(), dev.fd().raw(), abi::VFIO_DEVICE_GET_IRQ_INFO, i, "get IRQ info") }?;
    Ok(if i.flags & abi::VFIO_IRQ_INFO_EVENTFD != 0 { i.count } else { 0 })
}

/// Why [`wait_cq_event`] returned without an event.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    #[error("{0}")]
    Hca(#[from] HcaError),
    #[error("{0}")]
    Vfio(#[from] VfioError),
}

/// The completion channel's blocking `ibv_get_cq_event` on Linux: returns the CQN of the next completion event,
/// sleeping on the EQ's interrupt vector between looks, or `None` after `timeout`.
///
/// No wakeup is lost: the EQ is re-armed when it is drained, and an interrupt that arrives between the drain and
/// the wait leaves the eventfd's counter non-zero, so the wait returns at once.
pub fn wait_cq_event<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(
    hca: &mut Hca<M, D, T, S>,
    irqs: &Interrupts,
    vector: usize,
    delay: &mut impl DelayNs,
    timeout: Duration,
) -> core::result::Result<Option<u32>, WaitError> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(cqn) = hca.get_cq_event(delay)? {
            return Ok(Some(cqn));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(None);
        }
        irqs.wait(vector, left)?;
    }
}
