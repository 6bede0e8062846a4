//! The vhost-user protocol, device ("backend") side, as UML's `virtio_uml.c` speaks it.
//!
//! A message is a 12-byte header (`request`, `flags`, `size`, native endian) and `size` bytes of payload; file
//! descriptors travel as `SCM_RIGHTS` ancillary data. Only messages UML sends are handled; the payload parsers are
//! plain functions over bytes so they are tested with fixtures.

use std::io::{self, Read, Write};
use std::os::fd::{FromRawFd, OwnedFd, RawFd};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::UnixStream;

pub const GET_FEATURES: u32 = 1;
pub const SET_FEATURES: u32 = 2;
pub const SET_OWNER: u32 = 3;
pub const RESET_OWNER: u32 = 4;
pub const SET_MEM_TABLE: u32 = 5;
pub const SET_VRING_NUM: u32 = 8;
pub const SET_VRING_ADDR: u32 = 9;
pub const SET_VRING_BASE: u32 = 10;
pub const GET_VRING_BASE: u32 = 11;
pub const SET_VRING_KICK: u32 = 12;
pub const SET_VRING_CALL: u32 = 13;
pub const SET_VRING_ERR: u32 = 14;
pub const GET_PROTOCOL_FEATURES: u32 = 15;
pub const SET_PROTOCOL_FEATURES: u32 = 16;
pub const GET_QUEUE_NUM: u32 = 17;
pub const SET_VRING_ENABLE: u32 = 18;
pub const SET_SLAVE_REQ_FD: u32 = 21;

/// `VHOST_USER_VERSION` in the low bits of `flags`, and the reply bit.
pub const FLAG_VERSION: u32 = 1;
pub const FLAG_REPLY: u32 = 1 << 2;
pub const FLAG_NEED_REPLY: u32 = 1 << 3;

/// `VIRTIO_F_VERSION_1` and `VHOST_USER_F_PROTOCOL_FEATURES`.
pub const F_VERSION_1: u64 = 1 << 32;
pub const F_PROTOCOL_FEATURES: u64 = 1 << 30;
/// `VHOST_USER_PROTOCOL_F_SLAVE_REQ`. UML allocates the vring-call interrupt only while setting up the slave
/// request channel (`virtio_uml.c`), so a device without it collides with the timer on IRQ 0 and fails with -EBUSY.
pub const PROTOCOL_F_SLAVE_REQ: u64 = 1 << 5;

/// The largest payload accepted (a memory table of 8 regions is 8 + 8 * 32 bytes).
const MAX_PAYLOAD: usize = 4096;
/// The most descriptors one message may carry.
const MAX_FDS: usize = 8;
/// `VHOST_USER_VRING_POLL_MASK`: the kick/call message carries no fd.
const VRING_NOFD: u64 = 1 << 8;

/// One message from the front end.
#[derive(Debug)]
pub struct Msg {
    pub request: u32,
    pub flags: u32,
    pub payload: Vec<u8>,
    pub fds: Vec<OwnedFd>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum ProtoError {
    Short {
        request: u32,
        len: usize,
    },
    TooLarge(usize),
    BadVersion(u32),
    TooManyRegions(u32),
    /// A ring size that is zero, not a power of two, or above 32768 (virtio 1.x, 2.7).
    BadRingSize(u32),
}

impl std::fmt::Display for ProtoError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{self:?}")
    }
}

/// Reads one message; `Ok(None)` when the front end closed the connection.
pub fn recv(sock: &UnixStream) -> io::Result<Option<Msg>> {
    let mut hdr = [0u8; 12];
    let mut cbuf = [0u64; 32];
    let mut iov = libc::iovec { iov_base: hdr.as_mut_ptr().cast(), iov_len: hdr.len() };
    // SAFETY: an all-zero msghdr is valid; the pointers set below reference live local buffers.
    let mut mh: libc::msghdr = unsafe { std::mem::zeroed() };
    mh.msg_iov = &mut iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf.as_mut_ptr().cast();
    mh.msg_controllen = std::mem::size_of_val(&cbuf) as _;
    // SAFETY: `mh` describes valid buffers for the duration of the call.
    let n = unsafe { libc::recvmsg(sock.as_raw_fd(), &mut mh, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    if n == 0 {
        return Ok(None);
    }
    let mut fds = Vec::new();
    // SAFETY: the CMSG_* walkers stay within `msg_controllen` bytes of `cbuf`, which the kernel filled.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&mh);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let count = ((*c).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / std::mem::size_of::<RawFd>();
                for i in 0..count.min(MAX_FDS) {
                    let fd = data.add(i).read_unaligned();
                    fds.push(OwnedFd::from_raw_fd(fd));
                }
            }
            c = libc::CMSG_NXTHDR(&mh, c);
        }
    }
    let mut got = n as usize;
    if got < hdr.len() {
        (&*sock).read_exact(&mut hdr[got..])?;
        got = hdr.len();
    }
    debug_assert_eq!(got, 12);
    let request = u32::from_ne_bytes([hdr[0], hdr[1], hdr[2], hdr[3]]);
    let flags = u32::from_ne_bytes([hdr[4], hdr[5], hdr[6], hdr[7]]);
    let size = u32::from_ne_bytes([hdr[8], hdr[9], hdr[10], hdr[11]]) as usize;
    if size > MAX_PAYLOAD {
        return Err(io::Error::new(io::ErrorKind::InvalidData, ProtoError::TooLarge(size).to_string()));
    }
    if flags & 3 != FLAG_VERSION {
        return Err(io::Error::new(io::ErrorKind::InvalidData, ProtoError::BadVersion(flags).to_string()));
    }
    let mut payload = vec![0u8; size];
    (&*sock).read_exact(&mut payload)?;
    Ok(Some(Msg { request, flags, payload, fds }))
}

