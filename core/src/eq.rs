//! Event queue commands (PRM CREATE_EQ / DESTROY_EQ; Linux `eq.c` `create_map_eq`).

use crate::cmd::{len_with_pas, write_pas, Pas, Simple};
use crate::cmdq::{write_header, CmdError, Command};
use crate::hal::{DmaRegion, Mmio};
use crate::prm::{c, consts, ifc, Bytes, EventType, MsgBuf, Opcode, SubBuf};

/// The `eqc` fields the driver sets.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EqContext {
    /// log2 of the number of 64-byte EQEs.
    pub log_eq_size: u8,
    /// UAR page the EQ's doorbells use.
    pub uar_page: u32,
    /// MSI-X vector the EQ interrupts on.
    pub intr: u16,
    /// Page size of `pas[]` relative to 4 KiB (`page_shift - MLX5_ADAPTER_PAGE_SHIFT`).
    pub log_page_size: u8,
    /// Offset of the ring in its first page.
    pub page_offset: u8,
}

/// `CREATE_EQ`: context, the four 64-bit event masks (bit `n` of word 0 = event type `n`) and the buffer pages.
#[derive(Debug, Clone, Copy)]
pub struct CreateEq<'a> {
    /// The EQ context.
    pub ctx: EqContext,
    /// Event types the EQ receives, one bit each.
    pub event_bitmask: [u64; 4],
    /// The ring's pages.
    pub pas: Pas<'a>,
    /// `uid`: `MLX5_SHARED_RESOURCE_UID` for a completion EQ on a device with user contexts, so CQs of any
    /// context may use it (`create_map_eq`), else 0.
    pub uid: u16,
}

impl Command for CreateEq<'_> {
    type In = ifc::create_eq_in::Bits;
    type Out = ifc::create_eq_out::Bits;
    /// The EQ number.
    type Output = u8;
    fn opcode(&self) -> Opcode {
        Opcode::CreateEq
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::create_eq_in::PAS, self.pas.len())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::CreateEq, 0);
        msg.set(ifc::create_eq_in::UID, self.uid.into());
        {
            let mut eqc = SubBuf::new(msg, ifc::create_eq_in::EQ_CONTEXT_ENTRY);
            eqc.set(ifc::eqc::LOG_EQ_SIZE, self.ctx.log_eq_size.into());
            eqc.set(ifc::eqc::UAR_PAGE, self.ctx.uar_page);
            eqc.set(ifc::eqc::INTR, self.ctx.intr.into());
            eqc.set(ifc::eqc::LOG_PAGE_SIZE, self.ctx.log_page_size.into());
            eqc.set(ifc::eqc::PAGE_OFFSET, self.ctx.page_offset.into());
        }
        for (i, &mask) in self.event_bitmask.iter().enumerate() {
            msg.set64(ifc::create_eq_in::EVENT_BITMASK.elem(i as u32), mask);
        }
        write_pas(msg, ifc::create_eq_in::PAS, self.pas);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<u8, CmdError> {
        Ok(out.get(ifc::create_eq_out::EQ_NUMBER) as u8)
    }
}

/// `DESTROY_EQ`.
pub fn destroy_eq(eqn: u8) -> Simple {
    Simple::new(Opcode::DestroyEq, ifc::destroy_eq_in::SIZE_BYTES, ifc::destroy_eq_out::SIZE_BYTES)
        .arg(ifc::destroy_eq_in::EQ_NUMBER, eqn.into())
}

/// Bytes per EQE (`MLX5_EQE_SIZE`).
pub const EQE_SIZE: usize = c::mlx5_eqe::SIZE;

/// One event queue entry, copied out of the ring after its ownership check (`struct mlx5_eqe`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Eqe(pub [u8; EQE_SIZE]);

impl core::fmt::Debug for Eqe {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Eqe").field("event", &self.event()).finish()
    }
}

/// Reads a big-endian member of a byte image (`Bytes` from the C layouts, at most 4 bytes).
fn be(buf: &[u8], base: usize, m: Bytes) -> u32 {
    m.get_be(buf, base)
}

