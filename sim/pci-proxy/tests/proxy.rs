//! The server driven from QEMU's side of the socket, exactly as x-pci-proxy-dev speaks to it: config accesses,
//! BAR accesses at guest-physical addresses, guest RAM as a memfd. The driver on top is the core itself (the
//! firmware example's `run`: bring-up, PD, MR, CQs, RC QPs, SENDs and an RDMA WRITE, teardown) with the
//! firmware's identity-mapped arena placed in that memfd; then the bad inputs: garbage BAR writes, unknown and
//! malformed messages, DMA outside guest RAM, and a guest gone mid-command.

use std::mem::MaybeUninit;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use mlx5_core::hal::Mmio;
use mlx5_core::prm::{c, consts, Opcode};
use mlx5_firmware_example::arena::Arena;
use mlx5_firmware_example::{fnv1a, pattern, run, TRANSFERS};
use mlx5_pci_proxy::msg::{self, Cmd, MsgError, SysmemRegion};
use mlx5_pci_proxy::server::{Server, ServerError};
use mlx5_sim::SimConfig;

/// Where the "BIOS" puts BAR0.
const BAR0: u64 = 0xfe00_0000;

/// Guest RAM: a memfd, mapped in this process too (as QEMU maps it).
struct Ram {
    fd: OwnedFd,
    host: *mut u8,
    len: usize,
}

impl Ram {
    fn new(len: usize) -> Self {
        // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
        let fd = unsafe { libc::memfd_create(c"guest-ram".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: `fd` is a fresh descriptor we own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: ftruncate on our memfd.
        assert_eq!(unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) }, 0);
        // SAFETY: a fresh shared mapping of the whole file.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Self { fd, host: p.cast(), len }
    }

    fn put(&self, off: usize, b: &[u8]) {
        assert!(off + b.len() <= self.len);
        // SAFETY: inside the mapping (checked above).
        unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), self.host.add(off), b.len()) };
    }

    fn get(&self, off: usize) -> u8 {
        assert!(off < self.len);
        // SAFETY: inside the mapping; the device may write it concurrently, hence volatile.
        unsafe { self.host.add(off).read_volatile() }
    }
}

/// QEMU's end of the socket, and the server on its own thread.
struct Qemu {
    sock: UnixStream,
    server: Option<JoinHandle<(Result<(), ServerError>, Server)>>,
}

impl Qemu {
    fn start() -> Self {
        let (a, b) = UnixStream::pair().expect("socketpair");
        let server = std::thread::spawn(move || {
            let mut s = Server::new(b, SimConfig::default(), 0x020000, None);
            let r = s.run();
            (r, s)
        });
        Self { sock: a, server: Some(server) }
    }

    /// Gives the device `ram` at guest-physical `gpa` (SYNC_SYSMEM: no reply).
    fn sync(&self, ram: &Ram, gpa: u64) {
        let r = SysmemRegion { gpa, size: ram.len as u64, offset: 0 };
        msg::send(&self.sock, Cmd::SyncSysmem as i32, &msg::sync_sysmem(&[r]), &[ram.fd.as_raw_fd()]).unwrap();
    }

    fn cfg_read(&self, addr: u32, len: i32) -> u64 {
        msg::send(&self.sock, Cmd::PciCfgRead as i32, &msg::pci_conf(addr, 0, len), &[]).unwrap();
        msg::recv_ret(&self.sock).unwrap().expect("a value")
    }

    fn cfg_write(&self, addr: u32, val: u32, len: i32) {
        msg::send(&self.sock, Cmd::PciCfgWrite as i32, &msg::pci_conf(addr, val, len), &[]).unwrap();
        msg::recv_ret(&self.sock).unwrap();
    }

    fn bar_read(&self, addr: u64, size: u32) -> u64 {
        msg::send(&self.sock, Cmd::BarRead as i32, &msg::bar_access(addr, 0, size, true), &[]).unwrap();
        msg::recv_ret(&self.sock).unwrap().expect("a value")
    }

