//! Management datagrams (IBA 13.4): the 256-byte MAD and its common header (`ib_mad_hdr`), parsed from bytes a
//! peer sent, so every length and version is checked before a field is read.

use thiserror::Error;

/// Every MAD on QP0 and QP1 is this long (IBA 13.4.2).
pub const MAD_LEN: usize = 256;
/// The common header (IBA 13.4.3); a class's data follows it.
pub const HDR_LEN: usize = 24;
/// `base_version` of every MAD this stack speaks (IBA 13.4.3: `IB_MGMT_BASE_VERSION`).
pub const BASE_VERSION: u8 = 1;
/// The GSI QP's well-known Q_Key (IBA 3.5.4, `IB_QP1_QKEY`).
pub const QP1_QKEY: u32 = 0x8001_0000;

/// Management classes (IBA 13.4.4, `IB_MGMT_CLASS_*`).
pub mod class {
    /// Subnet management, LID-routed.
    pub const SUBN_LID_ROUTED: u8 = 0x01;
    /// Subnet management, directed route.
    pub const SUBN_DIRECTED_ROUTE: u8 = 0x81;
    /// Subnet administration.
    pub const SUBN_ADM: u8 = 0x03;
    /// Performance management.
    pub const PERF_MGMT: u8 = 0x04;
    /// Communication management (IBA 12).
    pub const CM: u8 = 0x07;
}

/// Methods (IBA 13.4.5, `IB_MGMT_METHOD_*`); bit 7 marks a response.
pub mod method {
    /// Get.
    pub const GET: u8 = 0x01;
    /// Set.
    pub const SET: u8 = 0x02;
    /// Send: the CM's method (IBA 12.6.1).
    pub const SEND: u8 = 0x03;
    /// The response bit.
    pub const RESP: u8 = 0x80;
    /// GetResp.
    pub const GET_RESP: u8 = GET | RESP;
}

/// MAD status codes (IBA 13.4.7 table 122, bits 2..4 of `status`), as `IB_MGMT_MAD_STATUS_*`.
pub mod status {
    /// Success.
    pub const SUCCESS: u16 = 0x0000;
    /// Bad base or class version.
    pub const BAD_VERSION: u16 = 0x0004;
    /// The method is not supported.
    pub const UNSUPPORTED_METHOD: u16 = 0x0008;
    /// The method and attribute combination is not supported.
    pub const UNSUPPORTED_METHOD_ATTRIB: u16 = 0x000c;
    /// An attribute field holds an invalid value.
    pub const INVALID_ATTRIB_VALUE: u16 = 0x001c;
}

/// Why bytes are not a MAD this stack can read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum MadError {
    /// Shorter than the header, or than the class's message needs.
    #[error("MAD truncated: {len} bytes, {need} needed")]
    Truncated {
        /// Bytes received.
        len: usize,
        /// Bytes the header or message needs.
        need: usize,
    },
    /// Longer than a MAD (IBA 13.4.2: exactly 256 bytes on QP0/QP1).
    #[error("MAD too long: {len} bytes (a MAD is {MAD_LEN})")]
    TooLong {
        /// Bytes received.
        len: usize,
    },
    /// `base_version` is not 1: the answer is a MAD status of bad version (IBA 13.4.7).
    #[error("MAD base version {0} (only {BASE_VERSION} is spoken)")]
    BadBaseVersion(u8),
    /// The class version is not one this class speaks.
    #[error("management class {class:#04x} version {version}")]
    BadClassVersion {
        /// The class.
        class: u8,
        /// The version the MAD carries.
        version: u8,
    },
    /// An attribute this class does not define, or not with this method.
    #[error("management class {class:#04x} has no attribute {attr_id:#06x} for method {method:#04x}")]
    UnsupportedAttribute {
        /// The class.
        class: u8,
        /// The method.
        method: u8,
        /// The attribute.
        attr_id: u16,
    },
    /// A field holds a value the message's definition forbids.
    #[error("invalid {what} ({value:#x})")]
    InvalidField {
        /// Which field.
        what: &'static str,
        /// Its value.
        value: u64,
    },
}

impl MadError {
    /// The MAD status an agent answers a request that failed so with (IBA 13.4.7), when it answers at all.
    pub fn status(&self) -> u16 {
        match self {
            MadError::Truncated { .. } | MadError::TooLong { .. } => status::INVALID_ATTRIB_VALUE,
            MadError::BadBaseVersion(_) | MadError::BadClassVersion { .. } => status::BAD_VERSION,
            MadError::UnsupportedAttribute { .. } => status::UNSUPPORTED_METHOD_ATTRIB,
            MadError::InvalidField { .. } => status::INVALID_ATTRIB_VALUE,
        }
    }
}

