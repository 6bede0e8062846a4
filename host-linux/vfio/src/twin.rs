//! The test twin of the kernel: a [`Sys`] that behaves as VFIO's container, group and device files, eventfds,
//! anonymous memory and the PCI sysfs tree do — enough to drive [`super::VfioDevice`], [`super::dma::VfioDma`],
//! [`super::irq::Interrupts`] and [`super::bind`] through every success and error path without a device. The
//! real kernel is exercised by `cargo xtask vfio-test` in a QEMU guest.
//!
//! Errors are returned as the kernel returns them (errno values from `drivers/vfio`), and failures can be
//! injected per operation with [`TwinState::fail`].
//!
//! A function may have a device behind it ([`Twin::add_backed_device`], a [`TwinBackend`]): its BAR 0 is then not
//! mappable (as vfio-pci reports a BAR it cannot map), so every register access is a `pread`/`pwrite` the twin
//! hands to the device; `VFIO_IOMMU_MAP_DMA` / `UNMAP_DMA` map and unmap the memory for the device at its IOVA;
//! and the device's interrupts are delivered to the eventfd `VFIO_DEVICE_SET_IRQS` wired to the vector, after
//! every BAR access and while a caller waits, as the kernel's interrupt handler signals it.

use std::alloc::Layout;
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::abi::{self, Pod};
use super::sys::{Arg, RawFd, Sys};

/// The device behind a twin function: what its BAR, its DMA and its interrupts do.
pub trait TwinBackend: Send + Sync + std::fmt::Debug {
    /// BAR 0's size in bytes.
    fn bar_len(&self) -> u64;
    /// A read of `buf.len()` bytes of BAR 0 at `off`, in the BAR's byte order. `Err` (an errno) refuses it.
    fn bar_read(&self, off: u64, buf: &mut [u8]) -> io::Result<()>;
    /// A write of `data` to BAR 0 at `off`, in the BAR's byte order. `Err` (an errno) refuses it.
    fn bar_write(&self, off: u64, data: &[u8]) -> io::Result<()>;
    /// Makes `len` bytes at `cpu` reachable by the device's DMA at bus address `iova` (the IOMMU mapping).
    ///
    /// # Safety
    /// The memory stays allocated, readable and writable until [`TwinBackend::dma_unmap`] of the same range.
    unsafe fn dma_map(&self, iova: u64, cpu: NonNull<u8>, len: usize) -> io::Result<()>;
    /// Takes a [`TwinBackend::dma_map`] mapping away: the device can no longer reach it.
    fn dma_unmap(&self, iova: u64, len: usize);
    /// The MSI-X vectors the device signalled since the last call, in order.
    fn take_interrupts(&self) -> Vec<u16>;
    /// A function reset (`VFIO_DEVICE_RESET`, and vfio-pci's release of the device fd).
    fn reset(&self);
}

/// A simulated PCI function.
#[derive(Debug)]
pub struct TwinDevice {
    pub group: u32,
    /// Driver bound now (`None`: no driver).
    pub driver: Option<String>,
    /// The driver the PCI core binds when no override is set (mlx5_core for a ConnectX).
    pub native_driver: Option<String>,
    pub driver_override: Option<String>,
    /// Unbinding fails with EBUSY (a driver that refuses to let go).
    pub busy: bool,
    /// BAR 0 contents (8-byte aligned so 64-bit accesses are aligned); unused when a backend answers.
    pub bar0: Box<[u64]>,
    /// Whether BAR 0 may be mapped (`VFIO_REGION_INFO_FLAG_MMAP`); otherwise it is read and written.
    pub bar_mmap: bool,
    /// The device behind the function, if any.
    pub backend: Option<Arc<dyn TwinBackend>>,
    pub config: Vec<u8>,
    pub msix: u32,
    pub msi: u32,
    /// Open device fds (vfio-pci allows one).
    pub open: bool,
    /// The eventfds wired by SET_IRQS and the index they are on.
    pub irq_index: Option<u32>,
    pub irq_fds: Vec<RawFd>,
    /// Interrupts delivered per vector over the function's life (the eventfd counters reset when read).
    pub irq_fired: Vec<u64>,
    /// Interrupts of a vector no eventfd was wired to (dropped, as a masked vector's would be).
    pub irq_unwired: u64,
    pub resets: u32,
}

#[derive(Debug)]
enum TwinFd {
    Container,
    Group(u32),
    Device(String),
    EventFd(u64),
}

/// A DMA mapping in the twin's IOMMU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TwinMap {
    pub vaddr: u64,
    pub size: u64,
}

/// Everything the twin knows; tests read and change it through [`Twin::state`].
#[derive(Debug)]
pub struct TwinState {
    pub euid: u32,
    pub vfio_loaded: bool,
    /// An IOMMU is on (devices have `iommu_group` links).
    pub iommu: bool,
    pub type1v2: bool,
    /// Interrupt remapping present (SET_IOMMU fails with EPERM without it).
    pub intremap: bool,
    /// 2 MiB hugetlb pages available.
    pub hugepages: usize,
    pub iova_ranges: Vec<(u64, u64)>,
    /// Errno to return from the named operation ("MAP_DMA", "UNMAP_DMA", "SET_IRQS", "mmap_anon", "bar" (a BAR
    /// `pread`/`pwrite`), ...).
    pub fail: HashMap<&'static str, i32>,
    pub devices: BTreeMap<String, TwinDevice>,
    /// Groups attached to the container, and whether the IOMMU is set.
    pub attached: Vec<u32>,
    pub iommu_set: bool,
    pub maps: BTreeMap<u64, TwinMap>,
    /// Process memory besides the twin's anonymous mappings that MAP_DMA can pin, as `(start, len)`: the kernel
    /// pins any mapped memory of the process; the twin knows only what tests declare (anything else is EFAULT,
    /// as `vfio_pin_pages_remote` fails on an unmapped address).
    pub pinnable: Vec<(u64, u64)>,
    /// Most bytes MAP_DMA keeps mapped at once (the locked-memory limit): a mapping beyond it fails with ENOMEM,
    /// as the kernel's accounting of pinned pages does.
    pub pin_limit: Option<u64>,
    /// Anonymous mappings: address → (layout, huge).
    pub anon: BTreeMap<usize, (usize, bool)>,
    pub log: Vec<String>,
    fds: HashMap<RawFd, TwinFd>,
    next_fd: RawFd,
    layouts: HashMap<usize, Anon>,
}