/// Writes a big-endian member of a byte image.
fn put_be(buf: &mut [u8], base: usize, m: Bytes, v: u32) {
    m.put_be(buf, base, v)
}

/// What an EQE says, decoded (`mlx5_eq_async_int` and the notifier handlers). Unknown types stay raw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Event {
    /// A CQ has a new completion (`data.comp.cqn`, 24 bits).
    Completion {
        /// The CQ number.
        cqn: u32,
    },
    /// Command slots completed (`data.cmd.vector`, one bit per slot).
    Command {
        /// One bit per completed slot.
        vector: u32,
    },
    /// Firmware wants pages (`num_pages` > 0) or offers pages back (< 0) (`data.req_pages`).
    PageRequest {
        /// The function.
        function_id: u16,
        /// Whether it is an embedded-CPU function.
        ec_function: bool,
        /// Pages wanted (> 0) or offered back (< 0).
        num_pages: i32,
    },
    /// A CQ overran or hit an error (`data.cq_err`).
    CqError {
        /// The CQ number.
        cqn: u32,
        /// `MLX5_CQ_ERROR_SYNDROME_*`.
        syndrome: u8,
    },
    /// Port state changed (`data.port.port`, upper nibble; `sub_type` = `MLX5_PORT_CHANGE_SUBTYPE_*`).
    PortChange {
        /// The port.
        port: u8,
        /// `MLX5_PORT_CHANGE_SUBTYPE_*`.
        sub_type: u8,
    },
    /// Firmware reported an internal error.
    InternalError,
    /// A QP's work queue failed and the QP is in ERR (`data.qp_srq` with queue type QP): a catastrophic error,
    /// an invalid request or an access error (`MLX5_EVENT_TYPE_WQ_*_ERROR`; verbs `IBV_EVENT_QP_FATAL`,
    /// `_QP_REQ_ERR`, `_QP_ACCESS_ERR`).
    QpError {
        /// The QP number.
        qpn: u32,
        /// Which error.
        kind: QpErrorKind,
    },
    /// A QP's affiliated event that is no error (`data.qp_srq` with queue type QP; `mlx5_ib_qp_event`): path
    /// migration, communication established, send queue drained, path migration failed.
    QpEvent {
        /// The QP number.
        qpn: u32,
        /// Which event.
        kind: QpEventKind,
    },
    /// Any other event type, undecoded.
    Other {
        /// The event type.
        event_type: u8,
        /// The sub-type.
        sub_type: u8,
    },
    /// Fewer WQEs than the armed limit are posted on an SRQ (`MLX5_EVENT_TYPE_SRQ_RQ_LIMIT`, the SRQ number in
    /// `data.qp_srq.qp_srq_n` as `srq_event_notifier` reads it; verbs `IBV_EVENT_SRQ_LIMIT_REACHED`).
    SrqLimit {
        /// The SRQ (or RMP) number.
        srqn: u32,
    },
    /// A QP attached to an SRQ went to ERR and will take no more WQEs from it (`MLX5_EVENT_TYPE_SRQ_LAST_WQE`;
    /// verbs `IBV_EVENT_QP_LAST_WQE_REACHED`).
    SrqLastWqe {
        /// The QP number.
        qpn: u32,
    },
}

/// Which affiliated QP error an event reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum QpErrorKind {
    /// `MLX5_EVENT_TYPE_WQ_CATAS_ERROR`.
    Catastrophic,
    /// `MLX5_EVENT_TYPE_WQ_INVAL_REQ_ERROR`.
    InvalidRequest,
    /// `MLX5_EVENT_TYPE_WQ_ACCESS_ERROR`.
    AccessError,
}

