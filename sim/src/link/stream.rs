//! The VDE fabric's point-to-point transport: Ethernet frames on a byte stream in QEMU's `-netdev stream` (or
//! `-netdev socket`) framing, each a 4-byte big-endian length followed by the bare frame (no FCS, no padding),
//! over TCP (`wire=listen` / `wire=connect`, `tcp.rs`) or a UNIX socket (a QEMU guest NIC, `guest.rs`).
//! `StreamConn` is the fabric's frame connection (`Datagrams`) over such a stream, so the fabric's logic
//! (`vde.rs`: addressing, ARP, IB frames, counters) is the same on a switch and on a cable. Plain sockets: no
//! libvdeplug needed.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Mutex;
use std::time::Duration;

use super::datagrams::Datagrams;

/// The largest frame accepted: a length above it means the stream is not QEMU's framing (or is out of step), and
/// the link fails rather than allocating or skipping blindly.
pub const MAX_STREAM_FRAME: usize = 65536;

/// Reads the next frame into `buf` (at least [`MAX_STREAM_FRAME`] long is always enough); returns its length.
/// `Ok(None)` is a clean end of stream between frames.
pub fn read_frame<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<Option<usize>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 || n > MAX_STREAM_FRAME || n > buf.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("stream frame length {n}")));
    }
    r.read_exact(&mut buf[..n])?;
    Ok(Some(n))
}

/// Writes one frame with its length prefix, in one `write_all` of the prefix and one of the frame.
pub fn write_frame<W: Write>(w: &mut W, frame: &[u8]) -> io::Result<()> {
    if frame.is_empty() || frame.len() > MAX_STREAM_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("frame of {} bytes", frame.len())));
    }
    w.write_all(&(frame.len() as u32).to_be_bytes())?;
    w.write_all(frame)
}

/// How long the rest of a frame may take once its first byte is in: a peer that stops mid-frame takes the link
/// down instead of holding the reader.
pub(crate) const FRAME_TIMEOUT: Duration = Duration::from_secs(5);

/// The socket a stream transport runs on.
#[derive(Debug)]
pub(crate) enum Sock {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Sock {
    fn read(&self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Sock::Tcp(s) => (&*s).read(buf),
            Sock::Unix(s) => (&*s).read(buf),
        }
    }

    fn write_all(&self, buf: &[u8]) -> io::Result<()> {
        match self {
            Sock::Tcp(s) => (&*s).write_all(buf),
            Sock::Unix(s) => (&*s).write_all(buf),
        }
    }

    fn fd(&self) -> i32 {
        match self {
            Sock::Tcp(s) => s.as_raw_fd(),
            Sock::Unix(s) => s.as_raw_fd(),
        }
    }

    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Sock::Tcp(s) => s.set_read_timeout(t),
            Sock::Unix(s) => s.set_read_timeout(t),
        }
    }

    /// Ends the connection both ways: the peer sees it close, and a reader or writer here returns.
    pub(crate) fn shutdown(&self) {
        let _ = match self {
            Sock::Tcp(s) => s.shutdown(Shutdown::Both),
            Sock::Unix(s) => s.shutdown(Shutdown::Both),
        };
    }
}

/// The fabric's frame connection over a stream: one writer (the link's writer thread) and one reader (its reader
/// thread) at once. Frames queued together are written in one call, each after its length; the reader reads
/// ahead into a buffer of its own and hands out whole frames. A bad length (not QEMU's framing), a stream that
/// ends mid-frame or a peer silent mid-frame for [`FRAME_TIMEOUT`] is the end of the connection (`recv` returns
/// -1, and the link goes down): a stream that lost its framing cannot be trusted again.
#[derive(Debug)]
pub(crate) struct StreamConn {
    sock: Sock,
    /// The writer's buffer (length prefixes and frames, sent in one call).
    out: Mutex<Vec<u8>>,
    /// Bytes read and not yet handed out.
    rx: Mutex<ReadAhead>,
}

