//! `cargo xtask aarch64`: the workspace's tests on aarch64 (BlueField's Arm cores, Arm servers) under
//! QEMU's user mode, and Debian's arm64 verbs programs on the aarch64 drop-in library.
//!
//! 1. Tools, installed when missing: the Rust target (rustup); `gcc-aarch64-linux-gnu` and `libc6-dev-arm64-cross`
//!    (the linker, and [`SYSROOT`], the arm64 C library the programs run with); `binutils-aarch64-linux-gnu`
//!    (objdump); `qemu-user` (`qemu-aarch64`).
//! 2. The tests of [`PACKAGES`] built for aarch64 in `target/aarch64`, a cargo
//!    directory of their own (the host's artifacts stay as they are, and the run under QEMU holds no lock the
//!    host's builds wait for), then run by cargo through QEMU: the target's `linker` and `runner` are given with
//!    `--config`. Tests that start their own binary again need the kernel to run an aarch64 program: the runner
//!    gives each test binary a private binfmt_misc in a user namespace (Linux 6.7 and later) with qemu-aarch64
//!    registered, unless the host has such a handler already; where neither, [`NEEDS_EXEC`] are skipped and said
//!    so. [`QEMU_LIMITS`] are skipped always, each with why. The `test result:` lines are summed into
//!    `N passed, N failed`; a test binary that dies without one counts as one failure.
//! 3. The drop-in `libibverbs.so.1` linked for aarch64 (release, as `cargo xtask libibverbs`), its exports
//!    checked, and its doorbells disassembled: the send doorbell must hold `dmb oshst` (WQEs before the doorbell
//!    record) and `dsb st` (the record before the BlueFlame write, and the flush after it), the CQ arm `dsb st`.
//! 4. Debian's arm64 `ibv_devinfo` and `ibv_rc_pingpong` (package `ibverbs-utils`, fetched by apt with its own
//!    state under `target/aarch64/apt`, so the host's package lists and architectures stay as they are) under
//!    qemu-aarch64 on that library: `mlx5_0` listed, and a ping-pong between two QEMU processes on the simulated
//!    wire over 127.0.0.1 ending with its `bytes in` line on both sides.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::cortex_m::Summary;
use crate::libibverbs::{self, Cross};
use crate::vfio_test::{apt_install, have, run, wait_until};

/// The Rust target.
pub(crate) const TARGET: &str = "aarch64-unknown-linux-gnu";
/// Its C compiler, the linker of the tests and of the drop-in library.
const CC: &str = "aarch64-linux-gnu-gcc";
const OBJDUMP: &str = "aarch64-linux-gnu-objdump";
/// The arm64 C library and loader of `libc6-arm64-cross`: QEMU's prefix for the programs' libraries.
const SYSROOT: &str = "/usr/aarch64-linux-gnu";
/// The core, the simulator, the verbs API, the drop-in library and the cross-crate tests. All of them cost
/// about 5 min cold on the shared 2-core machine (the core, verbs API and drop-in alone about 2 min), within
/// what CI allows a step, so CI runs them all.
pub(crate) const PACKAGES: &[&str] = &["mlx5-core", "mlx5-sim", "mlx5-verbs", "mlx5-ibverbs", "mlx5-tests"];
/// The tests' run under QEMU took 45-130 s on the shared machine; a hung test is stopped here.
const RUN_TIMEOUT: Duration = Duration::from_secs(1800);

/// QEMU 7.2 (Debian bookworm) answers `process_vm_readv` / `process_vm_writev` with ENOSYS, so the simulator
/// copies lent memory directly, as it does under a seccomp filter that refuses them, and a DMA into memory the
/// program unmapped faults the process: these tests check what the system calls give.
const NO_PROCESS_VM: &str = "qemu-user has no process_vm_readv/writev (ENOSYS)";
/// QEMU 7.2's user mode aborts in a child forked from a threaded program when the child starts a thread
/// (`qemu_plugin_vcpu_init_hook: assertion failed`), before the test's own code runs.
const FORK_THREADS: &str = "qemu-user 7.2 aborts a forked child of a threaded program that starts a thread";

