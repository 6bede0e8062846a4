//! [`SimDevice`], the handle a test holds: it makes the device, hands out the HAL handles ([`SimMmio`],
//! [`SimDma`], [`SimDelay`]), configures and injects faults, and observes the device.

use std::sync::Arc;
use std::time::Duration;

use mlx5_core::prm::c::mlx5_cqe64 as c_cqe;

use crate::config::SimConfig;
use crate::delay::SimDelay;
use crate::device::{lock, Shared};
use crate::dma::DmaFault;
use crate::dma_handle::SimDma;
use crate::events::{ExecutedCmd, Recoveries, SimEvent};
use crate::fault::Fault;
use crate::fw::cq::{CqInfo, PostCqeError};
use crate::fw::eq::{EqInfo, EQE_DATA_LEN};
use crate::fw::mkey::{MkeyAccess, MkeyFault};
use crate::fw::qp::QpInfo;
use crate::fw::HcaState;
use crate::link;
use crate::link::tcp::WireError;
use crate::mmio::SimMmio;
use crate::regs::Health;
use crate::wire::roce;

/// Handle to one simulated device. Clones share the device.
#[derive(Debug, Clone)]
pub struct SimDevice {
    pub(crate) shared: Arc<Shared>,
}

impl Default for SimDevice {
    fn default() -> Self {
        Self::new(SimConfig::default())
    }
}

impl SimDevice {
    pub fn new(cfg: SimConfig) -> Self {
        Self { shared: Shared::new(cfg) }
    }

    /// A catastrophic error on QP `qpn`, as firmware reports a work-queue fault it found: the QP moves to ERR (the
    /// datapath then flushes its outstanding work requests, as for any QP in ERR) and a `WQ_CATAS_ERROR` event
    /// naming it goes to the EQ subscribed to that event. Returns `false`, changing nothing, when there is no such
    /// QP or the device is dead or gone.
    pub fn fail_qp(&self, qpn: u32) -> bool {
        if !lock(&self.shared).fail_qp(qpn) {
            return false;
        }
        // The device runs now, as after any state change: in-line mode flushes the QP at once.
        self.shared.run(true);
        true
    }

    /// The BAR (initialization segment and UAR pages).
    pub fn mmio(&self) -> SimMmio {
        SimMmio { shared: self.shared.clone() }
    }

    /// The device-visible memory allocator.
    pub fn dma(&self) -> SimDma {
        SimDma { shared: self.shared.clone() }
    }

    /// Time: virtual in inline mode, real sleeps in threaded mode.
    pub fn delay(&self) -> SimDelay {
        SimDelay { shared: self.shared.clone() }
    }

    pub fn config(&self) -> SimConfig {
        lock(&self.shared).cfg.clone()
    }

    /// Adds a fault; faults are checked in the order they were injected.
    pub fn inject(&self, fault: Fault) {
        lock(&self.shared).faults.push(fault);
    }

    pub fn clear_faults(&self) {
        lock(&self.shared).faults.clear();
    }

    /// Completed commands, in completion order.
    pub fn executed(&self) -> Vec<ExecutedCmd> {
        lock(&self.shared).executed.clone()
    }

    /// Everything else the device noticed, in order: the most recent ones once there were more than
    /// [`EVENT_LOG_MAX`](crate::EVENT_LOG_MAX) (see [`SimDevice::events_dropped`]).
    pub fn events(&self) -> Vec<SimEvent> {
        lock(&self.shared).events.clone()
    }

    /// Events dropped from the front of the log to keep it bounded.
    pub fn events_dropped(&self) -> u64 {
        lock(&self.shared).events_dropped
    }

    /// What the port recovered from so far (retransmissions, NAKs, duplicates), counted from the event log.
    pub fn recoveries(&self) -> Recoveries {
        let s = lock(&self.shared);
        Recoveries::count(&s.events, s.events_dropped)
    }

    /// Device accesses outside live DMA memory, in order.
    pub fn dma_faults(&self) -> Vec<DmaFault> {
        lock(&self.shared).dma.faults.clone()
    }

    /// Live DMA regions: (count, bytes).
    pub fn dma_outstanding(&self) -> (usize, usize) {
        lock(&self.shared).dma.outstanding()
    }

    /// Pages the driver has given to firmware and not taken back.
    pub fn pages_owned(&self) -> usize {
        lock(&self.shared).fw.pages.owned()
    }

    pub fn hca_state(&self) -> HcaState {
        lock(&self.shared).fw.state
    }

    /// Current device time in nanoseconds (virtual in inline mode).
    pub fn now_ns(&self) -> u64 {
        lock(&self.shared).now_ns()
    }

