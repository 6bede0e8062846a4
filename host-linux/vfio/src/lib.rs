//! `mlx5-vfio`: a PCI function driven from userspace through Linux VFIO, implementing the core's [`Mmio`] over
//! its BAR 0 and [`Dma`] over IOMMU-mapped memory (`dma`), with MSI-X / MSI vectors delivered into eventfds
//! (`irq`) and the sysfs binding that hands a device to vfio-pci (`bind`). [`Vfio`] bundles them for the core;
//! [`StdDelay`] is the core's delay on Linux.
//!
//! Opening follows the kernel's VFIO document (`Documentation/driver-api/vfio.rst`): the device's IOMMU group must
//! be viable (every device in it bound to vfio-pci or to no driver), then container → type1v2 IOMMU → group
//! attached → device fd → region info → BAR mmap (or `pread`/`pwrite` on the device fd when vfio-pci cannot map
//! it) → bus master on. Every syscall goes through [`sys::Sys`], so the same code runs against the kernel and
//! against a test twin of it (`twin::Twin`, with the `test-utils` feature).
//!
//! It is not a driver: it knows nothing of mlx5 commands or queues (that is `mlx5-core`) and offers no verbs
//! (that is `mlx5-verbs`).
//!
//! [`Mmio`]: mlx5_core::hal::Mmio
//! [`Dma`]: mlx5_core::hal::Dma

pub mod abi;
pub mod bind;
pub mod dma;
pub mod irq;
pub mod sys;
#[cfg(any(test, feature = "test-utils"))]
pub mod twin;

use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::str::FromStr;
use std::sync::Arc;

use abi::Pod;
use mlx5_core::hal::Mmio;
use sys::{Arg, RawFd, Sys};

/// A PCI address, `domain:bus:device.function`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Bdf {
    pub domain: u16,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

impl FromStr for Bdf {
    type Err = VfioError;

    /// Accepts `DDDD:BB:DD.F` and the short `BB:DD.F` (domain 0), in hex, as lspci prints them.
    fn from_str(s: &str) -> Result<Self> {
        let bad = || VfioError::BadAddress(s.to_string());
        let (rest, function) = s.rsplit_once('.').ok_or_else(bad)?;
        let parts: Vec<&str> = rest.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [d, b, v] => (*d, *b, *v),
            [b, v] => ("0", *b, *v),
            _ => return Err(bad()),
        };
        // At most as many hex digits as the field has (no sign, which `from_str_radix` would take, and no
        // five-digit domain), and a value in the field's range.
        let hex = |t: &str, digits: usize, max: u32| {
            let plain = !t.is_empty() && t.len() <= digits && t.bytes().all(|b| b.is_ascii_hexdigit());
            u32::from_str_radix(t, 16).ok().filter(|&v| plain && v <= max)
        };
        Ok(Bdf {
            domain: hex(domain, 4, 0xffff).ok_or_else(bad)? as u16,
            bus: hex(bus, 2, 0xff).ok_or_else(bad)? as u8,
            device: hex(device, 2, 0x1f).ok_or_else(bad)? as u8,
            function: hex(function, 1, 7).ok_or_else(bad)? as u8,
        })
    }
}

impl fmt::Display for Bdf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:04x}:{:02x}:{:02x}.{:x}", self.domain, self.bus, self.device, self.function)
    }
}

impl Bdf {
    /// `/sys/bus/pci/devices/<bdf>`.
    pub fn sysfs(&self) -> PathBuf {
        PathBuf::from(format!("/sys/bus/pci/devices/{self}"))
    }
}

