//! `mlx5-core` reused on bare metal: the three traits the core needs, implemented for a Cortex-M class
//! microcontroller with a PCIe root complex, and [`run`], the driver's whole life on one device, generic over
//! those traits: bring-up, PD, a registered buffer, two CQs and two RC QPs connected to each other on the port's
//! loopback (RESET → INIT → RTR → RTS), two SENDs and an RDMA WRITE between them, every completion and every byte
//! checked, then everything destroyed and the HCA torn down with every firmware page returned.
//!
//! * [`mmio::Bar`]: `Mmio` over BAR 0 at a fixed CPU address (raw-pointer volatile, big endian, the 64-bit doorbell
//!   on a 32-bit core explained where it is written);
//! * [`arena::Arena`]: `Dma` from a static arena (bump pointer and a `heapless` free list; iova = CPU address);
//! * [`delay::CycleDelay`]: `DelayNs` from the DWT cycle counter.
//!
//! The binary (`src/main.rs`) wires them to fixed addresses for `thumbv7em-none-eabihf`; nothing board-specific is
//! in this library. On the host the same [`run`] runs against `mlx5_sim::SimDevice` (`tests/sim.rs`), which is the
//! proof that the firmware's code path is the real driver's. [`run_with`] without traffic sends commands only, for
//! a command-level expectation mock (`mlx5_core::mock`), which writes no completions.

#![cfg_attr(not(test), no_std)]

pub mod arena;
pub mod delay;
pub mod mmio;
pub mod peer;

pub use peer::{run_peer, PeerInfo, PeerInfoError, PeerReport, Rendezvous};

use mlx5_core::cq::{Cq, CqeError, LinkLayer, WcOpcode, WcStatus, WorkCompletion};
use mlx5_core::hal::{DelayNs, Dma, DmaError, DmaRegion, Mmio};
use mlx5_core::hca::{BringupError, Config, Error, Fixed, Hca};
use mlx5_core::hca::{CqAttr, Pd, QpInitAttr};
use mlx5_core::mkey::{Access, Mr};
use mlx5_core::qp::{
    AhAttr, Grh, Mtu, PostError, Qp, QpAttr, QpAttrMask, QpCap, QpState, QpType, RecvWr, SendFlags, SendOp, SendWr, Sge,
};
use mlx5_core::trace::CmdTrace;
use mlx5_core::vport::RoceVersion;

/// Firmware-page chunks the HCA may hold (64 pages of 4 KiB each; see `mlx5_core::pages::CHUNK_PAGES`). Sized for
/// the arena, not for a ConnectX's appetite: a real adapter's QUERY_PAGES answer decides what a product needs.
pub const FW_PAGE_CHUNKS: usize = 4;
/// CQs the HCA tracks completion events for.
pub const MAX_CQS: usize = 4;

/// The HCA as this firmware instantiates it: small fixed tables instead of the host's defaults.
pub type FwHca<M, D, T> = Hca<M, D, T, Fixed<FW_PAGE_CHUNKS, MAX_CQS>>;

/// How the firmware brings the function up: Linux's sequence, with event queues sized for a microcontroller.
pub fn config() -> Config {
    Config {
        driver_version: concat!("mlx5-firmware-example,", env!("CARGO_PKG_VERSION")),
        // 64 usable entries each (+ MLX5_NUM_SPARE_EQE, rounded up to a power of two): 12 KiB per EQ instead of
        // the host's 1 MiB-class completion EQ.
        async_eq_nent: 64,
        comp_eq_nent: 64,
        ..Config::default()
    }
}

/// Bytes of the one registered buffer: the sources of the transfers in its first half, their targets in the
/// second.
pub const BUF_BYTES: usize = 16 * 1024;

/// What a transfer is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A SEND from QP A into a receive posted on QP B.
    Send,
    /// An RDMA WRITE from QP A to the target address through the buffer's rkey (no receive consumed).
    RdmaWrite,
}

/// One transfer from QP A to QP B: `len` bytes from offset `src` of the buffer to offset `dst`, into a target area
/// of `room` bytes (the receive buffer's length for a SEND). The bytes of the area past `len` must stay zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transfer {
    pub op: Op,
    pub src: usize,
    pub len: u32,
    pub dst: usize,
    pub room: usize,
}

