//! What a peer process can feed the simulated wire, for the `wire` fuzz target: a byte stream cut into frames
//! as the TCP link reads it, each frame taken as a hello or a packet by the parsers the link uses.

use crate::link::tcp::{decode_hello, encode_hello, read_frame, MAX_FRAME};
use crate::wire::frame::{decode_packet, encode_packet, FRAME_PACKET};

/// What [`wire_stream`] made of a stream.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct WireStats {
    /// Frames read whole.
    pub frames: usize,
    /// Frames that parsed as a hello.
    pub hellos: usize,
    /// Frames that parsed as a packet.
    pub packets: usize,
}

/// Reads `stream` as the link reads its socket: frames until the stream ends or a frame is refused. Every frame
/// is offered to the hello parser and, when its type says packet, to the packet parser. A hello or packet that
/// parses is emitted again and must parse back to the same bytes. Panics only when that does not hold (the
/// fuzz target's assertion); any input is otherwise an error value.
pub fn wire_stream(stream: &[u8]) -> WireStats {
    let mut r = stream;
    let mut s = WireStats::default();
    while let Ok(frame) = read_frame(&mut r) {
        assert!(frame.len() <= MAX_FRAME, "a frame above MAX_FRAME was accepted");
        s.frames += 1;
        if let Ok(addr) = decode_hello(&frame) {
            s.hellos += 1;
            let again = encode_hello(&addr);
            assert_eq!(decode_hello(&again), Ok(addr), "a hello does not survive emit and parse");
        }
        if let Some((&FRAME_PACKET, body)) = frame.split_first() {
            if let Ok(p) = decode_packet(body, ()) {
                s.packets += 1;
                let emitted = encode_packet(&p);
                let again = decode_packet(&emitted[1..], ()).expect("an emitted packet parses");
                assert_eq!(encode_packet(&again), emitted, "a packet does not survive emit and parse");
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::link::PortAddr;

    fn framed(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn a_stream_of_a_hello_and_garbage_is_read_frame_by_frame() {
        let hello = encode_hello(&PortAddr::new(&SimConfig::default()));
        let mut stream = framed(&hello);
        stream.extend(framed(&[FRAME_PACKET, 1, 2, 3]));
        stream.extend([0xff, 0xff, 0xff, 0xff]);
        assert_eq!(wire_stream(&stream), WireStats { frames: 2, hellos: 1, packets: 0 });
        assert_eq!(wire_stream(&[]), WireStats::default());
    }
}
