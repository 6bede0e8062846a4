//! The recording's header and record flags, in one copy for the reader (`core/tests-m4/src/board.rs`) and the
//! writer (`examples/firmware/tests/recording.rs`, which includes this file by path).

/// The file's first bytes.
pub const MAGIC: &[u8; 8] = b"MLX5MOCK";
/// The layout's version.
pub const VERSION: u16 = 1;
/// Record flag: a MANAGE_PAGES take, which the mock answers with pages of its own (no output recorded).
pub const GIVE_BACK: u8 = 1;
/// Record flag: a page request (function_id, num_pages) follows.
pub const PAGE_REQUEST: u8 = 2;
/// Record flag: a compare mask follows the input.
pub const MASKED: u8 = 4;
/// Record flag: the input is the start of the sent input only.
pub const PREFIX: u8 = 8;
/// Every flag a reader knows.
pub const KNOWN_FLAGS: u8 = GIVE_BACK | PAGE_REQUEST | MASKED | PREFIX;
