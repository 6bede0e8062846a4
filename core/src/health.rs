//! Firmware health (Linux `health.c`): the health buffer in the initialization segment, the heartbeat counter,
//! and the fatal sensors that move an HCA to the internal-error state.
//!
//! The core has no timer. [`Health::poll`] is one tick of Linux's health timer: call it every
//! [`HEALTH_POLL_INTERVAL_MS`] (the bring-up and the command waits do so from their own delays). A heartbeat that
//! does not move for [`consts::MAX_MISSES`] ticks, a health syndrome, a disabled or resetting NIC interface, or an
//! all-ones read (the device has left the bus) is a [`HealthFailure`].

use crate::hal::Mmio;
use crate::prm::{c, consts, Bytes, HealthSyndrome, Named};

/// How often Linux polls health (`MLX5_TO_HEALTH_POLL_INTERVAL_MS`, lib/tout.c).
pub const HEALTH_POLL_INTERVAL_MS: u32 = 2_000;

const HB: usize = c::mlx5_init_seg::HEALTH.off;
const FW_VER: usize = HB + c::health_buffer::FW_VER.off;
const HEALTH_COUNTER: usize = c::mlx5_init_seg::HEALTH_COUNTER.off;
const CMDQ_ADDR_L_SZ: usize = c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off;

/// Why the HCA is considered failed. Mirrors Linux's fatal sensors (`check_fatal_sensors`) plus the stalled
/// heartbeat (`MAX_MISSES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum HealthFailure {
    /// Reads return all ones: the device is gone from the bus (`MLX5_SENSOR_PCI_COMM_ERR`).
    DeviceGone,
    /// The NIC interface reads disabled (`MLX5_SENSOR_NIC_DISABLED`).
    NicDisabled,
    /// The NIC interface is in software reset (`MLX5_SENSOR_NIC_SW_RESET`).
    NicSwReset,
    /// Firmware reported a health syndrome.
    Syndrome {
        /// The health syndrome.
        synd: HealthSyndrome,
        /// The extended syndrome.
        ext_synd: u16,
        /// Severity (valid when non-zero).
        severity: u8,
        /// Recovery flow required.
        rfr: bool,
    },
    /// The heartbeat counter stayed at `counter` for `misses` polls.
    Stalled {
        /// The heartbeat value that stopped.
        counter: u32,
        /// Polls it stayed the same.
        misses: u32,
    },
    /// The driver gave up on firmware (a command timed out during bring-up or teardown).
    Unresponsive,
}

impl core::fmt::Display for HealthFailure {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match *self {
            HealthFailure::DeviceGone => write!(f, "device is gone (PCI reads return all ones)"),
            HealthFailure::NicDisabled => write!(f, "NIC interface is disabled"),
            HealthFailure::NicSwReset => write!(f, "NIC interface is in software reset"),
            HealthFailure::Syndrome { synd, ext_synd, severity, rfr } => write!(
                f,
                "health syndrome {} ext_synd 0x{ext_synd:04x} severity {severity}{}",
                Named(synd.name(), synd.raw().into()),
                if rfr { " (recovery flow required)" } else { "" }
            ),
            HealthFailure::Stalled { counter, misses } => {
                write!(f, "health counter stuck at 0x{counter:x} for {misses} polls")
            }
            HealthFailure::Unresponsive => write!(f, "firmware stopped answering commands"),
        }
    }
}

impl core::error::Error for HealthFailure {}

/// The health buffer as read from the device (`struct health_buffer`), for reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct HealthBuffer {
    /// `fw_ver`.
    pub fw_ver: u32,
    /// `hw_id`.
    pub hw_id: u32,
    /// `time`.
    pub time: u32,
    /// `assert_exit_ptr`.
    pub assert_exit_ptr: u32,
    /// `assert_callra`.
    pub assert_callra: u32,
    /// `rfr`: recovery flow required.
    pub rfr: bool,
    /// Severity when `valid` (`MLX5_SEVERITY_MASK`), else 0.
    pub severity: u8,
    /// Whether `severity` is valid.
    pub valid: bool,
    /// `irisc_index`.
    pub irisc_index: u8,
    /// `synd`: the health syndrome (0 = healthy).
    pub synd: u8,
    /// `ext_synd`.
    pub ext_synd: u16,
    /// `health_counter`: the firmware heartbeat.
    pub counter: u32,
}