    /// Advances virtual time and runs due work, exactly as [`SimDelay`] does (inline mode; threaded: sleeps).
    pub fn advance_ns(&self, ns: u64) {
        self.delay().advance(ns);
    }

    /// The string SET_DRIVER_VERSION wrote, if any.
    pub fn driver_version(&self) -> Option<String> {
        lock(&self.shared).fw.port.driver_version.clone()
    }

    /// The `he` byte the host-endianness register was written with (`set_hca_ctrl`), if it was.
    pub fn host_endianness(&self) -> Option<u8> {
        lock(&self.shared).fw.port.host_endianness
    }

    /// The `roce_addr_layout` image SET_ROCE_ADDRESS stored at `index` (all zeros when empty), if in range.
    pub fn roce_address(&self, index: usize) -> Option<[u8; mlx5_core::prm::ifc::roce_addr_layout::SIZE_BYTES]> {
        lock(&self.shared).fw.port.roce_table.get(index).copied()
    }

    /// Live objects: (PDs, UARs, EQs, CQs).
    /// Runs `f` on the firmware's tables (unit tests look at what a command left behind).
    #[cfg(test)]
    pub(crate) fn with_fw<R>(&self, f: impl FnOnce(&crate::fw::Firmware) -> R) -> R {
        f(&lock(&self.shared).fw)
    }

    pub fn object_counts(&self) -> (usize, usize, usize, usize) {
        lock(&self.shared).fw.object_counts()
    }

    /// The state of EQ `eqn`, if it exists.
    pub fn eq_info(&self, eqn: u8) -> Option<EqInfo> {
        lock(&self.shared).fw.eqs.info(eqn)
    }

    /// Makes `len` bytes of memory shared with another system (a UML guest's RAM, see `mlx5-uml-bridge`)
    /// reachable by device DMA at bus address `iova`: that system's driver hands the device its own physical
    /// addresses. `Err(Unreachable)` when the range is empty or overlaps mapped memory.
    ///
    /// # Safety
    /// `cpu..cpu + len` must stay mapped, readable and writable for as long as the device exists, or until
    /// [`SimDevice::unmap_guest_memory`] takes the range away.
    pub unsafe fn map_guest_memory(
        &self,
        iova: u64,
        cpu: std::ptr::NonNull<u8>,
        len: usize,
    ) -> Result<(), mlx5_core::hal::DmaError> {
        lock(&self.shared).dma.map_fixed(iova, cpu, len).map(|_| ())
    }

    /// Backs the device memory (MEMIC) region with `len` bytes at `cpu`, which the datapath then reads and writes
    /// for MRs on device memory: under UML, the BAR file's pages of that region, which user processes map.
    /// Refused unless `len` is the configured `memic_size`.
    ///
    /// # Safety
    /// As [`SimDevice::map_guest_memory`]: the bytes stay valid, and nothing else frees them, for the device's life.
    pub unsafe fn map_device_memory(
        &self,
        cpu: std::ptr::NonNull<u8>,
        len: usize,
    ) -> Result<(), mlx5_core::hal::DmaError> {
        let mut st = lock(&self.shared);
        if len == 0 || len != st.cfg.memic_size as usize {
            return Err(mlx5_core::hal::DmaError::Unreachable { addr: cpu.as_ptr() as usize, len });
        }
        st.dma.map_fixed(crate::fw::memic::DMA_BASE, cpu, len).map(|_| ())
    }

    /// Takes away what [`SimDevice::map_guest_memory`] mapped at exactly `iova..iova + len`, as an IOMMU unmap:
    /// later device accesses there fault. `false`, changing nothing, when no such mapping exists.
    pub fn unmap_guest_memory(&self, iova: u64, len: usize) -> bool {
        lock(&self.shared).dma.unmap_fixed(iova, len)
    }

    /// The MSI-X vectors (`eqc.intr`) of the EQ interrupts fired since `*cursor`, an index into the event log the
    /// caller keeps (start at 0); advances it. An interrupt of an EQ destroyed since is dropped.
    pub fn interrupts_since(&self, cursor: &mut usize) -> Vec<u16> {
        let st = lock(&self.shared);
        let from = (*cursor).min(st.events.len());
        *cursor = st.events.len();
        st.events[from..]
            .iter()
            .filter_map(|e| match e {
                SimEvent::EqInterrupt { eqn } => st.fw.eqs.info(*eqn).map(|i| i.intr),
                _ => None,
            })
            .collect()
    }

    /// The commands completed since `*cursor` (an index into the completion log the caller keeps); advances it.
    pub fn executed_since(&self, cursor: &mut usize) -> Vec<ExecutedCmd> {
        let st = lock(&self.shared);
        let from = (*cursor).min(st.executed.len());
        *cursor = st.executed.len();
        st.executed[from..].to_vec()
    }