/// The transfers, posted in this order on QP A (one doorbell): a short SEND, a SEND longer than a 1024-byte path
/// MTU (two packets), and a page-sized RDMA WRITE (four packets at 1024).
pub const TRANSFERS: [Transfer; 3] = [
    Transfer { op: Op::Send, src: 0, len: 256, dst: 0x2000, room: 0x800 },
    Transfer { op: Op::Send, src: 0x400, len: 2000, dst: 0x2800, room: 0x800 },
    Transfer { op: Op::RdmaWrite, src: 0x1000, len: 4096, dst: 0x3000, room: 0x1000 },
];
/// SENDs among [`TRANSFERS`]: the receives QP B posts.
pub const RECVS: usize = 2;
/// Completions the run expects: one per transfer on QP A's CQ, one per SEND on QP B's.
pub const COMPLETIONS: usize = TRANSFERS.len() + RECVS;
/// `wr_id` of transfer `i` is `SEND_WR_ID + i`; of the receive for the `k`th SEND, `RECV_WR_ID + k`.
pub const SEND_WR_ID: u64 = 0x5e00;
/// See [`SEND_WR_ID`].
pub const RECV_WR_ID: u64 = 0x4e00;

/// Byte `i` of the buffer's source half: no period shorter than 251 bytes, so a misplaced or repeated packet shows.
pub const fn pattern(i: usize) -> u8 {
    ((i % 251) as u8) ^ ((i >> 8) as u8).wrapping_mul(0x1d) ^ 0x5a
}

/// FNV-1a (32-bit): how [`Report::digests`] condenses a target area.
pub fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// What [`run_with`] does beyond the commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Options {
    /// Post the transfers and check their completions and data. Without traffic the run connects the QPs to RTS
    /// and tears down: commands only, for a mock that answers commands and writes no completions.
    pub traffic: bool,
    /// How long to wait for the completions, in microseconds of the caller's `DelayNs` (polled every
    /// [`POLL_INTERVAL_US`]).
    pub completion_timeout_us: u32,
}

impl Default for Options {
    /// Traffic on, one second for the completions (a loopback completes in microseconds).
    fn default() -> Self {
        Self { traffic: true, completion_timeout_us: 1_000_000 }
    }
}

/// The pause between two empty polls of the CQs.
pub const POLL_INTERVAL_US: u32 = 10;

/// What [`run`] saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Report {
    pub fw_rev: (u16, u16, u16),
    pub link_layer: LinkLayer,
    pub pdn: u32,
    /// The memory key's lkey and rkey.
    pub keys: (u32, u32),
    /// CQs of QP A and QP B.
    pub cqns: [u32; 2],
    /// QP A (the requester) and QP B (the responder).
    pub qpns: [u32; 2],
    /// QP A's state as QUERY_QP reported it after RESET → INIT → RTR → RTS.
    pub qp_state: QpState,
    /// QP A's three send completions in posting order, then QP B's two receive completions (all default
    /// without traffic).
    pub completions: [WorkCompletion; COMPLETIONS],
    /// [`fnv1a`] of each transfer's whole target area (`room` bytes) after the completions (0 without traffic).
    pub digests: [u32; TRANSFERS.len()],
    /// Microseconds spent waiting for the completions (in empty-poll intervals).
    pub waited_us: u32,
    pub pages_reclaimed: usize,
}

