//! The Linux completion channel: `wait_cq_event` sleeps on the EQ's interrupt eventfd until a completion event
//! arrives. The HCA is the simulated one; the interrupt path is the VFIO layer's, over the kernel twin.

use std::sync::Arc;
use std::time::Duration;

use mlx5_core::cq::{CqeFields, Notify};
use mlx5_core::hca::CqAttr;
use mlx5_core::hca::{Config, Hca};
use mlx5_core::prm::consts;
use mlx5_sim::SimDevice;
use mlx5_vfio::irq::{wait_cq_event, Interrupts};
use mlx5_vfio::sys::Sys;
use mlx5_vfio::twin::Twin;
use mlx5_vfio::VfioDevice;

const BDF: &str = "0000:03:00.0";

#[test]
fn a_waiter_sleeps_until_the_eq_interrupt_and_then_gets_the_cqn() {
    let twin = Arc::new(Twin::new());
    twin.add_device(BDF, 0x15b3, 0x1017, 7, Some("vfio-pci"), 1 << 20);
    let sys: Arc<dyn Sys> = twin.clone();
    let vdev = VfioDevice::open_with(sys, BDF.parse().unwrap()).unwrap();
    let irqs = Interrupts::enable(&vdev, 1).unwrap();

    let dev = SimDevice::default();
    let mut d = dev.delay();
    let mut hca: Hca<_, _> = Hca::bring_up(dev.mmio(), dev.dma(), (), &mut d, Config::default()).unwrap();
    let cq = hca.create_cq(CqAttr::default(), &mut d).unwrap();
    let cqn = cq.cqn();

    // Nothing armed, nothing fired: the wait times out with no event.
    assert_eq!(wait_cq_event(&mut hca, &irqs, 0, &mut d, Duration::from_millis(30)).unwrap(), None);

    // Armed; the "device" completes a send on another thread and raises the EQ's vector.
    hca.req_notify_cq(&cq, Notify::NextComp).unwrap();
    let cqe = CqeFields {
        opcode: consts::MLX5_CQE_REQ,
        wqe_opcode: consts::MLX5_OPCODE_SEND,
        qpn: 0x42,
        ..CqeFields::default()
    }
    .emit()
    .0;
    let fired = std::thread::scope(|s| {
        let t = s.spawn(|| {
            std::thread::sleep(Duration::from_millis(50));
            dev.post_cqe(cqn, cqe).unwrap();
            twin.fire(BDF, 0)
        });
        let got = wait_cq_event(&mut hca, &irqs, 0, &mut d, Duration::from_secs(30)).unwrap();
        assert_eq!(got, Some(cqn));
        t.join().unwrap()
    });
    assert!(fired, "the vector was wired to an eventfd");
    hca.ack_cq_events(&cq, 1).unwrap();

    // An interrupt that arrived while nobody waited is not lost, and one event is one event.
    hca.req_notify_cq(&cq, Notify::NextComp).unwrap();
    dev.post_cqe(cqn, cqe).unwrap();
    twin.fire(BDF, 0);
    assert_eq!(wait_cq_event(&mut hca, &irqs, 0, &mut d, Duration::from_secs(30)).unwrap(), Some(cqn));
    assert_eq!(wait_cq_event(&mut hca, &irqs, 0, &mut d, Duration::from_millis(10)).unwrap(), None);
    hca.ack_cq_events(&cq, 1).unwrap();
    hca.destroy_cq(cq, &mut d).unwrap();
    hca.teardown(&mut d).unwrap();
}