/// What can go wrong opening or using a VFIO device. Each message is one line naming what failed and why.
#[derive(Debug, thiserror::Error)]
pub enum VfioError {
    #[error("{0:?} is not a PCI address (expected DDDD:BB:DD.F, e.g. 0000:03:00.0)")]
    BadAddress(String),
    #[error("no PCI device {0} (nothing at /sys/bus/pci/devices/{0})")]
    NoSuchDevice(Bdf),
    #[error("{0} has no IOMMU group: the IOMMU is disabled or absent (boot with intel_iommu=on or amd_iommu=on)")]
    NoIommuGroup(Bdf),
    #[error("{bdf} is bound to {driver}, not vfio-pci (run `mlx5 bind {bdf}`)")]
    NotBoundToVfio { bdf: Bdf, driver: String },
    #[error("IOMMU group {group} is not viable: {} still bound to a host driver (bind them to vfio-pci or unbind them)", .blockers.join(", "))]
    GroupNotViable { group: u32, blockers: Vec<String> },
    #[error("permission denied on {0}: run as root or give this user the VFIO group's device node")]
    PermissionDenied(PathBuf),
    #[error("{0} needs root (effective uid 0)")]
    NotRoot(&'static str),
    #[error("the vfio-pci driver is not loaded (modprobe vfio-pci)")]
    VfioNotLoaded,
    #[error("VFIO API version {0}, this driver speaks version 0")]
    ApiVersion(i32),
    #[error("the kernel's VFIO offers no type1v2 IOMMU backend")]
    NoType1v2,
    #[error("{0} is busy: another process or driver holds it")]
    Busy(Bdf),
    #[error("{bdf} is not a Mellanox device (vendor {vendor:#06x}, expected 0x15b3)")]
    NotMellanox { bdf: Bdf, vendor: u16 },
    #[error("{bdf}: BAR {index} cannot be mapped (flags {flags:#x}, size {size:#x})")]
    BarNotMappable { bdf: Bdf, index: u32, flags: u32, size: u64 },
    #[error("{0} is not a PCI device of vfio-pci")]
    NotPci(Bdf),
    #[error("no IOVA space left for {0} bytes inside the IOMMU's valid ranges")]
    NoIova(usize),
    #[error("{bdf} has no {kind} interrupts")]
    NoInterrupts { bdf: Bdf, kind: &'static str },
    #[error("{bdf}: {detail}")]
    Bind { bdf: Bdf, detail: String },
    #[error("IOVA = physical address: {detail}")]
    PhysIova {
        detail: String,
        #[source]
        source: Option<io::Error>,
    },
    #[error("MLX5_RS_IOVA_MODE={0:?}: expected va or pa")]
    BadIovaMode(String),
    #[error("failed to {what}: {source}")]
    Sys {
        what: String,
        #[source]
        source: io::Error,
    },
}

pub type Result<T> = std::result::Result<T, VfioError>;

/// Wraps a syscall error with what was being done ("failed to map DMA: Invalid argument").
pub(crate) fn sys_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> VfioError {
    move |source| VfioError::Sys { what: what.into(), source }
}

/// Runs an ioctl whose argument is a Pod structure, returning the structure as the kernel left it.
///
/// # Safety
/// `req` is a VFIO request on `fd` whose argument is an argsz-led `T` (the `argsz` in `v` is checked against
/// `T`'s size by the seam).
pub(crate) unsafe fn ioctl_pod<T: Pod>(sys: &dyn Sys, fd: RawFd, req: u64, v: T, what: &str) -> Result<T> {
    let mut b = v.as_bytes().to_vec();
    // SAFETY: the caller guarantees `req` takes an argsz-led `T`, which `b` holds.
    unsafe { sys.ioctl(fd, req, Arg::Buf(&mut b)) }.map_err(sys_err(what))?;
    Ok(T::read_from(&b))
}

/// An owned file descriptor closed through the seam. Only this crate makes one, from a descriptor the seam just
/// returned, so each is the sole owner of its number.
#[derive(Debug)]
pub struct Fd {
    sys: Arc<dyn Sys>,
    fd: RawFd,
}

impl Fd {
    pub fn raw(&self) -> RawFd {
        self.fd
    }
}

impl Drop for Fd {
    fn drop(&mut self) {
        // SAFETY: this Fd is the only owner of the descriptor (made from a fresh one) and is dropped once.
        unsafe { self.sys.close(self.fd) };
    }
}

/// An IOVA range the IOMMU can translate, inclusive at both ends (`struct vfio_iova_range`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IovaRange {
    pub start: u64,
    pub end: u64,
}

/// A VFIO container with the type1v2 IOMMU set: the IOVA space the device's DMA goes through.
#[derive(Debug)]
pub struct Container {
    sys: Arc<dyn Sys>,
    fd: Fd,
    /// Page sizes the IOMMU maps (`iova_pgsizes`), one bit per size.
    pub iova_pgsizes: u64,
    /// Where IOVAs may be placed (`VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE`); the whole 64-bit space when the kernel
    /// reports no ranges.
    pub iova_ranges: Vec<IovaRange>,
}

impl Container {
    /// Opens `/dev/vfio/vfio` and checks the API version and the type1v2 backend.
    fn open(sys: &Arc<dyn Sys>) -> Result<Fd> {
        let path = Path::new("/dev/vfio/vfio");
        let fd = sys.open(path, true).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => VfioError::VfioNotLoaded,
            io::ErrorKind::PermissionDenied => VfioError::PermissionDenied(path.into()),
            _ => VfioError::Sys { what: "open /dev/vfio/vfio".into(), source: e },
        })?;
        let fd = Fd { sys: sys.clone(), fd };
        // SAFETY: VFIO_GET_API_VERSION on the container takes no argument.
        let v = unsafe { sys.ioctl(fd.raw(), abi::VFIO_GET_API_VERSION, Arg::None) }
            .map_err(sys_err("get the VFIO API version"))?;
        if v != abi::VFIO_API_VERSION {
            return Err(VfioError::ApiVersion(v));
        }
        // SAFETY: VFIO_CHECK_EXTENSION takes the extension number by value.
        let ok = unsafe { sys.ioctl(fd.raw(), abi::VFIO_CHECK_EXTENSION, Arg::Int(abi::VFIO_TYPE1V2_IOMMU)) }
            .map_err(sys_err("check for the type1v2 IOMMU"))?;
        if ok <= 0 {
            return Err(VfioError::NoType1v2);
        }
        Ok(fd)
    }

    /// Sets the IOMMU (allowed once a group is attached) and reads its page sizes and valid IOVA ranges.
    fn set_iommu(sys: &Arc<dyn Sys>, fd: Fd) -> Result<Container> {
        // SAFETY: VFIO_SET_IOMMU takes the IOMMU type by value.
        unsafe { sys.ioctl(fd.raw(), abi::VFIO_SET_IOMMU, Arg::Int(abi::VFIO_TYPE1V2_IOMMU)) }.map_err(|e| {
            let what = if e.raw_os_error() == Some(libc::EPERM) {
                "set the type1v2 IOMMU (EPERM usually means no interrupt remapping: intremap, or \
                 vfio_iommu_type1.allow_unsafe_interrupts=1)"
            } else {
                "set the type1v2 IOMMU"
            };
            VfioError::Sys { what: what.into(), source: e }
        })?;
        // Two calls: the first learns how big the capability chain is (the kernel raises argsz), the second reads it.
        let hdr = std::mem::size_of::<abi::vfio_iommu_type1_info>();
        let mut buf = abi::vfio_iommu_type1_info { argsz: hdr as u32, ..Default::default() }.as_bytes().to_vec();
        // SAFETY: VFIO_IOMMU_GET_INFO takes an argsz-led vfio_iommu_type1_info, which buf holds.
        unsafe { sys.ioctl(fd.raw(), abi::VFIO_IOMMU_GET_INFO, Arg::Buf(&mut buf)) }
            .map_err(sys_err("get IOMMU info"))?;
        let need = abi::vfio_iommu_type1_info::read_from(&buf).argsz as usize;
        if need > buf.len() {
            // The kernel never asks for more than a page or so; a larger value would be a broken kernel.
            let need = need.min(1 << 16);
            buf = vec![0; need];
            buf[..4].copy_from_slice(&(need as u32).to_ne_bytes());
            // SAFETY: as above, with room for the capability chain the kernel asked for.
            unsafe { sys.ioctl(fd.raw(), abi::VFIO_IOMMU_GET_INFO, Arg::Buf(&mut buf)) }
                .map_err(sys_err("get IOMMU info"))?;
        }
        let info = abi::vfio_iommu_type1_info::read_from(&buf);
        let iova_pgsizes = if info.flags & abi::VFIO_IOMMU_INFO_PGSIZES != 0 { info.iova_pgsizes } else { 4096 };
        let iova_ranges = parse_iova_ranges(&buf, &info);
        Ok(Container { sys: sys.clone(), fd, iova_pgsizes, iova_ranges })
    }

    /// `VFIO_IOMMU_MAP_DMA`: the device may read and write `len` bytes at `iova`, backed by `vaddr`.
    ///
    /// # Safety
    /// `[vaddr, vaddr + len)` is memory of this process that the caller keeps mapped, and does not free or hand to
    /// anything else, until [`Container::unmap_dma`] of this mapping succeeded: until then the device may write
    /// to it at any time, behind the compiler's back.
    pub unsafe fn map_dma(&self, vaddr: u64, iova: u64, len: u64) -> Result<()> {
        let m = abi::vfio_iommu_type1_dma_map {
            argsz: std::mem::size_of::<abi::vfio_iommu_type1_dma_map>() as u32,
            flags: abi::VFIO_DMA_MAP_FLAG_READ | abi::VFIO_DMA_MAP_FLAG_WRITE,
            vaddr,
            iova,
            size: len,
        };
        // SAFETY: VFIO_IOMMU_MAP_DMA takes an argsz-led vfio_iommu_type1_dma_map; the memory it names is the
        // caller's to lend (this function's contract).
        unsafe { ioctl_pod(&*self.sys, self.fd.raw(), abi::VFIO_IOMMU_MAP_DMA, m, "map DMA") }.map(|_| ())
    }

    /// `VFIO_IOMMU_UNMAP_DMA` of exactly one earlier mapping; returns the bytes the kernel unmapped.
    pub fn unmap_dma(&self, iova: u64, len: u64) -> Result<u64> {
        let u = abi::vfio_iommu_type1_dma_unmap {
            argsz: std::mem::size_of::<abi::vfio_iommu_type1_dma_unmap>() as u32,
            flags: 0,
            iova,
            size: len,
        };
        // SAFETY: VFIO_IOMMU_UNMAP_DMA takes an argsz-led vfio_iommu_type1_dma_unmap.
        Ok(unsafe { ioctl_pod(&*self.sys, self.fd.raw(), abi::VFIO_IOMMU_UNMAP_DMA, u, "unmap DMA") }?.size)
    }
}

