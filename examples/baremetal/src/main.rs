//! `mlx5-core` on bare x86_64: an image QEMU boots with `-kernel` (PVH entry), no std, no alloc. It switches to
//! long mode with the first 4 GiB identity-mapped, finds the ConnectX (15b3:1017) by scanning PCI config space
//! (ports 0xcf8/0xcfc), turns on memory decoding and bus mastering, and drives it through the firmware example
//! with an `Mmio` over BAR0 at the address the BIOS gave it, the firmware's `Arena` over a static buffer (iova =
//! CPU address = physical address) and a TSC delay calibrated on the PIT. With `mlx5.peer=FACTS` on its command
//! line (QEMU's `-append`, read from the PVH start info) it runs `run_peer()` against the host process those
//! facts describe: bring-up in Linux's order, PD, MR, CQ and an RC QP, its own facts printed on serial
//! (`baremetal: ready FACTS`) once the QP is ready, 1,000 rounds of 4 KiB SENDs and RDMA WRITEs each way with
//! every byte checked, teardown with every firmware page returned. Without it, the loopback `run()`. It logs on
//! the serial port and exits through `isa-debug-exit` (1: passed, 2: failed; QEMU exits with `(v << 1) | 1`).
//!
//! Build: `cargo build --release -p mlx5-baremetal-example --target x86_64-unknown-none` with
//! `RUSTFLAGS=-C relocation-model=static` (`cargo xtask pci-sim` does). On the host the binary runs the same
//! code against the simulator: without arguments the loopback `run()`, with `--peer HOST:PORT` the other side of
//! the image's exchange (a simulated device whose wire listens there; `peer FACTS` on stdout, the image's facts
//! read from stdin); either way it then prints the device's command trace, the reference the image's is compared
//! with.

#![cfg_attr(target_os = "none", no_std, no_main)]

#[cfg(target_os = "none")]
mod image {
    use core::arch::{asm, global_asm};
    use core::fmt::Write;
    use core::mem::MaybeUninit;

    use mlx5_core::hal::{DelayNs, Mmio};
    use mlx5_core::trace::{CmdRecord, CmdTrace};
    use mlx5_firmware_example::arena::Arena;
    use mlx5_firmware_example::{run, run_peer, PeerInfo, Rendezvous};

    // The PVH entry (32-bit protected mode, paging off): page tables identity-mapping 4 GiB with 2 MiB pages,
    // PAE, long mode, paging, a 64-bit code segment, a stack, then Rust.
    global_asm!(
        r#"
        .section .text.boot, "ax"
        .code32
        .global _start32
        _start32:
            cli
            movl %ebx, boot_start_info
            movl $boot_stack_top, %esp
            movl $boot_pd, %edi
            xorl %ecx, %ecx
        1:  movl %ecx, %eax
            shll $21, %eax
            orl $0x83, %eax
            movl %eax, (%edi,%ecx,8)
            movl %ecx, %edx
            shrl $11, %edx
            movl %edx, 4(%edi,%ecx,8)
            incl %ecx
            cmpl $2048, %ecx
            jne 1b
            movl $boot_pdpt, %edi
            movl $boot_pd, %eax
            orl $3, %eax
            xorl %ecx, %ecx
        2:  movl %eax, (%edi,%ecx,8)
            movl $0, 4(%edi,%ecx,8)
            addl $4096, %eax
            incl %ecx
            cmpl $4, %ecx
            jne 2b
            movl $boot_pml4, %edi
            movl $boot_pdpt, %eax
            orl $3, %eax
            movl %eax, (%edi)
            movl $0, 4(%edi)
            movl %edi, %cr3
            movl %cr4, %eax
            orl $0x20, %eax
            movl %eax, %cr4
            movl $0xc0000080, %ecx
            rdmsr
            orl $0x100, %eax
            wrmsr
            movl %cr0, %eax
            orl $0x80000001, %eax
            movl %eax, %cr0
            lgdt boot_gdt_ptr
            ljmp $0x08, $boot_start64
        .code64
        boot_start64:
            movw $0x10, %ax
            movw %ax, %ds
            movw %ax, %es
            movw %ax, %ss
            movw %ax, %fs
            movw %ax, %gs
            movq $boot_stack_top, %rsp
            call baremetal_main
        3:  hlt
            jmp 3b

        .section .rodata.boot, "a"
        .balign 8
        boot_gdt:
            .quad 0
            .quad 0x00af9a000000ffff
            .quad 0x00cf92000000ffff
        boot_gdt_ptr:
            .word 23
            .long boot_gdt

        .section .note.Xen, "a"
        .balign 4
            .long 4
            .long 4
            .long 18
            .asciz "Xen"
            .long _start32

        .section .bss.boot, "aw", @nobits
        .balign 4096
        .global boot_start_info
        boot_start_info: .skip 4
        .balign 4096
        boot_pml4: .skip 4096
        boot_pdpt: .skip 4096
        boot_pd: .skip 16384
        boot_stack: .skip 262144
        boot_stack_top:
        "#,
        options(att_syntax)
    );

