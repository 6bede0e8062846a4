//! Ethernet II: destination MAC, source MAC, EtherType, payload. No FCS, no preamble, no padding: the frames the
//! simulated port and QEMU's `-netdev stream` exchange are bare (a 42-byte ARP stays 42 bytes).

use super::error::Error;

/// A MAC address.
pub type Mac = [u8; 6];

/// The broadcast MAC.
pub const BROADCAST: Mac = [0xff; 6];

wire_code! {
    /// The EtherType of an Ethernet II frame.
    pub EtherType: u16 { Ipv4 = 0x0800, Arp = 0x0806, Ipv6 = 0x86dd, }
}

mod field {
    pub(super) type Field = core::ops::Range<usize>;
    pub(super) const DST: Field = 0..6;
    pub(super) const SRC: Field = 6..12;
    pub(super) const ETHERTYPE: Field = 12..14;
    pub(super) const PAYLOAD: usize = 14;
}

/// Bytes of the Ethernet II header.
pub const HEADER_LEN: usize = field::PAYLOAD;

/// A checked view of an Ethernet II frame.
#[derive(Debug, Clone, Copy)]
pub struct EthernetFrame<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> EthernetFrame<T> {
    /// The bytes as a frame, unchecked: the accessors panic on a buffer shorter than the header.
    pub fn new_unchecked(buffer: T) -> Self {
        EthernetFrame { buffer }
    }

    /// The bytes as a frame, after checking the header is complete.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        if buffer.as_ref().len() < HEADER_LEN {
            return Err(Error::Truncated);
        }
        Ok(EthernetFrame { buffer })
    }

    /// The destination MAC.
    pub fn dst(&self) -> Mac {
        mac(&self.buffer.as_ref()[field::DST])
    }

    /// The source MAC.
    pub fn src(&self) -> Mac {
        mac(&self.buffer.as_ref()[field::SRC])
    }

    /// The EtherType.
    pub fn ethertype(&self) -> EtherType {
        let b = &self.buffer.as_ref()[field::ETHERTYPE];
        EtherType::from(u16::from_be_bytes([b[0], b[1]]))
    }

    /// The bytes after the header.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[field::PAYLOAD..]
    }

    /// The underlying bytes.
    pub fn into_inner(self) -> T {
        self.buffer
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> EthernetFrame<T> {
    /// Sets the destination MAC.
    pub fn set_dst(&mut self, v: Mac) {
        self.buffer.as_mut()[field::DST].copy_from_slice(&v);
    }

    /// Sets the source MAC.
    pub fn set_src(&mut self, v: Mac) {
        self.buffer.as_mut()[field::SRC].copy_from_slice(&v);
    }

    /// Sets the EtherType.
    pub fn set_ethertype(&mut self, v: EtherType) {
        self.buffer.as_mut()[field::ETHERTYPE].copy_from_slice(&u16::from(v).to_be_bytes());
    }

    /// The bytes after the header, writable.
    pub fn payload_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::PAYLOAD..]
    }
}

pub(super) fn mac(b: &[u8]) -> Mac {
    let mut m = [0u8; 6];
    m.copy_from_slice(&b[..6]);
    m
}

/// The header of an Ethernet II frame, as values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EthernetRepr {
    /// Destination MAC.
    pub dst: Mac,
    /// Source MAC.
    pub src: Mac,
    /// What the payload is.
    pub ethertype: EtherType,
}

impl EthernetRepr {
    /// The header of a checked frame.
    pub fn parse<T: AsRef<[u8]>>(frame: &EthernetFrame<T>) -> EthernetRepr {
        EthernetRepr { dst: frame.dst(), src: frame.src(), ethertype: frame.ethertype() }
    }

    /// Writes the header into a frame at least [`HEADER_LEN`] long.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, frame: &mut EthernetFrame<T>) {
        frame.set_dst(self.dst);
        frame.set_src(self.src);
        frame.set_ethertype(self.ethertype);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static BYTES: [u8; 16] = [
        0x52, 0x54, 0x00, 0x00, 0x00, 0x01, // dst
        0x02, 0x00, 0x00, 0x00, 0x00, 0x02, // src
        0x08, 0x00, // IPv4
        0xaa, 0xbb,
    ];

    #[test]
    fn parse_fixture() {
        let f = EthernetFrame::new_checked(&BYTES[..]).unwrap();
        let r = EthernetRepr::parse(&f);
        assert_eq!(r.dst, [0x52, 0x54, 0, 0, 0, 1]);
        assert_eq!(r.src, [2, 0, 0, 0, 0, 2]);
        assert_eq!(r.ethertype, EtherType::Ipv4);
        assert_eq!(f.payload(), &[0xaa, 0xbb]);
    }

    #[test]
    fn emit_fixture() {
        let mut buf = [0u8; 16];
        buf[14..].copy_from_slice(&[0xaa, 0xbb]);
        let r = EthernetRepr { dst: [0x52, 0x54, 0, 0, 0, 1], src: [2, 0, 0, 0, 0, 2], ethertype: EtherType::Ipv4 };
        r.emit(&mut EthernetFrame::new_unchecked(&mut buf[..]));
        assert_eq!(buf, BYTES);
    }

    #[test]
    fn short_and_unknown() {
        assert_eq!(EthernetFrame::new_checked(&BYTES[..13]).unwrap_err(), Error::Truncated);
        let mut b = BYTES;
        b[12..14].copy_from_slice(&[0x88, 0xcc]);
        let f = EthernetFrame::new_checked(&b[..]).unwrap();
        assert_eq!(f.ethertype(), EtherType::Unknown(0x88cc));
        assert_eq!(u16::from(EtherType::Unknown(0x88cc)), 0x88cc);
    }
}