/// Walks the capability chain of `VFIO_IOMMU_GET_INFO` for the IOVA-range capability. Offsets come from the
/// kernel, so each is bounds-checked against the buffer, and a chain that loops is cut after 64 steps.
fn parse_iova_ranges(buf: &[u8], info: &abi::vfio_iommu_type1_info) -> Vec<IovaRange> {
    let all = vec![IovaRange { start: 0, end: u64::MAX }];
    if info.flags & abi::VFIO_IOMMU_INFO_CAPS == 0 {
        return all;
    }
    let mut off = info.cap_offset as usize;
    let hdr = std::mem::size_of::<abi::vfio_info_cap_header>();
    for _ in 0..64 {
        if off == 0 || off + hdr > buf.len() {
            break;
        }
        let h = abi::vfio_info_cap_header::read_from(&buf[off..]);
        if h.id == abi::VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE {
            let cap = abi::vfio_iommu_type1_info_cap_iova_range::read_from(&buf[off..]);
            let first = off + std::mem::size_of::<abi::vfio_iommu_type1_info_cap_iova_range>();
            let size = std::mem::size_of::<abi::vfio_iova_range>();
            let ranges: Vec<IovaRange> = (0..cap.nr_iovas as usize)
                .map_while(|i| buf.get(first + i * size..first + (i + 1) * size))
                .map(abi::vfio_iova_range::read_from)
                .filter(|r| r.start <= r.end)
                .map(|r| IovaRange { start: r.start, end: r.end })
                .collect();
            return if ranges.is_empty() { all } else { ranges };
        }
        if h.next as usize <= off {
            break;
        }
        off = h.next as usize;
    }
    all
}