/// Which affiliated QP event (not an error) an EQE reports; verbs' names in parentheses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum QpEventKind {
    /// `MLX5_EVENT_TYPE_PATH_MIG` (`IBV_EVENT_PATH_MIG`): the QP migrated to its alternate path.
    PathMigrated,
    /// `MLX5_EVENT_TYPE_COMM_EST` (`IBV_EVENT_COMM_EST`): a QP in RTR received its first packet.
    CommEst,
    /// `MLX5_EVENT_TYPE_SQ_DRAINED` (`IBV_EVENT_SQ_DRAINED`): a QP in SQD has no outstanding send WQE.
    SqDrained,
    /// `MLX5_EVENT_TYPE_PATH_MIG_FAILED` (`IBV_EVENT_PATH_MIG_ERR`): migrating to the alternate path failed.
    PathMigFailed,
}

impl QpEventKind {
    /// The event type that carries this event.
    pub const fn event_type(self) -> EventType {
        match self {
            QpEventKind::PathMigrated => EventType::PathMig,
            QpEventKind::CommEst => EventType::CommEst,
            QpEventKind::SqDrained => EventType::SqDrained,
            QpEventKind::PathMigFailed => EventType::PathMigFailed,
        }
    }
}

impl QpErrorKind {
    /// The event type that carries this error.
    pub const fn event_type(self) -> EventType {
        match self {
            QpErrorKind::Catastrophic => EventType::WqCatasError,
            QpErrorKind::InvalidRequest => EventType::WqInvalReqError,
            QpErrorKind::AccessError => EventType::WqAccessError,
        }
    }
}

impl Eqe {
    /// The event type byte.
    pub fn event_type(&self) -> EventType {
        EventType::from_raw(self.0[c::mlx5_eqe::TYPE.off])
    }

    /// The event sub-type byte.
    pub fn sub_type(&self) -> u8 {
        self.0[c::mlx5_eqe::SUB_TYPE.off]
    }

    /// The owner bit.
    pub fn owner(&self) -> u8 {
        self.0[c::mlx5_eqe::OWNER.off]
    }

    /// Decodes the payload for the event types the driver handles.
    pub fn event(&self) -> Event {
        let d = c::mlx5_eqe::DATA.off;
        let b = &self.0;
        match self.event_type() {
            EventType::Comp => Event::Completion { cqn: be(b, d, c::mlx5_eqe_comp::CQN) & 0x00ff_ffff },
            EventType::Cmd => Event::Command { vector: be(b, d, c::mlx5_eqe_cmd::VECTOR) },
            EventType::PageRequest => {
                let ec = be(b, d, c::mlx5_eqe_page_req::EC_FUNCTION);
                Event::PageRequest {
                    function_id: be(b, d, c::mlx5_eqe_page_req::FUNC_ID) as u16,
                    ec_function: ec & consts::EC_FUNCTION_MASK != 0,
                    num_pages: be(b, d, c::mlx5_eqe_page_req::NUM_PAGES) as i32,
                }
            }
            EventType::CqError => Event::CqError {
                cqn: be(b, d, c::mlx5_eqe_cq_err::CQN) & 0x00ff_ffff,
                syndrome: be(b, d, c::mlx5_eqe_cq_err::SYNDROME) as u8,
            },
            // The port number is the upper nibble of `data.port.port` (`mlx5_eq_async_int` / `port_change`).
            EventType::PortChange => Event::PortChange {
                port: (be(b, d, c::mlx5_eqe_port_state::PORT) >> 4) as u8 & 0xf,
                sub_type: self.sub_type(),
            },
            EventType::InternalError => Event::InternalError,
            t @ (EventType::WqCatasError | EventType::WqInvalReqError | EventType::WqAccessError) => {
                // Only QP events name a QP; RQ, SQ and DCT events name objects this driver never creates.
                if b[d + c::mlx5_eqe_qp_srq::TYPE.off] != consts::MLX5_EVENT_QUEUE_TYPE_QP {
                    return Event::Other { event_type: t.raw(), sub_type: self.sub_type() };
                }
                let kind = match t {
                    EventType::WqCatasError => QpErrorKind::Catastrophic,
                    EventType::WqInvalReqError => QpErrorKind::InvalidRequest,
                    _ => QpErrorKind::AccessError,
                };
                Event::QpError { qpn: be(b, d, c::mlx5_eqe_qp_srq::QP_SRQ_N) & 0x00ff_ffff, kind }
            }
            // The resource number and its queue type, as `rsc_event_notifier` reads them; only QPs are known here.
            t @ (EventType::PathMig | EventType::CommEst | EventType::SqDrained | EventType::PathMigFailed) => {
                if b[d + c::mlx5_eqe_qp_srq::TYPE.off] != consts::MLX5_EVENT_QUEUE_TYPE_QP {
                    return Event::Other { event_type: t.raw(), sub_type: self.sub_type() };
                }
                let kind = match t {
                    EventType::PathMig => QpEventKind::PathMigrated,
                    EventType::CommEst => QpEventKind::CommEst,
                    EventType::SqDrained => QpEventKind::SqDrained,
                    _ => QpEventKind::PathMigFailed,
                };
                Event::QpEvent { qpn: be(b, d, c::mlx5_eqe_qp_srq::QP_SRQ_N) & 0x00ff_ffff, kind }
            }
            EventType::SrqRqLimit => Event::SrqLimit { srqn: be(b, d, c::mlx5_eqe_qp_srq::QP_SRQ_N) & 0x00ff_ffff },
            // A QP event: the queue type must name a QP (`rsc_event_notifier` keys the resource by it).
            EventType::SrqLastWqe if b[d + c::mlx5_eqe_qp_srq::TYPE.off] == consts::MLX5_EVENT_QUEUE_TYPE_QP => {
                Event::SrqLastWqe { qpn: be(b, d, c::mlx5_eqe_qp_srq::QP_SRQ_N) & 0x00ff_ffff }
            }
            t => Event::Other { event_type: t.raw(), sub_type: self.sub_type() },
        }
    }

