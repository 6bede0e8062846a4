//! The CM state machine (IBA 12.9) without I/O: MADs received are handed to [`Engine::recv`], MADs to send come
//! out of [`Engine::poll_output`], what the application sees comes out of [`Engine::poll_event`] (named as
//! rdma_cm's events), and retransmissions and timeouts run on the caller's clock in [`Engine::tick`]. `A` is
//! whatever names a peer's GSI QP to the caller (an address handle's attributes).
//!
//! What does not fit gets the spec's answer, as Linux's ib_cm gives it: a REQ for a service nobody listens on is
//! REJected (invalid service ID), a REP for a connection this side does not have is REJected (invalid
//! communication ID), REQs past the pending limit are REJected (no resources), a SIDR_REQ nobody serves gets a
//! SIDR_REP with status 1 (unsupported service ID), a REQ or REP unanswered after its
//! retries ends in `Unreachable` (ETIMEDOUT) and a REJ (timeout) to the peer, a DREQ for an unknown connection is
//! answered with a DREP; a MAD that does not parse is dropped and counted.

use std::collections::{HashMap, VecDeque};

use thiserror::Error;

use crate::cm::{self, CmMsg, CommIds, Dreq, MsgRejected, Rej, RejReason, Rep, Req, SidrRep, SidrReq};
use crate::mad::{MadError, MAD_LEN};

/// One connection's name on this side (IBA's Local Communication ID).
pub type CommId = u32;

/// Engine limits and the CM's timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EngineConfig {
    /// Passive connections waiting for the application or for the peer's RTU at once; a REQ past it is
    /// REJected with no resources.
    pub max_pending: usize,
    /// The first communication ID handed out (rdma_cm draws them at random; tests name them).
    pub first_comm_id: u32,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig { max_pending: 128, first_comm_id: 1 }
    }
}

/// What the application sees (`rdma_cm_event_type`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// `RDMA_CM_EVENT_CONNECT_REQUEST`: a REQ for a listened service; answer with accept or reject.
    ConnectRequest {
        /// The new connection.
        id: CommId,
        /// The request.
        req: Box<Req>,
    },
    /// `RDMA_CM_EVENT_ESTABLISHED`: the active side got the REP (and sent the RTU), or the passive side the RTU.
    Established {
        /// The connection.
        id: CommId,
        /// The peer's REP, on the active side.
        rep: Option<Box<Rep>>,
    },
    /// `RDMA_CM_EVENT_REJECTED`: the peer refused.
    Rejected {
        /// The connection.
        id: CommId,
        /// Why.
        reason: RejReason,
    },
    /// `RDMA_CM_EVENT_UNREACHABLE` with status ETIMEDOUT: a REQ or REP got no answer after its retries.
    Unreachable {
        /// The connection.
        id: CommId,
    },
    /// `RDMA_CM_EVENT_DISCONNECTED`: a DREQ arrived, or ours was answered (or timed out).
    Disconnected {
        /// The connection.
        id: CommId,
    },
    /// `RDMA_CM_EVENT_CONNECT_REQUEST` on a UD listener: a SIDR_REQ; answer with `sidr_accept` or `sidr_reject`.
    SidrRequest {
        /// The request's name here.
        id: CommId,
        /// The request.
        req: Box<SidrReq>,
    },
    /// `RDMA_CM_EVENT_ESTABLISHED` on a UD ID: the service's QPN and Q_Key.
    SidrResolved {
        /// The request.
        id: CommId,
        /// The serving QP.
        qpn: u32,
        /// Its Q_Key.
        qkey: u32,
    },
    /// `RDMA_CM_EVENT_UNREACHABLE` on a UD ID: the SIDR_REP's status was not success (1 unsupported service ID,
    /// 2 rejected, 3 no QP, 4 redirect, 5 unsupported class version).
    SidrFailed {
        /// The request.
        id: CommId,
        /// The SIDR_REP's status.
        status: u8,
    },
}

/// Why a call on the engine failed (errno in parentheses, as librdmacm would report it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum EngineError {
    /// Someone already listens on the service (EADDRINUSE).
    #[error("service ID {0:#x} already has a listener")]
    AddrInUse(u64),
    /// No connection has this ID (EINVAL).
    #[error("no connection {0}")]
    NoConnection(CommId),
    /// The connection is not in a state that allows the call (EINVAL).
    #[error("connection {id} is {state:?}")]
    BadState {
        /// The connection.
        id: CommId,
        /// Its state.
        state: State,
    },
    /// The received bytes are not a CM MAD this engine reads; dropped and counted.
    #[error("dropped a malformed CM MAD")]
    Malformed(#[source] MadError),
}

/// A connection's CM state (IBA 12.9.6), the states this engine has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Active: REQ sent, waiting for the REP.
    ReqSent,
    /// Passive: REQ received, waiting for the application.
    ReqRcvd,
    /// Passive: REP sent, waiting for the RTU.
    RepSent,
    /// Connected.
    Established,
    /// DREQ sent, waiting for the DREP.
    DreqSent,
}

/// Counters of what was dropped or refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    /// MADs that did not parse.
    pub malformed: u64,
    /// REQs refused: nobody listens.
    pub rej_no_listener: u64,
    /// REQs refused: too many pending.
    pub rej_no_resources: u64,
    /// REPs for unknown connections, REJected.
    pub rej_unknown_rep: u64,
    /// Messages for unknown connections, dropped.
    pub stale: u64,
    /// Duplicate REQs (a peer's retransmission), dropped or answered again.
    pub duplicate_req: u64,
    /// Retransmissions sent.
    pub retries: u64,
    /// SIDR_REQs for services nobody listens on, answered with status 1.
    pub sidr_unsupported: u64,
}

/// The SIDR_REP status of a service ID nobody listens on (`IB_SIDR_UNSUPPORTED`).
pub const SIDR_UNSUPPORTED: u8 = 1;
/// The SIDR_REP status the application's refusal gives (`IB_SIDR_REJECT`).
pub const SIDR_REJECT: u8 = 2;

