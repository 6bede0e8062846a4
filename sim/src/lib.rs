//! A simulated ConnectX (mlx5) HCA for testing `mlx5-core` without hardware.
//!
//! # Handles
//! A [`SimDevice`] is a cheap, clonable handle to one device (`Arc` + `Mutex` inside). The driver talks to it
//! through three handles that implement the `mlx5-core` HAL: [`SimMmio`] (the BAR: initialization segment plus
//! UAR pages), [`SimDma`] (device-visible memory) and [`SimDelay`] (time). Tests use the device handle to
//! configure it ([`SimConfig`]), inject faults ([`Fault`]) and observe it ([`SimDevice::executed`],
//! [`SimDevice::events`], [`SimDevice::dma_faults`], [`SimDevice::eq_info`], [`SimDevice::health`], ...).
//!
//! # Inline and threaded modes
//! In [`Mode::Inline`] (the default) a write to `cmd_dbell` executes the rung commands synchronously inside
//! `write32`, so a test is deterministic and single threaded. In [`Mode::Threaded`] a worker thread takes the
//! doorbells as posted writes, in order (it is woken only when parked), and completes the commands
//! asynchronously, as real firmware does; it exercises the driver's polling and ordering.
//!
//! # Virtual time
//! In inline mode nothing really sleeps: [`SimDelay`] advances a virtual clock and runs device work that became
//! due (commands delayed by [`Fault::Delay`]). The clock also drives `initializing` ([`SimConfig::init_delay_ms`]),
//! the health counter and the internal timer. In threaded mode `SimDelay` really sleeps and the clock is wall time.
//!
//! # DMA and its faults
//! [`SimDma`] hands out zeroed host memory behind fresh IOVAs that are never reused, each followed by an unmapped
//! guard page. The device side reaches memory only through a checked translation: an access that is not fully
//! inside one live region is recorded as a [`DmaFault`] and fails the command (delivery status `FW_ERR`) instead
//! of touching memory. Device DMA is modelled outside the Rust memory model, as real DMA is: the device copies
//! bytes with raw pointer copies under its lock, and the command protocol (owner bit and barriers) is what keeps
//! the CPU and the device off the same bytes.
//!
//! # Firmware
//! The command engine (module `fw`) validates delivery exactly as the PRM describes (entry type, signatures,
//! tokens, block numbers, pointer alignment), then runs the command with firmware-like checks: HCA state machine
//! (ENABLE_HCA, INIT_HCA, TEARDOWN_HCA, DISABLE_HCA), ISSI, page management, capabilities and the first objects
//! (PD, UAR, EQ, CQ), then the RDMA objects and the Ethernet ones mlx5e creates (TIS, TIR, RQT, RQ, SQ, NIC receive
//! flow tables; their capabilities only with [`SimConfig::eth_netdev`]). Failures carry a status and a syndrome from [`syndrome`]; a command sent in the wrong HCA
//! state fails with `BAD_SYS_STATE`, as real firmware answers.
//!
//! # Event queues
//! An EQ created with CREATE_EQ really receives EQEs. CREATE_EQ refuses (`BAD_PARAM`, [`syndrome::EQ_EVENT_TYPE`])
//! a bitmask asking for a type the device cannot report: the types Linux subscribes to unconditionally, completion,
//! command, page-request and internal-error events, and the capability-dependent ones its capabilities offer. An
//! event of type `T` goes to the lowest-numbered EQ whose `event_bitmask` has bit `T` (bit `n` of word 0 = type
//! `n`); a type no EQ subscribes to is dropped: the 64-byte `mlx5_eqe` is written at entry
//! `pi & (nent - 1)`, then, after a fence, its owner byte `(pi >> log_nent) & 1` (hardware writes 0 on the first
//! pass; the driver pre-sets 1). A full EQ is never overwritten: the firmware dies with the health syndrome
//! `ASYNCHRONOUS_EQ_BUF_OVERRUN` instead. The EQ doorbell in the EQ's UAR page (`MLX5_EQ_DOORBELL_OFFSET`:
//! update the consumer index and arm; 8 bytes further: update only) takes `(ci & 0xffffff) | eqn << 24`. An armed
//! EQ "interrupts" once on its next EQE (recorded as [`SimEvent::EqInterrupt`] and counted in
//! [`SimDevice::eq_info`]); arming with unconsumed EQEs interrupts at once. Firmware posts:
//! * a command-completion EQE (`MLX5_EVENT_TYPE_CMD`, `data.cmd.vector = 1 << slot`) after every completion of a
//!   command that ran while an EQ subscribed to command events (not for the CREATE_EQ that makes the first one);
//! * page requests (`MLX5_EVENT_TYPE_PAGE_REQUEST`): for the regular pages still needed after INIT_HCA, for
//!   [`Fault::PageRequest`], [`Fault::NeedPages`] and [`SimDevice::request_pages`]. A request made while no EQ
//!   subscribes to page requests is held; when one appears firmware posts one request for the balance then due
//!   (what QUERY_PAGES(regular) reports);
//! * PORT_CHANGE (port 1, sub-type DOWN or ACTIVE) when the link goes down or comes up: a TCP link's far end
//!   going away or plugging in, or [`SimDevice::set_port_up`] (the port state the queries report follows); any
//!   other sub-type on request ([`SimDevice::port_change`]);
//! * COMM_EST (`data.qp_srq`: queue type QP, the QP number) when an RC QP in RTR receives its first packet, once
//!   per entry into RTR; `WQ_CATAS_ERROR` from [`SimDevice::fail_qp`]. The device models neither alternate paths
//!   nor the SQD state, so it never posts PATH_MIG, PATH_MIG_FAILED or SQ_DRAINED.
//!
//! A command hit by [`Fault::NeedPages`] stays with hardware until the driver gives the pages on another slot
//! (the driver uses the last one): the MANAGE_PAGES that covers the need completes first, then the stalled
//! command executes and completes, inside the same doorbell (inline) or worker step (threaded). This is how a
//! physical function behaves: it must serve page requests while a command waits.
//!
//! # Completion queues
//! A CQ created with CREATE_CQ really receives CQEs (from the datapath, and from [`SimDevice::post_cqe`]):
//! CQE `n` is written at entry `n mod nent` through the CQ's `pas[]` pages (scattered pages and pages above
//! 4 KiB both work; a 128-byte CQE carries its `mlx5_cqe64` in its second half), bytes 0..63 first and, after a
//! fence, `op_own` with the owner bit `(n >> log_nent) & 1`. Before writing, firmware reads the consumer index
//! from the doorbell record: a full CQ (`pi - ci == nent`) overruns, unless `oi` is set: the CQ enters
//! `MLX5_CQC_STATUS_CQ_OVERFLOW`, takes no more CQEs and a CQ-error EQE (`MLX5_CQ_ERROR_SYNDROME_CQ_OVERRUN`) goes
//! to the EQ subscribed to CQ errors. The CQ doorbell (`MLX5_CQ_DOORBELL` in the CQ's UAR page, one 64-bit write
//! of `(sn << 28 | cmd | ci) << 32 | cqn`) arms for the next CQE or for the next solicited (or error) CQE; an
//! armed CQ fires one completion EQE on its own `c_eqn` EQ, whatever that EQ subscribes to, and arming while
//! matching CQEs are unconsumed fires at once. QUERY_CQ reports the context; MODIFY_CQ changes the moderation or
//! resizes (a `MLX5_CQE_RESIZE_CQ` CQE at the old buffer's next index, then the new buffer continues one index
//! further, as rdma-core's `mlx5_cq_resize_copy_cqes` expects).
//!
//! # Memory keys
//! CREATE_MKEY / DESTROY_MKEY keep PA keys (identity translation) and MTT keys (one page address per page of
//! `start_addr .. start_addr + len`). [`SimDevice::mkey_access`] checks an access (key, variant, PD, bounds,
//! rights, live DMA) and returns the IOVA pieces it touches, for tests now and the datapath later.
//!
//! # Queue pairs and the datapath
//! CREATE_QP makes RC and UD QPs (buffer: RQ at byte 0, SQ after it; doorbell record at `dbr_addr`), moved through
//! RST2INIT, INIT2RTR, RTR2RTS, RTS2RTS, 2ERR and 2RST with firmware's checks (`BAD_QP_STATE` from the wrong
//! state); QUERY_QP reports the context and counters, [`SimDevice::qp_info`] the same for tests. A 64-bit write at
//! offset 0 of a BlueFlame buffer of the QP's UAR page is the send doorbell; the rest of a BlueFlame copy is
//! checked against the WQE in memory ([`SimEvent::BlueFlameMismatch`]). In in-line mode the datapath runs inside
//! the MMIO write; in threaded mode on the device thread. SEND, SEND_IMM, RDMA_WRITE(_IMM), RDMA_READ and the two
//! 8-byte atomics execute in order through the memory keys, with requester, responder and error CQEs, RNR NAKs and
//! transport retries on device time, and flushes of a QP in ERR (module `transport`). Timers are checked whenever
//! the device runs: a doorbell, any MMIO write, a [`SimDelay`] sleep, and every millisecond on the device thread.
//!
//! # The Ethernet half
//! With [`SimConfig::eth_netdev`] an Ethernet port also runs mlx5e's queues (module `transport::eth`): a send
//! doorbell naming an SQ executes its Ethernet WQEs (checksum offload, LSO) and puts the frames on the wire by
//! destination MAC (send CQEs on request, an error CQE and the SQ in ERR for a malformed WQE); a received frame
//! that is not RoCEv2 goes through NIC receive steering (root table, groups, entries, TIR, RSS) into its RQ's
//! next WQE with an RX CQE. QUERY_VPORT_COUNTER and PPCNT report the traffic; a PAOS write that changes the
//! operational state posts PORT_CHANGE.
//!
//! # Addresses and the wire
//! Port 1 has GID index 0 ([`SimDevice::gid`]: the link-local address of the MAC on Ethernet, fe80::/64 + port
//! GUID on IB) and, on IB, the LID [`SimConfig::lid`]. A packet addressed to the device's own LID or GID (and MAC)
//! is loopback; [`SimDevice::connect`] joins two devices so each reaches the other's address (modules `link` and `wire`).
//! On a VDE fabric an IB port may wait for a subnet manager ([`SimConfig::subnet_manager`]: LID 0 until its SMA
//! is given one) behind an [`IbSwitch`], which one SM sweeps and programs with its HCAs.
//!
//! # Health and device loss
//! The health buffer (`mlx5_init_seg.health`) and the heartbeat (`health_counter`, one tick per ms of device
//! time) are live. [`Fault::Fatal`] / [`SimDevice::fail_health`] kill the firmware with a syndrome (health buffer
//! `synd`, `ext_synd`, a valid severity and the recovery-flow bit); [`Fault::Stall`] / [`SimDevice::stall_health`] kill it silently
//! (syndrome 0). A dead firmware freezes the heartbeat, never completes a command (the owner bit stays with
//! hardware) and posts no EQE. [`Fault::DeviceGone`] / [`SimDevice::device_gone`] remove the device from the bus:
//! every BAR read returns all ones, writes are ignored, DMA stops. In both states the driver can still free all
//! its DMA memory; pages a dead firmware still owned are counted in [`SimDevice::pages_abandoned`].
//!
//! # Layout
//! Layers (bottom first): config events fault pcap small | dma regs wire | link | fw | transport switch | uar | device | delay dma_handle mmio | sim_device | testkit
//!
//! Each module names only modules of lower layers (or of its own layer, acyclically) and never an item through
//! the crate root; `cargo xtask modcheck` reads the line above. `regs` holds the initialization segment and the
//! device clock; `wire` the packet format; `link` carries frames and reports what it receives through
//! `link::Station`, which `device` implements (the links never lock a device or run its datapath); `fw` is the
//! command engine with one table per object; `transport` the datapath over `Datapath`, a view of the device
//! (its engines run on narrower ones); `switch` is [`IbSwitch`], a simulated InfiniBand switch on VDE cables (its
//! SMA over `fw`'s SMP layouts, its ports over `link`'s VDE connections); `uar` decodes doorbells over that view; `device` owns the state behind
//! the lock, the device thread, command delivery and the run loop (`device::pump`: the datapath runs, its
//! packets go to devices or links). The handles (`mmio`, `dma_handle`, `delay`) hold the device; `sim_device` is
//! [`SimDevice`]. This file only re-exports.