/// Where [`run`] failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunError {
    BringUp(BringupError),
    /// A verbs step (`what`) failed; everything created before it was destroyed and the HCA torn down.
    Step {
        what: &'static str,
        error: Error,
    },
    /// The data buffer could not be allocated.
    Buffer(DmaError),
    /// The port is not active (`IB_PORT_*` state), so nothing would arrive.
    PortDown {
        state: u8,
    },
    /// The RoCE GID table holds no entry to address the loopback with.
    NoGid,
    /// A post was refused (`what`: the queue).
    Post {
        what: &'static str,
        error: PostError,
    },
    /// Polling a CQ met a CQE the driver refuses (a device fault).
    Poll(CqeError),
    /// Fewer completions than expected arrived within the timeout on the CQ of QP A (`qp` 0) or QP B (1).
    Timeout {
        qp: usize,
        got: usize,
        want: usize,
    },
    /// Completion `index` of [`Report::completions`]'s order is not the one expected (in [`run_peer`]'s rounds: 0
    /// the RDMA WRITE, 1 the SEND, 2 the receive).
    Completion {
        index: usize,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u32,
    },
    /// Byte `offset` of transfer `transfer`'s target area is not what was sent (or, past the transfer's length,
    /// not zero). In [`run_peer`]'s rounds transfer 0 is the other side's SEND, 1 its RDMA WRITE.
    Data {
        transfer: usize,
        offset: usize,
        expected: u8,
        got: u8,
    },
    /// The other side's connection facts could not be had ([`Rendezvous::peer`]).
    NoPeer,
    /// No completion arrived within the timeout in round `round` of [`run_peer`]'s exchange.
    PeerTimeout {
        round: u32,
    },
    /// Teardown reported an error (its report still returned every page it could).
    Teardown(Error),
    /// Teardown freed pages firmware never returned.
    PagesKept {
        pages: usize,
    },
}

impl core::fmt::Display for RunError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            RunError::BringUp(e) => write!(f, "{e}"),
            RunError::Step { what, error } => write!(f, "{what} failed: {error}"),
            RunError::Buffer(e) => write!(f, "data buffer: {e}"),
            RunError::PortDown { state } => write!(f, "port 1 is not active (state {state})"),
            RunError::NoGid => write!(f, "the RoCE GID table is empty"),
            RunError::Post { what, error } => write!(f, "posting to the {what} failed: {error}"),
            RunError::Poll(e) => write!(f, "polling failed: {e}"),
            RunError::Timeout { qp, got, want } => {
                write!(f, "QP {}'s CQ: {got} of {want} completions in time", ["A", "B"][*qp])
            }
            RunError::Completion { index, wr_id, status, opcode, byte_len } => {
                write!(f, "completion {index} unexpected: wr_id {wr_id:#x}, {status}, {opcode:?}, {byte_len} bytes")
            }
            RunError::Data { transfer, offset, expected, got } => {
                write!(f, "transfer {transfer}: byte {offset} of the target is {got:#04x}, expected {expected:#04x}")
            }
            RunError::NoPeer => write!(f, "no connection facts from the other side"),
            RunError::PeerTimeout { round } => write!(f, "round {round}: no completion in time"),
            RunError::Teardown(e) => write!(f, "teardown failed: {e}"),
            RunError::PagesKept { pages } => write!(f, "teardown freed {pages} pages firmware did not return"),
        }
    }
}

fn step(what: &'static str) -> impl FnOnce(Error) -> RunError {
    move |error| RunError::Step { what, error }
}

/// [`run_with`] with the default [`Options`]: traffic on.
pub fn run<M: Mmio, D: Dma, T: CmdTrace>(
    mmio: M,
    dma: D,
    trace: T,
    delay: &mut impl DelayNs,
) -> Result<Report, RunError> {
    run_with(mmio, dma, trace, delay, Options::default())
}

