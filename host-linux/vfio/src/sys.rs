//! The system-call seam. Every syscall and sysfs access the VFIO layer makes goes through [`Sys`]: [`LinuxSys`]
//! makes the real calls, and `twin::Twin` (feature `test-utils`) is a test twin that behaves as the kernel's VFIO and
//! sysfs interfaces do, so the layer's logic (argument encoding, error mapping, clean-up order) is unit-tested
//! on any machine, and the same code runs against the real kernel in the QEMU test (`cargo xtask vfio-test`).

use std::ffi::{CStr, CString};
use std::fmt;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::ptr::NonNull;

/// A file descriptor owned by the caller of [`Sys::open`] / [`Sys::eventfd`].
pub type RawFd = i32;

/// The argument of an ioctl, one variant per shape VFIO requests take.
#[derive(Debug)]
pub enum Arg<'a> {
    /// No argument.
    None,
    /// An integer passed by value.
    Int(u64),
    /// A structure that starts with its `u32 argsz`, which the kernel reads and may fill up to `argsz` bytes.
    /// [`Arg::check`] refuses a buffer whose `argsz` claims more bytes than it has.
    Buf(&'a mut [u8]),
    /// A file descriptor the kernel reads through a pointer (`VFIO_GROUP_SET_CONTAINER`).
    Fd(RawFd),
    /// A NUL-terminated name (`VFIO_GROUP_GET_DEVICE_FD`).
    Name(&'a CStr),
}

/// An argsz-led ioctl buffer that cannot be passed to the kernel: too short to hold `argsz`, or an `argsz` larger
/// than the buffer (the kernel trusts `argsz` and would read and write past the buffer's end).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArgszError {
    /// The `argsz` the buffer claims; `None` when the buffer is shorter than the field itself.
    pub argsz: Option<u32>,
    /// The buffer's real length.
    pub len: usize,
}

impl fmt::Display for ArgszError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.argsz {
            Some(argsz) => write!(f, "ioctl argsz {argsz} exceeds its {}-byte buffer", self.len),
            None => write!(f, "ioctl buffer of {} bytes is too short for argsz", self.len),
        }
    }
}

impl std::error::Error for ArgszError {}

impl Arg<'_> {
    /// Checks an argsz-led buffer against its length; the other shapes carry no length to check.
    pub fn check(&self) -> Result<(), ArgszError> {
        let Arg::Buf(b) = self else { return Ok(()) };
        match b.first_chunk::<4>().map(|a| u32::from_ne_bytes(*a)) {
            Some(argsz) if argsz as usize <= b.len() => Ok(()),
            argsz => Err(ArgszError { argsz, len: b.len() }),
        }
    }

    /// [`Arg::check`] as the `io::Error` an ioctl returns (`InvalidInput`, with the [`ArgszError`] inside).
    pub fn check_io(&self) -> io::Result<()> {
        self.check().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))
    }
}