/// A VFIO group file (`/dev/vfio/<group>`).
#[derive(Debug)]
pub struct Group {
    fd: Fd,
    pub id: u32,
}

/// Identity of the device read from config space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciIds {
    pub vendor: u16,
    pub device: u16,
    pub subsystem_vendor: u16,
    pub subsystem_device: u16,
    pub revision: u8,
}

/// A PCI function opened through VFIO. Owns the device fd, its group and (shared with the DMA allocator) the
/// container. Dropping it closes the device fd, which makes vfio-pci disable and reset the function.
#[derive(Debug)]
pub struct VfioDevice {
    sys: Arc<dyn Sys>,
    pub bdf: Bdf,
    fd: Arc<Fd>,
    container: Arc<Container>,
    group: Group,
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
    config_offset: u64,
    config_size: u64,
}

/// `VFIO_DEVICE_GET_REGION_INFO` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RegionInfo {
    pub index: u32,
    pub flags: u32,
    pub size: u64,
    pub offset: u64,
}

impl VfioDevice {
    /// Opens `bdf` on the real system.
    pub fn open(bdf: Bdf) -> Result<VfioDevice> {
        Self::open_with(Arc::new(sys::LinuxSys), bdf)
    }

    /// Opens `bdf` through `sys`: checks the device, its driver and its group's viability in sysfs first, so each
    /// common mistake gets its own error instead of an errno from deep inside VFIO.
    pub fn open_with(sys: Arc<dyn Sys>, bdf: Bdf) -> Result<VfioDevice> {
        let group_id = bind::check_ready(&*sys, bdf)?;
        let container_fd = Container::open(&sys)?;
        let gpath = PathBuf::from(format!("/dev/vfio/{group_id}"));
        let gfd = sys.open(&gpath, true).map_err(|e| match e.kind() {
            io::ErrorKind::PermissionDenied => VfioError::PermissionDenied(gpath.clone()),
            _ if e.raw_os_error() == Some(libc::EBUSY) => VfioError::Busy(bdf),
            _ => VfioError::Sys { what: format!("open {}", gpath.display()), source: e },
        })?;
        let group = Group { fd: Fd { sys: sys.clone(), fd: gfd }, id: group_id };
        let status = abi::vfio_group_status { argsz: 8, flags: 0 };
        // SAFETY: VFIO_GROUP_GET_STATUS takes an argsz-led vfio_group_status.
        let status =
            unsafe { ioctl_pod(&*sys, group.fd.raw(), abi::VFIO_GROUP_GET_STATUS, status, "get the group status") }?;
        if status.flags & abi::VFIO_GROUP_FLAGS_VIABLE == 0 {
            return Err(VfioError::GroupNotViable {
                group: group_id,
                blockers: bind::group_blockers(&*sys, group_id).unwrap_or_default(),
            });
        }
        // SAFETY: VFIO_GROUP_SET_CONTAINER reads the container's fd through a pointer.
        unsafe { sys.ioctl(group.fd.raw(), abi::VFIO_GROUP_SET_CONTAINER, Arg::Fd(container_fd.raw())) }
            .map_err(sys_err("attach the group to the container"))?;
        let container = Arc::new(Container::set_iommu(&sys, container_fd)?);
        // A Bdf prints as hex digits, ':' and '.', never NUL.
        let name = std::ffi::CString::new(bdf.to_string()).map_err(|_| VfioError::BadAddress(bdf.to_string()))?;
        // SAFETY: VFIO_GROUP_GET_DEVICE_FD reads a NUL-terminated device name.
        let dfd =
            unsafe { sys.ioctl(group.fd.raw(), abi::VFIO_GROUP_GET_DEVICE_FD, Arg::Name(&name)) }.map_err(|e| {
                if e.raw_os_error() == Some(libc::EBUSY) {
                    VfioError::Busy(bdf)
                } else {
                    VfioError::Sys { what: format!("get the device fd of {bdf}"), source: e }
                }
            })?;
        let fd = Arc::new(Fd { sys: sys.clone(), fd: dfd });
        let info =
            abi::vfio_device_info { argsz: std::mem::size_of::<abi::vfio_device_info>() as u32, ..Default::default() };
        // SAFETY: VFIO_DEVICE_GET_INFO takes an argsz-led vfio_device_info.
        let info = unsafe { ioctl_pod(&*sys, fd.raw(), abi::VFIO_DEVICE_GET_INFO, info, "get device info") }?;
        if info.flags & abi::VFIO_DEVICE_FLAGS_PCI == 0 || info.num_regions <= abi::VFIO_PCI_CONFIG_REGION_INDEX {
            return Err(VfioError::NotPci(bdf));
        }
        let mut dev = VfioDevice {
            sys,
            bdf,
            fd,
            container,
            group,
            flags: info.flags,
            num_regions: info.num_regions,
            num_irqs: info.num_irqs,
            config_offset: 0,
            config_size: 0,
        };
        let cfg = dev.region_info(abi::VFIO_PCI_CONFIG_REGION_INDEX)?;
        dev.config_offset = cfg.offset;
        dev.config_size = cfg.size;
        Ok(dev)
    }

