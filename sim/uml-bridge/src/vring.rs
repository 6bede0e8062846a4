//! The device side of a split virtqueue (virtio 1.x, section 2.7) over guest memory.
//!
//! The guest writes the descriptor table and the available ring; the device reads them and writes the used ring.
//! Everything read from the guest is bounds-checked: a bad index or length is a [`RingError`], never a panic.

use std::sync::atomic::{fence, Ordering};

use crate::guest::{GuestMem, OutOfRange};

/// `VRING_DESC_F_NEXT`: the chain continues at `next`.
pub const DESC_F_NEXT: u16 = 1;
/// `VRING_DESC_F_WRITE`: the buffer is device-writable.
pub const DESC_F_WRITE: u16 = 2;
/// `VRING_DESC_F_INDIRECT`: the buffer is a table of descriptors (not negotiated, so refused).
pub const DESC_F_INDIRECT: u16 = 4;

/// Bytes of one descriptor: `addr` u64, `len` u32, `flags` u16, `next` u16.
const DESC_SIZE: u64 = 16;
/// The largest driver-to-device payload accepted in one chain (the largest virt-pci message is a BAR write of a
/// few KiB).
pub const MAX_OUT: usize = 64 * 1024;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RingError {
    /// A ring or buffer address outside shared memory.
    Guest(OutOfRange),
    /// A descriptor index at or beyond the queue size.
    BadIndex(u16),
    /// A chain longer than the queue (a loop), or with more out bytes than [`MAX_OUT`].
    ChainTooLong,
    /// An indirect descriptor, which this device did not offer.
    Indirect,
    /// A readable descriptor after a writable one.
    OutAfterIn,
    /// The queue has not been set up (no size or addresses).
    NotReady,
}

impl From<OutOfRange> for RingError {
    fn from(e: OutOfRange) -> Self {
        RingError::Guest(e)
    }
}

/// One device-writable buffer of a chain.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InBuf {
    pub addr: u64,
    pub len: u32,
}

/// A chain taken from the available ring: its head (to return it), the driver's bytes, the device-writable buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    pub head: u16,
    pub out: Vec<u8>,
    pub ins: Vec<InBuf>,
}

impl Chain {
    /// Total device-writable bytes.
    pub fn in_len(&self) -> usize {
        self.ins.iter().map(|b| b.len as usize).sum()
    }
}

/// A split virtqueue as configured by SET_VRING_NUM/ADDR/BASE.
#[derive(Debug, Clone, Default)]
pub struct Vring {
    pub num: u16,
    pub desc: u64,
    pub avail: u64,
    pub used: u64,
    /// The next available-ring entry to take (free-running).
    pub last_avail: u16,
    /// The next used-ring entry to fill (free-running).
    pub used_idx: u16,
}

impl Vring {
    /// Whether size and all three addresses have been set (the front end sets them one message at a time).
    pub fn is_ready(&self) -> bool {
        self.ready().is_ok()
    }

    fn ready(&self) -> Result<(), RingError> {
        if self.num == 0 || !self.num.is_power_of_two() || self.desc == 0 || self.avail == 0 || self.used == 0 {
            return Err(RingError::NotReady);
        }
        Ok(())
    }

    /// Whether the driver has made chains available that we have not taken.
    pub fn has_avail(&self, mem: &dyn GuestMem) -> Result<bool, RingError> {
        self.ready()?;
        let idx = mem.read_u16(self.avail + 2)?;
        Ok(idx != self.last_avail)
    }

    /// How many chains the driver has made available that we have not taken (at most the queue size: a driver
    /// with every descriptor in flight can add no request until we return some).
    pub fn backlog(&self, mem: &dyn GuestMem) -> Result<u16, RingError> {
        self.ready()?;
        let idx = mem.read_u16(self.avail + 2)?;
        Ok(idx.wrapping_sub(self.last_avail))
    }

