//! The device side of the links (`link::Station`): a link reader thread hands what it received to the device
//! through this, and the device runs. Links thus carry frames without knowing the device or its datapath.

use std::sync::Arc;

use super::pump::pump;
use super::state::{lock, Shared};
use crate::events::SimEvent;
use crate::link::{DevRef, Packet, Station, Wire};

impl Station for Shared {
    fn with_wire<R>(&self, f: impl FnOnce(&mut Wire, &mut Vec<SimEvent>) -> (R, Option<bool>)) -> R {
        let mut guard = lock(self);
        let st = &mut *guard;
        let (r, port_up) = f(&mut st.wire, &mut st.events);
        if let Some(up) = port_up {
            let _ = st.set_port_up(up);
        }
        r
    }

    fn receive_frame(&self, frame: &[u8], src: &DevRef) -> Option<Vec<u8>> {
        lock(self).datapath().receive_frame(frame, src)
    }

    fn receive_packet(&self, p: Packet) {
        let mut st = lock(self);
        let me = st.wire.me.clone();
        st.datapath().receive(Packet { dst: me, ..p });
    }

    fn run(self: &Arc<Self>) {
        pump(self);
    }
}
