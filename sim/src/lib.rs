//! A simulated ConnectX (mlx5) HCA for testing `mlx5-core` without hardware.
//!
//! # Handles
//! A [`SimDevice`] is a cheap, clonable handle to one device (`Arc` + `Mutex` inside). The driver talks to it
//! through three handles that implement the `mlx5-core` HAL: [`SimMmio`] (the BAR: initialization segment plus
//! UAR pages), [`SimDma`] (device-visible memory) and [`SimDelay`] (time). Tests use the device handle to
//! configure it ([`SimConfig`]), inject faults ([`Fault`]) and observe it ([`SimDevice::executed`],
//! [`SimDevice::events`], [`SimDevice::dma_faults`], ...).
//!
//! # Inline and threaded modes
//! In [`Mode::Inline`] (the default) a write to `cmd_dbell` executes the rung commands synchronously inside
//! `write32`, so a test is deterministic and single threaded. In [`Mode::Threaded`] a worker thread receives the
//! doorbells over a channel and completes the commands asynchronously, as real firmware does; it exercises the
//! driver's polling and ordering.
//!
//! # Virtual time
//! In inline mode nothing really sleeps: [`SimDelay`] advances a virtual clock and runs device work that became
//! due (commands delayed by [`Fault::Delay`]). The clock also drives `initializing` ([`SimConfig::init_delay_ms`]),
//! the health counter and the internal timer. In threaded mode `SimDelay` really sleeps and the clock is wall time.
//!
//! # DMA and its faults
//! [`SimDma`] hands out zeroed host memory behind fresh IOVAs that are never reused, each followed by an unmapped
//! guard page. The device side reaches memory only through a checked translation: an access that is not fully
//! inside one live region is recorded as a [`DmaFault`] and fails the command (delivery status `FW_ERR`) instead
//! of touching memory. Device DMA is modelled outside the Rust memory model, as real DMA is: the device copies
//! bytes with raw pointer copies under its lock, and the command protocol (owner bit and barriers) is what keeps
//! the CPU and the device off the same bytes.
//!
//! # Firmware
//! The command engine (module `fw`) validates delivery exactly as the PRM describes (entry type, signatures,
//! tokens, block numbers, pointer alignment), then runs the command with firmware-like checks: HCA state machine
//! (ENABLE_HCA, INIT_HCA, TEARDOWN_HCA, DISABLE_HCA), ISSI, page management, capabilities and the first objects
//! (PD, UAR, EQ, CQ). Failures carry a status and a syndrome from [`syndrome`].

mod caps;
mod dma;
mod fw;
mod mmio;
pub mod mocks;

#[cfg(test)]
mod testutil;

use std::sync::atomic::{fence, Ordering};
use std::sync::{mpsc, Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use mlx5_core::hal::DelayNs;

pub use dma::{DmaFault, SimDma};
pub use fw::{syndrome, HcaState};
pub use mmio::SimMmio;

use dma::DmaSpace;
use fw::Firmware;
use mmio::Regs;

/// How the device completes commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// A doorbell executes the command synchronously inside `write32`; delays use a virtual clock.
    #[default]
    Inline,
    /// A worker thread executes doorbells asynchronously; delays really sleep.
    Threaded,
}

/// Port link layer reported in `cmd_hca_cap.port_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PortType {
    /// InfiniBand (`MLX5_CAP_PORT_TYPE_IB`).
    Ib,
    /// Ethernet / RoCE (`MLX5_CAP_PORT_TYPE_ETH`).
    #[default]
    Eth,
}