/// An anonymous mapping's allocation, kept as a pointer so a backend's DMA reaches it with its provenance.
#[derive(Debug)]
struct Anon {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: the pointer is the twin's own heap allocation, handed out by mmap_anon and freed once; it is not tied
// to a thread.
unsafe impl Send for Anon {}

/// The twin. Shareable across threads (an interrupt can be fired from another thread while one waits).
#[derive(Debug)]
pub struct Twin {
    st: Mutex<TwinState>,
}

fn errno(e: i32) -> io::Error {
    io::Error::from_raw_os_error(e)
}

impl Default for Twin {
    fn default() -> Self {
        Self::new()
    }
}

impl Twin {
    /// A machine with VFIO loaded, root, interrupt remapping, 16 hugepages and the usual x86 IOVA ranges.
    pub fn new() -> Twin {
        Twin {
            st: Mutex::new(TwinState {
                euid: 0,
                vfio_loaded: true,
                iommu: true,
                type1v2: true,
                intremap: true,
                hugepages: 16,
                iova_ranges: vec![(0, 0xfedf_ffff), (0xfef0_0000, (1 << 48) - 1)],
                fail: HashMap::new(),
                devices: BTreeMap::new(),
                attached: Vec::new(),
                iommu_set: false,
                maps: BTreeMap::new(),
                pinnable: Vec::new(),
                pin_limit: None,
                anon: BTreeMap::new(),
                log: Vec::new(),
                fds: HashMap::new(),
                next_fd: 100,
                layouts: HashMap::new(),
            }),
        }
    }

    /// Adds a function at `bdf` in IOMMU group `group`, bound to `driver`, with a BAR 0 of `bar_len` bytes.
    pub fn add_device(&self, bdf: &str, vendor: u16, device: u16, group: u32, driver: Option<&str>, bar_len: usize) {
        let mut config = vec![0u8; 256];
        config[0..2].copy_from_slice(&vendor.to_le_bytes());
        config[2..4].copy_from_slice(&device.to_le_bytes());
        config[4..6].copy_from_slice(&0x0103u16.to_le_bytes());
        config[8] = 0x10;
        config[0x2c..0x2e].copy_from_slice(&vendor.to_le_bytes());
        config[0x2e..0x30].copy_from_slice(&0x0007u16.to_le_bytes());
        self.state().devices.insert(
            bdf.to_string(),
            TwinDevice {
                group,
                driver: driver.map(str::to_string),
                native_driver: if vendor == 0x15b3 { Some("mlx5_core".into()) } else { None },
                driver_override: None,
                busy: false,
                bar0: vec![0u64; bar_len / 8].into_boxed_slice(),
                bar_mmap: true,
                backend: None,
                config,
                msix: if vendor == 0x15b3 { 64 } else { 0 },
                msi: 1,
                open: false,
                irq_index: None,
                irq_fds: Vec::new(),
                irq_fired: Vec::new(),
                irq_unwired: 0,
                resets: 0,
            },
        );
    }

    /// Adds a function at `bdf` as [`Twin::add_device`] does, bound to vfio-pci, with `backend` behind it: BAR 0
    /// is the backend's, reached with `pread`/`pwrite`, and DMA mappings and interrupts go to and come from it.
    pub fn add_backed_device(&self, bdf: &str, vendor: u16, device: u16, group: u32, backend: Arc<dyn TwinBackend>) {
        self.add_device(bdf, vendor, device, group, Some("vfio-pci"), 0);
        let mut s = self.state();
        let d = s.devices.get_mut(bdf).expect("just added");
        d.bar_mmap = false;
        d.backend = Some(backend);
    }

    /// Delivers the interrupts the devices signalled since the last look into their wired eventfds.
    pub fn deliver_interrupts(&self) {
        let backends: Vec<(String, Arc<dyn TwinBackend>)> = self
            .state()
            .devices
            .iter()
            .filter_map(|(n, d)| d.backend.as_ref().map(|b| (n.clone(), b.clone())))
            .collect();
        for (name, b) in backends {
            // Taken outside the twin's lock: the device runs there.
            let vectors = b.take_interrupts();
            if !vectors.is_empty() {
                let mut s = self.state();
                for v in vectors {
                    s.signal(&name, usize::from(v));
                }
            }
        }
    }

    /// A BAR 0 access handed to the device behind `fd`, then its interrupts delivered; `None` when `fd` is not
    /// such a device's BAR 0.
    fn backend_bar(&self, fd: RawFd, offset: u64, len: usize) -> io::Result<Option<(Arc<dyn TwinBackend>, u64)>> {
        let s = self.state();
        let Some(TwinFd::Device(name)) = s.fds.get(&fd) else { return Err(errno(libc::EBADF)) };
        if (offset >> 40) as u32 != abi::VFIO_PCI_BAR0_REGION_INDEX {
            return Ok(None);
        }
        let d = s.device_of(name)?;
        let off = offset & ((1 << 40) - 1);
        let Some(b) = &d.backend else { return Ok(None) };
        if off.checked_add(len as u64).is_none_or(|end| end > b.bar_len()) {
            return Err(errno(libc::EINVAL));
        }
        Ok(Some((b.clone(), off)))
    }

