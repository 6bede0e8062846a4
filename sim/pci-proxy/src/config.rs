//! Config space of the function as x-pci-proxy-dev can carry it: conventional PCI, a 256-byte header, BAR0 a
//! 32-bit memory BAR (QEMU's proxy sizes each BAR register on its own, so a 64-bit BAR would show its upper half
//! as a second, bogus BAR), INTx pin A, and the PCI Express capability so the guest sees function-level reset.
//! No MSI or MSI-X: the proxy cannot deliver them. Registers are little-endian; a per-byte write mask makes BAR
//! sizing fall out.

/// Size of BAR0 (a ConnectX-5's 32 MiB).
pub const BAR0_SIZE: u64 = 32 << 20;
/// Bytes of config space QEMU forwards for a conventional PCI function.
pub const CFG_SIZE: usize = 256;
/// Offset of the PCI Express capability.
const CAP_PCIE: usize = 0x40;
/// `PCI_CAP_ID_EXP`.
const CAP_ID_EXP: u8 = 0x10;
/// `PCI_EXP_DEVCAP_FLR`.
const DEVCAP_FLR: u32 = 1 << 28;
/// Offset of Device Control in the capability and its `PCI_EXP_DEVCTL_BCR_FLR` bit (write-only, reads zero).
const DEVCTL: usize = CAP_PCIE + 8;
const DEVCTL_BCR_FLR: u16 = 1 << 15;

/// The config space image.
#[derive(Debug, Clone)]
pub struct ConfigSpace {
    cfg: [u8; CFG_SIZE],
    wmask: [u8; CFG_SIZE],
}