    /// Takes the next available chain, if any.
    pub fn pop(&mut self, mem: &dyn GuestMem) -> Result<Option<Chain>, RingError> {
        self.ready()?;
        let idx = mem.read_u16(self.avail + 2)?;
        if idx == self.last_avail {
            return Ok(None);
        }
        // The ring entry and descriptors are read after the index that published them.
        fence(Ordering::Acquire);
        let slot = u64::from(self.last_avail % self.num);
        let head = mem.read_u16(self.avail + 4 + 2 * slot)?;
        self.last_avail = self.last_avail.wrapping_add(1);
        let mut chain = Chain { head, out: Vec::new(), ins: Vec::new() };
        let mut i = head;
        for _ in 0..self.num {
            if i >= self.num {
                return Err(RingError::BadIndex(i));
            }
            let d = self.desc + u64::from(i) * DESC_SIZE;
            let addr = mem.read_u64(d)?;
            let len = mem.read_u32(d + 8)?;
            let flags = mem.read_u16(d + 12)?;
            let next = mem.read_u16(d + 14)?;
            if flags & DESC_F_INDIRECT != 0 {
                return Err(RingError::Indirect);
            }
            if flags & DESC_F_WRITE != 0 {
                chain.ins.push(InBuf { addr, len });
            } else {
                if !chain.ins.is_empty() {
                    return Err(RingError::OutAfterIn);
                }
                let start = chain.out.len();
                let end = start.checked_add(len as usize).filter(|&e| e <= MAX_OUT).ok_or(RingError::ChainTooLong)?;
                chain.out.resize(end, 0);
                mem.read(addr, &mut chain.out[start..])?;
            }
            if flags & DESC_F_NEXT == 0 {
                return Ok(Some(chain));
            }
            i = next;
        }
        Err(RingError::ChainTooLong)
    }

    /// Writes `data` into the chain's device-writable buffers, in order; returns the bytes written (at most
    /// [`Chain::in_len`]).
    pub fn fill(mem: &dyn GuestMem, chain: &Chain, data: &[u8]) -> Result<u32, RingError> {
        let mut done = 0usize;
        for b in &chain.ins {
            if done == data.len() {
                break;
            }
            let n = (b.len as usize).min(data.len() - done);
            mem.write(b.addr, &data[done..done + n])?;
            done += n;
        }
        Ok(done as u32)
    }

    /// Returns a chain to the driver with `written` bytes filled in.
    pub fn push_used(&mut self, mem: &dyn GuestMem, head: u16, written: u32) -> Result<(), RingError> {
        self.ready()?;
        let slot = u64::from(self.used_idx % self.num);
        let e = self.used + 4 + 8 * slot;
        let mut elem = [0u8; 8];
        elem[..4].copy_from_slice(&u32::from(head).to_le_bytes());
        elem[4..].copy_from_slice(&written.to_le_bytes());
        mem.write(e, &elem)?;
        self.used_idx = self.used_idx.wrapping_add(1);
        // The element must be visible before the index that publishes it.
        fence(Ordering::Release);
        mem.write(self.used + 2, &self.used_idx.to_le_bytes())?;
        fence(Ordering::SeqCst);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::guest::VecMem;

    const BASE: u64 = 0x1000;
    const DESC: u64 = BASE;
    const AVAIL: u64 = BASE + 0x100;
    const USED: u64 = BASE + 0x200;
    const BUFS: u64 = BASE + 0x400;

    fn ring() -> Vring {
        Vring { num: 4, desc: DESC, avail: AVAIL, used: USED, ..Vring::default() }
    }

    /// Writes descriptor `i` as the guest driver would.
    fn desc(m: &VecMem, i: u16, addr: u64, len: u32, flags: u16, next: u16) {
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&len.to_le_bytes());
        d[12..14].copy_from_slice(&flags.to_le_bytes());
        d[14..].copy_from_slice(&next.to_le_bytes());
        m.write(DESC + 16 * u64::from(i), &d).unwrap();
    }

    fn publish(m: &VecMem, slot: u16, head: u16, idx: u16) {
        m.write(AVAIL + 4 + 2 * u64::from(slot), &head.to_le_bytes()).unwrap();
        m.write(AVAIL + 2, &idx.to_le_bytes()).unwrap();
    }