/// A stream's bytes read ahead: `buf[start..end]` is what is not handed out yet.
#[derive(Debug)]
struct ReadAhead {
    buf: Vec<u8>,
    start: usize,
    end: usize,
}

/// Bytes a stream reads ahead at most: room for several frames, and always for one whole frame once what was
/// handed out is dropped.
const READ_AHEAD: usize = 4 * (4 + MAX_STREAM_FRAME);

impl ReadAhead {
    /// The next whole frame, copied into `out`: its length; `Ok(None)` while it is not all in; an error for a
    /// length that is not the framing's.
    fn take(&mut self, out: &mut [u8]) -> io::Result<Option<usize>> {
        let have = &self.buf[self.start..self.end];
        if have.len() < 4 {
            return Ok(None);
        }
        let n = u32::from_be_bytes([have[0], have[1], have[2], have[3]]) as usize;
        if n == 0 || n > MAX_STREAM_FRAME || n > out.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, format!("stream frame length {n}")));
        }
        if have.len() < 4 + n {
            return Ok(None);
        }
        out[..n].copy_from_slice(&have[4..4 + n]);
        self.start += 4 + n;
        if self.start == self.end {
            (self.start, self.end) = (0, 0);
        }
        Ok(Some(n))
    }

    /// Whether a whole frame (or a bad length, which `take` then reports) is waiting.
    fn ready(&self) -> bool {
        let have = &self.buf[self.start..self.end];
        have.len() >= 4 && {
            let n = u32::from_be_bytes([have[0], have[1], have[2], have[3]]) as usize;
            n == 0 || n > MAX_STREAM_FRAME || have.len() >= 4 + n
        }
    }
}

impl StreamConn {
    pub(crate) fn new(sock: Sock) -> io::Result<StreamConn> {
        if let Sock::Tcp(s) = &sock {
            // A ping-pong's frames go at once, not after Nagle's wait for the previous one's ACK.
            s.set_nodelay(true)?;
        }
        sock.set_read_timeout(Some(FRAME_TIMEOUT))?;
        Ok(StreamConn {
            sock,
            out: Mutex::new(Vec::with_capacity(4 + MAX_STREAM_FRAME)),
            rx: Mutex::new(ReadAhead { buf: vec![0; READ_AHEAD], start: 0, end: 0 }),
        })
    }
}

impl Datagrams for StreamConn {
    fn send(&self, frame: &[u8]) -> isize {
        match self.send_many(std::slice::from_ref(&frame.to_vec())) {
            n if n < 0 => -1,
            0 => 0,
            _ => frame.len() as isize,
        }
    }

    fn send_many(&self, frames: &[Vec<u8>]) -> isize {
        let mut out = self.out.lock().unwrap_or_else(|e| e.into_inner());
        out.clear();
        let mut sent = 0;
        for f in frames {
            // Not a frame this framing carries: not sent (the fabric checks lengths before it gets here).
            if f.is_empty() || f.len() > MAX_STREAM_FRAME {
                continue;
            }
            out.extend_from_slice(&(f.len() as u32).to_be_bytes());
            out.extend_from_slice(f);
            sent += 1;
        }
        if out.is_empty() {
            return 0;
        }
        let result = self.sock.write_all(&out);
        // A burst's buffer is not kept (a 1 MiB IB message would stay allocated per link).
        if out.capacity() > 4 * (4 + MAX_STREAM_FRAME) {
            *out = Vec::with_capacity(4 + MAX_STREAM_FRAME);
        }
        match result {
            Ok(()) => sent,
            Err(_) => -1,
        }
    }

    fn recv(&self, buf: &mut [u8]) -> isize {
        let mut r = self.rx.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match r.take(buf) {
                Ok(Some(n)) => return n as isize,
                Ok(None) => {}
                Err(_) => return -1,
            }
            // Not all in: make room at the end, then read what the socket has (the first read after `poll` said
            // readable does not block; the rest of a frame may, up to the read timeout).
            if r.end == r.buf.len() {
                let (start, end) = (r.start, r.end);
                r.buf.copy_within(start..end, 0);
                (r.start, r.end) = (0, end - start);
            }
            let end = r.end;
            match self.sock.read(&mut r.buf[end..]) {
                Ok(0) => return -1,
                Ok(k) => r.end += k,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return -1,
            }
        }
    }

    fn pending(&self) -> bool {
        self.rx.lock().unwrap_or_else(|e| e.into_inner()).ready()
    }

    fn fds(&self) -> (i32, i32) {
        (self.sock.fd(), -1)
    }

    fn shut(&self) {
        self.sock.shutdown();
    }
}