/// Device configuration. The defaults model a ConnectX-5 with a 32-slot command queue.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub mode: Mode,
    /// log2 of the number of command slots, reported in `cmdq_addr_l_sz` (5 = 32 slots, `MLX5_MAX_COMMANDS`).
    pub log_cmdq_size: u8,
    /// log2 of the distance between command slots in bytes (6 = 64, one `mlx5_cmd_layout`).
    pub log_cmdq_stride: u8,
    /// Command interface revision in `cmdif_rev_fw_sub` (the kernel requires `CMD_IF_REV` = 5).
    pub cmdif_rev: u16,
    /// Firmware version (major, minor, subminor).
    pub fw_rev: (u16, u16, u16),
    /// Value of `cmd_exec_to` (default command timeout in ms).
    pub cmd_exec_to_ms: u32,
    /// Value of `cmd_q_init_to` (ms); non-zero tells the driver the init-segment timeouts are valid.
    pub cmd_q_init_to_ms: u32,
    /// For this long after creation (virtual time in inline mode) `initializing` reads 1.
    pub init_delay_ms: u32,
    /// Pages firmware asks for at QUERY_PAGES(boot).
    pub boot_pages: i32,
    /// Additional pages firmware asks for at QUERY_PAGES(init).
    pub init_pages: i32,
    /// Additional pages firmware asks for at QUERY_PAGES(regular).
    pub regular_pages: i32,
    /// Verify entry and mailbox signatures, and sign the output. Off by default, as the Linux driver runs
    /// (`checksum_disabled`); the entry signature is then not checked either.
    pub checksum: bool,
    /// Link layer reported in the general capabilities.
    pub port_type: PortType,
    /// Number of UAR pages in the BAR after the initialization segment (ALLOC_UAR fails beyond it).
    pub num_uars: u32,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Inline,
            log_cmdq_size: 5,
            log_cmdq_stride: 6,
            cmdif_rev: 5,
            fw_rev: (16, 35, 2000),
            cmd_exec_to_ms: 60_000,
            cmd_q_init_to_ms: 2_000,
            init_delay_ms: 0,
            boot_pages: 8,
            init_pages: 16,
            regular_pages: 4,
            checksum: false,
            port_type: PortType::Eth,
            num_uars: 16,
        }
    }
}

/// A fault to inject into the firmware. Each matches commands by opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The command completes (delivery OK) with this status and syndrome, without executing. `times` is the
    /// number of commands affected; 0 means every matching command until [`SimDevice::clear_faults`].
    Status { opcode: u16, status: u8, syndrome: u32, times: u32 },
    /// The command never completes: the owner bit stays with hardware.
    Hang { opcode: u16 },
    /// The command completes `ms` milliseconds after its doorbell (virtual time in inline mode).
    Delay { opcode: u16, ms: u32 },
    /// Delivery fails with this `MLX5_CMD_DELIVERY_STAT_*` value.
    Delivery { opcode: u16, status: u8 },
    /// After execution, byte `offset` of the output message is replaced by `value`.
    CorruptOutput { opcode: u16, offset: usize, value: u8 },
}

impl Fault {
    fn opcode(&self) -> u16 {
        match *self {
            Fault::Status { opcode, .. }
            | Fault::Hang { opcode }
            | Fault::Delay { opcode, .. }
            | Fault::Delivery { opcode, .. }
            | Fault::CorruptOutput { opcode, .. } => opcode,
        }
    }
}

/// One completed command, in completion order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExecutedCmd {
    pub slot: u8,
    pub opcode: u16,
    pub op_mod: u16,
    /// `mbox_out.status` (0 when delivery failed).
    pub status: u8,
    pub syndrome: u32,
    /// `MLX5_CMD_DELIVERY_STAT_*` written in `status_own >> 1`.
    pub delivery: u8,
}

/// Things the device noticed that are not command completions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimEvent {
    /// `cmdq_addr_l_sz` was written: the command queue now lives at `iova`.
    CmdqAddress { iova: u64 },
    /// A doorbell rang before a command queue address was set.
    DoorbellNoQueue { mask: u32 },
    /// A doorbell bit beyond the queue size.
    DoorbellBadSlot { slot: u8 },
    /// A doorbell for a slot whose owner bit is software's: ignored.
    DoorbellNotOwned { slot: u8 },
    /// The entry of a rung slot was not in live DMA memory (also in `dma_faults`).
    EntryUnreadable { slot: u8, iova: u64 },
    /// Writing a completion failed on a DMA fault (also in `dma_faults`).
    CompletionUnwritable { slot: u8 },
    /// A command held by [`Fault::Hang`].
    Hung { slot: u8, opcode: u16 },
    /// A command postponed by [`Fault::Delay`].
    Delayed { slot: u8, opcode: u16, ms: u32 },
    /// A write to a register the simulator does not model (or beyond the BAR); it had no effect.
    IgnoredWrite { off: usize, val: u32 },
    /// A write into a UAR page (doorbells; not executed yet).
    UarWrite { off: usize, val: u32 },
    /// The host freed a region that still contained pages given to firmware.
    FreedDeviceOwned { iova: u64, len: usize, pages: usize },
    /// `Dma::free` of something that is not a live region (double free or a forged region); nothing was freed.
    BadFree { iova: u64, len: usize },
    /// TEARDOWN_HCA while objects were still alive; they were destroyed with it.
    TeardownWithObjects { objects: usize },
    /// DISABLE_HCA while firmware still owned pages.
    DisableWithPages { pages: usize },
}