    /// Builds an EQE image for an event (the inverse of [`Eqe::event`], for tests). The owner byte is left 0. The
    /// simulator encodes its EQEs on its own, so this decoder is checked against an independent encoder.
    pub fn emit(event: &Event) -> Eqe {
        let mut e = [0u8; EQE_SIZE];
        let d = c::mlx5_eqe::DATA.off;
        let (ty, sub) = match *event {
            Event::Completion { cqn } => {
                put_be(&mut e, d, c::mlx5_eqe_comp::CQN, cqn & 0x00ff_ffff);
                (EventType::Comp.raw(), 0)
            }
            Event::Command { vector } => {
                put_be(&mut e, d, c::mlx5_eqe_cmd::VECTOR, vector);
                (EventType::Cmd.raw(), 0)
            }
            Event::PageRequest { function_id, ec_function, num_pages } => {
                put_be(&mut e, d, c::mlx5_eqe_page_req::FUNC_ID, function_id.into());
                put_be(
                    &mut e,
                    d,
                    c::mlx5_eqe_page_req::EC_FUNCTION,
                    if ec_function { consts::EC_FUNCTION_MASK } else { 0 },
                );
                put_be(&mut e, d, c::mlx5_eqe_page_req::NUM_PAGES, num_pages as u32);
                (EventType::PageRequest.raw(), 0)
            }
            Event::CqError { cqn, syndrome } => {
                put_be(&mut e, d, c::mlx5_eqe_cq_err::CQN, cqn & 0x00ff_ffff);
                put_be(&mut e, d, c::mlx5_eqe_cq_err::SYNDROME, syndrome.into());
                (EventType::CqError.raw(), 0)
            }
            Event::PortChange { port, sub_type } => {
                put_be(&mut e, d, c::mlx5_eqe_port_state::PORT, u32::from(port & 0xf) << 4);
                (EventType::PortChange.raw(), sub_type)
            }
            Event::InternalError => (EventType::InternalError.raw(), 0),
            Event::QpError { qpn, kind } => {
                e[d + c::mlx5_eqe_qp_srq::TYPE.off] = consts::MLX5_EVENT_QUEUE_TYPE_QP;
                put_be(&mut e, d, c::mlx5_eqe_qp_srq::QP_SRQ_N, qpn & 0x00ff_ffff);
                (kind.event_type().raw(), 0)
            }
            Event::QpEvent { qpn, kind } => {
                e[d + c::mlx5_eqe_qp_srq::TYPE.off] = consts::MLX5_EVENT_QUEUE_TYPE_QP;
                put_be(&mut e, d, c::mlx5_eqe_qp_srq::QP_SRQ_N, qpn & 0x00ff_ffff);
                (kind.event_type().raw(), 0)
            }
            Event::SrqLimit { srqn } => {
                put_be(&mut e, d, c::mlx5_eqe_qp_srq::QP_SRQ_N, srqn & 0x00ff_ffff);
                (EventType::SrqRqLimit.raw(), 0)
            }
            Event::SrqLastWqe { qpn } => {
                e[d + c::mlx5_eqe_qp_srq::TYPE.off] = consts::MLX5_EVENT_QUEUE_TYPE_QP;
                put_be(&mut e, d, c::mlx5_eqe_qp_srq::QP_SRQ_N, qpn & 0x00ff_ffff);
                (EventType::SrqLastWqe.raw(), 0)
            }
            Event::Other { event_type, sub_type } => {
                // A queue-error type decodes as `QpError` when the queue is a QP (type 0, what zeroed data
                // says); `Other` of such a type was another queue's, so the image names one (an RQ).
                let t = EventType::from_raw(event_type);
                if matches!(
                    t,
                    EventType::WqCatasError
                        | EventType::WqInvalReqError
                        | EventType::WqAccessError
                        | EventType::PathMig
                        | EventType::CommEst
                        | EventType::SqDrained
                        | EventType::PathMigFailed
                        | EventType::SrqLastWqe
                ) {
                    e[d + c::mlx5_eqe_qp_srq::TYPE.off] = consts::MLX5_EVENT_QUEUE_TYPE_RQ;
                }
                (event_type, sub_type)
            }
        };
        e[c::mlx5_eqe::TYPE.off] = ty;
        e[c::mlx5_eqe::SUB_TYPE.off] = sub;
        Eqe(e)
    }
}