    fn outb(port: u16, v: u8) {
        // SAFETY: port I/O to the legacy devices this image owns (serial, PIT, debug exit); no memory is touched.
        unsafe { asm!("out dx, al", in("dx") port, in("al") v, options(nomem, nostack, preserves_flags)) };
    }
    fn inb(port: u16) -> u8 {
        let v: u8;
        // SAFETY: as in `outb`.
        unsafe { asm!("in al, dx", out("al") v, in("dx") port, options(nomem, nostack, preserves_flags)) };
        v
    }
    fn outl(port: u16, v: u32) {
        // SAFETY: as in `outb` (PCI configuration mechanism #1).
        unsafe { asm!("out dx, eax", in("dx") port, in("eax") v, options(nomem, nostack, preserves_flags)) };
    }
    fn inl(port: u16) -> u32 {
        let v: u32;
        // SAFETY: as in `outb`.
        unsafe { asm!("in eax, dx", out("eax") v, in("dx") port, options(nomem, nostack, preserves_flags)) };
        v
    }
    fn rdtsc() -> u64 {
        let (lo, hi): (u32, u32);
        // SAFETY: reads the time-stamp counter; no memory is touched.
        unsafe { asm!("rdtsc", out("eax") lo, out("edx") hi, options(nomem, nostack, preserves_flags)) };
        (u64::from(hi) << 32) | u64::from(lo)
    }

    /// COM1, as QEMU's `-serial stdio` shows it.
    struct Serial;

    impl Write for Serial {
        fn write_str(&mut self, s: &str) -> core::fmt::Result {
            for b in s.bytes() {
                // Transmit holding register empty.
                while inb(0x3fd) & 0x20 == 0 {}
                outb(0x3f8, b);
            }
            Ok(())
        }
    }

    macro_rules! log {
        ($($t:tt)*) => {{ let _ = writeln!(Serial, $($t)*); }};
    }

    /// `isa-debug-exit` at 0xf4: QEMU exits with `(v << 1) | 1`.
    fn exit(v: u8) -> ! {
        outb(0xf4, v);
        loop {
            // SAFETY: halts until an interrupt; interrupts are off, so for good.
            unsafe { asm!("hlt", options(nomem, nostack)) };
        }
    }

    fn cfg_read(dev: u8, off: u8) -> u32 {
        outl(0xcf8, 0x8000_0000 | u32::from(dev) << 11 | u32::from(off & 0xfc));
        inl(0xcfc)
    }
    fn cfg_write(dev: u8, off: u8, v: u32) {
        outl(0xcf8, 0x8000_0000 | u32::from(dev) << 11 | u32::from(off & 0xfc));
        outl(0xcfc, v);
    }

    /// BAR0 through the identity map: big-endian registers, each access one load or store of its width.
    struct Bar(usize);

