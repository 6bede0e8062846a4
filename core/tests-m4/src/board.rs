//! Board tests: the firmware example's command-only run (`run_with(.., Options { traffic: false, .. })`) against
//! an expectation mock of its recorded bring-up, on the M4 and on the host alike.
//!
//! The script is `data/firmware-run.bin`: every command that run sent to the simulated ConnectX, with the
//! simulator's answers, written by `examples/firmware/tests/recording.rs` (which also fails when the file is not
//! current) and compiled into the image. It is read here without a heap, straight from the image's bytes:
//!
//! ```text
//! header  "MLX5MOCK", version u16 (1), commands u16
//! command opcode u16, op_mod u16, flags u8 (1 give back pages, 2 page request, 4 masked input, 8 the input's
//!         start only)
//!         [flags & 2: function_id u16, num_pages i32]
//!         input length u16, input bytes, [flags & 4: as many mask bytes]
//!         output length u16, output bytes (trailing zeros left out)
//! ```
//!
//! Numbers are little-endian; the messages themselves are as on the wire. A mask clears the bits of the driver's
//! bus and CPU addresses, which differ between the simulator and the mock.

use mlx5_core::hal::DelayNs;
use mlx5_core::mock::{Expect, MockConfig, MockDevice, Reply};
use mlx5_core::prm::Opcode;
use mlx5_core::qp::QpState;
use mlx5_core::testlist::{self, Test};
use mlx5_firmware_example::{run_with, Options};

/// The recording, in the image.
pub static RECORDING: &[u8] = include_bytes!("../data/firmware-run.bin");

mod format;
use format::{GIVE_BACK, KNOWN_FLAGS, MAGIC, MASKED, PAGE_REQUEST, PREFIX, VERSION};

/// Why a recording cannot be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScriptError {
    /// It does not start with `MLX5MOCK`.
    NotARecording,
    /// A version this reader does not know.
    Version(u16),
    /// It ends inside command `command` (counting from 0).
    Truncated { command: u16 },
    /// Command `command` has flags this reader does not know.
    Flags { command: u16, flags: u8 },
    /// Bytes follow the last command.
    Trailing { at: usize },
}

/// The recording's commands as expectations, borrowing its bytes.
#[derive(Debug, Clone)]
pub struct Script {
    bytes: &'static [u8],
    at: usize,
    next: u16,
    count: u16,
}

impl Script {
    /// Checks the header; the commands are read one by one by iterating.
    pub fn new(bytes: &'static [u8]) -> Result<Self, ScriptError> {
        if bytes.get(..MAGIC.len()) != Some(&MAGIC[..]) {
            return Err(ScriptError::NotARecording);
        }
        let mut s = Self { bytes, at: MAGIC.len(), next: 0, count: 0 };
        let version = s.u16().ok_or(ScriptError::Truncated { command: 0 })?;
        if version != VERSION {
            return Err(ScriptError::Version(version));
        }
        s.count = s.u16().ok_or(ScriptError::Truncated { command: 0 })?;
        Ok(s)
    }

    /// Commands the recording holds.
    pub fn len(&self) -> usize {
        self.count.into()
    }

    fn take(&mut self, n: usize) -> Option<&'static [u8]> {
        let end = self.at.checked_add(n)?;
        let b = self.bytes.get(self.at..end)?;
        self.at = end;
        Some(b)
    }

    fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| u16::from_le_bytes([b[0], b[1]]))
    }

    fn command(&mut self) -> Result<Expect<'static>, ScriptError> {
        let command = self.next;
        let short = ScriptError::Truncated { command };
        let opcode = Opcode::from_raw(self.u16().ok_or(short)?);
        let op_mod = self.u16().ok_or(short)?;
        let flags = self.take(1).ok_or(short)?[0];
        if flags & !KNOWN_FLAGS != 0 {
            return Err(ScriptError::Flags { command, flags });
        }
        let mut reply = Reply::ok();
        if flags & PAGE_REQUEST != 0 {
            let function_id = self.u16().ok_or(short)?;
            let n = self.take(4).ok_or(short)?;
            reply = reply.page_request(function_id, i32::from_le_bytes([n[0], n[1], n[2], n[3]]));
        }
        let inlen = self.u16().ok_or(short)?.into();
        let input = self.take(inlen).ok_or(short)?;
        let e = Expect::cmd(opcode).op_mod(op_mod);
        let mut e = if flags & PREFIX != 0 { e.input_prefix(input) } else { e.input(input) };
        if flags & MASKED != 0 {
            e = e.input_mask(self.take(inlen).ok_or(short)?);
        }
        let outlen = self.u16().ok_or(short)?.into();
        reply = reply.output(self.take(outlen).ok_or(short)?);
        if flags & GIVE_BACK != 0 {
            reply = reply.give_back_pages();
        }
        Ok(e.reply(reply))
    }
}

impl Iterator for Script {
    type Item = Result<Expect<'static>, ScriptError>;

    /// The next command; after an error, nothing more.
    fn next(&mut self) -> Option<Self::Item> {
        if self.next == self.count {
            let trailing = self.at < self.bytes.len();
            let at = self.at;
            // Reported once.
            self.at = self.bytes.len();
            return trailing.then_some(Err(ScriptError::Trailing { at }));
        }
        let r = self.command();
        self.next = if r.is_ok() { self.next + 1 } else { self.count };
        if r.is_err() {
            self.at = self.bytes.len();
        }
        Some(r)
    }
}

