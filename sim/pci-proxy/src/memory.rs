//! Guest RAM as the device sees it: the memfd regions SYNC_SYSMEM shares, mapped here and made DMA-reachable at
//! their guest-physical addresses.
//!
//! QEMU sends the whole set again on every memory-topology change (SeaBIOS toggling the PAM ranges, BARs being
//! placed). The simulator can map guest memory but not unmap it, so the server keeps the union: a range already
//! mapped stays mapped, and only the parts of a new region not yet covered are mapped. A region whose backing
//! differs from what is already mapped at that address cannot be remapped and is counted as stale.

use std::os::fd::{AsRawFd, OwnedFd};
use std::ptr::NonNull;

use mlx5_sim::SimDevice;

use crate::msg::SysmemRegion;

/// Why a region of a SYNC_SYSMEM was not (fully) mapped.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    #[error("region at 0x{gpa:x}: size {size} and offset {offset} do not fit a page-aligned mapping")]
    Shape { gpa: u64, size: u64, offset: u64 },
    #[error("region at 0x{gpa:x}: offset {offset} + size {size} runs past the end of its file ({file_len} bytes)")]
    PastEnd { gpa: u64, size: u64, offset: u64, file_len: u64 },
    #[error("region at 0x{gpa:x}: fstat or mmap failed")]
    Os {
        gpa: u64,
        #[source]
        source: std::io::Error,
    },
    #[error("region at 0x{gpa:x}: the simulator refused the mapping: {what}")]
    Refused { gpa: u64, what: String },
}

const PAGE: u64 = 4096;

/// One mapping of part of a guest RAM file.
#[derive(Debug)]
struct Mapping {
    gpa: u64,
    len: usize,
    host: NonNull<u8>,
    /// The file (device, inode) and the offset in it of `gpa`: what a later region at that address must match.
    backing: (u64, u64, u64),
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `host..host + len` is a mapping made by `mmap` in `GuestRam::sync` and unmapped only here; the
        // server drops the simulator (which holds translations to it) before its `GuestRam`.
        unsafe { libc::munmap(self.host.as_ptr().cast(), self.len) };
    }
}

/// The guest RAM mapped so far.
#[derive(Debug, Default)]
pub struct GuestRam {
    maps: Vec<Mapping>,
    /// Regions (or parts) whose backing conflicted with an existing mapping.
    pub stale: u64,
}

// SAFETY: the mappings are plain shared memory owned by this value; any thread may access them.
unsafe impl Send for GuestRam {}

impl GuestRam {
    /// Bytes of guest RAM mapped.
    pub fn bytes(&self) -> u64 {
        self.maps.iter().map(|m| m.len as u64).sum()
    }

    /// Whether `gpa..gpa + len` lies in mapped guest RAM.
    pub fn contains(&self, gpa: u64, len: u64) -> bool {
        let Some(end) = gpa.checked_add(len) else { return false };
        self.maps.iter().any(|m| m.gpa <= gpa && end <= m.gpa + m.len as u64)
    }

    /// Maps what `regions` add to guest RAM and hands each new piece to `sim`. Errors name the regions skipped;
    /// the others are mapped regardless.
    pub fn sync(&mut self, regions: &[(SysmemRegion, OwnedFd)], sim: &SimDevice) -> Vec<RegionError> {
        let mut errors = Vec::new();
        for (r, fd) in regions {
            if let Err(e) = self.add(r, fd, sim) {
                errors.push(e);
            }
        }
        errors
    }

    fn add(&mut self, r: &SysmemRegion, fd: &OwnedFd, sim: &SimDevice) -> Result<(), RegionError> {
        let shape = RegionError::Shape { gpa: r.gpa, size: r.size, offset: r.offset };
        let end = r.gpa.checked_add(r.size).filter(|_| r.size > 0).ok_or_else(|| shape_err(r))?;
        if !r.gpa.is_multiple_of(PAGE)
            || !r.offset.is_multiple_of(PAGE)
            || !r.size.is_multiple_of(PAGE)
            || r.offset.checked_add(r.size).is_none()
        {
            return Err(shape);
        }
        // SAFETY: an all-zero stat is a valid out-buffer for fstat.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: `fd` is an open descriptor; `st` is a valid out-pointer.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(RegionError::Os { gpa: r.gpa, source: std::io::Error::last_os_error() });
        }
        // A mapping past the end of the file would fault (SIGBUS) on the device's first access there.
        let file_len = st.st_size as u64;
        if r.offset + r.size > file_len {
            return Err(RegionError::PastEnd { gpa: r.gpa, size: r.size, offset: r.offset, file_len });
        }
        let (dev, ino) = (st.st_dev, st.st_ino);
        // The parts of gpa..end not mapped yet; overlaps with existing mappings must have the same backing.
        let mut holes = vec![(r.gpa, end)];
        for m in &self.maps {
            let (ms, me) = (m.gpa, m.gpa + m.len as u64);
            let (os, oe) = (ms.max(r.gpa), me.min(end));
            if os < oe
                && (m.backing.0 != dev || m.backing.1 != ino || m.backing.2 + (os - ms) != r.offset + (os - r.gpa))
            {
                self.stale += 1;
                eprintln!(
                    "mlx5-pci-proxy: guest RAM 0x{os:x}..0x{oe:x} changed backing; the device keeps the old one (no \
                     unmap in the simulator)"
                );
            }
            holes = holes
                .into_iter()
                .flat_map(|(hs, he)| {
                    let mut out = Vec::new();
                    if he <= ms || hs >= me {
                        out.push((hs, he));
                    } else {
                        if hs < ms {
                            out.push((hs, ms));
                        }
                        if he > me {
                            out.push((me, he));
                        }
                    }
                    out
                })
                .collect();
        }
        for (hs, he) in holes {
            let off = r.offset + (hs - r.gpa);
            let len = usize::try_from(he - hs).map_err(|_| shape_err(r))?;
            let foff = libc::off_t::try_from(off).map_err(|_| shape_err(r))?;
            // SAFETY: a fresh shared mapping of the fd QEMU sent, inside the file (checked above).
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    foff,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(RegionError::Os { gpa: hs, source: std::io::Error::last_os_error() });
            }
            let host = NonNull::new(p.cast::<u8>()).ok_or_else(|| shape_err(r))?;
            let m = Mapping { gpa: hs, len, host, backing: (dev, ino, off) };
            // SAFETY: the mapping lives in `self.maps` until the server drops, after the simulator.
            unsafe { sim.map_guest_memory(hs, host, len) }
                .map_err(|e| RegionError::Refused { gpa: hs, what: format!("{e:?}") })?;
            self.maps.push(m);
        }
        Ok(())
    }

    /// Hands every mapping to a new simulator (after a device reset).
    pub fn map_into(&self, sim: &SimDevice) -> Vec<RegionError> {
        let mut errors = Vec::new();
        for m in &self.maps {
            // SAFETY: as in `add`: the mapping outlives the simulator it is handed to.
            if let Err(e) = unsafe { sim.map_guest_memory(m.gpa, m.host, m.len) } {
                errors.push(RegionError::Refused { gpa: m.gpa, what: format!("{e:?}") });
            }
        }
        errors
    }
}

fn shape_err(r: &SysmemRegion) -> RegionError {
    RegionError::Shape { gpa: r.gpa, size: r.size, offset: r.offset }
}
