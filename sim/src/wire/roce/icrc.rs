//! The invariant CRC (ICRC) that ends every RoCEv2 packet: CRC-32 (the Ethernet/zlib polynomial) over the IP
//! header, UDP header, BTH, extended headers, payload and pad, with the fields a router may change masked to ones,
//! preceded by eight 0xFF bytes standing for the masked LRH of native InfiniBand. Masked: IPv4 type of service, TTL
//! and header checksum; IPv6 traffic class, flow label and hop limit; the UDP checksum; the BTH's `resv8a` byte
//! (FECN, BECN). The CRC (`crc32fast`) goes on the wire least significant byte first. Verified against `rdma_rxe`
//! frames (`../shared/notes/rdma-rxe-in-qemu.md`).

use super::error::Error;
use super::ib::BTH_LEN;
use super::ip::{IPV4_HEADER_LEN, IPV6_HEADER_LEN};
use super::udp;

/// Bytes of the ICRC.
pub const ICRC_LEN: usize = 4;

/// A running CRC-32 (reflected, polynomial 0x04C11DB7, initial value and final XOR all ones): `crc32fast`, which
/// folds with carry-less multiplication where the CPU has it (every payload byte of every frame is checked twice,
/// on emit and on receive).
#[derive(Debug, Clone, Default)]
pub struct Crc32(crc32fast::Hasher);

impl Crc32 {
    /// Adds bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The CRC of the bytes added.
    pub fn finish(self) -> u32 {
        self.0.finalize()
    }
}

/// The ICRC of a RoCEv2 packet: `l3` is the IP packet from its header up to, not including, the ICRC; `ipv6`
/// tells which IP header starts it. The result goes on the wire as `to_le_bytes()`.
pub fn compute(l3: &[u8], ipv6: bool) -> Result<u32, Error> {
    let ip_len = if ipv6 { IPV6_HEADER_LEN } else { IPV4_HEADER_LEN };
    let fixed = ip_len + udp::HEADER_LEN + BTH_LEN;
    if l3.len() < fixed {
        return Err(Error::Truncated);
    }
    // The masked copy of the headers: at most the IPv6 header, UDP and BTH. No allocation.
    let mut hdr = [0u8; IPV6_HEADER_LEN + udp::HEADER_LEN + BTH_LEN];
    let hdr = &mut hdr[..fixed];
    hdr.copy_from_slice(&l3[..fixed]);
    if ipv6 {
        hdr[0] |= 0x0f; // traffic class, upper nibble
        hdr[1..4].fill(0xff); // traffic class, lower nibble, and flow label
        hdr[7] = 0xff; // hop limit
    } else {
        hdr[1] = 0xff; // type of service
        hdr[8] = 0xff; // TTL
        hdr[10..12].fill(0xff); // header checksum
    }
    hdr[ip_len + 6..ip_len + 8].fill(0xff); // UDP checksum
    hdr[ip_len + udp::HEADER_LEN + 4] = 0xff; // BTH resv8a
    let mut crc = Crc32::default();
    crc.update(&[0xff; 8]);
    crc.update(hdr);
    crc.update(&l3[fixed..]);
    Ok(crc.finish())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn crc32_check_value() {
        // The CRC-32 catalogue's check value for "123456789".
        let mut c = Crc32::default();
        c.update(b"123456789");
        assert_eq!(c.finish(), 0xcbf4_3926);
    }

    #[test]
    fn the_crc_equals_the_bitwise_definition_at_every_length_and_split() {
        let data: Vec<u8> = (0..300u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in 0..data.len() {
            for split in [0, len / 3, len] {
                let mut sliced = Crc32::default();
                sliced.update(&data[..split]);
                sliced.update(&data[split..len]);
                // The CRC bit by bit, as the polynomial defines it.
                let mut c = !0u32;
                for &b in &data[..len] {
                    c ^= u32::from(b);
                    for _ in 0..8 {
                        c = if c & 1 != 0 { 0xedb8_8320 ^ (c >> 1) } else { c >> 1 };
                    }
                }
                assert_eq!(sliced.finish(), !c, "length {len}, split {split}");
            }
        }
    }

    /// An RC SEND ONLY of 4 bytes from 10.0.0.2:49441 to 10.0.0.1:4791, QP 0x11, PSN 0x123456, AckReq; the ICRC
    /// (last four bytes) computed independently with Python's zlib.crc32 following the note's recipe.
    pub(crate) static SEND_ONLY_V4: [u8; 48] = [
        0x45, 0x00, 0x00, 0x30, 0x00, 0x01, 0x40, 0x00, 0x40, 0x11, 0x26, 0xba, 10, 0, 0, 2, 10, 0, 0, 1, // IPv4
        0xc1, 0x21, 0x12, 0xb7, 0x00, 0x1c, 0x00, 0x00, // UDP
        0x04, 0x00, 0xff, 0xff, 0x00, 0x00, 0x00, 0x11, 0x80, 0x12, 0x34, 0x56, // BTH
        0xca, 0xfe, 0xba, 0xbe, // payload
        0x51, 0x32, 0x19, 0x0a, // ICRC
    ];

    #[test]
    fn icrc_matches_the_independent_fixture() {
        let body = &SEND_ONLY_V4[..44];
        let c = compute(body, false).unwrap();
        assert_eq!(c.to_le_bytes(), SEND_ONLY_V4[44..]);
    }

    #[test]
    fn masked_fields_do_not_change_it() {
        let mut b = SEND_ONLY_V4;
        b[1] = 0x68; // DSCP
        b[8] = 1; // TTL
        b[10] = 0; // IP checksum
        b[26] = 0x12; // UDP checksum
        b[32] = 0xc0; // FECN/BECN
        assert_eq!(compute(&b[..44], false).unwrap().to_le_bytes(), SEND_ONLY_V4[44..]);
        let mut b = SEND_ONLY_V4;
        b[43] ^= 1; // payload
        assert_ne!(compute(&b[..44], false).unwrap().to_le_bytes(), SEND_ONLY_V4[44..]);
        assert_eq!(compute(&b[..39], false).unwrap_err(), Error::Truncated);
    }

    #[test]
    fn ipv6_masks_class_flow_and_hop_limit() {
        let mut l3 = [0u8; 40 + 8 + 12];
        l3[0] = 0x60;
        l3[6] = 17;
        l3[7] = 64;
        let base = compute(&l3, true).unwrap();
        let mut m = l3;
        m[0] = 0x6a;
        m[1..4].copy_from_slice(&[0x81, 0x23, 0x45]);
        m[7] = 1;
        assert_eq!(compute(&m, true).unwrap(), base);
        let mut m = l3;
        m[8] = 1; // source address is covered
        assert_ne!(compute(&m, true).unwrap(), base);
    }
}