/// System calls used by the VFIO layer.
///
/// # Safety
/// Implementers guarantee that a pointer returned by [`Sys::mmap_device`] or [`Sys::mmap_anon`] is valid for
/// reads and writes of `len` bytes, page aligned (2 MiB aligned for a huge mapping), and stays valid until it is
/// passed to [`Sys::munmap`]; anonymous memory is zero-filled. Callers guarantee that they pass to `munmap` only
/// pointers and lengths these methods returned, each once, and never touch the memory afterwards.
pub unsafe trait Sys: Send + Sync + std::fmt::Debug {
    fn open(&self, path: &Path, write: bool) -> io::Result<RawFd>;
    /// Closes a file descriptor.
    ///
    /// # Safety
    /// The caller owns `fd` (this object's `open`, `eventfd` or device-fd ioctl returned it), closes it once and
    /// does not use the number afterwards: closing a descriptor someone else owns would let theirs refer to
    /// whatever file next gets the number.
    unsafe fn close(&self, fd: RawFd);
    /// Runs an ioctl. An argsz-led buffer whose `argsz` exceeds its length is refused before the call, with an
    /// `InvalidInput` error carrying an [`ArgszError`].
    ///
    /// # Safety
    /// `request` is a VFIO request on `fd` that takes an argument of `arg`'s shape (an integer where the kernel
    /// expects a pointer would let it write to that address), and the kernel touches an [`Arg::Buf`] structure
    /// only within its `argsz`.
    unsafe fn ioctl(&self, fd: RawFd, request: u64, arg: Arg<'_>) -> io::Result<i32>;
    /// Maps `len` bytes of a device file at `offset`, shared and read-write (a BAR).
    fn mmap_device(&self, fd: RawFd, len: usize, offset: u64) -> io::Result<NonNull<u8>>;
    /// Maps `len` bytes of private anonymous memory, populated; `huge` asks for 2 MiB hugetlb pages.
    fn mmap_anon(&self, len: usize, huge: bool) -> io::Result<NonNull<u8>>;
    /// Unmaps what an `mmap_*` call returned.
    ///
    /// # Safety
    /// `ptr` and `len` come from one `mmap_*` call of this object, are unmapped once, and nothing uses the memory
    /// afterwards.
    unsafe fn munmap(&self, ptr: NonNull<u8>, len: usize);
    fn pread(&self, fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<usize>;
    fn pwrite(&self, fd: RawFd, buf: &[u8], offset: u64) -> io::Result<usize>;
    /// A non-blocking eventfd with counter semantics.
    fn eventfd(&self) -> io::Result<RawFd>;
    /// Waits until one of `fds` is readable or `timeout_ms` passes; returns the index of a readable one.
    fn wait_readable(&self, fds: &[RawFd], timeout_ms: i32) -> io::Result<Option<usize>>;
    /// Reads (and so resets) an eventfd's counter; `Ok(0)` when it was zero.
    fn read_eventfd(&self, fd: RawFd) -> io::Result<u64>;
    /// Adds to an eventfd's counter (the kernel's interrupt path does this on the real system).
    fn write_eventfd(&self, fd: RawFd, v: u64) -> io::Result<()>;
    fn read_to_string(&self, path: &Path) -> io::Result<String>;
    fn write_file(&self, path: &Path, data: &str) -> io::Result<()>;
    fn read_link(&self, path: &Path) -> io::Result<std::path::PathBuf>;
    fn exists(&self, path: &Path) -> bool;
    fn read_dir(&self, path: &Path) -> io::Result<Vec<String>>;
    fn geteuid(&self) -> u32;
}

/// The real system calls.
#[derive(Debug, Default, Clone, Copy)]
pub struct LinuxSys;

fn cstr(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

fn check(rc: libc::c_int) -> io::Result<i32> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn check_size(rc: libc::ssize_t) -> io::Result<usize> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as usize)
    }
}

// SAFETY: mmap returns page-aligned mappings valid until munmap (MAP_HUGETLB ones 2 MiB aligned); anonymous
// mappings are zero-filled by the kernel.
unsafe impl Sys for LinuxSys {
    fn open(&self, path: &Path, write: bool) -> io::Result<RawFd> {
        let c = cstr(path)?;
        let flags = if write { libc::O_RDWR } else { libc::O_RDONLY } | libc::O_CLOEXEC;
        // SAFETY: c is a NUL-terminated path that outlives the call.
        check(unsafe { libc::open(c.as_ptr(), flags) })
    }

    unsafe fn close(&self, fd: RawFd) {
        // SAFETY: the caller owns fd, closes it once and no longer uses it.
        unsafe { libc::close(fd) };
    }

    unsafe fn ioctl(&self, fd: RawFd, request: u64, arg: Arg<'_>) -> io::Result<i32> {
        arg.check_io()?;
        let req = request as libc::c_ulong;
        // SAFETY: the caller guarantees the request takes this argument shape; a Buf's argsz was just checked to
        // lie within the buffer, which is all the kernel touches; Fd and Name point at live values for the call.
        let rc = unsafe {
            match arg {
                Arg::None => libc::ioctl(fd, req),
                Arg::Int(v) => libc::ioctl(fd, req, v as libc::c_ulong),
                Arg::Buf(b) => libc::ioctl(fd, req, b.as_mut_ptr()),
                Arg::Fd(v) => libc::ioctl(fd, req, &v as *const RawFd),
                Arg::Name(n) => libc::ioctl(fd, req, n.as_ptr()),
            }
        };
        check(rc)
    }

