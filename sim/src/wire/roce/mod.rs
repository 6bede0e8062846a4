//! RoCEv2 on the wire: the frames a RoCE port exchanges, as zero-copy typed views over bytes with `parse`/`emit`
//! pairs (smoltcp's `wire` style). Ethernet II ([`ether`]), ARP ([`arp`]), IPv4 and IPv6 ([`ip`]), UDP to port
//! 4791 ([`udp`]), the InfiniBand transport headers BTH, RETH, AETH, AtomicETH, AtomicAckETH, DETH, XRCETH, ImmDt and IETH
//! ([`ib`]), the invariant CRC ([`icrc`]), and a whole frame ([`frame`]: every check, a typed drop reason, the
//! counters). Facts come from the IBTA RoCEv2 annex as Linux's `rdma_rxe` implements it.
//!
//! Each view has `new_unchecked` (for buffers this side sized) and `new_checked` (lengths verified, so accessors
//! stay in bounds); a value this side does not know parses as `Unknown(n)`. Nothing here panics on input bytes or
//! allocates.

pub mod arp;
mod error;
pub mod ether;
pub mod frame;
pub mod ib;
pub mod icrc;
pub mod ip;
pub mod rc;
pub mod udp;

pub use error::Error;
