//! HCA bring-up and teardown in Linux's order (`main.c` `mlx5_function_enable` / `mlx5_function_open` /
//! `mlx5_load`, `mlx5_unload` / `mlx5_function_teardown`): capabilities, startup pages, the EQs and the return of
//! every firmware page and DMA allocation.

use core::cell::Cell;

use crate::caps::{DeviceCaps, GeneralCaps};
use crate::cmdq::{iseg_timeout_ms, CmdError, CmdQueue};
use crate::dbr::DbrPoolOf;
use crate::eq::{
    async_event_mask, destroy_eq, event_bitmask, log_eq_size, AsyncEventCaps, CreateEq, EqContext, EqRing,
};
use crate::hal::{DelayNs, Dma, DmaGuard, DmaRegion, Mmio};
use crate::health::{Health, HealthFailure};
use crate::init::{
    disable_hca, enable_hca, init_hca, set_issi, teardown_hca, CapBlock, CapMode, CapType, QueryHcaCap, QueryIssi,
    SetDriverVersion, SetHcaCap,
};
use crate::pages::{FwPagesOf, PageStage, QueryPages, RECLAIM_BATCH};
use crate::prm::{c, consts, ifc, MsgBuf, Opcode};
use crate::trace::CmdTrace;
use crate::uar::{alloc_uar, dealloc_uar};

use super::error::{BringupError, Error, Step};
use super::events::{AsyncEvents, CqEvents};
use super::wait::{Clock, GiveError, Watch};
use super::Tables;
use super::{
    Config, Ctx, EqTable, EventCounts, Hca, HcaState, PageStats, TeardownReport, ATOMIC_REQ_MODE_HOST_ENDIANNESS,
    FW_INIT_TIMEOUT_MS, FW_PRE_INIT_WAIT_MS, MAX_ASYNC_EQS, MAX_COMP_VECTORS, PROFILE_LOG_MAX_QP,
};

/// Waits for `initializing` (bit 31 at 0x1fc) to clear (`wait_fw_init`). All-ones reads mean the device is gone.
fn wait_fw_init<M: Mmio + ?Sized>(
    mmio: &M,
    delay: &mut impl DelayNs,
    timeout_ms: u32,
    state: &'static str,
) -> Result<(), Error> {
    let reg = c::mlx5_init_seg::INITIALIZING.off;
    let bit = 32 - ifc::initial_seg::INITIALIZING.width - (ifc::initial_seg::INITIALIZING.off % 32);
    let mut waited = 0u32;
    loop {
        let v = mmio.read32(reg);
        if v == u32::MAX && mmio.read32(c::mlx5_init_seg::FW_REV.off) == u32::MAX {
            return Err(Error::Health(HealthFailure::DeviceGone));
        }
        if (v >> bit) & 1 == 0 {
            return Ok(());
        }
        if waited >= timeout_ms {
            return Err(Error::FwInitTimeout { state, waited_ms: waited });
        }
        delay.delay_ms(FW_PRE_INIT_WAIT_MS);
        waited += FW_PRE_INIT_WAIT_MS;
    }
}