/// A SIDR exchange: ours waiting for its reply, or a peer's waiting for the application.
#[derive(Debug)]
struct Sidr<A> {
    peer: A,
    tid: u64,
    /// Ours: the request, resent until answered. The peer's: its request ID and service.
    req: SidrReq,
    outgoing: bool,
    deadline_ns: u64,
    timeout_ns: u64,
    retries_left: u8,
}

#[derive(Debug)]
struct Conn<A> {
    state: State,
    peer: A,
    remote_comm_id: u32,
    remote_ca_guid: u64,
    remote_qpn: u32,
    passive: bool,
    /// The last message sent that expects an answer, its transaction and when to send it again.
    pending: Option<Box<CmMsg>>,
    tid: u64,
    deadline_ns: u64,
    timeout_ns: u64,
    retries_left: u8,
}

/// The connection manager of one port.
#[derive(Debug)]
pub struct Engine<A: Clone> {
    cfg: EngineConfig,
    ca_guid: u64,
    listeners: HashMap<u64, ()>,
    conns: HashMap<CommId, Conn<A>>,
    /// Passive connections by the peer's (CA GUID, communication ID), to spot a retransmitted REQ.
    by_remote: HashMap<(u64, u32), CommId>,
    next_comm_id: u32,
    next_tid: u64,
    out: VecDeque<(A, [u8; MAD_LEN])>,
    events: VecDeque<Event>,
    counters: Counters,
    sidr: HashMap<CommId, Sidr<A>>,
}

/// The CM's wait for an answer: 4.096 us * 2^t (IBA 12.6.5), doubled as ib_cm doubles it for the packet lifetime.
fn cm_timeout_ns(t: u8) -> u64 {
    2 * (4096u64 << t.min(31))
}

impl<A: Clone> Engine<A> {
    /// An engine for the port of CA `ca_guid`.
    pub fn new(ca_guid: u64, cfg: EngineConfig) -> Self {
        Engine {
            cfg,
            ca_guid,
            listeners: HashMap::new(),
            conns: HashMap::new(),
            by_remote: HashMap::new(),
            next_comm_id: cfg.first_comm_id,
            next_tid: 1,
            out: VecDeque::new(),
            events: VecDeque::new(),
            counters: Counters::default(),
            sidr: HashMap::new(),
        }
    }

    /// Listens on a service (`rdma_listen`).
    pub fn listen(&mut self, service_id: u64) -> Result<(), EngineError> {
        if self.listeners.insert(service_id, ()).is_some() {
            return Err(EngineError::AddrInUse(service_id));
        }
        Ok(())
    }

    /// Stops listening (`rdma_destroy_id` of a listener).
    pub fn unlisten(&mut self, service_id: u64) {
        self.listeners.remove(&service_id);
    }

    /// Sends a REQ (`rdma_connect`); its `local_comm_id` is replaced by the new connection's.
    pub fn connect(&mut self, now_ns: u64, peer: A, mut req: Req) -> CommId {
        let id = self.alloc_id();
        req.local_comm_id = id;
        req.local_ca_guid = self.ca_guid;
        let timeout_ns = cm_timeout_ns(req.remote_cm_response_timeout);
        let tid = self.tid();
        let mut conn = Conn {
            state: State::ReqSent,
            peer,
            remote_comm_id: 0,
            remote_ca_guid: 0,
            remote_qpn: 0,
            passive: false,
            pending: None,
            tid,
            deadline_ns: now_ns.saturating_add(timeout_ns),
            timeout_ns,
            retries_left: req.max_cm_retries,
        };
        self.send_expecting(&mut conn, CmMsg::Req(req));
        self.conns.insert(id, conn);
        id
    }

    /// Answers a connect request with a REP (`rdma_accept`); `rep`'s communication IDs are filled in.
    pub fn accept(&mut self, now_ns: u64, id: CommId, mut rep: Rep) -> Result<(), EngineError> {
        let mut conn = self.take_in(id, State::ReqRcvd)?;
        rep.local_comm_id = id;
        rep.remote_comm_id = conn.remote_comm_id;
        rep.local_ca_guid = self.ca_guid;
        conn.state = State::RepSent;
        conn.deadline_ns = now_ns.saturating_add(conn.timeout_ns);
        self.send_expecting(&mut conn, CmMsg::Rep(rep));
        self.conns.insert(id, conn);
        Ok(())
    }

    /// Refuses a connect request (`rdma_reject`): a REJ, consumer defined, with the application's private data.
    pub fn reject(&mut self, id: CommId, private_data: &[u8]) -> Result<(), EngineError> {
        let conn = self.take_in(id, State::ReqRcvd)?;
        let mut pd = [0u8; cm::private_len::REJ];
        let n = private_data.len().min(pd.len());
        pd[..n].copy_from_slice(&private_data[..n]);
        let rej = rej_msg(id, conn.remote_comm_id, MsgRejected::Req, RejReason::ConsumerDefined, pd);
        self.send(conn.peer.clone(), conn.tid, &rej);
        self.forget(id, &conn);
        Ok(())
    }

    /// Sends a DREQ (`rdma_disconnect`); `Disconnected` follows the DREP or the DREQ's timeout.
    pub fn disconnect(&mut self, now_ns: u64, id: CommId) -> Result<(), EngineError> {
        let mut conn = self.take_in(id, State::Established)?;
        let dreq = Dreq {
            local_comm_id: id,
            remote_comm_id: conn.remote_comm_id,
            remote_qpn: conn.remote_qpn,
            private_data: [0; cm::private_len::DREQ],
        };
        conn.state = State::DreqSent;
        conn.tid = self.tid();
        conn.deadline_ns = now_ns.saturating_add(conn.timeout_ns);
        conn.retries_left = 3;
        self.send_expecting(&mut conn, CmMsg::Dreq(dreq));
        self.conns.insert(id, conn);
        Ok(())
    }

