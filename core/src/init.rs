//! HCA life-cycle commands (PRM "HCA Commands"; Linux `main.c`, `fw.c`): ENABLE_HCA / DISABLE_HCA, QUERY_ISSI /
//! SET_ISSI, QUERY_HCA_CAP / SET_HCA_CAP, INIT_HCA, TEARDOWN_HCA.

use crate::cmd::Simple;
use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{consts, ifc, MsgBuf, Opcode, SubBuf};

/// Size of one capability block (`query_hca_cap_out.capability`, a 4 KiB union).
pub const CAP_BYTES: usize = ifc::query_hca_cap_out::CAPABILITY.len;

/// A capability block as firmware returns it; read it with the `ifc::cmd_hca_cap` (etc.) field tables.
pub type CapBlock = [u8; CAP_BYTES];

/// `ENABLE_HCA` for this function (`mlx5_core_enable_hca`).
pub fn enable_hca(function_id: u16) -> Simple {
    Simple::new(Opcode::EnableHca, ifc::enable_hca_in::SIZE_BYTES, ifc::enable_hca_out::SIZE_BYTES)
        .arg(ifc::enable_hca_in::FUNCTION_ID, function_id.into())
}

/// `DISABLE_HCA` (`mlx5_core_disable_hca`).
pub fn disable_hca(function_id: u16) -> Simple {
    Simple::new(Opcode::DisableHca, ifc::disable_hca_in::SIZE_BYTES, ifc::disable_hca_out::SIZE_BYTES)
        .arg(ifc::disable_hca_in::FUNCTION_ID, function_id.into())
}

/// `SET_ISSI` (`mlx5_core_set_issi`).
pub fn set_issi(issi: u16) -> Simple {
    Simple::new(Opcode::SetIssi, ifc::set_issi_in::SIZE_BYTES, ifc::set_issi_out::SIZE_BYTES)
        .arg(ifc::set_issi_in::CURRENT_ISSI, issi.into())
}

/// `INIT_HCA` without a software owner id (`mlx5_cmd_init_hca`).
pub fn init_hca() -> Simple {
    Simple::new(Opcode::InitHca, ifc::init_hca_in::SIZE_BYTES, ifc::init_hca_out::SIZE_BYTES)
}

/// `TEARDOWN_HCA` with the graceful profile (`MLX5_TEARDOWN_HCA_IN_PROFILE_GRACEFUL_CLOSE`).
pub fn teardown_hca() -> Simple {
    Simple::new(Opcode::TeardownHca, ifc::teardown_hca_in::SIZE_BYTES, ifc::teardown_hca_out::SIZE_BYTES)
        .arg(ifc::teardown_hca_in::PROFILE, consts::MLX5_TEARDOWN_HCA_IN_PROFILE_GRACEFUL_CLOSE)
}

/// What QUERY_ISSI reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Issi {
    /// The ISSI in use.
    pub current: u16,
    /// Bit `n` set: ISSI `n` supported (first dword of the supported bitmap, which covers ISSI 0..31).
    pub supported: u32,
}

impl Issi {
    /// Whether firmware supports `issi`.
    pub fn supports(&self, issi: u16) -> bool {
        issi < 32 && self.supported & (1 << issi) != 0
    }
}

/// `QUERY_ISSI`.
#[derive(Debug, Clone, Copy, Default)]
pub struct QueryIssi;

impl Command for QueryIssi {
    type In = ifc::query_issi_in::Bits;
    type Out = ifc::query_issi_out::Bits;
    type Output = Issi;
    fn opcode(&self) -> Opcode {
        Opcode::QueryIssi
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryIssi, 0);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<Issi, CmdError> {
        Ok(Issi {
            current: out.get(ifc::query_issi_out::CURRENT_ISSI) as u16,
            supported: out.get(ifc::query_issi_out::SUPPORTED_ISSI_DW0),
        })
    }
}

