//! `vfio-edu-test`: the VFIO layer of `mlx5-vfio` against the real Linux VFIO stack, with QEMU's `edu` PCI device
//! (vendor 0x1234, device 0x11e8: a DMA engine, MSI, a 4 KiB device buffer at DMA address 0x40000) standing in
//! for a ConnectX. `cargo xtask vfio-test` boots a guest with an emulated IOMMU and runs this as its only program;
//! it can also be run by hand on any machine with an `edu` device and the vfio-pci module loaded.
//!
//! Every property is checked against what the device did, not what the driver believes: bytes are compared after
//! DMA in both directions, the interrupt must arrive on the eventfd, and the IOMMU and the bus-master bit must
//! each stop a DMA that a positive control shows would otherwise happen. Exit status 0 only if every check passes.

use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

use mlx5_core::hal::{Dma, DmaRegion, Mmio};
use mlx5_vfio::dma::{Backing, DmaOptions, VfioDma};
use mlx5_vfio::irq::{Interrupts, IrqKind};
use mlx5_vfio::sys::{LinuxSys, Sys};
use mlx5_vfio::{bind, Bar, Bdf, VfioDevice, VfioError};

const EDU_VENDOR: u16 = 0x1234;
const EDU_DEVICE: u16 = 0x11e8;
const EDU_ID: usize = 0x00;
const EDU_LIVENESS: usize = 0x04;
const EDU_IRQ_STATUS: usize = 0x24;
const EDU_IRQ_RAISE: usize = 0x60;
const EDU_IRQ_ACK: usize = 0x64;
const EDU_DMA_SRC: usize = 0x80;
const EDU_DMA_DST: usize = 0x88;
const EDU_DMA_CNT: usize = 0x90;
const EDU_DMA_CMD: usize = 0x98;
const EDU_DMA_IRQ: u32 = 0x100;
/// The device's own buffer, as its DMA engine addresses it.
const EDU_BUF: u64 = 0x40000;
/// QEMU 7.2 aborts on a transfer of the whole 4096-byte buffer; one byte less covers it all but the last.
const LEN: usize = 4095;
/// edu's default DMA mask is 28 bits.
const EDU_MAX_IOVA: u64 = (1 << 28) - 1;
/// An IOVA well above what the allocator hands out first, for the hand-mapped buffer.
const SPARE_IOVA: u64 = 0x0f00_0000;

/// edu's registers are little endian; the crate's `Mmio` is big endian (mlx5's convention), so swap here. The
/// accesses still go through `Bar`'s volatile loads and stores.
struct Edu<'a>(&'a Bar);

impl Edu<'_> {
    fn r32(&self, off: usize) -> u32 {
        self.0.read32(off).swap_bytes()
    }
    fn w32(&self, off: usize, v: u32) {
        self.0.write32(off, v.swap_bytes())
    }
    fn w64(&self, off: usize, v: u64) {
        self.0.write64(off, v.swap_bytes())
    }

    /// Runs one DMA and waits for the engine to finish (edu takes about 100 ms of guest time per transfer).
    fn dma(&self, src: u64, dst: u64, len: usize, to_ram: bool, irq: bool) -> Result<(), String> {
        self.w64(EDU_DMA_SRC, src);
        self.w64(EDU_DMA_DST, dst);
        self.w64(EDU_DMA_CNT, len as u64);
        self.w64(EDU_DMA_CMD, 1 | (to_ram as u64) << 1 | (irq as u64) << 2);
        let start = Instant::now();
        while self.r32(EDU_DMA_CMD) & 1 != 0 {
            if start.elapsed() > Duration::from_secs(20) {
                return Err("edu DMA did not finish in 20 s".into());
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        Ok(())
    }

    fn to_device(&self, iova: u64) -> Result<(), String> {
        self.dma(iova, EDU_BUF, LEN, false, false)
    }

    fn to_ram(&self, iova: u64) -> Result<(), String> {
        self.dma(EDU_BUF, iova, LEN, true, false)
    }
}

/// Copies `data` into the start of a region.
fn put(r: &DmaRegion, data: &[u8]) {
    assert!(data.len() <= r.len());
    // SAFETY: r is a live region of at least data.len() bytes; the device touches it only during the DMAs this
    // test starts and waits for.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), r.cpu().as_ptr(), data.len()) }
}

/// The first LEN bytes of a region.
fn get(r: &DmaRegion) -> Vec<u8> {
    let mut v = vec![0; LEN];
    // SAFETY: r is a live region of at least LEN bytes (every region here is allocated with LEN or more).
    unsafe { std::ptr::copy_nonoverlapping(r.cpu().as_ptr(), v.as_mut_ptr(), LEN) };
    v
}

fn pattern(seed: u8) -> Vec<u8> {
    (0..LEN).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) | 1).collect()
}

