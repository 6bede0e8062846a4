//! `cargo xtask vfio-test`: the host crate's VFIO layer against the real Linux VFIO stack, in a QEMU guest.
//!
//! No NIC is needed: the guest gets an emulated Intel IOMMU (with interrupt remapping, which type1 requires) and
//! QEMU's `edu` PCI device, which has a DMA engine and MSI. The xtask
//! 1. installs what it needs from Debian (qemu-system-x86, busybox-static) and fetches a Debian kernel package;
//! 2. builds `vfio-edu-test` (host-linux/vfio/src/bin) as a static binary;
//! 3. packs a busybox initramfs whose `/init` loads the VFIO modules, reserves hugepages and runs the test;
//! 4. boots the guest under TCG and reads the verdict from QEMU's exit code (`isa-debug-exit`: the guest writes 1
//!    for pass, 2 for fail; QEMU exits with `(v << 1) | 1`).
//!
//! The recipe and its gotchas: ../shared/notes/vfio-in-qemu.md.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// VFIO modules in load order (6.1 has vfio_virqfd separate; later kernels fold it into vfio).
const MODULES: &[&str] = &["irqbypass", "vfio", "vfio_virqfd", "vfio_iommu_type1", "vfio-pci-core", "vfio-pci"];
const GUEST_TARGET: &str = "x86_64-unknown-linux-gnu";
const BOOT_TIMEOUT: Duration = Duration::from_secs(420);

pub(crate) fn run(cmd: &mut Command) -> Result<String, String> {
    let out = cmd.output().map_err(|e| format!("failed to run {cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim()));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Waits for `child` to exit, looking every `every` until `deadline`; `None` once the deadline passed, the child
/// left running (what a timeout means is the caller's).
pub(crate) fn wait_until(child: &mut Child, deadline: Instant, every: Duration) -> Result<Option<ExitStatus>, String> {
    loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            return Ok(Some(s));
        }
        if Instant::now() > deadline {
            return Ok(None);
        }
        std::thread::sleep(every);
    }
}

pub(crate) fn have(program: &str) -> bool {
    Command::new("sh")
        .arg("-c")
        .arg(format!("command -v {program}"))
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// apt-get install, running `apt-get update` once if the first attempt cannot find the packages.
pub(crate) fn apt_install(pkgs: &[&str]) -> Result<(), String> {
    println!("xtask: installing {}", pkgs.join(" "));
    let install = || {
        Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(pkgs)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .map_err(|e| format!("failed to run apt-get: {e}"))
    };
    if install()?.success() {
        return Ok(());
    }
    run(Command::new("apt-get").args(["update", "-q"]))?;
    if install()?.success() {
        Ok(())
    } else {
        Err(format!("apt-get could not install {}", pkgs.join(" ")))
    }
}

fn ensure_packages() -> Result<(), String> {
    let mut need = Vec::new();
    if !have("qemu-system-x86_64") {
        need.push("qemu-system-x86");
    }
    if !Path::new("/bin/busybox").exists() {
        need.push("busybox-static");
    }
    if !need.is_empty() {
        apt_install(&need)?;
    }
    let devices = run(Command::new("qemu-system-x86_64").args(["-device", "help"]))?;
    if !devices.contains("\"edu\"") {
        return Err("this qemu-system-x86_64 has no edu device".into());
    }
    Ok(())
}

/// Downloads and unpacks the kernel package `linux-image-amd64` depends on; returns (vmlinuz, modules dir).
pub(crate) fn ensure_kernel(work: &Path) -> Result<(PathBuf, PathBuf), String> {
    let root = work.join("kernel");
    if !root.join("boot").exists() {
        let deps = run(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))?;
        let pkg = deps
            .lines()
            .filter_map(|l| l.trim().strip_prefix("Depends: "))
            .find(|p| p.starts_with("linux-image-") && !p.contains("unsigned"))
            .map(str::to_string);
        let pkg = match pkg {
            Some(p) => p,
            None => {
                run(Command::new("apt-get").args(["update", "-q"]))?;
                let deps = run(Command::new("apt-cache").args(["depends", "linux-image-amd64"]))?;
                deps.lines()
                    .filter_map(|l| l.trim().strip_prefix("Depends: "))
                    .find(|p| p.starts_with("linux-image-"))
                    .ok_or("apt-cache names no kernel package for linux-image-amd64")?
                    .to_string()
            }
        };
        let dl = work.join("deb");
        std::fs::create_dir_all(&dl).map_err(|e| e.to_string())?;
        println!("vfio-test: downloading {pkg}");
        let get = |dir: &Path| Command::new("apt-get").args(["download", "-q", &pkg]).current_dir(dir).status();
        if !get(&dl).map_err(|e| e.to_string())?.success() {
            run(Command::new("apt-get").args(["update", "-q"]))?;
            if !get(&dl).map_err(|e| e.to_string())?.success() {
                return Err(format!("apt-get download {pkg} failed"));
            }
        }
        let deb = std::fs::read_dir(&dl)
            .map_err(|e| e.to_string())?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "deb"))
            .ok_or("no .deb downloaded")?;
        let tmp = work.join("kernel.tmp");
        let _ = std::fs::remove_dir_all(&tmp);
        run(Command::new("dpkg").arg("-x").arg(&deb).arg(&tmp))?;
        std::fs::rename(&tmp, &root).map_err(|e| e.to_string())?;
        let _ = std::fs::remove_dir_all(&dl);
    }
    let boot = root.join("boot");
    let vmlinuz = std::fs::read_dir(&boot)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("vmlinuz-")))
        .ok_or("no vmlinuz in the kernel package")?;
    let modules = root.join("lib/modules");
    let ver = std::fs::read_dir(&modules)
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .next()
        .ok_or("no modules in the kernel package")?;
    Ok((vmlinuz, ver))
}

