//! Expectation mocks of the firmware command interface (feature `mock`), in the spirit of embedded-hal-mock: a
//! test lists the commands it expects, with the reply to each, and the code under test runs against a
//! [`MockDevice`] through the ordinary [`Mmio`](crate::hal::Mmio) and [`Dma`](crate::hal::Dma) traits.
//!
//! ```ignore
//! let dev: MockDevice = MockDevice::new(arena);
//! dev.expect(Expect::cmd(Opcode::CreateCq).field("cq_context.log_cq_size", 10).returns("cqn", 5))
//!    .expect(Expect::cmd(Opcode::DestroyCq).field("cqn", 5));
//! // ... the code under test runs with `&dev` as its Mmio and Dma ...
//! dev.done()?; // or dev.assert_done()
//! ```
//!
//! An expectation names the opcode, optionally `op_mod`, input fields by their PRM path inside `<opcode>_in`
//! (`cq_context.log_cq_size`, `pas[0]`, resolved through the generated name table) or the whole input message;
//! its [`Reply`] gives output fields by name (inside `<opcode>_out`) or a whole recorded output, status and
//! syndrome, a timeout (the entry is never handed back), a delivery error, or a page request posted as an EQE
//! before the command completes. The first command that departs from the script is kept as a readable message
//! (`CREATE_CQ: cq_context.log_cq_size expected 10, got 11`, `expected CREATE_CQ, got DESTROY_CQ`) and answered
//! with `BAD_OP` (syndrome [`UNEXPECTED_SYNDROME`]) so the code under test fails fast; [`MockDevice::done`]
//! reports it, or the expectations left over (`2 expectations left: DESTROY_CQ, DEALLOC_PD`). Commands a test does
//! not care about are answered only when named with [`MockDevice::allow_any`], never silently.
//!
//! The device side emulates what the core's bring-up reads of the initialization segment (firmware and command
//! interface revisions, queue geometry, `initializing` clear, a moving heartbeat, the command timeout) and the
//! command queue (entry, mailbox chains followed by their `next` pointers, ownership, delivery status). It does not
//! execute commands: every answer comes from the script. Everything is fixed-capacity (`N` expectations, `R` live
//! DMA regions, [`MAX_FIELDS`] fields each) and nothing allocates, so the same tests run on a microcontroller.

// Messages are returned by value: the mock has no heap to box them in.
#![allow(clippy::result_large_err)]

mod device;
mod expect;
mod names;

#[cfg(test)]
mod tests;

pub use device::{MockConfig, MockDevice, IOVA_BASE, MAX_ALIGN, MAX_ALLOWED, MAX_PAGE_RUNS, UNEXPECTED_SYNDROME};
pub use expect::{Ending, Expect, NamedValue, Reply, MAX_FIELDS};

use crate::prm::Opcode;

/// Characters a mock message holds (longer ones are cut).
pub const MSG_LEN: usize = 256;

/// A mock's report, without allocation.
pub type Message = heapless::String<MSG_LEN>;

/// Why [`MockDevice::done`] failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MockError {
    /// The first command that departed from the script (or another misuse of the device), as a message naming the
    /// command and the field.
    Unexpected(Message),
    /// The code under test stopped before these expectations were met.
    Left {
        /// How many.
        count: usize,
        /// Their opcodes, in order (`, ...` when they do not all fit).
        names: Message,
    },
}

impl core::fmt::Display for MockError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            MockError::Unexpected(m) => f.write_str(m),
            MockError::Left { count: 1, names } => write!(f, "1 expectation left: {names}"),
            MockError::Left { count, names } => write!(f, "{count} expectations left: {names}"),
        }
    }
}

impl core::error::Error for MockError {}

/// An opcode's kernel name (`CREATE_CQ`), or its number when the headers do not name it.
pub(crate) struct OpStr(Opcode);

impl core::fmt::Display for OpStr {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self.0.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "opcode {:#x}", self.0.raw()),
        }
    }
}

pub(crate) fn op_str(op: Opcode) -> OpStr {
    OpStr(op)
}
