//! PCI configuration space (type 0 header, PCI Express and MSI-X capabilities) and the MSI-X table.
//!
//! Config space is a byte image with a per-byte write mask, so BAR sizing falls out of the mask: writing all ones
//! to BAR0 reads back the size bits as zero. Registers are little-endian, as PCI defines them.

/// Size of BAR0 (a ConnectX-5's 32 MiB, 64-bit prefetchable).
pub const BAR0_SIZE: u64 = 32 << 20;
/// MSI-X vectors the function offers (UML's virt-pci handles at most 32 in all, `virt-pci.c` `MAX_MSI_VECTORS`).
pub const MSIX_VECTORS: usize = 32;
/// BAR0 offset of the MSI-X table: far above the init segment and UAR pages, and below 16 MiB. UML's
/// `lib/logic_iomem.c` encodes an ioremap cookie as area index << 24 plus the offset from the start of the BAR, so
/// an access 16 MiB or more into a BAR lands in another area and is dropped with "Invalid writeql" (measured: the
/// table first sat in the BAR's last pages and MSI-X vector 31 was never reachable).
pub const MSIX_TABLE: u64 = 0x80_0000;
/// BAR0 offset of the pending-bit array.
pub const MSIX_PBA: u64 = MSIX_TABLE + 0x1000;
/// The end of the MSI-X structures.
const MSIX_END: u64 = MSIX_PBA + 0x1000;
const _: () = assert!(MSIX_END <= 1 << 24 && MSIX_END <= BAR0_SIZE);
/// Bytes of one MSI-X table entry: address low, address high, data, vector control.
const MSIX_ENTRY: usize = 16;
/// Bytes of config space (PCI Express has 4 KiB).
pub const CFG_SIZE: usize = 4096;

/// Offset of the PCI Express capability.
const CAP_PCIE: usize = 0x40;
/// Offset of the MSI-X capability.
const CAP_MSIX: usize = 0x80;
/// `PCI_CAP_ID_EXP` and `PCI_CAP_ID_MSIX`.
const CAP_ID_EXP: u8 = 0x10;
const CAP_ID_MSIX: u8 = 0x11;
/// `PCI_MSIX_FLAGS_ENABLE` and `PCI_MSIX_FLAGS_MASKALL` in the message control word.
const MSIX_ENABLE: u16 = 1 << 15;
const MSIX_MASKALL: u16 = 1 << 14;
/// `PCI_MSIX_ENTRY_CTRL_MASKBIT`.
const ENTRY_MASKED: u32 = 1;

/// Config space and MSI-X state of the function.
#[derive(Debug, Clone)]
pub struct PciFunction {
    cfg: Vec<u8>,
    wmask: Vec<u8>,
    table: Vec<u8>,
    pending: u64,
}

impl PciFunction {
    /// A function with these ids and class code (`0x020000` Ethernet, `0x020700` InfiniBand).
    pub fn new(vendor: u16, device: u16, class: u32) -> Self {
        let mut f = Self {
            cfg: vec![0; CFG_SIZE],
            wmask: vec![0; CFG_SIZE],
            table: vec![0; MSIX_VECTORS * MSIX_ENTRY],
            pending: 0,
        };
        f.put16(0x00, vendor);
        f.put16(0x02, device);
        // Status: the capability list exists.
        f.put16(0x06, 1 << 4);
        // Command: I/O, memory, bus master, SERR, and INTx disable are the driver's to set.
        f.mask16(0x04, 0x0547);
        f.put32(0x08, class << 8);
        // BAR0: 64-bit (type 2), prefetchable; the low 25 bits are the size, read-only zero.
        f.put32(0x10, 0b1100);
        f.mask32(0x10, !(BAR0_SIZE as u32 - 1));
        f.mask32(0x14, u32::MAX);
        // Subsystem vendor and id.
        f.put16(0x2c, vendor);
        f.put16(0x2e, 0x0008);
        f.cfg[0x34] = CAP_PCIE as u8;
        // Interrupt line is scratch for the OS.
        f.wmask[0x3c] = 0xff;

        // PCI Express capability, version 2, endpoint.
        f.cfg[CAP_PCIE] = CAP_ID_EXP;
        f.cfg[CAP_PCIE + 1] = CAP_MSIX as u8;
        f.put16(CAP_PCIE + 2, 0x0002);
        // Device capabilities: 512-byte max payload, function-level reset.
        f.put32(CAP_PCIE + 4, 0x2 | 1 << 28);
        // Device control is the OS's (max payload, read request size, error reporting).
        f.mask16(CAP_PCIE + 8, 0x7fff);
        // Link capabilities: 8 GT/s, x16; link status the same, trained.
        f.put32(CAP_PCIE + 0x0c, 0x3 | 16 << 4);
        f.mask16(CAP_PCIE + 0x10, 0x0fff);
        f.put16(CAP_PCIE + 0x12, 0x3 | 16 << 4);
        f.mask16(CAP_PCIE + 0x28, 0xffff);

        // MSI-X: table and PBA in BAR0; enable and mask-all are the OS's.
        f.cfg[CAP_MSIX] = CAP_ID_MSIX;
        f.put16(CAP_MSIX + 2, (MSIX_VECTORS - 1) as u16);
        f.mask16(CAP_MSIX + 2, MSIX_ENABLE | MSIX_MASKALL);
        f.put32(CAP_MSIX + 4, MSIX_TABLE as u32);
        f.put32(CAP_MSIX + 8, MSIX_PBA as u32);
        // Every vector starts masked (PCI Local Bus spec, MSI-X vector control).
        for v in 0..MSIX_VECTORS {
            f.table[v * MSIX_ENTRY + 12] = ENTRY_MASKED as u8;
        }
        f
    }