impl ConfigSpace {
    /// A function with these ids and class code (`0x020000` Ethernet, `0x020700` InfiniBand).
    pub fn new(vendor: u16, device: u16, class: u32) -> Self {
        let mut f = Self { cfg: [0; CFG_SIZE], wmask: [0; CFG_SIZE] };
        f.put16(0x00, vendor);
        f.put16(0x02, device);
        // Command: I/O, memory, bus master, SERR and INTx disable are the OS's to set.
        f.mask16(0x04, 0x0547);
        // Status: the capability list exists.
        f.put16(0x06, 1 << 4);
        f.put32(0x08, class << 8);
        // Cache line size and latency timer are scratch for the OS.
        f.wmask[0x0c] = 0xff;
        f.wmask[0x0d] = 0xff;
        // BAR0: 32-bit memory, prefetchable; the low 25 bits are the size and read as zero.
        f.put32(0x10, 0b1000);
        f.mask32(0x10, !(BAR0_SIZE as u32 - 1));
        f.put16(0x2c, vendor);
        f.put16(0x2e, 0x0008);
        f.cfg[0x34] = CAP_PCIE as u8;
        f.wmask[0x3c] = 0xff;
        // Interrupt pin A, as the proxy's own copy says.
        f.cfg[0x3d] = 1;
        // PCI Express capability, version 2, endpoint; function-level reset offered.
        f.cfg[CAP_PCIE] = CAP_ID_EXP;
        f.put16(CAP_PCIE + 2, 0x0002);
        f.put32(CAP_PCIE + 4, 0x2 | DEVCAP_FLR);
        f.mask16(DEVCTL, 0x7fff);
        f.put32(CAP_PCIE + 0x0c, 0x3 | 16 << 4);
        f.put16(CAP_PCIE + 0x12, 0x3 | 16 << 4);
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

    /// A read of `len` bytes (1, 2 or 4) at `off`; `None` for another length or a range past the header.
    pub fn read(&self, off: u32, len: i32) -> Option<u32> {
        let (off, len) = Self::range(off, len)?;
        let mut b = [0u8; 4];
        b[..len].copy_from_slice(&self.cfg[off..off + len]);
        Some(u32::from_le_bytes(b))
    }

    /// A write of the low `len` bytes of `v`; read-only bits keep their value. `Some(true)` when it initiated a
    /// function-level reset, `None` when the access itself is malformed.
    pub fn write(&mut self, off: u32, len: i32, v: u32) -> Option<bool> {
        let (off, len) = Self::range(off, len)?;
        let bytes = v.to_le_bytes();
        let mut flr = false;
        for (i, &nb) in bytes.iter().enumerate().take(len) {
            let a = off + i;
            if a == DEVCTL + 1 && nb & (DEVCTL_BCR_FLR >> 8) as u8 != 0 {
                flr = true;
            }
            let m = self.wmask[a];
            self.cfg[a] = (self.cfg[a] & !m) | (nb & m);
        }
        Some(flr)
    }

    fn range(off: u32, len: i32) -> Option<(usize, usize)> {
        let len = usize::try_from(len).ok().filter(|l| matches!(l, 1 | 2 | 4))?;
        let off = usize::try_from(off).ok()?;
        (off.checked_add(len)? <= CFG_SIZE).then_some((off, len))
    }

    /// The guest-physical address the OS gave BAR0 (0 until it has).
    pub fn bar0(&self) -> u64 {
        u64::from(u32::from_le_bytes([self.cfg[0x10], self.cfg[0x11], self.cfg[0x12], self.cfg[0x13]]) & !0xf)
    }

    /// Whether memory decoding is on (command register bit 1).
    pub fn memory_enabled(&self) -> bool {
        self.cfg[0x04] & 0x2 != 0
    }

    /// Back to power-on state (function-level reset): the OS restores what it saved.
    pub fn reset(&mut self) {
        let (vendor, device) = (self.read(0, 2).unwrap_or(0) as u16, self.read(2, 2).unwrap_or(0) as u16);
        *self = Self::new(vendor, device, self.read(0x08, 4).unwrap_or(0) >> 8);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_class_pin_and_capability() {
        let f = ConfigSpace::new(0x15b3, 0x1017, 0x020000);
        assert_eq!(f.read(0, 4), Some(0x1017_15b3));
        assert_eq!(f.read(0x08, 4).map(|v| v >> 8), Some(0x020000));
        assert_eq!(f.read(0x3d, 1), Some(1));
        assert_eq!(f.read(0x34, 1), Some(0x40));
        assert_eq!(f.read(0x40, 2), Some(0x0010));
        assert_eq!(f.read(0x44, 4).map(|v| v & DEVCAP_FLR), Some(DEVCAP_FLR));
        // Malformed accesses are refused, not served.
        assert_eq!(f.read(0, 3), None);
        assert_eq!(f.read(254, 4), None);
        assert_eq!(f.read(u32::MAX, 4), None);
        assert_eq!(f.read(0, -1), None);
    }

    #[test]
    fn bar0_sizes_as_a_32_bit_bar_and_no_other_bar_exists() {
        let mut f = ConfigSpace::new(0x15b3, 0x1017, 0x020000);
        f.write(0x10, 4, u32::MAX);
        let v = f.read(0x10, 4).unwrap_or(0);
        assert_eq!(v & 0xf, 0x8, "32-bit memory, prefetchable");
        assert_eq!(u64::from(!(v & !0xf)) + 1, BAR0_SIZE);
        for bar in 1..6 {
            f.write(0x10 + 4 * bar, 4, u32::MAX);
            assert_eq!(f.read(0x10 + 4 * bar, 4), Some(0), "BAR{bar}");
        }
        f.write(0x10, 4, 0xfe00_0000);
        assert_eq!(f.bar0(), 0xfe00_0000);
        f.write(0, 4, 0);
        assert_eq!(f.read(0, 2), Some(0x15b3));
    }

    #[test]
    fn flr_bit_starts_a_reset_and_reads_zero() {
        let mut f = ConfigSpace::new(0x15b3, 0x1017, 0x020000);
        f.write(0x10, 4, 0xfe00_0000);
        assert_eq!(f.write(DEVCTL as u32, 2, 0x0010), Some(false));
        assert_eq!(f.write(DEVCTL as u32, 2, u32::from(DEVCTL_BCR_FLR)), Some(true));
        assert_eq!(f.read(DEVCTL as u32, 2).map(|v| v & u32::from(DEVCTL_BCR_FLR)), Some(0));
        f.reset();
        assert_eq!(f.bar0(), 0);
        assert_eq!(f.read(0, 4), Some(0x1017_15b3));
    }
}
