//! User doorbells through the BAR file. Our UML patch (`xtask/uml/0002-um-virt-pci-bar-file.patch`) backs user
//! mappings of the BAR window with a host file, so the UAR and BlueFlame pages rdma-core maps are pages of that
//! file: a process's stores land there and are not trapped. The bridge maps the same file and, on each pass of its
//! event loop (a 1 ms sleeping poll), compares the doorbell registers of every UAR page with what it saw last:
//! the first 8 bytes of each BlueFlame buffer (the send doorbell) and the CQ doorbell. A changed register is
//! replayed to the simulator as the 64-bit BAR write the process made.
//!
//! Each send doorbell carries the WQE index, so consecutive ones differ; one overwritten before a pass is not
//! lost, because the device reads the producer counter from the doorbell record (`MLX5_SND_DBR`), which covers
//! the earlier WQEs too. A register seen changed is cleared (an atomic exchange from the value seen to 0), so the
//! same value written again is a new doorbell: after a QP's reset its first WQE has index 0 again, and rdma-core
//! rings a register without BlueFlame at the same offset every time, so the doorbell was byte for byte the one
//! before the reset and went unseen (found with rdma-core's test_mr_rereg_addr under UML: the client's SEND after
//! both QPs' reset never completed). Kernel writes to the BAR never reach the file (they travel as virt-pci
//! messages).

use std::fs::File;
use std::os::fd::AsRawFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};

use mlx5_core::prm::consts;

/// The page size of UAR pages.
const PAGE: usize = 4096;
/// BlueFlame registers start here in a UAR page.
const BF_OFFSET: usize = consts::MLX5_BF_OFFSET as usize;
const BFREGS_PER_UAR: usize = consts::MLX5_BFREGS_PER_UAR as usize;
/// The CQ arm doorbell (one 64-bit register).
const CQ_DB: usize = consts::MLX5_CQ_DOORBELL as usize;

/// A shared mapping of the BAR file (read, and written only to clear a doorbell register seen) and the doorbell
/// registers last seen in it.
#[derive(Debug)]
pub struct BarFile {
    map: FileRegion,
    /// BAR offsets of the watched registers (8-byte aligned, below `len`).
    offs: Vec<usize>,
    /// Their values when last seen, as loaded (`last[i]` is the register at `offs[i]`).
    last: Vec<u64>,
}

// SAFETY: the mapping is owned by this value and accessed only through atomic loads and exchanges; any thread may
// do those on shared memory.
unsafe impl Send for BarFile {}

impl BarFile {
    /// Maps `file` (opened for reading and writing) and watches the UAR pages from `first_uar_page` up to `bar_size` bytes (within the file),
    /// with BlueFlame registers of `bf_reg_size` bytes (two buffers each).
    pub fn open(file: &File, first_uar_page: usize, bar_size: usize, bf_reg_size: usize) -> std::io::Result<Self> {
        Self::open_at(file, 0, first_uar_page, bar_size, bf_reg_size)
    }

    /// [`open`](Self::open) of a BAR that starts `file_offset` bytes into the file: UML backs its whole BAR
    /// window with one file, so the second device of a guest has its BAR further in (a page multiple).
    pub fn open_at(
        file: &File,
        file_offset: u64,
        first_uar_page: usize,
        bar_size: usize,
        bf_reg_size: usize,
    ) -> std::io::Result<Self> {
        if !file_offset.is_multiple_of(PAGE as u64) {
            return Err(std::io::Error::other(format!("BAR file offset {file_offset:#x} is not page aligned")));
        }
        let file_len = file.metadata()?.len().saturating_sub(file_offset);
        let len = bar_size.min(usize::try_from(file_len).unwrap_or(usize::MAX)) / PAGE * PAGE;
        if len == 0 {
            return Err(std::io::Error::other("the BAR file is smaller than a page past the BAR's offset"));
        }
        let map = FileRegion::map(file, file_offset, len)?;
        let mut offs = Vec::new();
        let half = (bf_reg_size / 2).max(8);
        for page in first_uar_page..len / PAGE {
            let base = page * PAGE;
            offs.push(base + CQ_DB);
            for b in 0..BFREGS_PER_UAR * 2 {
                let at = BF_OFFSET + b * half;
                if at + 8 <= PAGE {
                    offs.push(base + at);
                }
            }
        }
        let last = vec![0; offs.len()];
        let mut me = Self { map, offs, last };
        // Whatever the file holds before the guest runs is not a doorbell.
        let _ = me.changed();
        Ok(me)
    }

