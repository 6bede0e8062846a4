//! The firmware's death: the health syndrome written into the initialization segment and logged.

use super::syndrome;
use crate::events::SimEvent;
use crate::regs::Regs;

/// The firmware dies with health syndrome `synd` (0: a silent stall) at device time `now_ns`. Idempotent.
pub(crate) fn fail(regs: &mut Regs, events: &mut Vec<SimEvent>, now_ns: u64, synd: u8) {
    if regs.dead() {
        return;
    }
    regs.die(synd, syndrome::HEALTH_EXT_SYND, now_ns);
    events.push(SimEvent::HealthFailure { synd });
}
