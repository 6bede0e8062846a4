//! The Toeplitz hash (Microsoft's RSS definition, which the PRM's `MLX5_RX_HASH_FN_TOEPLITZ` names): each set
//! bit of the input, most significant first, XORs in the 32 key bits starting at that bit's position.

use crate::fw::tir::TOEPLITZ_KEY_LEN;

/// The Toeplitz hash of `input` under `key`. Inputs longer than the key allows (36 bytes, the IPv6 4-tuple)
/// are hashed up to the key's end, as hardware does.
pub(crate) fn toeplitz(key: &[u8; TOEPLITZ_KEY_LEN], input: &[u8]) -> u32 {
    let mut hash = 0u32;
    // The 32 key bits in line with the current input bit, and the next key byte to shift in.
    let mut window = u32::from_be_bytes([key[0], key[1], key[2], key[3]]);
    let usable = input.len().min(TOEPLITZ_KEY_LEN - 4);
    for (i, &byte) in input[..usable].iter().enumerate() {
        let next = key[i + 4];
        for bit in 0..8 {
            if byte & (0x80 >> bit) != 0 {
                hash ^= window;
            }
            window = (window << 1) | u32::from((next >> (7 - bit)) & 1);
        }
    }
    hash
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The key and IPv4 cases of Microsoft's "Verifying the RSS Hash Calculation" (public test vectors).
    const KEY: [u8; 40] = [
        0x6d, 0x5a, 0x56, 0xda, 0x25, 0x5b, 0x0e, 0xc2, 0x41, 0x67, 0x25, 0x3d, 0x43, 0xa3, 0x8f, 0xb0, 0xd0, 0xca,
        0x2b, 0xcb, 0xae, 0x7b, 0x30, 0xb4, 0x77, 0xcb, 0x2d, 0xa3, 0x80, 0x30, 0xf2, 0x0c, 0x6a, 0x42, 0xb7, 0x3b,
        0xbe, 0xac, 0x01, 0xfa,
    ];

    fn tuple(src: [u8; 4], dst: [u8; 4], ports: Option<(u16, u16)>) -> Vec<u8> {
        let mut v = [src, dst].concat();
        if let Some((s, d)) = ports {
            v.extend_from_slice(&s.to_be_bytes());
            v.extend_from_slice(&d.to_be_bytes());
        }
        v
    }

    #[test]
    fn toeplitz_matches_the_published_rss_verification_vectors() {
        let cases = [
            ([66, 9, 149, 187], [161, 142, 100, 80], (2794, 1766), 0x323e_8fc2, 0x51cc_c178),
            ([199, 92, 111, 2], [65, 69, 140, 83], (14230, 4739), 0xd718_262a, 0xc626_b0ea),
        ];
        for (src, dst, ports, ip_only, with_ports) in cases {
            assert_eq!(toeplitz(&KEY, &tuple(src, dst, None)), ip_only, "{src:?} -> {dst:?}");
            assert_eq!(toeplitz(&KEY, &tuple(src, dst, Some(ports))), with_ports, "{src:?} -> {dst:?} ports");
        }
    }

    #[test]
    fn an_input_longer_than_the_key_is_bounded() {
        // 64 bytes of input under a 40-byte key: hashed up to the key's end, no panic.
        assert_eq!(toeplitz(&KEY, &[0xff; 64]), toeplitz(&KEY, &[0xff; 36]));
    }
}