    /// The registers written since the last call, as (BAR offset, the 8 bytes in BAR order), in BAR order.
    ///
    /// The bridge calls this once a millisecond, so it is a tight loop of loads: one aligned 64-bit atomic load per
    /// register (a store in progress is seen whole or not at all), compared with the value last seen; a register
    /// that changed is then cleared, unless the guest wrote it again meanwhile (then the next call reports that).
    /// A store of 0 is not seen: no doorbell is 0 (it names a QP or CQ number above 0).
    pub fn changed(&mut self) -> Vec<(u64, [u8; 8])> {
        let mut out = Vec::new();
        let base = self.map.ptr().as_ptr();
        for (&off, last) in self.offs.iter().zip(self.last.iter_mut()) {
            // SAFETY: `off + 8 <= len` (the offsets are built below the mapping's length in `open_at`), the address is 8-byte
            // aligned (page-aligned mapping, offsets multiples of 8), and the mapping lives as long as `self`;
            // atomic because the guest writes it concurrently.
            let reg = unsafe { AtomicU64::from_ptr(base.add(off).cast::<u64>()) };
            let now = reg.load(Ordering::Acquire);
            if now != *last {
                out.push((off as u64, now.to_ne_bytes()));
                *last = match reg.compare_exchange(now, 0, Ordering::AcqRel, Ordering::Acquire) {
                    Ok(_) => 0,
                    Err(_) => now,
                };
            }
        }
        out
    }
}

/// A shared mapping of a range of the BAR file that the simulator reads and writes as memory: the device memory
/// (MEMIC) region, whose pages user processes map through the same file. Unmapped on drop.
#[derive(Debug)]
pub struct FileRegion {
    ptr: NonNull<u8>,
    len: usize,
}

impl FileRegion {
    /// Maps `len` bytes of `file` from `offset` (both page multiples, within the file).
    pub fn map(file: &File, offset: u64, len: usize) -> std::io::Result<Self> {
        let fits = offset.checked_add(len as u64).is_some_and(|e| e <= file.metadata().map_or(0, |m| m.len()));
        if len == 0 || !offset.is_multiple_of(PAGE as u64) || !len.is_multiple_of(PAGE) || !fits {
            return Err(std::io::Error::other(format!(
                "BAR file range {offset:#x}+{len:#x}: not whole pages inside the file"
            )));
        }
        let off = libc::off_t::try_from(offset).map_err(|_| std::io::Error::other("BAR file offset"))?;
        // SAFETY: a fresh shared mapping of an open file at a page-aligned offset within it; the kernel picks the
        // address, and the result is checked before use.
        let p = unsafe {
            let prot = libc::PROT_READ | libc::PROT_WRITE;
            libc::mmap(std::ptr::null_mut(), len, prot, libc::MAP_SHARED, file.as_raw_fd(), off)
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<u8>()).ok_or_else(|| std::io::Error::other("mmap returned null"))?;
        Ok(Self { ptr, len })
    }

