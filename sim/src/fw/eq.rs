//! Datapath side: `EqPost` here (every EQE is written by it), `transport/cqe.rs` (completion events), `uar.rs`
//! (the EQ doorbell).
//!
//! Event queues on the device side (c-layouts.md section 3): [`EqTable`] with CREATE/DESTROY_EQ over the narrow
//! [`EqFw`] view, posting EQEs, and the firmware's page requests; the EQ doorbell is decoded in `uar.rs`. Mirrors
//! the kernel's `eq.c` from the device side.
//!
//! An EQE is written through the checked DMA translation: the entry first, then, after a fence, its owner byte,
//! so a driver that sees the new owner value (and issues `dma_rmb`) reads a complete entry.

use std::sync::atomic::{fence, Ordering};

use mlx5_core::prm::{c, consts, ifc, CmdStatus, MsgBuf};

use super::pages::FW_PAGE;
use super::reply::{bad_param, err, rd, CmdErr};
use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut};

use super::caps::Caps;
use super::ids::{alloc_id, IdSet};
use super::pas::check_pas;
use super::syndrome;
use crate::dma::DmaSpace;

use super::hca::HcaState;
use super::health;
use super::pages::Pages;
use crate::events::SimEvent;
use crate::regs::{Clock, Regs};

/// Bytes of event data in an EQE (`union ev_data`).
pub const EQE_DATA_LEN: usize = c::mlx5_eqe::DATA.len;

/// The event data of a command-completion EQE for `slot`: `data.cmd.vector` = `1 << slot`.
fn cmd_data(slot: u8) -> [u8; EQE_DATA_LEN] {
    let mut d = [0u8; EQE_DATA_LEN];
    let v = c::mlx5_eqe_cmd::VECTOR;
    d[v.off..v.end()].copy_from_slice(&(1u32 << (slot & 31)).to_be_bytes());
    d
}

/// The event data of a page request for our own function (`func_id` 0).
fn page_req_data(num_pages: i32) -> [u8; EQE_DATA_LEN] {
    use c::mlx5_eqe_page_req as p;
    let mut d = [0u8; EQE_DATA_LEN];
    d[p::FUNC_ID.off..p::FUNC_ID.end()].copy_from_slice(&0u16.to_be_bytes());
    d[p::NUM_PAGES.off..p::NUM_PAGES.end()].copy_from_slice(&num_pages.to_be_bytes());
    d
}

/// The state of one EQ, as [`SimDevice::eq_info`](crate::sim_device::SimDevice::eq_info) reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EqInfo {
    /// Number of entries (`1 << log_eq_size`).
    pub nent: u32,
    /// Producer index: EQEs posted so far (wrapping 32-bit counter).
    pub pi: u32,
    /// Consumer index the driver last wrote (reconstructed to 32 bits from the doorbell's 24).
    pub ci: u32,
    /// Whether the next EQE interrupts.
    pub armed: bool,
    /// Interrupts fired.
    pub interrupts: u64,
    /// EQEs refused because the EQ was full.
    pub overruns: u64,
    /// UAR page the EQ's doorbell lives in.
    pub uar_page: u32,
    /// The four `event_bitmask` words from CREATE_EQ.
    pub event_bitmask: [u64; 4],
    /// `eqc.intr`: the interrupt vector the EQ signals.
    pub intr: u16,
}

/// An event queue: its buffer, subscriptions and indices.
#[derive(Debug)]
pub(crate) struct Eq {
    pub(crate) uar: u32,
    /// Bus addresses of the buffer pages (`pas[]`), `page_bytes` each.
    pub(crate) pas: Vec<u64>,
    /// `4 KiB << log_page_size`. `page_offset` is always 0 (CREATE_EQ refuses anything else).
    pub(crate) page_bytes: u64,
    pub(crate) log_nent: u32,
    /// `event_bitmask[4]`: bit `n` of word 0 = event type `n`.
    pub(crate) bitmask: [u64; 4],
    /// `eqc.intr`.
    pub(crate) intr: u16,
    /// EQEs posted (wrapping).
    pub(crate) pi: u32,
    /// The consumer index the driver last wrote, extended to 32 bits.
    pub(crate) ci: u32,
    /// The next EQE interrupts (starts disarmed).
    pub(crate) armed: bool,
    pub(crate) interrupts: u64,
    pub(crate) overruns: u64,
}

impl Eq {
    fn nent(&self) -> u32 {
        1 << self.log_nent
    }

    /// Bus address of entry `idx` (< nent), from the `pas[]` pages CREATE_EQ gave.
    fn entry_iova(&self, idx: u32) -> Option<u64> {
        let off = u64::from(idx) * c::mlx5_eqe::SIZE as u64;
        let page = usize::try_from(off / self.page_bytes).ok()?;
        self.pas.get(page)?.checked_add(off % self.page_bytes)
    }
}

/// The EQ table: every EQ by number, and the number CREATE_EQ tries next.
#[derive(Debug)]
pub(crate) struct EqTable {
    map: BTreeMap<u32, Eq>,
    next: u32,
}