    fn bar_write(&self, addr: u64, val: u64, size: u32, memory: bool) {
        msg::send(&self.sock, Cmd::BarWrite as i32, &msg::bar_access(addr, val, size, memory), &[]).unwrap();
        msg::recv_ret(&self.sock).unwrap();
    }

    /// What SeaBIOS and Linux do to a new function: size BAR0, place it, enable memory and bus mastering.
    fn enumerate(&self) {
        self.cfg_write(0x10, u32::MAX, 4);
        assert_eq!(self.cfg_read(0x10, 4) as u32 & !0xf, !((32u32 << 20) - 1));
        self.cfg_write(0x10, BAR0 as u32, 4);
        self.cfg_write(0x04, 0x0006, 2);
    }

    fn reset(&self) {
        msg::send(&self.sock, Cmd::DeviceReset as i32, &[], &[]).unwrap();
        assert_eq!(msg::recv_ret(&self.sock).unwrap(), None, "DEVICE_RESET's reply carries no value");
    }

    /// Closes QEMU's end and returns how the server ended; it must end within 10 s.
    fn finish(mut self) -> (Result<(), ServerError>, Server) {
        drop(self.sock);
        let h = self.server.take().unwrap_or_else(|| unreachable!());
        let start = Instant::now();
        while !h.is_finished() {
            assert!(start.elapsed() < Duration::from_secs(10), "the server hangs after QEMU went away");
            std::thread::sleep(Duration::from_millis(5));
        }
        h.join().expect("the server never panics")
    }

    /// Waits for the server to end on its own (after a message it refuses) and returns how it ended.
    fn ended(mut self) -> (Result<(), ServerError>, Server) {
        let h = self.server.take().unwrap_or_else(|| unreachable!());
        let start = Instant::now();
        while !h.is_finished() {
            assert!(start.elapsed() < Duration::from_secs(10), "the server did not end");
            std::thread::sleep(Duration::from_millis(5));
        }
        h.join().expect("the server never panics")
    }
}

/// The core's `Mmio` as a guest CPU has it: every access a BAR_READ or BAR_WRITE over the proxy. The device's
/// registers are big-endian; an x86 guest's `ioread32be` is a little-endian load byte-swapped, which is what the
/// conversions below do.
struct ProxyMmio<'a>(&'a Qemu);

impl Mmio for ProxyMmio<'_> {
    fn read32(&self, off: usize) -> u32 {
        let v = self.0.bar_read(BAR0 + off as u64, 4) as u32;
        u32::from_be_bytes(v.to_le_bytes())
    }
    fn write32(&self, off: usize, v: u32) {
        self.0.bar_write(BAR0 + off as u64, u64::from(u32::from_le_bytes(v.to_be_bytes())), 4, true);
    }
    fn read64(&self, off: usize) -> u64 {
        u64::from_be_bytes(self.0.bar_read(BAR0 + off as u64, 8).to_le_bytes())
    }
    fn write64(&self, off: usize, v: u64) {
        self.0.bar_write(BAR0 + off as u64, u64::from_le_bytes(v.to_be_bytes()), 8, true);
    }
}

/// Wall-clock delays: the server pulls device time to wall time.
struct Sleep;

impl embedded_hal::delay::DelayNs for Sleep {
    fn delay_ns(&mut self, ns: u32) {
        std::thread::sleep(Duration::from_nanos(u64::from(ns)));
    }
}

/// The firmware's whole run through the proxy, its arena in guest RAM at guest-physical = this process's
/// address of the mapping (identity-mapped, as on bare metal). Returns the report's digests.
fn core_run(q: &Qemu, ram: &Ram) -> Vec<u32> {
    // SAFETY: the mapping is `ram.len` bytes, lives as long as `ram`, and only this arena uses it during the run;
    // the 'static is the arena's bare-metal signature, and the arena is dropped inside `run`.
    let mem: &'static mut [MaybeUninit<u8>] =
        unsafe { std::slice::from_raw_parts_mut(ram.host.cast::<MaybeUninit<u8>>(), ram.len) };
    // SAFETY: the memory is this arena's alone (see above).
    let arena: Arena = unsafe { Arena::new(mem) };
    let report = run(ProxyMmio(q), &arena, (), &mut Sleep).expect("the core's run over the proxy");
    assert_eq!(report.fw_rev, (16, 35, 2000));
    report.digests.to_vec()
}