    /// The application destroyed a connection's ID (`rdma_destroy_id`): as Linux's `cm_destroy_id`, a REQ or REP
    /// not yet answered is withdrawn with a REJ (timeout for our REQ, consumer defined otherwise), a request not
    /// yet answered is refused, an established connection gets a DREQ (sent once, not retried), and the engine
    /// forgets the connection at once; what the peer answers afterwards is stale.
    pub fn abort(&mut self, id: CommId) {
        if let Some(x) = self.sidr.remove(&id) {
            if !x.outgoing {
                self.send(x.peer, x.tid, &CmMsg::SidrRep(sidr_rep(&x.req, SIDR_REJECT, 0, 0)));
            }
            return;
        }
        let Some(conn) = self.conns.remove(&id) else { return };
        let (what, reason) = match conn.state {
            State::ReqSent => (Some(MsgRejected::Req), RejReason::Timeout),
            State::ReqRcvd => (Some(MsgRejected::Req), RejReason::ConsumerDefined),
            State::RepSent => (Some(MsgRejected::Rep), RejReason::ConsumerDefined),
            State::Established | State::DreqSent => (None, RejReason::ConsumerDefined),
        };
        match what {
            Some(what) => {
                let mut rej = rej_msg(id, conn.remote_comm_id, what, reason, [0; cm::private_len::REJ]);
                self.name_ca_in_timeout(&mut rej);
                self.send(conn.peer.clone(), conn.tid, &rej);
            }
            None if conn.state == State::Established => {
                let dreq = Dreq {
                    local_comm_id: id,
                    remote_comm_id: conn.remote_comm_id,
                    remote_qpn: conn.remote_qpn,
                    private_data: [0; cm::private_len::DREQ],
                };
                let tid = self.tid();
                self.send(conn.peer.clone(), tid, &CmMsg::Dreq(dreq));
            }
            None => {}
        }
        self.forget(id, &conn);
    }

    /// A MAD that arrived on QP1 from `peer`.
    pub fn recv(&mut self, now_ns: u64, peer: A, mad: &[u8]) -> Result<(), EngineError> {
        let (h, msg) = match CmMsg::parse(mad) {
            Ok(m) => m,
            Err(e) => {
                self.counters.malformed += 1;
                return Err(EngineError::Malformed(e));
            }
        };
        match msg {
            CmMsg::Req(req) => self.on_req(now_ns, peer, h.tid, req),
            CmMsg::Rep(rep) => self.on_rep(peer, h.tid, rep),
            CmMsg::Rtu(rtu) => self.on_rtu(rtu),
            CmMsg::Rej(rej) => self.on_rej(rej),
            CmMsg::Mra(mra) => {
                // The peer needs longer: wait its service timeout before the next retry.
                if let Some(c) = self.conns.get_mut(&mra.remote_comm_id) {
                    c.deadline_ns =
                        now_ns.saturating_add(cm_timeout_ns(mra.service_timeout)).saturating_add(c.timeout_ns);
                } else {
                    self.counters.stale += 1;
                }
            }
            CmMsg::Dreq(dreq) => self.on_dreq(peer, h.tid, dreq),
            CmMsg::Drep(drep) => {
                let id = drep.remote_comm_id;
                match self.conns.get(&id) {
                    Some(c) if c.state == State::DreqSent => {
                        let c = self.conns.remove(&id).expect("present");
                        self.forget(id, &c);
                        self.events.push_back(Event::Disconnected { id });
                    }
                    _ => self.counters.stale += 1,
                }
            }
            // SIDR is answered by its own service, not offered by this engine yet.
            CmMsg::SidrReq(req) => self.on_sidr_req(now_ns, peer, h.tid, req),
            CmMsg::SidrRep(rep) => self.on_sidr_rep(rep),
        }
        Ok(())
    }

    /// Retransmits what waits too long and gives up after the retries (`Unreachable`, or `Disconnected` for a
    /// DREQ), telling the peer with a REJ (timeout) where the spec asks for one.
    pub fn tick(&mut self, now_ns: u64) {
        let due: Vec<CommId> =
            self.sidr.iter().filter(|(_, x)| x.outgoing && x.deadline_ns <= now_ns).map(|(id, _)| *id).collect();
        for id in due {
            let mut x = self.sidr.remove(&id).expect("listed");
            if x.retries_left == 0 {
                self.events.push_back(Event::Unreachable { id });
                continue;
            }
            x.retries_left -= 1;
            x.deadline_ns = now_ns.saturating_add(x.timeout_ns);
            self.send(x.peer.clone(), x.tid, &CmMsg::SidrReq(x.req));
            self.counters.retries += 1;
            self.sidr.insert(id, x);
        }
        let due: Vec<CommId> = self
            .conns
            .iter()
            .filter(|(_, c)| c.pending.is_some() && c.deadline_ns <= now_ns)
            .map(|(id, _)| *id)
            .collect();
        for id in due {
            let mut conn = self.conns.remove(&id).expect("listed");
            if conn.retries_left > 0 {
                conn.retries_left -= 1;
                conn.deadline_ns = now_ns.saturating_add(conn.timeout_ns);
                let msg = conn.pending.clone().expect("due");
                self.send(conn.peer.clone(), conn.tid, &msg);
                self.counters.retries += 1;
                self.conns.insert(id, conn);
                continue;
            }
            match conn.state {
                State::ReqSent | State::RepSent => {
                    let what = if conn.passive { MsgRejected::Rep } else { MsgRejected::Req };
                    let mut rej = rej_msg(id, conn.remote_comm_id, what, RejReason::Timeout, [0; cm::private_len::REJ]);
                    self.name_ca_in_timeout(&mut rej);
                    self.send(conn.peer.clone(), conn.tid, &rej);
                    self.events.push_back(Event::Unreachable { id });
                }
                _ => self.events.push_back(Event::Disconnected { id }),
            }
            self.forget(id, &conn);
        }
    }