/// Sends a reply to `request` with `payload`.
pub fn reply(sock: &UnixStream, request: u32, payload: &[u8]) -> io::Result<()> {
    let mut m = Vec::with_capacity(12 + payload.len());
    m.extend_from_slice(&request.to_ne_bytes());
    m.extend_from_slice(&(FLAG_VERSION | FLAG_REPLY).to_ne_bytes());
    m.extend_from_slice(&(payload.len() as u32).to_ne_bytes());
    m.extend_from_slice(payload);
    (&*sock).write_all(&m)
}

fn u64_at(p: &[u8], off: usize) -> Option<u64> {
    p.get(off..off + 8).map(|b| u64::from_ne_bytes(b.try_into().unwrap_or_default()))
}

fn u32_at(p: &[u8], off: usize) -> Option<u32> {
    p.get(off..off + 4).map(|b| u32::from_ne_bytes(b.try_into().unwrap_or_default()))
}

/// The u64 payload of GET/SET_FEATURES and friends.
pub fn parse_u64(request: u32, p: &[u8]) -> Result<u64, ProtoError> {
    u64_at(p, 0).ok_or(ProtoError::Short { request, len: p.len() })
}

/// `struct vhost_vring_state`: (index, num).
pub fn parse_vring_state(request: u32, p: &[u8]) -> Result<(u32, u32), ProtoError> {
    let short = ProtoError::Short { request, len: p.len() };
    Ok((u32_at(p, 0).ok_or(short)?, u32_at(p, 4).ok_or(ProtoError::Short { request, len: p.len() })?))
}

/// `struct vhost_vring_addr`: (index, desc, used, avail) user addresses.
pub fn parse_vring_addr(p: &[u8]) -> Result<(u32, u64, u64, u64), ProtoError> {
    let short = || ProtoError::Short { request: SET_VRING_ADDR, len: p.len() };
    let index = u32_at(p, 0).ok_or_else(short)?;
    let desc = u64_at(p, 8).ok_or_else(short)?;
    let used = u64_at(p, 16).ok_or_else(short)?;
    let avail = u64_at(p, 24).ok_or_else(short)?;
    Ok((index, desc, used, avail))
}

/// The payload of SET_VRING_KICK/CALL: (ring index, whether an fd comes with it).
pub fn parse_vring_fd(request: u32, p: &[u8]) -> Result<(u32, bool), ProtoError> {
    let v = parse_u64(request, p)?;
    Ok(((v & 0xff) as u32, v & VRING_NOFD == 0))
}

/// One `struct vhost_user_mem_region`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemRegion {
    pub guest_addr: u64,
    pub size: u64,
    pub user_addr: u64,
    pub mmap_offset: u64,
}

