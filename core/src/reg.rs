//! Access registers (PRM ACCESS_REGISTER; Linux `port.c` `mlx5_core_access_reg`): host endianness, PMTU, PAOS.

use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{consts, ifc, Array, MsgBuf, Opcode};

/// `ACCESS_REGISTER` for one register: `data` is written (write) or filled with the register's contents (read).
/// `op_mod` is 0 to write and 1 to read (`mlx5_core_access_reg` sets `op_mod = !write`).
#[derive(Debug)]
pub struct AccessReg<'a> {
    /// `register_id` (`MLX5_REG_*`).
    pub register_id: u16,
    /// `argument`.
    pub argument: u32,
    /// Write (`true`) or read.
    pub write: bool,
    /// The register's bytes: written from, or read into.
    pub data: &'a mut [u8],
}

fn data_len(arr: Array, n: usize) -> usize {
    arr.byte_off() + n
}

impl Command for AccessReg<'_> {
    type In = ifc::access_register_in::Bits;
    type Out = ifc::access_register_out::Bits;
    /// Bytes of register data firmware returned (the request's length).
    type Output = usize;
    fn opcode(&self) -> Opcode {
        Opcode::AccessReg
    }
    fn inlen(&self) -> usize {
        data_len(ifc::access_register_in::REGISTER_DATA, self.data.len())
    }
    fn outlen(&self) -> usize {
        data_len(ifc::access_register_out::REGISTER_DATA, self.data.len())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::AccessReg, u16::from(!self.write));
        msg.set(ifc::access_register_in::REGISTER_ID, self.register_id.into());
        msg.set(ifc::access_register_in::ARGUMENT, self.argument);
        msg.write_bytes(ifc::access_register_in::REGISTER_DATA.byte_off(), self.data);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<usize, CmdError> {
        out.read_bytes(ifc::access_register_out::REGISTER_DATA.byte_off(), self.data);
        Ok(self.data.len())
    }
}

/// `struct mlx5_reg_host_endianness` (driver.h) is `{ u8 he; u8 rsvd[15]; }`: 16 bytes, `he` its first member.
pub const HOST_ENDIANNESS_LEN: usize = 16;

/// `MLX5_SET_HOST_ENDIANNESS` (device.h) for the host this is built for. The header defines it under
/// `#if __BYTE_ORDER`: 0 on a little-endian host, 0x80 on a big-endian one. The vendored constant is the
/// little-endian value, so the big-endian one is written here.
#[cfg(target_endian = "little")]
pub const SET_HOST_ENDIANNESS: u8 = consts::MLX5_SET_HOST_ENDIANNESS;
/// `MLX5_SET_HOST_ENDIANNESS` (device.h) on a big-endian host.
#[cfg(target_endian = "big")]
pub const SET_HOST_ENDIANNESS: u8 = 0x80;

/// The host-endianness register write Linux's `set_hca_ctrl` does on a physical function.
pub fn host_endianness(data: &mut [u8; HOST_ENDIANNESS_LEN]) -> AccessReg<'_> {
    *data = [0; HOST_ENDIANNESS_LEN];
    // `he` is the struct's first member, so it sits at byte 0 (C places the first member at offset 0).
    data[0] = SET_HOST_ENDIANNESS;
    AccessReg { register_id: consts::MLX5_REG_HOST_ENDIANNESS, argument: 0, write: true, data }
}

/// PMTU (`mlx5_query_port_mtu`): MTUs of a local port in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortMtu {
    /// Largest MTU the port supports.
    pub max_mtu: u16,
    /// MTU the administrator set.
    pub admin_mtu: u16,
    /// MTU in use.
    pub oper_mtu: u16,
}

/// A read of PMTU for `local_port` (1-based).
pub fn pmtu_read(local_port: u8, data: &mut [u8; ifc::pmtu_reg::SIZE_BYTES]) -> AccessReg<'_> {
    *data = [0; ifc::pmtu_reg::SIZE_BYTES];
    data.set(ifc::pmtu_reg::LOCAL_PORT, local_port.into());
    AccessReg { register_id: consts::MLX5_REG_PMTU, argument: 0, write: false, data }
}

impl PortMtu {
    /// Reads the register bytes.
    pub fn parse(data: &[u8; ifc::pmtu_reg::SIZE_BYTES]) -> Self {
        Self {
            max_mtu: data.get(ifc::pmtu_reg::MAX_MTU) as u16,
            admin_mtu: data.get(ifc::pmtu_reg::ADMIN_MTU) as u16,
            oper_mtu: data.get(ifc::pmtu_reg::OPER_MTU) as u16,
        }
    }
}

/// PAOS (`mlx5_query_port_admin_status` / oper status): administrative and operational state of a port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortStatus {
    /// `MLX5_PORT_UP` (1) or `MLX5_PORT_DOWN` (2).
    pub admin_status: u8,
    /// `oper_status`: 1 up, 2 down.
    pub oper_status: u8,
}

/// A read of PAOS for `local_port` (1-based).
pub fn paos_read(local_port: u8, data: &mut [u8; ifc::paos_reg::SIZE_BYTES]) -> AccessReg<'_> {
    *data = [0; ifc::paos_reg::SIZE_BYTES];
    data.set(ifc::paos_reg::LOCAL_PORT, local_port.into());
    AccessReg { register_id: consts::MLX5_REG_PAOS, argument: 0, write: false, data }
}

impl PortStatus {
    /// Reads the register bytes.
    pub fn parse(data: &[u8; ifc::paos_reg::SIZE_BYTES]) -> Self {
        Self {
            admin_status: data.get(ifc::paos_reg::ADMIN_STATUS) as u8,
            oper_status: data.get(ifc::paos_reg::OPER_STATUS) as u8,
        }
    }
}
