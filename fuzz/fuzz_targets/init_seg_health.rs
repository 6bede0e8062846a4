//! The initialization segment as the device presents it: firmware and command-interface revisions, the command
//! queue geometry in `cmdq_addr_l_sz`, the timeout registers, the `initializing` bit (clearing after some reads,
//! or never), the health buffer and the heartbeat.
//!
//! Asserted: no panic; `HealthBuffer::read` returns the buffer's bytes; `Health::poll` over a sequence of register
//! states reports exactly Linux's fatal sensors in Linux's order (all-ones reads, NIC interface disabled or in
//! reset, a health syndrome) and a heartbeat stuck for `MAX_MISSES` polls, and nothing otherwise; `CmdQueue::new`
//! accepts exactly the revisions and geometries that fit, with typed errors naming the values, and a timeout that
//! is the register's value in its unit (or Linux's default); `Hca::bring_up` over the segment and a device that
//! answers commands with the input's status bytes fails only with typed errors at the right step (device gone,
//! firmware init timeout no earlier than the timeout and no later than one poll after it, command queue errors),
//! and a failed bring-up whose cleanup met no error has returned every DMA allocation.
#![no_main]

use std::cell::{Cell, RefCell};

use libfuzzer_sys::fuzz_target;
use mlx5_core::cmdq::{iseg_timeout_ms, CmdError, CmdQueue, CMD_IF_REV, DEFAULT_CMD_TIMEOUT_MS};
use mlx5_core::hca::{
    BringupError, Config, Error, Hca, Step, FW_INIT_TIMEOUT_MS, FW_PRE_INIT_TIMEOUT_MS, FW_PRE_INIT_WAIT_MS,
};
use mlx5_core::health::{Health, HealthBuffer, HealthFailure};
use mlx5_core::prm::{c, consts, HealthSyndrome};
use mlx5_fuzz::{bytes, int, HeapDma, RegFile, Unstructured, VDelay};

use c::mlx5_init_seg as iseg;

const HB: usize = iseg::HEALTH.off;

/// The registers the driver reads during bring-up and health polling.
#[derive(Debug, Clone, Copy)]
struct Seg {
    fw_rev: u32,
    cmdif_rev_fw_sub: u32,
    cmdq_addr_l_sz: u32,
    initializing: u32,
    cmd_exec_to: u32,
    cmd_q_init_to: u32,
    health: [u8; 64],
    counter: u32,
}

impl Seg {
    fn arbitrary(u: &mut Unstructured<'_>) -> Self {
        let mut s = Seg {
            fw_rev: int(u, 0u32..=u32::MAX),
            cmdif_rev_fw_sub: int(u, 0u32..=u32::MAX),
            cmdq_addr_l_sz: int(u, 0u32..=u32::MAX),
            initializing: int(u, 0u32..=u32::MAX),
            cmd_exec_to: int(u, 0u32..=u32::MAX),
            cmd_q_init_to: int(u, 0u32..=u32::MAX),
            health: bytes::<64>(u),
            counter: int(u, 0u32..=u32::MAX),
        };
        // Mostly a segment the command queue accepts, so bring-up gets further.
        if int(u, 0u8..=3) != 3 {
            s.cmdif_rev_fw_sub = (CMD_IF_REV << 16) | (s.cmdif_rev_fw_sub & 0xffff);
            s.cmdq_addr_l_sz = (s.cmdq_addr_l_sz & !0xff) | (int(u, 1u32..=5) << 4) | 6;
        }
        s
    }

    fn load(&self, bar: &RegFile<'_>) {
        bar.preset32(iseg::FW_REV.off, self.fw_rev);
        bar.preset32(iseg::CMDIF_REV_FW_SUB.off, self.cmdif_rev_fw_sub);
        bar.preset32(iseg::CMDQ_ADDR_L_SZ.off, self.cmdq_addr_l_sz);
        bar.preset32(iseg::INITIALIZING.off, self.initializing);
        bar.preset32(iseg::CMD_EXEC_TO.off, self.cmd_exec_to);
        bar.preset32(iseg::CMD_Q_INIT_TO.off, self.cmd_q_init_to);
        bar.load(HB, &self.health);
        bar.preset32(iseg::HEALTH_COUNTER.off, self.counter);
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let seg = Seg::arbitrary(&mut u);
    health(&mut u, seg);
    cmdq(seg);
    bring_up(&mut u, seg);
});