    /// The commands completed since the last call, with their input and output bytes, when
    /// [`SimConfig::record_messages`] is set (empty otherwise).
    pub fn take_messages(&self) -> Vec<crate::events::CmdMessage> {
        lock(&self.shared).messages.drain(..).collect()
    }

    /// Live memory keys.
    pub fn mkey_count(&self) -> usize {
        lock(&self.shared).fw.mkey_count()
    }

    /// Changes the largest allocation the DMA allocator grants from now on (`None`: no limit). Bring-up needs
    /// large contiguous chunks (firmware pages, EQs); tests fragment later allocations by setting a limit after it.
    pub fn set_dma_max_contig(&self, max: Option<usize>) {
        lock(&self.shared).dma.max_contig = max;
    }

    /// The state of CQ `cqn`, if it exists.
    pub fn cq_info(&self, cqn: u32) -> Option<CqInfo> {
        lock(&self.shared).cq_info(cqn)
    }

    /// Writes `cqe` (a 64-bit `mlx5_cqe64` image; the owner bit is replaced) as the next CQE of CQ `cqn`, with
    /// the overrun check and the completion event the hardware applies. Returns the CQE's counter value `n` (it
    /// sits at entry `n mod nent`).
    pub fn post_cqe(&self, cqn: u32, cqe: [u8; c_cqe::SIZE]) -> Result<u32, PostCqeError> {
        lock(&self.shared).datapath().cqs().post_cqe(cqn, &cqe)
    }

    /// CQ `cqn` overruns now, as when a whole ring of completions arrives that its consumer has not polled: the CQ
    /// enters overflow (it takes no more CQEs) and a CQ-error event reports it. Returns whether it did (the CQ
    /// exists, was healthy, and the firmware is alive).
    pub fn overrun_cq(&self, cqn: u32) -> bool {
        let mut st = lock(&self.shared);
        !st.dead() && st.datapath().cqs().cq_overflow(cqn)
    }

    /// The numbers of the CQs that exist, lowest first.
    pub fn cq_numbers(&self) -> Vec<u32> {
        let mut cqns: Vec<u32> = lock(&self.shared).fw.cqs.iter().map(|(cqn, _)| cqn).collect();
        cqns.sort_unstable();
        cqns
    }