impl<M: Mmio, D: Dma, T: CmdTrace, S: Tables> Hca<M, D, T, S> {
    /// Brings the function up in Linux's order. On failure everything done so far is undone (pages reclaimed,
    /// function disabled, memory returned) before the error comes back.
    pub fn bring_up(mmio: M, dma: D, trace: T, delay: &mut impl DelayNs, cfg: Config) -> Result<Self, BringupError> {
        let fail = |step, error| BringupError { step, error, cleanup: None };
        wait_fw_init(&mmio, delay, cfg.pre_init_timeout_ms, "pre-initializing")
            .map_err(|e| fail(Step::PreInitializing, e))?;
        let fw_rev = {
            use ifc::initial_seg as s;
            let w0 = mmio.read32(c::mlx5_init_seg::FW_REV.off).to_be_bytes();
            let w1 = mmio.read32(c::mlx5_init_seg::CMDIF_REV_FW_SUB.off).to_be_bytes();
            let mut img = [0u8; 8];
            img[..4].copy_from_slice(&w0);
            img[4..].copy_from_slice(&w1);
            (img.get(s::FW_REV_MAJOR) as u16, img.get(s::FW_REV_MINOR) as u16, img.get(s::FW_REV_SUBMINOR) as u16)
        };
        let cmdq = CmdQueue::new(mmio, dma, trace).map_err(|e| fail(Step::CmdqInit, e.into()))?;
        let init_to = if cmdq.mmio().read32(c::mlx5_init_seg::CMD_Q_INIT_TO.off) != 0 {
            iseg_timeout_ms(cmdq.mmio().read32(c::mlx5_init_seg::CMD_Q_INIT_TO.off)).min(u64::from(u32::MAX)) as u32
        } else {
            FW_INIT_TIMEOUT_MS
        };
        let mut hca = Hca {
            cmdq,
            ctx: Ctx {
                cfg,
                pages: FwPagesOf::new(),
                watch: Watch {
                    health: Health::new(),
                    last_poll_us: 0,
                    interval_us: u64::from(cfg.health_poll_interval_ms) * 1000,
                    failure: None,
                    tick_ms: 0,
                    tick_interval_ms: u64::from(cfg.health_poll_interval_ms),
                },
                event_caps: AsyncEventCaps::default(),
                page_request_disable: false,
                eqs: EqTable::new(),
                cqs: CqEvents::new(),
                async_events: AsyncEvents::new(),
                stats: PageStats::default(),
                events: EventCounts::default(),
            },
            dbr: DbrPoolOf::new(if cfg.cache_line_128 { 128 } else { 64 }),
            mkey_variant: 0,
            clock_us: Cell::new(0),
            state: HcaState::Up,
            enabled: false,
            initialized: false,
            uar: None,
            bfregs: crate::uar::BfregPool::default(),
            issi: 0,
            orphans: [const { None }; 8],
            roce_v2_gids: [0; 4],
            q_counter: None,
            caps: DeviceCaps::default(),
            fw_rev,
        };
        let mut step = Step::Initializing;
        let r = (|| -> Result<(), Error> {
            wait_fw_init(hca.cmdq.mmio(), delay, init_to, "initializing")?;
            hca.setup(delay, &mut step)
        })();
        match r {
            Ok(()) => Ok(hca),
            Err(error) => {
                let report = hca.shutdown(delay);
                Err(BringupError { step, error, cleanup: report.first_error })
            }
        }
    }