/// Reads the byte-sized member `m` of the health buffer through the aligned 32-bit register that holds it (the
/// BAR is read 32 bits at a time, big endian, as `ioread32be` does).
fn member<M: Mmio + ?Sized>(mmio: &M, m: Bytes) -> u32 {
    let dw = m.off & !3;
    let shift = (4 - (m.off - dw) - m.len) * 8;
    let mask = if m.len >= 4 { u32::MAX } else { (1u32 << (m.len * 8)) - 1 };
    (mmio.read32(HB + dw) >> shift) & mask
}

impl HealthBuffer {
    /// Reads the buffer and the heartbeat.
    pub fn read<M: Mmio + ?Sized>(mmio: &M) -> Self {
        use c::health_buffer as h;
        let rfr_sev = member(mmio, h::RFR_SEVERITY) as u8;
        let valid = rfr_sev & consts::MLX5_SEVERITY_VALID_MASK != 0;
        Self {
            fw_ver: mmio.read32(FW_VER),
            hw_id: member(mmio, h::HW_ID),
            time: member(mmio, h::TIME),
            assert_exit_ptr: member(mmio, h::ASSERT_EXIT_PTR),
            assert_callra: member(mmio, h::ASSERT_CALLRA),
            rfr: rfr_sev >> consts::MLX5_RFR_BIT_OFFSET != 0,
            severity: if valid { rfr_sev & consts::MLX5_SEVERITY_MASK } else { 0 },
            valid,
            irisc_index: member(mmio, h::IRISC_INDEX) as u8,
            synd: member(mmio, h::SYND) as u8,
            ext_synd: member(mmio, h::EXT_SYND) as u16,
            counter: mmio.read32(HEALTH_COUNTER),
        }
    }
}

/// Heartbeat tracking between polls (`struct mlx5_core_health`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Health {
    prev: Option<u32>,
    misses: u32,
    polls: u32,
}

impl Health {
    /// A health monitor with no polls yet.
    pub const fn new() -> Self {
        Self { prev: None, misses: 0, polls: 0 }
    }

    /// Polls so far.
    pub fn polls(&self) -> u32 {
        self.polls
    }

    /// The fatal sensors, in Linux's order (`check_fatal_sensors`), plus any health syndrome: cheap enough to run
    /// whenever a wait gets long.
    pub fn check_fatal<M: Mmio + ?Sized>(mmio: &M) -> Option<HealthFailure> {
        // `sensor_pci_not_working`: a device that left the bus reads all ones.
        if mmio.read32(FW_VER) == u32::MAX {
            return Some(HealthFailure::DeviceGone);
        }
        let nic = (mmio.read32(CMDQ_ADDR_L_SZ) >> consts::MLX5_NIC_IFC_OFFSET) & 0x7;
        if nic == consts::MLX5_INITIAL_SEG_NIC_INTERFACE_DISABLED {
            return Some(HealthFailure::NicDisabled);
        }
        if nic == consts::MLX5_INITIAL_SEG_NIC_INTERFACE_SW_RESET {
            return Some(HealthFailure::NicSwReset);
        }
        // `sensor_fw_synd_rfr`: a syndrome is fatal when firmware also asks for the recovery flow; one without
        // `rfr` is only reported by Linux (its devlink health report), so it does not stop the HCA here either.
        let hb = HealthBuffer::read(mmio);
        if hb.synd != 0 && hb.rfr {
            return Some(HealthFailure::Syndrome {
                synd: HealthSyndrome::from_raw(hb.synd),
                ext_synd: hb.ext_synd,
                severity: hb.severity,
                rfr: hb.rfr,
            });
        }
        None
    }

    /// One health-timer tick (`poll_health`): fatal sensors first, then the heartbeat.
    pub fn poll<M: Mmio + ?Sized>(&mut self, mmio: &M) -> Result<(), HealthFailure> {
        self.polls = self.polls.saturating_add(1);
        if let Some(f) = Self::check_fatal(mmio) {
            return Err(f);
        }
        let count = mmio.read32(HEALTH_COUNTER);
        if self.prev == Some(count) {
            self.misses += 1;
        } else {
            self.misses = 0;
        }
        self.prev = Some(count);
        if self.misses >= consts::MAX_MISSES {
            return Err(HealthFailure::Stalled { counter: count, misses: self.misses });
        }
        Ok(())
    }
}
