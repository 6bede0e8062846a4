//! A minimal hand-rolled command submitter for the simulator's own tests: it builds entries and mailbox chains
//! in DMA memory through the public API, exactly as a driver would, with every offset from the PRM layouts.

// Helpers are shared by several test modules; not every one uses all of them.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use mlx5_core::hal::{Dma, DmaRegion, Mmio};
use mlx5_core::prm::{c, consts, ifc, MsgBuf};

use crate::{Mode, SimConfig, SimDevice, SimDma, SimMmio};

/// Copies `data` into `r` at `off`.
pub(crate) fn put(r: &DmaRegion, off: usize, data: &[u8]) {
    let p = r.ptr_at(off, data.len());
    // SAFETY: `ptr_at` bounds-checked the range inside the live region; the test owns the memory (the device only
    // touches it while a command is outstanding, and inline mode runs on this thread).
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
}

/// Copies `out.len()` bytes of `r` at `off` into `out`.
pub(crate) fn get(r: &DmaRegion, off: usize, out: &mut [u8]) {
    let p = r.ptr_at(off, out.len());
    // SAFETY: as in `put`; reads happen after the command completed (owner bit back to software).
    unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
}

fn xor8(b: &[u8]) -> u8 {
    b.iter().fold(0, |a, x| a ^ x)
}

/// A posted command: its slot and mailbox chains.
#[derive(Debug)]
pub(crate) struct Posted {
    pub slot: u8,
    pub in_blocks: Vec<DmaRegion>,
    pub out_blocks: Vec<DmaRegion>,
    pub outlen: usize,
}

#[derive(Debug)]
pub(crate) struct Harness {
    pub dev: SimDevice,
    pub mmio: SimMmio,
    pub dma: SimDma,
    pub q: DmaRegion,
    pub token: u8,
    pub checksum: bool,
    pub stride: u32,
    pub threaded: bool,
    /// Regions given to firmware by `give_pages`, so a test can free everything.
    pub page_regions: Vec<DmaRegion>,
}

const BLK: usize = c::mlx5_cmd_prot_block::SIZE;
const DATA: usize = consts::MLX5_CMD_DATA_BLOCK_SIZE as usize;
const INLINE: usize = c::mlx5_cmd_layout::IN.len;

impl Harness {
    pub fn new(cfg: SimConfig) -> Self {
        let checksum = cfg.checksum;
        let stride = u32::from(cfg.log_cmdq_stride);
        let threaded = cfg.mode == Mode::Threaded;
        let dev = SimDevice::new(cfg);
        let mmio = dev.mmio();
        let dma = dev.dma();
        let q = dma.alloc(4096, 4096).unwrap();
        mmio.write32(c::mlx5_init_seg::CMDQ_ADDR_H.off, (q.iova >> 32) as u32);
        mmio.write32(c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off, q.iova as u32);
        Self { dev, mmio, dma, q, token: 0, checksum, stride, threaded, page_regions: Vec::new() }
    }

    pub fn inline() -> Self {
        Self::new(SimConfig::default())
    }

    pub fn entry_off(&self, slot: u8) -> usize {
        (slot as usize) << self.stride
    }

    /// Allocates and links `n` blocks, filling data from `msg[16..]` (input) or leaving it zero (output).
    fn chain(&self, n: usize, token: u8, msg: Option<&[u8]>) -> Vec<DmaRegion> {
        use c::mlx5_cmd_prot_block as b;
        let blocks: Vec<DmaRegion> = (0..n).map(|_| self.dma.alloc(BLK, BLK.next_power_of_two()).unwrap()).collect();
        for (k, r) in blocks.iter().enumerate() {
            let mut blk = vec![0u8; BLK];
            if let Some(m) = msg {
                let start = INLINE + k * DATA;
                let end = (start + DATA).min(m.len());
                blk[..end - start].copy_from_slice(&m[start..end]);
            }
            let next = blocks.get(k + 1).map_or(0, |n| n.iova);
            blk.write_u64(b::NEXT.off, next);
            blk.write_u32(b::BLOCK_NUM.off, k as u32);
            blk[b::TOKEN.off] = token;
            if self.checksum {
                blk[b::CTRL_SIG.off] = !xor8(&blk[b::DATA.end()..b::CTRL_SIG.off]);
                blk[b::SIG.off] = !xor8(&blk[..b::SIG.off]);
            }
            put(r, 0, &blk);
        }
        blocks
    }

