//! The VFIO layer against the test twin: every path of open, DMA, interrupts, binding and teardown.

use std::sync::Arc;
use std::time::Duration;

use std::ptr::NonNull;

use mlx5_core::hal::{Dma, DmaError, Mmio};

use super::dma::{Backing, DmaOptions, VfioDma, CHUNK};
use super::irq::{Interrupts, IrqKind};
use super::twin::Twin;
use super::*;

const MLX: &str = "0000:03:00.0";
const BAR_LEN: usize = 1 << 20;

fn bdf(s: &str) -> Bdf {
    s.parse().unwrap()
}

/// A twin with a ConnectX at 03:00.0 bound to vfio-pci in group 7.
fn twin() -> Arc<Twin> {
    let t = Arc::new(Twin::new());
    t.add_device(MLX, 0x15b3, 0x1017, 7, Some("vfio-pci"), BAR_LEN);
    t
}

fn sys(t: &Arc<Twin>) -> Arc<dyn Sys> {
    t.clone()
}

#[test]
fn bdf_parses_long_and_short_forms() {
    assert_eq!(bdf("0000:03:00.0"), Bdf { domain: 0, bus: 3, device: 0, function: 0 });
    assert_eq!(bdf("af:1f.7").to_string(), "0000:af:1f.7");
    assert_eq!(bdf("10000:00:00.0".trim_start_matches('1')).domain, 0);
    for bad in [
        "",
        "03:00",
        "0000:03:20.0",
        "0000:03:00.8",
        "zz:00.0",
        "0000:0300.0",
        "1:2:3:4.0",
        "0000:03:00.",
        "00000:03:00.0",
        "0000:003:00.0",
        "+000:03:00.0",
        "0000:03:00.+1",
    ] {
        assert!(matches!(bad.parse::<Bdf>(), Err(VfioError::BadAddress(_))), "{bad} accepted");
    }
}

#[test]
fn open_maps_bar_and_reads_the_iommu_ranges() {
    let t = twin();
    let dev = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap();
    assert_eq!(dev.group_id(), 7);
    assert_eq!(
        dev.container().iova_ranges,
        vec![IovaRange { start: 0, end: 0xfedf_ffff }, IovaRange { start: 0xfef0_0000, end: (1 << 48) - 1 }]
    );
    assert_ne!(dev.container().iova_pgsizes & CHUNK as u64, 0);
    let ids = dev.pci_ids().unwrap();
    assert_eq!((ids.vendor, ids.device, ids.revision), (0x15b3, 0x1017, 0x10));

    let bar = dev.map_bar(0).unwrap();
    assert!(bar.is_mapped());
    check_registers(&t, &bar);

    // Bus master: vfio-pci leaves it off; set and clear it through config space.
    assert!(!dev.bus_master().unwrap());
    dev.set_bus_master(true).unwrap();
    assert!(dev.bus_master().unwrap());
    assert_eq!(dev.config_read16(4).unwrap(), 0x0107);
    dev.set_bus_master(false).unwrap();
    assert_eq!(dev.config_read16(4).unwrap(), 0x0103);
    assert!(dev.config_read16(0x100).is_err(), "config access past the region is refused");
    dev.reset().unwrap();
    drop(bar);
    drop(dev);
    assert_eq!(t.open_fds(), 0, "every fd closed");
    assert!(!t.state().devices[MLX].open);
}

/// What the device sees of the driver's register accesses through `bar` (the twin's own BAR 0 storage).
fn check_registers(t: &Twin, bar: &Bar) {
    assert_eq!(bar.len(), BAR_LEN);
    // Registers are big endian: the device sees the most significant byte first.
    bar.write32(0x14, 0x1122_3344);
    assert_eq!(t.bar_word(MLX, 0x14).to_ne_bytes(), [0x11, 0x22, 0x33, 0x44]);
    assert_eq!(bar.read32(0x14), 0x1122_3344);
    bar.write64(0x800, 0x0102_0304_0506_0708);
    assert_eq!(t.bar_word(MLX, 0x800).to_ne_bytes(), [1, 2, 3, 4]);
    assert_eq!(t.bar_word(MLX, 0x804).to_ne_bytes(), [5, 6, 7, 8]);
    assert_eq!(bar.read64(0x800), 0x0102_0304_0506_0708);
    // A BlueFlame chunk lands as the bytes it holds in memory, in address order.
    let chunk: [u64; 8] = core::array::from_fn(|i| u64::from_ne_bytes([i as u8; 8]));
    bar.write_bf64(0x900, &chunk);
    for i in 0..8 {
        assert_eq!(t.bar_word(MLX, 0x900 + 8 * i).to_ne_bytes(), [i as u8; 4], "word {i}");
        assert_eq!(t.bar_word(MLX, 0x904 + 8 * i).to_ne_bytes(), [i as u8; 4], "word {i}");
    }
}