/// The VDE link's tests, each named (libtest's `--exact` applies to `--skip` too, so a prefix skips nothing).
const NO_VDEPLUG: &str = "the cross sysroot has no arm64 libvdeplug.so.2 (the VDE link's tests run on the host)";

/// Tests that race a link paced at 3 frames a millisecond against 1 s ACK timers: under qemu-user an emulated thread
/// can stall past a timer (the fresh CI run of 2026-12-07 saw one READ timed out), so they run on the host only.
const PACED: &str = "it races a paced link against 1 s ACK timers, and qemu-user's emulated threads stall past one";

/// Tests skipped under QEMU everywhere (exact name, why).
pub(crate) const QEMU_LIMITS: &[(&str, &str)] = &[
    (
        "link::guest::tests::a_read_the_link_carries_longer_than_the_ack_timers_completes_without_being_asked_again",
        PACED,
    ),
    (
        "link::guest::tests::a_message_the_link_carries_longer_than_the_ack_timers_completes_with_nothing_sent_twice",
        PACED,
    ),
    ("dma::tests::lent_memory_the_program_unmapped_or_made_read_only_faults_the_access_not_the_process", NO_PROCESS_VM),
    ("dma::tests::rdma_on_a_registration_the_program_unmapped_completes_in_error", NO_PROCESS_VM),
    ("a_forked_child_opens_a_wired_device_afresh_and_the_parent_keeps_working", FORK_THREADS),
    ("link::vde::tests::three_ports_on_one_switch_exchange_rc_and_ud_in_any_order", NO_VDEPLUG),
    ("link::vde::tests::eight_ports_on_one_fabric_exchange_rc_and_ud_between_every_pair", NO_VDEPLUG),
    ("link::vde::tests::ipv4_gids_are_resolved_by_arp_over_the_fabric", NO_VDEPLUG),
    ("link::vde::tests::frames_that_are_not_ours_are_dropped_and_counted", NO_VDEPLUG),
    ("link::vde::tests::a_peer_that_goes_away_ends_in_a_retry_error", NO_VDEPLUG),
    ("link::vde::tests::a_switch_that_goes_away_takes_the_port_down", NO_VDEPLUG),
    ("link::vde::tests::rc_through_wirefilter_loss_duplicates_and_reordering_delivers_every_message_once", NO_VDEPLUG),
    (
        "link::vde::tests::reads_of_sixteen_packets_reordered_on_the_wire_complete_as_long_as_attempts_make_progress",
        NO_VDEPLUG,
    ),
    ("link::vde::tests::pcap_records_every_frame_the_port_sends_and_receives_on_the_fabric", NO_VDEPLUG),
    ("link::vde::tests::a_bad_url_is_a_clear_error", NO_VDEPLUG),
    ("link::vde::tests::ports_of_one_machine_go_past_the_switch_and_anything_else_through_it", NO_VDEPLUG),
    ("link::vde::tests::an_ib_port_that_leaves_and_comes_back_with_its_lid_is_its_holder_again", NO_VDEPLUG),
    ("link::vde::tests::ib_rc_through_wirefilter_loss_and_duplicates_delivers_every_message_once", NO_VDEPLUG),
    ("link::vde::tests::pcap_records_an_ib_ports_frames_on_the_fabric", NO_VDEPLUG),
    ("link::vde::tests::two_ib_ports_on_one_switch_exchange_rc_and_ud_by_lid", NO_VDEPLUG),
    ("link::vde::tests::ib_and_roce_ports_on_one_switch_do_not_take_each_others_frames", NO_VDEPLUG),
    ("link::vde::tests::malformed_ib_frames_are_dropped_and_counted_and_the_port_goes_on", NO_VDEPLUG),
    ("link::vde::tests::a_lid_already_on_the_fabric_is_refused_and_its_frames_from_another_port_dropped", NO_VDEPLUG),
    (
        "link::vde::tests::a_peer_that_does_not_read_costs_one_bounded_wait_then_frames_go_through_the_switch",
        NO_VDEPLUG,
    ),
    ("link::vde::tests::a_socket_left_behind_by_a_port_that_ended_is_swept", NO_VDEPLUG),
    ("link::vde::tests::ports_that_find_no_switch_at_once_start_one_and_all_plug_into_it", NO_VDEPLUG),
    ("switch::tests::a_hand_made_sm_sweeps_the_switch_and_two_hcas_and_they_talk_through_its_lft", NO_VDEPLUG),
    ("switch::tests::a_switch_without_cables_or_with_one_nobody_serves_is_a_clear_error", NO_VDEPLUG),
];