    pub fn state(&self) -> MutexGuard<'_, TwinState> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fires vector `v` of `bdf` as the device's interrupt would: adds 1 to the wired eventfd.
    pub fn fire(&self, bdf: &str, v: usize) -> bool {
        self.state().signal(bdf, v)
    }

    /// The eventfd counters of `bdf`'s wired vectors, in vector order, without resetting them (what a `read`
    /// would return).
    pub fn eventfd_counts(&self, bdf: &str) -> Vec<u64> {
        let s = self.state();
        let Some(d) = s.devices.get(bdf) else { return Vec::new() };
        d.irq_fds
            .iter()
            .map(|fd| match s.fds.get(fd) {
                Some(TwinFd::EventFd(c)) => *c,
                _ => 0,
            })
            .collect()
    }

    /// Reads BAR 0 of `bdf` at `off` as the device sees it (the raw 32-bit word in memory order).
    pub fn bar_word(&self, bdf: &str, off: usize) -> u32 {
        let s = self.state();
        let bar = &s.devices[bdf].bar0;
        assert!(off.is_multiple_of(4) && off + 4 <= bar.len() * 8, "offset outside BAR 0");
        // SAFETY: off + 4 bytes lie inside the boxed slice (asserted above) and off is 4-byte aligned.
        unsafe { bar.as_ptr().cast::<u8>().add(off).cast::<u32>().read_volatile() }
    }

    /// Open file descriptors the twin still tracks (a leak check for tests).
    pub fn open_fds(&self) -> usize {
        self.state().fds.len()
    }
}

impl TwinState {
    /// The open container's file descriptor, if there is one.
    pub fn open_container(&self) -> Option<RawFd> {
        self.fds.iter().find_map(|(&fd, k)| matches!(k, TwinFd::Container).then_some(fd))
    }

    /// Signals vector `v` of `bdf`: adds 1 to the eventfd wired to it and counts it; `false` when no eventfd is.
    fn signal(&mut self, bdf: &str, v: usize) -> bool {
        let Some(d) = self.devices.get_mut(bdf) else { return false };
        let Some(fd) = d.irq_fds.get(v).copied() else {
            d.irq_unwired += 1;
            return false;
        };
        if d.irq_fired.len() <= v {
            d.irq_fired.resize(v + 1, 0);
        }
        d.irq_fired[v] += 1;
        match self.fds.get_mut(&fd) {
            Some(TwinFd::EventFd(c)) => {
                *c += 1;
                true
            }
            _ => false,
        }
    }

    /// The backends of the functions whose groups are attached to the container (what the IOMMU serves).
    fn attached_backends(&self) -> Vec<Arc<dyn TwinBackend>> {
        self.devices.values().filter(|d| self.attached.contains(&d.group)).filter_map(|d| d.backend.clone()).collect()
    }

    /// Takes every IOMMU mapping away from the devices (the container closed, the twin dropped).
    fn unmap_all(&mut self) {
        let backends: Vec<Arc<dyn TwinBackend>> = self.devices.values().filter_map(|d| d.backend.clone()).collect();
        for (iova, m) in std::mem::take(&mut self.maps) {
            for b in &backends {
                b.dma_unmap(iova, m.size as usize);
            }
        }
    }

    /// The twin's pointer to `len` bytes of its anonymous memory at `vaddr`, if it has them.
    fn anon_ptr(&self, vaddr: u64, len: u64) -> Option<NonNull<u8>> {
        let (&a, &(alen, _)) = self.anon.range(..=vaddr as usize).next_back()?;
        let off = vaddr as usize - a;
        if off.checked_add(len as usize)? > alen {
            return None;
        }
        let base = self.layouts.get(&a)?.ptr;
        // SAFETY: off + len lies inside the allocation of alen bytes at base (checked above).
        Some(unsafe { base.add(off) })
    }

    fn check_fail(&self, op: &str) -> io::Result<()> {
        match self.fail.get(op) {
            Some(&e) => Err(errno(e)),
            None => Ok(()),
        }
    }

    fn new_fd(&mut self, kind: TwinFd) -> RawFd {
        let fd = self.next_fd;
        self.next_fd += 1;
        self.fds.insert(fd, kind);
        fd
    }

    fn device_of(&self, bdf: &str) -> io::Result<&TwinDevice> {
        self.devices.get(bdf).ok_or_else(|| errno(libc::ENODEV))
    }

    fn viable(&self, group: u32) -> bool {
        self.devices.values().filter(|d| d.group == group).all(|d| d.driver.as_deref().is_none_or(|n| n == "vfio-pci"))
    }

    /// The twin's view of sysfs links: `driver` and `iommu_group` of each device.
    fn link(&self, path: &Path) -> io::Result<PathBuf> {
        let s = path.to_string_lossy();
        let rest = s.strip_prefix("/sys/bus/pci/devices/").ok_or_else(|| errno(libc::ENOENT))?;
        let (bdf, attr) = rest.split_once('/').ok_or_else(|| errno(libc::EINVAL))?;
        let d = self.device_of(bdf).map_err(|_| errno(libc::ENOENT))?;
        match attr {
            "driver" => d
                .driver
                .as_ref()
                .map(|n| PathBuf::from(format!("../../../bus/pci/drivers/{n}")))
                .ok_or_else(|| errno(libc::ENOENT)),
            "iommu_group" if self.iommu => Ok(PathBuf::from(format!("../../../kernel/iommu_groups/{}", d.group))),
            _ => Err(errno(libc::ENOENT)),
        }
    }

