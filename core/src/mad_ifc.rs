//! MAD_IFC (PRM "MAD_IFC"; Linux mlx5_ib `mlx5_cmd_mad_ifc` and `mlx5_MAD_IFC` in `mad.c`): a management datagram
//! handed to the device's own agents and the response MAD they give back. mlx5_ib's `process_mad` passes every
//! subnet management packet (SMP) that arrives on QP0 through it, so the firmware's subnet management agent (SMA)
//! answers a subnet manager; the response carries the MAD status the agent chose, which is not the command's: a
//! MAD the agent refuses is still a completed command with a non-zero MAD status in its reply.
//!
//! The MAD is the IBTA's (volume 1, 13.4): 256 bytes, its common header first. Only the header fields a driver
//! needs to route the reply are read here (method, status, class); the attribute is the caller's.

use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{consts, ifc, MsgBuf, Opcode};

/// Bytes of a MAD (IBTA 13.4.1), the size of `mad_ifc_in.mad` and `mad_ifc_out.response_mad_packet`.
pub const MAD_LEN: usize = 256;

/// Byte offsets of the MAD common header (IBTA 13.4.2) read here.
mod hdr {
    pub const MGMT_CLASS: usize = 1;
    pub const METHOD: usize = 3;
    pub const STATUS: usize = 4;
}

/// `op_mod` of MAD_IFC: which key checks firmware skips (`MLX5_MAD_IFC_*`). mlx5_ib sets both for a MAD it
/// originates itself and for one without a receive completion (no trap could be sent for a failed check).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct MadIfcFlags {
    /// `MLX5_MAD_IFC_IGNORE_MKEY`: do not check the M_Key.
    pub ignore_mkey: bool,
    /// `MLX5_MAD_IFC_IGNORE_BKEY`: do not check the B_Key.
    pub ignore_bkey: bool,
}

impl MadIfcFlags {
    /// Both checks skipped: a MAD the driver itself asks (`mlx5_MAD_IFC` with no `in_wc`).
    pub const LOCAL: Self = Self { ignore_mkey: true, ignore_bkey: true };

    /// The `op_mod` word.
    pub fn op_mod(self) -> u16 {
        let mut m = 0;
        if self.ignore_mkey {
            m |= consts::MLX5_MAD_IFC_IGNORE_MKEY;
        }
        if self.ignore_bkey {
            m |= consts::MLX5_MAD_IFC_IGNORE_BKEY;
        }
        m as u16
    }
}

/// The invalid-field code of a MAD status (bits 4:2, IBTA 13.4.7 Table 113).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum MadStatusCode {
    /// 0: no invalid field.
    Ok,
    /// 1: bad base or class version (or a class the agent does not serve).
    BadVersion,
    /// 2: the method is not supported.
    UnsupportedMethod,
    /// 3: the method and attribute combination is not supported.
    UnsupportedMethodAttr,
    /// 7: a field of the attribute or the attribute modifier is invalid.
    InvalidField,
    /// Codes 4 to 6, reserved.
    Reserved(u8),
}

/// A MAD's status word (IBTA 13.4.7): the invalid-field code, busy, redirect, and the class-specific bits, among
/// them bit 15, the direction bit of a directed-route SMP's response.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub struct MadStatus(pub u16);

impl MadStatus {
    /// The direction bit of a directed-route SMP (set in responses).
    pub const DIRECTION: u16 = 0x8000;

    /// The invalid-field code.
    pub fn code(self) -> MadStatusCode {
        match (self.0 >> 2) & 7 {
            0 => MadStatusCode::Ok,
            1 => MadStatusCode::BadVersion,
            2 => MadStatusCode::UnsupportedMethod,
            3 => MadStatusCode::UnsupportedMethodAttr,
            7 => MadStatusCode::InvalidField,
            n => MadStatusCode::Reserved(n as u8),
        }
    }

    /// Bit 0: the agent is busy, ask again.
    pub fn busy(self) -> bool {
        self.0 & 1 != 0
    }

    /// Bit 1: the request must be redirected.
    pub fn redirect(self) -> bool {
        self.0 & 2 != 0
    }

    /// Whether the agent took the request: no code, busy or redirect bit (the class-specific bits aside).
    pub fn is_ok(self) -> bool {
        self.0 & 0x1f == 0
    }
}

/// The response MAD of a completed MAD_IFC, as firmware wrote it.
#[derive(Clone, PartialEq, Eq)]
pub struct MadReply {
    /// The 256 bytes of `response_mad_packet`.
    pub mad: [u8; MAD_LEN],
}

