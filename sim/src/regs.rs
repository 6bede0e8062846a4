//! The initialization segment's registers (`struct mlx5_init_seg`): the static image, the dynamic registers
//! computed at read time (`initializing`, the health counter, the internal timer), the health buffer a dying
//! firmware writes, and the BAR's layout (where the UAR pages start). `mmio.rs` is the handle that reaches them.

use mlx5_core::prm::{c, consts, ifc, Field, MsgBuf};

use std::time::Instant;

use crate::config::{Mode, SimConfig};
use crate::events::SimEvent;

/// Bytes in one BAR page (the UAR granule, `MLX5_ADAPTER_PAGE_SIZE`).
pub(crate) const PAGE: usize = consts::MLX5_ADAPTER_PAGE_SIZE as usize;
/// Pages the initialization segment covers; UAR index `n` is the BAR page `n`, so UARs start after these.
pub const INIT_SEG_PAGES: usize = c::mlx5_init_seg::SIZE.div_ceil(PAGE);

/// Whether `off..off + len` lies inside `r` (no overflow).
pub(crate) fn range_holds(r: &std::ops::Range<usize>, off: usize, len: usize) -> bool {
    off >= r.start && off.checked_add(len).is_some_and(|e| e <= r.end)
}

pub(crate) const FW_REV: usize = c::mlx5_init_seg::FW_REV.off;
pub(crate) const CMDQ_ADDR_H: usize = c::mlx5_init_seg::CMDQ_ADDR_H.off;
pub(crate) const CMDQ_ADDR_L_SZ: usize = c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off;
pub(crate) const CMD_DBELL: usize = c::mlx5_init_seg::CMD_DBELL.off;
pub(crate) const INITIALIZING: usize = c::mlx5_init_seg::INITIALIZING.off;
pub(crate) const HEALTH_COUNTER: usize = c::mlx5_init_seg::HEALTH_COUNTER.off;
pub(crate) const INTERNAL_TIMER_H: usize = c::mlx5_init_seg::INTERNAL_TIMER_H.off;
pub(crate) const INTERNAL_TIMER_L: usize = c::mlx5_init_seg::INTERNAL_TIMER_L.off;

/// `nic_interface` in `cmdq_addr_l_sz` is three bits at `MLX5_NIC_IFC_OFFSET` (bits 10:8) as the kernel reads it
/// (`mlx5_get_nic_state`: `(v >> 8) & 7`, c-layouts.md section 1); the PRM layout only names two of them.
pub(crate) const NIC_IFC_SHIFT: u32 = consts::MLX5_NIC_IFC_OFFSET;
pub(crate) const NIC_IFC_MASK: u32 = 0x7;

/// Kernel log level `LOGLEVEL_CRIT` (include/linux/kern_levels.h), the severity a dead firmware reports in
/// `rfr_severity` bits 2:0 (`MLX5_SEVERITY_MASK`); health.c reads it only when `MLX5_SEVERITY_VALID_MASK` is set.
pub(crate) const SEVERITY_CRIT: u8 = 2;

/// Health of the simulated device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Health {
    /// Firmware runs and the heartbeat ticks.
    #[default]
    Ok,
    /// Firmware died with this health syndrome (0: a silent stall); the heartbeat is frozen.
    Failed { synd: u8 },
    /// The device left the bus: every read returns all ones.
    Gone,
}

/// What a register write asks the device to do beyond updating the register file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RegWrite {
    /// Nothing more.
    Done,
    /// `cmd_dbell` was written with this mask.
    CmdDoorbell(u32),
    /// A write into a UAR page (doorbells), for the device to interpret.
    Uar,
}

/// A field of the initialization segment relative to the 32-bit register at `reg`, so a register value can be
/// decoded with the PRM layout.
const fn in_reg(f: Field, reg: usize) -> Field {
    Field::new(f.off - (reg as u32) * 8, f.width)
}

#[derive(Debug)]
pub(crate) struct Regs {
    image: Vec<u8>,
    pub(crate) bar_size: usize,
    /// Where the UAR pages end: the device memory (MEMIC) region, if any, follows them up to `bar_size`.
    uar_end: usize,
    cmdq_h: u32,
    /// The queue address, set once both halves have been written (`cmdq_addr_l_sz` last).
    pub(crate) cmdq_iova: Option<u64>,
    pub(crate) log_cmdq_size: u8,
    pub(crate) log_cmdq_stride: u8,
    init_delay_ns: u64,
    pub(crate) health: Health,
    /// The heartbeat value (ms) the health counter froze at when the firmware died.
    frozen_ms: Option<u64>,
}