#[test]
fn a_bar_that_cannot_be_mapped_is_read_and_written_through_the_device_fd() {
    let t = twin();
    t.state().devices.get_mut(MLX).unwrap().bar_mmap = false;
    let dev = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap();
    assert_eq!(dev.region_info(0).unwrap().flags & abi::VFIO_REGION_INFO_FLAG_MMAP, 0);
    let bar = dev.map_bar(0).unwrap();
    assert!(!bar.is_mapped());
    t.state().log.clear();
    check_registers(&t, &bar);
    // The same bytes as through a mapping; nothing was mapped.
    assert!(!t.state().log.iter().any(|l| l.starts_with("mmap")));
    // A write the kernel refuses is dropped and a read it refuses reads all ones, as on a bus.
    t.state().fail.insert("bar", libc::EIO);
    bar.write32(0x14, 0x5566_7788);
    assert_eq!(bar.read32(0x14), u32::MAX);
    t.state().fail.clear();
    assert_eq!(bar.read32(0x14), 0x1122_3344);
    drop(bar);
    drop(dev);
    assert_eq!(t.open_fds(), 0);
}

/// A device behind a twin function: a BAR of 4 KiB held as bytes, the DMA mappings it was given, and the
/// interrupts a test makes it raise.
#[derive(Debug, Default)]
struct FakeDevice {
    bar: std::sync::Mutex<Vec<u8>>,
    maps: std::sync::Mutex<Vec<(u64, usize)>>,
    pending: std::sync::Mutex<Vec<u16>>,
    resets: std::sync::atomic::AtomicU32,
}