impl MadReply {
    /// The response's status word.
    pub fn status(&self) -> MadStatus {
        MadStatus(u16::from_be_bytes([self.mad[hdr::STATUS], self.mad[hdr::STATUS + 1]]))
    }

    /// The response's method (GetResp, 0x81, when the agent answered).
    pub fn method(&self) -> u8 {
        self.mad[hdr::METHOD]
    }

    /// The response's management class.
    pub fn mgmt_class(&self) -> u8 {
        self.mad[hdr::MGMT_CLASS]
    }
}

impl core::fmt::Debug for MadReply {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("MadReply")
            .field("mgmt_class", &self.mgmt_class())
            .field("method", &self.method())
            .field("status", &self.status())
            .finish_non_exhaustive()
    }
}

/// `MAD_IFC` of one MAD on one port (`mlx5_cmd_mad_ifc`: opcode, `op_mod`, `port` and the MAD; `remote_lid` and
/// `plane_index` stay 0, as Linux leaves them for a port that is not an SMI plane).
#[derive(Debug, Clone, Copy)]
pub struct MadIfc<'a> {
    /// The port, 1-based.
    pub port: u8,
    /// Key checks to skip.
    pub flags: MadIfcFlags,
    /// The MAD as received (or built).
    pub mad: &'a [u8; MAD_LEN],
}

impl Command for MadIfc<'_> {
    type In = ifc::mad_ifc_in::Bits;
    type Out = ifc::mad_ifc_out::Bits;
    type Output = MadReply;
    fn opcode(&self) -> Opcode {
        Opcode::MadIfc
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::mad_ifc_in as i;
        write_header(msg, Opcode::MadIfc, self.flags.op_mod());
        msg.set(i::PORT, self.port.into());
        msg.write_bytes(i::MAD.byte_off(), self.mad);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<MadReply, CmdError> {
        let mut mad = [0u8; MAD_LEN];
        out.read_bytes(ifc::mad_ifc_out::RESPONSE_MAD_PACKET.byte_off(), &mut mad);
        Ok(MadReply { mad })
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn the_mad_and_port_land_where_the_prm_puts_them() {
        let mut mad = [0u8; MAD_LEN];
        for (k, b) in mad.iter_mut().enumerate() {
            *b = k as u8;
        }
        let mut inp = [0u8; ifc::mad_ifc_in::SIZE_BYTES];
        MadIfc { port: 1, flags: MadIfcFlags::LOCAL, mad: &mad }.encode(&mut inp[..]);
        // Opcode 0x50d, op_mod 3 (both keys ignored), port 1 in the low byte of dword 2, the MAD from byte 16.
        assert_eq!(inp[..8], [0x05, 0x0d, 0, 0, 0, 0, 0, 3]);
        assert_eq!(inp[8..16], [0, 0, 0, 1, 0, 0, 0, 0]);
        assert_eq!(inp[16..], mad[..]);
        let only_mkey = MadIfcFlags { ignore_mkey: true, ignore_bkey: false };
        assert_eq!((only_mkey.op_mod(), MadIfcFlags::default().op_mod()), (1, 0));
    }

    #[test]
    fn the_reply_is_the_response_packet_with_its_mad_status() {
        let mut out = [0u8; ifc::mad_ifc_out::SIZE_BYTES];
        let rsp = ifc::mad_ifc_out::RESPONSE_MAD_PACKET.byte_off();
        assert_eq!(rsp, 16);
        // A directed-route GetResp with "invalid field" and the direction bit.
        out[rsp..rsp + 6].copy_from_slice(&[1, 0x81, 1, 0x81, 0x80, 0x1c]);
        out[rsp + MAD_LEN - 1] = 0xee;
        let mad = [0u8; MAD_LEN];
        let r = MadIfc { port: 1, flags: MadIfcFlags::LOCAL, mad: &mad }.decode(&out[..]).unwrap();
        assert_eq!((r.mgmt_class(), r.method(), r.mad[MAD_LEN - 1]), (0x81, 0x81, 0xee));
        let s = r.status();
        assert_eq!((s.code(), s.is_ok(), s.0 & MadStatus::DIRECTION), (MadStatusCode::InvalidField, false, 0x8000));
        assert!(MadStatus(MadStatus::DIRECTION).is_ok());
        assert!(MadStatus(1).busy() && !MadStatus(1).is_ok() && MadStatus(2).redirect());
        let codes = [(0x04, MadStatusCode::BadVersion), (0x08, MadStatusCode::UnsupportedMethod)];
        for (v, c) in
            codes.into_iter().chain([(0x0c, MadStatusCode::UnsupportedMethodAttr), (0x14, MadStatusCode::Reserved(5))])
        {
            assert_eq!(MadStatus(v).code(), c);
        }
    }
}
