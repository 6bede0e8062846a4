//! A simulated InfiniBand switch: N external ports, each plugged into a VDE fabric of its own (a `vde_switch` with
//! two plugs is a cable: the switch's port and one simulated HCA port, `SimDevice::vde_plug`), and a management
//! port 0 with an SMA, so one subnet manager sweeps the switch and every channel adapter behind it, gives each a
//! LID and programs the switch's forwarding table. What the switch does with a frame is `forward.rs` (LFT
//! routing, the directed-route hop rules, drops counted by why); what its SMA answers is `sma.rs`.
//!
//! Each port has one reader thread: it takes a frame from its cable, runs it through the switch under one lock
//! and sends what comes out on the output ports' cables (libvdeplug sends never block for long: a full
//! `vde_switch` queue drops, as a congested link would). A cable that goes away takes its port Down
//! (PortStateChange set for the SM); the switch keeps running for the others.

mod forward;
mod sma;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::link::vde::{Conn, VdeError};
use crate::link::Datagrams;

pub use forward::SwitchCounters;

/// How long a reader waits in `poll` before it looks whether the switch is stopping.
const POLL_MS: i32 = 50;

/// What one external port looks like from outside: its state and physical state (PortInfo's codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwitchPort {
    /// 1 Down, 2 Init, 3 Armed, 4 Active.
    pub state: u8,
    /// 2 Polling, 5 LinkUp.
    pub phys: u8,
}

/// A snapshot of the switch: its LID (0: none yet), its ports, how many LIDs its LFT routes, and its counters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SwitchState {
    pub lid: u16,
    pub sm_lid: u16,
    pub ports: Vec<SwitchPort>,
    pub lft_entries: usize,
    pub counters: SwitchCounters,
    /// SMPs answered with a MAD status other than success: (method, attribute, status, how many).
    pub statuses: Vec<(u8, u16, u16, u64)>,
}

struct Inner {
    sw: Mutex<forward::Switch>,
    /// The cables of ports 1..=N, in order.
    conns: Vec<Conn>,
    stop: AtomicBool,
}

/// A running switch (its reader threads end when it is dropped).
pub struct IbSwitch {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for IbSwitch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IbSwitch").field("state", &self.state()).finish()
    }
}

impl IbSwitch {
    /// Starts a switch with node GUID `node_guid` and NodeDescription `description`, one external port per
    /// libvdeplug URL in `cables` (1 to 15; port k is `cables[k-1]`).
    pub fn start(node_guid: u64, description: &str, cables: &[&str]) -> Result<IbSwitch, VdeError> {
        if cables.is_empty() || cables.len() > 15 {
            return Err(VdeError::BadUrl { url: format!("{} cables (a switch here has 1 to 15 ports)", cables.len()) });
        }
        let conns = cables.iter().map(|u| Conn::open(u)).collect::<Result<Vec<_>, _>>()?;
        let sw = forward::Switch::new(sma::SwitchSma::new(node_guid, cables.len() as u8, description));
        let inner = Arc::new(Inner { sw: Mutex::new(sw), conns, stop: AtomicBool::new(false) });
        let mut threads = Vec::new();
        for k in 0..cables.len() {
            let i = inner.clone();
            let t = std::thread::Builder::new()
                .name(format!("mlx5-sim-switch-{}", k + 1))
                .spawn(move || read_loop(&i, k as u8 + 1))
                .map_err(|source| VdeError::Threads { source })?;
            threads.push(t);
        }
        Ok(IbSwitch { inner, threads })
    }

    /// The switch as it is now.
    pub fn state(&self) -> SwitchState {
        let sw = self.inner.sw.lock().unwrap_or_else(|e| e.into_inner());
        SwitchState {
            lid: sw.sma.lid(),
            sm_lid: sw.sma.ports[0].info.master_sm_lid,
            ports: sw.sma.ports[1..].iter().map(|p| SwitchPort { state: p.state, phys: p.phys }).collect(),
            lft_entries: sw.sma.lft.iter().filter(|&&p| p != sma::UNPROGRAMMED).count(),
            counters: sw.counters,
            statuses: sw.sma.statuses.clone(),
        }
    }
}

impl Drop for IbSwitch {
    fn drop(&mut self) {
        self.inner.stop.store(true, Ordering::Relaxed);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn read_loop(inner: &Inner, port: u8) {
    let conn = &inner.conns[usize::from(port - 1)];
    let (data, ctl) = conn.fds();
    let mut buf = vec![0u8; 1 << 16];
    while !inner.stop.load(Ordering::Relaxed) {
        let mut fds = [
            libc::pollfd { fd: data, events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: ctl, events: libc::POLLIN, revents: 0 },
        ];
        let nfds = if ctl >= 0 { 2 } else { 1 };
        // SAFETY: `fds` holds `nfds` valid pollfd entries.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), nfds, POLL_MS) };
        if n <= 0 {
            continue;
        }
        // The control socket is readable only when the fabric went away.
        let gone = fds[1].revents != 0 && nfds == 2;
        let got = if fds[0].revents & libc::POLLIN != 0 { conn.recv(&mut buf) } else { 0 };
        if gone || (fds[0].revents != 0 && got <= 0) {
            inner.sw.lock().unwrap_or_else(|e| e.into_inner()).sma.set_link(port, false);
            return;
        }
        if got <= 0 {
            continue;
        }
        let out = inner.sw.lock().unwrap_or_else(|e| e.into_inner()).frame_in(port, &buf[..got as usize]);
        for (p, f) in out {
            if let Some(c) = inner.conns.get(usize::from(p).wrapping_sub(1)) {
                let _ = c.send(&f);
            }
        }
    }
}
