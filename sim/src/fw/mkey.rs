//! Datapath side: `transport/keys.rs` (gathers, scatters and remote targets through the keys checked here).
//!
//! Memory keys: [`MkeyTable`] with CREATE_MKEY / DESTROY_MKEY over the narrow [`MkeyFw`] view, and the access
//! check the datapath applies to every lkey and rkey (the kernel's `mr.c` from the device side).
//!
//! Two translations are modelled: PA (`MLX5_MKC_ACCESS_MODE_PA`, the identity; with `length64` it covers every
//! IOVA) and MTT (`MLX5_MKC_ACCESS_MODE_MTT`: one page address per page of `start_addr .. start_addr + len`, the
//! first entry mapping the page that contains `start_addr`). `mkc.log_page_size` is the absolute page shift.
//! `start_addr` is the key's virtual address, unrelated to where the memory is on the bus; every access is checked
//! against `start_addr .. start_addr + len` and translated through the MTT.

use std::ops::{BitOr, BitOrAssign};

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf};

use super::reply::{bad_param, err, rd, CmdErr};
use std::ops::{Deref, DerefMut};

use super::caps::Caps;
use super::ids::{alloc_id, IdSet};
use super::syndrome;
use crate::dma::DmaSpace;
use crate::small::IdMap;

/// `qpn` of a key not bound to a QP.
const QPN_NONE: u32 = 0xff_ffff;
/// Bytes per MTT entry (a be64 page address) in `klm_pas_mtt`.
const MTT_BYTES: usize = 8;
/// MTT entries per `translations_octword_size` unit (16 bytes).
const MTT_PER_OCTWORD: u64 = 2;
/// The smallest MTT page shift (4 KiB) and the largest a u64 address can hold.
const MIN_PAGE_SHIFT: u32 = consts::MLX5_ADAPTER_PAGE_SHIFT;
const MAX_PAGE_SHIFT: u32 = 63;
/// The variant byte is the key's low byte; the index is above it (`mlx5_idx_to_mkey`: `idx << 8`).
const VARIANT_BITS: u32 = 8;

/// Access rights an access asks for, or a key grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct MkeyAccess(u8);

impl MkeyAccess {
    /// Local read: every key allows it.
    pub const LOCAL_READ: Self = Self(1 << 0);
    /// Local write (`mkc.lw`).
    pub const LOCAL_WRITE: Self = Self(1 << 1);
    /// Remote read (`mkc.rr`).
    pub const REMOTE_READ: Self = Self(1 << 2);
    /// Remote write (`mkc.rw`).
    pub const REMOTE_WRITE: Self = Self(1 << 3);
    /// Remote atomic (`mkc.a`).
    pub const REMOTE_ATOMIC: Self = Self(1 << 4);

    pub const fn empty() -> Self {
        Self(0)
    }

    pub const fn bits(self) -> u8 {
        self.0
    }

    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Whether every right in `other` is in `self`.
    pub const fn contains(self, other: Self) -> bool {
        self.0 & other.0 == other.0
    }

    /// The rights in `self` that are not in `other`.
    pub const fn difference(self, other: Self) -> Self {
        Self(self.0 & !other.0)
    }
}

impl BitOr for MkeyAccess {
    type Output = Self;
    fn bitor(self, rhs: Self) -> Self {
        Self(self.0 | rhs.0)
    }
}

impl BitOrAssign for MkeyAccess {
    fn bitor_assign(&mut self, rhs: Self) {
        self.0 |= rhs.0;
    }
}

/// Why an access through a memory key fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MkeyFault {
    /// No live key has this index.
    UnknownKey,
    /// The key's low byte differs from the key's `mkey_7_0`.
    VariantMismatch,
    /// The access comes from another protection domain.
    PdMismatch,
    /// The range is not inside `start_addr .. start_addr + len` (or wraps around 2^64).
    OutOfBounds,
    /// The key does not grant these rights.
    AccessDenied(MkeyAccess),
    /// The translated piece starting at `iova` is not entirely in live DMA memory.
    NotMapped { iova: u64 },
    /// A memory window that is not bound (free), or is bound to another QP (type 2).
    WindowUnbound,
}

#[derive(Debug)]
enum Translation {
    /// The identity.
    Pa,
    /// Page `k` of the key (counted from `start_addr` rounded down to the page) is at `mtt[k]`.
    Mtt { page_shift: u32, mtt: Vec<u64> },
    /// An indirect key (`free`, `umr_en`, KLM access mode): a memory window as `mlx5_ib_alloc_mw` creates it, or
    /// an mlx5dv mkey. Nothing until a UMR WQE lays it over ranges of other keys.
    Window(Option<Binding>),
    /// Device memory (`MLX5_MKC_ACCESS_MODE_MEMIC`, mlx5_ib's `mlx5_ib_get_dm_mr`): `start_addr` is a BAR offset
    /// in the MEMIC region and the key is zero based (`ibv_reg_dm_mr` requires it), so byte `va` of the key is
    /// device memory byte `dev + va`, at IOVA [`memic::DMA_BASE`](super::memic::DMA_BASE) plus that.
    Memic { dev: u64 },
}

/// One KLM entry: `len` bytes at `addr` of key `key`; in a repeat block, cycle `c` takes them at
/// `addr + c * stride` (`stride` is 0 in a KLM list).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Klm {
    pub(crate) key: u32,
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) stride: u64,
}

/// What a bound indirect key maps: `start .. start + len` of the key is `cycles` cycles of its entries one after
/// the other (a KLM list is one cycle; an interleaved layout's repeat block has `repeat_count`), and a type 2
/// window answers only on QP `qpn`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Binding {
    entries: Vec<Klm>,
    /// The bytes of one cycle: the sum of the entries' lengths.
    cycle: u64,
    cycles: u64,
    qpn: Option<u32>,
}

/// A memory key.
#[derive(Debug)]
pub(crate) struct Mkey {
    pub(crate) pd: u32,
    /// `mkey_7_0`.
    variant: u8,
    start: u64,
    len: u64,
    /// The key covers every address (`length64`, PA keys only).
    length64: bool,
    rights: MkeyAccess,
    translation: Translation,
    /// `en_rinval`: a remote SEND with invalidate may free the key (a type 2 window).
    en_rinval: bool,
    /// `translations_octword_size`: the most entries a UMR may lay an indirect key over.
    descriptors: u32,
}