fn be32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes(b[off..off + 4].try_into().unwrap())
}

/// Linux's fatal sensors over a register image (`check_fatal_sensors` plus the health syndrome).
fn fatal(fw_ver: u32, l_sz: u32, h: &[u8; 64]) -> Option<HealthFailure> {
    use c::health_buffer as hb;
    if fw_ver == u32::MAX {
        return Some(HealthFailure::DeviceGone);
    }
    match (l_sz >> consts::MLX5_NIC_IFC_OFFSET) & 7 {
        consts::MLX5_INITIAL_SEG_NIC_INTERFACE_DISABLED => return Some(HealthFailure::NicDisabled),
        consts::MLX5_INITIAL_SEG_NIC_INTERFACE_SW_RESET => return Some(HealthFailure::NicSwReset),
        _ => {}
    }
    let synd = h[hb::SYND.off];
    let rs = h[hb::RFR_SEVERITY.off];
    // `sensor_fw_synd_rfr`: a syndrome is fatal only when firmware also asks for the recovery flow.
    (synd != 0 && rs >> consts::MLX5_RFR_BIT_OFFSET != 0).then(|| {
        let valid = rs & consts::MLX5_SEVERITY_VALID_MASK != 0;
        HealthFailure::Syndrome {
            synd: HealthSyndrome::from_raw(synd),
            ext_synd: u16::from_be_bytes([h[hb::EXT_SYND.off], h[hb::EXT_SYND.off + 1]]),
            severity: if valid { rs & consts::MLX5_SEVERITY_MASK } else { 0 },
            rfr: rs >> consts::MLX5_RFR_BIT_OFFSET != 0,
        }
    })
}

fn health(u: &mut Unstructured<'_>, seg: Seg) {
    use c::health_buffer as hb;
    let bar = RegFile::new();
    seg.load(&bar);
    let mut h = Health::new();
    let mut prev: Option<u32> = None;
    let mut misses = 0u32;
    let (mut l_sz, mut buf, mut counter) = (seg.cmdq_addr_l_sz, seg.health, seg.counter);
    let fw_ver = be32(&seg.health, hb::FW_VER.off);
    for i in 0..int(u, 1u8..=12) {
        // Between polls: the heartbeat moves or not, the syndrome or NIC state may change.
        match int(u, 0u8..=7) {
            0..=3 => counter = counter.wrapping_add(int(u, 1u32..=3)),
            4 => buf[hb::SYND.off] = int(u, 0u8..=u8::MAX),
            5 => l_sz = int(u, 0u32..=u32::MAX),
            _ => {}
        }
        bar.preset32(iseg::CMDQ_ADDR_L_SZ.off, l_sz);
        bar.load(HB, &buf);
        bar.preset32(iseg::HEALTH_COUNTER.off, counter);

        let r = HealthBuffer::read(&bar);
        assert_eq!(r.fw_ver, be32(&buf, hb::FW_VER.off));
        assert_eq!(r.hw_id, be32(&buf, hb::HW_ID.off));
        assert_eq!(r.time, be32(&buf, hb::TIME.off));
        assert_eq!(r.assert_exit_ptr, be32(&buf, hb::ASSERT_EXIT_PTR.off));
        assert_eq!(r.assert_callra, be32(&buf, hb::ASSERT_CALLRA.off));
        assert_eq!((r.irisc_index, r.synd), (buf[hb::IRISC_INDEX.off], buf[hb::SYND.off]));
        assert_eq!(r.ext_synd, u16::from_be_bytes([buf[hb::EXT_SYND.off], buf[hb::EXT_SYND.off + 1]]));
        assert_eq!(r.counter, counter);
        assert!(r.severity <= 7);
        assert_eq!(r.valid, buf[hb::RFR_SEVERITY.off] & consts::MLX5_SEVERITY_VALID_MASK != 0);
        if !r.valid {
            assert_eq!(r.severity, 0);
        }

        let want_fatal = fatal(fw_ver, l_sz, &buf);
        assert_eq!(Health::check_fatal(&bar), want_fatal, "poll {i}");
        let got = h.poll(&bar);
        let want = match want_fatal {
            Some(f) => Err(f),
            None => {
                misses = if prev == Some(counter) { misses + 1 } else { 0 };
                prev = Some(counter);
                if misses >= consts::MAX_MISSES {
                    Err(HealthFailure::Stalled { counter, misses })
                } else {
                    Ok(())
                }
            }
        };
        assert_eq!(got, want, "poll {i}");
        if let Err(f) = got {
            assert!(!f.to_string().is_empty());
        }
        assert_eq!(h.polls(), u32::from(i) + 1);
    }
}