    /// The container the device's DMA goes through (shared with [`dma::VfioDma`]).
    pub fn container(&self) -> &Arc<Container> {
        &self.container
    }

    pub fn group_id(&self) -> u32 {
        self.group.id
    }

    pub fn sys(&self) -> &Arc<dyn Sys> {
        &self.sys
    }

    pub(crate) fn fd(&self) -> &Arc<Fd> {
        &self.fd
    }

    pub fn region_info(&self, index: u32) -> Result<RegionInfo> {
        let r = abi::vfio_region_info {
            argsz: std::mem::size_of::<abi::vfio_region_info>() as u32,
            index,
            ..Default::default()
        };
        // SAFETY: VFIO_DEVICE_GET_REGION_INFO takes an argsz-led vfio_region_info.
        let r =
            unsafe { ioctl_pod(&*self.sys, self.fd.raw(), abi::VFIO_DEVICE_GET_REGION_INFO, r, "get region info") }?;
        Ok(RegionInfo { index, flags: r.flags, size: r.size, offset: r.offset })
    }

    /// Opens BAR `index` for MMIO: mapped when vfio-pci lets it be mapped, else reached with `pread`/`pwrite` on
    /// the device fd (a region without `VFIO_REGION_INFO_FLAG_MMAP`, as vfio-pci reports a BAR it cannot map).
    pub fn map_bar(&self, index: u32) -> Result<Bar> {
        let r = self.region_info(index)?;
        let rw = abi::VFIO_REGION_INFO_FLAG_READ | abi::VFIO_REGION_INFO_FLAG_WRITE;
        if r.flags & rw != rw || r.size == 0 || r.size > isize::MAX as u64 {
            return Err(VfioError::BarNotMappable { bdf: self.bdf, index, flags: r.flags, size: r.size });
        }
        let len = r.size as usize;
        let access = if r.flags & abi::VFIO_REGION_INFO_FLAG_MMAP != 0 {
            let ptr =
                self.sys.mmap_device(self.fd.raw(), len, r.offset).map_err(sys_err(format!("mmap BAR {index}")))?;
            BarAccess::Mapped(ptr)
        } else {
            log::info!("{}: BAR {index} cannot be mapped; its registers are reached with pread/pwrite", self.bdf);
            BarAccess::ReadWrite { offset: r.offset }
        };
        Ok(Bar { sys: self.sys.clone(), fd: self.fd.clone(), access, len })
    }