    impl Mmio for Bar {
        fn read32(&self, off: usize) -> u32 {
            // SAFETY: `off` is inside BAR0 (the core only addresses the initialization segment and its UARs), which
            // the page tables map 1:1.
            u32::from_be(unsafe { ((self.0 + off) as *const u32).read_volatile() })
        }
        fn write32(&self, off: usize, v: u32) {
            // SAFETY: as in `read32`.
            unsafe { ((self.0 + off) as *mut u32).write_volatile(v.to_be()) }
        }
        fn read64(&self, off: usize) -> u64 {
            // SAFETY: as in `read32`.
            u64::from_be(unsafe { ((self.0 + off) as *const u64).read_volatile() })
        }
        fn write64(&self, off: usize, v: u64) {
            // SAFETY: as in `read32`; one 8-byte store, so a doorbell is one access.
            unsafe { ((self.0 + off) as *mut u64).write_volatile(v.to_be()) }
        }
    }

    /// Delays on the TSC, its rate measured against the PIT.
    struct Tsc {
        per_us: u64,
    }

    impl Tsc {
        /// Counts TSC ticks over 10 ms of PIT channel 2 (1.193182 MHz, mode 0, gate on, speaker off).
        fn calibrate() -> Self {
            outb(0x61, (inb(0x61) & !0x02) | 0x01);
            outb(0x43, 0xb0);
            let count: u16 = 11_932;
            outb(0x42, count as u8);
            outb(0x42, (count >> 8) as u8);
            let t0 = rdtsc();
            while inb(0x61) & 0x20 == 0 {}
            let t1 = rdtsc();
            Self { per_us: ((t1 - t0) / 10_000).max(1) }
        }
    }

    impl DelayNs for Tsc {
        fn delay_ns(&mut self, ns: u32) {
            let end = rdtsc() + (u64::from(ns) * self.per_us).div_ceil(1000);
            while rdtsc() < end {
                core::hint::spin_loop();
            }
        }
    }

    /// Logs every command the core completes.
    struct SerialTrace(u32);

    impl CmdTrace for SerialTrace {
        fn record(&mut self, rec: &CmdRecord<'_>) {
            self.0 += 1;
            log!(
                "fw: {:#06x} {} op_mod {} {:?}",
                rec.opcode.raw(),
                rec.opcode.name().unwrap_or("?"),
                rec.op_mod,
                rec.outcome
            );
        }
    }

    extern "C" {
        /// The physical address of the PVH `hvm_start_info` the loader passed in %ebx.
        static boot_start_info: u32;
    }

    /// `XEN_HVM_START_MAGIC_VALUE`, the first field of `hvm_start_info`.
    const HVM_START_MAGIC: u32 = 0x336e_c578;
    /// Offset of `cmdline_paddr` in `hvm_start_info` (after magic, version, flags, nr_modules, modlist_paddr).
    const HVM_CMDLINE_PADDR: usize = 24;
    /// The longest command line read.
    const CMDLINE_MAX: usize = 4096;