/// A `DelayNs` that only counts: the mock answers each command as its doorbell is rung, so nothing real is
/// waited for, and the board's clock does not matter.
#[derive(Debug, Default)]
pub struct Clock {
    /// Nanoseconds asked for so far.
    pub ns: u64,
}

impl DelayNs for Clock {
    fn delay_ns(&mut self, ns: u32) {
        self.ns += u64::from(ns);
    }
}

/// Expectations the mock can hold: the recording's commands, with room to spare.
const SCRIPT_MAX: usize = 96;
/// Device memory the mock hands out: the firmware's own arena size (examples/firmware/src/main.rs).
const MOCK_ARENA: usize = 2 << 20;

/// The firmware's command-only run against its recorded bring-up: every command sent in the recorded order with
/// the recorded input (addresses aside), every expectation met (`done()`), nothing left allocated.
fn the_firmware_run_replays_against_its_recorded_bring_up() {
    let script = Script::new(RECORDING).expect("the recording's header");
    assert!(script.len() <= SCRIPT_MAX, "{} commands recorded", script.len());
    // SAFETY: the slice is used only by this test's mock, dropped before the test returns.
    let arena = unsafe { testlist::take_arena(MOCK_ARENA, 4096) }.expect("the harness's arena holds the mock's");
    let cfg = MockConfig { fw_rev: (16, 35, 2000), ..MockConfig::default() };
    let dev: MockDevice<'static, SCRIPT_MAX, 128> = MockDevice::with_config(cfg, arena);
    let mut count = 0;
    for e in script {
        dev.expect(e.expect("a well-formed recording"));
        count += 1;
    }
    let mut clock = Clock::default();
    let opts = Options { traffic: false, ..Options::default() };
    let run = run_with(&dev, &dev, (), &mut clock, opts);
    if let Err(e) = dev.done() {
        panic!("{e} (after {} of {count} commands; the run returned {run:?})", dev.matched());
    }
    let report = run.expect("the command-only run");
    assert_eq!(dev.matched(), count);
    assert_eq!((report.fw_rev, report.qp_state), ((16, 35, 2000), QpState::Rts));
    let [qa, qb] = report.qpns;
    assert!(qa != 0 && qb != 0 && qa != qb, "{:?}", report.qpns);
    assert!(report.pages_reclaimed > 0, "{report:?}");
    assert_eq!((dev.live_regions(), dev.pages_held()), (0, 0), "every region and firmware page back");
}

/// The reader never panics on a damaged recording: every cut of it and a foreign header are errors.
fn a_damaged_recording_is_an_error_not_a_panic() {
    assert_eq!(Script::new(b"MLX5MOCX").unwrap_err(), ScriptError::NotARecording);
    assert_eq!(Script::new(b"MLX5MOCK\x02\x00\x00\x00").unwrap_err(), ScriptError::Version(2));
    assert_eq!(Script::new(b"MLX5MOCK\x01").unwrap_err(), ScriptError::Truncated { command: 0 });
    let whole = Script::new(RECORDING).expect("the recording's header");
    assert!(whole.clone().all(|e| e.is_ok()), "the whole recording reads");
    // Cuts at a stride (and just before the end): each ends in one error after the commands before it.
    for cut in (12..RECORDING.len()).step_by(97).chain([RECORDING.len() - 1]) {
        let s = Script::new(&RECORDING[..cut]).expect("the header survives the cut");
        let mut errors = 0;
        let mut read = 0;
        for e in s {
            match e {
                Ok(_) => read += 1,
                Err(ScriptError::Truncated { command }) => {
                    assert_eq!(usize::from(command), read, "cut at {cut}");
                    errors += 1;
                }
                Err(other) => panic!("cut at {cut}: {other:?}"),
            }
        }
        assert_eq!(errors, 1, "cut at {cut}");
        assert!(read < whole.len());
    }
    // An unknown flag and bytes after the end are named.
    static FLAGGED: [u8; 17] = *b"MLX5MOCK\x01\x00\x01\x00\x04\x01\x00\x00\x80";
    let first = Script::new(&FLAGGED).unwrap().next().map(|r| r.err());
    assert_eq!(first, Some(Some(ScriptError::Flags { command: 0, flags: 0x80 })));
    static TRAILING: [u8; 13] = *b"MLX5MOCK\x01\x00\x00\x00\xff";
    let mut t = Script::new(&TRAILING).unwrap();
    assert_eq!(t.next().map(|r| r.err()), Some(Some(ScriptError::Trailing { at: 12 })));
    assert!(t.next().is_none());
}

/// Tests of this board beyond the core's unit tests, run after them.
pub const TESTS: &[Test] = &[
    Test {
        name: "board::the_firmware_run_replays_against_its_recorded_bring_up",
        run: the_firmware_run_replays_against_its_recorded_bring_up,
        should_panic: None,
    },
    Test {
        name: "board::a_damaged_recording_is_an_error_not_a_panic",
        run: a_damaged_recording_is_an_error_not_a_panic,
        should_panic: None,
    },
];
