//! Firmware side: `fw/qp.rs` (the QP's rings), `fw/srq.rs` (SRQ WQEs).
//!
//! WQE views: a send WQE parsed in place from the SQ (`mlx5_wqe_ctrl_seg` and the segments after it: raddr,
//! atomic, datagram, data and inline segments; `mlx5_av` for UD) and the receive WQE taken from the RQ
//! (`mlx5_wqe_data_seg` list), with what a malformed one completes with.

use super::common::*;
use super::srq::next_srq_recv;
use crate::fw::qp::QpTable;
use crate::fw::srq::SrqTable;

/// A gather entry of a send WQE: a data segment, or (`inline`) `sge.len` inline bytes at offset `sge.addr` of
/// [`DpState::inline`]. A struct rather than an enum, so a data segment's fields can be written straight into the
/// list (see `Small::push_slot`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Seg {
    pub(super) sge: Sge,
    pub(super) inline: bool,
}

/// A [`Seg`] to match on.
pub(super) enum SegView {
    Inline { at: usize, len: usize },
    Ptr(Sge),
}

impl Seg {
    pub(super) fn inline(at: usize, len: usize) -> Self {
        Seg { sge: Sge { addr: at as u64, len: len as u64, lkey: 0 }, inline: true }
    }

    pub(super) fn view(&self) -> SegView {
        if self.inline {
            SegView::Inline { at: self.sge.addr as usize, len: self.sge.len as usize }
        } else {
            SegView::Ptr(self.sge)
        }
    }
}

/// The gather list of a send WQE; one or two entries in practice.
pub(super) type Segs = Small<Seg, 2>;

/// A UD address vector (`mlx5_av`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Av {
    pub(super) dqpn: u32,
    pub(super) qkey: u32,
    pub(super) sl: u8,
    pub(super) rlid: u16,
    pub(super) grh: bool,
    pub(super) sgid_index: u32,
    pub(super) tclass: u8,
    pub(super) hop_limit: u8,
    pub(super) flow_label: u32,
    pub(super) rgid: [u8; 16],
    pub(super) rmac: [u8; 6],
}

