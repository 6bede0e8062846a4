//! A real card's failures, through the verbs API: a firmware assert, a command that never completes, a function
//! reset under traffic, a port going down and up under traffic, and a page request the host cannot satisfy. Each
//! ends with every waiter woken (an error, a flush completion or the event verbs defines), every object gone with
//! no DMA memory left, and the same `Device` opened again in this process and passing traffic.

use std::time::{Duration, Instant};

use mlx5_core::prm::consts;
use mlx5_sim::{Fault, SimConfig, SimDevice, SimEvent};
use mlx5_verbs::{wr, Access, AsyncEvent, Context, Device, QpCap, QpType, VerbsError, WcStatus, WorkCompletion};

const CAP: QpCap = QpCap { max_send_wr: 16, max_recv_wr: 16, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };

fn sim_of(dev: &Device) -> SimDevice {
    dev.sim_device().expect("a simulated device").clone()
}

/// `n` SENDs over an RC QP connected to itself: every send and receive completes with success.
fn traffic(ctx: &Context, n: u64) {
    let pd = ctx.alloc_pd().unwrap();
    let cq = ctx.create_cq(64).unwrap();
    let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
    let me = ctx.remote_qp(&qp).unwrap();
    let qp = qp.connect_rc(me, Access::default()).unwrap();
    let mut buf = ctx.alloc_buffer(64 * 16).unwrap();
    let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
    for i in 0..n {
        qp.post_recv(&[wr::recv(i, &[mr.sge(64 * (i % 16) as usize, 64)])]).unwrap();
        qp.post_send(&[wr::send_inline(1 << 32 | i, &i.to_le_bytes())]).unwrap();
        let mut wc = [WorkCompletion::default(); 2];
        assert_eq!(cq.poll_until(&mut wc, 2, Duration::from_secs(10)).unwrap(), 2, "message {i}");
        assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
    }
}

/// Every completion the CQ holds now.
fn drain(cq: &mlx5_verbs::CompletionQueue<'_>) -> Vec<(u64, WcStatus)> {
    let mut out = Vec::new();
    let mut wc = [WorkCompletion::default(); 16];
    loop {
        let n = cq.poll(&mut wc).unwrap();
        if n == 0 {
            return out;
        }
        out.extend(wc[..n].iter().map(|w| (w.wr_id, w.status)));
    }
}

/// After every context closed: no DMA memory left, then the device opens again and passes traffic.
fn reopens_and_works(dev: &Device) {
    assert!(!dev.is_open(), "every context closed");
    assert_eq!(sim_of(dev).dma_outstanding(), (0, 0), "no DMA memory left");
    let ctx = dev.open().unwrap_or_else(|e| panic!("opening the device again: {e}"));
    traffic(&ctx, 8);
}

#[test]
fn a_firmware_assert_wakes_every_waiter_and_the_device_opens_again() {
    let dev = Device::sim(SimConfig::default()).unwrap();
    let sim = sim_of(&dev);
    {
        let ctx = dev.open().unwrap();
        traffic(&ctx, 2);
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(16).unwrap();
        let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
        let me = ctx.remote_qp(&qp).unwrap();
        let qp = qp.connect_rc(me, Access::default()).unwrap();
        let mut buf = ctx.alloc_buffer(256).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        for i in 0..3 {
            qp.post_recv(&[wr::recv(i, &[mr.sge(64 * i as usize, 64)])]).unwrap();
        }
        cq.req_notify(false).unwrap();
        std::thread::scope(|s| {
            // Two waiters block before the assert: one for a completion event, one for an async event.
            let cq_waiter = s.spawn(|| ctx.get_cq_event(Duration::from_secs(20)));
            let async_waiter = s.spawn(|| ctx.get_async_event(Duration::from_secs(20)));
            std::thread::sleep(Duration::from_millis(50));
            sim.fail_health(consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR);
            let t0 = Instant::now();
            assert_eq!(async_waiter.join().unwrap(), Some(AsyncEvent::DeviceFatal));
            let r = cq_waiter.join().unwrap();
            assert!(r.is_err(), "the completion-event waiter is woken with an error: {r:?}");
            assert!(t0.elapsed() < Duration::from_secs(10), "woken within the health poll: {:?}", t0.elapsed());
        });
        assert!(ctx.is_dead());
        assert!(matches!(qp.post_send(&[wr::send_inline(9, b"x")]), Err(VerbsError::Post(_))));
        assert_eq!(drain(&cq), [(0, WcStatus::WrFlushErr), (1, WcStatus::WrFlushErr), (2, WcStatus::WrFlushErr)]);
        assert!(ctx.alloc_pd().is_err(), "no command reaches a dead device");
    }
    reopens_and_works(&dev);
    assert!(sim.events().contains(&SimEvent::FunctionReset), "the open reset the dead function");
}

