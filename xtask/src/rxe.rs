//! `cargo xtask rxe-interop`: the simulated ConnectX's RoCEv2 wire against Linux's software RoCE (`rdma_rxe`) in a
//! QEMU guest, `mlx5 pingpong` on one side and rdma-core's `ibv_rc_pingpong` (and `ibv_ud_pingpong`) on the
//! other, both directions.
//!
//! The recipe is ../shared/notes/rdma-rxe-in-qemu.md. The xtask
//! 1. installs what it needs from Debian (qemu-system-x86, busybox-static, ibverbs-utils, ibverbs-providers,
//!    iproute2, vde2) and unpacks a Debian kernel (shared with `vfio-test`);
//! 2. packs an initramfs: busybox, the RDMA modules in load order, `ibv_rc_pingpong`, `rdma`, the rxe provider and
//!    the library closure `ldd` names, and an `/init` that brings up rxe0 on the RoCE NIC and runs the ping-pong;
//! 3. builds the `mlx5` tool and, for each direction and size, boots the guest under TCG with two NICs: the RoCE
//!    NIC is `-netdev stream` on a UNIX socket that the simulated port plugs into (`mlx5 pingpong --qemu-sock`),
//!    or, for the runs on a VDE fabric (rping and the host's `ibv_rc_pingpong` on the drop-in, `wire=vde:URL`),
//!    `-netdev dgram` on libvdeplug's point-to-point socket that Debian's `vde_plug` joins to a `vde_switch` of the
//!    run's own ([`Fabric`]: QEMU 7.2 has no `-netdev vde`); the exchange NIC is QEMU user networking with
//!    `restrict=on` (host -> guest: a `hostfwd` bound to 127.0.0.1; guest -> host: a `guestfwd` to a relay here on
//!    127.0.0.1, into a network namespace of its own for a host server). Nothing leaves the machine.
//! 4. passes when both ping-pongs report success: ours checks every byte of every message, rc_pingpong runs with
//!    `-c`; the guest's verdict comes back through `isa-debug-exit`. Each run's pcap (our side, `--pcap`) is then
//!    decoded by tshark when it is installed (none malformed), and every RoCE frame QEMU saw on the cable (its
//!    `filter-dump`) has the ICRC an independent computation here gives. Two more runs lose one chosen frame,
//!    one each way, and rxe's counters must show the recovery. Faults on a real wire: Debian's `wirefilter`
//!    between two switches (loss, duplicates, reordering each way) with rping on both sides, every buffer
//!    checked: between two processes of this host (in CI, 3 % lost) and, with `--wirefilter` only (see
//!    [`Part`]), against the guest both ways at 5 %, rxe's recovery counters required to move; each of our ports
//!    logs its own recoveries at exit (`MLX5_RS_LOG=info`) for the report.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::verbs_guest::{self, LIBDIR};
use crate::vfio_test::{apt_install, ensure_kernel, find_module, have, module_bytes, run, wait_until, Cpio};
use crate::Reap;

/// The modules rdma_rxe needs, in load order (crc32_generic is not a declared dependency but rxe's ICRC needs
/// it; without it `rdma link add` fails).
const MODULES: &[&str] = &[
    "virtio_ring",
    "virtio",
    "virtio_pci_modern_dev",
    "virtio_pci_legacy_dev",
    "virtio_pci",
    "failover",
    "net_failover",
    "virtio_net",
    "crc32_generic",
    "ib_core",
    "ib_uverbs",
    // rdma_cm and its user interface (`/dev/infiniband/rdma_cm`), for rping; rdma_cm's configfs directory needs
    // configfs, a module in Debian's kernel.
    "configfs",
    "ib_cm",
    "iw_cm",
    "rdma_cm",
    "rdma_ucm",
    "udp_tunnel",
    "ip6_udp_tunnel",
    "rdma_rxe",
];
/// What runs in the guest, with the libraries `ldd` finds for them.
const GUEST_BINARIES: &[&str] = &["ibv_rc_pingpong", "ibv_ud_pingpong", "ibv_devinfo", "rdma"];
/// The guest's RoCE address and ours (a RoCE v2 GID each, `::ffff:a.b.c.d`).
const GUEST_IP: &str = "10.0.0.1";
const SIM_IP: &str = "10.0.0.2";
/// The port rping listens on (either side).
const RPING_PORT: u16 = 7174;
/// rping's iterations, each buffer printed (`-v`) and checked.
const RPING_COUNT: u32 = 100;
/// The simulated port's GID table in Linux's order: v1 and v2 link-local, then v1 and v2 of the IPv4 address.
const SIM_GID_INDEX: &str = "3";
/// rc_pingpong's exchange port in the guest; the guest reaches the host's at this address (guestfwd).
const GUEST_PORT: u16 = 18515;
const HOST_ALIAS: &str = "10.0.2.100";
/// (message size, iterations): one packet, four packets and 64 at the guest's 1024-byte path MTU.
const RUNS: &[(usize, u32)] = &[(64, 50), (4096, 20), (65536, 5)];
const RUN_TIMEOUT: Duration = Duration::from_secs(300);
/// How long the guest lets its ping-pong run before it prints rxe's counters and ends it (a healthy run takes
/// seconds; the host's `RUN_TIMEOUT` covers the boot as well).
const GUEST_DEADLINE_S: u32 = 150;

fn ensure_packages() -> Result<(), String> {
    verbs_guest::ensure_packages(&["rxe"])?;
    // vde_switch and vde_plug for the runs on a VDE fabric.
    crate::vde::ensure_vde()?;
    let mut need = Vec::new();
    if !have("qemu-system-x86_64") {
        need.push("qemu-system-x86");
    }
    if !have("rdma") {
        need.push("iproute2");
    }
    // The guest's rping runs on Debian's librdmacm (the closure `ldd` finds here).
    if !Path::new("/").join(LIBDIR).join("librdmacm.so.1").exists() {
        need.push("librdmacm1");
    }
    if !need.is_empty() {
        apt_install(&need)?;
    }
    Ok(())
}

/// The guest's `/init`: modules, addresses, rxe0 on eth0, then rc_pingpong as the kernel command line says
/// (`rxe_mode=server|client rxe_size=N rxe_iters=N`), the verdict through isa-debug-exit.
fn init_script() -> String {
    format!(
        r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin:/usr/bin LD_LIBRARY_PATH=/{LIBDIR}
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
for m in $(cat /modules/order); do insmod /modules/$m.ko || echo "init: insmod $m failed"; done
for kv in $(cat /proc/cmdline); do case "$kv" in rxe_*=*) export "$kv";; esac; done
ip link set lo up
ip link set eth0 up
ip addr add {GUEST_IP}/24 dev eth0
ip link set eth1 up
ip addr add 10.0.2.15/24 dev eth1
rdma link add rxe0 type rxe netdev eth0 || echo "init: rdma link add failed"
G=
for n in 0 1 2 3 4 5 6 7; do
  g=$(cat /sys/class/infiniband/rxe0/ports/1/gids/$n 2>/dev/null)
  t=$(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$n 2>/dev/null)
  if [ "$g" = "0000:0000:0000:0000:0000:ffff:0a00:0001" ] && [ "$t" = "RoCE v2" ]; then G=$n; break; fi
done
echo "rxe-interop: guest GID index $G"
counters() {{
  for f in /sys/class/infiniband/rxe0/ports/1/hw_counters/*; do
    v=$(cat $f)
    [ "$v" != 0 ] && echo "rxe-counter: ${{f##*/}} $v"
  done
}}
PP=ibv_rc_pingpong
[ "$rxe_ud" = 1 ] && PP=ibv_ud_pingpong
[ "$rxe_app" = rping ] && PP=rping
PEER=
[ "$rxe_mode" = server ] || PEER={HOST_ALIAS}
if [ "$PP" = rping ] && [ "$rxe_mode" = server ]; then
  rping -s -a {GUEST_IP} -p {RPING_PORT} -C $rxe_iters -v -V &
elif [ "$PP" = rping ]; then
  rping -c -a {SIM_IP} -p {RPING_PORT} -C $rxe_iters -v -V &