pub(crate) fn find_module(dir: &Path, name: &str) -> Option<PathBuf> {
    for e in std::fs::read_dir(dir).ok()?.flatten() {
        let p = e.path();
        if p.is_dir() {
            if let Some(f) = find_module(&p, name) {
                return Some(f);
            }
        } else {
            let f = p.file_name()?.to_string_lossy().into_owned();
            if f == format!("{name}.ko") || f == format!("{name}.ko.xz") || f == format!("{name}.ko.zst") {
                return Some(p);
            }
        }
    }
    None
}

/// A module's bytes, decompressed when the package ships it compressed (busybox insmod wants plain ELF).
pub(crate) fn module_bytes(p: &Path) -> Result<Vec<u8>, String> {
    let name = p.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        Some("xz")
    } else if name.ends_with(".zst") {
        Some("zstd")
    } else {
        None
    };
    match tool {
        None => std::fs::read(p).map_err(|e| e.to_string()),
        Some(t) => {
            let out = Command::new(t).arg("-dc").arg(p).output().map_err(|e| format!("{t}: {e}"))?;
            if !out.status.success() {
                return Err(format!("{t} -dc {} failed", p.display()));
            }
            Ok(out.stdout)
        }
    }
}

/// A `newc` cpio archive, the format the kernel unpacks as its initramfs.
#[derive(Default)]
pub(crate) struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    pub(crate) fn entry(&mut self, name: &str, mode: u32, data: &[u8]) {
        self.ino += 1;
        let fields = [self.ino, mode, 0, 0, 1, 0, data.len() as u32, 0, 0, 0, 0, name.len() as u32 + 1, 0];
        self.buf.extend_from_slice(b"070701");
        for f in fields {
            self.buf.extend_from_slice(format!("{f:08x}").as_bytes());
        }
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }
    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }
    pub(crate) fn dir(&mut self, name: &str) {
        self.entry(name, 0o040755, &[]);
    }
    pub(crate) fn file(&mut self, name: &str, exec: bool, data: &[u8]) {
        self.entry(name, if exec { 0o100755 } else { 0o100644 }, data);
    }
    pub(crate) fn symlink(&mut self, name: &str, target: &str) {
        self.entry(name, 0o120777, target.as_bytes());
    }
    pub(crate) fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, &[]);
        self.buf
    }
}

/// The guest's `/init`: mount, load VFIO, reserve hugepages, run the test, report through isa-debug-exit.
fn init_script(modules: &[String]) -> String {
    let mut s = String::from(
        "#!/bin/sh\n\
         mount -t proc proc /proc\n\
         mount -t sysfs sys /sys\n\
         mount -t devtmpfs dev /dev\n",
    );
    for m in modules {
        s.push_str(&format!("insmod /modules/{m}.ko || echo \"init: insmod {m} failed\"\n"));
    }
    s.push_str(
        "echo 16 > /proc/sys/vm/nr_hugepages\n\
         echo \"init: kernel $(uname -r), hugepages $(cat /proc/sys/vm/nr_hugepages)\"\n\
         /vfio-edu-test\n\
         rc=$?\n\
         if [ $rc -eq 0 ]; then v='\\001'; else v='\\002'; fi\n\
         printf \"$v\" | dd of=/dev/port bs=1 seek=244 count=1 2>/dev/null\n\
         poweroff -f\n",
    );
    s
}

fn build_guest_binary(root: &Path, work: &Path) -> Result<PathBuf, String> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let target_dir = work.join("target");
    println!("vfio-test: building vfio-edu-test (static)");
    let status = Command::new(cargo)
        .args(["build", "--release", "-p", "mlx5-vfio", "--bin", "vfio-edu-test", "--target", GUEST_TARGET])
        .env("RUSTFLAGS", "-C target-feature=+crt-static")
        .env("CARGO_TARGET_DIR", &target_dir)
        .current_dir(root)
        .status()
        .map_err(|e| format!("failed to run cargo: {e}"))?;
    if !status.success() {
        return Err("building vfio-edu-test failed".into());
    }
    Ok(target_dir.join(GUEST_TARGET).join("release/vfio-edu-test"))
}

