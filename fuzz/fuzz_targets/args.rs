//! The command line of the `mlx5` tool: arbitrary arguments (the input split at NUL bytes, any bytes, so not
//! always UTF-8) through `mlx5_tool::cli::parse`, then `bench`'s options through perftest's parser; and the
//! argument layer's number and seconds parsers on arbitrary text.
//!
//! Asserted: no panic; an accepted command line names a known command and every number is in its documented
//! range (size, iterations, port, timeout); a refusal is one line; an argument that is not UTF-8 is named by
//! its position; a number or a duration accepted is within the range asked and was written in plain digits.
#![no_main]

use std::ffi::OsString;
use std::os::unix::ffi::OsStringExt;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use mlx5_args::{ArgError, Argv};
use mlx5_tool::cli::{parse, MAX_MESSAGE, MAX_TIMEOUT_S};

fuzz_target!(|data: &[u8]| {
    let items: Vec<OsString> = data.split(|&b| b == 0).map(|a| OsString::from_vec(a.to_vec())).collect();
    match parse(Argv::new(items.clone())) {
        Ok(a) => {
            assert!(
                ["devices", "devinfo", "fw-tour", "pingpong", "bench", "bind", "unbind", "trace"]
                    .contains(&a.command.as_str()),
                "unknown command {:?} accepted",
                a.command
            );
            assert!(a.size.is_none_or(|s| (1..=MAX_MESSAGE).contains(&s)));
            assert!(a.iters.is_none_or(|n| n >= 1));
            assert!(a.port.is_none_or(|p| (1..u16::MAX).contains(&p)));
            assert!(a.timeout.is_none_or(|t| t >= Duration::from_secs(1) && t.as_secs() <= MAX_TIMEOUT_S));
            if a.command == "bench" {
                if let Err(e) = mlx5_tool::perftest::Options::parse(&a.operands) {
                    assert!(!e.to_string().contains('\n'), "a bench refusal on more than one line: {e}");
                }
            }
        }
        Err(ArgError::NotUtf8 { index, .. }) => {
            assert!(index >= 1 && index <= items.len());
            assert!(items[index - 1].to_str().is_none(), "argument {index} is UTF-8");
        }
        Err(e) => assert!(!e.to_string().contains('\n'), "a refusal on more than one line: {e}"),
    }
    let text = String::from_utf8_lossy(data);
    if let Ok(v) = mlx5_args::number("--n", &text, 3u64, 1_000_000) {
        assert!((3..=1_000_000).contains(&v));
        assert!(text.bytes().all(|b| b.is_ascii_digit()));
    }
    if let Ok(d) = mlx5_args::seconds("--s", &text, 0.001, 86_400.0) {
        assert!(d >= Duration::from_micros(999) && d <= Duration::from_secs(86_400));
    }
});