    /// Reads `buf.len()` bytes of config space at `off`.
    pub fn config_read(&self, off: u64, buf: &mut [u8]) -> Result<()> {
        self.config_range(off, buf.len())?;
        let n = self.sys.pread(self.fd.raw(), buf, self.config_offset + off).map_err(sys_err("read config space"))?;
        if n != buf.len() {
            return Err(VfioError::Sys {
                what: "read config space".into(),
                source: io::ErrorKind::UnexpectedEof.into(),
            });
        }
        Ok(())
    }

    /// Writes `buf` to config space at `off`.
    pub fn config_write(&self, off: u64, buf: &[u8]) -> Result<()> {
        self.config_range(off, buf.len())?;
        let n = self.sys.pwrite(self.fd.raw(), buf, self.config_offset + off).map_err(sys_err("write config space"))?;
        if n != buf.len() {
            return Err(VfioError::Sys { what: "write config space".into(), source: io::ErrorKind::WriteZero.into() });
        }
        Ok(())
    }

    fn config_range(&self, off: u64, len: usize) -> Result<()> {
        if off.checked_add(len as u64).is_none_or(|end| end > self.config_size) {
            return Err(VfioError::Sys {
                what: format!("access config space at {off:#x}+{len}"),
                source: io::ErrorKind::InvalidInput.into(),
            });
        }
        Ok(())
    }

    pub fn config_read16(&self, off: u64) -> Result<u16> {
        let mut b = [0; 2];
        self.config_read(off, &mut b)?;
        Ok(u16::from_le_bytes(b))
    }

    pub fn config_write16(&self, off: u64, v: u16) -> Result<()> {
        self.config_write(off, &v.to_le_bytes())
    }

    /// Vendor, device, subsystem and revision from config space.
    pub fn pci_ids(&self) -> Result<PciIds> {
        let mut b = [0u8; 0x30];
        self.config_read(0, &mut b)?;
        let w = |o: usize| u16::from_le_bytes([b[o], b[o + 1]]);
        Ok(PciIds { vendor: w(0), device: w(2), revision: b[8], subsystem_vendor: w(0x2c), subsystem_device: w(0x2e) })
    }

    /// Sets or clears Bus Master Enable (command register bit 2). vfio-pci leaves it off; without it the function
    /// cannot issue DMA (or MSI writes).
    pub fn set_bus_master(&self, on: bool) -> Result<()> {
        const PCI_COMMAND: u64 = 0x04;
        const PCI_COMMAND_MASTER: u16 = 1 << 2;
        let cmd = self.config_read16(PCI_COMMAND)?;
        let new = if on { cmd | PCI_COMMAND_MASTER } else { cmd & !PCI_COMMAND_MASTER };
        if new != cmd {
            self.config_write16(PCI_COMMAND, new)?;
        }
        Ok(())
    }

    pub fn bus_master(&self) -> Result<bool> {
        Ok(self.config_read16(0x04)? & (1 << 2) != 0)
    }

    /// `VFIO_DEVICE_RESET` (function level reset or what vfio-pci offers).
    pub fn reset(&self) -> Result<()> {
        // SAFETY: VFIO_DEVICE_RESET takes no argument.
        unsafe { self.sys.ioctl(self.fd.raw(), abi::VFIO_DEVICE_RESET, Arg::None) }
            .map_err(sys_err("reset the device"))?;
        Ok(())
    }
}

/// A BAR of the device: the core's [`Mmio`] for a real device.
///
/// Accesses are of exactly the width asked for: `write64` is one 64-bit store (or one 8-byte `pwrite`, which
/// vfio-pci performs as one 64-bit access), so a doorbell is never seen half-written. mlx5 registers are big
/// endian; the byte swap happens here.
#[derive(Debug)]
pub struct Bar {
    sys: Arc<dyn Sys>,
    fd: Arc<Fd>,
    access: BarAccess,
    len: usize,
}

/// How a BAR's registers are reached.
#[derive(Debug)]
enum BarAccess {
    /// Mapped into this process: volatile loads and stores.
    Mapped(NonNull<u8>),
    /// Read and written through the device fd at the region's offset, each access one syscall (vfio-pci's
    /// `vfio_pci_bar_rw`). Slower, but it works where the BAR cannot be mapped.
    ReadWrite { offset: u64 },
}

