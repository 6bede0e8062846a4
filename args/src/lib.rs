//! The argument layer every binary of the workspace shares (the `mlx5` tool, `cargo xtask`, the verbs examples).
//!
//! It reads the command line as OS strings, so an argument that is not UTF-8 is an error and not a panic; it
//! parses numbers strictly (digits only, no sign, no blanks) and checks their range; it names an option that
//! does not apply to the command; and every usage error ends the same way: the error line, then the usage, on
//! standard error, with exit code [`USAGE_EXIT`]. `-h` / `--help` prints the usage on standard output and exits 0.

use std::ffi::OsString;
use std::fmt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// The exit code of every usage error (as `sysexits.h`'s `EX_USAGE` is for many tools, 2 for getopt programs).
pub const USAGE_EXIT: u8 = 2;

/// What is wrong with a command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgError {
    /// `-h` / `--help` was given: not an error, the usage goes to standard output.
    Help,
    /// Argument `index` (1-based, after the program name) is not UTF-8 text.
    NotUtf8 { index: usize, lossy: String },
    /// An option nobody takes.
    Unknown(String),
    /// An option the command does not take.
    NotApplicable { option: String, command: String },
    /// An option given without its value.
    Missing { option: String, what: String },
    /// A value that does not parse or is out of range.
    Invalid { option: String, why: String },
    /// Anything else, already worded.
    Other(String),
}

impl fmt::Display for ArgError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Arguments are echoed with their control characters escaped, so every error is one line whatever was typed.
        let l = one_line;
        match self {
            ArgError::Help => write!(f, "help requested"),
            ArgError::NotUtf8 { index, lossy } => write!(f, "argument {index} ({lossy:?}) is not UTF-8 text"),
            ArgError::Unknown(o) => write!(f, "unknown option {}", l(o)),
            ArgError::NotApplicable { option, command } => write!(f, "{} does not apply to {}", l(option), l(command)),
            ArgError::Missing { option, what } => write!(f, "{} needs {}", l(option), l(what)),
            ArgError::Invalid { option, why } => write!(f, "{}: {}", l(option), l(why)),
            ArgError::Other(s) => f.write_str(&l(s)),
        }
    }
}

/// `s` with its control characters (newlines, escapes, ...) written as Rust escapes, so it prints on one line.
pub fn one_line(s: &str) -> std::borrow::Cow<'_, str> {
    if !s.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

impl std::error::Error for ArgError {}

impl From<String> for ArgError {
    fn from(s: String) -> Self {
        ArgError::Other(s)
    }
}

impl From<&str> for ArgError {
    fn from(s: &str) -> Self {
        ArgError::Other(s.to_string())
    }
}

/// The command line as a cursor over OS strings.
#[derive(Debug, Clone, Default)]
pub struct Argv {
    items: Vec<OsString>,
    next: usize,
}

impl Argv {
    /// The process's arguments after the program name.
    pub fn from_env() -> Self {
        Self::new(std::env::args_os().skip(1))
    }

    /// Arguments given by the caller (no program name).
    pub fn new<I: IntoIterator<Item = S>, S: Into<OsString>>(items: I) -> Self {
        Argv { items: items.into_iter().map(Into::into).collect(), next: 0 }
    }

    /// The next argument as text; `None` at the end.
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> Option<Result<String, ArgError>> {
        let index = self.next + 1;
        let a = self.items.get(self.next)?;
        self.next += 1;
        Some(
            a.to_str()
                .map(str::to_string)
                .ok_or_else(|| ArgError::NotUtf8 { index, lossy: a.to_string_lossy().into_owned() }),
        )
    }

    /// The next argument as text, before taking it.
    pub fn peek(&self) -> Option<&str> {
        self.items.get(self.next).and_then(|a| a.to_str())
    }

    /// The next argument as it is, before taking it.
    pub fn peek_os(&self) -> Option<&std::ffi::OsStr> {
        self.items.get(self.next).map(OsString::as_os_str)
    }

    /// The value of `option` as text.
    pub fn value(&mut self, option: &str, what: &str) -> Result<String, ArgError> {
        match self.next() {
            Some(v) => v,
            None => Err(ArgError::Missing { option: option.into(), what: what.into() }),
        }
    }

    /// The value of `option` as a path, which need not be UTF-8.
    pub fn path(&mut self, option: &str) -> Result<PathBuf, ArgError> {
        let v = self.items.get(self.next).cloned();
        self.next += usize::from(v.is_some());
        v.map(PathBuf::from).ok_or_else(|| ArgError::Missing { option: option.into(), what: "a file name".into() })
    }

    /// The value of `option` as a number in `lo..=hi`.
    pub fn number<T: Number>(&mut self, option: &str, lo: T, hi: T) -> Result<T, ArgError> {
        let v = self.value(option, "a number")?;
        number(option, &v, lo, hi)
    }

