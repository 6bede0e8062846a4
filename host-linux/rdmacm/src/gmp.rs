//! Transactions of general management packets (IBA 13.4.6): a request leaves on QP1 with a transaction ID of its
//! sender's, the response carries it back; a request with no response within its timeout is sent again, up to its
//! retries, then given up with a timeout event, as `ib_mad`'s send agents do (`timeout_ms`, `retries` of
//! `ib_post_send_mad`). Without I/O, on the caller's clock, as [`crate::engine`] runs the CM's own messages:
//! requests out through [`Transactions::poll_output`], MADs in through [`Transactions::recv`], results through
//! [`Transactions::poll_event`]. What arrives and matches no request (a response to nothing, a repeat of one
//! already taken, bytes that are no MAD) is dropped and counted, never an error.

use std::collections::VecDeque;

use thiserror::Error;

use crate::mad::{MadError, MadHdr, MAD_LEN};

/// Why a request was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum GmpError {
    /// As many requests as the table holds are waiting for their responses.
    #[error("{0} requests already wait for their responses")]
    Full(usize),
    /// The bytes are no MAD (too short, bad base version).
    #[error("not a MAD: {0}")]
    Mad(#[from] MadError),
    /// A response (method bit 7 set) is no request.
    #[error("method {0:#04x} is a response, not a request")]
    NotARequest(u8),
}

/// What became of a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GmpEvent<A> {
    /// Its response arrived.
    Response {
        /// The request's transaction ID.
        tid: u64,
        /// Who answered.
        from: A,
        /// The response.
        mad: Box<[u8; MAD_LEN]>,
    },
    /// No response came after its retries.
    TimedOut {
        /// The request's transaction ID.
        tid: u64,
        /// Where it was sent.
        to: A,
    },
}

/// Counts of what the table did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GmpCounters {
    /// Requests taken.
    pub requests: u64,
    /// Requests sent again.
    pub retries: u64,
    /// Requests given up.
    pub timeouts: u64,
    /// Responses matched to a request.
    pub responses: u64,
    /// MADs dropped because they match no waiting request (a late or repeated response, a request).
    pub unmatched: u64,
    /// MADs dropped because they are no MAD.
    pub malformed: u64,
}

#[derive(Debug)]
struct Pending<A> {
    tid: u64,
    class: u8,
    to: A,
    mad: Box<[u8; MAD_LEN]>,
    timeout_ns: u64,
    deadline_ns: u64,
    retries_left: u8,
}

/// The requests waiting for responses, at most `limit` at once.
#[derive(Debug)]
pub struct Transactions<A> {
    next_tid: u64,
    limit: usize,
    pending: Vec<Pending<A>>,
    out: VecDeque<(A, Box<[u8; MAD_LEN]>)>,
    events: VecDeque<GmpEvent<A>>,
    counters: GmpCounters,
}

/// Where the transaction ID sits in the common header (IBA 13.4.3).
const TID: usize = 8;

impl<A: Clone> Transactions<A> {
    /// A table whose transaction IDs start at `first_tid` (the high half tells senders of one port apart, as
    /// `ib_mad` puts its agent's number there), holding at most `limit` waiting requests.
    pub fn new(first_tid: u64, limit: usize) -> Self {
        Transactions {
            next_tid: first_tid,
            limit,
            pending: Vec::new(),
            out: VecDeque::new(),
            events: VecDeque::new(),
            counters: GmpCounters::default(),
        }
    }

    /// Takes request `mad` for `to`: gives it the next transaction ID, queues it for sending and waits
    /// `timeout_ns` for its response, sending it again up to `retries` times. Returns the transaction ID.
    pub fn request(
        &mut self,
        now_ns: u64,
        to: A,
        mad: &[u8; MAD_LEN],
        timeout_ns: u64,
        retries: u8,
    ) -> Result<u64, GmpError> {
        let hdr = MadHdr::parse(mad)?;
        if hdr.is_response() {
            return Err(GmpError::NotARequest(hdr.method));
        }
        if self.pending.len() >= self.limit {
            return Err(GmpError::Full(self.pending.len()));
        }
        let tid = self.next_tid;
        self.next_tid = self.next_tid.wrapping_add(1);
        let mut mad = Box::new(*mad);
        mad[TID..TID + 8].copy_from_slice(&tid.to_be_bytes());
        self.out.push_back((to.clone(), mad.clone()));
        self.pending.push(Pending {
            tid,
            class: hdr.mgmt_class,
            to,
            mad,
            timeout_ns,
            deadline_ns: now_ns.saturating_add(timeout_ns),
            retries_left: retries,
        });
        self.counters.requests += 1;
        Ok(tid)
    }

    /// A MAD that arrived from `from`: the response to a waiting request (same transaction ID and class) ends it;
    /// anything else is dropped and counted.
    pub fn recv(&mut self, from: A, bytes: &[u8]) {
        let hdr = match MadHdr::parse(bytes) {
            Ok(h) if bytes.len() == MAD_LEN => h,
            _ => {
                self.counters.malformed += 1;
                return;
            }
        };
        let at = hdr
            .is_response()
            .then(|| self.pending.iter().position(|p| p.tid == hdr.tid && p.class == hdr.mgmt_class))
            .flatten();
        let Some(at) = at else {
            self.counters.unmatched += 1;
            return;
        };
        let p = self.pending.swap_remove(at);
        let mut mad = Box::new([0u8; MAD_LEN]);
        mad.copy_from_slice(bytes);
        self.counters.responses += 1;
        self.events.push_back(GmpEvent::Response { tid: p.tid, from, mad });
    }

