//! The mpqemu message (QEMU 7.2, `include/hw/remote/mpqemu-link.h`, `MPQemuMsg` on x86_64): a 16-byte header
//! (`int cmd`, padding, `size_t size`), then `size` bytes of the data union; file descriptors ride as
//! SCM_RIGHTS on the header. Replies are `MPQEMU_CMD_RET` with the 8-byte value (size 0 after a reset).

use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;

/// Bytes before the data union (`MPQEMU_MSG_HDR_SIZE`).
pub const HDR: usize = 16;
/// `sizeof` the data union: its largest member, `SyncSysmemMsg` (8 addresses, 8 sizes, 8 offsets).
pub const MAX_DATA: usize = 3 * 8 * MAX_FDS;
/// `REMOTE_MAX_FDS`.
pub const MAX_FDS: usize = 8;
/// Bytes of `PciConfDataMsg` (`addr`, `val`, `len`).
pub const PCI_CONF_SIZE: usize = 12;
/// Bytes of `BarAccessMsg` (`addr`, `val`, `size`, `memory`, padded to 8).
pub const BAR_ACCESS_SIZE: usize = 24;

/// `MPQemuCmd`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(i32)]
pub enum Cmd {
    SyncSysmem = 0,
    Ret = 1,
    PciCfgWrite = 2,
    PciCfgRead = 3,
    BarWrite = 4,
    BarRead = 5,
    SetIrqfd = 6,
    DeviceReset = 7,
}

/// Why a message could not be taken. Each ends the session: the stream cannot be trusted after it (QEMU's own
/// remote process ends it the same way).
#[derive(Debug, thiserror::Error)]
pub enum MsgError {
    #[error("socket I/O")]
    Io(#[source] io::Error),
    #[error("the peer closed the socket after {got} of {want} bytes of a message")]
    Truncated { got: usize, want: usize },
    #[error("message size {size} is larger than the {MAX_DATA}-byte data union")]
    Oversized { size: u64 },
    #[error("{n} file descriptors sent with one message (at most {MAX_FDS}), or the control data was cut")]
    TooManyFds { n: usize },
    #[error("unknown mpqemu command {cmd}")]
    UnknownCommand { cmd: i32 },
    #[error("command {cmd:?} with {size} data bytes and {fds} fds does not have that command's shape")]
    BadShape { cmd: Cmd, size: usize, fds: usize },
}

/// One received message: the raw command number, its data bytes and the descriptors that came with it.
#[derive(Debug)]
pub struct Msg {
    pub cmd: i32,
    pub data: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

/// `PciConfDataMsg`: a config access of `len` bytes at `addr` (`val` for writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PciConf {
    pub addr: u32,
    pub val: u32,
    pub len: i32,
}

/// `BarAccessMsg`: an access of `size` bytes at guest-physical `addr`; `memory` false for I/O space.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BarAccess {
    pub addr: u64,
    pub val: u64,
    pub size: u32,
    pub memory: bool,
}

/// One region of `SyncSysmemMsg`: `size` bytes of guest RAM at `gpa`, at `offset` in its fd.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SysmemRegion {
    pub gpa: u64,
    pub size: u64,
    pub offset: u64,
}

/// A message decoded by command, its shape checked.
#[derive(Debug)]
pub enum Request {
    /// The whole set of guest RAM regions, each with its fd (replaces the previous set; no reply).
    SyncSysmem(Vec<(SysmemRegion, OwnedFd)>),
    CfgWrite(PciConf),
    CfgRead(PciConf),
    BarWrite(BarAccess),
    BarRead(BarAccess),
    /// The INTx eventfd and its resample eventfd (no reply).
    SetIrqfd {
        intr: OwnedFd,
        resample: OwnedFd,
    },
    DeviceReset,
}

fn u32_at(d: &[u8], o: usize) -> u32 {
    u32::from_ne_bytes([d[o], d[o + 1], d[o + 2], d[o + 3]])
}

fn u64_at(d: &[u8], o: usize) -> u64 {
    let mut b = [0u8; 8];
    b.copy_from_slice(&d[o..o + 8]);
    u64::from_ne_bytes(b)
}