/// The common MAD header (IBA 13.4.3, `ib_mad_hdr`), all fields big-endian on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct MadHdr {
    /// `base_version`: 1.
    pub base_version: u8,
    /// `mgmt_class`.
    pub mgmt_class: u8,
    /// `class_version`.
    pub class_version: u8,
    /// `method`, with the response bit.
    pub method: u8,
    /// `status`.
    pub status: u16,
    /// `class_specific`.
    pub class_specific: u16,
    /// `tid`: the transaction, which a response repeats.
    pub tid: u64,
    /// `attr_id`.
    pub attr_id: u16,
    /// `attr_mod`.
    pub attr_mod: u32,
}

impl MadHdr {
    /// Reads the header of a received MAD: at least the header, at most a MAD, base version 1.
    pub fn parse(b: &[u8]) -> Result<MadHdr, MadError> {
        if b.len() < HDR_LEN {
            return Err(MadError::Truncated { len: b.len(), need: HDR_LEN });
        }
        if b.len() > MAD_LEN {
            return Err(MadError::TooLong { len: b.len() });
        }
        let h = MadHdr {
            base_version: b[0],
            mgmt_class: b[1],
            class_version: b[2],
            method: b[3],
            status: be16(b, 4),
            class_specific: be16(b, 6),
            tid: u64::from(be32(b, 8)) << 32 | u64::from(be32(b, 12)),
            attr_id: be16(b, 16),
            attr_mod: be32(b, 20),
        };
        if h.base_version != BASE_VERSION {
            return Err(MadError::BadBaseVersion(h.base_version));
        }
        Ok(h)
    }

    /// Writes the header into the first [`HDR_LEN`] bytes of `b` (a MAD buffer, so at least that long).
    pub fn write(&self, b: &mut [u8; MAD_LEN]) {
        b[0] = self.base_version;
        b[1] = self.mgmt_class;
        b[2] = self.class_version;
        b[3] = self.method;
        set_be16(b, 4, self.status);
        set_be16(b, 6, self.class_specific);
        set_be32(b, 8, (self.tid >> 32) as u32);
        set_be32(b, 12, self.tid as u32);
        set_be16(b, 16, self.attr_id);
        set_be16(b, 18, 0);
        set_be32(b, 20, self.attr_mod);
    }

    /// Whether this is a response (the method's bit 7).
    pub fn is_response(&self) -> bool {
        self.method & method::RESP != 0
    }
}

pub(crate) fn be16(b: &[u8], off: usize) -> u16 {
    u16::from_be_bytes([b[off], b[off + 1]])
}

pub(crate) fn be32(b: &[u8], off: usize) -> u32 {
    u32::from_be_bytes([b[off], b[off + 1], b[off + 2], b[off + 3]])
}

pub(crate) fn be64(b: &[u8], off: usize) -> u64 {
    u64::from(be32(b, off)) << 32 | u64::from(be32(b, off + 4))
}

pub(crate) fn set_be16(b: &mut [u8], off: usize, v: u16) {
    b[off..off + 2].copy_from_slice(&v.to_be_bytes());
}

pub(crate) fn set_be32(b: &mut [u8], off: usize, v: u32) {
    b[off..off + 4].copy_from_slice(&v.to_be_bytes());
}

pub(crate) fn set_be64(b: &mut [u8], off: usize, v: u64) {
    b[off..off + 8].copy_from_slice(&v.to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_round_trips_big_endian() {
        let h = MadHdr {
            base_version: 1,
            mgmt_class: class::CM,
            class_version: 2,
            method: method::SEND,
            status: 0,
            class_specific: 0,
            tid: 0x0102_0304_0506_0708,
            attr_id: 0x0010,
            attr_mod: 0xa0b0_c0d0,
        };
        let mut b = [0u8; MAD_LEN];
        h.write(&mut b);
        assert_eq!(&b[..4], &[1, 7, 2, 3]);
        assert_eq!(&b[8..16], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&b[16..18], &[0, 0x10]);
        assert_eq!(MadHdr::parse(&b), Ok(h));
    }

    #[test]
    fn malformed_headers_are_typed_errors_with_the_status_an_agent_answers() {
        let mut b = [0u8; MAD_LEN];
        MadHdr { base_version: 1, ..MadHdr::default() }.write(&mut b);
        for len in [0, 1, HDR_LEN - 1] {
            let e = MadHdr::parse(&b[..len]).unwrap_err();
            assert_eq!(e, MadError::Truncated { len, need: HDR_LEN });
            assert_eq!(e.status(), status::INVALID_ATTRIB_VALUE);
        }
        let long = [0u8; MAD_LEN + 1];
        assert_eq!(MadHdr::parse(&long), Err(MadError::TooLong { len: MAD_LEN + 1 }));
        b[0] = 2;
        let e = MadHdr::parse(&b).unwrap_err();
        assert_eq!((e, e.status()), (MadError::BadBaseVersion(2), status::BAD_VERSION));
    }
}