fn expected_digests() -> Vec<u32> {
    TRANSFERS
        .iter()
        .map(|t| {
            let mut area = vec![0u8; t.room];
            for (k, b) in area.iter_mut().take(t.len as usize).enumerate() {
                *b = pattern(t.src + k);
            }
            fnv1a(&area)
        })
        .collect()
}

#[test]
fn enumerates_as_15b3_1017_with_one_32_mib_bar_as_qemus_probe_sees_it() {
    let q = Qemu::start();
    // probe_pci_info: ids and class by 2-byte reads, then each BAR register sized on its own.
    assert_eq!(q.cfg_read(0x00, 2), 0x15b3);
    assert_eq!(q.cfg_read(0x02, 2), 0x1017);
    assert_eq!(q.cfg_read(0x0a, 2), 0x0200);
    let mut sizes = Vec::new();
    for i in 0..7u32 {
        let reg = 0x10 + 4 * i;
        let orig = q.cfg_read(reg, 4) as u32;
        q.cfg_write(reg, u32::MAX, 4);
        let v = q.cfg_read(reg, 4) as u32;
        q.cfg_write(reg, orig, 4);
        sizes.push((!(v & 0xffff_fff0)).wrapping_add(1));
    }
    assert_eq!(sizes, vec![32 << 20, 0, 0, 0, 0, 0, 0]);
    // Before the BAR is placed, a BAR access reaches nothing: all ones, no panic.
    assert_eq!(q.bar_read(BAR0, 4), u64::MAX);
    q.enumerate();
    // fw_rev through the BAR: minor 35 in the high half, major 16 in the low half, as ioread32be sees it.
    let v = q.bar_read(BAR0 + c::mlx5_init_seg::FW_REV.off as u64, 4) as u32;
    assert_eq!(u32::from_be_bytes(v.to_le_bytes()), 35 << 16 | 16);
    let (r, s) = q.finish();
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(s.stats.rejected, 1, "the one access before BAR0 was placed");
}

#[test]
fn the_core_brings_the_hca_up_and_moves_checked_data_through_the_proxy() {
    let q = Qemu::start();
    let ram = Ram::new(4 << 20);
    q.sync(&ram, ram.host as u64);
    q.enumerate();
    assert_eq!(core_run(&q, &ram), expected_digests(), "the bytes that landed in guest RAM");
    let (r, s) = q.finish();
    assert!(r.is_ok(), "{r:?}");
    let ops: Vec<u16> = s.commands.iter().map(|c| c.opcode).collect();
    assert_eq!(ops.first(), Some(&Opcode::EnableHca.raw()), "{ops:x?}");
    assert_eq!(ops.last(), Some(&Opcode::DisableHca.raw()), "{ops:x?}");
    assert!(s.commands.iter().all(|c| c.status == 0 && c.delivery == 0), "every command OK");
    assert_eq!(s.sim.pages_owned(), 0, "every firmware page returned");
    assert!(s.sim.dma_faults().is_empty(), "{:?}", s.sim.dma_faults());
    assert_eq!(s.stats.rejected, 0);
}

/// A small xorshift, so the garbage is the same on every run.
fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}