/// Brings the HCA up (Linux's order: `Hca::bring_up`), allocates a PD and a [`BUF_BYTES`] buffer from `dma`,
/// registers it, creates a CQ and an RC QP on it for each side, connects the two QPs to each other, posts
/// [`TRANSFERS`] (receives first), polls [`COMPLETIONS`] completions, checks each and every byte of the targets,
/// then destroys everything in reverse and tears the HCA down. Whatever fails, what was created is destroyed and
/// the HCA torn down before the first error is returned.
pub fn run_with<M: Mmio, D: Dma, T: CmdTrace>(
    mmio: M,
    dma: D,
    trace: T,
    delay: &mut impl DelayNs,
    opts: Options,
) -> Result<Report, RunError> {
    let mut hca: FwHca<M, D, T> = Hca::bring_up(mmio, dma, trace, delay, config()).map_err(RunError::BringUp)?;
    let mut objs = Objects::default();
    let mut report = Report {
        fw_rev: hca.fw_rev(),
        link_layer: LinkLayer::default(),
        pdn: 0,
        keys: (0, 0),
        cqns: [0; 2],
        qpns: [0; 2],
        qp_state: QpState::Reset,
        completions: [WorkCompletion::default(); COMPLETIONS],
        digests: [0; TRANSFERS.len()],
        waited_us: 0,
        pages_reclaimed: 0,
    };
    let ran = with_objects(&mut hca, &mut objs, &mut report, opts, delay);
    let released = objs.release(&mut hca, delay);
    let down = hca.teardown(delay);
    ran?;
    released?;
    let down = down.map_err(RunError::Teardown)?;
    if down.pages_abandoned != 0 {
        return Err(RunError::PagesKept { pages: down.pages_abandoned });
    }
    report.pages_reclaimed = down.pages_reclaimed;
    Ok(report)
}

/// What the run created, each destroyed by [`Objects::release`] whatever happened after it was made.
#[derive(Default)]
struct Objects {
    pd: Option<Pd>,
    buf: Option<DmaRegion>,
    mr: Option<Mr>,
    cq_a: Option<Cq>,
    cq_b: Option<Cq>,
    qp_a: Option<Qp>,
    qp_b: Option<Qp>,
}

impl Objects {
    /// Destroys in reverse order of creation; returns the first failure. An object firmware did not confirm
    /// destroyed is kept by the device, so its memory is leaked rather than freed (and the buffer is freed only
    /// once the key over it is gone).
    fn release<M: Mmio, D: Dma, T: CmdTrace>(
        self,
        hca: &mut FwHca<M, D, T>,
        delay: &mut impl DelayNs,
    ) -> Result<(), RunError> {
        let mut first = None;
        let mut note = |what: &'static str, r: Result<(), Error>| {
            if let Err(error) = r {
                first.get_or_insert(RunError::Step { what, error });
            }
        };
        for qp in [self.qp_b, self.qp_a].into_iter().flatten() {
            note("DESTROY_QP", hca.destroy_qp(qp, delay).map_err(|e| e.error));
        }
        for cq in [self.cq_b, self.cq_a].into_iter().flatten() {
            note("DESTROY_CQ", hca.destroy_cq(cq, delay).map_err(|e| e.error));
        }
        let unreachable = match self.mr {
            Some(mr) => hca.dereg_mr(mr, delay).map_err(|e| e.error),
            None => Ok(()),
        };
        let key_gone = unreachable.is_ok();
        note("DESTROY_MKEY", unreachable);
        if let (Some(buf), true) = (self.buf, key_gone) {
            // SAFETY: the buffer came from this HCA's allocator and is freed once; the only key the device could
            // reach it through is destroyed (or was never made), and the QPs that used that key are gone.
            unsafe { hca.cmdq().dma().free(buf) };
        }
        if let Some(pd) = self.pd {
            note("DEALLOC_PD", hca.dealloc_pd(pd, delay).map_err(|e| e.error));
        }
        first.map_or(Ok(()), Err)
    }
}

