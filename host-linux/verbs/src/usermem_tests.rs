//! Registrations of this process's own memory on a simulated device, made unpinnable with `mmap`/`munmap`/
//! `mprotect`. They go through the raw objects, so they sit above both `usermem` (which checks the memory) and
//! `raw` (which registers it): the check itself stays a leaf that nothing above it is reached from.

use std::ptr::NonNull;

use crate::error::{BadMemory, BadMemoryKind, VerbsError};
use crate::raw::RawPd;
use crate::usermem::USER_END;
use crate::{Access, Context};

/// `pages` fresh anonymous pages with protection `prot`.
fn map(pages: usize, prot: i32) -> *mut u8 {
    // SAFETY: a new private anonymous mapping; no existing memory is touched.
    let p =
        unsafe { libc::mmap(std::ptr::null_mut(), pages * 4096, prot, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
    assert_ne!(p, libc::MAP_FAILED);
    p.cast()
}

fn unmap(p: *mut u8, pages: usize) {
    // SAFETY: a mapping this test made, unmapped once.
    assert_eq!(unsafe { libc::munmap(p.cast(), pages * 4096) }, 0);
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

fn reg(pd: &RawPd, addr: *mut u8, len: usize, access: Access) -> Result<(), VerbsError> {
    let ptr = NonNull::new(addr).expect("non-null");
    // SAFETY: the memory is this test's own mapping (or none at all, which is the point), deregistered before
    // it is unmapped.
    let mr = unsafe { pd.reg_mr(ptr, len, None, access) }?;
    mr.dereg()
}

fn why(r: Result<(), VerbsError>) -> BadMemoryKind {
    match r {
        Err(VerbsError::BadMemory(BadMemory { why, .. })) => why,
        other => panic!("expected a typed BadMemory error, got {other:?}"),
    }
}

#[test]
fn unpinnable_memory_is_refused_at_registration_with_a_typed_error() {
    let ctx = Context::open_sim().unwrap();
    let pd = crate::raw::alloc_pd(&ctx).unwrap();
    let w = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    // Unmapped.
    let gone = unmapped(2);
    assert_eq!(why(reg(&pd, gone, 8192, w)), BadMemoryKind::Unmapped { page: gone as usize });
    assert_eq!(why(reg(&pd, gone, 10, Access::default())), BadMemoryKind::Unmapped { page: gone as usize });
    // Read-only: refused with any write right, registered without.
    let ro = map(2, libc::PROT_READ);
    for a in [Access::LOCAL_WRITE, w, Access::LOCAL_WRITE | Access::REMOTE_ATOMIC] {
        assert_eq!(why(reg(&pd, ro, 8192, a)), BadMemoryKind::NotWritable { page: ro as usize }, "{a:?}");
    }
    reg(&pd, ro, 8192, Access::REMOTE_READ).unwrap();
    reg(&pd, ro, 8192, Access::default()).unwrap();
    // A writable page then a read-only one: the second is named.
    let mixed = map(2, libc::PROT_READ | libc::PROT_WRITE);
    // SAFETY: the second page of this test's own mapping.
    assert_eq!(unsafe { libc::mprotect(mixed.add(4096).cast(), 4096, libc::PROT_READ) }, 0);
    reg(&pd, mixed, 4096, w).unwrap();
    let second = mixed as usize + 4096;
    assert_eq!(why(reg(&pd, mixed, 4097, w)), BadMemoryKind::NotWritable { page: second });
    // PROT_NONE: not even readable.
    // SAFETY: as above.
    assert_eq!(unsafe { libc::mprotect(mixed.cast(), 8192, libc::PROT_NONE) }, 0);
    assert_eq!(why(reg(&pd, mixed, 16, Access::default())), BadMemoryKind::NotReadable { page: mixed as usize });
    // Past the end of user space, and a length that wraps.
    let high = (USER_END - 4096) as *mut u8;
    assert_eq!(why(reg(&pd, high, 8192, Access::default())), BadMemoryKind::PastUserSpace { end: USER_END });
    assert_eq!(why(reg(&pd, ro, usize::MAX - 100, Access::default())), BadMemoryKind::Wraps);
    // Nothing was mapped for the device by the refused registrations.
    assert_eq!(ctx.user_mappings(), 0);
    unmap(ro, 2);
    unmap(mixed, 2);
    pd.dealloc().unwrap();
}
