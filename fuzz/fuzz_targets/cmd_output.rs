//! Command outputs and mailbox chains as the device writes them.
//!
//! Mode A: a fake device (plain-memory BAR and DMA) answers real commands sent through `CmdQueue::exec`: when the
//! doorbell rings it overwrites the entry's output, status and delivery byte, the output mailboxes (data, `next`,
//! `block_num`, token, signatures) and anything else in the entry with input bytes, or keeps the slot (a hang,
//! answered at a later doorbell or never). Asserted: no panic; the result is the typed error the bytes call for
//! (timeout for a kept slot, `SlotBusy` while it is kept, `Delivery` with the delivery code, `BadSignature` only
//! with checksums on and a signature the device did not compute, `Status` with the header's status and
//! syndrome); an output that decodes is the bytes the device wrote (capability blocks, register data, page lists
//! checked before use); every command is traced, and both trace renderings work on any output.
//!
//! Mode B: the simulated device brings the HCA up with output corruption, status and delivery faults on
//! arbitrary commands of the bring-up and teardown. Asserted: no panic, errors typed and printable.
#![no_main]

use std::cell::{Cell, RefCell};

use libfuzzer_sys::fuzz_target;
use mlx5_core::caps::GeneralCaps;
use mlx5_core::cmdq::{CmdError, CmdQueue, Command, CMD_IF_REV};
use mlx5_core::cq::{CqContext, CqeSize, CreateCq, QueryCq};
use mlx5_core::hca::CqAttr;
use mlx5_core::hca::{Config, Hca};
use mlx5_core::init::{CapMode, CapType, QueryHcaCap, QueryIssi};
use mlx5_core::pages::{ManagePagesTake, PageStage, QueryPages, FW_PAGE_SIZE};
use mlx5_core::pd::alloc_pd;
use mlx5_core::prm::{c, ifc, CmdStatus, DeliveryStatus, MsgBuf, Opcode};
use mlx5_core::qp::QueryQp;
use mlx5_core::reg::{pmtu_read, PortMtu};
use mlx5_core::trace::{CmdOutcome, CmdRecord, CmdTrace};
use mlx5_core::vport::{QueryHcaVportContext, QueryNicVportContext, QueryVportState};
use mlx5_fuzz::{bytes, flag, int, HeapDma, RegFile, Unstructured, VDelay};
use mlx5_sim::{Fault, SimConfig, SimDevice};

use c::mlx5_cmd_layout as lay;
use c::mlx5_cmd_prot_block as blk;
use c::mlx5_init_seg as iseg;

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    if int(&mut u, 0u8..=7) == 0 {
        sim_faults(&mut u);
    } else {
        fake_device(u);
    }
});

// ---------------------------------------------------------------------------------------------------------------
// Mode A

/// What the device did with a slot the last time it was rung.
#[derive(Debug, Clone, Default)]
struct Answer {
    hung: bool,
    delivery: u8,
    /// The output message as the device wrote it: 16 inline bytes, then each mailbox's data.
    out: Vec<u8>,
    /// Entry and every mailbox written carry correct signatures.
    signed: bool,
}

struct Fw<'a, 'd> {
    mem: &'a HeapDma,
    u: RefCell<Unstructured<'d>>,
    page_hi: Cell<u32>,
    page_lo: Cell<u32>,
    answers: RefCell<Vec<Answer>>,
}

/// Field `f` of an output message as the device wrote it, when the device wrote that far.
fn field(out: &[u8], f: mlx5_core::prm::Field) -> Option<u32> {
    let end = (f.off as usize + f.width as usize).div_ceil(32) * 4;
    (end <= out.len()).then(|| MsgBuf::get(out, f))
}

fn xor(b: &[u8]) -> u8 {
    b.iter().fold(0, |a, x| a ^ x)
}

impl Fw<'_, '_> {
    fn page(&self) -> u64 {
        (u64::from(self.page_hi.get()) << 32) | u64::from(self.page_lo.get() & !0xfff)
    }

    fn on_write(&self, off: usize, v: u32) {
        if off == iseg::CMDQ_ADDR_H.off {
            self.page_hi.set(v);
        } else if off == iseg::CMDQ_ADDR_L_SZ.off {
            self.page_lo.set(v);
        } else if off == iseg::CMD_DBELL.off {
            for slot in 0..32 {
                let hung = self.answers.borrow()[slot].hung;
                // Rung now, or kept earlier and answered late (at some later doorbell).
                if v & (1 << slot) != 0 || (hung && int(&mut self.u.borrow_mut(), 0u8..=3) == 0) {
                    self.answer(slot);
                }
            }
        }
    }