/// The ethertype of a stream link's hello (IEEE 802 local experimental ethertype 2; the IB frames have 1).
pub const ETHERTYPE_HELLO: u16 = 0x88b6;

/// Bytes of a hello: Ethernet header, `MLX5`, the link layer (1: InfiniBand), the LID, GID index 0.
pub(crate) const HELLO_LEN: usize = 14 + 4 + 1 + 2 + 16;

/// What a hello says: the sender's port is InfiniBand, its LID, GID index 0 and MAC (the frame's source).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hello {
    pub(crate) ib: bool,
    pub(crate) lid: u16,
    pub(crate) gid: [u8; 16],
    pub(crate) mac: [u8; 6],
}

impl Hello {
    /// The first frame each end of a TCP stream sends (broadcast, from the port's MAC): the far end learns that
    /// a fabric port is there, and whether it has this port's own address.
    pub(crate) fn frame(&self) -> Vec<u8> {
        let mut f = Vec::with_capacity(HELLO_LEN);
        f.extend_from_slice(&[0xff; 6]);
        f.extend_from_slice(&self.mac);
        f.extend_from_slice(&ETHERTYPE_HELLO.to_be_bytes());
        f.extend_from_slice(b"MLX5");
        f.push(u8::from(self.ib));
        f.extend_from_slice(&self.lid.to_be_bytes());
        f.extend_from_slice(&self.gid);
        f
    }

