//! The rc_pingpong exchange message a peer sends over TCP (`LLLL:QQQQQQ:PPPPPP:GID`, NUL-padded to 52 bytes):
//! `exchange::decode_dest` on arbitrary bytes, and on the input padded with NULs to the message's length
//! (so the fuzzer explores the text rather than the length check).
//!
//! Asserted: no panic (the original crash was a string slice inside a multi-byte character); only a message of
//! exactly `MSG_LEN` bytes is accepted, and a refused length names the length received; an accepted message
//! re-encodes to the same text (hex case aside) and decodes back to the same peer; a refusal is one line.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx5_tool::exchange::{decode_dest, encode_dest, DestError, MSG_LEN};

fn check(msg: &[u8]) {
    match decode_dest(msg) {
        Ok(d) => {
            assert_eq!(msg.len(), MSG_LEN, "a message of the wrong length was accepted");
            let again = encode_dest(&d);
            assert_eq!(decode_dest(&again), Ok(d), "an encoded message does not decode to its peer");
            let text = msg.split(|&b| b == 0).next().unwrap_or_default();
            assert_eq!(text.len(), 4 + 1 + 6 + 1 + 6 + 1 + 32, "accepted text of the wrong shape");
            assert!(again[..text.len()].eq_ignore_ascii_case(text), "the peer decoded is not the text sent");
            assert_eq!(d.qpn >> 24, 0, "a QPN wider than 24 bits");
            assert_eq!(d.psn >> 24, 0, "a PSN wider than 24 bits");
        }
        Err(DestError::Length(n)) => assert!(n == msg.len() && n != MSG_LEN),
        Err(e @ DestError::Malformed(_)) => {
            assert_eq!(msg.len(), MSG_LEN);
            assert!(!e.to_string().contains('\n'), "a refusal printed on more than one line: {e}");
        }
    }
}

fuzz_target!(|data: &[u8]| {
    check(data);
    if data.len() < MSG_LEN {
        let mut padded = [0u8; MSG_LEN];
        padded[..data.len()].copy_from_slice(data);
        check(&padded);
    }
});