/// Capability types (`enum mlx5_cap_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum CapType {
    /// `MLX5_CAP_GENERAL`.
    General,
    /// `MLX5_CAP_ETHERNET_OFFLOADS`.
    EthernetOffloads,
    /// `MLX5_CAP_ODP`.
    Odp,
    /// `MLX5_CAP_ATOMIC`.
    Atomic,
    /// `MLX5_CAP_ROCE`.
    Roce,
    /// `MLX5_CAP_GENERAL_2`.
    General2,
    /// Any other capability type, by value.
    Other(u16),
}

impl CapType {
    /// The `MLX5_CAP_*` value.
    pub const fn raw(self) -> u16 {
        match self {
            CapType::General => consts::MLX5_CAP_GENERAL,
            CapType::EthernetOffloads => consts::MLX5_CAP_ETHERNET_OFFLOADS,
            CapType::Odp => consts::MLX5_CAP_ODP,
            CapType::Atomic => consts::MLX5_CAP_ATOMIC,
            CapType::Roce => consts::MLX5_CAP_ROCE,
            CapType::General2 => consts::MLX5_CAP_GENERAL_2,
            CapType::Other(n) => n,
        }
    }
}

/// Which copy of a capability QUERY_HCA_CAP returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CapMode {
    /// What the device can do (`HCA_CAP_OPMOD_GET_MAX`).
    Max,
    /// What is currently set (`HCA_CAP_OPMOD_GET_CUR`).
    Current,
}

/// `QUERY_HCA_CAP`: `op_mod = cap_type << 1 | mode` (`mlx5_core_get_caps_mode`). Output: the 4 KiB block.
#[derive(Debug, Clone, Copy)]
pub struct QueryHcaCap {
    /// Which capability block.
    pub cap: CapType,
    /// Maximum or current values.
    pub mode: CapMode,
}

impl Command for QueryHcaCap {
    type In = ifc::query_hca_cap_in::Bits;
    type Out = ifc::query_hca_cap_out::Bits;
    type Output = CapBlock;
    fn opcode(&self) -> Opcode {
        Opcode::QueryHcaCap
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        let mode = match self.mode {
            CapMode::Max => consts::HCA_CAP_OPMOD_GET_MAX,
            CapMode::Current => consts::HCA_CAP_OPMOD_GET_CUR,
        } as u16;
        write_header(msg, Opcode::QueryHcaCap, (self.cap.raw() << 1) | mode);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<CapBlock, CmdError> {
        let mut cap = [0u8; CAP_BYTES];
        out.read_bytes(ifc::query_hca_cap_out::CAPABILITY.off, &mut cap);
        Ok(cap)
    }
}

/// `SET_HCA_CAP`: `op_mod = cap_type << 1`, the whole 4 KiB block as it should become (`set_caps`).
#[derive(Debug, Clone, Copy)]
pub struct SetHcaCap<'a> {
    /// Which capability block.
    pub cap: CapType,
    /// The values to set.
    pub block: &'a CapBlock,
}

impl Command for SetHcaCap<'_> {
    type In = ifc::set_hca_cap_in::Bits;
    type Out = ifc::set_hca_cap_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::SetHcaCap
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::SetHcaCap, self.cap.raw() << 1);
        SubBuf::new(msg, ifc::set_hca_cap_in::CAPABILITY).write_bytes(0, self.block);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// `SET_DRIVER_VERSION` (`mlx5_set_driver_version`): a string of at most 64 bytes, NUL padded.
#[derive(Debug, Clone, Copy)]
pub struct SetDriverVersion<'a> {
    /// The driver version string.
    pub version: &'a str,
}

impl Command for SetDriverVersion<'_> {
    type In = ifc::set_driver_version_in::Bits;
    type Out = ifc::set_driver_version_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::SetDriverVersion
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::SetDriverVersion, 0);
        let arr = ifc::set_driver_version_in::DRIVER_VERSION;
        let bytes = self.version.as_bytes();
        // Truncated to the field; firmware reads up to the first NUL (the message is zeroed beforehand).
        let n = bytes.len().min(arr.count as usize - 1);
        msg.write_bytes(arr.byte_off(), &bytes[..n]);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}
