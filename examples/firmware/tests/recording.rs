//! The recording the Cortex-M4 board test replays (`core/tests-m4/data/firmware-run.bin`): every command
//! `run_with(.., Options { traffic: false, .. })` sends to the simulated ConnectX, with the simulator's answers,
//! in the compact form `core/tests-m4/src/board.rs` reads without a heap. This test records it again and fails
//! when the file is not what the current driver and simulator produce; `MLX5_WRITE_RECORDING=1 cargo test -p
//! mlx5-firmware-example --test recording` rewrites it.
//!
//! Bus and CPU addresses of the driver's buffers differ from run to run and from the mock's, so the 64-bit words
//! holding one are zeroed in the recording and left out of the input's compare mask.

use std::cell::RefCell;
use std::path::PathBuf;

use mlx5_core::hal::{Dma, DmaError, DmaRegion};
use mlx5_core::prm::ifc::{create_mkey_in, manage_pages_in, mkc};
use mlx5_core::prm::{MsgBuf, Opcode};
use mlx5_core::trace::{CmdOutcome, CmdRecord, CmdTrace};
use mlx5_firmware_example::{run_with, Options};
use mlx5_sim::{SimConfig, SimDevice};

/// The file's header and record flags, shared with the reader (see `core/tests-m4/src/board.rs` for the layout).
#[path = "../../../core/tests-m4/src/board/format.rs"]
#[allow(dead_code)] // KNOWN_FLAGS is the reader's.
mod format;
use format::{GIVE_BACK, MAGIC, MASKED, PAGE_REQUEST, PREFIX, VERSION};
/// MANAGE_PAGES `op_mod`s (Linux's `MLX5_PAGES_GIVE`, `MLX5_PAGES_TAKE`).
const PAGES_GIVE: u16 = 1;
const PAGES_TAKE: u16 = 2;

/// One command as sent and answered.
struct Cmd {
    opcode: Opcode,
    op_mod: u16,
    input: Vec<u8>,
    output: Vec<u8>,
}

#[derive(Default)]
struct Recorder(Vec<Cmd>);

impl CmdTrace for Recorder {
    fn record(&mut self, r: &CmdRecord<'_>) {
        assert!(matches!(r.outcome, CmdOutcome::Completed { .. }), "{:?} did not complete: {:?}", r.opcode, r.outcome);
        let mut input = vec![0u8; r.input.len()];
        r.input.read_bytes(0, &mut input);
        let mut output = vec![0u8; r.output.map_or(0, |o| o.len())];
        if let Some(o) = r.output {
            o.read_bytes(0, &mut output);
        }
        self.0.push(Cmd { opcode: r.opcode, op_mod: r.op_mod, input, output });
    }
}

/// The simulator's allocator, noting the bus and CPU range of every region it handed out.
struct Ranges {
    sim: mlx5_sim::SimDma,
    seen: RefCell<Vec<(u64, u64)>>,
    first_done: RefCell<bool>,
}

impl Ranges {
    fn holds(&self, v: u64) -> bool {
        self.seen.borrow().iter().any(|&(start, len)| v >= start && v - start < len)
    }
}

// SAFETY: every region is the simulator's, which honours the contract; this wrapper only keeps books.
unsafe impl Dma for Ranges {
    fn alloc(&self, len: usize, align: usize) -> Result<DmaRegion, DmaError> {
        let r = self.sim.alloc(len, align)?;
        let n = len.max(1) as u64;
        let mut seen = self.seen.borrow_mut();
        // The first region is the command queue, whose address goes only to the initialization segment, never
        // into a command; left out so that an object number 1 before a small field does not look like it.
        if !std::mem::replace(&mut *self.first_done.borrow_mut(), true) {
            return Ok(r);
        }
        seen.extend([(r.iova(), n), (r.cpu().as_ptr() as u64, n)]);
        Ok(r)
    }

    fn iova_of(&self, cpu: *const u8, len: usize) -> Option<u64> {
        self.sim.iova_of(cpu, len)
    }

    unsafe fn free(&self, region: DmaRegion) {
        // SAFETY: the caller's duties are passed through.
        unsafe { self.sim.free(region) };
    }
}

/// Zeroes every big-endian 64-bit word that holds an address of a region (the PRM's 64-bit fields, `pas[]`,
/// `dbr_addr`, `start_addr`, are 64-bit aligned), clearing its bits in `mask` too; whether anything was.
fn strip_addresses(bytes: &mut [u8], mask: &mut [u8], ranges: &Ranges) -> bool {
    let mut any = false;
    for (word, m) in bytes.chunks_exact_mut(8).zip(mask.chunks_exact_mut(8)) {
        let v = u64::from_be_bytes(word.try_into().expect("8 bytes"));
        if v != 0 && ranges.holds(v) {
            word.fill(0);
            m.fill(0);
            any = true;
        }
    }
    any
}

fn put16(out: &mut Vec<u8>, v: u16) {
    out.extend_from_slice(&v.to_le_bytes());
}

