//! [`SimDelay`], the device's clock as the core's `DelayNs`: virtual time that runs due device work (in-line
//! mode), or real sleep (threaded mode).

use std::sync::Arc;
use std::time::Duration;

use mlx5_core::hal::DelayNs;

use crate::config::Mode;
use crate::device::lock;
use crate::device::Shared;

/// [`DelayNs`] for the simulator: advances virtual time (inline) or sleeps (threaded).
#[derive(Debug, Clone)]
pub struct SimDelay {
    pub(crate) shared: Arc<Shared>,
}

impl SimDelay {
    pub(crate) fn advance(&self, ns: u64) {
        let mode = lock(&self.shared).cfg.mode;
        match mode {
            Mode::Inline => {
                lock(&self.shared).advance_virtual(ns);
                // Retries whose timer expired (and anything commands made due) run now.
                self.shared.run(false);
            }
            Mode::Threaded => {
                std::thread::sleep(Duration::from_nanos(ns));
                self.shared.run(true);
            }
        }
    }
}

impl DelayNs for SimDelay {
    fn delay_ns(&mut self, ns: u32) {
        self.advance(u64::from(ns));
    }
    fn delay_us(&mut self, us: u32) {
        self.advance(u64::from(us) * 1_000);
    }
    fn delay_ms(&mut self, ms: u32) {
        self.advance(u64::from(ms) * 1_000_000);
    }
}