/// Tests that run their own binary again (`std::env::current_exe`): skipped only when no binfmt_misc handler
/// for aarch64 can be had.
pub(crate) const NEEDS_EXEC: &[&str] = &[
    "tests::a_comp_channel_at_the_descriptor_limit_is_null_with_emfile",
    "an_open_that_fails_says_why_on_stderr_without_mlx5_rs_log",
    "the_two_ends_of_a_wire_need_no_host_option",
    "a_close_with_objects_alive_releases_the_device_and_a_reopen_is_fresh",
    "a_wire_connect_end_closed_with_objects_alive_unplugs_and_connects_again_at_reopen",
    "device::wire_spec_tests::frames_queued_on_a_wire_at_exit_reach_the_far_end",
];

/// binfmt_misc's magic and mask for an aarch64 ELF executable (QEMU's `qemu-binfmt-conf.sh`).
const BINFMT_MAGIC: &str = r"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00";
const BINFMT_MASK: &str = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff";

/// How an aarch64 test binary that starts another aarch64 program gets it run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exec {
    /// The host's binfmt_misc has an aarch64 handler.
    Host,
    /// A binfmt_misc of the runner's own, in a user namespace.
    Private,
    /// Neither: [`NEEDS_EXEC`] are skipped.
    None,
}

/// The package that provides each tool, installed when the tool is missing.
const TOOLS: &[(&str, &str)] = &[
    (CC, "gcc-aarch64-linux-gnu"),
    ("/usr/aarch64-linux-gnu/lib/libc.so", "libc6-dev-arm64-cross"),
    (OBJDUMP, "binutils-aarch64-linux-gnu"),
];

fn ensure_tools() -> Result<PathBuf, String> {
    crate::ensure_target(TARGET)?;
    let mut need: Vec<&str> = TOOLS
        .iter()
        .filter(|(tool, _)| if tool.starts_with('/') { !Path::new(tool).exists() } else { !have(tool) })
        .map(|(_, pkg)| *pkg)
        .collect();
    if qemu().is_none() {
        need.push("qemu-user");
    }
    if !need.is_empty() {
        apt_install(&need)?;
    }
    qemu().ok_or_else(|| "qemu-aarch64 is missing after installing qemu-user".to_string())
}

/// QEMU's aarch64 user mode: Debian's `qemu-user` or `qemu-user-static`, by its absolute path (binfmt_misc needs
/// one).
fn qemu() -> Option<PathBuf> {
    ["qemu-aarch64", "qemu-aarch64-static"].iter().find_map(|q| {
        let out = Command::new("sh").arg("-c").arg(format!("command -v {q}")).output().ok()?;
        let path = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (out.status.success() && path.starts_with('/')).then(|| PathBuf::from(path))
    })
}

/// The shell script that registers `qemu` for aarch64 in the binfmt_misc mounted at `$B`.
fn register_script(qemu: &Path) -> String {
    // F: the interpreter is opened now, so it is found whatever the program's mount namespace.
    format!("printf '%s' ':qemu-aarch64:M::{BINFMT_MAGIC}:{BINFMT_MASK}:{}:F' > \"$B/register\"", qemu.display())
}

/// The runner script (run as `sh SCRIPT PROGRAM ARGS...`): each test binary in a new user and mount namespace
/// (root there, the caller's uid mapped to it) with a binfmt_misc of its own where qemu-aarch64 is registered,
/// then run by QEMU. The script runs itself again inside the namespaces.
fn private_runner(qemu: &Path) -> String {
    format!(
        "#!/bin/sh\n\
         # Written by cargo xtask aarch64 (xtask/src/aarch64.rs): the runner of the aarch64 tests.\n\
         set -e\n\
         if [ -z \"$MLX5_RS_AARCH64_NS\" ]; then\n\
         \x20   MLX5_RS_AARCH64_NS=1 exec unshare --user --map-root-user --mount sh \"$0\" \"$@\"\n\
         fi\n\
         unset MLX5_RS_AARCH64_NS\n\
         B=/proc/sys/fs/binfmt_misc\n\
         mount -t binfmt_misc mlx5-rs \"$B\"\n\
         {}\n\
         exec {} \"$@\"\n",
        register_script(qemu),
        qemu.display()
    )
}