    fn answer(&self, slot: usize) {
        let mut u = self.u.borrow_mut();
        let u = &mut *u;
        let e = self.page() + (slot * 64) as u64;
        let Some(mut entry) = self.mem.try_read(e, lay::SIZE) else { return };
        if int(u, 0u8..=15) == 0 {
            self.answers.borrow_mut()[slot] = Answer { hung: true, ..Answer::default() };
            return;
        }
        let be32 = |b: &[u8], m: mlx5_core::prm::Bytes| m.get_be(b, 0);
        let outlen = be32(&entry, lay::OUTLEN) as usize;
        let out_ptr = u64::from_be_bytes(entry[lay::OUT_PTR.off..lay::OUT_PTR.end()].try_into().unwrap());
        let sign = flag(u);
        let mut inline = bytes::<16>(u);
        if int(u, 0u8..=3) != 0 {
            inline[0] = 0;
        }
        let delivery = if int(u, 0u8..=7) == 0 { int(u, 1u8..=0x7f) } else { 0 };
        let mut out = inline.to_vec();
        // The output mailboxes, followed as the device follows them (by `next`, from `out_ptr`).
        let nblocks = outlen.saturating_sub(16).div_ceil(512).min(64);
        let mut addr = out_ptr;
        for _ in 0..nblocks {
            let Some(mut b) = self.mem.try_read(addr, blk::SIZE) else { break };
            let next = u64::from_be_bytes(b[blk::NEXT.off..blk::NEXT.end()].try_into().unwrap());
            let data = bytes::<512>(u);
            b[..512].copy_from_slice(&data);
            if int(u, 0u8..=7) == 0 {
                // Control part rewritten too: next, block number, token, signatures.
                let ctrl = bytes::<64>(u);
                b[512..].copy_from_slice(&ctrl);
            }
            if sign {
                b[blk::CTRL_SIG.off] = !xor(&b[blk::DATA.end()..blk::CTRL_SIG.off]);
                b[blk::SIG.off] = !xor(&b[..blk::SIG.off]);
            }
            assert!(self.mem.try_write(addr, &b));
            out.extend_from_slice(&data);
            addr = next;
        }
        entry[lay::OUT.off..lay::OUT.end()].copy_from_slice(&inline);
        if int(u, 0u8..=7) == 0 {
            // The rest of the entry as well: type, lengths, pointers, input bytes, token.
            let junk = bytes::<61>(u);
            entry[..lay::OUT.off].copy_from_slice(&junk[..lay::OUT.off]);
            entry[lay::OUT.end()..lay::SIG.off].copy_from_slice(&junk[lay::OUT.off..lay::SIG.off - 16]);
        }
        entry[lay::STATUS_OWN.off] = delivery << 1;
        if sign {
            entry[lay::SIG.off] = 0;
            entry[lay::SIG.off] = !xor(&entry);
        }
        assert!(self.mem.try_write(e, &entry));
        self.answers.borrow_mut()[slot] = Answer { hung: false, delivery, out, signed: sign };
    }
}

/// Renders every record both ways and remembers the outcomes.
#[derive(Default)]
struct Tracer {
    outcomes: Vec<(u8, CmdOutcome)>,
}

impl CmdTrace for Tracer {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        let mut s = String::new();
        rec.write_json(&mut s).expect("json rendering");
        assert!(s.starts_with('{') && s.trim_end().ends_with('}'), "{s}");
        let mut h = String::new();
        rec.write_hexdump(&mut h).expect("hexdump rendering");
        self.outcomes.push((rec.slot, rec.outcome));
    }
}

