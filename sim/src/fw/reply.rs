//! The result of a command, built in one place: [`CmdErr`] (the `mbox_out` status and syndrome of a refusal) and
//! its constructors, and [`rd`], the field read every command makes of its request (`MLX5_GET` in the kernel).

use mlx5_core::prm::{CmdStatus, Field, MsgBuf};

pub(crate) fn rd(b: &[u8], f: Field) -> u32 {
    MsgBuf::get(b, f)
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
