//! The message the two-process ping-pong's sides swap before they connect: what the other needs (LID, QPN, PSN,
//! GID) in rc_pingpong's text form (`"LLLL:QQQQQQ:PPPPPP:GGGG…"`, hexadecimal, the GID as 32 digits, NUL-ended).
//! A leaf: `remote_pingpong` sends it and `error` carries its [`DestError`].

use mlx5_verbs::RemoteQp;

/// Bytes of the exchange message, rc_pingpong's `sizeof "0000:000000:000000:" + 32 GID digits` with its NUL.
pub const MSG_LEN: usize = 52;
/// One side's half of the exchange, in rc_pingpong's text form.
pub fn encode_dest(d: &RemoteQp) -> [u8; MSG_LEN] {
    let mut gid = String::with_capacity(32);
    for b in d.gid {
        gid.push_str(&format!("{b:02x}"));
    }
    let text = format!("{:04x}:{:06x}:{:06x}:{gid}", d.lid, d.qpn & 0xff_ffff, d.psn & 0xff_ffff);
    let mut msg = [0u8; MSG_LEN];
    msg[..text.len()].copy_from_slice(text.as_bytes());
    msg
}

/// Why a peer's exchange message was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DestError {
    /// Not `MSG_LEN` bytes.
    #[error("the peer's address message is {0} bytes, not {MSG_LEN}")]
    Length(usize),
    /// Not `LLLL:QQQQQQ:PPPPPP:GID` in hex digits, NUL-terminated; the text is shown escaped.
    #[error("the peer sent {0}, not LID:QPN:PSN:GID in hexadecimal")]
    Malformed(String),
}

/// Exactly `digits` hex digits (no sign, blank or prefix, which `from_str_radix` would take).
fn hex_field(f: &[u8], digits: usize) -> Option<u32> {
    if f.len() != digits || !f.iter().all(u8::is_ascii_hexdigit) {
        return None;
    }
    f.iter().try_fold(0u32, |acc, &c| Some(acc << 4 | (c as char).to_digit(16)?))
}

/// The peer's half; anything malformed is an error naming what was wrong, whatever the bytes (the message
/// comes from the network). The MAC (RoCE) is the one in the GID's modified EUI-64, as for a link-local GID.
pub fn decode_dest(msg: &[u8]) -> Result<RemoteQp, DestError> {
    if msg.len() != MSG_LEN {
        return Err(DestError::Length(msg.len()));
    }
    let text = msg.split(|&b| b == 0).next().unwrap_or_default();
    // The text as shown in the error: escaped, so control characters and invalid UTF-8 print as one line.
    let bad = || DestError::Malformed(format!("\"{}\"", text.escape_ascii()));
    let parts: Vec<&[u8]> = text.split(|&b| b == b':').collect();
    let [lid, qpn, psn, g] = parts.as_slice() else { return Err(bad()) };
    let (lid, qpn, psn) =
        (hex_field(lid, 4).ok_or_else(bad)?, hex_field(qpn, 6).ok_or_else(bad)?, hex_field(psn, 6).ok_or_else(bad)?);
    if g.len() != 32 {
        return Err(bad());
    }
    let mut gid = [0u8; 16];
    for (b, pair) in gid.iter_mut().zip(g.chunks(2)) {
        *b = hex_field(pair, 2).ok_or_else(bad)? as u8;
    }
    Ok(RemoteQp { qpn, psn, lid: lid as u16, gid, mac: mlx5_verbs::mac_of_gid(&gid) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_exchange_message_is_rc_pingpongs() {
        let gid = [0xfe, 0x80, 0, 0, 0, 0, 0, 0, 0xba, 0xce, 0xf6, 0xff, 0xfe, 0x12, 0x34, 0x56];
        let d = RemoteQp { qpn: 0x1a2b, psn: 0xabcdef, lid: 7, gid, mac: [0xb8, 0xce, 0xf6, 0x12, 0x34, 0x56] };
        let msg = encode_dest(&d);
        assert_eq!(&msg[..51], b"0007:001a2b:abcdef:fe80000000000000bacef6fffe123456".as_slice());
        assert_eq!(msg[51], 0);
        assert_eq!(decode_dest(&msg), Ok(d));
    }

    #[test]
    fn a_bad_exchange_message_is_an_error_not_a_panic() {
        let good = encode_dest(&RemoteQp::default());
        for cut in 0..MSG_LEN {
            let mut m = good;
            m[cut] = if cut == 4 { b'x' } else { 0 };
            if cut != MSG_LEN - 1 {
                assert!(decode_dest(&m).is_err(), "cut at {cut}");
            }
        }
        assert!(decode_dest(b"0000:000000:000000:zz800000000000000000000000000000\0").is_err());
        assert!(decode_dest(b"0000:000000:000000:00000000000000000000000000000000:1").is_err());
        assert!(matches!(decode_dest(&[0xff; MSG_LEN]), Err(DestError::Malformed(_))));
        assert_eq!(decode_dest(b"short"), Err(DestError::Length(5)));
        assert!(decode_dest(b"+000:000000:000000:00000000000000000000000000000000\0").is_err());
    }

    #[test]
    fn a_gid_that_is_not_ascii_is_an_error_not_a_panic() {
        // Issue 21's remote panic: the GID field's 32 bytes hold multi-byte characters.
        let text = format!("0000:000000:000000:a{}a\0", "\u{e9}".repeat(15));
        assert_eq!(text.len(), MSG_LEN);
        let e = decode_dest(text.as_bytes()).unwrap_err().to_string();
        assert!(e.contains("not LID:QPN:PSN:GID") && !e.contains('\n'), "{e}");
    }
}