#[test]
fn garbage_bar_writes_are_absorbed_and_a_reset_gives_a_device_the_core_brings_up() {
    let q = Qemu::start();
    let ram = Ram::new(4 << 20);
    q.sync(&ram, ram.host as u64);
    q.enumerate();
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    // Every register of the initialization segment and the first UAR pages, with every width and alignment,
    // the command doorbell included (so the device chases a garbage command queue address).
    for i in 0..3000u64 {
        let size = [1u32, 2, 4, 8][(i % 4) as usize];
        let off = xorshift(&mut x) % 0x6000;
        q.bar_write(BAR0 + off, xorshift(&mut x), size, true);
    }
    q.bar_write(BAR0 + c::mlx5_init_seg::CMD_DBELL.off as u64, u64::from(u32::MAX), 4, true);
    // Outside BAR0, across its end, a 3-byte access, I/O space, below the BAR.
    q.bar_write(BAR0 + (32 << 20), 1, 4, true);
    q.bar_write(BAR0 + (32 << 20) - 4, 1, 8, true);
    q.bar_write(BAR0, 1, 3, true);
    q.bar_write(BAR0, 1, 4, false);
    q.bar_write(BAR0 - 4, 1, 4, true);
    assert_eq!(q.bar_read(BAR0 + (32 << 20), 4), u64::MAX);
    // Still answering config space.
    assert_eq!(q.cfg_read(0, 4), 0x1017_15b3);
    // DEVICE_RESET: power-on state, the same guest RAM, BAR0 to be placed again.
    q.reset();
    assert_eq!(q.cfg_read(0x10, 4), 0x8);
    q.enumerate();
    assert_eq!(core_run(&q, &ram), expected_digests());
    let (r, s) = q.finish();
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(s.stats.resets, 1);
    assert!(s.stats.rejected >= 6, "{:?}", s.stats);
    assert!(s.stats.narrow_writes > 0, "{:?}", s.stats);
    assert!(s.sim.dma_faults().is_empty(), "the device after the reset is a fresh one: {:?}", s.sim.dma_faults());
}

#[test]
fn function_level_reset_through_config_space_resets_the_device() {
    let q = Qemu::start();
    q.enumerate();
    // Set the command queue address, then FLR (PCI_EXP_DEVCTL_BCR_FLR in the PCIe capability at 0x40).
    q.bar_write(BAR0 + c::mlx5_init_seg::CMDQ_ADDR_H.off as u64, 0x1234_0000, 4, true);
    q.cfg_write(0x48, 1 << 15, 2);
    assert_eq!(q.cfg_read(0x10, 4), 0x8, "BAR0 unassigned after the reset");
    q.enumerate();
    assert_eq!(q.bar_read(BAR0 + c::mlx5_init_seg::CMDQ_ADDR_H.off as u64, 4), 0, "a fresh device");
    let (r, s) = q.finish();
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(s.stats.resets, 1);
}

#[test]
fn a_command_whose_mailbox_is_outside_guest_ram_completes_with_a_delivery_error() {
    use c::mlx5_cmd_layout as l;
    let q = Qemu::start();
    // 1 MiB of guest RAM at 1 MiB; the command queue in its first page.
    let ram = Ram::new(1 << 20);
    let gpa = 0x10_0000u64;
    q.sync(&ram, gpa);
    q.enumerate();
    let w =
        |off: usize, v: u32| q.bar_write(BAR0 + off as u64, u64::from(u32::from_le_bytes(v.to_be_bytes())), 4, true);
    w(c::mlx5_init_seg::CMDQ_ADDR_H.off, 0);
    w(c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off, gpa as u32);
    // QUERY_HCA_CAP-sized input (more than the 16 inline bytes) with its mailbox at 2 GiB: no RAM there.
    let outside = 0x8000_0000u64;
    let mut e = [0u8; l::SIZE];
    e[l::TYPE.off] = consts::MLX5_PCI_CMD_XPORT;
    e[l::INLEN.off..l::INLEN.off + 4].copy_from_slice(&64u32.to_be_bytes());
    e[l::IN_PTR.off..l::IN_PTR.off + 8].copy_from_slice(&outside.to_be_bytes());
    e[l::IN.off..l::IN.off + 2].copy_from_slice(&Opcode::QueryHcaCap.raw().to_be_bytes());
    e[l::OUTLEN.off..l::OUTLEN.off + 4].copy_from_slice(&16u32.to_be_bytes());
    e[l::TOKEN.off] = 1;
    e[l::STATUS_OWN.off] = consts::CMD_OWNER_HW;
    ram.put(0, &e);
    w(c::mlx5_init_seg::CMD_DBELL.off, 1);
    let start = Instant::now();
    while ram.get(l::STATUS_OWN.off) & 1 == 1 {
        assert!(start.elapsed() < Duration::from_secs(10), "the command never completed");
        // Any access lets the server's loop run the device.
        q.cfg_read(0, 2);
        std::thread::sleep(Duration::from_millis(1));
    }
    let delivery = ram.get(l::STATUS_OWN.off) >> 1;
    assert_ne!(delivery, 0, "a delivery error in the entry");
    // A command queue placed outside guest RAM: the doorbell is a DMA fault, not a crash.
    w(c::mlx5_init_seg::CMDQ_ADDR_H.off, 1);
    w(c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off, 0);
    w(c::mlx5_init_seg::CMD_DBELL.off, 1);
    assert_eq!(q.cfg_read(0, 2), 0x15b3);
    let (r, s) = q.finish();
    assert!(r.is_ok(), "{r:?}");
    let faults = s.sim.dma_faults();
    assert!(faults.iter().any(|f| f.iova == outside), "{faults:?}");
    assert!(faults.iter().any(|f| f.iova == 1 << 32), "{faults:?}");
}

