//! The firmware image: `mlx5_firmware_example::run` on a Cortex-M4F/M7 whose PCIe root complex maps the HCA's
//! BAR 0 at [`BAR0`] and reaches the DMA arena (in the `DMARAM` region of `memory.x`) at its CPU address.
//!
//! Build: `cargo build --release -p mlx5-firmware-example --target thumbv7em-none-eabihf`. On the host this file is
//! a stub; `cargo test -p mlx5-firmware-example` runs the same `run()` against the simulated ConnectX.

#![cfg_attr(target_os = "none", no_std, no_main)]

#[cfg(target_os = "none")]
mod firmware {
    use core::cell::UnsafeCell;
    use core::mem::MaybeUninit;
    use core::sync::atomic::{compiler_fence, AtomicU32, Ordering};

    use cortex_m_rt::entry;
    use mlx5_firmware_example::{arena::Arena, delay::CycleDelay, mmio::Bar, run, RunError};

    /// CPU address of the HCA's BAR 0: the PCIe controller's outbound window, in the Device-memory part of the
    /// Cortex-M map. Board-specific: set it to where your root complex places BAR 0.
    const BAR0: usize = 0x4000_0000;
    /// Core clock, for the cycle-counter delay.
    const CPU_HZ: u32 = 168_000_000;
    /// DMA memory: command queue, mailboxes, firmware pages, EQ/CQ/QP buffers, doorbell records.
    const ARENA_BYTES: usize = 2 << 20;

    /// The arena's memory, placed in `.dma_arena` (NOLOAD, in DMARAM; see memory.x).
    #[repr(C, align(4096))]
    struct ArenaMem(UnsafeCell<MaybeUninit<[u8; ARENA_BYTES]>>);

    // SAFETY: the memory is handed out exactly once, to the one `Arena` `main` builds; nothing else touches it.
    unsafe impl Sync for ArenaMem {}

    #[link_section = ".dma_arena"]
    static ARENA_MEM: ArenaMem = ArenaMem(UnsafeCell::new(MaybeUninit::uninit()));

    /// The outcome, for a debugger (or a later boot stage) to read: 0 running, 1 success, 2 failure, 3 panic.
    #[no_mangle]
    static MLX5_RESULT: AtomicU32 = AtomicU32::new(0);
    /// On success, the number of QP A (the requester of the loopback transfers).
    #[no_mangle]
    static MLX5_QPN: AtomicU32 = AtomicU32::new(0);

    #[entry]
    fn main() -> ! {
        // SAFETY: `main` runs once (cortex-m-rt's entry), so this is the only reference ever made to the arena's
        // memory; MaybeUninit<[u8; N]> and [MaybeUninit<u8>] have the same layout.
        let mem: &'static mut [MaybeUninit<u8>] =
            unsafe { core::slice::from_raw_parts_mut(ARENA_MEM.0.get().cast::<MaybeUninit<u8>>(), ARENA_BYTES) };
        // SAFETY: memory.x puts `.dma_arena` in DMARAM, which the PCIe inbound window maps 1:1 (the device reaches
        // it at its CPU address) and which is not cached (no D-cache on a Cortex-M4; on a Cortex-M7 an MPU region
        // makes it Normal non-cacheable before this point).
        let dma: Arena = unsafe { Arena::new(mem) };
        // SAFETY: BAR0 is where the root complex maps the HCA's BAR 0, in Device memory; only this code uses it.
        let bar = unsafe { Bar::new(BAR0) };
        // SAFETY: thumbv7em is a Cortex-M4/M7, which implement the DWT cycle counter; nothing else configures it.
        let mut delay = unsafe { CycleDelay::new(CPU_HZ) };
        defmt::info!("mlx5: bringing the HCA up (BAR 0 at {=usize:#x})", BAR0);
        match run(bar, &dma, (), &mut delay) {
            Ok(r) => {
                let (major, minor, sub) = r.fw_rev;
                defmt::info!(
                    "mlx5: firmware {=u16}.{=u16}.{=u16}; PD {=u32}, CQs {=u32:#x}/{=u32:#x}, QPs {=u32:#x}/{=u32:#x} in {}",
                    major,
                    minor,
                    sub,
                    r.pdn,
                    r.cqns[0],
                    r.cqns[1],
                    r.qpns[0],
                    r.qpns[1],
                    r.qp_state
                );
                defmt::info!(
                    "mlx5: {=usize} completions and every byte checked after {=u32} us; {=usize} pages back",
                    r.completions.len(),
                    r.waited_us,
                    r.pages_reclaimed
                );
                MLX5_QPN.store(r.qpns[0], Ordering::Relaxed);
                MLX5_RESULT.store(1, Ordering::Release);
            }
            Err(e) => {
                match e {
                    RunError::BringUp(b) => defmt::error!("mlx5: bring-up failed at {}: {}", b.step, b.error),
                    RunError::Step { what, error } => defmt::error!("mlx5: {=str} failed: {}", what, error),
                    RunError::Buffer(error) => defmt::error!("mlx5: data buffer: {}", error),
                    RunError::PortDown { state } => defmt::error!("mlx5: port 1 not active (state {=u8})", state),
                    RunError::NoGid => defmt::error!("mlx5: the RoCE GID table is empty"),
                    RunError::Post { what, error } => {
                        defmt::error!("mlx5: posting to the {=str} failed: {}", what, error)
                    }
                    RunError::Poll(error) => defmt::error!("mlx5: polling failed: {}", error),
                    RunError::Timeout { qp, got, want } => {
                        defmt::error!("mlx5: QP {=usize}'s CQ: {=usize} of {=usize} completions", qp, got, want)
                    }
                    RunError::Completion { index, wr_id, status, opcode, byte_len } => defmt::error!(
                        "mlx5: completion {=usize} unexpected: wr_id {=u64:#x}, {}, {}, {=u32} bytes",
                        index,
                        wr_id,
                        status,
                        opcode,
                        byte_len
                    ),
                    RunError::Data { transfer, offset, expected, got } => defmt::error!(
                        "mlx5: transfer {=usize}: byte {=usize} is {=u8:#x}, expected {=u8:#x}",
                        transfer,
                        offset,
                        got,
                        expected
                    ),
                    RunError::NoPeer => defmt::error!("mlx5: no connection facts from the other side"),
                    RunError::PeerTimeout { round } => defmt::error!("mlx5: round {=u32}: no completion", round),
                    RunError::Teardown(error) => defmt::error!("mlx5: teardown failed: {}", error),
                    RunError::PagesKept { pages } => defmt::error!("mlx5: {=usize} pages not returned", pages),
                }
                MLX5_RESULT.store(2, Ordering::Release);
            }
        }
        loop {
            compiler_fence(Ordering::SeqCst);
        }
    }