    /// Sends a SIDR_REQ (`rdma_resolve_route` .. `rdma_connect` on a UD ID): which QP serves `req.service_id`
    /// at `peer`; `SidrResolved`, `SidrFailed` or, after `retries` resends a `timeout_ns` apart, `Unreachable`
    /// follows. `req.request_id` is replaced by the new ID.
    pub fn sidr_resolve(&mut self, now_ns: u64, peer: A, mut req: SidrReq, timeout_ns: u64, retries: u8) -> CommId {
        let id = self.alloc_id();
        req.request_id = id;
        let tid = self.tid();
        self.send(peer.clone(), tid, &CmMsg::SidrReq(req));
        let x = Sidr {
            peer,
            tid,
            req,
            outgoing: true,
            deadline_ns: now_ns.saturating_add(timeout_ns),
            timeout_ns,
            retries_left: retries,
        };
        self.sidr.insert(id, x);
        id
    }

    /// Answers a SIDR request with the serving QP (`rdma_accept` on a UD ID).
    pub fn sidr_accept(&mut self, id: CommId, qpn: u32, qkey: u32) -> Result<(), EngineError> {
        self.sidr_answer(id, 0, qpn, qkey)
    }

    /// Refuses a SIDR request (`rdma_reject` on a UD ID): status 2.
    pub fn sidr_reject(&mut self, id: CommId) -> Result<(), EngineError> {
        self.sidr_answer(id, SIDR_REJECT, 0, 0)
    }

    fn sidr_answer(&mut self, id: CommId, status: u8, qpn: u32, qkey: u32) -> Result<(), EngineError> {
        match self.sidr.get(&id) {
            Some(x) if !x.outgoing => {}
            _ => return Err(EngineError::NoConnection(id)),
        }
        let x = self.sidr.remove(&id).expect("present");
        let rep = sidr_rep(&x.req, status, qpn, qkey);
        self.send(x.peer, x.tid, &CmMsg::SidrRep(rep));
        Ok(())
    }

    fn on_sidr_req(&mut self, now_ns: u64, peer: A, tid: u64, req: SidrReq) {
        if !self.listeners.contains_key(&req.service_id) {
            self.counters.sidr_unsupported += 1;
            self.send(peer, tid, &CmMsg::SidrRep(sidr_rep(&req, SIDR_UNSUPPORTED, 0, 0)));
            return;
        }
        // A repeat of a request still with the application is the same request.
        if self.sidr.values().any(|x| !x.outgoing && x.req.request_id == req.request_id && x.tid == tid) {
            self.counters.duplicate_req += 1;
            return;
        }
        let pending = self.sidr.values().filter(|x| !x.outgoing).count();
        if pending >= self.cfg.max_pending {
            self.counters.rej_no_resources += 1;
            self.send(peer, tid, &CmMsg::SidrRep(sidr_rep(&req, SIDR_REJECT, 0, 0)));
            return;
        }
        let id = self.alloc_id();
        let x = Sidr { peer, tid, req, outgoing: false, deadline_ns: now_ns, timeout_ns: 0, retries_left: 0 };
        self.sidr.insert(id, x);
        self.events.push_back(Event::SidrRequest { id, req: Box::new(req) });
    }

    fn on_sidr_rep(&mut self, rep: SidrRep) {
        let id = rep.request_id;
        match self.sidr.get(&id) {
            Some(x) if x.outgoing => {
                self.sidr.remove(&id);
                self.events.push_back(if rep.status == 0 {
                    Event::SidrResolved { id, qpn: rep.qpn, qkey: rep.qkey }
                } else {
                    Event::SidrFailed { id, status: rep.status }
                });
            }
            _ => self.counters.stale += 1,
        }
    }

    /// The next MAD to send, and to whom.
    pub fn poll_output(&mut self) -> Option<(A, [u8; MAD_LEN])> {
        self.out.pop_front()
    }

    /// The next event for the application.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// A connection's state, if it exists.
    pub fn state(&self, id: CommId) -> Option<State> {
        self.conns.get(&id).map(|c| c.state)
    }

    /// Where a connection's peer is (the address its messages came from or go to).
    pub fn peer(&self, id: CommId) -> Option<&A> {
        self.conns.get(&id).map(|c| &c.peer)
    }

    /// Where a SIDR request waiting for the application came from.
    pub fn sidr_peer(&self, id: CommId) -> Option<&A> {
        self.sidr.get(&id).filter(|x| !x.outgoing).map(|x| &x.peer)
    }

    /// Connections and SIDR exchanges alive (every other ID has been forgotten).
    pub fn connections(&self) -> usize {
        self.conns.len() + self.sidr.len()
    }

    /// What was dropped or refused.
    pub fn counters(&self) -> Counters {
        self.counters
    }

    fn on_req(&mut self, now_ns: u64, peer: A, tid: u64, req: Req) {
        let key = (req.local_ca_guid, req.local_comm_id);
        if let Some(&id) = self.by_remote.get(&key) {
            // The peer sent its REQ again: our REP was lost, so send it again; still deciding, say nothing.
            self.counters.duplicate_req += 1;
            if let Some(c) = self.conns.get(&id) {
                if let (State::RepSent, Some(m)) = (c.state, c.pending.clone()) {
                    self.send(peer, tid, &m);
                }
            }
            return;
        }
        let reject = |reason| rej_msg(0, req.local_comm_id, MsgRejected::Req, reason, [0; cm::private_len::REJ]);
        if !self.listeners.contains_key(&req.service_id) {
            self.counters.rej_no_listener += 1;
            self.send(peer, tid, &reject(RejReason::InvalidServiceId));
            return;
        }
        let pending = self.conns.values().filter(|c| matches!(c.state, State::ReqRcvd | State::RepSent)).count();
        if pending >= self.cfg.max_pending {
            self.counters.rej_no_resources += 1;
            self.send(peer, tid, &reject(RejReason::NoResources));
            return;
        }
        let id = self.alloc_id();
        let timeout_ns = cm_timeout_ns(req.local_cm_response_timeout);
        self.conns.insert(
            id,
            Conn {
                state: State::ReqRcvd,
                peer,
                remote_comm_id: req.local_comm_id,
                remote_ca_guid: req.local_ca_guid,
                remote_qpn: req.local_qpn,
                passive: true,
                pending: None,
                tid,
                deadline_ns: now_ns.saturating_add(timeout_ns),
                timeout_ns,
                retries_left: req.max_cm_retries,
            },
        );
        self.by_remote.insert(key, id);
        self.events.push_back(Event::ConnectRequest { id, req: Box::new(req) });
    }

