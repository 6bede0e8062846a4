//! The VFIO user ABI (`include/uapi/linux/vfio.h`) that this crate uses: request numbers, flags and the argument
//! structures, `#[repr(C)]` as the header declares them. Field offsets are taken with `offset_of!`, never typed by
//! hand, and a test compiles a C program against the system's `<linux/vfio.h>` and compares every size and offset.

use core::mem::{offset_of, size_of};

/// `VFIO_API_VERSION`: the only version the container interface has ever reported.
pub const VFIO_API_VERSION: i32 = 0;
/// `VFIO_TYPE1v2_IOMMU`: the type1 IOMMU backend with v2 unmap semantics (unmap exactly what was mapped).
pub const VFIO_TYPE1V2_IOMMU: u64 = 3;

const VFIO_TYPE: u64 = b';' as u64;
const VFIO_BASE: u64 = 100;

/// `_IO(VFIO_TYPE, VFIO_BASE + n)`: every VFIO request is encoded without size or direction bits.
const fn vfio_io(n: u64) -> u64 {
    (VFIO_TYPE << 8) | (VFIO_BASE + n)
}

pub const VFIO_GET_API_VERSION: u64 = vfio_io(0);
pub const VFIO_CHECK_EXTENSION: u64 = vfio_io(1);
pub const VFIO_SET_IOMMU: u64 = vfio_io(2);
pub const VFIO_GROUP_GET_STATUS: u64 = vfio_io(3);
pub const VFIO_GROUP_SET_CONTAINER: u64 = vfio_io(4);
pub const VFIO_GROUP_UNSET_CONTAINER: u64 = vfio_io(5);
pub const VFIO_GROUP_GET_DEVICE_FD: u64 = vfio_io(6);
pub const VFIO_DEVICE_GET_INFO: u64 = vfio_io(7);
pub const VFIO_DEVICE_GET_REGION_INFO: u64 = vfio_io(8);
pub const VFIO_DEVICE_GET_IRQ_INFO: u64 = vfio_io(9);
pub const VFIO_DEVICE_SET_IRQS: u64 = vfio_io(10);
pub const VFIO_DEVICE_RESET: u64 = vfio_io(11);
pub const VFIO_IOMMU_GET_INFO: u64 = vfio_io(12);
pub const VFIO_IOMMU_MAP_DMA: u64 = vfio_io(13);
pub const VFIO_IOMMU_UNMAP_DMA: u64 = vfio_io(14);

pub const VFIO_GROUP_FLAGS_VIABLE: u32 = 1 << 0;
pub const VFIO_GROUP_FLAGS_CONTAINER_SET: u32 = 1 << 1;

pub const VFIO_DEVICE_FLAGS_RESET: u32 = 1 << 0;
pub const VFIO_DEVICE_FLAGS_PCI: u32 = 1 << 1;

pub const VFIO_REGION_INFO_FLAG_READ: u32 = 1 << 0;
pub const VFIO_REGION_INFO_FLAG_WRITE: u32 = 1 << 1;
pub const VFIO_REGION_INFO_FLAG_MMAP: u32 = 1 << 2;

pub const VFIO_IRQ_INFO_EVENTFD: u32 = 1 << 0;

pub const VFIO_IRQ_SET_DATA_NONE: u32 = 1 << 0;
pub const VFIO_IRQ_SET_DATA_EVENTFD: u32 = 1 << 2;
pub const VFIO_IRQ_SET_ACTION_TRIGGER: u32 = 1 << 5;

pub const VFIO_DMA_MAP_FLAG_READ: u32 = 1 << 0;
pub const VFIO_DMA_MAP_FLAG_WRITE: u32 = 1 << 1;

pub const VFIO_IOMMU_INFO_PGSIZES: u32 = 1 << 0;
pub const VFIO_IOMMU_INFO_CAPS: u32 = 1 << 1;
pub const VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE: u16 = 1;