fn fake_device(mut u: Unstructured<'_>) {
    let checksum = flag(&mut u);
    let timeout_ms = int(&mut u, 1u32..=20);
    let ncmds = int(&mut u, 1u8..=6);
    let kinds: Vec<u8> = (0..ncmds).map(|_| int(&mut u, 0u8..=11)).collect();
    let params: Vec<u32> = (0..ncmds).map(|_| int(&mut u, 0u32..=u32::MAX)).collect();
    // SAFETY: declared before everything that holds its regions, so dropped last.
    let mem = unsafe { HeapDma::for_fuzzing(None) };
    let fw = Fw {
        mem: &mem,
        u: RefCell::new(u),
        page_hi: Cell::new(0),
        page_lo: Cell::new(0),
        answers: RefCell::new(vec![Answer::default(); 32]),
    };
    let bar = RegFile::new();
    bar.preset32(iseg::CMDIF_REV_FW_SUB.off, CMD_IF_REV << 16);
    bar.preset32(iseg::CMDQ_ADDR_L_SZ.off, (5 << 4) | 6);
    bar.on_write32(|off, v| fw.on_write(off, v));
    let mut q = CmdQueue::new(&bar, &mem, Tracer::default()).expect("a valid init segment");
    q.set_checksum(checksum);
    q.set_timeout_ms(timeout_ms);
    for (&kind, &p) in kinds.iter().zip(&params) {
        run(&mut q, &fw, kind, p, checksum, timeout_ms);
    }
    drop(q);
}

/// The slot a command goes to, what the device did there before the command (kept or not), and after.
fn run(
    q: &mut CmdQueue<&RegFile<'_>, &HeapDma, Tracer>,
    fw: &Fw<'_, '_>,
    kind: u8,
    p: u32,
    checksum: bool,
    timeout_ms: u32,
) {
    let mut d = VDelay::default();
    let traced = q.tracer().outcomes.len();
    match kind {
        0 | 1 => {
            let caps = [
                CapType::General,
                CapType::General2,
                CapType::Atomic,
                CapType::Roce,
                CapType::Odp,
                CapType::EthernetOffloads,
                CapType::Other(p as u16 >> 1),
            ];
            let cap = caps[(p as usize >> 16) % caps.len()];
            let mode = if p & 1 == 0 { CapMode::Current } else { CapMode::Max };
            let mut cmd = QueryHcaCap { cap, mode };
            let r = exec(q, &mut cmd, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |block, out| {
                let off = ifc::query_hca_cap_out::CAPABILITY.off;
                let n = out.len().saturating_sub(off).min(block.len());
                assert_eq!(&block[..n], &out[off..off + n], "capability block as the device wrote it");
                let g = GeneralCaps::parse(block);
                let _ = (g.max_sge(), g.max_inline_data(), g.max_rq_sge(), g.port_type());
            });
        }
        2 => {
            let r = exec(q, &mut QueryIssi, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |issi, out| {
                if let Some(v) = field(out, ifc::query_issi_out::CURRENT_ISSI) {
                    assert_eq!(u32::from(issi.current), v);
                }
                let _ = (issi.supports(0), issi.supports(1), issi.supports(u16::MAX));
            });
        }
        3 => {
            let stage = [PageStage::Boot, PageStage::Init, PageStage::Regular][p as usize % 3];
            let r = exec(q, &mut QueryPages { stage }, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |req, out| {
                assert_eq!(Some(req.num_pages as u32), field(out, ifc::query_pages_out::NUM_PAGES));
                assert_eq!(Some(u32::from(req.function_id)), field(out, ifc::query_pages_out::FUNCTION_ID));
            });
        }
        4 => {
            let cap = (p % 600) as usize;
            let mut pages = vec![0u64; cap];
            let r = exec(q, &mut ManagePagesTake { function_id: 0, pages: &mut pages[..] }, &mut d);
            let claimed = field(&fw.answers.borrow()[31].out, ifc::manage_pages_out::OUTPUT_NUM_ENTRIES);
            match &r.2 {
                Err(CmdError::OutputTooShort { opcode, needed, got }) => {
                    assert_eq!(*opcode, Opcode::ManagePages);
                    assert!(needed > got);
                    assert!(claimed.is_some_and(|n| n as usize > cap), "refused a count that fits");
                }
                Err(CmdError::Malformed { what, value, .. }) => {
                    assert_eq!(*what, "page address");
                    assert_ne!(value % FW_PAGE_SIZE as u64, 0);
                }
                _ => {}
            }
            check(q, fw, &r, checksum, timeout_ms, |&n, out| {
                assert!(n <= cap, "{n} pages returned into room for {cap}");
                for (i, &a) in pages[..n].iter().enumerate() {
                    assert_eq!(a % FW_PAGE_SIZE as u64, 0, "unaligned page accepted");
                    let f = ifc::manage_pages_out::PAS.elem(i as u32);
                    if f.off as usize / 8 + 8 <= out.len() {
                        assert_eq!(a, MsgBuf::get64(out, f), "page list as the device wrote it");
                    }
                }
            });
        }
        5 => {
            let pas = [0x1000u64, 0x2000];
            let ctx = CqContext { cqe_sz: CqeSize::B64, log_cq_size: 1, ..CqContext::default() };
            let r = exec(q, &mut CreateCq { ctx, pas: (&pas).into() }, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |&cqn, _| assert!(cqn <= 0xff_ffff, "cqn {cqn:#x}"));
        }
        6 => {
            let r = exec(q, &mut QueryCq { cqn: p & 0xff_ffff }, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |s, _| {
                let _ = s.overflowed();
            });
        }
        7 => {
            let r = exec(q, &mut QueryQp { qpn: p & 0xff_ffff }, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |_, _| {});
        }
        8 => {
            let mut data = [0u8; ifc::pmtu_reg::SIZE_BYTES];
            let r = exec(q, &mut pmtu_read(1, &mut data), &mut d);
            let ok = r.2.is_ok();
            check(q, fw, &r, checksum, timeout_ms, |_, _| {});
            if ok {
                let _ = PortMtu::parse(&data);
            }
        }
        9 => {
            let r = exec(q, &mut QueryNicVportContext, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |_, _| {});
        }
        10 => {
            let r = exec(q, &mut QueryHcaVportContext { port_num: 1 }, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |_, _| {});
            let r = exec(q, &mut QueryVportState, &mut d);
            check(q, fw, &r, checksum, timeout_ms, |_, _| {});
        }
        _ => {
            let r = exec(q, &mut alloc_pd(), &mut d);
            check(q, fw, &r, checksum, timeout_ms, |_, _| {});
        }
    }
    let _ = traced;
}