    fn ioctl(&mut self, fd: RawFd, req: u64, arg: Arg<'_>) -> io::Result<i32> {
        let kind = self.fds.get(&fd).ok_or_else(|| errno(libc::EBADF))?;
        match (kind, req) {
            (TwinFd::Container, abi::VFIO_GET_API_VERSION) => Ok(abi::VFIO_API_VERSION),
            (TwinFd::Container, abi::VFIO_CHECK_EXTENSION) => match arg {
                Arg::Int(abi::VFIO_TYPE1V2_IOMMU) => Ok(self.type1v2 as i32),
                _ => Ok(0),
            },
            (TwinFd::Container, abi::VFIO_SET_IOMMU) => {
                if self.attached.is_empty() {
                    return Err(errno(libc::EINVAL));
                }
                if !self.intremap {
                    return Err(errno(libc::EPERM));
                }
                self.iommu_set = true;
                Ok(0)
            }
            (TwinFd::Container, abi::VFIO_IOMMU_GET_INFO) => {
                let Arg::Buf(b) = arg else { return Err(errno(libc::EFAULT)) };
                let hdr = std::mem::size_of::<abi::vfio_iommu_type1_info>();
                let cap = std::mem::size_of::<abi::vfio_iommu_type1_info_cap_iova_range>();
                let need = hdr + cap + 16 * self.iova_ranges.len();
                let mut info = abi::vfio_iommu_type1_info::read_from(b);
                info.flags = abi::VFIO_IOMMU_INFO_PGSIZES | abi::VFIO_IOMMU_INFO_CAPS;
                info.iova_pgsizes = 0x4000_0000 | 0x20_0000 | 0x1000;
                if (info.argsz as usize) < need || b.len() < need {
                    info.argsz = need as u32;
                    info.cap_offset = 0;
                    b[..hdr].copy_from_slice(info.as_bytes());
                    return Ok(0);
                }
                info.cap_offset = hdr as u32;
                b[..hdr].copy_from_slice(info.as_bytes());
                let c = abi::vfio_iommu_type1_info_cap_iova_range {
                    header: abi::vfio_info_cap_header {
                        id: abi::VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE,
                        version: 1,
                        next: 0,
                    },
                    nr_iovas: self.iova_ranges.len() as u32,
                    reserved: 0,
                };
                b[hdr..hdr + cap].copy_from_slice(c.as_bytes());
                for (i, &(start, end)) in self.iova_ranges.iter().enumerate() {
                    let r = abi::vfio_iova_range { start, end };
                    b[hdr + cap + 16 * i..hdr + cap + 16 * (i + 1)].copy_from_slice(r.as_bytes());
                }
                Ok(0)
            }
            (TwinFd::Container, abi::VFIO_IOMMU_MAP_DMA) => {
                self.check_fail("MAP_DMA")?;
                let Arg::Buf(b) = arg else { return Err(errno(libc::EFAULT)) };
                let m = abi::vfio_iommu_type1_dma_map::read_from(b);
                // `vfio_iommu_type1_ioctl`: argsz must reach past `size`.
                if (m.argsz as usize) < std::mem::size_of::<abi::vfio_iommu_type1_dma_map>() {
                    return Err(errno(libc::EINVAL));
                }
                if !self.iommu_set
                    || m.flags & !3 != 0
                    || m.flags == 0
                    || m.size == 0
                    || (m.iova | m.vaddr | m.size) & 0xfff != 0
                {
                    return Err(errno(libc::EINVAL));
                }
                let end = m.iova.checked_add(m.size - 1).ok_or_else(|| errno(libc::EINVAL))?;
                if !self.iova_ranges.iter().any(|&(s, e)| m.iova >= s && end <= e) {
                    return Err(errno(libc::EINVAL));
                }
                if self.maps.iter().any(|(&i, t)| i <= end && m.iova < i + t.size) {
                    return Err(errno(libc::EEXIST));
                }
                let backed = self
                    .anon
                    .range(..=m.vaddr as usize)
                    .next_back()
                    .is_some_and(|(&a, &(len, _))| m.vaddr as usize + m.size as usize <= a + len)
                    || self.pinnable.iter().any(|&(a, len)| m.vaddr >= a && m.vaddr - a + m.size <= len);
                if !backed {
                    return Err(errno(libc::EFAULT));
                }
                let pinned: u64 = self.maps.values().map(|t| t.size).sum();
                if self.pin_limit.is_some_and(|limit| pinned + m.size > limit) {
                    return Err(errno(libc::ENOMEM));
                }
                let backends = self.attached_backends();
                if !backends.is_empty() {
                    // The devices reach only memory the twin can name by pointer: its own anonymous mappings.
                    let Some(cpu) = self.anon_ptr(m.vaddr, m.size) else { return Err(errno(libc::EFAULT)) };
                    for (i, b) in backends.iter().enumerate() {
                        // SAFETY: the twin's anonymous memory stays allocated while this mapping exists: munmap
                        // keeps memory that is still mapped, and UNMAP_DMA, the container's close and the twin's
                        // drop unmap it from every backend first.
                        if let Err(e) = unsafe { b.dma_map(m.iova, cpu, m.size as usize) } {
                            backends[..i].iter().for_each(|b| b.dma_unmap(m.iova, m.size as usize));
                            return Err(e);
                        }
                    }
                }
                self.maps.insert(m.iova, TwinMap { vaddr: m.vaddr, size: m.size });
                Ok(0)
            }
            (TwinFd::Container, abi::VFIO_IOMMU_UNMAP_DMA) => {
                self.check_fail("UNMAP_DMA")?;
                let Arg::Buf(b) = arg else { return Err(errno(libc::EFAULT)) };
                let mut u = abi::vfio_iommu_type1_dma_unmap::read_from(b);
                if (u.argsz as usize) < std::mem::size_of::<abi::vfio_iommu_type1_dma_unmap>() {
                    return Err(errno(libc::EINVAL));
                }
                // type1v2: an unmap must cover whole mappings; splitting one is EINVAL.
                let hit: Vec<u64> = self
                    .maps
                    .iter()
                    .filter(|(&i, t)| i < u.iova + u.size && u.iova < i + t.size)
                    .map(|(&i, _)| i)
                    .collect();
                for i in &hit {
                    let t = self.maps[i];
                    if *i < u.iova || i + t.size > u.iova + u.size {
                        return Err(errno(libc::EINVAL));
                    }
                }
                let backends = self.attached_backends();
                u.size = hit
                    .iter()
                    .filter_map(|i| self.maps.remove(i).map(|t| (*i, t)))
                    .map(|(i, t)| {
                        backends.iter().for_each(|b| b.dma_unmap(i, t.size as usize));
                        t.size
                    })
                    .sum();
                b[..u.as_bytes().len()].copy_from_slice(u.as_bytes());
                Ok(0)
            }
            (TwinFd::Group(g), abi::VFIO_GROUP_GET_STATUS) => {
                let g = *g;
                let Arg::Buf(b) = arg else { return Err(errno(libc::EFAULT)) };
                let mut st = abi::vfio_group_status::read_from(b);
                st.flags = if self.viable(g) { abi::VFIO_GROUP_FLAGS_VIABLE } else { 0 };
                if self.attached.contains(&g) {
                    st.flags |= abi::VFIO_GROUP_FLAGS_CONTAINER_SET;
                }
                b[..8].copy_from_slice(st.as_bytes());
                Ok(0)
            }
            (TwinFd::Group(g), abi::VFIO_GROUP_SET_CONTAINER) => {
                let g = *g;
                if !self.viable(g) {
                    return Err(errno(libc::EPERM));
                }
                let Arg::Fd(cfd) = arg else { return Err(errno(libc::EFAULT)) };
                if !matches!(self.fds.get(&cfd), Some(TwinFd::Container)) {
                    return Err(errno(libc::EBADF));
                }
                if self.attached.contains(&g) {
                    return Err(errno(libc::EBUSY));
                }
                self.attached.push(g);
                Ok(0)
            }
            (TwinFd::Group(g), abi::VFIO_GROUP_GET_DEVICE_FD) => {
                let g = *g;
                let Arg::Name(n) = arg else { return Err(errno(libc::EFAULT)) };
                if !self.attached.contains(&g) || !self.iommu_set {
                    return Err(errno(libc::EINVAL));
                }
                let name = n.to_string_lossy().into_owned();
                let d = self.devices.get_mut(&name).filter(|d| d.group == g).ok_or_else(|| errno(libc::ENODEV))?;
                if d.open {
                    return Err(errno(libc::EBUSY));
                }
                d.open = true;
                Ok(self.new_fd(TwinFd::Device(name)))
            }
            (TwinFd::Device(name), _) => {
                let name = name.clone();
                self.device_ioctl(&name, req, arg)
            }
            _ => Err(errno(libc::ENOTTY)),
        }
    }