/// The EQ doorbell value (`eq_update_ci`): consumer index (24 bits) and EQ number in the top byte.
pub const fn eq_doorbell_value(eqn: u8, cons_index: u32) -> u32 {
    (cons_index & 0x00ff_ffff) | ((eqn as u32) << 24)
}

/// `log_eq_size` for `nent` usable entries plus the spare ones (`order_base_2(nent + MLX5_NUM_SPARE_EQE)`).
pub fn log_eq_size(nent: u32) -> u8 {
    let n = nent.saturating_add(consts::MLX5_NUM_SPARE_EQE).max(1);
    (u32::BITS - (n - 1).leading_zeros()) as u8
}

/// The event types an event bitmask word covers: bit `n` of word 0 = type `n`, word `n / 64` for the rest.
pub fn event_bitmask(types: &[EventType]) -> [u64; 4] {
    let mut m = [0u64; 4];
    for t in types {
        let n = t.raw() as usize;
        m[n / 64] |= 1u64 << (n % 64);
    }
    m
}

/// The capabilities `gather_async_events_mask` (Linux `eq.c`) looks at, each adding one event type to the async
/// EQ's mask. Capabilities from blocks this driver does not query (PPS, MCAM tracer registers, MACsec, IPsec, the
/// eswitch and the `event_cap` user-event masks) are not represented: their events are never subscribed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AsyncEventCaps {
    /// `MLX5_VPORT_MANAGER`: `vport_group_manager`, an Ethernet port and a physical function.
    pub vport_manager: bool,
    /// Current `general_notification_event`.
    pub general_notification_event: bool,
    /// Current `port_module_event`.
    pub port_module_event: bool,
    /// Current `fpga`.
    pub fpga: bool,
    /// Maximum `dct` (`MLX5_CAP_GEN_MAX`).
    pub dct_max: bool,
    /// Current `temp_warn_event`.
    pub temp_warn_event: bool,
    /// Current `max_num_of_monitor_counters` is non-zero.
    pub monitor_counters: bool,
    /// Maximum `vhca_state` (`MLX5_CAP_GEN_MAX`).
    pub vhca_state_max: bool,
}

