//! The virtio-pcidev device: virt-pci's requests (config space and BAR accesses) served from the PCI function
//! model and the simulator's BAR, and the simulator's EQ interrupts turned into MSI messages.

use mlx5_core::hal::Mmio;
use mlx5_sim::{SimDevice, SimMmio};

use crate::pci::PciFunction;

/// `VIRTIO_PCIDEV_OP_*` (include/uapi/linux/virtio_pcidev.h).
pub const OP_CFG_READ: u8 = 1;
pub const OP_CFG_WRITE: u8 = 2;
pub const OP_MMIO_READ: u8 = 3;
pub const OP_MMIO_WRITE: u8 = 4;
pub const OP_MMIO_MEMSET: u8 = 5;
pub const OP_MSI: u8 = 7;
/// Bytes of `struct virtio_pcidev_msg` before its data.
pub const HDR: usize = 16;
/// The largest BAR access served (virt-pci sends `memcpy_toio` as one message).
const MAX_ACCESS: usize = 64 * 1024;

/// A request header: `op`, `bar`, `size`, `addr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub op: u8,
    pub bar: u8,
    pub size: u32,
    pub addr: u64,
}

impl Request {
    pub fn parse(b: &[u8]) -> Option<Self> {
        let h = b.get(..HDR)?;
        Some(Self {
            op: h[0],
            bar: h[1],
            size: u32::from_le_bytes(h[4..8].try_into().ok()?),
            addr: u64::from_le_bytes(h[8..16].try_into().ok()?),
        })
    }
}

/// An MSI message for the irq queue: op MSI with the 32-bit data word (virt-pci's MSI data is the Linux IRQ number).
pub fn msi_message(data: u32) -> [u8; HDR + 4] {
    let mut m = [0u8; HDR + 4];
    m[0] = OP_MSI;
    m[4..8].copy_from_slice(&4u32.to_le_bytes());
    m[HDR..].copy_from_slice(&data.to_le_bytes());
    m
}

/// Counters of what the guest asked for.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub cfg_reads: u64,
    pub cfg_writes: u64,
    pub mmio_reads: u64,
    pub mmio_writes: u64,
    /// Requests that could not be served (bad op, BAR, size): answered with ones or dropped.
    pub rejected: u64,
    /// BAR writes narrower than the device's 32-bit registers (the simulator cannot take them).
    pub narrow_writes: u64,
    pub msis: u64,
    /// Doorbells user processes wrote into the BAR file (`barfile.rs`), replayed as BAR writes.
    pub user_doorbells: u64,
    /// EQ interrupts the simulator fired (each becomes an MSI now or when its vector is unmasked).
    pub interrupts: u64,
    /// Scans of the BAR file for user doorbells (at most one a millisecond, however many requests arrive).
    pub bar_scans: u64,
    /// The most requests found waiting on the command queue at once.
    pub max_backlog: u16,
    /// Passes that found the command queue full (virt-pci then waits for room:
    /// `xtask/uml/0005-um-virt-pci-wait-for-room.patch`; UML 6.12 dropped the request).
    pub full_queue: u64,
}

/// The device behind the virtqueues.
#[derive(Debug)]
pub struct Device {
    pub sim: SimDevice,
    mmio: SimMmio,
    pub pci: PciFunction,
    pub stats: Stats,
    irq_cursor: usize,
    /// Log every BAR write to stderr.
    pub verbose: bool,
}

impl Device {
    pub fn new(sim: SimDevice, class: u32) -> Self {
        let (vendor, device) = sim.config().pci_ids;
        Self {
            mmio: sim.mmio(),
            sim,
            pci: PciFunction::new(vendor, device, class),
            stats: Stats::default(),
            irq_cursor: 0,
            verbose: false,
        }
    }

    /// Counts a request that could not be served and says which (rare: each one is worth a look).
    fn reject(&mut self, req: Option<Request>, out: &[u8]) {
        self.stats.rejected += 1;
        eprintln!(
            "mlx5-uml-bridge: rejected request {req:?} ({} bytes: {:02x?})",
            out.len(),
            &out[..out.len().min(64)]
        );
    }

