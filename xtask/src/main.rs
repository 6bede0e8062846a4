//! `cargo xtask`: the project's automation (the cargo xtask pattern).
//!
//! * `vendor`: copy PRM facts from `../shared/prm` into the repository; `--linux-extra`: extract the layouts
//!   those lack from Linux 6.12's `mlx5_ifc.h`, checked by the C compiler.
//! * `codegen [--check]`: generate `core/src/prm/generated.rs` from the vendored facts, or check it is current.
//! * `ci`: everything CI runs: format, lints, codegen freshness, tests, the `no_std` firmware build, Debian's
//!   verbs programs on the drop-in libibverbs, the VFIO test in a QEMU guest. `ci --fresh [--command CMD]`:
//!   `.ci/run` (or CMD) on a fresh clone of HEAD in a minimal Debian bookworm root (`fresh.rs`), so nothing
//!   installed on this host is visible.
//! * `vfio-test`: the host crate's VFIO layer against the real Linux VFIO stack, in a QEMU guest with QEMU's
//!   `edu` device behind an emulated IOMMU.
//! * `pci-sim [--full]`: the simulator behind QEMU's `x-pci-proxy-dev` (`sim/pci-proxy`), driven through the
//!   guest's vfio-pci by the `mlx5` tool, and by the bare-metal image exchanging SENDs and RDMA WRITEs with a host
//!   process over the wire; writes `target/pci-sim/summary.json` (`pci_sim.rs`).
//! * `bench [--json]`: the datapath, encoding and simulator benchmarks and the core's size; writes `BENCHMARKS.md`.
//!   `--peer`: the datapath calls against rdma-core's mlx5 provider, built from its source (`xtask/peer/`).
//! * `fuzz [--seconds N] [--target NAME]`: the cargo-fuzz targets in `fuzz/`, N seconds each (default 30), then
//!   their corpus replayed; see FUZZING.md.
//! * `miri`: the core's tests and the simulator's unsafe-heavy parts under Miri (nightly); see ARCHITECTURE.md.
//! * `cortex-m`: the core's device-free unit tests on a Cortex-M4F (QEMU's mps2-an386, semihosting) and the same
//!   list on the host; both print `N passed, N failed` (`cortex_m.rs`).
//! * `aarch64`: the tests of the core, the simulator, the verbs API, the drop-in library and the cross-crate tests
//!   built for aarch64 and run under qemu-aarch64, the drop-in's doorbells disassembled, Debian's arm64
//!   `ibv_devinfo` and `ibv_rc_pingpong` on the aarch64 drop-in (`aarch64.rs`).
//! * `modcheck [--graph] [--root DIR]`: no import cycle between sibling modules of any crate of the workspace; in
//!   `mlx5-sim` also no reference up to an ancestor's items or to a higher layer, and no type with `impl` blocks in
//!   more than 3 files (`modcheck.rs`).
//! * `libibverbs [--debug]`: the drop-in `target/libibverbs/libibverbs.so.1` (`host-linux/ibverbs`), its exports
//!   checked against rdma-core 44's. `verbs-apps [--debug] [--only PART]`: Debian's verbs programs run on it.
//! * `soak [--ops N] [--seed S] [--json] [--threaded] [--wire [--kills K]]`: random traffic between two simulated
//!   devices under injected faults, with its invariants checked (threaded, or across two processes with the peer
//!   killed); see SOAK.md.
//! * `uml`: a User-Mode Linux kernel with NVIDIA's mlx5 drivers and virt-pci (cached under `target/uml/`).
//! * `linux-drives-sim`: that kernel's `mlx5_core` and `mlx5_ib`, and Debian's rdma-core, drive the simulator
//!   (`--opensm`: Debian's opensm brings two simulated IB ports to Active, then a host process's port on our stack)
//!   through `mlx5-uml-bridge`.

mod aarch64;
mod bench;
mod codegen;
mod cortex_m;
mod fresh;
mod fuzz;
mod libibverbs;
mod linux_drives_sim;
mod linux_ifc;
mod miri;
mod modcheck;
mod pci_sim;
mod rxe;
mod soak;
mod uml;
mod vde;
mod vendored;
mod verbs_guest;
mod vfio_test;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The embedded target `mlx5-core` must build for, without alloc.
const EMBEDDED_TARGET: &str = "thumbv7em-none-eabihf";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the workspace root").to_path_buf()
}