    fn device_ioctl(&mut self, name: &str, req: u64, arg: Arg<'_>) -> io::Result<i32> {
        let d = self.devices.get_mut(name).ok_or_else(|| errno(libc::ENODEV))?;
        match req {
            abi::VFIO_DEVICE_GET_INFO => {
                let Arg::Buf(b) = arg else { return Err(errno(libc::EFAULT)) };
                let mut i = abi::vfio_device_info::read_from(b);
                i.flags = abi::VFIO_DEVICE_FLAGS_PCI | abi::VFIO_DEVICE_FLAGS_RESET;
                i.num_regions = 9;
                i.num_irqs = 5;
                b[..i.as_bytes().len()].copy_from_slice(i.as_bytes());
                Ok(0)
            }
            abi::VFIO_DEVICE_GET_REGION_INFO => {
                let Arg::Buf(b) = arg else { return Err(errno(libc::EFAULT)) };
                let mut r = abi::vfio_region_info::read_from(b);
                let rw = abi::VFIO_REGION_INFO_FLAG_READ | abi::VFIO_REGION_INFO_FLAG_WRITE;
                (r.flags, r.size) = match r.index {
                    abi::VFIO_PCI_BAR0_REGION_INDEX => {
                        let mmap = if d.bar_mmap { abi::VFIO_REGION_INFO_FLAG_MMAP } else { 0 };
                        (rw | mmap, d.backend.as_ref().map_or(d.bar0.len() as u64 * 8, |b| b.bar_len()))
                    }
                    abi::VFIO_PCI_CONFIG_REGION_INDEX => (rw, d.config.len() as u64),
                    i if i < 9 => (0, 0),
                    _ => return Err(errno(libc::EINVAL)),
                };
                r.offset = (r.index as u64) << 40;
                b[..r.as_bytes().len()].copy_from_slice(r.as_bytes());
                Ok(0)
            }
            abi::VFIO_DEVICE_GET_IRQ_INFO => {
                let Arg::Buf(b) = arg else { return Err(errno(libc::EFAULT)) };
                let mut i = abi::vfio_irq_info::read_from(b);
                i.count = match i.index {
                    abi::VFIO_PCI_INTX_IRQ_INDEX => 1,
                    abi::VFIO_PCI_MSI_IRQ_INDEX => d.msi,
                    abi::VFIO_PCI_MSIX_IRQ_INDEX => d.msix,
                    i if i < 5 => 0,
                    _ => return Err(errno(libc::EINVAL)),
                };
                i.flags = if i.count > 0 { abi::VFIO_IRQ_INFO_EVENTFD } else { 0 };
                b[..i.as_bytes().len()].copy_from_slice(i.as_bytes());
                Ok(0)
            }
            abi::VFIO_DEVICE_SET_IRQS => {
                let Arg::Buf(b) = arg else { return Err(errno(libc::EFAULT)) };
                let s = abi::vfio_irq_set::read_from(b);
                let have = match s.index {
                    abi::VFIO_PCI_MSI_IRQ_INDEX => d.msi,
                    abi::VFIO_PCI_MSIX_IRQ_INDEX => d.msix,
                    _ => return Err(errno(libc::EINVAL)),
                };
                if s.flags == abi::VFIO_IRQ_SET_DATA_NONE | abi::VFIO_IRQ_SET_ACTION_TRIGGER && s.count == 0 {
                    d.irq_index = None;
                    d.irq_fds.clear();
                    return Ok(0);
                }
                if s.flags != abi::VFIO_IRQ_SET_DATA_EVENTFD | abi::VFIO_IRQ_SET_ACTION_TRIGGER
                    || s.start != 0
                    || s.count == 0
                    || s.count > have
                    || d.irq_index.is_some_and(|i| i != s.index)
                {
                    return Err(errno(libc::EINVAL));
                }
                let hdr = std::mem::size_of::<abi::vfio_irq_set>();
                if b.len() < hdr + 4 * s.count as usize || (s.argsz as usize) < hdr + 4 * s.count as usize {
                    return Err(errno(libc::EINVAL));
                }
                let fds: Vec<RawFd> = (0..s.count as usize)
                    .map(|i| i32::from_ne_bytes(b[hdr + 4 * i..hdr + 4 * i + 4].try_into().unwrap()))
                    .collect();
                d.irq_index = Some(s.index);
                d.irq_fds = fds.clone();
                if fds.iter().any(|f| !matches!(self.fds.get(f), Some(TwinFd::EventFd(_)))) {
                    let d = self.devices.get_mut(name).unwrap();
                    d.irq_index = None;
                    d.irq_fds.clear();
                    return Err(errno(libc::EBADF));
                }
                self.check_fail("SET_IRQS")?;
                Ok(0)
            }
            abi::VFIO_DEVICE_RESET => {
                d.resets += 1;
                if let Some(b) = &d.backend {
                    b.reset();
                }
                Ok(0)
            }
            _ => Err(errno(libc::ENOTTY)),
        }
    }