#[test]
fn a_command_that_never_completes_times_out_and_the_device_opens_again() {
    // In-line mode runs on virtual time: the command's timeout passes without the test waiting for it.
    let dev = Device::sim(SimConfig::default()).unwrap();
    let sim = sim_of(&dev);
    {
        let ctx = dev.open().unwrap();
        traffic(&ctx, 2);
        sim.inject(Fault::Hang { opcode: consts::MLX5_CMD_OP_CREATE_CQ });
        let t0 = Instant::now();
        // Two more callers wait behind the hung command for the command interface: each is let through once it
        // times out, as Linux fails only the command that timed out (its slot leaked, the device up).
        let e = std::thread::scope(|s| {
            let hung = s.spawn(|| ctx.create_cq(16).map(drop).expect_err("a CREATE_CQ firmware never answers"));
            std::thread::sleep(Duration::from_millis(20));
            let others: Vec<_> = (0..2).map(|_| s.spawn(|| ctx.alloc_pd().map(drop))).collect();
            for o in others {
                o.join().unwrap().expect("a command queued behind the hung one runs after its timeout");
            }
            hung.join().unwrap()
        });
        eprintln!("CREATE_CQ that never completes: {e} after {:?}", t0.elapsed());
        let timed_out = matches!(
            e,
            VerbsError::Hca(mlx5_core::hca::Error::Cmd(mlx5_core::cmdq::CmdError::Timeout { opcode, .. }))
                if opcode.raw() == consts::MLX5_CMD_OP_CREATE_CQ
        );
        assert!(timed_out, "the caller is woken with the command's timeout: {e:?}");
        assert!(t0.elapsed() < Duration::from_secs(30), "the caller is woken by the timeout");
        sim.clear_faults();
        // The context goes on: the next CREATE_CQ takes another slot.
        drop(ctx.create_cq(16).expect("a CQ once firmware answers again"));
    }
    reopens_and_works(&dev);
}

#[test]
fn a_function_reset_under_traffic_is_device_fatal_and_the_device_opens_again() {
    let dev = Device::sim(SimConfig::default()).unwrap();
    let sim = sim_of(&dev);
    {
        let ctx = dev.open().unwrap();
        let pd = ctx.alloc_pd().unwrap();
        let cq = ctx.create_cq(64).unwrap();
        let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
        let me = ctx.remote_qp(&qp).unwrap();
        let qp = qp.connect_rc(me, Access::default()).unwrap();
        let mut buf = ctx.alloc_buffer(64 * 16).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        for i in 0..4 {
            qp.post_recv(&[wr::recv(i, &[mr.sge(64 * i as usize, 64)])]).unwrap();
        }
        sim.function_reset();
        let e = ctx.get_async_event(Duration::from_secs(10));
        assert_eq!(e, Some(AsyncEvent::DeviceFatal), "a reset under the driver is found");
        let got = drain(&cq);
        assert!(got.iter().all(|(_, s)| *s == WcStatus::WrFlushErr) && got.len() == 4, "{got:?}");
    }
    reopens_and_works(&dev);
}

#[test]
fn a_port_flap_under_traffic_delivers_port_err_then_port_active() {
    let dev = Device::sim(SimConfig::default()).unwrap();
    let sim = sim_of(&dev);
    {
        let ctx = dev.open().unwrap();
        traffic(&ctx, 2);
        assert!(sim.set_port_up(false).is_some());
        assert_eq!(ctx.get_async_event(Duration::from_secs(5)), Some(AsyncEvent::PortErr { port: 1 }));
        assert!(sim.set_port_up(true).is_some());
        assert_eq!(ctx.get_async_event(Duration::from_secs(5)), Some(AsyncEvent::PortActive { port: 1 }));
        traffic(&ctx, 4);
    }
    reopens_and_works(&dev);
}

#[test]
fn a_page_request_the_host_cannot_satisfy_fails_its_command_and_the_device_keeps_working() {
    let dev = Device::sim(SimConfig::default()).unwrap();
    let sim = sim_of(&dev);
    {
        let ctx = dev.open().unwrap();
        traffic(&ctx, 2);
        // The next ALLOC_PD (which needs no host memory of its own) needs pages the host's DMA allocator will not
        // grant: the driver answers MANAGE_PAGES(CANT_GIVE), and the command fails instead of waiting forever.
        let cursor = sim.executed().len();
        sim.set_dma_max_contig(Some(0));
        sim.inject(Fault::NeedPages { opcode: consts::MLX5_CMD_OP_ALLOC_PD, pages: 100_000 });
        let t0 = Instant::now();
        let r = ctx.alloc_pd().map(drop);
        sim.set_dma_max_contig(None);
        let e = r.expect_err("an ALLOC_PD firmware could not get pages for");
        eprintln!("ALLOC_PD without its pages: {e} after {:?}", t0.elapsed());
        let cant_give = sim.executed()[cursor..]
            .iter()
            .any(|c| c.opcode == consts::MLX5_CMD_OP_MANAGE_PAGES && c.op_mod == consts::MLX5_PAGES_CANT_GIVE);
        assert!(cant_give, "the driver told firmware it cannot give the pages");
        traffic(&ctx, 4);
    }
    reopens_and_works(&dev);
}