    /// The steps after the command queue is up (`mlx5_function_enable` from ENABLE_HCA, `mlx5_function_open`,
    /// the start of `mlx5_load`).
    fn setup(&mut self, delay: &mut impl DelayNs, step: &mut Step) -> Result<(), Error> {
        let func = self.ctx.cfg.function_id;
        *step = Step::EnableHca;
        self.exec(&mut enable_hca(func), delay)?;
        self.enabled = true;

        *step = Step::SetIssi;
        match self.exec(&mut QueryIssi, delay) {
            Ok(issi) if issi.supports(1) => {
                self.exec(&mut set_issi(1), delay)?;
                self.issi = 1;
            }
            Ok(issi) if !issi.supports(0) => return Err(Error::NoIssi { supported: issi.supported }),
            Ok(_) => self.issi = 0,
            // Firmware that answers QUERY_ISSI with an error status predates it: ISSI 0 (`mlx5_core_set_issi`).
            Err(Error::Cmd(CmdError::Status { .. })) => self.issi = 0,
            Err(e) => return Err(e),
        }

        *step = Step::BootPages;
        self.ctx.stats.boot = self.startup_pages(PageStage::Boot, delay)?;

        *step = Step::HcaCtrl;
        let mut he = [0u8; crate::reg::HOST_ENDIANNESS_LEN];
        self.exec(&mut crate::reg::host_endianness(&mut he), delay)?;

        *step = Step::SetHcaCaps;
        self.set_hca_caps(delay)?;

        *step = Step::InitPages;
        self.ctx.stats.init = self.startup_pages(PageStage::Init, delay)?;

        *step = Step::InitHca;
        self.exec(&mut init_hca(), delay)?;
        self.initialized = true;

        *step = Step::DriverVersion;
        if self.caps.general.driver_version {
            let v = self.ctx.cfg.driver_version;
            // Informational only: Linux ignores a refusal (`mlx5_set_driver_version` returns nothing). A device
            // that does not answer at all still fails the bring-up.
            match self.exec(&mut SetDriverVersion { version: v }, delay) {
                Ok(()) | Err(Error::Cmd(CmdError::Status { .. })) => {}
                Err(e) => return Err(e),
            }
        }

        *step = Step::QueryCaps;
        self.query_hca_caps(delay)?;

        *step = Step::AllocUar;
        let uar = self.exec(&mut alloc_uar(), delay)?;
        self.uar = Some(uar);
        self.bfregs.add_page(uar);

        *step = Step::CreateEq;
        self.create_async_eqs(delay)?;

        // Firmware asks for its regular pages through the EQ as soon as it can; serve them now.
        *step = Step::RegularPages;
        self.process_events(delay)?;

        // mlx5_ib's counters stage (`mlx5_ib_alloc_counters`), before the device registers and its GID cache
        // programs the table.
        if self.caps.general.max_qp_cnt > 0 {
            *step = Step::QCounter;
            let shared = self.caps.general.log_max_uctx != 0;
            self.q_counter = Some(self.exec(&mut crate::qcounter::alloc_q_counter(shared), delay)? as u8);
        }

        // mlx5_ib's add_gid for each entry the GID cache builds, on a RoCE port only.
        if self.caps.general.port_type() != crate::caps::PortType::InfiniBand
            && self.caps.roce_address_table_size.is_some()
        {
            *step = Step::GidTable;
            self.program_gid_table(delay)?;
        }
        Ok(())
    }

    /// QUERY_PAGES for a stage, then MANAGE_PAGES give (`mlx5_satisfy_startup_pages`). Returns pages given.
    fn startup_pages(&mut self, stage: PageStage, delay: &mut impl DelayNs) -> Result<usize, Error> {
        let req = self.exec(&mut QueryPages { stage }, delay)?;
        if req.num_pages <= 0 {
            return Ok(0);
        }
        let n = req.num_pages as usize;
        self.check_state(Opcode::ManagePages)?;
        let mut clk = Clock { inner: delay, us: &self.clock_us };
        let r = self.ctx.give_all(&mut self.cmdq, &mut clk, &self.clock_us, req.function_id, n, |_, _| {});
        match r {
            Ok(()) => Ok(n),
            Err(GiveError::Pool(e)) => Err(Error::Pages(e)),
            Err(GiveError::Cmd(e)) => Err(self.cmd_error(e)),
        }
    }