impl Av {
    pub(super) fn parse(b: &[u8]) -> Self {
        use c::mlx5_av as a;
        let dqp = be(a::DQP_DCT, b, 0);
        let gid_fl = be(a::GRH_GID_FL, b, 0);
        // Without the extended flag the AV has no GRH part.
        let grh = dqp & EXTENDED_AV != 0 && gid_fl & AV_GRH != 0;
        let mut rgid = [0u8; 16];
        rgid.copy_from_slice(&b[a::RGID.off..a::RGID.end()]);
        let mut rmac = [0u8; 6];
        rmac.copy_from_slice(&b[a::RMAC.off..a::RMAC.end()]);
        Self {
            dqpn: dqp & QPN_MASK,
            qkey: be(a::QKEY, b, 0),
            sl: b[a::STAT_RATE_SL.off] & AV_SL_MASK,
            rlid: be(a::RLID, b, 0) as u16,
            grh,
            sgid_index: (gid_fl >> AV_SGID_SHIFT) & AV_SGID_MASK,
            tclass: b[a::TCLASS.off],
            hop_limit: b[a::HOP_LIMIT.off],
            flow_label: gid_fl & FLOW_LABEL_MASK,
            rgid,
            rmac,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) enum Kind {
    #[default]
    Nop,
    Send,
    Write {
        raddr: u64,
        rkey: u32,
    },
    Read {
        raddr: u64,
        rkey: u32,
    },
    Atomic {
        raddr: u64,
        rkey: u32,
        op: AtomicOp,
    },
    /// A UMR WQE of the driver's UMR QP (`MLX5_OPCODE_UMR`): `mask` (`mkey_mask`) names what of `key` changes to
    /// the values the WQE's mkey context carries (`pd`, the access bits as the mkc's `lr`/`lw`/`rr`/`rw`/`a` give
    /// them, each 1 or 0 in `rights` as [`MkeyAccess`] counts); `xlt` is its translation-entry count.
    Umr {
        key: u32,
        mask: u64,
        pd: u32,
        rights: MkeyAccess,
        xlt: u16,
    },
    /// A UMR WQE of a user RC or UC QP on an indirect key (a memory window or an mlx5dv mkey): a layout, or a
    /// free, as rdma-core's mlx5 provider builds them for `ibv_bind_mw`, `IBV_WR_BIND_MW`, `IBV_WR_LOCAL_INV` and
    /// `mlx5dv_wr_mr_list`. Its KLM entries are in [`DpState::inline`], 16 bytes each (`mlx5_klm`).
    Window(WindowUmr),
}

/// A send WQE, parsed. Its inline bytes are in [`DpState::inline`] until the next WQE is fetched.
#[derive(Debug, Clone, Default)]
pub(super) struct SendWqe {
    /// The WQE's index (its first basic block, the device's consumer counter).
    pub(super) index: u16,
    pub(super) nbb: u16,
    pub(super) opcode: u8,
    pub(super) signaled: bool,
    pub(super) solicited: bool,
    /// A fence mode is set: the WQE waits until the READs and atomics before it complete.
    pub(super) fence: bool,
    pub(super) imm: Option<[u8; 4]>,
    /// A SEND with invalidate (`MLX5_OPCODE_SEND_INVAL`): the rkey its immediate field names, for the responder to
    /// free.
    pub(super) invalidate: Option<u32>,
    pub(super) kind: Kind,
    pub(super) av: Option<Av>,
    /// An XRC initiator's WQE: the remote XRC SRQ its `mlx5_wqe_xrc_seg` names (24 bits).
    pub(super) xrc_srqn: Option<u32>,
    pub(super) segs: Segs,
}

impl SendWqe {
    /// The bytes the WQE gathers.
    pub(super) fn total_len(&self) -> u64 {
        self.segs.iter().fold(0u64, |a, s| a.saturating_add(s.sge.len))
    }

    pub(super) fn id(&self) -> WqeId {
        WqeId { index: self.index, nbb: self.nbb, opcode: self.opcode, signaled: self.signaled }
    }

    pub(super) fn sges(&self) -> Sges {
        let mut out = Sges::new();
        for s in self.segs.iter() {
            if !s.inline {
                out.push(s.sge);
            }
        }
        out
    }
}

/// A WQE the device cannot execute: what its error CQE says and how far the consumer counter moves.
#[derive(Debug, Clone, Copy)]
pub(super) struct BadWqe {
    pub(super) nbb: u16,
    pub(super) opcode: u8,
    pub(super) syndrome: u8,
}

/// What reading WQEs borrows from the device: the QP table (and the SRQs a receive may take from), device
/// memory, the inline bytes of the send WQE being executed, and the event log. Built per read (`Datapath::wqes`).
pub(super) struct Wqes<'a> {
    pub(super) qps: &'a mut QpTable,
    pub(super) srqs: &'a SrqTable,
    pub(super) dma: &'a mut DmaSpace,
    pub(super) inline: &'a mut Vec<u8>,
    pub(super) events: &'a mut Vec<SimEvent>,
}

impl Wqes<'_> {
    /// Reads and parses the send WQE at the SQ consumer counter into `w`. Inlined into its one caller, the SQ
    /// loop, as it was before the views: the call and the view it builds cost more than the parse.
    #[inline]
    pub(super) fn fetch_wqe(&mut self, qpn: u32, w: &mut SendWqe) -> Result<(), BadWqe> {
        use c::mlx5_wqe_ctrl_seg as cs;
        let bad = |nbb: u16, opcode: u8| BadWqe {
            nbb: nbb.max(1),
            opcode,
            syndrome: consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR,
        };
        let qp = self.qps.get(&qpn).ok_or(bad(1, 0))?;
        let (index, st, sq_bbs, max_wqe) = (qp.sq_next, qp.st, qp.sq_bbs(), qp.max_wqe);
        let xrc = qp.xrcd.is_some();
        let umr_qp = qp.special == Some(crate::fw::qp::SpecialQp::RegUmr);
        let pending = qp.sq_pi.wrapping_sub(index);
        // The first basic block holds the control segment and, for a small WQE, all of it: one read. When that
        // read cannot be made, the WQE is read as it always was (the control segment, then the whole WQE), so a
        // fault is met and recorded at the same access.
        let mut first = [0u8; BB as usize];
        let quick = qp.try_read_sq_bb(self.dma, index, &mut first);
        if !quick {
            qp.read_sq(self.dma, u64::from(index) * BB, &mut first[..CTRL]).map_err(|_| bad(1, 0))?;
        }
        let ctrl = &first[..CTRL];
        let w0 = be(cs::OPMOD_IDX_OPCODE, ctrl, 0);
        let w1 = be(cs::QPN_DS, ctrl, 0);
        let opcode = (w0 & OPCODE_MASK) as u8;
        let ds = (w1 & DS_MASK) as usize;
        if ds == 0 {
            return Err(bad(1, opcode));
        }
        let bytes = ds * DS;
        let nbb = bytes.div_ceil(BB as usize) as u16;
        if u32::from(nbb) > sq_bbs || nbb > pending || bytes > max_wqe {
            return Err(bad(nbb.min(pending), opcode));
        }
        if w1 >> QPN_SHIFT != qpn || (w0 >> IDX_SHIFT) as u16 != index {
            return Err(bad(nbb, opcode));
        }
        let fm = first[cs::FM_CE_SE.off];
        let mut imm = [0u8; 4];
        imm.copy_from_slice(&first[cs::IMM.off..cs::IMM.end()]);
        let mut stack;
        let mut heap = Vec::new();
        let wqe: &[u8] = if quick && bytes <= first.len() {
            &first[..bytes]
        } else {
            let wqe: &mut [u8] = if bytes <= WQE_STACK {
                stack = [0u8; WQE_STACK];
                &mut stack[..bytes]
            } else {
                heap.resize(bytes, 0);
                &mut heap
            };
            qp.read_sq(self.dma, u64::from(index) * BB, wqe).map_err(|_| bad(nbb, opcode))?;
            wqe
        };
        let mut at = CTRL;
        // The UMR QP is a datagram QP to firmware, but its WQEs carry no address vector.
        let av = if st == QpType::Ud && opcode != consts::MLX5_OPCODE_NOP && !umr_qp {
            if at + DGRAM_SEG > bytes {
                return Err(bad(nbb, opcode));
            }
            let av = Av::parse(&wqe[at..at + DGRAM_SEG]);
            at += DGRAM_SEG;
            Some(av)
        } else {
            None
        };
        // An XRC initiator's WQE names the XRC SRQ at the target after its control segment (rdma-core's mlx5
        // provider, `IBV_QPT_XRC_SEND`), before the remote address; a NOP carries none.
        let xrc_srqn = if xrc && opcode != consts::MLX5_OPCODE_NOP {
            if at + XRC_SEG > bytes {
                return Err(bad(nbb, opcode));
            }
            let n = be(c::mlx5_wqe_xrc_seg::XRC_SRQN, wqe, at) & QPN_MASK;
            at += XRC_SEG;
            Some(n)
        } else {
            None
        };
        let raddr = |at: usize| -> Result<(u64, u32), BadWqe> {
            use c::mlx5_wqe_raddr_seg as r;
            if at + RADDR_SEG > bytes {
                return Err(bad(nbb, opcode));
            }
            Ok((be64(wqe, at + r::RADDR.off), be(r::RKEY, wqe, at)))
        };
        let rc = st == QpType::Rc;
        // RDMA WRITE is RC's and UC's; READ and atomics are RC's alone.
        let connected = st != QpType::Ud;
        // An indirect key's UMR: where its KLM entries are in the WQE.
        let mut klm = 0..0;
        let (kind, with_imm) = match opcode {
            consts::MLX5_OPCODE_NOP => (Kind::Nop, false),
            consts::MLX5_OPCODE_SEND => (Kind::Send, false),
            consts::MLX5_OPCODE_SEND_IMM => (Kind::Send, true),
            // RC alone (IBA 9.4.1.1: no UC or UD opcode carries an IETH).
            consts::MLX5_OPCODE_SEND_INVAL if rc => (Kind::Send, false),
            consts::MLX5_OPCODE_RDMA_WRITE | consts::MLX5_OPCODE_RDMA_WRITE_IMM if connected => {
                let (raddr, rkey) = raddr(at)?;
                at += RADDR_SEG;
                (Kind::Write { raddr, rkey }, opcode == consts::MLX5_OPCODE_RDMA_WRITE_IMM)
            }
            consts::MLX5_OPCODE_RDMA_READ if rc => {
                let (raddr, rkey) = raddr(at)?;
                at += RADDR_SEG;
                (Kind::Read { raddr, rkey }, false)
            }
            consts::MLX5_OPCODE_ATOMIC_CS | consts::MLX5_OPCODE_ATOMIC_FA if rc => {
                use c::mlx5_wqe_atomic_seg as a;
                let (raddr, rkey) = raddr(at)?;
                at += RADDR_SEG;
                if at + ATOMIC_SEG > bytes {
                    return Err(bad(nbb, opcode));
                }
                let swap_add = be64(wqe, at + a::SWAP_ADD.off);
                let compare = be64(wqe, at + a::COMPARE.off);
                at += ATOMIC_SEG;
                let op = if opcode == consts::MLX5_OPCODE_ATOMIC_CS {
                    AtomicOp::CmpSwap { compare, swap: swap_add }
                } else {
                    AtomicOp::FetchAdd { add: swap_add }
                };
                (Kind::Atomic { raddr, rkey, op }, false)
            }
            consts::MLX5_OPCODE_UMR if umr_qp => {
                use c::mlx5_wqe_umr_ctrl_seg as u;
                use mlx5_core::prm::ifc::mkc as m;
                // The UMR control segment, then the mkey context (an `mkc`, as the driver fills it).
                let mk = at + u::SIZE;
                if mk + m::SIZE_BYTES > bytes {
                    return Err(bad(nbb, opcode));
                }
                let seg = &wqe[mk..mk + m::SIZE_BYTES];
                let mut rights = MkeyAccess::empty();
                for (f, r) in [
                    (m::LR, MkeyAccess::LOCAL_READ),
                    (m::LW, MkeyAccess::LOCAL_WRITE),
                    (m::RR, MkeyAccess::REMOTE_READ),
                    (m::RW, MkeyAccess::REMOTE_WRITE),
                    (m::A, MkeyAccess::REMOTE_ATOMIC),
                ] {
                    if mlx5_core::prm::MsgBuf::get(seg, f) != 0 {
                        rights |= r;
                    }
                }
                let kind = Kind::Umr {
                    key: u32::from_be_bytes(imm),
                    mask: be64(wqe, at + u::MKEY_MASK.off),
                    pd: mlx5_core::prm::MsgBuf::get(seg, m::PD),
                    rights,
                    xlt: be(u::XLT_OCTOWORDS, wqe, at) as u16,
                };
                at = bytes;
                (kind, false)
            }
            consts::MLX5_OPCODE_UMR if connected => {
                let (u, entries) = parse_window_umr(wqe, at, u32::from_be_bytes(imm)).ok_or(bad(nbb, opcode))?;
                klm = entries;
                at = bytes;
                (Kind::Window(u), false)
            }
            _ => return Err(bad(nbb, opcode)),
        };
        let segs = &mut w.segs;
        segs.clear();
        let inline = &mut self.inline;
        inline.clear();
        inline.extend_from_slice(&wqe[klm]);
        if kind != Kind::Nop {
            // Bounded: every segment advances `at` by at least 16 bytes.
            while at < bytes {
                use c::mlx5_wqe_data_seg as d;
                let bc = be(d::BYTE_COUNT, wqe, at);
                if bc & INLINE_FLAG != 0 {
                    let n = (bc & !INLINE_FLAG) as usize;
                    // Bit 31 is the inline flag, so an SGE length of 2 GiB or more posted as is (rdma-core's
                    // `set_data_ptr_seg` writes it unchanged) reads as an inline segment. Drivers write one inline
                    // segment holding all of a WQE's inline bytes and never an empty one: anything else is the
                    // local length error a ConnectX reports for such a length. (A lone 0x8000_0001 stays
                    // indistinguishable from a one-byte inline send.)
                    if n == 0 || !segs.is_empty() {
                        return Err(BadWqe {
                            syndrome: consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR,
                            ..bad(nbb, opcode)
                        });
                    }
                    let end = at.checked_add(INLINE_HDR + n).filter(|&e| e <= bytes).ok_or(bad(nbb, opcode))?;
                    segs.push(Seg::inline(inline.len(), n));
                    inline.extend_from_slice(&wqe[at + INLINE_HDR..end]);
                    at = end.next_multiple_of(DS);
                } else {
                    if at + DATA_SEG > bytes {
                        return Err(bad(nbb, opcode));
                    }
                    if segs.iter().any(|s| s.inline) {
                        return Err(BadWqe {
                            syndrome: consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR,
                            ..bad(nbb, opcode)
                        });
                    }
                    let len = if bc == 0 { ZERO_COUNT_BYTES } else { u64::from(bc) };
                    let lkey = be(d::LKEY, wqe, at);
                    // Filled in place (see `Small::push_slot`).
                    let seg = segs.push_slot();
                    seg.sge.addr = be64(wqe, at + d::ADDR.off);
                    seg.sge.len = len;
                    seg.sge.lkey = lkey;
                    at += DATA_SEG;
                }
            }
        }
        w.index = index;
        w.nbb = nbb;
        w.opcode = opcode;
        w.signaled = fm & consts::MLX5_WQE_CTRL_CQ_UPDATE != 0;
        w.solicited = fm & SOLICITED != 0;
        w.fence = fm & FENCE_MODE_MASK != 0;
        w.imm = with_imm.then_some(imm);
        w.invalidate = (opcode == consts::MLX5_OPCODE_SEND_INVAL).then(|| u32::from_be_bytes(imm));
        w.kind = kind;
        w.av = av;
        w.xrc_srqn = xrc_srqn;
        Ok(())
    }