    #[test]
    fn pops_a_read_request_chain_and_returns_it_used() {
        let m = VecMem::new(BASE, 0x1000);
        // A virt-pci MMIO read: a 16-byte header out, then 4 device-writable bytes.
        let hdr = [3u8, 0, 0, 0, 4, 0, 0, 0, 0x10, 0, 0, 0, 0, 0, 0, 0];
        m.write(BUFS, &hdr).unwrap();
        desc(&m, 2, BUFS, 16, DESC_F_NEXT, 3);
        desc(&m, 3, BUFS + 0x40, 4, DESC_F_WRITE, 0);
        publish(&m, 0, 2, 1);
        let mut r = ring();
        assert!(r.has_avail(&m).unwrap());
        let c = r.pop(&m).unwrap().unwrap();
        assert_eq!(c.head, 2);
        assert_eq!(c.out, hdr);
        assert_eq!(c.ins, vec![InBuf { addr: BUFS + 0x40, len: 4 }]);
        assert_eq!(Vring::fill(&m, &c, &[0xde, 0xad, 0xbe, 0xef, 0x99]).unwrap(), 4);
        r.push_used(&m, c.head, 4).unwrap();
        assert_eq!(m.read_u32(BUFS + 0x40).unwrap(), 0xefbe_adde);
        // used.idx = 1, used.ring[0] = {id 2, len 4}.
        assert_eq!(m.read_u16(USED + 2).unwrap(), 1);
        assert_eq!(m.read_u32(USED + 4).unwrap(), 2);
        assert_eq!(m.read_u32(USED + 8).unwrap(), 4);
        assert_eq!(r.pop(&m).unwrap(), None);
    }

    #[test]
    fn out_bytes_spread_over_two_descriptors_are_joined() {
        let m = VecMem::new(BASE, 0x1000);
        m.write(BUFS, &[1, 2, 3]).unwrap();
        m.write(BUFS + 0x80, &[4, 5]).unwrap();
        desc(&m, 0, BUFS, 3, DESC_F_NEXT, 1);
        desc(&m, 1, BUFS + 0x80, 2, 0, 0);
        publish(&m, 0, 0, 1);
        let c = ring().pop(&m).unwrap().unwrap();
        assert_eq!(c.out, vec![1, 2, 3, 4, 5]);
        assert!(c.ins.is_empty());
    }

    #[test]
    fn malformed_chains_are_errors_not_panics() {
        let m = VecMem::new(BASE, 0x1000);
        // A loop: 0 -> 1 -> 0.
        desc(&m, 0, BUFS, 1, DESC_F_NEXT, 1);
        desc(&m, 1, BUFS, 1, DESC_F_NEXT, 0);
        publish(&m, 0, 0, 1);
        assert_eq!(ring().pop(&m), Err(RingError::ChainTooLong));
        // A head beyond the queue size.
        publish(&m, 0, 9, 1);
        assert_eq!(ring().pop(&m), Err(RingError::BadIndex(9)));
        // A buffer outside guest memory.
        desc(&m, 0, 0xdead_0000, 8, 0, 0);
        publish(&m, 0, 0, 1);
        assert!(matches!(ring().pop(&m), Err(RingError::Guest(_))));
        // Indirect descriptors were not offered.
        desc(&m, 0, BUFS, 16, DESC_F_INDIRECT, 0);
        assert_eq!(ring().pop(&m), Err(RingError::Indirect));
        // A readable buffer after a writable one.
        desc(&m, 0, BUFS, 4, DESC_F_WRITE | DESC_F_NEXT, 1);
        desc(&m, 1, BUFS, 4, 0, 0);
        assert_eq!(ring().pop(&m), Err(RingError::OutAfterIn));
        // An unconfigured queue.
        assert_eq!(Vring::default().pop(&m), Err(RingError::NotReady));
        let mut r = ring();
        r.num = 3;
        assert_eq!(r.pop(&m), Err(RingError::NotReady));
    }

    #[test]
    fn indices_wrap_around_the_ring() {
        let m = VecMem::new(BASE, 0x1000);
        desc(&m, 1, BUFS, 8, DESC_F_WRITE, 0);
        let mut r = ring();
        r.last_avail = u16::MAX;
        r.used_idx = u16::MAX;
        // Slot u16::MAX % 4 = 3.
        publish(&m, 3, 1, 0);
        let c = r.pop(&m).unwrap().unwrap();
        assert_eq!((c.head, r.last_avail), (1, 0));
        r.push_used(&m, c.head, 8).unwrap();
        assert_eq!(m.read_u16(USED + 2).unwrap(), 0);
        assert_eq!(m.read_u32(USED + 4 + 8 * 3).unwrap(), 1);
    }
}