    /// `set_hca_cap`: general (as `handle_hca_cap` sets it), atomic, RoCE, general 2 (ODP is not used by this
    /// driver, as in a kernel built without `CONFIG_INFINIBAND_ON_DEMAND_PAGING`).
    fn set_hca_caps(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        use ifc::cmd_hca_cap as g;
        let max = self.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Max }, delay)?;
        let maxg = GeneralCaps::parse(&max);
        let max_of = |f| max.get(f);
        let mut set: CapBlock = self.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Current }, delay)?;
        let cur = GeneralCaps::parse(&set);
        set.set(g::PKEY_TABLE_SIZE, consts::MLX5_CMD_HCA_CAP_PKEY_TABLE_SIZE_128_ENTRIES);
        let log_max_qp = self.ctx.cfg.log_max_qp.unwrap_or(PROFILE_LOG_MAX_QP).min(maxg.log_max_qp);
        set.set(g::LOG_MAX_QP, log_max_qp.into());
        // Command signatures stay off (`cmdif_checksum` 0), as Linux runs.
        set.set(g::CMDIF_CHECKSUM, 0);
        if max_of(g::UAR_4K) != 0 && self.ctx.cfg.page_shift > 12 {
            set.set(g::UAR_4K, 1);
        }
        set.set(g::LOG_UAR_PAGE_SZ, u32::from(self.ctx.cfg.page_shift.saturating_sub(12)));
        if max_of(g::CACHE_LINE_128BYTE) != 0 {
            set.set(g::CACHE_LINE_128BYTE, self.ctx.cfg.cache_line_128.into());
        }
        for f in [g::DCT, g::PCI_SYNC_FOR_FW_UPDATE_EVENT, g::PCI_SYNC_FOR_FW_UPDATE_WITH_DRIVER_UNLOAD] {
            if max_of(f) != 0 {
                set.set(f, 1);
            }
        }
        if max_of(g::NUM_VHCA_PORTS) != 0 {
            set.set(g::NUM_VHCA_PORTS, max_of(g::NUM_VHCA_PORTS));
        }
        for f in [g::RELEASE_ALL_PAGES, g::MKEY_BY_NAME] {
            if max_of(f) != 0 {
                set.set(f, 1);
            }
        }
        // `mlx5_vhca_state_cap_handle`.
        if max_of(g::VHCA_STATE) != 0 {
            for f in [
                g::EVENT_ON_VHCA_STATE_TEARDOWN_REQUEST,
                g::EVENT_ON_VHCA_STATE_IN_USE,
                g::EVENT_ON_VHCA_STATE_ACTIVE,
                g::EVENT_ON_VHCA_STATE_ALLOCATED,
                g::EVENT_ON_VHCA_STATE_INVALID,
            ] {
                set.set(f, 1);
            }
        }
        if max_of(g::NUM_TOTAL_DYNAMIC_VF_MSIX) != 0 {
            set.set(g::NUM_TOTAL_DYNAMIC_VF_MSIX, max_of(g::NUM_TOTAL_DYNAMIC_VF_MSIX));
        }
        // RoCE on (devlink `enable_roce` defaults to true).
        if set.get(g::ROCE_RW_SUPPORTED) != 0 && maxg.roce {
            set.set(g::ROCE, 1);
        }
        self.exec(&mut SetHcaCap { cap: CapType::General, block: &set }, delay)?;
        self.caps.general = GeneralCaps::parse(&set);
        // `gather_async_events_mask` reads these two from the maximum capabilities.
        self.ctx.event_caps.dct_max = maxg.dct;
        self.ctx.event_caps.vhca_state_max = max_of(g::VHCA_STATE) != 0;

        // `handle_hca_cap_atomic`: the current general caps (as queried before the set) decide.
        if cur.atomic {
            let _ = self.exec(&mut QueryHcaCap { cap: CapType::Atomic, mode: CapMode::Max }, delay)?;
            let acur = self.exec(&mut QueryHcaCap { cap: CapType::Atomic, mode: CapMode::Current }, delay)?;
            if acur.get(ifc::atomic_caps::SUPPORTED_ATOMIC_REQ_8B_ENDIANNESS_MODE_1) == ATOMIC_REQ_MODE_HOST_ENDIANNESS
            {
                let mut aset = [0u8; crate::init::CAP_BYTES];
                aset.set(ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE, ATOMIC_REQ_MODE_HOST_ENDIANNESS);
                self.exec(&mut SetHcaCap { cap: CapType::Atomic, block: &aset }, delay)?;
            }
        }
        // `handle_hca_cap_roce`: turn on software-chosen RoCE source ports when the device allows it.
        if cur.roce {
            let rmax = self.exec(&mut QueryHcaCap { cap: CapType::Roce, mode: CapMode::Max }, delay)?;
            let mut rset = self.exec(&mut QueryHcaCap { cap: CapType::Roce, mode: CapMode::Current }, delay)?;
            use ifc::roce_cap as r;
            if rset.get(r::SW_R_ROCE_SRC_UDP_PORT) == 0 && rmax.get(r::SW_R_ROCE_SRC_UDP_PORT) != 0 {
                rset.set(r::SW_R_ROCE_SRC_UDP_PORT, 1);
                if rmax.get(r::QP_OOO_TRANSMIT_DEFAULT) != 0 {
                    rset.set(r::QP_OOO_TRANSMIT_DEFAULT, 1);
                }
                self.exec(&mut SetHcaCap { cap: CapType::Roce, block: &rset }, delay)?;
            }
        }
        // `handle_hca_cap_2`: read; `sw_vhca_id` is only set for devices with software vhca ids.
        if maxg.hca_cap_2 {
            self.exec(&mut QueryHcaCap { cap: CapType::General2, mode: CapMode::Max }, delay)?;
            self.exec(&mut QueryHcaCap { cap: CapType::General2, mode: CapMode::Current }, delay)?;
            // Linux then sets `sw_vhca_id` when the maximum image offers software vhca ids, a multi-function
            // feature this driver does not use (ConnectX-5 does not offer it).
        }
        Ok(())
    }

    /// `mlx5_query_hca_caps`, for the capability types this driver uses: general, general 2, Ethernet offloads,
    /// ODP, atomic, RoCE (current values), in Linux's order.
    fn query_hca_caps(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        let gen = self.exec(&mut QueryHcaCap { cap: CapType::General, mode: CapMode::Current }, delay)?;
        let g = GeneralCaps::parse(&gen);
        self.caps.general = g;
        {
            use ifc::cmd_hca_cap as f;
            let on = |fl| gen.get(fl) != 0;
            let eth = g.port_type() == crate::caps::PortType::Ethernet;
            self.ctx.event_caps = AsyncEventCaps {
                // `MLX5_VPORT_MANAGER`: the physical function of an Ethernet port that manages the vport group.
                vport_manager: on(f::VPORT_GROUP_MANAGER) && eth && self.ctx.cfg.function_id == 0,
                general_notification_event: on(f::GENERAL_NOTIFICATION_EVENT),
                port_module_event: on(f::PORT_MODULE_EVENT),
                fpga: on(f::FPGA),
                temp_warn_event: on(f::TEMP_WARN_EVENT),
                monitor_counters: on(f::MAX_NUM_OF_MONITOR_COUNTERS),
                ..self.ctx.event_caps
            };
            // `get_num_eqs`: the EQs the device allows (`max_num_eqs`, else `1 << log_max_eq`) less the async ones.
            let max_eqs = match gen.get(f::MAX_NUM_EQS) {
                0 => 1u32 << g.log_max_eq.min(31),
                n => n,
            };
            let avail = max_eqs.saturating_sub(MAX_ASYNC_EQS).min(MAX_COMP_VECTORS as u32);
            self.ctx.eqs.num_comp = (u32::from(self.ctx.cfg.num_comp_vectors).min(avail).max(1)) as u16;
            self.ctx.page_request_disable = on(f::PAGE_REQUEST_DISABLE);
        }
        let cur = |cap| QueryHcaCap { cap, mode: CapMode::Current };
        if g.hca_cap_2 {
            self.exec(&mut cur(CapType::General2), delay)?;
        }
        if g.eth_net_offloads {
            self.exec(&mut cur(CapType::EthernetOffloads), delay)?;
        }
        if g.pg {
            self.exec(&mut cur(CapType::Odp), delay)?;
        }
        if g.atomic {
            let a = self.exec(&mut cur(CapType::Atomic), delay)?;
            self.caps.atomic_operations = Some(a.get(ifc::atomic_caps::ATOMIC_OPERATIONS) as u16);
            self.caps.atomic_size_qp = Some(a.get(ifc::atomic_caps::ATOMIC_SIZE_QP) as u16);
        }
        if g.roce {
            let r = self.exec(&mut cur(CapType::Roce), delay)?;
            self.caps.roce_version = Some(r.get(ifc::roce_cap::ROCE_VERSION) as u8);
            self.caps.roce_address_table_size = Some(r.get(ifc::roce_cap::ROCE_ADDRESS_TABLE_SIZE) as u16);
            self.caps.roce_qp_ts_format = Some(r.get(ifc::roce_cap::QP_TS_FORMAT) as u8);
        }
        // Signatures follow what firmware now says.
        self.cmdq.set_checksum(g.cmdif_checksum != 0);
        Ok(())
    }

    /// `create_async_eqs`: the command EQ (`MLX5_NUM_CMD_EQE` entries, command completions only), the async EQ
    /// (`Config::async_eq_nent`, the mask gathered from the capabilities) and, unless the device says it sends no
    /// page requests (`page_request_disable`), the pages EQ (one entry, page requests only). All three use the
    /// control interrupt, vector 0. Commands are still completed by polling their slot: the driver waits on one
    /// thread and drains every EQ while it does, so switching to command events would only move where the
    /// completion is noticed; the command EQ's events are drained and counted.
    fn create_async_eqs(&mut self, delay: &mut impl DelayNs) -> Result<(), Error> {
        let cmd =
            self.create_eq_ring(consts::MLX5_NUM_CMD_EQE, event_bitmask(&[crate::prm::EventType::Cmd]), 0, delay)?;
        self.ctx.eqs.cmd = Some(cmd);
        let mask = async_event_mask(&self.ctx.event_caps);
        let ring = self.create_eq_ring(self.ctx.cfg.async_eq_nent, mask, 0, delay)?;
        self.ctx.eqs.async_eq = Some(ring);
        if !self.ctx.page_request_disable {
            let pages = self.create_eq_ring(1, event_bitmask(&[crate::prm::EventType::PageRequest]), 0, delay)?;
            self.ctx.eqs.pages = Some(pages);
        }
        Ok(())
    }

    /// The completion EQ of `vector` (`mlx5_comp_eqn_get` / `create_comp_eq`): no event mask, CQs name it in
    /// `c_eqn`; created on first use. It interrupts after the control vector (`MLX5_IRQ_VEC_COMP_BASE`, as
    /// `mlx5_irq_request_vector` offsets it) when the host has more than one vector, else on the shared vector 0.
    pub(crate) fn comp_eqn(&mut self, vector: u16, delay: &mut impl DelayNs) -> Result<u8, Error> {
        let v = usize::from(vector);
        if vector >= self.ctx.eqs.num_comp || v >= MAX_COMP_VECTORS {
            return Err(Error::BadSize {
                what: "completion vector",
                requested: vector.into(),
                max: u64::from(self.ctx.eqs.num_comp) - 1,
            });
        }
        if let Some(r) = &self.ctx.eqs.comp[v] {
            return Ok(r.eqn());
        }
        let intr = match self.ctx.cfg.num_irqs {
            0 | 1 => 0,
            n => 1 + vector % (n - 1),
        };
        let ring = self.create_eq_ring(self.ctx.cfg.comp_eq_nent, [0; 4], intr, delay)?;
        let eqn = ring.eqn();
        self.ctx.eqs.comp[v] = Some(ring);
        Ok(eqn)
    }

    /// An EQ of at least `nent` usable entries on the HCA's UAR: buffer with owner bits pre-set, CREATE_EQ, then
    /// armed.
    fn create_eq_ring(
        &mut self,
        nent: u32,
        mask: [u64; 4],
        intr: u16,
        delay: &mut impl DelayNs,
    ) -> Result<EqRing, Error> {
        let uar = self.uar.unwrap_or(0);
        let log_nent = log_eq_size(nent);
        let len = EqRing::buf_len(log_nent);
        let dma = self.cmdq.dma();
        let buf = dma.alloc(len, crate::cmd::FW_PAGE_SIZE)?;
        // SAFETY: fresh from `dma`; the device learns of it only from CREATE_EQ, after `keep` below.
        let buf = unsafe { DmaGuard::new(dma, buf) };
        buf.zero(0, len);
        EqRing::init_buf(&buf, log_nent)?;
        let buf = buf.keep();
        let npages = len / crate::cmd::FW_PAGE_SIZE;
        let mut cmd = CreateEq {
            ctx: EqContext { log_eq_size: log_nent, uar_page: uar, intr, log_page_size: 0, page_offset: 0 },
            event_bitmask: mask,
            pas: crate::cmd::Pas::Contiguous { base: buf.iova(), count: npages },
            // A completion EQ (no event types in the first mask word) is shared with user contexts when the device
            // has them (`create_map_eq`).
            uid: if mask[0] == 0 && self.caps.general.log_max_uctx != 0 {
                consts::MLX5_SHARED_RESOURCE_UID as u16
            } else {
                0
            },
        };
        match self.exec(&mut cmd, delay) {
            Ok(eqn) => {
                let uar_off = uar as usize * crate::cmd::FW_PAGE_SIZE;
                let mut ring = EqRing::new(buf, log_nent, eqn, uar_off);
                ring.update_ci(self.cmdq.mmio(), true);
                self.ctx.events.arms += 1;
                Ok(ring)
            }
            Err(e) => {
                self.release_unless_held(buf, &e);
                Err(e)
            }
        }
    }

    /// After a CREATE failed: frees `buf` when firmware answered with a status (it never used the buffer),
    /// otherwise keeps it until the function is disabled (firmware may have created the object and may write it).
    pub(crate) fn release_unless_held(&mut self, buf: DmaRegion, e: &Error) {
        if matches!(e, Error::Cmd(CmdError::Status { .. })) {
            // SAFETY: CREATE failed with a status, so the device holds no reference to the buffer.
            unsafe { self.cmdq.dma().free(buf) };
        } else {
            self.orphan(buf);
        }
    }

    /// Tears the HCA down (`mlx5_unload` + `mlx5_function_teardown`): DESTROY_EQ, DEALLOC_UAR, TEARDOWN_HCA,
    /// MANAGE_PAGES take until firmware has returned every page, DISABLE_HCA; every DMA allocation goes back.
    pub fn teardown(mut self, delay: &mut impl DelayNs) -> Result<TeardownReport, Error> {
        let report = self.shutdown(delay);
        match report.first_error {
            Some(e) => Err(e),
            None => Ok(report),
        }
    }

    /// The teardown steps, each attempted whatever happened before (a failure is remembered, not returned early).
    /// A command that gets no answer does not stop the rest: its slot stays taken and the next command uses
    /// another one, so a firmware that hangs on one opcode is still disabled properly. Only when DISABLE_HCA itself
    /// gets no answer does the driver give up on the firmware and finish locally.
    fn shutdown(&mut self, delay: &mut impl DelayNs) -> TeardownReport {
        let mut rep = TeardownReport::default();
        let note = |rep: &mut TeardownReport, e: Error| {
            rep.first_error.get_or_insert(e);
        };
        // mlx5_ib lets its counter set go before mlx5_core unloads (`mlx5_ib_dealloc_counters`).
        if let Some(id) = self.q_counter.take() {
            if let Err(e) = self.exec_destroy(crate::qcounter::dealloc_q_counter(id), delay) {
                note(&mut rep, e);
            }
        }
        // `mlx5_eq_table_destroy`: the completion EQs by vector, then `destroy_async_eqs` (pages, async, command).
        let mut order: [Option<EqRing>; MAX_COMP_VECTORS + 3] = [const { None }; MAX_COMP_VECTORS + 3];
        for (slot, ring) in order.iter_mut().zip(self.ctx.eqs.comp.iter_mut()) {
            *slot = ring.take();
        }
        order[MAX_COMP_VECTORS] = self.ctx.eqs.pages.take();
        order[MAX_COMP_VECTORS + 1] = self.ctx.eqs.async_eq.take();
        order[MAX_COMP_VECTORS + 2] = self.ctx.eqs.cmd.take();
        for ring in order.into_iter().flatten() {
            match self.exec_destroy(destroy_eq(ring.eqn()), delay) {
                Ok(()) => {
                    // SAFETY: the EQ is destroyed (or the device is dead), so the device no longer writes it.
                    unsafe { self.cmdq.dma().free(ring.into_buf()) };
                }
                Err(e) => {
                    // CQs left alive may still point at it: its buffer waits for DISABLE_HCA (or the dead device).
                    note(&mut rep, e);
                    self.orphan(ring.into_buf());
                }
            }
        }
        // The pages QPs' BlueFlame registers needed beyond the bring-up page, then that page.
        let mut extra = [None; crate::uar::MAX_BF_PAGES];
        for (slot, uar) in extra.iter_mut().zip(self.bfregs.drain_extra()) {
            *slot = Some(uar);
        }
        for uar in extra.into_iter().flatten().chain(self.uar.take()) {
            if let Err(e) = self.exec_destroy(dealloc_uar(uar), delay) {
                note(&mut rep, e);
            }
        }
        if self.initialized {
            match self.exec_destroy(teardown_hca(), delay) {
                Ok(()) => self.initialized = false,
                Err(e) => note(&mut rep, e),
            }
        }
        self.reclaim_all(delay, &mut rep);
        if self.enabled {
            match self.exec_destroy(disable_hca(self.ctx.cfg.function_id), delay) {
                Ok(()) => self.enabled = false,
                Err(e) => {
                    note(&mut rep, e);
                    if let Error::Cmd(CmdError::Timeout { .. }) = e {
                        self.enter_internal_error(HealthFailure::Unresponsive);
                    }
                }
            }
        }
        let dead = matches!(self.state, HcaState::InternalError(_));
        // Disabling the function (or its death) releases everything firmware held: pages it did not hand back,
        // objects whose destroy failed, the command queue.
        let released = !self.enabled || dead;
        if released && (self.ctx.pages.given() > 0 || self.ctx.pages.chunks() > 0) {
            let held = self.ctx.pages.abandon_all(self.cmdq.dma());
            self.ctx.stats.abandoned += held;
            rep.pages_abandoned += held;
            if held > 0 && !dead {
                note(&mut rep, Error::PagesNotReturned { pages: held });
            }
        }
        for slot in self.orphans.iter_mut() {
            if let Some(buf) = slot.take_if(|_| released) {
                // SAFETY: the function is disabled (DISABLE_HCA completed, or it was never enabled) or the device is
                // dead, so firmware no longer writes buffers of objects it may still have had.
                unsafe { self.cmdq.dma().free(buf) };
            }
        }
        if released {
            // SAFETY: the function is disabled or dead, so the device reads no doorbell record any more (records
            // of CQs the caller never destroyed included).
            unsafe { self.dbr.release_all(self.cmdq.dma()) };
        }
        rep.local_only = dead;
        rep.pages_reclaimed = self.ctx.stats.reclaimed;
        if released {
            // Firmware released the queue too, so its memory can go even if a timed-out command holds a slot.
            self.cmdq.set_device_down(true);
        }
        // Otherwise firmware refused DISABLE_HCA and still owns its pages and objects: they are leaked, never
        // freed under it.
        rep
    }

    /// Keeps a buffer firmware may still write until the function is disabled. With no room left it is leaked,
    /// which is safe.
    pub(crate) fn orphan(&mut self, buf: DmaRegion) {
        if let Some(slot) = self.orphans.iter_mut().find(|o| o.is_none()) {
            *slot = Some(buf);
        }
    }

    /// `mlx5_reclaim_startup_pages`: MANAGE_PAGES take in `optimal_reclaimed_pages` batches until firmware has
    /// returned everything or stops returning (or answering); in internal error the pages are reclaimed locally.
    fn reclaim_all(&mut self, delay: &mut impl DelayNs, rep: &mut TeardownReport) {
        let func = self.ctx.cfg.function_id;
        while self.ctx.pages.given() > 0 {
            if let HcaState::InternalError(_) = self.state {
                let held = self.ctx.pages.abandon_all(self.cmdq.dma());
                self.ctx.stats.abandoned += held;
                rep.pages_abandoned += held;
                break;
            }
            let want = self.ctx.pages.given().min(RECLAIM_BATCH);
            let clock = &self.clock_us;
            let mut clk = Clock { inner: &mut *delay, us: clock };
            let r = self.ctx.take(&mut self.cmdq, &mut clk, clock, func, want);
            match r {
                Ok(0) => return,
                Ok(_) => {}
                Err(e) => {
                    let e = self.cmd_error(e);
                    rep.first_error.get_or_insert(e);
                    // A dead device is handled at the top of the loop; anything else ends reclaiming here and
                    // DISABLE_HCA settles the rest.
                    if !matches!(self.state, HcaState::InternalError(_)) {
                        return;
                    }
                }
            }
        }
        self.ctx.pages.free_empty(self.cmdq.dma());
    }
}
