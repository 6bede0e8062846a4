//! The packet format between devices: what one QP sends another. In process a packet is the Rust value [`Packet`],
//! a whole message. On a link it takes a byte form: between Ethernet ports the RoCEv2 frames `roce_map.rs` makes
//! from it (cut at the path MTU, one PSN per packet; `roce/` holds the frame views) and the port's receive side
//! (`transport/roce_rx.rs`) puts back together; between IB ports the simulator's own encoding (`frame.rs`).
//!
//! A packet is generic over `D`, the handle naming its source and destination device: the wire format does not
//! know how packets travel (that is `link`).

/// A code of one integer width with named values; any other value is kept as `Unknown(n)`, so reading one never
/// fails and the parser that meets it decides whether to refuse it. One definition for the simulator's own frame
/// format (`frame.rs`) and the RoCEv2 views (`roce/`).
macro_rules! wire_code {
    ($(#[$m:meta])* $vis:vis $name:ident: $ty:ty { $($(#[$vm:meta])* $var:ident = $val:literal,)+ }) => {
        $(#[$m])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        #[allow(missing_docs)]
        $vis enum $name {
            $($(#[$vm])* $var,)+
            /// A value this side does not know.
            Unknown($ty),
        }

        impl From<$ty> for $name {
            fn from(v: $ty) -> Self {
                match v {
                    $($val => $name::$var,)+
                    other => $name::Unknown(other),
                }
            }
        }

        impl From<$name> for $ty {
            fn from(c: $name) -> $ty {
                match c {
                    $($name::$var => $val,)+
                    $name::Unknown(other) => other,
                }
            }
        }
    };
}

pub(crate) mod frame;
mod packet;
pub mod roce;
pub(crate) mod roce_map;

pub(crate) use packet::*;

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn a_payload_up_to_a_cache_line_travels_inline() {
        let small: Vec<u8> = (0..64).collect();
        let large: Vec<u8> = (0..65).collect();
        let (a, b) = (Payload::from(&small[..]), Payload::from(&large[..]));
        assert!(matches!(a, Payload::Inline { len: 64, .. }) && matches!(b, Payload::Shared(_)));
        assert_eq!((&a[..], &b[..]), (&small[..], &large[..]));
        assert!(matches!(Payload::from(&[][..]), Payload::Inline { len: 0, .. }));
        // Equal by content, whatever the representation.
        assert_eq!(Payload::Shared(Arc::from(&small[..])), a);
        assert_eq!(format!("{a:?}"), format!("{small:?}"));
    }
}
