//! Golden vectors: the byte-exact images in `tests/vectors/vectors.json` (vendored from shared/prm, re-encoded
//! there with the kernel's own MLX5_SET macros) reproduced by this driver's command queue. The encoders' and
//! decoders' vectors are unit tests of the core (`core/src/golden.rs`), so they run on the Cortex-M4F too.

use mlx5_core::cmd::Pas;
use mlx5_core::cmdq::{CmdError, CmdQueue};
use mlx5_core::cq::{CqContext, CqeSize, CreateCq};
use mlx5_core::eq::{eq_doorbell_value, EqRing, Eqe, Event, EQE_SIZE};
use mlx5_core::hal::Dma;
use mlx5_core::pd::alloc_pd;
use mlx5_core::prm::{CmdStatus, Opcode};
use mlx5_sim::testkit::{HeapDma, RegFile};
use mlx5_tests::{hex, unhex};
use serde_json::Value;

/// Vectors for objects later issues implement; the guard test below keeps this list honest.
const DEFERRED: &[(&str, &str)] = &[];

/// Reproduced here (the command queue's entry and outputs, the EQ doorbell through the ring) or, for the
/// encoders and decoders, in the core's own unit tests (`core/src/golden.rs`, run on the Cortex-M4F too).
const COVERED: &[&str] = &[
    "create_cq_in",
    "create_eq_in",
    "enable_hca_in",
    "query_issi_in",
    "set_issi_in",
    "query_pages_in_boot",
    "manage_pages_in_give2",
    "query_hca_cap_in_general_cur",
    "init_hca_in",
    "alloc_pd_in",
    "alloc_uar_in",
    "create_cq_out_ok",
    "query_pages_out_boot",
    "mbox_out_bad_param",
    "cmd_layout_create_cq",
    "eqe_completion_cq1a",
    "eq_update_ci_arm",
    "cqe64_req_rdma_write_ok",
    "init2rtr_qp_in_ib",
    // Reproduced through a real QP in tests/datapath.rs (rdma_write_wqe_matches_the_golden_vector).
    "wqe_rdma_write_signaled",
];

fn vectors() -> Vec<Value> {
    let v: Value = serde_json::from_str(include_str!("../../vectors/vectors.json")).unwrap();
    v["vectors"].as_array().unwrap().clone()
}

fn vector(name: &str) -> Value {
    vectors().into_iter().find(|v| v["name"] == name).unwrap_or_else(|| panic!("no vector {name}"))
}

fn golden(name: &str) -> Vec<u8> {
    let v = vector(name);
    let bytes = unhex(v["hex"].as_str().unwrap());
    assert_eq!(bytes.len() as u64, v["length_bytes"].as_u64().unwrap(), "{name}: length");
    bytes
}

include!("../../vectors/create_cq_in.rs");

#[test]
fn every_vector_is_covered_or_deferred() {
    for v in vectors() {
        let name = v["name"].as_str().unwrap();
        let known = COVERED.contains(&name) || DEFERRED.iter().any(|(d, _)| *d == name);
        assert!(known, "vector {name} is neither reproduced nor deferred to a named issue");
    }
}

/// The queue entry the command queue builds for the golden CREATE_CQ, read back from DMA memory before any
/// firmware touches it: type, lengths, mailbox pointer, inline bytes, token 1, owner bit, signature.
#[test]
fn command_entry_matches_byte_for_byte() {
    let dma = HeapDma::scripted(&[0x7000_0000, 0x12345000]);
    let regs = RegFile::with_cmdq();
    let mut q = CmdQueue::new(&regs, &dma, ()).unwrap();
    let pas = [0xaaaa000, 0xbbbb000];
    q.post(0, &create_cq_vector_cmd(&pas)).unwrap();
    assert_eq!(hex(&dma.read(0x7000_0000, 64)), hex(&golden("cmd_layout_create_cq")));
    // The mailbox holds input bytes 16.. of the command, then its chain header: block 0, token 1, no next.
    let full = golden("create_cq_in");
    assert_eq!(dma.read(0x12345000, full.len() - 16), full[16..]);
    // And the doorbell was rung for slot 0 alone.
    assert_eq!(regs.words().last(), Some(&(0x18, 1)));
}

/// An output header with BAD_PARAM and a syndrome, placed in a completed entry, surfaces as the typed error.
#[test]
fn error_output_header_decodes_to_typed_status() {
    let dma = HeapDma::scripted(&[0x7000_0000]);
    let regs = RegFile::with_cmdq();
    let mut q = CmdQueue::new(&regs, &dma, ()).unwrap();
    let mut cmd = alloc_pd();
    q.post(0, &cmd).unwrap();
    assert!(!q.poll(0), "nothing completed it yet");
    // Play firmware: write the golden output header into the entry's inline output and give ownership back.
    let out = golden("mbox_out_bad_param");
    let mut entry = dma.read(0x7000_0000, 64);
    entry[0x20..0x30].copy_from_slice(&out);
    entry[0x3f] = 0;
    dma.write(0x7000_0000, &entry);
    assert!(q.poll(0));
    let err = q.finish(0, &mut cmd).unwrap_err();
    assert_eq!(
        err,
        CmdError::Status { opcode: Opcode::AllocPd, op_mod: 0, status: CmdStatus::BadParam, syndrome: 0x12345678 }
    );
    assert_eq!(err.to_string(), "ALLOC_PD(0x800) op_mod(0x0) failed, status BAD_PARAM(0x3), syndrome (0x12345678)");
}

#[test]
fn eq_doorbell_matches_and_goes_to_the_arm_register() {
    let bytes = golden("eq_update_ci_arm");
    assert_eq!(hex(&eq_doorbell_value(7, 0x20).to_be_bytes()), hex(&bytes));

    // Through the ring: 0x20 software-owned EQEs consumed from a fresh ring, then one arming update.
    let regs = RegFile::with_cmdq();
    let dma = HeapDma::scripted(&[0x4000_0000]);
    let log_nent = 6;
    let buf = dma.alloc(EqRing::buf_len(log_nent), 4096).unwrap();
    EqRing::init_buf(&buf, log_nent).unwrap();
    for i in 0..0x20usize {
        // First pass: the device writes owner 0.
        let mut e = Eqe::emit(&Event::Completion { cqn: i as u32 }).0;
        e[EQE_SIZE - 1] = 0;
        dma.write(buf.iova() + (i * EQE_SIZE) as u64, &e);
    }
    let uar_off = 5 * 4096;
    let mut ring = EqRing::new(buf, log_nent, 7, uar_off);
    let mut got = 0;
    while let Some(e) = ring.next(&regs) {
        assert_eq!(e.event(), Event::Completion { cqn: got });
        got += 1;
    }
    assert_eq!(got, 0x20);
    ring.update_ci(&regs, true);
    let doorbell = ifc_eq_doorbell(uar_off);
    assert_eq!(regs.words().last().copied(), Some((doorbell, u32::from_be_bytes(bytes.try_into().unwrap()))));
    // SAFETY: allocated above from this allocator; nothing else references it.
    unsafe { dma.free(ring.into_buf()) };
}

/// The arming doorbell's BAR offset: UAR page + `MLX5_EQ_DOORBELL_OFFSET`.
fn ifc_eq_doorbell(uar_off: usize) -> usize {
    uar_off + mlx5_core::prm::consts::MLX5_EQ_DOORBELL_OFFSET as usize
}
