//! A minimal hand-rolled command submitter for the simulator's own unit tests (`cfg(test)`: its items are the
//! crate's, not the kit's public API): it builds entries and mailbox chains in DMA memory through the public
//! API, exactly as a driver would, with every offset from the PRM layouts.

// Helpers are shared by several test modules; not every one uses all of them.
#![allow(dead_code)]

use std::time::{Duration, Instant};

use mlx5_core::hal::{Dma, DmaRegion, DmaView, Mmio};
use mlx5_core::prm::{c, consts, ifc, MsgBuf};

use crate::config::Mode;
use crate::config::SimConfig;
use crate::dma_handle::SimDma;
use crate::mmio::SimMmio;
use crate::sim_device::SimDevice;

/// Copies `data` into `r` at `off`.
pub(crate) fn put(r: &DmaRegion, off: usize, data: &[u8]) {
    put_view(r.view(), off, data)
}

/// Copies `out.len()` bytes of `r` at `off` into `out`.
pub(crate) fn get(r: &DmaRegion, off: usize, out: &mut [u8]) {
    get_view(r.view(), off, out)
}

/// [`put`] through a borrowed view.
pub(crate) fn put_view(r: DmaView<'_>, off: usize, data: &[u8]) {
    let p = r.ptr_at(off, data.len());
    // SAFETY: `ptr_at` bounds-checked the range inside the live region; the test owns the memory (the device only
    // touches it while a command is outstanding, and inline mode runs on this thread).
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
}