/// A child we started (by its own handle): killed unless it already exited, and reaped, at `end` or when dropped.
pub(crate) struct Reap(pub(crate) std::process::Child);

impl Reap {
    pub(crate) fn end(&mut self) {
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
        }
        let _ = self.0.wait();
    }
}

impl Drop for Reap {
    fn drop(&mut self) {
        self.end();
    }
}

fn cargo(root: &Path, args: &[&str]) -> Result<(), String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    println!("$ cargo {}", args.join(" "));
    let status = Command::new(cargo)
        .args(args)
        .current_dir(root)
        .status()
        .map_err(|e| format!("failed to run cargo {}: {e}", args.join(" ")))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("`cargo {}` failed ({status})", args.join(" ")))
    }
}

/// Installs what CI needs from rustup (the embedded target, rustfmt, clippy) when it is missing.
/// Adds the rustup target `target` when it is not installed.
pub(crate) fn ensure_target(target: &str) -> Result<(), String> {
    let installed = Command::new("rustup")
        .args(["target", "list", "--installed"])
        .output()
        .map_err(|e| format!("failed to run rustup: {e}"))?;
    if !String::from_utf8_lossy(&installed.stdout).lines().any(|l| l.trim() == target) {
        println!("$ rustup target add {target}");
        let ok = Command::new("rustup").args(["target", "add", target]).status().map_err(|e| e.to_string())?;
        if !ok.success() {
            return Err(format!("rustup could not add {target}"));
        }
    }
    Ok(())
}

fn ensure_toolchain() -> Result<(), String> {
    ensure_target(EMBEDDED_TARGET)?;
    let ok =
        Command::new("rustup").args(["component", "add", "rustfmt", "clippy"]).status().map_err(|e| e.to_string())?;
    if !ok.success() {
        return Err("rustup could not add rustfmt and clippy".into());
    }
    Ok(())
}

