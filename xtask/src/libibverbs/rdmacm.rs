//! `cargo xtask librdmacm`: links `mlx5-rdmacm-sys` into `target/librdmacm/librdmacm.so.1` against the drop-in
//! libibverbs with rdma-core 44's version nodes and checks its exports. `verbs-apps --only rdmacm`: Debian's
//! unmodified rdmacm-utils (`rping`, `ucmatose`, `udaddy`, `rdma_server`/`rdma_client`) and perftest's `-R` runs
//! between two processes on it.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use super::{apt_download, exports, on_dropin, run, wait, wait_listening, Apps};

/// Every default-version export of Debian bookworm's librdmacm (`name VERSION` a line).
const SYMBOLS: &str = include_str!("../../../host-linux/rdmacm-sys/symbols.txt");

/// The version nodes in order, each inheriting from the one before (rdma-core's `librdmacm.map`).
const VERSIONS: &[&str] = &["RDMACM_1.0", "RDMACM_1.1", "RDMACM_1.2", "RDMACM_1.3"];

fn symbols() -> BTreeSet<(String, String)> {
    SYMBOLS.lines().filter_map(|l| l.split_once(' ')).map(|(n, v)| (n.to_string(), v.to_string())).collect()
}

fn version_script() -> String {
    let syms = symbols();
    let mut out = String::new();
    for (i, v) in VERSIONS.iter().enumerate() {
        out.push_str(&format!("{v} {{\n  global:\n"));
        for (n, _) in syms.iter().filter(|(_, sv)| sv == v) {
            out.push_str(&format!("    {n};\n"));
        }
        if i == 0 {
            out.push_str("  local: *;\n};\n");
        } else {
            out.push_str(&format!("}} {};\n", VERSIONS[i - 1]));
        }
    }
    out
}

/// Builds the static library and links `librdmacm.so.1` against the drop-in libibverbs in `ibverbs`; returns
/// its directory.
pub fn build(root: &Path, release: bool, ibverbs: &Path) -> Result<PathBuf, String> {
    let mut args = vec!["build", "-p", "mlx5-rdmacm-sys", "--lib"];
    if release {
        args.push("--release");
    }
    println!("$ cargo {}", args.join(" "));
    let status = Command::new("cargo").args(&args).current_dir(root).status().map_err(|e| e.to_string())?;
    if !status.success() {
        return Err("building mlx5-rdmacm-sys failed".into());
    }
    let target = std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| root.join("target"), PathBuf::from);
    let archive = target.join(if release { "release" } else { "debug" }).join("libmlx5_rdmacm_sys.a");
    let dir = target.join("librdmacm");
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let map = dir.join("librdmacm.map");
    std::fs::write(&map, version_script()).map_err(|e| e.to_string())?;
    let lib = dir.join("librdmacm.so.1");
    let mut cc = Command::new("cc");
    cc.arg("-shared")
        .arg("-o")
        .arg(&lib)
        .arg("-Wl,--whole-archive")
        .arg(&archive)
        .arg("-Wl,--no-whole-archive")
        .arg(format!("-Wl,--version-script={}", map.display()))
        .arg(format!("-L{}", ibverbs.display()))
        .args(["-Wl,-soname,librdmacm.so.1", "-Wl,-z,now", "-libverbs", "-lgcc_s", "-lpthread", "-ldl", "-lm", "-lc"]);
    println!("$ {cc:?}");
    run(&mut cc)?;
    let link = dir.join("librdmacm.so");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink("librdmacm.so.1", &link).map_err(|e| e.to_string())?;
    let ours = exports(&lib)?;
    let want = symbols();
    if ours != want {
        return Err(format!(
            "librdmacm exports differ from rdma-core 44's: extra {:?}, missing {:?}",
            ours.difference(&want).collect::<Vec<_>>(),
            want.difference(&ours).collect::<Vec<_>>()
        ));
    }
    println!("librdmacm exports: {} names, each at rdma-core 44's version node", ours.len());
    Ok(dir)
}

/// `cargo xtask librdmacm [--debug]`.
pub fn run_librdmacm(root: &Path, args: &[String]) -> Result<(), String> {
    let release = !args.iter().any(|a| a == "--debug");
    let ibverbs = super::build(root, release)?;
    let dir = build(root, release, &ibverbs)?;
    println!(
        "built {}/librdmacm.so.1\n\nrping between two processes on the simulated wire:\n  \
         MLX5_RS_DEVICES=sim:wire=listen:127.0.0.1:18700 LD_LIBRARY_PATH={0}:{1} rping -s -a 192.168.1.10 -v -C 10\n  \
         MLX5_RS_DEVICES=sim:host=1:wire=connect:127.0.0.1:18700 LD_LIBRARY_PATH={0}:{1} rping -c -a 192.168.1.10 -v -C 10",
        dir.display(),
        ibverbs.display()
    );
    Ok(())
}

