//! [`SimDma`], the driver's handle to the device's DMA space (`dma.rs`): allocations and frees go through the
//! device lock, and a free checks it against the pages firmware still owns.

use std::ptr::NonNull;
use std::sync::Arc;

use mlx5_core::hal::{Dma, DmaError, DmaRegion};

use crate::device::{lock, Shared};
use crate::events::SimEvent;

/// The simulator's [`Dma`] allocator: zeroed host memory behind fresh, never reused IOVAs.
#[derive(Clone, Debug)]
pub struct SimDma {
    pub(crate) shared: Arc<Shared>,
}

// SAFETY: regions come from `alloc_zeroed` with the requested alignment (IOVAs aligned to at least the same),
// are never handed out twice while live (fresh IOVAs, distinct allocations), stay valid until `free` (even if the
// last handle to the device goes first: see `DmaSpace`'s `Drop`), and the
// simulated device reads and writes the same host memory, so it is coherent by construction.
unsafe impl Dma for SimDma {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        lock(&self.shared).dma.alloc(len, align)
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        lock(&self.shared).dma.iova_of(cpu, len)
    }

    unsafe fn map_user(&self, ptr: NonNull<u8>, len: usize) -> Result<DmaRegion, DmaError> {
        lock(&self.shared).dma.map_user(ptr, len)
    }

    unsafe fn free(&self, region: DmaRegion) {
        let mut st = lock(&self.shared);
        let owned = st.fw.pages.pages_in(region.iova(), region.len() as u64);
        if owned > 0 && st.dead() {
            // A dead firmware (or a vanished device) will never touch or return its pages again, so the driver
            // may free them: they are abandoned, not freed under the device.
            match st.dma.free(&region) {
                Ok(()) => st.fw.pages.abandon(region.iova(), region.len() as u64),
                Err(()) => st.events.push(SimEvent::BadFree { iova: region.iova(), len: region.len() }),
            }
            return;
        }
        if owned > 0 {
            st.events.push(SimEvent::FreedDeviceOwned { iova: region.iova(), len: region.len(), pages: owned });
        }
        if st.dma.free(&region).is_err() {
            st.events.push(SimEvent::BadFree { iova: region.iova(), len: region.len() });
        }
    }
}