fn ci(root: &Path) -> Result<(), String> {
    ensure_toolchain()?;
    cargo(root, &["fmt", "--all", "--check"])?;
    codegen::run_codegen(root, true)?;
    modcheck::run(root, false)?;
    cargo(root, &["clippy", "--workspace", "--all-targets", "--", "-D", "warnings"])?;
    // The simulator's VDE tests need Debian's vde2 and libvdeplug2.
    vde::ensure_vde()?;
    // tshark, a RoCE decoder nobody here wrote, reads the captures of tests/all/pcap.rs and of rxe-interop.
    if !vfio_test::have("tshark") {
        vfio_test::apt_install(&["tshark"])?;
    }
    cargo(root, &["test", "--workspace"])?;
    // Rustdoc of the libraries a user reads, with every intra-doc link resolved.
    let deny = r#"build.rustdocflags=["-D", "warnings"]"#;
    let mut doc = vec!["doc", "--no-deps", "--config", deny];
    for lib in ["mlx5-core", "mlx5-sim", "mlx5-vfio", "mlx5-verbs", "mlx5-tool"] {
        doc.extend(["-p", lib]);
    }
    cargo(root, &doc)?;
    // The verbs API without the simulator (VFIO only), as a program that drives only real devices builds it.
    cargo(root, &["clippy", "-p", "mlx5-verbs", "--no-default-features", "--", "-D", "warnings"])?;
    cargo(root, &["build", "-p", "mlx5-core", "--target", EMBEDDED_TARGET])?;
    cargo(root, &["build", "-p", "mlx5-core", "--target", EMBEDDED_TARGET, "--features", "defmt"])?;
    cargo(
        root,
        &["clippy", "-p", "mlx5-core", "--target", EMBEDDED_TARGET, "--features", "defmt", "--", "-D", "warnings"],
    )?;
    // The firmware example: a linked no_std image (cortex-m-rt, memory.x) running the core's bring-up.
    cargo(root, &["build", "--release", "-p", "mlx5-firmware-example", "--target", EMBEDDED_TARGET])?;
    cargo(root, &["clippy", "-p", "mlx5-firmware-example", "--target", EMBEDDED_TARGET, "--", "-D", "warnings"])?;
    // The core's device-free unit tests run on a Cortex-M4F in QEMU, and the same list on the host.
    cargo(root, &["clippy", "-p", "mlx5-core-tests-m4", "--target", EMBEDDED_TARGET, "--", "-D", "warnings"])?;
    cortex_m::run(root)?;
    // The workspace's tests on aarch64 under qemu-user, and Debian's arm64 programs on the aarch64 drop-in.
    aarch64::run_aarch64(root)?;
    // The examples run on the simulator, each verifying its data (doctests ran with `cargo test`).
    for example in ["rc_pingpong", "ud_pingpong", "rdma_write_read", "event_driven", "srq_pingpong"] {
        cargo(root, &["run", "--release", "-q", "-p", "mlx5-verbs", "--example", example])?;
    }
    // The unsafe code under Miri (the core's tests, the simulator's DMA space and test kit; xtask/src/miri.rs).
    miri::run(root)?;
    // 4,096 RC QPs with their own CQs and MRs made, used on a sample, destroyed, nothing leaked (`bench --scale`).
    bench::ci_scale(root)?;
    // The fault-injection soak at CI size, then threaded and across two processes: every invariant must hold.
    soak::run(root, &soak::CI_ARGS.iter().map(|a| a.to_string()).collect::<Vec<_>>())?;
    for args in soak::CI_WIDER_ARGS {
        soak::run(root, &args.iter().map(|a| a.to_string()).collect::<Vec<_>>())?;
    }
    // Debian's verbs programs on the drop-in libibverbs.so.1 (downloads the packages when not installed).
    libibverbs::run_verbs_apps(root, &[])?;
    // Simulated ports of four processes on one VDE fabric, started in no order.
    vde::run(root, &[])?;
    vfio_test::run_vfio_test(root)?;
    // Linux's rdma_rxe in a TCG guest answering our RoCEv2 frames (reuses vfio-test's Debian kernel).
    rxe::run_rxe_interop(root, rxe::Part::All)?;
    // The simulator behind QEMU's x-pci-proxy-dev, driven through the guest's vfio-pci (reuses the same kernel).
    pci_sim::run_pci_sim(root, false)?;
    // Linux's own mlx5_core and mlx5_ib drive the simulator in User-Mode Linux, rdma-core's programs on top
    // (the UML kernel is built once, then cached under target/uml/).
    linux_drives_sim::ci_step(root)?;
    // Two simulated Ethernet ports under two UML instances' mlx5e, on one cable: ping, iperf3, ethtool -S, then
    // over RoCEv2 ibv_devinfo, ibv_rc_pingpong -g, and over rdma_cm rping, ib_send_bw -R and ib_write_bw -R (the
    // whole `--eth`: 26-37 s warm, against 17-25 s without the rdma_cm programs).
    linux_drives_sim::ci_step_eth(root)?;
    // Two simulated IB ports of one UML on one cable: Debian's opensm assigns the LIDs and activates them; then a
    // second opensm sweeps a third function's cable to a host process on our own stack (its QP0 served by
    // SmiAgent). 13-16 s warm, about a minute cold with opensm and infiniband-diags from apt and the builds.
    linux_drives_sim::run_opensm(root)?;
    // rdma-core's own Python test suite (Debian's python3-pyverbs) on mlx5_ib in the guest, on an IB and on a
    // RoCE port: no test may fail, and every skip must be of a named class (about 2 and 3 minutes warm).
    linux_drives_sim::run_python(root, false)?;
    linux_drives_sim::run_python(root, true)?;
    fuzz::run_fuzz(root, &["--seconds".to_string(), fuzz::CI_SECONDS.to_string()])?;
    println!("xtask ci: all steps passed");
    Ok(())
}

const USAGE: &str = "usage: cargo xtask <command> [options]