    /// Serves one request chain's driver bytes; returns the bytes for its device-writable part (empty for
    /// writes) and the MSI data words a write made deliverable.
    pub fn handle(&mut self, out: &[u8]) -> (Vec<u8>, Vec<u32>) {
        let Some(req) = Request::parse(out) else {
            self.reject(None, out);
            return (Vec::new(), Vec::new());
        };
        let data = &out[HDR..];
        let size = req.size as usize;
        match req.op {
            OP_CFG_READ => {
                self.stats.cfg_reads += 1;
                if !matches!(size, 1 | 2 | 4 | 8) {
                    self.reject(Some(req), out);
                    return (vec![0xff; 8], Vec::new());
                }
                (self.pci.cfg_read(req.addr, size).to_le_bytes()[..size].to_vec(), Vec::new())
            }
            // virt-pci sends `memset_io` on a BAR as CFG_WRITE with one data byte and `size` the length
            // (`um_pci_bar_set`); a config write always carries `size` bytes.
            OP_CFG_WRITE if size > 1 && data.len() == 1 => (Vec::new(), self.bar_memset(req, data[0])),
            OP_MMIO_MEMSET if !data.is_empty() => (Vec::new(), self.bar_memset(req, data[0])),
            OP_CFG_WRITE => {
                self.stats.cfg_writes += 1;
                if !matches!(size, 1 | 2 | 4 | 8) || data.len() < size {
                    self.reject(Some(req), out);
                    return (Vec::new(), Vec::new());
                }
                let mut v = [0u8; 8];
                v[..size].copy_from_slice(&data[..size]);
                (Vec::new(), self.pci.cfg_write(req.addr, size, u64::from_le_bytes(v)))
            }
            OP_MMIO_READ => {
                self.stats.mmio_reads += 1;
                let mut buf = vec![0xff; size.min(MAX_ACCESS)];
                if req.bar == 0 && size <= MAX_ACCESS {
                    self.bar_read(req.addr, &mut buf);
                } else {
                    self.reject(Some(req), out);
                }
                (buf, Vec::new())
            }
            OP_MMIO_WRITE => {
                self.stats.mmio_writes += 1;
                if req.bar != 0 || data.len() < size || size > MAX_ACCESS {
                    self.reject(Some(req), out);
                    return (Vec::new(), Vec::new());
                }
                (Vec::new(), self.bar_write(req.addr, &data[..size]))
            }
            _ => {
                self.reject(Some(req), out);
                (Vec::new(), Vec::new())
            }
        }
    }

    fn bar_memset(&mut self, req: Request, byte: u8) -> Vec<u32> {
        self.stats.mmio_writes += 1;
        let size = req.size as usize;
        if req.bar != 0 || size > MAX_ACCESS {
            self.reject(Some(req), &[]);
            return Vec::new();
        }
        self.bar_write(req.addr, &vec![byte; size])
    }

    /// A BAR0 read: the MSI-X structures from the function model, the rest from the simulator's BAR, whose
    /// registers are big-endian 32-bit words (bytes in BAR order are the word's big-endian bytes).
    pub fn bar_read(&mut self, off: u64, buf: &mut [u8]) {
        if PciFunction::is_msix(off, buf.len()) {
            self.pci.msix_read(off, buf);
            return;
        }
        let mut i = 0;
        while i < buf.len() {
            let a = off + i as u64;
            let word = a & !3;
            let bytes = match usize::try_from(word) {
                Ok(w) => self.mmio.read32(w).to_be_bytes(),
                Err(_) => [0xff; 4],
            };
            let from = (a - word) as usize;
            let n = (4 - from).min(buf.len() - i);
            buf[i..i + n].copy_from_slice(&bytes[from..from + n]);
            i += n;
        }
    }

    /// A BAR0 write: 64-bit aligned pieces as one 64-bit access (doorbells), 32-bit ones as registers.
    pub fn bar_write(&mut self, off: u64, data: &[u8]) -> Vec<u32> {
        if self.verbose {
            eprintln!("bar write 0x{off:x} {data:02x?}");
        }
        if PciFunction::is_msix(off, data.len()) {
            return self.pci.msix_write(off, data);
        }
        let mut i = 0;
        while i < data.len() {
            let a = off + i as u64;
            let Ok(au) = usize::try_from(a) else { break };
            let rest = data.len() - i;
            if a.is_multiple_of(8) && rest >= 8 {
                let v = u64::from_be_bytes(data[i..i + 8].try_into().unwrap_or_default());
                self.mmio.write64(au, v);
                i += 8;
            } else if a.is_multiple_of(4) && rest >= 4 {
                let v = u32::from_be_bytes(data[i..i + 4].try_into().unwrap_or_default());
                self.mmio.write32(au, v);
                i += 4;
            } else {
                // The device has no sub-word registers; such a write is counted and dropped.
                self.stats.narrow_writes += 1;
                i += rest.min(4 - (a % 4) as usize);
            }
        }
        Vec::new()
    }