// SAFETY: the mapping is device memory accessed only by volatile loads and stores of whole registers; the device
// orders concurrent accesses itself, and the core serialises the sequences that need order (doorbells) by &mut.
unsafe impl Send for Bar {}
// SAFETY: as above: shared references only perform volatile register accesses (or syscalls on the device fd).
unsafe impl Sync for Bar {}

impl Bar {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the BAR is mapped into this process (else each access is a `pread`/`pwrite`).
    pub fn is_mapped(&self) -> bool {
        matches!(self.access, BarAccess::Mapped(_))
    }

    /// Checks that a naturally aligned register of `size` bytes at `off` lies inside the BAR.
    ///
    /// # Panics
    /// When the register lies outside the BAR or is misaligned: offsets come from the driver's own layouts, so
    /// this catches a driver bug, never a device value.
    fn check(&self, off: usize, size: usize) {
        assert!(
            off.is_multiple_of(size) && off.checked_add(size).is_some_and(|e| e <= self.len),
            "MMIO {off:#x} outside BAR"
        );
    }

    /// Reads `N` bytes at `off` through the device fd. A failed read returns all ones, as a read the bus could
    /// not complete does on a real machine (the health poll then sees a device that is gone).
    fn pread<const N: usize>(&self, offset: u64, off: usize) -> [u8; N] {
        let mut b = [0u8; N];
        match self.sys.pread(self.fd.raw(), &mut b, offset + off as u64) {
            Ok(n) if n == N => b,
            r => {
                log::warn!("BAR read of {N} bytes at {off:#x} failed ({r:?}): reads as all ones");
                [0xff; N]
            }
        }
    }

    /// Writes `data` at `off` through the device fd. A failed write is dropped, as a posted write the device
    /// never accepted is, and logged.
    fn pwrite(&self, offset: u64, off: usize, data: &[u8]) {
        match self.sys.pwrite(self.fd.raw(), data, offset + off as u64) {
            Ok(n) if n == data.len() => {}
            r => log::warn!("BAR write of {} bytes at {off:#x} failed ({r:?}): dropped", data.len()),
        }
    }
}

impl Drop for Bar {
    fn drop(&mut self) {
        if let BarAccess::Mapped(ptr) = self.access {
            // SAFETY: ptr/len came from mmap_device and are unmapped once; no reference into the mapping outlives
            // self.
            unsafe { self.sys.munmap(ptr, self.len) };
        }
    }
}

impl Mmio for Bar {
    fn read32(&self, off: usize) -> u32 {
        self.check(off, 4);
        match self.access {
            // SAFETY: check() verified bounds and 4-byte alignment inside the live mapping.
            BarAccess::Mapped(p) => u32::from_be(unsafe { p.as_ptr().add(off).cast::<u32>().read_volatile() }),
            BarAccess::ReadWrite { offset } => u32::from_be_bytes(self.pread(offset, off)),
        }
    }

    fn write32(&self, off: usize, v: u32) {
        self.check(off, 4);
        match self.access {
            // SAFETY: check() verified bounds and 4-byte alignment inside the live mapping.
            BarAccess::Mapped(p) => unsafe { p.as_ptr().add(off).cast::<u32>().write_volatile(v.to_be()) },
            BarAccess::ReadWrite { offset } => self.pwrite(offset, off, &v.to_be_bytes()),
        }
    }

    fn read64(&self, off: usize) -> u64 {
        self.check(off, 8);
        match self.access {
            // SAFETY: check() verified bounds and 8-byte alignment inside the live mapping.
            BarAccess::Mapped(p) => u64::from_be(unsafe { p.as_ptr().add(off).cast::<u64>().read_volatile() }),
            BarAccess::ReadWrite { offset } => u64::from_be_bytes(self.pread(offset, off)),
        }
    }

    fn write64(&self, off: usize, v: u64) {
        self.check(off, 8);
        match self.access {
            // SAFETY: check() verified bounds and 8-byte alignment inside the live mapping; one 64-bit store.
            BarAccess::Mapped(p) => unsafe { p.as_ptr().add(off).cast::<u64>().write_volatile(v.to_be()) },
            BarAccess::ReadWrite { offset } => self.pwrite(offset, off, &v.to_be_bytes()),
        }
    }