impl twin::TwinBackend for FakeDevice {
    fn bar_len(&self) -> u64 {
        4096
    }
    fn bar_read(&self, off: u64, buf: &mut [u8]) -> std::io::Result<()> {
        let bar = self.bar.lock().unwrap();
        buf.copy_from_slice(&bar[off as usize..off as usize + buf.len()]);
        Ok(())
    }
    fn bar_write(&self, off: u64, data: &[u8]) -> std::io::Result<()> {
        // Writing 0xdead_beef to offset 0 raises vector 2, as a doorbell would make an EQ interrupt.
        if off == 0 && data == 0xdead_beefu32.to_be_bytes() {
            self.pending.lock().unwrap().push(2);
        }
        self.bar.lock().unwrap()[off as usize..off as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
    unsafe fn dma_map(&self, iova: u64, _cpu: NonNull<u8>, len: usize) -> std::io::Result<()> {
        self.maps.lock().unwrap().push((iova, len));
        Ok(())
    }
    fn dma_unmap(&self, iova: u64, len: usize) {
        self.maps.lock().unwrap().retain(|&m| m != (iova, len));
    }
    fn take_interrupts(&self) -> Vec<u16> {
        std::mem::take(&mut *self.pending.lock().unwrap())
    }
    fn reset(&self) {
        self.resets.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    }
}

#[test]
fn a_backed_function_gets_bar_accesses_dma_mappings_and_raises_interrupts_on_its_vector() {
    let t = Arc::new(Twin::new());
    let fake = Arc::new(FakeDevice { bar: std::sync::Mutex::new(vec![0; 4096]), ..FakeDevice::default() });
    t.add_backed_device(MLX, 0x15b3, 0x1017, 7, fake.clone());
    let v = Vfio::open_with(sys(&t), bdf(MLX), VfioOptions { vectors: 4, ..VfioOptions::default() }).unwrap();
    assert!(!v.bar.is_mapped());
    assert_eq!(v.bar.len(), 4096);
    v.bar.write32(0x10, 0x0102_0304);
    assert_eq!(fake.bar.lock().unwrap()[0x10..0x14], [1, 2, 3, 4]);
    assert_eq!(v.bar.read32(0x10), 0x0102_0304);
    // DMA memory is mapped for the device at its IOVA.
    let r = v.dma.alloc(4096, 4096).unwrap();
    let chunk = *fake.maps.lock().unwrap().first().expect("the chunk mapped for the device");
    assert!(chunk.0 <= r.iova() && r.iova() < chunk.0 + chunk.1 as u64);
    // The interrupt the write raises reaches vector 2's eventfd alone.
    v.bar.write32(0, 0xdead_beef);
    assert_eq!(t.eventfd_counts(MLX), [0, 0, 1, 0]);
    let irqs = v.irqs.as_ref().unwrap();
    assert_eq!(irqs.wait_any(Duration::from_secs(1)).unwrap(), Some((2, 1)));
    assert_eq!(t.state().devices[MLX].irq_fired, [0, 0, 1]);
    // SAFETY: the region came from this allocator and the device is done with it.
    unsafe { v.dma.free(r) };
    drop(v);
    assert!(fake.maps.lock().unwrap().is_empty(), "every mapping taken away from the device");
    assert_eq!(fake.resets.load(std::sync::atomic::Ordering::Relaxed), 1, "released as vfio-pci resets");
    assert_eq!(t.open_fds(), 0);
}

#[test]
#[should_panic(expected = "outside BAR")]
fn bar_access_outside_the_mapping_is_a_driver_bug() {
    let t = twin();
    let dev = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap();
    let bar = dev.map_bar(0).unwrap();
    bar.read32(BAR_LEN);
}

#[test]
fn open_errors_name_the_cause() {
    let t = twin();
    let e = VfioDevice::open_with(sys(&t), bdf("0000:00:00.0")).unwrap_err();
    assert!(matches!(e, VfioError::NoSuchDevice(_)));
    assert_eq!(e.to_string(), "no PCI device 0000:00:00.0 (nothing at /sys/bus/pci/devices/0000:00:00.0)");

    t.state().iommu = false;
    let e = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap_err();
    assert!(matches!(e, VfioError::NoIommuGroup(_)), "{e}");
    assert!(e.to_string().contains("IOMMU is disabled"));
    t.state().iommu = true;

    t.state().devices.get_mut(MLX).unwrap().driver = Some("mlx5_core".into());
    let e = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap_err();
    assert_eq!(e.to_string(), "0000:03:00.0 is bound to mlx5_core, not vfio-pci (run `mlx5 bind 0000:03:00.0`)");
    t.state().devices.get_mut(MLX).unwrap().driver = Some("vfio-pci".into());

    // Another function of the same group still on a host driver makes the group unusable.
    t.add_device("0000:03:00.1", 0x15b3, 0x1017, 7, Some("mlx5_core"), 4096);
    let e = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap_err();
    assert_eq!(
        e.to_string(),
        "IOMMU group 7 is not viable: 0000:03:00.1 (mlx5_core) still bound to a host driver (bind them to vfio-pci \
         or unbind them)"
    );
    t.state().devices.get_mut("0000:03:00.1").unwrap().driver = None;
    VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap();

    t.state().euid = 1000;
    let e = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap_err();
    assert!(matches!(e, VfioError::PermissionDenied(_)), "{e}");
    t.state().euid = 0;

    t.state().intremap = false;
    let e = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap_err();
    assert!(e.to_string().contains("no interrupt remapping"), "{e}");
    assert!(std::error::Error::source(&e).is_some(), "the errno is kept as the source");
    t.state().intremap = true;

    t.state().type1v2 = false;
    assert!(matches!(VfioDevice::open_with(sys(&t), bdf(MLX)), Err(VfioError::NoType1v2)));
    t.state().type1v2 = true;

    // One process at a time: the group (and the device) are busy while open.
    let held = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap();
    let e = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap_err();
    assert_eq!(e.to_string(), "0000:03:00.0 is busy: another process or driver holds it");
    drop(held);
    drop(e);
    assert_eq!(t.open_fds(), 0, "error paths close what they opened");
}

fn dma(t: &Arc<Twin>, opts: DmaOptions) -> (VfioDevice, VfioDma) {
    let dev = VfioDevice::open_with(sys(t), bdf(MLX)).unwrap();
    let d = VfioDma::new(dev.container().clone(), opts);
    (dev, d)
}

#[test]
fn dma_regions_are_mapped_aligned_zeroed_and_returned() {
    let t = twin();
    let (_dev, d) = dma(&t, DmaOptions::default());
    assert_eq!(d.backing(), Backing::None);
    let a = d.alloc(4096, 4096).unwrap();
    let b = d.alloc(576, 1024).unwrap();
    let c = d.alloc(64 << 10, 64 << 10).unwrap();
    assert_eq!(d.backing(), Backing::Huge2M);
    assert_eq!(d.chunks(), 1, "small regions share one 2 MiB chunk");
    for r in [&a, &b, &c] {
        assert!(r.iova() >= CHUNK as u64, "IOVA 0 stays unmapped");
        // SAFETY: r is a live region of r.len bytes.
        let bytes = unsafe { std::slice::from_raw_parts(r.cpu().as_ptr(), r.len()) };
        assert!(bytes.iter().all(|&x| x == 0));
    }
    assert_eq!(b.iova() % 1024, 0);
    assert_eq!(c.iova() % (64 << 10), 0);
    assert_eq!(c.cpu().as_ptr() as usize % (64 << 10), 0);
    // The IOVA and the CPU address move together inside a chunk: what the device reads is what the CPU wrote.
    assert_eq!(b.iova() - a.iova(), b.cpu().as_ptr() as u64 - a.cpu().as_ptr() as u64);
    {
        let s = t.state();
        let (iova, m) = s.maps.iter().next().unwrap();
        assert_eq!(m.size, CHUNK as u64);
        assert_eq!(a.iova() - iova, a.cpu().as_ptr() as u64 - m.vaddr);
    }
    assert_eq!(d.iova_of(b.cpu().as_ptr().wrapping_add(16), 100), Some(b.iova() + 16));
    assert_eq!(d.iova_of(b.cpu().as_ptr(), 4096), None, "past the region's end");
    assert_eq!(d.iova_of(&0u8, 1), None, "not DMA memory");
    assert_eq!(d.outstanding(), (3, 4096 + 576 + (64 << 10)));

    // Reused memory comes back zeroed.
    // SAFETY: a is live and 4096 bytes long.
    unsafe { a.cpu().as_ptr().write_bytes(0xaa, 4096) };
    // SAFETY: a came from d, is freed once, and nothing accesses it.
    unsafe { d.free(a) };
    let a2 = d.alloc(4096, 4096).unwrap();
    // SAFETY: a2 is live and 4096 bytes long.
    assert!(unsafe { std::slice::from_raw_parts(a2.cpu().as_ptr(), 4096) }.iter().all(|&x| x == 0));

    // A region bigger than a chunk gets its own mapping.
    let big = d.alloc(5 << 20, 4096).unwrap();
    assert_eq!(d.chunks(), 2);
    assert_eq!(t.state().maps.len(), 2);
    for r in [a2, b, c, big] {
        // SAFETY: each came from d, is freed once, and nothing accesses it.
        unsafe { d.free(r) };
    }
    assert_eq!(d.outstanding(), (0, 0));
    assert_eq!(d.chunks(), 0, "empty chunks are unmapped and returned");
    assert!(t.state().maps.is_empty());
    assert!(t.state().anon.is_empty());
    assert_eq!(t.state().hugepages, 16, "every hugepage returned");
    assert_eq!(d.map_counts(), (2, 2));
    assert_eq!(d.alloc(64, 4 << 20), Err(DmaError::BadAlignment { align: 4 << 20 }));
}

#[test]
fn dma_falls_back_to_small_pages_with_a_notice() {
    let t = twin();
    t.state().hugepages = 0;
    let (_dev, d) = dma(&t, DmaOptions::default());
    let r = d.alloc(8192, 2 << 20).unwrap();
    assert_eq!(d.backing(), Backing::Pages4K);
    assert!(d.fell_back_to_small_pages());
    assert_eq!(r.cpu().as_ptr() as usize % CHUNK, 0, "2 MiB alignment holds without hugepages too");
    assert_eq!(r.iova() % CHUNK as u64, 0);
    // SAFETY: r came from d, is freed once.
    unsafe { d.free(r) };
    assert!(t.state().anon.is_empty());
}

#[test]
fn dma_respects_the_device_limit_and_cleans_up_failures() {
    let t = twin();
    let opts = DmaOptions { max_iova: (8 << 20) - 1, ..DmaOptions::default() };
    let (_dev, d) = dma(&t, opts);
    // [2 MiB, 8 MiB) holds three chunks.
    let rs: Vec<_> = (0..3).map(|_| d.alloc(CHUNK, 4096).unwrap()).collect();
    assert!(rs.iter().all(|r| r.iova() + r.len() as u64 <= 8 << 20));
    assert_eq!(d.alloc(CHUNK, 4096), Err(DmaError::NoMemory { len: CHUNK }));
    for r in rs {
        // SAFETY: r came from d, is freed once.
        unsafe { d.free(r) };
    }
    // A refused IOMMU mapping gives the memory and the IOVA back.
    t.state().fail.insert("MAP_DMA", libc::ENOSPC);
    assert_eq!(d.alloc(4096, 4096), Err(DmaError::MapFailed));
    assert!(t.state().anon.is_empty());
    t.state().fail.clear();
    let r = d.alloc(4096, 4096).unwrap();
    assert_eq!(r.iova(), CHUNK as u64, "the IOVA of the failed attempt was returned");
    // A failed unmap keeps the memory: the device might still reach it.
    t.state().fail.insert("UNMAP_DMA", libc::EINVAL);
    // SAFETY: r came from d, is freed once.
    unsafe { d.free(r) };
    assert_eq!(t.state().anon.len(), 1);
    t.state().fail.clear();
}

/// A heap buffer of `len` bytes starting `off` bytes past an `align`-aligned address, declared pinnable to the
/// twin (the kernel pins any mapped memory; the twin only what it is told). Returns the buffer and the address.
fn user_buf(t: &Arc<Twin>, len: usize, align: usize, off: usize) -> (Vec<u8>, NonNull<u8>) {
    let mut v = vec![0u8; len + off + 2 * align];
    let start = v.as_ptr() as usize;
    let at = start.next_multiple_of(align) + off - start;
    let lo = (start as u64) & !0xfff;
    let hi = ((start + v.len()) as u64).next_multiple_of(4096);
    t.state().pinnable.push((lo, hi - lo));
    let p = NonNull::new(v.as_mut_ptr().wrapping_add(at)).unwrap();
    (v, p)
}

#[test]
fn map_user_pins_the_covering_pages_and_unmaps_them_on_free() {
    let t = twin();
    let (_dev, d) = dma(&t, DmaOptions::default());
    // 5000 bytes from 0x123 into a page: two pages are mapped.
    let (v, p) = user_buf(&t, 3 * 4096, 4096, 0x123);
    // SAFETY: `v` outlives the mapping (freed below) and nothing else maps it.
    let r = unsafe { d.map_user(p, 5000) }.unwrap();
    assert_eq!((r.cpu(), r.len()), (p, 5000));
    assert_eq!(r.iova() % 4096, 0x123, "the bus address keeps the offset in the page");
    let page = p.as_ptr() as u64 & !0xfff;
    let map_iova = r.iova() & !0xfff;
    assert_eq!(t.state().maps.get(&map_iova).copied(), Some(twin::TwinMap { vaddr: page, size: 8192 }));
    assert!(t.state().log.iter().any(|l| l.ends_with(&format!("{:#x}", abi::VFIO_IOMMU_MAP_DMA))));
    assert_eq!(d.iova_of(p.as_ptr(), 5000), Some(r.iova()));
    assert_eq!(d.iova_of(p.as_ptr(), 5001), None);
    assert_eq!(d.outstanding(), (1, 5000));
    // SAFETY: from `d`, freed once; no device uses it.
    unsafe { d.free(r) };
    assert!(t.state().maps.is_empty(), "unmapped from the IOMMU");
    assert_eq!((d.user_map_counts(), d.outstanding()), ((1, 1), (0, 0)));
    // The IOVA came back: the same memory maps at the same address again.
    // SAFETY: as above.
    let again = unsafe { d.map_user(p, 5000) }.unwrap();
    assert_eq!(again.iova() & !0xfff, map_iova);
    // Dropping the allocator takes the mapping away from the device too.
    drop(d);
    assert!(t.state().maps.is_empty());
    drop(v);
}

#[test]
fn map_user_aligns_the_bus_address_as_the_memory_is() {
    let t = twin();
    let (_dev, d) = dma(&t, DmaOptions::default());
    let (v, p) = user_buf(&t, 4 << 20, 4 << 20, 0);
    // SAFETY: `v` outlives the mapping, which nothing else covers.
    let r = unsafe { d.map_user(p, 4 << 20) }.unwrap();
    assert_eq!(r.iova() % (4 << 20), 0, "4 MiB aligned memory gets a 4 MiB aligned bus address");
    // SAFETY: from `d`, freed once.
    unsafe { d.free(r) };
    drop(v);
}

#[test]
fn map_user_refusals_leave_nothing_mapped() {
    let t = twin();
    // [2 MiB, 4 MiB): one chunk of IOVA below the device's limit.
    let opts = DmaOptions { max_iova: (4 << 20) - 1, ..DmaOptions::default() };
    let (_dev, d) = dma(&t, opts);
    let (v, p) = user_buf(&t, 3 << 20, 4096, 0);
    let nothing = |t: &Arc<Twin>, d: &VfioDma| t.state().maps.is_empty() && d.outstanding() == (0, 0);
    let addr = p.as_ptr() as usize;
    // Beyond the IOVA aperture: 3 MiB does not fit below 4 MiB.
    // SAFETY: `v` outlives every mapping; a refused attempt maps and touches nothing.
    assert_eq!(unsafe { d.map_user(p, 3 << 20) }, Err(DmaError::Unreachable { addr, len: 3 << 20 }));
    assert!(nothing(&t, &d));
    // Empty.
    // SAFETY: `v` outlives every mapping; a refused attempt maps and touches nothing.
    assert_eq!(unsafe { d.map_user(p, 0) }, Err(DmaError::Unreachable { addr, len: 0 }));
    // The IOMMU refuses: nothing mapped, and the IOVA is given back.
    t.state().fail.insert("MAP_DMA", libc::ENOSPC);
    // SAFETY: `v` outlives every mapping; a refused attempt maps and touches nothing.
    assert_eq!(unsafe { d.map_user(p, 4096) }, Err(DmaError::MapFailed));
    assert!(nothing(&t, &d));
    t.state().fail.clear();
    // Over the locked-memory limit.
    t.state().pin_limit = Some(4096);
    // SAFETY: `v` outlives every mapping; a refused attempt maps and touches nothing.
    assert_eq!(unsafe { d.map_user(p, 8192) }, Err(DmaError::NoMemory { len: 8192 }));
    assert!(nothing(&t, &d));
    t.state().pin_limit = None;
    // Memory the kernel cannot pin.
    let stray = NonNull::new(0x7000_0000_0000usize as *mut u8).unwrap();
    // SAFETY: `v` outlives every mapping; a refused attempt maps and touches nothing.
    assert!(matches!(unsafe { d.map_user(stray, 64) }, Err(DmaError::Unreachable { .. })));
    assert!(nothing(&t, &d));
    // Memory the allocator made is already reachable.
    let a = d.alloc(4096, 4096).unwrap();
    // SAFETY: `v` outlives every mapping; a refused attempt maps and touches nothing.
    assert!(matches!(unsafe { d.map_user(a.cpu(), 16) }, Err(DmaError::Unreachable { .. })));
    // SAFETY: from `d`, freed once, never given to a device.
    unsafe { d.free(a) };
    // After all that, the whole IOVA space is still free: a mapping gets its first chunk.
    // SAFETY: `v` outlives every mapping; a refused attempt maps and touches nothing.
    let r = unsafe { d.map_user(p, 4096) }.unwrap();
    assert_eq!(r.iova(), CHUNK as u64);
    // A failed unmap keeps the IOVA reserved: it may still translate.
    t.state().fail.insert("UNMAP_DMA", libc::EINVAL);
    // SAFETY: from `d`, freed once.
    unsafe { d.free(r) };
    t.state().fail.clear();
    assert_eq!(t.state().maps.len(), 1);
    // SAFETY: `v` outlives every mapping; a refused attempt maps and touches nothing.
    assert!(matches!(unsafe { d.map_user(p, 4096) }, Err(DmaError::Unreachable { .. })), "no IOVA left");
    drop(v);
}

#[test]
fn the_twin_refuses_dma_ioctls_whose_argsz_is_short() {
    let t = twin();
    let (_dev, _d) = dma(&t, DmaOptions::default());
    let container_fd = t.state().open_container().expect("a container is open");
    for (req, len) in [
        (abi::VFIO_IOMMU_MAP_DMA, std::mem::size_of::<abi::vfio_iommu_type1_dma_map>()),
        (abi::VFIO_IOMMU_UNMAP_DMA, std::mem::size_of::<abi::vfio_iommu_type1_dma_unmap>()),
    ] {
        let mut b = with_argsz(len, len as u32 - 8);
        // SAFETY: both requests take an argsz-led buffer; the twin touches no memory.
        let e = unsafe { t.ioctl(container_fd, req, sys::Arg::Buf(&mut b)) }.unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    }
    assert!(t.state().maps.is_empty());
}

/// Dropping the allocator with regions still live takes every mapping away from the device, but keeps the CPU
/// memory of the chunks those regions live in: a `DmaRegion` promises its memory until it is freed. Chunks with
/// no live region go back to the kernel.
#[test]
fn dropping_the_allocator_unmaps_everything_from_the_device_and_keeps_live_memory() {
    let t = twin();
    let (dev, d) = dma(&t, DmaOptions::default());
    let leak = d.alloc(100, 64).unwrap();
    let leak2 = d.alloc(3 << 20, 4096).unwrap();
    let gone = d.alloc(3 << 20, 4096).unwrap();
    // SAFETY: from d, freed once, never given to a device.
    unsafe { d.free(gone) };
    assert_eq!(t.state().maps.len(), 2);
    assert_eq!(t.state().anon.len(), 2);
    drop(d);
    assert!(t.state().maps.is_empty());
    assert_eq!(t.state().anon.len(), 2, "the chunks of live regions keep their memory");
    leak.write_volatile_u8(99, 0x5a);
    assert_eq!(leak.read_volatile_u8(99), 0x5a);
    leak2.zero(0, 3 << 20);
    drop(dev);
    assert_eq!(t.open_fds(), 0);
}

#[test]
fn interrupts_wake_a_waiter() {
    let t = twin();
    let dev = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap();
    let irqs = Interrupts::enable(&dev, 4).unwrap();
    assert_eq!(irqs.kind(), IrqKind::Msix);
    assert_eq!(irqs.count(), 4);
    assert_eq!(t.state().devices[MLX].irq_fds.len(), 4);
    assert_eq!(irqs.wait(2, Duration::from_millis(20)).unwrap(), 0, "nothing fired: timeout");
    let t2 = t.clone();
    let firer = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(30));
        t2.fire(MLX, 2)
    });
    assert_eq!(irqs.wait_any(Duration::from_secs(5)).unwrap(), Some((2, 1)));
    assert!(firer.join().unwrap());
    // Two interrupts before the wait are one wakeup with a count of two; none is lost.
    t.fire(MLX, 0);
    t.fire(MLX, 0);
    assert_eq!(irqs.wait(0, Duration::ZERO).unwrap(), 2);
    assert!(irqs.wait(9, Duration::ZERO).is_err());
    drop(irqs);
    assert!(t.state().devices[MLX].irq_fds.is_empty(), "vectors disabled on drop");
    drop(dev);
    assert_eq!(t.open_fds(), 0, "eventfds closed");
}

