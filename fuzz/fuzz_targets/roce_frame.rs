//! RoCEv2 frames as a port receives them: `roce::frame::parse` on arbitrary bytes (a bare Ethernet frame), and
//! the first 40 bytes as the GRH room of a UD receive (`init_ah_from_wc`).
//!
//! Asserted: no panic; a frame that fails is named by one drop reason and counted once; a RoCE frame that parses
//! re-emits (into a buffer of exactly `frame_len` bytes, no longer than the input) to a frame that parses to the
//! same values with the same Ethernet header, and an ARP frame re-emits byte for byte.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx5_core::ah::{init_ah_from_wc, GRH_BYTES};
use mlx5_core::cq::{WcFlags, WorkCompletion};
use mlx5_sim::roce::frame::{emit_arp, parse, parse_counted, DropCounters, Parsed};

fuzz_target!(|data: &[u8]| {
    // The 40 bytes of GRH room a UD receive gets from its peer: `init_ah_from_wc` answers or refuses, never panics,
    // and an answer always routes by GID.
    if let Some(grh) = data.get(..GRH_BYTES).and_then(|g| <&[u8; GRH_BYTES]>::try_from(g).ok()) {
        let wc = WorkCompletion { wc_flags: WcFlags::GRH, ..WorkCompletion::default() };
        if let Ok(ah) = init_ah_from_wc(&wc, Some(grh), 1, |gid, _| Some(gid[15])) {
            assert!(ah.grh.is_some());
        }
    }
    let mut counters = DropCounters::default();
    let first = parse_counted(data, &mut counters);
    assert_eq!(counters.total(), u64::from(first.is_none()));
    match parse(data) {
        Err(r) => assert_eq!(counters.get(r), 1),
        Ok(Parsed::Arp(eth, arp)) => {
            let mut buf = [0u8; 42];
            assert_eq!(emit_arp(&eth, &arp, &mut buf), Ok(42));
            assert_eq!(buf[..], data[..42]);
        }
        Ok(Parsed::Roce(r)) => {
            let mut buf = vec![0u8; r.frame_len()];
            let n = r.emit(&mut buf).expect("a parsed frame re-emits");
            assert_eq!(n, buf.len());
            match parse(&buf) {
                Ok(Parsed::Roce(again)) => {
                    assert_eq!(again.payload, r.payload);
                    assert_eq!(
                        (again.bth, again.ext, again.udp, again.ip, again.eth),
                        (r.bth, r.ext, r.udp, r.ip, r.eth)
                    );
                }
                other => panic!("re-emitted frame does not parse: {other:?}"),
            }
            // Ethernet header, addresses and the payload are the input's bytes.
            assert_eq!(buf[..14], data[..14]);
            assert!(n <= data.len());
        }
    }
});