/// vfio-pci's fixed region indexes (`VFIO_PCI_BAR0_REGION_INDEX` ...).
pub const VFIO_PCI_BAR0_REGION_INDEX: u32 = 0;
pub const VFIO_PCI_CONFIG_REGION_INDEX: u32 = 7;
/// vfio-pci's fixed interrupt indexes.
pub const VFIO_PCI_INTX_IRQ_INDEX: u32 = 0;
pub const VFIO_PCI_MSI_IRQ_INDEX: u32 = 1;
pub const VFIO_PCI_MSIX_IRQ_INDEX: u32 = 2;

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_group_status {
    pub argsz: u32,
    pub flags: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_device_info {
    pub argsz: u32,
    pub flags: u32,
    pub num_regions: u32,
    pub num_irqs: u32,
    pub cap_offset: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_region_info {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub cap_offset: u32,
    pub size: u64,
    pub offset: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_irq_info {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub count: u32,
}

/// Header of `struct vfio_irq_set`; `data[]` (one `__s32` eventfd per vector) follows it.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_irq_set {
    pub argsz: u32,
    pub flags: u32,
    pub index: u32,
    pub start: u32,
    pub count: u32,
}

/// Header of `struct vfio_iommu_type1_info`; capabilities follow at `cap_offset` when `VFIO_IOMMU_INFO_CAPS`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_iommu_type1_info {
    pub argsz: u32,
    pub flags: u32,
    pub iova_pgsizes: u64,
    pub cap_offset: u32,
    pub pad: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_info_cap_header {
    pub id: u16,
    pub version: u16,
    pub next: u32,
}

/// Header of `struct vfio_iommu_type1_info_cap_iova_range`; `nr_iovas` ranges follow.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_iommu_type1_info_cap_iova_range {
    pub header: vfio_info_cap_header,
    pub nr_iovas: u32,
    pub reserved: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_iova_range {
    pub start: u64,
    pub end: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_iommu_type1_dma_map {
    pub argsz: u32,
    pub flags: u32,
    pub vaddr: u64,
    pub iova: u64,
    pub size: u64,
}

/// Header of `struct vfio_iommu_type1_dma_unmap` (no dirty bitmap is ever requested).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct vfio_iommu_type1_dma_unmap {
    pub argsz: u32,
    pub flags: u32,
    pub iova: u64,
    pub size: u64,
}

/// A VFIO argument structure: plain integers, no padding that carries meaning, any bit pattern valid.
///
/// # Safety
/// Implementers are `#[repr(C)]` structs of integer fields (or of such structs), so every byte pattern is a valid
/// value and viewing them as bytes exposes no uninitialised padding the kernel would read as data.
pub unsafe trait Pod: Copy + Default {
    /// The bytes of `self`, as the kernel reads them.
    fn as_bytes(&self) -> &[u8] {
        // SAFETY: Self is Pod (integer fields, repr(C)); the slice covers exactly the value and lives as long as it.
        unsafe { core::slice::from_raw_parts((self as *const Self).cast::<u8>(), size_of::<Self>()) }
    }

    /// Reads a value from the start of `bytes` (unaligned; zero-extended when `bytes` is short).
    fn read_from(bytes: &[u8]) -> Self {
        let mut v = Self::default();
        let n = bytes.len().min(size_of::<Self>());
        // SAFETY: v is a Pod value of size_of::<Self>() bytes; n bytes fit in it and every bit pattern is valid.
        unsafe { core::ptr::copy_nonoverlapping(bytes.as_ptr(), (&mut v as *mut Self).cast::<u8>(), n) };
        v
    }
}

// SAFETY: each is repr(C) with only u16/u32/u64 fields (or Pod structs of them), laid out without hidden padding.
unsafe impl Pod for vfio_group_status {}
// SAFETY: as above.
unsafe impl Pod for vfio_device_info {}
// SAFETY: as above.
unsafe impl Pod for vfio_region_info {}
// SAFETY: as above.
unsafe impl Pod for vfio_irq_info {}
// SAFETY: as above.
unsafe impl Pod for vfio_irq_set {}
// SAFETY: as above (the explicit `pad` field makes the tail padding a field).
unsafe impl Pod for vfio_iommu_type1_info {}
// SAFETY: as above.
unsafe impl Pod for vfio_info_cap_header {}
// SAFETY: as above.
unsafe impl Pod for vfio_iommu_type1_info_cap_iova_range {}
// SAFETY: as above.
unsafe impl Pod for vfio_iova_range {}
// SAFETY: as above.
unsafe impl Pod for vfio_iommu_type1_dma_map {}
// SAFETY: as above.
unsafe impl Pod for vfio_iommu_type1_dma_unmap {}

/// A Pod value with its `argsz` set, as bytes ready for an ioctl.
pub fn arg_bytes<T: Pod>(v: &T) -> Vec<u8> {
    v.as_bytes().to_vec()
}

/// `(struct, field, offset)` for every field the crate uses, compared with the C header by the ABI test.
pub const LAYOUT: &[(&str, &str, usize)] = &[
    ("vfio_group_status", "flags", offset_of!(vfio_group_status, flags)),
    ("vfio_device_info", "flags", offset_of!(vfio_device_info, flags)),
    ("vfio_device_info", "num_regions", offset_of!(vfio_device_info, num_regions)),
    ("vfio_device_info", "num_irqs", offset_of!(vfio_device_info, num_irqs)),
    ("vfio_device_info", "cap_offset", offset_of!(vfio_device_info, cap_offset)),
    ("vfio_region_info", "flags", offset_of!(vfio_region_info, flags)),
    ("vfio_region_info", "index", offset_of!(vfio_region_info, index)),
    ("vfio_region_info", "size", offset_of!(vfio_region_info, size)),
    ("vfio_region_info", "offset", offset_of!(vfio_region_info, offset)),
    ("vfio_irq_info", "flags", offset_of!(vfio_irq_info, flags)),
    ("vfio_irq_info", "index", offset_of!(vfio_irq_info, index)),
    ("vfio_irq_info", "count", offset_of!(vfio_irq_info, count)),
    ("vfio_irq_set", "flags", offset_of!(vfio_irq_set, flags)),
    ("vfio_irq_set", "index", offset_of!(vfio_irq_set, index)),
    ("vfio_irq_set", "start", offset_of!(vfio_irq_set, start)),
    ("vfio_irq_set", "count", offset_of!(vfio_irq_set, count)),
    ("vfio_iommu_type1_info", "flags", offset_of!(vfio_iommu_type1_info, flags)),
    ("vfio_iommu_type1_info", "iova_pgsizes", offset_of!(vfio_iommu_type1_info, iova_pgsizes)),
    ("vfio_iommu_type1_info", "cap_offset", offset_of!(vfio_iommu_type1_info, cap_offset)),
    ("vfio_info_cap_header", "id", offset_of!(vfio_info_cap_header, id)),
    ("vfio_info_cap_header", "version", offset_of!(vfio_info_cap_header, version)),
    ("vfio_info_cap_header", "next", offset_of!(vfio_info_cap_header, next)),
    ("vfio_iommu_type1_info_cap_iova_range", "nr_iovas", offset_of!(vfio_iommu_type1_info_cap_iova_range, nr_iovas)),
    ("vfio_iova_range", "start", offset_of!(vfio_iova_range, start)),
    ("vfio_iova_range", "end", offset_of!(vfio_iova_range, end)),
    ("vfio_iommu_type1_dma_map", "flags", offset_of!(vfio_iommu_type1_dma_map, flags)),
    ("vfio_iommu_type1_dma_map", "vaddr", offset_of!(vfio_iommu_type1_dma_map, vaddr)),
    ("vfio_iommu_type1_dma_map", "iova", offset_of!(vfio_iommu_type1_dma_map, iova)),
    ("vfio_iommu_type1_dma_map", "size", offset_of!(vfio_iommu_type1_dma_map, size)),
    ("vfio_iommu_type1_dma_unmap", "flags", offset_of!(vfio_iommu_type1_dma_unmap, flags)),
    ("vfio_iommu_type1_dma_unmap", "iova", offset_of!(vfio_iommu_type1_dma_unmap, iova)),
    ("vfio_iommu_type1_dma_unmap", "size", offset_of!(vfio_iommu_type1_dma_unmap, size)),
];

/// `(struct, size)` for the ABI test.
pub const SIZES: &[(&str, usize)] = &[
    ("vfio_group_status", size_of::<vfio_group_status>()),
    ("vfio_device_info", size_of::<vfio_device_info>()),
    ("vfio_region_info", size_of::<vfio_region_info>()),
    ("vfio_irq_info", size_of::<vfio_irq_info>()),
    ("vfio_irq_set", size_of::<vfio_irq_set>()),
    ("vfio_iommu_type1_info", size_of::<vfio_iommu_type1_info>()),
    ("vfio_info_cap_header", size_of::<vfio_info_cap_header>()),
    ("vfio_iommu_type1_info_cap_iova_range", size_of::<vfio_iommu_type1_info_cap_iova_range>()),
    ("vfio_iova_range", size_of::<vfio_iova_range>()),
    ("vfio_iommu_type1_dma_map", size_of::<vfio_iommu_type1_dma_map>()),
    ("vfio_iommu_type1_dma_unmap", size_of::<vfio_iommu_type1_dma_unmap>()),
];

/// `(macro, value)` for the ABI test.
pub const CONSTANTS: &[(&str, u64)] = &[
    ("VFIO_API_VERSION", VFIO_API_VERSION as u64),
    ("VFIO_TYPE1v2_IOMMU", VFIO_TYPE1V2_IOMMU),
    ("VFIO_GET_API_VERSION", VFIO_GET_API_VERSION),
    ("VFIO_CHECK_EXTENSION", VFIO_CHECK_EXTENSION),
    ("VFIO_SET_IOMMU", VFIO_SET_IOMMU),
    ("VFIO_GROUP_GET_STATUS", VFIO_GROUP_GET_STATUS),
    ("VFIO_GROUP_SET_CONTAINER", VFIO_GROUP_SET_CONTAINER),
    ("VFIO_GROUP_UNSET_CONTAINER", VFIO_GROUP_UNSET_CONTAINER),
    ("VFIO_GROUP_GET_DEVICE_FD", VFIO_GROUP_GET_DEVICE_FD),
    ("VFIO_DEVICE_GET_INFO", VFIO_DEVICE_GET_INFO),
    ("VFIO_DEVICE_GET_REGION_INFO", VFIO_DEVICE_GET_REGION_INFO),
    ("VFIO_DEVICE_GET_IRQ_INFO", VFIO_DEVICE_GET_IRQ_INFO),
    ("VFIO_DEVICE_SET_IRQS", VFIO_DEVICE_SET_IRQS),
    ("VFIO_DEVICE_RESET", VFIO_DEVICE_RESET),
    ("VFIO_IOMMU_GET_INFO", VFIO_IOMMU_GET_INFO),
    ("VFIO_IOMMU_MAP_DMA", VFIO_IOMMU_MAP_DMA),
    ("VFIO_IOMMU_UNMAP_DMA", VFIO_IOMMU_UNMAP_DMA),
    ("VFIO_GROUP_FLAGS_VIABLE", VFIO_GROUP_FLAGS_VIABLE as u64),
    ("VFIO_GROUP_FLAGS_CONTAINER_SET", VFIO_GROUP_FLAGS_CONTAINER_SET as u64),
    ("VFIO_DEVICE_FLAGS_RESET", VFIO_DEVICE_FLAGS_RESET as u64),
    ("VFIO_DEVICE_FLAGS_PCI", VFIO_DEVICE_FLAGS_PCI as u64),
    ("VFIO_REGION_INFO_FLAG_READ", VFIO_REGION_INFO_FLAG_READ as u64),
    ("VFIO_REGION_INFO_FLAG_WRITE", VFIO_REGION_INFO_FLAG_WRITE as u64),
    ("VFIO_REGION_INFO_FLAG_MMAP", VFIO_REGION_INFO_FLAG_MMAP as u64),
    ("VFIO_IRQ_INFO_EVENTFD", VFIO_IRQ_INFO_EVENTFD as u64),
    ("VFIO_IRQ_SET_DATA_NONE", VFIO_IRQ_SET_DATA_NONE as u64),
    ("VFIO_IRQ_SET_DATA_EVENTFD", VFIO_IRQ_SET_DATA_EVENTFD as u64),
    ("VFIO_IRQ_SET_ACTION_TRIGGER", VFIO_IRQ_SET_ACTION_TRIGGER as u64),
    ("VFIO_DMA_MAP_FLAG_READ", VFIO_DMA_MAP_FLAG_READ as u64),
    ("VFIO_DMA_MAP_FLAG_WRITE", VFIO_DMA_MAP_FLAG_WRITE as u64),
    ("VFIO_IOMMU_INFO_PGSIZES", VFIO_IOMMU_INFO_PGSIZES as u64),
    ("VFIO_IOMMU_INFO_CAPS", VFIO_IOMMU_INFO_CAPS as u64),
    ("VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE", VFIO_IOMMU_TYPE1_INFO_CAP_IOVA_RANGE as u64),
    ("VFIO_PCI_BAR0_REGION_INDEX", VFIO_PCI_BAR0_REGION_INDEX as u64),
    ("VFIO_PCI_CONFIG_REGION_INDEX", VFIO_PCI_CONFIG_REGION_INDEX as u64),
    ("VFIO_PCI_INTX_IRQ_INDEX", VFIO_PCI_INTX_IRQ_INDEX as u64),
    ("VFIO_PCI_MSI_IRQ_INDEX", VFIO_PCI_MSI_IRQ_INDEX as u64),
    ("VFIO_PCI_MSIX_IRQ_INDEX", VFIO_PCI_MSIX_IRQ_INDEX as u64),
];

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;
    use std::process::Command;

    /// Compiles a C program against the system's `<linux/vfio.h>` that prints every size, offset and constant
    /// this module declares, and compares them one by one.
    #[test]
    fn abi_matches_the_kernel_header() {
        let mut c = String::from("#include <stdio.h>\n#include <stddef.h>\n#include <linux/vfio.h>\nint main(void){\n");
        for (s, f, _) in LAYOUT {
            writeln!(c, "printf(\"{s}.{f} %zu\\n\", offsetof(struct {s}, {f}));").unwrap();
        }
        for (s, _) in SIZES {
            // Flexible array members do not count in sizeof, so the C size equals the Rust header's size.
            writeln!(c, "printf(\"sizeof {s} %zu\\n\", sizeof(struct {s}));").unwrap();
        }
        for (m, _) in CONSTANTS {
            writeln!(c, "printf(\"{m} %llu\\n\", (unsigned long long)({m}));").unwrap();
        }
        c.push_str("return 0;}\n");
        let dir = std::env::temp_dir().join(format!("mlx5-vfio-abi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src = dir.join("abi.c");
        let exe = dir.join("abi");
        std::fs::write(&src, c).unwrap();
        let cc = Command::new("gcc").arg("-o").arg(&exe).arg(&src).output().expect("gcc is needed for the ABI test");
        assert!(cc.status.success(), "gcc failed: {}", String::from_utf8_lossy(&cc.stderr));
        let out = Command::new(&exe).output().unwrap();
        let text = String::from_utf8(out.stdout).unwrap();
        let mut expected = String::new();
        for (s, f, o) in LAYOUT {
            writeln!(expected, "{s}.{f} {o}").unwrap();
        }
        for (s, n) in SIZES {
            writeln!(expected, "sizeof {s} {n}").unwrap();
        }
        for (m, v) in CONSTANTS {
            writeln!(expected, "{m} {v}").unwrap();
        }
        std::fs::remove_dir_all(&dir).ok();
        for (c_line, rust_line) in text.lines().zip(expected.lines()) {
            assert_eq!(c_line, rust_line, "C header (left) and Rust (right) disagree");
        }
        assert_eq!(text.lines().count(), expected.lines().count());
    }

    #[test]
    fn pod_round_trip() {
        let m = vfio_iommu_type1_dma_map { argsz: 32, flags: 3, vaddr: 0x7f00_0000_0000, iova: 0x10_0000, size: 4096 };
        let b = m.as_bytes();
        assert_eq!(b.len(), 32);
        assert_eq!(&b[8..16], &0x7f00_0000_0000u64.to_ne_bytes());
        let back = vfio_iommu_type1_dma_map::read_from(b);
        assert_eq!(back.iova, 0x10_0000);
        // A short buffer zero-extends instead of reading past its end.
        assert_eq!(vfio_region_info::read_from(&[1, 0, 0, 0]).argsz, 1);
    }
}