/// What `CmdQueue::new` must say about the segment.
fn expect_cmdq(seg: &Seg) -> Result<u32, CmdError> {
    let rev = seg.cmdif_rev_fw_sub >> 16;
    if rev != CMD_IF_REV {
        return Err(CmdError::CmdIfRev { found: rev });
    }
    let (log_sz, log_stride) = (((seg.cmdq_addr_l_sz >> 4) & 0xf) as u8, (seg.cmdq_addr_l_sz & 0xf) as u8);
    let fits = (1..=5).contains(&log_sz) && log_stride >= 6 && u32::from(log_sz) + u32::from(log_stride) <= 12;
    if !fits {
        return Err(CmdError::BadQueueGeometry { log_sz, log_stride });
    }
    let to = if seg.cmd_q_init_to != 0 { iseg_timeout_ms(seg.cmd_exec_to).min(u64::from(u32::MAX)) as u32 } else { 0 };
    Ok(if to == 0 { DEFAULT_CMD_TIMEOUT_MS } else { to })
}

fn cmdq(seg: Seg) {
    // SAFETY: declared before everything that holds its regions, so dropped last.
    let mem = unsafe { HeapDma::for_fuzzing(None) };
    let bar = RegFile::new();
    seg.load(&bar);
    let r = CmdQueue::new(&bar, &mem, ());
    match (expect_cmdq(&seg), &r) {
        (Ok(to), Ok(q)) => {
            assert_eq!(q.timeout_ms(), to);
            assert_eq!(q.num_slots(), 1 << ((seg.cmdq_addr_l_sz >> 4) & 0xf));
            // The queue page went to the device high word first, then the low word.
            let w = bar.writes();
            assert_eq!((w[0].off, w[1].off), (iseg::CMDQ_ADDR_H.off, iseg::CMDQ_ADDR_L_SZ.off));
            assert_eq!(((w[0].value << 32) | w[1].value), q.iova());
            assert_eq!(q.iova() % 4096, 0);
        }
        (Err(want), Err(got)) => {
            assert_eq!(*got, want);
            assert_eq!(mem.outstanding(), 0, "nothing allocated for a refused queue");
            assert!(bar.writes().is_empty(), "nothing written to a refused device");
        }
        (want, got) => panic!("CmdQueue::new: expected {want:?}, got {:?}", got.as_ref().map(|_| ())),
    }
}

