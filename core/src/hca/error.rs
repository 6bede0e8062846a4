//! The HCA's errors: the bring-up [`Step`] that failed, [`Error`] and [`BringupError`] (the failures Linux logs
//! from `mlx5_load_one` and friends).

use crate::cmdq::CmdError;
use crate::eq::EqError;
use crate::hal::DmaError;
use crate::health::HealthFailure;
use crate::pages::PagesError;
use crate::prm::Opcode;

/// A bring-up step, named as Linux logs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Step {
    /// Waiting for firmware before the command queue exists.
    PreInitializing,
    /// Setting up the command queue.
    CmdqInit,
    /// Waiting for firmware after the queue address is set.
    Initializing,
    /// ENABLE_HCA.
    EnableHca,
    /// QUERY_ISSI / SET_ISSI.
    SetIssi,
    /// Boot pages (QUERY_PAGES, MANAGE_PAGES).
    BootPages,
    /// ACCESS_REG(HOST_ENDIANNESS).
    HcaCtrl,
    /// QUERY_HCA_CAP / SET_HCA_CAP.
    SetHcaCaps,
    /// Init pages.
    InitPages,
    /// INIT_HCA.
    InitHca,
    /// SET_DRIVER_VERSION.
    DriverVersion,
    /// QUERY_HCA_CAP (current values).
    QueryCaps,
    /// ALLOC_UAR.
    AllocUar,
    /// CREATE_EQ of the command, async and pages EQs.
    CreateEq,
    /// Regular pages.
    RegularPages,
    /// ALLOC_Q_COUNTER of the port's counter set.
    QCounter,
    /// SET_ROCE_ADDRESS of each GID table entry (RoCE ports).
    GidTable,
}

impl core::fmt::Display for Step {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str(match self {
            Step::PreInitializing => "wait for firmware (pre-initializing)",
            Step::CmdqInit => "command queue init",
            Step::Initializing => "wait for firmware (initializing)",
            Step::EnableHca => "enable hca",
            Step::SetIssi => "set issi",
            Step::BootPages => "boot pages",
            Step::HcaCtrl => "set hca ctrl",
            Step::SetHcaCaps => "set hca caps",
            Step::InitPages => "init pages",
            Step::InitHca => "init hca",
            Step::DriverVersion => "set driver version",
            Step::QueryCaps => "query hca caps",
            Step::AllocUar => "alloc uar",
            Step::CreateEq => "create async eqs",
            Step::RegularPages => "regular pages",
            Step::QCounter => "alloc q counter",
            Step::GidTable => "program gid table",
        })
    }
}

/// What went wrong.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum Error {
    /// A command failed.
    Cmd(CmdError),
    /// A DMA allocation failed.
    Dma(DmaError),
    /// The firmware page pool failed.
    Pages(PagesError),
    /// An EQ could not be set up.
    Eq(EqError),
    /// `initializing` stayed set.
    FwInitTimeout {
        /// Which wait (`pre-initializing` or `initializing`).
        state: &'static str,
        /// Milliseconds waited.
        waited_ms: u32,
    },
    /// Health failed just now; the HCA moved to internal error.
    Health(HealthFailure),
    /// The HCA is in internal error (since `cause`); the command was not sent.
    InternalError {
        /// The failure that moved the HCA to internal error.
        cause: HealthFailure,
        /// The command that was not sent.
        opcode: Opcode,
    },
    /// Firmware supports neither ISSI 1 nor ISSI 0.
    NoIssi {
        /// The ISSI bitmask firmware reported.
        supported: u32,
    },
    /// Firmware kept pages after teardown asked for all of them.
    PagesNotReturned {
        /// Pages firmware still holds.
        pages: usize,
    },
    /// The doorbell-record pool failed.
    Dbr(crate::dbr::DbrError),
    /// A size outside what the device supports (checked before any command is sent).
    BadSize {
        /// What was sized.
        what: &'static str,
        /// The size asked for.
        requested: u64,
        /// The largest the device supports.
        max: u64,
    },
    /// The device lacks the capability this needs.
    NotSupported {
        /// The missing capability.
        what: &'static str,
    },
    /// The completion-event table is full: a fixed capacity of the [`Hca`](super::Hca)'s [`Tables`](super::Tables),
    /// or no memory to grow a growable one.
    TooManyCqs {
        /// CQs the table holds.
        max: usize,
    },
    /// A CQ this HCA does not know.
    UnknownCq {
        /// The CQ number.
        cqn: u32,
    },
    /// Completion events taken and not acknowledged.
    UnackedEvents {
        /// The CQ number.
        cqn: u32,
        /// Events not yet acknowledged.
        unacked: u32,
    },
    /// Memory registration of a range that is not inside one region of the DMA allocator.
    NotDmaMemory {
        /// Start of the range.
        addr: usize,
        /// Length of the range.
        len: usize,
    },
    /// The virtual and bus addresses of a memory region differ within 4 KiB, so no page size maps it.
    NoPageSize {
        /// CPU address.
        addr: usize,
        /// Bus address.
        iova: u64,
    },
    /// A memory region's virtual address and bus address differ within 4 KiB, so no MTT page size maps it
    /// (`ib_umem_find_best_pgsz` finds none; verbs requires the address and `iova` to agree within a page).
    IovaMismatch {
        /// The virtual address asked for.
        iova: u64,
        /// The bus address of the memory.
        dma: u64,
    },
    /// A memory region whose last byte would lie past the end of the 64-bit address space.
    IovaOverflow {
        /// The virtual address asked for.
        iova: u64,
        /// The length.
        len: u64,
    },
    /// A re-registration that names nothing to change.
    NothingToRereg,
    /// Remote write or atomic access without local write (`ib_check_mr_access`).
    BadAccess {
        /// The access bits given.
        access: u32,
    },
    /// After MODIFY_CQ(resize) the old ring held no resize CQE.
    ResizeCqeMissing {
        /// The CQ number.
        cqn: u32,
    },
    /// The requested QP capabilities exceed the device's.
    QpSize(crate::qp::SizeError),
    /// A QP state transition refused before any command was sent.
    Modify(crate::qp::ModifyError),
}