fn hugepages_free() -> Option<u64> {
    let m = std::fs::read_to_string("/proc/meminfo").ok()?;
    m.lines().find_map(|l| l.strip_prefix("HugePages_Free:")).and_then(|v| v.trim().parse().ok())
}

struct Report {
    passed: u32,
    failed: u32,
}

impl Report {
    fn check(&mut self, name: &str, r: Result<String, String>) {
        let n = self.passed + self.failed + 1;
        match r {
            Ok(detail) => {
                self.passed += 1;
                println!("ok {n} - {name}{}", if detail.is_empty() { String::new() } else { format!(": {detail}") });
            }
            Err(why) => {
                self.failed += 1;
                println!("not ok {n} - {name}: {why}");
            }
        }
    }
}

fn ensure(cond: bool, why: impl FnOnce() -> String) -> Result<(), String> {
    if cond {
        Ok(())
    } else {
        Err(why())
    }
}

/// A round trip RAM → edu → RAM through two regions of `dma`, bytes compared.
fn round_trip(edu: &Edu, dma: &VfioDma, seed: u8) -> Result<String, String> {
    let src = dma.alloc(LEN, 4096).map_err(|e| e.to_string())?;
    let dst = dma.alloc(LEN, 4096).map_err(|e| e.to_string())?;
    let p = pattern(seed);
    put(&src, &p);
    let r = edu.to_device(src.iova()).and_then(|_| edu.to_ram(dst.iova()));
    let same = get(&dst) == p;
    let detail = format!("src IOVA {:#x}, dst IOVA {:#x}, {:?}", src.iova(), dst.iova(), dma.backing());
    // SAFETY: the DMAs above have completed; the device no longer touches either region.
    unsafe {
        dma.free(src);
        dma.free(dst);
    }
    r?;
    ensure(same, || format!("bytes differ after RAM -> device -> RAM ({detail})"))?;
    Ok(detail)
}