    /// Writes a command into `slot` (owner = hardware) without ringing.
    pub fn post(&mut self, slot: u8, input: &[u8], outlen: usize) -> Posted {
        use c::mlx5_cmd_layout as l;
        self.token = self.token.wrapping_add(1).max(1);
        let token = self.token;
        let nb = |len: usize| len.saturating_sub(INLINE).div_ceil(DATA);
        let in_blocks = self.chain(nb(input.len()), token, Some(input));
        let out_blocks = self.chain(nb(outlen), token, None);
        let mut e = [0u8; l::SIZE];
        e[l::TYPE.off] = consts::MLX5_PCI_CMD_XPORT as u8;
        e.write_u32(l::INLEN.off, input.len() as u32);
        e.write_u64(l::IN_PTR.off, in_blocks.first().map_or(0, |r| r.iova));
        let n = input.len().min(INLINE);
        e[l::IN.off..l::IN.off + n].copy_from_slice(&input[..n]);
        e.write_u64(l::OUT_PTR.off, out_blocks.first().map_or(0, |r| r.iova));
        e.write_u32(l::OUTLEN.off, outlen as u32);
        e[l::TOKEN.off] = token;
        e[l::STATUS_OWN.off] = consts::CMD_OWNER_HW as u8;
        if self.checksum {
            e[l::SIG.off] = !xor8(&e);
        }
        put(&self.q, self.entry_off(slot), &e);
        Posted { slot, in_blocks, out_blocks, outlen }
    }

    /// Rewrites the entry of `slot` through `f` (to break it on purpose), fixing nothing up.
    pub fn patch_entry(&self, slot: u8, f: impl FnOnce(&mut [u8])) {
        let mut e = [0u8; c::mlx5_cmd_layout::SIZE];
        get(&self.q, self.entry_off(slot), &mut e);
        f(&mut e);
        put(&self.q, self.entry_off(slot), &e);
    }

    pub fn ring(&self, slot: u8) {
        self.mmio.wmb();
        self.mmio.write32(c::mlx5_init_seg::CMD_DBELL.off, 1 << slot);
    }

    pub fn status_own(&self, slot: u8) -> u8 {
        self.q.read_volatile_u8(self.entry_off(slot) + c::mlx5_cmd_layout::STATUS_OWN.off)
    }

