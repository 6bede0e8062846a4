//! `cargo xtask linux-drives-sim --opensm`: one InfiniBand subnet of a simulated switch (`mlx5_sim::IbSwitch`,
//! the `ib_switch` example of `mlx5-sim`) and three channel adapters, each port waiting for a subnet manager
//! (Init, no LID): two simulated ConnectX-5 ports that are PCI functions of one UML guest (mlx5_0 on switch port
//! 1, mlx5_1 on port 2) and a host process on this repository's verbs stack (the `sma` example of `mlx5-verbs`,
//! `sim:link=ib:sm=wait:wire=vde:URL`: its QP0 served by `SmiAgent`, SMPs through MAD_IFC) on port 3. Each
//! cable is a `vde_switch` with two plugs, the switch's port and the HCA's.
//!
//! Debian's `opensm` in the guest binds mlx5_0's port and sweeps the subnet with directed-route SMPs (its own
//! port through ib_umad, ib_mad and MAD_IFC; the switch's SMA one hop out; the other ports through the
//! switch), assigns every LID, programs the switch's forwarding table and brings every port to Active. The run
//! checks `ibstat` (State: Active, distinct LIDs, the SM's LID as each port's SM lid), `smpquery` by LID and by
//! directed route (the switch's NodeInfo and SwitchInfo, mlx5_1's NodeInfo and NodeDescription through the
//! switch), `ibnetdiscover`'s topology (one switch, three channel adapters, each on its own switch port),
//! `ibv_rc_pingpong` between the two guest ports over opensm's LIDs (through the switch's LFT), the host port
//! by directed route and by LID, the host process's own report of its LID and state, and the switch's own
//! report (its LID, Active ports, routed LIDs, frames forwarded).
//!
//! UML backs its whole BAR window with one file, so the second bridge watches its BAR at `--bar-file-offset`
//! (checked against the guest's sysfs). Kept in `target/linux-drives-sim/opensm/`: `console.txt`, `dmesg.txt`,
//! `{a,b}.trace.jsonl`, `{a,b}.bridge.log`, `host.sma.log` (the host process), `switch.log` (the switch), and
//! opensm's own logs in the console.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::{
    bad_lines, between, build_bridge, init_prelude, initramfs_with, spawn_uml, wait_for_socket, Reap, BOOT_TIMEOUT,
    DMESG_BEGIN, DMESG_END, DONE, HARNESS, PINGPONG_PORT_HEX, PROGRAM_TIMEOUT_S,
};
use crate::vfio_test::wait_until;

/// The guest's ports: (name, node GUID), on switch ports 1 and 2. Distinct GUIDs, or opensm would see one node
/// twice.
const PORTS: [(&str, &str); 2] = [("a", "b8cef60300a00001"), ("b", "b8cef60300a00002")];
/// The switch's node GUID; the host process is on its port 3.
const SWITCH_GUID: &str = "b8cef60300ff0001";
/// How long the host process serves its QP0 and the switch runs (both are stopped when the guest is done).
const HOST_SMA_SECONDS: u32 = 900;
/// Each device's BAR0 (`mlx5_sim`'s 32 MiB), and so where the second one starts in UML's BAR window.
const BAR_BYTES: u64 = 32 << 20;
/// UML's virt-pci BAR window starts here (`xtask/uml/0002-um-virt-pci-bar-file.patch`).
const BAR_WINDOW: u64 = 0xf000_0000;
/// How long the guest waits for opensm to bring every port to Active, in tenths of a second.
const SWEEP_WAIT_DS: u32 = 900;
/// ibv_rc_pingpong between the two ports over opensm's LIDs: iterations of 4 KiB, sleeping on events.
const RC_ITERS: u32 = 200;
/// Attributes the SMA answers with a MAD status that are no failure, each with why: opensm asks Mellanox's vendor
/// ExtendedPortInfo (FDR10) of every port and takes "unsupported" as no FDR10.
const SMP_STATUS_KNOWN: &[(&str, &str)] =
    &[("attribute 0xff90", "Mellanox's vendor ExtendedPortInfo (FDR10) is not modelled; opensm goes on without it")];
