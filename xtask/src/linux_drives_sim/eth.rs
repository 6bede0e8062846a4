//! `cargo xtask linux-drives-sim --eth`: two simulated ConnectX-5 Ethernet ports, each driven by its own UML
//! instance's `mlx5_core` + `mlx5e` (+ `mlx5_ib`), on one cable: the two bridges' devices are joined by the
//! simulator's TCP link on 127.0.0.1 (`--wire-listen` / `--wire-connect`), so every frame one netdev sends goes
//! through the simulated SQ, the cable, and the other device's flow steering into its RQ.
//!
//! Instance A pings B (`ping -c 20`), then sends B a line over TCP (busybox `nc`), which lets B finish; each
//! prints its netdev's counters and its kernel log. Kept in `target/linux-drives-sim/eth/{a,b}/`: `console.txt`,
//! `dmesg.txt`, `trace.jsonl`, `bridge.log`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::{
    bad_lines, between, build_bridge, initramfs_with, spawn_uml, wait_for_socket, Reap, BOOT_TIMEOUT, DMESG_BEGIN,
    DMESG_END, DONE, GUEST_BINARIES, HARNESS,
};
use crate::vfio_test::wait_until;

/// The two ports: (name, MAC, IPv4 address).
const PORTS: [(&str, &str, &str); 2] =
    [("a", "02:35:00:00:00:0a", "10.35.0.1"), ("b", "02:35:00:00:00:0b", "10.35.0.2")];
/// The BAR file's size (sparse), as the InfiniBand run makes it.
const BAR_FILE_BYTES: u64 = 32 << 20;
/// Pings A sends B.
const PINGS: u32 = 20;
/// The TCP port B's `nc` listens on for A's closing line.
const NC_PORT: u16 = 5035;
const PING_BEGIN: &str = "=== ping begin ===";
const PING_END: &str = "=== ping exit ";
const NC_LINE: &str = "over mlx5e and the simulated cable";
/// iperf3's TCP run from A to B, in seconds.
const IPERF_SECONDS: u32 = 5;
/// ibv_rc_pingpong over RoCEv2 between the two netdevs' IPv4 GIDs: iterations of 4 KiB.
const RC_ITERS: u32 = 100;
/// rping's pings (`-C`), each one verified (`-V`).
const RPING_COUNT: u32 = 100;
/// perftest's programs run over rdma_cm (`-R`), each on its own rdma_cm port (`-p`: the second server may listen
/// before the first's connection is gone), and their iterations (`-n`) of the default 64 KiB message.
const PERFTEST: [(&str, u16); 2] = [("ib_send_bw", 18515), ("ib_write_bw", 18516)];
const PERF_ITERS: u32 = 100;
/// How often a perftest pair runs at most. perftest reports only when its calibration of the cycle counter
/// against gettimeofday fits (r^2 >= 0.9); in a UML guest on a loaded host a system call's time varies so much
/// that 2 client runs of 17 here missed it after a complete test ("Can't produce a report"). A then asks B for
/// another server (over TCP, `VERDICT_PORT`), and the run says how many it took. B listens for that word while its
/// server runs: a server whose client died at the report waits for the client's last exchange until its bound.
const PERF_ATTEMPTS: u32 = 3;
/// The TCP port B waits on for A's word after each perftest server: `again` or `done`.
const VERDICT_PORT: u16 = 5036;
/// How often A starts a client before B's server listens (half a second apart).
const RETRIES: u32 = 40;
/// Debian packages whose programs go into the guests besides rdma-core's ibverbs-utils: (program, package).
const PACKAGES: &[(&str, &str)] = &[("iperf3", "iperf3"), ("ethtool", "ethtool")];
/// The same for the RoCE runs: rdma_cm's rping and perftest (both on Debian's librdmacm).
const RDMA_PACKAGES: &[(&str, &str)] =
    &[("rping", "rdmacm-utils"), ("ib_send_bw", "perftest"), ("ib_write_bw", "perftest")];