/// Creates the objects into `objs` (so they are released whatever follows), connects the QPs and, with
/// `opts.traffic`, runs and checks the transfers; fills `report` as it goes.
fn with_objects<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    objs: &mut Objects,
    report: &mut Report,
    opts: Options,
    delay: &mut impl DelayNs,
) -> Result<(), RunError> {
    let pd = &*objs.pd.insert(hca.alloc_pd(delay).map_err(step("ALLOC_PD"))?);
    report.pdn = pd.pdn();
    let buf = &*objs.buf.insert(hca.cmdq().dma().alloc(BUF_BYTES, 4096).map_err(RunError::Buffer)?);
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let mr =
        &*objs.mr.insert(hca.reg_mr(pd, buf.cpu().as_ptr(), BUF_BYTES, access, delay).map_err(step("CREATE_MKEY"))?);
    report.keys = (mr.lkey, mr.rkey);
    let cq_attr = CqAttr { cqe: 15, ..CqAttr::default() };
    let cq_a = objs.cq_a.insert(hca.create_cq(cq_attr, delay).map_err(step("CREATE_CQ"))?);
    let cq_b = objs.cq_b.insert(hca.create_cq(cq_attr, delay).map_err(step("CREATE_CQ"))?);
    report.cqns = [cq_a.cqn(), cq_b.cqn()];
    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 0 };
    let attr = QpInitAttr { qp_type: QpType::Rc, cap, sq_sig_all: false };
    let qp_a = objs.qp_a.insert(hca.create_qp(pd, cq_a, cq_a, attr, delay).map_err(step("CREATE_QP"))?);
    let qp_b = objs.qp_b.insert(hca.create_qp(pd, cq_b, cq_b, attr, delay).map_err(step("CREATE_QP"))?);
    report.qpns = [qp_a.qpn(), qp_b.qpn()];

    let port = hca.query_port(delay).map_err(step("query port"))?;
    report.link_layer = port.link_layer;
    if opts.traffic && port.state != IB_PORT_ACTIVE {
        return Err(RunError::PortDown { state: port.state });
    }
    // Both QPs live on this port, so each one's remote address is the port's own.
    let ah = loopback_address(hca, port.link_layer, port.lid, delay)?;
    let path_mtu = mtu_of(port.active_mtu);
    let (qa, qb) = (qp_a.qpn(), qp_b.qpn());
    connect(hca, qp_a, qb, ah, path_mtu, delay)?;
    connect(hca, qp_b, qa, ah, path_mtu, delay)?;
    report.qp_state = hca.query_qp(qp_a, delay).map_err(step("QUERY_QP"))?.state;
    if !opts.traffic {
        return Ok(());
    }

    transfer(hca, buf, mr, [cq_a, cq_b], [qp_a, qp_b], report, opts, delay)?;
    check_data(buf, report)
}

/// `IB_PORT_ACTIVE`.
const IB_PORT_ACTIVE: u8 = 4;

/// The path MTU of the port's active MTU (`ib_mtu`), 1024 bytes when the port names none.
fn mtu_of(active: u8) -> Mtu {
    match active {
        1 => Mtu::M256,
        2 => Mtu::M512,
        4 => Mtu::M2048,
        5 => Mtu::M4096,
        _ => Mtu::M1024,
    }
}

/// The address of this port as a peer sees it. InfiniBand: its LID, no GRH (the same subnet). RoCE: a GRH to the
/// port's own GID and the port's MAC as the next hop (the MAC of the GID entry), on the first RoCE v2 entry of the
/// table (Linux's order puts the link-local v2 GID at index 1), else on entry 0.
fn loopback_address<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    link: LinkLayer,
    lid: u16,
    delay: &mut impl DelayNs,
) -> Result<AhAttr, RunError> {
    if link == LinkLayer::InfiniBand {
        return Ok(AhAttr { dlid: lid, port_num: 1, ..AhAttr::default() });
    }
    let mut chosen = None;
    for index in 0..2u8 {
        let entry = hca.query_roce_gid(index.into(), delay).map_err(step("QUERY_ROCE_ADDRESS"))?;
        if let Some(e) = entry {
            if chosen.is_none() || e.version == RoceVersion::V2 {
                chosen = Some((index, e));
            }
            if e.version == RoceVersion::V2 {
                break;
            }
        }
    }
    let (sgid_index, e) = chosen.ok_or(RunError::NoGid)?;
    let grh = Grh { dgid: e.gid, sgid_index, hop_limit: 64, ..Grh::default() };
    Ok(AhAttr { grh: Some(grh), dmac: e.mac, port_num: 1, ..AhAttr::default() })
}