/// What goes into the guest: rdma-core's, opensm's and infiniband-diags' programs.
const BINARIES: &[&str] = &["ibv_devinfo", "ibv_rc_pingpong", "opensm", "ibstat", "smpquery", "ibnetdiscover"];
/// Debian packages for the programs rdma-core's ibverbs-utils does not bring: (program, package).
const PACKAGES: &[(&str, &str)] = &[("opensm", "opensm"), ("ibnetdiscover", "infiniband-diags")];

const IBSTAT_BEGIN: &str = "=== ibstat begin ===";
const IBSTAT_END: &str = "=== ibstat end ===";
const SMPQUERY_BEGIN: &str = "=== smpquery begin ===";
const SMPQUERY_END: &str = "=== smpquery exit ";
const SWITCH_BEGIN: &str = "=== switch smpquery begin ===";
const SWITCH_END: &str = "=== switch smpquery exit ";
const NETDISC_BEGIN: &str = "=== ibnetdiscover begin ===";
const NETDISC_END: &str = "=== ibnetdiscover exit ";
const SWEPT: &str = "=== opensm swept: ";
const RC_EXIT: &str = "=== ibv_rc_pingpong exit server=";
const HOST_PORTINFO_BEGIN: &str = "=== host portinfo begin ===";
const HOST_PORTINFO_END: &str = "=== host portinfo end ===";
const HOST_NODEINFO_BEGIN: &str = "=== host nodeinfo begin ===";
const HOST_NODEINFO_END: &str = "=== host nodeinfo exit ";

fn init_script() -> String {
    let prelude = init_prelude();
    format!(
        r#"{prelude}mkdir -p /var/log /var/cache/opensm /etc/opensm /run
ip link set lo up
for d in /sys/bus/pci/devices/*; do echo "bar: $(basename $d) $(head -n 1 $d/resource | cut -d' ' -f1)"; done
for i in /sys/class/infiniband/*; do [ -e "$i" ] && echo "rdma: $(basename $i) node_guid=$(cat $i/node_guid) state=$(cat $i/ports/1/state) lid=$(cat $i/ports/1/lid)"; done
echo "before opensm: $(ibstat mlx5_0 1 | grep -E 'State|Base lid' | tr -s '\t\n' '  ')"
guid=$(ibstat -p mlx5_0 | head -n 1)
timeout 600 opensm -g $guid -f /tmp/opensm.log > /tmp/opensm.out 2>&1 &
sm=$!
n=0
while [ $n -lt {SWEEP_WAIT_DS} ]; do
  a=$(cat /sys/class/infiniband/mlx5_0/ports/1/state 2>/dev/null)
  b=$(cat /sys/class/infiniband/mlx5_1/ports/1/state 2>/dev/null)
  case "$a $b" in *ACTIVE*ACTIVE*)
    timeout 10 smpquery -C mlx5_0 -P 1 -D portinfo 0,1,3 2>/dev/null | grep -q 'LinkState:.*Active' && break;;
  esac
  sleep 0.2
  n=$((n+2))
done
echo "{SWEPT}$n ==="
echo "{IBSTAT_BEGIN}"
ibstat
echo "{IBSTAT_END}"
lid1=$(cat /sys/class/infiniband/mlx5_1/ports/1/lid)
echo "{SMPQUERY_BEGIN}"
timeout {PROGRAM_TIMEOUT_S} smpquery -C mlx5_0 -P 1 nodeinfo $((lid1)) && timeout {PROGRAM_TIMEOUT_S} smpquery -C mlx5_0 -P 1 -D nodedesc 0,1,2
echo "{SMPQUERY_END}$? ==="
echo "{SWITCH_BEGIN}"
timeout {PROGRAM_TIMEOUT_S} smpquery -C mlx5_0 -P 1 -D nodeinfo 0,1 && slid=$(timeout {PROGRAM_TIMEOUT_S} smpquery -C mlx5_0 -P 1 -D portinfo 0,1 0 | sed -n 's/^Lid:\.*//p') && timeout {PROGRAM_TIMEOUT_S} smpquery -C mlx5_0 -P 1 switchinfo $((slid))
echo "{SWITCH_END}$? ==="
echo "{NETDISC_BEGIN}"
timeout {PROGRAM_TIMEOUT_S} ibnetdiscover -C mlx5_0 -P 1
echo "{NETDISC_END}$? ==="
timeout {PROGRAM_TIMEOUT_S} ibv_rc_pingpong -d mlx5_0 -s 4096 -n {RC_ITERS} -e > /tmp/server.txt 2>&1 &
spid=$!
n=0
while ! grep -Eq ':{PINGPONG_PORT_HEX} 0+:0000 0A' /proc/net/tcp /proc/net/tcp6 2>/dev/null && [ $n -lt 200 ]; do sleep 0.1; n=$((n+1)); done
timeout {PROGRAM_TIMEOUT_S} ibv_rc_pingpong -d mlx5_1 -s 4096 -n {RC_ITERS} -e 127.0.0.1 > /tmp/client.txt 2>&1
crc=$?
wait $spid
src=$?
sed 's/^/rc server: /' /tmp/server.txt
sed 's/^/rc client: /' /tmp/client.txt
echo "{RC_EXIT}$src client=$crc ==="
echo "{HOST_PORTINFO_BEGIN}"
timeout {PROGRAM_TIMEOUT_S} smpquery -C mlx5_0 -P 1 -D portinfo 0,1,3
echo "{HOST_PORTINFO_END}"
hlid=$(timeout {PROGRAM_TIMEOUT_S} smpquery -C mlx5_0 -P 1 -D portinfo 0,1,3 | sed -n 's/^Lid:\.*//p')
echo "{HOST_NODEINFO_BEGIN}"
timeout {PROGRAM_TIMEOUT_S} smpquery -C mlx5_0 -P 1 nodeinfo $((hlid))
echo "{HOST_NODEINFO_END}$? ==="
kill $sm 2>/dev/null
wait $sm
sed 's/^/opensm: /' /tmp/opensm.out
grep -E 'SUBNET UP|ERR|sweep' /tmp/opensm.log | sed 's/^/opensm.log: /'
echo "{DMESG_BEGIN}"
dmesg
echo "{DMESG_END}"
echo "{DONE}"
poweroff -f
"#
    )
}