    /// Lets device time catch up with `now_ns` (wall time since start): heartbeat, timers, delayed work.
    pub fn tick(&mut self, now_ns: u64) {
        let dev_ns = self.sim.now_ns();
        if now_ns > dev_ns {
            self.sim.advance_ns(now_ns - dev_ns);
        }
    }

    /// The MSI data words of the interrupts the simulator fired since the last call (masked vectors are held
    /// pending by the function model).
    pub fn take_msis(&mut self) -> Vec<u32> {
        let vectors = self.sim.interrupts_since(&mut self.irq_cursor);
        self.stats.interrupts += vectors.len() as u64;
        let out: Vec<u32> = vectors.into_iter().filter_map(|v| self.pci.signal(v)).collect();
        self.stats.msis += out.len() as u64;
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx5_core::prm::c;
    use mlx5_sim::SimConfig;

    fn req(op: u8, size: u32, addr: u64, data: &[u8]) -> Vec<u8> {
        let mut m = vec![op, 0, 0, 0];
        m.extend_from_slice(&size.to_le_bytes());
        m.extend_from_slice(&addr.to_le_bytes());
        m.extend_from_slice(data);
        m
    }

    #[test]
    fn bar_reads_are_the_init_segment_in_big_endian_byte_order() {
        let mut d = Device::new(SimDevice::new(SimConfig::default()), 0x020000);
        // fw_rev: minor 35 (0x23) in the high half, major 16 in the low half, stored big-endian.
        let (r, _) = d.handle(&req(OP_MMIO_READ, 4, c::mlx5_init_seg::FW_REV.off as u64, &[]));
        assert_eq!(r, vec![0x00, 0x23, 0x00, 0x10]);
        // ioread32be in the guest: the little-endian load, byte-swapped.
        assert_eq!(u32::from_be_bytes(r.try_into().unwrap()) & 0xffff, 16);
        // A 2-byte read in the middle of the word.
        let (r, _) = d.handle(&req(OP_MMIO_READ, 2, 2, &[]));
        assert_eq!(r, vec![0x00, 0x10]);
        // A read of another BAR is all ones.
        let mut m = req(OP_MMIO_READ, 4, 0, &[]);
        m[1] = 2;
        assert_eq!(d.handle(&m).0, vec![0xff; 4]);
        assert_eq!(d.stats.rejected, 1);
    }

    #[test]
    fn config_requests_and_bad_sizes() {
        let mut d = Device::new(SimDevice::new(SimConfig::default()), 0x020000);
        assert_eq!(d.handle(&req(OP_CFG_READ, 4, 0, &[])).0, vec![0xb3, 0x15, 0x17, 0x10]);
        d.handle(&req(OP_CFG_WRITE, 4, 0x10, &0xf000_0000u32.to_le_bytes()));
        assert_eq!(d.pci.bar0(), 0xf000_0000);
        assert_eq!(d.handle(&req(OP_CFG_READ, 3, 0, &[])).0, vec![0xff; 8]);
        // A truncated header, an unknown op: rejected, no panic.
        assert_eq!(d.handle(&[1, 2, 3]).0, Vec::<u8>::new());
        d.handle(&req(9, 4, 0, &[]));
        assert_eq!(d.stats.rejected, 3);
    }

    #[test]
    fn msix_table_writes_go_to_the_function_model() {
        let mut d = Device::new(SimDevice::new(SimConfig::default()), 0x020000);
        let e = crate::pci::MSIX_TABLE;
        d.handle(&req(OP_MMIO_WRITE, 4, e + 8, &0x41u32.to_le_bytes()));
        assert_eq!(d.handle(&req(OP_MMIO_READ, 4, e + 8, &[])).0, 0x41u32.to_le_bytes().to_vec());
        assert_eq!(msi_message(0x41)[..8], [OP_MSI, 0, 0, 0, 4, 0, 0, 0]);
    }
}
