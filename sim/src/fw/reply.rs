//! The result of a command, built in one place: [`CmdErr`] (the `mbox_out` status and syndrome of a refusal) and
//! its constructors, and [`rd`], the field read every command makes of its request (`MLX5_GET` in the kernel).

use mlx5_core::prm::{CmdStatus, Field, MsgBuf};

pub(crate) fn rd(b: &[u8], f: Field) -> u32 {
    MsgBuf::get(b, f)
}

/// [`rd`] of a field of at most 16 bits (`opcode`, `op_mod`, `register_id`), as the `u16` its constants are.
pub(crate) fn rd16(b: &[u8], f: Field) -> u16 {
    debug_assert!(f.width <= 16, "rd16 of a {}-bit field", f.width);
    rd(b, f) as u16
}

/// [`rd`] of a field of at most 8 bits (a state, an MTU), as the `u8` its constants are.
pub(crate) fn rd8(b: &[u8], f: Field) -> u8 {
    debug_assert!(f.width <= 8, "rd8 of a {}-bit field", f.width);
    rd(b, f) as u8
}

/// A failing command: status and syndrome for `mbox_out`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CmdErr {
    pub(crate) status: CmdStatus,
    pub(crate) syndrome: u32,
}

pub(crate) fn err(status: CmdStatus, syndrome: u32) -> CmdErr {
    CmdErr { status, syndrome }
}

pub(crate) fn bad_param(syndrome: u32) -> CmdErr {
    err(CmdStatus::BadParam, syndrome)
}
