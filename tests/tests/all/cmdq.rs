//! Command queue behaviour with exact control over "firmware": a passive register file and heap DMA, with the
//! test writing the entry's ownership byte itself. End-to-end behaviour against the firmware model is in `sim.rs`.

use embedded_hal_mock::eh1::delay::{CheckedDelay, NoopDelay, Transaction};
use mlx5_core::cmd::Pas;
use mlx5_core::cmdq::{CmdError, CmdQueue, Command, SlotKind, BLOCK_STRIDE};
use mlx5_core::pages::{ManagePagesGive, ManagePagesTake};
use mlx5_core::pd::alloc_pd;
use mlx5_core::prm::{c, ifc, DeliveryStatus, MsgBuf, Opcode};
use mlx5_core::trace::{CmdRecord, CmdTrace};
use mlx5_sim::testkit::{HeapDma, RegFile};

const PAGE: u64 = 0x7000_0000;
const STATUS_OWN: usize = c::mlx5_cmd_layout::STATUS_OWN.off;

fn queue<'a, 'h>(regs: &'a RegFile<'h>, dma: &'a HeapDma) -> CmdQueue<&'a RegFile<'h>, &'a HeapDma> {
    CmdQueue::new(regs, dma, ()).unwrap()
}

/// Plays firmware for slot 0: writes `out` as the inline output and hands the entry back with `delivery`.
fn complete(dma: &HeapDma, slot: usize, out: &[u8], delivery: u8) {
    let base = PAGE + (slot as u64) * 64;
    let mut entry = dma.read(base, 64);
    entry[0x20..0x20 + out.len()].copy_from_slice(out);
    entry[STATUS_OWN] = delivery << 1;
    dma.write(base, &entry);
}

#[test]
fn timeout_backs_off_from_10us_and_reports_typed_error() {
    let (regs, dma) = (RegFile::with_cmdq(), HeapDma::scripted(&[PAGE]));
    let mut q = queue(&regs, &dma);
    q.set_timeout_ms(2);
    // Each wait equals the time waited so far (10 us first), capped at 1 ms: total 2,000 us then give up.
    // 10+10+20+40+80+160+320+640 = 1280, +1000 = 2280 >= 2000: the next check times out without sleeping.
    let steps = [10, 10, 20, 40, 80, 160, 320, 640, 1000];
    let expected: Vec<Transaction> = steps.iter().map(|&us| Transaction::delay_us(us)).collect();
    let mut delay = CheckedDelay::new(&expected);
    let err = q.exec(&mut alloc_pd(), &mut delay).unwrap_err();
    assert_eq!(err, CmdError::Timeout { opcode: Opcode::AllocPd, waited_ms: 2 });
    delay.done();
    // The entry still belongs to firmware: the slot is busy, and nothing else is written to the doorbell.
    let doorbells = regs.words().iter().filter(|w| w.0 == c::mlx5_init_seg::CMD_DBELL.off).count();
    assert_eq!(q.post(0, &alloc_pd()).unwrap_err(), CmdError::SlotBusy { slot: 0 });
    assert_eq!(regs.words().iter().filter(|w| w.0 == c::mlx5_init_seg::CMD_DBELL.off).count(), doorbells);
    // When firmware finally hands it back, the slot is usable again.
    complete(&dma, 0, &[0; 16], 0);
    q.post(0, &alloc_pd()).unwrap();
}

#[test]
fn default_timeout_is_linux_60s_unless_the_init_segment_says_otherwise() {
    let (regs, dma) = (RegFile::with_cmdq(), HeapDma::scripted(&[PAGE]));
    assert_eq!(queue(&regs, &dma).timeout_ms(), 60_000);
    let regs = RegFile::with_cmdq();
    regs.preset32(c::mlx5_init_seg::CMD_Q_INIT_TO.off, 1000);
    regs.preset32(c::mlx5_init_seg::CMD_EXEC_TO.off, 1234);
    assert_eq!(queue(&regs, &HeapDma::default()).timeout_ms(), 1234);
    // Seconds as the unit: 90 s. (A fresh register file: the first queue wrote its address over the geometry.)
    let regs = RegFile::with_cmdq();
    regs.preset32(c::mlx5_init_seg::CMD_Q_INIT_TO.off, 1000);
    regs.preset32(c::mlx5_init_seg::CMD_EXEC_TO.off, (1 << 29) | 90);
    assert_eq!(queue(&regs, &HeapDma::default()).timeout_ms(), 90_000);
}

#[test]
fn doorbell_is_one_bit_and_never_read() {
    let (regs, dma) = (RegFile::with_cmdq(), HeapDma::scripted(&[PAGE]));
    let mut q = queue(&regs, &dma);
    let pages_slot = q.slot(SlotKind::Pages);
    assert_eq!(pages_slot, 31, "the last of 32 slots is reserved for MANAGE_PAGES");
    q.post(pages_slot, &ManagePagesGive { function_id: 0, pages: Pas::List(&[0x1000]) }).unwrap();
    q.post(0, &alloc_pd()).unwrap();
    let bells: Vec<u32> = regs.words().iter().filter(|w| w.0 == c::mlx5_init_seg::CMD_DBELL.off).map(|w| w.1).collect();
    assert_eq!(bells, [1 << 31, 1]);
    // The queue address went in high word first, then the low word.
    let w = regs.words();
    assert_eq!(w[0], (c::mlx5_init_seg::CMDQ_ADDR_H.off, 0));
    assert_eq!(w[1], (c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off, PAGE as u32));
}

#[test]
fn delivery_status_is_a_typed_error() {
    let (regs, dma) = (RegFile::with_cmdq(), HeapDma::scripted(&[PAGE]));
    let mut q = queue(&regs, &dma);
    let mut cmd = alloc_pd();
    q.post(0, &cmd).unwrap();
    complete(&dma, 0, &[0; 16], DeliveryStatus::Tok.raw());
    assert_eq!(
        q.finish(0, &mut cmd).unwrap_err(),
        CmdError::Delivery { opcode: Opcode::AllocPd, status: DeliveryStatus::Tok }
    );
    // An unknown delivery code keeps its value.
    q.post(0, &cmd).unwrap();
    complete(&dma, 0, &[0; 16], 0x55);
    assert_eq!(
        q.finish(0, &mut cmd).unwrap_err(),
        CmdError::Delivery { opcode: Opcode::AllocPd, status: DeliveryStatus::Unknown(0x55) }
    );
}

#[test]
fn output_claiming_more_pages_than_it_holds_is_rejected() {
    let (regs, dma) = (RegFile::with_cmdq(), HeapDma::scripted(&[PAGE]));
    let mut q = queue(&regs, &dma);
    let mut pages = [0u64; 1];
    let mut cmd = ManagePagesTake { function_id: 0, pages: &mut pages[..] };
    let slot = q.slot(SlotKind::Pages);
    q.post(slot, &cmd).unwrap();
    let mut out = [0u8; 16];
    out.set(ifc::manage_pages_out::OUTPUT_NUM_ENTRIES, 1000);
    complete(&dma, slot as usize, &out, 0);
    assert_eq!(
        q.finish(slot, &mut cmd).unwrap_err(),
        CmdError::OutputTooShort { opcode: Opcode::ManagePages, needed: 16 + 8000, got: 24 }
    );
}

#[test]
fn bad_arguments_and_device_state_are_typed_errors() {
    let regs = RegFile::with_cmdq();
    regs.preset32(c::mlx5_init_seg::CMDIF_REV_FW_SUB.off, 4 << 16);
    assert_eq!(CmdQueue::new(&regs, &HeapDma::default(), ()).unwrap_err(), CmdError::CmdIfRev { found: 4 });
    let regs = RegFile::with_cmdq();
    regs.preset32(c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off, (6 << 4) | 7);
    assert_eq!(
        CmdQueue::new(&regs, &HeapDma::default(), ()).unwrap_err(),
        CmdError::BadQueueGeometry { log_sz: 6, log_stride: 7 }
    );

    let (regs, dma) = (RegFile::with_cmdq(), HeapDma::scripted(&[PAGE]));
    let mut q = queue(&regs, &dma);
    assert_eq!(q.post(40, &alloc_pd()).unwrap_err(), CmdError::BadSlot { slot: 40 });
    q.set_device_down(true);
    let before = regs.words().len();
    assert_eq!(q.exec(&mut alloc_pd(), &mut NoopDelay).unwrap_err(), CmdError::DeviceDown { opcode: Opcode::AllocPd });
    assert_eq!(regs.words().len(), before, "no doorbell for a device that is down");
}

/// With checksums on, the entry XORs to 0xff and every mailbox block's control part and whole block do too.
#[test]
fn signatures_cover_entry_and_blocks() {
    let (regs, dma) = (RegFile::with_cmdq(), HeapDma::scripted(&[PAGE, 0x5000_0000]));
    let mut q = queue(&regs, &dma);
    q.set_checksum(true);
    let pages: Vec<u64> = (0..100).map(|i| 0x1000_0000 + i * 4096).collect();
    q.post(q.slot(SlotKind::Pages), &ManagePagesGive { function_id: 0, pages: Pas::List(&pages) }).unwrap();
    let entry = dma.read(PAGE + 31 * 64, 64);
    assert_eq!(entry.iter().fold(0, |a, b| a ^ b), 0xff);
    let nblocks = (16 + 800usize - 16).div_ceil(512);
    assert_eq!(nblocks, 2);
    for i in 0..nblocks {
        let block = dma.read(0x5000_0000 + (i * BLOCK_STRIDE) as u64, c::mlx5_cmd_prot_block::SIZE);
        assert_eq!(block[512..575].iter().fold(0, |a, b| a ^ b), 0xff, "ctrl_sig of block {i}");
        assert_eq!(block.iter().fold(0, |a, b| a ^ b), 0xff, "sig of block {i}");
        let num = u32::from_be_bytes(block[c::mlx5_cmd_prot_block::BLOCK_NUM.off..][..4].try_into().unwrap());
        assert_eq!(num, i as u32);
    }
}

#[derive(Default)]
struct Lines(Vec<String>);

impl CmdTrace for Lines {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        let mut s = String::new();
        rec.write_json(&mut s).unwrap();
        self.0.push(s);
    }
}

#[test]
fn trace_carries_full_input_including_mailboxes() {
    let (regs, dma) = (RegFile::with_cmdq(), HeapDma::scripted(&[PAGE]));
    let mut q = CmdQueue::new(&regs, &dma, Lines::default()).unwrap();
    let pages: Vec<u64> = (0..70).map(|i| 0x1000_0000 + i * 4096).collect();
    let mut cmd = ManagePagesGive { function_id: 0, pages: Pas::List(&pages) };
    let slot = q.slot(SlotKind::Pages);
    q.post(slot, &cmd).unwrap();
    complete(&dma, slot as usize, &[0; 16], 0);
    q.finish(slot, &mut cmd).unwrap();
    let line = &q.tracer().0[0];
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    assert_eq!(v["opcode"], "MANAGE_PAGES");
    assert_eq!(v["status"], "OK");
    let input = v["input"].as_str().unwrap();
    assert_eq!(input.len(), 2 * cmd.inlen());
    // The last page address is in the second mailbox block and must appear at the end of the input.
    assert!(input.ends_with(&format!("{:016x}", pages[69])));
}