impl Mkey {
    /// The IOVA of `va..va + len` when it translates to one range: a PA key, or an MTT range inside one page (the
    /// datapath's usual access, translated without building a list). `None` for an empty range and for one
    /// [`MkeyTable::pieces`] must split (or refuse); the range must have passed [`MkeyTable::check`].
    #[inline]
    pub(crate) fn contiguous(&self, va: u64, len: u64) -> Option<u64> {
        if len == 0 {
            return None;
        }
        match &self.translation {
            Translation::Pa => Some(va),
            Translation::Memic { dev } => Some(super::memic::DMA_BASE + dev + va),
            // `check` resolves a window to the key it is bound over.
            Translation::Window(_) => None,
            Translation::Mtt { page_shift, mtt } => {
                let page = 1u64 << page_shift;
                let off = va.checked_sub(self.start & !(page - 1))?;
                let in_page = off & (page - 1);
                if len > page - in_page {
                    return None;
                }
                let pa = *mtt.get(usize::try_from(off >> page_shift).ok()?)?;
                Some(pa + in_page)
            }
        }
    }
}

/// The first mkey index handed out: index 1 with variant 0 is key 0x100, `MLX5_INVALID_LKEY`, the key that ends a
/// scatter list (mlx5e's first mkey, variant 0, would otherwise be it and its receive WQEs would scatter nothing).
const MKEY_INDEX_FIRST: u32 = 2;

/// The memory key table: every key by index (the datapath looks keys up here), and the index CREATE_MKEY tries
/// next.
#[derive(Debug)]
pub(crate) struct MkeyTable {
    map: IdMap<Mkey>,
    next: u32,
}

impl MkeyTable {
    pub(crate) fn new() -> Self {
        MkeyTable { map: IdMap::new(), next: MKEY_INDEX_FIRST }
    }
}

impl Deref for MkeyTable {
    type Target = IdMap<Mkey>;
    #[inline]
    fn deref(&self) -> &IdMap<Mkey> {
        &self.map
    }
}

impl DerefMut for MkeyTable {
    #[inline]
    fn deref_mut(&mut self) -> &mut IdMap<Mkey> {
        &mut self.map
    }
}

/// What the memory key commands need of the rest of the firmware, and nothing more.
pub(crate) struct MkeyFw<'a> {
    pub(crate) caps: &'a Caps,
    /// The allocated protection domains.
    pub(crate) pds: &'a IdSet,
}

impl MkeyTable {
    pub(crate) fn create(&mut self, fw: &MkeyFw, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::create_mkey_in as i;
        use ifc::mkc as m;
        let ctx = i::MEMORY_KEY_MKEY_ENTRY;
        let get = |f: mlx5_core::prm::Field| rd(inp, f.at(ctx));
        // The access mode is split over two fields: bits 1:0 and bits 4:2.
        let mode = get(m::ACCESS_MODE_4_2) << 2 | get(m::ACCESS_MODE_1_0);
        // A memory window: a free KLM key that only UMR fills, as `mlx5_ib_alloc_mw` asks (with `imaicl`).
        let window = get(m::FREE) != 0
            && get(m::UMR_EN) != 0
            && mode == consts::MLX5_MKC_ACCESS_MODE_KLMS
            && fw.caps.gen(ifc::cmd_hca_cap::IMAICL) != 0;
        let unsupported = (get(m::FREE) != 0 && !window)
            || get(m::BSF_EN) != 0
            || rd(inp, i::MKEY_UMEM_VALID) != 0
            || get(m::CROSSING_TARGET_VHCA_ID) != 0;
        // Relaxed ordering only where the device reports it (mlx5_ib sets the bits only then).
        let ro_refused = (get(m::RELAXED_ORDERING_WRITE) != 0
            && fw.caps.gen(ifc::cmd_hca_cap::RELAXED_ORDERING_WRITE) == 0)
            || (get(m::RELAXED_ORDERING_READ) != 0
                && fw.caps.gen(ifc::cmd_hca_cap::RELAXED_ORDERING_READ) == 0
                && fw.caps.gen(ifc::cmd_hca_cap::RELAXED_ORDERING_READ_PCI_ENABLED) == 0);
        if unsupported || ro_refused {
            return Err(bad_param(syndrome::MKEY_FEATURE));
        }
        let memic = mode == consts::MLX5_MKC_ACCESS_MODE_MEMIC && fw.caps.memic_region().is_some();
        let direct = [consts::MLX5_MKC_ACCESS_MODE_PA, consts::MLX5_MKC_ACCESS_MODE_MTT].contains(&mode);
        if !window && !memic && !direct {
            return Err(bad_param(syndrome::MKEY_ACCESS_MODE));
        }
        if get(m::QPN) != QPN_NONE {
            return Err(bad_param(syndrome::MKEY_QPN));
        }
        let pd = get(m::PD);
        if !fw.pds.contains(pd) {
            return Err(bad_param(syndrome::PD_INVALID));
        }
        let start = inp.get64(m::START_ADDR.at(ctx));
        let len = inp.get64(m::LEN.at(ctx));
        let length64 = get(m::LENGTH64) != 0;
        let end = start.checked_add(len);
        let translation = if window {
            // Its range and rights come with each bind.
            Translation::Window(None)
        } else if memic {
            let (base, size) = fw.caps.memic_region().unwrap_or_default();
            // The whole key lies in the region: `start .. start + len` as BAR offsets.
            let inside = start >= base && end.is_some_and(|e| e <= base + size) && !length64;
            if !inside {
                return Err(bad_param(syndrome::MKEY_LENGTH));
            }
            Translation::Memic { dev: start - base }
        } else if mode == consts::MLX5_MKC_ACCESS_MODE_PA {
            if !length64 && end.is_none() {
                return Err(bad_param(syndrome::MKEY_LENGTH));
            }
            Translation::Pa
        } else {
            let end = match end {
                Some(e) if !length64 => e,
                _ => return Err(bad_param(syndrome::MKEY_LENGTH)),
            };
            let page_shift = get(m::LOG_PAGE_SIZE);
            if !(MIN_PAGE_SHIFT..=MAX_PAGE_SHIFT).contains(&page_shift) {
                return Err(bad_param(syndrome::MKEY_PAGE_SIZE));
            }
            let mtt = Self::read_mtt(dma, inp, start, end, page_shift)?;
            Translation::Mtt { page_shift, mtt }
        };
        let mut rights = MkeyAccess::LOCAL_READ;
        for (f, r) in [
            (m::LW, MkeyAccess::LOCAL_WRITE),
            (m::RR, MkeyAccess::REMOTE_READ),
            (m::RW, MkeyAccess::REMOTE_WRITE),
            (m::A, MkeyAccess::REMOTE_ATOMIC),
        ] {
            if get(f) != 0 {
                rights |= r;
            }
        }
        let limit = 1u32 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_MKEY).min(24);
        let index = alloc_id(&self.map, &mut self.next, MKEY_INDEX_FIRST, limit.max(MKEY_INDEX_FIRST + 1))
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        // An indirect key's length comes with its first UMR.
        let len = if window { 0 } else { len };
        // A device memory key is zero based: its range starts at 0, whatever BAR offset it maps.
        let start = if memic { 0 } else { start };
        let en_rinval = get(m::EN_RINVAL) != 0;
        let descriptors = get(m::TRANSLATIONS_OCTWORD_SIZE);
        let variant = get(m::MKEY_7_0) as u8;
        let mkey = Mkey { pd, variant, start, len, length64, rights, translation, en_rinval, descriptors };
        self.map.insert(index, mkey);
        out.set(ifc::create_mkey_out::MKEY_INDEX, index);
        Ok(())
    }

    /// Reads and checks the MTT of a key over `start..end`: one entry per page, aligned to the page, with the
    /// part of the page the key covers in live DMA memory.
    fn read_mtt(dma: &DmaSpace, inp: &[u8], start: u64, end: u64, page_shift: u32) -> Result<Vec<u64>, CmdErr> {
        use ifc::create_mkey_in as i;
        let page = 1u64 << page_shift;
        let base = start & !(page - 1);
        let npages = if end == start { 0 } else { (end - base).div_ceil(page) };
        let octwords = u64::from(rd(inp, ifc::mkc::TRANSLATIONS_OCTWORD_SIZE.at(i::MEMORY_KEY_MKEY_ENTRY)));
        let given = (inp.len().saturating_sub(i::KLM_PAS_MTT.byte_off()) / MTT_BYTES) as u64;
        if octwords * MTT_PER_OCTWORD < npages || given < npages {
            return Err(bad_param(syndrome::PAS_TOO_FEW));
        }
        // With `pg_access` the driver ORs `MLX5_IB_MTT_PRESENT` (read and write) into each entry's low bits.
        let flags = if rd(inp, i::PG_ACCESS) != 0 { u64::from(consts::MLX5_IB_MTT_PRESENT) } else { 0 };
        let mut mtt = Vec::with_capacity(npages as usize);
        for k in 0..npages {
            let pa = inp.read_u64(i::KLM_PAS_MTT.byte_off() + k as usize * MTT_BYTES) & !flags;
            if pa & (page - 1) != 0 {
                return Err(bad_param(syndrome::PAS_MISALIGNED));
            }
            let page_start = base + k * page;
            let lo = start.max(page_start) - page_start;
            let hi = end.min(page_start.saturating_add(page)) - page_start;
            let covered = pa.checked_add(lo).filter(|&a| dma.is_mapped(a, (hi - lo) as usize));
            if covered.is_none() {
                return Err(bad_param(syndrome::PAS_NOT_MAPPED));
            }
            mtt.push(pa);
        }
        Ok(mtt)
    }

    pub(crate) fn destroy(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let index = rd(inp, ifc::destroy_mkey_in::MKEY_INDEX);
        if self.map.remove(&index).is_none() {
            return Err(bad_param(syndrome::MKEY_INVALID));
        }
        Ok(())
    }
}

