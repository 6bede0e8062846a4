//! The bridge's server against a scripted vhost-user front end (what UML's virtio_uml and virt-pci send), without
//! UML: handshake, a shared memory file, the two virtqueues, a config read and a BAR read answered through them.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use mlx5_sim::{SimConfig, SimDevice};
use mlx5_uml_bridge::device::Device;
use mlx5_uml_bridge::server::Server;
use mlx5_uml_bridge::vhost::*;

const GUEST: u64 = 0x10_0000;
const LEN: usize = 1 << 20;
const Q0: u64 = GUEST;
const Q1: u64 = GUEST + 0x4000;
const BUF: u64 = GUEST + 0x8000;

fn send(s: &UnixStream, request: u32, payload: &[u8], fd: Option<RawFd>) {
    let mut m = Vec::new();
    m.extend_from_slice(&request.to_ne_bytes());
    m.extend_from_slice(&FLAG_VERSION.to_ne_bytes());
    m.extend_from_slice(&(payload.len() as u32).to_ne_bytes());
    m.extend_from_slice(payload);
    let mut cbuf = [0u64; 8];
    let mut iov = libc::iovec { iov_base: m.as_ptr() as *mut _, iov_len: m.len() };
    // SAFETY: a zeroed msghdr pointing at live local buffers; the CMSG_* writes stay inside `cbuf`.
    unsafe {
        let mut mh: libc::msghdr = std::mem::zeroed();
        mh.msg_iov = &mut iov;
        mh.msg_iovlen = 1;
        if let Some(fd) = fd {
            mh.msg_control = cbuf.as_mut_ptr().cast();
            mh.msg_controllen = libc::CMSG_SPACE(4) as _;
            let c = libc::CMSG_FIRSTHDR(&mh);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(4) as _;
            (libc::CMSG_DATA(c) as *mut RawFd).write_unaligned(fd);
        }
        assert_eq!(libc::sendmsg(s.as_raw_fd(), &mh, 0), m.len() as isize);
    }
}

fn reply_u64(s: &UnixStream) -> u64 {
    let mut b = [0u8; 20];
    (&*s).read_exact(&mut b).unwrap();
    u64::from_ne_bytes(b[12..].try_into().unwrap())
}

fn eventfd() -> OwnedFd {
    // SAFETY: eventfd returns a new descriptor or -1, checked.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh descriptor we own.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

struct Guest {
    p: *mut u8,
}

impl Guest {
    fn w(&self, addr: u64, b: &[u8]) {
        let off = (addr - GUEST) as usize;
        assert!(off + b.len() <= LEN);
        // SAFETY: inside the test's shared mapping of LEN bytes.
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.p.add(off), b.len()) };
    }
    fn r(&self, addr: u64, n: usize) -> Vec<u8> {
        let off = (addr - GUEST) as usize;
        assert!(off + n <= LEN);
        let mut v = vec![0; n];
        // SAFETY: inside the test's shared mapping of LEN bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.p.add(off), v.as_mut_ptr(), n) };
        v
    }
    fn desc(&self, q: u64, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = Vec::new();
        d.extend_from_slice(&addr.to_le_bytes());
        d.extend_from_slice(&len.to_le_bytes());
        d.extend_from_slice(&flags.to_le_bytes());
        d.extend_from_slice(&next.to_le_bytes());
        self.w(q + 16 * u64::from(i), &d);
    }
    fn used_idx(&self, q: u64) -> u16 {
        u16::from_le_bytes(self.r(q + 0x2000 + 2, 2).try_into().unwrap())
    }
}

fn wait_used(g: &Guest, q: u64, idx: u16) {
    let t = Instant::now();
    while g.used_idx(q) != idx {
        assert!(t.elapsed() < Duration::from_secs(10), "the bridge did not answer");
        std::thread::sleep(Duration::from_millis(1));
    }
}