    /// Whether firmware handed `slot` back: checked once in inline mode, polled for up to 10 s in threaded mode.
    pub fn wait(&self, slot: u8) -> bool {
        let start = Instant::now();
        while self.status_own(slot) & 1 == 1 {
            if !self.threaded || start.elapsed() > Duration::from_secs(10) {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        true
    }

    /// The output message of a completed command.
    pub fn output(&self, p: &Posted) -> Vec<u8> {
        use c::mlx5_cmd_layout as l;
        let mut out = vec![0u8; p.outlen.max(INLINE)];
        let mut head = [0u8; INLINE];
        get(&self.q, self.entry_off(p.slot) + l::OUT.off, &mut head);
        out[..INLINE].copy_from_slice(&head);
        for (k, r) in p.out_blocks.iter().enumerate() {
            let start = INLINE + k * DATA;
            let n = DATA.min(p.outlen - start);
            get(r, 0, &mut out[start..start + n]);
        }
        out
    }

    pub fn release(&self, p: Posted) {
        for r in p.in_blocks.into_iter().chain(p.out_blocks) {
            // SAFETY: the blocks came from this allocator and the command has completed.
            unsafe { self.dma.free(r) };
        }
    }

    /// Posts on slot 0, rings, waits, and returns (delivery status, output).
    pub fn exec(&mut self, input: &[u8], outlen: usize) -> (u8, Vec<u8>) {
        let p = self.post(0, input, outlen);
        self.ring(0);
        assert!(self.wait(0), "command still owned by hardware");
        let so = self.status_own(0);
        let out = self.output(&p);
        self.release(p);
        (so >> 1, out)
    }

    /// Executes a command expected to be delivered; returns (status, syndrome, output).
    pub fn cmd(&mut self, input: &[u8], outlen: usize) -> (u8, u32, Vec<u8>) {
        let (d, out) = self.exec(input, outlen);
        assert_eq!(d, 0, "delivery status");
        (MsgBuf::get(&out[..], ifc::mbox_out::STATUS) as u8, MsgBuf::get(&out[..], ifc::mbox_out::SYNDROME), out)
    }

    /// A MANAGE_PAGES(give) input for `n` fresh pages (one region, `n` * 4 KiB, kept in `page_regions`).
    pub fn give_input(&mut self, n: u32) -> Vec<u8> {
        use ifc::manage_pages_in as i;
        let pages = self.dma.alloc((n as usize * 4096).max(1), 4096).unwrap();
        let mut inp = vec![0u8; i::PAS.byte_off() + n as usize * 8];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES);
        inp.set(i::OP_MOD, consts::MLX5_PAGES_GIVE);
        inp.set(i::INPUT_NUM_ENTRIES, n);
        for k in 0..n {
            inp.set64(i::PAS.elem(k), pages.iova + u64::from(k) * 4096);
        }
        self.page_regions.push(pages);
        inp
    }

    /// Gives `n` fresh pages to firmware.
    pub fn give_pages(&mut self, n: u32) -> (u8, u32) {
        let inp = self.give_input(n);
        let (s, syn, _) = self.cmd(&inp, ifc::manage_pages_out::SIZE_BYTES);
        (s, syn)
    }

    /// MANAGE_PAGES(take) for up to `n` pages; returns (status, pages returned).
    pub fn take_pages(&mut self, n: u32) -> (u8, Vec<u64>) {
        use ifc::manage_pages_in as i;
        let mut inp = vec![0u8; i::SIZE_BYTES];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES);
        inp.set(i::OP_MOD, consts::MLX5_PAGES_TAKE);
        inp.set(i::INPUT_NUM_ENTRIES, n);
        let outlen = ifc::manage_pages_out::PAS.byte_off() + 8 * n as usize;
        let (s, _, out) = self.cmd(&inp, outlen);
        let count = MsgBuf::get(&out[..], ifc::manage_pages_out::OUTPUT_NUM_ENTRIES).min(n);
        (s, (0..count).map(|k| out.get64(ifc::manage_pages_out::PAS.elem(k))).collect())
    }

    pub fn alloc_uar(&mut self) -> u32 {
        let (s, _, out) = self.simple(consts::MLX5_CMD_OP_ALLOC_UAR, 0, 16, 16);
        assert_eq!(s, 0);
        MsgBuf::get(&out[..], ifc::alloc_uar_out::UAR)
    }

