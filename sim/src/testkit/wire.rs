//! What a peer process can feed the simulated wire, for the `wire` fuzz target: a byte stream cut into frames
//! as a stream link (TCP, a QEMU guest's socket) reads it, each frame taken as a hello and as an InfiniBand
//! port's frame by the parsers the link uses.

use crate::link::stream::{read_frame, Hello, MAX_STREAM_FRAME};
use crate::link::vde_ib::{decode, parse, Kind};

/// What [`wire_stream`] made of a stream.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WireStats {
    /// Frames read whole.
    pub frames: usize,
    /// Frames that parsed as a hello.
    pub hellos: usize,
    /// Frames that parsed as an IB frame holding a whole packet.
    pub packets: usize,
}

/// Reads `stream` as a stream link reads its socket: frames until the stream ends or a length is refused. Every
/// frame is offered to the hello parser and to the IB frame parser, and a whole packet in an IB frame to the
/// packet parser. A hello or packet that parses is emitted again and must parse back to the same bytes. Panics
/// only when that does not hold (the fuzz target's assertion); any input is otherwise an error value.
pub fn wire_stream(stream: &[u8]) -> WireStats {
    let mut r = stream;
    let mut s = WireStats::default();
    let mut buf = vec![0u8; MAX_STREAM_FRAME];
    while let Ok(Some(n)) = read_frame(&mut r, &mut buf) {
        let frame = &buf[..n];
        assert!(n <= MAX_STREAM_FRAME, "a frame above MAX_STREAM_FRAME was accepted");
        s.frames += 1;
        if let Some(Ok(h)) = Hello::parse(frame) {
            s.hellos += 1;
            let again = h.frame();
            assert_eq!(Hello::parse(&again), Some(Ok(h)), "a hello does not survive emit and parse");
        }
        if let Ok(f) = parse(frame) {
            if f.kind == Kind::Data && f.offset == 0 && f.fragment.len() == f.total {
                if let Ok(p) = decode(f.fragment, ()) {
                    s.packets += 1;
                    let emitted = crate::wire::frame::encode_packet(&p);
                    let again = decode(&emitted, ()).expect("an emitted packet parses");
                    assert_eq!(
                        crate::wire::frame::encode_packet(&again),
                        emitted,
                        "a packet does not survive emit and parse"
                    );
                }
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn a_stream_of_a_hello_and_garbage_is_read_frame_by_frame() {
        let hello = Hello { ib: false, lid: 0, gid: [7; 16], mac: [0x02, 0, 0, 0, 0, 9] }.frame();
        let mut stream = framed(&hello);
        stream.extend(framed(&[0xff; 20]));
        stream.extend([0xff, 0xff, 0xff, 0xff]);
        assert_eq!(wire_stream(&stream), WireStats { frames: 2, hellos: 1, packets: 0 });
        assert_eq!(wire_stream(&[]), WireStats::default());
    }
}
