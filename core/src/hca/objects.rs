//! The verbs objects of an HCA: protection domains, memory regions, completion queues, queue pairs and port
//! queries (mlx5_ib `main.c` `mlx5_ib_alloc_pd`, `mr.c` `mlx5_ib_reg_user_mr` / `mlx5_ib_get_dma_mr`, `cq.c`
//! `mlx5_ib_create_cq` / `mlx5_ib_resize_cq`, `qp.c` `mlx5_ib_create_qp`).
//!
//! Objects are plain values owned by the caller; destroying one consumes it, and a destroy firmware did not
//! confirm hands the object back ([`DestroyError`]) so its memory is never freed while the device may use it.

use crate::hal::{DelayNs, Dma, DmaView, Mmio};
use crate::prm::{consts, Opcode};
use crate::trace::CmdTrace;

use super::error::Error;
use super::queue_mem::QueueSpec;
use super::{Hca, HcaState, Tables};
use crate::buf::{page_sizes, DmaSeg, PageLayout, QueueBuf, ADAPTER_PAGE_SHIFT};
use crate::cmd::Pas;
use crate::cq::Cq;
use crate::cq::{
    destroy_cq, CqContext, CqState, CqeError, CqeSize, CreateCq, LinkLayer, ModifyCqModeration, QueryCq, ResizeCq,
    WorkCompletion, WrTable,
};
use crate::mkey::{destroy_mkey, Access, CreateMkey, Mr, Translation};
use crate::pd::{alloc_pd, dealloc_pd};
use crate::qp::{
    check_modify, destroy_qp, ib_rate_to_mlx5, qp_sizes, Ah, AhAttr, CreateQp, ModifyError, ModifyQp, PostError,
    PostErrorKind, Qp, QpAttr, QpAttrMask, QpCap, QpContext, QpQuery, QpState, QpType, QueryQp, RecvWr, SendWr,
    Transition,
};

/// Largest page size a memory region's MTT uses (2 GiB): mlx5_ib reads `mkc.log_page_size` as a 5-bit value
/// unless the device reports `umr_log_entity_size_5` (`mlx5_umem_mkc_find_best_pgsz`), which is not read here.
pub const MR_MAX_PAGE_SHIFT: u32 = 31;

/// A protection domain (`ibv_pd`).
#[derive(Debug, PartialEq, Eq)]
pub struct Pd {
    pdn: u32,
}

impl Pd {
    /// The PD number firmware assigned.
    pub fn pdn(&self) -> u32 {
        self.pdn
    }
}

/// A destroy that firmware did not confirm: the object is still alive on the device (or may be), so it comes back
/// to the caller instead of having its memory freed.
#[derive(Debug)]
pub struct DestroyError<T> {
    /// The object, still alive on the device.
    pub obj: T,
    /// Why the destroy failed.
    pub error: Error,
}

impl<T> core::fmt::Display for DestroyError<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "destroy failed, object kept: {}", self.error)
    }
}

/// What [`Hca::rereg_mr`] changes (`ibv_rereg_mr`'s `IB_MR_REREG_TRANS`, `_PD` and `_ACCESS`): each `Some` is
/// one flag, and at least one must be given.
#[derive(Debug, Clone, Copy, Default)]
pub struct Rereg<'a, 'p> {
    /// New memory and, optionally, the virtual address to register it at (its CPU address by default).
    pub translation: Option<(DmaView<'a>, Option<u64>)>,
    /// A new protection domain.
    pub pd: Option<&'p Pd>,
    /// New access rights.
    pub access: Option<Access>,
}

/// A re-registration that did not complete. `mr` is the old region, still registered; `new` is the region made
/// before the old one's DESTROY_MKEY failed (both are then live, and the old one should be deregistered again).
#[derive(Debug)]
pub struct ReregError {
    /// The old region, still registered.
    pub mr: Mr,
    /// The new region, when it was made.
    pub new: Option<Mr>,
    /// Why the re-registration failed.
    pub error: Error,
}

impl core::fmt::Display for ReregError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.new {
            Some(_) => write!(f, "re-registration made the new key but the old one stayed: {}", self.error),
            None => write!(f, "re-registration failed, old key kept: {}", self.error),
        }
    }
}

impl core::error::Error for ReregError {
    fn source(&self) -> Option<&(dyn core::error::Error + 'static)> {
        Some(&self.error)
    }
}

/// Port attributes: every field of `ibv_port_attr`, as mlx5_ib fills them (`mlx5_query_hca_port` on
/// InfiniBand, `mlx5_query_port_roce` on Ethernet) and uverbs passes them on (`copy_port_attr_to_resp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAttr {
    /// `IB_PORT_*`: 1 down, 4 active.
    pub state: u8,
    /// `ib_mtu` enum (1 = 256 ... 5 = 4096).
    pub max_mtu: u8,
    /// The active MTU (`ib_mtu`).
    pub active_mtu: u8,
    /// GID table entries.
    pub gid_tbl_len: u16,
    /// `IB_PORT_*` capability bits (`port_cap_flags`, with `IP_BASED_GIDS` on RoCE as uverbs adds it).
    pub port_cap_flags: u32,
    /// The largest message in bytes.
    pub max_msg_sz: u32,
    /// P_Key violations counted.
    pub bad_pkey_cntr: u32,
    /// Q_Key violations counted.
    pub qkey_viol_cntr: u32,
    /// P_Key table entries.
    pub pkey_tbl_len: u16,
    /// The port's LID (InfiniBand).
    pub lid: u16,
    /// The subnet manager's LID (InfiniBand).
    pub sm_lid: u16,
    /// LID mask count.
    pub lmc: u8,
    /// Virtual lanes (IBA VLCap: 4 = VL0-7), from PVLC on InfiniBand; 0 on Ethernet, as mlx5_ib leaves it.
    pub max_vl_num: u8,
    /// The subnet manager's SL.
    pub sm_sl: u8,
    /// Subnet timeout.
    pub subnet_timeout: u8,
    /// PortInfo:InitTypeReply.
    pub init_type_reply: u8,
    /// `IB_WIDTH_*`.
    pub active_width: u8,
    /// `IB_SPEED_*` as one byte (what `ibv_port_attr.active_speed` holds; 0 for speeds above 255).
    pub active_speed: u8,
    /// `IB_PORT_PHYS_STATE_*`.
    pub phys_state: u8,
    /// InfiniBand or Ethernet.
    pub link_layer: LinkLayer,
    /// `IBV_QPF_*` (`QPF_GRH_REQUIRED`).
    pub flags: u8,
    /// `cap_mask2` when `port_cap_flags` says it is supported, else 0.
    pub port_cap_flags2: u16,
    /// `IB_SPEED_*` at full width (`active_speed_ex`, XDR included).
    pub active_speed_ex: u32,
}

/// A GID's type, as `ibv_query_gid_ex` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GidType {
    /// InfiniBand.
    Ib,
    /// RoCE v1.
    RoceV1,
    /// RoCE v2.
    RoceV2,
}

/// The RoCE GID table in Linux's order: the link-local GID of `mac` as v1 then v2, then for each IPv4 address
/// (mapped as `::ffff:a.b.c.d`) and each IPv6 address a v1 and a v2 entry.
pub fn gid_table<'a>(
    mac: [u8; 6],
    ipv4: &'a [[u8; 4]],
    ipv6: &'a [[u8; 16]],
) -> impl Iterator<Item = crate::vport::RoceGid> + 'a {
    use crate::vport::{RoceGid, RoceVersion};
    let mapped = ipv4.iter().map(|a| {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(a);
        g
    });
    core::iter::once(link_local_gid(mac_to_eui64(mac))).chain(mapped).chain(ipv6.iter().copied()).flat_map(move |gid| {
        [RoceVersion::V1, RoceVersion::V2].map(|version| RoceGid { gid, version, vlan: None, mac })
    })
}