/// One CA's `ibstat` fields: (State, Base lid, SM lid).
fn ibstat_port(out: &str, ca: &str) -> Option<(String, u16, u16)> {
    let block = out.split("CA '").find(|b| b.starts_with(&format!("{ca}'")))?;
    let field = |k: &str| block.lines().find_map(|l| l.trim().strip_prefix(k).map(|v| v.trim().to_string()));
    Some((field("State:")?, field("Base lid:")?.parse().ok()?, field("SM lid:")?.parse().ok()?))
}

/// What the console must show; each problem found goes into `problems`.
fn check(console: &str, host_guid: Option<&str>, problems: &mut Vec<String>) {
    // The second function's BAR is where its bridge watches the BAR file.
    let bars: Vec<u64> = console
        .lines()
        .filter_map(|l| l.strip_prefix("bar: "))
        .filter_map(|l| u64::from_str_radix(l.split_whitespace().nth(1)?.trim_start_matches("0x"), 16).ok())
        .collect();
    let want: Vec<u64> = (0..PORTS.len() as u64).map(|k| BAR_WINDOW + k * BAR_BYTES).collect();
    if bars != want {
        problems.push(format!("the functions' BAR0s are {bars:x?}, the bridges watch {want:x?}"));
    }
    // The LIDs are opensm's: both ports came up in Init without one.
    for ca in ["mlx5_0", "mlx5_1"] {
        let before = format!("rdma: {ca} ");
        let fresh = console.lines().any(|l| l.starts_with(&before) && l.ends_with("state=2: INIT lid=0x0"));
        if !fresh {
            problems.push(format!("{ca} was not in Init without a LID before opensm ran"));
        }
    }
    match between(console, SWEPT, " ===").and_then(|n| n.trim().parse::<u32>().ok()) {
        Some(n) if n < SWEEP_WAIT_DS => println!(
            "linux-drives-sim --opensm: both guest ports and the host port Active {:.1} s after opensm started",
            f64::from(n) / 10.0
        ),
        _ => problems.push(format!(
            "opensm did not bring both guest ports and the host port to Active within {} s",
            SWEEP_WAIT_DS / 10
        )),
    }
    let ibstat = between(console, IBSTAT_BEGIN, IBSTAT_END).unwrap_or_default();
    let ports: Vec<_> = ["mlx5_0", "mlx5_1"].iter().map(|ca| (ca, ibstat_port(ibstat, ca))).collect();
    for (ca, p) in &ports {
        match p {
            Some((state, lid, sm)) => {
                println!("linux-drives-sim --opensm: ibstat {ca}: State: {state}, Base lid: {lid}, SM lid: {sm}");
                if state != "Active" {
                    problems.push(format!("ibstat {ca}: State: {state}, not Active"));
                }
                if *lid == 0 || *sm == 0 {
                    problems.push(format!("ibstat {ca}: no LID or no SM lid (Base lid {lid}, SM lid {sm})"));
                }
            }
            None => problems.push(format!("ibstat shows no port of {ca}")),
        }
    }
    if let [(_, Some((_, la, sa))), (_, Some((_, lb, sb)))] = ports.as_slice() {
        if la == lb {
            problems.push(format!("both ports have LID {la}"));
        }
        // opensm runs on mlx5_0: both ports name its LID as their SM's.
        if sa != la || sb != la {
            problems.push(format!("SM lids {sa} and {sb}, but opensm's port has LID {la}"));
        }
    }
    let smp = between(console, SMPQUERY_BEGIN, SMPQUERY_END).unwrap_or_default();
    let b_guid = format!("0x{}", PORTS[1].1);
    let exit = console.split(SMPQUERY_END).nth(1).and_then(|r| r.split_whitespace().next());
    if exit != Some("0") || !smp.lines().any(|l| l.contains("Guid") && l.contains(&b_guid)) {
        problems.push(format!("smpquery nodeinfo by LID did not show mlx5_1's GUID {b_guid} (exit {exit:?})"));
    }
    if !smp.contains("ConnectX5 mlx5-sim") {
        problems.push("smpquery -D nodedesc 0,1,2 (through the switch) did not show mlx5_1's node description".into());
    }
    // The switch one hop out: its NodeInfo by directed route, its SwitchInfo by the LID opensm gave it.
    let sw = between(console, SWITCH_BEGIN, SWITCH_END).unwrap_or_default();
    let exit = console.split(SWITCH_END).nth(1).and_then(|r| r.split_whitespace().next());
    let is_switch = smp_field(sw, "NodeType") == Some("Switch") && smp_field(sw, "NumPorts") == Some("3");
    let guid = smp_field(sw, "Guid").is_some_and(|g| g == format!("0x{SWITCH_GUID}"));
    let top = smp_field(sw, "LinearFdbTop").and_then(|v| v.parse::<u16>().ok());
    match (exit, is_switch && guid, top) {
        (Some("0"), true, Some(t)) if t > 0 => println!(
            "linux-drives-sim --opensm: smpquery -D nodeinfo 0,1: a switch of 3 ports, GUID 0x{SWITCH_GUID}; \
             switchinfo by its LID: LinearFdbTop {t}"
        ),
        _ => problems.push(format!(
            "the switch: smpquery exit {exit:?}, a 3-port switch with GUID 0x{SWITCH_GUID}: {}, LinearFdbTop {top:?}",
            is_switch && guid
        )),
    }
    let disc = between(console, NETDISC_BEGIN, NETDISC_END).unwrap_or_default();
    let switches = disc.lines().filter(|l| l.starts_with("Switch\t")).count();
    let cas = disc.lines().filter(|l| l.starts_with("Ca\t")).count();
    // Each channel adapter's link to the switch: a `[port](guid)` line naming the switch (ibnetdiscover prints
    // the GUID in parentheses without leading zeros).
    let mut guids: Vec<String> = PORTS.iter().map(|(_, g)| g.to_string()).collect();
    guids.extend(host_guid.map(str::to_string));
    let linked = guids
        .iter()
        .map(|g| format!("({})", g.trim_start_matches('0')))
        .filter(|g| disc.lines().any(|l| l.starts_with('[') && l.contains(g.as_str()) && l.contains(SWITCH_GUID)))
        .count();
    if switches != 1 || cas != 3 || linked != 3 {
        problems.push(format!(
            "ibnetdiscover: {switches} switches (want 1), {cas} channel adapters (want 3), {linked} of them linked to \
             the switch (want 3)"
        ));
    } else {
        println!("linux-drives-sim --opensm: ibnetdiscover found 1 switch and 3 channel adapters, each linked to it");
    }
    let rc = console.split(RC_EXIT).nth(1).and_then(|r| r.lines().next()).unwrap_or("?");
    let bytes = format!("{} bytes in", 2 * 4096 * u64::from(RC_ITERS));
    match console.lines().find(|l| l.starts_with("rc client: ") && l.contains(&bytes)) {
        Some(l) if rc == "0 client=0 ===" => println!("linux-drives-sim --opensm: {l}"),
        _ => problems.push(format!("ibv_rc_pingpong over opensm's LIDs: exit server={rc}")),
    }
}