commands:
  vendor [--linux-extra]         copy PRM facts from ../shared/prm into core/prm/ (--linux-extra: extract the
                                 layouts ../shared/prm lacks from Linux 6.12's mlx5_ifc.h, checked by the C compiler)
  codegen [--check]              regenerate core/src/prm/generated.rs (--check: fail if it is stale)
  ci                             everything CI runs
  ci --fresh [--command CMD]     .ci/run on a fresh clone of HEAD in a minimal Debian bookworm root built with
                                 mmdebstrap (cached under target/fresh/; needs root); --command: bash -c CMD in
                                 the clone instead
  vfio-test                      the VFIO layer against real Linux VFIO in a QEMU guest (needs root)
  pci-sim [--full]               the simulator as a PCI device of a QEMU guest (x-pci-proxy-dev): the guest's
                                 vfio-pci and our VFIO crate bring it up, devinfo and a 1,000 x 4 KiB ping-pong
                                 (--full: also a bench loopback), over the wire with host processes, and the
                                 bare-metal image's 1,000 x 4 KiB SENDs and RDMA WRITEs with a host process;
                                 writes target/pci-sim/summary.json (needs root)
  rxe-interop [--rping|--vde|--wirefilter]
                                 mlx5 pingpong against ibv_rc_pingpong over rdma_rxe in a QEMU guest, both ways,
                                 rping on the drop-in librdmacm against Linux's rdma_cm and the host's
                                 ibv_rc_pingpong on the drop-in, both ways with the guest on a VDE switch
                                 (--rping: only the rping runs; --vde: only the VDE runs; --wirefilter: only
                                 rping through wirefilter losing 5 %, duplicating and reordering each way,
                                 between two host processes and against the guest both ways; CI runs a
                                 shorter host-only one at 3 %)
  vde                            mlx5 pingpong --wire vde: RC and UD, two RoCE pairs and an InfiniBand pair
                                 (--link ib) at once on one VDE fabric (the default switch, started by the
                                 first process), clients first; installs vde2;
                                 --bench: RC and UD ping-pong throughput over VDE and over a TCP stream
  bench [--json]                 the benchmarks; rewrites BENCHMARKS.md (--json: the figures as JSON too)
  bench --peer [--json]          the datapath against rdma-core's mlx5 provider; rewrites its BENCHMARKS.md section
  bench --scale [--json]         65,536 RC QPs, each with its own CQ and MR, on one simulated device, a message on
                                 a sample, all destroyed, nothing leaked; rewrites its BENCHMARKS.md section
  fuzz [--seconds N] [--target NAME]
                                 every fuzz target N seconds (1..86400, default 30), then the corpus replayed
  cortex-m                       the core's device-free unit tests on a Cortex-M4F (QEMU mps2-an386, semihosting)
                                 and the same list on the host, each ending `N passed, N failed`
  aarch64                        the core's, simulator's, verbs API's, drop-in's and cross-crate tests built for
                                 aarch64 and run under qemu-aarch64 (installed when missing), ending `N passed, N
                                 failed`; Debian's arm64 ibv_devinfo and ibv_rc_pingpong on the aarch64 drop-in
  miri                           the core's tests and the simulator's unsafe-heavy parts under Miri
  modcheck [--graph] [--root DIR]
                                 no import cycle between sibling modules of any workspace crate; in mlx5-sim no
                                 reference to an ancestor's items or a higher layer, no type impl'd in > 3 files
                                 (--graph: print the edges; --root: check the checkout at DIR)
  libibverbs [--debug]           link target/libibverbs/libibverbs.so.1 and check its exports
  librdmacm [--debug]            link target/librdmacm/librdmacm.so.1 (over the drop-in libibverbs) and check
                                 its exports
  verbs-apps [--debug] [--only PART]
                                 Debian's ibverbs-utils, perftest and rdma-core Python tests on it (PART: one
                                 of devinfo, pingpong, perftest, faults, python, abi, crate, qperf, ucx, rdmacm)
  soak [--ops N] [--seed S] [--json] [--threaded] [--progress N] [--wire [--kills K]]
                                 the fault-injection soak (options go to mlx5-soak)
  uml [--check]                  build (or find cached) the User-Mode Linux kernel with mlx5 and virt-pci
                                 (--check: only that the patches and config fragment still apply)
  linux-drives-sim [--strict] [--eth [--no-cm | --no-rdma]] [--opensm] [--python [--eth]]
                                 boot it with the simulator as its PCI device: mlx5_core and mlx5_ib probe
                                 cleanly, ibv_devinfo, rc/ud pingpong (rdma-core) and a clean poweroff (--eth:
                                 two Ethernet ports in two UMLs on one cable, mlx5e's netdevs: ping, iperf3,
                                 ethtool -S, then over RoCEv2 ibv_devinfo, ibv_rc_pingpong -g, rping and
                                 ib_send_bw/ib_write_bw -R; --no-cm: without rping and perftest; --no-rdma:
                                 without any RoCE run; --opensm: two IB ports of one guest on one cable, opensm
                                 assigns the LIDs and brings both to Active, ibstat/smpquery/ibnetdiscover,
                                 ibv_rc_pingpong on them; then a second opensm sweeps a host process's port
                                 on our stack (the sma example) to Active; --python: rdma-core's Python test
                                 suite on the IB port, with --eth on a RoCE port, into
                                 target/linux-drives-sim/python-*.json)";

