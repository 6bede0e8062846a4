//! A VDE port's direct path (`vde.rs` plugs it in): a UNIX datagram socket of the port's own in its switch's
//! directory, named by its MAC, through which ports of one machine send each other frames past the switch, packed
//! several to a datagram. Its own file so the link's state (`port.rs`) can hold one without naming `vde.rs`.

use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Set to `0` to send every frame through the switch (no direct path).
pub(crate) const DIRECT_ENV: &str = "MLX5_SIM_VDE_DIRECT";

/// A port's direct socket in its switch's directory: this prefix and its MAC in hex.
pub(super) const DIRECT_PREFIX: &str = "mlx5-direct-";

/// How long the writer waits for a peer's direct socket to take a frame (its queue is full: the peer is not
/// reading) before it drops the frame and sends to that peer through the switch for [`DIRECT_RETRY`].
pub(super) const DIRECT_SEND_TIMEOUT: Duration = Duration::from_millis(50);

/// How long the writer sends to a peer through the switch after its direct socket failed (none: a QEMU guest, a
/// port on another switch, a port gone) before it tries the socket again.
pub(super) const DIRECT_RETRY: Duration = Duration::from_secs(1);

/// A port's direct path on a `vde_switch`: `rx`, bound at `<switch dir>/mlx5-direct-<MAC>`, receives frames
/// from ports of this machine on that switch; the writer sends to theirs ([`DirectPeers`], blocking for at most
/// [`DIRECT_SEND_TIMEOUT`]). The socket file is removed when the link closes (one a process left behind, by the next port
/// that plugs into the switch).
#[derive(Debug)]
pub(crate) struct Direct {
    pub(super) rx: UnixDatagram,
    path: PathBuf,
    /// The socket file's inode, so only this port's file is removed.
    ino: u64,
    dir: PathBuf,
    /// The sockets to the peers and the packing buffer, shared by the writer and a sender that sends at once
    /// (`VdeLink::send_now`); whoever holds it sends, so frames to one peer leave in the order they were made.
    pub(super) tx: Mutex<DirectTx>,
}

/// The direct path's sending state ([`Direct::tx`]).
#[derive(Debug, Default)]
pub(super) struct DirectTx {
    pub(super) peers: DirectPeers,
    pub(super) pack: Vec<u8>,
}

impl Direct {
    /// The switch directory a libvdeplug URL names (`vde:///dir`, or a bare path), if it holds a switch's
    /// control socket; `None` for other fabrics (`vxvde://`, `udp://`, a port number `[N]`, ...).
    pub(super) fn switch_dir(url: &str) -> Option<PathBuf> {
        let path = match url.strip_prefix("vde://") {
            Some(p) => p,
            None if !url.contains("://") => url,
            None => return None,
        };
        let dir = Path::new(path);
        (dir.is_absolute() && !path.contains('[') && dir.join("ctl").exists()).then(|| dir.to_path_buf())
    }

    pub(super) fn socket(dir: &Path, mac: [u8; 6]) -> PathBuf {
        let hex: String = mac.iter().map(|b| format!("{b:02x}")).collect();
        dir.join(format!("{DIRECT_PREFIX}{hex}"))
    }

    /// Binds the port's socket in `dir`. `None` (frames go through the switch) when the direct path is turned
    /// off, the path is too long for a socket, or a live port already has this MAC.
    pub(super) fn open(dir: &Path, mac: [u8; 6]) -> Option<Direct> {
        if std::env::var(DIRECT_ENV).is_ok_and(|v| v == "0") {
            return None;
        }
        Direct::sweep(dir);
        let path = Direct::socket(dir, mac);
        // A live port with this MAC keeps its socket (bind fails); a stale one was swept.
        let rx = UnixDatagram::bind(&path).ok()?;
        let ino = std::os::unix::fs::MetadataExt::ino(&std::fs::symlink_metadata(&path).ok()?);
        let tx = Mutex::new(DirectTx { peers: DirectPeers::default(), pack: Vec::with_capacity(DIRECT_DATAGRAM) });
        let direct = Direct { rx, path, ino, dir: dir.to_path_buf(), tx };
        direct.rx.set_nonblocking(true).ok()?;
        Some(direct)
    }

    /// Removes the direct sockets in `dir` that nobody reads (their ports' processes ended without closing
    /// them), so they do not pile up.
    fn sweep(dir: &Path) {
        let Ok(entries) = std::fs::read_dir(dir) else { return };
        let Ok(probe) = UnixDatagram::unbound() else { return };
        for e in entries.flatten() {
            let path = e.path();
            let ours = e.file_name().to_str().is_some_and(|n| n.starts_with(DIRECT_PREFIX));
            if ours && probe.connect(&path).is_err_and(|e| e.kind() == io::ErrorKind::ConnectionRefused) {
                let _ = std::fs::remove_file(&path);
            }
        }
    }

