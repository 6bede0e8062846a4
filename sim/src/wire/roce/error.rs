//! The one error of the header views.

/// Why bytes are not a well-formed header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// Shorter than the header (or than the length the header announces).
    Truncated,
    /// A field holds a value the format forbids.
    Malformed,
    /// A checksum or CRC does not match.
    Checksum,
}
