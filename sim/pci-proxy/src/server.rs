//! One x-pci-proxy-dev connection: requests served in order (QEMU waits for each reply), device time pulled to
//! wall time on every pass, device reset on DEVICE_RESET or a function-level reset.

use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::Instant;

use mlx5_core::hal::Mmio;
use mlx5_core::prm::{CmdStatus, Opcode};
use mlx5_sim::{ExecutedCmd, Mode, SimConfig, SimDevice, SimMmio};

use crate::config::{ConfigSpace, BAR0_SIZE};
use crate::memory::GuestRam;
use crate::msg::{self, BarAccess, MsgError, Request};

/// How long a (re)plug into the simulated wire may wait for the listener.
const WIRE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// How long a replug after a device reset may wait.
const REPLUG_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Why a session ended other than by QEMU closing the socket between messages.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("bad message from QEMU")]
    Msg(#[from] MsgError),
    #[error("replying to QEMU")]
    Reply(#[source] io::Error),
    #[error("waiting for QEMU")]
    Poll(#[source] io::Error),
}

/// What the guest asked for.
#[derive(Debug, Default, Clone, Copy)]
pub struct Stats {
    pub cfg_reads: u64,
    pub cfg_writes: u64,
    pub bar_reads: u64,
    pub bar_writes: u64,
    /// Accesses that could not be served (bad length, I/O space, outside BAR0, BAR unassigned): reads answer
    /// all ones, writes are dropped.
    pub rejected: u64,
    /// BAR writes narrower than the device's 32-bit registers (dropped).
    pub narrow_writes: u64,
    pub syncs: u64,
    /// SYNC_SYSMEM regions not mapped (each logged with its reason).
    pub bad_regions: u64,
    pub resets: u64,
}

/// The device behind one connection.
#[derive(Debug)]
pub struct Server {
    sock: UnixStream,
    sim_cfg: SimConfig,
    // Before `ram`, so the simulator's translations are gone before the mappings are.
    pub sim: SimDevice,
    mmio: SimMmio,
    pub cfg: ConfigSpace,
    pub stats: Stats,
    /// Every command completed, across resets.
    pub commands: Vec<ExecutedCmd>,
    cursor: usize,
    irqfds: Option<(OwnedFd, OwnedFd)>,
    start: Instant,
    trace: Option<File>,
    pub verbose: bool,
    /// The simulated wire this device's port is plugged into (`host:port` of another process's listener),
    /// plugged again after every reset.
    wire: Option<String>,
    pub ram: GuestRam,
}

impl Server {
    /// A server for `sock` (QEMU's end is the `fd=` of x-pci-proxy-dev) with a device of `sim_cfg`, class
    /// `0x020000` (Ethernet) or `0x020700` (InfiniBand).
    pub fn new(sock: UnixStream, sim_cfg: SimConfig, class: u32, trace: Option<File>) -> Self {
        let sim = SimDevice::new(sim_cfg.clone());
        let (vendor, device) = sim.config().pci_ids;
        Self {
            sock,
            sim_cfg,
            mmio: sim.mmio(),
            sim,
            cfg: ConfigSpace::new(vendor, device, class),
            stats: Stats::default(),
            commands: Vec::new(),
            cursor: 0,
            irqfds: None,
            start: Instant::now(),
            trace,
            verbose: false,
            wire: None,
            ram: GuestRam::default(),
        }
    }

    /// Plugs the port into the simulated wire listening at `addr` (another process, e.g. `mlx5 pingpong
    /// --server` on the simulator), now and after every device reset. The device should be threaded
    /// ([`Mode::Threaded`]) so its retry timers run in real time.
    pub fn plug_wire(&mut self, addr: &str) -> Result<(), mlx5_sim::WireError> {
        self.wire = Some(addr.to_string());
        self.sim.wire_connect(addr, WIRE_TIMEOUT)
    }

    /// Serves until QEMU closes the socket (`Ok`) or sends what cannot be served (`Err`; the socket is then
    /// closed, so QEMU's every later access fails and the guest reads all ones, as from a device gone).
    pub fn run(&mut self) -> Result<(), ServerError> {
        loop {
            let mut p = libc::pollfd { fd: self.sock.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd for the call.
            let n = unsafe { libc::poll(&mut p, 1, 1) };
            if n < 0 {
                let e = io::Error::last_os_error();
                if e.kind() != io::ErrorKind::Interrupted {
                    return Err(ServerError::Poll(e));
                }
            }
            if n > 0 {
                let r = match msg::recv(&self.sock) {
                    Ok(Some(m)) => Request::parse(m).map_err(ServerError::from).and_then(|r| self.serve(r)),
                    Ok(None) => break,
                    Err(e) => Err(e.into()),
                };
                if let Err(e) = r {
                    self.collect();
                    return Err(e);
                }
            }
            self.tick();
        }
        self.collect();
        Ok(())
    }

    /// Serves one request and sends its reply, if it has one.
    pub fn serve(&mut self, req: Request) -> Result<(), ServerError> {
        self.tick();
        let reply = match req {
            Request::CfgRead(c) => {
                self.stats.cfg_reads += 1;
                Some(Some(self.cfg.read(c.addr, c.len).map_or_else(|| self.reject(u64::MAX), u64::from)))
            }
            Request::CfgWrite(c) => {
                self.stats.cfg_writes += 1;
                match self.cfg.write(c.addr, c.len, c.val) {
                    Some(true) => {
                        self.reset();
                        Some(Some(0))
                    }
                    Some(false) => Some(Some(0)),
                    None => Some(Some(self.reject(u64::MAX))),
                }
            }
            Request::BarRead(a) => {
                self.stats.bar_reads += 1;
                Some(Some(self.bar_read(a)))
            }
            Request::BarWrite(a) => {
                self.stats.bar_writes += 1;
                self.bar_write(a);
                Some(Some(0))
            }
            Request::SyncSysmem(regions) => {
                self.stats.syncs += 1;
                for e in self.ram.sync(&regions, &self.sim) {
                    self.stats.bad_regions += 1;
                    eprintln!("mlx5-pci-proxy: {}", chain(&e));
                }
                None
            }
            Request::SetIrqfd { intr, resample } => {
                self.irqfds = Some((intr, resample));
                None
            }
            Request::DeviceReset => {
                self.reset();
                Some(None)
            }
        };
        if let Some(v) = reply {
            msg::send_ret(&self.sock, v).map_err(ServerError::Reply)?;
        }
        self.tick();
        Ok(())
    }

    fn reject(&mut self, v: u64) -> u64 {
        self.stats.rejected += 1;
        v
    }

    /// The BAR0 offset of an access, when it is a memory access of 1, 2, 4 or 8 bytes inside the assigned BAR.
    fn bar_offset(&self, a: &BarAccess) -> Option<usize> {
        let base = self.cfg.bar0();
        let size = u64::from(a.size);
        if !a.memory || base == 0 || !matches!(a.size, 1 | 2 | 4 | 8) {
            return None;
        }
        let off = a.addr.checked_sub(base)?;
        (off.checked_add(size)? <= BAR0_SIZE).then(|| usize::try_from(off).ok()).flatten()
    }

    /// A BAR0 read: the device's registers are big-endian 32-bit words, so the bytes in BAR order are each
    /// word's big-endian bytes; QEMU carries them as a little-endian value.
    fn bar_read(&mut self, a: BarAccess) -> u64 {
        let Some(off) = self.bar_offset(&a) else { return self.reject(u64::MAX) };
        let mut bytes = [0u8; 8];
        let len = a.size as usize;
        let mut i = 0;
        while i < len {
            let at = off + i;
            let word = at & !3;
            let w = self.mmio.read32(word).to_be_bytes();
            let from = at - word;
            let n = (4 - from).min(len - i);
            bytes[i..i + n].copy_from_slice(&w[from..from + n]);
            i += n;
        }
        u64::from_le_bytes(bytes)
    }

    /// A BAR0 write: an aligned 8-byte access is one 64-bit write (doorbells), aligned 4-byte pieces are
    /// registers; narrower writes are counted and dropped (the device has no sub-word registers).
    fn bar_write(&mut self, a: BarAccess) {
        let Some(off) = self.bar_offset(&a) else {
            self.reject(0);
            return;
        };
        let bytes = a.val.to_le_bytes();
        if self.verbose {
            eprintln!("bar write 0x{off:x} {:02x?}", &bytes[..a.size as usize]);
        }
        match a.size {
            8 if off % 8 == 0 => self.mmio.write64(off, u64::from_be_bytes(bytes)),
            8 if off % 4 == 0 => {
                self.mmio.write32(off, u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]));
                self.mmio.write32(off + 4, u32::from_be_bytes([bytes[4], bytes[5], bytes[6], bytes[7]]));
            }
            4 if off % 4 == 0 => self.mmio.write32(off, u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])),
            _ => self.stats.narrow_writes += 1,
        }
    }

    /// A fresh device (power-on state) over the same guest RAM; config space back to its reset values.
    pub fn reset(&mut self) {
        self.collect();
        self.stats.resets += 1;
        self.sim = SimDevice::new(self.sim_cfg.clone());
        self.mmio = self.sim.mmio();
        self.cursor = 0;
        self.cfg.reset();
        self.start = Instant::now();
        for e in self.ram.map_into(&self.sim) {
            eprintln!("mlx5-pci-proxy: after reset: {}", chain(&e));
        }
        if let Some(addr) = &self.wire {
            // The listener was there for the first plug; a short wait here, since the guest's vCPU waits too.
            if let Err(e) = self.sim.wire_connect(addr, REPLUG_TIMEOUT) {
                eprintln!("mlx5-pci-proxy: after reset: the port stays unplugged: {}", chain(&e));
            }
        }
    }

    /// Lets device time catch up with wall time (heartbeat, command execution, datapath).
    fn tick(&mut self) {
        // A threaded device keeps its own (real) time.
        if self.sim_cfg.mode == Mode::Threaded {
            self.collect();
            return;
        }
        let now = u64::try_from(self.start.elapsed().as_nanos()).unwrap_or(u64::MAX);
        let dev = self.sim.now_ns();
        if now > dev {
            self.sim.advance_ns(now - dev);
        }
        self.collect();
    }

    /// Appends the commands completed since the last call to `commands` and the trace file.
    fn collect(&mut self) {
        for c in self.sim.executed_since(&mut self.cursor) {
            if let Some(t) = &mut self.trace {
                let _ = writeln!(
                    t,
                    "{{\"opcode\":\"0x{:x}\",\"name\":\"{}\",\"op_mod\":{},\"status\":\"{}\",\"syndrome\":\"0x{:x}\",\"delivery\":{}}}",
                    c.opcode,
                    Opcode::from_raw(c.opcode).name().unwrap_or("UNKNOWN"),
                    c.op_mod,
                    CmdStatus::from_raw(c.status).name().unwrap_or("UNKNOWN"),
                    c.syndrome,
                    c.delivery
                );
            }
            self.commands.push(c);
        }
    }
}

/// An error with its sources, on one line.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}