/// The default GID of a port: the link-local prefix fe80::/64 and an interface id, as InfiniBand (port GUID) and
/// RoCE (the MAC as a modified EUI-64) define it.
pub fn link_local_gid(interface_id: u64) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[0] = 0xfe;
    g[1] = 0x80;
    g[8..].copy_from_slice(&interface_id.to_be_bytes());
    g
}

/// The modified EUI-64 of a MAC address (RFC 4291 appendix A): `ff:fe` in the middle, universal/local bit flipped.
pub fn mac_to_eui64(mac: [u8; 6]) -> u64 {
    u64::from_be_bytes([mac[0] ^ 2, mac[1], mac[2], 0xff, 0xfe, mac[3], mac[4], mac[5]])
}

/// What a new QP should be (`ibv_qp_init_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QpInitAttr {
    /// RC or UD.
    pub qp_type: QpType,
    /// The requested capabilities.
    pub cap: QpCap,
    /// Every send WQE is signaled (`sq_sig_all`).
    pub sq_sig_all: bool,
}

/// What a new CQ should be (`ibv_cq_init_attr`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CqAttr {
    /// Completions the CQ must hold; the ring gets `(cqe + 1).next_power_of_two()` entries, as mlx5_ib sizes it.
    pub cqe: u32,
    /// CQE size.
    pub cqe_size: CqeSize,
    /// Ask the device not to report overruns (`cqc.oi`); needs `cq_oi`.
    pub overrun_ignore: bool,
    /// The completion vector whose EQ gets this CQ's completion events (`ibv_create_cq`'s `comp_vector`), below
    /// [`Hca::num_comp_vectors`].
    pub comp_vector: u16,
}

impl Default for CqAttr {
    fn default() -> Self {
        Self { cqe: 255, cqe_size: CqeSize::B64, overrun_ignore: false, comp_vector: 0 }
    }
}

/// The virtual range of a registration of `mem` at `iova` (its CPU address by default), checked: not empty, and
/// not wrapping past the end of the 64-bit address space.
fn check_mr_range(mem: DmaView<'_>, iova: Option<u64>) -> Result<(u64, u64), Error> {
    let len = mem.len() as u64;
    if len == 0 {
        return Err(Error::BadSize { what: "memory region length", requested: 0, max: u64::MAX });
    }
    let va = iova.unwrap_or(mem.cpu().as_ptr() as usize as u64);
    // The last byte, va + len - 1, must be addressable (`ib_umem_get` refuses ranges that wrap).
    if va.checked_add(len - 1).is_none() || mem.iova().checked_add(len - 1).is_none() {
        return Err(Error::IovaOverflow { iova: va, len });
    }
    Ok((va, len))
}

impl<M: Mmio, D: Dma, T: CmdTrace, S: Tables> Hca<M, D, T, S> {
    // -- protection domains ----------------------------------------------------------------------------------

    /// `ALLOC_PD`.
    pub fn alloc_pd(&mut self, delay: &mut impl DelayNs) -> Result<Pd, Error> {
        let pdn = self.exec(&mut alloc_pd(), delay)?;
        Ok(Pd { pdn })
    }

    /// `DEALLOC_PD`; firmware refuses while memory keys or QPs use it.
    pub fn dealloc_pd(&mut self, pd: Pd, delay: &mut impl DelayNs) -> Result<(), DestroyError<Pd>> {
        match self.exec_destroy(dealloc_pd(pd.pdn), delay) {
            Ok(()) => Ok(()),
            Err(error) => Err(DestroyError { obj: pd, error }),
        }
    }

    // -- memory regions --------------------------------------------------------------------------------------

    /// Registers `len` bytes of DMA memory at CPU address `addr` (`ibv_reg_mr`): an MTT key whose virtual
    /// addresses are the CPU addresses, with the largest page size the memory's layout allows. The range must lie
    /// inside one region of the HCA's DMA allocator.
    pub fn reg_mr(
        &mut self,
        pd: &Pd,
        addr: *const u8,
        len: usize,
        access: Access,
        delay: &mut impl DelayNs,
    ) -> Result<Mr, Error> {
        self.check_state(Opcode::CreateMkey)?;
        self.check_access(access)?;
        if len == 0 {
            return Err(Error::BadSize { what: "memory region length", requested: 0, max: u64::MAX });
        }
        let iova = self.cmdq.dma().iova_of(addr, len).ok_or(Error::NotDmaMemory { addr: addr as usize, len })?;
        let va = addr as usize as u64;
        let segs = [DmaSeg { iova, len: len as u64 }];
        if PageLayout::choose(&segs, va, page_sizes(ADAPTER_PAGE_SHIFT, MR_MAX_PAGE_SHIFT)).is_none() {
            return Err(Error::NoPageSize { addr: addr as usize, iova });
        }
        self.mtt_mr(pd.pdn, va, iova, len as u64, access, delay)
    }

    /// Registers the memory of `mem` (`ibv_reg_mr` / `ibv_reg_mr_iova` on process memory made reachable with
    /// [`Dma::map_user`], or any other DMA view) at virtual address `iova`, by default
    /// its CPU address (mlx5_ib `mlx5_ib_reg_user_mr`). The key covers exactly `mem`; its MTT uses the largest page
    /// size the bus and virtual addresses allow (`mlx5_umem_mkc_find_best_pgsz`), so `iova` must agree with the
    /// bus address within 4 KiB.
    pub fn reg_user_mr(
        &mut self,
        pd: &Pd,
        mem: DmaView<'_>,
        iova: Option<u64>,
        access: Access,
        delay: &mut impl DelayNs,
    ) -> Result<Mr, Error> {
        self.check_state(Opcode::CreateMkey)?;
        self.check_access(access)?;
        let (va, len) = check_mr_range(mem, iova)?;
        self.mtt_mr(pd.pdn, va, mem.iova(), len, access, delay)
    }

    /// Re-registers `mr` (`ibv_rereg_mr`, mlx5_ib `mlx5_ib_rereg_user_mr`): new memory, PD or access, as `req`
    /// says. Without UMR the key cannot be changed in place, so, as mlx5_ib does when it cannot use UMR, a new key
    /// is created and the old one destroyed: the returned region has new keys. The new key is made first, so a
    /// refused request leaves the old region registered (returned in the error).
    // The old region comes back by value on failure because the core has no heap to box it in.
    #[allow(clippy::result_large_err)]
    pub fn rereg_mr(&mut self, mr: Mr, req: Rereg<'_, '_>, delay: &mut impl DelayNs) -> Result<Mr, ReregError> {
        if req.translation.is_none() && req.pd.is_none() && req.access.is_none() {
            // `ib_uverbs_rereg_mr` refuses a request without flags.
            return Err(ReregError { mr, new: None, error: Error::NothingToRereg });
        }
        let access = req.access.unwrap_or(mr.access);
        let pdn = req.pd.map_or(mr.pd, Pd::pdn);
        let made = self.check_state(Opcode::CreateMkey).and_then(|()| self.check_access(access)).and_then(|()| {
            match req.translation {
                Some((mem, iova)) => {
                    let (va, len) = check_mr_range(mem, iova)?;
                    self.mtt_mr(pdn, va, mem.iova(), len, access, delay)
                }
                // The old translation, kept: an all-IOVA key stays one.
                None if mr.page_shift == 0 => self.pa_mr(pdn, access, delay),
                None => self.mtt_mr(pdn, mr.addr, mr.dma, mr.length, access, delay),
            }
        });
        let new = match made {
            Ok(new) => new,
            Err(error) => return Err(ReregError { mr, new: None, error }),
        };
        match self.dereg_mr(mr, delay) {
            Ok(()) => Ok(new),
            Err(e) => Err(ReregError { mr: e.obj, new: Some(new), error: e.error }),
        }
    }