impl From<CmdError> for Error {
    fn from(e: CmdError) -> Self {
        Error::Cmd(e)
    }
}
impl From<DmaError> for Error {
    fn from(e: DmaError) -> Self {
        Error::Dma(e)
    }
}
impl From<PagesError> for Error {
    fn from(e: PagesError) -> Self {
        Error::Pages(e)
    }
}
impl From<EqError> for Error {
    fn from(e: EqError) -> Self {
        Error::Eq(e)
    }
}

impl core::fmt::Display for Error {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Error::Cmd(e) => write!(f, "{e}"),
            Error::Dma(e) => write!(f, "DMA allocation failed: {e}"),
            Error::Pages(e) => write!(f, "{e}"),
            Error::Eq(e) => write!(f, "bad event queue: {e:?}"),
            Error::FwInitTimeout { state, waited_ms } => {
                write!(f, "firmware over {waited_ms} ms in {state} state, aborting")
            }
            Error::Health(h) => write!(f, "device health failure: {h}"),
            Error::InternalError { cause, opcode } => write!(
                f,
                "device is in internal error ({cause}); {} not sent",
                crate::prm::Named(opcode.name(), opcode.raw().into())
            ),
            Error::NoIssi { supported } => write!(f, "firmware supports neither ISSI 1 nor 0 (mask 0x{supported:x})"),
            Error::PagesNotReturned { pages } => write!(f, "firmware did not return {pages} pages"),
            Error::Dbr(e) => write!(f, "{e}"),
            Error::BadSize { what, requested, max } => write!(f, "{what} {requested} out of range (max {max})"),
            Error::NotSupported { what } => write!(f, "not supported by the device: {what}"),
            Error::TooManyCqs { max } => write!(f, "too many CQs for the event table ({max})"),
            Error::UnknownCq { cqn } => write!(f, "CQ {cqn:#x} does not belong to this HCA"),
            Error::UnackedEvents { cqn, unacked } => {
                write!(f, "CQ {cqn:#x} has {unacked} completion events not acknowledged")
            }
            Error::NotDmaMemory { addr, len } => {
                write!(f, "{len} bytes at {addr:#x} are not inside one DMA region; the device cannot reach them")
            }
            Error::NoPageSize { addr, iova } => {
                write!(f, "address {addr:#x} and bus address {iova:#x} differ within a 4 KiB page; cannot register")
            }
            Error::IovaMismatch { iova, dma } => {
                write!(f, "virtual address {iova:#x} and bus address {dma:#x} differ within a 4 KiB page")
            }
            Error::IovaOverflow { iova, len } => write!(f, "{len} bytes at {iova:#x} wrap past the address space"),
            Error::NothingToRereg => write!(f, "re-registration with nothing to change"),
            Error::BadAccess { access } => {
                write!(f, "access flags {access:#x}: remote write or atomic needs local write")
            }
            Error::ResizeCqeMissing { cqn } => write!(f, "CQ {cqn:#x} resized but the resize CQE never appeared"),
            Error::QpSize(e) => write!(f, "QP capabilities not available: {e:?}"),
            Error::Modify(e) => write!(f, "{e}"),
        }
    }
}

impl core::error::Error for Error {}

/// A failed bring-up: the step, the cause, and whether the cleanup that followed was itself clean.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BringupError {
    /// The step that failed.
    pub step: Step,
    /// Why it failed.
    pub error: Error,
    /// The first error the cleanup met (it carried on regardless, and returned all memory it could).
    pub cleanup: Option<Error>,
}

impl core::fmt::Display for BringupError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "bring-up failed at {}: {}", self.step, self.error)?;
        if let Some(c) = &self.cleanup {
            write!(f, " (cleanup: {c})")?;
        }
        Ok(())
    }
}

impl core::error::Error for BringupError {}