/// What a UMR WQE changes of a key (`mlx5r_umr_rereg_pd_access`: the PD and the access rights, the key staying
/// in use): the PD when `Some`, and the rights in `rights_mask` to their value in `rights`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct MkeyUpdate {
    pub(crate) pd: Option<u32>,
    pub(crate) rights_mask: MkeyAccess,
    pub(crate) rights: MkeyAccess,
}

impl MkeyTable {
    fn rights_from_bits(b: u8) -> MkeyAccess {
        MkeyAccess(b)
    }

    /// Applies a UMR's update to `key` (its index and variant must name a live key).
    pub(crate) fn umr_update(&mut self, key: u32, u: MkeyUpdate) -> Result<(), MkeyFault> {
        let mk = self.map.get_mut(&(key >> VARIANT_BITS)).ok_or(MkeyFault::UnknownKey)?;
        if key as u8 != mk.variant {
            return Err(MkeyFault::VariantMismatch);
        }
        if let Some(pd) = u.pd {
            mk.pd = pd;
        }
        let (m, r) = (u.rights_mask.bits(), u.rights.bits());
        // Local read is every key's.
        mk.rights = Self::rights_from_bits((mk.rights.bits() & !m) | (r & m)) | MkeyAccess::LOCAL_READ;
        Ok(())
    }
}

/// A UMR WQE a user QP posts on an indirect key: rdma-core's `set_bind_wr` (`ibv_bind_mw`, `IBV_WR_BIND_MW`,
/// `IBV_WR_LOCAL_INV`) and its mlx5dv mkey builders (`mlx5dv_wr_mr_list`). `key` is the WQE's immediate (its
/// index counts); each `Option` is a field the `mkey_mask` changes; the KLM entries come separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct WindowUmr {
    pub(crate) key: u32,
    pub(crate) variant: Option<u8>,
    /// The mkey context's `qpn` (0xffffff: any QP; a type 2 window's bind names the posting QP).
    pub(crate) qpn: u32,
    /// `MLX5_WQE_UMR_CTRL_FLAG_CHECK_QPN`: a bound key must be bound to the posting QP.
    pub(crate) check_qpn: bool,
    /// The mkey context's `free`: the UMR frees the key instead of laying it out.
    pub(crate) free: bool,
    pub(crate) start: Option<u64>,
    pub(crate) len: Option<u64>,
    /// The rights the mask names, and their new values.
    pub(crate) rights_mask: MkeyAccess,
    pub(crate) rights: MkeyAccess,
    /// A repeat block (`mlx5dv_wr_mr_interleaved`) instead of a KLM list: its header's cycle count and bytes per
    /// cycle; its entries come with their strides.
    pub(crate) repeat: Option<RepeatBlock>,
}

/// The header of an interleaved layout (`struct mlx5_stride_block_ctrl_seg`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct RepeatBlock {
    pub(crate) repeat_count: u32,
    pub(crate) bcount_per_cycle: u32,
}

