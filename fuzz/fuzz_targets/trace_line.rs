//! A `--trace` file as `mlx5 trace decode` reads it: `decode::decode_stream` over arbitrary bytes (the first
//! byte picks `--all` and `--hexdump`), and `Entry::parse` with both renderings on every line that is text.
//!
//! Asserted: no panic; a decoded trace has at least one command and output; an error is one line naming the
//! file, and a line error names a line that exists; a parsed entry renders (fields and hexdump) without panic,
//! and its header names the entry's index.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx5_tool::decode::{decode_stream, DecodeError, Entry, Options};

fuzz_target!(|data: &[u8]| {
    let Some((&mode, body)) = data.split_first() else { return };
    let opts = Options { all: mode & 1 != 0, hexdump: mode & 2 != 0 };
    let mut out = Vec::new();
    let lines = body.split(|&b| b == b'\n').count();
    match decode_stream(body, "fuzz.jsonl", opts, &mut out) {
        Ok(n) => {
            assert!(n >= 1, "a trace without commands was accepted");
            assert!(!out.is_empty());
        }
        Err(e) => {
            let s = e.to_string();
            assert!(!s.contains('\n'), "an error on more than one line: {s}");
            assert!(s.starts_with("fuzz.jsonl"), "an error that does not name the file: {s}");
            if let DecodeError::Line { line, .. } = e {
                assert!((1..=lines).contains(&line), "line {line} of {lines}");
            }
        }
    }
    for line in body.split(|&b| b == b'\n') {
        if let Ok(text) = std::str::from_utf8(line) {
            if let Ok(e) = Entry::parse(text) {
                assert!(e.render(7, opts.all).starts_with("#7 "));
                let _ = e.hexdump();
            }
        }
    }
});