    /// A read or write of the twin's own BAR 0 storage through the device fd: `None` when the access is to
    /// another region.
    fn bar_access(&self, fd: RawFd, offset: u64, len: usize) -> io::Result<Option<(String, usize)>> {
        let Some(TwinFd::Device(name)) = self.fds.get(&fd) else { return Err(errno(libc::EBADF)) };
        if (offset >> 40) as u32 != abi::VFIO_PCI_BAR0_REGION_INDEX {
            return Ok(None);
        }
        self.check_fail("bar")?;
        let off = (offset & ((1 << 40) - 1)) as usize;
        let bar_len = self.device_of(name)?.bar0.len() * 8;
        if off.checked_add(len).is_none_or(|end| end > bar_len) {
            return Err(errno(libc::EINVAL));
        }
        Ok(Some((name.clone(), off)))
    }

    fn config_access(&mut self, fd: RawFd, offset: u64, len: usize) -> io::Result<(String, usize)> {
        let Some(TwinFd::Device(name)) = self.fds.get(&fd) else { return Err(errno(libc::EBADF)) };
        let region = (offset >> 40) as u32;
        let off = (offset & ((1 << 40) - 1)) as usize;
        let d = self.device_of(name)?;
        if region != abi::VFIO_PCI_CONFIG_REGION_INDEX || off + len > d.config.len() {
            return Err(errno(libc::EINVAL));
        }
        Ok((name.clone(), off))
    }
}

// SAFETY: anonymous memory comes from the global allocator with 4 KiB (2 MiB when huge) alignment, zeroed, and
// lives until munmap; device mappings point into the device's boxed BAR, which lives as long as the twin.
unsafe impl Sys for Twin {
    fn open(&self, path: &Path, _write: bool) -> io::Result<RawFd> {
        let mut s = self.state();
        s.log.push(format!("open {}", path.display()));
        let p = path.to_string_lossy();
        if p == "/dev/vfio/vfio" {
            if !s.vfio_loaded {
                return Err(errno(libc::ENOENT));
            }
            if s.euid != 0 {
                return Err(errno(libc::EACCES));
            }
            return Ok(s.new_fd(TwinFd::Container));
        }
        if let Some(g) = p.strip_prefix("/dev/vfio/") {
            let g: u32 = g.parse().map_err(|_| errno(libc::ENOENT))?;
            if !s.vfio_loaded || !s.devices.values().any(|d| d.group == g) {
                return Err(errno(libc::ENOENT));
            }
            if s.euid != 0 {
                return Err(errno(libc::EACCES));
            }
            if s.fds.values().any(|f| matches!(f, TwinFd::Group(x) if *x == g)) {
                return Err(errno(libc::EBUSY));
            }
            return Ok(s.new_fd(TwinFd::Group(g)));
        }
        Err(errno(libc::ENOENT))
    }

    unsafe fn close(&self, fd: RawFd) {
        let mut s = self.state();
        s.log.push(format!("close {fd}"));
        match s.fds.remove(&fd) {
            Some(TwinFd::Device(name)) => {
                if let Some(d) = s.devices.get_mut(&name) {
                    // vfio-pci's release: interrupts off, function reset.
                    d.open = false;
                    d.irq_index = None;
                    d.irq_fds.clear();
                    d.resets += 1;
                    if let Some(b) = &d.backend {
                        b.reset();
                    }
                }
            }
            Some(TwinFd::Group(g)) => s.attached.retain(|&x| x != g),
            Some(TwinFd::Container) => {
                s.unmap_all();
                s.iommu_set = false;
            }
            _ => {}
        }
    }