/// One xtask command and its options, checked before anything runs.
enum Task {
    Vendor { linux_extra: bool },
    Codegen { check: bool },
    Ci { fresh: bool, command: Option<String> },
    VfioTest,
    RxeInterop { part: rxe::Part },
    PciSim { full: bool },
    Vde(Vec<String>),
    Bench { json: bool, peer: bool, scale: bool },
    Fuzz(Vec<String>),
    Miri,
    CortexM,
    Aarch64,
    Modcheck { graph: bool, root: Option<PathBuf> },
    Soak(Vec<String>),
    Uml { check: bool },
    LinuxDrivesSim { strict: bool, eth: bool, no_rdma: bool, no_cm: bool, opensm: bool, python: bool },
    Libibverbs(Vec<String>),
    Librdmacm(Vec<String>),
    VerbsApps(Vec<String>),
}

fn parse(mut argv: mlx5_args::Argv) -> Result<Task, mlx5_args::ArgError> {
    use mlx5_args::ArgError;
    let command = match argv.next() {
        Some(c) => c?,
        None => return Err(ArgError::Other("no command given".into())),
    };
    if mlx5_args::is_help(&command) {
        return Err(ArgError::Help);
    }
    let mut task = match command.as_str() {
        "vendor" => Task::Vendor { linux_extra: false },
        "codegen" => Task::Codegen { check: false },
        "ci" => Task::Ci { fresh: false, command: None },
        "vfio-test" => Task::VfioTest,
        "rxe-interop" => Task::RxeInterop { part: rxe::Part::All },
        "pci-sim" => Task::PciSim { full: false },
        "vde" => Task::Vde(Vec::new()),
        "bench" => Task::Bench { json: false, peer: false, scale: false },
        "fuzz" => Task::Fuzz(Vec::new()),
        "miri" => Task::Miri,
        "cortex-m" => Task::CortexM,
        "aarch64" => Task::Aarch64,
        "modcheck" => Task::Modcheck { graph: false, root: None },
        "soak" => Task::Soak(Vec::new()),
        "uml" => Task::Uml { check: false },
        "linux-drives-sim" => Task::LinuxDrivesSim {
            strict: false,
            eth: false,
            no_rdma: false,
            no_cm: false,
            opensm: false,
            python: false,
        },
        "libibverbs" => Task::Libibverbs(Vec::new()),
        "librdmacm" => Task::Librdmacm(Vec::new()),
        "verbs-apps" => Task::VerbsApps(Vec::new()),
        other => return Err(ArgError::Other(format!("unknown command {other:?}"))),
    };
    while let Some(a) = argv.next() {
        let a = a?;
        if mlx5_args::is_help(&a) {
            return Err(ArgError::Help);
        }
        match (&mut task, a.as_str()) {
            (Task::Codegen { check }, "--check") => *check = true,
            (Task::Vendor { linux_extra }, "--linux-extra") => *linux_extra = true,
            (Task::Bench { json, .. }, "--json") => *json = true,
            (Task::Bench { peer, scale: false, .. }, "--peer") => *peer = true,
            (Task::Bench { scale, peer: false, .. }, "--scale") => *scale = true,
            (Task::Bench { .. }, "--peer" | "--scale") => {
                return Err(ArgError::Other("bench takes one of --peer and --scale".into()))
            }
            (Task::Fuzz(v), "--seconds") => {
                // libFuzzer reads 0 as "no limit": a run must end.
                let n: u32 = argv.number("--seconds", 1, 86_400)?;
                v.extend(["--seconds".to_string(), n.to_string()]);
            }
            (Task::Fuzz(v), "--target") => {
                let t = argv.value("--target", "a target name")?;
                if !fuzz::TARGETS.contains(&t.as_str()) {
                    let why = format!("no fuzz target {t:?} (targets: {})", fuzz::TARGETS.join(", "));
                    return Err(ArgError::Invalid { option: "--target".into(), why });
                }
                v.extend(["--target".to_string(), t]);
            }
            (Task::Ci { fresh, .. }, "--fresh") => *fresh = true,
            (Task::Ci { command, .. }, "--command") => *command = Some(argv.value("--command", "a shell command")?),
            (Task::Modcheck { graph, .. }, "--graph") => *graph = true,
            (Task::LinuxDrivesSim { strict, .. }, "--strict") => *strict = true,
            (Task::LinuxDrivesSim { eth, .. }, "--eth") => *eth = true,
            (Task::LinuxDrivesSim { no_rdma, .. }, "--no-rdma") => *no_rdma = true,
            (Task::LinuxDrivesSim { opensm, .. }, "--opensm") => *opensm = true,
            (Task::LinuxDrivesSim { no_cm, .. }, "--no-cm") => *no_cm = true,
            (Task::LinuxDrivesSim { python, .. }, "--python") => *python = true,
            (Task::Uml { check }, "--check") => *check = true,
            (Task::PciSim { full }, "--full") => *full = true,
            (Task::RxeInterop { part }, "--rping") => *part = rxe::Part::Rping,
            (Task::RxeInterop { part }, "--vde") => *part = rxe::Part::Vde,
            (Task::RxeInterop { part }, "--wirefilter") => *part = rxe::Part::Wirefilter,
            (Task::Vde(v), "--bench") => v.push(a),
            (Task::Modcheck { root, .. }, "--root") => *root = Some(argv.path("--root")?),
            // The soak binary parses and checks its own options.
            (Task::Soak(v), _) => v.push(a),
            (Task::Libibverbs(v) | Task::Librdmacm(v) | Task::VerbsApps(v), "--debug") => v.push(a),
            (Task::VerbsApps(v), "--only") => {
                let part = argv.value("--only", "a part name")?;
                let names: Vec<&str> = libibverbs::PARTS.iter().map(|(n, _)| *n).collect();
                if !names.contains(&part.as_str()) {
                    let why = format!("no part {part:?} (parts: {})", names.join(", "));
                    return Err(ArgError::Invalid { option: "--only".into(), why });
                }
                v.extend(["--only".to_string(), part]);
            }
            (_, o) if o.starts_with('-') => {
                return Err(ArgError::NotApplicable { option: o.to_string(), command: format!("xtask {command}") })
            }
            (_, o) => return Err(ArgError::Other(format!("unexpected argument {o:?}"))),
        }
    }
    if let Task::Ci { fresh: false, command: Some(_) } = task {
        let why = "runs only inside the fresh root (ci --fresh --command CMD)".to_string();
        return Err(ArgError::Invalid { option: "--command".into(), why });
    }
    Ok(task)
}