    /// The boot command line (QEMU's `-append`), empty when there is none.
    fn cmdline() -> &'static str {
        // SAFETY: written once by the entry code before any Rust runs.
        let info = unsafe { core::ptr::addr_of!(boot_start_info).read() } as usize;
        if info == 0 {
            return "";
        }
        // SAFETY: the loader's start_info lies in the identity-mapped low 4 GiB; its first two fields are read.
        let (magic, paddr) = unsafe {
            ((info as *const u32).read_volatile(), ((info + HVM_CMDLINE_PADDR) as *const u64).read_unaligned())
        };
        if magic != HVM_START_MAGIC || paddr == 0 || paddr >= 1 << 32 {
            return "";
        }
        let p = paddr as *const u8;
        let mut len = 0;
        // SAFETY: a NUL-terminated string the loader placed in identity-mapped memory, read up to CMDLINE_MAX.
        while len < CMDLINE_MAX && unsafe { p.add(len).read_volatile() } != 0 {
            len += 1;
        }
        // SAFETY: `len` bytes were just read; nothing writes them while the image runs.
        let bytes = unsafe { core::slice::from_raw_parts(p, len) };
        core::str::from_utf8(bytes).unwrap_or("")
    }

    /// The host's facts come on the command line (`mlx5.peer=FACTS`); this side's go out on serial once its QP
    /// is ready, where the xtask reads them and hands them to the host process.
    struct BootRendezvous(PeerInfo);

    impl Rendezvous for BootRendezvous {
        fn peer(&mut self, mine: &PeerInfo) -> Option<PeerInfo> {
            log!("baremetal: qp {:#x} created", mine.qpn);
            Some(self.0)
        }
        fn ready(&mut self, mine: &PeerInfo) {
            log!("baremetal: ready {mine}");
        }
    }

    /// How long the image waits for each completion of the exchange.
    const PEER_TIMEOUT_US: u32 = 60_000_000;

    const ARENA_BYTES: usize = 4 << 20;
    /// The DMA arena: identity-mapped, so its CPU addresses are the bus addresses the device sees.
    static mut ARENA_MEM: [MaybeUninit<u8>; ARENA_BYTES] = [MaybeUninit::uninit(); ARENA_BYTES];

    #[no_mangle]
    extern "C" fn baremetal_main() -> ! {
        log!("baremetal: long mode, 4 GiB identity-mapped");
        let mut found = None;
        for dev in 0..32u8 {
            let id = cfg_read(dev, 0);
            if id == 0x1017_15b3 {
                found = Some(dev);
                break;
            }
        }
        let Some(dev) = found else {
            log!("baremetal: no 15b3:1017 on bus 0");
            exit(2)
        };
        let bar0 = (cfg_read(dev, 0x10) & !0xf) as usize;
        // Memory decoding and bus mastering on.
        cfg_write(dev, 0x04, cfg_read(dev, 0x04) | 0x6);
        log!("baremetal: enumerated 00:{dev:02x}.0 15b3:1017 bar0 {bar0:#x}");
        let mut delay = Tsc::calibrate();
        log!("baremetal: tsc {} ticks/us", delay.per_us);
        // SAFETY: the one reference to the arena's memory, made once, handed to the one Arena.
        let mem: &'static mut [MaybeUninit<u8>] = unsafe { &mut *core::ptr::addr_of_mut!(ARENA_MEM) };
        // SAFETY: the memory is this arena's alone.
        let arena: Arena = unsafe { Arena::new(mem) };
        let mut trace = SerialTrace(0);
        let peer = cmdline().split_whitespace().find_map(|a| a.strip_prefix("mlx5.peer="));
        if let Some(facts) = peer {
            let host: PeerInfo = match facts.parse() {
                Ok(p) => p,
                Err(e) => {
                    log!("baremetal: failed: mlx5.peer=: {e}");
                    exit(2)
                }
            };
            log!("baremetal: peer {host}");
            let mut rv = BootRendezvous(host);
            match run_peer(Bar(bar0), &arena, &mut trace, &mut delay, &mut rv, false, PEER_TIMEOUT_US) {
                Ok(r) => {
                    log!(
                        "baremetal: passed: fw {}.{}.{}, {} commands, qpn {:#x} to {:#x}, {} rounds, {} pages reclaimed",
                        r.fw_rev.0,
                        r.fw_rev.1,
                        r.fw_rev.2,
                        trace.0,
                        r.mine.qpn,
                        r.theirs.qpn,
                        r.rounds,
                        r.pages_reclaimed
                    );
                    log!("baremetal: bytes_checked {}", r.bytes_checked);
                    log!("baremetal: arena {:?}", arena.stats());
                    exit(1)
                }
                Err(e) => {
                    log!("baremetal: failed: {e}");
                    exit(2)
                }
            }
        }
        match run(Bar(bar0), &arena, &mut trace, &mut delay) {
            Ok(r) => {
                log!(
                    "baremetal: passed: fw {}.{}.{}, {} commands, qpns {:#x} {:#x}, digests {:08x?}, {} pages reclaimed",
                    r.fw_rev.0,
                    r.fw_rev.1,
                    r.fw_rev.2,
                    trace.0,
                    r.qpns[0],
                    r.qpns[1],
                    r.digests,
                    r.pages_reclaimed
                );
                let checked: u32 = mlx5_firmware_example::TRANSFERS.iter().map(|t| t.len).sum();
                log!("baremetal: bytes_checked {checked}");
                let s = arena.stats();
                log!("baremetal: arena {s:?}");
                exit(1)
            }
            Err(e) => {
                log!("baremetal: failed: {e:?}");
                exit(2)
            }
        }
    }

    #[panic_handler]
    fn panic(info: &core::panic::PanicInfo) -> ! {
        log!("baremetal: panic: {info}");
        exit(2)
    }
}

