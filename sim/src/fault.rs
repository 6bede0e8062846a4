//! Faults a test injects: [`Fault`] into the firmware's commands (matched by opcode), and, at any moment, a QP's
//! catastrophic error ([`SimDevice::fail_qp`](crate::SimDevice::fail_qp)).

/// A fault to inject into the firmware. Each matches commands by opcode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The command completes (delivery OK) with this status and syndrome, without executing. `times` is the
    /// number of commands affected; 0 means every matching command until [`SimDevice::clear_faults`](crate::SimDevice::clear_faults).
    Status { opcode: u16, status: u8, syndrome: u32, times: u32 },
    /// The command never completes: the owner bit stays with hardware.
    Hang { opcode: u16 },
    /// The command completes `ms` milliseconds after its doorbell (virtual time in inline mode).
    Delay { opcode: u16, ms: u32 },
    /// Delivery fails with this `MLX5_CMD_DELIVERY_STAT_*` value.
    Delivery { opcode: u16, status: u8 },
    /// After execution, byte `offset` of the output message is replaced by `value`.
    CorruptOutput { opcode: u16, offset: usize, value: u8 },
    /// Each time a command with this opcode completes, firmware posts a page request for `num_pages`: positive,
    /// its need grows by that much; negative, it marks that many pages returnable and the next MANAGE_PAGES(take)
    /// hands them back. Held until an EQ subscribes to page requests.
    PageRequest { opcode: u16, num_pages: i32 },
    /// The next command with this opcode (once) cannot complete until the driver gives `pages` more pages:
    /// firmware posts a page request and keeps the command (owner bit with hardware, nothing written) until a
    /// MANAGE_PAGES(give) on another slot covers it; then that MANAGE_PAGES completes, and the stalled command
    /// executes and completes.
    NeedPages { opcode: u16, pages: u32 },
    /// Ringing a command with this opcode kills the firmware instead of executing it: health syndrome `synd`,
    /// frozen heartbeat, no more completions or EQEs (see [`SimDevice::fail_health`](crate::SimDevice::fail_health)).
    Fatal { opcode: u16, synd: u8 },
    /// As [`Fault::Fatal`] with syndrome 0: only the frozen heartbeat and the hung commands show it.
    Stall { opcode: u16 },
    /// Ringing a command with this opcode removes the device from the bus (see [`SimDevice::device_gone`](crate::SimDevice::device_gone)).
    DeviceGone { opcode: u16 },
}

impl Fault {
    /// The opcode the fault matches.
    pub fn opcode(&self) -> u16 {
        match *self {
            Fault::Status { opcode, .. }
            | Fault::Hang { opcode }
            | Fault::Delay { opcode, .. }
            | Fault::Delivery { opcode, .. }
            | Fault::CorruptOutput { opcode, .. }
            | Fault::PageRequest { opcode, .. }
            | Fault::NeedPages { opcode, .. }
            | Fault::Fatal { opcode, .. }
            | Fault::Stall { opcode }
            | Fault::DeviceGone { opcode } => opcode,
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::events::SimEvent;
    use crate::sim_device::SimDevice;

    #[test]
    fn failing_an_unknown_qp_or_on_a_dead_device_changes_nothing() {
        let dev = SimDevice::default();
        assert!(!dev.fail_qp(0x1234));
        dev.stall_health();
        assert!(!dev.fail_qp(0x1234));
        assert!(!dev.events().iter().any(|e| matches!(e, SimEvent::Eqe { .. })));
    }
}
