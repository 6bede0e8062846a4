//! The `pas[]` page lists of queue buffers: the create-time check that they cover the buffer with live pages,
//! and the page-by-page read through them that the QP and SRQ rings share.

use mlx5_core::prm::MsgBuf;

use super::reply::{bad_param, CmdErr};
use super::syndrome;
use crate::dma::{DmaFault, DmaSpace};

/// Checks that the `pas[]` array of `inp` covers `bytes` with live pages of `page_bytes`.
pub(crate) fn check_pas(
    dma: &DmaSpace,
    inp: &[u8],
    pas: mlx5_core::prm::Array,
    bytes: u64,
    page_bytes: u64,
) -> Result<(), CmdErr> {
    let given = inp.len().saturating_sub(pas.byte_off()) as u64 / u64::from(pas.elem_bits / 8);
    let needed = bytes.div_ceil(page_bytes);
    if given < needed {
        return Err(bad_param(syndrome::PAS_TOO_FEW));
    }
    for k in 0..needed {
        let pa = inp.get64(pas.elem(k as u32));
        if !pa.is_multiple_of(page_bytes) {
            return Err(bad_param(syndrome::PAS_MISALIGNED));
        }
        let len = page_bytes.min(bytes - k * page_bytes);
        if !dma.is_mapped(pa, len as usize) {
            return Err(bad_param(syndrome::PAS_NOT_MAPPED));
        }
    }
    Ok(())
}

/// Reads `out.len()` bytes at byte `at` of a buffer whose pages of `1 << page_shift` bytes are `pas`, page by page.
#[inline]
pub(crate) fn read_paged(
    dma: &mut DmaSpace,
    pas: &[u64],
    page_shift: u32,
    at: u64,
    out: &mut [u8],
) -> Result<(), DmaFault> {
    let page = 1u64 << page_shift;
    let mut done = 0usize;
    // Bounded: each step consumes at least one byte.
    while done < out.len() {
        let at = at + done as u64;
        let in_page = at & (page - 1);
        let n = ((page - in_page) as usize).min(out.len() - done);
        let pa = usize::try_from(at >> page_shift).ok().and_then(|k| pas.get(k)).ok_or(DmaFault {
            iova: 0,
            len: n,
            write: false,
        })?;
        dma.read(pa + in_page, &mut out[done..done + n])?;
        done += n;
    }
    Ok(())
}