/// RESET → INIT → RTR → RTS towards QP `dest` at `ah`, with rdma-core's `ibv_rc_pingpong` values (timeout 14,
/// 7 retries, RNR retry 7, RNR timer 12, PSNs 0, one RDMA READ/atomic in flight) and remote write allowed.
fn connect<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    qp: &mut Qp,
    dest: u32,
    ah: AhAttr,
    path_mtu: Mtu,
    delay: &mut impl DelayNs,
) -> Result<(), RunError> {
    use QpAttrMask as K;
    let a = QpAttr {
        qp_access_flags: Access::REMOTE_WRITE,
        pkey_index: 0,
        port_num: 1,
        ah_attr: ah,
        path_mtu,
        dest_qp_num: dest,
        rq_psn: 0,
        sq_psn: 0,
        max_dest_rd_atomic: 1,
        max_rd_atomic: 1,
        min_rnr_timer: 12,
        timeout: 14,
        retry_cnt: 7,
        rnr_retry: 7,
        ..QpAttr::default()
    };
    let steps = [
        (QpState::Init, K::STATE | K::PKEY_INDEX | K::PORT | K::ACCESS_FLAGS, "RST2INIT_QP"),
        (
            QpState::Rtr,
            K::STATE | K::AV | K::PATH_MTU | K::DEST_QPN | K::RQ_PSN | K::MAX_DEST_RD_ATOMIC | K::MIN_RNR_TIMER,
            "INIT2RTR_QP",
        ),
        (
            QpState::Rts,
            K::STATE | K::TIMEOUT | K::RETRY_CNT | K::RNR_RETRY | K::SQ_PSN | K::MAX_QP_RD_ATOMIC,
            "RTR2RTS_QP",
        ),
    ];
    for (qp_state, mask, what) in steps {
        hca.modify_qp(qp, &QpAttr { qp_state, ..a }, mask, delay).map_err(step(what))?;
    }
    Ok(())
}

/// The transfers: the source half filled with [`pattern`], QP B's receives posted, QP A's work requests posted
/// in one call (one doorbell), then both CQs polled until every completion arrived; each is checked.
#[allow(clippy::too_many_arguments)]
fn transfer<M: Mmio, D: Dma, T: CmdTrace>(
    hca: &mut FwHca<M, D, T>,
    buf: &DmaRegion,
    mr: &Mr,
    cqs: [&mut Cq; 2],
    qps: [&mut Qp; 2],
    report: &mut Report,
    opts: Options,
    delay: &mut impl DelayNs,
) -> Result<(), RunError> {
    let half = BUF_BYTES / 2;
    let src = buf.ptr_at(0, half);
    for i in 0..half {
        // SAFETY: `src` covers the first half of the live buffer (ptr_at checked it); no work request uses it yet.
        unsafe { src.add(i).write(pattern(i)) };
    }
    let addr = |off: usize| buf.cpu().as_ptr() as u64 + off as u64;
    let sge = |off: usize, length: u32| Sge { addr: addr(off), length, lkey: mr.lkey };
    let [cq_a, cq_b] = cqs;
    let [qp_a, qp_b] = qps;

    let mut rsge = [Sge::default(); RECVS];
    let mut sends = TRANSFERS.iter().filter(|t| t.op == Op::Send);
    for s in rsge.iter_mut() {
        if let Some(t) = sends.next() {
            *s = sge(t.dst, t.room as u32);
        }
    }
    let recvs: [RecvWr<'_>; RECVS] =
        core::array::from_fn(|k| RecvWr { wr_id: RECV_WR_ID + k as u64, sg_list: core::slice::from_ref(&rsge[k]) });
    hca.post_recv(qp_b, &recvs).map_err(|error| RunError::Post { what: "receive queue of QP B", error })?;

    let ssge: [Sge; TRANSFERS.len()] = core::array::from_fn(|i| sge(TRANSFERS[i].src, TRANSFERS[i].len));
    let wrs: [SendWr<'_>; TRANSFERS.len()] = core::array::from_fn(|i| {
        let t = TRANSFERS[i];
        SendWr {
            wr_id: SEND_WR_ID + i as u64,
            op: match t.op {
                Op::Send => SendOp::Send,
                Op::RdmaWrite => SendOp::RdmaWrite { remote_addr: addr(t.dst), rkey: mr.rkey },
            },
            sg_list: core::slice::from_ref(&ssge[i]),
            flags: SendFlags::SIGNALED,
            inline: None,
            ud: None,
        }
    });
    hca.post_send(qp_a, &wrs).map_err(|error| RunError::Post { what: "send queue of QP A", error })?;

    // Poll both CQs until each has its count, checking every completion as it comes: a failed one ends the wait
    // (its QP is in error, the rest would only be flushed). Each poll asks for no more than is still missing.
    let [qa, qb] = report.qpns;
    let (sent, received) = report.completions.split_at_mut(TRANSFERS.len());
    let (mut got_a, mut got_b) = (0, 0);
    let mut waited: u32 = 0;
    while got_a < sent.len() || got_b < received.len() {
        let a = hca.poll_cq(cq_a, qp_a, &mut sent[got_a..]).map_err(RunError::Poll)?;
        for (i, w) in sent.iter().enumerate().skip(got_a).take(a) {
            check_completion(i, w, qa, qb)?;
        }
        let b = hca.poll_cq(cq_b, qp_b, &mut received[got_b..]).map_err(RunError::Poll)?;
        for (k, w) in received.iter().enumerate().skip(got_b).take(b) {
            check_completion(TRANSFERS.len() + k, w, qa, qb)?;
        }
        got_a += a;
        got_b += b;
        if a + b == 0 {
            if waited >= opts.completion_timeout_us {
                let (qp, got, want) =
                    if got_a < sent.len() { (0, got_a, sent.len()) } else { (1, got_b, received.len()) };
                return Err(RunError::Timeout { qp, got, want });
            }
            delay.delay_us(POLL_INTERVAL_US);
            waited = waited.saturating_add(POLL_INTERVAL_US);
            // The core polls health from its own command waits only; a datapath loop ticks it on its own clock
            // (a compare until 2 s, Linux's interval, have passed), so a wait longer than that notices a dead
            // device and ends with flushed completions instead of the timeout.
            hca.health_tick(u64::from(waited / 1000)).map_err(step("health poll"))?;
        }
    }
    report.waited_us = waited;
    Ok(())
}

