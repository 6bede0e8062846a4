//! The BAR: the initialization segment (`struct mlx5_init_seg`) followed by UAR pages.
//!
//! The registers themselves are `regs.rs`. Static registers live in a byte image written through the PRM layouts (`ifc::initial_seg`, `c::mlx5_init_seg`);
//! the dynamic ones (`initializing`, the health counter, the internal timer) are computed at read time. The
//! health buffer is written when the firmware dies; a device that left the bus reads all ones.
//!
//! A write into a UAR page is decoded by `uar.rs` (`Device::uar_write32`, `uar_write64`); a send
//! doorbell there then runs the transport (`Shared::run`). The command doorbell rings the firmware (`fw/cmd.rs`).

use std::sync::atomic::{fence, Ordering};
use std::sync::Arc;

use mlx5_core::hal::Mmio;

use crate::device::{lock, Bell, Shared};
use crate::events::SimEvent;
use crate::regs::{Health, RegWrite, PAGE};

/// The simulator's [`Mmio`]: register accesses to the simulated BAR.
#[derive(Clone, Debug)]
pub struct SimMmio {
    pub(crate) shared: Arc<Shared>,
}

impl SimMmio {
    /// Size of the BAR in bytes (initialization segment, UAR pages and device memory); reads beyond it return all
    /// ones.
    pub fn bar_size(&self) -> usize {
        lock(&self.shared).regs.bar_size
    }

    /// Where the UAR pages end in the BAR (the device memory region, if configured, starts here).
    pub fn uar_end(&self) -> usize {
        lock(&self.shared).regs.uar_range().end
    }

    /// BAR offset of UAR page `index` (as returned by ALLOC_UAR).
    pub fn uar_offset(index: u32) -> usize {
        index as usize * PAGE
    }
}

impl Mmio for SimMmio {
    fn read32(&self, off: usize) -> u32 {
        let st = lock(&self.shared);
        st.regs.read32(off, st.now_ns())
    }

    fn write32(&self, off: usize, v: u32) {
        // Threaded: a UAR write is posted to the device thread without the device lock.
        if let Some(w) = self.shared.worker.as_ref().filter(|w| w.in_uar(off, 4)) {
            w.post(Bell::Uar32(off, v));
            return;
        }
        let bell = {
            let mut guard = lock(&self.shared);
            let st = &mut *guard;
            if st.regs.health == Health::Gone {
                st.events.push(SimEvent::WriteWhileGone { off, val: v });
                return;
            }
            match st.regs.write32(off, v, &mut st.events) {
                RegWrite::Done => None,
                RegWrite::CmdDoorbell(mask) => Some(mask),
                RegWrite::Uar => {
                    st.uar_write32(off, v);
                    None
                }
            }
        };
        match bell {
            Some(mask) => self.shared.doorbell(mask),
            // Any MMIO write lets the device run: due retries, flushes of receives posted since.
            None => self.shared.run(false),
        }
    }

    fn read64(&self, off: usize) -> u64 {
        let hi = self.read32(off);
        let lo = self.read32(off.saturating_add(4));
        (u64::from(hi) << 32) | u64::from(lo)
    }

    fn write64(&self, off: usize, v: u64) {
        // Threaded: a UAR doorbell is posted to the device thread without the device lock.
        if let Some(w) = self.shared.worker.as_ref().filter(|w| w.in_uar(off, 8)) {
            w.post(Bell::Uar64(off, v));
            return;
        }
        let kick = {
            let mut st = lock(&self.shared);
            // UAR doorbells (CQ, send/BlueFlame) are 64-bit registers and must be seen as one access; the
            // initialization segment has only 32-bit registers, so a 64-bit write there is two of them.
            (st.regs.health != Health::Gone && st.regs.in_uar(off, 8)).then(|| st.uar_write64(off, v))
        };
        match kick {
            // A send doorbell runs the datapath now (in-line) or on the device thread (threaded).
            Some(kick) => self.shared.run(kick),
            None => {
                self.write32(off, (v >> 32) as u32);
                self.write32(off.saturating_add(4), v as u32);
            }
        }
    }