    /// The value of `option` as seconds in `lo..=hi` (a decimal fraction is allowed).
    pub fn seconds(&mut self, option: &str, lo: f64, hi: f64) -> Result<Duration, ArgError> {
        let v = self.value(option, "a number of seconds")?;
        seconds(option, &v, lo, hi)
    }
}

/// The unsigned integer types [`number`] parses.
pub trait Number: Copy + PartialOrd + fmt::Display + std::str::FromStr {}
impl Number for u8 {}
impl Number for u16 {}
impl Number for u32 {}
impl Number for u64 {}
impl Number for usize {}

/// `text` as a decimal number in `lo..=hi`: digits only (no sign, blank or prefix), and a value past the type's
/// range is "out of range", not "not a number".
pub fn number<T: Number>(option: &str, text: &str, lo: T, hi: T) -> Result<T, ArgError> {
    let range = || ArgError::Invalid { option: option.into(), why: format!("{text:?} is not between {lo} and {hi}") };
    if text.is_empty() || !text.bytes().all(|b| b.is_ascii_digit()) {
        return Err(ArgError::Invalid { option: option.into(), why: format!("{text:?} is not a number") });
    }
    let v: T = text.parse().map_err(|_| range())?;
    if v < lo || v > hi {
        return Err(range());
    }
    Ok(v)
}

