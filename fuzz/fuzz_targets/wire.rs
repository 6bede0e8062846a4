//! What a peer process can feed the simulated wire over a stream link (TCP, a QEMU guest's socket): a byte stream
//! cut into length-prefixed Ethernet frames, each taken as a hello (what each end of a TCP stream sends first) or
//! an InfiniBand port's frame holding a packet, by the parsers the link itself uses
//! (`mlx5_sim::testkit::wire_stream`).
//!
//! Asserted (inside `wire_stream`): no panic; no frame above `MAX_STREAM_FRAME` is accepted; a hello or packet that
//! parses is emitted again and parses back to the same value and bytes. Here too: the counts are consistent.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx5_sim::testkit::wire_stream;

fuzz_target!(|data: &[u8]| {
    let s = wire_stream(data);
    assert!(s.hellos + s.packets <= s.frames);
    // Every frame costs its 4-byte length prefix.
    assert!(s.frames * 4 <= data.len());
});