/// Sends raw bytes (and fds) and returns how the server ended: each of these ends the session with a named error.
fn refused(bytes: &[u8], fds: &[i32]) -> ServerError {
    let q = Qemu::start();
    if fds.is_empty() {
        use std::io::Write;
        (&q.sock).write_all(bytes).unwrap();
    } else {
        let cmd = i32::from_ne_bytes(bytes[..4].try_into().unwrap());
        msg::send(&q.sock, cmd, &bytes[msg::HDR..], fds).unwrap();
    }
    let (r, _) = q.ended();
    r.expect_err("the server refuses the message")
}

#[test]
fn unknown_oversized_and_misshapen_messages_end_the_session_with_a_named_error() {
    let e = refused(&msg::encode(42, &[]), &[]);
    assert!(matches!(e, ServerError::Msg(MsgError::UnknownCommand { cmd: 42 })), "{e:?}");
    let e = refused(&msg::encode(-1, &[0; 8]), &[]);
    assert!(matches!(e, ServerError::Msg(MsgError::UnknownCommand { cmd: -1 })), "{e:?}");
    // A RET sent to the device.
    let e = refused(&msg::encode(Cmd::Ret as i32, &[0; 8]), &[]);
    assert!(matches!(e, ServerError::Msg(MsgError::UnknownCommand { cmd: 1 })), "{e:?}");
    // A size beyond the data union: refused before anything is read or allocated.
    let mut big = msg::encode(Cmd::BarRead as i32, &[]);
    big[8..16].copy_from_slice(&u64::MAX.to_ne_bytes());
    let e = refused(&big, &[]);
    assert!(matches!(e, ServerError::Msg(MsgError::Oversized { size: u64::MAX })), "{e:?}");
    // A BAR read of the wrong size, a config write with an fd, a SYNC_SYSMEM without fds, SET_IRQFD with one.
    let e = refused(&msg::encode(Cmd::BarRead as i32, &[0; 12]), &[]);
    assert!(matches!(e, ServerError::Msg(MsgError::BadShape { cmd: Cmd::BarRead, size: 12, fds: 0 })), "{e:?}");
    let e = refused(&msg::encode(Cmd::PciCfgWrite as i32, &[0; 12]), &[0]);
    assert!(matches!(e, ServerError::Msg(MsgError::BadShape { cmd: Cmd::PciCfgWrite, fds: 1, .. })), "{e:?}");
    let e = refused(&msg::encode(Cmd::SyncSysmem as i32, &[0; msg::MAX_DATA]), &[]);
    assert!(matches!(e, ServerError::Msg(MsgError::BadShape { cmd: Cmd::SyncSysmem, fds: 0, .. })), "{e:?}");
    let e = refused(&msg::encode(Cmd::SetIrqfd as i32, &[]), &[0]);
    assert!(matches!(e, ServerError::Msg(MsgError::BadShape { cmd: Cmd::SetIrqfd, fds: 1, .. })), "{e:?}");
    // More descriptors than a message may carry.
    let e = refused(&msg::encode(Cmd::SyncSysmem as i32, &[0; msg::MAX_DATA]), &[0; 9]);
    assert!(matches!(e, ServerError::Msg(MsgError::TooManyFds { n: 9 })), "{e:?}");
}

