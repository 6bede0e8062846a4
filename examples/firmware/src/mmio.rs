//! [`Mmio`] over a fixed physical window: the HCA's BAR 0 as the SoC's PCIe controller maps it into the CPU's
//! address space (its outbound window). Raw-pointer volatile accesses, never references (a reference to device
//! memory lets the compiler add reads), big endian as the trait documents.

use mlx5_core::hal::Mmio;

/// BAR 0 of the ConnectX at a fixed CPU address.
///
/// What the platform must have done before [`Bar::new`]: PCIe link up, the function's BAR 0 assigned a bus address
/// inside the controller's outbound window (by boot firmware or a small enumeration), memory space and bus
/// mastering enabled in its command register. On Cortex-M the window sits in a Device-memory region (the default
/// map makes 0x4000_0000..0x5FFF_FFFF and 0xA000_0000..0xDFFF_FFFF Device), so accesses are neither cached nor
/// merged nor reordered with each other.
#[derive(Debug)]
pub struct Bar {
    base: usize,
}

impl Bar {
    /// # Safety
    /// `base` is the CPU address of the HCA's BAR 0, mapped as Device memory for the whole BAR (the init segment,
    /// the UAR pages the driver allocates), and nothing else accesses the HCA's registers while this `Bar` lives.
    pub const unsafe fn new(base: usize) -> Self {
        Self { base }
    }

    fn reg<T>(&self, off: usize) -> *mut T {
        debug_assert!(off & (core::mem::align_of::<T>() - 1) == 0, "misaligned register offset {off:#x}");
        (self.base + off) as *mut T
    }
}

impl Mmio for Bar {
    fn read32(&self, off: usize) -> u32 {
        // SAFETY: the register lies in the BAR that `new`'s caller vouched for; offsets come from the PRM layouts.
        u32::from_be(unsafe { self.reg::<u32>(off).read_volatile() })
    }

    fn write32(&self, off: usize, v: u32) {
        // SAFETY: as in read32.
        unsafe { self.reg::<u32>(off).write_volatile(v.to_be()) }
    }

    fn read64(&self, off: usize) -> u64 {
        #[cfg(target_pointer_width = "64")]
        {
            // SAFETY: as in read32; one 64-bit load.
            u64::from_be(unsafe { self.reg::<u64>(off).read_volatile() })
        }
        #[cfg(not(target_pointer_width = "64"))]
        {
            // Two 32-bit loads, the high (first) word first; the registers the driver reads this way are stable
            // while it reads them.
            (u64::from(self.read32(off)) << 32) | u64::from(self.read32(off + 4))
        }
    }

    fn write64(&self, off: usize, v: u64) {
        #[cfg(target_pointer_width = "64")]
        {
            // SAFETY: as in read32; one 64-bit store, as the doorbells need.
            unsafe { self.reg::<u64>(off).write_volatile(v.to_be()) }
        }
        #[cfg(not(target_pointer_width = "64"))]
        {
            // A 32-bit core has no 64-bit store to Device memory: ARMv7-M's STRD is two word accesses, each
            // single-copy atomic on its own. The HCA must still see one doorbell, so two things must hold:
            //  * no other write reaches the doorbell between the two words: interrupts are masked around the pair
            //    (Linux's `mlx5_write64` on 32-bit kernels takes a spinlock for the same reason), and the high word
            //    (lower address) goes first, then the low word, as Linux writes them;
            //  * the PCIe bridge forwards the two posted 32-bit writes in order, to consecutive addresses, and does
            //    not drop or reorder either. A bridge (AXI/AHB-to-PCIe) that gathers a 32-bit write followed by
            //    one to the next word into a single 8-byte memory-write TLP gives the device exactly what a 64-bit
            //    CPU would; one that does not still works the way Linux on 32-bit hosts drives a ConnectX (two
            //    4-byte TLPs, high word first). What must never happen is a lone half reaching the device with
            //    another doorbell's half: that is what the masked interrupts prevent on this core.
            let b = v.to_be_bytes();
            let first = u32::from_ne_bytes([b[0], b[1], b[2], b[3]]);
            let second = u32::from_ne_bytes([b[4], b[5], b[6], b[7]]);
            let p = self.reg::<u32>(off);
            let masked = irq::disable();
            // SAFETY: as in read32; the two words of the 8-byte register, in address order.
            unsafe {
                p.write_volatile(first);
                p.add(1).write_volatile(second);
            }
            irq::restore(masked);
        }
    }
}

/// Interrupt masking around the two halves of a 64-bit doorbell on a 32-bit core.
#[cfg(not(target_pointer_width = "64"))]
mod irq {
    /// Masks interrupts; returns whether they were already masked.
    #[inline(always)]
    pub fn disable() -> bool {
        #[cfg(target_arch = "arm")]
        {
            let primask: u32;
            // SAFETY: reads PRIMASK and sets it (interrupts masked); no memory is touched. Not `nomem`: the
            // doorbell stores must not move above the mask.
            unsafe {
                core::arch::asm!("mrs {}, PRIMASK", "cpsid i", out(reg) primask, options(nostack, preserves_flags))
            };
            primask & 1 == 1
        }
        #[cfg(not(target_arch = "arm"))]
        {
            true
        }
    }

    /// Unmasks interrupts unless they were masked before [`disable`].
    #[inline(always)]
    pub fn restore(was_masked: bool) {
        #[cfg(target_arch = "arm")]
        if !was_masked {
            // SAFETY: clears PRIMASK, which `disable` set; no memory is touched. Not `nomem`: the doorbell stores
            // must not move below the unmask.
            unsafe { core::arch::asm!("cpsie i", options(nostack, preserves_flags)) };
        }
        #[cfg(not(target_arch = "arm"))]
        let _ = was_masked;
    }
}