/// Completion `index` of [`Report::completions`] as expected: QP A's in posting order (SEND, SEND, RDMA WRITE),
/// then QP B's receives in posting order with the SENDs' lengths and A as their source; all successful, each
/// naming its own QP.
fn check_completion(index: usize, w: &WorkCompletion, qa: u32, qb: u32) -> Result<(), RunError> {
    let ok = match TRANSFERS.get(index) {
        Some(t) => {
            let opcode = match t.op {
                Op::Send => WcOpcode::Send,
                Op::RdmaWrite => WcOpcode::RdmaWrite,
            };
            w.wr_id == SEND_WR_ID + index as u64 && w.opcode == opcode && w.qp_num == qa
        }
        None => {
            let k = index - TRANSFERS.len();
            let sent = TRANSFERS.iter().filter(|t| t.op == Op::Send).nth(k);
            sent.is_some_and(|t| {
                w.wr_id == RECV_WR_ID + k as u64
                    && w.opcode == WcOpcode::Recv
                    && w.byte_len == t.len
                    && w.qp_num == qb
                    && w.src_qp == qa
            })
        }
    };
    if ok && w.status == WcStatus::Success {
        return Ok(());
    }
    Err(RunError::Completion { index, wr_id: w.wr_id, status: w.status, opcode: w.opcode, byte_len: w.byte_len })
}

/// Every target area holds exactly what was sent and nothing past it: the first `len` bytes are the source's, the
/// rest of the area still zero (the allocator zeroes the buffer). Records each area's digest.
fn check_data(buf: &DmaRegion, report: &mut Report) -> Result<(), RunError> {
    for (transfer, t) in TRANSFERS.iter().enumerate() {
        let p = buf.ptr_at(t.dst, t.room);
        // SAFETY: the area lies inside the live buffer (ptr_at checked it), and every work request that wrote it has
        // completed: the device no longer writes it, and the core's poll ordered the CQE read before these loads.
        let area = unsafe { core::slice::from_raw_parts(p, t.room) };
        for (offset, &got) in area.iter().enumerate() {
            let expected = if offset < t.len as usize { pattern(t.src + offset) } else { 0 };
            if got != expected {
                return Err(RunError::Data { transfer, offset, expected, got });
            }
        }
        report.digests[transfer] = fnv1a(area);
    }
    Ok(())
}