#[test]
fn functions_without_msix_use_msi() {
    let t = twin();
    t.add_device("0000:00:04.0", 0x1234, 0x11e8, 3, Some("vfio-pci"), 1 << 20);
    let dev = VfioDevice::open_with(sys(&t), bdf("00:04.0")).unwrap();
    let irqs = Interrupts::enable(&dev, 8).unwrap();
    assert_eq!((irqs.kind(), irqs.count()), (IrqKind::Msi, 1));
    assert_eq!(t.state().devices["0000:00:04.0"].irq_index, Some(abi::VFIO_PCI_MSI_IRQ_INDEX));
    let e = Interrupts::enable_kind(&dev, IrqKind::Msix, 1).unwrap_err();
    assert_eq!(e.to_string(), "0000:00:04.0 has no MSI-X interrupts");
    drop(irqs);
    t.state().fail.insert("SET_IRQS", libc::EINVAL);
    let e = Interrupts::enable(&dev, 1).unwrap_err();
    assert!(e.to_string().starts_with("failed to enable 1 MSI vectors"), "{e}");
    t.state().fail.clear();
    drop(dev);
    assert_eq!(t.open_fds(), 0, "eventfds of the failed enable closed");
}

#[test]
fn vfio_bundle_stops_bus_mastering_before_unmapping() {
    let t = twin();
    let v = Vfio::open_with(sys(&t), bdf(MLX), VfioOptions::default()).unwrap();
    assert!(v.device.bus_master().unwrap(), "open enables bus mastering");
    let _r = v.dma.alloc(4096, 4096).unwrap();
    t.state().log.clear();
    drop(v);
    let log = t.state().log.clone();
    let bm_off = log.iter().position(|l| l.starts_with("pwrite config 0x4")).expect("bus master cleared");
    let unmap = log.iter().position(|l| l.ends_with(&format!("{:#x}", abi::VFIO_IOMMU_UNMAP_DMA))).expect("unmapped");
    assert!(bm_off < unmap, "{log:?}");
    assert!(t.state().maps.is_empty());
    assert_eq!(t.open_fds(), 0);
}

