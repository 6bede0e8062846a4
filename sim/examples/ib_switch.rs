//! A simulated InfiniBand switch (`mlx5_sim::IbSwitch`) on VDE cables, one external port per URL, for
//! `--seconds`: it prints its LID, its ports' states and how many LIDs its forwarding table routes each time a
//! subnet manager changes them, and its counters when they change (at most every 200 ms).
//!
//! `cargo run -p mlx5-sim --example ib_switch -- [--node-guid HEX] [--seconds N] vde:///cable1 vde:///cable2 ...`
//!
//! Each URL names a `vde_switch` that is a cable to one HCA port (`mlx5-uml-bridge --wire-vde`, or
//! `sim:link=ib:sm=wait:wire=vde:URL` of the verbs stack). `cargo xtask linux-drives-sim --opensm` runs it.

use std::process::ExitCode;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: ib_switch [--node-guid HEX] [--seconds N] URL [URL...] (1 to 15 cables)";

fn main() -> ExitCode {
    let mut guid = 0xb8ce_f603_00ff_0001u64;
    let mut seconds = 60u64;
    let mut cables = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = match a.as_str() {
            "--node-guid" | "--seconds" => args.next(),
            "-h" | "--help" => {
                println!("{USAGE}");
                return ExitCode::SUCCESS;
            }
            _ => {
                cables.push(a);
                continue;
            }
        };
        let ok = match (a.as_str(), v) {
            ("--node-guid", Some(v)) => u64::from_str_radix(v.trim_start_matches("0x"), 16).map(|g| guid = g).is_ok(),
            ("--seconds", Some(v)) => v.parse().map(|s| seconds = s).is_ok(),
            _ => false,
        };
        if !ok {
            eprintln!("ib_switch: {a} needs a value\n{USAGE}");
            return ExitCode::from(2);
        }
    }
    let urls: Vec<&str> = cables.iter().map(String::as_str).collect();
    let sw = match mlx5_sim::IbSwitch::start(guid, "mlx5-sim switch", &urls) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("ib_switch: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!("switch: node_guid={guid:016x} {} ports", urls.len());
    let end = Instant::now() + Duration::from_secs(seconds);
    let (mut last_state, mut last_counters) = (None, None);
    let mut last_statuses = Vec::new();
    while Instant::now() < end {
        let s = sw.state();
        let ports: Vec<u8> = s.ports.iter().map(|p| p.state).collect();
        let now = (s.lid, s.sm_lid, ports.clone(), s.lft_entries);
        if last_state.as_ref() != Some(&now) {
            println!(
                "switch: lid={:#x} sm_lid={:#x} port states={ports:?} lft_entries={}",
                s.lid, s.sm_lid, s.lft_entries
            );
            last_state = Some(now);
        }
        // Each kind once, when first seen.
        for &(method, attr, status, _) in s.statuses.iter().skip(last_statuses.len()) {
            println!("switch: SMP answered with MAD status {status:#06x}: method {method:#04x} attribute {attr:#06x}");
        }
        last_statuses.clone_from(&s.statuses);
        if last_counters != Some(s.counters) {
            println!("switch: counters {:?}", s.counters);
            last_counters = Some(s.counters);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    ExitCode::SUCCESS
}