    /// Checks an access of `len` bytes at `va` through memory key `key` (from a PD `pd`, when the access comes
    /// from a QP), and returns the IOVA pieces it covers, split where the translation is not contiguous.
    pub fn mkey_access(
        &self,
        key: u32,
        pd: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<Vec<(u64, u64)>, MkeyFault> {
        lock(&self.shared).mkey_access(key, pd, va, len, access)
    }

    /// Posts an EQE of `event_type` now, to the lowest-numbered EQ subscribed to it. Returns that EQ, or `None`
    /// when no EQ subscribes, the firmware is dead or the EQE could not be posted.
    pub fn post_event(&self, event_type: u8, sub_type: u8, data: [u8; EQE_DATA_LEN]) -> Option<u8> {
        lock(&self.shared).post_eqe(event_type, sub_type, &data)
    }

    /// The port's link goes down (`false`) or comes up (`true`), as a cable pulled or plugged: the port state the
    /// queries report follows and firmware posts a PORT_CHANGE event (sub-type DOWN or ACTIVE). Returns the EQ
    /// the event went to; `None` when the state did not change, no EQ subscribes, or the firmware is dead.
    pub fn set_port_up(&self, up: bool) -> Option<u8> {
        lock(&self.shared).set_port_up(up)
    }

    /// Firmware reports a port change of `sub_type` (`MLX5_PORT_CHANGE_SUBTYPE_LID`, `_PKEY`, `_GUID`,
    /// `_CLIENT_REREG`, ...) on port 1, as a subnet manager's change makes it do. Returns the EQ it went to.
    pub fn port_change(&self, sub_type: u8) -> Option<u8> {
        lock(&self.shared).port_change(sub_type)
    }

    /// Firmware asks for `num_pages` now (positive: its need grows; negative: that many pages become returnable
    /// to the next MANAGE_PAGES(take)). Posted at once if an EQ subscribes to page requests, else held.
    pub fn request_pages(&self, num_pages: i32) {
        lock(&self.shared).page_request(num_pages);
    }

    /// Kills the firmware now with health syndrome `synd` (a `MLX5_INITIAL_SEG_HEALTH_SYNDROME_*`; 0 is a
    /// silent stall). No effect when it is already dead or gone.
    pub fn fail_health(&self, synd: u8) {
        lock(&self.shared).fail(synd);
    }

    /// Kills the firmware now without a syndrome: the heartbeat freezes and commands hang.
    pub fn stall_health(&self) {
        lock(&self.shared).fail(0);
    }

    /// Removes the device from the bus now: reads return all ones, writes and DMA stop.
    pub fn device_gone(&self) {
        lock(&self.shared).vanish();
    }

    /// A function-level reset: a dead or removed device comes back as at power-on (initializing for the configured
    /// time, then ready for a new bring-up), every firmware object and page forgotten; host memory is untouched.
    /// The verbs layer resets a dead device this way when it is opened again, as vfio-pci resets a released one.
    pub fn function_reset(&self) {
        lock(&self.shared).function_reset();
    }

    /// Alive, dead (with its syndrome) or gone.
    pub fn health(&self) -> Health {
        lock(&self.shared).regs.health
    }

    /// Pages firmware owned when the driver freed them after the firmware died or the device left.
    pub fn pages_abandoned(&self) -> usize {
        lock(&self.shared).fw.pages.abandoned()
    }

    /// The state of QP `qpn`, if it exists.
    pub fn qp_info(&self, qpn: u32) -> Option<QpInfo> {
        lock(&self.shared).fw.qps.get(&qpn).map(|q| q.info())
    }

    /// Live QPs.
    pub fn qp_count(&self) -> usize {
        lock(&self.shared).fw.qps.len()
    }

    /// Joins this device and `peer` with a virtual wire (both directions): packets addressed to the peer's LID
    /// (IB) or GID and MAC (RoCE) reach it. Joining a device to itself changes nothing (loopback needs no wire).
    pub fn connect(&self, peer: &SimDevice) {
        crate::device::pump::connect(&self.shared, &peer.shared);
    }

    /// Listens on `addr` (e.g. `"0.0.0.0:18516"`; port 0 picks one) for a simulated device in another process
    /// to plug into this device's port: the fabric's link ([`SimDevice::vde_plug`]) over the TCP stream, with no
    /// libvdeplug. Returns the address bound. While a peer is plugged in, another is turned away (one port, one
    /// cable); one whose port address equals this device's is turned away ([`SimEvent::LinkDown`]). Use [`Mode::Threaded`](crate::Mode::Threaded) for a
    /// linked device, so its retry timers run in real time.
    pub fn wire_listen(&self, addr: &str) -> Result<std::net::SocketAddr, WireError> {
        link::tcp::listen(&self.shared, addr)
    }

    /// Plugs this device's port into the device listening at `addr` (`host:port`) in another process, retrying
    /// a refused connection with backoff for up to `timeout` (the listener may start later:
    /// [`WireError::NoListener`] once the time is up); each end first sends a hello naming its port's address.
    /// The stream then carries the fabric's frames (RoCEv2 between Ethernet ports, MACs from link-local GIDs or
    /// ARP; IB frames to any LID between InfiniBand ports); when it goes down packets are lost, and RC requests
    /// time out.
    pub fn wire_connect(&self, addr: &str, timeout: Duration) -> Result<(), WireError> {
        link::tcp::connect(&self.shared, addr, timeout)
    }

    /// Unplugs the link to another process that [`SimDevice::wire_connect`] or a listener plugged in, if any:
    /// frames already queued go out, then the far end sees the connection close ([`SimEvent::LinkDown`] there)
    /// and this port's link is down. A listener keeps listening. Returns whether a link was plugged in.
    pub fn wire_unplug(&self) -> bool {
        link::tcp::unplug(&*self.shared)
    }

    /// Waits (at most `timeout` for each step) until the doorbells rung so far have run and every frame queued
    /// for the process at the other end of the wire (or the VDE fabric) is on its socket, the link staying
    /// plugged in. A process that exits right after posting (a CM's DREP) so
    /// loses nothing a NIC would have sent. True when nothing was left (or no link is plugged in).
    pub fn wire_drain(&self, timeout: Duration) -> bool {
        // The doorbells rung so far go through the datapath first (in threaded mode the device thread runs them).
        let settled = self.shared.worker.as_ref().is_none_or(|w| w.settle(timeout));
        // A VDE fabric's frames likewise.
        let vde = lock(&self.shared).wire.vde_link();
        settled && vde.is_none_or(|l| l.drain(timeout))
    }

    /// Listens on the UNIX socket `path` for a QEMU guest NIC (`-netdev stream,server=off,addr.type=unix,
    /// addr.path=PATH`) and plugs the first connection into this device's port: RoCEv2 frames in QEMU's stream
    /// framing, ARP answered for [`SimConfig::ipv4_addrs`]. Returns once listening. Use [`Mode::Threaded`](crate::Mode::Threaded).
    pub fn guest_listen(&self, path: &std::path::Path) -> std::io::Result<()> {
        link::guest::listen(&self.shared, path)
    }

    /// Plugs this device's port into the guest NIC listening on the UNIX socket `path` (QEMU `server=on`),
    /// retrying for up to `timeout`.
    pub fn guest_connect(&self, path: &std::path::Path, timeout: Duration) -> std::io::Result<()> {
        link::guest::connect(&self.shared, path, timeout)
    }

    /// Whether a guest NIC is plugged in and its link is up.
    pub fn guest_plugged(&self) -> bool {
        lock(&self.shared).wire.guest_link().is_some_and(|l| l.is_up())
    }

    /// Makes the guest link drop the `n`-th RoCE frame it sends from now on (1: the next one): a lost frame,
    /// for retransmission tests. Returns false when no guest link is plugged in.
    pub fn guest_drop_frame(&self, n: u64) -> bool {
        let l = lock(&self.shared).wire.guest_link();
        l.map(|l| l.drop_frame(n)).is_some()
    }

    /// Makes the guest link lose the `n`-th RoCE frame it receives from now on (1: the next one), before the port
    /// sees it. Returns false when no guest link is plugged in.
    pub fn guest_drop_frame_in(&self, n: u64) -> bool {
        let l = lock(&self.shared).wire.guest_link();
        l.map(|l| l.drop_frame_in(n)).is_some()
    }

    /// RoCE frames the guest link put on the cable (counting one dropped on purpose) and took from it (counting
    /// one lost on purpose); `None` when no guest link is plugged in.
    pub fn guest_frames(&self) -> Option<(u64, u64)> {
        lock(&self.shared).wire.guest_link().map(|l| l.frames())
    }

    /// Makes the guest link a slow cable: it writes at most `per_ms` frames a millisecond (0: no limit). Returns
    /// false when no guest link is plugged in.
    pub fn guest_pace(&self, per_ms: u64) -> bool {
        let l = lock(&self.shared).wire.guest_link();
        l.map(|l| l.set_pace(per_ms)).is_some()
    }

    /// The most frames the guest link held queued for its writer at once; `None` when no guest link is plugged
    /// in.
    pub fn guest_backlog_peak(&self) -> Option<u64> {
        lock(&self.shared).wire.guest_link().map(|l| l.backlog_peak())
    }

    /// Plugs this port into the VDE fabric at the libvdeplug URL `url` (`vde:///path` for a
    /// `vde_switch`, `vxvde://GROUP` across a LAN, ...), or with `None` into the default switch of this user
    /// (`vde::default_switch_dir`), which the first process to need it starts. Frames to and from any
    /// number of ports on the fabric; on Ethernet destination MACs from link-local GIDs or ARP, on InfiniBand
    /// from the destination LID (`vde::lid_mac`), after a probe that no other port holds this port's LID
    /// (`VdeError::LidInUse`). Use [`Mode::Threaded`](crate::Mode::Threaded).
    pub fn vde_plug(&self, url: Option<&str>) -> Result<(), link::vde::VdeError> {
        link::vde::plug(&self.shared, url)
    }

    /// [`SimDevice::vde_plug`] into the switch at `dir`, started if none answers (tests: a private switch).
    #[cfg(test)]
    pub(crate) fn vde_plug_dir(&self, dir: &std::path::Path) -> Result<(), link::vde::VdeError> {
        link::vde::plug_dir(&self.shared, dir)
    }

    /// The VDE link plugged in (tests look at its tables).
    #[cfg(test)]
    pub(crate) fn vde_link_for_test(&self) -> std::sync::Arc<link::VdeLink> {
        lock(&self.shared).wire.vde_link().expect("a VDE link")
    }

    /// Whether a VDE fabric is plugged in and its link is up.
    pub fn vde_plugged(&self) -> bool {
        lock(&self.shared).wire.vde_link().is_some_and(|l| l.is_up())
    }

    /// Unplugs the VDE fabric, once what is queued is on it (the ACK of a peer's last message, often queued as a
    /// program closes its device): the port's link goes down. Returns whether a fabric was plugged in.
    pub fn vde_unplug(&self) -> bool {
        let l = lock(&self.shared).wire.vde_link();
        let Some(l) = l else { return false };
        l.drain(link::DRAIN_TIMEOUT);
        l.close();
        let id = l.id;
        link::Station::with_wire(&*self.shared, |w, _| {
            w.unplug_remote(id);
            ((), Some(false))
        });
        true
    }

    /// What the VDE link counted; `None` when none is plugged in.
    pub fn vde_counters(&self) -> Option<link::vde::VdeCounters> {
        lock(&self.shared).wire.vde_link().map(|l| l.counters())
    }

    /// Frames the RoCE port received and accepted (every check passed), from links and from devices of this
    /// process.
    pub fn frames_received(&self) -> u64 {
        lock(&self.shared).wire.frames_in
    }

    /// Frames the RoCE port dropped from its links, per reason.
    pub fn frame_drops(&self) -> roce::frame::DropCounters {
        lock(&self.shared).wire.drops
    }

    /// Waits until a peer in another process is plugged in (true) or `timeout` passes (false).
    pub fn wire_wait_peer(&self, timeout: Duration) -> bool {
        link::tcp::wait_peer(&*self.shared, timeout)
    }

    /// The socket address of the peer plugged into this device's link, while the link is up.
    pub fn wire_peer(&self) -> Option<std::net::SocketAddr> {
        lock(&self.shared).wire.remote_link().filter(|l| l.is_up()).and_then(|l| l.cable.as_ref().and_then(|c| c.peer))
    }

    /// GID table entry `index` of port 1: index 0 is the default GID (IB: fe80::/64 + port GUID; RoCE: the
    /// IPv6 link-local address of the port MAC, modified EUI-64). No other entry is populated.
    pub fn gid(&self, index: u32) -> Option<[u8; 16]> {
        lock(&self.shared).wire.addr.gid(index)
    }

    /// The port LID (0 on Ethernet).
    pub fn lid(&self) -> u16 {
        lock(&self.shared).wire.addr.lid
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::EVENT_LOG_MAX;
    use crate::fw::syndrome;
    use crate::testkit::submit::Harness;
    use mlx5_core::hal::{Dma, Mmio};
    use mlx5_core::prm::{c, consts, ifc, MsgBuf};

    const HEALTH_COUNTER: usize = c::mlx5_init_seg::HEALTH_COUNTER.off;

    /// The 64-byte health buffer as the driver reads it (big-endian dwords).
    fn health_buffer(m: &SimMmio) -> [u8; c::health_buffer::SIZE] {
        let mut hb = [0u8; c::health_buffer::SIZE];
        for (k, w) in hb.chunks_mut(4).enumerate() {
            w.copy_from_slice(&m.read32(c::mlx5_init_seg::HEALTH.off + 4 * k).to_be_bytes());
        }
        hb
    }

    fn input(opcode: u16, len: usize) -> Vec<u8> {
        let mut inp = vec![0u8; len];
        inp.set(ifc::mbox_in::OPCODE, opcode.into());
        inp
    }

    /// Frees every region the harness handed out (queue and pages); mailboxes are released by the caller.
    fn free_all(h: &mut Harness) {
        for r in h.page_regions.drain(..) {
            // SAFETY: the region came from this allocator; the device is dead or gone and never touches it again.
            unsafe { h.dma.free(r) };
        }
        // SAFETY: every caller is done with the queue page: nothing reads `h.q` after this.
        let q = unsafe { std::mem::ManuallyDrop::take(&mut h.q) };
        // SAFETY: as above, for the command queue page.
        unsafe { h.dma.free(q) };
    }

    #[test]
    fn fault_opcode_covers_every_variant() {
        let faults = [
            Fault::Status { opcode: 1, status: 0, syndrome: 0, times: 0 },
            Fault::Hang { opcode: 1 },
            Fault::Delay { opcode: 1, ms: 0 },
            Fault::Delivery { opcode: 1, status: 0 },
            Fault::CorruptOutput { opcode: 1, offset: 0, value: 0 },
            Fault::PageRequest { opcode: 1, num_pages: -1 },
            Fault::NeedPages { opcode: 1, pages: 1 },
            Fault::Fatal { opcode: 1, synd: 1 },
            Fault::Stall { opcode: 1 },
            Fault::DeviceGone { opcode: 1 },
        ];
        assert!(faults.iter().all(|f| f.opcode() == 1));
    }

    #[test]
    fn fatal_fault_kills_the_firmware() {
        let mut h = Harness::inline();
        h.bring_up();
        let synd = consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_HW_FATAL_ERR;
        h.dev.inject(Fault::Fatal { opcode: consts::MLX5_CMD_OP_ALLOC_PD, synd });
        assert_eq!(health_buffer(&h.mmio), [0u8; c::health_buffer::SIZE]);
        let p = h.post(0, &input(consts::MLX5_CMD_OP_ALLOC_PD, 16), 16);
        h.ring(0);
        assert_eq!(h.status_own(0) & 1, 1);
        assert_eq!(h.dev.health(), Health::Failed { synd });
        assert!(h.dev.events().contains(&SimEvent::HealthFailure { synd }));
        let hb = health_buffer(&h.mmio);
        assert_eq!(hb[c::health_buffer::SYND.off], synd);
        let ext = c::health_buffer::EXT_SYND.off;
        assert_eq!(u16::from_be_bytes([hb[ext], hb[ext + 1]]), syndrome::HEALTH_EXT_SYND);
        let sev = hb[c::health_buffer::RFR_SEVERITY.off];
        assert_ne!(sev & consts::MLX5_SEVERITY_VALID_MASK, 0);
        assert_eq!(sev & consts::MLX5_SEVERITY_MASK, 2);
        assert_eq!(sev >> consts::MLX5_RFR_BIT_OFFSET, 1, "firmware asks for the recovery flow");
        // The heartbeat is frozen.
        let beat = h.mmio.read32(HEALTH_COUNTER);
        h.dev.advance_ns(50_000_000);
        assert_eq!(h.mmio.read32(HEALTH_COUNTER), beat);
        // Nothing completes any more, on any slot, however long the driver waits.
        let q = h.post(1, &input(consts::MLX5_CMD_OP_QUERY_ISSI, 16), ifc::query_issi_out::SIZE_BYTES);
        h.ring(1);
        h.dev.advance_ns(120_000_000_000);
        assert_eq!((h.status_own(0) & 1, h.status_own(1) & 1), (1, 1));
        assert!(h.dev.events().contains(&SimEvent::DoorbellWhileDead { slot: 1 }));
        // The last command that ran is bring-up's last: SET_ROCE_ADDRESS of the default GID on this RoCE port.
        assert_eq!(h.dev.executed().last().unwrap().opcode, consts::MLX5_CMD_OP_SET_ROCE_ADDRESS);
        // No more EQEs either, and another failure changes nothing.
        h.dev.request_pages(5);
        assert_eq!(h.dev.post_event(0, 0, [0; EQE_DATA_LEN]), None);
        h.dev.fail_health(1);
        assert_eq!(h.dev.health(), Health::Failed { synd });
        // The driver can still return all its memory; firmware's pages are abandoned, not freed under it.
        h.release(p);
        h.release(q);
        free_all(&mut h);
        assert_eq!(h.dev.dma_outstanding(), (0, 0));
        assert_eq!(h.dev.pages_abandoned(), 8 + 16);
        assert_eq!(h.dev.pages_owned(), 0);
        assert!(!h.dev.events().iter().any(|e| matches!(e, SimEvent::FreedDeviceOwned { .. })));
    }

    #[test]
    fn the_event_log_keeps_the_most_recent_events_only() {
        let dev = SimDevice::new(SimConfig::default());
        let m = dev.mmio();
        // A UAR write before bring-up is ignored and logged: one event per write.
        let other = SimMmio::uar_offset(0) + consts::MLX5_BF_OFFSET as usize;
        let writes = 2 * EVENT_LOG_MAX + 100;
        for i in 0..writes {
            m.write32(other, i as u32);
        }
        let ev = dev.events();
        assert!(ev.len() <= 2 * EVENT_LOG_MAX && dev.events_dropped() > 0, "{} kept", ev.len());
        assert_eq!(ev.len() as u64 + dev.events_dropped(), writes as u64, "one event per write, none lost silently");
        assert_eq!(ev.last(), Some(&SimEvent::IgnoredWrite { off: other, val: (writes - 1) as u32 }));
    }

    #[test]
    fn stall_fault_only_freezes_the_heartbeat() {
        let mut h = Harness::inline();
        h.dev.inject(Fault::Stall { opcode: consts::MLX5_CMD_OP_ENABLE_HCA });
        h.dev.advance_ns(3_000_000);
        let p = h.post(0, &input(consts::MLX5_CMD_OP_ENABLE_HCA, 16), 16);
        h.ring(0);
        assert_eq!(h.status_own(0) & 1, 1);
        assert_eq!(h.dev.health(), Health::Failed { synd: 0 });
        assert!(h.dev.events().contains(&SimEvent::HealthFailure { synd: 0 }));
        assert_eq!(health_buffer(&h.mmio), [0u8; c::health_buffer::SIZE]);
        assert_eq!(h.mmio.read32(HEALTH_COUNTER), 3);
        h.dev.advance_ns(10_000_000);
        assert_eq!(h.mmio.read32(HEALTH_COUNTER), 3);
        assert_eq!(h.dev.hca_state(), HcaState::Disabled);
        h.release(p);
    }

    #[test]
    fn commands_delayed_before_a_stall_never_complete() {
        let mut h = Harness::inline();
        h.dev.inject(Fault::Delay { opcode: consts::MLX5_CMD_OP_ENABLE_HCA, ms: 10 });
        let p = h.post(0, &input(consts::MLX5_CMD_OP_ENABLE_HCA, 16), 16);
        h.ring(0);
        h.dev.stall_health();
        h.dev.advance_ns(20_000_000);
        assert_eq!(h.status_own(0) & 1, 1);
        assert!(h.dev.executed().is_empty());
        h.release(p);
    }

    #[test]
    fn device_gone_reads_all_ones_and_never_touches_memory() {
        let mut h = Harness::inline();
        assert_eq!(h.enable_hca(), 0);
        assert_eq!(h.give_pages(8), (0, 0));
        h.dev.inject(Fault::DeviceGone { opcode: consts::MLX5_CMD_OP_QUERY_PAGES });
        let mut inp = input(consts::MLX5_CMD_OP_QUERY_PAGES, ifc::query_pages_in::SIZE_BYTES);
        inp.set(ifc::query_pages_in::OP_MOD, consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES.into());
        let p = h.post(0, &inp, ifc::query_pages_out::SIZE_BYTES);
        h.ring(0);
        assert_eq!(h.dev.health(), Health::Gone);
        assert!(h.dev.events().contains(&SimEvent::DeviceGone));
        let uar = SimMmio::uar_offset(3);
        for off in [0, c::mlx5_init_seg::HEALTH.off, HEALTH_COUNTER, c::mlx5_init_seg::INITIALIZING.off, uar] {
            assert_eq!(h.mmio.read32(off), u32::MAX, "offset {off:#x}");
        }
        assert_eq!(h.mmio.read64(0), u64::MAX);
        // Writes (a doorbell included) are ignored, and the entry stays as the driver left it.
        h.ring(0);
        assert!(h.dev.events().contains(&SimEvent::WriteWhileGone { off: c::mlx5_init_seg::CMD_DBELL.off, val: 1 }));
        assert_eq!(h.status_own(0), consts::CMD_OWNER_HW);
        h.dev.device_gone();
        assert_eq!(h.dev.events().iter().filter(|e| **e == SimEvent::DeviceGone).count(), 1);
        h.release(p);
        free_all(&mut h);
        assert_eq!(h.dev.dma_outstanding(), (0, 0));
        assert_eq!(h.dev.pages_abandoned(), 8);
        assert!(h.dev.dma_faults().is_empty());
    }

    #[test]
    fn stalled_command_is_never_released_by_a_dead_firmware() {
        let mut h = Harness::inline();
        h.bring_up();
        h.dev.inject(Fault::NeedPages { opcode: consts::MLX5_CMD_OP_ALLOC_PD, pages: 1 });
        let p = h.post(0, &input(consts::MLX5_CMD_OP_ALLOC_PD, 16), 16);
        h.ring(0);
        h.dev.fail_health(consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR);
        let inp = h.give_input(1);
        let g = h.post(31, &inp, 16);
        h.ring(31);
        assert_eq!((h.status_own(0) & 1, h.status_own(31) & 1), (1, 1));
        h.release(p);
        h.release(g);
        free_all(&mut h);
        assert_eq!(h.dev.dma_outstanding(), (0, 0));
    }

    #[test]
    fn an_injected_overrun_puts_the_cq_in_overflow_and_reports_it_once() {
        let mut r = crate::testkit::submit::Rdma::inline();
        let (a, b) = (r.cq(4), r.cq(4));
        assert_eq!(r.h.dev.cq_numbers(), [a.cqn, b.cqn]);
        assert!(r.h.dev.overrun_cq(b.cqn));
        let info = r.h.dev.cq_info(b.cqn).unwrap();
        assert_eq!(info.status, consts::MLX5_CQC_STATUS_CQ_OVERFLOW);
        assert_eq!(r.h.dev.cq_info(a.cqn).unwrap().status, consts::MLX5_CQC_STATUS_OK);
        // (The CQ-error EQE goes to an EQ that subscribes; this harness has none, the verbs tests see it.)
        let overruns = |ev: Vec<SimEvent>| ev.iter().filter(|e| matches!(e, SimEvent::CqOverrun { .. })).count();
        assert_eq!(overruns(r.h.dev.events()), 1);
        // Already in error, or no such CQ: nothing more happens.
        assert!(!r.h.dev.overrun_cq(b.cqn));
        assert!(!r.h.dev.overrun_cq(0xff_ffff));
        assert_eq!(overruns(r.h.dev.events()), 1);
    }
}