impl Regs {
    /// The registers after a function-level reset at `now_ns`: as at power-on, initializing again for the
    /// configured time from now, and `nic_interface` reading `SW_RESET` until a driver writes the command queue
    /// address (Linux's health poll takes that state as fatal, `MLX5_SENSOR_NIC_SW_RESET`: a driver still running
    /// on the function learns it was reset beneath it).
    pub(crate) fn after_reset(cfg: &SimConfig, now_ns: u64) -> Self {
        let mut r = Self::new(cfg);
        r.init_delay_ns = r.init_delay_ns.saturating_add(now_ns);
        let v = r.image.read_u32(CMDQ_ADDR_L_SZ) & !(NIC_IFC_MASK << NIC_IFC_SHIFT);
        let sw_reset = consts::MLX5_INITIAL_SEG_NIC_INTERFACE_SW_RESET;
        r.image.write_u32(CMDQ_ADDR_L_SZ, v | sw_reset << NIC_IFC_SHIFT);
        r
    }

    pub(crate) fn new(cfg: &SimConfig) -> Self {
        use ifc::initial_seg as s;
        let mut image = vec![0u8; INIT_SEG_PAGES * PAGE];
        let (major, minor, sub) = cfg.fw_rev;
        image.set(s::FW_REV_MAJOR, major.into());
        image.set(s::FW_REV_MINOR, minor.into());
        image.set(s::FW_REV_SUBMINOR, sub.into());
        image.set(s::CMD_INTERFACE_REV, cfg.cmdif_rev.into());
        image.set(s::LOG_CMDQ_SIZE, cfg.log_cmdq_size.into());
        image.set(s::LOG_CMDQ_STRIDE, cfg.log_cmdq_stride.into());
        image.write_u32(c::mlx5_init_seg::CMD_EXEC_TO.off, cfg.cmd_exec_to_ms);
        image.write_u32(c::mlx5_init_seg::CMD_Q_INIT_TO.off, cfg.cmd_q_init_to_ms);
        Self {
            image,
            bar_size: (INIT_SEG_PAGES + cfg.num_uars as usize) * PAGE + cfg.memic_size as usize,
            uar_end: (INIT_SEG_PAGES + cfg.num_uars as usize) * PAGE,
            cmdq_h: 0,
            cmdq_iova: None,
            log_cmdq_size: cfg.log_cmdq_size,
            log_cmdq_stride: cfg.log_cmdq_stride,
            init_delay_ns: u64::from(cfg.init_delay_ms) * 1_000_000,
            health: Health::Ok,
            frozen_ms: None,
        }
    }

    /// The firmware dies at `now_ns`: the heartbeat freezes and, for a non-zero syndrome, the health buffer
    /// reports it (with the extended syndrome `ext_synd`), a valid severity and the recovery-flow-required bit
    /// (`rfr`), which is what makes Linux's `sensor_fw_synd_rfr` call it fatal.
    pub(crate) fn die(&mut self, synd: u8, ext_synd: u16, now_ns: u64) {
        use c::health_buffer as h;
        let base = c::mlx5_init_seg::HEALTH.off;
        self.health = Health::Failed { synd };
        self.frozen_ms = Some(now_ns / 1_000_000);
        if synd != 0 {
            self.image[base + h::SYND.off] = synd;
            self.image.write_bytes(base + h::EXT_SYND.off, &ext_synd.to_be_bytes());
            let sev = 1 << consts::MLX5_RFR_BIT_OFFSET
                | consts::MLX5_SEVERITY_VALID_MASK
                | (SEVERITY_CRIT & consts::MLX5_SEVERITY_MASK);
            self.image[base + h::RFR_SEVERITY.off] = sev;
        }
    }