/// Debian's rdmacm-utils, unpacked under `target/libibverbs/rdmacm` (never installed).
pub(crate) fn rdmacm_utils(lib: &Path) -> Result<PathBuf, String> {
    let dir = lib.join("rdmacm");
    let bin = dir.join("root/usr/bin");
    if !bin.join("rping").exists() {
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        apt_download(&["rdmacm-utils"], &dir)?;
        for e in std::fs::read_dir(&dir).map_err(|e| e.to_string())? {
            let p = e.map_err(|e| e.to_string())?.path();
            if p.extension().is_some_and(|x| x == "deb") {
                run(Command::new("dpkg").arg("-x").arg(&p).arg(dir.join("root")))?;
            }
        }
    }
    Ok(bin)
}

/// The simulated host 0's address: the server's port (`sim`, host 0) has it, the client is host 1.
const SERVER_IP: &str = "192.168.1.10";

/// A server and a client on the drop-in libraries, each with its own simulated device joined by the wire;
/// returns both outputs' stdout once both succeeded.
fn pair(
    link: &str,
    ld_path: &str,
    server: (&Path, &[&str]),
    client: (&Path, &[&str]),
    wire: u16,
    what: &str,
) -> Result<(String, String), String> {
    // Output goes to files, not pipes: nobody reads a pipe until the program exits, and rping -v's 1,000 lines
    // fill one (64 KiB) and block it.
    let dir = std::env::temp_dir().join(format!("mlx5-rdmacm-{}-{wire}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let file = |name: &str| std::fs::File::create(dir.join(name)).map_err(|e| e.to_string());
    let spawn = |prog: &Path, args: &[&str], devices: &str, side: &str| -> Result<std::process::Child, String> {
        let mut c = Command::new(prog);
        on_dropin(&mut c, ld_path, devices)
            .args(args)
            .stdout(Stdio::from(file(&format!("{side}.out"))?))
            .stderr(Stdio::from(file(&format!("{side}.err"))?));
        c.spawn().map_err(|e| format!("{}: {e}", prog.display()))
    };
    let read = |side: &str| {
        let r = |ext: &str| std::fs::read_to_string(dir.join(format!("{side}.{ext}"))).unwrap_or_default();
        (r("out"), r("err"))
    };
    let s = spawn(server.0, server.1, &format!("sim{link}:wire=listen:127.0.0.1:{wire}"), "server")?;
    // The server's device listens on the wire once opened; its rdma_listen follows at once.
    wait_listening(wire, Duration::from_secs(60));
    std::thread::sleep(Duration::from_millis(500));
    let c = spawn(client.0, client.1, &format!("sim{link}:host=1:wire=connect:127.0.0.1:{wire}"), "client")?;
    let limit = Duration::from_secs(120);
    let c = wait(c, limit, &format!("{what} (client)"));
    let s = match &c {
        Ok(out) if out.status.success() => wait(s, limit, &format!("{what} (server)")),
        _ => wait(s, Duration::from_secs(5), &format!("{what} (server)")),
    };
    let ((so, se), (co, ce)) = (read("server"), read("client"));
    let _ = std::fs::remove_dir_all(&dir);
    let both = format!("client stdout:\n{co}\nclient stderr:\n{ce}\nserver stdout:\n{so}\nserver stderr:\n{se}");
    match (c, s) {
        (Ok(c), Ok(s)) if c.status.success() && s.status.success() => Ok((so, co)),
        (Ok(c), Ok(s)) => Err(format!("{what}: client {}, server {}\n{both}", c.status, s.status)),
        (Err(e), _) | (_, Err(e)) => Err(format!("{e}\n{both}")),
    }
}

/// Whether rping -v's line for iteration `i` shows the buffer rping wrote: `rdma-ping-i: ` then letters from
/// 'A' + i mod 58, each the next of 'A'..='z' (wrapping), as rping's client fills it.
pub(crate) fn rping_line_ok(line: &str, i: usize) -> bool {
    let prefix = format!("ping data: rdma-ping-{i}: ");
    let Some(rest) = line.strip_prefix(&prefix) else { return false };
    let b = rest.as_bytes();
    let next = |c: u8| if c >= b'z' { b'A' } else { c + 1 };
    b.first() == Some(&(b'A' + (i % 58) as u8))
        && b.iter().all(|c| (b'A'..=b'z').contains(c))
        && b.windows(2).all(|w| w[1] == next(w[0]))
}

/// The rdmacm part: rping (1,000 iterations, each buffer checked), ucmatose, udaddy, ib_send_bw -R and
/// ib_write_bw -R, each between two processes on the drop-in libraries.
pub fn rdmacm_part(a: &Apps<'_>) -> Result<(), String> {
    let cm = build(a.root, a.release, &a.lib)?;
    let bin = rdmacm_utils(&a.lib)?;
    let ld = format!("{}:{}", cm.display(), a.p.path);
    let port = "18751";
    // RoCE with 1,000 pings, InfiniBand (LID-addressed) with 100, then RoCE with -q: each side creates its own
    // QP and moves it with rdma_init_qp_attr's attributes (RST→INIT→INIT→RTR→RTS).
    for (link, count, wire, own_qp) in
        [("", 1000usize, 18851u16, false), (":link=ib", 100, 18859, false), ("", 100, 18858, true)]
    {
        let n = count.to_string();
        let q: &[&str] = if own_qp { &["-q"] } else { &[] };
        let server: Vec<&str> = [&["-s", "-a", SERVER_IP, "-p", port, "-C", &n, "-V"], q].concat();
        let client: Vec<&str> = [&["-c", "-a", SERVER_IP, "-p", port, "-C", &n, "-v", "-V"], q].concat();
        let (s, c) = pair(link, &ld, (&bin.join("rping"), &server), (&bin.join("rping"), &client), wire, "rping")?;
        let lines: Vec<&str> = c.lines().filter(|l| l.starts_with("ping data:")).collect();
        let bad = lines.iter().enumerate().find(|(i, l)| !rping_line_ok(l, *i));
        if lines.len() != count || bad.is_some() {
            return Err(format!("rping: {} ping lines, first bad {bad:?}\n{c}\nserver:\n{s}", lines.len()));
        }
        let q = if own_qp { " -q" } else { "" };
        println!("rping -c -v -V -C {count}{q} (sim{link}): {count} pings, each buffer as rping wrote it: ok");
    }
    let (_, c) = pair(
        "",
        &ld,
        (&bin.join("ucmatose"), &["-p", "18752"]),
        (&bin.join("ucmatose"), &["-s", SERVER_IP, "-p", "18752"]),
        18852,
        "ucmatose",
    )?;
    if !c.contains("test complete") {
        return Err(format!("ucmatose: no \"test complete\":\n{c}"));
    }
    println!("ucmatose (sim): ok");
    let (_, c) = pair(
        "",
        &ld,
        // udaddy has no port option (its -p is the port space): it serves port 7174.
        (&bin.join("udaddy"), &[]),
        (&bin.join("udaddy"), &["-s", SERVER_IP]),
        18853,
        "udaddy",
    )?;
    if !c.contains("test complete") {
        return Err(format!("udaddy: no \"test complete\":\n{c}"));
    }
    println!("udaddy (sim): ok");
    // Synchronous IDs (no channel): rdma_create_ep, rdma_get_request and rdma_verbs.h's post and completion helpers.
    let (s, c) = pair(
        "",
        &ld,
        (&bin.join("rdma_server"), &["-p", "18757"]),
        (&bin.join("rdma_client"), &["-s", SERVER_IP, "-p", "18757"]),
        18857,
        "rdma_server/rdma_client",
    )?;
    if !s.contains("rdma_server: end 0") || !c.contains("rdma_client: end 0") {
        return Err(format!("rdma_server/rdma_client: not both ended with 0:\n{s}\n{c}"));
    }
    println!("rdma_server / rdma_client (sim): ok");
    for (i, prog) in ["ib_send_bw", "ib_write_bw"].iter().enumerate() {
        let p = (18754 + i as u16).to_string();
        let args = ["-R", "-u", "20", "-n", "200", "-p", &p];
        let mut client: Vec<&str> = args.to_vec();
        client.push(SERVER_IP);
        let (_, c) =
            pair("", &ld, (&a.p.bin.join(prog), &args), (&a.p.bin.join(prog), &client), 18854 + i as u16, prog)?;
        // The result row, compared with runs of white space collapsed (`#bytes #iterations ...`).
        if !c.split_whitespace().collect::<Vec<_>>().join(" ").contains("65536 200") {
            return Err(format!("{prog} -R: no result row:\n{c}"));
        }
        println!("{prog} -R (sim): ok");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn rping_lines_are_checked_letter_by_letter() {
        assert!(super::rping_line_ok("ping data: rdma-ping-0: ABCDEFG", 0));
        assert!(super::rping_line_ok("ping data: rdma-ping-59: BCD", 59));
        assert!(super::rping_line_ok("ping data: rdma-ping-57: zABC", 57));
        assert!(!super::rping_line_ok("ping data: rdma-ping-1: ABCD", 1), "starts one further each ping");
        assert!(!super::rping_line_ok("ping data: rdma-ping-0: ABDE", 0), "a letter skipped");
        assert!(!super::rping_line_ok("ping data: rdma-ping-0: ", 0));
    }
}