    /// Whether `f` is a hello frame (its ethertype), and what it says if it is well formed.
    pub(crate) fn parse(f: &[u8]) -> Option<Result<Hello, &'static str>> {
        if f.get(12..14) != Some(&ETHERTYPE_HELLO.to_be_bytes()[..]) {
            return None;
        }
        if f.len() != HELLO_LEN || &f[14..18] != b"MLX5" || f[18] > 1 {
            return Some(Err("malformed hello on the stream"));
        }
        let (mut gid, mut mac) = ([0u8; 16], [0u8; 6]);
        gid.copy_from_slice(&f[21..37]);
        mac.copy_from_slice(&f[6..12]);
        Some(Ok(Hello { ib: f[18] == 1, lid: u16::from_be_bytes([f[19], f[20]]), gid, mac }))
    }

    /// Whether the two ends are one port's address (link layer, LID, GID and MAC): two simulated devices made
    /// with one configuration. The LID a port has before a subnet manager assigns one, and a GUID two bridges may
    /// share, do not alone make a twin.
    pub(crate) fn same_port(&self, other: &Hello) -> bool {
        self == other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn framing_fixture_both_ways() {
        let mut out = Vec::new();
        write_frame(&mut out, &[1, 2, 3]).unwrap();
        assert_eq!(out, [0, 0, 0, 3, 1, 2, 3]);
        let mut buf = [0u8; 16];
        let mut r = &out[..];
        assert_eq!(read_frame(&mut r, &mut buf).unwrap(), Some(3));
        assert_eq!(buf[..3], [1, 2, 3]);
        assert_eq!(read_frame(&mut r, &mut buf).unwrap(), None);
    }

    #[test]
    fn bad_lengths_fail_the_link() {
        let mut buf = [0u8; 16];
        let zero: &[u8] = &[0, 0, 0, 0];
        assert_eq!(read_frame(&mut &zero[..], &mut buf).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let huge: &[u8] = &[0, 1, 0, 1];
        assert_eq!(read_frame(&mut &huge[..], &mut buf).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let cut: &[u8] = &[0, 0, 0, 3, 1];
        assert_eq!(read_frame(&mut &cut[..], &mut buf).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        let half: &[u8] = &[0, 0];
        assert_eq!(read_frame(&mut &half[..], &mut buf).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        assert!(write_frame(&mut Vec::new(), &[]).is_err());
    }

    /// The fabric's connection reads ahead: several frames in one read come out one by one (`pending` says so),
    /// a frame split across writes comes out whole, and a length that is not the framing's ends the connection.
    #[test]
    fn a_stream_conn_hands_out_whole_frames_however_they_arrive() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let conn = StreamConn::new(Sock::Unix(a)).unwrap();
        let mut burst = Vec::new();
        for n in [60usize, 1514, 9000] {
            write_frame(&mut burst, &vec![n as u8; n]).unwrap();
        }
        b.write_all(&burst).unwrap();
        let mut buf = vec![0u8; MAX_STREAM_FRAME];
        for n in [60usize, 1514, 9000] {
            assert_eq!(conn.recv(&mut buf), n as isize);
            assert!(buf[..n].iter().all(|&x| x == n as u8));
        }
        assert!(!conn.pending());
        // One frame in three writes: the reader waits for its rest.
        let mut f = Vec::new();
        write_frame(&mut f, &[7u8; 3000]).unwrap();
        let t = std::thread::spawn(move || {
            for part in [&f[..2], &f[2..100], &f[100..]] {
                b.write_all(part).unwrap();
                std::thread::sleep(Duration::from_millis(20));
            }
            b
        });
        assert_eq!(conn.recv(&mut buf), 3000);
        let mut b = t.join().unwrap();
        // Two frames and a bad length in one write: the two, then the end.
        let mut tail = Vec::new();
        write_frame(&mut tail, &[1, 2, 3]).unwrap();
        write_frame(&mut tail, &[4, 5]).unwrap();
        tail.extend_from_slice(&(MAX_STREAM_FRAME as u32 + 1).to_be_bytes());
        b.write_all(&tail).unwrap();
        assert_eq!(conn.recv(&mut buf), 3);
        assert!(conn.pending(), "the second frame was read with the first");
        assert_eq!(conn.recv(&mut buf), 2);
        assert_eq!(conn.recv(&mut buf), -1);
        // Frames written together by the writer side arrive as they were.
        let (c, mut d) = UnixStream::pair().unwrap();
        let out = StreamConn::new(Sock::Unix(c)).unwrap();
        assert_eq!(out.send_many(&[vec![9; 10], vec![], vec![8; 20]]), 2, "an empty frame is not sent");
        let mut got = vec![0u8; 64];
        assert_eq!(read_frame(&mut d, &mut got).unwrap(), Some(10));
        assert_eq!(read_frame(&mut d, &mut got).unwrap(), Some(20));
    }

    /// A peer that stops in the middle of a frame ends the connection once the read timeout passes (here
    /// shortened from [`FRAME_TIMEOUT`]) instead of holding the reader.
    #[test]
    fn a_peer_silent_mid_frame_ends_the_connection() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let conn = StreamConn::new(Sock::Unix(a)).unwrap();
        conn.sock.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
        b.write_all(&[0, 0, 0, 100, 1, 2, 3]).unwrap();
        let mut buf = vec![0u8; MAX_STREAM_FRAME];
        assert_eq!(conn.recv(&mut buf), -1);
        drop(b);
    }

    #[test]
    fn over_a_unix_socket() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            let mut buf = vec![0u8; MAX_STREAM_FRAME];
            let mut lens = Vec::new();
            while let Some(n) = read_frame(&mut b, &mut buf).unwrap() {
                lens.push((n, buf[n - 1]));
            }
            lens
        });
        for n in [42usize, 1514, 9000] {
            let f: Vec<u8> = (0..n).map(|i| i as u8).collect();
            write_frame(&mut a, &f).unwrap();
        }
        drop(a);
        assert_eq!(t.join().unwrap(), [(42, 41), (1514, (1513 % 256) as u8), (9000, (8999 % 256) as u8)]);
    }
}