    fn write_bf64(&self, off: usize, chunk: &[u64; 8]) {
        // One bounds and alignment check for the whole 64-byte chunk.
        self.check(off, 64);
        match self.access {
            BarAccess::Mapped(p) => {
                // Eight stores in address order, so the write-combining buffer fills in one burst.
                // SAFETY: check() verified that off..off + 64 is inside the live mapping and 64-byte aligned.
                let dst = unsafe { p.as_ptr().add(off) }.cast::<u64>();
                for (i, w) in chunk.iter().enumerate() {
                    // SAFETY: word i of the checked 64-byte chunk; the chunk holds the bytes in memory order.
                    unsafe { dst.add(i).write_volatile(*w) };
                }
            }
            BarAccess::ReadWrite { offset } => {
                // One 64-byte write, which vfio-pci performs as eight 8-byte accesses in address order.
                let mut b = [0u8; 64];
                for (d, w) in b.chunks_exact_mut(8).zip(chunk) {
                    d.copy_from_slice(&w.to_ne_bytes());
                }
                self.pwrite(offset, off, &b);
            }
        }
    }
}

/// A delay for the core on Linux: sleeps (the command queue's backoff starts at 10 µs, so sleeping is fine).
#[derive(Debug, Default, Clone, Copy)]
pub struct StdDelay;

impl mlx5_core::hal::DelayNs for StdDelay {
    fn delay_ns(&mut self, ns: u32) {
        std::thread::sleep(std::time::Duration::from_nanos(ns.into()));
    }
}

/// Everything needed to run the core on a VFIO device: BAR 0, IOMMU-backed DMA memory, interrupts.
///
/// Teardown order matters and is fixed here: bus mastering is switched off first, so the function can no longer
/// reach memory; then interrupts are released, DMA memory is unmapped from the IOMMU and freed, BAR 0 is unmapped,
/// and last the device fd is closed (vfio-pci then resets the function).
#[derive(Debug)]
pub struct Vfio {
    pub irqs: Option<irq::Interrupts>,
    pub dma: dma::VfioDma,
    pub bar: Bar,
    pub device: VfioDevice,
}

/// Options for [`Vfio::open`].
#[derive(Debug, Clone)]
pub struct VfioOptions {
    pub dma: dma::DmaOptions,
    /// Interrupt vectors to request (MSI-X, or MSI when the function has no MSI-X); 0 for none.
    pub vectors: u32,
}

impl Default for VfioOptions {
    fn default() -> Self {
        VfioOptions { dma: dma::DmaOptions::default(), vectors: 1 }
    }
}

impl VfioOptions {
    /// The defaults, with the IOVA mode `MLX5_RS_IOVA_MODE` chooses: `va` (unset: IOVAs this driver allocates,
    /// translated by the IOMMU) or `pa` (IOVA = the memory's physical address, for a device whose DMA bypasses
    /// the IOMMU, as QEMU's x-pci-proxy-dev does; DPDK's `--iova-mode=pa`). Never chosen automatically: a device
    /// behind a working IOMMU must not be handed physical addresses.
    pub fn from_env() -> Result<Self> {
        let mut o = Self::default();
        match std::env::var("MLX5_RS_IOVA_MODE").as_deref() {
            Err(_) | Ok("") | Ok("va") => {}
            Ok("pa") => o.dma.iova_mode = dma::IovaMode::Physical,
            Ok(other) => return Err(VfioError::BadIovaMode(other.to_string())),
        }
        Ok(o)
    }
}

impl Vfio {
    pub fn open(bdf: Bdf, opts: VfioOptions) -> Result<Vfio> {
        Self::open_with(Arc::new(sys::LinuxSys), bdf, opts)
    }

    pub fn open_with(sys: Arc<dyn Sys>, bdf: Bdf, opts: VfioOptions) -> Result<Vfio> {
        let device = VfioDevice::open_with(sys, bdf)?;
        let bar = device.map_bar(abi::VFIO_PCI_BAR0_REGION_INDEX)?;
        let dma = dma::VfioDma::new(device.container().clone(), opts.dma);
        let irqs = match opts.vectors {
            0 => None,
            n => match irq::Interrupts::enable(&device, n) {
                Ok(i) => Some(i),
                // A function with neither MSI-X nor MSI (QEMU's x-pci-proxy-dev forwards none): the driver polls.
                Err(VfioError::NoInterrupts { bdf, .. }) => {
                    log::warn!("{bdf} has no MSI-X or MSI interrupts: completions and events are polled");
                    None
                }
                Err(e) => return Err(e),
            },
        };
        device.set_bus_master(true)?;
        Ok(Vfio { irqs, dma, bar, device })
    }
}

impl Drop for Vfio {
    fn drop(&mut self) {
        // Nothing may reach memory once it is unmapped and freed below.
        if let Err(e) = self.device.set_bus_master(false) {
            log::warn!("{}: could not switch bus mastering off before teardown: {e}", self.device.bdf);
        }
    }
}

#[cfg(test)]
mod tests;