    fn put16(&mut self, off: usize, v: u16) {
        self.cfg[off..off + 2].copy_from_slice(&v.to_le_bytes());
    }
    fn put32(&mut self, off: usize, v: u32) {
        self.cfg[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }
    fn mask16(&mut self, off: usize, m: u16) {
        self.wmask[off..off + 2].copy_from_slice(&m.to_le_bytes());
    }
    fn mask32(&mut self, off: usize, m: u32) {
        self.wmask[off..off + 4].copy_from_slice(&m.to_le_bytes());
    }

    /// A config read of `len` bytes (1, 2, 4 or 8); bytes past the end read as ones.
    pub fn cfg_read(&self, off: u64, len: usize) -> u64 {
        let mut b = [0xffu8; 8];
        for (i, byte) in b.iter_mut().enumerate().take(len.min(8)) {
            if let Some(v) = off.checked_add(i as u64).and_then(|a| self.cfg.get(a as usize)) {
                *byte = *v;
            }
        }
        if len < 8 {
            for byte in &mut b[len..] {
                *byte = 0;
            }
        }
        u64::from_le_bytes(b)
    }

    /// A config write of the low `len` bytes of `v`; read-only bits keep their value. Returns the MSI data words of
    /// interrupts that the write unmasked while pending.
    pub fn cfg_write(&mut self, off: u64, len: usize, v: u64) -> Vec<u32> {
        let bytes = v.to_le_bytes();
        for (i, &nb) in bytes.iter().enumerate().take(len.min(8)) {
            let Some(a) = off.checked_add(i as u64).map(|a| a as usize).filter(|&a| a < CFG_SIZE) else { break };
            let m = self.wmask[a];
            self.cfg[a] = (self.cfg[a] & !m) | (nb & m);
        }
        self.deliver_pending()
    }

    /// The address the OS assigned to BAR0 (0 until it has).
    pub fn bar0(&self) -> u64 {
        let lo = u32::from_le_bytes(self.cfg[0x10..0x14].try_into().unwrap_or_default()) & !0xf;
        let hi = u32::from_le_bytes(self.cfg[0x14..0x18].try_into().unwrap_or_default());
        (u64::from(hi) << 32) | u64::from(lo)
    }

    fn msix_ctrl(&self) -> u16 {
        u16::from_le_bytes([self.cfg[CAP_MSIX + 2], self.cfg[CAP_MSIX + 3]])
    }

    /// Whether `off..off + len` of BAR0 is the MSI-X table or PBA (which this module serves, not the device).
    pub fn is_msix(off: u64, len: usize) -> bool {
        off >= MSIX_TABLE && off.saturating_add(len as u64) <= MSIX_END
    }

    /// A read of the MSI-X table or PBA.
    pub fn msix_read(&self, off: u64, buf: &mut [u8]) {
        for (i, b) in buf.iter_mut().enumerate() {
            let a = off + i as u64;
            *b = if a >= MSIX_PBA {
                let bit = (a - MSIX_PBA) * 8;
                if bit < 64 {
                    (self.pending >> bit) as u8
                } else {
                    0
                }
            } else {
                self.table.get((a - MSIX_TABLE) as usize).copied().unwrap_or(0)
            };
        }
    }

    /// A write to the MSI-X table (the PBA is read-only). Returns the data words of pending interrupts it unmasked.
    pub fn msix_write(&mut self, off: u64, data: &[u8]) -> Vec<u32> {
        for (i, &b) in data.iter().enumerate() {
            let a = off + i as u64;
            if a >= MSIX_PBA || a >= MSIX_END {
                break;
            }
            let t = (a - MSIX_TABLE) as usize;
            if let Some(slot) = self.table.get_mut(t) {
                // Only the mask bit of vector control is writable.
                *slot = if t % MSIX_ENTRY == 12 {
                    b & ENTRY_MASKED as u8
                } else if t % MSIX_ENTRY > 12 {
                    0
                } else {
                    b
                };
            }
        }
        self.deliver_pending()
    }

    fn entry_word(&self, vector: usize, word: usize) -> u32 {
        let o = vector * MSIX_ENTRY + 4 * word;
        u32::from_le_bytes(self.table[o..o + 4].try_into().unwrap_or_default())
    }

    /// Signals MSI-X `vector`: the data word to send now, or `None` when the vector is masked (it is then pending
    /// and sent when unmasked) or does not exist.
    pub fn signal(&mut self, vector: u16) -> Option<u32> {
        let v = usize::from(vector);
        if v >= MSIX_VECTORS {
            return None;
        }
        let ctrl = self.msix_ctrl();
        let masked = ctrl & MSIX_ENABLE == 0 || ctrl & MSIX_MASKALL != 0 || self.entry_word(v, 3) & ENTRY_MASKED != 0;
        if masked {
            self.pending |= 1 << v;
            return None;
        }
        Some(self.entry_word(v, 2))
    }

    fn deliver_pending(&mut self) -> Vec<u32> {
        let mut out = Vec::new();
        let pending = std::mem::take(&mut self.pending);
        for v in 0..MSIX_VECTORS {
            if pending & (1 << v) != 0 {
                if let Some(d) = self.signal(v as u16) {
                    out.push(d);
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f() -> PciFunction {
        PciFunction::new(0x15b3, 0x1017, 0x020700)
    }

    #[test]
    fn header_ids_class_and_capability_chain() {
        let f = f();
        assert_eq!(f.cfg_read(0, 4), 0x1017_15b3);
        assert_eq!(f.cfg_read(0, 8), 0x0010_0000_1017_15b3);
        assert_eq!(f.cfg_read(0x08, 4) >> 8, 0x020700);
        assert_eq!(f.cfg_read(0x06, 2) & 0x10, 0x10);
        // Capability list: 0x34 -> PCIe at 0x40 -> MSI-X at 0x80 -> end.
        let p = f.cfg_read(0x34, 1);
        assert_eq!(f.cfg_read(p, 2), 0x8010);
        assert_eq!(f.cfg_read(0x80, 2), 0x0011);
        // 32 vectors; table and PBA in BAR0 (BIR 0).
        assert_eq!(f.cfg_read(0x82, 2), 31);
        assert_eq!(f.cfg_read(0x84, 4), MSIX_TABLE);
        assert_eq!(f.cfg_read(0x88, 4), MSIX_PBA);
        // Beyond the function: ones.
        assert_eq!(f.cfg_read(4095, 2), 0xff00 | f.cfg_read(4095, 1));
    }

    #[test]
    fn bar0_sizing_then_assignment() {
        let mut f = f();
        // The OS writes all ones and reads back the size mask with the type bits.
        f.cfg_write(0x10, 4, 0xffff_ffff);
        f.cfg_write(0x14, 4, 0xffff_ffff);
        let lo = f.cfg_read(0x10, 4);
        let hi = f.cfg_read(0x14, 4);
        assert_eq!(lo & 0xf, 0xc);
        let size = !((hi << 32) | (lo & !0xf)) + 1;
        assert_eq!(size, BAR0_SIZE);
        f.cfg_write(0x10, 4, 0xf000_0000);
        f.cfg_write(0x14, 4, 0);
        assert_eq!(f.bar0(), 0xf000_0000);
        assert_eq!(f.cfg_read(0x10, 4), 0xf000_000c);
        // Read-only identity bytes ignore writes.
        f.cfg_write(0, 4, 0);
        assert_eq!(f.cfg_read(0, 2), 0x15b3);
    }

    #[test]
    fn msix_delivers_the_programmed_data_word_and_holds_masked_vectors() {
        let mut f = f();
        // Not enabled yet: the interrupt is held.
        assert_eq!(f.signal(1), None);
        let mut pba = [0u8; 8];
        f.msix_read(MSIX_PBA, &mut pba);
        assert_eq!(u64::from_le_bytes(pba), 2);
        // Program entry 1: address 0xa0000, data 0x41, then unmask; enable MSI-X.
        let e = MSIX_TABLE + 16;
        f.msix_write(e, &0xa0000u32.to_le_bytes());
        f.msix_write(e + 8, &0x41u32.to_le_bytes());
        assert_eq!(f.msix_write(e + 12, &0u32.to_le_bytes()), Vec::<u32>::new());
        // Enabling delivers the pending one.
        assert_eq!(f.cfg_write(0x82, 2, u64::from(MSIX_ENABLE) | 31), vec![0x41]);
        assert_eq!(f.signal(1), Some(0x41));
        let mut d = [0u8; 4];
        f.msix_read(e + 8, &mut d);
        assert_eq!(u32::from_le_bytes(d), 0x41);
        // Vector count is read-only; mask-all holds interrupts.
        assert_eq!(f.cfg_read(0x82, 2), u64::from(MSIX_ENABLE) | 31);
        f.cfg_write(0x82, 2, u64::from(MSIX_ENABLE | MSIX_MASKALL));
        assert_eq!(f.signal(1), None);
        assert_eq!(f.cfg_write(0x82, 2, u64::from(MSIX_ENABLE)), vec![0x41]);
        // A vector beyond the table never signals.
        assert_eq!(f.signal(MSIX_VECTORS as u16), None);
        assert!(PciFunction::is_msix(MSIX_TABLE, 4));
        assert!(!PciFunction::is_msix(0x1000, 4));
    }
}