    /// The next posted receive WQE of `qpn`, without consuming it: its index, and its scatter list into `sges`
    /// (empty on entry; filled in place, as returning the list by value costs more than reading the WQE).
    #[inline]
    pub(super) fn next_recv(&mut self, qpn: u32, sges: &mut Sges) -> Option<u16> {
        use c::mlx5_wqe_data_seg as d;
        let qp = self.qps.get(&qpn)?;
        if let Some(srqn) = qp.recv_srq() {
            return next_srq_recv(self.srqs, self.dma, self.events, qpn, srqn, sges);
        }
        if qp.rq_wqes() == 0 {
            return None;
        }
        let mut rec = [0u8; 4];
        self.dma.read(qp.dbr + RCV_DBR, &mut rec).ok()?;
        let head = (u32::from_be_bytes(rec) & CTR16) as u16;
        let pending = head.wrapping_sub(qp.rq_ci);
        if pending == 0 {
            return None;
        }
        if u32::from(pending) > qp.rq_wqes() {
            self.events.push(SimEvent::BadRqCounter { qpn, head });
            return None;
        }
        let index = qp.rq_ci;
        let stride = usize::try_from(qp.rq_stride()).ok()?;
        // A buffer no larger than the usual WQE (up to four SGEs), zeroed for nothing otherwise.
        let mut small = [0u8; RQ_SMALL];
        let mut stack;
        let mut heap = Vec::new();
        let wqe: &mut [u8] = if stride <= RQ_SMALL {
            &mut small[..stride]
        } else if stride <= WQE_STACK {
            stack = [0u8; WQE_STACK];
            &mut stack[..stride]
        } else {
            heap.resize(stride, 0);
            &mut heap
        };
        qp.read_rq(self.dma, index, wqe).ok()?;
        for seg in wqe.chunks_exact(DATA_SEG) {
            let lkey = be(d::LKEY, seg, 0);
            if lkey == INVALID_LKEY {
                break;
            }
            let bc = be(d::BYTE_COUNT, seg, 0);
            let len = if bc == 0 { ZERO_COUNT_BYTES } else { u64::from(bc) };
            let sge = sges.push_slot();
            sge.addr = be64(seg, d::ADDR.off);
            sge.len = len;
            sge.lkey = lkey;
        }
        Some(index)
    }
}

