//! [`DelayNs`] from the Cortex-M cycle counter (DWT `CYCCNT`, present on the Cortex-M3/M4/M7 this target covers).
//! The command queue's waits are polls with backoff (10 µs doubling to 1 ms), so a busy wait is all it needs.

use mlx5_core::hal::DelayNs;

/// Debug Exception and Monitor Control Register (ARMv7-M ARM, C1.6.5): bit 24 `TRCENA` powers the DWT.
const DEMCR: usize = 0xE000_EDFC;
const DEMCR_TRCENA: u32 = 1 << 24;
/// DWT control register (ARMv7-M ARM, C1.8.7): bit 0 `CYCCNTENA` starts the cycle counter.
const DWT_CTRL: usize = 0xE000_1000;
const DWT_CTRL_CYCCNTENA: u32 = 1;
/// DWT cycle count register (ARMv7-M ARM, C1.8.8): counts core clock cycles, wrapping at 2^32.
const DWT_CYCCNT: usize = 0xE000_1004;

/// Busy-waits on the cycle counter of a core clocked at `hz`.
#[derive(Debug)]
pub struct CycleDelay {
    hz: u32,
}

impl CycleDelay {
    /// Starts the cycle counter.
    ///
    /// # Safety
    /// Runs on an ARMv7-M core that implements the DWT cycle counter, clocked at `hz`; nothing else (a debugger
    /// excepted) reconfigures the DWT while this delay is in use.
    pub unsafe fn new(hz: u32) -> Self {
        // SAFETY: DEMCR and DWT_CTRL are architectural System Control Space registers, always mapped on ARMv7-M
        // (the caller's promise); read-modify-write sets one enable bit each and keeps the rest.
        unsafe {
            let demcr = DEMCR as *mut u32;
            demcr.write_volatile(demcr.read_volatile() | DEMCR_TRCENA);
            let ctrl = DWT_CTRL as *mut u32;
            ctrl.write_volatile(ctrl.read_volatile() | DWT_CTRL_CYCCNTENA);
        }
        Self { hz }
    }

    fn now() -> u32 {
        // SAFETY: CYCCNT is an architectural register, mapped on the core `new` was promised; reading it has no
        // side effect.
        unsafe { (DWT_CYCCNT as *const u32).read_volatile() }
    }

    /// Cycles in `ns` nanoseconds, rounded up so a delay is never shorter than asked.
    pub fn cycles(&self, ns: u32) -> u64 {
        (u64::from(ns) * u64::from(self.hz)).div_ceil(1_000_000_000)
    }
}

impl DelayNs for CycleDelay {
    fn delay_ns(&mut self, ns: u32) {
        let mut left = self.cycles(ns);
        // In steps well below the counter's wrap, so `wrapping_sub` always measures the true elapsed count.
        while left > 0 {
            let step = left.min(1 << 30) as u32;
            let start = Self::now();
            while Self::now().wrapping_sub(start) < step {
                core::hint::spin_loop();
            }
            left -= u64::from(step);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycle_counts_round_up() {
        // No DWT on the host: only the arithmetic is checked, never `new` or `now`.
        let d = CycleDelay { hz: 168_000_000 };
        assert_eq!(d.cycles(0), 0);
        assert_eq!(d.cycles(1), 1);
        assert_eq!(d.cycles(1_000), 168);
        assert_eq!(d.cycles(u32::MAX), 721_554_505_570 / 1000 + 1);
    }
}