#[cfg(not(target_os = "none"))]
mod host {
    use std::io::{BufRead, Write};

    use mlx5_firmware_example::{PeerInfo, Rendezvous};

    /// The facts go out on stdout (`peer FACTS`) and the other side's come back on stdin (one line of FACTS).
    pub struct StdioRendezvous;

    impl Rendezvous for StdioRendezvous {
        fn peer(&mut self, mine: &PeerInfo) -> Option<PeerInfo> {
            let mut out = std::io::stdout().lock();
            writeln!(out, "peer {mine}").ok()?;
            out.flush().ok()?;
            let mut line = String::new();
            std::io::stdin().lock().read_line(&mut line).ok()?;
            match line.trim().parse() {
                Ok(p) => Some(p),
                Err(e) => {
                    eprintln!("mlx5-baremetal-example: the other side's facts {:?}: {e}", line.trim());
                    None
                }
            }
        }
        fn ready(&mut self, _: &PeerInfo) {}
    }
}

/// How long the host side waits for each completion of the exchange (the guest runs under TCG).
#[cfg(not(target_os = "none"))]
const HOST_PEER_TIMEOUT_US: u32 = 120_000_000;

#[cfg(not(target_os = "none"))]
fn main() -> std::process::ExitCode {
    use mlx5_sim::{Mode, SimConfig, SimDevice};
    let args: Vec<String> = std::env::args().skip(1).collect();
    let dev;
    let res = match args.iter().map(String::as_str).collect::<Vec<_>>()[..] {
        // The loopback run() on the simulator; the device's command trace, one `opcode op_mod` a line.
        [] => {
            dev = SimDevice::new(SimConfig::default());
            mlx5_firmware_example::run(dev.mmio(), dev.dma(), (), &mut dev.delay()).map(|_| ())
        }
        // The host side of the image's exchange: a simulated device (as mlx5-pci-proxy configures its own)
        // whose wire listens at ADDR, running run_peer() as the side that sends first; then its trace.
        ["--peer", addr] => {
            let cfg = SimConfig { mode: Mode::Threaded, num_uars: 256, ..SimConfig::default() };
            dev = SimDevice::new(cfg);
            if let Err(e) = dev.wire_listen(addr) {
                eprintln!("mlx5-baremetal-example: --peer {addr}: {e}");
                return std::process::ExitCode::FAILURE;
            }
            let mut rv = host::StdioRendezvous;
            mlx5_firmware_example::run_peer(
                dev.mmio(),
                dev.dma(),
                (),
                &mut dev.delay(),
                &mut rv,
                true,
                HOST_PEER_TIMEOUT_US,
            )
            .map(|r| {
                println!("passed rounds {} bytes_checked {} pages {}", r.rounds, r.bytes_checked, r.pages_reclaimed)
            })
        }
        _ => {
            eprintln!("usage: mlx5-baremetal-example [--peer HOST:PORT]");
            return std::process::ExitCode::from(2);
        }
    };
    match res {
        Ok(()) => {
            for c in dev.executed() {
                println!("{:#x} {}", c.opcode, c.op_mod);
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("mlx5-baremetal-example: failed on the simulator: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
