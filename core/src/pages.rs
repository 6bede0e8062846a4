//! Firmware pages (Linux `pagealloc.c`): QUERY_PAGES and MANAGE_PAGES give / take.
//!
//! Firmware asks for host memory at boot, at init and during operation; the driver gives 4 KiB pages by bus
//! address and takes them back at teardown or when firmware returns them (a negative request).

use crate::cmd::{len_with_pas, write_pas};
use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{consts, ifc, MsgBuf, Opcode};

/// Size of a firmware page (`MLX5_ADAPTER_PAGE_SIZE`).
pub const FW_PAGE_SIZE: usize = consts::MLX5_ADAPTER_PAGE_SIZE as usize;

/// Which pages QUERY_PAGES asks about (`MLX5_QUERY_PAGES_IN_OP_MOD_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum PageStage {
    Boot,
    Init,
    Regular,
}

impl PageStage {
    const fn op_mod(self) -> u16 {
        (match self {
            PageStage::Boot => consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES,
            PageStage::Init => consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES,
            PageStage::Regular => consts::MLX5_QUERY_PAGES_IN_OP_MOD_REGULAR_PAGES,
        }) as u16
    }
}

/// Firmware's answer to QUERY_PAGES.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRequest {
    pub function_id: u16,
    /// Pages firmware wants (positive) or wants to return (negative).
    pub num_pages: i32,
}

/// `QUERY_PAGES` (`mlx5_cmd_query_pages`).
#[derive(Debug, Clone, Copy)]
pub struct QueryPages {
    pub stage: PageStage,
}

impl Command for QueryPages {
    type Output = PageRequest;
    fn opcode(&self) -> Opcode {
        Opcode::QueryPages
    }
    fn inlen(&self) -> usize {
        ifc::query_pages_in::SIZE_BYTES
    }
    fn outlen(&self) -> usize {
        ifc::query_pages_out::SIZE_BYTES
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::QueryPages, self.stage.op_mod());
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<PageRequest, CmdError> {
        Ok(PageRequest {
            function_id: out.get(ifc::query_pages_out::FUNCTION_ID) as u16,
            num_pages: out.get(ifc::query_pages_out::NUM_PAGES) as i32,
        })
    }
}

/// `MANAGE_PAGES` give (`MLX5_PAGES_GIVE`): hands `pages` (4 KiB-aligned bus addresses) to firmware.
#[derive(Debug, Clone, Copy)]
pub struct ManagePagesGive<'a> {
    pub function_id: u16,
    pub pages: &'a [u64],
}

impl Command for ManagePagesGive<'_> {
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::ManagePages
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::manage_pages_in::PAS, self.pages.len())
    }
    fn outlen(&self) -> usize {
        ifc::manage_pages_out::SIZE_BYTES
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::ManagePages, consts::MLX5_PAGES_GIVE as u16);
        msg.set(ifc::manage_pages_in::FUNCTION_ID, self.function_id.into());
        msg.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, self.pages.len() as u32);
        write_pas(msg, ifc::manage_pages_in::PAS, self.pages);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// `MANAGE_PAGES` take (`MLX5_PAGES_TAKE`, `reclaim_pages_cmd`): asks for up to `pages.len()` pages back; the
/// addresses firmware returns are written to `pages` and their count is the output.
#[derive(Debug)]
pub struct ManagePagesTake<'a> {
    pub function_id: u16,
    pub pages: &'a mut [u64],
}

impl Command for ManagePagesTake<'_> {
    type Output = usize;
    fn opcode(&self) -> Opcode {
        Opcode::ManagePages
    }
    fn inlen(&self) -> usize {
        ifc::manage_pages_in::SIZE_BYTES
    }
    fn outlen(&self) -> usize {
        len_with_pas(ifc::manage_pages_out::PAS, self.pages.len())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::ManagePages, consts::MLX5_PAGES_TAKE as u16);
        msg.set(ifc::manage_pages_in::FUNCTION_ID, self.function_id.into());
        msg.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, self.pages.len() as u32);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<usize, CmdError> {
        let n = out.get(ifc::manage_pages_out::OUTPUT_NUM_ENTRIES) as usize;
        if n > self.pages.len() {
            // Firmware claims more pages than the output can hold: trust none of them.
            return Err(CmdError::OutputTooShort {
                opcode: Opcode::ManagePages,
                needed: len_with_pas(ifc::manage_pages_out::PAS, n),
                got: out.len(),
            });
        }
        for i in 0..n {
            let addr = out.get64(ifc::manage_pages_out::PAS.elem(i as u32));
            if !addr.is_multiple_of(FW_PAGE_SIZE as u64) {
                return Err(CmdError::Malformed { opcode: Opcode::ManagePages, what: "page address", value: addr });
            }
            self.pages[i] = addr;
        }
        Ok(n)
    }
}