    /// CREATE_MKEY of an MTT key for `len` bytes at virtual address `va`, reached by the device at bus address
    /// `dma` (mlx5_ib `reg_create` with the PAS populated).
    fn mtt_mr(
        &mut self,
        pdn: u32,
        va: u64,
        dma: u64,
        len: u64,
        access: Access,
        delay: &mut impl DelayNs,
    ) -> Result<Mr, Error> {
        let segs = [DmaSeg { iova: dma, len }];
        let layout = PageLayout::choose(&segs, va, page_sizes(ADAPTER_PAGE_SHIFT, MR_MAX_PAGE_SHIFT))
            .ok_or(Error::IovaMismatch { iova: va, dma })?;
        let variant = self.next_mkey_variant();
        let (relaxed_write, relaxed_read) = self.relaxed_ordering(access);
        let mut cmd = CreateMkey {
            pd: pdn,
            access,
            variant,
            translation: Translation::Mtt { va, len, segs: &segs, layout },
            relaxed_write,
            relaxed_read,
            ma_translation_mode: 0,
        };
        let key = self.exec(&mut cmd, delay)?;
        Ok(Mr { lkey: key, rkey: key, addr: va, dma, length: len, access, pd: pdn, page_shift: layout.page_shift })
    }

    /// CREATE_MKEY of a physical-address key over all of IOVA.
    fn pa_mr(&mut self, pdn: u32, access: Access, delay: &mut impl DelayNs) -> Result<Mr, Error> {
        let variant = self.next_mkey_variant();
        // `mlx5_ib_get_dma_mr` always asks for relaxed ordering (the caps decide) and follows the device's ATS.
        let (relaxed_write, relaxed_read) = self.relaxed_ordering(access | Access::RELAXED_ORDERING);
        let mut cmd = CreateMkey {
            pd: pdn,
            access,
            variant,
            translation: Translation::AllIova,
            relaxed_write,
            relaxed_read,
            ma_translation_mode: self.caps.general.ats.into(),
        };
        let key = self.exec(&mut cmd, delay)?;
        Ok(Mr { lkey: key, rkey: key, addr: 0, dma: 0, length: u64::MAX, access, pd: pdn, page_shift: 0 })
    }

    /// The mkc relaxed-ordering bits for `access` (`set_mkc_access_pd_addr_fields`): write when the device reports
    /// `relaxed_ordering_write`, read when it reports `relaxed_ordering_read` or `relaxed_ordering_read_pci_enabled`
    /// (Linux also asks the PCI core whether relaxed ordering is enabled; firmware sets the latter capability
    /// only when it is). Without the capabilities the flag is accepted and has no effect.
    fn relaxed_ordering(&self, access: Access) -> (bool, bool) {
        let g = &self.caps.general;
        let ro = access.contains(Access::RELAXED_ORDERING);
        (ro && g.relaxed_ordering_write, ro && (g.relaxed_ordering_read || g.relaxed_ordering_read_pci_enabled))
    }

    /// A key over all of IOVA in physical-address mode (`mlx5_ib_get_dma_mr`): virtual address = bus address.
    /// Only the function's owner (this driver, uid 0) may create one; firmware refuses it to user contexts.
    pub fn reg_dma_mr(&mut self, pd: &Pd, access: Access, delay: &mut impl DelayNs) -> Result<Mr, Error> {
        self.check_state(Opcode::CreateMkey)?;
        self.check_access(access)?;
        self.pa_mr(pd.pdn, access, delay)
    }

    /// `DESTROY_MKEY` (`ibv_dereg_mr`).
    pub fn dereg_mr(&mut self, mr: Mr, delay: &mut impl DelayNs) -> Result<(), DestroyError<Mr>> {
        match self.exec_destroy(destroy_mkey(mr.lkey), delay) {
            Ok(()) => Ok(()),
            Err(error) => Err(DestroyError { obj: mr, error }),
        }
    }

    /// Verbs' access rules (`ib_check_mr_access`): remote write or atomic needs local write; atomics need the
    /// device to support them.
    fn check_access(&self, access: Access) -> Result<(), Error> {
        if access.unsupported() != 0 {
            return Err(Error::NotSupported {
                what: "memory region access flags beyond local/remote read/write/atomic and relaxed ordering",
            });
        }
        let remote_w = Access(Access::REMOTE_WRITE.0 | Access::REMOTE_ATOMIC.0);
        if access.0 & remote_w.0 != 0 && !access.contains(Access::LOCAL_WRITE) {
            return Err(Error::BadAccess { access: access.0 });
        }
        if access.contains(Access::REMOTE_ATOMIC) && !self.caps.general.atomic {
            return Err(Error::NotSupported { what: "remote atomic access (no atomic capability)" });
        }
        Ok(())
    }

    fn next_mkey_variant(&mut self) -> u8 {
        self.mkey_variant = self.mkey_variant.wrapping_add(1);
        self.mkey_variant
    }

    // -- completion queues -----------------------------------------------------------------------------------

    /// Ring entries for `cqe` requested completions, checked against `log_max_cq_sz`.
    fn cq_entries(&self, cqe: u32) -> Result<u8, Error> {
        let max = 1u64 << self.caps.general.log_max_cq_sz;
        let entries = (u64::from(cqe) + 1).next_power_of_two();
        if cqe == 0 || entries > max {
            return Err(Error::BadSize { what: "CQ entries", requested: cqe.into(), max: max - 1 });
        }
        Ok(entries.trailing_zeros() as u8)
    }

    /// Creates a completion queue (`mlx5_ib_create_cq` for a kernel consumer): ring buffer with every CQE invalid,
    /// a doorbell record, the page list at the largest page size the buffer allows, CREATE_CQ on the completion
    /// EQ of the CQ's completion vector.
    pub fn create_cq(&mut self, attr: CqAttr, delay: &mut impl DelayNs) -> Result<Cq, Error> {
        self.check_state(Opcode::CreateCq)?;
        let log_nent = self.cq_entries(attr.cqe)?;
        if attr.overrun_ignore && !self.caps.general.cq_oi {
            return Err(Error::NotSupported { what: "CQ overrun ignore (no cq_oi capability)" });
        }
        if !self.ctx.cqs.has_room() {
            // A fixed table at its capacity, or a growable one that got no memory: the CQs it holds.
            return Err(Error::TooManyCqs { max: self.ctx.cqs.len() });
        }
        let uar = self.uar.ok_or(Error::NotSupported { what: "CQ without a UAR" })?;
        let c_eqn = self.comp_eqn(attr.comp_vector, delay)?;
        let spec = QueueSpec { buf_len: attr.cqe_size.bytes() << log_nent, shadow_len: None };
        let (cqn, mem) = self.create_queue(spec, |hca, mem| {
            Cq::init_buf(&mem.buf, log_nent, attr.cqe_size);
            let pages = mem.buf.pages();
            let layout = pages.layout;
            let list = pages.list();
            let mut cmd = CreateCq {
                ctx: CqContext {
                    cqe_sz: attr.cqe_size,
                    log_cq_size: log_nent,
                    uar_page: uar,
                    c_eqn: c_eqn.into(),
                    log_page_size: layout.log_page_size(),
                    page_offset: 0,
                    dbr_addr: mem.dbrec.iova(),
                    oi: attr.overrun_ignore,
                },
                pas: Pas::Source(&list),
            };
            hca.exec(&mut cmd, delay)
        })?;
        // Room was checked above, and nothing else registers in between.
        let _ = self.ctx.cqs.register(cqn);
        let link = self.link_layer();
        let uar_off = uar as usize * crate::uar::UAR_PAGE_SIZE;
        Ok(Cq::new(mem.buf, mem.dbrec, cqn, log_nent, attr.cqe_size, uar_off, link))
    }