/// The async EQ's event mask as `gather_async_events_mask` builds it: `MLX5_ASYNC_EVENT_MASK` (path migration,
/// COMM_EST, SQ_DRAINED, CQ and WQ errors, port change, the SRQ events) plus one type per capability. Internal
/// errors are not in it: Linux learns of them from the health poll.
pub fn async_event_mask(caps: &AsyncEventCaps) -> [u64; 4] {
    let mut m = u64::from(consts::MLX5_ASYNC_EVENT_MASK);
    let mut add = |on: bool, t: u8| {
        if on {
            m |= 1u64 << t;
        }
    };
    add(caps.vport_manager, consts::MLX5_EVENT_TYPE_NIC_VPORT_CHANGE);
    add(caps.general_notification_event, consts::MLX5_EVENT_TYPE_GENERAL_EVENT);
    add(caps.port_module_event, consts::MLX5_EVENT_TYPE_PORT_MODULE_EVENT);
    add(caps.fpga, consts::MLX5_EVENT_TYPE_FPGA_ERROR);
    add(caps.fpga, consts::MLX5_EVENT_TYPE_FPGA_QP_ERROR);
    add(caps.dct_max, consts::MLX5_EVENT_TYPE_DCT_DRAINED);
    add(caps.temp_warn_event, consts::MLX5_EVENT_TYPE_TEMP_WARN_EVENT);
    add(caps.monitor_counters, consts::MLX5_EVENT_TYPE_MONITOR_COUNTER);
    add(caps.vhca_state_max, consts::MLX5_EVENT_TYPE_VHCA_STATE_CHANGE);
    [m, 0, 0, 0]
}

/// Why an EQ ring could not be used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum EqError {
    /// `log_eq_size` outside what one DMA buffer of 4 KiB pages can describe here.
    BadSize {
        /// The size asked for.
        log_eq_size: u8,
    },
}

/// The software side of an event queue: its buffer, consumer index and doorbell (Linux `struct mlx5_eq` with
/// `next_eqe_sw` / `eq_update_ci`).
///
/// Entries start with owner 1 (`MLX5_EQE_OWNER_INIT_VAL`); entry `ci & (nent - 1)` belongs to software when
/// `(owner ^ (ci >> log_nent)) & 1 == 0`, i.e. the device writes owner 0 on its first pass, 1 on the second.
#[derive(Debug)]
pub struct EqRing {
    buf: DmaRegion,
    log_nent: u8,
    cons_index: u32,
    eqn: u8,
    /// BAR offset of the EQ doorbell in the UAR page the EQ was created with.
    doorbell: usize,
    /// EQEs consumed since the consumer index was last published.
    unpublished: u32,
}

impl EqRing {
    /// Bytes of the ring buffer for `2^log_nent` entries.
    pub const fn buf_len(log_nent: u8) -> usize {
        EQE_SIZE << log_nent
    }

    /// Takes a zeroed buffer of [`EqRing::buf_len`] bytes and pre-sets every owner byte to 1, as `init_eq_buf`
    /// does, so no stale entry looks software-owned.
    pub fn init_buf(buf: &DmaRegion, log_nent: u8) -> Result<(), EqError> {
        if log_nent > 22 || buf.len() < Self::buf_len(log_nent) {
            return Err(EqError::BadSize { log_eq_size: log_nent });
        }
        for i in 0..(1usize << log_nent) {
            buf.write_volatile_u8(i * EQE_SIZE + c::mlx5_eqe::OWNER.off, consts::MLX5_EQE_OWNER_INIT_VAL);
        }
        Ok(())
    }