/// `text` as seconds in `lo..=hi` (`lo` above zero): a plain decimal (`2`, `0.5`), not `inf`, `nan` or an
/// exponent, so a value too small to time anything is refused by its range rather than rounded to nothing.
pub fn seconds(option: &str, text: &str, lo: f64, hi: f64) -> Result<Duration, ArgError> {
    let plain = !text.is_empty()
        && text.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && text.bytes().filter(|&b| b == b'.').count() <= 1
        && text.bytes().any(|b| b.is_ascii_digit());
    let secs: f64 = if plain { text.parse().unwrap_or(f64::NAN) } else { f64::NAN };
    if secs.is_nan() {
        return Err(ArgError::Invalid { option: option.into(), why: format!("{text:?} is not a number of seconds") });
    }
    if !(lo..=hi).contains(&secs) {
        return Err(ArgError::Invalid {
            option: option.into(),
            why: format!("{text:?} is not between {lo} and {hi} seconds"),
        });
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Whether `arg` asks for help.
pub fn is_help(arg: &str) -> bool {
    arg == "-h" || arg == "--help"
}

/// Refuses `option` unless `command` takes it (`allowed`).
pub fn applies(option: &str, command: &str, allowed: &[&str]) -> Result<(), ArgError> {
    if allowed.contains(&option) {
        Ok(())
    } else {
        Err(ArgError::NotApplicable { option: option.into(), command: command.into() })
    }
}

/// Ends a program on a usage error: `--help` prints `usage` on standard output and exits 0; anything else
/// prints `program: error` and the usage on standard error and exits [`USAGE_EXIT`].
pub fn usage_exit(program: &str, err: &ArgError, usage: &str) -> ExitCode {
    use std::io::Write;
    if *err == ArgError::Help {
        // A closed standard output (`--help | head`) has nowhere to go; help was still given.
        let _ = writeln!(std::io::stdout().lock(), "{usage}");
        return ExitCode::SUCCESS;
    }
    let _ = writeln!(std::io::stderr().lock(), "{program}: {err}\n{usage}");
    ExitCode::from(USAGE_EXIT)
}

/// What an option of a small program ([`Opts`]) takes.
#[derive(Debug, Clone, Copy)]
pub enum Takes {
    /// Text, described for the error when it is missing (e.g. "a PCI address").
    Text(&'static str),
    /// A number in `lo..=hi`.
    Number(u64, u64),
}

/// The options of a small program (the verbs examples): `--NAME VALUE` pairs it declares, each at most once,
/// numbers checked against their range, and `-h` / `--help`; anything else is refused.
#[derive(Debug, Clone, Default)]
pub struct Opts {
    given: Vec<(String, String)>,
}

impl Opts {
    /// Reads `argv` against `spec` (each option and what it takes).
    pub fn parse(mut argv: Argv, spec: &[(&str, Takes)]) -> Result<Self, ArgError> {
        let mut given: Vec<(String, String)> = Vec::new();
        while let Some(a) = argv.next() {
            let a = a?;
            if is_help(&a) {
                return Err(ArgError::Help);
            }
            let Some(&(name, takes)) = spec.iter().find(|(n, _)| *n == a) else {
                return Err(if a.starts_with('-') {
                    ArgError::Unknown(a)
                } else {
                    ArgError::Other(format!("unexpected argument {a:?}"))
                });
            };
            if given.iter().any(|(n, _)| n == name) {
                return Err(ArgError::Other(format!("{name} given twice")));
            }
            let v = match takes {
                Takes::Text(what) => argv.value(name, what)?,
                Takes::Number(lo, hi) => argv.number(name, lo, hi)?.to_string(),
            };
            given.push((name.to_string(), v));
        }
        Ok(Opts { given })
    }

    /// The process's options, or the end of the process on a usage error ([`usage_exit`]'s output and code).
    pub fn from_env_or_exit(program: &str, usage: &str, spec: &[(&str, Takes)]) -> Self {
        match Self::parse(Argv::from_env(), spec) {
            Ok(o) => o,
            Err(e) => {
                let code = if e == ArgError::Help { 0 } else { i32::from(USAGE_EXIT) };
                let _ = usage_exit(program, &e, usage);
                std::process::exit(code)
            }
        }
    }

    /// The text given for `option`.
    pub fn text(&self, option: &str) -> Option<&str> {
        self.given.iter().find(|(n, _)| n == option).map(|(_, v)| v.as_str())
    }

    /// The number given for `option` (already checked against its range), or `default`.
    pub fn number(&self, option: &str, default: u64) -> u64 {
        self.text(option).and_then(|v| v.parse().ok()).unwrap_or(default)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_error_is_one_line_whatever_was_typed() {
        // Found by the `args` fuzz target: an option with a newline in it printed a two-line error.
        let e = ArgError::Unknown("--lin\nib".into()).to_string();
        assert_eq!(e, "unknown option --lin\\nib");
        let e = ArgError::NotApplicable { option: "--x\r\x1b[2J".into(), command: "c\n".into() }.to_string();
        assert!(!e.contains(['\n', '\r', '\x1b']), "{e}");
        assert_eq!(one_line("plain \"text\""), "plain \"text\"");
    }

    #[test]
    fn small_programs_take_only_what_they_declare() {
        let spec = [("--size", Takes::Number(1, 100)), ("--device", Takes::Text("a PCI address"))];
        let p = |a: &[&str]| Opts::parse(Argv::new(a.iter().copied()), &spec);
        let o = p(&["--size", "7", "--device", "sim"]).unwrap();
        assert_eq!((o.number("--size", 1), o.text("--device"), o.number("--iters", 9)), (7, Some("sim"), 9));
        assert!(matches!(p(&["--size", "0"]), Err(ArgError::Invalid { .. })));
        assert!(matches!(p(&["--size"]), Err(ArgError::Missing { .. })));
        assert!(matches!(p(&["--frob"]), Err(ArgError::Unknown(_))));
        assert!(matches!(p(&["frob"]), Err(ArgError::Other(_))));
        assert!(matches!(p(&["--size", "1", "--size", "2"]), Err(ArgError::Other(_))));
        assert_eq!(p(&["--help"]).unwrap_err(), ArgError::Help);
    }

    #[test]
    fn numbers_are_digits_in_range() {
        assert_eq!(number("--n", "42", 1u32, 100), Ok(42));
        for bad in ["", "+1", "-1", " 1", "1 ", "0x10", "1e3", "١"] {
            assert!(matches!(number("--n", bad, 0u32, 100), Err(ArgError::Invalid { .. })), "{bad:?}");
        }
        let e = number("--t", "18446744073709551616", 1u64, 86400).unwrap_err().to_string();
        assert!(e.contains("between 1 and 86400"), "{e}");
        assert!(number("--t", "0", 1u64, 10).is_err());
    }

    #[test]
    fn seconds_refuse_exponents_infinities_and_values_out_of_range() {
        assert_eq!(seconds("--d", "0.5", 0.01, 10.0), Ok(Duration::from_millis(500)));
        for bad in ["1e-300", "inf", "nan", "-1", "", ".", "1..2", "0", "11"] {
            assert!(seconds("--d", bad, 0.01, 10.0).is_err(), "{bad:?}");
        }
    }

    #[cfg(unix)]
    #[test]
    fn an_argument_that_is_not_utf8_is_an_error() {
        use std::os::unix::ffi::OsStringExt;
        let mut a = Argv::new([OsString::from("ok"), OsString::from_vec(vec![0xff, b'x'])]);
        assert_eq!(a.next(), Some(Ok("ok".to_string())));
        assert!(matches!(a.next(), Some(Err(ArgError::NotUtf8 { index: 2, .. }))));
        assert_eq!(a.next(), None);
        let mut p = Argv::new([OsString::from_vec(vec![0xff])]);
        assert_eq!(p.path("--trace").unwrap().as_os_str().len(), 1);
        assert!(matches!(p.path("--trace"), Err(ArgError::Missing { .. })));
    }

    #[test]
    fn options_that_do_not_apply_are_named() {
        assert!(applies("--json", "devinfo", &["--json"]).is_ok());
        let e = applies("--json", "fw-tour", &[]).unwrap_err().to_string();
        assert_eq!(e, "--json does not apply to fw-tour");
    }
}