impl MkeyTable {
    /// Executes an indirect key's UMR posted on QP `qpn` of PD `pd` with its KLM `entries`, with the checks a
    /// bind makes (IBA 10.6.7: the key and every region in the QP's PD, each range inside its region, remote write
    /// or atomic rights only over regions with local write, the entries covering the key's length; a type 2 window
    /// free before a bind and bound to the QP that binds it). No more entries than the key's descriptors; a repeat
    /// block has at least one entry, none empty, at least one cycle, and every cycle of each entry (`addr` plus
    /// `stride` per cycle) inside its region.
    pub(crate) fn umr_window(&mut self, pd: u32, qpn: u32, u: &WindowUmr, entries: &[Klm]) -> Result<(), MkeyFault> {
        let index = u.key >> VARIANT_BITS;
        let mk = self.map.get(&index).ok_or(MkeyFault::UnknownKey)?;
        let Translation::Window(binding) = &mk.translation else { return Err(MkeyFault::UnknownKey) };
        if mk.pd != pd {
            return Err(MkeyFault::PdMismatch);
        }
        if u.check_qpn && binding.as_ref().is_some_and(|b| b.qpn.is_some_and(|q| q != qpn)) {
            return Err(MkeyFault::WindowUnbound);
        }
        // A type 2 window (`en_rinval`) is bound to the QP that binds it, and only from the free state (IBA
        // 10.6.7.2.1; rdma-core flags that check with a bit Linux's `mlx5r_umr` names otherwise, so the state is
        // checked here, not by that bit). Type 1 windows and mlx5dv mkeys name no QP.
        let bound_qpn = (u.qpn != QPN_NONE).then_some(u.qpn);
        if !u.free && bound_qpn.is_some() && (!mk.en_rinval || bound_qpn != Some(qpn) || binding.is_some()) {
            return Err(MkeyFault::WindowUnbound);
        }
        let rights = MkeyAccess((mk.rights.bits() & !u.rights_mask.bits()) | (u.rights.bits() & u.rights_mask.bits()));
        let (start, len) = (u.start.unwrap_or(mk.start), u.len.unwrap_or(mk.len));
        let cycles = u.repeat.map_or(1, |r| u64::from(r.repeat_count));
        let mut cycle = 0u64;
        if !u.free {
            if entries.len() > mk.descriptors as usize {
                return Err(MkeyFault::OutOfBounds);
            }
            if u.repeat.is_some() && (entries.is_empty() || cycles == 0 || entries.iter().any(|e| e.len == 0)) {
                return Err(MkeyFault::OutOfBounds);
            }
            let needs_lw = MkeyAccess::REMOTE_WRITE.bits() | MkeyAccess::REMOTE_ATOMIC.bits();
            for e in entries {
                // Every cycle's piece of this entry: from `addr` to the last cycle's end.
                let span = e.stride.checked_mul(cycles - 1).and_then(|s| s.checked_add(e.len));
                let span = span.ok_or(MkeyFault::OutOfBounds)?;
                let region = self.plain_check(e.key, Some(pd), e.addr, span, MkeyAccess::empty())?;
                if matches!(region.translation, Translation::Window(_)) {
                    return Err(MkeyFault::UnknownKey);
                }
                if rights.bits() & needs_lw != 0 && !region.rights.contains(MkeyAccess::LOCAL_WRITE) {
                    return Err(MkeyFault::AccessDenied(MkeyAccess::LOCAL_WRITE));
                }
                cycle = cycle.checked_add(e.len).ok_or(MkeyFault::OutOfBounds)?;
            }
            let header_agrees = u.repeat.is_none_or(|r| u64::from(r.bcount_per_cycle) == cycle);
            let total = cycle.checked_mul(cycles);
            if !header_agrees || total != Some(len) || start.checked_add(len).is_none() {
                return Err(MkeyFault::OutOfBounds);
            }
        }
        let mk = self.map.get_mut(&index).ok_or(MkeyFault::UnknownKey)?;
        if let Some(v) = u.variant {
            mk.variant = v;
        }
        if u.free {
            mk.len = 0;
            mk.translation = Translation::Window(None);
        } else {
            mk.start = start;
            mk.len = len;
            mk.rights = rights;
            let binding = Binding { entries: entries.to_vec(), cycle, cycles, qpn: bound_qpn };
            mk.translation = Translation::Window(Some(binding));
        }
        Ok(())
    }

    /// A SEND with invalidate's `rkey` arriving on QP `qpn` of PD `pd`: frees a key created with `en_rinval` (a
    /// type 2 window bound to that QP, or an mlx5dv mkey). The key must be live, with its variant, in the PD.
    pub(crate) fn remote_invalidate(&mut self, pd: u32, qpn: u32, rkey: u32) -> Result<(), MkeyFault> {
        let mk = self.map.get_mut(&(rkey >> VARIANT_BITS)).ok_or(MkeyFault::UnknownKey)?;
        if rkey as u8 != mk.variant {
            return Err(MkeyFault::VariantMismatch);
        }
        if mk.pd != pd {
            return Err(MkeyFault::PdMismatch);
        }
        if !mk.en_rinval {
            return Err(MkeyFault::AccessDenied(MkeyAccess::empty()));
        }
        match &mk.translation {
            Translation::Window(Some(b)) if b.qpn.is_none_or(|q| q == qpn) => {
                mk.len = 0;
                mk.translation = Translation::Window(None);
                Ok(())
            }
            _ => Err(MkeyFault::WindowUnbound),
        }
    }
}

/// The IOVA pieces (address, length) an access through a key touches, in order.
pub(crate) type Pieces = crate::small::Small<(u64, u64), 4>;