    /// After a CREATE or resize failed: each fragment goes the way `release_unless_held` sends a buffer (freed
    /// after a status, otherwise kept until the function is disabled).
    pub(super) fn drop_queue_buf(&mut self, buf: QueueBuf, e: &Error) {
        for r in buf.into_frags() {
            self.release_unless_held(r, e);
        }
    }

    /// `DESTROY_CQ`, then the buffer and doorbell record are freed. Refused while events taken with
    /// [`Hca::get_cq_event`] are not acknowledged (as `ibv_destroy_cq` waits for them).
    // The CQ comes back by value on failure because the core has no heap to box it in.
    #[allow(clippy::result_large_err)]
    pub fn destroy_cq(&mut self, mut cq: Cq, delay: &mut impl DelayNs) -> Result<(), DestroyError<Cq>> {
        let cqn = cq.cqn();
        if let Some(e) = self.ctx.cqs.find(cqn) {
            if e.unacked > 0 {
                let unacked = e.unacked;
                return Err(DestroyError { obj: cq, error: Error::UnackedEvents { cqn, unacked } });
            }
        }
        match self.exec_destroy(destroy_cq(cqn), delay) {
            Ok(()) => {
                self.ctx.cqs.unregister(cqn);
                // SAFETY: the CQ is destroyed (or the device is dead), so the device writes neither its ring nor
                // reads its doorbell record.
                unsafe {
                    cq.buf.free(self.cmdq.dma());
                    let _ = self.dbr.free(self.cmdq.dma(), cq.dbrec);
                }
                Ok(())
            }
            Err(error) => Err(DestroyError { obj: cq, error }),
        }
    }

    /// `QUERY_CQ`.
    pub fn query_cq(&mut self, cq: &Cq, delay: &mut impl DelayNs) -> Result<CqState, Error> {
        self.exec(&mut QueryCq { cqn: cq.cqn() }, delay)
    }

    /// Interrupt moderation (`ib_modify_cq`): an event after `count` completions or `period_us`, whichever first.
    pub fn modify_cq(&mut self, cq: &Cq, count: u16, period_us: u16, delay: &mut impl DelayNs) -> Result<(), Error> {
        if !self.caps.general.cq_moderation {
            return Err(Error::NotSupported { what: "CQ moderation (no cq_moderation capability)" });
        }
        // cq_period is 12 bits wide.
        if period_us >= 1 << 12 {
            return Err(Error::BadSize { what: "CQ moderation period", requested: period_us.into(), max: 4095 });
        }
        self.exec(&mut ModifyCqModeration { cqn: cq.cqn(), cq_period: period_us, cq_max_count: count }, delay)
    }

    /// Resizes the ring (`ibv_resize_cq`): a new buffer, MODIFY_CQ(resize), then the completions not yet polled
    /// move to the new ring in order. The new size must hold them.
    pub fn resize_cq(&mut self, cq: &mut Cq, cqe: u32, delay: &mut impl DelayNs) -> Result<(), Error> {
        self.check_state(Opcode::ModifyCq)?;
        if !self.caps.general.cq_resize {
            return Err(Error::NotSupported { what: "CQ resize (no cq_resize capability)" });
        }
        let log_nent = self.cq_entries(cqe)?;
        if log_nent == cq.log_nent() {
            return Ok(());
        }
        let new = QueueBuf::alloc(self.cmdq.dma(), cq.cqe_size().bytes() << log_nent)?;
        Cq::init_buf(&new, log_nent, cq.cqe_size());
        let pages = new.pages();
        let layout = pages.layout;
        let list = pages.list();
        let mut cmd = ResizeCq {
            cqn: cq.cqn(),
            cqe_sz: cq.cqe_size(),
            log_cq_size: log_nent,
            log_page_size: layout.log_page_size(),
            page_offset: 0,
            pas: Pas::Source(&list),
        };
        if let Err(e) = self.exec(&mut cmd, delay) {
            self.drop_queue_buf(new, &e);
            return Err(e);
        }
        match cq.switch_buffers(self.cmdq.mmio(), new, log_nent) {
            Ok(mut old) => {
                // SAFETY: the device wrote the resize CQE into the old ring and writes only the new one from then on.
                unsafe { old.free(self.cmdq.dma()) };
                Ok(())
            }
            Err(old) => {
                // Where the device switched is unknown: keep the old ring until the function is disabled.
                let e = Error::ResizeCqeMissing { cqn: cq.cqn() };
                self.drop_queue_buf(old, &e);
                Err(e)
            }
        }
    }

    /// Polls up to `wc.len()` completions of `cq`, oldest first (`ibv_poll_cq`); `wq` holds every QP with a queue
    /// on this CQ and maps each completion to its work request.
    ///
    /// When the device will write no more completions to this CQ, the work requests it will never complete are
    /// completed here instead, with [`WcStatus::WrFlushErr`](crate::cq::WcStatus::WrFlushErr), each exactly once and
    /// in posting order per queue (mlx5_ib's software completions of the internal-error state): after the CQEs the
    /// device already wrote, every work request outstanding on a queue of `wq` on this CQ once the HCA is in
    /// internal error (the device is dead or gone); and after a CQ error (an overrun: the device writes nothing
    /// more to the CQ), those of QPs the caller moved to ERR, which the device no longer executes. The HCA learns
    /// of a failure from [`Hca::poll_health`], a command, or [`Hca::process_events`] (CQ errors).
    pub fn poll_cq(
        &self,
        cq: &mut Cq,
        wq: &mut (impl WrTable + ?Sized),
        wc: &mut [WorkCompletion],
    ) -> Result<usize, CqeError> {
        let cqn = cq.cqn();
        poll_cq_with(self.cmdq.mmio(), cq, wq, wc, || {
            let dead = !matches!(self.state(), HcaState::Up);
            // The CQ-error lookup runs only once some CQ has failed, so an empty poll pays one compare for it.
            let failed = self.ctx.events.cq_error != 0 && self.ctx.cqs.failed(cqn);
            (dead || failed).then_some(dead)
        })
    }

    // -- queue pairs -------------------------------------------------------------------------------------------

    fn link_layer(&self) -> LinkLayer {
        match self.caps.general.port_type() {
            crate::caps::PortType::InfiniBand => LinkLayer::InfiniBand,
            _ => LinkLayer::Ethernet,
        }
    }

    /// Whether GID entry `sgid_index` was programmed as RoCE v2 (the type Linux's GID cache keeps per entry).
    fn sgid_is_roce_v2(&self, sgid_index: u8) -> bool {
        let i = usize::from(sgid_index);
        self.roce_v2_gids[i / 64] >> (i % 64) & 1 != 0
    }