    unsafe fn ioctl(&self, fd: RawFd, request: u64, arg: Arg<'_>) -> io::Result<i32> {
        // The same refusal as the real seam's, before the call reaches the (twin) kernel.
        arg.check_io()?;
        let mut s = self.state();
        s.log.push(format!("ioctl {fd} {request:#x}"));
        s.ioctl(fd, request, arg)
    }

    fn mmap_device(&self, fd: RawFd, len: usize, offset: u64) -> io::Result<NonNull<u8>> {
        let mut s = self.state();
        s.check_fail("mmap_device")?;
        let Some(TwinFd::Device(name)) = s.fds.get(&fd) else { return Err(errno(libc::EBADF)) };
        let name = name.clone();
        let d = s.devices.get_mut(&name).ok_or_else(|| errno(libc::ENODEV))?;
        if !d.bar_mmap || offset != (abi::VFIO_PCI_BAR0_REGION_INDEX as u64) << 40 || len > d.bar0.len() * 8 {
            return Err(errno(libc::EINVAL));
        }
        NonNull::new(d.bar0.as_mut_ptr().cast::<u8>()).ok_or_else(|| errno(libc::ENOMEM))
    }

    fn mmap_anon(&self, len: usize, huge: bool) -> io::Result<NonNull<u8>> {
        let mut s = self.state();
        s.check_fail("mmap_anon")?;
        let align = if huge { 2 << 20 } else { 4096 };
        if huge {
            let pages = len.div_ceil(2 << 20);
            if !len.is_multiple_of(2 << 20) || pages > s.hugepages {
                return Err(errno(libc::ENOMEM));
            }
            s.hugepages -= pages;
        }
        if len == 0 {
            return Err(errno(libc::EINVAL));
        }
        let layout = Layout::from_size_align(len, align).map_err(|_| errno(libc::EINVAL))?;
        // SAFETY: layout is valid and non-zero (checked above).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        let p = NonNull::new(p).ok_or_else(|| errno(libc::ENOMEM))?;
        s.anon.insert(p.as_ptr() as usize, (len, huge));
        s.layouts.insert(p.as_ptr() as usize, Anon { ptr: p, layout });
        Ok(p)
    }

    unsafe fn munmap(&self, ptr: NonNull<u8>, len: usize) {
        let mut s = self.state();
        let a = ptr.as_ptr() as usize;
        if let Some((l, huge)) = s.anon.remove(&a) {
            assert_eq!(l, len, "munmap length differs from mmap's");
            if huge {
                s.hugepages += len / (2 << 20);
            }
            // Memory still mapped for a device stays allocated, as the kernel keeps pinned pages, until the twin
            // goes (its drop unmaps every backend first).
            let end = (a + len) as u64;
            if s.maps.values().any(|m| m.vaddr < end && (a as u64) < m.vaddr + m.size) {
                log::warn!("twin: munmap of {len} bytes still mapped for DMA; kept until the twin is dropped");
                return;
            }
            let anon = s.layouts.remove(&a).expect("layout of an anon mapping");
            // SAFETY: the allocation and layout come from alloc_zeroed above and are freed once (removed from the
            // maps).
            unsafe { std::alloc::dealloc(anon.ptr.as_ptr(), anon.layout) };
        }
        // Device mappings point into the twin's BAR storage; nothing to free.
    }

    fn pread(&self, fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        if let Some((b, off)) = self.backend_bar(fd, offset, buf.len())? {
            let r = b.bar_read(off, buf);
            self.deliver_interrupts();
            return r.map(|()| buf.len());
        }
        let mut s = self.state();
        if let Some((name, off)) = s.bar_access(fd, offset, buf.len())? {
            let bar = &s.devices[&name].bar0;
            // SAFETY: off + len lies inside the boxed BAR (checked by bar_access); bytes are read as plain memory.
            let src = unsafe { std::slice::from_raw_parts(bar.as_ptr().cast::<u8>().add(off), buf.len()) };
            buf.copy_from_slice(src);
            return Ok(buf.len());
        }
        let (name, off) = s.config_access(fd, offset, buf.len())?;
        buf.copy_from_slice(&s.devices[&name].config[off..off + buf.len()]);
        Ok(buf.len())
    }

    fn pwrite(&self, fd: RawFd, buf: &[u8], offset: u64) -> io::Result<usize> {
        if let Some((b, off)) = self.backend_bar(fd, offset, buf.len())? {
            let r = b.bar_write(off, buf);
            self.deliver_interrupts();
            return r.map(|()| buf.len());
        }
        let mut s = self.state();
        if let Some((name, off)) = s.bar_access(fd, offset, buf.len())? {
            let bar = &mut s.devices.get_mut(&name).expect("bar_access found it").bar0;
            // SAFETY: off + len lies inside the boxed BAR (checked by bar_access); bytes are written as plain memory.
            let dst = unsafe { std::slice::from_raw_parts_mut(bar.as_mut_ptr().cast::<u8>().add(off), buf.len()) };
            dst.copy_from_slice(buf);
            return Ok(buf.len());
        }
        let (name, off) = s.config_access(fd, offset, buf.len())?;
        s.log.push(format!("pwrite config {off:#x} {buf:02x?}"));
        s.devices.get_mut(&name).unwrap().config[off..off + buf.len()].copy_from_slice(buf);
        Ok(buf.len())
    }