/// [`get`] through a borrowed view.
pub(crate) fn get_view(r: DmaView<'_>, off: usize, out: &mut [u8]) {
    let p = r.ptr_at(off, out.len());
    // SAFETY: as in `put_view`; reads happen after the command completed (owner bit back to software).
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
    /// The command queue page; `ManuallyDrop` so a test can free it (`free_all`) and never touch it again.
    pub q: std::mem::ManuallyDrop<DmaRegion>,
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
        mmio.write32(c::mlx5_init_seg::CMDQ_ADDR_H.off, (q.iova() >> 32) as u32);
        mmio.write32(c::mlx5_init_seg::CMDQ_ADDR_L_SZ.off, q.iova() as u32);
        Self {
            dev,
            mmio,
            dma,
            q: std::mem::ManuallyDrop::new(q),
            token: 0,
            checksum,
            stride,
            threaded,
            page_regions: Vec::new(),
        }
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
            let next = blocks.get(k + 1).map_or(0, |n| n.iova());
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
        e[l::TYPE.off] = consts::MLX5_PCI_CMD_XPORT;
        e.write_u32(l::INLEN.off, input.len() as u32);
        e.write_u64(l::IN_PTR.off, in_blocks.first().map_or(0, |r| r.iova()));
        let n = input.len().min(INLINE);
        e[l::IN.off..l::IN.off + n].copy_from_slice(&input[..n]);
        e.write_u64(l::OUT_PTR.off, out_blocks.first().map_or(0, |r| r.iova()));
        e.write_u32(l::OUTLEN.off, outlen as u32);
        e[l::TOKEN.off] = token;
        e[l::STATUS_OWN.off] = consts::CMD_OWNER_HW;
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
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES.into());
        inp.set(i::OP_MOD, consts::MLX5_PAGES_GIVE.into());
        inp.set(i::INPUT_NUM_ENTRIES, n);
        for k in 0..n {
            inp.set64(i::PAS.elem(k), pages.iova() + u64::from(k) * 4096);
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
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_MANAGE_PAGES.into());
        inp.set(i::OP_MOD, consts::MLX5_PAGES_TAKE.into());
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

    /// ALLOC_XRCD, which must succeed; the domain's number.
    pub fn alloc_xrcd(&mut self) -> u32 {
        let (s, syn, out) = self.simple(
            consts::MLX5_CMD_OP_ALLOC_XRCD,
            0,
            ifc::alloc_xrcd_in::SIZE_BYTES,
            ifc::alloc_xrcd_out::SIZE_BYTES,
        );
        assert_eq!((s, syn), (0, 0));
        MsgBuf::get(&out[..], ifc::alloc_xrcd_out::XRCD)
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
            buf.write_volatile_u8(k * c::mlx5_eqe::SIZE + c::mlx5_eqe::OWNER.off, consts::MLX5_EQE_OWNER_INIT_VAL);
        }
        let npages = bytes / 4096;
        let mut inp = vec![0u8; i::PAS.byte_off() + 8 * npages];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_EQ.into());
        inp.set(ifc::eqc::LOG_EQ_SIZE.at(ctx), log_size);
        inp.set(ifc::eqc::UAR_PAGE.at(ctx), uar);
        inp.set64(i::EVENT_BITMASK.elem(0), mask);
        for k in 0..npages {
            inp.set64(i::PAS.elem(k as u32), buf.iova() + 4096 * k as u64);
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
    pub fn query_pages_on(&mut self, slot: u8, op_mod: u16) -> i32 {
        let mut inp = vec![0u8; ifc::query_pages_in::SIZE_BYTES];
        inp.set(ifc::query_pages_in::OPCODE, consts::MLX5_CMD_OP_QUERY_PAGES.into());
        inp.set(ifc::query_pages_in::OP_MOD, op_mod.into());
        let p = self.post(slot, &inp, ifc::query_pages_out::SIZE_BYTES);
        self.ring(slot);
        assert!(self.wait(slot), "QUERY_PAGES still owned by hardware");
        let out = self.output(&p);
        self.release(p);
        MsgBuf::get(&out[..], ifc::query_pages_out::NUM_PAGES) as i32
    }

    pub fn query_pages(&mut self, op_mod: u16) -> i32 {
        let mut inp = vec![0u8; ifc::query_pages_in::SIZE_BYTES];
        inp.set(ifc::query_pages_in::OPCODE, consts::MLX5_CMD_OP_QUERY_PAGES.into());
        inp.set(ifc::query_pages_in::OP_MOD, op_mod.into());
        let (s, _, out) = self.cmd(&inp, ifc::query_pages_out::SIZE_BYTES);
        assert_eq!(s, 0);
        MsgBuf::get(&out[..], ifc::query_pages_out::NUM_PAGES) as i32
    }

    /// A command with only a header: opcode and op_mod, `inlen`/`outlen` from the layouts.
    pub fn simple(&mut self, opcode: u16, op_mod: u16, inlen: usize, outlen: usize) -> (u8, u32, Vec<u8>) {
        let mut inp = vec![0u8; inlen];
        inp.set(ifc::mbox_in::OPCODE, opcode.into());
        inp.set(ifc::mbox_in::OP_MOD, op_mod.into());
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
        if self.dev.config().port_type == crate::config::PortType::Eth {
            // A RoCE driver programs the default GID (index 0) before any QP names it.
            let gid = self.dev.gid(0).expect("default GID");
            assert_eq!(self.set_roce_address(0, gid), (0, 0));
        }
    }

    /// SET_ROCE_ADDRESS of a RoCE v1 entry for `gid` with the port MAC at `index`: (status, syndrome).
    pub fn set_roce_address(&mut self, index: u16, gid: [u8; 16]) -> (u8, u32) {
        use ifc::roce_addr_layout as r;
        use ifc::set_roce_address_in as i;
        let mut inp = vec![0u8; i::SIZE_BYTES];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_SET_ROCE_ADDRESS.into());
        inp.set(i::ROCE_ADDRESS_INDEX, index.into());
        let at = i::ROCE_ADDRESS.off + r::SOURCE_L3_ADDRESS.byte_off();
        inp[at..at + 16].copy_from_slice(&gid);
        let m = self.dev.config().mac;
        inp.set(r::SOURCE_MAC_47_32.at(i::ROCE_ADDRESS), u16::from_be_bytes([m[0], m[1]]).into());
        inp.set(r::SOURCE_MAC_31_0.at(i::ROCE_ADDRESS), u32::from_be_bytes([m[2], m[3], m[4], m[5]]));
        inp.set(r::ROCE_VERSION.at(i::ROCE_ADDRESS), consts::MLX5_ROCE_VERSION_1);
        let (st, synd, _) = self.cmd(&inp, ifc::set_roce_address_out::SIZE_BYTES);
        (st, synd)
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Verbs objects for the datapath tests: CQs, memory keys, QPs, WQEs and doorbells, built by hand from the PRM
// layouts as a driver would.

/// Bytes of a send WQE basic block and of a WQE's 16-byte units.
pub(crate) const BB: usize = consts::MLX5_SEND_WQE_BB as usize;
const DS: usize = consts::MLX5_SEND_WQE_DS as usize;
const PAGE: usize = 4096;

/// A CQ of 64-byte CQEs in one region.
#[derive(Debug)]
pub(crate) struct TCq {
    pub cqn: u32,
    pub buf: DmaRegion,
    pub dbr: DmaRegion,
    pub log_size: u32,
    /// The consumer index.
    pub ci: u32,
}

/// A polled CQE, decoded through the layouts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cqe(pub [u8; c::mlx5_cqe64::SIZE]);

impl Cqe {
    fn be(&self, m: mlx5_core::prm::Bytes) -> u32 {
        m.get_be(&self.0, 0)
    }
    pub fn opcode(&self) -> u8 {
        self.0[c::mlx5_cqe64::OP_OWN.off] >> 4
    }
    pub fn solicited(&self) -> bool {
        self.0[c::mlx5_cqe64::OP_OWN.off] & 2 != 0
    }
    pub fn qpn(&self) -> u32 {
        self.be(c::mlx5_cqe64::SOP_DROP_QPN) & 0xff_ffff
    }
    pub fn wqe_opcode(&self) -> u8 {
        // The top byte of the big-endian `sop_drop_qpn`.
        self.0[c::mlx5_cqe64::SOP_DROP_QPN.off]
    }
    pub fn wqe_counter(&self) -> u16 {
        self.be(c::mlx5_cqe64::WQE_COUNTER) as u16
    }
    pub fn byte_cnt(&self) -> u32 {
        self.be(c::mlx5_cqe64::BYTE_CNT)
    }
    pub fn imm(&self) -> u32 {
        self.be(c::mlx5_cqe64::IMMEDIATE)
    }
    pub fn srqn_uidx(&self) -> u32 {
        self.be(c::mlx5_cqe64::SRQN) & 0xff_ffff
    }
    pub fn flags_rqpn(&self) -> u32 {
        self.be(c::mlx5_cqe64::FLAGS_RQPN)
    }
    pub fn slid(&self) -> u16 {
        self.be(c::mlx5_cqe64::SLID) as u16
    }
    pub fn syndrome(&self) -> u8 {
        self.0[c::mlx5_err_cqe::SYNDROME.off]
    }
    pub fn vendor_err(&self) -> u8 {
        self.0[c::mlx5_err_cqe::VENDOR_ERR_SYND.off]
    }
    /// (CQE opcode, syndrome) for a quick comparison; the syndrome is 0 for a good CQE.
    pub fn status(&self) -> (u8, u8) {
        let err = matches!(self.opcode(), consts::MLX5_CQE_REQ_ERR | consts::MLX5_CQE_RESP_ERR);
        (self.opcode(), if err { self.syndrome() } else { 0 })
    }
}

/// A memory key over one region (PA mode, `start_addr` = the region's IOVA).
#[derive(Debug)]
pub(crate) struct Mr {
    pub region: DmaRegion,
    pub key: u32,
}

impl Mr {
    pub fn addr(&self) -> u64 {
        self.region.iova()
    }
    pub fn write(&self, off: usize, data: &[u8]) {
        put(&self.region, off, data);
    }
    pub fn read(&self, off: usize, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        get(&self.region, off, &mut v);
        v
    }
}

/// Rights of a test memory key: (local write, remote read, remote write, atomic).
pub(crate) const ALL_RIGHTS: [bool; 4] = [true, true, true, true];

/// How a QP is created.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpSpec {
    pub st: u32,
    pub log_rq: u32,
    pub log_rq_stride: u32,
    pub log_sq: u32,
    pub zero_rq: bool,
    pub no_sq: bool,
}