    pub(crate) fn read32(&self, off: usize, now_ns: u64) -> u32 {
        if self.health == Health::Gone {
            // Nobody answers on the bus: the read completes with all ones (a master abort).
            return u32::MAX;
        }
        if off.checked_add(4).is_none_or(|end| end > self.bar_size) {
            // A read past the BAR completes with all ones, like a PCI master abort.
            return u32::MAX;
        }
        if off + 4 > self.image.len() {
            // UAR pages read back zero.
            return 0;
        }
        let mut word = [0u8; 4];
        self.image.read_bytes(off, &mut word);
        match off {
            INITIALIZING => {
                let busy = now_ns < self.init_delay_ns;
                word.set(in_reg(ifc::initial_seg::INITIALIZING, off), busy.into());
            }
            HEALTH_COUNTER => {
                // The heartbeat advances once per (virtual) millisecond while the firmware lives.
                let ms = self.frozen_ms.unwrap_or(now_ns / 1_000_000);
                word.set(in_reg(ifc::initial_seg::HEALTH_COUNTER, off), ms as u32);
            }
            INTERNAL_TIMER_H => return (now_ns >> 32) as u32,
            INTERNAL_TIMER_L => return now_ns as u32,
            // The doorbell register reads as zero: every rung slot has been taken.
            CMD_DBELL => return 0,
            _ => {}
        }
        u32::from_be_bytes(word)
    }

    /// The UAR pages' part of the BAR.
    pub(crate) fn uar_range(&self) -> std::ops::Range<usize> {
        self.image.len()..self.uar_end
    }

    /// Whether `off..off + len` lies inside one of the UAR pages (after the initialization segment, in the BAR).
    pub(crate) fn in_uar(&self, off: usize, len: usize) -> bool {
        range_holds(&self.uar_range(), off, len)
    }

    /// A register write; says what else the device must do.
    pub(crate) fn write32(&mut self, off: usize, v: u32, events: &mut Vec<SimEvent>) -> RegWrite {
        match off {
            CMDQ_ADDR_H => {
                self.cmdq_h = v;
                self.image.set(ifc::initial_seg::CMDQ_PHY_ADDR_63_32, v);
            }
            CMDQ_ADDR_L_SZ => {
                use ifc::initial_seg as s;
                let w = v.to_be_bytes();
                let addr_hi_bits = MsgBuf::get(&w, in_reg(s::CMDQ_PHY_ADDR_31_12, off));
                self.image.set(s::CMDQ_PHY_ADDR_31_12, addr_hi_bits);
                let nic = (v >> NIC_IFC_SHIFT) & NIC_IFC_MASK;
                let old = self.image.read_u32(off);
                let kept = old & !(NIC_IFC_MASK << NIC_IFC_SHIFT);
                self.image.write_u32(off, kept | (nic << NIC_IFC_SHIFT));
                let low = u64::from(addr_hi_bits) << consts::MLX5_ADAPTER_PAGE_SHIFT;
                let iova = (u64::from(self.cmdq_h) << 32) | low;
                self.cmdq_iova = Some(iova);
                events.push(SimEvent::CmdqAddress { iova });
            }
            CMD_DBELL => return RegWrite::CmdDoorbell(v),
            _ if self.in_uar(off, 4) => return RegWrite::Uar,
            _ => events.push(SimEvent::IgnoredWrite { off, val: v }),
        }
        RegWrite::Done
    }
}

// `FW_REV` is the first register; naming it keeps the match above honest about where the segment starts.
const _: () = assert!(FW_REV == 0);

/// Device time: virtual in inline mode (advanced by `SimDelay`), wall time since creation in threaded mode.
#[derive(Debug)]
pub(crate) struct Clock {
    mode: Mode,
    virt_ns: u64,
    start: Instant,
}

impl Clock {
    pub(crate) fn new(mode: Mode) -> Self {
        Self { mode, virt_ns: 0, start: Instant::now() }
    }

    #[inline]
    pub(crate) fn now_ns(&self) -> u64 {
        match self.mode {
            Mode::Inline => self.virt_ns,
            Mode::Threaded => u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX),
        }
    }

    /// Advances virtual time by `ns` (inline mode).
    pub(crate) fn advance(&mut self, ns: u64) {
        self.virt_ns = self.virt_ns.saturating_add(ns);
    }
}

impl Regs {
    /// Whether the firmware is dead or the device gone: nothing executes, nothing is written.
    #[inline]
    pub(crate) fn dead(&self) -> bool {
        self.health != Health::Ok
    }
}