    fn on_rep(&mut self, peer: A, tid: u64, rep: Rep) {
        let id = rep.remote_comm_id;
        match self.conns.get_mut(&id) {
            Some(c) if c.state == State::ReqSent => {
                c.state = State::Established;
                c.pending = None;
                c.remote_comm_id = rep.local_comm_id;
                c.remote_ca_guid = rep.local_ca_guid;
                c.remote_qpn = rep.local_qpn;
                let (to, tid) = (c.peer.clone(), c.tid);
                let rtu = CommIds { local_comm_id: id, remote_comm_id: rep.local_comm_id, private_data: [0; 224] };
                self.send(to, tid, &CmMsg::Rtu(rtu));
                self.events.push_back(Event::Established { id, rep: Some(Box::new(rep)) });
            }
            // Established already: our RTU was lost and the peer repeats its REP; repeat the RTU.
            Some(c) if c.state == State::Established && c.remote_comm_id == rep.local_comm_id => {
                let (to, tid) = (c.peer.clone(), c.tid);
                let rtu = CommIds { local_comm_id: id, remote_comm_id: rep.local_comm_id, private_data: [0; 224] };
                self.send(to, tid, &CmMsg::Rtu(rtu));
            }
            _ => {
                self.counters.rej_unknown_rep += 1;
                let rej = rej_msg(
                    0,
                    rep.local_comm_id,
                    MsgRejected::Rep,
                    RejReason::InvalidCommId,
                    [0; cm::private_len::REJ],
                );
                self.send(peer, tid, &rej);
            }
        }
    }

    fn on_rtu(&mut self, rtu: CommIds<{ cm::private_len::RTU }>) {
        let id = rtu.remote_comm_id;
        match self.conns.get_mut(&id) {
            Some(c) if c.state == State::RepSent && c.remote_comm_id == rtu.local_comm_id => {
                c.state = State::Established;
                c.pending = None;
                self.events.push_back(Event::Established { id, rep: None });
            }
            _ => self.counters.stale += 1,
        }
    }

    fn on_rej(&mut self, rej: Rej) {
        let mut id = rej.remote_comm_id;
        // A requester that gives up before our REP named no ID of ours: a timeout REJ carries its CA GUID in
        // the ARI (IBA 12.6.7.2), found with its communication ID among the requests we hold (as ib_cm does).
        if rej.reason == RejReason::Timeout && rej.ari_len >= 8 && !self.conns.contains_key(&id) {
            let guid = u64::from_be_bytes(rej.ari[..8].try_into().expect("8 bytes"));
            if let Some(&found) = self.by_remote.get(&(guid, rej.local_comm_id)) {
                id = found;
            }
        }
        match self.conns.get(&id) {
            // A requester may withdraw its REQ while the application decides (ReqRcvd), as ib_cm allows.
            Some(c) if matches!(c.state, State::ReqSent | State::ReqRcvd | State::RepSent) => {
                let c = self.conns.remove(&id).expect("present");
                self.forget(id, &c);
                self.events.push_back(Event::Rejected { id, reason: rej.reason });
            }
            _ => self.counters.stale += 1,
        }
    }

    fn on_dreq(&mut self, peer: A, tid: u64, dreq: Dreq) {
        let id = dreq.remote_comm_id;
        let known = matches!(
            self.conns.get(&id),
            Some(c) if matches!(c.state, State::Established | State::DreqSent) && c.remote_comm_id == dreq.local_comm_id
        );
        // A DREP answers every DREQ, also one for a connection already gone (IBA 12.9.6: its DREP was lost).
        let drep = CommIds { local_comm_id: id, remote_comm_id: dreq.local_comm_id, private_data: [0; 224] };
        self.send(peer, tid, &CmMsg::Drep(drep));
        if known {
            let c = self.conns.remove(&id).expect("present");
            self.forget(id, &c);
            self.events.push_back(Event::Disconnected { id });
        } else {
            self.counters.stale += 1;
        }
    }

    /// A timeout REJ names our CA GUID in its ARI, so a peer that never learned our ID finds the connection.
    fn name_ca_in_timeout(&self, rej: &mut CmMsg) {
        if let CmMsg::Rej(r) = rej {
            if r.reason == RejReason::Timeout {
                r.ari[..8].copy_from_slice(&self.ca_guid.to_be_bytes());
                r.ari_len = 8;
            }
        }
    }

    fn take_in(&mut self, id: CommId, want: State) -> Result<Conn<A>, EngineError> {
        let c = self.conns.get(&id).ok_or(EngineError::NoConnection(id))?;
        if c.state != want {
            return Err(EngineError::BadState { id, state: c.state });
        }
        Ok(self.conns.remove(&id).expect("present"))
    }

    fn forget(&mut self, _id: CommId, c: &Conn<A>) {
        if c.passive {
            self.by_remote.remove(&(c.remote_ca_guid, c.remote_comm_id));
        }
    }

    fn alloc_id(&mut self) -> CommId {
        loop {
            let id = self.next_comm_id;
            self.next_comm_id = self.next_comm_id.wrapping_add(1);
            // 0 means "none" in a REJ; skip IDs still in use after a wrap.
            if id != 0 && !self.conns.contains_key(&id) && !self.sidr.contains_key(&id) {
                return id;
            }
        }
    }

    fn tid(&mut self) -> u64 {
        self.next_tid += 1;
        self.next_tid
    }

    fn send_expecting(&mut self, conn: &mut Conn<A>, msg: CmMsg) {
        self.send(conn.peer.clone(), conn.tid, &msg);
        conn.pending = Some(Box::new(msg));
    }