fn build_initramfs(work: &Path, modules_dir: &Path, test_bin: &Path) -> Result<PathBuf, String> {
    let mut c = Cpio::default();
    for d in ["bin", "sbin", "dev", "proc", "sys", "modules", "tmp"] {
        c.dir(d);
    }
    let busybox = std::fs::read("/bin/busybox").map_err(|e| format!("/bin/busybox: {e}"))?;
    c.file("bin/busybox", true, &busybox);
    for applet in ["sh", "mount", "insmod", "echo", "cat", "dd", "printf", "poweroff", "uname", "dmesg"] {
        c.symlink(&format!("bin/{applet}"), "busybox");
    }
    let mut loaded = Vec::new();
    for m in MODULES {
        match find_module(modules_dir, m) {
            Some(p) => {
                c.file(&format!("modules/{m}.ko"), false, &module_bytes(&p)?);
                loaded.push(m.to_string());
            }
            // vfio_virqfd exists only up to 6.1; every other module is required.
            None if *m == "vfio_virqfd" => {}
            None => return Err(format!("module {m} not found under {}", modules_dir.display())),
        }
    }
    c.file("init", true, init_script(&loaded).as_bytes());
    c.file("vfio-edu-test", true, &std::fs::read(test_bin).map_err(|e| e.to_string())?);
    let out = work.join("initramfs.cpio");
    std::fs::write(&out, c.finish()).map_err(|e| e.to_string())?;
    Ok(out)
}

/// Boots the guest and returns whether the test passed, echoing the guest console.
fn boot(kernel: &Path, initrd: &Path) -> Result<bool, String> {
    let mut cmd = Command::new("qemu-system-x86_64");
    cmd.args(["-accel", "tcg", "-machine", "q35,kernel-irqchip=split"])
        .args(["-device", "intel-iommu,intremap=on,caching-mode=on"])
        .args(["-m", "1G", "-smp", "2", "-nographic", "-no-reboot", "-nodefaults", "-serial", "stdio"])
        .args(["-device", "isa-debug-exit,iobase=0xf4,iosize=0x04"])
        .arg("-kernel")
        .arg(kernel)
        .arg("-initrd")
        .arg(initrd)
        .args(["-append", "console=ttyS0 panic=-1 quiet intel_iommu=on"])
        .args(["-device", "edu"])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    println!("vfio-test: booting the guest ({cmd:?})");
    let start = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("failed to start qemu: {e}"))?;
    let stdout = child.stdout.take().ok_or("no qemu stdout")?;
    let reader = std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in BufReader::new(stdout).split(b'\n').map_while(Result::ok) {
            let l = String::from_utf8_lossy(&line).trim_end_matches('\r').to_string();
            println!("guest| {l}");
            let _ = std::io::stdout().flush();
            lines.push(l);
        }
        lines
    });
    let status = loop {
        if let Some(s) = child.try_wait().map_err(|e| e.to_string())? {
            break s;
        }
        if start.elapsed() > BOOT_TIMEOUT {
            let _ = child.kill();
            let _ = child.wait();
            return Err(format!("the guest did not finish within {} s", BOOT_TIMEOUT.as_secs()));
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let lines = reader.join().map_err(|_| "console reader panicked")?;
    let summary = lines.iter().rev().find(|l| l.starts_with("vfio-edu-test:")).cloned();
    println!(
        "vfio-test: guest finished in {:.1} s, qemu {status}; {}",
        start.elapsed().as_secs_f64(),
        summary.as_deref().unwrap_or("no summary from the test")
    );
    // isa-debug-exit: the guest wrote 1 (pass) → 3; 2 (fail) → 5; a guest that just powered off → 0.
    Ok(status.code() == Some(3) && summary.is_some_and(|s| s.ends_with(" 0 failed")))
}

pub fn run_vfio_test(root: &Path) -> Result<(), String> {
    let work = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join("target"))
        .join("vfio-test");
    std::fs::create_dir_all(&work).map_err(|e| e.to_string())?;
    let work = work.canonicalize().map_err(|e| e.to_string())?;
    ensure_packages()?;
    let (vmlinuz, modules) = ensure_kernel(&work)?;
    let bin = build_guest_binary(root, &work)?;
    let initrd = build_initramfs(&work, &modules, &bin)?;
    if boot(&vmlinuz, &initrd)? {
        println!("vfio-test: passed");
        Ok(())
    } else {
        Err("vfio-test failed (see the guest's `not ok` lines above)".into())
    }
}