#[test]
fn bind_moves_a_connectx_to_vfio_and_back() {
    let t = twin();
    t.state().devices.get_mut(MLX).unwrap().driver = Some("mlx5_core".into());
    let s = sys(&t);
    assert_eq!(
        bind::bind(&*s, bdf(MLX), Some(bind::MELLANOX_VENDOR_ID)).unwrap(),
        bind::Bound::From(Some("mlx5_core".into()))
    );
    assert_eq!(bind::driver(&*s, bdf(MLX)).as_deref(), Some("vfio-pci"));
    let writes: Vec<String> = t.state().log.iter().filter(|l| l.starts_with("write")).cloned().collect();
    assert_eq!(
        writes,
        vec![
            "write /sys/bus/pci/devices/0000:03:00.0/driver_override \"vfio-pci\"",
            "write /sys/bus/pci/devices/0000:03:00.0/driver/unbind \"0000:03:00.0\"",
            "write /sys/bus/pci/drivers_probe \"0000:03:00.0\"",
        ]
    );
    assert_eq!(bind::bind(&*s, bdf(MLX), Some(bind::MELLANOX_VENDOR_ID)).unwrap(), bind::Bound::AlreadyBound);
    assert_eq!(bind::find(&*s, bind::MELLANOX_VENDOR_ID, None), vec![bdf(MLX)]);
    assert_eq!(bind::unbind(&*s, bdf(MLX)).unwrap().as_deref(), Some("mlx5_core"));
    assert_eq!(t.state().devices[MLX].driver_override, None, "override cleared");
}

