//! Whether process memory may be registered with the access asked, checked as the kernel's `ib_umem_get` checks
//! it when it pins the pages (`EFAULT` otherwise): every page mapped and readable, and writable when the region
//! lets the device write (local write, remote write, remote atomic). A VFIO device gets this from the kernel
//! (`VFIO_IOMMU_MAP_DMA` pins the pages); the simulator pins nothing, so its registrations are checked here,
//! against `/proc/self/maps`. The check is [`check_in`] over the text of that file, so tests can feed it any map.

use mlx5_core::mkey::Access;

use crate::error::{BadMemory, BadMemoryKind};

/// Where user space ends (`TASK_SIZE`): 47-bit user addresses on x86-64 (`TASK_SIZE_MAX`, one guard page below
/// 2^47), 48-bit on arm64; elsewhere only the map decides.
#[cfg(target_arch = "x86_64")]
pub(crate) const USER_END: usize = 0x7fff_ffff_f000;
#[cfg(target_arch = "aarch64")]
pub(crate) const USER_END: usize = 1 << 48;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
pub(crate) const USER_END: usize = usize::MAX;

/// The access rights that make `ib_umem_get` pin for writing (`ib_access_writable`).
fn writes(access: Access) -> bool {
    access.0 & (Access::LOCAL_WRITE.0 | Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0) != 0
}

/// Checks the `len` bytes at `addr` of this process for a registration with `access`. Where the map cannot be
/// read (no `/proc`), nothing is refused: the simulated device's accesses are checked as they happen.
pub(crate) fn check(addr: usize, len: usize, access: Access) -> Result<(), BadMemory> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: sysconf takes no pointers.
        let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096);
        match std::fs::read_to_string("/proc/self/maps") {
            Ok(maps) => check_in(&maps, page, addr, len, writes(access)),
            Err(e) => {
                log::debug!("/proc/self/maps: {e}; memory registered unchecked");
                Ok(())
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = (addr, len, access);
        Ok(())
    }
}

/// Checks the `len` bytes at `addr` against `maps` (the text of `/proc/self/maps`: ascending `start-end perms
/// ...` lines, hexadecimal) with pages of `page` bytes, for writing when `write`. In `ib_umem_get`'s order: a
/// range that wraps or has more than 2^32 pages is `EINVAL`, then every page must be pinnable.
pub(crate) fn check_in(maps: &str, page: usize, addr: usize, len: usize, write: bool) -> Result<(), BadMemory> {
    let bad = |why| BadMemory { addr, len, why };
    let page = page.max(1).next_power_of_two();
    let end = addr.checked_add(len).ok_or(bad(BadMemoryKind::Wraps))?;
    let end = end.checked_next_multiple_of(page).ok_or(bad(BadMemoryKind::Wraps))?;
    let mut at = addr & !(page - 1);
    if (end - at) / page > u32::MAX as usize {
        return Err(bad(BadMemoryKind::TooManyPages));
    }
    if end > USER_END {
        return Err(bad(BadMemoryKind::PastUserSpace { end: USER_END }));
    }
    if at == end {
        return Ok(());
    }
    for (start, stop, perms) in maps.lines().filter_map(parse_line) {
        if stop <= at {
            continue;
        }
        if start > at {
            break;
        }
        if !perms.starts_with('r') {
            return Err(bad(BadMemoryKind::NotReadable { page: at }));
        }
        if write && perms.as_bytes().get(1) != Some(&b'w') {
            return Err(bad(BadMemoryKind::NotWritable { page: at }));
        }
        at = stop;
        if at >= end {
            return Ok(());
        }
    }
    Err(bad(BadMemoryKind::Unmapped { page: at }))
}