else
  $PP -d rxe0 -g $G -s $rxe_size -n $rxe_iters -c $PEER &
fi
pid=$!
# A ping-pong that never ends (rxe reads retry_cnt 7 as unlimited, so a request nobody answers is sent again
# forever) shows rxe's counters, so the host sees what it was waiting for, and fails.
( sleep {GUEST_DEADLINE_S}; echo "rxe-interop: $PP still running after {GUEST_DEADLINE_S} s"; counters; kill $pid ) &
dog=$!
if [ "$PP" = rping ] && [ "$rxe_mode" = server ]; then
  # rdma_cm's listening ID, as the kernel's resource tracking shows it.
  while kill -0 $pid 2>/dev/null && ! rdma resource show cm_id 2>/dev/null | grep -q LISTEN; do sleep 0.2; done
  echo "rxe-interop: server listening"
elif [ "$rxe_mode" = server ]; then
  while ! grep -q ':4853 0000' /proc/net/tcp /proc/net/tcp6 2>/dev/null; do sleep 0.2; done
  echo "rxe-interop: server listening"
fi
wait $pid
rc=$?
kill $dog 2>/dev/null
echo "rxe-interop: $PP exit $rc"
counters
if [ $rc -eq 0 ]; then v='\001'; else v='\002'; fi
printf "$v" | dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null
poweroff -f
"#
    )
}

fn build_initramfs(work: &Path, modules_dir: &Path, rping: &Path) -> Result<PathBuf, String> {
    let mut c = Cpio::default();
    for d in ["bin", "sbin", "dev", "proc", "sys", "tmp", "run", "modules"] {
        c.dir(d);
    }
    let busybox = std::fs::read("/bin/busybox").map_err(|e| format!("/bin/busybox: {e}"))?;
    c.file("bin/busybox", true, &busybox);
    c.symlink("bin/sh", "busybox");
    // Modules: every one found, in order; one the kernel has built in is skipped.
    let builtin = std::fs::read_to_string(modules_dir.join("modules.builtin")).unwrap_or_default();
    let mut order = String::new();
    for m in MODULES {
        match find_module(modules_dir, m) {
            Some(p) => {
                c.file(&format!("modules/{m}.ko"), false, &module_bytes(&p)?);
                order.push_str(m);
                order.push('\n');
            }
            None if builtin.lines().any(|l| l.ends_with(&format!("/{m}.ko"))) => {}
            None => return Err(format!("module {m} not found under {}", modules_dir.display())),
        }
    }
    c.file("modules/order", false, order.as_bytes());
    let rping = rping.to_string_lossy();
    let bins: Vec<&str> = GUEST_BINARIES.iter().copied().chain([rping.as_ref()]).collect();
    let libs = verbs_guest::add_userspace(&mut c, &bins, &["rxe"])?;
    // glibc dlopens libgcc_s for pthread_exit (rping's threads end with it); no ldd closure names it.
    let gcc_s = Path::new("/").join(LIBDIR).join("libgcc_s.so.1");
    c.file(
        &format!("{LIBDIR}/libgcc_s.so.1"),
        true,
        &std::fs::read(&gcc_s).map_err(|e| format!("{}: {e}", gcc_s.display()))?,
    );
    c.file("init", true, init_script().as_bytes());
    let out = work.join("initramfs.cpio");
    std::fs::write(&out, c.finish()).map_err(|e| e.to_string())?;
    println!("rxe-interop: initramfs with {} modules and {libs} libraries", order.lines().count());
    Ok(out)
}

fn build_tool(root: &Path) -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let status = Command::new(cargo)
        .args(["build", "-q", "-p", "mlx5-tool", "--bin", "mlx5"])
        .current_dir(root)
        .status()
        .map_err(|e| format!("failed to run cargo: {e}"))?;
    if !status.success() {
        return Err("building mlx5 failed".into());
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    Ok(target.join("debug/mlx5"))
}

fn free_port() -> Result<u16, String> {
    let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// `CLONE_NEWNET` (`<sched.h>`).
const CLONE_NEWNET: i32 = 0x4000_0000;

extern "C" {
    /// glibc's `int setns(int fd, int nstype)`.
    fn setns(fd: i32, nstype: i32) -> i32;
}

/// Moves the calling thread (only it) into the network namespace of process `pid`.
fn enter_netns(pid: u32) -> Result<(), String> {
    use std::os::fd::AsRawFd;
    let path = format!("/proc/{pid}/ns/net");
    let ns = std::fs::File::open(&path).map_err(|e| format!("{path}: {e}"))?;
    // SAFETY: `ns` is an open namespace file for the duration of the call; setns changes only this thread's
    // network namespace, which the sockets this thread makes afterwards belong to.
    if unsafe { setns(ns.as_raw_fd(), CLONE_NEWNET) } != 0 {
        return Err(format!("setns({path}): {}", std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Copies bytes both ways between QEMU's guestfwd connection (accepted on `l`) and the ping-pong server at
/// 127.0.0.1:`to` (connected with retries, as it may still be starting). With `netns`, the server is in the
/// network namespace of the process whose id comes there: the connection is made from inside it.
fn relay(l: TcpListener, to: u16, netns: Option<mpsc::Receiver<u32>>) {
    std::thread::spawn(move || {
        let Ok((guest, _)) = l.accept() else { return };
        let end = Instant::now() + RUN_TIMEOUT;
        let pid = match netns.map(|rx| rx.recv_timeout(RUN_TIMEOUT)) {
            None => None,
            Some(Ok(pid)) => Some(pid),
            Some(Err(_)) => return,
        };
        let host = loop {
            // The server may not have left this namespace yet (`unshare` runs first): entered again each try.
            if let Some(pid) = pid {
                if let Err(e) = enter_netns(pid) {
                    println!("rxe-interop: relay: {e}");
                    return;
                }
            }
            match TcpStream::connect(("127.0.0.1", to)) {
                Ok(s) => break s,
                Err(_) if Instant::now() < end => std::thread::sleep(Duration::from_millis(50)),
                Err(_) => return,
            }
        };
        let pipe = |mut a: TcpStream, mut b: TcpStream| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                while let Ok(n) = a.read(&mut buf) {
                    if n == 0 || b.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
                let _ = b.shutdown(std::net::Shutdown::Write);
            })
        };
        if let (Ok(g2), Ok(h2)) = (guest.try_clone(), host.try_clone()) {
            pipe(guest, h2);
            pipe(host, g2);
        }
    });
}

/// Echoes the guest console with a prefix and forwards each line.
fn console(child: &mut Child) -> Result<mpsc::Receiver<String>, String> {
    let stdout = child.stdout.take().ok_or("no qemu stdout")?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).split(b'\n').map_while(Result::ok) {
            let l = String::from_utf8_lossy(&line).trim_end_matches('\r').to_string();
            println!("guest| {l}");
            let _ = std::io::stdout().flush();
            let _ = tx.send(l);
        }
    });
    Ok(rx)
}

fn wait_child(child: &mut Child, end: Instant, what: &str) -> Result<std::process::ExitStatus, String> {
    if let Some(s) = wait_until(child, end, Duration::from_millis(50))? {
        return Ok(s);
    }
    let _ = child.kill();
    let _ = child.wait();
    Err(format!("{what} did not finish within {} s", RUN_TIMEOUT.as_secs()))
}

/// The share of frames `wirefilter` loses each way in the lossy runs with the guest (`--wirefilter`).
const WIRE_LOSS_PCT: f64 = 5.0;

/// The share lost each way in the run between two processes of this host that CI makes ([`CI_PAIR_PINGS`]).
/// Some recovery is certain even in a run this short: besides the loss, the reordering turns about half of the
/// two-packet messages around, which the responder NAKs.
const CI_WIRE_LOSS_PCT: f64 = 3.0;