    /// Halts: a panic is a driver bug (device values never panic the core), so stop where a debugger can see it.
    #[panic_handler]
    fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
        // A panic inside the logger must not log again (it would re-enter it).
        if !crate::log::busy() {
            defmt::error!("mlx5: panic");
        }
        MLX5_RESULT.store(3, Ordering::Release);
        loop {
            compiler_fence(Ordering::SeqCst);
        }
    }
}

/// defmt's transport: encoded log frames go into a RAM ring, [`log::MLX5_LOG`], with the count of bytes ever
/// written in [`log::MLX5_LOG_HEAD`]. A debugger reads both (e.g. `probe-rs read`) and `defmt-print -e <elf>`
/// decodes the bytes; nothing on the board has to drain it, so logging never blocks the driver.
#[cfg(target_os = "none")]
mod log {
    use core::cell::UnsafeCell;
    use core::sync::atomic::{AtomicBool, AtomicU32, Ordering};

    const LOG_BYTES: usize = 4096;

    /// The ring's bytes.
    pub struct Ring(UnsafeCell<[u8; LOG_BYTES]>);
    // SAFETY: only the holder of `TAKEN` writes the ring (see `RamLog::acquire`); a debugger reads it from outside.
    unsafe impl Sync for Ring {}

    #[no_mangle]
    pub static MLX5_LOG: Ring = Ring(UnsafeCell::new([0; LOG_BYTES]));
    #[no_mangle]
    pub static MLX5_LOG_HEAD: AtomicU32 = AtomicU32::new(0);

    /// One logger at a time: the image logs from `main` and the panic handler only, never from an interrupt, so
    /// a flag (not a critical section) is enough; a nested acquire is a bug defmt itself reports.
    static TAKEN: AtomicBool = AtomicBool::new(false);

    /// Whether a frame is being written (a panic there must not log).
    pub fn busy() -> bool {
        TAKEN.load(Ordering::Relaxed)
    }
    /// defmt's frame encoder; used only by the holder of `TAKEN`.
    struct Enc(UnsafeCell<defmt::Encoder>);
    // SAFETY: as for `Ring`: only the holder of `TAKEN` touches it.
    unsafe impl Sync for Enc {}
    static ENCODER: Enc = Enc(UnsafeCell::new(defmt::Encoder::new()));

    fn put(bytes: &[u8]) {
        for &b in bytes {
            let head = MLX5_LOG_HEAD.load(Ordering::Relaxed);
            // SAFETY: the index is reduced modulo the ring's size, and only the holder of `TAKEN` writes.
            unsafe { (*MLX5_LOG.0.get())[head as usize % LOG_BYTES] = b };
            // The byte before the head that makes it visible, for a debugger reading while we run.
            MLX5_LOG_HEAD.store(head.wrapping_add(1), Ordering::Release);
        }
    }

    #[defmt::global_logger]
    struct RamLog;

    // SAFETY: acquire/release bracket every frame and refuse nesting (defmt's contract for a logger); write and
    // flush are called only between them, by the one holder.
    unsafe impl defmt::Logger for RamLog {
        fn acquire() {
            if TAKEN.swap(true, Ordering::Acquire) {
                panic!("defmt logger taken twice");
            }
            // SAFETY: we hold `TAKEN`.
            unsafe { (*ENCODER.0.get()).start_frame(put) };
        }

        unsafe fn flush() {}

        unsafe fn release() {
            // SAFETY: the caller holds the logger (defmt calls release only after acquire).
            unsafe { (*ENCODER.0.get()).end_frame(put) };
            TAKEN.store(false, Ordering::Release);
        }

        unsafe fn write(bytes: &[u8]) {
            // SAFETY: the caller holds the logger.
            unsafe { (*ENCODER.0.get()).write(bytes, put) };
        }
    }
}

#[cfg(not(target_os = "none"))]
fn main() {
    eprintln!(
        "mlx5-firmware-example is a firmware image: build it with `--target thumbv7em-none-eabihf`; \
         `cargo test -p mlx5-firmware-example` runs its run() against the simulated ConnectX"
    );
}