#[test]
fn a_front_end_reads_config_space_and_the_init_segment_through_the_rings() {
    // The guest's RAM: a memory file both sides map, as UML's physmem file.
    // SAFETY: memfd_create with a static name; the result is checked.
    let mfd = unsafe { libc::memfd_create(c"guest".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(mfd >= 0);
    // SAFETY: a fresh descriptor we own.
    let mfd = unsafe { OwnedFd::from_raw_fd(mfd) };
    // SAFETY: ftruncate and mmap of our own memfd; results checked.
    let p = unsafe {
        assert_eq!(libc::ftruncate(mfd.as_raw_fd(), LEN as i64), 0);
        libc::mmap(std::ptr::null_mut(), LEN, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, mfd.as_raw_fd(), 0)
    };
    assert_ne!(p, libc::MAP_FAILED);
    let g = Guest { p: p.cast() };

    let (fe, be) = UnixStream::pair().unwrap();
    let server = std::thread::spawn(move || {
        let dev = Device::new(SimDevice::new(SimConfig::default()), 0x020000);
        let mut s = Server::new(be, dev, None, false);
        let r = s.run();
        (r.map_err(|e| e.to_string()), s.dev.stats)
    });

    send(&fe, SET_OWNER, &[], None);
    send(&fe, GET_FEATURES, &[], None);
    let f = reply_u64(&fe);
    assert_eq!(f & (F_VERSION_1 | F_PROTOCOL_FEATURES), F_VERSION_1 | F_PROTOCOL_FEATURES);
    send(&fe, GET_PROTOCOL_FEATURES, &[], None);
    // Without SLAVE_REQ, UML's vring-call interrupt collides with the timer (IRQ 0).
    assert_ne!(reply_u64(&fe) & PROTOCOL_F_SLAVE_REQ, 0);
    send(&fe, SET_PROTOCOL_FEATURES, &PROTOCOL_F_SLAVE_REQ.to_ne_bytes(), None);
    let (slave, _slave_peer) = UnixStream::pair().unwrap();
    send(&fe, SET_SLAVE_REQ_FD, &[], Some(slave.as_raw_fd()));
    send(&fe, SET_FEATURES, &(F_VERSION_1 | F_PROTOCOL_FEATURES).to_ne_bytes(), None);
    let mut mt = Vec::new();
    mt.extend_from_slice(&1u32.to_ne_bytes());
    mt.extend_from_slice(&0u32.to_ne_bytes());
    for v in [GUEST, LEN as u64, GUEST, 0] {
        mt.extend_from_slice(&v.to_ne_bytes());
    }
    send(&fe, SET_MEM_TABLE, &mt, Some(mfd.as_raw_fd()));
    let (kick0, call0, kick1, call1) = (eventfd(), eventfd(), eventfd(), eventfd());
    for (i, q, call) in [(0u32, Q0, &call0), (1, Q1, &call1)] {
        send(&fe, SET_VRING_CALL, &u64::from(i).to_ne_bytes(), Some(call.as_raw_fd()));
        let mut st = Vec::new();
        st.extend_from_slice(&i.to_ne_bytes());
        st.extend_from_slice(&8u32.to_ne_bytes());
        send(&fe, SET_VRING_NUM, &st, None);
        let mut st = Vec::new();
        st.extend_from_slice(&i.to_ne_bytes());
        st.extend_from_slice(&0u32.to_ne_bytes());
        send(&fe, SET_VRING_BASE, &st, None);
        let mut a = Vec::new();
        a.extend_from_slice(&i.to_ne_bytes());
        a.extend_from_slice(&0u32.to_ne_bytes());
        for v in [q, q + 0x2000, q + 0x1000, 0] {
            a.extend_from_slice(&v.to_ne_bytes());
        }
        send(&fe, SET_VRING_ADDR, &a, None);
    }
    for (i, k) in [(0u64, &kick0), (1, &kick1)] {
        send(&fe, SET_VRING_KICK, &i.to_ne_bytes(), Some(k.as_raw_fd()));
        let mut st = Vec::new();
        st.extend_from_slice(&(i as u32).to_ne_bytes());
        st.extend_from_slice(&1u32.to_ne_bytes());
        send(&fe, SET_VRING_ENABLE, &st, None);
    }

    // virt-pci's config read of the ids: a header out, 8 device-writable bytes in.
    let hdr = |op: u8, size: u32, addr: u64| {
        let mut h = vec![op, 0, 0, 0];
        h.extend_from_slice(&size.to_le_bytes());
        h.extend_from_slice(&addr.to_le_bytes());
        h
    };
    g.w(BUF, &hdr(1, 4, 0));
    g.desc(Q0, 0, BUF, 16, 1, 1);
    g.desc(Q0, 1, BUF + 0x100, 8, 2, 0);
    g.w(Q0 + 0x1000 + 4, &0u16.to_le_bytes());
    g.w(Q0 + 0x1000 + 2, &1u16.to_le_bytes());
    (&File(&kick0)).write_all(&1u64.to_ne_bytes()).unwrap();
    wait_used(&g, Q0, 1);
    assert_eq!(g.r(BUF + 0x100, 4), vec![0xb3, 0x15, 0x17, 0x10]);

    // An MMIO read of fw_rev from BAR0 (the init segment, big-endian): minor 35, major 16.
    g.w(BUF + 0x200, &hdr(3, 4, 0));
    g.desc(Q0, 2, BUF + 0x200, 16, 1, 3);
    g.desc(Q0, 3, BUF + 0x300, 4, 2, 0);
    g.w(Q0 + 0x1000 + 6, &2u16.to_le_bytes());
    g.w(Q0 + 0x1000 + 2, &2u16.to_le_bytes());
    (&File(&kick0)).write_all(&1u64.to_ne_bytes()).unwrap();
    wait_used(&g, Q0, 2);
    assert_eq!(g.r(BUF + 0x300, 4), vec![0x00, 0x23, 0x00, 0x10]);

    // UML going away ends the server cleanly.
    drop(fe);
    let (r, stats) = server.join().unwrap();
    assert_eq!(r, Ok(()));
    assert_eq!((stats.cfg_reads, stats.mmio_reads, stats.rejected), (1, 1, 0));
    // SAFETY: our own mapping, no longer used.
    unsafe { libc::munmap(p, LEN) };
}

/// Writes to an fd we only borrow.
struct File<'a>(&'a OwnedFd);

impl Write for &File<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        // SAFETY: writing from a live buffer to a descriptor we hold open.
        let n = unsafe { libc::write(self.0.as_raw_fd(), b.as_ptr().cast(), b.len()) };
        if n < 0 {
            Err(std::io::Error::last_os_error())
        } else {
            Ok(n as usize)
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}