/// The guest's `/init` for port `me` (0: A, the client of every test; 1: B, the servers); `rdma`: the RoCEv2 runs
/// too (`ibv_devinfo -v`, `ibv_rc_pingpong -g`, `rping`, `ib_send_bw -R`, `ib_write_bw -R`).
///
/// B runs its servers one after another in the background; A retries each client until B's server listens (a
/// connection to a port nobody listens on is refused at once, and costs the server nothing).
///
/// `cpu_mhz`: the host's `cpu MHz` (UML's /proc/cpuinfo has none, and perftest will not report without one; it
/// measures the cycle counter against the clock and takes that figure when the two differ by more than 2%).
fn init_script(me: usize, roce: Roce, cpu_mhz: Option<&str>) -> String {
    let (_, _, ip) = PORTS[me];
    // The rdma_cm programs (rping, perftest) run with `Roce::Cm` only.
    let cm = |p: &str| roce == Roce::Cm || !(p.starts_with("rping") || p.starts_with("ib_"));
    let (rc_client, rc_server, rc_server_out) = if roce != Roce::Off {
        let peer = PORTS[1 - me].2;
        let mut client = format!(
            "timeout 60 ibv_devinfo -v -d mlx5_0 > /tmp/devinfo.txt 2>&1\necho \"=== ibv_devinfo exit $? ===\"\n\
             sed 's/^/devinfo: /' /tmp/devinfo.txt\n\
             retry {RETRIES} timeout 120 ibv_rc_pingpong -d mlx5_0 -g $gid -s 4096 -n {RC_ITERS} -c {peer} > /tmp/rc.txt 2>&1\n\
             echo \"=== rc_pingpong exit $? ===\"\nsed 's/^/rc_pingpong: /' /tmp/rc.txt\n"
        );
        if cm("rping") {
            client.push_str(&format!(
                "retry {RETRIES} timeout 120 rping -c -a {peer} -C {RPING_COUNT} -v -V > /tmp/rping.txt 2> /tmp/rping.err\n\
                 echo \"=== rping exit $? ===\"\nsed 's/^/rping: /' /tmp/rping.txt\nsed 's/^/rping stderr: /' /tmp/rping.err\n"
            ));
        }
        for (prog, port) in PERFTEST.iter().filter(|p| cm(p.0)) {
            client.push_str(&format!(
                "a=0\nwhile :; do\n\
                 a=$((a+1))\n\
                 perf /tmp/{prog}.txt {prog} -d mlx5_0 -R -p {port} -n {PERF_ITERS} {peer}; s=$?\n\
                 if [ $s -eq 0 ] || [ $a -ge {PERF_ATTEMPTS} ]; then v=done; else v=again; fi\n\
                 n=0; until echo $v | nc -w 5 {peer} {VERDICT_PORT} || [ $n -ge 120 ]; do sleep 0.5; n=$((n+1)); done\n\
                 [ $v = done ] && break\n\
                 done\n\
                 echo \"=== {prog} exit $s ===\"\necho \"=== {prog} attempts $a ===\"\nsed 's/^/{prog}: /' /tmp/{prog}.txt\n"
            ));
        }
        let mut server = format!(
            "timeout 60 ibv_devinfo -v -d mlx5_0 > /tmp/devinfo.txt 2>&1\necho \"=== ibv_devinfo exit $? ===\"\n\
             sed 's/^/devinfo: /' /tmp/devinfo.txt\n\
             (timeout 200 ibv_rc_pingpong -d mlx5_0 -g $gid -s 4096 -n {RC_ITERS} -c > /tmp/rc.txt 2>&1\n"
        );
        if cm("rping") {
            server.push_str(&format!(
                "timeout 200 rping -s -a {ip} -C {RPING_COUNT} -v -V > /tmp/rping.txt 2>&1\n\
                 echo \"rping server exit $?\" >> /tmp/rping.txt\n"
            ));
        }
        for (prog, port) in PERFTEST.iter().filter(|p| cm(p.0)) {
            server.push_str(&format!(
                "a=0\nwhile :; do\n\
                 a=$((a+1))\n\
                 timeout 200 {prog} -d mlx5_0 -R -p {port} -n {PERF_ITERS} >> /tmp/{prog}.txt 2>&1 &\n\
                 p=$!\n\
                 v=$(timeout 300 nc -l -p {VERDICT_PORT})\n\
                 [ \"$v\" = again ] && kill $p 2>/dev/null\n\
                 wait $p; echo \"{prog} server exit $?\" >> /tmp/{prog}.txt\n\
                 [ \"$v\" = again ] && [ $a -lt {PERF_ATTEMPTS} ] || break\n\
                 done\n"
            ));
        }
        server.push_str(") &\n");
        let mut server_out = "sleep 1\nsed 's/^/rc_pingpong server: /' /tmp/rc.txt\n".to_string();
        if cm("rping") {
            server_out.push_str("sed 's/^/rping server: /' /tmp/rping.txt\n");
        }
        for (prog, _) in PERFTEST.iter().filter(|p| cm(p.0)) {
            server_out.push_str(&format!("sed 's/^/{prog} server: /' /tmp/{prog}.txt\n"));
        }
        (client, server, server_out)
    } else {
        (String::new(), String::new(), String::new())
    };
    let (_, _, peer) = PORTS[1 - me];
    let role = if me == 0 {
        format!(
            r#"n=0
until ping -c 1 -W 1 {peer} >/dev/null 2>&1 || [ $n -ge 60 ]; do n=$((n+1)); done
echo "{PING_BEGIN}"
ping -c {PINGS} -i 0.2 {peer}
echo "{PING_END}$? ==="
n=0
until iperf3 -c {peer} -t {IPERF_SECONDS} > /tmp/iperf3.txt 2>&1 || [ $n -ge 20 ]; do sleep 0.5; n=$((n+1)); done
sed 's/^/iperf3: /' /tmp/iperf3.txt
{rc_client}n=0
until echo "{NC_LINE}" | nc -w 5 {peer} {NC_PORT} || [ $n -ge 20 ]; do sleep 0.5; n=$((n+1)); done
"#
        )
    } else {
        format!(
            r#"iperf3 -s -1 > /tmp/iperf3.txt 2>&1 &
{rc_server}timeout 300 nc -l -p {NC_PORT} > /tmp/nc.txt
echo "nc received: $(cat /tmp/nc.txt)"
{rc_server_out}"#
        )
    };
    let prelude = super::init_prelude();
    // perftest reads the CPU's clock from /proc/cpuinfo: the host's figure after each processor's line, bound
    // over the guest's.
    let cpuinfo = match cpu_mhz {
        Some(mhz) if roce == Roce::Cm => format!(
            "while IFS= read -r l; do echo \"$l\"; case \"$l\" in processor*) printf 'cpu MHz\\t\\t: {mhz}\\n';; esac; \
             done < /proc/cpuinfo > /tmp/cpuinfo && mount --bind /tmp/cpuinfo /proc/cpuinfo\n\
             echo \"cpuinfo: $(grep -c 'cpu MHz' /proc/cpuinfo) x cpu MHz\"\n"
        ),
        _ => String::new(),
    };
    format!(
        r#"{prelude}{cpuinfo}# retry N CMD...: CMD until it succeeds, at most N times half a second apart; CMD's last status.
retry() {{ k=$1; shift; while :; do "$@"; s=$?; [ $s -eq 0 ] || [ $k -le 1 ] && return $s; k=$((k-1)); sleep 0.5; done; }}
# perf OUT CMD...: a perftest client, again while the server's rdma_cm refuses its connection (not listening
# yet), at most {RETRIES} times; its output appended to OUT. A run that connected ends it, passed or not.
perf() {{ o=$1; shift; k={RETRIES}; while :; do timeout 120 "$@" > /tmp/perf.run 2>&1; s=$?; cat /tmp/perf.run >> $o
  grep -q 'Unable to init the socket connection' /tmp/perf.run && [ $k -gt 1 ] || return $s; k=$((k-1)); sleep 0.5; done; }}
ip link set lo up
dev=
for n in /sys/class/net/*; do [ -e "$n/device" ] && dev=$(basename $n); done
echo "netdev: ${{dev:-none}} address=$(cat /sys/class/net/$dev/address 2>/dev/null)"
if [ -n "$dev" ]; then
  ip addr add {ip}/24 dev $dev
  ip link set $dev up
  n=0
  until [ "$(cat /sys/class/net/$dev/operstate)" = up ] || [ $n -ge 50 ]; do sleep 0.1; n=$((n+1)); done
  echo "operstate: $(cat /sys/class/net/$dev/operstate)"
  # The RoCEv2 GID of the IPv4 address (mlx5_ib adds it when the address appears).
  gid=
  n=0
  while [ -z "$gid" ] && [ $n -lt 50 ]; do
    for g in /sys/class/infiniband/mlx5_0/ports/1/gids/*; do
      i=$(basename $g)
      t=$(cat /sys/class/infiniband/mlx5_0/ports/1/gid_attrs/types/$i 2>/dev/null)
      case "$(cat $g)" in 0000:0000:0000:0000:0000:ffff:*) [ "$t" = "RoCE v2" ] && gid=$i;; esac
    done
    [ -z "$gid" ] && sleep 0.1
    n=$((n+1))
  done
  echo "gid: index ${{gid:-none}}"
{role}  for c in tx_packets tx_bytes rx_packets rx_bytes rx_dropped tx_dropped rx_errors tx_errors; do
    echo "stat: $c $(cat /sys/class/net/$dev/statistics/$c)"
  done
  ethtool -S $dev | sed 's/^ */ethtool: /'
fi
for i in /sys/class/infiniband/*; do [ -e "$i" ] && echo "rdma: $(basename $i) fw=$(cat $i/fw_ver 2>/dev/null)"; done
echo "{DMESG_BEGIN}"
dmesg
echo "{DMESG_END}"
echo "{DONE}"
poweroff -f
"#
    )
}

/// The first `cpu MHz` figure of the host's /proc/cpuinfo (digits and one dot only, as it goes into a script).
fn host_cpu_mhz() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    let v = info.lines().find_map(|l| l.strip_prefix("cpu MHz")?.split(':').nth(1).map(str::trim))?;
    let ok = !v.is_empty() && v.chars().all(|c| c.is_ascii_digit() || c == '.') && v.matches('.').count() <= 1;
    ok.then(|| v.to_string())
}

/// One UML instance and its bridge.
struct Instance {
    dir: PathBuf,
    bridge: Reap,
    uml: Option<Reap>,
}

/// A free TCP port on 127.0.0.1 for the cable (bound, read, released).
fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("127.0.0.1:0: {e}"))?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

/// Which RoCEv2 runs go with the Ethernet ones.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Roce {
    /// None (`--no-rdma`).
    Off,
    /// `ibv_devinfo -v` and `ibv_rc_pingpong -g` (`--no-cm`).
    Verbs,
    /// Those, then `rping` and perftest's `-R` runs over rdma_cm (`--eth` alone: what CI runs).
    Cm,
}

/// The whole run with the RoCEv2 runs `roce` between the GIDs.
pub(super) fn run(root: &Path, roce: Roce) -> Result<(), String> {
    let rdma = roce != Roce::Off;
    let started = Instant::now();
    let linux = crate::uml::build(root)?;
    let bridge = build_bridge(root)?;
    let packages: Vec<(&str, &str)> =
        PACKAGES.iter().chain(RDMA_PACKAGES.iter().filter(|_| roce == Roce::Cm)).copied().collect();
    let mut missing: Vec<&str> =
        packages.iter().filter(|(prog, _)| !crate::vfio_test::have(prog)).map(|p| p.1).collect();
    missing.dedup();
    if !missing.is_empty() {
        crate::vfio_test::apt_install(&missing)?;
    }
    let binaries: Vec<&str> = GUEST_BINARIES.iter().copied().chain(packages.iter().map(|p| p.0)).collect();
    let work = root.join("target/linux-drives-sim/eth");
    let cable = format!("127.0.0.1:{}", free_port()?);
    let mut inst = Vec::new();
    for (k, (name, mac, _)) in PORTS.iter().enumerate() {
        let dir = work.join(name);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let sock = dir.join("mlx5.sock");
        let _ = std::fs::remove_file(&sock);
        let log = std::fs::File::create(dir.join("bridge.log")).map_err(|e| e.to_string())?;
        // The BAR file: user mappings of the UAR pages (rdma-core's doorbells) land here, the bridge replays them.
        let bar_file = dir.join("bar0.file");
        std::fs::File::create(&bar_file)
            .and_then(|f| f.set_len(BAR_FILE_BYTES))
            .map_err(|e| format!("{}: {e}", bar_file.display()))?;
        let wire = if k == 0 { "--wire-listen" } else { "--wire-connect" };
        let child = Command::new(&bridge)
            .arg("--socket")
            .arg(&sock)
            .arg("--trace")
            .arg(dir.join("trace.jsonl"))
            .arg("--bar-file")
            .arg(&bar_file)
            .args(["--port", "eth", "--mac", mac, wire, &cable])
            .stderr(log)
            .spawn()
            .map_err(|e| format!("{}: {e}", bridge.display()))?;
        wait_for_socket(&sock, name)?;
        inst.push(Instance { dir, bridge: Reap(child), uml: None });
    }
    let mhz = host_cpu_mhz();
    if roce == Roce::Cm && mhz.is_none() {
        println!("  the host's /proc/cpuinfo has no cpu MHz: perftest in the guests will not report");
    }
    let boot = Instant::now();
    for (k, i) in inst.iter_mut().enumerate() {
        let initrd = initramfs_with(&i.dir, &init_script(k, roce, mhz.as_deref()), &binaries)?;
        let (sock, bar_file) = (i.dir.join("mlx5.sock"), i.dir.join("bar0.file"));
        i.uml = Some(spawn_uml(&linux, "256M", &initrd, &[sock], &bar_file, &i.dir, &i.dir.join("console.txt"))?);
        // A's bridge listens on the cable once its device exists, before B's connects.
        if k == 0 {
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    let mut timed_out = false;
    for i in inst.iter_mut() {
        if let Some(u) = i.uml.as_mut() {
            if wait_until(&mut u.0, boot + BOOT_TIMEOUT, Duration::from_millis(50))?.is_none() {
                timed_out = true;
                let _ = u.0.kill();
            }
        }
    }
    let guest_time = boot.elapsed();
    let mut problems = Vec::new();
    let mut known = Vec::new();
    let mut consoles = Vec::new();
    for (k, mut i) in inst.into_iter().enumerate() {
        let name = PORTS[k].0;
        drop(i.uml.take());
        let _ = wait_until(&mut i.bridge.0, Instant::now() + Duration::from_secs(10), Duration::from_millis(20));
        drop(i.bridge);
        let console =
            String::from_utf8_lossy(&std::fs::read(i.dir.join("console.txt")).unwrap_or_default()).into_owned();
        let dmesg = between(&console, DMESG_BEGIN, DMESG_END).unwrap_or(&console).to_string();
        std::fs::write(i.dir.join("dmesg.txt"), &dmesg).map_err(|e| e.to_string())?;
        // What the bridge served, and how far virt-pci's queue filled (a full one made UML 6.12 drop writes).
        let log = std::fs::read_to_string(i.dir.join("bridge.log")).unwrap_or_default();
        if let Some(l) = log.lines().find_map(|l| l.strip_prefix("mlx5-uml-bridge: done: ")) {
            println!("  {name}: bridge: {l}");
        }
        // Every command the simulator completed has a name (`mlx5 trace decode` shows it field by field then): the
        // bridge writes "UNKNOWN" for an opcode the PRM tables do not name.
        let trace = std::fs::read_to_string(i.dir.join("trace.jsonl")).unwrap_or_default();
        let unknown = trace.lines().filter(|l| l.contains("\"opcode\":\"UNKNOWN\"")).count();
        println!("  {name}: trace: {} commands, {unknown} with an unknown opcode", trace.lines().count());
        if unknown > 0 || trace.is_empty() {
            problems.push(format!("{name}: trace.jsonl: {unknown} commands with an unknown opcode (or none at all)"));
        }
        // Its counts by reason: frames dropped, NAKs, retries, QPs that went to error.
        for l in log.lines().filter_map(|l| l.strip_prefix("mlx5-uml-bridge: ")).filter(|l| l.contains(" x ")) {
            println!("  {name}: bridge: {l}");
        }
        for l in console.lines().filter(|l| {
            ["pci: ", "netdev: ", "operstate: ", "gid: ", "stat: ", "rdma: ", "nc received"]
                .iter()
                .any(|p| l.starts_with(p))
        }) {
            println!("  {name}: {l}");
        }
        if !console.contains(DONE) {
            problems.push(format!("{name}: the guest did not finish its init script"));
        }
        if !console.lines().any(|l| l.starts_with("netdev: ") && !l.contains("none")) {
            problems.push(format!("{name}: mlx5e made no netdev"));
        }
        if !console.lines().any(|l| l == "operstate: up") {
            problems.push(format!("{name}: the netdev's carrier did not come up"));
        }
        for l in bad_lines(&dmesg) {
            match HARNESS.iter().find(|(p, _)| l.contains(p)) {
                Some((_, why)) => known.push(format!("{name}: {} ({why})", l.trim())),
                None => problems.push(format!("{name}: dmesg: {}", l.trim())),
            }
        }
        if dmesg.contains("hw csum failure") {
            problems.push(format!("{name}: hw csum failure"));
        }
        consoles.push(console);
    }
    println!(
        "linux-drives-sim --eth: guests ran {:.2} s; total {:.1} s; logs in {}",
        guest_time.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        work.display()
    );
    if timed_out {
        problems.push(format!("a guest did not power off within {} s", BOOT_TIMEOUT.as_secs()));
    }
    // A's ping: every reply back, and its round-trip times.
    match between(&consoles[0], PING_BEGIN, PING_END) {
        Some(out) => {
            for l in out.lines().filter(|l| l.contains("packets transmitted") || l.contains("round-trip")) {
                println!("  a: {}", l.trim());
            }
            let all = format!("{PINGS} packets transmitted, {PINGS} packets received, 0% packet loss");
            if !out.contains(&all) {
                problems.push(format!("a: ping {} did not get every reply", PORTS[1].2));
            }
        }
        None => problems.push("a: ping did not run".into()),
    }
    // iperf3's receiver line: what crossed in TCP over the simulated cable (checksum offload and TSO on).
    match consoles[0].lines().find(|l| l.starts_with("iperf3: ") && l.contains("receiver")) {
        Some(l) => println!("  a: {}", l.trim()),
        None => problems.push("a: iperf3 reported no receiver line".into()),
    }
    // ethtool -S: the device's own counters (QUERY_VPORT_COUNTER, PPCNT) agree with the traffic; TSO and
    // CHECKSUM_COMPLETE were used.
    let stat = |c: &str, name: &str| -> u64 {
        let key = format!("ethtool: {name}: ");
        c.lines().find_map(|l| l.strip_prefix(&key)).and_then(|v| v.trim().parse().ok()).unwrap_or(0)
    };
    let want = [
        (0, "tx_vport_unicast_packets", u64::from(PINGS)),
        (1, "rx_vport_unicast_packets", u64::from(PINGS)),
        (0, "tx_packets_phy", u64::from(PINGS)),
        (1, "rx_packets_phy", u64::from(PINGS)),
        (0, "tx_tso_packets", 1),
        (1, "rx_csum_complete", 1),
    ];
    for (k, name, min) in want {
        let v = stat(&consoles[k], name);
        println!("  {}: ethtool -S {name} = {v}", PORTS[k].0);
        if v < min {
            problems.push(format!("{}: ethtool -S {name} is {v}, want at least {min}", PORTS[k].0));
        }
    }
    let (sent, got) = (stat(&consoles[0], "tx_vport_unicast_packets"), stat(&consoles[1], "rx_vport_unicast_packets"));
    if got > sent {
        problems.push(format!("b received {got} unicast frames, more than the {sent} a sent"));
    }
    if rdma {
        roce_checks(&consoles, roce == Roce::Cm, &mut problems);
    }
    if !consoles.get(1).is_some_and(|c| c.contains(&format!("nc received: {NC_LINE}"))) {
        problems.push("b: the TCP line from a did not arrive".into());
    }
    for k in &known {
        println!("  known, not failing: {k}");
    }
    if problems.is_empty() {
        println!("linux-drives-sim --eth: every check passed");
        Ok(())
    } else {
        Err(format!("linux-drives-sim --eth: {} problem(s):\n  {}", problems.len(), problems.join("\n  ")))
    }
}

/// The RoCEv2 runs' checks on both consoles: `ibv_devinfo` (port active, the IPv4 address's RoCE v2 GID),
/// `ibv_rc_pingpong -g` (every buffer checked), `rping -V` (every ping's data verified) and perftest's `-R` runs
/// (a result line with every iteration).
fn roce_checks(consoles: &[String], cm: bool, problems: &mut Vec<String>) {
    for (k, c) in consoles.iter().enumerate() {
        let (name, _, ip) = PORTS[k];
        let devinfo: Vec<&str> = c.lines().filter_map(|l| l.strip_prefix("devinfo: ")).collect();
        let state = devinfo.iter().find(|l| l.trim_start().starts_with("state:")).map_or("none", |l| l.trim());
        let gid = devinfo.iter().find(|l| l.contains(&format!("::ffff:{ip}")) && l.contains("RoCE v2"));
        println!("  {name}: ibv_devinfo {state}; GID {}", gid.map_or("none", |l| l.trim()));
        if !c.contains("=== ibv_devinfo exit 0 ===") || !state.contains("PORT_ACTIVE") {
            problems.push(format!("{name}: ibv_devinfo did not show port 1 PORT_ACTIVE"));
        }
        if !devinfo.iter().any(|l| l.trim_start().starts_with("link_layer:") && l.trim_end().ends_with("Ethernet")) {
            problems.push(format!("{name}: ibv_devinfo shows no Ethernet link layer"));
        }
        if gid.is_none() {
            problems.push(format!("{name}: ibv_devinfo shows no RoCE v2 GID ::ffff:{ip}"));
        }
    }
    let a = &consoles[0];
    let bytes = format!("{} bytes in", 2 * 4096 * u64::from(RC_ITERS));
    match a.lines().find(|l| l.starts_with("rc_pingpong: ") && l.contains(&bytes)) {
        Some(l) if a.contains("=== rc_pingpong exit 0 ===") => println!("  a: {}", l.trim()),
        _ => problems.push(format!("a: ibv_rc_pingpong -g over RoCEv2 did not report {bytes}")),
    }
    if !cm {
        return;
    }
    // rping -v prints each ping's buffer as the client read it back (-V already compared it with what it sent);
    // each line is checked against the pattern rping fills in too. Its stderr goes to another file: stdout to a
    // file is flushed in 4 KiB blocks, and "client DISCONNECT EVENT..." landed inside a ping line.
    let pings: Vec<&str> =
        a.lines().filter_map(|l| l.strip_prefix("rping: ")).filter(|l| l.starts_with("ping data:")).collect();
    let good = pings.iter().enumerate().filter(|(i, l)| crate::libibverbs::rdmacm::rping_line_ok(l, *i)).count();
    println!("  a: rping -c -C {RPING_COUNT} -v -V: {} pings, {good} as rping wrote them", pings.len());
    if !a.contains("=== rping exit 0 ===") || pings.len() != RPING_COUNT as usize || good != pings.len() {
        problems
            .push(format!("a: rping -c -C {RPING_COUNT} -V over rdma_cm: {} pings back, {good} intact", pings.len()));
    }
    for (prog, _) in PERFTEST {
        // The result line: bytes, iterations, peak and average bandwidth (MB/s), message rate.
        let result = a.lines().filter_map(|l| l.strip_prefix(&format!("{prog}: "))).find(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() >= 4 && f[0].parse::<u64>().is_ok() && f[1] == PERF_ITERS.to_string() && f[3].parse::<f64>().is_ok()
        });
        match result {
            Some(l) if a.contains(&format!("=== {prog} exit 0 ===")) => {
                let f: Vec<&str> = l.split_whitespace().collect();
                // How many pairs it took, and why the others gave no report.
                let tag = format!("=== {prog} attempts ");
                let tries = a.lines().find_map(|l| l.strip_prefix(&tag)?.strip_suffix(" ===")).unwrap_or("?");
                let calib = a.lines().filter(|l| l.starts_with(&format!("{prog}: Correlation coefficient"))).count();
                println!(
                    "  a: {prog} -R: {} x {} bytes, average {} MB/s (run {tries} of at most {PERF_ATTEMPTS}; {calib} \
                     without a report: perftest's clock calibration missed)",
                    f[1], f[0], f[3]
                );
            }
            _ => problems.push(format!("a: {prog} -R did not finish {PERF_ITERS} iterations")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_init_scripts_name_each_side_s_address_and_parse() {
        let (a, b) = (init_script(0, Roce::Cm, Some("2596.1")), init_script(1, Roce::Cm, Some("2596.1")));
        for prog in ["ibv_devinfo", "ibv_rc_pingpong", "rping", "ib_send_bw", "ib_write_bw"] {
            assert!(
                !init_script(0, Roce::Off, Some("2596.1")).contains(prog)
                    && !init_script(1, Roce::Off, Some("2596.1")).contains(prog),
                "{prog}"
            );
            assert!(a.contains(prog) && b.contains(prog), "{prog}");
        }
        assert!(a.contains(&format!("rping -c -a 10.35.0.2 -C {RPING_COUNT} -v -V")));
        assert!(b.contains(&format!("rping -s -a 10.35.0.2 -C {RPING_COUNT} -v -V")));
        // Each perftest on its own rdma_cm port, client and server alike.
        assert!(a.contains("ib_send_bw -d mlx5_0 -R -p 18515") && b.contains("ib_send_bw -d mlx5_0 -R -p 18515"));
        assert!(a.contains("ib_write_bw -d mlx5_0 -R -p 18516") && b.contains("ib_write_bw -d mlx5_0 -R -p 18516"));
        // A failed pair runs again: A says so on the verdict port, where B waits after each server.
        assert!(
            a.contains(&format!("nc -w 5 10.35.0.2 {VERDICT_PORT}")) && b.contains(&format!("nc -l -p {VERDICT_PORT}"))
        );
        // perftest's cpu MHz goes in with the rdma_cm runs only.
        assert!(
            a.contains("printf 'cpu MHz\\t\\t: 2596.1\\n'") && a.contains("mount --bind /tmp/cpuinfo /proc/cpuinfo")
        );
        assert!(!init_script(0, Roce::Verbs, Some("1")).contains("cpuinfo"));
        assert!(!init_script(0, Roce::Cm, None).contains("cpuinfo"));
        // The reduced form (--no-cm): devinfo and the RC ping-pong, no rdma_cm program.
        let (va, vb) = (init_script(0, Roce::Verbs, Some("2596.1")), init_script(1, Roce::Verbs, Some("2596.1")));
        assert!(va.contains("ibv_rc_pingpong") && vb.contains("ibv_devinfo -v"));
        assert!(!va.contains("rping") && !vb.contains("ib_send_bw") && !va.contains("ib_write_bw"));
        assert!(a.contains("ip addr add 10.35.0.1/24") && a.contains(&format!("ping -c {PINGS} -i 0.2 10.35.0.2")));
        assert!(b.contains("ip addr add 10.35.0.2/24") && b.contains(&format!("nc -l -p {NC_PORT}")));
        // The shell that runs them in the guest reads them without a syntax error.
        if Path::new("/bin/busybox").exists() {
            for s in [&a, &b, &init_script(0, Roce::Off, Some("2596.1")), &init_script(1, Roce::Off, Some("2596.1"))] {
                let ok = Command::new("/bin/busybox").args(["sh", "-n", "-c", s]).status().is_ok_and(|st| st.success());
                assert!(ok, "{s}");
            }
        }
    }

    /// A console as the guest prints it: ibv_devinfo's port lines (`state`, `link_layer`, the GID table) and
    /// rc_pingpong's result.
    fn console(k: usize, state: &str, gid: bool) -> String {
        let ip = PORTS[k].2;
        let mut c = format!(
            "=== ibv_devinfo exit 0 ===\ndevinfo: \t\t\tstate:\t\t\t{state}\ndevinfo: \t\t\tlink_layer:\t\tEthernet\n"
        );
        if gid {
            c.push_str(&format!("devinfo: \t\t\tGID[  3]:\t\t::ffff:{ip}, RoCE v2\n"));
        }
        c.push_str("=== rc_pingpong exit 0 ===\nrc_pingpong: 819200 bytes in 0.19 seconds = 34.91 Mbit/sec\n");
        c
    }

    #[test]
    fn the_roce_checks_pass_on_what_a_good_run_prints_and_name_what_is_missing() {
        let good = [console(0, "PORT_ACTIVE (4)", true), console(1, "PORT_ACTIVE (4)", true)];
        let mut p = Vec::new();
        roce_checks(&good, false, &mut p);
        assert!(p.is_empty(), "{p:?}");
        let bad = [console(0, "PORT_DOWN (1)", true), console(1, "PORT_ACTIVE (4)", false)];
        roce_checks(&bad, false, &mut p);
        assert_eq!(p.len(), 2, "{p:?}");
        assert!(p[0].starts_with("a: ibv_devinfo did not show") && p[1].contains("no RoCE v2 GID ::ffff:10.35.0.2"));
        // With rdma_cm: rping's lines must all be there and intact, and perftest's result lines.
        let mut a = good[0].clone();
        a.push_str("=== rping exit 0 ===\n");
        // rping's buffer for ping i: letters from 'A' + i mod 58, each the next of 'A'..='z'.
        let line = |i: usize| {
            let data: String = (0..10).map(|k| char::from(b'A' + ((i + k) % 58) as u8)).collect();
            format!("rping: ping data: rdma-ping-{i}: {data}\n")
        };
        for i in 0..RPING_COUNT as usize - 1 {
            a.push_str(&line(i));
        }
        for (prog, _) in PERFTEST {
            a.push_str(&format!(
                "=== {prog} exit 0 ===\n{prog}:  65536      {PERF_ITERS}     1.50     1.42     0.000023\n"
            ));
        }
        let mut p = Vec::new();
        roce_checks(&[a.clone(), good[1].clone()], true, &mut p);
        assert_eq!(p, vec![format!("a: rping -c -C {RPING_COUNT} -V over rdma_cm: 99 pings back, 99 intact")]);
        // A corrupted buffer is caught, the right one passes.
        let mut broken = a.clone();
        broken.push_str(&line(99).replace("rdma-ping-99: ", "rdma-ping-99: B"));
        let mut p = Vec::new();
        roce_checks(&[broken, good[1].clone()], true, &mut p);
        assert_eq!(p, vec![format!("a: rping -c -C {RPING_COUNT} -V over rdma_cm: 100 pings back, 99 intact")]);
        a.push_str(&line(99));
        let mut p = Vec::new();
        roce_checks(&[a, good[1].clone()], true, &mut p);
        assert!(p.is_empty(), "{p:?}");
    }
}
