//! A pcap capture file (the classic libpcap format, microsecond timestamps, link type 1 = Ethernet) of the frames
//! a simulated port sends and receives, for Wireshark/tshark (which decode UDP port 4791 as RoCEv2).

use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// The pcap magic number (microsecond timestamps), written in the file's byte order (little endian here).
const MAGIC: u32 = 0xa1b2_c3d4;
/// LINKTYPE_ETHERNET.
pub const LINKTYPE_ETHERNET: u32 = 1;
/// The largest frame captured whole; longer frames are cut and keep their original length in the record.
pub const SNAPLEN: u32 = 65535;
/// Bytes of the file header.
pub const FILE_HEADER_LEN: usize = 24;
/// Bytes of a record header.
pub const RECORD_HEADER_LEN: usize = 16;

/// Writes a pcap stream: the file header on creation, then one record per frame.
#[derive(Debug)]
pub struct PcapWriter<W: Write> {
    out: W,
    frames: u64,
}

impl<W: Write> PcapWriter<W> {
    /// Starts a capture on `out` by writing the file header.
    pub fn new(mut out: W) -> io::Result<Self> {
        let mut h = [0u8; FILE_HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        h[4..6].copy_from_slice(&2u16.to_le_bytes()); // version 2.4
        h[6..8].copy_from_slice(&4u16.to_le_bytes());
        // 8..16: time zone offset and accuracy, zero.
        h[16..20].copy_from_slice(&SNAPLEN.to_le_bytes());
        h[20..24].copy_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        out.write_all(&h)?;
        Ok(PcapWriter { out, frames: 0 })
    }

    /// Records `frame` (a bare Ethernet frame) at `ts` since the Unix epoch.
    pub fn write_frame_at(&mut self, ts: Duration, frame: &[u8]) -> io::Result<()> {
        let orig = u32::try_from(frame.len()).unwrap_or(u32::MAX);
        let incl = orig.min(SNAPLEN);
        let mut h = [0u8; RECORD_HEADER_LEN];
        h[0..4].copy_from_slice(&(ts.as_secs() as u32).to_le_bytes());
        h[4..8].copy_from_slice(&ts.subsec_micros().to_le_bytes());
        h[8..12].copy_from_slice(&incl.to_le_bytes());
        h[12..16].copy_from_slice(&orig.to_le_bytes());
        self.out.write_all(&h)?;
        self.out.write_all(&frame[..incl as usize])?;
        self.frames += 1;
        Ok(())
    }

    /// Records `frame` now.
    pub fn write_frame(&mut self, frame: &[u8]) -> io::Result<()> {
        let now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default();
        self.write_frame_at(now, frame)
    }

    /// Frames recorded.
    pub fn frames(&self) -> u64 {
        self.frames
    }

    /// Flushes the output.
    pub fn flush(&mut self) -> io::Result<()> {
        self.out.flush()
    }

    /// The output, after a flush.
    pub fn into_inner(mut self) -> io::Result<W> {
        self.out.flush()?;
        Ok(self.out)
    }
}

/// A capture file shared by the simulated ports that write to it ([`SimConfig::pcap`](crate::config::SimConfig::pcap)):
/// each port records the RoCEv2 frames it sends, and those it receives from another process; frames between
/// ports of one process are recorded once, by the sender. Every packet is flushed as it is written, so the file is
/// complete whenever the process stops.
#[derive(Clone)]
pub struct PcapSink(Arc<Mutex<Capture>>);

struct Capture {
    writer: PcapWriter<BufWriter<File>>,
    /// Where frames are built (reused).
    scratch: Vec<u8>,
    /// The first write error; nothing more is written after it.
    error: Option<io::ErrorKind>,
}

impl std::fmt::Debug for PcapSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let frames = self.0.lock().map_or(0, |c| c.writer.frames());
        f.debug_struct("PcapSink").field("frames", &frames).finish()
    }
}

/// Two sinks are equal when they write the same capture.
impl PartialEq for PcapSink {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl PcapSink {
    /// Creates (or truncates) the file at `path` and writes the pcap header.
    pub fn create(path: impl AsRef<Path>) -> io::Result<PcapSink> {
        let mut writer = PcapWriter::new(BufWriter::new(File::create(path)?))?;
        writer.flush()?;
        Ok(PcapSink(Arc::new(Mutex::new(Capture { writer, scratch: Vec::new(), error: None }))))
    }

    /// Frames written so far.
    pub fn frames(&self) -> u64 {
        self.0.lock().map_or(0, |c| c.writer.frames())
    }

    /// The first write error, if writing failed (the capture stops there; the simulation goes on).
    pub fn error(&self) -> Option<io::ErrorKind> {
        self.0.lock().ok().and_then(|c| c.error)
    }

    /// Builds frames with `emit` (given the reusable buffer and a function that records one frame) and flushes.
    pub(crate) fn record(&self, emit: impl FnOnce(&mut Vec<u8>, &mut dyn FnMut(&[u8]))) {
        let Ok(mut c) = self.0.lock() else { return };
        if c.error.is_some() {
            return;
        }
        let Capture { writer, scratch, error } = &mut *c;
        emit(scratch, &mut |f| {
            if error.is_none() {
                if let Err(e) = writer.write_frame(f) {
                    *error = Some(e.kind());
                }
            }
        });
        if error.is_none() {
            if let Err(e) = writer.flush() {
                *error = Some(e.kind());
            }
        }
    }
}

/// Reads the frames back from a pcap this module wrote (little endian, microseconds): `(timestamp, frame)` pairs,
/// or `None` if the bytes are not such a file or a record is cut short.
pub fn read_frames(bytes: &[u8]) -> Option<Vec<(Duration, &[u8])>> {
    let h = bytes.get(..FILE_HEADER_LEN)?;
    if h[0..4] != MAGIC.to_le_bytes() || h[20..24] != LINKTYPE_ETHERNET.to_le_bytes() {
        return None;
    }
    let mut at = FILE_HEADER_LEN;
    let mut out = Vec::new();
    while at < bytes.len() {
        let r = bytes.get(at..at + RECORD_HEADER_LEN)?;
        let le = |i: usize| u32::from_le_bytes([r[i], r[i + 1], r[i + 2], r[i + 3]]);
        let ts = Duration::from_secs(u64::from(le(0))) + Duration::from_micros(u64::from(le(4)));
        let incl = le(8) as usize;
        at += RECORD_HEADER_LEN;
        out.push((ts, bytes.get(at..at.checked_add(incl)?)?));
        at += incl;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_and_record_fixture_both_ways() {
        let mut w = PcapWriter::new(Vec::new()).unwrap();
        w.write_frame_at(Duration::new(0x6000_0000, 1_500), &[0xaa; 3]).unwrap();
        assert_eq!(w.frames(), 1);
        let bytes = w.into_inner().unwrap();
        let want: [u8; 43] = [
            0xd4, 0xc3, 0xb2, 0xa1, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0, 0, 1, 0, 0, 0, // file
            0, 0, 0, 0x60, 1, 0, 0, 0, 3, 0, 0, 0, 3, 0, 0, 0, // record: 0x60000000 s, 1 µs, 3 of 3 bytes
            0xaa, 0xaa, 0xaa,
        ];
        assert_eq!(bytes, want);
        let frames = read_frames(&bytes).unwrap();
        assert_eq!(frames, vec![(Duration::new(0x6000_0000, 1_000), &[0xaa; 3][..])]);
        assert_eq!(read_frames(&bytes[..42]), None);
        assert_eq!(read_frames(&bytes[..10]), None);
    }
}