fn run(rep: &mut Report) -> Result<(), String> {
    let sys: Arc<dyn Sys> = Arc::new(LinuxSys);
    let found = bind::find(&*sys, EDU_VENDOR, Some(EDU_DEVICE));
    let bdf: Bdf = *found.first().ok_or("no edu device (1234:11e8) on this machine")?;
    rep.check("find the edu device in sysfs", Ok(bdf.to_string()));

    let refused = bind::bind(&*sys, bdf, Some(bind::MELLANOX_VENDOR_ID));
    rep.check(
        "bind refuses a non-Mellanox device when asked for one",
        match refused {
            Err(e @ VfioError::NotMellanox { .. }) => Ok(e.to_string()),
            other => Err(format!("{other:?}")),
        },
    );
    let bound = bind::bind(&*sys, bdf, None).map_err(|e| e.to_string())?;
    rep.check(
        "bind to vfio-pci (driver_override + drivers_probe)",
        ensure(bind::driver(&*sys, bdf).as_deref() == Some("vfio-pci"), || "not bound".into())
            .map(|_| format!("{bound:?}")),
    );

    let dev = VfioDevice::open_with(sys.clone(), bdf).map_err(|e| e.to_string())?;
    let c = dev.container();
    rep.check(
        "open: container, type1v2 IOMMU, group, device fd",
        Ok(format!("group {}, IOVA ranges {:x?}, page sizes {:#x}", dev.group_id(), c.iova_ranges, c.iova_pgsizes)),
    );
    let ids = dev.pci_ids().map_err(|e| e.to_string())?;
    rep.check(
        "config space through the device fd",
        ensure(ids.vendor == EDU_VENDOR && ids.device == EDU_DEVICE, || format!("{ids:?}"))
            .map(|_| format!("{:04x}:{:04x}", ids.vendor, ids.device)),
    );

    let bar = dev.map_bar(0).map_err(|e| e.to_string())?;
    let edu = Edu(&bar);
    let id = edu.r32(EDU_ID);
    rep.check(
        "BAR0 mmap: edu id register",
        ensure(id == 0x0100_00ed, || format!("id {id:#x}")).map(|_| format!("{id:#010x}")),
    );
    edu.w32(EDU_LIVENESS, 0x1234_5678);
    let live = edu.r32(EDU_LIVENESS);
    rep.check(
        "BAR0 mmap: write then read the liveness register",
        ensure(live == !0x1234_5678u32, || format!("read {live:#x}")).map(|_| format!("{live:#010x}")),
    );

    let was_on = dev.bus_master().map_err(|e| e.to_string())?;
    dev.set_bus_master(true).map_err(|e| e.to_string())?;
    let on = dev.bus_master().map_err(|e| e.to_string())?;
    rep.check("bus master enable in config space", ensure(on, || "still off".into()).map(|_| format!("was {was_on}")));

    let huge_before = hugepages_free();
    {
        let dma = VfioDma::new(c.clone(), DmaOptions { max_iova: EDU_MAX_IOVA, ..DmaOptions::default() });
        let r = round_trip(&edu, &dma, 7);
        rep.check(
            "DMA both ways through the allocator, 2 MiB hugepages",
            r.and_then(|d| ensure(d.contains("Huge2M"), || format!("not hugepage-backed: {d}")).map(|_| d)),
        );
        rep.check(
            "allocator returns every region and chunk",
            ensure(dma.outstanding() == (0, 0) && dma.chunks() == 0, || format!("{:?}", dma.outstanding()))
                .map(|_| format!("chunks mapped/unmapped {:?}", dma.map_counts())),
        );
    }
    rep.check(
        "hugepages given back",
        ensure(hugepages_free() == huge_before, || format!("{huge_before:?} -> {:?}", hugepages_free()))
            .map(|_| format!("HugePages_Free {huge_before:?}")),
    );
    {
        let dma =
            VfioDma::new(c.clone(), DmaOptions { hugepages: false, max_iova: EDU_MAX_IOVA, ..DmaOptions::default() });
        let r = round_trip(&edu, &dma, 11);
        rep.check(
            "DMA both ways through the allocator, 4 KiB pages",
            r.and_then(|d| ensure(dma.backing() != Backing::Huge2M && d.contains("Pages4K"), || d.clone()).map(|_| d)),
        );
    }

    // MSI: edu has one MSI vector and no MSI-X.
    let irqs = Interrupts::enable(&dev, 1).map_err(|e| e.to_string())?;
    let quiet = irqs.wait(0, Duration::from_millis(200)).map_err(|e| e.to_string())?;
    rep.check(
        "no interrupt before one is raised",
        ensure(quiet == 0, || format!("{quiet} spurious")).map(|_| String::new()),
    );
    edu.w32(EDU_IRQ_RAISE, 0x5a);
    let n = irqs.wait(0, Duration::from_secs(10)).map_err(|e| e.to_string())?;
    let status = edu.r32(EDU_IRQ_STATUS);
    edu.w32(EDU_IRQ_ACK, status);
    rep.check(
        "MSI delivered to the eventfd",
        ensure(irqs.kind() == IrqKind::Msi && n >= 1 && status == 0x5a, || format!("count {n}, status {status:#x}"))
            .map(|_| format!("{} vector, count {n}", irqs.kind().name())),
    );
    {
        let dma = VfioDma::new(c.clone(), DmaOptions { max_iova: EDU_MAX_IOVA, ..DmaOptions::default() });
        let r = dma.alloc(LEN, 4096).map_err(|e| e.to_string())?;
        let res = edu.dma(r.iova(), EDU_BUF, LEN, false, true).and_then(|_| {
            let n = irqs.wait(0, Duration::from_secs(10)).map_err(|e| e.to_string())?;
            let status = edu.r32(EDU_IRQ_STATUS);
            edu.w32(EDU_IRQ_ACK, status);
            ensure(n >= 1 && status & EDU_DMA_IRQ != 0, || format!("count {n}, status {status:#x}"))
                .map(|_| format!("status {status:#x}"))
        });
        rep.check("DMA-completion interrupt delivered to the eventfd", res);
        // SAFETY: the DMA has completed.
        unsafe { dma.free(r) };
    }
    drop(irqs);

    // The IOMMU blocks a device write to an IOVA the crate has unmapped. The buffer is mapped by hand so the CPU
    // side stays readable after the unmap.
    let spare = sys.mmap_anon(4096, false).map_err(|e| e.to_string())?;
    // SAFETY: spare is a live 4096-byte mapping owned here until the munmap below.
    let spare_bytes = unsafe { std::slice::from_raw_parts_mut(spare.as_ptr(), 4096) };
    let p = pattern(23);
    let dma = VfioDma::new(c.clone(), DmaOptions { max_iova: EDU_MAX_IOVA, ..DmaOptions::default() });
    let src = dma.alloc(LEN, 4096).map_err(|e| e.to_string())?;
    put(&src, &p);
    edu.to_device(src.iova())?;
    // SAFETY: spare stays mapped until the munmap below, which comes after the unmap_dma (an early return leaves
    // it mapped for good), and nothing else uses that memory.
    unsafe { c.map_dma(spare.as_ptr() as u64, SPARE_IOVA, 4096) }.map_err(|e| e.to_string())?;
    spare_bytes.fill(0x11);
    edu.to_ram(SPARE_IOVA)?;
    let control = spare_bytes[..LEN] == p[..];
    let unmapped = c.unmap_dma(SPARE_IOVA, 4096).map_err(|e| e.to_string())?;
    spare_bytes.fill(0x11);
    edu.to_ram(SPARE_IOVA)?;
    let untouched = spare_bytes.iter().all(|&b| b == 0x11);
    rep.check(
        "IOMMU blocks a device write to an unmapped IOVA",
        ensure(control && unmapped == 4096 && untouched, || {
            format!("control write landed: {control}, unmapped {unmapped}, memory untouched after unmap: {untouched}")
        })
        .map(|_| format!("IOVA {SPARE_IOVA:#x}: written while mapped, untouched after unmap")),
    );
    // And a device read from an IOVA the allocator freed (its chunk unmapped) brings none of the old data in.
    let secret = dma.alloc(LEN, 4096).map_err(|e| e.to_string())?;
    let secret_iova = secret.iova();
    put(&secret, &[0x33; LEN]);
    let chunks_before = dma.chunks();
    // SAFETY: the device has not been told about this region.
    unsafe { dma.free(secret) };
    let dst = dma.alloc(LEN, 4096).map_err(|e| e.to_string())?;
    let read_blocked = (|| -> Result<String, String> {
        // The freed region shared its chunk with `src`, so use a region alone in its own chunk.
        // Preload the device buffer with a byte the freed memory does not hold.
        put(&dst, &[0x55; LEN]);
        edu.to_device(dst.iova())?;
        let lone = dma.alloc(2 << 20, 2 << 20).map_err(|e| e.to_string())?;
        let lone_iova = lone.iova();
        put(&lone, &[0x33; LEN]);
        // SAFETY: the device has not been told about this region.
        unsafe { dma.free(lone) };
        edu.to_device(lone_iova)?;
        edu.to_ram(dst.iova())?;
        let leaked = get(&dst).iter().filter(|&&b| b == 0x33).count();
        ensure(leaked == 0, || format!("{leaked} bytes of freed memory reached the device"))?;
        Ok(format!("freed IOVA {lone_iova:#x} (and {secret_iova:#x}, chunks {chunks_before}) unreadable"))
    })();
    rep.check("IOMMU blocks a device read from an IOVA the allocator freed", read_blocked);

    // Bus master off: the same DMA does nothing; back on, it works again.
    put(&dst, &[0x44; LEN]);
    dev.set_bus_master(false).map_err(|e| e.to_string())?;
    edu.to_ram(dst.iova())?;
    let off_untouched = get(&dst).iter().all(|&b| b == 0x44);
    dev.set_bus_master(true).map_err(|e| e.to_string())?;
    edu.to_device(src.iova())?;
    edu.to_ram(dst.iova())?;
    let on_works = get(&dst) == p;
    rep.check(
        "bus master off blocks DMA (and on again restores it)",
        ensure(off_untouched && on_works, || format!("untouched while off: {off_untouched}, works again: {on_works}"))
            .map(|_| String::new()),
    );
    // SAFETY: every DMA has completed.
    unsafe {
        dma.free(src);
        dma.free(dst);
        sys.munmap(spare, 4096);
    }
    rep.check(
        "teardown: nothing left allocated",
        ensure(dma.outstanding() == (0, 0) && dma.chunks() == 0, || format!("{:?}", dma.outstanding()))
            .map(|_| String::new()),
    );
    drop(dma);
    drop(bar);
    drop(dev);
    let unbound = bind::unbind(&*sys, bdf).map_err(|e| e.to_string())?;
    rep.check("unbind from vfio-pci", ensure(unbound.is_none(), || format!("now {unbound:?}")).map(|_| String::new()));
    Ok(())
}

fn main() -> ExitCode {
    let mut rep = Report { passed: 0, failed: 0 };
    if let Err(e) = run(&mut rep) {
        rep.failed += 1;
        println!("not ok - aborted: {e}");
    }
    println!("vfio-edu-test: {} passed, {} failed", rep.passed, rep.failed);
    if rep.failed == 0 && rep.passed > 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