impl Deref for EqTable {
    type Target = BTreeMap<u32, Eq>;
    #[inline]
    fn deref(&self) -> &BTreeMap<u32, Eq> {
        &self.map
    }
}

impl DerefMut for EqTable {
    #[inline]
    fn deref_mut(&mut self) -> &mut BTreeMap<u32, Eq> {
        &mut self.map
    }
}

impl EqTable {
    pub(crate) fn new() -> Self {
        EqTable { map: BTreeMap::new(), next: 1 }
    }
}

/// What the EQ commands need of the rest of the firmware, and nothing more.
pub(crate) struct EqFw<'a> {
    pub(crate) caps: &'a Caps,
    /// The allocated UAR pages.
    pub(crate) uars: &'a IdSet,
    /// Whether a CQ sends its completion events to an EQ (which then cannot be destroyed).
    pub(crate) in_use: &'a dyn Fn(u32) -> bool,
}

/// The event types this device can report, one bit each (bit `n` of word 0 = type `n`): completions, commands,
/// page requests, internal errors, the affiliated and port events of `MLX5_ASYNC_EVENT_MASK`, and the types each
/// capability adds (the ones `gather_async_events_mask` checks in Linux `eq.c`). CREATE_EQ refuses any other bit.
pub(crate) fn supported_events(caps: &Caps) -> [u64; 4] {
    use ifc::cmd_hca_cap as g;
    let mut m = u64::from(consts::MLX5_ASYNC_EVENT_MASK);
    for t in [
        consts::MLX5_EVENT_TYPE_COMP,
        consts::MLX5_EVENT_TYPE_CMD,
        consts::MLX5_EVENT_TYPE_PAGE_REQUEST,
        consts::MLX5_EVENT_TYPE_INTERNAL_ERROR,
    ] {
        m |= 1 << t;
    }
    let on = |f| caps.gen(f) != 0;
    let eth = caps.gen(g::PORT_TYPE) == consts::MLX5_CAP_PORT_TYPE_ETH;
    for (yes, t) in [
        (on(g::VPORT_GROUP_MANAGER) && eth, consts::MLX5_EVENT_TYPE_NIC_VPORT_CHANGE),
        (on(g::GENERAL_NOTIFICATION_EVENT), consts::MLX5_EVENT_TYPE_GENERAL_EVENT),
        (on(g::PORT_MODULE_EVENT), consts::MLX5_EVENT_TYPE_PORT_MODULE_EVENT),
        (on(g::FPGA), consts::MLX5_EVENT_TYPE_FPGA_ERROR),
        (on(g::FPGA), consts::MLX5_EVENT_TYPE_FPGA_QP_ERROR),
        (caps.gen_max(g::DCT) != 0, consts::MLX5_EVENT_TYPE_DCT_DRAINED),
        (on(g::TEMP_WARN_EVENT), consts::MLX5_EVENT_TYPE_TEMP_WARN_EVENT),
        (on(g::MAX_NUM_OF_MONITOR_COUNTERS), consts::MLX5_EVENT_TYPE_MONITOR_COUNTER),
        (caps.gen_max(g::VHCA_STATE) != 0, consts::MLX5_EVENT_TYPE_VHCA_STATE_CHANGE),
    ] {
        if yes {
            m |= 1 << t;
        }
    }
    [m, 0, 0, 0]
}

impl EqTable {
    /// The lowest-numbered EQ subscribed to `event_type`.
    pub(crate) fn subscriber(&self, event_type: u8) -> Option<u32> {
        let (word, bit) = (usize::from(event_type / 64), event_type % 64);
        self.map.iter().find(|(_, eq)| eq.bitmask[word] >> bit & 1 == 1).map(|(&eqn, _)| eqn)
    }

    pub(crate) fn info(&self, eqn: u8) -> Option<EqInfo> {
        let eq = self.map.get(&u32::from(eqn))?;
        Some(EqInfo {
            nent: 1 << eq.log_nent,
            pi: eq.pi,
            ci: eq.ci,
            armed: eq.armed,
            interrupts: eq.interrupts,
            overruns: eq.overruns,
            uar_page: eq.uar,
            event_bitmask: eq.bitmask,
            intr: eq.intr,
        })
    }

