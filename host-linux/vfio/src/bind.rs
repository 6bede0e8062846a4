//! Handing a PCI function to vfio-pci and back, through sysfs, as `dpdk-devbind` does: set `driver_override`,
//! unbind from the current driver, ask the PCI core to probe again. And the checks that let [`super::VfioDevice`]
//! name the exact reason a device cannot be opened (no IOMMU, wrong driver, group not viable).

use std::io;
use std::path::{Path, PathBuf};

use super::sys::Sys;
use super::{Bdf, Result, VfioError};

/// Mellanox / NVIDIA networking's PCI vendor id.
pub const MELLANOX_VENDOR_ID: u16 = 0x15b3;

/// Drivers whose devices do not stop a group from being viable: vfio-pci itself, pci-stub, and PCIe port
/// services on bridges (the kernel's `vfio_dev_driver_allowed` list plus the bridge rule).
const GROUP_SAFE_DRIVERS: &[&str] = &["vfio-pci", "pci-stub", "pcieport"];

fn file_name(p: &Path) -> Option<String> {
    p.file_name().map(|n| n.to_string_lossy().into_owned())
}

/// The driver `bdf` is bound to, if any.
pub fn driver(sys: &dyn Sys, bdf: Bdf) -> Option<String> {
    sys.read_link(&bdf.sysfs().join("driver")).ok().as_deref().and_then(file_name)
}

/// The IOMMU group of `bdf`, if the IOMMU is on.
pub fn iommu_group(sys: &dyn Sys, bdf: Bdf) -> Option<u32> {
    let link = sys.read_link(&bdf.sysfs().join("iommu_group")).ok()?;
    file_name(&link)?.parse().ok()
}

/// Reads a hex sysfs attribute such as `vendor` ("0x15b3\n").
pub fn read_id(sys: &dyn Sys, bdf: Bdf, attr: &str) -> Option<u16> {
    let s = sys.read_to_string(&bdf.sysfs().join(attr)).ok()?;
    u16::from_str_radix(s.trim().trim_start_matches("0x"), 16).ok()
}

/// Every PCI function with this vendor (and device, when given) id.
pub fn find(sys: &dyn Sys, vendor: u16, device: Option<u16>) -> Vec<Bdf> {
    let names = sys.read_dir(Path::new("/sys/bus/pci/devices")).unwrap_or_default();
    names
        .iter()
        .filter_map(|n| n.parse::<Bdf>().ok())
        .filter(|&b| read_id(sys, b, "vendor") == Some(vendor))
        .filter(|&b| device.is_none() || read_id(sys, b, "device") == device)
        .collect()
}

/// Devices of `group` bound to a driver that makes the group unusable for VFIO, as "BDF (driver)".
pub fn group_blockers(sys: &dyn Sys, group: u32) -> io::Result<Vec<String>> {
    let dir = PathBuf::from(format!("/sys/kernel/iommu_groups/{group}/devices"));
    let mut out = Vec::new();
    for name in sys.read_dir(&dir)? {
        let Ok(b) = name.parse::<Bdf>() else { continue };
        if let Some(d) = driver(sys, b) {
            if !GROUP_SAFE_DRIVERS.contains(&d.as_str()) {
                out.push(format!("{b} ({d})"));
            }
        }
    }
    Ok(out)
}

/// Checks that `bdf` exists, sits behind an IOMMU, is bound to vfio-pci and that its group is viable; returns the
/// group number.
pub fn check_ready(sys: &dyn Sys, bdf: Bdf) -> Result<u32> {
    if !sys.exists(&bdf.sysfs()) {
        return Err(VfioError::NoSuchDevice(bdf));
    }
    let group = iommu_group(sys, bdf).ok_or(VfioError::NoIommuGroup(bdf))?;
    match driver(sys, bdf) {
        Some(d) if d == "vfio-pci" => {}
        Some(d) => return Err(VfioError::NotBoundToVfio { bdf, driver: d }),
        None => return Err(VfioError::NotBoundToVfio { bdf, driver: "no driver".into() }),
    }
    let blockers = group_blockers(sys, group).map_err(super::sys_err(format!("list IOMMU group {group}")))?;
    if !blockers.is_empty() {
        return Err(VfioError::GroupNotViable { group, blockers });
    }
    Ok(group)
}