    /// Records the type of GID entry `index` after firmware took it.
    fn note_gid_type(&mut self, index: u16, v2: bool) {
        let i = usize::from(index);
        if let Some(word) = self.roce_v2_gids.get_mut(i / 64) {
            let bit = 1u64 << (i % 64);
            if v2 {
                *word |= bit;
            } else {
                *word &= !bit;
            }
        }
    }

    /// Creates a QP (`mlx5_ib_create_qp` for a kernel consumer): queues sized from the requested capabilities
    /// and the device's limits, one buffer (receive queue first), a doorbell record, CREATE_QP in RESET.
    pub fn create_qp(
        &mut self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        attr: QpInitAttr,
        delay: &mut impl DelayNs,
    ) -> Result<Qp, Error> {
        self.create_qp_on(pd, send_cq, recv_cq, attr, None, delay)
    }

    /// [`Hca::create_qp`], receiving through SRQ `srqn` when it is given (no receive queue of its own, as
    /// `set_rq_size` makes one for a QP with an SRQ).
    pub(super) fn create_qp_on(
        &mut self,
        pd: &Pd,
        send_cq: &Cq,
        recv_cq: &Cq,
        attr: QpInitAttr,
        srqn: Option<u32>,
        delay: &mut impl DelayNs,
    ) -> Result<Qp, Error> {
        self.check_state(Opcode::CreateQp)?;
        let g = &self.caps.general;
        let supported = match attr.qp_type {
            QpType::Rc => g.rc,
            QpType::Uc => g.uc,
            QpType::Ud | QpType::Gsi | QpType::Smi => g.ud,
        };
        if !supported {
            return Err(Error::NotSupported { what: "this QP type" });
        }
        // QP0 exists on InfiniBand ports only (`rdma_cap_ib_smi`): a RoCE port has no subnet manager.
        if attr.qp_type == QpType::Smi && self.link_layer() != LinkLayer::InfiniBand {
            return Err(Error::NotSupported { what: "the SMI QP (QP0) on an Ethernet port" });
        }
        let sizes = qp_sizes(attr.qp_type, &attr.cap, g.max_wqe_sz_sq.into(), g.max_wqe_sz_rq.into(), g.log_max_qp_sz)
            .map_err(Error::QpSize)?;
        let sizes = if srqn.is_some() { sizes.without_rq() } else { sizes };
        let (uar, bf) = self.take_bfreg(delay)?;
        let spec = QueueSpec { buf_len: sizes.rq_bytes() + sizes.sq_bytes(), shadow_len: Some(Qp::shadow_len(&sizes)) };
        let made = self.create_queue(spec, |hca, mem| {
            let pages = mem.buf.pages();
            let layout = pages.layout;
            let list = pages.list();
            let mut cmd = CreateQp {
                ctx: QpContext {
                    qp_type: attr.qp_type,
                    pd: pd.pdn,
                    uar_page: uar.index,
                    cqn_snd: send_cq.cqn(),
                    cqn_rcv: recv_cq.cqn(),
                    log_sq_size: sizes.sq_wqe_cnt.trailing_zeros() as u8,
                    log_rq_size: sizes.rq_wqe_cnt.max(1).trailing_zeros() as u8,
                    log_rq_stride: sizes.rq_wqe_shift - 4,
                    no_sq: sizes.sq_wqe_cnt == 0,
                    zero_len_rq: srqn.is_none() && sizes.rq_wqe_cnt == 0,
                    log_page_size: layout.log_page_size(),
                    dbr_addr: mem.dbrec.iova(),
                    ts_format: hca.caps.qp_default_ts(),
                    user_index: (hca.caps.general.cqe_version == 1).then_some(consts::MLX5_IB_DEFAULT_UIDX),
                    srqn,
                },
                pas: Pas::Source(&list),
            };
            hca.exec(&mut cmd, delay)
        });
        let (qpn, mut mem) = match made {
            Ok(made) => made,
            Err(e) => {
                // Whatever firmware did, no QP of ours rings the register: the next QP may have it.
                self.give_bfreg(&bf);
                return Err(e);
            }
        };
        let cqns = (send_cq.cqn(), recv_cq.cqn());
        let shadow = mem.take_shadow();
        let mut qp = Qp::new(mem.buf, mem.dbrec, shadow, qpn, attr.qp_type, sizes, bf, attr.sq_sig_all, cqns);
        qp.pd = pd.pdn;
        qp.srqn = srqn;
        Ok(qp)
    }

    /// Moves a QP through its states (`ibv_modify_qp`). The transition and the attributes are checked against
    /// verbs' table before any command is sent.
    pub fn modify_qp(
        &mut self,
        qp: &mut Qp,
        attr: &QpAttr,
        mask: QpAttrMask,
        delay: &mut impl DelayNs,
    ) -> Result<(), Error> {
        let from = qp.state;
        check_modify(qp.qp_type(), from, attr, mask).map_err(Error::Modify)?;
        let to = if mask.contains(QpAttrMask::STATE) { attr.qp_state } else { from };
        // RESET to RESET changes nothing: mlx5_ib_modify_qp sends no command for it.
        if from == QpState::Reset && to == QpState::Reset {
            return Ok(());
        }
        // A RoCE path is routed by GID (mlx5_set_path refuses one without a GRH).
        if mask.contains(QpAttrMask::AV) && self.link_layer() == LinkLayer::Ethernet && attr.ah_attr.grh.is_none() {
            return Err(Error::Modify(ModifyError::BadValue { what: "RoCE address without a GRH", value: 0 }));
        }
        let transition =
            Transition::of(from, to).ok_or(Error::Modify(crate::qp::ModifyError::BadTransition { from, to }))?;
        let stat_rate = if mask.contains(QpAttrMask::AV) {
            let rate = attr.ah_attr.static_rate;
            ib_rate_to_mlx5(rate, self.caps.general.stat_rate_support)
                .ok_or(Error::Modify(ModifyError::BadValue { what: "static_rate", value: rate.into() }))?
        } else {
            0
        };
        let mut cmd = ModifyQp {
            qpn: qp.qpn(),
            qp_type: qp.qp_type(),
            transition,
            attr: *attr,
            mask,
            link: self.link_layer(),
            log_max_msg: self.caps.general.log_max_msg,
            stat_rate,
            roce_v2: self.link_layer() == LinkLayer::Ethernet
                && attr.ah_attr.grh.is_some_and(|g| self.sgid_is_roce_v2(g.sgid_index)),
            pd: qp.pd,
            cqn_snd: qp.cqns().0,
            cqn_rcv: qp.cqns().1,
            dbr_addr: (qp.sizes().rq_wqe_cnt > 0).then(|| qp.dbrec().iova()),
            cur_access: qp.access,
            cur_resp_depth: qp.resp_depth,
            pm_state: ModifyQp::linux_defaults().0,
            log_ack_req_freq: ModifyQp::linux_defaults().1,
            atomic_mode: self.caps.atomic_mode().unwrap_or(0),
            counter_set_id: self.q_counter,
            qp_port: qp.port,
        };
        // Linux refuses remote atomics the device has no atomic mode for (`set_qpc_atomic_flags`).
        if cmd.remote_access().is_some_and(|a| a.contains(Access::REMOTE_ATOMIC)) && self.caps.atomic_mode().is_none() {
            return Err(Error::NotSupported { what: "remote atomic access (no atomic mode: get_atomic_mode)" });
        }
        self.exec(&mut cmd, delay)?;
        // Kept only once firmware took them, as `__mlx5_ib_modify_qp` does.
        if mask.contains(QpAttrMask::ACCESS_FLAGS) {
            qp.access = attr.qp_access_flags;
        }
        if mask.contains(QpAttrMask::MAX_DEST_RD_ATOMIC) {
            qp.resp_depth = attr.max_dest_rd_atomic;
        }
        if mask.contains(QpAttrMask::PORT) {
            qp.port = attr.port_num.max(1);
        }
        qp.state = to;
        if to == QpState::Reset {
            qp.reset_rings();
        }
        Ok(())
    }