#[test]
fn guest_ram_regions_that_do_not_fit_their_file_are_refused_and_the_rest_served() {
    let q = Qemu::start();
    let ram = Ram::new(1 << 20);
    let bad = [
        // Past the end of the file (the device's access there would be SIGBUS), unaligned, empty, wrapping.
        SysmemRegion { gpa: 0x100_0000, size: 2 << 20, offset: 0 },
        SysmemRegion { gpa: 0x200_0000, size: 4096, offset: 100 },
        SysmemRegion { gpa: 0x300_0000, size: 0, offset: 0 },
        SysmemRegion { gpa: u64::MAX - 4095, size: 8192, offset: 0 },
        SysmemRegion { gpa: 0x400_0000, size: 1 << 20, offset: 0 },
    ];
    let fd = ram.fd.as_raw_fd();
    msg::send(&q.sock, Cmd::SyncSysmem as i32, &msg::sync_sysmem(&bad), &[fd; 5]).unwrap();
    // The same region again, and one overlapping it with another file offset: the union stays, nothing remapped.
    q.sync(&ram, 0x400_0000);
    let shifted = SysmemRegion { gpa: 0x408_0000, size: 512 << 10, offset: 0 };
    msg::send(&q.sock, Cmd::SyncSysmem as i32, &msg::sync_sysmem(&[shifted]), &[fd]).unwrap();
    assert_eq!(q.cfg_read(0, 2), 0x15b3);
    let (r, s) = q.finish();
    assert!(r.is_ok(), "{r:?}");
    assert_eq!(s.stats.bad_regions, 4);
    assert_eq!(s.ram.bytes(), 1 << 20);
    assert!(s.ram.contains(0x400_0000, 1 << 20));
    assert!(!s.ram.contains(0x100_0000, 1));
    assert_eq!(s.ram.stale, 1);
}

#[test]
fn a_guest_killed_mid_message_or_mid_command_ends_the_session_cleanly() {
    // Half a header, then the socket closes.
    let q = Qemu::start();
    {
        use std::io::Write;
        (&q.sock).write_all(&msg::encode(Cmd::BarRead as i32, &[0; 24])[..10]).unwrap();
    }
    let (r, _) = q.finish();
    assert!(matches!(r, Err(ServerError::Msg(MsgError::Truncated { got: 10, want: 16 }))), "{r:?}");
    // A whole header, half the data.
    let q = Qemu::start();
    {
        use std::io::Write;
        (&q.sock).write_all(&msg::encode(Cmd::BarRead as i32, &[0; 24])[..20]).unwrap();
    }
    let (r, _) = q.finish();
    assert!(matches!(r, Err(ServerError::Msg(MsgError::Truncated { got: 20, want: 40 }))), "{r:?}");
    // A command rung and the guest gone before it was read back: the server ends, the device is dropped.
    let q = Qemu::start();
    let ram = Ram::new(1 << 20);
    q.sync(&ram, 0x10_0000);
    q.enumerate();
    let w =
        |off: usize, v: u32| q.bar_write(BAR0 + off as u64, u64::from(u32::from_le_bytes(v.to_be_bytes())), 4, true);
    w(c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off, 0x10_0000);
    let mut e = [0u8; c::mlx5_cmd_layout::SIZE];
    e[c::mlx5_cmd_layout::TYPE.off] = consts::MLX5_PCI_CMD_XPORT;
    e[c::mlx5_cmd_layout::STATUS_OWN.off] = consts::CMD_OWNER_HW;
    ram.put(0, &e);
    w(c::mlx5_init_seg::CMD_DBELL.off, 1);
    let (r, _) = q.finish();
    assert!(r.is_ok(), "{r:?}");
    // A BAR read sent, the socket shut before the reply is read: the reply fails or is discarded, no panic.
    let q = Qemu::start();
    msg::send(&q.sock, Cmd::BarRead as i32, &msg::bar_access(BAR0, 0, 4, true), &[]).unwrap();
    let (r, _) = q.finish();
    assert!(r.is_ok() || matches!(r, Err(ServerError::Reply(_))), "{r:?}");
}