/// What [`bind`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bound {
    AlreadyBound,
    /// Moved from this driver (or from none) to vfio-pci.
    From(Option<String>),
}

fn write(sys: &dyn Sys, bdf: Bdf, path: &Path, data: &str) -> Result<()> {
    sys.write_file(path, data).map_err(|e| match e.raw_os_error() {
        Some(libc::EBUSY) => VfioError::Busy(bdf),
        Some(libc::EACCES) | Some(libc::EPERM) => VfioError::PermissionDenied(path.into()),
        _ => VfioError::Sys { what: format!("write {data:?} to {}", path.display()), source: e },
    })
}

/// Binds `bdf` to vfio-pci. `vendor` restricts it to one vendor (the `mlx5` tool passes
/// [`MELLANOX_VENDOR_ID`]; the QEMU test binds QEMU's `edu` device with `None`).
pub fn bind(sys: &dyn Sys, bdf: Bdf, vendor: Option<u16>) -> Result<Bound> {
    if sys.geteuid() != 0 {
        return Err(VfioError::NotRoot("binding a device to vfio-pci"));
    }
    if !sys.exists(&bdf.sysfs()) {
        return Err(VfioError::NoSuchDevice(bdf));
    }
    if let Some(want) = vendor {
        let got = read_id(sys, bdf, "vendor").unwrap_or(0);
        if got != want {
            return Err(VfioError::NotMellanox { bdf, vendor: got });
        }
    }
    if iommu_group(sys, bdf).is_none() {
        return Err(VfioError::NoIommuGroup(bdf));
    }
    if !sys.exists(Path::new("/sys/bus/pci/drivers/vfio-pci")) {
        return Err(VfioError::VfioNotLoaded);
    }
    let old = driver(sys, bdf);
    if old.as_deref() == Some("vfio-pci") {
        return Ok(Bound::AlreadyBound);
    }
    write(sys, bdf, &bdf.sysfs().join("driver_override"), "vfio-pci")?;
    if old.is_some() {
        write(sys, bdf, &bdf.sysfs().join("driver/unbind"), &bdf.to_string())?;
    }
    write(sys, bdf, Path::new("/sys/bus/pci/drivers_probe"), &bdf.to_string())?;
    match driver(sys, bdf) {
        Some(d) if d == "vfio-pci" => Ok(Bound::From(old)),
        other => Err(VfioError::Bind {
            bdf,
            detail: format!("after probing it is bound to {}", other.as_deref().unwrap_or("no driver")),
        }),
    }
}

/// Releases `bdf` from vfio-pci and lets the kernel's own driver (mlx5_core) probe it again. Returns the driver
/// it ended up with.
pub fn unbind(sys: &dyn Sys, bdf: Bdf) -> Result<Option<String>> {
    if sys.geteuid() != 0 {
        return Err(VfioError::NotRoot("unbinding a device from vfio-pci"));
    }
    if !sys.exists(&bdf.sysfs()) {
        return Err(VfioError::NoSuchDevice(bdf));
    }
    match driver(sys, bdf) {
        Some(d) if d == "vfio-pci" => write(sys, bdf, &bdf.sysfs().join("driver/unbind"), &bdf.to_string())?,
        Some(d) => return Err(VfioError::Bind { bdf, detail: format!("bound to {d}, not vfio-pci") }),
        None => {}
    }
    // An empty override (a lone newline) clears it, so the probe picks the device's own driver.
    write(sys, bdf, &bdf.sysfs().join("driver_override"), "\n")?;
    write(sys, bdf, Path::new("/sys/bus/pci/drivers_probe"), &bdf.to_string())?;
    Ok(driver(sys, bdf))
}