/// Which [`Exec`] this machine allows.
fn exec_mode(qemu: &Path) -> Exec {
    let handler = Path::new("/proc/sys/fs/binfmt_misc/qemu-aarch64");
    if std::fs::read_to_string(handler).is_ok_and(|t| t.lines().next() == Some("enabled")) {
        return Exec::Host;
    }
    let probe = format!("B=/proc/sys/fs/binfmt_misc; mount -t binfmt_misc mlx5-rs \"$B\" && {}", register_script(qemu));
    let ok = Command::new("unshare")
        .args(["--user", "--map-root-user", "--mount", "sh", "-c", &probe])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        Exec::Private
    } else {
        Exec::None
    }
}

/// One test binary's line of the log: its name and, once read, its `test result:` counts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Binary {
    pub(crate) name: String,
    pub(crate) result: Option<Summary>,
}

/// The counts of a libtest `test result:` line.
fn result_line(line: &str) -> Option<Summary> {
    let rest = line.trim().strip_prefix("test result: ")?;
    let (_, counts) = rest.split_once(". ")?;
    let mut fields = counts.split("; ");
    let passed = fields.next()?.strip_suffix(" passed")?.parse().ok()?;
    let failed = fields.next()?.strip_suffix(" failed")?.parse().ok()?;
    Some(Summary { passed, failed })
}

/// The test binaries cargo ran (its `Running ...` lines) with their results, in order, from the log of a
/// `cargo test` whose output and its tests' share one file.
pub(crate) fn binaries(log: &str) -> Vec<Binary> {
    let mut out: Vec<Binary> = Vec::new();
    for line in log.lines() {
        let t = line.trim();
        if let Some(name) = t.strip_prefix("Running ").or_else(|| t.strip_prefix("Doc-tests ")) {
            out.push(Binary { name: name.to_string(), result: None });
        } else if let Some(r) = result_line(t) {
            match out.last_mut() {
                Some(b) if b.result.is_none() => b.result = Some(r),
                // A result line without a binary before it: counted under a name of its own.
                _ => out.push(Binary { name: "(unnamed)".into(), result: Some(r) }),
            }
        }
    }
    out
}

/// The sum over `bins`; a binary without a result line (it died: a signal, an abort) is one failure.
pub(crate) fn total(bins: &[Binary]) -> Summary {
    bins.iter().fold(Summary { passed: 0, failed: 0 }, |s, b| match b.result {
        Some(r) => Summary { passed: s.passed + r.passed, failed: s.failed + r.failed },
        None => Summary { passed: s.passed, failed: s.failed + 1 },
    })
}