/// The firmware's command-only run on the simulator, encoded.
fn record() -> Vec<u8> {
    let dev = SimDevice::new(SimConfig::default());
    let dma = Ranges { sim: dev.dma(), seen: RefCell::default(), first_done: RefCell::default() };
    let mut rec = Recorder::default();
    let opts = Options { traffic: false, ..Options::default() };
    run_with(dev.mmio(), &dma, &mut rec, &mut dev.delay(), opts).expect("the command-only run on the simulator");

    // A MANAGE_PAGES give that no QUERY_PAGES asked for answers a page request the simulator posted while the
    // command before it ran: the mock posts that request from the earlier command's reply.
    let cmds = rec.0;
    let mut requests = vec![None; cmds.len()];
    for (i, c) in cmds.iter().enumerate().skip(1) {
        if c.opcode == Opcode::ManagePages && c.op_mod == PAGES_GIVE && cmds[i - 1].opcode != Opcode::QueryPages {
            let input = &c.input[..];
            let function_id = MsgBuf::get(input, manage_pages_in::FUNCTION_ID) as u16;
            let pages = MsgBuf::get(input, manage_pages_in::INPUT_NUM_ENTRIES) as i32;
            requests[i - 1] = Some((function_id, pages));
        }
    }

    let mut out = MAGIC.to_vec();
    put16(&mut out, VERSION);
    put16(&mut out, u16::try_from(cmds.len()).expect("commands fit a u16"));
    for (c, request) in cmds.into_iter().zip(requests) {
        let (mut input, mut output) = (c.input, c.output);
        let mut mask = vec![0xffu8; input.len()];
        let mut masked = strip_addresses(&mut input, &mut mask, &dma);
        // CREATE_MKEY's translation entries (how many, of what page size) follow from where the buffer lies, which
        // the replaying device decides: only the part before them is expected, without its page-size fields.
        let prefix = c.opcode == Opcode::CreateMkey;
        if prefix {
            let entry = create_mkey_in::MEMORY_KEY_MKEY_ENTRY;
            for f in [
                mkc::LOG_PAGE_SIZE.at(entry),
                mkc::TRANSLATIONS_OCTWORD_SIZE.at(entry),
                create_mkey_in::TRANSLATIONS_OCTWORD_ACTUAL_SIZE,
            ] {
                MsgBuf::set(&mut input[..], f, 0);
                MsgBuf::set(&mut mask[..], f, 0);
            }
            let end = create_mkey_in::KLM_PAS_MTT.byte_off();
            input.truncate(end);
            mask.truncate(end);
            masked = true;
        }
        // Addresses in an output (QUERY_QP's context) are nothing the driver uses; zeroed so the file is stable.
        let mut unused = vec![0; output.len()];
        strip_addresses(&mut output, &mut unused, &dma);
        let give_back = c.opcode == Opcode::ManagePages && c.op_mod == PAGES_TAKE;
        if give_back {
            // The pages firmware hands back are the mock's own (their bus addresses are the mock's).
            output.clear();
        }
        let trimmed = output.iter().rposition(|&b| b != 0).map_or(0, |p| p + 1);
        output.truncate(trimmed);

        let mut flags = 0;
        if give_back {
            flags |= GIVE_BACK;
        }
        if request.is_some() {
            flags |= PAGE_REQUEST;
        }
        if masked {
            flags |= MASKED;
        }
        if prefix {
            flags |= PREFIX;
        }
        put16(&mut out, c.opcode.raw());
        put16(&mut out, c.op_mod);
        out.push(flags);
        if let Some((function_id, pages)) = request {
            put16(&mut out, function_id);
            out.extend_from_slice(&pages.to_le_bytes());
        }
        put16(&mut out, u16::try_from(input.len()).expect("inputs fit a u16"));
        out.extend_from_slice(&input);
        if masked {
            out.extend_from_slice(&mask);
        }
        put16(&mut out, u16::try_from(output.len()).expect("outputs fit a u16"));
        out.extend_from_slice(&output);
    }
    out
}

fn path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../core/tests-m4/data/firmware-run.bin")
}

#[test]
fn the_board_tests_recording_is_what_the_simulator_answers_today() {
    let now = record();
    let again = record();
    let first = now.iter().zip(&again).position(|(a, b)| a != b);
    assert!(
        now == again,
        "two recordings differ (lengths {} and {}, first at byte {first:?}): something in them is not stable from run \
         to run",
        now.len(),
        again.len()
    );
    let file = path();
    if std::env::var_os("MLX5_WRITE_RECORDING").is_some() {
        std::fs::create_dir_all(file.parent().expect("a parent")).expect("creating the data directory");
        std::fs::write(&file, &now).expect("writing the recording");
        println!("wrote {} ({} bytes)", file.display(), now.len());
        return;
    }
    let stored = std::fs::read(&file).unwrap_or_default();
    assert!(
        stored == now,
        "{} is not current ({} bytes stored, {} recorded now); rewrite it with \
         MLX5_WRITE_RECORDING=1 cargo test -p mlx5-firmware-example --test recording",
        file.display(),
        stored.len(),
        now.len()
    );
}
