//! Helpers shared by the integration tests that the simulator's test kit (`mlx5_sim::testkit`, where the register
//! file, DMA fake and fixtures live) has no business holding: hex for the golden vectors, and the loaders of
//! recorded traces into expectation-mock scripts ([`mock_load`]).

pub mod mock_load;

/// Decodes a lower-case hex string.
pub fn unhex(s: &str) -> Vec<u8> {
    (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex")).collect()
}

/// Encodes bytes as lower-case hex.
pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}
