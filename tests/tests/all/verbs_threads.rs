//! Verbs from several threads: objects are Send + Sync, QPs of several threads complete on one shared CQ pair,
//! and a CQ is polled on one thread while another posts; every work request completes exactly once.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use mlx5_sim::{Mode, SimConfig, SimDevice};

use mlx5_verbs::{
    wr, Access, CompletionQueue, Context, Device, DmaBuffer, MemoryRegion, ProtectionDomain, QpCap, QpType, QueuePair,
    Rts, WcStatus, WorkCompletion,
};

fn send_sync<T: Send + Sync>() {}

#[test]
fn verbs_objects_are_send_and_sync() {
    send_sync::<Context>();
    send_sync::<Device>();
    send_sync::<ProtectionDomain<'static>>();
    send_sync::<MemoryRegion<'static>>();
    send_sync::<CompletionQueue<'static>>();
    send_sync::<QueuePair<'static, Rts>>();
    fn send<T: Send>() {}
    send::<DmaBuffer<'static>>();
}

const CAP: QpCap = QpCap { max_send_wr: 32, max_recv_wr: 32, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };

/// Every completion seen, by wr_id: (count, status).
#[derive(Default)]
struct Ledger(Mutex<HashMap<u64, (u32, WcStatus)>>);

impl Ledger {
    fn record(&self, wc: &[WorkCompletion]) {
        let mut m = self.0.lock().unwrap();
        for w in wc {
            let e = m.entry(w.wr_id).or_insert((0, w.status));
            e.0 += 1;
        }
    }

    fn check(&self, want: impl Iterator<Item = u64>) {
        let m = self.0.lock().unwrap();
        let mut n = 0;
        for id in want {
            assert_eq!(m.get(&id), Some(&(1, WcStatus::Success)), "wr_id {id:#x}");
            n += 1;
        }
        assert_eq!(m.len(), n, "no completion that was not posted");
    }
}

#[test]
fn threads_each_with_their_own_qp_share_one_cq_pair() {
    threads_on_a_shared_cq_pair(Mode::Inline);
}

#[test]
fn threads_share_a_cq_pair_with_firmware_on_its_own_thread() {
    threads_on_a_shared_cq_pair(Mode::Threaded);
}

fn threads_on_a_shared_cq_pair(mode: Mode) {
    const THREADS: u64 = 4;
    const MSGS: u64 = 150;
    let ctx = Context::open_sim_device(SimDevice::new(SimConfig { mode, ..SimConfig::default() })).unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let (scq, rcq) = (ctx.create_cq(1024).unwrap(), ctx.create_cq(1024).unwrap());
    let ledger = Ledger::default();
    // Completions each thread has seen retire, whoever polled them: sends (to bound what is outstanding) and
    // receives.
    let sends_done: Vec<AtomicUsize> = (0..THREADS).map(|_| AtomicUsize::new(0)).collect();
    let recvs_done: Vec<AtomicUsize> = (0..THREADS).map(|_| AtomicUsize::new(0)).collect();
    let total = (2 * THREADS * MSGS) as usize;
    let seen = AtomicUsize::new(0);
    let poll = |cq: &CompletionQueue<'_>| {
        let mut wc = [WorkCompletion::default(); 16];
        let n = cq.poll(&mut wc).unwrap();
        for w in &wc[..n] {
            let t = (w.wr_id >> 32 & 0xff) as usize;
            if w.wr_id >> 40 == 1 {
                sends_done[t].fetch_add(1, Ordering::AcqRel);
            } else {
                recvs_done[t].fetch_add(1, Ordering::AcqRel);
            }
        }
        ledger.record(&wc[..n]);
        seen.fetch_add(n, Ordering::AcqRel);
    };
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let (ctx, pd, scq, rcq, poll) = (&ctx, &pd, &scq, &rcq, &poll);
            let (sends_done, recvs_done, seen) = (&sends_done, &recvs_done, &seen);
            s.spawn(move || {
                // A loopback pair per thread: a sends, b receives; both complete on the shared CQs.
                let a = pd.create_qp(QpType::Rc, scq, rcq, CAP).unwrap();
                let b = pd.create_qp(QpType::Rc, scq, rcq, CAP).unwrap();
                let (ra, rb) = (ctx.remote_qp(&a).unwrap(), ctx.remote_qp(&b).unwrap());
                let a = a.connect_rc(rb, Access::default()).unwrap();
                let b = b.connect_rc(ra, Access::default()).unwrap();
                let mut buf = ctx.alloc_buffer(64 * 32).unwrap();
                let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
                let (mut sent, mut posted_recv) = (0u64, 0u64);
                let deadline = Instant::now() + Duration::from_secs(60);
                while sent < MSGS {
                    assert!(Instant::now() < deadline, "thread {t} stuck at {sent}");
                    // Keep the receive queue ahead and at most 16 sends outstanding.
                    while posted_recv < MSGS
                        && posted_recv - (recvs_done[t as usize].load(Ordering::Acquire) as u64) < 16
                    {
                        let slot = (posted_recv % 32) as usize * 64;
                        b.post_recv(&[wr::recv(2 << 40 | t << 32 | posted_recv, &[mr.sge(slot, 64)])]).unwrap();
                        posted_recv += 1;
                    }
                    if sent < posted_recv && sent - (sends_done[t as usize].load(Ordering::Acquire) as u64) < 16 {
                        a.post_send(&[wr::send_inline(1 << 40 | t << 32 | sent, &sent.to_le_bytes())]).unwrap();
                        sent += 1;
                    }
                    poll(scq);
                    poll(rcq);
                }
                while seen.load(Ordering::Acquire) < total {
                    assert!(Instant::now() < deadline, "thread {t} waiting for the others");
                    poll(scq);
                    poll(rcq);
                }
                // The QPs and the region go on this thread, after every completion is in.
                drop((a, b, mr));
            });
        }
    });
    ledger
        .check((0..THREADS).flat_map(|t| (0..MSGS).flat_map(move |i| [1 << 40 | t << 32 | i, 2 << 40 | t << 32 | i])));
}

