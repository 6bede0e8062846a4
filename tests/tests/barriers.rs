//! The core's per-architecture barriers (`mlx5_core::hal::barrier`, and the `Mmio` methods that default to them)
//! are the instructions Linux uses for each (`arch/arm64/include/asm/barrier.h`, `arch/x86/include/asm/barrier.h`):
//! each is called, then its own code is read back and the instruction looked for. `cargo xtask aarch64` runs this
//! on aarch64 under QEMU; on x86-64 it runs with the host's tests.

use mlx5_core::hal::{barrier, Mmio};

/// An `Mmio` with only the register accesses: its barriers are the trait's defaults.
struct Plain;

impl Mmio for Plain {
    fn read32(&self, _: usize) -> u32 {
        0
    }
    fn write32(&self, _: usize, _: u32) {}
    fn read64(&self, _: usize) -> u64 {
        0
    }
    fn write64(&self, _: usize, _: u64) {}
}

/// The first `n` bytes of the code at `f` (the function's own, and possibly what follows it in the text segment).
fn code(f: usize, n: usize) -> Vec<u8> {
    // SAFETY: `f` is the address of a function of this program, in its text segment, which is mapped readable
    // (ELF text is R+X); `n` is at most 64 bytes, and no function here is followed by the segment's end within 64
    // bytes (the test binary's text is far larger, and these functions are not its last).
    (0..n).map(|i| unsafe { ((f + i) as *const u8).read_volatile() }).collect()
}

#[cfg(target_arch = "aarch64")]
mod arch {
    /// `dsb sy`, `dsb st`, `dmb oshst`, `dmb oshld` (Arm ARM C6.2: DSB/DMB with CRm = the option).
    pub const MB: Option<u32> = Some(0xd503_3f9f);
    pub const WMB: Option<u32> = Some(0xd503_3e9f);
    pub const DMA_WMB: Option<u32> = Some(0xd503_32bf);
    pub const DMA_RMB: Option<u32> = Some(0xd503_31bf);
    const RET: u32 = 0xd65f_03c0;

    /// The instruction words of the function whose code is `bytes`, up to its first `ret`.
    fn words(bytes: &[u8]) -> Vec<u32> {
        let all = bytes.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]]));
        all.take_while(|&w| w != RET).collect()
    }

    pub fn holds(bytes: &[u8], insn: u32) -> bool {
        words(bytes).contains(&insn)
    }

    /// No DMB or DSB of any kind before the first `ret`.
    pub fn holds_no_barrier(bytes: &[u8]) -> bool {
        words(bytes).iter().all(|w| w & 0xffff_f0df != 0xd503_309f)
    }
}

#[cfg(target_arch = "x86_64")]
mod arch {
    /// `mfence` and `sfence`, as the three bytes `0f ae f0` / `0f ae f8` read little-endian into a word; the DMA
    /// barriers are compiler barriers only (x86-64 keeps stores and loads in order).
    pub const MB: Option<u32> = Some(0x00f0_ae0f);
    pub const WMB: Option<u32> = Some(0x00f8_ae0f);
    pub const DMA_WMB: Option<u32> = None;
    pub const DMA_RMB: Option<u32> = None;

    fn fences(bytes: &[u8]) -> impl Iterator<Item = u32> + '_ {
        // Up to the first `ret` (a fence's bytes never hold 0xc3).
        let end = bytes.iter().position(|&b| b == 0xc3).unwrap_or(bytes.len());
        bytes[..end].windows(3).map(|w| u32::from_le_bytes([w[0], w[1], w[2], 0]))
    }

    pub fn holds(bytes: &[u8], insn: u32) -> bool {
        fences(bytes).any(|w| w == insn)
    }

    /// No mfence, sfence or lfence before the first `ret`.
    pub fn holds_no_barrier(bytes: &[u8]) -> bool {
        fences(bytes).all(|w| ![0x00f0_ae0f, 0x00f8_ae0f, 0x00e8_ae0f].contains(&w))
    }
}

/// A barrier's name, the address of its code, and the instruction it must hold (`None`: no barrier instruction).
type Barrier = (&'static str, usize, Option<u32>);

/// Runs the free function `f`, then names it for the check.
fn free(name: &'static str, f: fn(), want: Option<u32>) -> Barrier {
    f();
    (name, f as usize, want)
}

/// Runs the default method `f` on [`Plain`], then names it for the check.
fn method(name: &'static str, f: fn(&Plain), want: Option<u32>) -> Barrier {
    f(&Plain);
    (name, f as usize, want)
}

#[cfg(any(target_arch = "aarch64", target_arch = "x86_64"))]
#[test]
fn each_barrier_runs_and_is_the_kernels_instruction_for_this_architecture() {
    let checked = [
        free("mb", barrier::mb, arch::MB),
        free("wmb", barrier::wmb, arch::WMB),
        free("wc_start", barrier::wc_start, arch::WMB),
        free("wc_flush", barrier::wc_flush, arch::WMB),
        free("dma_wmb", barrier::dma_wmb, arch::DMA_WMB),
        free("dma_rmb", barrier::dma_rmb, arch::DMA_RMB),
        method("Mmio::mb", Plain::mb, arch::MB),
        method("Mmio::wmb", Plain::wmb, arch::WMB),
        method("Mmio::wc_start", Plain::wc_start, arch::WMB),
        method("Mmio::wc_flush", Plain::wc_flush, arch::WMB),
        method("Mmio::dma_wmb", Plain::dma_wmb, arch::DMA_WMB),
        method("Mmio::dma_rmb", Plain::dma_rmb, arch::DMA_RMB),
    ];
    for (name, at, want) in checked {
        let bytes = code(at, 64);
        match want {
            Some(insn) => assert!(arch::holds(&bytes, insn), "{name} lacks {insn:#010x}: {bytes:02x?}"),
            None => assert!(arch::holds_no_barrier(&bytes), "{name} should be a compiler barrier: {bytes:02x?}"),
        }
    }
}