#[test]
fn bind_errors_name_the_cause() {
    let t = twin();
    t.add_device("0000:00:04.0", 0x8086, 0x100e, 3, Some("e1000"), 4096);
    let s = sys(&t);
    let mlx = Some(bind::MELLANOX_VENDOR_ID);
    let e = bind::bind(&*s, bdf("00:04.0"), mlx).unwrap_err();
    assert_eq!(e.to_string(), "0000:00:04.0 is not a Mellanox device (vendor 0x8086, expected 0x15b3)");
    assert!(matches!(bind::bind(&*s, bdf("00:09.0"), mlx), Err(VfioError::NoSuchDevice(_))));
    t.state().devices.get_mut(MLX).unwrap().driver = Some("mlx5_core".into());
    t.state().devices.get_mut(MLX).unwrap().busy = true;
    assert!(matches!(bind::bind(&*s, bdf(MLX), mlx), Err(VfioError::Busy(_))));
    t.state().devices.get_mut(MLX).unwrap().busy = false;
    t.state().iommu = false;
    assert!(matches!(bind::bind(&*s, bdf(MLX), mlx), Err(VfioError::NoIommuGroup(_))));
    t.state().iommu = true;
    t.state().vfio_loaded = false;
    assert_eq!(
        bind::bind(&*s, bdf(MLX), mlx).unwrap_err().to_string(),
        "the vfio-pci driver is not loaded (modprobe vfio-pci)"
    );
    t.state().vfio_loaded = true;
    t.state().euid = 1000;
    assert_eq!(
        bind::bind(&*s, bdf(MLX), mlx).unwrap_err().to_string(),
        "binding a device to vfio-pci needs root (effective uid 0)"
    );
    assert!(matches!(bind::unbind(&*s, bdf(MLX)), Err(VfioError::NotRoot(_))));
    t.state().euid = 0;
    assert!(matches!(bind::unbind(&*s, bdf(MLX)), Err(VfioError::Bind { .. })), "not ours to unbind");
}