/// One field of `smpquery portinfo` output (`Lid:.....3`).
fn smp_field<'a>(out: &'a str, name: &str) -> Option<&'a str> {
    out.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(':')).map(|v| v.trim_start_matches('.').trim())
}

/// The host process's reports of its port, in order: (LID, state). (Its port goes Down at the end, when the
/// guest powers off and the cable's far end is gone.)
fn host_port(log: &str) -> Vec<(u16, u8)> {
    let one = |l: &str| {
        let field = |k: &str| l.split_whitespace().find_map(|w| w.strip_prefix(k)).map(str::to_string);
        let lid = u16::from_str_radix(field("lid=")?.trim_start_matches("0x"), 16).ok()?;
        Some((lid, field("state=")?.parse().ok()?))
    };
    log.lines().filter(|l| l.starts_with("sma: port 1: ")).filter_map(one).collect()
}

/// The host process's node GUID, as it reports it.
fn host_guid(host_log: &str) -> Option<&str> {
    host_log.lines().find_map(|l| l.split_whitespace().find_map(|w| w.strip_prefix("node_guid=")))
}

/// The host stack's port on switch port 3, swept by the same opensm: what the guest saw of it and what the host
/// process says.
fn check_host(console: &str, host_log: &str, problems: &mut Vec<String>) {
    let pi = between(console, HOST_PORTINFO_BEGIN, HOST_PORTINFO_END).unwrap_or_default();
    let lid = smp_field(pi, "Lid").and_then(|v| v.parse::<u16>().ok()).unwrap_or(0);
    let state = smp_field(pi, "LinkState").unwrap_or("?");
    println!("linux-drives-sim --opensm: smpquery -D portinfo 0,1,3 (the host port): Lid {lid}, LinkState {state}");
    if lid == 0 || state != "Active" {
        problems.push(format!("the host port by directed route: Lid {lid}, LinkState {state} (want a LID, Active)"));
    }
    let guid = host_guid(host_log).unwrap_or("(none)");
    let ni = between(console, HOST_NODEINFO_BEGIN, HOST_NODEINFO_END).unwrap_or_default();
    let exit = console.split(HOST_NODEINFO_END).nth(1).and_then(|r| r.split_whitespace().next());
    if exit != Some("0") || !ni.lines().any(|l| l.contains("Guid") && l.contains(&format!("0x{guid}"))) {
        problems.push(format!("smpquery nodeinfo {lid} did not show the host port's GUID 0x{guid} (exit {exit:?})"));
    } else {
        println!(
            "linux-drives-sim --opensm: smpquery nodeinfo {lid} (by LID) answers with the host port's GUID 0x{guid}"
        );
    }
    let seen = host_port(host_log);
    if seen.first() != Some(&(0, 2)) {
        problems.push(format!("the host port did not start in Init without a LID: {seen:?}"));
    }
    if lid != 0 && seen.contains(&(lid, 4)) {
        println!("linux-drives-sim --opensm: the host process reports its port lid={lid:#x} state=4 (Active); (lid, state) as it went: {seen:?}");
    } else {
        problems.push(format!("the host process reports (lid, state) {seen:?}, never LID {lid} Active"));
    }
}