/// What `wirefilter` does to the frames between two switches besides the loss: 2 % duplicated, and a delay of
/// 1-3 ms without FIFO order (`-N`), so frames overtake each other (as the simulator's own wirefilter tests do).
fn wirefilter_faults(loss_pct: f64) -> Vec<String> {
    ["-l", &loss_pct.to_string(), "-D", "2", "-d", "2+1", "-N"].iter().map(|s| s.to_string()).collect()
}

/// Debian's `wirefilter` joining the switches on `a` and `b` with [`wirefilter_faults`]; it lives as long as the
/// `Reap`.
fn start_filter(a: &Path, b: &Path, loss_pct: f64) -> Result<Reap, String> {
    let mut filter = Reap(
        Command::new("wirefilter")
            .arg("-v")
            .arg(format!("{}:{}", a.display(), b.display()))
            .args(wirefilter_faults(loss_pct))
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start wirefilter (Debian: vde2): {e}"))?,
    );
    wait_for(|| plugged_in(a) && plugged_in(b), &mut filter, "wirefilter", "both switches plugged")?;
    Ok(filter)
}

/// The drop-in's own recovery counts from a program's stderr (`MLX5_RS_LOG=info`: the line each simulated port
/// logs at exit, `mlx5_N: wire recoveries: ...`).
fn our_recoveries(stderr: &str) -> Vec<String> {
    stderr
        .lines()
        .filter_map(|l| l.find("wire recoveries: ").map(|at| l[at + "wire recoveries: ".len()..].to_string()))
        .collect()
}

/// Whether one of those lines shows a recovery (any count before its word is non-zero).
fn recovered(lines: &[String]) -> bool {
    lines.iter().any(|l| {
        let counts = l.split(';').next().unwrap_or("");
        counts.trim_start_matches("at least: ").split(", ").any(|c| c.split(' ').next().is_some_and(|n| n != "0"))
    })
}

/// rping's iterations between two processes of this host through `wirefilter` in CI, and their buffer size: two
/// packets a message at the fabric's 1024-byte MTU, so a message can lose either, or have them reordered. A
/// loss the responder cannot see (a message's last packet, an ACK) waits for the ACK timer: 0.5 s, Linux's for a
/// RoCE route, so these runs are slow for their size (30 pings: 10-14 s at 3 % here, 10: 5 s). Messages of 8
/// packets through this filter take 1.2-1.4 s a ping, nearly every one reordered.
const CI_PAIR_PINGS: (u32, usize) = (10, 2000);

/// The same with `--wirefilter`: 200 pings of two packets (95 s at 5 % here, mostly ACK timers).
const PAIR_PINGS: (u32, usize) = (200, 2000);

/// The client's address in that run (the server has the simulator's usual [`SIM_IP`]).
const PAIR_CLIENT_IP: &str = "10.0.0.3";

/// Debian's unmodified rping between two processes of this host through `wirefilter` (no guest): each on the
/// drop-in librdmacm and libibverbs with a simulated port on a `vde_switch` of its own (`sim:ipv4=A:wire=vde:URL`;
/// the client names the server's address in `MLX5_RS_RDMACM_ADDRS` and finds its MAC by ARP, across the filter
/// like everything else), the filter joining the two switches
/// with `loss_pct` % lost, 2 % duplicated and frames reordered each way. Every buffer the client prints (`-v`) is
/// checked letter by letter, in order, one per iteration (nothing lost or repeated); both rpings check each
/// round trip byte for byte themselves (`-V`) and must exit 0; and the two ports' recovery counts (each logs its
/// own at exit) must show the loss was recovered from. Returns the seconds it took.
fn run_rping_pair(
    work: &Path,
    ld: &str,
    rping: &Path,
    (count, size): (u32, usize),
    loss_pct: f64,
) -> Result<f64, String> {
    let tag = format!("rping-pair-wirefilter-{count}");
    let (a, b) = (work.join(format!("vde-{tag}-a")), work.join(format!("vde-{tag}-b")));
    let _switches = (start_switch(&a)?, start_switch(&b)?);
    let filter = start_filter(&a, &b, loss_pct)?;
    let file = |name: &str| std::fs::File::create(work.join(format!("{tag}-{name}"))).map_err(|e| e.to_string());
    let read = |name: &str| std::fs::read_to_string(work.join(format!("{tag}-{name}"))).unwrap_or_default();
    let (n, s, port) = (count.to_string(), size.to_string(), RPING_PORT.to_string());
    let spawn = |side: &str, ip: &str, dir: &Path, args: &[&str]| -> Result<Child, String> {
        let mut c = Command::new(rping);
        crate::libibverbs::on_dropin(&mut c, ld, &format!("sim:ipv4={ip}:wire=vde:vde://{}", dir.display()))
            .env("MLX5_RS_LOG", "info")
            .env("MLX5_RS_RDMACM_ADDRS", SIM_IP)
            .args(args)
            .args(["-a", SIM_IP, "-p", &port, "-C", &n, "-S", &s, "-V"])
            .stdout(Stdio::from(file(&format!("{side}.out"))?))
            .stderr(Stdio::from(file(&format!("{side}.err"))?));
        c.spawn().map_err(|e| format!("failed to start rping: {e}"))
    };
    println!(
        "rxe-interop: {tag}: rping -v -V -C {count} -S {size} between two processes on the drop-in, wirefilter {:?}",
        wirefilter_faults(loss_pct).join(" ")
    );
    let start = Instant::now();
    let end = start + RUN_TIMEOUT;
    let mut server = spawn("server", SIM_IP, &a, &["-s"])?;
    // The server's rdma_listen follows its device's plug-in at once; a client that comes first is refused and
    // retries (rping does not), so it waits a moment.
    std::thread::sleep(Duration::from_millis(500));
    let mut client = spawn("client", PAIR_CLIENT_IP, &b, &["-c", "-v"])?;
    let client_status = wait_child(&mut client, end, "rping (client)");
    let server_status = wait_child(&mut server, end, "rping (server)");
    let secs = start.elapsed().as_secs_f64();
    drop(filter);
    let (co, ce, se) = (read("client.out"), read("client.err"), read("server.err"));
    let both = format!("client stdout:\n{co}\nclient stderr:\n{ce}\nserver stderr:\n{se}");
    match (&client_status, &server_status) {
        (Ok(c), Ok(s)) if c.success() && s.success() => {}
        _ => return Err(format!("{tag}: client {client_status:?}, server {server_status:?}\n{both}")),
    }
    let pings: Vec<&str> = co.lines().filter(|l| l.starts_with("ping data:")).collect();
    let bad = pings.iter().enumerate().find(|(i, l)| !crate::libibverbs::rdmacm::rping_line_ok(l, *i));
    if pings.len() != count as usize || bad.is_some() {
        return Err(format!("{tag}: {} ping lines of {count}, first bad {bad:?}\n{both}", pings.len()));
    }
    let (ours_c, ours_s) = (our_recoveries(&ce), our_recoveries(&se));
    if ours_c.is_empty() || ours_s.is_empty() {
        return Err(format!("{tag}: a side logged no recovery counts\n{both}"));
    }
    if !recovered(&ours_c) && !recovered(&ours_s) {
        return Err(format!("{tag}: {loss_pct} % lost each way, yet neither port recovered from anything\n{both}"));
    }
    println!(
        "rxe-interop: {tag}: {count} pings of {size} B, each buffer as rping wrote it, in order, none twice ({secs:.1} s)\n\
         rxe-interop: {tag}: client port: {}\nrxe-interop: {tag}: server port: {}",
        ours_c.join(" | "),
        ours_s.join(" | ")
    );
    Ok(secs)
}

/// rdma_rxe's counters that move when it recovers from a lost frame: a request after a gap (NAKed), a request
/// again (its ACK was lost), a sequence NAK received, a request sent again after its ACK timer.
const RECOVERY_COUNTERS: &[&str] = &["out_of_seq_request", "duplicate_request", "rcvd_seq_err", "completer_retry_err"];

/// A lost-frame run: the simulated port's link loses one chosen RoCE frame (`MLX5_SIM_DROP_OUT` /
/// `MLX5_SIM_DROP_IN`), and the rxe counter that shows the recovery must have moved.
struct Loss {
    env: &'static str,
    nth: u32,
    /// An rxe hw_counter that must be non-zero afterwards.
    counter: &'static str,
}