#[test]
fn a_thread_polls_while_another_posts() {
    const MSGS: u64 = 400;
    let ctx = Context::open_sim().unwrap();
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(256).unwrap();
    let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
    let me = ctx.remote_qp(&qp).unwrap();
    let qp = qp.connect_rc(me, Access::default()).unwrap();
    let mut buf = ctx.alloc_buffer(64 * 32).unwrap();
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
    let ledger = Ledger::default();
    let (done_send, done_recv) = (AtomicUsize::new(0), AtomicUsize::new(0));
    std::thread::scope(|s| {
        // The poller: takes every completion until all are in.
        s.spawn(|| {
            let mut wc = [WorkCompletion::default(); 8];
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut n = 0;
            while n < 2 * MSGS as usize {
                assert!(Instant::now() < deadline, "poller stuck at {n}");
                let k = cq.poll(&mut wc).unwrap();
                for w in &wc[..k] {
                    if w.wr_id >> 40 == 1 { &done_send } else { &done_recv }.fetch_add(1, Ordering::AcqRel);
                }
                ledger.record(&wc[..k]);
                n += k;
            }
        });
        // The poster: receives and sends on the one QP, never more than the queues hold.
        s.spawn(|| {
            let (mut sent, mut posted_recv) = (0u64, 0u64);
            let deadline = Instant::now() + Duration::from_secs(60);
            while sent < MSGS {
                assert!(Instant::now() < deadline, "poster stuck at {sent}");
                if posted_recv < MSGS && posted_recv - (done_recv.load(Ordering::Acquire) as u64) < 16 {
                    let slot = (posted_recv % 32) as usize * 64;
                    qp.post_recv(&[wr::recv(2 << 40 | posted_recv, &[mr.sge(slot, 64)])]).unwrap();
                    posted_recv += 1;
                }
                if sent < posted_recv && sent - (done_send.load(Ordering::Acquire) as u64) < 16 {
                    qp.post_send(&[wr::send_inline(1 << 40 | sent, b"x")]).unwrap();
                    sent += 1;
                } else {
                    std::thread::yield_now();
                }
            }
        });
    });
    ledger.check((0..MSGS).flat_map(|i| [1 << 40 | i, 2 << 40 | i]));
}

#[test]
fn shared_device_serves_threads_of_two_contexts() {
    // One device from the process list, opened on two threads at once: one HCA, two working contexts.
    let dev = Device::sim(SimConfig::default()).unwrap();
    // Both contexts are open before either closes, so neither open can bring the device up afresh.
    let (opened, finished) = (std::sync::Barrier::new(2), std::sync::Barrier::new(2));
    std::thread::scope(|s| {
        for _ in 0..2 {
            let (dev, opened, finished) = (&dev, &opened, &finished);
            s.spawn(move || {
                let ctx = dev.open().unwrap();
                opened.wait();
                let pd = ctx.alloc_pd().unwrap();
                let cq = ctx.create_cq(8).unwrap();
                let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
                let me = ctx.remote_qp(&qp).unwrap();
                let qp = qp.connect_rc(me, Access::default()).unwrap();
                let mut buf = ctx.alloc_buffer(64).unwrap();
                let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
                qp.post_recv(&[wr::recv(1, &[mr.sge(0, 64)])]).unwrap();
                qp.post_send(&[wr::send_inline(2, b"both")]).unwrap();
                let mut wc = [WorkCompletion::default(); 2];
                assert_eq!(cq.poll_until(&mut wc, 2, Duration::from_secs(10)).unwrap(), 2);
                assert!(wc.iter().all(|w| w.status == WcStatus::Success));
                finished.wait();
            });
        }
    });
    let sim = dev.sim_device().unwrap();
    let enables = sim.executed().iter().filter(|c| c.opcode == mlx5_core::prm::Opcode::EnableHca.raw()).count();
    assert_eq!(enables, 1, "both opens shared one HCA");
    assert!(!dev.is_open());
    assert_eq!(sim.hca_state(), mlx5_sim::HcaState::Disabled);
}