mod config;
mod delay;
mod device;
mod dma;
mod dma_handle;
mod events;
mod fault;
mod fw;
mod link;
mod mmio;
pub mod pcap;
mod regs;
mod sim_device;
mod small;
mod switch;
#[cfg(any(test, feature = "test-utils"))]
pub mod testkit;
mod transport;
mod uar;
mod wire;

pub use config::{Mode, ObjectLimits, PortInfo, PortType, SimConfig};
pub use delay::SimDelay;
pub use dma::DmaFault;
pub use dma_handle::SimDma;
pub use events::{CmdMessage, ExecutedCmd, Recoveries, RetryKind, SimEvent};
pub use fault::Fault;
pub use fw::cq::{CqInfo, PostCqeError};
pub use fw::eq::{EqInfo, EQE_DATA_LEN};
pub use fw::mkey::{MkeyAccess, MkeyFault};
pub use fw::qp::{QpInfo, QpState, QpType, SpecialQp};
pub use fw::{syndrome, HcaState};
pub use link::stream;
pub use link::tcp::WireError;
/// The VDE fabric link: its errors, counters and the default switch.
pub mod vde {
    pub use crate::link::vde::{
        default_switch_dir, lid_mac, resolve, switch_url, VdeCounters, VdeError, ETHERTYPE_IB, MAX_ETH_FRAME,
        MAX_NEIGHBOURS, TX_QUEUE,
    };
}
pub use regs::Health;
/// The BAR page of UAR 0: the initialization segment's pages come first.
pub use regs::INIT_SEG_PAGES as FIRST_UAR_PAGE;
/// Bytes of one BlueFlame register, as the capabilities say (`1 << log_bf_reg_size`).
pub const BF_REG_SIZE: usize = 1 << fw::caps::LOG_BF_REG_SIZE;
pub use mmio::SimMmio;
pub use sim_device::SimDevice;
pub use switch::{IbSwitch, SwitchCounters, SwitchError, SwitchPort, SwitchState};
pub use transport::reasm::arp_neighbour;
pub use wire::roce;

pub use device::EVENT_LOG_MAX;