/// One report of the switch: (LID, SM LID, port states, LIDs its LFT routes).
type SwitchReport = (u16, u16, String, usize);

/// The switch's reports, in order, and its last counters line.
fn switch_reports(log: &str) -> (Vec<SwitchReport>, Option<&str>) {
    let one = |l: &str| {
        let rest = l.strip_prefix("switch: lid=")?;
        let field = |k: &str| rest.split(k).nth(1)?.split_whitespace().next();
        let lid = u16::from_str_radix(rest.split_whitespace().next()?.trim_start_matches("0x"), 16).ok()?;
        let sm = u16::from_str_radix(field("sm_lid=")?.trim_start_matches("0x"), 16).ok()?;
        let states = rest.split("states=").nth(1)?.split(']').next()?.to_string() + "]";
        Some((lid, sm, states, field("lft_entries=")?.parse().ok()?))
    };
    let counters = log.lines().filter_map(|l| l.strip_prefix("switch: counters ")).next_back();
    (log.lines().filter_map(one).collect(), counters)
}

/// One counter of the switch's `SwitchCounters { forwarded: 5, ... }` line.
fn counter(line: &str, name: &str) -> Option<u64> {
    line.split(&format!(" {name}: ")).nth(1)?.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
}

/// The switch's own account: opensm gave it a LID, made its three ports Active and routed every LID; the
/// ping-pong crossed its LFT.
fn check_switch(log: &str, problems: &mut Vec<String>) {
    let (seen, counters) = switch_reports(log);
    match seen.last() {
        Some((lid, sm, states, lft)) if *lid != 0 && *sm != 0 && states == "[4, 4, 4]" && *lft >= 4 => println!(
            "linux-drives-sim --opensm: the switch reports lid={lid:#x} sm_lid={sm:#x} port states {states} \
             (Active), {lft} LIDs in its LFT"
        ),
        last => problems
            .push(format!("the switch's last report {last:?}: want a LID, an SM, 3 Active ports, 4+ LIDs routed")),
    }
    let c = counters.unwrap_or("");
    match (counter(c, "forwarded"), counter(c, "dr_forwarded"), counter(c, "answered")) {
        (Some(f), Some(d), Some(a)) if f > u64::from(RC_ITERS) && d > 0 && a > 0 => {
            println!("linux-drives-sim --opensm: the switch's counters: {c}")
        }
        _ => problems.push(format!("the switch forwarded too little (want the ping-pong by LFT, SMPs by route): {c}")),
    }
}

