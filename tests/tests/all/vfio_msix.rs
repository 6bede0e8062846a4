//! MSI-X on VFIO, end to end: the verbs layer opens a simulated ConnectX-5 through the VFIO code a real card
//! uses (container, group and device fds, region info, BAR 0 read and written through the device fd, DMA
//! mapped with `VFIO_IOMMU_MAP_DMA`, `VFIO_DEVICE_SET_IRQS` wiring one eventfd per vector), with the system calls
//! answered by the kernel's twin and the BAR, DMA and interrupts by the simulator. Each completion EQ has a vector
//! and an eventfd of its own, and a completion raises its interrupt on the eventfd of the vector its CQ asked
//! for, and on no other. In-line, the interrupt reaches its eventfd during the doorbell's `pwrite`; threaded, the
//! device raises it on its own thread and the twin delivers it at the next BAR access or while the verbs layer
//! sleeps on the eventfds.

use std::collections::BTreeSet;
use std::io;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mlx5_core::hal::Mmio;
use mlx5_sim::{Mode, SimConfig, SimDevice, SimMmio};
use mlx5_verbs::{wr, Access, Context, QpCap, QpType, WcStatus, WorkCompletion};
use mlx5_vfio::twin::{Twin, TwinBackend};

const BDF: &str = "0000:03:00.0";
const CAP: QpCap = QpCap { max_send_wr: 4, max_recv_wr: 4, max_send_sge: 1, max_recv_sge: 1, max_inline_data: 64 };

/// The simulator as the device behind a twin function, as the UML bridge and the PCI proxy put it behind a
/// guest's: BAR bytes are its big-endian registers, IOMMU mappings its DMA space, EQ interrupts its MSI-X vectors.
/// An in-line device's time follows the wall clock, pulled forward on every access (a threaded one keeps its own).
#[derive(Debug)]
struct SimBehindVfio {
    sim: SimDevice,
    mmio: SimMmio,
    inline: bool,
    start: Instant,
    cursor: Mutex<usize>,
}

impl SimBehindVfio {
    fn new(sim: SimDevice) -> SimBehindVfio {
        let inline = sim.config().mode == Mode::Inline;
        SimBehindVfio { mmio: sim.mmio(), sim, inline, start: Instant::now(), cursor: Mutex::new(0) }
    }

    fn tick(&self) {
        if !self.inline {
            return;
        }
        let now = self.start.elapsed().as_nanos() as u64;
        let dev = self.sim.now_ns();
        if now > dev {
            self.sim.advance_ns(now - dev);
        }
    }
}

fn einval() -> io::Error {
    io::Error::from_raw_os_error(libc::EINVAL)
}

impl TwinBackend for SimBehindVfio {
    fn bar_len(&self) -> u64 {
        self.mmio.bar_size() as u64
    }

    fn bar_read(&self, off: u64, buf: &mut [u8]) -> io::Result<()> {
        self.tick();
        let off = usize::try_from(off).map_err(|_| einval())?;
        match buf.len() {
            8 if off.is_multiple_of(8) => buf.copy_from_slice(&self.mmio.read64(off).to_be_bytes()),
            n if n % 4 == 0 && off.is_multiple_of(4) => {
                for (i, w) in buf.chunks_exact_mut(4).enumerate() {
                    w.copy_from_slice(&self.mmio.read32(off + 4 * i).to_be_bytes());
                }
            }
            _ => return Err(einval()),
        }
        Ok(())
    }

    fn bar_write(&self, off: u64, data: &[u8]) -> io::Result<()> {
        self.tick();
        let off = usize::try_from(off).map_err(|_| einval())?;
        match data.len() {
            4 if off.is_multiple_of(4) => self.mmio.write32(off, u32::from_be_bytes(data.try_into().unwrap())),
            // vfio-pci performs a longer write as 8-byte accesses in address order: each one doorbell.
            n if n % 8 == 0 && off.is_multiple_of(8) => {
                for (i, w) in data.chunks_exact(8).enumerate() {
                    self.mmio.write64(off + 8 * i, u64::from_be_bytes(w.try_into().unwrap()));
                }
            }
            _ => return Err(einval()),
        }
        Ok(())
    }

    unsafe fn dma_map(&self, iova: u64, cpu: NonNull<u8>, len: usize) -> io::Result<()> {
        // SAFETY: the twin keeps the memory allocated until dma_unmap, which takes the mapping away.
        unsafe { self.sim.map_guest_memory(iova, cpu, len) }.map_err(|_| io::Error::from_raw_os_error(libc::EEXIST))
    }

    fn dma_unmap(&self, iova: u64, len: usize) {
        assert!(self.sim.unmap_guest_memory(iova, len), "the twin unmaps only what it mapped");
    }

    fn take_interrupts(&self) -> Vec<u16> {
        self.tick();
        self.sim.interrupts_since(&mut self.cursor.lock().unwrap())
    }

    fn reset(&self) {
        self.sim.function_reset();
    }
}

/// A twin machine with a simulated ConnectX-5 at [`BDF`] bound to vfio-pci.
fn machine(mode: Mode) -> (Arc<Twin>, SimDevice) {
    let sim = SimDevice::new(SimConfig { mode, ..SimConfig::default() });
    let twin = Arc::new(Twin::new());
    twin.add_backed_device(BDF, 0x15b3, 0x1017, 7, Arc::new(SimBehindVfio::new(sim.clone())));
    (twin, sim)
}