    /// CREATE_EQ with `2^log_size` entries on UAR page `uar`, subscribed to `mask` (event_bitmask word 0).
    /// Every owner byte is pre-set to `MLX5_EQE_OWNER_INIT_VAL`, as the driver does. Returns (status, eqn, buffer).
    pub fn create_eq(&mut self, uar: u32, log_size: u32, mask: u64) -> (u8, u8, DmaRegion) {
        use ifc::create_eq_in as i;
        let ctx = i::EQ_CONTEXT_ENTRY;
        let nent = 1usize << log_size;
        let bytes = (c::mlx5_eqe::SIZE * nent).next_multiple_of(4096);
        let buf = self.dma.alloc(bytes, 4096).unwrap();
        for k in 0..nent {
            buf.write_volatile_u8(
                k * c::mlx5_eqe::SIZE + c::mlx5_eqe::OWNER.off,
                consts::MLX5_EQE_OWNER_INIT_VAL as u8,
            );
        }
        let npages = bytes / 4096;
        let mut inp = vec![0u8; i::PAS.byte_off() + 8 * npages];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_EQ);
        inp.set(ifc::eqc::LOG_EQ_SIZE.at(ctx), log_size);
        inp.set(ifc::eqc::UAR_PAGE.at(ctx), uar);
        inp.set64(i::EVENT_BITMASK.elem(0), mask);
        for k in 0..npages {
            inp.set64(i::PAS.elem(k as u32), buf.iova + 4096 * k as u64);
        }
        let (s, _, out) = self.cmd(&inp, ifc::create_eq_out::SIZE_BYTES);
        (s, MsgBuf::get(&out[..], ifc::create_eq_out::EQ_NUMBER) as u8, buf)
    }

    /// EQE `idx` of an EQ buffer.
    pub fn eqe(buf: &DmaRegion, idx: usize) -> [u8; c::mlx5_eqe::SIZE] {
        let mut e = [0u8; c::mlx5_eqe::SIZE];
        get(buf, idx * c::mlx5_eqe::SIZE, &mut e);
        e
    }

    /// Writes the EQ doorbell of `eqn` in UAR page `uar`: consumer index `ci`, arming when `arm`.
    pub fn eq_doorbell(&self, uar: u32, eqn: u8, ci: u32, arm: bool) {
        let off = SimMmio::uar_offset(uar) + consts::MLX5_EQ_DOORBELL_OFFSET as usize + if arm { 0 } else { 8 };
        self.mmio.write32(off, (ci & 0xff_ffff) | u32::from(eqn) << 24);
    }

    /// QUERY_PAGES on `slot`, without waiting for other slots (inline mode).
    pub fn query_pages_on(&mut self, slot: u8, op_mod: u32) -> i32 {
        let mut inp = vec![0u8; ifc::query_pages_in::SIZE_BYTES];
        inp.set(ifc::query_pages_in::OPCODE, consts::MLX5_CMD_OP_QUERY_PAGES);
        inp.set(ifc::query_pages_in::OP_MOD, op_mod);
        let p = self.post(slot, &inp, ifc::query_pages_out::SIZE_BYTES);
        self.ring(slot);
        assert!(self.wait(slot), "QUERY_PAGES still owned by hardware");
        let out = self.output(&p);
        self.release(p);
        MsgBuf::get(&out[..], ifc::query_pages_out::NUM_PAGES) as i32
    }

    pub fn query_pages(&mut self, op_mod: u32) -> i32 {
        let mut inp = vec![0u8; ifc::query_pages_in::SIZE_BYTES];
        inp.set(ifc::query_pages_in::OPCODE, consts::MLX5_CMD_OP_QUERY_PAGES);
        inp.set(ifc::query_pages_in::OP_MOD, op_mod);
        let (s, _, out) = self.cmd(&inp, ifc::query_pages_out::SIZE_BYTES);
        assert_eq!(s, 0);
        MsgBuf::get(&out[..], ifc::query_pages_out::NUM_PAGES) as i32
    }

    /// A command with only a header: opcode and op_mod, `inlen`/`outlen` from the layouts.
    pub fn simple(&mut self, opcode: u32, op_mod: u32, inlen: usize, outlen: usize) -> (u8, u32, Vec<u8>) {
        let mut inp = vec![0u8; inlen];
        inp.set(ifc::mbox_in::OPCODE, opcode);
        inp.set(ifc::mbox_in::OP_MOD, op_mod);
        self.cmd(&inp, outlen)
    }

    pub fn enable_hca(&mut self) -> u8 {
        self.simple(consts::MLX5_CMD_OP_ENABLE_HCA, 0, ifc::enable_hca_in::SIZE_BYTES, ifc::enable_hca_out::SIZE_BYTES)
            .0
    }

    /// ENABLE_HCA, boot and init pages, INIT_HCA.
    pub fn bring_up(&mut self) {
        assert_eq!(self.enable_hca(), 0);
        let boot = self.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES);
        assert_eq!(self.give_pages(boot as u32), (0, 0));
        let init = self.query_pages(consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES);
        assert_eq!(self.give_pages(init as u32), (0, 0));
        let (s, _, _) =
            self.simple(consts::MLX5_CMD_OP_INIT_HCA, 0, ifc::init_hca_in::SIZE_BYTES, ifc::init_hca_out::SIZE_BYTES);
        assert_eq!(s, 0);
    }
}