/// An argsz-led buffer claiming `argsz` bytes.
fn with_argsz(len: usize, argsz: u32) -> Vec<u8> {
    let mut b = vec![0u8; len];
    if let Some(a) = b.first_chunk_mut::<4>() {
        *a = argsz.to_ne_bytes();
    }
    b
}

fn argsz_error(e: &std::io::Error) -> Option<sys::ArgszError> {
    e.get_ref()?.downcast_ref::<sys::ArgszError>().copied()
}

#[test]
fn argsz_check_refuses_a_buffer_that_claims_more_than_it_has() {
    let len = std::mem::size_of::<abi::vfio_device_info>();
    assert_eq!(Arg::Buf(&mut with_argsz(len, len as u32)).check(), Ok(()));
    assert_eq!(Arg::Buf(&mut with_argsz(len, 4)).check(), Ok(()), "a smaller argsz is the kernel's to refuse");
    assert_eq!(
        Arg::Buf(&mut with_argsz(len, len as u32 + 1)).check(),
        Err(sys::ArgszError { argsz: Some(len as u32 + 1), len })
    );
    assert_eq!(Arg::Buf(&mut with_argsz(len, u32::MAX)).check(), Err(sys::ArgszError { argsz: Some(u32::MAX), len }));
    assert_eq!(Arg::Buf(&mut [0u8; 3]).check(), Err(sys::ArgszError { argsz: None, len: 3 }));
    assert_eq!(Arg::Buf(&mut []).check(), Err(sys::ArgszError { argsz: None, len: 0 }));
    assert_eq!(Arg::Int(u64::MAX).check(), Ok(()));
    assert_eq!(
        sys::ArgszError { argsz: Some(4096), len: 24 }.to_string(),
        "ioctl argsz 4096 exceeds its 24-byte buffer"
    );
}