impl Request {
    /// Decodes `msg` as QEMU's `mpqemu_msg_valid` would accept it.
    pub fn parse(msg: Msg) -> Result<Self, MsgError> {
        let cmd = match msg.cmd {
            0 => Cmd::SyncSysmem,
            2 => Cmd::PciCfgWrite,
            3 => Cmd::PciCfgRead,
            4 => Cmd::BarWrite,
            5 => Cmd::BarRead,
            6 => Cmd::SetIrqfd,
            7 => Cmd::DeviceReset,
            // RET is a reply: the device never receives one.
            c => return Err(MsgError::UnknownCommand { cmd: c }),
        };
        let (size, nfds) = (msg.data.len(), msg.fds.len());
        let bad = MsgError::BadShape { cmd, size, fds: nfds };
        let d = &msg.data;
        Ok(match cmd {
            Cmd::SyncSysmem if size == MAX_DATA && nfds > 0 => {
                let regions = (0..nfds).map(|i| SysmemRegion {
                    gpa: u64_at(d, 8 * i),
                    size: u64_at(d, 64 + 8 * i),
                    offset: u64_at(d, 128 + 8 * i),
                });
                Request::SyncSysmem(regions.zip(msg.fds).collect())
            }
            Cmd::PciCfgWrite | Cmd::PciCfgRead if size == PCI_CONF_SIZE && nfds == 0 => {
                let c = PciConf { addr: u32_at(d, 0), val: u32_at(d, 4), len: u32_at(d, 8) as i32 };
                if cmd == Cmd::PciCfgWrite {
                    Request::CfgWrite(c)
                } else {
                    Request::CfgRead(c)
                }
            }
            Cmd::BarWrite | Cmd::BarRead if size == BAR_ACCESS_SIZE && nfds == 0 => {
                let a = BarAccess { addr: u64_at(d, 0), val: u64_at(d, 8), size: u32_at(d, 16), memory: d[20] != 0 };
                if cmd == Cmd::BarWrite {
                    Request::BarWrite(a)
                } else {
                    Request::BarRead(a)
                }
            }
            Cmd::SetIrqfd if size == 0 && nfds == 2 => {
                let mut f = msg.fds.into_iter();
                match (f.next(), f.next()) {
                    (Some(intr), Some(resample)) => Request::SetIrqfd { intr, resample },
                    _ => return Err(bad),
                }
            }
            Cmd::DeviceReset if nfds == 0 => Request::DeviceReset,
            _ => return Err(bad),
        })
    }
}

/// Space for the descriptors of one message and more, so an excess is seen (and closed) rather than cut.
const CMSG_FDS: usize = 2 * MAX_FDS;

/// Receives one message; `Ok(None)` when the peer closed the socket between messages.
pub fn recv(sock: &UnixStream) -> Result<Option<Msg>, MsgError> {
    let mut hdr = [0u8; HDR];
    let mut fds: Vec<OwnedFd> = Vec::new();
    let mut got = 0;
    let mut cut = false;
    while got < HDR {
        // SAFETY: CMSG_SPACE is a pure size computation.
        let space = unsafe { libc::CMSG_SPACE((CMSG_FDS * size_of::<RawFd>()) as u32) } as usize;
        let mut cbuf = vec![0u64; space.div_ceil(8)];
        let mut iov = libc::iovec { iov_base: hdr[got..].as_mut_ptr().cast(), iov_len: HDR - got };
        // SAFETY: an all-zero msghdr is a valid empty one; its pointers are set below.
        let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        mh.msg_control = cbuf.as_mut_ptr().cast();
        mh.msg_controllen = space as _;
        // SAFETY: `mh` points at `iov` (into `hdr`) and `cbuf`, both live and sized as declared.
        let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut mh, libc::MSG_CMSG_CLOEXEC) };
        if n < 0 {
            let e = io::Error::last_os_error();
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            return Err(MsgError::Io(e));
        }
        cut |= mh.msg_flags & libc::MSG_CTRUNC != 0;
        // SAFETY: the control buffer was filled by recvmsg; the CMSG_* walk stays inside `msg_controllen`.
        unsafe {
            let mut c = libc::CMSG_FIRSTHDR(&mh);
            while !c.is_null() {
                if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(c).cast::<RawFd>();
                    let n = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / size_of::<RawFd>();
                    for i in 0..n {
                        // Each received descriptor is new and ours; owning it closes it on every path.
                        fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                    }
                }
                c = libc::CMSG_NXTHDR(&mh, c);
            }
        }
        if n == 0 {
            return if got == 0 { Ok(None) } else { Err(MsgError::Truncated { got, want: HDR }) };
        }
        got += n as usize;
    }
    if cut || fds.len() > MAX_FDS {
        return Err(MsgError::TooManyFds { n: fds.len() });
    }
    let cmd = i32::from_ne_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let size = u64_at(&hdr, 8);
    if size > MAX_DATA as u64 {
        return Err(MsgError::Oversized { size });
    }
    let mut data = vec![0u8; size as usize];
    let mut have = 0;
    let mut s = sock;
    while have < data.len() {
        match s.read(&mut data[have..]) {
            Ok(0) => return Err(MsgError::Truncated { got: HDR + have, want: HDR + data.len() }),
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(MsgError::Io(e)),
        }
    }
    Ok(Some(Msg { cmd, data, fds }))
}