    /// Removes the socket file if it is still this port's.
    pub(super) fn unlink(&self) {
        let ino = std::fs::symlink_metadata(&self.path).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
        if ino.is_ok_and(|i| i == self.ino) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

impl Drop for Direct {
    fn drop(&mut self) {
        self.unlink();
    }
}

/// What the writer knows of its peers' direct sockets: a socket connected to a peer's (so a send looks up no
/// path), or until when the peer is reached through the switch. At most [`MAX_DIRECT_PEERS`] (the oldest goes
/// first).
#[derive(Debug, Default)]
pub(super) struct DirectPeers(Vec<([u8; 6], Result<UnixDatagram, Instant>)>);

/// Peers the writer keeps a connected socket (a descriptor) or a failure for, at most.
const MAX_DIRECT_PEERS: usize = 64;

/// What became of frames offered to the direct path.
pub(super) enum DirectSend {
    /// Sent (all of them).
    Sent,
    /// A send that may not wait found the peer's queue full: the rest waits for the writer.
    Busy,
    /// The peer's socket did not take the next datagram in time: its frames (this many) are dropped.
    TimedOut(usize),
    /// No direct path to the peer: send the next frame through the switch.
    Switch,
}

impl DirectPeers {
    fn connect(d: &Direct, dst: [u8; 6], now: Instant) -> Result<UnixDatagram, Instant> {
        let s = UnixDatagram::unbound().map_err(|_| now + DIRECT_RETRY)?;
        s.connect(Direct::socket(&d.dir, dst)).map_err(|_| now + DIRECT_RETRY)?;
        s.set_write_timeout(Some(DIRECT_SEND_TIMEOUT)).map_err(|_| now + DIRECT_RETRY)?;
        Ok(s)
    }

    /// Sends `frames` (all to one MAC) on the direct path, packed into as few datagrams as fit
    /// ([`DIRECT_DATAGRAM`]): how many went, and what became of the next ([`DirectSend::Sent`]: none left).
    /// Without `wait` a full peer queue ends it at once ([`DirectSend::Busy`]; the writer then waits for it).
    pub(super) fn send(
        &mut self,
        d: &Direct,
        frames: &[Vec<u8>],
        pack: &mut Vec<u8>,
        wait: bool,
    ) -> (usize, DirectSend) {
        let Some(dst) = frames.first().and_then(|f| dst_mac(f)) else {
            return (0, DirectSend::Switch);
        };
        if dst[0] & 1 != 0 {
            return (0, DirectSend::Switch);
        }
        let now = Instant::now();
        let at = match self.0.iter().position(|(m, _)| *m == dst) {
            Some(i) => {
                if matches!(self.0[i].1, Err(until) if now >= until) {
                    self.0[i].1 = DirectPeers::connect(d, dst, now);
                }
                i
            }
            None => {
                if self.0.len() >= MAX_DIRECT_PEERS {
                    let _ = self.0.remove(0);
                }
                self.0.push((dst, DirectPeers::connect(d, dst, now)));
                self.0.len() - 1
            }
        };
        let Ok(sock) = &self.0[at].1 else { return (0, DirectSend::Switch) };
        let mut sent = 0;
        while sent < frames.len() {
            let k = pack_frames(&frames[sent..], pack);
            let flags = if wait { 0 } else { libc::MSG_DONTWAIT };
            // SAFETY: `pack` is valid for reads of its length; the socket is open (owned by `sock`).
            let n = unsafe { libc::send(sock.as_raw_fd(), pack.as_ptr().cast(), pack.len(), flags) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                if !wait && e.kind() == io::ErrorKind::WouldBlock {
                    return (sent, DirectSend::Busy);
                }
                self.0[at].1 = Err(now + DIRECT_RETRY);
                return match e.kind() {
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => (sent, DirectSend::TimedOut(k)),
                    _ => (sent, DirectSend::Switch),
                };
            }
            sent += k;
        }
        (sent, DirectSend::Sent)
    }
}

/// A frame's destination MAC.
pub(super) fn dst_mac(frame: &[u8]) -> Option<[u8; 6]> {
    frame.get(..6).and_then(|m| <[u8; 6]>::try_from(m).ok())
}

/// The most bytes of one datagram on the direct path (frames and their length prefixes).
pub(super) const DIRECT_DATAGRAM: usize = 60 * 1024;

/// Packs the first of `frames` and as many after it as fit in [`DIRECT_DATAGRAM`] bytes into `pack`, each a
/// 2-byte big-endian length and the frame (so a batch of frames costs one send and one receive, and each frame
/// is still checked on its own at the receiver); how many.
pub(super) fn pack_frames(frames: &[Vec<u8>], pack: &mut Vec<u8>) -> usize {
    pack.clear();
    let mut k = 0;
    for f in frames {
        if k > 0 && pack.len() + 2 + f.len() > DIRECT_DATAGRAM {
            break;
        }
        // Frames are at most MAX_ETH_FRAME bytes (`VdeLink::queue`).
        pack.extend_from_slice(&(f.len() as u16).to_be_bytes());
        pack.extend_from_slice(f);
        k += 1;
    }
    k
}

/// The frames of a direct-path datagram ([`pack_frames`]); `Err` at the first length that overruns it, after
/// the frames before it.
pub(super) fn unpack_frames(mut d: &[u8], mut each: impl FnMut(&[u8]) -> bool) -> Result<(), ()> {
    while !d.is_empty() {
        let len = usize::from(u16::from_be_bytes([d[0], *d.get(1).ok_or(())?]));
        let frame = d.get(2..2 + len).ok_or(())?;
        if !each(frame) {
            return Ok(());
        }
        d = &d[2 + len..];
    }
    Ok(())
}