    pub(super) fn create(&mut self, fw: &EqFw, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::create_eq_in as i;
        use ifc::eqc as q;
        let ctx = i::EQ_CONTEXT_ENTRY;
        let log_size = rd(inp, q::LOG_EQ_SIZE.at(ctx));
        if log_size > fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_EQ_SZ) {
            return Err(bad_param(syndrome::LOG_SIZE));
        }
        let uar = rd(inp, q::UAR_PAGE.at(ctx));
        if !fw.uars.contains(uar) {
            return Err(bad_param(syndrome::UAR_INVALID));
        }
        if rd(inp, q::PAGE_OFFSET.at(ctx)) != 0 {
            return Err(bad_param(syndrome::PAGE_OFFSET));
        }
        let page_bytes = FW_PAGE << rd(inp, q::LOG_PAGE_SIZE.at(ctx));
        let bytes = (1u64 << log_size) * c::mlx5_eqe::SIZE as u64;
        check_pas(dma, inp, i::PAS, bytes, page_bytes)?;
        let pas = (0..bytes.div_ceil(page_bytes)).map(|k| inp.get64(i::PAS.elem(k as u32))).collect();
        let mut bitmask = [0u64; 4];
        for (k, w) in bitmask.iter_mut().enumerate() {
            *w = inp.get64(i::EVENT_BITMASK.elem(k as u32));
        }
        // Firmware refuses a subscription to an event it cannot report, as it refuses any bad field.
        let supported = supported_events(fw.caps);
        if bitmask.iter().zip(supported).any(|(&w, s)| w & !s != 0) {
            return Err(bad_param(syndrome::EQ_EVENT_TYPE));
        }
        let max = 1u32 << fw.caps.gen(ifc::cmd_hca_cap::LOG_MAX_EQ).min(8);
        if self.map.len() as u32 >= max {
            return Err(err(CmdStatus::NoRes, syndrome::NO_RESOURCES));
        }
        // eq_number is an 8-bit field.
        let eqn = alloc_id(&self.map, &mut self.next, 0, 1 << ifc::create_eq_out::EQ_NUMBER.width)
            .ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        let eq = Eq {
            uar,
            pas,
            page_bytes,
            log_nent: log_size,
            bitmask,
            intr: rd(inp, q::INTR.at(ctx)) as u16,
            pi: 0,
            ci: 0,
            armed: false,
            interrupts: 0,
            overruns: 0,
        };
        self.map.insert(eqn, eq);
        out.set(ifc::create_eq_out::EQ_NUMBER, eqn);
        Ok(())
    }

    pub(super) fn destroy(&mut self, fw: &EqFw, inp: &[u8]) -> Result<(), CmdErr> {
        let eqn = rd(inp, ifc::destroy_eq_in::EQ_NUMBER);
        if !self.map.contains_key(&eqn) {
            return Err(bad_param(syndrome::EQ_INVALID));
        }
        if (fw.in_use)(eqn) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.map.remove(&eqn);
        Ok(())
    }
}

/// What posting an EQE touches, borrowed from the device: the EQs, device memory, the event log, the health
/// (an overrun kills the firmware) and the clock. The datapath and the command engine build one per event.
pub(crate) struct EqPost<'a> {
    pub(crate) eqs: &'a mut EqTable,
    pub(crate) dma: &'a mut DmaSpace,
    pub(crate) events: &'a mut Vec<SimEvent>,
    pub(crate) regs: &'a mut Regs,
    pub(crate) clock: &'a Clock,
}