/// Parses a user QP's UMR on an indirect key (rdma-core's `set_bind_wr` and `mlx5dv_wr_mr_list`): the UMR control
/// segment at `at`, the mkey context after it, and for a layout the KLM entries after that (`klm_octowords` of
/// them, zero-padded to 64 bytes; the entries that make up the new length count). Returns the UMR and where its
/// entries are in `wqe`; `None` for a WQE too short for its segments, or one that leaves `free` unmasked.
fn parse_window_umr(wqe: &[u8], at: usize, key: u32) -> Option<(WindowUmr, std::ops::Range<usize>)> {
    use c::mlx5_klm as k;
    use c::mlx5_stride_block_ctrl_seg as rb;
    use c::mlx5_stride_block_entry as se;
    use c::mlx5_wqe_umr_ctrl_seg as u;
    use mlx5_core::prm::ifc::mkc as m;
    use mlx5_core::prm::MsgBuf;
    let mk = at + u::SIZE;
    let seg = wqe.get(mk..mk + m::SIZE_BYTES)?;
    let flags = u32::from(wqe[at + u::FLAGS.off]);
    let mask = be64(wqe, at + u::MKEY_MASK.off);
    let has = |bit: u32| mask & u64::from(bit) != 0;
    if !has(consts::MLX5_MKEY_MASK_FREE) {
        return None;
    }
    let mut rights_mask = MkeyAccess::empty();
    let mut rights = MkeyAccess::empty();
    for (b, f, r) in [
        (consts::MLX5_MKEY_MASK_LR, m::LR, MkeyAccess::LOCAL_READ),
        (consts::MLX5_MKEY_MASK_LW, m::LW, MkeyAccess::LOCAL_WRITE),
        (consts::MLX5_MKEY_MASK_RR, m::RR, MkeyAccess::REMOTE_READ),
        (consts::MLX5_MKEY_MASK_RW, m::RW, MkeyAccess::REMOTE_WRITE),
        (consts::MLX5_MKEY_MASK_A, m::A, MkeyAccess::REMOTE_ATOMIC),
    ] {
        if has(b) {
            rights_mask |= r;
            if MsgBuf::get(seg, f) != 0 {
                rights |= r;
            }
        }
    }
    let umr = WindowUmr {
        key,
        variant: has(consts::MLX5_MKEY_MASK_KEY).then(|| MsgBuf::get(seg, m::MKEY_7_0) as u8),
        qpn: MsgBuf::get(seg, m::QPN),
        check_qpn: flags & consts::MLX5_WQE_UMR_CTRL_FLAG_CHECK_QPN != 0,
        free: MsgBuf::get(seg, m::FREE) != 0,
        start: has(consts::MLX5_MKEY_MASK_START_ADDR).then(|| MsgBuf::get64(seg, m::START_ADDR)),
        len: has(consts::MLX5_MKEY_MASK_LEN).then(|| MsgBuf::get64(seg, m::LEN)),
        rights_mask,
        rights,
        repeat: None,
    };
    if umr.free {
        return Some((umr, 0..0));
    }
    // One entry per 16 bytes of translation; those that make up the length count, the padding does not.
    let from = mk + m::SIZE_BYTES;
    let given = usize::from(be(u::XLT_OCTOWORDS, wqe, at) as u16);
    let area = wqe.get(from..from + given * k::SIZE)?;
    // An interleaved layout (`mlx5dv_wr_mr_interleaved`): a repeat block header where a KLM list has its first
    // entry, told apart by its `op`; then `num_entries` strided entries, all inside the translation area.
    if let Some(head) = area.get(..rb::SIZE).filter(|h| be(rb::OP, h, 0) == consts::MLX5_STRIDE_BLOCK_OP) {
        let n = usize::from(be(rb::NUM_ENTRIES, head, 0) as u16);
        let repeat = RepeatBlock {
            repeat_count: be(rb::REPEAT_COUNT, head, 0),
            bcount_per_cycle: be(rb::BCOUNT_PER_CYCLE, head, 0),
        };
        let entries = from + rb::SIZE..from + rb::SIZE + n * se::SIZE;
        area.get(rb::SIZE..rb::SIZE + n * se::SIZE)?;
        return Some((WindowUmr { repeat: Some(repeat), ..umr }, entries));
    }
    let mut n = 0;
    let mut total = 0u64;
    for e in area.chunks_exact(k::SIZE) {
        if umr.len.is_some_and(|l| total >= l) || (umr.len.is_none() && be(k::BCOUNT, e, 0) == 0) {
            break;
        }
        total += u64::from(be(k::BCOUNT, e, 0));
        n += 1;
    }
    Some((umr, from..from + n * k::SIZE))
}