impl QpSpec {
    pub fn rc() -> Self {
        Self { st: consts::MLX5_QP_ST_RC, log_rq: 4, log_rq_stride: 2, log_sq: 6, zero_rq: false, no_sq: false }
    }
    pub fn ud() -> Self {
        Self { st: consts::MLX5_QP_ST_UD, ..Self::rc() }
    }
    pub(crate) fn rq_bytes(&self) -> usize {
        if self.zero_rq {
            0
        } else {
            (1usize << self.log_rq) << (self.log_rq_stride + 4)
        }
    }
    pub(crate) fn sq_bytes(&self) -> usize {
        if self.no_sq {
            0
        } else {
            BB << self.log_sq
        }
    }
}

/// A QP as the test driver sees it: its buffer pages (one region each, so the device's page walk is exercised),
/// doorbell record and software counters.
#[derive(Debug)]
pub(crate) struct TQp {
    pub qpn: u32,
    pub spec: QpSpec,
    pub pages: Vec<DmaRegion>,
    pub dbr: DmaRegion,
    pub uar: u32,
    /// SQ producer counter in basic blocks and RQ head.
    pub sq_pi: u16,
    pub rq_head: u16,
    /// The BlueFlame buffer offset the next doorbell uses (alternates between the two halves).
    pub bf_off: usize,
}

impl TQp {
    fn buf_write(&self, off: usize, data: &[u8]) {
        let mut done = 0;
        while done < data.len() {
            let at = off + done;
            let n = (PAGE - at % PAGE).min(data.len() - done);
            put(&self.pages[at / PAGE], at % PAGE, &data[done..done + n]);
            done += n;
        }
    }

    fn buf_read(&self, off: usize, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let at = off + done;
            let n = (PAGE - at % PAGE).min(out.len() - done);
            get(&self.pages[at / PAGE], at % PAGE, &mut out[done..done + n]);
            done += n;
        }
    }

    /// Writes into the SQ ring at byte `off`, wrapping at its end.
    fn sq_write(&self, off: usize, data: &[u8]) {
        let size = self.spec.sq_bytes();
        for (k, b) in data.iter().enumerate() {
            self.buf_write(self.spec.rq_bytes() + (off + k) % size, &[*b]);
        }
    }

    pub fn sq_read(&self, off: usize, len: usize) -> Vec<u8> {
        let size = self.spec.sq_bytes();
        let mut out = vec![0u8; len];
        for (k, b) in out.iter_mut().enumerate() {
            let mut one = [0u8];
            self.buf_read(self.spec.rq_bytes() + (off + k) % size, &mut one);
            *b = one[0];
        }
        out
    }

    /// Overwrites bytes of the WQE at SQ index `index` (to break it on purpose).
    pub fn patch_sq(&self, index: u16, off: usize, data: &[u8]) {
        self.sq_write(usize::from(index) * BB + off, data);
    }

    pub fn set_sq_dbr(&self, pi: u16) {
        put(&self.dbr, consts::MLX5_SND_DBR as usize * 4, &u32::from(pi).to_be_bytes());
    }

    pub fn set_rq_dbr(&self, head: u16) {
        put(&self.dbr, consts::MLX5_RCV_DBR as usize * 4, &u32::from(head).to_be_bytes());
    }
}

/// A send WQE being built: everything after the control segment, in 16-byte units.
#[derive(Debug, Clone)]
pub(crate) struct Wqe {
    pub opcode: u8,
    pub fm_ce_se: u8,
    pub imm: [u8; 4],
    pub segs: Vec<u8>,
    /// `ds` to write instead of the real size (to break the WQE on purpose).
    pub ds_override: Option<u32>,
}