/// The bytes of a message: header, then `data`.
pub fn encode(cmd: i32, data: &[u8]) -> Vec<u8> {
    let mut m = Vec::with_capacity(HDR + data.len());
    m.extend_from_slice(&cmd.to_ne_bytes());
    m.extend_from_slice(&[0; 4]);
    m.extend_from_slice(&(data.len() as u64).to_ne_bytes());
    m.extend_from_slice(data);
    m
}

/// Sends a message with `fds` attached (what QEMU's proxy does; the tests are that side).
pub fn send(sock: &UnixStream, cmd: i32, data: &[u8], fds: &[RawFd]) -> io::Result<()> {
    let bytes = encode(cmd, data);
    if fds.is_empty() {
        let mut s = sock;
        return s.write_all(&bytes);
    }
    let payload = std::mem::size_of_val(fds);
    // SAFETY: pure size computations.
    let space = unsafe { libc::CMSG_SPACE(payload as u32) } as usize;
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
    // SAFETY: an all-zero msghdr is a valid empty one.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.as_mut_ptr().cast();
    mh.msg_controllen = space as _;
    // SAFETY: `cbuf` holds CMSG_SPACE(payload) bytes, so the first header and its data fit.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&mh);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(payload as u32) as _;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
    }
    // SAFETY: `mh` points at live buffers sized as declared; the kernel only reads them.
    let n = unsafe { libc::sendmsg(sock.as_raw_fd(), &mh, libc::MSG_NOSIGNAL) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if (n as usize) < bytes.len() {
        let mut s = sock;
        s.write_all(&bytes[n as usize..])?;
    }
    Ok(())
}

/// Sends `MPQEMU_CMD_RET` carrying `val` (or nothing, as the reply to DEVICE_RESET).
pub fn send_ret(sock: &UnixStream, val: Option<u64>) -> io::Result<()> {
    let data = val.map(u64::to_ne_bytes);
    let mut s = sock;
    s.write_all(&encode(Cmd::Ret as i32, data.as_ref().map_or(&[][..], |d| &d[..])))
}

/// Receives a RET and returns its value (`None` for the empty one): the proxy's side, for tests.
pub fn recv_ret(sock: &UnixStream) -> Result<Option<u64>, MsgError> {
    let m = recv(sock)?.ok_or(MsgError::Truncated { got: 0, want: HDR })?;
    if m.cmd != Cmd::Ret as i32 {
        return Err(MsgError::UnknownCommand { cmd: m.cmd });
    }
    match m.data.len() {
        0 => Ok(None),
        8 => Ok(Some(u64_at(&m.data, 0))),
        n => Err(MsgError::BadShape { cmd: Cmd::Ret, size: n, fds: m.fds.len() }),
    }
}

/// The data of a config access.
pub fn pci_conf(addr: u32, val: u32, len: i32) -> [u8; PCI_CONF_SIZE] {
    let mut d = [0u8; PCI_CONF_SIZE];
    d[..4].copy_from_slice(&addr.to_ne_bytes());
    d[4..8].copy_from_slice(&val.to_ne_bytes());
    d[8..].copy_from_slice(&len.to_ne_bytes());
    d
}

/// The data of a BAR access.
pub fn bar_access(addr: u64, val: u64, size: u32, memory: bool) -> [u8; BAR_ACCESS_SIZE] {
    let mut d = [0u8; BAR_ACCESS_SIZE];
    d[..8].copy_from_slice(&addr.to_ne_bytes());
    d[8..16].copy_from_slice(&val.to_ne_bytes());
    d[16..20].copy_from_slice(&size.to_ne_bytes());
    d[20] = u8::from(memory);
    d
}

/// The data of a SYNC_SYSMEM for these regions (their fds go alongside, in order).
pub fn sync_sysmem(regions: &[SysmemRegion]) -> [u8; MAX_DATA] {
    let mut d = [0u8; MAX_DATA];
    for (i, r) in regions.iter().take(MAX_FDS).enumerate() {
        d[8 * i..8 * i + 8].copy_from_slice(&r.gpa.to_ne_bytes());
        d[64 + 8 * i..72 + 8 * i].copy_from_slice(&r.size.to_ne_bytes());
        d[128 + 8 * i..136 + 8 * i].copy_from_slice(&r.offset.to_ne_bytes());
    }
    d
}