/// Runs a command: its slot, how many trace records there were before, the result.
fn exec<C: Command>(
    q: &mut CmdQueue<&RegFile<'_>, &HeapDma, Tracer>,
    cmd: &mut C,
    d: &mut VDelay,
) -> (u8, usize, Result<C::Output, CmdError>) {
    let slot = if cmd.opcode() == Opcode::ManagePages { 31 } else { 0 };
    let traced = q.tracer().outcomes.len();
    (slot, traced, q.exec(cmd, d))
}

/// The result is the one the device's bytes call for; `ok` checks a decoded output against them.
fn check<T>(
    q: &mut CmdQueue<&RegFile<'_>, &HeapDma, Tracer>,
    fw: &Fw<'_, '_>,
    r: &(u8, usize, Result<T, CmdError>),
    checksum: bool,
    timeout_ms: u32,
    ok: impl FnOnce(&T, &[u8]),
) {
    let (slot, traced, res) = r;
    let a = fw.answers.borrow()[*slot as usize].clone();
    // Every command that reached the device is traced once, with the outcome the caller got.
    let new = &q.tracer().outcomes[*traced..];
    if matches!(res, Err(CmdError::SlotBusy { .. })) {
        assert!(new.is_empty(), "a command never sent was traced");
    } else {
        assert_eq!(new.len(), 1, "one trace record per command");
        let (s, o) = new[0];
        assert_eq!(s, *slot);
        let agrees = match (res, o) {
            (Err(CmdError::Timeout { .. }), CmdOutcome::Timeout) => true,
            (Err(CmdError::Delivery { status, .. }), CmdOutcome::Delivery(t)) => *status == t,
            (Err(CmdError::BadSignature { .. }), CmdOutcome::BadSignature) => true,
            (Err(CmdError::Status { status, syndrome, .. }), CmdOutcome::Completed { status: t, syndrome: y }) => {
                (*status, *syndrome) == (t, y)
            }
            (_, CmdOutcome::Completed { status, .. }) => status == CmdStatus::Ok,
            _ => false,
        };
        assert!(agrees, "trace says {o:?}, caller got {:?}", res.as_ref().err());
    }
    match res {
        Err(CmdError::SlotBusy { slot: s }) => {
            assert_eq!(s, slot);
            assert!(a.hung, "slot {s} busy but the device released it");
        }
        Err(CmdError::Timeout { waited_ms, .. }) => {
            assert!(a.hung, "timeout on a slot the device answered");
            assert!(*waited_ms >= timeout_ms, "gave up after {waited_ms} ms of {timeout_ms}");
            assert!(q.is_posted(*slot), "a timed-out slot stays taken");
        }
        Err(CmdError::Delivery { status, .. }) => {
            assert!(!a.hung);
            assert_eq!(*status, DeliveryStatus::from_raw(a.delivery));
            assert_ne!(a.delivery, 0);
        }
        Err(CmdError::BadSignature { .. }) => {
            assert!(!a.hung && a.delivery == 0);
            assert!(checksum && !a.signed, "signature refused although the device signed correctly");
        }
        Err(CmdError::Status { status, syndrome, .. }) => {
            assert!(!a.hung && a.delivery == 0);
            assert_eq!(*status, CmdStatus::from_raw(a.out[0]));
            assert_ne!(*status, CmdStatus::Ok);
            assert_eq!(*syndrome, u32::from_be_bytes(a.out[4..8].try_into().unwrap()));
        }
        Err(CmdError::OutputTooShort { .. } | CmdError::Malformed { .. }) => {
            assert!(!a.hung && a.delivery == 0 && a.out[0] == 0);
        }
        Err(e) => panic!("unexpected error {e:?}"),
        Ok(v) => {
            assert!(!a.hung && a.delivery == 0, "{a:?}");
            assert_eq!(a.out[0], 0, "a failed status decoded as success");
            ok(v, &a.out);
        }
    }
    if let Err(e) = res {
        let _ = e.to_string();
    }
    // A checksummed queue with a correctly signed answer never reports a bad signature.
    if checksum && a.signed && !a.hung && a.delivery == 0 {
        assert!(!matches!(res, Err(CmdError::BadSignature { .. })));
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Mode B

fn sim_faults(u: &mut Unstructured<'_>) {
    let opcodes = [
        Opcode::EnableHca,
        Opcode::QueryIssi,
        Opcode::SetIssi,
        Opcode::QueryPages,
        Opcode::ManagePages,
        Opcode::AccessReg,
        Opcode::QueryHcaCap,
        Opcode::SetHcaCap,
        Opcode::InitHca,
        Opcode::SetDriverVersion,
        Opcode::AllocUar,
        Opcode::CreateEq,
        Opcode::CreateCq,
        Opcode::AllocPd,
        Opcode::QueryVportState,
        Opcode::QueryNicVportContext,
        Opcode::DestroyCq,
        Opcode::DeallocPd,
        Opcode::DestroyEq,
        Opcode::DeallocUar,
        Opcode::TeardownHca,
        Opcode::DisableHca,
    ];
    let dev = SimDevice::new(SimConfig { checksum: flag(u), ..SimConfig::default() });
    for _ in 0..int(u, 1u8..=4) {
        let opcode = opcodes[int(u, 0usize..=opcodes.len() - 1)].raw();
        let f = match int(u, 0u8..=5) {
            0..=2 => Fault::CorruptOutput { opcode, offset: int(u, 0usize..=0x1100), value: int(u, 0u8..=u8::MAX) },
            3 => Fault::Status {
                opcode,
                status: int(u, 1u8..=u8::MAX),
                syndrome: int(u, 0u32..=u32::MAX),
                times: int(u, 0u32..=3),
            },
            4 => Fault::Delivery { opcode, status: int(u, 1u8..=0x7f) },
            _ => Fault::PageRequest { opcode, num_pages: int(u, -32i32..=32) },
        };
        dev.inject(f);
    }
    let mut d = dev.delay();
    // A pool of 16 chunks (1024 firmware pages): a corrupted page count costs megabytes, not 64 MiB, per input.
    let r: Result<Hca<mlx5_sim::SimMmio, mlx5_sim::SimDma, (), mlx5_core::hca::Fixed<16>>, _> =
        Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default());
    let mut hca = match r {
        Ok(h) => h,
        Err(e) => {
            let _ = e.to_string();
            return;
        }
    };
    if let Ok(cq) = hca.create_cq(CqAttr { cqe: int(u, 1u32..=64), ..CqAttr::default() }, &mut d) {
        if let Err(e) = hca.destroy_cq(cq, &mut d) {
            let _ = e.error.to_string();
        }
    }
    if let Ok(pd) = hca.alloc_pd(&mut d) {
        let _ = hca.dealloc_pd(pd, &mut d).map_err(|e| e.error.to_string());
    }
    let _ = hca.query_port(&mut d).map_err(|e| e.to_string());
    let _ = hca.process_events(&mut d);
    if let Err(e) = hca.teardown(&mut d) {
        let _ = e.to_string();
    }
}