impl Wqe {
    pub fn new(opcode: u8) -> Self {
        Self { opcode, fm_ce_se: consts::MLX5_WQE_CTRL_CQ_UPDATE, imm: [0; 4], segs: Vec::new(), ds_override: None }
    }
    pub fn unsignaled(mut self) -> Self {
        self.fm_ce_se &= !consts::MLX5_WQE_CTRL_CQ_UPDATE;
        self
    }
    pub fn solicited(mut self) -> Self {
        self.fm_ce_se |= consts::MLX5_WQE_CTRL_SOLICITED;
        self
    }
    /// The small initiator fence, as rdma-core's mlx5 provider sets it for `IBV_SEND_FENCE`.
    pub fn fence(mut self) -> Self {
        self.fm_ce_se |= consts::MLX5_FENCE_MODE_INITIATOR_SMALL as u8;
        self
    }
    /// Immediate data, big endian in the WQE as verbs gives it.
    pub fn imm(mut self, v: u32) -> Self {
        self.imm = v.to_be_bytes();
        self
    }
    pub fn seg(mut self, b: &[u8]) -> Self {
        self.segs.extend_from_slice(b);
        let padded = self.segs.len().next_multiple_of(DS);
        self.segs.resize(padded, 0);
        self
    }
    pub fn data(self, len: u32, lkey: u32, addr: u64) -> Self {
        use c::mlx5_wqe_data_seg as d;
        let mut s = [0u8; d::SIZE];
        d::BYTE_COUNT.put_be(&mut s, 0, len);
        d::LKEY.put_be(&mut s, 0, lkey);
        s[d::ADDR.off..d::ADDR.end()].copy_from_slice(&addr.to_be_bytes());
        self.seg(&s)
    }
    pub fn raddr(self, raddr: u64, rkey: u32) -> Self {
        use c::mlx5_wqe_raddr_seg as r;
        let mut s = [0u8; r::SIZE];
        s[r::RADDR.off..r::RADDR.end()].copy_from_slice(&raddr.to_be_bytes());
        r::RKEY.put_be(&mut s, 0, rkey);
        self.seg(&s)
    }
    pub fn atomic(self, swap_add: u64, compare: u64) -> Self {
        use c::mlx5_wqe_atomic_seg as a;
        let mut s = [0u8; a::SIZE];
        s[a::SWAP_ADD.off..a::SWAP_ADD.end()].copy_from_slice(&swap_add.to_be_bytes());
        s[a::COMPARE.off..a::COMPARE.end()].copy_from_slice(&compare.to_be_bytes());
        self.seg(&s)
    }
    pub fn inline(self, data: &[u8]) -> Self {
        let mut s = (data.len() as u32 | consts::MLX5_INLINE_SEG).to_be_bytes().to_vec();
        s.extend_from_slice(data);
        self.seg(&s)
    }
    /// A UD datagram segment (extended AV).
    pub fn av(self, av: &TAv) -> Self {
        use c::mlx5_av as a;
        let mut s = [0u8; c::mlx5_wqe_datagram_seg::SIZE];
        a::QKEY.put_be(&mut s, 0, av.qkey);
        a::DQP_DCT.put_be(&mut s, 0, av.dqpn | consts::MLX5_EXTENDED_UD_AV);
        s[a::STAT_RATE_SL.off] = av.sl;
        a::RLID.put_be(&mut s, 0, av.rlid.into());
        s[a::RMAC.off..a::RMAC.end()].copy_from_slice(&av.rmac);
        s[a::HOP_LIMIT.off] = av.hop_limit;
        s[a::TCLASS.off] = av.tclass;
        let grh = if av.grh { 1u32 << 30 } else { 0 };
        a::GRH_GID_FL.put_be(&mut s, 0, grh | av.sgid_index << 20 | av.flow_label);
        s[a::RGID.off..a::RGID.end()].copy_from_slice(&av.rgid);
        self.seg(&s)
    }
    fn ds(&self) -> u32 {
        self.ds_override.unwrap_or(((c::mlx5_wqe_ctrl_seg::SIZE + self.segs.len()) / DS) as u32)
    }
}

/// A UD address vector as the test writes it.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TAv {
    pub dqpn: u32,
    pub qkey: u32,
    pub sl: u8,
    pub rlid: u16,
    pub grh: bool,
    pub sgid_index: u32,
    pub flow_label: u32,
    pub tclass: u8,
    pub hop_limit: u8,
    pub rgid: [u8; 16],
    pub rmac: [u8; 6],
}

/// How a send is announced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bell {
    /// Not at all (the test rings later).
    None,
    /// The 8-byte doorbell.
    Db,
    /// The whole WQE through BlueFlame.
    Bf,
    /// BlueFlame with byte `n` of the copy flipped.
    BfCorrupt(usize),
}

/// Where a connected RC QP sends: the peer QP and its port address.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Remote {
    pub qpn: u32,
    pub lid: u16,
    pub gid: [u8; 16],
    pub mac: [u8; 6],
}