    fn mmap_device(&self, fd: RawFd, len: usize, offset: u64) -> io::Result<NonNull<u8>> {
        // SAFETY: a new shared mapping of the device file; it aliases no Rust object.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                offset as libc::off_t,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(p.cast()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))
    }

    fn mmap_anon(&self, len: usize, huge: bool) -> io::Result<NonNull<u8>> {
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE;
        if huge {
            flags |= libc::MAP_HUGETLB | (21 << libc::MAP_HUGE_SHIFT);
        }
        // SAFETY: a new private anonymous mapping; it aliases no Rust object.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, flags, -1, 0) };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        NonNull::new(p.cast()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))
    }

    unsafe fn munmap(&self, ptr: NonNull<u8>, len: usize) {
        // SAFETY: the caller passes a mapping returned by mmap_*, once, and no longer uses it.
        unsafe { libc::munmap(ptr.as_ptr().cast(), len) };
    }

    fn pread(&self, fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        // SAFETY: buf is valid for buf.len() bytes of writes.
        check_size(unsafe { libc::pread(fd, buf.as_mut_ptr().cast(), buf.len(), offset as libc::off_t) })
    }

    fn pwrite(&self, fd: RawFd, buf: &[u8], offset: u64) -> io::Result<usize> {
        // SAFETY: buf is valid for buf.len() bytes of reads.
        check_size(unsafe { libc::pwrite(fd, buf.as_ptr().cast(), buf.len(), offset as libc::off_t) })
    }

    fn eventfd(&self) -> io::Result<RawFd> {
        // SAFETY: creates a new descriptor; no memory is passed.
        check(unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) })
    }

    fn wait_readable(&self, fds: &[RawFd], timeout_ms: i32) -> io::Result<Option<usize>> {
        let mut pfds: Vec<libc::pollfd> =
            fds.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }).collect();
        loop {
            // SAFETY: pfds is a valid array of pfds.len() pollfd structures.
            let rc = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
            if rc < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                return Err(e);
            }
            return Ok(pfds.iter().position(|p| p.revents & libc::POLLIN != 0));
        }
    }

    fn read_eventfd(&self, fd: RawFd) -> io::Result<u64> {
        let mut v = [0u8; 8];
        // SAFETY: v is valid for 8 bytes of writes, the size an eventfd read requires.
        match check_size(unsafe { libc::read(fd, v.as_mut_ptr().cast(), 8) }) {
            Ok(_) => Ok(u64::from_ne_bytes(v)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            Err(e) => Err(e),
        }
    }

    fn write_eventfd(&self, fd: RawFd, v: u64) -> io::Result<()> {
        let b = v.to_ne_bytes();
        // SAFETY: b is valid for 8 bytes of reads.
        check_size(unsafe { libc::write(fd, b.as_ptr().cast(), 8) }).map(|_| ())
    }

    fn read_to_string(&self, path: &Path) -> io::Result<String> {
        std::fs::read_to_string(path)
    }

    fn write_file(&self, path: &Path, data: &str) -> io::Result<()> {
        // sysfs attributes take one write of the whole value; OpenOptions without truncate or create.
        use std::io::Write;
        std::fs::OpenOptions::new().write(true).open(path)?.write_all(data.as_bytes())
    }

    fn read_link(&self, path: &Path) -> io::Result<std::path::PathBuf> {
        std::fs::read_link(path)
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn read_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for e in std::fs::read_dir(path)? {
            names.push(e?.file_name().to_string_lossy().into_owned());
        }
        names.sort();
        Ok(names)
    }

    fn geteuid(&self) -> u32 {
        // SAFETY: geteuid has no preconditions and cannot fail.
        unsafe { libc::geteuid() }
    }
}