fn bring_up(u: &mut Unstructured<'_>, mut seg: Seg) {
    // `initializing` reads set for the first `clears_after` reads (forever when `None`), and set again from read
    // `relapse` on. A firmware that never finishes initializing is waited for as long as the segment says
    // (Linux does the same); that wait is kept short enough to fuzz.
    let clears_after: Option<u64> = if int(u, 0u8..=7) == 7 { None } else { Some(u64::from(int(u, 0u8..=40))) };
    let relapse: Option<u64> = match clears_after {
        Some(n) if int(u, 0u8..=3) == 3 => Some(n + u64::from(int(u, 1u8..=4))),
        _ => None,
    };
    if relapse.is_some() {
        seg.cmd_q_init_to &= 0xffff;
    }
    let statuses: Vec<u8> = (0..int(u, 0u8..=40)).map(|_| int(u, 0u8..=u8::MAX)).collect();
    // SAFETY: declared before everything that holds its regions, so dropped last.
    let mem = unsafe { HeapDma::for_fuzzing(None) };
    mem.set_budget(Some(64));
    let reads = Cell::new(0u64);
    let page = RefCell::new((0u32, 0u32));
    let answered = Cell::new(0usize);
    let init_bit = 1u32 << 31;
    let bar = RegFile::new();
    seg.load(&bar);
    bar.on_read32(|off, v| {
        if off != iseg::INITIALIZING.off {
            return v;
        }
        reads.set(reads.get() + 1);
        let k = reads.get();
        match (clears_after, relapse) {
            (_, Some(r)) if k > r => v | init_bit,
            (Some(n), _) if k > n => v & !init_bit,
            _ => v | init_bit,
        }
    });
    // A device that answers every command at once: delivery OK, the input's status bytes (0 when they run out),
    // all other output bytes zero.
    bar.on_write32(|off, v| {
        if off == iseg::CMDQ_ADDR_H.off {
            page.borrow_mut().0 = v;
        } else if off == iseg::CMDQ_ADDR_L_SZ.off {
            page.borrow_mut().1 = v;
        } else if off == iseg::CMD_DBELL.off {
            let (hi, lo) = *page.borrow();
            let base = (u64::from(hi) << 32) | u64::from(lo & !0xfff);
            let stride = 1u64 << (seg.cmdq_addr_l_sz & 0xf);
            for slot in 0..32 {
                if v & (1 << slot) == 0 {
                    continue;
                }
                let n = answered.get();
                answered.set(n + 1);
                let status = statuses.get(n).copied().unwrap_or(0);
                let e = base + slot * stride;
                let out = c::mlx5_cmd_layout::OUT.off as u64;
                mem.try_write(e + out, &[status, 0, 0, 0, 0, 0, 0, 0]);
                mem.try_write(e + c::mlx5_cmd_layout::STATUS_OWN.off as u64, &[0]);
            }
        }
    });
    let mut d = VDelay::default();
    let r: Result<Hca<&RegFile<'_>, &HeapDma>, BringupError> = Hca::bring_up(&bar, &mem, (), &mut d, Config::default());
    let gone = seg.fw_rev == u32::MAX;
    match r {
        Ok(hca) => {
            // Linux: `fw_rev_maj = fw_rev & 0xffff`, `fw_rev_min = fw_rev >> 16`, `fw_rev_sub = cmdif_rev_fw_sub
            // & 0xffff`.
            let (major, minor) = (seg.fw_rev as u16, (seg.fw_rev >> 16) as u16);
            assert_eq!(hca.fw_rev(), (major, minor, seg.cmdif_rev_fw_sub as u16));
            let _ = hca.teardown(&mut d);
        }
        Err(e) => {
            assert!(!e.to_string().is_empty());
            let waited_ms = d.ns / 1_000_000;
            match (e.step, e.error) {
                (Step::PreInitializing, Error::Health(HealthFailure::DeviceGone)) => {
                    assert!(gone, "device gone, but fw_rev reads {:#x}", seg.fw_rev)
                }
                (Step::PreInitializing, Error::FwInitTimeout { waited_ms: w, .. }) => {
                    assert!(clears_after.is_none_or(|n| n > u64::from(FW_PRE_INIT_TIMEOUT_MS / FW_PRE_INIT_WAIT_MS)));
                    assert!((FW_PRE_INIT_TIMEOUT_MS..FW_PRE_INIT_TIMEOUT_MS + FW_PRE_INIT_WAIT_MS).contains(&w));
                    assert_eq!(u64::from(w), waited_ms);
                }
                (Step::PreInitializing, other) => panic!("pre-initializing failed with {other:?}"),
                (Step::CmdqInit, Error::Cmd(err)) => {
                    assert_eq!(Err(err), expect_cmdq(&seg));
                    assert_eq!(mem.outstanding(), 0);
                }
                (Step::CmdqInit, other) => panic!("command queue init failed with {other:?}"),
                (Step::Initializing, Error::FwInitTimeout { waited_ms: w, .. }) => {
                    let limit = if seg.cmd_q_init_to != 0 {
                        iseg_timeout_ms(seg.cmd_q_init_to).min(u64::from(u32::MAX))
                    } else {
                        u64::from(FW_INIT_TIMEOUT_MS)
                    };
                    assert!((limit..limit + u64::from(FW_PRE_INIT_WAIT_MS)).contains(&u64::from(w)));
                }
                (Step::Initializing, Error::Health(HealthFailure::DeviceGone)) => assert!(gone),
                (Step::Initializing, other) => panic!("initializing failed with {other:?}"),
                (_, _) => {}
            }
            // The device answered every command, so a cleanup that met no error left nothing behind.
            if e.cleanup.is_none() && e.step != Step::PreInitializing {
                assert_eq!(mem.outstanding(), 0, "failed bring-up ({e}) kept DMA memory");
            }
        }
    }
}