/// RC connection parameters.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RcParams {
    pub min_rnr_nak: u32,
    pub retry_count: u32,
    pub rnr_retry: u32,
    pub ack_timeout: u32,
    pub access: [bool; 3],
    /// The QP's first send PSN and the PSN it expects first from its peer (equal on both sides by default, so
    /// two QPs connected with the defaults match).
    pub sq_psn: u32,
    pub rq_psn: u32,
    /// `log_sra_max`: the READs and atomics the requester may have in flight, as a power of two.
    pub log_sra_max: u32,
}

impl Default for RcParams {
    fn default() -> Self {
        Self {
            min_rnr_nak: 12,
            retry_count: 7,
            rnr_retry: 7,
            ack_timeout: 14,
            access: [true; 3],
            sq_psn: 0x100,
            rq_psn: 0x100,
            log_sra_max: 2,
        }
    }
}

/// A brought-up device with a UAR, a completion EQ and a PD.
#[derive(Debug)]
pub(crate) struct Rdma {
    pub h: Harness,
    pub uar: u32,
    pub eqn: u8,
    pub pd: u32,
}

impl Rdma {
    pub fn new(cfg: crate::config::SimConfig) -> Self {
        let mut h = Harness::new(cfg);
        h.bring_up();
        let uar = h.alloc_uar();
        let (s, eqn, _eq) = h.create_eq(uar, 6, 0);
        assert_eq!(s, 0);
        let (s, _, out) = h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16);
        assert_eq!(s, 0);
        let pd = MsgBuf::get(&out[..], ifc::alloc_pd_out::PD);
        Self { h, uar, eqn, pd }
    }

    pub fn inline() -> Self {
        Self::new(crate::config::SimConfig::default())
    }

    pub fn cq(&mut self, log_size: u32) -> TCq {
        use ifc::cqc as q;
        use ifc::create_cq_in as i;
        let ctx = i::CQ_CONTEXT;
        let bytes = (64usize << log_size).next_multiple_of(PAGE);
        let buf = self.h.dma.alloc(bytes, PAGE).unwrap();
        for n in 0..1usize << log_size {
            put(&buf, n * 64 + c::mlx5_cqe64::OP_OWN.off, &[consts::MLX5_CQE_INVALID << 4]);
        }
        let dbr = self.h.dma.alloc(64, 64).unwrap();
        let mut inp = vec![0u8; i::PAS.byte_off() + 8 * (bytes / PAGE)];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_CQ.into());
        inp.set(q::CQE_SZ.at(ctx), consts::CQE_STRIDE_64);
        inp.set(q::LOG_CQ_SIZE.at(ctx), log_size);
        inp.set(q::UAR_PAGE.at(ctx), self.uar);
        inp.set(q::C_EQN_OR_APU_ELEMENT.at(ctx), self.eqn.into());
        inp.set64(q::DBR_ADDR.at(ctx), dbr.iova());
        for k in 0..bytes / PAGE {
            inp.set64(i::PAS.elem(k as u32), buf.iova() + (k * PAGE) as u64);
        }
        let (s, syn, out) = self.h.cmd(&inp, ifc::create_cq_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0), "CREATE_CQ");
        TCq { cqn: MsgBuf::get(&out[..], ifc::create_cq_out::CQN), buf, dbr, log_size, ci: 0 }
    }

    /// The next CQE of `cq`, if the device has written one (the consumer index then moves past it).
    pub fn poll(&self, cq: &mut TCq) -> Option<Cqe> {
        let nent = 1u32 << cq.log_size;
        let off = (cq.ci & (nent - 1)) as usize * 64;
        let op_own = cq.buf.read_volatile_u8(off + c::mlx5_cqe64::OP_OWN.off);
        let owner = u32::from(op_own & 1);
        if op_own >> 4 == consts::MLX5_CQE_INVALID || owner != (cq.ci >> cq.log_size) & 1 {
            return None;
        }
        self.h.mmio.dma_rmb();
        let mut e = [0u8; 64];
        get(&cq.buf, off, &mut e);
        cq.ci = cq.ci.wrapping_add(1);
        put(&cq.dbr, 0, &(cq.ci & 0xff_ffff).to_be_bytes());
        Some(Cqe(e))
    }

    /// Every CQE available now.
    pub fn drain(&self, cq: &mut TCq) -> Vec<Cqe> {
        std::iter::from_fn(|| self.poll(cq)).collect()
    }

    /// Polls until a CQE arrives: once (in-line mode: the device already ran) or for up to 10 s (threaded).
    pub fn wait_cqe(&self, cq: &mut TCq) -> Option<Cqe> {
        let start = Instant::now();
        loop {
            if let Some(e) = self.poll(cq) {
                return Some(e);
            }
            if !self.h.threaded || start.elapsed() > Duration::from_secs(10) {
                return None;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    /// A PA memory key over a fresh region of `len` bytes with `rights` (local write, remote read, remote
    /// write, atomic), in PD `pd`.
    pub fn mr_in(&mut self, pd: u32, len: usize, rights: [bool; 4]) -> Mr {
        let region = self.h.dma.alloc(len, 64).unwrap();
        self.mr_on(pd, region, rights)
    }

    /// A memory key over `region` (allocated or lent process memory), in PD `pd` with `rights`.
    pub fn mr_on(&mut self, pd: u32, region: DmaRegion, rights: [bool; 4]) -> Mr {
        use ifc::create_mkey_in as i;
        use ifc::mkc as m;
        let len = region.len();
        let ctx = i::MEMORY_KEY_MKEY_ENTRY;
        let mut inp = vec![0u8; i::KLM_PAS_MTT.byte_off()];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_MKEY.into());
        inp.set(m::ACCESS_MODE_1_0.at(ctx), consts::MLX5_MKC_ACCESS_MODE_PA & 3);
        inp.set(m::LR.at(ctx), 1);
        for (f, on) in [m::LW, m::RR, m::RW, m::A].into_iter().zip(rights) {
            inp.set(f.at(ctx), on.into());
        }
        inp.set(m::QPN.at(ctx), 0xff_ffff);
        inp.set(m::MKEY_7_0.at(ctx), 0x42);
        inp.set(m::PD.at(ctx), pd);
        inp.set64(m::START_ADDR.at(ctx), region.iova());
        inp.set64(m::LEN.at(ctx), len as u64);
        let (s, syn, out) = self.h.cmd(&inp, ifc::create_mkey_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0), "CREATE_MKEY");
        Mr { region, key: MsgBuf::get(&out[..], ifc::create_mkey_out::MKEY_INDEX) << 8 | 0x42 }
    }

    pub fn mr(&mut self, len: usize) -> Mr {
        self.mr_in(self.pd, len, ALL_RIGHTS)
    }

    /// A CREATE_QP input for `spec` with fresh buffer pages and doorbell record; the caller may break it.
    pub fn create_qp_in(&mut self, spec: QpSpec, cqn_snd: u32, cqn_rcv: u32) -> (Vec<u8>, Vec<DmaRegion>, DmaRegion) {
        use ifc::create_qp_in as i;
        use ifc::qpc as q;
        let ctx = i::QPC;
        let bytes = spec.rq_bytes() + spec.sq_bytes();
        let pages: Vec<DmaRegion> = (0..bytes.div_ceil(PAGE)).map(|_| self.h.dma.alloc(PAGE, PAGE).unwrap()).collect();
        let dbr = self.h.dma.alloc(64, 64).unwrap();
        let mut inp = vec![0u8; i::PAS.byte_off() + 8 * pages.len()];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_QP.into());
        inp.set(q::ST.at(ctx), spec.st);
        inp.set(q::PM_STATE.at(ctx), consts::MLX5_QP_PM_MIGRATED);
        inp.set(q::PD.at(ctx), self.pd);
        inp.set(q::UAR_PAGE.at(ctx), self.uar);
        inp.set(q::LOG_RQ_SIZE.at(ctx), spec.log_rq);
        inp.set(q::LOG_RQ_STRIDE.at(ctx), spec.log_rq_stride);
        inp.set(q::LOG_SQ_SIZE.at(ctx), spec.log_sq);
        inp.set(q::NO_SQ.at(ctx), spec.no_sq.into());
        let rq_type = if spec.zero_rq { consts::MLX5_ZERO_LEN_RQ } else { consts::MLX5_NON_ZERO_RQ };
        inp.set(q::RQ_TYPE.at(ctx), rq_type);
        inp.set(q::CQN_SND.at(ctx), cqn_snd);
        inp.set(q::CQN_RCV.at(ctx), cqn_rcv);
        inp.set64(q::DBR_ADDR.at(ctx), dbr.iova());
        for (k, p) in pages.iter().enumerate() {
            inp.set64(i::PAS.elem(k as u32), p.iova());
        }
        (inp, pages, dbr)
    }

    pub fn qp(&mut self, spec: QpSpec, cqn_snd: u32, cqn_rcv: u32) -> TQp {
        self.qp_with(spec, cqn_snd, cqn_rcv, |_| {})
    }

    /// [`Rdma::qp`] with `edit` applied to the CREATE_QP input first.
    pub fn qp_with(&mut self, spec: QpSpec, cqn_snd: u32, cqn_rcv: u32, edit: impl FnOnce(&mut Vec<u8>)) -> TQp {
        let (mut inp, pages, dbr) = self.create_qp_in(spec, cqn_snd, cqn_rcv);
        edit(&mut inp);
        let (s, syn, out) = self.h.cmd(&inp, ifc::create_qp_out::SIZE_BYTES);
        assert_eq!((s, syn), (0, 0), "CREATE_QP");
        let qpn = MsgBuf::get(&out[..], ifc::create_qp_out::QPN);
        let bf_off = consts::MLX5_BF_OFFSET as usize;
        TQp { qpn, spec, pages, dbr, uar: self.uar, sq_pi: 0, rq_head: 0, bf_off }
    }

    /// A modify command (`op`) for `qpn` with `opt` optional parameters; `f` fills the qpc. Returns (status,
    /// syndrome).
    pub fn modify(
        &mut self,
        op: u16,
        qpn: u32,
        opt: u32,
        f: impl FnOnce(&mut Vec<u8>, mlx5_core::prm::Sub),
    ) -> (u8, u32) {
        use ifc::rst2init_qp_in as i;
        let short = op == consts::MLX5_CMD_OP_2ERR_QP || op == consts::MLX5_CMD_OP_2RST_QP;
        let mut inp = vec![0u8; if short { ifc::qp_2err_in::SIZE_BYTES } else { i::SIZE_BYTES }];
        inp.set(i::OPCODE, op.into());
        inp.set(i::QPN, qpn);
        if !short {
            inp.set(i::OPT_PARAM_MASK, opt);
            f(&mut inp, i::QPC);
        }
        let (s, syn, _) = self.h.cmd(&inp, ifc::rst2init_qp_out::SIZE_BYTES);
        (s, syn)
    }

    /// QUERY_QP's output.
    pub fn query_qp(&mut self, qpn: u32) -> (u8, Vec<u8>) {
        let mut inp = vec![0u8; ifc::query_qp_in::SIZE_BYTES];
        inp.set(ifc::query_qp_in::OPCODE, consts::MLX5_CMD_OP_QUERY_QP.into());
        inp.set(ifc::query_qp_in::QPN, qpn);
        let (s, _, out) = self.h.cmd(&inp, ifc::query_qp_out::QP_PAS_OR_QPC_EXT_AND_PAS.off);
        (s, out)
    }

    /// This device's port address, as a peer's path names it.
    pub fn me(&self, qpn: u32) -> Remote {
        let cfg = self.h.dev.config();
        Remote { qpn, lid: self.h.dev.lid(), gid: self.h.dev.gid(0).unwrap(), mac: cfg.mac }
    }

    /// Fills a primary path toward `r` (RoCE: GRH, GID, MAC; IB: LID and SL).
    pub fn path(&self, inp: &mut [u8], qpc: mlx5_core::prm::Sub, r: &Remote) {
        use ifc::ads as a;
        let p = ifc::qpc::PRIMARY_ADDRESS_PATH.at(qpc);
        inp.set(a::VHCA_PORT_NUM.at(p), 1);
        if self.h.dev.config().port_type == crate::config::PortType::Ib {
            inp.set(a::RLID.at(p), r.lid.into());
            inp.set(a::SL.at(p), 3);
        } else {
            inp.set(a::HOP_LIMIT.at(p), 64);
            inp.set(a::SRC_ADDR_INDEX.at(p), 0);
            inp.set(a::UDP_SPORT.at(p), 0xc000);
            let g = a::RGID_RIP.byte_off() + p.off;
            inp[g..g + 16].copy_from_slice(&r.gid);
            inp.set(a::RMAC_47_32.at(p), u32::from(u16::from_be_bytes([r.mac[0], r.mac[1]])));
            inp.set(a::RMAC_31_0.at(p), u32::from_be_bytes([r.mac[2], r.mac[3], r.mac[4], r.mac[5]]));
        }
    }

    /// RST2INIT, INIT2RTR and RTR2RTS for an RC QP toward `r`.
    pub fn connect_rc(&mut self, qp: &TQp, r: &Remote, prm: RcParams) {
        use ifc::qpc as q;
        let st = self.modify(consts::MLX5_CMD_OP_RST2INIT_QP, qp.qpn, 0, |inp, c| {
            inp.set(ifc::ads::VHCA_PORT_NUM.at(q::PRIMARY_ADDRESS_PATH.at(c)), 1);
            inp.set(q::RRE.at(c), prm.access[0].into());
            inp.set(q::RWE.at(c), prm.access[1].into());
            inp.set(q::RAE.at(c), prm.access[2].into());
            if prm.access[2] {
                inp.set(q::ATOMIC_MODE.at(c), consts::MLX5_ATOMIC_MODE_IB_COMP);
            }
        });
        assert_eq!(st, (0, 0), "RST2INIT");
        let mut path = vec![0u8; ifc::init2rtr_qp_in::SIZE_BYTES];
        self.path(&mut path, ifc::init2rtr_qp_in::QPC, r);
        let st = self.modify(consts::MLX5_CMD_OP_INIT2RTR_QP, qp.qpn, 0, |inp, c| {
            let s = q::PRIMARY_ADDRESS_PATH.at(c);
            inp[s.off..s.off + s.len].copy_from_slice(&path[s.off..s.off + s.len]);
            inp.set(q::MTU.at(c), consts::IB_MTU_1024.into());
            inp.set(q::LOG_MSG_MAX.at(c), 30);
            inp.set(q::REMOTE_QPN.at(c), r.qpn);
            inp.set(q::NEXT_RCV_PSN.at(c), prm.rq_psn);
            inp.set(q::LOG_RRA_MAX.at(c), 2);
            inp.set(q::MIN_RNR_NAK.at(c), prm.min_rnr_nak);
        });
        assert_eq!(st, (0, 0), "INIT2RTR");
        let st = self.modify(consts::MLX5_CMD_OP_RTR2RTS_QP, qp.qpn, 0, |inp, c| {
            inp.set(q::NEXT_SEND_PSN.at(c), prm.sq_psn);
            inp.set(q::RETRY_COUNT.at(c), prm.retry_count);
            inp.set(q::RNR_RETRY.at(c), prm.rnr_retry);
            inp.set(q::LOG_SRA_MAX.at(c), prm.log_sra_max);
            // As mlx5_ib writes it in every context: AckReq every 256 packets.
            inp.set(q::LOG_ACK_REQ_FREQ.at(c), 8);
            inp.set(ifc::ads::ACK_TIMEOUT.at(q::PRIMARY_ADDRESS_PATH.at(c)), prm.ack_timeout);
        });
        assert_eq!(st, (0, 0), "RTR2RTS");
    }

    /// RST2INIT (qkey), INIT2RTR, RTR2RTS for a UD QP, each with the MTU and message size mlx5_ib sends with every
    /// UD modify.
    pub fn ready_ud(&mut self, qp: &TQp, qkey: u32) {
        use ifc::qpc as q;
        let ud = |inp: &mut Vec<u8>, c: mlx5_core::prm::Sub| {
            inp.set(q::ST.at(c), consts::MLX5_QP_ST_UD);
            inp.set(q::MTU.at(c), consts::IB_MTU_4096.into());
            inp.set(q::LOG_MSG_MAX.at(c), 12);
        };
        let st = self.modify(consts::MLX5_CMD_OP_RST2INIT_QP, qp.qpn, 0, |inp, c| {
            ud(inp, c);
            inp.set(ifc::ads::VHCA_PORT_NUM.at(q::PRIMARY_ADDRESS_PATH.at(c)), 1);
            inp.set(q::Q_KEY.at(c), qkey);
        });
        assert_eq!(st, (0, 0), "RST2INIT");
        assert_eq!(self.modify(consts::MLX5_CMD_OP_INIT2RTR_QP, qp.qpn, 0, ud), (0, 0), "INIT2RTR");
        let st = self.modify(consts::MLX5_CMD_OP_RTR2RTS_QP, qp.qpn, 0, |inp, c| {
            ud(inp, c);
            inp.set(q::NEXT_SEND_PSN.at(c), 1);
        });
        assert_eq!(st, (0, 0), "RTR2RTS");
    }

    /// Writes `w` at the SQ producer counter (ctrl segment filled in: index, opcode, QPN, ds), moves the counter
    /// and the doorbell record, and rings as `bell` says. Returns the WQE's index.
    pub fn post_send(&self, qp: &mut TQp, w: &Wqe, bell: Bell) -> u16 {
        use c::mlx5_wqe_ctrl_seg as cs;
        let index = qp.sq_pi;
        let mut bytes = vec![0u8; cs::SIZE];
        cs::OPMOD_IDX_OPCODE.put_be(&mut bytes, 0, u32::from(index) << 8 | u32::from(w.opcode));
        cs::QPN_DS.put_be(&mut bytes, 0, qp.qpn << 8 | w.ds());
        bytes[cs::FM_CE_SE.off] = w.fm_ce_se;
        bytes[cs::IMM.off..cs::IMM.end()].copy_from_slice(&w.imm);
        bytes.extend_from_slice(&w.segs);
        let nbb = bytes.len().div_ceil(BB);
        qp.sq_write(usize::from(index) * BB, &bytes);
        qp.sq_pi = qp.sq_pi.wrapping_add(nbb as u16);
        self.h.mmio.wmb();
        qp.set_sq_dbr(qp.sq_pi);
        self.h.mmio.wmb();
        self.ring(qp, index, nbb, bell);
        index
    }

    /// Rings the doorbell for the WQE at `index` spanning `nbb` basic blocks.
    pub fn ring(&self, qp: &mut TQp, index: u16, nbb: usize, bell: Bell) {
        let base = SimMmio::uar_offset(qp.uar) + qp.bf_off;
        // The copy comes from the SQ memory, as rdma-core's `mlx5_bf_copy` copies the WQE it just wrote.
        let mut copy = qp.sq_read(usize::from(index) * BB, nbb * BB);
        let chunks = match bell {
            Bell::None => return,
            Bell::Db => 1,
            Bell::Bf => copy.len() / 8,
            Bell::BfCorrupt(n) => {
                copy[n] ^= 0xff;
                copy.len() / 8
            }
        };
        for k in 0..chunks {
            let mut v = [0u8; 8];
            v.copy_from_slice(&copy[8 * k..8 * k + 8]);
            self.h.mmio.write64(base + 8 * k, u64::from_be_bytes(v));
        }
        // The next doorbell uses the other half of the BlueFlame register.
        let half = 1usize << 8;
        qp.bf_off ^= half;
    }

    /// Posts a receive with scatter list `sges` (address, length, lkey), terminated early when shorter than
    /// the RQ stride.
    pub fn post_recv(&self, qp: &mut TQp, sges: &[(u64, u32, u32)]) -> u16 {
        use c::mlx5_wqe_data_seg as d;
        let stride = 16usize << qp.spec.log_rq_stride;
        let index = qp.rq_head;
        let mut wqe = vec![0u8; stride];
        for (k, &(addr, len, lkey)) in sges.iter().enumerate() {
            let s = k * d::SIZE;
            d::BYTE_COUNT.put_be(&mut wqe, s, len);
            d::LKEY.put_be(&mut wqe, s, lkey);
            wqe[s + d::ADDR.off..s + d::ADDR.end()].copy_from_slice(&addr.to_be_bytes());
        }
        if sges.len() * d::SIZE < stride {
            d::LKEY.put_be(&mut wqe, sges.len() * d::SIZE, consts::MLX5_INVALID_LKEY);
        }
        let slot = usize::from(index) & ((1usize << qp.spec.log_rq) - 1);
        qp.buf_write(slot * stride, &wqe);
        qp.rq_head = qp.rq_head.wrapping_add(1);
        self.h.mmio.wmb();
        qp.set_rq_dbr(qp.rq_head);
        index
    }
}
