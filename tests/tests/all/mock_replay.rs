//! Recorded traces replayed through the expectation mock: the simulator's trace.jsonl of a whole bring-up and
//! teardown, and a real ConnectX-4's commands as Linux recorded them (../shared/data/connectx4-fw-14.12.1220).

use std::io::Read;

use mlx5_core::hal::DelayNs;
use mlx5_core::hca::{Config, Hca, Step};
use mlx5_core::mock::MockDevice;
use mlx5_core::trace::{CmdRecord, CmdTrace};
use mlx5_sim::{SimConfig, SimDevice};
use mlx5_tests::mock_load::{expectations, from_linux_dump, from_trace_jsonl};

struct NoDelay;
impl DelayNs for NoDelay {
    fn delay_ns(&mut self, _ns: u32) {}
}

/// Collects the JSON lines `mlx5 --trace FILE` writes.
#[derive(Default)]
struct JsonLines(String);
impl CmdTrace for JsonLines {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        rec.write_json(&mut self.0).unwrap();
        self.0.push('\n');
    }
}

fn arena(bytes: usize) -> &'static mut [u8] {
    Box::leak(vec![0u8; bytes].into_boxed_slice())
}

#[test]
fn mock_replay_of_a_simulator_trace_runs_the_same_bring_up_and_teardown() {
    let cfg = Config { async_eq_nent: 64, ..Config::default() };
    let sim = SimDevice::new(SimConfig::default());
    let mut d = sim.delay();
    let hca: Hca<_, _, _> = Hca::bring_up(sim.mmio(), sim.dma(), JsonLines::default(), &mut d, cfg).unwrap();
    let given = hca.pages_given();
    let mut hca = hca;
    let text = std::mem::take(&mut hca.cmdq().tracer().0);
    hca.teardown(&mut d).unwrap();
    let recs = from_trace_jsonl(&text).unwrap();
    assert!(recs.len() > 20, "a whole bring-up: {}", recs.len());

    let dev: MockDevice<'_, 128, 128> = MockDevice::new(arena(64 << 20));
    dev.expect_all(expectations(&recs));
    let hca: Hca<_, _> =
        Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg).unwrap_or_else(|e| panic!("{e}: {:?}", dev.done()));
    dev.assert_done();
    // The simulator's page requests (served during bring-up) were replayed as page-request EQEs.
    assert_eq!(hca.pages_given(), given);
    assert_eq!(dev.pages_held(), given);
    drop(hca);
}

#[test]
fn mock_replay_loader_reads_trace_lines_and_names_bad_ones() {
    let line = "{\"slot\":0,\"token\":1,\"opcode\":\"ALLOC_PD\",\"opcode_raw\":2048,\"op_mod\":0,\
                \"input\":\"08000000000000000000000000000000\",\"output\":\"03000000123456780000000000000000\",\
                \"delivery\":\"OK\",\"status\":\"BAD_PARAM\",\"status_raw\":3,\"syndrome\":305419896,\"waited_us\":0}";
    let recs = from_trace_jsonl(line).unwrap();
    assert_eq!(
        (recs[0].opcode, recs[0].output.as_ref().unwrap()[4..8].to_vec()),
        (0x800, vec![0x12, 0x34, 0x56, 0x78])
    );
    let timeout = line.replace("\"output\":\"03000000123456780000000000000000\"", "\"output\":null");
    assert_eq!(from_trace_jsonl(&timeout).unwrap()[0].output, None);
    assert_eq!(from_trace_jsonl("{}\n").unwrap_err(), "line 1: no number opcode_raw");
    assert_eq!(from_trace_jsonl(&line.replace("0800", "08x0")).unwrap_err(), "line 1: bad hex input");
}

fn connectx4() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/connectx4-fw-14.12.1220/trace-mlx5_core.txt.gz");
    let gz = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut text = String::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_string(&mut text).unwrap();
    text
}

#[test]
fn mock_replay_loader_reads_the_linux_dump_of_a_connectx4() {
    let recs = from_linux_dump(&connectx4()).unwrap();
    assert_eq!(recs.len(), 42);
    let first: Vec<(u16, u16)> = recs.iter().take(5).map(|r| (r.opcode, r.op_mod)).collect();
    assert_eq!(first, [(0x104, 0), (0x10a, 0), (0x10b, 0), (0x107, 1), (0x108, 1)]);
    // QUERY_ISSI's output came through its mailbox: supported_issi_dw0 at byte 0x6c says ISSI 1 (bit 1).
    let issi = recs[1].output.as_ref().unwrap();
    assert_eq!((issi.len(), &issi[0x6c..0x70]), (0x70, &[0, 0, 0, 2][..]));
    // Every command completed with status 0 and was delivered.
    assert!(recs.iter().all(|r| r.delivery == 0 && r.output.as_ref().is_some_and(|o| o[0] == 0)));
}

#[test]
fn mock_replay_loader_refuses_a_malformed_dump() {
    assert_eq!(
        from_linux_dump("mlx5_core: dump command FOO(0x999) OUTPUT\n000: 07000000\n").unwrap_err(),
        "0x999: dump shorter than a command entry"
    );
    assert!(from_linux_dump("dump command FOO(0xzz) INPUT").unwrap_err().contains("bad opcode"));
}

/// The ConnectX-4 recording into the core's bring-up: the two agree from ENABLE_HCA through SET_HCA_CAP of the
/// general capabilities (11 commands, with the real device's capability pages, boot pages and ISSI), then
/// depart. Linux of 2016 (the recording) went on to QUERY_PAGES(init); the core, as Linux 6.12's
/// `handle_hca_cap_atomic`, first queries the atomic capabilities, which this ConnectX-4 reports (`atomic` set in
/// its current general capabilities), so the first command the recording does not expect is QUERY_HCA_CAP where
/// it has QUERY_PAGES.
#[test]
fn mock_replay_of_a_connectx4_recording_agrees_until_the_atomic_caps() {
    let recs = from_linux_dump(&connectx4()).unwrap();
    let dev: MockDevice<'_, 64, 128> = MockDevice::new(arena(64 << 20));
    dev.expect_all(expectations(&recs));
    let err = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, Config::default()).unwrap_err();
    assert_eq!(dev.first_unexpected().as_deref(), Some("expected QUERY_PAGES, got QUERY_HCA_CAP"));
    assert_eq!(dev.matched(), 9);
    assert_eq!(err.step, Step::SetHcaCaps);
    // The recording has no teardown: the unwinding's MANAGE_PAGES take and DISABLE_HCA are answered BAD_OP, so
    // the function was never disabled and the driver keeps the boot pages firmware may still write (one chunk)
    // rather than freeing them under it.
    assert!(err.cleanup.is_some());
    assert_eq!((dev.pages_held(), dev.live_regions()), (6, 1));
}