/// One ping-pong: the guest as `mode` ("server" or "client"), ours the other side. Returns the seconds it took.
/// What every run uses: the work directory, the guest's kernel and initramfs, the `mlx5` binary.
struct Setup {
    work: PathBuf,
    kernel: PathBuf,
    initrd: PathBuf,
    mlx5: PathBuf,
}

/// Our side of a run: the `mlx5` tool, or rdma-core's own `ibv_rc_pingpong` on this host over the drop-in
/// `libibverbs.so.1` in the given directory: plugged into the guest NIC's stream socket (`wire=qemu`, as a client
/// only), or on a VDE switch with the guest NIC (`wire=vde:URL`), either side; its server listens on every
/// address, so it runs in a network namespace of its own where there is only loopback.
enum Ours<'a> {
    Tool,
    /// The tool on the guest's VDE switch (`--wire vde:URL`); its `--pcap` must hold every RoCE frame the guest
    /// NIC saw.
    ToolVde,
    HostRcPingpong(&'a Path),
    HostRcPingpongVde(&'a Path),
}

/// QEMU for one run: the kernel and initramfs, `/init`'s parameters, the RoCE NIC on the `-netdev` `roce` (id `n0`:
/// a stream socket our port plugs into, or a datagram socket on a VDE switch; its frames captured to `pcap`), the
/// exchange NIC as user networking (`user`).
fn guest_command((kernel, initrd): (&Path, &Path), params: &str, roce: &str, pcap: &Path, user: &str) -> Command {
    let mut q = Command::new("qemu-system-x86_64");
    q.args(["-accel", "tcg", "-cpu", "max", "-m", "1G", "-smp", "2", "-nographic", "-no-reboot", "-nodefaults"])
        .args(["-serial", "stdio", "-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        // `no_timer_check`: under load the TCG guest's IO-APIC timer check can fail and panic the boot ("IO-APIC +
        // timer doesn't work!"), as it did once in a row of runs.
        .arg("-append")
        .arg(format!("console=ttyS0 panic=-1 quiet no_timer_check {params}"))
        .arg("-netdev")
        .arg(roce)
        .args(["-device", "virtio-net-pci,netdev=n0,mac=52:54:00:00:00:01"])
        .arg("-object")
        .arg(format!("filter-dump,id=f0,netdev=n0,file={},maxlen=2000", pcap.display()))
        .arg("-netdev")
        .arg(user)
        .args(["-device", "virtio-net-pci,netdev=n1,mac=52:54:00:00:00:11"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    q
}

/// The RoCE NIC as a QEMU stream socket (`server=on`) our port connects to (`wire=qemu`, `--qemu-sock`).
fn stream_netdev(sock: &Path) -> String {
    format!("stream,id=n0,server=on,addr.type=unix,addr.path={}", sock.display())
}

/// A VDE fabric for one run: Debian's `vde_switch` on a directory of its own, and Debian's `vde_plug` joining it
/// to libvdeplug's point-to-point form (`ptp://PATH`: raw Ethernet frames, one per UNIX datagram, the first end
/// bound to PATH and sending to `PATH+`), which QEMU 7.2's `-netdev dgram` speaks from the other end (it has no
/// `-netdev vde`). The guest NIC is then one more port on the switch, as a simulated port with `wire=vde:URL` is.
/// Both processes end when the fabric is dropped. With a loss rate, the guest's plug is on a second switch, and
/// Debian's `wirefilter` joins the two, losing that share of the frames each way.
struct Fabric {
    dir: PathBuf,
    ptp: PathBuf,
    plug: Reap,
    /// The guest's switch and the `wirefilter` between the two, with a loss rate.
    lossy: Option<(PathBuf, Reap, Reap)>,
    switch: Reap,
}

/// How long the switch and the plug may take to make their sockets.
const FABRIC_START: Duration = Duration::from_secs(10);

/// Waits until `ready` holds; fails when `who` ended or the time ran out.
fn wait_for(ready: impl Fn() -> bool, who: &mut Reap, name: &str, what: &str) -> Result<(), String> {
    let end = Instant::now() + FABRIC_START;
    while !ready() {
        if let Some(st) = who.0.try_wait().map_err(|e| e.to_string())? {
            return Err(format!("{name} ended ({st}) before {what}"));
        }
        if Instant::now() > end {
            return Err(format!("no {what} from {name} in {} s", FABRIC_START.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Waits until `who` made the socket `path`.
fn wait_for_socket(path: &Path, who: &mut Reap, name: &str) -> Result<(), String> {
    wait_for(|| path.exists(), who, name, &format!("{}", path.display()))
}

/// A `vde_switch` in the foreground on the directory `dir`, its console on a pipe we hold: it lives as long as
/// the `Reap`.
pub(crate) fn start_switch(dir: &Path) -> Result<Reap, String> {
    let _ = std::fs::remove_dir_all(dir);
    let mut switch = Reap(
        Command::new("vde_switch")
            .arg("-s")
            .arg(dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .map_err(|e| format!("cannot start vde_switch (Debian: vde2): {e}"))?,
    );
    wait_for_socket(&dir.join("ctl"), &mut switch, "vde_switch")?;
    Ok(switch)
}

/// Whether a plug joined the switch on `dir` (each makes a data socket there beside `ctl`).
fn plugged_in(dir: &Path) -> bool {
    std::fs::read_dir(dir).map(|d| d.filter_map(Result::ok).any(|e| e.file_name() != "ctl")).unwrap_or(false)
}

impl Fabric {
    /// `loss`: the percentage of frames `wirefilter` loses each way between our switch and the guest's.
    fn start(work: &Path, tag: &str, loss: Option<f64>) -> Result<Fabric, String> {
        let dir = work.join(format!("vde-{tag}"));
        let ptp = work.join(format!("vde-{tag}.ptp"));
        let _ = std::fs::remove_file(&ptp);
        let _ = std::fs::remove_file(format!("{}+", ptp.display()));
        let switch = start_switch(&dir)?;
        let lossy = match loss {
            None => None,
            Some(pct) => {
                let guest_dir = work.join(format!("vde-{tag}-guest"));
                let guest_switch = start_switch(&guest_dir)?;
                let filter = start_filter(&dir, &guest_dir, pct)?;
                Some((guest_dir, guest_switch, filter))
            }
        };
        let guest_side = lossy.as_ref().map_or(&dir, |(d, _, _)| d);
        let mut plug = Reap(
            Command::new("vde_plug")
                .arg(format!("vde://{}", guest_side.display()))
                .arg(format!("ptp://{}", ptp.display()))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .map_err(|e| format!("cannot start vde_plug (Debian: vdeplug): {e}"))?,
        );
        wait_for_socket(&ptp, &mut plug, "vde_plug")?;
        Ok(Fabric { dir, ptp, plug, lossy, switch })
    }

    /// The switch as a libvdeplug URL (`wire=vde:URL`).
    fn url(&self) -> String {
        format!("vde://{}", self.dir.display())
    }

    /// The guest's RoCE NIC on the plug's point-to-point socket: bound to `PATH+`, sending to `PATH`.
    fn netdev(&self) -> String {
        let p = self.ptp.display();
        format!("dgram,id=n0,local.type=unix,local.path={p}+,remote.type=unix,remote.path={p}")
    }

    /// The drop-in's device: a simulated port on this switch at the simulator's address (GID index 3).
    fn devices(&self) -> String {
        format!("sim:ipv4={SIM_IP}:wire=vde:{}", self.url())
    }
}

impl Drop for Fabric {
    fn drop(&mut self) {
        // The plug leaves the switch, the filter and the switches end, then their sockets go.
        self.plug.end();
        if let Some((dir, switch, filter)) = &mut self.lossy {
            filter.end();
            switch.end();
            let _ = std::fs::remove_dir_all(dir);
        }
        self.switch.end();
        let _ = std::fs::remove_dir_all(&self.dir);
        let _ = std::fs::remove_file(&self.ptp);
        let _ = std::fs::remove_file(format!("{}+", self.ptp.display()));
    }
}

/// The guest's console until `want` (`None`: the guest stopped first, or `end` passed).
fn wait_line(lines: &mpsc::Receiver<String>, want: &str, end: Instant) -> Option<()> {
    loop {
        match lines.recv_timeout(Duration::from_millis(200)) {
            Ok(l) if l.contains(want) => return Some(()),
            Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return None,
        }
        if Instant::now() > end {
            return None;
        }
    }
}

/// Debian's unmodified rping on this host, over the drop-in librdmacm and libibverbs (`ld_path`) and a simulated
/// port with the address 10.0.0.2 on a VDE switch the guest NIC is on too (`wire=vde:URL`), against Linux's
/// rdma_cm and rping over rdma_rxe in the guest. `mode` is the guest's side. Both rpings run `-v -V -C 100`; the client's printed buffers are checked
/// letter by letter (ours from its output file, the guest's from the console), both must exit 0. With
/// `wire_loss`, `wirefilter` is between our switch and the guest's (that share lost each way, duplicates,
/// reordering): rxe's recovery counters must move, and our port's (logged at exit) are reported beside them.
fn run_rping(setup: &Setup, mode: &str, ld_path: &str, rping: &Path, wire_loss: Option<f64>) -> Result<f64, String> {
    let tag = format!("rping-guest-{mode}{}", if wire_loss.is_some() { "-wirefilter" } else { "" });
    let guest_pcap = setup.work.join(format!("guest-{tag}.pcap"));
    let out_file = setup.work.join(format!("host-{tag}.out"));
    let err_file = setup.work.join(format!("host-{tag}.err"));
    let fabric = Fabric::start(&setup.work, &tag, wire_loss)?;
    let params = format!("rxe_mode={mode} rxe_app=rping rxe_size=0 rxe_iters={RPING_COUNT} rxe_ud=0");
    let mut q =
        guest_command((&setup.kernel, &setup.initrd), &params, &fabric.netdev(), &guest_pcap, "user,id=n1,restrict=on");
    println!(
        "rxe-interop: {tag}: guest rping as {mode}, host rping on the drop-in librdmacm, {RPING_COUNT} pings, both on \
         a VDE switch"
    );
    let start = Instant::now();
    let end = start + RUN_TIMEOUT;
    let mut qemu = q.spawn().map_err(|e| format!("failed to start qemu: {e}"))?;
    let lines = console(&mut qemu)?;
    if mode == "server" && wait_line(&lines, "rxe-interop: server listening", end).is_none() {
        let _ = qemu.kill();
        return Err(format!("{tag}: the guest's rping never listened"));
    }
    let port = RPING_PORT.to_string();
    let count = RPING_COUNT.to_string();
    let mut c = Command::new(rping);
    crate::libibverbs::on_dropin(&mut c, ld_path, &fabric.devices());
    if mode == "server" {
        // The guest is no simulated host: the static neighbour table names it (its MAC comes from ARP).
        c.env("MLX5_RS_RDMACM_ADDRS", GUEST_IP).args(["-c", "-a", GUEST_IP]);
    } else {
        c.args(["-s", "-a", SIM_IP]);
    }
    c.args(["-p", &port, "-C", &count, "-v", "-V"])
        .env("MLX5_RS_LOG", "info")
        .stdout(Stdio::from(std::fs::File::create(&out_file).map_err(|e| e.to_string())?))
        .stderr(Stdio::from(std::fs::File::create(&err_file).map_err(|e| e.to_string())?));
    let mut ours = c.spawn().map_err(|e| format!("failed to start rping: {e}"))?;
    let ours_status = wait_child(&mut ours, end, "rping (host)");
    let qemu_status = wait_child(&mut qemu, end, "the guest");
    let secs = start.elapsed().as_secs_f64();
    let (ours_status, qemu_status) = (ours_status?, qemu_status?);
    let console: Vec<String> = lines.iter().collect();
    let host_out = std::fs::read_to_string(&out_file).map_err(|e| e.to_string())?;
    let host_err = std::fs::read_to_string(&err_file).unwrap_or_default();
    println!("rxe-interop: {tag}: host rping {ours_status}, guest {qemu_status}, {secs:.1} s");
    if !ours_status.success() || qemu_status.code() != Some(3) {
        return Err(format!(
            "{tag}: rping failed (host {ours_status}, guest {qemu_status})\nhost:\n{host_out}\nhost stderr:\n\
             {host_err}\nguest:\n{}",
            console.join("\n")
        ));
    }
    // The client prints `ping data: ...` per iteration; the console may prefix nothing else on those lines.
    let client: Vec<&str> = if mode == "server" {
        host_out.lines().collect()
    } else {
        console.iter().map(|l| l.trim_end_matches('\r')).collect()
    };
    let pings: Vec<&str> = client.into_iter().filter(|l| l.starts_with("ping data:")).collect();
    let bad = pings.iter().enumerate().find(|(i, l)| !crate::libibverbs::rdmacm::rping_line_ok(l, *i));
    if pings.len() != RPING_COUNT as usize || bad.is_some() {
        return Err(format!("{tag}: {} ping lines of {RPING_COUNT}, first bad {bad:?}", pings.len()));
    }
    let who = if mode == "server" { "host" } else { "guest" };
    println!("rxe-interop: {tag}: {RPING_COUNT} pings, each buffer the {who} client printed as rping wrote it: ok");
    if let Some(pct) = wire_loss {
        let rxe: Vec<&str> = console.iter().filter_map(|l| l.strip_prefix("rxe-counter: ")).collect();
        let ours = our_recoveries(&host_err);
        if !rxe.iter().any(|c| RECOVERY_COUNTERS.contains(&c.split_whitespace().next().unwrap_or(""))) {
            return Err(format!(
                "{tag}: {pct} % lost each way, yet no rxe recovery counter moved: {rxe:?}; ours {ours:?}"
            ));
        }
        println!(
            "rxe-interop: {tag}: {pct} % lost each way by wirefilter, every ping right; rxe: {}; our port: {}",
            rxe.join(", "),
            ours.join(" | ")
        );
    }
    let n = check_icrc(&guest_pcap)?;
    println!("rxe-interop: {tag}: {n} RoCE frames on the cable, every ICRC right");
    Ok(secs)
}

fn run_one(
    setup: &Setup,
    mode: &str,
    (size, iters): (usize, u32),
    loss: Option<&Loss>,
    ud: bool,
    ours_is: &Ours<'_>,
) -> Result<f64, String> {
    let (work, kernel, initrd, mlx5) = (&setup.work, &setup.kernel, &setup.initrd, &setup.mlx5);
    let host_lib = match ours_is {
        Ours::HostRcPingpong(lib) if mode == "server" && !ud && loss.is_none() => Some(*lib),
        Ours::HostRcPingpongVde(lib) if !ud && loss.is_none() => Some(*lib),
        Ours::HostRcPingpong(_) => return Err("the host's ibv_rc_pingpong runs only as an RC client".into()),
        Ours::HostRcPingpongVde(_) => return Err("the host's ibv_rc_pingpong runs RC without a lost frame".into()),
        Ours::ToolVde if loss.is_some() => return Err("a lost frame is the --qemu-sock link's".into()),
        Ours::Tool | Ours::ToolVde => None,
    };
    let vde = matches!(ours_is, Ours::HostRcPingpongVde(_) | Ours::ToolVde);
    let kind = match (ud, host_lib, vde) {
        (true, _, false) => "-ud",
        (true, _, true) => "-ud-vde",
        (false, Some(_), false) => "-host-rc_pingpong",
        (false, Some(_), true) => "-host-rc_pingpong-vde",
        (false, None, false) => "",
        (false, None, true) => "-vde",
    };
    let tag = format!("{mode}-{size}{kind}{}", if loss.is_some() { "-loss" } else { "" });
    let sock = work.join(format!("roce-{tag}.sock"));
    let pcap = work.join(format!("mlx5-{tag}.pcap"));
    let guest_pcap = work.join(format!("guest-{tag}.pcap"));
    let _ = std::fs::remove_file(&sock);
    // The guest NIC and our port on one VDE switch, or our port plugged into the NIC's socket.
    let fabric = if vde { Some(Fabric::start(work, &tag, None)?) } else { None };
    let roce = fabric.as_ref().map_or_else(|| stream_netdev(&sock), Fabric::netdev);
    let host_port = free_port()?;
    let mut user = format!("user,id=n1,restrict=on,hostfwd=tcp:127.0.0.1:{host_port}-10.0.2.15:{GUEST_PORT}");
    let ours = free_port()?;
    // The host server's process id, for a relay into its network namespace.
    let mut server_pid = None;
    if mode == "client" {
        let l = TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        let relay_port = l.local_addr().map_err(|e| e.to_string())?.port();
        let netns = host_lib.map(|_| {
            let (tx, rx) = mpsc::channel();
            server_pid = Some(tx);
            rx
        });
        relay(l, ours, netns);
        user.push_str(&format!(",guestfwd=tcp:{HOST_ALIAS}:{GUEST_PORT}-tcp:127.0.0.1:{relay_port}"));
    }
    let mut q = guest_command(
        (kernel, initrd),
        &format!("rxe_mode={mode} rxe_size={size} rxe_iters={iters} rxe_ud={}", u8::from(ud)),
        &roce,
        &guest_pcap,
        &user,
    );
    let pp = if ud { "ibv_ud_pingpong" } else { "ibv_rc_pingpong" };
    println!("rxe-interop: {tag}: guest runs {pp} as {mode}, {iters} x {size} B");
    let start = Instant::now();
    let end = start + RUN_TIMEOUT;
    let mut qemu = q.spawn().map_err(|e| format!("failed to start qemu: {e}"))?;
    let lines = console(&mut qemu)?;
    if mode == "server" {
        // Our client starts once the guest's server listens (slirp accepts and then drops a connection nobody in
        // the guest takes).
        loop {
            match lines.recv_timeout(Duration::from_millis(200)) {
                Ok(l) if l.contains("rxe-interop: server listening") => break,
                Ok(_) | Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(format!("{tag}: the guest stopped early")),
            }
            if Instant::now() > end {
                let _ = qemu.kill();
                return Err(format!("{tag}: the guest's server never listened"));
            }
        }
    }
    let mut m = match (host_lib, &fabric) {
        // rdma-core's program, unmodified, on the simulated device the drop-in library opens, its port on the
        // guest's VDE switch with the simulator's IPv4 address (GID index 3). Its server listens on every address
        // (rc_pingpong has no bind option): in a network namespace of its own only loopback is there, and the
        // relay reaches it from inside.
        (Some(lib), Some(f)) => {
            let mut c = if mode == "server" {
                Command::new("ibv_rc_pingpong")
            } else {
                let mut c = Command::new("unshare");
                c.args(["--net", "--", "sh", "-c", "ip link set lo up && exec \"$@\"", "sh", "ibv_rc_pingpong"]);
                c
            };
            crate::libibverbs::on_dropin(&mut c, lib, &f.devices())
                .args(["-d", "mlx5_0", "-g", SIM_GID_INDEX, "-s", &size.to_string(), "-n", &iters.to_string()])
                .args(["-c", "-p"]);
            if mode == "server" {
                c.arg(host_port.to_string()).arg("127.0.0.1");
            } else {
                c.arg(ours.to_string());
            }
            c
        }
        // The same program plugged into the guest NIC's socket instead (`wire=qemu`), an RC client of the guest's
        // server.
        (Some(lib), None) => {
            let mut c = Command::new("ibv_rc_pingpong");
            crate::libibverbs::on_dropin(&mut c, lib, &format!("sim:wire=qemu:{SIM_IP}:{}", sock.display()))
                .args(["-d", "mlx5_0", "-g", SIM_GID_INDEX, "-s", &size.to_string(), "-n", &iters.to_string()])
                .args(["-c", "-p"])
                .arg(host_port.to_string())
                .arg("127.0.0.1");
            c
        }
        (None, _) => {
            let mut c = Command::new(mlx5);
            c.arg("--pcap").arg(&pcap).arg("pingpong");
            if mode == "server" {
                c.arg("--client").arg(format!("127.0.0.1:{host_port}"));
            } else {
                c.args(["--server", "--bind", "127.0.0.1", "--port"]).arg(ours.to_string());
            }
            match &fabric {
                // On the switch: rc_pingpong's buffer (`--chk`) and the ACK timeout of a TCG peer, both of which
                // `--qemu-sock` implies.
                Some(f) => {
                    c.args(["--wire", &format!("vde:{}", f.url()), "--chk"]);
                    if !ud {
                        c.args(["--qp-timeout", "18"]);
                    }
                }
                None => {
                    c.arg("--qemu-sock").arg(&sock);
                }
            }
            c.args(["--ipv4", SIM_IP, "--gid-idx", SIM_GID_INDEX, "--timeout", "120"]).args([
                "--size",
                &size.to_string(),
                "--iters",
                &iters.to_string(),
            ]);
            if ud {
                c.arg("--ud");
            }
            c
        }
    };
    if let Some(l) = loss {
        m.env(l.env, l.nth.to_string());
    }
    let mut ours_child = m.spawn().map_err(|e| format!("failed to start our side: {e}"))?;
    if let Some(tx) = server_pid {
        let _ = tx.send(ours_child.id());
    }
    let ours_status = wait_child(&mut ours_child, end, "mlx5 pingpong");
    let qemu_status = wait_child(&mut qemu, end, "the guest");
    let secs = start.elapsed().as_secs_f64();
    let (ours_status, qemu_status) = (ours_status?, qemu_status?);
    // isa-debug-exit: the guest wrote 1 (rc_pingpong passed) -> 3.
    println!("rxe-interop: {tag}: ours {ours_status}, guest {qemu_status}, {secs:.1} s");
    if !ours_status.success() || qemu_status.code() != Some(3) {
        return Err(format!("{tag}: ping-pong failed (ours {ours_status}, guest {qemu_status})"));
    }
    if let Some(l) = loss {
        // The console reader ends with QEMU; what it has not handed over yet is the run's end.
        let counters: Vec<String> = lines.iter().filter(|s| s.starts_with("rxe-counter: ")).collect();
        let moved = counters.iter().any(|s| s.split_whitespace().nth(1) == Some(l.counter));
        if !moved {
            return Err(format!("{tag}: rxe's {} did not move: {counters:?}", l.counter));
        }
        println!("rxe-interop: {tag}: one frame lost ({}={}), recovered; rxe {}", l.env, l.nth, l.counter);
    }
    // The drop-in library writes no capture; QEMU's below covers that run.
    if host_lib.is_none() {
        check_pcap(&pcap)?;
    }
    if host_lib.is_none() && vde {
        // Every frame crossed the switch: our capture holds exactly the RoCE frames the guest NIC saw.
        let n = same_roce_frames(&pcap, &guest_pcap)?;
        println!("rxe-interop: {tag}: our --pcap holds the {n} RoCE frames the guest NIC saw, byte for byte");
    }
    // Every RoCE frame on the cable, ours and rxe's, has the ICRC an independent computation gives: rxe accepted
    // ours (it drops a bad one silently) and ours accepted rxe's.
    let n = check_icrc(&guest_pcap)?;
    println!("rxe-interop: {tag}: {n} RoCE frames on the cable, every ICRC right");
    Ok(secs)
}

/// The frames of a pcap file (classic format, as QEMU's filter-dump and our `--pcap` write it).
fn pcap_frames(bytes: &[u8]) -> Result<Vec<&[u8]>, String> {
    let mut frames = Vec::new();
    let mut at = 24;
    while at + 16 <= bytes.len() {
        let incl = u32::from_le_bytes([bytes[at + 8], bytes[at + 9], bytes[at + 10], bytes[at + 11]]) as usize;
        frames.push(bytes.get(at + 16..at + 16 + incl).ok_or("a pcap record is cut short")?);
        at += 16 + incl;
    }
    Ok(frames)
}

/// Whether a frame is IPv4 RoCEv2 (IPv4 without options, UDP to 4791).
fn is_roce_v4(f: &[u8]) -> bool {
    f.len() >= 42 && f[12..14] == [0x08, 0x00] && f[14] == 0x45 && f[23] == 17 && f[36..38] == [0x12, 0xb7]
}

/// Checks that two captures hold the same RoCE frames, byte for byte, in any order (each side records its own
/// sends before the peer's receives); returns how many.
fn same_roce_frames(ours: &Path, theirs: &Path) -> Result<usize, String> {
    let read = |p: &Path| std::fs::read(p).map_err(|e| format!("{}: {e}", p.display()));
    let (a, b) = (read(ours)?, read(theirs)?);
    let roce = |bytes| -> Result<Vec<&[u8]>, String> {
        let mut v: Vec<&[u8]> = pcap_frames(bytes)?.into_iter().filter(|f| is_roce_v4(f)).collect();
        v.sort_unstable();
        Ok(v)
    };
    let (a, b) = (roce(&a)?, roce(&b)?);
    if a.is_empty() || a != b {
        return Err(format!(
            "{} holds {} RoCE frames, {} {}: not the same frames",
            ours.display(),
            a.len(),
            theirs.display(),
            b.len()
        ));
    }
    Ok(a.len())
}

/// CRC-32 (the Ethernet/zlib polynomial, reflected), bit by bit: the xtask checks a few hundred frames.
fn crc32(data: impl Iterator<Item = u8>) -> u32 {
    let mut c = !0u32;
    for b in data {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 != 0 { (c >> 1) ^ 0xedb8_8320 } else { c >> 1 };
        }
    }
    !c
}

/// Checks the ICRC of every IPv4 RoCEv2 frame in a pcap (QEMU's capture of the guest NIC, so both directions as
/// they crossed the cable), computed independently of the simulator: eight 0xff bytes for the masked LRH, then IP,
/// UDP and the IB packet with TOS, TTL, the IP and UDP checksums and the BTH's resv8a masked to ones. Returns the
/// frames checked.
fn check_icrc(pcap: &Path) -> Result<usize, String> {
    let bytes = std::fs::read(pcap).map_err(|e| format!("{}: {e}", pcap.display()))?;
    let mut checked = 0;
    for (i, f) in pcap_frames(&bytes)?.into_iter().enumerate() {
        // With a BTH and an ICRC at least.
        if f.len() < 42 + 12 + 4 || !is_roce_v4(f) {
            continue;
        }
        let total = usize::from(u16::from_be_bytes([f[16], f[17]]));
        if total < 20 + 8 + 12 + 4 {
            return Err(format!("{}: frame {}: an IP length too short for a BTH and an ICRC", pcap.display(), i + 1));
        }
        let l3 = f.get(14..14 + total).ok_or("an IP packet longer than its frame")?;
        let body = &l3[..l3.len() - 4];
        let mut masked = body.to_vec();
        masked[1] = 0xff;
        masked[8] = 0xff;
        masked[10..12].copy_from_slice(&[0xff, 0xff]);
        masked[26..28].copy_from_slice(&[0xff, 0xff]);
        masked[28 + 4] = 0xff;
        let want = crc32([0xffu8; 8].into_iter().chain(masked));
        if want.to_le_bytes() != l3[l3.len() - 4..] {
            return Err(format!("{}: frame {} has a wrong ICRC", pcap.display(), i + 1));
        }
        checked += 1;
    }
    Ok(checked)
}

/// tshark over our side's capture: frames decode as RoCE (or ARP), none malformed. Skipped with a reason when
/// tshark is missing.
fn check_pcap(pcap: &Path) -> Result<(), String> {
    if !have("tshark") {
        println!("rxe-interop: pcap check skipped: tshark is not installed (apt-get install tshark)");
        return Ok(());
    }
    let out = run(Command::new("tshark").arg("-r").arg(pcap).args(["-o", "udp.check_checksum:TRUE", "-V"]))?;
    if out.contains("Malformed") || out.contains("[Checksum Status: Bad]") {
        return Err(format!("tshark finds a malformed frame or a bad checksum in {}", pcap.display()));
    }
    let frames = out.lines().filter(|l| l.starts_with("Frame ")).count();
    let roce = out.lines().filter(|l| l.starts_with("InfiniBand")).count();
    println!("rxe-interop: {}: {frames} frames, {roce} RoCE, none malformed", pcap.display());
    if roce == 0 {
        return Err(format!("no RoCE frame in {}", pcap.display()));
    }
    Ok(())
}

/// Which runs `rxe-interop` makes.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Every run (CI).
    All,
    /// `--rping`: the two rping runs (Linux's rdma_cm against the drop-in librdmacm).
    Rping,
    /// `--vde`: the runs with the guest on a VDE switch (rping and the host's ibv_rc_pingpong, both ways).
    Vde,
    /// `--wirefilter`: only the runs through `wirefilter` (loss, duplicates, reordering each way): rping between
    /// two processes of this host (CI runs a shorter one of these), then against rdma_rxe in the guest, both ways.
    /// rping, not rc_pingpong: rc_pingpong has no closing handshake, so when the ACK of its last message is lost
    /// the side that finished first has left and its peer retransmits to nobody (rdma_rxe forever, until the
    /// guest's deadline; one of four runs here ended so); rping's CM disconnect flushes that send instead.
    Wirefilter,
}

/// `cargo xtask rxe-interop`, also a CI step: builds the guest (a first run downloads the Debian kernel, later
/// ones reuse it) and runs every ping-pong, with its wall time. Needs QEMU, VDE and the guest's packages, which
/// it installs from Debian (root).
pub fn run_rxe_interop(root: &Path, part: Part) -> Result<(), String> {
    let started = Instant::now();
    let target = std::env::var_os("CARGO_TARGET_DIR").map(PathBuf::from).unwrap_or_else(|| root.join("target"));
    let work = target.join("rxe-interop");
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let work = work.canonicalize().map_err(|e| e.to_string())?;
    ensure_packages()?;
    // The kernel is the one vfio-test unpacks (a Debian kernel with rdma_rxe as a module).
    let kernel_work = target.join("vfio-test");
    std::fs::create_dir_all(&kernel_work).map_err(|e| e.to_string())?;
    let (vmlinuz, modules) = ensure_kernel(&kernel_work.canonicalize().map_err(|e| e.to_string())?)?;
    // Debian's rdmacm-utils, unpacked where `verbs-apps --only rdmacm` keeps them.
    let rping = crate::libibverbs::rdmacm::rdmacm_utils(&target.join("libibverbs"))?.join("rping");
    let initrd = build_initramfs(&work, &modules, &rping)?;
    let mlx5 = build_tool(root)?;
    let setup = Setup { work, kernel: vmlinuz, initrd, mlx5 };
    let built = started.elapsed().as_secs_f64();
    let mut times = Vec::new();
    // Debian's rping on the drop-in librdmacm against Linux's rdma_cm, the guest as server and as client, both on
    // a VDE switch.
    let lib = crate::libibverbs::build(root, false)?;
    let cm = crate::libibverbs::rdmacm::build(root, false, &lib)?;
    let ld = format!("{}:{}", cm.display(), lib.display());
    if part == Part::Wirefilter {
        // Faults on a real wire: Debian's wirefilter between two switches losing, duplicating and reordering
        // frames each way; rping (which ends with a CM disconnect, so a lost last ACK is flushed, not waited for)
        // between two processes of this host, then against rdma_rxe in the guest, both ways.
        let (count, size) = PAIR_PINGS;
        let secs = run_rping_pair(&setup.work, &ld, &rping, PAIR_PINGS, WIRE_LOSS_PCT)?;
        times.push(("none", (size, count), " (rping between two host processes through wirefilter)", secs));
        for mode in ["server", "client"] {
            let secs = run_rping(&setup, mode, &ld, &rping, Some(WIRE_LOSS_PCT))?;
            times.push((mode, (0, RPING_COUNT), " (rping, host on the drop-in, VDE through wirefilter)", secs));
        }
        return report(started, built, &times);
    }
    if part == Part::All {
        // The reduced run of the above in CI: no guest, two processes of this host (a few seconds).
        let (count, size) = CI_PAIR_PINGS;
        let secs = run_rping_pair(&setup.work, &ld, &rping, CI_PAIR_PINGS, CI_WIRE_LOSS_PCT)?;
        times.push(("none", (size, count), " (rping between two host processes through wirefilter)", secs));
    }
    // Both directions run, and the first failure is reported after them.
    let mut failed = None;
    for mode in ["server", "client"] {
        match run_rping(&setup, mode, &ld, &rping, None) {
            Ok(secs) => times.push((mode, (0, RPING_COUNT), " (rping, host on the drop-in librdmacm, VDE)", secs)),
            Err(e) => {
                println!("rxe-interop: {e}");
                failed = failed.or(Some(e));
            }
        }
    }
    if let Some(e) = failed {
        return Err(e);
    }
    if part == Part::Rping {
        return report(started, built, &times);
    }
    // rdma-core's unmodified ibv_rc_pingpong on this host, over the drop-in libibverbs.so.1 and a simulated
    // device on the guest NIC's VDE switch, against the guest's, both ways (four packets a message).
    for mode in ["server", "client"] {
        let run = (4096, 20);
        let secs = run_one(&setup, mode, run, None, false, &Ours::HostRcPingpongVde(&lib))?;
        times.push((mode, run, " (host ibv_rc_pingpong, VDE)", secs));
    }
    // The tool on the switch, with its capture compared to the guest NIC's.
    let run = (4096, 20);
    times.push((
        "server",
        run,
        " (mlx5 pingpong --wire vde --pcap)",
        run_one(&setup, "server", run, None, false, &Ours::ToolVde)?,
    ));
    if part == Part::Vde {
        return report(started, built, &times);
    }
    // The rest: our port plugged into the guest NIC's stream socket (`--qemu-sock`, `wire=qemu`).
    for mode in ["server", "client"] {
        for &run in RUNS {
            times.push((mode, run, "", run_one(&setup, mode, run, None, false, &Ours::Tool)?));
        }
    }
    // A frame we send is lost (rxe NAKs the sequence gap, we send again), then one rxe sends (we NAK, rxe sends
    // again).
    let ours_lost = Loss { env: "MLX5_SIM_DROP_OUT", nth: 2, counter: "out_of_seq_request" };
    let theirs_lost = Loss { env: "MLX5_SIM_DROP_IN", nth: 2, counter: "rcvd_seq_err" };
    for (mode, loss) in [("server", &ours_lost), ("client", &theirs_lost)] {
        let run = (4096, 5);
        let secs = run_one(&setup, mode, run, Some(loss), false, &Ours::Tool)?;
        times.push((mode, run, " (one frame lost)", secs));
    }
    // UD: ibv_ud_pingpong, datagrams with DETH and its Q_Key, one MTU at most.
    for mode in ["server", "client"] {
        let run = (512, 20);
        times.push((mode, run, " UD", run_one(&setup, mode, run, None, true, &Ours::Tool)?));
    }
    // The host's ibv_rc_pingpong with its device plugged into the guest NIC's socket (`wire=qemu`).
    let run = (64, 50);
    let secs = run_one(&setup, "server", run, None, false, &Ours::HostRcPingpong(&lib))?;
    times.push(("server", run, " (host ibv_rc_pingpong, wire=qemu)", secs));
    report(started, built, &times)
}

/// Each run's wall time, and the totals.
fn report(started: Instant, built: f64, times: &[(&str, (usize, u32), &str, f64)]) -> Result<(), String> {
    for (mode, (size, iters), what, secs) in times {
        println!("rxe-interop: guest {mode:6} {iters:3} x {size:6} B{what}: {secs:5.1} s boot to poweroff");
    }
    let total = started.elapsed().as_secs_f64();
    println!("rxe-interop: guest and tool ready in {built:.0} s, the runs {:.0} s, {total:.0} s in all", total - built);
    println!("rxe-interop: passed");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn our_recoveries_are_read_from_the_exit_log_and_a_line_of_zeros_is_no_recovery() {
        let none = "libibverbs(mlx5-rs) INFO: mlx5_0: wire recoveries: 0 retransmissions (0 ACK timeouts), 0 RNR \
                    retries, 0 sequence NAKs received, 0 out-of-sequence requests NAKed, 0 duplicate requests \
                    answered again; VDE fabric: 81 frames sent, 81 received";
        let lines = our_recoveries(&format!("rping: noise\n{none}\n"));
        assert_eq!(lines.len(), 1);
        assert!(lines[0].starts_with("0 retransmissions") && !recovered(&lines), "{lines:?}");
        let some = none.replace("0 duplicate requests", "6 duplicate requests");
        assert!(recovered(&our_recoveries(&some)));
        let partial = none.replace("recoveries: 0 retransmissions", "recoveries: at least: 3 retransmissions");
        assert!(recovered(&our_recoveries(&partial)));
        assert!(our_recoveries("nothing logged").is_empty());
    }

    #[test]
    fn crc32_is_the_ethernet_crc() {
        assert_eq!(crc32(b"123456789".iter().copied()), 0xcbf4_3926);
    }

    /// A pcap of one IPv4 RoCEv2 frame (BTH and 4 payload bytes) whose ICRC is `icrc`.
    fn pcap_of(icrc: Option<[u8; 4]>) -> Vec<u8> {
        let mut f = vec![0u8; 14];
        f[12..14].copy_from_slice(&[0x08, 0x00]);
        let ib_len = 12 + 4 + 4;
        let total = 20 + 8 + ib_len;
        let mut ip =
            vec![0x45, 0, (total >> 8) as u8, total as u8, 0, 1, 0x40, 0, 64, 17, 0, 0, 10, 0, 0, 2, 10, 0, 0, 1];
        ip.extend_from_slice(&[0xc0, 0x00, 0x12, 0xb7, 0, (8 + ib_len) as u8, 0, 0]);
        ip.extend_from_slice(&[4, 0x40, 0xff, 0xff, 0, 0, 0, 0x11, 0x80, 0, 0, 1, 1, 2, 3, 4]);
        let mut masked = ip.clone();
        masked[1] = 0xff;
        masked[8] = 0xff;
        masked[10..12].copy_from_slice(&[0xff, 0xff]);
        masked[26..28].copy_from_slice(&[0xff, 0xff]);
        masked[32] = 0xff;
        let right = crc32([0xffu8; 8].into_iter().chain(masked)).to_le_bytes();
        ip.extend_from_slice(&icrc.unwrap_or(right));
        f.extend_from_slice(&ip);
        let mut p = vec![0u8; 24];
        let mut rec = vec![0u8; 16];
        rec[8..12].copy_from_slice(&(f.len() as u32).to_le_bytes());
        rec[12..16].copy_from_slice(&(f.len() as u32).to_le_bytes());
        p.extend_from_slice(&rec);
        p.extend_from_slice(&f);
        p
    }

    #[test]
    fn the_icrc_check_takes_a_right_frame_and_refuses_a_wrong_one() {
        let dir = std::env::temp_dir();
        let (good, bad) = (
            dir.join(format!("xtask-icrc-{}-good.pcap", std::process::id())),
            dir.join(format!("xtask-icrc-{}-bad.pcap", std::process::id())),
        );
        std::fs::write(&good, pcap_of(None)).unwrap();
        std::fs::write(&bad, pcap_of(Some([1, 2, 3, 4]))).unwrap();
        assert_eq!(check_icrc(&good), Ok(1));
        assert!(check_icrc(&bad).is_err());
        // Two captures of one frame are the same frames; a frame that differs in its last bytes is not.
        assert_eq!(same_roce_frames(&good, &good), Ok(1));
        assert!(same_roce_frames(&good, &bad).is_err());
        let _ = (std::fs::remove_file(good), std::fs::remove_file(bad));
    }
}