/// SET_MEM_TABLE: `num` (u32), padding, then `num` regions of four u64.
pub fn parse_mem_table(p: &[u8]) -> Result<Vec<MemRegion>, ProtoError> {
    let short = || ProtoError::Short { request: SET_MEM_TABLE, len: p.len() };
    let num = u32_at(p, 0).ok_or_else(short)?;
    if num as usize > MAX_FDS {
        return Err(ProtoError::TooManyRegions(num));
    }
    (0..num as usize)
        .map(|i| {
            let o = 8 + 32 * i;
            Ok(MemRegion {
                guest_addr: u64_at(p, o).ok_or_else(short)?,
                size: u64_at(p, o + 8).ok_or_else(short)?,
                user_addr: u64_at(p, o + 16).ok_or_else(short)?,
                mmap_offset: u64_at(p, o + 24).ok_or_else(short)?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_table_as_uml_sends_it() {
        // One region as measured: guest = user = 0x2a096000, size 0xf738000, mmap_offset = the physical address.
        let mut p = vec![];
        p.extend_from_slice(&1u32.to_ne_bytes());
        p.extend_from_slice(&0u32.to_ne_bytes());
        for v in [0x2a09_6000u64, 0xf73_8000, 0x2a09_6000, 0x2a09_6000] {
            p.extend_from_slice(&v.to_ne_bytes());
        }
        let r = parse_mem_table(&p).unwrap();
        assert_eq!(
            r,
            vec![MemRegion {
                guest_addr: 0x2a09_6000,
                size: 0xf73_8000,
                user_addr: 0x2a09_6000,
                mmap_offset: 0x2a09_6000
            }]
        );
        // Truncated, or claiming more regions than fit: errors.
        assert!(matches!(parse_mem_table(&p[..20]), Err(ProtoError::Short { .. })));
        let mut big = p.clone();
        big[0] = 200;
        assert_eq!(parse_mem_table(&big), Err(ProtoError::TooManyRegions(200)));
        big[0] = 2;
        assert!(matches!(parse_mem_table(&big), Err(ProtoError::Short { .. })));
    }

    #[test]
    fn vring_messages() {
        let mut p = vec![];
        p.extend_from_slice(&1u32.to_ne_bytes());
        p.extend_from_slice(&0u32.to_ne_bytes());
        for v in [0x1000u64, 0x3000, 0x2000, 0] {
            p.extend_from_slice(&v.to_ne_bytes());
        }
        assert_eq!(parse_vring_addr(&p).unwrap(), (1, 0x1000, 0x3000, 0x2000));
        let mut s = vec![];
        s.extend_from_slice(&1u32.to_ne_bytes());
        s.extend_from_slice(&256u32.to_ne_bytes());
        assert_eq!(parse_vring_state(SET_VRING_NUM, &s).unwrap(), (1, 256));
        assert!(parse_vring_state(SET_VRING_NUM, &s[..6]).is_err());
        assert_eq!(parse_vring_fd(SET_VRING_KICK, &1u64.to_ne_bytes()).unwrap(), (1, true));
        assert_eq!(parse_vring_fd(SET_VRING_CALL, &0x100u64.to_ne_bytes()).unwrap(), (0, false));
    }

    #[test]
    fn messages_round_trip_over_a_socket_pair_with_an_fd() {
        let (a, b) = UnixStream::pair().unwrap();
        // The front end's side: header, payload and one fd in a single sendmsg, as virtio_uml does.
        let (r, _w) = UnixStream::pair().unwrap();
        let mut m = Vec::new();
        m.extend_from_slice(&SET_VRING_KICK.to_ne_bytes());
        m.extend_from_slice(&FLAG_VERSION.to_ne_bytes());
        m.extend_from_slice(&8u32.to_ne_bytes());
        m.extend_from_slice(&1u64.to_ne_bytes());
        send_with_fd(&a, &m, r.as_raw_fd());
        let msg = recv(&b).unwrap().unwrap();
        assert_eq!(msg.request, SET_VRING_KICK);
        assert_eq!(msg.fds.len(), 1);
        assert_eq!(parse_vring_fd(msg.request, &msg.payload).unwrap(), (1, true));
        reply(&b, GET_FEATURES, &7u64.to_ne_bytes()).unwrap();
        let mut back = [0u8; 20];
        (&a).read_exact(&mut back).unwrap();
        assert_eq!(u32::from_ne_bytes(back[4..8].try_into().unwrap()), FLAG_VERSION | FLAG_REPLY);
        assert_eq!(u64::from_ne_bytes(back[12..].try_into().unwrap()), 7);
        drop(a);
        assert!(recv(&b).unwrap().is_none());
    }

    fn send_with_fd(s: &UnixStream, bytes: &[u8], fd: RawFd) {
        let mut cbuf = [0u64; 8];
        let mut iov = libc::iovec { iov_base: bytes.as_ptr() as *mut _, iov_len: bytes.len() };
        // SAFETY: zeroed msghdr, then pointers to live local buffers; CMSG_* stay within `cbuf`.
        unsafe {
            let mut mh: libc::msghdr = std::mem::zeroed();
            mh.msg_iov = &mut iov;
            mh.msg_iovlen = 1;
            mh.msg_control = cbuf.as_mut_ptr().cast();
            mh.msg_controllen = libc::CMSG_SPACE(4) as _;
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            (libc::CMSG_DATA(c) as *mut RawFd).write_unaligned(fd);
            assert_eq!(libc::sendmsg(s.as_raw_fd(), &mh, 0), bytes.len() as isize);
        }
    }
}