#[test]
fn the_real_seam_refuses_a_lying_argsz_before_the_syscall() {
    let len = std::mem::size_of::<abi::vfio_device_info>();
    let mut lying = with_argsz(len, 4096);
    // SAFETY: VFIO_DEVICE_GET_INFO takes an argsz-led vfio_device_info; fd -1 is no descriptor at all.
    let e = unsafe { sys::LinuxSys.ioctl(-1, abi::VFIO_DEVICE_GET_INFO, Arg::Buf(&mut lying)) }.unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
    assert_eq!(argsz_error(&e), Some(sys::ArgszError { argsz: Some(4096), len }));
    assert!(lying[4..].iter().all(|&b| b == 0), "nothing was written");
    // An honest buffer passes the check and reaches the kernel, which refuses the bad descriptor.
    let mut honest = with_argsz(len, len as u32);
    // SAFETY: as above.
    let e = unsafe { sys::LinuxSys.ioctl(-1, abi::VFIO_DEVICE_GET_INFO, Arg::Buf(&mut honest)) }.unwrap_err();
    assert_eq!(e.raw_os_error(), Some(libc::EBADF));
    assert_eq!(argsz_error(&e), None);
}

#[test]
fn the_twin_refuses_a_lying_argsz_as_the_real_seam_does() {
    let t = twin();
    let dev = VfioDevice::open_with(sys(&t), bdf(MLX)).unwrap();
    let fd = dev.fd().raw();
    let calls = t.state().log.len();
    let len = std::mem::size_of::<abi::vfio_device_info>();
    let mut lying = with_argsz(len, len as u32 + 8);
    // SAFETY: VFIO_DEVICE_GET_INFO on the device fd takes an argsz-led vfio_device_info.
    let e = unsafe { t.ioctl(fd, abi::VFIO_DEVICE_GET_INFO, Arg::Buf(&mut lying)) }.unwrap_err();
    assert_eq!(argsz_error(&e), Some(sys::ArgszError { argsz: Some(len as u32 + 8), len }));
    assert_eq!(t.state().log.len(), calls, "the refused call never reached the twin kernel");
    assert!(lying[4..].iter().all(|&b| b == 0), "nothing was written");
    let mut honest = with_argsz(len, len as u32);
    // SAFETY: as above.
    unsafe { t.ioctl(fd, abi::VFIO_DEVICE_GET_INFO, Arg::Buf(&mut honest)) }.unwrap();
    assert_eq!(abi::vfio_device_info::read_from(&honest).num_regions, 9);
}

/// IOVA = PA: a page never touched is not present, so it has no physical address to give a device; a touched
/// one has one (as root) or the pagemap hides it (not root): never a made-up address.
#[test]
fn physical_address_needs_a_present_page_and_names_why_not() {
    use crate::dma::physical_address;
    // SAFETY: a fresh private anonymous mapping of two pages, unmapped below.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            8192,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(p, libc::MAP_FAILED);
    let a = p as usize;
    let e = physical_address(a, 4096).unwrap_err().to_string();
    assert!(e.contains("not present"), "{e}");
    // SAFETY: inside the mapping.
    unsafe { (p as *mut u8).add(100).write_volatile(1) };
    match physical_address(a + 100, 1) {
        Ok(pa) => assert_eq!(pa % 4096, 100),
        Err(e) => assert!(e.to_string().contains("CAP_SYS_ADMIN"), "{e}"),
    }
    // SAFETY: the mapping made above, unused now.
    unsafe { libc::munmap(p, 8192) };
}