fn main() -> ExitCode {
    let task = match parse(mlx5_args::Argv::from_env()) {
        Ok(t) => t,
        Err(e) => return mlx5_args::usage_exit("xtask", &e, USAGE),
    };
    let root = root();
    let result = match task {
        Task::Vendor { linux_extra: false } => codegen::run_vendor(&root),
        Task::Vendor { linux_extra: true } => linux_ifc::run_vendor_extra(&root),
        Task::Codegen { check } => codegen::run_codegen(&root, check),
        Task::Ci { fresh: false, .. } => ci(&root),
        Task::Ci { fresh: true, command } => fresh::run_fresh(&root, command.as_deref()),
        Task::VfioTest => vfio_test::run_vfio_test(&root),
        Task::RxeInterop { part } => rxe::run_rxe_interop(&root, part),
        Task::PciSim { full } => pci_sim::run_pci_sim(&root, full),
        Task::Vde(args) => vde::run(&root, &args),
        Task::Bench { json, peer: false, scale: false } => bench::run(&root, json),
        Task::Bench { json, peer: true, .. } => bench::run_peer(&root, json),
        Task::Bench { json, scale: true, .. } => bench::run_scale(&root, json),
        Task::Fuzz(args) => fuzz::run_fuzz(&root, &args),
        Task::Miri => miri::run(&root),
        Task::CortexM => cortex_m::run(&root),
        Task::Aarch64 => aarch64::run_aarch64(&root),
        Task::Soak(args) => soak::run(&root, &args),
        Task::Uml { check: false } => uml::run_uml(&root),
        Task::Uml { check: true } => uml::check_recipe(&root),
        Task::LinuxDrivesSim { opensm: true, .. } => linux_drives_sim::run_opensm(&root),
        Task::LinuxDrivesSim { python: true, eth, .. } => linux_drives_sim::run_python(&root, eth),
        Task::LinuxDrivesSim { strict: _, eth: true, no_rdma, no_cm, .. } => {
            let roce = match (no_rdma, no_cm) {
                (true, _) => linux_drives_sim::Roce::Off,
                (false, true) => linux_drives_sim::Roce::Verbs,
                (false, false) => linux_drives_sim::Roce::Cm,
            };
            linux_drives_sim::run_eth(&root, roce)
        }
        Task::LinuxDrivesSim { strict, eth: false, .. } => linux_drives_sim::run(&root, strict, false),
        Task::Libibverbs(args) => libibverbs::run_libibverbs(&root, &args),
        Task::Librdmacm(args) => libibverbs::rdmacm::run_librdmacm(&root, &args),
        Task::VerbsApps(args) => libibverbs::run_verbs_apps(&root, &args),
        // `--root DIR` checks another checkout (a worktree) with this build of the checker.
        Task::Modcheck { graph, root: other } => modcheck::run(other.as_deref().unwrap_or(&root), graph),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx5_args::{ArgError, Argv};

    fn p(a: &[&str]) -> Result<Task, ArgError> {
        parse(Argv::new(a.iter().copied()))
    }

    /// Issue 21: `bench --quick` rewrote BENCHMARKS.md, `fuzz --seconds 0` fuzzed forever, `--help` exited 1.
    #[test]
    fn unknown_flags_and_endless_runs_are_refused_before_anything_runs() {
        assert!(matches!(p(&["bench", "--quick"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["bench", "--scale", "--peer"]), Err(ArgError::Other(_))));
        assert!(matches!(p(&["bench", "--scale", "--json"]), Ok(Task::Bench { json: true, scale: true, peer: false })));
        assert!(matches!(p(&["ci", "--frob"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["miri", "--all"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["fuzz", "--seconds", "0"]), Err(ArgError::Invalid { .. })));
        assert!(matches!(p(&["fuzz", "--target", "nope"]), Err(ArgError::Invalid { .. })));
        assert!(matches!(p(&["frob"]), Err(ArgError::Other(_))));
        assert_eq!(p(&["--help"]).err(), Some(ArgError::Help));
        assert_eq!(p(&["fuzz", "-h"]).err(), Some(ArgError::Help));
        assert!(matches!(p(&["fuzz", "--target", "args", "--seconds", "5"]), Ok(Task::Fuzz(_))));
        assert!(matches!(p(&["miri"]), Ok(Task::Miri)));
        assert!(matches!(p(&["cortex-m"]), Ok(Task::CortexM)));
        assert!(matches!(p(&["cortex-m", "--release"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["aarch64"]), Ok(Task::Aarch64)));
        assert!(matches!(p(&["aarch64", "--full"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["vendor", "--linux-extra"]), Ok(Task::Vendor { linux_extra: true })));
        assert!(matches!(p(&["codegen", "--linux-extra"]), Err(ArgError::NotApplicable { .. })));
        assert!(matches!(p(&["ci", "--fresh"]), Ok(Task::Ci { fresh: true, command: None })));
        assert!(matches!(p(&["ci", "--fresh", "--command", "true"]), Ok(Task::Ci { fresh: true, command: Some(_) })));
        assert!(matches!(p(&["ci", "--command", "true"]), Err(ArgError::Invalid { .. })));
        assert!(matches!(p(&["ci", "--fresh", "--command"]), Err(ArgError::Missing { .. })));
    }

    #[test]
    fn every_fuzz_target_has_a_binary_and_seeds() {
        let root = root();
        let manifest = std::fs::read_to_string(root.join("fuzz/Cargo.toml")).unwrap();
        for t in fuzz::TARGETS {
            assert!(manifest.contains(&format!("name = \"{t}\"")), "{t} is not a bin of fuzz/Cargo.toml");
            assert!(root.join(format!("fuzz/fuzz_targets/{t}.rs")).is_file(), "{t} has no source");
        }
        // Ten targets at CI_SECONDS each stay within the three minutes of fuzzing CI allows.
        assert!(fuzz::TARGETS.len() as u32 * fuzz::CI_SECONDS <= 180);
    }
}