/// `cargo xtask aarch64`.
pub(crate) fn run_aarch64(root: &Path) -> Result<(), String> {
    let start = Instant::now();
    let qemu = ensure_tools()?;
    let dir = root.join("target").join("aarch64");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let tests = run_tests(root, &dir, &qemu, PACKAGES);
    let tests_took = start.elapsed();
    // The programs run even when a test failed: both results are reported.
    let programs = dropin_and_programs(root, &dir, &qemu);
    tests?;
    programs?;
    println!(
        "aarch64: all passed (tools and tests {:.0} s, in all {:.0} s)",
        tests_took.as_secs_f64(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn run_tests(root: &Path, dir: &Path, qemu: &Path, packages: &[&str]) -> Result<(), String> {
    let mode = exec_mode(qemu);
    let runner = match mode {
        Exec::Private => {
            let script = dir.join("qemu-runner.sh");
            std::fs::write(&script, private_runner(qemu)).map_err(|e| format!("{}: {e}", script.display()))?;
            vec!["sh".to_string(), script.display().to_string()]
        }
        Exec::Host | Exec::None => vec![qemu.display().to_string()],
    };
    let mut skip: Vec<&str> = QEMU_LIMITS.iter().map(|(t, _)| *t).collect();
    match mode {
        Exec::Host => println!("aarch64: the host's binfmt_misc runs aarch64 programs a test starts"),
        Exec::Private => println!("aarch64: each test binary has a binfmt_misc of its own for the programs it starts"),
        Exec::None => {
            println!(
                "aarch64: no binfmt_misc for aarch64 (none on the host, no user namespace for one of our own): \
                 the tests that start their own binary again are skipped: {}",
                NEEDS_EXEC.join(", ")
            );
            skip.extend(NEEDS_EXEC);
        }
    }
    let mut cargo_args: Vec<String> = vec!["test".into(), "--target".into(), TARGET.into(), "--tests".into()];
    for p in packages {
        cargo_args.extend(["-p".to_string(), p.to_string()]);
    }
    cargo_args.extend([
        "--config".to_string(),
        format!("target.{TARGET}.linker={CC:?}"),
        "--config".to_string(),
        format!("target.{TARGET}.runner={runner:?}"),
    ]);
    let cargo = |extra: &[&str], log: Option<&Path>| -> Result<Command, String> {
        let mut c = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
        c.args(&cargo_args).args(extra).current_dir(root).env("CARGO_TARGET_DIR", dir).env("QEMU_LD_PREFIX", SYSROOT);
        if let Some(log) = log {
            let file = File::create(log).map_err(|e| format!("creating {}: {e}", log.display()))?;
            let err = file.try_clone().map_err(|e| e.to_string())?;
            c.stdout(file).stderr(err);
        }
        Ok(c)
    };
    let build_start = Instant::now();
    println!("$ CARGO_TARGET_DIR={} cargo {} --no-run", dir.display(), cargo_args.join(" "));
    let ok = cargo(&["--no-run"], None)?.status().map_err(|e| format!("failed to run cargo: {e}"))?;
    if !ok.success() {
        return Err(format!("building the tests for {TARGET} failed"));
    }
    println!("aarch64: tests built ({:.0} s)", build_start.elapsed().as_secs_f64());

    let log = dir.join("test.log");
    let mut libtest = vec!["--no-fail-fast", "--", "--exact"];
    for s in &skip {
        libtest.extend(["--skip", s]);
    }
    println!("$ cargo {} {} (output in {})", cargo_args.join(" "), libtest.join(" "), log.display());
    let run_start = Instant::now();
    // Its own process group, so a hung run is stopped with every QEMU under it.
    let mut child = {
        use std::os::unix::process::CommandExt;
        cargo(&libtest, Some(&log))?.process_group(0).spawn().map_err(|e| format!("failed to run cargo: {e}"))?
    };
    let status = wait_until(&mut child, Instant::now() + RUN_TIMEOUT, Duration::from_millis(200))?;
    if status.is_none() {
        let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).status();
        let _ = child.wait();
    }
    let text = std::fs::read_to_string(&log).map_err(|e| format!("reading {}: {e}", log.display()))?;
    let bins = binaries(&text);
    for b in &bins {
        match b.result {
            Some(r) => println!("  {}: {} passed, {} failed", b.name, r.passed, r.failed),
            None => println!("  {}: ended without a result (killed by a signal or aborted)", b.name),
        }
    }
    for (t, why) in QEMU_LIMITS {
        println!("  skipped {t}: {why}");
    }
    let sum = total(&bins);
    println!(
        "aarch64 tests under QEMU ({:.0} s):\n{} passed, {} failed",
        run_start.elapsed().as_secs_f64(),
        sum.passed,
        sum.failed
    );
    if status.is_none() {
        return Err(format!("the tests did not end within {} s (log: {})", RUN_TIMEOUT.as_secs(), log.display()));
    }
    let failed_lines: Vec<&str> = text
        .lines()
        .filter(|l| l.ends_with("... FAILED") || l.contains("panicked at") || l.starts_with("qemu:"))
        .collect();
    if sum.failed > 0 || bins.is_empty() || status.is_some_and(|s| !s.success()) {
        return Err(format!(
            "{} aarch64 test(s) failed under QEMU{}:\n{}\n(log: {})",
            sum.failed,
            if mode == Exec::None { " (with no binfmt_misc, a test that starts its own binary fails)" } else { "" },
            failed_lines.join("\n"),
            log.display()
        ));
    }
    Ok(())
}

/// The function `name` in `objdump -d -C` output: its instructions (mnemonic and operands, white space
/// collapsed), for each function of that name.
pub(crate) fn functions(disasm: &str, name: &str) -> Vec<Vec<String>> {
    let header = format!("<{name}>:");
    let mut out = Vec::new();
    let mut lines = disasm.lines();
    while let Some(l) = lines.next() {
        if !l.ends_with(&header) {
            continue;
        }
        // `  addr:\tmnemonic\toperands` lines, up to the blank line that ends the function.
        let body = lines
            .by_ref()
            .take_while(|l| !l.trim().is_empty())
            .filter_map(|l| l.split_once(":\t").map(|(_, i)| i.split_whitespace().collect::<Vec<_>>().join(" ")))
            .collect();
        out.push(body);
    }
    out
}

/// The doorbell functions (any one of the names) and the barrier instructions each must hold.
const DOORBELLS: &[(&[&str], &[&str])] = &[
    // The send doorbell: `ring_sq`, which the optimiser inlines into `post_send`.
    (&["mlx5_core::qp::ring::Qp::ring_sq", "mlx5_core::qp::ring::Qp::post_send"], &["dmb oshst", "dsb st"]),
    (&["mlx5_core::cq::ring::Cq::arm"], &["dsb st"]),
];

/// Each doorbell function of `lib` holds its barriers.
fn check_doorbells(lib: &Path) -> Result<(), String> {
    let disasm = run(Command::new(OBJDUMP).args(["-d", "-C", "--no-show-raw-insn"]).arg(lib))?;
    for (names, want) in DOORBELLS {
        let found: Vec<Vec<String>> = names.iter().flat_map(|n| functions(&disasm, n)).collect();
        if found.is_empty() {
            return Err(format!("{}: no function {} to disassemble", lib.display(), names.join(" or ")));
        }
        if !found.iter().any(|f| want.iter().all(|w| f.iter().any(|i| i == w))) {
            return Err(format!("{} in {} lacks {}", names.join(" / "), lib.display(), want.join(" and ")));
        }
        println!("aarch64: {} holds {}: ok", names[0], want.join(", "));
    }
    Ok(())
}

/// The aarch64 drop-in, its doorbells, then Debian's arm64 programs on it.
fn dropin_and_programs(root: &Path, dir: &Path, qemu: &Path) -> Result<(), String> {
    let cross = Cross { triple: TARGET, cc: CC, target_dir: dir.to_path_buf() };
    let lib = libibverbs::build_for(root, true, Some(&cross))?;
    check_doorbells(&lib.join("libibverbs.so.1"))?;
    let bin = arm64_programs(dir)?;
    let ld_path = lib.display().to_string();
    let prog = |name: &str, devices: &str| {
        let mut c = Command::new(qemu);
        c.arg("-L").arg(SYSROOT).arg(bin.join(name));
        libibverbs::on_dropin(&mut c, &ld_path, devices);
        c.stdout(Stdio::piped()).stderr(Stdio::piped());
        c
    };
    // The loader finds every library (the drop-in for libibverbs.so.1, the C library in the sysroot).
    for name in ["ibv_devinfo", "ibv_rc_pingpong"] {
        let mut c = Command::new(qemu);
        c.arg("-L").arg(SYSROOT).arg(Path::new(SYSROOT).join("lib/ld-linux-aarch64.so.1")).arg("--list");
        libibverbs::on_dropin(c.arg(bin.join(name)), &ld_path, "sim");
        let text = run(&mut c)?;
        if !text.lines().any(|l| l.contains("libibverbs.so.1 => ") && l.contains(&ld_path)) {
            return Err(format!("arm64 {name} does not load the aarch64 drop-in:\n{text}"));
        }
    }
    let out = prog("ibv_devinfo", "sim").output().map_err(|e| format!("qemu-aarch64 ibv_devinfo: {e}"))?;
    libibverbs::expect(
        &out,
        "arm64 ibv_devinfo (qemu-aarch64)",
        &["hca_id: mlx5_0", "vendor_part_id: 4119", "state: PORT_ACTIVE (4)"],
    )?;
    let start = Instant::now();
    let pingpong = |port: u16| -> Result<(), String> {
        let (port_s, wire) = (port.to_string(), port + 100);
        let args = ["-g", "0", "-n", "500", "-c", "-p", &port_s];
        let server = prog("ibv_rc_pingpong", &format!("sim:wire=listen:127.0.0.1:{wire}"))
            .args(args)
            .spawn()
            .map_err(|e| format!("qemu-aarch64 ibv_rc_pingpong: {e}"))?;
        // The client connects once: it starts when the server listens.
        libibverbs::wait_listening(port, Duration::from_secs(120));
        let client = prog("ibv_rc_pingpong", &format!("sim:host=1:wire=connect:127.0.0.1:{wire}"))
            .args(args)
            .arg("127.0.0.1")
            .spawn()
            .map_err(|e| format!("qemu-aarch64 ibv_rc_pingpong: {e}"))?;
        let what = "arm64 ibv_rc_pingpong -g 0 -n 500 -c (qemu-aarch64)";
        let c = libibverbs::wait(client, Duration::from_secs(300), &format!("{what}, client"));
        // A failed client leaves the server waiting for a peer.
        let limit = Duration::from_secs(if c.as_ref().is_ok_and(|o| o.status.success()) { 300 } else { 5 });
        let s = libibverbs::wait(server, limit, &format!("{what}, server"));
        libibverbs::expect(&c?, &format!("{what}, client"), &["bytes in", "iters in"])?;
        libibverbs::expect(&s?, &format!("{what}, server"), &["bytes in", "iters in"])
    };
    match pingpong(18700) {
        // rc_pingpong's ACK timeout (67 ms x 7 retries) runs on real time, and QEMU on a loaded host can starve a
        // peer past it: such a run is repeated once, and said so (as verbs-apps does).
        Err(e) if e.contains("retry counter exceeded") || e.contains("Failed status 12") => {
            println!("aarch64: ibv_rc_pingpong: RC retries exhausted (loaded host?); running it again once");
            pingpong(18710)
        }
        r => r,
    }?;
    println!("aarch64: ibv_rc_pingpong between two qemu-aarch64 processes ({:.1} s)", start.elapsed().as_secs_f64());
    Ok(())
}

/// Apt's options for arm64 packages with state of its own under `dir`: the host's sources and settings (a
/// proxy, say), but not its package lists, its architectures or its installed packages.
fn apt_options(dir: &Path) -> Vec<String> {
    let d = dir.display();
    [
        "APT::Architecture=arm64".to_string(),
        "APT::Architectures=arm64".to_string(),
        format!("Dir::State={d}/state"),
        format!("Dir::State::Lists={d}/lists"),
        "Dir::State::status=/dev/null".to_string(),
        format!("Dir::Cache={d}/cache"),
        // The downloads go to a directory of ours, which apt's sandbox user may not write.
        "APT::Sandbox::User=root".to_string(),
    ]
    .into_iter()
    .flat_map(|o| ["-o".to_string(), o])
    .collect()
}

/// Debian's arm64 `ibverbs-utils`, unpacked under `target/aarch64/debs/root`; returns its `usr/bin`.
fn arm64_programs(dir: &Path) -> Result<PathBuf, String> {
    let debs = dir.join("debs");
    let root = debs.join("root");
    let bin = root.join("usr/bin");
    if bin.join("ibv_rc_pingpong").exists() && bin.join("ibv_devinfo").exists() {
        return Ok(bin);
    }
    let apt = dir.join("apt");
    for d in ["state", "lists/partial", "cache/archives/partial"] {
        std::fs::create_dir_all(apt.join(d)).map_err(|e| e.to_string())?;
    }
    std::fs::create_dir_all(&debs).map_err(|e| e.to_string())?;
    let opts = apt_options(&apt);
    println!("$ apt-get update (arm64, its lists under {})", apt.display());
    run(Command::new("apt-get").args(&opts).args(["update", "-q"]))?;
    println!("$ apt-get download ibverbs-utils:arm64");
    run(Command::new("apt-get").args(&opts).args(["download", "-q", "ibverbs-utils"]).current_dir(&debs))?;
    for e in std::fs::read_dir(&debs).map_err(|e| e.to_string())? {
        let p = e.map_err(|e| e.to_string())?.path();
        if p.extension().is_some_and(|x| x == "deb") {
            run(Command::new("dpkg").arg("-x").arg(&p).arg(&root))?;
        }
    }
    Ok(bin)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_are_summed_per_binary_and_a_binary_that_died_is_a_failure() {
        let log = "   Compiling x\n     Running unittests src/lib.rs (target/a/mlx5_core-1)\n\nrunning 2 tests\n\
                   test a ... ok\ntest result: ok. 152 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; \
                   finished in 1.35s\n\n     Running unittests src/lib.rs (target/a/mlx5_sim-2)\n\nrunning 222 \
                   tests\nqemu: uncaught target signal 11 (Segmentation fault) - core dumped\nerror: test failed\n\
                        Running tests/fork.rs (target/a/fork-3)\ntest result: FAILED. 28 passed; 2 failed; 0 \
                   ignored; 0 measured; 3 filtered out; finished in 1.6s\n";
        let bins = binaries(log);
        assert_eq!(bins.len(), 3);
        assert_eq!(bins[0].result, Some(Summary { passed: 152, failed: 0 }));
        assert_eq!(bins[1].name, "unittests src/lib.rs (target/a/mlx5_sim-2)");
        assert_eq!(bins[1].result, None);
        assert_eq!(bins[2].result, Some(Summary { passed: 28, failed: 2 }));
        assert_eq!(total(&bins), Summary { passed: 180, failed: 3 });
        assert_eq!(result_line("test result: ok. x passed; 0 failed"), None);
        assert_eq!(result_line("2 passed, 1 failed"), None);
    }

    #[test]
    fn a_function_is_read_to_its_end_and_only_its_own_instructions() {
        let d = "00000000000ef238 <mlx5_core::cq::ring::Cq::arm>:\n   ef238:\tstp\tx29, x30, [sp, #-48]!\n   \
                 ef298:\tdsb\tst\n   ef2c0:\tb\t110254 <<mlx5_vfio::Bar as mlx5_core::hal::Mmio>::write64>\n\n\
                 00000000000ef300 <mlx5_core::cq::ring::Cq::poll>:\n   ef300:\tdmb\toshld\n\n";
        let f = functions(d, "mlx5_core::cq::ring::Cq::arm");
        assert_eq!(f.len(), 1);
        assert!(f[0].contains(&"dsb st".to_string()));
        assert!(!f[0].contains(&"dmb oshld".to_string()));
        assert!(functions(d, "mlx5_core::cq::ring::Cq").is_empty());
    }

    #[test]
    fn the_runner_script_registers_qemu_then_runs_the_program_under_it() {
        let s = private_runner(Path::new("/usr/bin/qemu-aarch64"));
        let lines: Vec<&str> = s.lines().collect();
        assert_eq!(lines[4], r#"    MLX5_RS_AARCH64_NS=1 exec unshare --user --map-root-user --mount sh "$0" "$@""#);
        let reg =
            r#"printf '%s' ':qemu-aarch64:M::\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:"#;
        assert_eq!(
            lines
                .iter()
                .filter(|l| l.starts_with(reg) && l.ends_with(r#":/usr/bin/qemu-aarch64:F' > "$B/register""#))
                .count(),
            1,
            "{s}"
        );
        assert_eq!(lines.last(), Some(&r#"exec /usr/bin/qemu-aarch64 "$@""#));
        // Skipped tests are named exactly, each once; every test of the VDE link is among them.
        let vde = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../sim/src/link/vde.rs")).unwrap();
        let mut after_test = false;
        for line in vde.lines().map(str::trim) {
            if let Some(name) = line.strip_prefix("fn ").filter(|_| after_test) {
                let name = name.split('(').next().unwrap_or(name);
                let full = format!("link::vde::tests::{name}");
                assert!(QEMU_LIMITS.iter().any(|(t, _)| *t == full), "{full} is not skipped under QEMU");
            }
            after_test = line == "#[test]" || (after_test && line.starts_with("#["));
        }
        let mut all: Vec<&str> = QEMU_LIMITS.iter().map(|(t, _)| *t).chain(NEEDS_EXEC.iter().copied()).collect();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), QEMU_LIMITS.len() + NEEDS_EXEC.len());
    }
}