    fn eventfd(&self) -> io::Result<RawFd> {
        let mut s = self.state();
        s.check_fail("eventfd")?;
        Ok(s.new_fd(TwinFd::EventFd(0)))
    }

    fn wait_readable(&self, fds: &[RawFd], timeout_ms: i32) -> io::Result<Option<usize>> {
        let deadline = Instant::now() + Duration::from_millis(timeout_ms.max(0) as u64);
        loop {
            // The devices run while the caller waits; what they signal reaches the eventfds now.
            self.deliver_interrupts();
            {
                let s = self.state();
                for (i, fd) in fds.iter().enumerate() {
                    match s.fds.get(fd) {
                        Some(TwinFd::EventFd(c)) if *c > 0 => return Ok(Some(i)),
                        Some(_) => {}
                        None => return Err(errno(libc::EBADF)),
                    }
                }
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn read_eventfd(&self, fd: RawFd) -> io::Result<u64> {
        match self.state().fds.get_mut(&fd) {
            Some(TwinFd::EventFd(c)) => Ok(std::mem::take(c)),
            _ => Err(errno(libc::EBADF)),
        }
    }

    fn write_eventfd(&self, fd: RawFd, v: u64) -> io::Result<()> {
        match self.state().fds.get_mut(&fd) {
            Some(TwinFd::EventFd(c)) => {
                *c += v;
                Ok(())
            }
            _ => Err(errno(libc::EBADF)),
        }
    }

    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        let s = self.state();
        let p = path.to_string_lossy();
        let rest = p.strip_prefix("/sys/bus/pci/devices/").ok_or_else(|| errno(libc::ENOENT))?;
        let (bdf, attr) = rest.split_once('/').ok_or_else(|| errno(libc::EISDIR))?;
        let d = s.device_of(bdf).map_err(|_| errno(libc::ENOENT))?;
        let id = |o: usize| u16::from_le_bytes([d.config[o], d.config[o + 1]]);
        match attr {
            "vendor" => Ok(format!("{:#06x}\n", id(0))),
            "device" => Ok(format!("{:#06x}\n", id(2))),
            "driver_override" => Ok(format!("{}\n", d.driver_override.as_deref().unwrap_or("(null)"))),
            _ => Err(errno(libc::ENOENT)),
        }
    }

    fn write_file(&self, path: &Path, data: &str) -> io::Result<()> {
        let mut s = self.state();
        s.log.push(format!("write {} {data:?}", path.display()));
        if s.euid != 0 {
            return Err(errno(libc::EACCES));
        }
        let p = path.to_string_lossy().into_owned();
        if p == "/sys/bus/pci/drivers_probe" {
            let vfio = s.vfio_loaded;
            let d = s.devices.get_mut(data.trim()).ok_or_else(|| errno(libc::ENODEV))?;
            if d.driver.is_none() {
                d.driver = match &d.driver_override {
                    Some(o) if o == "vfio-pci" && !vfio => None,
                    Some(o) => Some(o.clone()),
                    None => d.native_driver.clone(),
                };
            }
            return Ok(());
        }
        let rest = p.strip_prefix("/sys/bus/pci/devices/").ok_or_else(|| errno(libc::ENOENT))?;
        let (bdf, attr) = rest.split_once('/').ok_or_else(|| errno(libc::EISDIR))?;
        let d = s.devices.get_mut(bdf).ok_or_else(|| errno(libc::ENOENT))?;
        match attr {
            "driver_override" => {
                let v = data.trim();
                d.driver_override = (!v.is_empty()).then(|| v.to_string());
                Ok(())
            }
            "driver/unbind" => {
                if d.driver.is_none() {
                    return Err(errno(libc::ENOENT));
                }
                if d.busy {
                    return Err(errno(libc::EBUSY));
                }
                if data.trim() != bdf {
                    return Err(errno(libc::ENODEV));
                }
                d.driver = None;
                Ok(())
            }
            _ => Err(errno(libc::ENOENT)),
        }
    }

    fn read_link(&self, path: &Path) -> io::Result<PathBuf> {
        self.state().link(path)
    }

    fn exists(&self, path: &Path) -> bool {
        let s = self.state();
        let p = path.to_string_lossy();
        if p == "/sys/bus/pci/drivers/vfio-pci" {
            return s.vfio_loaded;
        }
        match p.strip_prefix("/sys/bus/pci/devices/") {
            Some(rest) => s.devices.contains_key(rest.split('/').next().unwrap_or_default()),
            None => false,
        }
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let s = self.state();
        let p = path.to_string_lossy();
        if p == "/sys/bus/pci/devices" {
            return Ok(s.devices.keys().cloned().collect());
        }
        let g = p
            .strip_prefix("/sys/kernel/iommu_groups/")
            .and_then(|r| r.strip_suffix("/devices"))
            .and_then(|g| g.parse::<u32>().ok())
            .ok_or_else(|| errno(libc::ENOENT))?;
        let names: Vec<String> = s.devices.iter().filter(|(_, d)| d.group == g).map(|(n, _)| n.clone()).collect();
        if names.is_empty() {
            return Err(errno(libc::ENOENT));
        }
        Ok(names)
    }

    fn geteuid(&self) -> u32 {
        self.state().euid
    }
}

impl Drop for Twin {
    fn drop(&mut self) {
        let s = self.st.get_mut().unwrap_or_else(|p| p.into_inner());
        // No device may reach the memory once it is freed.
        s.unmap_all();
        for (_, anon) in s.layouts.drain() {
            // SAFETY: every entry was allocated by alloc_zeroed with this layout and not yet freed.
            unsafe { std::alloc::dealloc(anon.ptr.as_ptr(), anon.layout) };
        }
    }
}