pub(super) fn run(root: &Path) -> Result<(), String> {
    let started = Instant::now();
    let linux = crate::uml::build(root)?;
    let bridge = build_bridge(root)?;
    crate::cargo(root, &["build", "-q", "-p", "mlx5-verbs", "--example", "sma"])?;
    crate::cargo(root, &["build", "-q", "-p", "mlx5-sim", "--example", "ib_switch"])?;
    let sma = root.join("target/debug/examples/sma");
    let switch = root.join("target/debug/examples/ib_switch");
    crate::vde::ensure_vde()?;
    let missing: Vec<&str> = PACKAGES.iter().filter(|(prog, _)| !crate::vfio_test::have(prog)).map(|p| p.1).collect();
    if !missing.is_empty() {
        crate::vfio_test::apt_install(&missing)?;
    }
    let work = root.join("target/linux-drives-sim/opensm");
    std::fs::create_dir_all(&work).map_err(|e| format!("{}: {e}", work.display()))?;
    let initrd = initramfs_with(&work, &init_script(), BINARIES)?;
    // One BAR file for UML's whole BAR window: both functions' user doorbells land in it.
    let bar_file = work.join("bar.file");
    std::fs::File::create(&bar_file)
        .and_then(|f| f.set_len(PORTS.len() as u64 * BAR_BYTES))
        .map_err(|e| format!("{}: {e}", bar_file.display()))?;
    // One cable (a `vde_switch` of two plugs) per switch port: a, b and the host process.
    let mut cables = Vec::new();
    let mut urls = Vec::new();
    for name in ["a", "b", "host"] {
        let dir = work.join(format!("cable-{name}"));
        cables.push(crate::rxe::start_switch(&dir)?);
        urls.push(format!("vde://{}", dir.display()));
    }
    let switch_log_path = work.join("switch.log");
    let switch_log = std::fs::File::create(&switch_log_path).map_err(|e| e.to_string())?;
    let mut ib_switch = Reap(
        Command::new(&switch)
            .args(["--node-guid", SWITCH_GUID, "--seconds", &HOST_SMA_SECONDS.to_string()])
            .args(&urls)
            .stdout(switch_log.try_clone().map_err(|e| e.to_string())?)
            .stderr(switch_log)
            .spawn()
            .map_err(|e| format!("{}: {e}", switch.display()))?,
    );
    let mut bridges = Vec::new();
    let mut sockets = Vec::new();
    for (k, (name, guid)) in PORTS.iter().enumerate() {
        let sock = work.join(format!("{name}.sock"));
        let _ = std::fs::remove_file(&sock);
        let log = std::fs::File::create(work.join(format!("{name}.bridge.log"))).map_err(|e| e.to_string())?;
        let child = Command::new(&bridge)
            .arg("--socket")
            .arg(&sock)
            .arg("--trace")
            .arg(work.join(format!("{name}.trace.jsonl")))
            .arg("--bar-file")
            .arg(&bar_file)
            .args(["--bar-file-offset", &format!("{:x}", k as u64 * BAR_BYTES)])
            .args(["--port", "ib", "--subnet-manager", "--node-guid", guid, "--wire-vde", &urls[k]])
            .stderr(log)
            .spawn()
            .map_err(|e| format!("{}: {e}", bridge.display()))?;
        bridges.push(Reap(child));
        wait_for_socket(&sock, name)?;
        sockets.push(sock);
    }
    // The host's own stack on switch port 3, its port waiting for an SM.
    let host_log_path = work.join("host.sma.log");
    let host_log = std::fs::File::create(&host_log_path).map_err(|e| e.to_string())?;
    let mut host = Reap(
        Command::new(&sma)
            .env("MLX5_RS_DEVICES", format!("sim:link=ib:sm=wait:wire=vde:{}", urls[2]))
            .args(["--seconds", &HOST_SMA_SECONDS.to_string()])
            .stdout(host_log.try_clone().map_err(|e| e.to_string())?)
            .stderr(host_log)
            .spawn()
            .map_err(|e| format!("{}: {e}", sma.display()))?,
    );
    let console_path = work.join("console.txt");
    let boot = Instant::now();
    let mut uml = spawn_uml(&linux, "384M", &initrd, &sockets, &bar_file, &work, &console_path)?;
    let timed_out = wait_until(&mut uml.0, boot + BOOT_TIMEOUT, Duration::from_millis(50))?.is_none();
    if timed_out {
        let _ = uml.0.kill();
    }
    let guest_time = boot.elapsed();
    drop(uml);
    for b in &mut bridges {
        let _ = wait_until(&mut b.0, Instant::now() + Duration::from_secs(10), Duration::from_millis(20));
    }
    drop(bridges);
    host.end();
    ib_switch.end();
    drop(cables);
    let host_log = std::fs::read_to_string(&host_log_path).unwrap_or_default();
    let switch_log = std::fs::read_to_string(&switch_log_path).unwrap_or_default();
    let console = String::from_utf8_lossy(&std::fs::read(&console_path).map_err(|e| e.to_string())?).into_owned();
    let dmesg = between(&console, DMESG_BEGIN, DMESG_END).unwrap_or(&console).to_string();
    std::fs::write(work.join("dmesg.txt"), &dmesg).map_err(|e| e.to_string())?;
    println!(
        "linux-drives-sim --opensm: guest ran {:.1} s; total {:.1} s; logs in {}",
        guest_time.as_secs_f64(),
        started.elapsed().as_secs_f64(),
        work.display()
    );
    for l in
        console.lines().filter(|l| ["pci: ", "bar: ", "rdma: ", "before opensm: "].iter().any(|p| l.starts_with(p)))
    {
        println!("  {l}");
    }
    let mut problems = Vec::new();
    if !console.contains(DONE) {
        problems.push(format!("the guest did not finish its init script{}", if timed_out { " in time" } else { "" }));
    }
    check(&console, host_guid(&host_log), &mut problems);
    check_host(&console, &host_log, &mut problems);
    check_switch(&switch_log, &mut problems);
    // Every SMP to the switch was answered with success, but for the known ones.
    for l in switch_log.lines().filter(|l| l.contains("SMP answered with MAD status")) {
        match SMP_STATUS_KNOWN.iter().find(|(k, _)| l.contains(k)) {
            Some((_, why)) => println!("  known, not failing: {} ({why})", l.trim()),
            None => problems.push(format!("switch: {}", l.trim())),
        }
    }
    for l in bad_lines(&dmesg) {
        match HARNESS.iter().find(|(p, _)| l.contains(p)) {
            Some((_, why)) => println!("  known, not failing: {} ({why})", l.trim()),
            None => problems.push(format!("dmesg: {}", l.trim())),
        }
    }
    for (name, _) in PORTS {
        let log = std::fs::read_to_string(work.join(format!("{name}.bridge.log"))).unwrap_or_default();
        // Every SMP opensm and infiniband-diags sent was answered with success, but for the known ones.
        for l in log.lines().filter(|l| l.contains("SMP answered with MAD status")) {
            match SMP_STATUS_KNOWN.iter().find(|(k, _)| l.contains(k)) {
                Some((_, why)) => println!("  known, not failing: {name}: {} ({why})", l.trim()),
                None => problems.push(format!("{name}: {}", l.trim())),
            }
        }
        match log.lines().find(|l| l.contains("mlx5-uml-bridge: done:")) {
            Some(l) if l.contains(" 0 rejected,") => {}
            Some(l) => problems.push(format!("{name}: the bridge refused virt-pci requests: {}", l.trim())),
            None => problems.push(format!("{name}: the bridge did not finish cleanly (no summary in its log)")),
        }
    }
    if problems.is_empty() {
        println!("linux-drives-sim --opensm: every check passed");
        Ok(())
    } else {
        Err(format!("linux-drives-sim --opensm: {} problem(s):\n  {}", problems.len(), problems.join("\n  ")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ibstat_fields_are_read_per_ca() {
        let out = "CA 'mlx5_0'\n\tCA type: MT4119\n\tPort 1:\n\t\tState: Active\n\t\tBase lid: 1\n\t\tSM lid: 1\n\
                   CA 'mlx5_1'\n\tPort 1:\n\t\tState: Initializing\n\t\tBase lid: 0\n\t\tSM lid: 0\n";
        assert_eq!(ibstat_port(out, "mlx5_0"), Some(("Active".into(), 1, 1)));
        assert_eq!(ibstat_port(out, "mlx5_1"), Some(("Initializing".into(), 0, 0)));
        assert_eq!(ibstat_port(out, "mlx5_2"), None);
    }

    #[test]
    fn the_host_port_is_read_from_smpquery_and_the_sma_log() {
        let pi = "# Port info: DR path slid 65535; dlid 65535; 0,1\nLid:.............................3\n\
                  SMLid:...........................1\nLinkState:.......................Active\n";
        assert_eq!((smp_field(pi, "Lid"), smp_field(pi, "LinkState")), (Some("3"), Some("Active")));
        assert_eq!(smp_field(pi, "Lmc"), None);
        let log = "sma: mlx5_0 node_guid=b8cef60300123457 serving QP0 (qpn 0x100)\n\
                   sma: port 1: lid=0x0 sm_lid=0x0 state=2 (Initializing)\n\
                   sma: port 1: lid=0x3 sm_lid=0x1 state=4 (Active)\n";
        assert_eq!(host_port(log), [(0, 2), (3, 4)]);
        assert!(host_port("sma: nothing\n").is_empty());
    }

    #[test]
    fn the_switch_log_is_read() {
        let log = "switch: node_guid=b8cef60300ff0001 3 ports\n\
                   switch: lid=0x0 sm_lid=0x0 port states=[2, 2, 2] lft_entries=0\n\
                   switch: counters SwitchCounters { forwarded: 0, dr_forwarded: 0, answered: 1 }\n\
                   switch: lid=0x2 sm_lid=0x1 port states=[4, 4, 4] lft_entries=4\n\
                   switch: counters SwitchCounters { forwarded: 1606, dr_forwarded: 70, answered: 39 }\n";
        let (seen, last) = switch_reports(log);
        assert_eq!(seen, [(0, 0, "[2, 2, 2]".to_string(), 0), (2, 1, "[4, 4, 4]".to_string(), 4)]);
        let last = last.unwrap();
        assert_eq!(
            (counter(last, "forwarded"), counter(last, "dr_forwarded"), counter(last, "x")),
            (Some(1606), Some(70), None)
        );
        let mut problems = Vec::new();
        check_switch(log, &mut problems);
        assert!(problems.is_empty(), "{problems:?}");
        check_switch("switch: lid=0x2 sm_lid=0x1 port states=[4, 2, 4] lft_entries=4\n", &mut problems);
        assert_eq!(problems.len(), 2, "{problems:?}");
    }

    #[test]
    fn the_init_script_parses() {
        let s = init_script();
        let ok = Command::new("/bin/busybox").args(["sh", "-n", "-c", &s]).status().is_ok_and(|st| st.success());
        assert!(ok || !Path::new("/bin/busybox").exists(), "busybox sh -n refuses the init script");
    }
}