    /// `ibv_create_ah` (`create_ib_ah`): the address vector of a UD send, with the rate mapped for the device and,
    /// on RoCE, the source GID entry's type deciding the UDP source port and the ECN bit.
    pub fn create_ah(&self, attr: &AhAttr) -> Result<Ah, Error> {
        let rate = attr.static_rate;
        let stat_rate = ib_rate_to_mlx5(rate, self.caps.general.stat_rate_support)
            .ok_or(Error::Modify(ModifyError::BadValue { what: "static_rate", value: rate.into() }))?;
        let link = self.link_layer();
        if link == LinkLayer::Ethernet && attr.grh.is_none() {
            // A RoCE address is routed by GID: create_ah refuses one without a GRH.
            return Err(Error::Modify(ModifyError::BadValue { what: "RoCE address without a GRH", value: 0 }));
        }
        let roce_v2 = link == LinkLayer::Ethernet && attr.grh.is_some_and(|g| self.sgid_is_roce_v2(g.sgid_index));
        Ok(Ah::build(attr, crate::qp::AvParams { link, roce_v2, stat_rate }))
    }

    /// `QUERY_Q_COUNTER` of the port's counter set (`rdma statistic show`); `None` when the device has none.
    pub fn query_q_counters(
        &mut self,
        clear: bool,
        delay: &mut impl DelayNs,
    ) -> Result<Option<crate::qcounter::QCounters>, Error> {
        let Some(id) = self.q_counter else { return Ok(None) };
        self.exec(&mut crate::qcounter::QueryQCounter { counter_set_id: id, clear }, delay).map(Some)
    }

    /// `MAD_IFC` (`mlx5_MAD_IFC`): hands `mad` to the device's agents on `port` and returns their response. The
    /// command fails only as every command does (its name, status and syndrome); an agent that refuses the MAD
    /// answers with a MAD status in the reply ([`MadReply::status`](crate::mad_ifc::MadReply::status)).
    pub fn mad_ifc(
        &mut self,
        port: u8,
        flags: crate::mad_ifc::MadIfcFlags,
        mad: &[u8; crate::mad_ifc::MAD_LEN],
        delay: &mut impl DelayNs,
    ) -> Result<crate::mad_ifc::MadReply, Error> {
        self.exec(&mut crate::mad_ifc::MadIfc { port, flags, mad }, delay)
    }

    /// `QUERY_QP`.
    pub fn query_qp(&mut self, qp: &Qp, delay: &mut impl DelayNs) -> Result<QpQuery, Error> {
        self.exec(&mut QueryQp { qpn: qp.qpn() }, delay)
    }

    /// `ibv_query_qp`: every attribute verbs returns, from QUERY_QP as `mlx5_ib_query_qp` decodes it and the
    /// driver's queue sizes.
    pub fn query_qp_attr(&mut self, qp: &Qp, delay: &mut impl DelayNs) -> Result<crate::qp::QpQueryAttr, Error> {
        let q = self.query_qp(qp, delay)?;
        Ok(crate::qp::QpQueryAttr::decode(&q, qp.qp_type(), qp.cap(), qp.sq_sig_all(), self.link_layer()))
    }

    /// `DESTROY_QP`, then its buffer, record and bookkeeping are freed.
    #[allow(clippy::result_large_err)]
    pub fn destroy_qp(&mut self, mut qp: Qp, delay: &mut impl DelayNs) -> Result<(), DestroyError<Qp>> {
        match self.exec_destroy(destroy_qp(qp.qpn()), delay) {
            Ok(()) => {
                self.give_bfreg(qp.bfreg());
                // SAFETY: the QP is destroyed (or the device dead): the device no longer touches its rings or
                // record; the shadow array was never the device's.
                unsafe {
                    qp.buf.free(self.cmdq.dma());
                    let _ = self.dbr.free(self.cmdq.dma(), qp.dbrec);
                    self.cmdq.dma().free(qp.shadow);
                }
                Ok(())
            }
            Err(error) => Err(DestroyError { obj: qp, error }),
        }
    }

