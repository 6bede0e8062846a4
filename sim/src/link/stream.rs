//! The link to a QEMU guest NIC over `-netdev stream` (or `-netdev socket`): on a byte stream, usually a UNIX
//! socket, each Ethernet frame is a 4-byte big-endian length followed by the bare frame (no FCS, no padding).
//! Only the framing lives here; what the frames say is `wire::roce`.

use std::io::{self, Read, Write};

/// The largest frame accepted: a length above it means the stream is not QEMU's framing (or is out of step), and
/// the link fails rather than allocating or skipping blindly.
pub const MAX_STREAM_FRAME: usize = 65536;

/// Reads the next frame into `buf` (at least [`MAX_STREAM_FRAME`] long is always enough); returns its length.
/// `Ok(None)` is a clean end of stream between frames.
pub fn read_frame<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<Option<usize>> {
    let mut len = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut len[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let n = u32::from_be_bytes(len) as usize;
    if n == 0 || n > MAX_STREAM_FRAME || n > buf.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("stream frame length {n}")));
    }
    r.read_exact(&mut buf[..n])?;
    Ok(Some(n))
}

/// Writes one frame with its length prefix, in one `write_all` of the prefix and one of the frame.
pub fn write_frame<W: Write>(w: &mut W, frame: &[u8]) -> io::Result<()> {
    if frame.is_empty() || frame.len() > MAX_STREAM_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, format!("frame of {} bytes", frame.len())));
    }
    w.write_all(&(frame.len() as u32).to_be_bytes())?;
    w.write_all(frame)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn framing_fixture_both_ways() {
        let mut out = Vec::new();
        write_frame(&mut out, &[1, 2, 3]).unwrap();
        assert_eq!(out, [0, 0, 0, 3, 1, 2, 3]);
        let mut buf = [0u8; 16];
        let mut r = &out[..];
        assert_eq!(read_frame(&mut r, &mut buf).unwrap(), Some(3));
        assert_eq!(buf[..3], [1, 2, 3]);
        assert_eq!(read_frame(&mut r, &mut buf).unwrap(), None);
    }

    #[test]
    fn bad_lengths_fail_the_link() {
        let mut buf = [0u8; 16];
        let zero: &[u8] = &[0, 0, 0, 0];
        assert_eq!(read_frame(&mut &zero[..], &mut buf).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let huge: &[u8] = &[0, 1, 0, 1];
        assert_eq!(read_frame(&mut &huge[..], &mut buf).unwrap_err().kind(), io::ErrorKind::InvalidData);
        let cut: &[u8] = &[0, 0, 0, 3, 1];
        assert_eq!(read_frame(&mut &cut[..], &mut buf).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        let half: &[u8] = &[0, 0];
        assert_eq!(read_frame(&mut &half[..], &mut buf).unwrap_err().kind(), io::ErrorKind::UnexpectedEof);
        assert!(write_frame(&mut Vec::new(), &[]).is_err());
    }

    #[test]
    fn over_a_unix_socket() {
        let (mut a, mut b) = UnixStream::pair().unwrap();
        let t = std::thread::spawn(move || {
            let mut buf = vec![0u8; MAX_STREAM_FRAME];
            let mut lens = Vec::new();
            while let Some(n) = read_frame(&mut b, &mut buf).unwrap() {
                lens.push((n, buf[n - 1]));
            }
            lens
        });
        for n in [42usize, 1514, 9000] {
            let f: Vec<u8> = (0..n).map(|i| i as u8).collect();
            write_frame(&mut a, &f).unwrap();
        }
        drop(a);
        assert_eq!(t.join().unwrap(), [(42, 41), (1514, (1513 % 256) as u8), (9000, (8999 % 256) as u8)]);
    }
}
