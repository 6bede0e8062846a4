//! The verbs device list and shared HCAs: names and order, GUIDs, no bring-up while listing, several contexts on
//! one device (reference counted, torn down at the last close).

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use mlx5_core::prm::Opcode;
use mlx5_sim::{HcaState, PortType, SimConfig};
use mlx5_verbs::{
    scan_vfio_pci, wr, Access, DeviceRegistry, DeviceSpec, QpCap, QpType, WcStatus, WireSpec, WorkCompletion,
};

/// A fresh directory under the system's temporary one (tests run in parallel threads of one process).
fn temp_dir(what: &str) -> PathBuf {
    static N: AtomicU32 = AtomicU32::new(0);
    let d = std::env::temp_dir().join(format!(
        "mlx5-verbs-{what}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A sysfs tree with vfio-pci bound to the given functions, each with its vendor id.
fn fake_sysfs(bound: &[(&str, &str)]) -> PathBuf {
    let root = temp_dir("sysfs");
    let drv = root.join("bus/pci/drivers/vfio-pci");
    std::fs::create_dir_all(&drv).unwrap();
    // The driver directory also holds control files, which are not devices.
    std::fs::write(drv.join("new_id"), "").unwrap();
    for (bdf, vendor) in bound {
        std::fs::create_dir_all(drv.join(bdf)).unwrap();
        std::fs::write(drv.join(bdf).join("vendor"), format!("{vendor}\n")).unwrap();
    }
    root
}

#[test]
fn vfio_scan_keeps_mellanox_functions_in_address_order() {
    let root = fake_sysfs(&[("0000:05:00.0", "0x15b3"), ("0000:03:00.1", "0x15b3"), ("0000:04:00.0", "0x8086")]);
    let found: Vec<String> = scan_vfio_pci(&root).iter().map(|b| b.to_string()).collect();
    assert_eq!(found, ["0000:03:00.1", "0000:05:00.0"]);
    // No vfio-pci directory at all (the module is not loaded): nothing, not an error.
    assert!(scan_vfio_pci(&temp_dir("empty")).is_empty());
}

#[test]
fn devices_are_named_sims_first_then_pci_sorted_and_stable() {
    let root = fake_sysfs(&[("0000:05:00.0", "0x15b3"), ("0000:03:00.1", "0x15b3"), ("0000:04:00.0", "0x8086")]);
    let specs = DeviceSpec::parse_list("sim, sim:link=ib:host=1, 0000:05:00.0, 01:00.0, vfio").unwrap();
    let reg = DeviceRegistry::new(&specs, &root);
    let list = reg.devices();
    let names: Vec<&str> = list.iter().map(|d| d.name()).collect();
    assert_eq!(names, ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3", "mlx5_4"]);
    let pci: Vec<Option<String>> = list.iter().map(|d| d.pci_address().map(|b| b.to_string())).collect();
    assert_eq!(
        pci,
        [None, None, Some("0000:01:00.0".into()), Some("0000:03:00.1".into()), Some("0000:05:00.0".into())],
        "named and found functions merged, each once, by address"
    );
    let base = SimConfig::default().node_guid;
    assert_eq!(list[0].guid(), Some(base));
    assert_eq!(list[1].guid(), Some(base + 1), "host=1 is the next simulated host");
    assert_eq!(list[1].sim_device().unwrap().config().port_type, PortType::Ib);
    let ib = list[1].open().unwrap();
    assert_eq!(ib.node_guid().unwrap(), base + 1, "from the HCA vport context on InfiniBand");
    drop(ib);
    assert_eq!(list[2].guid(), None, "a VFIO device's GUID needs bring-up");
    // A second listing names the same devices the same way.
    let again: Vec<(String, Option<u64>)> = reg.devices().iter().map(|d| (d.name().into(), d.guid())).collect();
    let first: Vec<(String, Option<u64>)> = list.iter().map(|d| (d.name().into(), d.guid())).collect();
    assert_eq!(again, first);
}

#[test]
fn bad_device_specs_are_refused() {
    for bad in
        ["sim:link=fc", "sim:host=x", "sim:wire=shout:127.0.0.1:1", "sim:wire=listen:", "mlx5_zero", "0000:03:00.9"]
    {
        assert!(DeviceSpec::parse(bad).is_err(), "{bad}");
    }
    let wired = DeviceSpec::parse("sim:link=ib:host=2:wire=connect:127.0.0.1:18516").unwrap();
    let want = DeviceSpec::Sim {
        link: PortType::Ib,
        host: 2,
        ipv4: None,
        wire: Some(WireSpec::Connect("127.0.0.1:18516".into())),
        connect_timeout: Duration::from_secs(30),
        subnet_manager: false,
    };
    assert_eq!(wired, want);
    // `sm=wait`: an InfiniBand port waiting for a subnet manager; a RoCE port has none.
    let waits = DeviceSpec::parse("sim:link=ib:sm=wait:wire=connect:127.0.0.1:18516").unwrap();
    assert!(matches!(waits, DeviceSpec::Sim { subnet_manager: true, link: PortType::Ib, .. }), "{waits:?}");
    assert!(DeviceSpec::parse("sim:sm=wait").is_err());
    assert!(DeviceSpec::parse("sim:link=ib:sm=later").is_err());
}

#[test]
fn listing_brings_nothing_up() {
    let reg = DeviceRegistry::new(&[DeviceSpec::parse("sim").unwrap()], temp_dir("nosys"));
    let list = reg.devices();
    let _ = reg.devices();
    let sim = list[0].sim_device().unwrap();
    assert!(sim.executed().is_empty(), "listing sent {} commands", sim.executed().len());
    assert_eq!(sim.hca_state(), HcaState::Disabled);
    assert!(!list[0].is_open());
}

#[test]
fn two_contexts_share_one_hca_ping_pong_and_the_last_close_tears_down() {
    let reg = DeviceRegistry::new(&[DeviceSpec::parse("sim").unwrap()], temp_dir("share"));
    let dev = reg.devices().remove(0);
    let sim = dev.sim_device().unwrap().clone();
    let enables = || sim.executed().iter().filter(|c| c.opcode == Opcode::EnableHca.raw()).count();
    let server = dev.open().unwrap();
    let client = reg.devices()[0].open().unwrap();
    assert_eq!(enables(), 1, "the second open shares the HCA");
    assert_eq!(client.node_guid().unwrap(), dev.guid().unwrap(), "firmware reports the listed GUID");
    assert!(dev.is_open());

    let cap = QpCap { max_send_wr: 8, max_recv_wr: 8, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    {
        let (spd, cpd) = (server.alloc_pd().unwrap(), client.alloc_pd().unwrap());
        let (scq, ccq) = (server.create_cq(16).unwrap(), client.create_cq(16).unwrap());
        let sqp = spd.create_qp(QpType::Rc, &scq, &scq, cap).unwrap();
        let cqp = cpd.create_qp(QpType::Rc, &ccq, &ccq, cap).unwrap();
        let (sr, cr) = (server.remote_qp(&sqp).unwrap(), client.remote_qp(&cqp).unwrap());
        let sqp = sqp.connect_rc(cr, Access::default()).unwrap();
        let cqp = cqp.connect_rc(sr, Access::default()).unwrap();
        let mut sbuf = server.alloc_buffer(4096).unwrap();
        let mut cbuf = client.alloc_buffer(4096).unwrap();
        let smr = spd.register(&mut sbuf, Access::LOCAL_WRITE).unwrap();
        let cmr = cpd.register(&mut cbuf, Access::LOCAL_WRITE).unwrap();
        let mut wc = [WorkCompletion::default(); 4];
        for i in 0..10u64 {
            // Client to server, then back.
            sqp.post_recv(&[wr::recv(i, &[smr.sge(0, 64)])]).unwrap();
            cqp.post_send(&[wr::send_inline(100 + i, format!("ping {i}").as_bytes())]).unwrap();
            assert_eq!(scq.poll_until(&mut wc, 1, Duration::from_secs(5)).unwrap(), 1);
            assert_eq!((wc[0].wr_id, wc[0].status), (i, WcStatus::Success));
            assert_eq!(smr.read_vec(0, 6), format!("ping {i}").as_bytes()[..6]);
            cqp.post_recv(&[wr::recv(200 + i, &[cmr.sge(0, 64)])]).unwrap();
            sqp.post_send(&[wr::send_inline(300 + i, b"pong")]).unwrap();
            // The client's CQ holds its send completion and the pong.
            let n = ccq.poll_until(&mut wc, 2, Duration::from_secs(5)).unwrap();
            let mut ids: Vec<u64> = wc[..n].iter().map(|w| w.wr_id).collect();
            ids.sort_unstable();
            assert_eq!(ids, [100 + i, 200 + i]);
            assert_eq!(scq.poll_until(&mut wc, 1, Duration::from_secs(5)).unwrap(), 1);
            assert_eq!(wc[0].wr_id, 300 + i);
        }
    }
    // Closing the client leaves the server working.
    drop(client);
    assert!(dev.is_open());
    {
        let pd = server.alloc_pd().unwrap();
        let cq = server.create_cq(8).unwrap();
        let qp = pd.create_qp(QpType::Rc, &cq, &cq, cap).unwrap();
        let me = server.remote_qp(&qp).unwrap();
        let qp = qp.connect_rc(me, Access::default()).unwrap();
        let mut buf = server.alloc_buffer(64).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        qp.post_recv(&[wr::recv(1, &[mr.sge(0, 64)])]).unwrap();
        qp.post_send(&[wr::send_inline(2, b"alone")]).unwrap();
        let mut wc = [WorkCompletion::default(); 2];
        assert_eq!(cq.poll_until(&mut wc, 2, Duration::from_secs(5)).unwrap(), 2);
        assert!(wc.iter().all(|w| w.status == WcStatus::Success));
        assert_eq!(mr.read_vec(0, 5), b"alone");
    }
    assert_eq!(sim.hca_state(), HcaState::Initialized);
    drop(server);
    assert!(!dev.is_open());
    assert_eq!(sim.hca_state(), HcaState::Disabled, "the last close tears the HCA down");
    assert_eq!(sim.dma_outstanding(), (0, 0), "every DMA allocation is given back");
    // A new open brings it up again.
    let again = dev.open().unwrap();
    assert_eq!(enables(), 2);
    drop(again);
}

#[test]
fn opens_racing_the_last_close_wait_for_its_teardown() {
    // Threads open and close one device over and over: an open that finds the HCA gone while the last close's
    // teardown still runs waits for it, then brings the device up again (never ENABLE_HCA on a half-torn-down
    // function).
    let reg = DeviceRegistry::new(&[DeviceSpec::parse("sim").unwrap()], temp_dir("race"));
    let dev = reg.devices().remove(0);
    let sim = dev.sim_device().unwrap().clone();
    std::thread::scope(|s| {
        for t in 0..6 {
            let dev = &dev;
            s.spawn(move || {
                for i in 0..40 {
                    let ctx = dev.open().unwrap_or_else(|e| panic!("thread {t}, open {i}: {e}"));
                    let pd = ctx.alloc_pd().unwrap();
                    drop(pd);
                    drop(ctx);
                }
            });
        }
    });
    assert!(!dev.is_open());
    assert_eq!(sim.hca_state(), HcaState::Disabled);
    assert_eq!(sim.dma_outstanding(), (0, 0));
}

#[test]
fn wired_specs_join_two_registries_devices_over_the_simulated_wire() {
    // Two processes' device lists, here two registries of one process, over 127.0.0.1.
    let a = DeviceRegistry::new(&[DeviceSpec::parse("sim:wire=listen:127.0.0.1:0").unwrap()], temp_dir("wa"));
    let da = a.devices().remove(0);
    assert_eq!(da.wire_addr(), None, "the wire is plugged in at the first open");
    let ca = da.open().unwrap();
    let at = da.wire_addr().expect("listening after the open");
    let spec = format!("sim:host=1:wire=connect:{at}");
    let b = DeviceRegistry::new(&[DeviceSpec::parse(&spec).unwrap()], temp_dir("wb"));
    let cb = b.devices()[0].open().unwrap();
    assert!(da.sim_device().unwrap().wire_wait_peer(Duration::from_secs(10)));

    let cap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };
    let (pa, pb) = (ca.alloc_pd().unwrap(), cb.alloc_pd().unwrap());
    let (qa_cq, qb_cq) = (ca.create_cq(8).unwrap(), cb.create_cq(8).unwrap());
    let qa = pa.create_qp(QpType::Rc, &qa_cq, &qa_cq, cap).unwrap();
    let qb = pb.create_qp(QpType::Rc, &qb_cq, &qb_cq, cap).unwrap();
    let (ra, rb) = (ca.remote_qp(&qa).unwrap(), cb.remote_qp(&qb).unwrap());
    assert_ne!(ra.gid, rb.gid, "two hosts");
    let qa = qa.connect_rc(rb, Access::default()).unwrap();
    let qb = qb.connect_rc(ra, Access::default()).unwrap();
    let mut buf = cb.alloc_buffer(64).unwrap();
    let mr = pb.register(&mut buf, Access::LOCAL_WRITE).unwrap();
    qb.post_recv(&[wr::recv(1, &[mr.sge(0, 64)])]).unwrap();
    qa.post_send(&[wr::send_inline(2, b"over the wire")]).unwrap();
    let mut wc = [WorkCompletion::default(); 1];
    assert_eq!(qb_cq.poll_until(&mut wc, 1, Duration::from_secs(10)).unwrap(), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (1, WcStatus::Success));
    assert_eq!(qa_cq.poll_until(&mut wc, 1, Duration::from_secs(10)).unwrap(), 1);
    assert_eq!((wc[0].wr_id, wc[0].status), (2, WcStatus::Success));
    assert_eq!(mr.read_vec(0, 13), b"over the wire");
}