    /// A ring over an initialised buffer for EQ `eqn`, whose doorbell is in the UAR page at BAR offset `uar_off`.
    pub fn new(buf: DmaRegion, log_nent: u8, eqn: u8, uar_off: usize) -> Self {
        Self {
            buf,
            log_nent,
            cons_index: 0,
            eqn,
            doorbell: uar_off + consts::MLX5_EQ_DOORBELL_OFFSET as usize,
            unpublished: 0,
        }
    }

    /// The EQ number.
    pub fn eqn(&self) -> u8 {
        self.eqn
    }

    /// Entries in the ring.
    pub fn nent(&self) -> u32 {
        1 << self.log_nent
    }

    /// The consumer index (EQEs consumed so far).
    pub fn cons_index(&self) -> u32 {
        self.cons_index
    }

    /// Gives up the ring for its buffer (to free after DESTROY_EQ, or to keep while the device may write it).
    pub fn into_buf(self) -> DmaRegion {
        self.buf
    }

    /// Takes the next software-owned EQE, if any (`next_eqe_sw` then `dma_rmb`). Publishes the consumer index
    /// without arming every `MLX5_NUM_SPARE_EQE` entries so the device never runs out of room during a long drain.
    pub fn next<M: Mmio + ?Sized>(&mut self, mmio: &M) -> Option<Eqe> {
        let idx = (self.cons_index & (self.nent() - 1)) as usize;
        let base = idx * EQE_SIZE;
        let owner = self.buf.read_volatile_u8(base + c::mlx5_eqe::OWNER.off);
        if (u32::from(owner) ^ (self.cons_index >> self.log_nent)) & 1 != 0 {
            return None;
        }
        // The owner byte said the entry is ours; its other bytes must be read only after that load.
        mmio.dma_rmb();
        let mut e = [0u8; EQE_SIZE];
        for (i, b) in e.iter_mut().enumerate() {
            *b = self.buf.read_volatile_u8(base + i);
        }
        self.cons_index = self.cons_index.wrapping_add(1);
        self.unpublished += 1;
        if self.unpublished >= consts::MLX5_NUM_SPARE_EQE {
            self.update_ci(mmio, false);
        }
        Some(Eqe(e))
    }

