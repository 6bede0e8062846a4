//! Hostile uses of the C API a program may make, called as a C program calls it on the default simulated device:
//! registering memory the kernel would refuse to pin.

use std::ffi::c_int;
use std::ptr;

use crate::abi::*;
use crate::context::*;
use crate::objects::*;
use crate::tests::{errno, open};

/// `pages` fresh anonymous pages with protection `prot`.
fn map(pages: usize, prot: c_int) -> *mut u8 {
    // SAFETY: a new private anonymous mapping; no existing memory is touched.
    let p = unsafe { libc::mmap(ptr::null_mut(), pages * 4096, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}

/// `pages` of address space nothing is mapped at. A hole made by unmapping a fresh mapping is not enough: another
/// test thread's `mmap` may take it before the check (a fresh CI run saw it registered). The kernel places a
/// mapping that names no address below the mmap area, top down, so a range 16 TiB up is left alone; `msync`
/// (ENOMEM where nothing is mapped) confirms it.
fn unmapped(pages: usize) -> *mut u8 {
    let len = pages * 4096;
    // 16 TiB up, 1 GiB apart: between a PIE program's heap and the mmap area, far from both.
    for i in 0..64usize {
        let p = (0x1000_0000_0000usize + (i << 30)) as *mut u8;
        // SAFETY: msync only reports; with no flags it writes nothing back and ENOMEM means unmapped.
        let r = unsafe { libc::msync(p.cast(), len, 0) };
        if r != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ENOMEM) {
            return p;
        }
    }
    panic!("no unmapped {len}-byte range found");
}

/// `ibv_reg_mr`'s answer: `Ok` (the region deregistered again) or the errno with NULL.
///
/// # Safety
/// `pd` is a live PD.
unsafe fn reg(pd: *mut ibv_pd, addr: *mut u8, len: usize, access: c_int) -> Result<(), c_int> {
    // SAFETY: the caller's PD; the memory is the test's own (or deliberately none).
    let mr = unsafe { ibv_reg_mr(pd, addr.cast(), len, access) };
    if mr.is_null() {
        return Err(errno());
    }
    // SAFETY: registered just now.
    assert_eq!(unsafe { ibv_dereg_mr(mr) }, 0);
    Ok(())
}

/// As the kernel's `ib_umem_get`, which pins the pages with the access asked: an unmapped range, a read-only one
/// with write access (local write, remote write, remote atomic) and one past the end of user space are EFAULT at
/// registration; read-only memory registers without write access; a range that wraps is EINVAL.
#[test]
fn reg_mr_refuses_what_the_kernel_cannot_pin() {
    const LOCAL_WRITE: c_int = 1;
    const REMOTE_WRITE: c_int = 2;
    const REMOTE_READ: c_int = 4;
    const REMOTE_ATOMIC: c_int = 8;
    let ctx = open();
    // SAFETY: every pointer is made by this library from this context and destroyed once; the mappings are the
    // test's own.
    unsafe {
        let pd = ibv_alloc_pd(ctx);
        assert!(!pd.is_null());
        let gone = unmapped(4);
        assert_eq!(reg(pd, gone, 4 * 4096, LOCAL_WRITE | REMOTE_WRITE), Err(libc::EFAULT));
        assert_eq!(reg(pd, gone.add(100), 10, 0), Err(libc::EFAULT), "unmapped without write access too");
        let ro = map(2, libc::PROT_READ);
        for a in [LOCAL_WRITE, LOCAL_WRITE | REMOTE_WRITE, LOCAL_WRITE | REMOTE_ATOMIC] {
            assert_eq!(reg(pd, ro, 8192, a), Err(libc::EFAULT), "access {a:#x}");
        }
        assert_eq!(reg(pd, ro, 8192, REMOTE_READ), Ok(()));
        assert_eq!(reg(pd, ro, 8192, 0), Ok(()));
        // The last user page and the one past it.
        let high = (0x7fff_ffff_f000usize - 4096) as *mut u8;
        assert_eq!(reg(pd, high, 8192, 0), Err(libc::EFAULT));
        assert_eq!(reg(pd, 0xffff_ffff_ff60_0000usize as *mut u8, 64, 0), Err(libc::EFAULT), "the vsyscall page");
        // addr + length wraps: EINVAL, ib_umem_get's first check.
        assert_eq!(reg(pd, ro, usize::MAX - 100, 0), Err(libc::EINVAL));
        // Writable memory still registers with every right.
        let rw = map(1, libc::PROT_READ | libc::PROT_WRITE);
        assert_eq!(reg(pd, rw, 4096, LOCAL_WRITE | REMOTE_WRITE | REMOTE_READ | REMOTE_ATOMIC), Ok(()));
        assert_eq!(libc::munmap(ro.cast(), 8192), 0);
        assert_eq!(libc::munmap(rw.cast(), 4096), 0);
        assert_eq!(ibv_dealloc_pd(pd), 0);
        assert_eq!(ibv_close_device(ctx), 0);
    }
}