    fn send(&mut self, to: A, tid: u64, msg: &CmMsg) {
        let mut b = [0u8; MAD_LEN];
        msg.write(tid, &mut b);
        self.out.push_back((to, b));
    }
}

fn sidr_rep(req: &SidrReq, status: u8, qpn: u32, qkey: u32) -> SidrRep {
    SidrRep {
        request_id: req.request_id,
        status,
        ari_len: 0,
        qpn,
        service_id: req.service_id,
        qkey,
        private_data: [0; cm::private_len::SIDR_REP],
    }
}

fn rej_msg(
    local: u32,
    remote: u32,
    what: MsgRejected,
    reason: RejReason,
    private_data: [u8; cm::private_len::REJ],
) -> CmMsg {
    CmMsg::Rej(Rej {
        local_comm_id: local,
        remote_comm_id: remote,
        message_rejected: what,
        ari_len: 0,
        reason,
        ari: [0; 72],
        private_data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cm::tests::req;
    use crate::mad::MadHdr;

    const SVC: u64 = 0x0106_4e20; // RDMA_PS_TCP, port 20000.
    const A: u8 = 0xa;
    const B: u8 = 0xb;

    fn rep() -> Rep {
        Rep {
            local_comm_id: 0,
            remote_comm_id: 0,
            local_qkey: 0,
            local_qpn: 0x99,
            starting_psn: 1,
            responder_resources: 1,
            initiator_depth: 1,
            target_ack_delay: 15,
            failover_accepted: 0,
            end_to_end_flow_control: true,
            rnr_retry_count: 7,
            srq: false,
            local_ca_guid: 0,
            private_data: [0; cm::private_len::REP],
        }
    }

    fn pair(cfg: EngineConfig) -> (Engine<u8>, Engine<u8>) {
        (Engine::new(0xaaaa, EngineConfig { first_comm_id: 100, ..cfg }), Engine::new(0xbbbb, cfg))
    }

    /// Delivers everything `from` has to send to `to`; returns how many MADs went.
    fn pump(now: u64, from: &mut Engine<u8>, from_addr: u8, to: &mut Engine<u8>) -> usize {
        let mut n = 0;
        while let Some((_, mad)) = from.poll_output() {
            to.recv(now, from_addr, &mad).unwrap();
            n += 1;
        }
        n
    }

    fn outputs(e: &mut Engine<u8>) -> Vec<CmMsg> {
        std::iter::from_fn(|| e.poll_output()).map(|(_, m)| CmMsg::parse(&m).unwrap().1).collect()
    }

    #[test]
    fn req_rep_rtu_then_dreq_drep_and_nothing_is_left() {
        let (mut a, mut b) = pair(EngineConfig::default());
        b.listen(SVC).unwrap();
        assert_eq!(b.listen(SVC), Err(EngineError::AddrInUse(SVC)));
        let ca = a.connect(0, B, req(0, SVC));
        assert_eq!(a.state(ca), Some(State::ReqSent));
        assert_eq!(pump(0, &mut a, A, &mut b), 1);
        let Some(Event::ConnectRequest { id: cb, req: r }) = b.poll_event() else { panic!("no connect request") };
        assert_eq!(
            (r.local_comm_id, r.service_id, r.local_ca_guid, &r.private_data[..4]),
            (ca, SVC, 0xaaaa, &b"rdma"[..])
        );
        b.accept(1, cb, rep()).unwrap();
        assert_eq!(pump(1, &mut b, B, &mut a), 1);
        let Some(Event::Established { id, rep: Some(p) }) = a.poll_event() else { panic!("active not established") };
        assert_eq!((id, p.local_comm_id, p.remote_comm_id, p.local_qpn), (ca, cb, ca, 0x99));
        assert_eq!(pump(2, &mut a, A, &mut b), 1, "the RTU");
        assert_eq!(b.poll_event(), Some(Event::Established { id: cb, rep: None }));
        // Nothing is retransmitted once established.
        a.tick(u64::MAX / 2);
        b.tick(u64::MAX / 2);
        assert_eq!((outputs(&mut a).len(), outputs(&mut b).len()), (0, 0));
        a.disconnect(3, ca).unwrap();
        assert_eq!(pump(3, &mut a, A, &mut b), 1);
        assert_eq!(b.poll_event(), Some(Event::Disconnected { id: cb }));
        assert_eq!(pump(4, &mut b, B, &mut a), 1, "the DREP");
        assert_eq!(a.poll_event(), Some(Event::Disconnected { id: ca }));
        assert_eq!((a.connections(), b.connections()), (0, 0));
        assert_eq!(a.counters(), Counters::default());
        assert_eq!(b.counters(), Counters::default());
    }

    #[test]
    fn a_req_nobody_listens_for_is_rejected_with_invalid_service_id() {
        let (mut a, mut b) = pair(EngineConfig::default());
        let ca = a.connect(0, B, req(0, SVC));
        pump(0, &mut a, A, &mut b);
        assert_eq!(b.poll_event(), None);
        let sent = outputs(&mut b);
        let [CmMsg::Rej(r)] = &sent[..] else { panic!("{sent:?}") };
        assert_eq!(
            (r.reason, r.message_rejected, r.remote_comm_id),
            (RejReason::InvalidServiceId, MsgRejected::Req, ca)
        );
        a.recv(1, B, &{
            let mut m = [0u8; MAD_LEN];
            sent[0].write(1, &mut m);
            m
        })
        .unwrap();
        assert_eq!(a.poll_event(), Some(Event::Rejected { id: ca, reason: RejReason::InvalidServiceId }));
        assert_eq!((a.connections(), b.connections(), b.counters().rej_no_listener), (0, 0, 1));
        // Another REJ for the gone connection is stale, dropped and counted.
        let mut m = [0u8; MAD_LEN];
        sent[0].write(1, &mut m);
        a.recv(2, B, &m).unwrap();
        assert_eq!((a.poll_event(), a.counters().stale), (None, 1));
    }

    #[test]
    fn a_rep_for_an_unknown_connection_is_rejected_with_invalid_comm_id() {
        let (_, mut b) = pair(EngineConfig::default());
        let mut m = [0u8; MAD_LEN];
        CmMsg::Rep(Rep { local_comm_id: 7, remote_comm_id: 4242, ..rep() }).write(9, &mut m);
        b.recv(0, A, &m).unwrap();
        let sent = std::iter::from_fn(|| b.poll_output()).collect::<Vec<_>>();
        assert_eq!(sent.len(), 1);
        let (h, msg) = CmMsg::parse(&sent[0].1).unwrap();
        let CmMsg::Rej(r) = msg else { panic!("{msg:?}") };
        assert_eq!((sent[0].0, h.tid), (A, 9), "answered to the sender, in its transaction");
        assert_eq!((r.reason, r.message_rejected, r.remote_comm_id), (RejReason::InvalidCommId, MsgRejected::Rep, 7));
        assert_eq!((b.poll_event(), b.connections(), b.counters().rej_unknown_rep), (None, 0, 1));
    }

    #[test]
    fn a_flood_of_reqs_is_held_to_the_pending_limit_and_repeats_make_no_connection() {
        let (_, mut b) = pair(EngineConfig { max_pending: 4, ..EngineConfig::default() });
        b.listen(SVC).unwrap();
        for i in 0..1000u32 {
            let mut m = [0u8; MAD_LEN];
            CmMsg::Req(Req { local_comm_id: 1 + i % 10, ..req(0, SVC) }).write(u64::from(i), &mut m);
            b.recv(0, A, &m).unwrap();
        }
        let requests = std::iter::from_fn(|| b.poll_event()).count();
        assert_eq!((requests, b.connections()), (4, 4));
        let c = b.counters();
        // Comm IDs 1..4 took the room; 5..10 were refused each time they came; repeats of 1..4 were seen as such.
        assert_eq!((c.duplicate_req, c.rej_no_resources), (400 - 4, 600));
        let sent = outputs(&mut b);
        assert_eq!(sent.len(), 600);
        assert!(sent.iter().all(|m| matches!(m, CmMsg::Rej(r) if r.reason == RejReason::NoResources)));
    }

    #[test]
    fn a_peer_that_vanishes_between_req_and_rtu_times_out_and_is_forgotten() {
        let (mut a, mut b) = pair(EngineConfig::default());
        b.listen(SVC).unwrap();
        a.connect(0, B, Req { max_cm_retries: 3, local_cm_response_timeout: 10, ..req(0, SVC) });
        pump(0, &mut a, A, &mut b);
        let Some(Event::ConnectRequest { id, .. }) = b.poll_event() else { panic!() };
        b.accept(0, id, rep()).unwrap();
        assert!(matches!(outputs(&mut b)[..], [CmMsg::Rep(_)]), "the REP, lost with the peer");
        // 4.096 us * 2^10 * 2: about 8.4 ms per try; nothing before the deadline.
        let step = cm_timeout_ns(10);
        b.tick(step - 1);
        assert!(outputs(&mut b).is_empty());
        let mut now = 0;
        for _ in 0..3 {
            now += step;
            b.tick(now);
            assert!(matches!(outputs(&mut b)[..], [CmMsg::Rep(_)]), "a retry");
        }
        assert_eq!(b.state(id), Some(State::RepSent));
        now += step;
        b.tick(now);
        assert_eq!(b.poll_event(), Some(Event::Unreachable { id }));
        let sent = outputs(&mut b);
        assert!(matches!(&sent[..], [CmMsg::Rej(r)] if r.reason == RejReason::Timeout), "{sent:?}");
        assert_eq!((b.connections(), b.counters().retries), (0, 3));
        // The same on the active side: a REQ nobody answers.
        let (mut a, _) = pair(EngineConfig::default());
        let ca = a.connect(0, B, Req { max_cm_retries: 1, remote_cm_response_timeout: 10, ..req(0, SVC) });
        outputs(&mut a);
        a.tick(step);
        assert_eq!(outputs(&mut a).len(), 1);
        a.tick(2 * step);
        assert_eq!(a.poll_event(), Some(Event::Unreachable { id: ca }));
        assert_eq!(a.connections(), 0);
    }

    #[test]
    fn an_id_destroyed_mid_handshake_withdraws_its_req_or_rep_and_leaves_nothing() {
        let (mut a, mut b) = pair(EngineConfig::default());
        b.listen(SVC).unwrap();
        // Active side gone before the REP: REJ (timeout); the late REP is answered as one for an unknown ID.
        let ca = a.connect(0, B, req(0, SVC));
        pump(0, &mut a, A, &mut b);
        let Some(Event::ConnectRequest { id: cb, .. }) = b.poll_event() else { panic!() };
        a.abort(ca);
        assert_eq!(pump(1, &mut a, A, &mut b), 1, "the REJ");
        assert_eq!(b.poll_event(), Some(Event::Rejected { id: cb, reason: RejReason::Timeout }));
        assert_eq!(b.accept(1, cb, rep()), Err(EngineError::NoConnection(cb)), "withdrawn");
        // A REP that crossed the REJ is answered as one for an unknown connection.
        let mut m = [0u8; MAD_LEN];
        CmMsg::Rep(Rep { local_comm_id: cb, remote_comm_id: ca, ..rep() }).write(9, &mut m);
        a.recv(1, B, &m).unwrap();
        assert!(matches!(&outputs(&mut a)[..], [CmMsg::Rej(r)] if r.reason == RejReason::InvalidCommId));
        // Passive side gone after its REP: REJ (consumer defined) to the requester, which reports it.
        let ca = a.connect(2, B, req(0, SVC));
        pump(2, &mut a, A, &mut b);
        let Some(Event::ConnectRequest { id: cb, .. }) = b.poll_event() else { panic!() };
        b.accept(2, cb, rep()).unwrap();
        let rep_mad = b.poll_output().unwrap();
        b.abort(cb);
        pump(3, &mut b, B, &mut a);
        assert_eq!(a.poll_event(), Some(Event::Rejected { id: ca, reason: RejReason::ConsumerDefined }));
        a.recv(3, B, &rep_mad.1).unwrap();
        assert_eq!(b.connections(), 0);
        assert_eq!(a.connections(), 0, "a REP after the REJ finds no connection");
        // An established connection's ID destroyed: one DREQ, and the peer sees it disconnect.
        let ca = a.connect(4, B, req(0, SVC));
        pump(4, &mut a, A, &mut b);
        let Some(Event::ConnectRequest { id: cb, .. }) = b.poll_event() else { panic!() };
        b.accept(4, cb, rep()).unwrap();
        pump(4, &mut b, B, &mut a);
        pump(4, &mut a, A, &mut b);
        assert!(matches!(a.poll_event(), Some(Event::Established { .. })));
        while a.poll_event().is_some() {}
        while b.poll_event().is_some() {}
        a.abort(ca);
        pump(5, &mut a, A, &mut b);
        assert_eq!(b.poll_event(), Some(Event::Disconnected { id: cb }));
        pump(5, &mut b, B, &mut a);
        assert_eq!((a.connections(), b.connections(), a.poll_event()), (0, 0, None));
    }

    #[test]
    fn sidr_resolves_a_ud_service_and_refuses_one_nobody_serves() {
        let (mut a, mut b) = pair(EngineConfig::default());
        const UDP_SVC: u64 = 0x0111_1c06; // RDMA_PS_UDP, port 7174.
        b.listen(UDP_SVC).unwrap();
        let sreq = |svc| SidrReq { request_id: 0, pkey: 0xffff, service_id: svc, private_data: [0; 216] };
        let ida = a.sidr_resolve(0, B, sreq(UDP_SVC), 1000, 2);
        pump(0, &mut a, A, &mut b);
        let Some(Event::SidrRequest { id, req }) = b.poll_event() else { panic!("no SIDR request") };
        assert_eq!((req.request_id, req.service_id), (ida, UDP_SVC));
        b.sidr_accept(id, 0x77, 0x1234_5678).unwrap();
        assert_eq!(b.sidr_accept(id, 0x77, 1), Err(EngineError::NoConnection(id)), "answered once");
        pump(1, &mut b, B, &mut a);
        assert_eq!(a.poll_event(), Some(Event::SidrResolved { id: ida, qpn: 0x77, qkey: 0x1234_5678 }));
        // Nobody serves port 7175: status 1, unsupported service ID.
        let idb = a.sidr_resolve(2, B, sreq(UDP_SVC + 1), 1000, 2);
        pump(2, &mut a, A, &mut b);
        pump(2, &mut b, B, &mut a);
        assert_eq!(a.poll_event(), Some(Event::SidrFailed { id: idb, status: SIDR_UNSUPPORTED }));
        assert_eq!(b.counters().sidr_unsupported, 1);
        // The application refuses: status 2.
        let idc = a.sidr_resolve(3, B, sreq(UDP_SVC), 1000, 2);
        pump(3, &mut a, A, &mut b);
        let Some(Event::SidrRequest { id, .. }) = b.poll_event() else { panic!() };
        b.sidr_reject(id).unwrap();
        pump(3, &mut b, B, &mut a);
        assert_eq!(a.poll_event(), Some(Event::SidrFailed { id: idc, status: SIDR_REJECT }));
        // Nobody answers: two resends, then unreachable.
        let idd = a.sidr_resolve(10, B, sreq(UDP_SVC), 1000, 2);
        assert_eq!(outputs(&mut a).len(), 1);
        a.tick(1010);
        a.tick(2010);
        assert_eq!(outputs(&mut a).len(), 2);
        a.tick(3010);
        assert_eq!(a.poll_event(), Some(Event::Unreachable { id: idd }));
        // A SIDR_REP nobody asked for is stale.
        let mut m = [0u8; MAD_LEN];
        CmMsg::SidrRep(sidr_rep(&SidrReq { request_id: 999, ..sreq(UDP_SVC) }, 0, 1, 1)).write(1, &mut m);
        a.recv(4000, B, &m).unwrap();
        assert_eq!((a.poll_event(), a.counters().stale), (None, 1));
        assert_eq!((a.connections(), b.connections()), (0, 0));
    }

    #[test]
    fn malformed_mads_are_dropped_and_counted_and_change_nothing() {
        let (_, mut b) = pair(EngineConfig::default());
        b.listen(SVC).unwrap();
        let mut good = [0u8; MAD_LEN];
        CmMsg::Req(req(1, SVC)).write(1, &mut good);
        let mut bad_version = good;
        bad_version[0] = 9;
        let mut bad_class = good;
        bad_class[2] = 1;
        let cases: [&[u8]; 5] = [&[], &good[..23], &good[..200], &bad_version, &bad_class];
        for (i, m) in cases.iter().enumerate() {
            assert!(matches!(b.recv(0, A, m), Err(EngineError::Malformed(_))), "case {i}");
        }
        assert_eq!(MadHdr::parse(&bad_version), Err(MadError::BadBaseVersion(9)));
        assert_eq!((b.counters().malformed, b.connections(), b.poll_event(), b.poll_output()), (5, 0, None, None));
        // Calls on connections that do not exist or are in the wrong state are typed errors.
        assert_eq!(b.accept(0, 77, rep()), Err(EngineError::NoConnection(77)));
        b.recv(0, A, &good).unwrap();
        let Some(Event::ConnectRequest { id, .. }) = b.poll_event() else { panic!() };
        assert_eq!(b.disconnect(0, id), Err(EngineError::BadState { id, state: State::ReqRcvd }));
        b.reject(id, b"no").unwrap();
        let sent = outputs(&mut b);
        assert!(
            matches!(&sent[..], [CmMsg::Rej(r)] if r.reason == RejReason::ConsumerDefined && &r.private_data[..2] == b"no")
        );
        assert_eq!(b.connections(), 0);
    }
}