/// `start-end perms ...` of one line of `/proc/self/maps`; `None` for anything else.
fn parse_line(line: &str) -> Option<(usize, usize, &str)> {
    let mut f = line.split_ascii_whitespace();
    let (start, end) = f.next()?.split_once('-')?;
    let perms = f.next()?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    (start < end).then_some((start, end, perms))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MAPS: &str = "\
55d1c0a00000-55d1c0a02000 r--p 00000000 08:01 1234 /usr/bin/prog
55d1c0a02000-55d1c0a05000 r-xp 00002000 08:01 1234 /usr/bin/prog
7f0000000000-7f0000004000 rw-p 00000000 00:00 0
7f0000004000-7f0000005000 ---p 00000000 00:00 0
7f0000005000-7f0000007000 rw-p 00000000 00:00 0
7f0000008000-7f0000009000 r--s 00000000 00:05 77 /dev/shm/x
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
";

    fn why(addr: usize, len: usize, write: bool) -> Result<(), BadMemoryKind> {
        check_in(MAPS, 4096, addr, len, write).map_err(|e| e.why)
    }

    #[test]
    fn a_range_inside_mappings_with_the_rights_asked_passes() {
        assert_eq!(why(0x7f00_0000_0010, 0x3000, true), Ok(()));
        // Across two adjacent mappings.
        assert_eq!(why(0x55d1_c0a0_1000, 0x2000, false), Ok(()));
        // Read-only memory without write rights (kernels since 6.2 pin it without FOLL_WRITE).
        assert_eq!(why(0x7f00_0000_8000, 0x1000, false), Ok(()));
        // The last byte of a page: one page only.
        assert_eq!(why(0x7f00_0000_3fff, 1, true), Ok(()));
    }

    #[test]
    fn each_unpinnable_page_is_named() {
        assert_eq!(why(0x7f00_0000_3000, 0x2000, false), Err(BadMemoryKind::NotReadable { page: 0x7f00_0000_4000 }));
        assert_eq!(why(0x7f00_0000_6000, 0x2000, false), Err(BadMemoryKind::Unmapped { page: 0x7f00_0000_7000 }));
        assert_eq!(why(0x7f00_0000_8000, 0x10, true), Err(BadMemoryKind::NotWritable { page: 0x7f00_0000_8000 }));
        assert_eq!(why(0x55d1_c0a0_0000, 0x10, true), Err(BadMemoryKind::NotWritable { page: 0x55d1_c0a0_0000 }));
        assert_eq!(why(0x1000, 1, false), Err(BadMemoryKind::Unmapped { page: 0x1000 }));
        assert_eq!(why(0x7f00_0000_9000, 1, false), Err(BadMemoryKind::Unmapped { page: 0x7f00_0000_9000 }));
    }

    #[test]
    fn ranges_past_user_space_or_wrapping_are_refused_before_the_map_is_read() {
        assert_eq!(why(USER_END - 0x1000, 0x2000, false), Err(BadMemoryKind::PastUserSpace { end: USER_END }));
        assert_eq!(why(0xffff_ffff_ff60_0000, 0x10, false), Err(BadMemoryKind::PastUserSpace { end: USER_END }));
        assert_eq!(why(0x7f00_0000_0000, usize::MAX - 0x10, false), Err(BadMemoryKind::Wraps));
        assert_eq!(why(usize::MAX - 10, 5, false), Err(BadMemoryKind::Wraps), "the page-aligned end wraps");
        assert_eq!(why(0x7f00_0000_0000, 1 << 50, false), Err(BadMemoryKind::TooManyPages));
    }

    #[test]
    fn garbage_lines_are_skipped_and_an_empty_map_maps_nothing() {
        let maps = "not a line\n7f0000000000-7f0000001000 rw-p 0 0 0\nzz-yy r\n";
        assert_eq!(check_in(maps, 4096, 0x7f00_0000_0000, 8, true), Ok(()));
        let e = check_in("", 4096, 0x7f00_0000_0000, 8, false).unwrap_err();
        assert_eq!(e.why, BadMemoryKind::Unmapped { page: 0x7f00_0000_0000 });
        assert_eq!(e.to_string(), "8 bytes at 0x7f0000000000: page 0x7f0000000000 is not mapped");
    }
}