    /// Posts send work requests and rings the doorbell once (`ibv_post_send`).
    pub fn post_send(&self, qp: &mut Qp, wrs: &[SendWr<'_>]) -> Result<(), PostError> {
        if !matches!(self.state(), HcaState::Up) {
            return Err(PostError { index: 0, kind: PostErrorKind::DeviceError });
        }
        qp.post_send(self.cmdq.mmio(), wrs)
    }

    /// Posts receive work requests (`ibv_post_recv`).
    pub fn post_recv(&self, qp: &mut Qp, wrs: &[RecvWr<'_>]) -> Result<(), PostError> {
        if !matches!(self.state(), HcaState::Up) {
            return Err(PostError { index: 0, kind: PostErrorKind::DeviceError });
        }
        qp.post_recv(self.cmdq.mmio(), wrs)
    }

    // -- ports -----------------------------------------------------------------------------------------------

    /// `ibv_query_port` for port 1, from the commands mlx5_ib uses. InfiniBand (`mlx5_query_hca_port`):
    /// QUERY_HCA_VPORT_CONTEXT, PTYS (width and speed), PMTU (MTUs), PVLC (virtual lanes). Ethernet (`mlx5_query_port_roce`): PTYS,
    /// QUERY_NIC_VPORT_CONTEXT (RoCE enabled, Q_Key violations), QUERY_VPORT_STATE (where Linux asks the netdev
    /// whether it is up) and PMTU's operational MTU less mlx5e's L2 overhead (where Linux reads the netdev MTU).
    pub fn query_port(&mut self, delay: &mut impl DelayNs) -> Result<PortAttr, Error> {
        use crate::port::{self as p, PortTypeSpeed};
        use crate::reg::{pmtu_read, PortMtu};
        use crate::vport::{iboe_mtu, QueryHcaVportContext, QueryNicVportContext, QueryVportState};
        let link = self.link_layer();
        let max_msg_sz = 1u32.checked_shl(self.caps.general.log_max_msg.into()).unwrap_or(0);
        let mut ptys = [0u8; crate::prm::ifc::ptys_reg::SIZE_BYTES];
        let mut pmtu = [0u8; crate::prm::ifc::pmtu_reg::SIZE_BYTES];
        let mut pvlc = [0u8; crate::prm::ifc::pvlc_reg::SIZE_BYTES];
        let bad = |what, value: u64| {
            Error::Cmd(crate::cmdq::CmdError::Malformed { opcode: crate::prm::Opcode::AccessReg, what, value })
        };
        match link {
            LinkLayer::InfiniBand => {
                let h = self.exec(&mut QueryHcaVportContext { port_num: 1 }, delay)?;
                self.exec(&mut p::ptys_read(1, consts::MLX5_PTYS_IB as u8, &mut ptys), delay)?;
                let speed = PortTypeSpeed::parse(&ptys);
                let active_width = p::ib_active_width(speed.ib_link_width_oper);
                self.exec(&mut pmtu_read(1, &mut pmtu), delay)?;
                let mtu = PortMtu::parse(&pmtu);
                let max_mtu = p::mtu_to_ib_mtu(mtu.max_mtu).ok_or(bad("PMTU max_mtu", mtu.max_mtu.into()))?;
                let active_mtu = p::mtu_to_ib_mtu(mtu.oper_mtu).ok_or(bad("PMTU oper_mtu", mtu.oper_mtu.into()))?;
                self.exec(&mut p::pvlc_read(1, &mut pvlc), delay)?;
                let vl_hw_cap = crate::prm::MsgBuf::get(&pvlc[..], crate::prm::ifc::pvlc_reg::VL_HW_CAP);
                let max_vl_num = p::max_vl_num(vl_hw_cap).ok_or(bad("PVLC vl_hw_cap", vl_hw_cap.into()))?;
                let g = &self.caps.general;
                Ok(PortAttr {
                    state: h.vport_state,
                    max_mtu,
                    active_mtu,
                    gid_tbl_len: p::gid_table_len(g.gid_table_size),
                    port_cap_flags: h.cap_mask1,
                    max_msg_sz,
                    bad_pkey_cntr: h.pkey_violation_counter.into(),
                    qkey_viol_cntr: h.qkey_violation_counter.into(),
                    pkey_tbl_len: p::pkey_table_len(g.pkey_table_size),
                    lid: h.lid,
                    sm_lid: h.sm_lid,
                    lmc: h.lmc,
                    max_vl_num,
                    sm_sl: h.sm_sl,
                    subnet_timeout: h.subnet_timeout,
                    init_type_reply: h.init_type_reply,
                    active_width,
                    active_speed: u8::try_from(speed.ib_proto_oper).unwrap_or(0),
                    phys_state: h.port_physical_state,
                    link_layer: link,
                    flags: if h.grh_required { p::QPF_GRH_REQUIRED } else { 0 },
                    port_cap_flags2: if h.cap_mask1 & p::PORT_CAP_MASK2_SUP != 0 { h.cap_mask2 as u16 } else { 0 },
                    active_speed_ex: speed.ib_proto_oper.into(),
                })
            }
            LinkLayer::Ethernet => {
                self.exec(&mut p::ptys_read(1, consts::MLX5_PTYS_EN as u8, &mut ptys), delay)?;
                let (speed, active_width) = PortTypeSpeed::parse(&ptys).eth_speed_width();
                let nic = self.exec(&mut QueryNicVportContext, delay)?;
                let up = self.exec(&mut QueryVportState, delay)?.is_up();
                self.exec(&mut pmtu_read(1, &mut pmtu), delay)?;
                let netdev_mtu = PortMtu::parse(&pmtu).oper_mtu.saturating_sub(p::ETH_HW_MTU_OVERHEAD);
                let max_mtu = consts::IB_MTU_4096;
                let (port_cap_flags, gid_tbl_len, qkey_viol) = if nic.roce_en {
                    (
                        p::PORT_CAP_CM_SUP | p::PORT_CAP_IP_BASED_GIDS,
                        self.caps.roce_address_table_size.unwrap_or(0),
                        nic.qkey_violation_counter,
                    )
                } else {
                    (0, 0, 0)
                };
                let (state, phys_state) = if up {
                    (consts::IB_PORT_ACTIVE, consts::IB_PORT_PHYS_STATE_LINK_UP)
                } else {
                    (consts::IB_PORT_DOWN, consts::IB_PORT_PHYS_STATE_DISABLED)
                };
                Ok(PortAttr {
                    state: state as u8,
                    max_mtu,
                    active_mtu: iboe_mtu(netdev_mtu.into()).min(max_mtu),
                    gid_tbl_len,
                    port_cap_flags,
                    max_msg_sz,
                    bad_pkey_cntr: 0,
                    qkey_viol_cntr: qkey_viol.into(),
                    pkey_tbl_len: 1,
                    lid: 0,
                    sm_lid: 0,
                    lmc: 0,
                    max_vl_num: 0,
                    sm_sl: 0,
                    subnet_timeout: 0,
                    init_type_reply: 0,
                    active_width,
                    active_speed: u8::try_from(speed).unwrap_or(0),
                    phys_state: phys_state as u8,
                    link_layer: link,
                    flags: 0,
                    port_cap_flags2: 0,
                    active_speed_ex: speed.into(),
                })
            }
        }
    }

    /// `ibv_query_gid` for port 1. InfiniBand: index 0, fe80:: + port GUID. RoCE: any programmed entry of the GID
    /// table (index 0 and 1 are the link-local address of the port MAC, v1 and v2).
    pub fn query_gid(&mut self, index: u16, delay: &mut impl DelayNs) -> Result<[u8; 16], Error> {
        Ok(self.query_gid_ex(index, delay)?.0)
    }

    /// `ibv_query_gid_ex` for port 1: the GID at `index` with its type.
    pub fn query_gid_ex(&mut self, index: u16, delay: &mut impl DelayNs) -> Result<([u8; 16], GidType), Error> {
        use crate::vport::{QueryHcaVportContext, RoceVersion};
        match self.link_layer() {
            LinkLayer::InfiniBand => {
                if index != 0 {
                    return Err(Error::BadSize {
                        what: "GID index (InfiniBand: only the default GID)",
                        requested: index.into(),
                        max: 0,
                    });
                }
                let guid = self.exec(&mut QueryHcaVportContext { port_num: 1 }, delay)?.port_guid;
                Ok((link_local_gid(guid), GidType::Ib))
            }
            LinkLayer::Ethernet => match self.query_roce_gid(index, delay)? {
                Some(e) => Ok((
                    e.gid,
                    match e.version {
                        RoceVersion::V1 => GidType::RoceV1,
                        RoceVersion::V2 => GidType::RoceV2,
                    },
                )),
                None => Err(Error::BadSize { what: "GID index (no entry there)", requested: index.into(), max: 0 }),
            },
        }
    }

    /// Programs the RoCE GID table as Linux's GID cache fills it (`roce_gid_mgmt` then `mlx5_ib` `add_gid`): the
    /// default link-local GID of the port MAC as v1 (index 0) and v2 (index 1), then each configured IPv4 and then
    /// IPv6 address as a v1 and a v2 entry.
    pub(crate) fn program_gid_table(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        let mac = self.exec(&mut crate::vport::QueryNicVportContext, delay)?.permanent_address;
        let max = self.caps.roce_address_table_size.unwrap_or(0);
        let cfg = self.ctx.cfg;
        for (index, entry) in gid_table(mac, cfg.ipv4_addrs, cfg.ipv6_addrs).enumerate() {
            let index = u16::try_from(index).ok().filter(|&i| i < max).ok_or(Error::BadSize {
                what: "GID table entries",
                requested: index as u64,
                max: max.into(),
            })?;
            self.set_roce_gid(index, Some(entry), delay)?;
        }
        Ok(())
    }

    /// Adds a port address to the RoCE GID table as Linux's GID cache does when the netdev gains one: a v1 entry
    /// in the first free index and a v2 entry in the next free one (free entries are found with
    /// QUERY_ROCE_ADDRESS). `addr` is an IPv6 address or an IPv4 one mapped as `::ffff:a.b.c.d`. Returns the two
    /// indices.
    pub fn add_roce_address(&mut self, addr: [u8; 16], delay: &mut impl DelayNs) -> Result<[u16; 2], Error> {
        use crate::vport::{RoceGid, RoceVersion};
        let mac = self.exec(&mut crate::vport::QueryNicVportContext, delay)?.permanent_address;
        let mut placed = [0u16; 2];
        let mut next = 0u16;
        for (slot, version) in placed.iter_mut().zip([RoceVersion::V1, RoceVersion::V2]) {
            let index = self.free_gid_index(next, delay)?;
            self.set_roce_gid(index, Some(RoceGid { gid: addr, version, vlan: None, mac }), delay)?;
            *slot = index;
            next = index + 1;
        }
        Ok(placed)
    }

    /// Removes a port address from the RoCE GID table: every entry holding it is cleared with an all-zero
    /// SET_ROCE_ADDRESS, as Linux deletes a GID. Returns how many entries were cleared.
    pub fn del_roce_address(&mut self, addr: [u8; 16], delay: &mut impl DelayNs) -> Result<usize, Error> {
        let max = self.caps.roce_address_table_size.unwrap_or(0);
        let mut cleared = 0;
        for index in 0..max {
            if let Some(e) = self.query_roce_gid(index, delay)?.filter(|e| e.gid == addr) {
                self.del_roce_gid(index, e.version, delay)?;
                cleared += 1;
            }
        }
        Ok(cleared)
    }

    /// The first empty RoCE GID table index at or after `from`.
    fn free_gid_index(&mut self, from: u16, delay: &mut impl DelayNs) -> Result<u16, Error> {
        let max = self.caps.roce_address_table_size.unwrap_or(0);
        for index in from..max {
            if self.query_roce_gid(index, delay)?.is_none() {
                return Ok(index);
            }
        }
        Err(Error::BadSize { what: "GID table entries (table full)", requested: u64::from(max) + 1, max: max.into() })
    }

    /// `SET_ROCE_ADDRESS` for port 1 (`mlx5_ib` `set_roce_addr`): programs GID table entry `index`, or deletes a
    /// RoCE v1 entry (all zeros) when `entry` is `None`; [`del_roce_gid`](Self::del_roce_gid) deletes either type.
    pub fn set_roce_gid(
        &mut self,
        index: u16,
        entry: Option<crate::vport::RoceGid>,
        delay: &mut impl DelayNs,
    ) -> Result<(), Error> {
        let deleted = crate::vport::RoceVersion::V1;
        self.exec(&mut crate::vport::SetRoceAddress { index, entry, deleted }, delay)?;
        self.note_gid_type(index, entry.is_some_and(|e| e.version == crate::vport::RoceVersion::V2));
        Ok(())
    }

    /// Deletes GID table entry `index` of type `version` as `mlx5_ib` `del_gid` does: address and MAC zeroed, the
    /// entry's type still named.
    pub fn del_roce_gid(
        &mut self,
        index: u16,
        version: crate::vport::RoceVersion,
        delay: &mut impl DelayNs,
    ) -> Result<(), Error> {
        self.exec(&mut crate::vport::SetRoceAddress { index, entry: None, deleted: version }, delay)?;
        self.note_gid_type(index, false);
        Ok(())
    }

    /// `QUERY_ROCE_ADDRESS` for port 1: GID table entry `index` with its RoCE version (`None` when empty).
    pub fn query_roce_gid(
        &mut self,
        index: u16,
        delay: &mut impl DelayNs,
    ) -> Result<Option<crate::vport::RoceGid>, Error> {
        self.exec(&mut crate::vport::QueryRoceAddress { index }, delay)
    }

    /// A BlueFlame register for a new QP and the UAR page it is in ([`crate::uar::BfregPool`]): a free dedicated
    /// one, one of a newly allocated page (ALLOC_UAR) when the pages held are full, or a shared one (8-byte
    /// doorbells only) when the pool holds all the pages it can or firmware has no UAR left.
    fn take_bfreg(&mut self, delay: &mut impl DelayNs) -> Result<(crate::uar::Uar, crate::uar::BfReg), Error> {
        let proto = self.uar_page().ok_or(Error::NotSupported { what: "QP without a UAR" })?;
        if let Some(t) = self.bfregs.take(&proto) {
            return Ok(t);
        }
        if self.bfregs.has_room() {
            match self.exec(&mut crate::uar::alloc_uar(), delay) {
                Ok(index) => {
                    self.bfregs.add_page(index);
                    if let Some(t) = self.bfregs.take(&proto) {
                        return Ok(t);
                    }
                }
                // Firmware refused (no UAR left): share a register below.
                Err(Error::Cmd(crate::cmdq::CmdError::Status { .. })) => {}
                Err(e) => return Err(e),
            }
        }
        let shared = proto.bfreg(0).ok_or(Error::NotSupported { what: "QP without a BlueFlame register" })?;
        Ok((proto, shared.shared()))
    }

    /// A register from [`Hca::take_bfreg`] back to the pool (a shared one stays shared).
    fn give_bfreg(&mut self, reg: &crate::uar::BfReg) {
        if let Some(proto) = self.uar_page() {
            self.bfregs.give(reg, &proto);
        }
    }

    /// QPs' BlueFlame registers: (dedicated ones in use, UAR pages held for them).
    pub fn bfreg_usage(&self) -> (usize, usize) {
        (self.bfregs.in_use(), self.bfregs.pages())
    }

    /// The HCA's mapped UAR page (its doorbells and BlueFlame registers).
    pub fn uar_page(&self) -> Option<crate::uar::Uar> {
        let g = &self.caps.general;
        self.uar.map(|index| crate::uar::Uar { index, bf_reg_size: 1usize << g.log_bf_reg_size, bf: g.bf })
    }

    /// Doorbell-record pool usage: (pages held, records in use).
    pub fn dbr_usage(&self) -> (usize, usize) {
        (self.dbr.pages(), self.dbr.in_use())
    }

    /// The completion EQ of vector 0, once a CQ created it.
    pub fn comp_eq(&self) -> Option<u8> {
        self.comp_eqn_of(0)
    }
}

/// [`Hca::poll_cq`] for a caller that keeps a CQ apart from its HCA (behind a lock of its own, polled on another
/// thread than the one running commands). `stopped` is asked only on a poll that found the ring empty: `None`
/// while the device still writes this CQ, `Some(dead)` once it does not (`dead`: the HCA is in internal error;
/// otherwise the CQ failed), and the outstanding work requests are then completed as [`Hca::poll_cq`] does.
pub fn poll_cq_with<M: Mmio + ?Sized>(
    mmio: &M,
    cq: &mut Cq,
    wq: &mut (impl WrTable + ?Sized),
    wc: &mut [WorkCompletion],
    stopped: impl FnOnce() -> Option<bool>,
) -> Result<usize, CqeError> {
    poll_cq_into(mmio, cq, wq, wc, stopped)
}

/// [`poll_cq_with`] into any [`WcSink`](crate::cq::WcSink): a host's own completion layout, written as each
/// completion is decoded.
#[inline]
pub fn poll_cq_into<M: Mmio + ?Sized, S: crate::cq::WcSink + ?Sized>(
    mmio: &M,
    cq: &mut Cq,
    wq: &mut (impl WrTable + ?Sized),
    wc: &mut S,
    stopped: impl FnOnce() -> Option<bool>,
) -> Result<usize, CqeError> {
    let mut n = cq.poll_into(mmio, wq, wc)?;
    let cap = wc.capacity();
    // Software completions only on a poll that found the ring empty: `Cq::poll` returns 0 only then (an entry it
    // cannot decode is an error of its own), so no completion the device wrote is passed over or repeated.
    if n > 0 || cap == 0 {
        return Ok(n);
    }
    let Some(dead) = stopped() else { return Ok(0) };
    while n < cap {
        let Some(f) = wq.flush_one(cq.cqn(), dead) else { break };
        // A flushed completion is whole: storing it cannot fail.
        let _ = wc.fill(n, |w| {
            crate::cq::WcOut::set(w, &f);
            Ok(true)
        });
        n += 1;
    }
    Ok(n)
}