    // The device orders through its lock; a full fence stands for the MMIO barriers and keeps threaded mode honest.
    // The two DMA barriers order only memory against memory (the device thread's CQE/EQE writes against the
    // driver's loads, the driver's WQE stores against its doorbell-record store): an acquire or release fence is
    // that ordering (the kernel's `dma_rmb`/`dma_wmb`; on x86-64 a compiler barrier), without the cost of a full
    // fence per polled CQE. Inlined: out of line the drop-in's poll paid a call per CQE for an empty function.
    #[inline]
    fn dma_wmb(&self) {
        fence(Ordering::Release)
    }
    #[inline]
    fn wmb(&self) {
        fence(Ordering::SeqCst)
    }
    #[inline]
    fn wc_start(&self) {
        fence(Ordering::SeqCst)
    }
    #[inline]
    fn wc_flush(&self) {
        fence(Ordering::SeqCst)
    }
    #[inline]
    fn dma_rmb(&self) {
        fence(Ordering::Acquire)
    }
    #[inline]
    fn mb(&self) {
        fence(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::events::SimEvent;
    use crate::regs::*;
    use crate::sim_device::SimDevice;
    use mlx5_core::hal::DelayNs;
    use mlx5_core::prm::{c, consts};

    #[test]
    fn init_segment_identity_registers() {
        let dev = SimDevice::new(SimConfig { cmd_q_init_to_ms: 2_000, ..SimConfig::default() });
        let m = dev.mmio();
        let fw = m.read32(c::mlx5_init_seg::FW_REV.off);
        assert_eq!(fw & 0xffff, 16);
        assert_eq!(fw >> 16, 35);
        let cmdif = m.read32(c::mlx5_init_seg::CMDIF_REV_FW_SUB.off);
        assert_eq!(cmdif >> 16, 5);
        assert_eq!(cmdif & 0xffff, 2000);
        let lsz = m.read32(CMDQ_ADDR_L_SZ);
        assert_eq!((lsz >> 4) & 0xf, 5);
        assert_eq!(lsz & 0xf, 6);
        assert_eq!((lsz >> 8) & 7, 0);
        assert_eq!(m.read32(c::mlx5_init_seg::CMD_EXEC_TO.off), 60_000);
        assert_eq!(m.read32(c::mlx5_init_seg::CMD_Q_INIT_TO.off), 2_000);
        // By default the firmware has no init-segment timeouts.
        assert_eq!(SimDevice::default().mmio().read32(c::mlx5_init_seg::CMD_Q_INIT_TO.off), 0);
        assert_eq!(m.read32(c::mlx5_init_seg::HEALTH.off), 0);
        assert_eq!(m.read32(m.bar_size()), u32::MAX);
        assert_eq!(m.read32(0x100), 0);
    }

    #[test]
    fn cmdq_address_and_nic_state() {
        let dev = SimDevice::default();
        let m = dev.mmio();
        m.write32(CMDQ_ADDR_H, 0x1);
        m.write32(CMDQ_ADDR_L_SZ, 0x2345_6000 | (1 << 8));
        assert!(dev.events().contains(&SimEvent::CmdqAddress { iova: 0x1_2345_6000 }));
        let lsz = m.read32(CMDQ_ADDR_L_SZ);
        assert_eq!(lsz & 0xff, 0x56);
        assert_eq!((lsz >> 8) & 7, 1);
        assert_eq!(lsz & !0xfff, 0x2345_6000);
        assert_eq!(m.read32(CMDQ_ADDR_H), 1);
        assert_eq!(m.read64(CMDQ_ADDR_H) >> 32, 1);
    }

    #[test]
    fn initializing_clears_on_virtual_time_and_heartbeat_ticks() {
        let dev = SimDevice::new(SimConfig { init_delay_ms: 5, ..SimConfig::default() });
        let m = dev.mmio();
        let mut d = dev.delay();
        assert_eq!(m.read32(INITIALIZING) >> 31, 1);
        let h0 = m.read32(HEALTH_COUNTER);
        d.delay_ms(5);
        assert_eq!(m.read32(INITIALIZING) >> 31, 0);
        assert_ne!(m.read32(HEALTH_COUNTER), h0);
    }

    #[test]
    fn unknown_and_uar_writes_are_recorded() {
        let dev = SimDevice::default();
        let m = dev.mmio();
        m.write32(0x100, 7);
        // A BlueFlame register (`MLX5_BF_OFFSET`): not interpreted yet.
        let uar = SimMmio::uar_offset(INIT_SEG_PAGES as u32) + consts::MLX5_BF_OFFSET as usize;
        m.write32(uar, 9);
        m.write32(m.bar_size() + 8, 1);
        let ev = dev.events();
        assert!(ev.contains(&SimEvent::IgnoredWrite { off: 0x100, val: 7 }));
        assert!(ev.contains(&SimEvent::UarWrite { off: uar, val: 9 }));
        assert_eq!(m.read32(0x100), 0);
    }

    #[test]
    fn device_memory_follows_the_uar_pages_and_is_not_a_doorbell() {
        let plain = SimDevice::default().mmio();
        assert_eq!(plain.uar_end(), plain.bar_size());
        let dev = SimDevice::new(SimConfig { memic_size: 0x4000, ..SimConfig::default() });
        let m = dev.mmio();
        assert_eq!(m.uar_end(), plain.bar_size());
        assert_eq!(m.bar_size(), m.uar_end() + 0x4000);
        // A store into device memory is no UAR write; the BAR ends after the region.
        m.write32(m.uar_end() + 8, 5);
        let ev = dev.events();
        assert!(ev.contains(&SimEvent::IgnoredWrite { off: m.uar_end() + 8, val: 5 }));
        assert!(!ev.iter().any(|e| matches!(e, SimEvent::UarWrite { .. })));
        assert_eq!(m.read32(m.bar_size() - 4), 0);
        assert_eq!(m.read32(m.bar_size()), u32::MAX);
    }
}