#[derive(Debug)]
struct Pending {
    due_ns: u64,
    slot: u8,
}

/// Everything behind the device lock.
#[derive(Debug)]
pub(crate) struct State {
    pub(crate) cfg: SimConfig,
    pub(crate) dma: DmaSpace,
    pub(crate) fw: Firmware,
    pub(crate) regs: Regs,
    pub(crate) events: Vec<SimEvent>,
    pub(crate) executed: Vec<ExecutedCmd>,
    pub(crate) faults: Vec<Fault>,
    pending: Vec<Pending>,
    virt_ns: u64,
    start: Instant,
}

impl State {
    /// Device time: virtual in inline mode, wall time since creation in threaded mode.
    pub(crate) fn now_ns(&self) -> u64 {
        match self.cfg.mode {
            Mode::Inline => self.virt_ns,
            Mode::Threaded => u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// Runs every postponed command whose time has come (inline mode).
    fn run_due(&mut self) {
        let now = self.now_ns();
        // Bounded: each pass removes one entry and a re-run never re-postpones (delay faults are skipped).
        for _ in 0..self.pending.len() {
            let Some(i) = self.pending.iter().position(|p| p.due_ns <= now) else { break };
            let p = self.pending.remove(i);
            self.run_slot(p.slot, false);
        }
    }

    /// Handles a doorbell mask; returns the (slot, ms) pairs a threaded device must complete later.
    pub(crate) fn ring(&mut self, mask: u32) -> Vec<(u8, u32)> {
        let mut later = Vec::new();
        for slot in 0..32u8 {
            if mask & (1 << slot) == 0 {
                continue;
            }
            if let Some(ms) = self.run_slot(slot, true) {
                match self.cfg.mode {
                    Mode::Inline => {
                        let due_ns = self.now_ns().saturating_add(u64::from(ms) * 1_000_000);
                        self.pending.push(Pending { due_ns, slot });
                    }
                    Mode::Threaded => later.push((slot, ms)),
                }
            }
        }
        later
    }
}

/// State shared by every handle.
#[derive(Debug)]
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Doorbells for the worker thread (threaded mode only).
    tx: Option<mpsc::Sender<u32>>,
}

/// Locks the device, recovering from a poisoned lock (a panicking test must not cascade into others).
pub(crate) fn lock(shared: &Shared) -> MutexGuard<'_, State> {
    shared.state.lock().unwrap_or_else(|e| e.into_inner())
}

impl Shared {
    /// Delivers a doorbell: executes it now (inline) or hands it to the worker (threaded).
    pub(crate) fn doorbell(self: &Arc<Self>, mask: u32) {
        match &self.tx {
            Some(tx) => {
                // The worker only goes away with the last handle, and we are one, so a send cannot fail; if it
                // ever did, the command would look hung, which the driver must cope with anyway.
                let _ = tx.send(mask);
            }
            None => {
                lock(self).ring(mask);
            }
        }
    }
}

/// Runs doorbells in threaded mode. Holds only a weak reference so dropping the last handle stops it.
fn worker(weak: Weak<Shared>, rx: mpsc::Receiver<u32>) {
    while let Ok(mask) = rx.recv() {
        let Some(shared) = weak.upgrade() else { break };
        // Order the driver's stores (entry, mailboxes) before our reads, as the doorbell write does in hardware.
        fence(Ordering::SeqCst);
        let later = lock(&shared).ring(mask);
        for (slot, ms) in later {
            let weak = Arc::downgrade(&shared);
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(u64::from(ms)));
                if let Some(shared) = weak.upgrade() {
                    lock(&shared).run_slot(slot, false);
                }
            });
        }
    }
}

/// Handle to one simulated device. Clones share the device.
#[derive(Debug, Clone)]
pub struct SimDevice {
    shared: Arc<Shared>,
}

impl Default for SimDevice {
    fn default() -> Self {
        Self::new(SimConfig::default())
    }
}

