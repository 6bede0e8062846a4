//! The bridge's event loop: one vhost-user connection from UML, its two virtqueues, and the device.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::ptr::NonNull;
use std::time::{Duration, Instant};

use mlx5_core::prm::{CmdStatus, DeliveryStatus, Opcode};

use crate::device::{msi_message, Device};
use crate::guest::{GuestMem, MappedMem, Region};
use crate::vhost::{self, Msg};
use crate::vring::Vring;

/// Queue 0 carries virt-pci's requests, queue 1 the device's interrupt messages.
const CMD_VQ: usize = 0;
const IRQ_VQ: usize = 1;
/// How often the BAR file is scanned for user doorbells. Not on every pass: a burst of virt-pci requests wakes
/// the loop once per request, and a scan per wake-up (some 2,300 registers) made the bridge fall behind the
/// guest's posted writes (mlx5_core's write-combining test posts 2,040 in a row) until virt-pci's queue was full.
const BAR_SCAN_PERIOD: Duration = Duration::from_millis(1);

/// One mapping of a shared memory fd, unmapped on drop.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<libc::c_void>,
    len: usize,
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr..ptr + len` is a mapping made by `mmap` in `set_mem_table` and unmapped only here. The
        // simulator may still hold a translation to it, but the device is dropped before the server's mappings
        // (field order in `Server`), and nothing touches it after.
        unsafe { libc::munmap(self.ptr.as_ptr(), self.len) };
    }
}

/// The bridge for one UML instance.
#[derive(Debug)]
pub struct Server {
    sock: UnixStream,
    pub dev: Device,
    mem: MappedMem,
    rings: [Vring; 2],
    kick: [Option<File>; 2],
    call: [Option<File>; 2],
    _slave: Option<OwnedFd>,
    pending_msi: VecDeque<u32>,
    start: Instant,
    trace: Option<File>,
    verbose: bool,
    /// The BAR file user doorbells land in (`--bar-file`), scanned every millisecond (`BAR_SCAN_PERIOD`).
    pub bar_file: Option<crate::barfile::BarFile>,
    /// When the BAR file is next scanned.
    next_bar_scan: Instant,
    // Last, so the device and memory view are gone before the mappings are.
    maps: Vec<Mapping>,
}

impl Server {
    pub fn new(sock: UnixStream, dev: Device, trace: Option<File>, verbose: bool) -> Self {
        Self {
            sock,
            dev,
            // SAFETY: no regions yet.
            mem: unsafe { MappedMem::new(Vec::new()) },
            rings: [Vring::default(), Vring::default()],
            kick: [None, None],
            call: [None, None],
            _slave: None,
            pending_msi: VecDeque::new(),
            start: Instant::now(),
            trace,
            verbose,
            bar_file: None,
            next_bar_scan: Instant::now(),
            maps: Vec::new(),
        }
    }

    /// Serves until UML closes the connection.
    pub fn run(&mut self) -> io::Result<()> {
        loop {
            let mut fds = [
                libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd {
                    fd: self.kick[0].as_ref().map_or(-1, |f| f.as_raw_fd()),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.kick[1].as_ref().map_or(-1, |f| f.as_raw_fd()),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: `fds` is a valid array of pollfd for the call; negative fds are ignored by poll.
            let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 1) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(e);
                }
            }
            if fds[0].revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0 {
                match vhost::recv(&self.sock)? {
                    Some(msg) => self.message(msg)?,
                    None => break,
                }
            }
            for (i, f) in fds[1..].iter().enumerate() {
                if f.revents & libc::POLLIN != 0 {
                    if let Some(k) = &mut self.kick[i] {
                        let mut b = [0u8; 8];
                        let _ = k.read(&mut b);
                    }
                }
            }
            self.serve(Instant::now())?;
        }
        self.write_trace();
        Ok(())
    }

    /// One pass of device work at time `now`: requests, user doorbells (once a period), time, interrupts, the
    /// trace.
    fn serve(&mut self, now: Instant) -> io::Result<()> {
        let mut served = false;
        if !self.mem.regions().is_empty() && self.rings[CMD_VQ].is_ready() {
            if let Ok(n) = self.rings[CMD_VQ].backlog(&self.mem) {
                let s = &mut self.dev.stats;
                s.max_backlog = s.max_backlog.max(n);
                if n >= self.rings[CMD_VQ].num {
                    s.full_queue += 1;
                }
            }
            loop {
                let chain = match self.rings[CMD_VQ].pop(&self.mem) {
                    Ok(Some(c)) => c,
                    Ok(None) => break,
                    Err(e) => return Err(io::Error::other(format!("cmd queue: {e:?}"))),
                };
                let rejected = self.dev.stats.rejected;
                let (resp, msis) = self.dev.handle(&chain.out);
                if self.dev.stats.rejected != rejected {
                    // Which shape the refused chain had (a header-only write with a device-writable part is a
                    // read whose header was overwritten in the guest: see ARCHITECTURE, "Linux's driver as judge").
                    eprintln!("mlx5-uml-bridge: the rejected chain has {} device-writable bytes", chain.in_len());
                }
                let written = Vring::fill(&self.mem, &chain, &resp).map_err(|e| io::Error::other(format!("{e:?}")))?;
                self.rings[CMD_VQ]
                    .push_used(&self.mem, chain.head, written)
                    .map_err(|e| io::Error::other(format!("{e:?}")))?;
                self.pending_msi.extend(msis);
                served = true;
            }
        }
        if served {
            self.notify(CMD_VQ);
        }
        // Doorbells user processes wrote into their mapped UAR pages since the last scan.
        if let Some(bar) = self.bar_file.as_mut().filter(|_| now >= self.next_bar_scan) {
            self.next_bar_scan = now + BAR_SCAN_PERIOD;
            self.dev.stats.bar_scans += 1;
            for (off, bytes) in bar.changed() {
                self.dev.stats.user_doorbells += 1;
                let msis = self.dev.bar_write(off, &bytes);
                self.pending_msi.extend(msis);
            }
        }
        let t = u64::try_from(now.saturating_duration_since(self.start).as_nanos()).unwrap_or(u64::MAX);
        self.dev.tick(t);
        let msis = self.dev.take_msis();
        self.pending_msi.extend(msis);
        self.deliver()?;
        self.write_trace();
        Ok(())
    }

    /// Sends pending MSIs through the buffers the guest posted on the irq queue.
    fn deliver(&mut self) -> io::Result<()> {
        let mut sent = false;
        while let Some(&data) = self.pending_msi.front() {
            if !self.rings[IRQ_VQ].is_ready() || self.mem.regions().is_empty() {
                break;
            }
            let chain = match self.rings[IRQ_VQ].pop(&self.mem) {
                Ok(Some(c)) => c,
                // No buffer posted: the message waits for the next pass.
                Ok(None) => break,
                Err(e) => return Err(io::Error::other(format!("irq queue: {e:?}"))),
            };
            let m = msi_message(data);
            let written = Vring::fill(&self.mem, &chain, &m).map_err(|e| io::Error::other(format!("{e:?}")))?;
            self.rings[IRQ_VQ]
                .push_used(&self.mem, chain.head, written)
                .map_err(|e| io::Error::other(format!("{e:?}")))?;
            self.pending_msi.pop_front();
            sent = true;
        }
        if sent {
            self.notify(IRQ_VQ);
        }
        Ok(())
    }

    fn notify(&mut self, q: usize) {
        if let Some(c) = &mut self.call[q] {
            let _ = c.write(&1u64.to_ne_bytes());
        }
    }

    /// Appends the commands completed since the last call, one JSON line each in the form `mlx5 trace decode`
    /// reads (`CmdRecord::write_json`'s keys: the input and output in hex), plus `t_ms` and `name`.
    fn write_trace(&mut self) {
        let Some(t) = &mut self.trace else { return };
        let hex = |b: &[u8]| b.iter().map(|x| format!("{x:02x}")).collect::<String>();
        for m in self.dev.sim.take_messages() {
            let c = m.cmd;
            let name = Opcode::from_raw(c.opcode).name().unwrap_or("UNKNOWN");
            let (delivery, status, raw) = match DeliveryStatus::from_raw(c.delivery) {
                DeliveryStatus::Ok => {
                    ("OK", CmdStatus::from_raw(c.status).name().unwrap_or("UNKNOWN"), i32::from(c.status))
                }
                d => (d.name().unwrap_or("UNKNOWN"), "NONE", -1),
            };
            let output = m.output.as_deref().map_or("null".to_string(), |o| format!("\"{}\"", hex(o)));
            let _ = writeln!(
                t,
                "{{\"t_ms\":{},\"slot\":{},\"token\":0,\"opcode\":\"{name}\",\"opcode_raw\":{},\"name\":\"{name}\",\"op_mod\":{},\"input\":\"{}\",\"output\":{output},\"delivery\":\"{delivery}\",\"status\":\"{status}\",\"status_raw\":{raw},\"syndrome\":{},\"waited_us\":0}}",
                self.start.elapsed().as_millis(),
                c.slot,
                c.opcode,
                c.op_mod,
                hex(&m.input),
                c.syndrome,
            );
        }
    }

    fn message(&mut self, msg: Msg) -> io::Result<()> {
        use vhost::*;
        let bad = |e: ProtoError| io::Error::new(io::ErrorKind::InvalidData, e.to_string());
        if self.verbose {
            eprintln!("vhost-user: request {} size {} fds {}", msg.request, msg.payload.len(), msg.fds.len());
        }
        let ring = |i: u32| -> io::Result<usize> {
            usize::try_from(i)
                .ok()
                .filter(|&i| i < 2)
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("vring {i}")))
        };
        match msg.request {
            GET_FEATURES => reply(&self.sock, msg.request, &(F_VERSION_1 | F_PROTOCOL_FEATURES).to_ne_bytes())?,
            GET_PROTOCOL_FEATURES => reply(&self.sock, msg.request, &PROTOCOL_F_SLAVE_REQ.to_ne_bytes())?,
            GET_QUEUE_NUM => reply(&self.sock, msg.request, &2u64.to_ne_bytes())?,
            SET_FEATURES | SET_PROTOCOL_FEATURES => {
                parse_u64(msg.request, &msg.payload).map_err(bad)?;
            }
            SET_OWNER | RESET_OWNER => {}
            SET_SLAVE_REQ_FD => self._slave = msg.fds.into_iter().next(),
            SET_MEM_TABLE => self.set_mem_table(&msg)?,
            SET_VRING_NUM => {
                let (i, num) = parse_vring_state(msg.request, &msg.payload).map_err(bad)?;
                let num = u16::try_from(num)
                    .ok()
                    .filter(|n| n.is_power_of_two() && *n <= 1 << 15)
                    .ok_or_else(|| bad(ProtoError::BadRingSize(num)))?;
                self.rings[ring(i)?].num = num;
            }
            SET_VRING_BASE => {
                let (i, base) = parse_vring_state(msg.request, &msg.payload).map_err(bad)?;
                let r = &mut self.rings[ring(i)?];
                r.last_avail = base as u16;
                r.used_idx = base as u16;
            }
            GET_VRING_BASE => {
                let (i, _) = parse_vring_state(msg.request, &msg.payload).map_err(bad)?;
                let r = &mut self.rings[ring(i)?];
                let mut p = [0u8; 8];
                p[..4].copy_from_slice(&i.to_ne_bytes());
                p[4..].copy_from_slice(&u32::from(r.last_avail).to_ne_bytes());
                // The ring stops.
                *r = Vring::default();
                reply(&self.sock, msg.request, &p)?;
            }
            SET_VRING_ADDR => {
                let (i, desc, used, avail) = parse_vring_addr(&msg.payload).map_err(bad)?;
                let r = &mut self.rings[ring(i)?];
                r.desc = desc;
                r.used = used;
                r.avail = avail;
            }
            SET_VRING_KICK | SET_VRING_CALL => {
                let (i, has_fd) = parse_vring_fd(msg.request, &msg.payload).map_err(bad)?;
                let f = if has_fd { msg.fds.into_iter().next().map(File::from) } else { None };
                let slot = if msg.request == SET_VRING_KICK { &mut self.kick } else { &mut self.call };
                slot[ring(i)?] = f;
            }
            SET_VRING_ERR | SET_VRING_ENABLE => {}
            other => eprintln!("mlx5-uml-bridge: vhost-user request {other} not handled"),
        }
        Ok(())
    }

    fn set_mem_table(&mut self, msg: &Msg) -> io::Result<()> {
        let regions = vhost::parse_mem_table(&msg.payload)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))?;
        if regions.len() != msg.fds.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "memory table: one fd per region expected"));
        }
        if !self.maps.is_empty() {
            return Err(io::Error::new(io::ErrorKind::Unsupported, "a second memory table"));
        }
        let mut view = Vec::new();
        for (r, fd) in regions.iter().zip(&msg.fds) {
            let len = usize::try_from(r.size).map_err(|_| io::Error::other("region size"))?;
            let off = libc::off_t::try_from(r.mmap_offset).map_err(|_| io::Error::other("region offset"))?;
            // SAFETY: a fresh shared mapping of the fd UML passed; failure is checked below.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    fd.as_raw_fd(),
                    off,
                )
            };
            if p == libc::MAP_FAILED {
                return Err(io::Error::last_os_error());
            }
            let ptr = NonNull::new(p).ok_or_else(|| io::Error::other("mmap returned null"))?;
            self.maps.push(Mapping { ptr, len });
            let host = ptr.cast::<u8>();
            // UML gives guest and user addresses equal (its physical addresses); rings use the latter.
            view.push(Region { guest_addr: r.user_addr, len, host });
            // SAFETY: the mapping lives in `self.maps` until the server drops, after the device.
            unsafe { self.dev.sim.map_guest_memory(r.guest_addr, host, len) }
                .map_err(|e| io::Error::other(format!("mapping guest memory for DMA: {e:?}")))?;
            eprintln!("mlx5-uml-bridge: guest memory 0x{:x}..0x{:x} shared", r.guest_addr, r.guest_addr + r.size);
        }
        // SAFETY: each region is a live mapping kept in `self.maps` for the server's life.
        self.mem = unsafe { MappedMem::new(view) };
        Ok(())
    }

    /// Guest memory as the rings see it (for diagnostics).
    pub fn guest(&self) -> &dyn GuestMem {
        &self.mem
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::barfile::BarFile;
    use crate::device::{HDR, OP_MMIO_WRITE};
    use crate::guest::Region;
    use mlx5_sim::{SimConfig, SimDevice};
    use std::os::unix::fs::FileExt;

    const BASE: u64 = 0x10_0000;
    const NUM: u16 = 8;
    const DESC: u64 = BASE;
    const AVAIL: u64 = BASE + 0x100;
    const USED: u64 = BASE + 0x200;
    const BUFS: u64 = BASE + 0x1000;

    /// A server over `mem` (guest memory at `BASE`) with its command queue set up and a BAR file watched.
    fn server(mem: &mut [u8], bar: &File) -> Server {
        let (sock, _) = UnixStream::pair().unwrap();
        let sim = SimDevice::new(SimConfig::default());
        let bar_size = sim.mmio().bar_size();
        let mut s = Server::new(sock, Device::new(sim, 0x020000), None, false);
        let host = NonNull::new(mem.as_mut_ptr()).unwrap();
        // SAFETY: `mem` outlives the server in each test (dropped after it) and is only reached through it.
        s.mem = unsafe { MappedMem::new(vec![Region { guest_addr: BASE, len: mem.len(), host }]) };
        s.rings[CMD_VQ] = Vring { num: NUM, desc: DESC, avail: AVAIL, used: USED, ..Vring::default() };
        s.bar_file = Some(BarFile::open(bar, mlx5_sim::FIRST_UAR_PAGE, bar_size, mlx5_sim::BF_REG_SIZE).unwrap());
        s
    }

    /// Makes request `n` available: a posted 8-byte BAR write (to a UAR page's free bytes, recorded and ignored
    /// by the device), one descriptor, as virt-pci adds it.
    fn post_write(mem: &dyn GuestMem, n: u16) {
        let put = |mem: &dyn GuestMem, at: u64, b: &[u8]| mem.write(at, b).unwrap();
        let slot = u64::from(n % NUM);
        let buf = BUFS + 0x40 * slot;
        let mut m = vec![OP_MMIO_WRITE, 0, 0, 0];
        m.extend_from_slice(&8u32.to_le_bytes());
        m.extend_from_slice(&((mlx5_sim::FIRST_UAR_PAGE * 4096 + 0x100) as u64).to_le_bytes());
        m.extend_from_slice(&[0; 8]);
        assert_eq!(m.len(), HDR + 8);
        put(mem, buf, &m);
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&buf.to_le_bytes());
        d[8..12].copy_from_slice(&(m.len() as u32).to_le_bytes());
        put(mem, DESC + 16 * slot, &d);
        put(mem, AVAIL + 4 + 2 * slot, &(slot as u16).to_le_bytes());
        put(mem, AVAIL + 2, &n.wrapping_add(1).to_le_bytes());
    }

    fn used_idx(s: &Server) -> u16 {
        s.guest().read_u16(USED + 2).unwrap()
    }

    fn bar_file(name: &str) -> (std::path::PathBuf, File) {
        let path = std::env::temp_dir().join(format!("mlx5-server-{name}-{}", std::process::id()));
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
        f.set_len(2 << 20).unwrap();
        (path, f)
    }

    #[test]
    fn a_burst_of_requests_is_served_with_one_bar_file_scan_per_period_and_doorbells_still_replayed() {
        let (path, f) = bar_file("burst");
        let mut mem = vec![0u8; 0x2000];
        let mut s = server(&mut mem, &f);
        let t0 = Instant::now() + Duration::from_secs(1);
        // Each posted write wakes the loop for one pass; within one period the BAR file is scanned once.
        for n in 0..64u16 {
            post_write(s.guest(), n);
            s.serve(t0).unwrap();
            assert_eq!(used_idx(&s), n + 1, "request {n} waits");
        }
        assert_eq!(s.dev.stats.bar_scans, 1);
        assert_eq!(s.dev.stats.mmio_writes, 64);
        // A CQ arm doorbell a process stores into its UAR page is replayed at the next period, once.
        let uar = (mlx5_sim::FIRST_UAR_PAGE + 1) * 4096;
        f.write_all_at(&[1; 8], (uar + mlx5_core::prm::consts::MLX5_CQ_DOORBELL as usize) as u64).unwrap();
        s.serve(t0).unwrap();
        assert_eq!(s.dev.stats.user_doorbells, 0);
        s.serve(t0 + BAR_SCAN_PERIOD).unwrap();
        s.serve(t0 + 2 * BAR_SCAN_PERIOD).unwrap();
        assert_eq!((s.dev.stats.user_doorbells, s.dev.stats.bar_scans), (1, 3));
        drop(s);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_full_command_queue_is_counted() {
        let (path, f) = bar_file("full");
        let mut mem = vec![0u8; 0x2000];
        let mut s = server(&mut mem, &f);
        for n in 0..NUM - 1 {
            post_write(s.guest(), n);
        }
        s.serve(Instant::now()).unwrap();
        assert_eq!((s.dev.stats.max_backlog, s.dev.stats.full_queue), (NUM - 1, 0));
        for n in NUM - 1..2 * NUM - 1 {
            post_write(s.guest(), n);
        }
        s.serve(Instant::now()).unwrap();
        assert_eq!((s.dev.stats.max_backlog, s.dev.stats.full_queue), (NUM, 1));
        assert_eq!(used_idx(&s), 2 * NUM - 1);
        drop(s);
        std::fs::remove_file(&path).unwrap();
    }
}