impl EqPost<'_> {
    /// A shorter-lived view over the same borrows, for a callee that takes its own.
    #[inline]
    pub(crate) fn reborrow(&mut self) -> EqPost<'_> {
        EqPost { eqs: self.eqs, dma: self.dma, events: self.events, regs: self.regs, clock: self.clock }
    }

    /// Posts an EQE to the lowest-numbered EQ subscribed to `event_type`; returns that EQ when it was written.
    pub(crate) fn post_eqe(&mut self, event_type: u8, sub_type: u8, data: &[u8; EQE_DATA_LEN]) -> Option<u8> {
        // A dead or vanished device writes nothing.
        if self.regs.dead() {
            return None;
        }
        let eqn = self.eqs.subscriber(event_type)?;
        self.post_eqe_to(eqn, event_type, sub_type, data)
    }

    /// Posts an EQE to EQ `eqn`, whatever it subscribes to (completion events are routed by the CQ's `c_eqn`);
    /// returns `eqn` when it was written.
    pub(crate) fn post_eqe_to(
        &mut self,
        eqn: u32,
        event_type: u8,
        sub_type: u8,
        data: &[u8; EQE_DATA_LEN],
    ) -> Option<u8> {
        if self.regs.dead() {
            return None;
        }
        let eqn8 = eqn as u8;
        let eq = self.eqs.get_mut(&eqn)?;
        if eq.pi.wrapping_sub(eq.ci) >= eq.nent() {
            // Hardware never overwrites an entry the driver has not consumed; it reports a fatal error instead.
            eq.overruns += 1;
            self.events.push(SimEvent::EqOverrun { eqn: eqn8 });
            health::fail(
                self.regs,
                self.events,
                self.clock.now_ns(),
                consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_ASYNCHRONOUS_EQ_BUF_OVERRUN,
            );
            return None;
        }
        let Some(iova) = eq.entry_iova(eq.pi & (eq.nent() - 1)) else {
            self.events.push(SimEvent::EqeUnwritable { eqn: eqn8 });
            return None;
        };
        let mut eqe = [0u8; c::mlx5_eqe::SIZE];
        eqe[c::mlx5_eqe::TYPE.off] = event_type;
        eqe[c::mlx5_eqe::SUB_TYPE.off] = sub_type;
        eqe[c::mlx5_eqe::DATA.off..c::mlx5_eqe::DATA.end()].copy_from_slice(data);
        // Hardware writes owner 0 on the first pass over the ring, 1 on the second, and so on.
        let owner = ((eq.pi >> eq.log_nent) & 1) as u8;
        let own = c::mlx5_eqe::OWNER;
        let mut ok = self.dma.write(iova, &eqe[..own.off]).is_ok();
        ok &= self.dma.write(iova + own.end() as u64, &eqe[own.end()..]).is_ok();
        if ok {
            // The entry must be visible before the owner byte that hands it to the driver.
            fence(Ordering::SeqCst);
            ok = self.dma.write_u8_volatile(iova + own.off as u64, owner).is_ok();
        }
        if !ok {
            self.events.push(SimEvent::EqeUnwritable { eqn: eqn8 });
            return None;
        }
        eq.pi = eq.pi.wrapping_add(1);
        self.events.push(SimEvent::Eqe { eqn: eqn8, event_type, sub_type });
        if eq.armed {
            eq.armed = false;
            eq.interrupts += 1;
            self.events.push(SimEvent::EqInterrupt { eqn: eqn8 });
        }
        Some(eqn8)
    }

    /// Posts the command-completion EQE for `slot` when an EQ subscribes to command events.
    pub(crate) fn post_cmd_completion(&mut self, slot: u8) {
        self.post_eqe(consts::MLX5_EVENT_TYPE_CMD, 0, &cmd_data(slot));
    }

    /// Firmware asks for `num_pages` (negative: offers that many back). The accounting changes now; the EQE is
    /// posted now when an EQ subscribes to page requests, else held for `flush_page_requests`.
    pub(crate) fn page_request(&mut self, pages: &mut Pages, state: HcaState, held: &mut bool, num_pages: i32) {
        if self.regs.dead() || num_pages == 0 {
            return;
        }
        pages.account_page_request(state, num_pages);
        if *held || self.eqs.subscriber(consts::MLX5_EVENT_TYPE_PAGE_REQUEST).is_none() {
            // Folded into the held request, whose balance includes this one.
            *held = true;
            self.flush_page_requests(pages, held);
        } else {
            self.post_eqe(consts::MLX5_EVENT_TYPE_PAGE_REQUEST, 0, &page_req_data(num_pages));
        }
    }

    /// Posts the held page request, if any, once an EQ subscribes: one request for the balance then due (what
    /// QUERY_PAGES(regular) reports), which covers every request made while nobody listened.
    pub(crate) fn flush_page_requests(&mut self, pages: &Pages, held: &mut bool) {
        if !*held || self.regs.dead() || self.eqs.subscriber(consts::MLX5_EVENT_TYPE_PAGE_REQUEST).is_none() {
            return;
        }
        *held = false;
        let balance = pages.page_balance().clamp(i32::MIN.into(), i32::MAX.into()) as i32;
        if balance != 0 {
            self.post_eqe(consts::MLX5_EVENT_TYPE_PAGE_REQUEST, 0, &page_req_data(balance));
        }
    }

    /// Posts an affiliated QP event (`data.qp_srq`: queue type QP, the QP number) to the EQ subscribed to
    /// `event_type`; returns that EQ when the EQE was written.
    pub(crate) fn post_qp_event(&mut self, event_type: u8, qpn: u32) -> Option<u8> {
        let q = c::mlx5_eqe_qp_srq::QP_SRQ_N;
        let mut data = [0u8; EQE_DATA_LEN];
        data[c::mlx5_eqe_qp_srq::TYPE.off] = consts::MLX5_EVENT_QUEUE_TYPE_QP;
        data[q.off..q.off + q.len].copy_from_slice(&(qpn & 0xff_ffff).to_be_bytes());
        self.post_eqe(event_type, 0, &data)
    }

    /// Posts a PORT_CHANGE EQE of `sub_type` for port 1; returns the EQ it went to.
    pub(crate) fn port_change(&mut self, sub_type: u8) -> Option<u8> {
        use mlx5_core::prm::c;
        let mut data = [0u8; EQE_DATA_LEN];
        data[c::mlx5_eqe_port_state::PORT.off] = 1 << 4;
        self.post_eqe(consts::MLX5_EVENT_TYPE_PORT_CHANGE, sub_type, &data)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Mode;
    use crate::config::SimConfig;
    use crate::device::lock;
    use crate::fault::Fault;
    use crate::fw::eq::EqInfo;
    use crate::regs::Health;
    use crate::testkit::submit::Harness;
    use mlx5_core::hal::{DmaRegion, Mmio};
    use mlx5_core::prm::{ifc, MsgBuf};
    use std::time::{Duration, Instant};

    /// Offset in a UAR page of the EQ doorbell that updates the consumer index and arms.
    const EQ_DB_ARM: usize = consts::MLX5_EQ_DOORBELL_OFFSET as usize;

    const PAGE_REQ_MASK: u64 = 1 << consts::MLX5_EVENT_TYPE_PAGE_REQUEST;
    const REGULAR: u16 = consts::MLX5_QUERY_PAGES_IN_OP_MOD_REGULAR_PAGES;

    fn owner(buf: &DmaRegion, idx: usize) -> u8 {
        Harness::eqe(buf, idx)[c::mlx5_eqe::OWNER.off]
    }

    fn typ(e: &[u8]) -> u8 {
        e[c::mlx5_eqe::TYPE.off]
    }

    /// `num_pages` of a page-request EQE.
    fn num_pages(e: &[u8]) -> i32 {
        let f = c::mlx5_eqe_page_req::NUM_PAGES;
        e.read_u32(c::mlx5_eqe::DATA.off + f.off) as i32
    }

    fn func_id(e: &[u8]) -> u16 {
        let f = c::mlx5_eqe_page_req::FUNC_ID;
        let at = c::mlx5_eqe::DATA.off + f.off;
        u16::from_be_bytes([e[at], e[at + 1]])
    }

    fn vector(e: &[u8]) -> u32 {
        e.read_u32(c::mlx5_eqe::DATA.off + c::mlx5_eqe_cmd::VECTOR.off)
    }

    fn alloc_pd_in() -> Vec<u8> {
        let mut inp = vec![0u8; ifc::alloc_pd_in::SIZE_BYTES];
        inp.set(ifc::alloc_pd_in::OPCODE, consts::MLX5_CMD_OP_ALLOC_PD.into());
        inp
    }

    fn marked(k: u8) -> [u8; EQE_DATA_LEN] {
        let mut d = [0u8; EQE_DATA_LEN];
        d[c::mlx5_eqe_port_state::PORT.off] = 1;
        d[0] = k;
        d
    }

    /// Brought up, with a page-request EQ (8 entries) whose first request, the regular pages, was served.
    fn with_page_eq(h: &mut Harness) -> (u32, u8, DmaRegion) {
        h.bring_up();
        let uar = h.alloc_uar();
        let (s, eqn, buf) = h.create_eq(uar, 3, PAGE_REQ_MASK);
        assert_eq!(s, 0);
        wait_pi(h, eqn, 1);
        let e = Harness::eqe(&buf, 0);
        assert_eq!((typ(&e), num_pages(&e), func_id(&e)), (consts::MLX5_EVENT_TYPE_PAGE_REQUEST, 4, 0));
        assert_eq!(h.give_pages(4), (0, 0));
        (uar, eqn, buf)
    }

    /// Waits (threaded mode) until EQ `eqn` has `pi` EQEs.
    fn wait_pi(h: &Harness, eqn: u8, pi: u32) {
        let start = Instant::now();
        while h.dev.eq_info(eqn).map(|i| i.pi) != Some(pi) {
            assert!(h.threaded && start.elapsed() < Duration::from_secs(10), "EQ {eqn} never reached pi {pi}");
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    #[test]
    fn eqes_go_to_the_lowest_subscriber_with_owner_per_pass_and_overrun_is_fatal() {
        let mut h = Harness::inline();
        h.bring_up();
        let uar = h.alloc_uar();
        let (_, a, abuf) = h.create_eq(uar, 2, 1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE);
        let (_, b, _bbuf) = h.create_eq(uar, 2, 1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE);
        assert!(a < b);
        assert_eq!(h.dev.post_event(consts::MLX5_EVENT_TYPE_CQ_ERROR, 0, marked(0)), None);
        let sub = consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE;
        assert_eq!(h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, sub, marked(0)), Some(a));
        let e = Harness::eqe(&abuf, 0);
        assert_eq!((typ(&e), e[c::mlx5_eqe::SUB_TYPE.off]), (consts::MLX5_EVENT_TYPE_PORT_CHANGE, sub));
        assert_eq!(&e[c::mlx5_eqe::DATA.off..c::mlx5_eqe::DATA.end()], &marked(0));
        // First pass: hardware writes owner 0; untouched entries keep the driver's initial 1.
        assert_eq!((owner(&abuf, 0), owner(&abuf, 1)), (0, 1));
        assert!(h.dev.events().contains(&SimEvent::Eqe {
            eqn: a,
            event_type: consts::MLX5_EVENT_TYPE_PORT_CHANGE,
            sub_type: sub
        }));
        // The EQ starts disarmed: no interrupt.
        assert!(!h.dev.events().iter().any(|e| matches!(e, SimEvent::EqInterrupt { .. })));
        for k in 1..4 {
            assert_eq!(h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, sub, marked(k)), Some(a));
            assert_eq!(owner(&abuf, k.into()), 0);
        }
        h.eq_doorbell(uar, a, 4, true);
        assert!(h.dev.events().contains(&SimEvent::EqDoorbell { eqn: a, ci: 4, arm: true }));
        // Second pass: owner 1, and the armed EQ interrupts once.
        h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, sub, marked(4));
        assert_eq!(owner(&abuf, 0), 1);
        assert_eq!(Harness::eqe(&abuf, 0)[c::mlx5_eqe::DATA.off], 4);
        assert!(h.dev.events().contains(&SimEvent::EqInterrupt { eqn: a }));
        let info = h.dev.eq_info(a).unwrap();
        assert_eq!((info.pi, info.ci, info.armed, info.interrupts), (5, 4, false, 1));
        for k in 5..8 {
            h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, sub, marked(k));
        }
        assert_eq!(h.dev.eq_info(a).unwrap().interrupts, 1);
        // Full: nothing is overwritten and the firmware dies with the overrun syndrome.
        assert_eq!(h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, sub, marked(8)), None);
        assert_eq!(Harness::eqe(&abuf, 0)[c::mlx5_eqe::DATA.off], 4);
        assert!(h.dev.events().contains(&SimEvent::EqOverrun { eqn: a }));
        let synd = consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_ASYNCHRONOUS_EQ_BUF_OVERRUN;
        assert_eq!(h.dev.health(), Health::Failed { synd });
        let hb = c::mlx5_init_seg::HEALTH.off + c::health_buffer::SYND.off;
        assert_eq!(h.mmio.read32(hb & !3) >> (8 * (3 - (hb & 3))) & 0xff, u32::from(synd));
        assert_eq!(h.dev.eq_info(a).unwrap().overruns, 1);
        // A dead firmware posts nothing more, even to the other EQ.
        assert_eq!(h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, sub, marked(9)), None);
        assert_eq!(h.dev.eq_info(b).unwrap().pi, 0);
    }

    #[test]
    fn eq_doorbell_is_validated_and_arms() {
        let mut h = Harness::inline();
        h.bring_up();
        let uar = h.alloc_uar();
        let uar2 = h.alloc_uar();
        let (_, eqn, _buf) = h.create_eq(uar, 3, 1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE);
        let bad = |h: &Harness, why: &str| {
            h.dev.events().iter().any(|e| matches!(e, SimEvent::BadEqDoorbell { why: w, .. } if *w == why))
        };
        h.eq_doorbell(uar2 + 5, eqn, 0, true);
        assert!(bad(&h, "UAR page not allocated"));
        h.eq_doorbell(uar, eqn + 1, 0, true);
        assert!(bad(&h, "no such EQ"));
        h.eq_doorbell(uar2, eqn, 0, true);
        assert!(bad(&h, "EQ uses another UAR page"));
        h.eq_doorbell(uar, eqn, 1, false);
        assert!(bad(&h, "consumer index beyond producer index"));
        assert!(!h.dev.eq_info(eqn).unwrap().armed);
        // Other UAR offsets are plain UAR writes.
        // A BlueFlame register (`MLX5_BF_OFFSET`): not interpreted yet.
        let other = crate::mmio::SimMmio::uar_offset(uar) + consts::MLX5_BF_OFFSET as usize;
        h.mmio.write32(other, 5);
        assert!(h.dev.events().contains(&SimEvent::UarWrite { off: other, val: 5 }));
        // The EQ doorbells are 32-bit registers: a 64-bit write over one is refused.
        let db = crate::mmio::SimMmio::uar_offset(uar) + EQ_DB_ARM;
        h.mmio.write64(db, u64::from(u32::from(eqn) << 24) << 32);
        let why = "64-bit write to a 32-bit EQ doorbell";
        assert!(h.dev.events().contains(&SimEvent::BadEqDoorbell { off: db, val: u32::from(eqn) << 24, why }));
        assert!(!h.dev.eq_info(eqn).unwrap().armed);

        h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, 0, marked(0));
        h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, 0, marked(1));
        h.eq_doorbell(uar, eqn, 1, false);
        assert!(h.dev.events().contains(&SimEvent::EqDoorbell { eqn, ci: 1, arm: false }));
        assert!(!h.dev.eq_info(eqn).unwrap().armed);
        // Arming with an unconsumed EQE interrupts at once and leaves the EQ disarmed.
        h.eq_doorbell(uar, eqn, 1, true);
        assert!(h.dev.events().contains(&SimEvent::EqInterrupt { eqn }));
        let info = h.dev.eq_info(eqn).unwrap();
        assert_eq!((info.armed, info.interrupts), (false, 1));
        h.eq_doorbell(uar, eqn, 2, true);
        let info = h.dev.eq_info(eqn).unwrap();
        let want = EqInfo {
            nent: 8,
            pi: 2,
            ci: 2,
            armed: true,
            interrupts: 1,
            overruns: 0,
            uar_page: uar,
            event_bitmask: [1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE, 0, 0, 0],
            intr: 0,
        };
        assert_eq!(info, want);
        assert_eq!(h.dev.eq_info(eqn + 1), None);
    }

    #[test]
    fn eq_doorbell_consumer_index_wraps_at_24_bits() {
        let mut h = Harness::inline();
        h.bring_up();
        let uar = h.alloc_uar();
        let (_, eqn, buf) = h.create_eq(uar, 3, 1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE);
        {
            let mut st = lock(&h.dev.shared);
            let eq = st.fw.eqs.get_mut(&u32::from(eqn)).unwrap();
            (eq.pi, eq.ci) = (0x00ff_fffe, 0x00ff_fffe);
        }
        for k in 0..3 {
            h.dev.post_event(consts::MLX5_EVENT_TYPE_PORT_CHANGE, 0, marked(k));
        }
        // Entries 6, 7, 0; pass 0x1f_ffff is odd, pass 0x20_0000 even.
        assert_eq!((owner(&buf, 6), owner(&buf, 7), owner(&buf, 0)), (1, 1, 0));
        h.eq_doorbell(uar, eqn, 0x0100_0001, false);
        assert!(h.dev.events().contains(&SimEvent::EqDoorbell { eqn, ci: 0x0100_0001, arm: false }));
        h.eq_doorbell(uar, eqn, 0x0100_0002, false);
        assert!(matches!(h.dev.events().last(), Some(SimEvent::BadEqDoorbell { .. })));
    }

    #[test]
    fn create_eq_refuses_event_types_the_device_cannot_report() {
        let mut h = Harness::inline();
        h.bring_up();
        let uar = h.alloc_uar();
        let before = h.dev.executed().len();
        // The simulated device has no temperature sensor events (`temp_warn_event` 0) and no GPIO events.
        for t in [consts::MLX5_EVENT_TYPE_TEMP_WARN_EVENT, consts::MLX5_EVENT_TYPE_GPIO_EVENT] {
            let (s, _, _buf) = h.create_eq(uar, 3, 1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE | 1 << t);
            assert_eq!(s, consts::MLX5_CMD_STAT_BAD_PARAM_ERR, "type {t}");
        }
        let refused: Vec<(u8, u32)> = h.dev.executed()[before..].iter().map(|c| (c.status, c.syndrome)).collect();
        let bad = (consts::MLX5_CMD_STAT_BAD_PARAM_ERR, syndrome::EQ_EVENT_TYPE);
        assert_eq!(refused, vec![bad, bad]);
        // DCT_DRAINED needs the maximum `dct` capability, which the device does not report (no DC transport).
        let (s, _, _buf) = h.create_eq(uar, 3, 1 << consts::MLX5_EVENT_TYPE_DCT_DRAINED);
        assert_eq!(s, consts::MLX5_CMD_STAT_BAD_PARAM_ERR);
        // Types the capabilities offer are taken: completions, internal errors.
        let ok = 1 << consts::MLX5_EVENT_TYPE_COMP
            | 1 << consts::MLX5_EVENT_TYPE_INTERNAL_ERROR
            | u64::from(consts::MLX5_ASYNC_EVENT_MASK);
        let (s, eqn, _buf) = h.create_eq(uar, 3, ok);
        assert_eq!((s, h.dev.eq_info(eqn).unwrap().event_bitmask), (0, [ok, 0, 0, 0]));
    }

    #[test]
    fn command_completions_post_cmd_eqes() {
        let mut h = Harness::inline();
        h.bring_up();
        let uar = h.alloc_uar();
        let (s, eqn, buf) = h.create_eq(uar, 3, 1 << consts::MLX5_EVENT_TYPE_CMD);
        assert_eq!(s, 0);
        // The CREATE_EQ that made the command EQ ran before any EQ took command events: no EQE for it. Linux polls
        // that command and only then listens for command events; under UML a late interrupt for such an EQE
        // completed the next command early, then "Command completion arrived after timeout" and a refcount
        // underflow followed.
        assert_eq!(h.dev.eq_info(eqn).unwrap().pi, 0);
        let p = h.post(5, &alloc_pd_in(), 16);
        h.ring(5);
        assert_eq!(h.status_own(5), 0);
        h.release(p);
        let e = Harness::eqe(&buf, 0);
        assert_eq!((typ(&e), vector(&e), e[c::mlx5_eqe::OWNER.off]), (consts::MLX5_EVENT_TYPE_CMD, 1 << 5, 0));
        assert_eq!(h.dev.eq_info(eqn).unwrap().pi, 1);
    }

    #[test]
    fn regular_pages_are_requested_when_a_page_eq_appears() {
        let mut h = Harness::inline();
        let (_, eqn, _) = with_page_eq(&mut h);
        assert_eq!(h.dev.eq_info(eqn).unwrap().pi, 1);
        assert_eq!(h.query_pages(REGULAR), 0);
        assert_eq!(h.dev.pages_owned(), 8 + 16 + 4);
    }

    #[test]
    fn requests_made_before_any_page_eq_are_posted_as_one_balance() {
        let mut h = Harness::inline();
        h.bring_up();
        h.dev.request_pages(5);
        h.dev.inject(Fault::PageRequest { opcode: consts::MLX5_CMD_OP_ALLOC_UAR, num_pages: 2 });
        let uar = h.alloc_uar();
        assert_eq!(h.query_pages(REGULAR), 4 + 5 + 2);
        let (_, eqn, buf) = h.create_eq(uar, 3, PAGE_REQ_MASK);
        assert_eq!(h.dev.eq_info(eqn).unwrap().pi, 1);
        assert_eq!(num_pages(&Harness::eqe(&buf, 0)), 11);
    }

    #[test]
    fn page_requests_grow_and_shrink_the_need() {
        let mut h = Harness::inline();
        let (_, eqn, buf) = with_page_eq(&mut h);
        h.dev.inject(Fault::PageRequest { opcode: consts::MLX5_CMD_OP_ALLOC_PD, num_pages: 3 });
        assert_eq!(h.cmd(&alloc_pd_in(), 16).0, 0);
        assert_eq!(num_pages(&Harness::eqe(&buf, 1)), 3);
        assert_eq!(h.query_pages(REGULAR), 3);
        h.give_pages(3);
        h.dev.clear_faults();
        // Firmware offers two pages back; the next take returns exactly those.
        h.dev.request_pages(-2);
        assert_eq!(num_pages(&Harness::eqe(&buf, 2)), -2);
        assert_eq!(h.dev.eq_info(eqn).unwrap().pi, 3);
        assert_eq!(h.query_pages(REGULAR), -2);
        assert_eq!(h.take_pages(10).1.len(), 2);
        assert_eq!(h.dev.pages_owned(), 8 + 16 + 4 + 3 - 2);
        assert_eq!(h.query_pages(REGULAR), 0);
        // Pages beyond the need are accepted, and are what a take returns.
        assert_eq!(h.give_pages(5), (0, 0));
        assert_eq!(h.query_pages(REGULAR), -5);
        assert_eq!(h.take_pages(10).1.len(), 5);
        // An initialized HCA keeps what it needs.
        assert_eq!(h.take_pages(10).1.len(), 0);
        assert_eq!(h.dev.pages_owned(), 29);
        // After TEARDOWN_HCA everything comes back.
        let (s, _, _) = h.simple(consts::MLX5_CMD_OP_TEARDOWN_HCA, 0, 16, 16);
        assert_eq!(s, 0);
        assert_eq!(h.take_pages(64).1.len(), 29);
        assert_eq!(h.dev.pages_owned(), 0);
    }

    #[test]
    fn need_pages_stalls_until_the_pages_slot_gives_them_inline() {
        let mut h = Harness::inline();
        let (_, eqn, buf) = with_page_eq(&mut h);
        let op = consts::MLX5_CMD_OP_ALLOC_PD;
        h.dev.inject(Fault::NeedPages { opcode: op, pages: 3 });
        let done = h.dev.executed().len();
        let pd = h.post(0, &alloc_pd_in(), 16);
        h.ring(0);
        assert_eq!(h.status_own(0) & 1, 1);
        assert!(h.dev.events().contains(&SimEvent::WaitingForPages { slot: 0, opcode: op, pages: 3 }));
        assert_eq!(h.dev.eq_info(eqn).unwrap().pi, 2);
        assert_eq!(num_pages(&Harness::eqe(&buf, 1)), 3);
        assert_eq!(h.query_pages_on(30, REGULAR), 3);
        h.ring(0);
        assert!(h.dev.events().contains(&SimEvent::DoorbellBusy { slot: 0 }));
        // Two pages are not enough: MANAGE_PAGES completes, the stalled command does not.
        let inp = h.give_input(2);
        let g = h.post(31, &inp, 16);
        h.ring(31);
        assert_eq!(h.status_own(31), 0);
        assert_eq!(h.status_own(0) & 1, 1);
        h.release(g);
        let inp = h.give_input(1);
        let g = h.post(31, &inp, 16);
        h.ring(31);
        assert_eq!((h.status_own(31), h.status_own(0)), (0, 0));
        h.release(g);
        let out = h.output(&pd);
        assert_eq!(MsgBuf::get(&out[..], ifc::mbox_out::STATUS), 0);
        assert_ne!(MsgBuf::get(&out[..], ifc::alloc_pd_out::PD), 0);
        h.release(pd);
        let ex: Vec<(u8, u16)> = h.dev.executed()[done..].iter().map(|e| (e.slot, e.opcode)).collect();
        let mp = consts::MLX5_CMD_OP_MANAGE_PAGES;
        let qp = consts::MLX5_CMD_OP_QUERY_PAGES;
        assert_eq!(ex, vec![(30, qp), (31, mp), (31, mp), (0, op)]);
        assert_eq!(h.query_pages(REGULAR), 0);
        // The fault was for one command only; a need of zero pages does not stall.
        assert_eq!(h.cmd(&alloc_pd_in(), 16).0, 0);
        h.dev.inject(Fault::NeedPages { opcode: op, pages: 0 });
        assert_eq!(h.cmd(&alloc_pd_in(), 16).0, 0);
    }

    #[test]
    fn need_pages_stalls_until_the_pages_slot_gives_them_threaded() {
        let mut h = Harness::new(SimConfig { mode: Mode::Threaded, ..SimConfig::default() });
        let (_, eqn, buf) = with_page_eq(&mut h);
        let op = consts::MLX5_CMD_OP_ALLOC_PD;
        h.dev.inject(Fault::NeedPages { opcode: op, pages: 2 });
        let pd = h.post(0, &alloc_pd_in(), 16);
        h.ring(0);
        wait_pi(&h, eqn, 2);
        assert_eq!(num_pages(&Harness::eqe(&buf, 1)), 2);
        assert_eq!(h.status_own(0) & 1, 1);
        let inp = h.give_input(2);
        let g = h.post(31, &inp, 16);
        h.ring(31);
        assert!(h.wait(31) && h.wait(0));
        assert_eq!(MsgBuf::get(&h.output(&pd)[..], ifc::mbox_out::STATUS), 0);
        let ex = h.dev.executed();
        let n = ex.len();
        assert_eq!((ex[n - 2].slot, ex[n - 1].slot), (31, 0));
        h.release(g);
        h.release(pd);
    }
}