impl SimDevice {
    pub fn new(cfg: SimConfig) -> Self {
        let mode = cfg.mode;
        let state = State {
            regs: Regs::new(&cfg),
            fw: Firmware::new(&cfg),
            cfg,
            dma: DmaSpace::new(),
            events: Vec::new(),
            executed: Vec::new(),
            faults: Vec::new(),
            pending: Vec::new(),
            virt_ns: 0,
            start: Instant::now(),
        };
        match mode {
            Mode::Inline => Self { shared: Arc::new(Shared { state: Mutex::new(state), tx: None }) },
            Mode::Threaded => {
                let (tx, rx) = mpsc::channel();
                let shared = Arc::new(Shared { state: Mutex::new(state), tx: Some(tx) });
                let weak = Arc::downgrade(&shared);
                std::thread::Builder::new()
                    .name("mlx5-sim-fw".into())
                    .spawn(move || worker(weak, rx))
                    .expect("spawning the simulator's firmware thread");
                Self { shared }
            }
        }
    }

    /// The BAR (initialization segment and UAR pages).
    pub fn mmio(&self) -> SimMmio {
        SimMmio { shared: self.shared.clone() }
    }

    /// The device-visible memory allocator.
    pub fn dma(&self) -> SimDma {
        SimDma { shared: self.shared.clone() }
    }

    /// Time: virtual in inline mode, real sleeps in threaded mode.
    pub fn delay(&self) -> SimDelay {
        SimDelay { shared: self.shared.clone() }
    }

    pub fn config(&self) -> SimConfig {
        lock(&self.shared).cfg.clone()
    }

    /// Adds a fault; faults are checked in the order they were injected.
    pub fn inject(&self, fault: Fault) {
        lock(&self.shared).faults.push(fault);
    }

    pub fn clear_faults(&self) {
        lock(&self.shared).faults.clear();
    }

    /// Completed commands, in completion order.
    pub fn executed(&self) -> Vec<ExecutedCmd> {
        lock(&self.shared).executed.clone()
    }

    /// Everything else the device noticed, in order.
    pub fn events(&self) -> Vec<SimEvent> {
        lock(&self.shared).events.clone()
    }

    /// Device accesses outside live DMA memory, in order.
    pub fn dma_faults(&self) -> Vec<DmaFault> {
        lock(&self.shared).dma.faults.clone()
    }

    /// Live DMA regions: (count, bytes).
    pub fn dma_outstanding(&self) -> (usize, usize) {
        lock(&self.shared).dma.outstanding()
    }

    /// Pages the driver has given to firmware and not taken back.
    pub fn pages_owned(&self) -> usize {
        lock(&self.shared).fw.pages_owned()
    }

    pub fn hca_state(&self) -> HcaState {
        lock(&self.shared).fw.state
    }

    /// Current device time in nanoseconds (virtual in inline mode).
    pub fn now_ns(&self) -> u64 {
        lock(&self.shared).now_ns()
    }

    /// Advances virtual time and runs due work, exactly as [`SimDelay`] does (inline mode; threaded: sleeps).
    pub fn advance_ns(&self, ns: u64) {
        self.delay().advance(ns);
    }

    /// Live objects: (PDs, UARs, EQs, CQs).
    pub fn object_counts(&self) -> (usize, usize, usize, usize) {
        lock(&self.shared).fw.object_counts()
    }
}

/// [`DelayNs`] for the simulator: advances virtual time (inline) or sleeps (threaded).
#[derive(Debug, Clone)]
pub struct SimDelay {
    shared: Arc<Shared>,
}

impl SimDelay {
    fn advance(&self, ns: u64) {
        let mode = lock(&self.shared).cfg.mode;
        match mode {
            Mode::Inline => {
                let mut st = lock(&self.shared);
                st.virt_ns = st.virt_ns.saturating_add(ns);
                st.run_due();
            }
            Mode::Threaded => std::thread::sleep(Duration::from_nanos(ns)),
        }
    }
}

impl DelayNs for SimDelay {
    fn delay_ns(&mut self, ns: u32) {
        self.advance(u64::from(ns));
    }
    fn delay_us(&mut self, us: u32) {
        self.advance(u64::from(us) * 1_000);
    }
    fn delay_ms(&mut self, ms: u32) {
        self.advance(u64::from(ms) * 1_000_000);
    }
}