    /// Publishes the consumer index (`eq_update_ci`), arming the EQ when `arm` (its next EQE raises the
    /// interrupt). This function owns the EQ doorbell sequence.
    pub fn update_ci<M: Mmio + ?Sized>(&mut self, mmio: &M, arm: bool) {
        // Every EQE load must be complete before the store that hands those entries back to the device.
        mmio.mb();
        let off = if arm { self.doorbell } else { self.doorbell + 2 * 4 };
        mmio.write32(off, eq_doorbell_value(self.eqn, self.cons_index));
        self.unpublished = 0;
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn every_event_kind_survives_emit_and_decode() {
        let events = [
            Event::Completion { cqn: 0x12_3456 },
            Event::Command { vector: 0x8000_0001 },
            Event::PageRequest { function_id: 7, ec_function: false, num_pages: 300 },
            Event::PageRequest { function_id: 0, ec_function: false, num_pages: -12 },
            Event::CqError { cqn: 0x99, syndrome: consts::MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN },
            Event::PortChange { port: 1, sub_type: consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE },
            Event::InternalError,
            Event::QpError { qpn: 0xab_cdef, kind: QpErrorKind::Catastrophic },
            Event::QpError { qpn: 1, kind: QpErrorKind::InvalidRequest },
            Event::QpError { qpn: 2, kind: QpErrorKind::AccessError },
            Event::QpEvent { qpn: 3, kind: QpEventKind::PathMigrated },
            Event::QpEvent { qpn: 0xff_fffe, kind: QpEventKind::CommEst },
            Event::QpEvent { qpn: 5, kind: QpEventKind::SqDrained },
            Event::QpEvent { qpn: 6, kind: QpEventKind::PathMigFailed },
            Event::Other { event_type: EventType::CommEst.raw(), sub_type: 0 },
            Event::SrqLimit { srqn: 0x12_3456 },
            Event::SrqLastWqe { qpn: 0xab_cdef },
            Event::Other { event_type: EventType::SrqLastWqe.raw(), sub_type: 0 },
        ];
        for e in events {
            assert_eq!(Eqe::emit(&e).event(), e);
        }
    }

    #[test]
    fn eqe_type_byte_names_the_event() {
        let eqe = Eqe::emit(&Event::PortChange { port: 1, sub_type: consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN });
        assert_eq!(eqe.event_type(), EventType::PortChange);
        assert_eq!(eqe.0[c::mlx5_eqe::TYPE.off], EventType::PortChange.raw());
        assert_eq!(eqe.sub_type(), consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN);
    }

    #[test]
    fn an_unknown_event_type_stays_raw() {
        let mut e = [0u8; EQE_SIZE];
        e[c::mlx5_eqe::TYPE.off] = 0xfe;
        e[c::mlx5_eqe::SUB_TYPE.off] = 3;
        assert_eq!(Eqe(e).event(), Event::Other { event_type: 0xfe, sub_type: 3 });
    }

    #[test]
    fn eq_doorbell_puts_the_eqn_in_the_top_byte_and_wraps_the_index() {
        assert_eq!(eq_doorbell_value(0x12, 5), 0x1200_0005);
        assert_eq!(eq_doorbell_value(0xff, 0x0100_0001), 0xff00_0001);
    }

    #[test]
    fn log_eq_size_adds_the_spare_entries_and_rounds_up() {
        let spare = consts::MLX5_NUM_SPARE_EQE;
        assert_eq!(1u32 << log_eq_size(256), (256 + spare).next_power_of_two());
        assert_eq!(1u32 << log_eq_size(0), spare.next_power_of_two());
        // Exactly a power of two stays; one more doubles.
        let p = 1024 - spare;
        assert_eq!(log_eq_size(p), 10);
        assert_eq!(log_eq_size(p + 1), 11);
    }

    #[test]
    fn event_bitmask_sets_one_bit_per_type_in_its_word() {
        let m = event_bitmask(&[EventType::Comp, EventType::PageRequest, EventType::Cmd]);
        let bit = |t: EventType| (m[t.raw() as usize / 64] >> (t.raw() % 64)) & 1;
        assert_eq!((bit(EventType::Comp), bit(EventType::PageRequest), bit(EventType::Cmd)), (1, 1, 1));
        assert_eq!(m.iter().map(|w| w.count_ones()).sum::<u32>(), 3);
        assert_eq!(event_bitmask(&[]), [0; 4]);
    }

    #[test]
    fn async_mask_is_linux_base_mask_plus_one_type_per_capability() {
        let bit = |m: [u64; 4], t: EventType| m[0] >> t.raw() & 1 == 1;
        let base = async_event_mask(&AsyncEventCaps::default());
        for t in [
            EventType::PathMig,
            EventType::CommEst,
            EventType::SqDrained,
            EventType::CqError,
            EventType::WqCatasError,
            EventType::PathMigFailed,
            EventType::WqInvalReqError,
            EventType::WqAccessError,
            EventType::PortChange,
            EventType::SrqCatasError,
            EventType::SrqLastWqe,
            EventType::SrqRqLimit,
        ] {
            assert!(bit(base, t), "{t:?} is in MLX5_ASYNC_EVENT_MASK");
        }
        // Completions, commands, pages and internal errors have EQs (or the health poll) of their own.
        for t in [EventType::Comp, EventType::Cmd, EventType::PageRequest, EventType::InternalError] {
            assert!(!bit(base, t), "{t:?} is not an async event");
        }
        assert_eq!(base[0].count_ones(), 12);
        let dct = async_event_mask(&AsyncEventCaps { dct_max: true, ..AsyncEventCaps::default() });
        assert_eq!(dct[0] & !base[0], 1 << consts::MLX5_EVENT_TYPE_DCT_DRAINED);
        let fpga = async_event_mask(&AsyncEventCaps { fpga: true, ..AsyncEventCaps::default() });
        assert_eq!((fpga[0] & !base[0]).count_ones(), 2);
    }
}