impl MkeyTable {
    /// Checks an access through `key` and translates it (see [`crate::sim_device::SimDevice::mkey_access`]).
    pub(crate) fn access(
        &self,
        dma: &DmaSpace,
        key: u32,
        pd: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<Vec<(u64, u64)>, MkeyFault> {
        self.pieces(dma, key, pd, None, va, len, access).map(|p| p.to_vec())
    }

    /// Checks an access through `key` (key, variant, PD, rights, bounds), without translating it; `qpn` is the
    /// QP a remote access arrives on (a type 2 window answers only its own). Returns `key`'s entry (a window's
    /// own: [`Mkey::contiguous`] is `None` for it, and [`MkeyTable::pieces`] translates through its binding).
    #[inline]
    pub(crate) fn check(
        &self,
        key: u32,
        pd: Option<u32>,
        qpn: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<&Mkey, MkeyFault> {
        let mk = self.plain_check(key, pd, va, len, access)?;
        if let Translation::Window(binding) = &mk.translation {
            let b = binding.as_ref().ok_or(MkeyFault::WindowUnbound)?;
            if b.qpn.is_some_and(|q| qpn != Some(q)) {
                return Err(MkeyFault::WindowUnbound);
            }
            self.walk(b, va - mk.start, len, |_, _, _| Ok(()))?;
        }
        Ok(mk)
    }

    /// Calls `f` with the key, address and length of each piece of `off .. off + len` of an indirect key's
    /// entries (each checked live, in range and not indirect itself), in order: cycle after cycle of the entries,
    /// cycle `c` taking each entry at `addr + c * stride`.
    fn walk(
        &self,
        b: &Binding,
        off: u64,
        len: u64,
        mut f: impl FnMut(&Mkey, u64, u64) -> Result<(), MkeyFault>,
    ) -> Result<(), MkeyFault> {
        if len == 0 {
            return Ok(());
        }
        if b.cycle == 0 {
            return Err(MkeyFault::OutOfBounds);
        }
        let (mut c, mut within) = (off / b.cycle, off % b.cycle);
        let mut left = len;
        // Bounded: every cycle but the first and last consumes `cycle` bytes (no entry is empty), and `c` stops
        // at the binding's cycle count.
        while left > 0 {
            if c >= b.cycles {
                return Err(MkeyFault::OutOfBounds);
            }
            for e in &b.entries {
                if left == 0 {
                    break;
                }
                if within >= e.len {
                    within -= e.len;
                    continue;
                }
                let n = (e.len - within).min(left);
                let at =
                    e.stride.checked_mul(c).and_then(|s| s.checked_add(e.addr)).and_then(|a| a.checked_add(within));
                let at = at.ok_or(MkeyFault::OutOfBounds)?;
                let inner = self.plain_check(e.key, None, at, n, MkeyAccess::empty())?;
                if matches!(inner.translation, Translation::Window(_)) {
                    return Err(MkeyFault::UnknownKey);
                }
                f(inner, at, n)?;
                left -= n;
                within = 0;
            }
            c += 1;
        }
        Ok(())
    }

    /// The checks of one key, without following a window's binding.
    #[inline]
    fn plain_check(
        &self,
        key: u32,
        pd: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<&Mkey, MkeyFault> {
        let mk = self.get(&(key >> VARIANT_BITS)).ok_or(MkeyFault::UnknownKey)?;
        if key as u8 != mk.variant {
            return Err(MkeyFault::VariantMismatch);
        }
        if pd.is_some_and(|p| p != mk.pd) {
            return Err(MkeyFault::PdMismatch);
        }
        let denied = access.difference(mk.rights);
        if !denied.is_empty() {
            return Err(MkeyFault::AccessDenied(denied));
        }
        let end = va.checked_add(len).ok_or(MkeyFault::OutOfBounds)?;
        // CREATE_MKEY refused keys whose range wraps, so `start + len` cannot overflow here.
        if !mk.length64 && (va < mk.start || end > mk.start + mk.len) {
            return Err(MkeyFault::OutOfBounds);
        }
        Ok(mk)
    }

    /// [`MkeyTable::access`] without a heap allocation for the usual few pieces (the datapath's form).
    #[allow(clippy::too_many_arguments)] // An access's coordinates: the key, who asks (PD, QP), the range, the rights.
    pub(crate) fn pieces(
        &self,
        dma: &DmaSpace,
        key: u32,
        pd: Option<u32>,
        qpn: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<Pieces, MkeyFault> {
        let mk = self.check(key, pd, qpn, va, len, access)?;
        let mut pieces = Pieces::new();
        match &mk.translation {
            Translation::Window(Some(b)) => {
                self.walk(b, va - mk.start, len, |inner, at, n| Self::translate(inner, at, n, &mut pieces))?
            }
            _ => Self::translate(mk, va, len, &mut pieces)?,
        }
        for &(iova, n) in pieces.iter() {
            let mapped = usize::try_from(n).is_ok_and(|n| dma.is_mapped(iova, n));
            if !mapped {
                return Err(MkeyFault::NotMapped { iova });
            }
        }
        Ok(pieces)
    }

    /// Appends the IOVA pieces of `va .. va + len` of a direct key (PA or MTT; checked in range) to `pieces`.
    fn translate(mk: &Mkey, va: u64, len: u64, pieces: &mut Pieces) -> Result<(), MkeyFault> {
        let end = va + len;
        match &mk.translation {
            Translation::Pa if len > 0 => pieces.push((va, len)),
            Translation::Memic { dev } if len > 0 => pieces.push((super::memic::DMA_BASE + dev + va, len)),
            Translation::Memic { .. } => {}
            Translation::Pa | Translation::Window(_) => {}
            Translation::Mtt { page_shift, mtt } => {
                let page = 1u64 << page_shift;
                let base = mk.start & !(page - 1);
                let mut at = va;
                // Bounded: one step per page of the range, which lies inside the key's MTT.
                while at < end {
                    let off = at - base;
                    let in_page = off & (page - 1);
                    let n = (page - in_page).min(end - at);
                    let pa = *mtt.get((off >> page_shift) as usize).ok_or(MkeyFault::OutOfBounds)?;
                    let iova = pa + in_page;
                    match pieces.last_mut() {
                        Some(last) if last.0 + last.1 == iova => last.1 += n,
                        _ => pieces.push((iova, n)),
                    }
                    at += n;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::SimEvent;
    use crate::testkit::submit::Harness;
    use mlx5_core::hal::Dma;

    const PAGE: u64 = 4096;

    /// A CREATE_MKEY request.
    #[derive(Clone)]
    struct Key {
        mode: u32,
        pd: u32,
        start: u64,
        len: u64,
        length64: bool,
        log_page: u32,
        mtt: Vec<u64>,
        /// `translations_octword_size`; `None`: enough for `mtt`.
        octwords: Option<u32>,
        rights: [bool; 4],
        variant: u8,
        qpn: u32,
        pg_access: bool,
        free: bool,
        /// `relaxed_ordering_write`, `relaxed_ordering_read`.
        ro: [bool; 2],
    }

    fn mtt_key(pd: u32, start: u64, len: u64, mtt: Vec<u64>) -> Key {
        Key {
            mode: consts::MLX5_MKC_ACCESS_MODE_MTT,
            pd,
            start,
            len,
            length64: false,
            log_page: 12,
            mtt,
            octwords: None,
            rights: [true, true, false, false],
            variant: 0x5a,
            qpn: QPN_NONE,
            pg_access: false,
            free: false,
            ro: [false, false],
        }
    }

    fn pa_key(pd: u32) -> Key {
        Key { mode: consts::MLX5_MKC_ACCESS_MODE_PA, length64: true, mtt: Vec::new(), ..mtt_key(pd, 0, 0, Vec::new()) }
    }

    fn create(h: &mut Harness, k: &Key) -> (u8, u32, u32) {
        use ifc::create_mkey_in as i;
        use ifc::mkc as m;
        let ctx = i::MEMORY_KEY_MKEY_ENTRY;
        let mut inp = vec![0u8; i::KLM_PAS_MTT.byte_off() + MTT_BYTES * k.mtt.len()];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_CREATE_MKEY.into());
        inp.set(i::PG_ACCESS, k.pg_access.into());
        inp.set(m::FREE.at(ctx), k.free.into());
        inp.set(m::RELAXED_ORDERING_WRITE.at(ctx), k.ro[0].into());
        inp.set(m::RELAXED_ORDERING_READ.at(ctx), k.ro[1].into());
        inp.set(m::ACCESS_MODE_1_0.at(ctx), k.mode & 3);
        inp.set(m::ACCESS_MODE_4_2.at(ctx), k.mode >> 2);
        for (f, on) in [m::LW, m::RR, m::RW, m::A].into_iter().zip(k.rights) {
            inp.set(f.at(ctx), on.into());
        }
        inp.set(m::LR.at(ctx), 1);
        inp.set(m::QPN.at(ctx), k.qpn);
        inp.set(m::MKEY_7_0.at(ctx), k.variant.into());
        inp.set(m::LENGTH64.at(ctx), k.length64.into());
        inp.set(m::PD.at(ctx), k.pd);
        inp.set64(m::START_ADDR.at(ctx), k.start);
        inp.set64(m::LEN.at(ctx), k.len);
        inp.set(m::LOG_PAGE_SIZE.at(ctx), k.log_page);
        let octwords = k.octwords.unwrap_or(k.mtt.len().div_ceil(2) as u32);
        inp.set(m::TRANSLATIONS_OCTWORD_SIZE.at(ctx), octwords);
        inp.set(i::TRANSLATIONS_OCTWORD_ACTUAL_SIZE, octwords);
        for (n, pa) in k.mtt.iter().enumerate() {
            inp.write_u64(i::KLM_PAS_MTT.byte_off() + n * MTT_BYTES, *pa);
        }
        let (s, syn, out) = h.cmd(&inp, ifc::create_mkey_out::SIZE_BYTES);
        (s, syn, rd(&out, ifc::create_mkey_out::MKEY_INDEX))
    }

    fn alloc_pd(h: &mut Harness) -> u32 {
        let (s, _, out) = h.simple(consts::MLX5_CMD_OP_ALLOC_PD, 0, 16, 16);
        assert_eq!(s, 0);
        rd(&out, ifc::alloc_pd_out::PD)
    }

    fn destroy(h: &mut Harness, op: u16, f: mlx5_core::prm::Field, n: u32) -> (u8, u32) {
        let mut inp = vec![0u8; 16];
        inp.set(ifc::mbox_in::OPCODE, op.into());
        inp.set(f, n);
        let (s, syn, _) = h.cmd(&inp, 16);
        (s, syn)
    }

    const READ: MkeyAccess = MkeyAccess::LOCAL_READ;

    #[test]
    fn mtt_key_translates_page_by_page_and_merges_adjacent_pages() {
        let mut h = Harness::inline();
        h.bring_up();
        let pd = alloc_pd(&mut h);
        // Page 0 alone; pages 1 and 2 adjacent in one region.
        let p0 = h.dma.alloc(PAGE as usize, PAGE as usize).unwrap();
        let p12 = h.dma.alloc(2 * PAGE as usize, PAGE as usize).unwrap();
        // 8 KiB starting 0x800 into a page: three pages, the first mapped from its rounded-down start.
        let start = 0x7f00_0000_0800;
        let k = mtt_key(pd, start, 2 * PAGE, vec![p0.iova(), p12.iova(), p12.iova() + PAGE]);
        let (s, syn, index) = create(&mut h, &k);
        assert_eq!((s, syn), (0, 0));
        assert!((1..1 << 24).contains(&index));
        assert_eq!(h.dev.mkey_count(), 1);
        let key = index << 8 | 0x5a;
        let whole = h.dev.mkey_access(key, Some(pd), start, 2 * PAGE, READ);
        assert_eq!(whole, Ok(vec![(p0.iova() + 0x800, 0x800), (p12.iova(), 0x1800)]));
        // A range inside one page, and the empty access.
        assert_eq!(h.dev.mkey_access(key, None, start + 0x1000, 16, READ), Ok(vec![(p12.iova() + 0x800, 16)]));
        assert_eq!(h.dev.mkey_access(key, None, start, 0, READ), Ok(vec![]));
        let lw = MkeyAccess::LOCAL_WRITE | MkeyAccess::REMOTE_READ;
        assert!(h.dev.mkey_access(key, Some(pd), start, 8, lw).is_ok());
        // Every fault.
        let f = |va: u64, len: u64, key: u32, pd: Option<u32>, a: MkeyAccess| h.dev.mkey_access(key, pd, va, len, a);
        assert_eq!(f(start, 8, key + (1 << 8), None, READ), Err(MkeyFault::UnknownKey));
        assert_eq!(f(start, 8, key ^ 1, None, READ), Err(MkeyFault::VariantMismatch));
        assert_eq!(f(start, 8, key, Some(pd + 1), READ), Err(MkeyFault::PdMismatch));
        assert_eq!(f(start - 1, 8, key, None, READ), Err(MkeyFault::OutOfBounds));
        assert_eq!(f(start + 2 * PAGE - 4, 8, key, None, READ), Err(MkeyFault::OutOfBounds));
        assert_eq!(f(u64::MAX, 2, key, None, READ), Err(MkeyFault::OutOfBounds));
        let wr = MkeyAccess::REMOTE_WRITE | MkeyAccess::LOCAL_WRITE | MkeyAccess::REMOTE_ATOMIC;
        let denied = MkeyAccess::REMOTE_WRITE | MkeyAccess::REMOTE_ATOMIC;
        assert_eq!(f(start, 8, key, None, wr), Err(MkeyFault::AccessDenied(denied)));
        // Memory freed under a live key is not mapped any more.
        let p0_iova = p0.iova();
        // SAFETY: the region came from this allocator; the check must report it, not touch it.
        unsafe { h.dma.free(p0) };
        assert_eq!(f(start, 16, key, None, READ), Err(MkeyFault::NotMapped { iova: p0_iova + 0x800 }));
        assert_eq!(f(start + 0x800, 16, key, None, READ), Ok(vec![(p12.iova(), 16)]));
        assert!(h.dev.dma_faults().is_empty(), "a check is not a device access");
    }

    #[test]
    fn large_pages_and_pg_access_flags() {
        let mut h = Harness::inline();
        h.bring_up();
        let pd = alloc_pd(&mut h);
        let big = 1u64 << 16;
        let a = h.dma.alloc(big as usize, big as usize).unwrap();
        let b = h.dma.alloc(big as usize, big as usize).unwrap();
        let start = 0x4_0000_0000 + big - 0x100;
        let mut k = mtt_key(pd, start, 0x200, vec![a.iova() | 3, b.iova() | 3]);
        k.log_page = 16;
        k.pg_access = true;
        let (s, _, index) = create(&mut h, &k);
        assert_eq!(s, 0);
        let got = h.dev.mkey_access(index << 8 | 0x5a, Some(pd), start, 0x200, READ);
        assert_eq!(got, Ok(vec![(a.iova() + big - 0x100, 0x100), (b.iova(), 0x100)]));
        // Without pg_access the low bits are part of the address: misaligned.
        k.pg_access = false;
        assert_eq!(create(&mut h, &k).1, syndrome::PAS_MISALIGNED);
    }

    #[test]
    fn a_key_over_mapped_process_memory_at_any_start_with_relaxed_ordering() {
        let mut h =
            Harness::new(crate::config::SimConfig { relaxed_ordering: true, ..crate::config::SimConfig::default() });
        h.bring_up();
        let pd = alloc_pd(&mut h);
        // Two pages of process memory, mapped from an odd offset for 5000 bytes.
        let mut v = vec![0u8; 4 * PAGE as usize];
        let at = (v.as_ptr() as usize).next_multiple_of(PAGE as usize) - v.as_ptr() as usize + 7;
        let p = std::ptr::NonNull::new(v.as_mut_ptr().wrapping_add(at)).unwrap();
        // SAFETY: `v` outlives the mapping (freed below), and nothing else maps it.
        let r = unsafe { h.dma.map_user(p, 5000) }.unwrap();
        // The key's start has nothing to do with the CPU or bus address, only the same offset in the page.
        let start = 0x7777_0000_0007;
        let base = r.iova() & !(PAGE - 1);
        let mut k = mtt_key(pd, start, 5000, vec![base, base + PAGE]);
        k.ro = [true, true];
        let (s, _, index) = create(&mut h, &k);
        assert_eq!(s, 0);
        let key = index << 8 | 0x5a;
        let lw = MkeyAccess::LOCAL_WRITE;
        assert_eq!(h.dev.mkey_access(key, Some(pd), start, 5000, lw), Ok(vec![(r.iova(), 5000)]));
        assert_eq!(h.dev.mkey_access(key, Some(pd), start + 4999, 2, lw), Err(MkeyFault::OutOfBounds));
        // Unmapped under the key: accesses through it fail as for freed memory.
        let iova = r.iova();
        // SAFETY: from this allocator, freed once; the check below must report it, not touch it.
        unsafe { h.dma.free(r) };
        assert_eq!(h.dev.mkey_access(key, Some(pd), start, 8, lw), Err(MkeyFault::NotMapped { iova }));
        drop(v);
    }

    #[test]
    fn pa_key_is_the_identity_over_every_iova() {
        let mut h = Harness::inline();
        h.bring_up();
        let pd = alloc_pd(&mut h);
        let mut k = pa_key(pd);
        k.rights = [true, true, true, true];
        k.variant = 7;
        let (s, _, index) = create(&mut h, &k);
        assert_eq!(s, 0);
        let key = index << 8 | 7;
        let r = h.dma.alloc(3 * PAGE as usize, PAGE as usize).unwrap();
        let all = MkeyAccess::LOCAL_WRITE | MkeyAccess::REMOTE_WRITE | MkeyAccess::REMOTE_ATOMIC;
        assert_eq!(
            h.dev.mkey_access(key, Some(pd), r.iova() + 5, 3 * PAGE - 5, all),
            Ok(vec![(r.iova() + 5, 3 * PAGE - 5)])
        );
        // In bounds everywhere, but only live memory is mapped (the guard page after the region is not).
        let miss = h.dev.mkey_access(key, None, r.iova() + 3 * PAGE, 8, READ);
        assert_eq!(miss, Err(MkeyFault::NotMapped { iova: r.iova() + 3 * PAGE }));
        assert_eq!(h.dev.mkey_access(key, None, u64::MAX - 4, 8, READ), Err(MkeyFault::OutOfBounds));
        // A bounded PA key (no length64) checks its range.
        let mut bounded = pa_key(pd);
        bounded.length64 = false;
        bounded.start = r.iova();
        bounded.len = PAGE;
        let (s, _, index) = create(&mut h, &bounded);
        assert_eq!(s, 0);
        let key = index << 8 | 0x5a;
        assert_eq!(h.dev.mkey_access(key, None, r.iova(), PAGE, READ), Ok(vec![(r.iova(), PAGE)]));
        assert_eq!(h.dev.mkey_access(key, None, r.iova(), PAGE + 1, READ), Err(MkeyFault::OutOfBounds));
    }

    #[test]
    fn a_device_memory_key_is_zero_based_over_its_memic_range() {
        let cfg = crate::config::SimConfig { memic_size: 0x4000, ..Default::default() };
        let base = super::super::caps::memic_bar_start(&cfg);
        let mut h = Harness::new(cfg);
        h.bring_up();
        let pd = alloc_pd(&mut h);
        let memic = |start: u64, len: u64| Key {
            mode: consts::MLX5_MKC_ACCESS_MODE_MEMIC,
            start,
            len,
            mtt: Vec::new(),
            ..mtt_key(pd, 0, 0, Vec::new())
        };
        let (s, _, index) = create(&mut h, &memic(base + 0x100, 0x200));
        assert_eq!(s, 0);
        let key = index << 8 | 0x5a;
        let iova = super::super::memic::DMA_BASE + 0x100;
        // Nothing backs the region yet: the access faults where the bytes would be.
        assert_eq!(h.dev.mkey_access(key, Some(pd), 0x10, 0x20, READ), Err(MkeyFault::NotMapped { iova: iova + 0x10 }));
        let mut backing = vec![0u8; 0x4000];
        let cpu = std::ptr::NonNull::new(backing.as_mut_ptr()).unwrap();
        // SAFETY: refused before anything is mapped (the size is not the configured one).
        let wrong = unsafe { h.dev.map_device_memory(cpu, 0x1000) };
        assert!(wrong.is_err(), "a backing of the wrong size");
        // SAFETY: `backing` outlives the harness's device (dropped after it at the end of the test).
        unsafe { h.dev.map_device_memory(cpu, backing.len()) }.unwrap();
        assert_eq!(h.dev.mkey_access(key, Some(pd), 0x10, 0x20, READ), Ok(vec![(iova + 0x10, 0x20)]));
        assert_eq!(h.dev.mkey_access(key, Some(pd), 0x1f0, 0x20, READ), Err(MkeyFault::OutOfBounds));
        // Keys must lie inside the region.
        assert_eq!(create(&mut h, &memic(base - 0x100, 0x200)).1, syndrome::MKEY_LENGTH);
        assert_eq!(create(&mut h, &memic(base + 0x3f00, 0x200)).1, syndrome::MKEY_LENGTH);
        drop(h);
        drop(backing);
        // Without device memory the mode is refused.
        let mut h = Harness::inline();
        h.bring_up();
        let pd = alloc_pd(&mut h);
        let k = Key { pd, ..memic(base, 0x100) };
        assert_eq!(create(&mut h, &k).1, syndrome::MKEY_ACCESS_MODE);
    }

    #[test]
    fn create_mkey_rejections() {
        let mut h = Harness::inline();
        h.bring_up();
        let pd = alloc_pd(&mut h);
        let p = h.dma.alloc(2 * PAGE as usize, PAGE as usize).unwrap();
        let good = mtt_key(pd, 0x1000_0000, 2 * PAGE, vec![p.iova(), p.iova() + PAGE]);
        let cases: Vec<(&str, Key, u32)> = vec![
            ("unknown PD", Key { pd: pd + 1, ..good.clone() }, syndrome::PD_INVALID),
            (
                "misaligned MTT",
                Key { mtt: vec![p.iova() + 0x100, p.iova() + PAGE], ..good.clone() },
                syndrome::PAS_MISALIGNED,
            ),
            (
                "unmapped MTT",
                Key { mtt: vec![p.iova(), p.iova() + 2 * PAGE], ..good.clone() },
                syndrome::PAS_NOT_MAPPED,
            ),
            (
                "MTT missing from the input",
                Key { mtt: vec![p.iova()], octwords: Some(1), ..good.clone() },
                syndrome::PAS_TOO_FEW,
            ),
            ("octword size too small", Key { octwords: Some(0), ..good.clone() }, syndrome::PAS_TOO_FEW),
            ("bound to a QP", Key { qpn: 5, ..good.clone() }, syndrome::MKEY_QPN),
            ("KLM mode", Key { mode: consts::MLX5_MKC_ACCESS_MODE_KLMS, ..good.clone() }, syndrome::MKEY_ACCESS_MODE),
            // Mode 4 needs access_mode_4_2: the split must be read back together.
            (
                "SW ICM mode",
                Key { mode: consts::MLX5_MKC_ACCESS_MODE_SW_ICM, ..good.clone() },
                syndrome::MKEY_ACCESS_MODE,
            ),
            ("pages below 4 KiB", Key { log_page: 11, ..good.clone() }, syndrome::MKEY_PAGE_SIZE),
            ("MTT with length64", Key { length64: true, ..good.clone() }, syndrome::MKEY_LENGTH),
            ("wrapping range", Key { start: u64::MAX - 10, ..good.clone() }, syndrome::MKEY_LENGTH),
            ("free key", Key { free: true, ..good.clone() }, syndrome::MKEY_FEATURE),
            ("relaxed write without the cap", Key { ro: [true, false], ..good.clone() }, syndrome::MKEY_FEATURE),
            ("relaxed read without the cap", Key { ro: [false, true], ..good.clone() }, syndrome::MKEY_FEATURE),
            ("wrapping PA", Key { length64: false, start: u64::MAX, len: 2, ..pa_key(pd) }, syndrome::MKEY_LENGTH),
        ];
        for (what, k, want) in cases {
            let (s, syn, _) = create(&mut h, &k);
            assert_eq!((s, syn), (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, want), "{what}");
        }
        assert_eq!(h.dev.mkey_count(), 0);
        assert_eq!(create(&mut h, &good).0, 0);
    }

    #[test]
    fn pd_in_use_destroy_and_teardown() {
        let mut h = Harness::inline();
        h.bring_up();
        let pd = alloc_pd(&mut h);
        let (s, _, index) = create(&mut h, &pa_key(pd));
        assert_eq!(s, 0);
        let dealloc = |h: &mut Harness| destroy(h, consts::MLX5_CMD_OP_DEALLOC_PD, ifc::dealloc_pd_in::PD, pd);
        assert_eq!(dealloc(&mut h), (consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR, syndrome::IN_USE));
        let op = consts::MLX5_CMD_OP_DESTROY_MKEY;
        assert_eq!(destroy(&mut h, op, ifc::destroy_mkey_in::MKEY_INDEX, index), (0, 0));
        assert_eq!(h.dev.mkey_access(index << 8 | 0x5a, None, 0, 0, READ), Err(MkeyFault::UnknownKey));
        assert_eq!(
            destroy(&mut h, op, ifc::destroy_mkey_in::MKEY_INDEX, index),
            (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::MKEY_INVALID)
        );
        assert_eq!(dealloc(&mut h), (0, 0));
        // TEARDOWN_HCA destroys keys with everything else.
        let pd = alloc_pd(&mut h);
        assert_eq!(create(&mut h, &pa_key(pd)).0, 0);
        assert_eq!(h.dev.mkey_count(), 1);
        assert_eq!(h.simple(consts::MLX5_CMD_OP_TEARDOWN_HCA, 0, 16, 16).0, 0);
        assert_eq!(h.dev.mkey_count(), 0);
        assert!(h.dev.events().contains(&SimEvent::TeardownWithObjects { objects: 2 }));
    }
}
