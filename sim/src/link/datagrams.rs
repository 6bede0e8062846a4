//! What a VDE link's Ethernet framing shares with the routing and the InfiniBand frames: the datagram
//! connection, the frame limits. A leaf, so `port.rs`, `vde.rs` and `vde_ib.rs` name it without naming each other.

/// Bytes of an Ethernet header; the ethertype is its last two.
pub(crate) const ETH_HEADER: usize = 14;

/// The largest Ethernet frame (header, 1500-byte payload and a VLAN tag, no FCS) a `vde_switch` carries.
pub const MAX_ETH_FRAME: usize = 1518;

/// A connection carrying whole Ethernet frames (libvdeplug's, in `vde.rs`; a point-to-point stream's, in
/// `stream.rs`), used by one reader and one writer thread at once.
pub(crate) trait Datagrams: Send + Sync + std::fmt::Debug {
    /// Sends one frame; negative when the fabric went away.
    fn send(&self, frame: &[u8]) -> isize;
    /// Sends frames in order, as few calls as the transport allows (a stream writes them at once); how many
    /// went, or negative when the fabric went away.
    fn send_many(&self, frames: &[Vec<u8>]) -> isize {
        for f in frames {
            if self.send(f) < 0 {
                return -1;
            }
        }
        frames.len() as isize
    }
    /// Receives one frame into `buf`; its length, or 0 or negative when the fabric went away.
    fn recv(&self, buf: &mut [u8]) -> isize;
    /// Whether a whole frame is already read and waiting (a stream reads ahead), so `recv` returns it without
    /// the descriptor being readable.
    fn pending(&self) -> bool {
        false
    }
    /// The descriptors to poll: data, and control (-1 if none), which is readable only when the fabric goes away.
    fn fds(&self) -> (i32, i32);
    /// Ends the connection at once, so the far end of a point-to-point stream sees it close (a switch's plug is
    /// closed when the link is dropped).
    fn shut(&self) {}
}