    /// Runs the timers: each request past its deadline is sent again, or given up once its retries are spent.
    pub fn tick(&mut self, now_ns: u64) {
        let mut k = 0;
        while k < self.pending.len() {
            let p = &mut self.pending[k];
            if now_ns < p.deadline_ns {
                k += 1;
                continue;
            }
            if p.retries_left > 0 {
                p.retries_left -= 1;
                p.deadline_ns = now_ns.saturating_add(p.timeout_ns);
                self.out.push_back((p.to.clone(), p.mad.clone()));
                self.counters.retries += 1;
                k += 1;
            } else {
                let p = self.pending.swap_remove(k);
                self.counters.timeouts += 1;
                self.events.push_back(GmpEvent::TimedOut { tid: p.tid, to: p.to });
            }
        }
    }

    /// The next MAD to send and where.
    pub fn poll_output(&mut self) -> Option<(A, Box<[u8; MAD_LEN]>)> {
        self.out.pop_front()
    }

    /// The next result.
    pub fn poll_event(&mut self) -> Option<GmpEvent<A>> {
        self.events.pop_front()
    }

    /// Requests waiting for their responses.
    pub fn outstanding(&self) -> usize {
        self.pending.len()
    }

    /// What the table did so far.
    pub fn counters(&self) -> GmpCounters {
        self.counters
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mad::{class, method};

    fn get(class: u8) -> [u8; MAD_LEN] {
        let mut m = [0u8; MAD_LEN];
        m[..4].copy_from_slice(&[1, class, 1, method::GET]);
        m
    }

    fn answer(req: &[u8; MAD_LEN]) -> [u8; MAD_LEN] {
        let mut r = *req;
        r[3] = method::GET_RESP;
        r
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn a_response_ends_its_request_and_a_repeat_of_it_is_dropped() {
        let mut t: Transactions<u16> = Transactions::new(0x7_0000_0000, 4);
        let tid = t.request(0, 5, &get(class::PERF_MGMT), 100 * MS, 2).unwrap();
        let (to, sent) = t.poll_output().unwrap();
        assert_eq!((to, u64::from_be_bytes(sent[8..16].try_into().unwrap())), (5, tid));
        let rsp = answer(&sent);
        t.recv(5, &rsp);
        assert!(matches!(t.poll_event(), Some(GmpEvent::Response { tid: x, from: 5, .. }) if x == tid));
        t.recv(5, &rsp);
        let mut other_class = rsp;
        other_class[1] = class::CM;
        t.recv(5, &other_class);
        t.recv(5, &rsp[..100]);
        let c = t.counters();
        assert_eq!((c.responses, c.unmatched, c.malformed, t.outstanding()), (1, 2, 1, 0));
        t.tick(10_000 * MS);
        assert!(t.poll_output().is_none() && t.poll_event().is_none(), "nothing left to send again");
    }

    #[test]
    fn a_request_nobody_answers_is_sent_again_then_times_out() {
        let mut t: Transactions<u16> = Transactions::new(1, 4);
        let tid = t.request(0, 9, &get(class::PERF_MGMT), 50 * MS, 2).unwrap();
        assert!(t.poll_output().is_some());
        t.tick(50 * MS - 1);
        assert!(t.poll_output().is_none(), "not before its timeout");
        for k in 1..=2 {
            t.tick(k * 50 * MS);
            let (_, again) = t.poll_output().expect("a retry");
            assert_eq!(u64::from_be_bytes(again[8..16].try_into().unwrap()), tid, "with the same TID");
        }
        t.tick(3 * 50 * MS);
        assert_eq!(t.poll_event(), Some(GmpEvent::TimedOut { tid, to: 9 }));
        let c = t.counters();
        assert_eq!((c.retries, c.timeouts, t.outstanding()), (2, 1, 0));
        // A response after the timeout matches nothing.
        let mut late = get(class::PERF_MGMT);
        late[3] = method::GET_RESP;
        late[8..16].copy_from_slice(&tid.to_be_bytes());
        t.recv(9, &late);
        assert_eq!(t.counters().unmatched, 1);
    }

    #[test]
    fn the_table_is_bounded_and_refuses_what_is_no_request() {
        let mut t: Transactions<u16> = Transactions::new(1, 2);
        t.request(0, 1, &get(class::PERF_MGMT), MS, 0).unwrap();
        t.request(0, 1, &get(class::PERF_MGMT), MS, 0).unwrap();
        assert_eq!(t.request(0, 1, &get(class::PERF_MGMT), MS, 0), Err(GmpError::Full(2)));
        let mut rsp = get(class::PERF_MGMT);
        rsp[3] = method::GET_RESP;
        let mut t2: Transactions<u16> = Transactions::new(1, 2);
        assert_eq!(t2.request(0, 1, &rsp, MS, 0), Err(GmpError::NotARequest(method::GET_RESP)));
        let mut bad = get(class::PERF_MGMT);
        bad[0] = 3;
        assert!(matches!(t2.request(0, 1, &bad, MS, 0), Err(GmpError::Mad(MadError::BadBaseVersion(3)))));
        t.tick(MS);
        assert_eq!((t.counters().timeouts, t.outstanding()), (2, 0));
    }
}