/// Interrupts delivered to each vector's eventfd once `want` is reached or 5 s passed: a threaded device may write
/// the EQE a poll finds just before it raises the interrupt, which the twin then delivers.
/// Vectors below `first` are not waited for.
fn fired_when(twin: &Twin, vectors: usize, want: &[u64], first: usize) -> Vec<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        twin.deliver_interrupts();
        let f = fired(twin, vectors);
        if f[first..] == want[first..] || Instant::now() >= deadline {
            return f;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Interrupts delivered to each vector's eventfd so far.
fn fired(twin: &Twin, vectors: usize) -> Vec<u64> {
    let mut f = twin.state().devices[BDF].irq_fired.clone();
    f.resize(vectors, 0);
    f
}

#[test]
fn vfio_msix_one_eventfd_per_eq_and_each_cq_interrupts_on_the_vector_it_asked_for() {
    msix_per_eq(Mode::Inline);
}

#[test]
fn vfio_msix_a_threaded_device_raises_each_cqs_interrupt_on_its_vector_too() {
    msix_per_eq(Mode::Threaded);
}

fn msix_per_eq(mode: Mode) {
    const COMP: u16 = 4;
    let (twin, sim) = machine(mode);
    // Threaded, the EQEs of the commands just run may raise vector 0 after the command returned, so the control
    // vector is left out of the comparison there; the completion vectors are compared in both modes.
    let first = if mode == Mode::Inline { 0 } else { 1 };
    let ctx = Context::open_vfio_on(twin.clone(), BDF.parse().unwrap(), COMP).unwrap();
    let n = ctx.num_comp_vectors().unwrap();
    assert_eq!(n, COMP, "num_comp_vectors is what was asked for: the function has 64 MSI-X vectors");
    let vectors = 1 + usize::from(n);

    // SET_IRQS wired one eventfd per vector, each its own.
    let fds = twin.state().devices[BDF].irq_fds.clone();
    assert_eq!(fds.len(), vectors, "vector 0 for the control EQs, one per completion vector");
    assert_eq!(fds.iter().collect::<BTreeSet<_>>().len(), vectors, "distinct eventfds: {fds:?}");
    {
        let pd = ctx.alloc_pd().unwrap();
        let ch = ctx.create_comp_channel().unwrap();
        let mut buf = ctx.alloc_buffer(4096).unwrap();
        let mr = pd.register(&mut buf, Access::LOCAL_WRITE).unwrap();
        // Highest vector first, so a CQ that landed on the lowest (or on vector 0) cannot pass by order.
        for v in (0..n).rev() {
            let cq = ctx.create_cq_on(16, u64::from(v), Some(&ch), v).unwrap();
            let qp = pd.create_qp(QpType::Rc, &cq, &cq, CAP).unwrap();
            let me = ctx.remote_qp(&qp).unwrap();
            let qp = qp.connect_rc(me, Access::default()).unwrap();
            let before = fired(&twin, vectors);
            let counts = twin.eventfd_counts(BDF);
            cq.req_notify(false).unwrap();
            qp.post_recv(&[wr::recv(1, &[mr.sge(0, 64)])]).unwrap();
            qp.post_send(&[wr::send_inline(2, b"vector")]).unwrap();
            let ev = ch.get_cq_event(Duration::from_secs(5)).unwrap().expect("a completion event");
            assert_eq!(ev.cq_context(), u64::from(v));
            let mut want = before.clone();
            want[1 + usize::from(v)] += 1;
            assert_eq!(
                fired_when(&twin, vectors, &want, first)[first..],
                want[first..],
                "comp_vector {v}: one interrupt, on vector {}",
                1 + v
            );
            if mode == Mode::Inline {
                // What a read of each eventfd would return moved by the same: the interrupt is in the eventfd of
                // the CQ's vector, and in no other. (Threaded, the waiter has read it.)
                let mut want = counts;
                want[1 + usize::from(v)] += 1;
                assert_eq!(twin.eventfd_counts(BDF), want, "comp_vector {v}: the eventfds");
            }
            ev.ack().unwrap();
            let mut wc = [WorkCompletion::default(); 2];
            assert_eq!(cq.poll_until(&mut wc, 2, Duration::from_secs(5)).unwrap(), 2);
            assert!(wc.iter().all(|w| w.status == WcStatus::Success), "{wc:?}");
        }
        // Each completion EQ (made on first use, as mlx5_comp_eqn_get does) on a vector of its own; the control
        // EQs (command, async, pages) on vector 0, as mlx5_core's MLX5_IRQ_VEC_COMP_BASE puts them.
        let intrs: Vec<u16> = (0..=u8::MAX).filter_map(|eqn| sim.eq_info(eqn)).map(|i| i.intr).collect();
        let comp: Vec<u16> = intrs.iter().copied().filter(|&v| v != 0).collect();
        assert_eq!(comp.len(), usize::from(n), "one completion EQ per vector: {intrs:?}");
        assert_eq!(comp.iter().copied().collect::<BTreeSet<_>>(), (1..=n).collect(), "none shared: {intrs:?}");
        assert_eq!(intrs.len(), comp.len() + 3, "{intrs:?}");
        assert_eq!(twin.state().devices[BDF].irq_unwired, 0, "every interrupt had its eventfd");
        assert!(ctx.create_cq_on(16, 0, Some(&ch), n).is_err(), "one past the last vector is refused");
    }

    // Closed: the vectors disabled, every mapping taken from the device, every fd closed, the function reset.
    drop(ctx);
    let s = twin.state();
    assert!(s.devices[BDF].irq_fds.is_empty() && s.maps.is_empty() && !s.devices[BDF].open);
    assert_eq!(s.devices[BDF].resets, 1);
    drop(s);
    assert_eq!(twin.open_fds(), 0);
    assert_eq!(sim.dma_outstanding(), (0, 0), "the simulator reaches no memory any more");
    assert!(sim.dma_faults().is_empty(), "{:?}", sim.dma_faults());
}