    /// The mapping's first byte.
    pub fn ptr(&self) -> NonNull<u8> {
        self.ptr
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for FileRegion {
    fn drop(&mut self) {
        // SAFETY: unmaps exactly the mapping made in `map`, which nothing else refers to.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::FileExt;

    #[test]
    fn a_store_to_a_doorbell_register_is_reported_once_and_others_are_not() {
        let path = std::env::temp_dir().join(format!("mlx5-barfile-{}", std::process::id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(8 * PAGE as u64).unwrap();
        // Something in the file before the watch starts is not a doorbell.
        f.write_all_at(&[1; 8], (2 * PAGE + BF_OFFSET) as u64).unwrap();
        let mut w = BarFile::open(&f, 2, 8 * PAGE, 512).unwrap();
        assert!(w.changed().is_empty());
        // A send doorbell in the second buffer of UAR page 3 and a CQ arm on page 4.
        let bell = [0, 0, 0x10, 0x0a, 0, 0, 0x12, 0x34];
        f.write_all_at(&bell, (3 * PAGE + BF_OFFSET + 256) as u64).unwrap();
        f.write_all_at(&[9; 8], (4 * PAGE + CQ_DB) as u64).unwrap();
        // A BlueFlame copy word and a store to the init segment are not doorbells.
        f.write_all_at(&[7; 8], (3 * PAGE + BF_OFFSET + 8) as u64).unwrap();
        f.write_all_at(&[7; 8], 0x18).unwrap();
        let got = w.changed();
        assert_eq!(got, vec![((3 * PAGE + BF_OFFSET + 256) as u64, bell), ((4 * PAGE + CQ_DB) as u64, [9; 8])]);
        assert!(w.changed().is_empty());
        // The register seen was cleared: the same doorbell again (a reset QP's WQE 0 once more) is seen again.
        let mut reg = [0xffu8; 8];
        f.read_exact_at(&mut reg, (3 * PAGE + BF_OFFSET + 256) as u64).unwrap();
        assert_eq!(reg, [0; 8]);
        f.write_all_at(&bell, (3 * PAGE + BF_OFFSET + 256) as u64).unwrap();
        assert_eq!(w.changed(), vec![((3 * PAGE + BF_OFFSET + 256) as u64, bell)]);
        assert!(w.changed().is_empty());
        std::fs::remove_file(&path).unwrap();
        // A file too small to hold a page is refused, not mapped.
        let tiny = std::env::temp_dir().join(format!("mlx5-barfile-tiny-{}", std::process::id()));
        let t = File::create(&tiny).unwrap();
        assert!(BarFile::open(&t, 0, 8 * PAGE, 512).is_err());
        std::fs::remove_file(&tiny).unwrap();
    }

    #[test]
    fn a_second_device_watches_its_own_bar_further_into_the_file() {
        // Two 8-page BARs in one file, as UML backs its whole BAR window with one: the second device's watch
        // sees its own page 3 and not the first device's.
        let path = std::env::temp_dir().join(format!("mlx5-barfile-two-{}", std::process::id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(16 * PAGE as u64).unwrap();
        let second = 8 * PAGE as u64;
        let mut w = BarFile::open_at(&f, second, 2, 8 * PAGE, 512).unwrap();
        f.write_all_at(&[5; 8], (3 * PAGE + CQ_DB) as u64).unwrap();
        assert!(w.changed().is_empty());
        f.write_all_at(&[6; 8], second + (3 * PAGE + CQ_DB) as u64).unwrap();
        assert_eq!(w.changed(), vec![((3 * PAGE + CQ_DB) as u64, [6; 8])]);
        // An offset that is not a page multiple, or past the file's end, is refused.
        assert!(BarFile::open_at(&f, 100, 2, 8 * PAGE, 512).is_err());
        assert!(BarFile::open_at(&f, 16 * PAGE as u64, 2, 8 * PAGE, 512).is_err());
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_doorbell_in_the_file_reaches_the_simulators_uar_decoder_as_the_process_wrote_it() {
        use crate::device::Device;
        use mlx5_sim::{SimConfig, SimDevice, SimEvent};
        let path = std::env::temp_dir().join(format!("mlx5-barfile-dev-{}", std::process::id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(8 * PAGE as u64).unwrap();
        let mut dev = Device::new(SimDevice::new(SimConfig::default()), 0x020000);
        // The simulator's initialization segment comes first; its UAR pages follow.
        let first = mlx5_sim::FIRST_UAR_PAGE;
        let mut w = BarFile::open(&f, first, 8 * PAGE, mlx5_sim::BF_REG_SIZE).unwrap();
        // mlx5_cq_arm as rdma-core stores it: the big-endian 64-bit (sn, cmd, ci) word and CQ number 7.
        let bell = (0x1000_0005u64 << 32 | 7).to_be_bytes();
        let off = (first + 1) * PAGE + CQ_DB;
        f.write_all_at(&bell, off as u64).unwrap();
        for (at, bytes) in w.changed() {
            dev.bar_write(at, &bytes);
        }
        // No UAR page is allocated on a device not brought up: the decoder says so, with the value as written.
        let want = SimEvent::BadCqDoorbell { off, val: u64::from_be_bytes(bell), why: "UAR page not allocated" };
        assert!(dev.sim.events().contains(&want), "{:?}", dev.sim.events());
        std::fs::remove_file(&path).unwrap();
    }
}
