//! The `wq` context that RQs and SQs share (`mlx5_ifc_wq_bits`): ring geometry, doorbell record and `pas[]`,
//! checked at create time as the CQ and QP rings are.

use mlx5_core::prm::{consts, ifc, Array, MsgBuf, Sub};

use super::pas::check_pas;
use super::reply::{bad_param, rd, CmdErr};
use super::syndrome;
use super::umem::UmemTable;
use crate::dma::DmaSpace;

/// A cyclic work queue's ring, as CREATE_RQ / CREATE_SQ gave it.
#[derive(Debug, Clone)]
pub(crate) struct Wq {
    pub(crate) pd: u32,
    pub(crate) uar_page: u32,
    pub(crate) dbr_addr: u64,
    pub(crate) log_stride: u32,
    pub(crate) log_size: u32,
    pub(crate) page_shift: u32,
    /// Where the ring starts in its first page, in bytes (`page_offset` counts 1/64ths of a page).
    pub(crate) buf_off: u64,
    /// The ring's pages: the Ethernet datapath reads WQEs through them.
    pub(crate) pas: Vec<u64>,
}

impl Wq {
    /// `page_offset` as CREATE gave it (QUERY reports it back).
    pub(crate) fn page_offset(&self) -> u32 {
        (self.buf_off >> (self.page_shift - PAGE_OFFSET_QUANTA.trailing_zeros())) as u32
    }

    /// The ring's size in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        1u64 << (self.log_stride + self.log_size)
    }

    /// Fills `out` from byte `off` of the ring, wrapping at its end, page by page through `pas[]`. A page the
    /// driver unmapped is a DMA fault, as on the device.
    pub(crate) fn read(&self, dma: &mut DmaSpace, off: u64, out: &mut [u8]) -> Result<(), crate::dma::DmaFault> {
        let (size, page) = (self.bytes(), 1u64 << self.page_shift);
        let mut done = 0usize;
        while done < out.len() {
            // The ring wraps at its size; its first byte is `buf_off` into the first page.
            let o = self.buf_off + (off + done as u64) % size;
            let within = o & (page - 1);
            let n = (out.len() - done).min((page - within) as usize).min((self.buf_off + size - o) as usize);
            // `parse` made one page address per page of the ring.
            let base = self.pas.get((o >> self.page_shift) as usize).copied().unwrap_or(u64::MAX);
            dma.read(base.wrapping_add(within), &mut out[done..done + n])?;
            done += n;
        }
        Ok(())
    }
}

/// `page_offset` counts 1/64ths of a page (the `scale` mlx5_ib quantizes with), as in a QP or SRQ context.
const PAGE_OFFSET_QUANTA: u32 = 64;

/// Reads and checks the `wq` at `wq` of `inp`, whose pages follow at `pas`. `log_max_wq_sz` bounds the ring.
pub(crate) fn parse(
    dma: &DmaSpace,
    inp: &[u8],
    wq: Sub,
    pas: Array,
    log_max_wq_sz: u32,
    pd_exists: &dyn Fn(u32) -> bool,
    umems: &UmemTable,
) -> Result<Wq, CmdErr> {
    use ifc::wq as w;
    // mlx5e's RQs and SQs are cyclic; striding RQs (MPWQE) and linked lists are not modelled.
    if rd(inp, w::WQ_TYPE.at(wq)) != consts::MLX5_WQ_TYPE_CYCLIC {
        return Err(bad_param(syndrome::WQ_TYPE));
    }
    let pd = rd(inp, w::PD.at(wq));
    // PD 0 is accepted: mlx5e's drop RQ names none (`mlx5e_build_drop_rq_param`), as it never gets a WQE; a
    // WQE through a key of a real PD then fails the key's PD check.
    if pd != 0 && !pd_exists(pd) {
        return Err(bad_param(syndrome::PD_INVALID));
    }
    let log_stride = rd(inp, w::LOG_WQ_STRIDE.at(wq));
    let log_size = rd(inp, w::LOG_WQ_SZ.at(wq));
    // A stride below one 16-byte segment or above a 4 KiB page, or a ring above the capability, is refused.
    if !(4..=12).contains(&log_stride) || log_size > log_max_wq_sz {
        return Err(bad_param(syndrome::WQ_SIZE));
    }
    let ring_bytes = 1u64 << (log_stride + log_size);
    let dbr_field = inp.get64(w::DBR_ADDR.at(wq));
    // With `dbr_umem_valid`, `dbr_addr` is an offset into that UMEM.
    let dbr_addr = if rd(inp, w::DBR_UMEM_VALID.at(wq)) != 0 {
        umems.addr(rd(inp, w::DBR_UMEM_ID.at(wq)), dbr_field, 8)?
    } else {
        dbr_field
    };
    if !dbr_addr.is_multiple_of(4) || !dma.is_mapped(dbr_addr, 8) {
        return Err(bad_param(syndrome::WQ_DBR));
    }
    let (pd, uar_page) = (pd, rd(inp, w::UAR_PAGE.at(wq)));
    // A ring on a UMEM takes its pages (and their size) from it, starting `wq_umem_offset` bytes in.
    if rd(inp, w::WQ_UMEM_VALID.at(wq)) != 0 {
        let id = rd(inp, w::WQ_UMEM_ID.at(wq));
        let (pas, page_shift) = umems.ring(id, inp.get64(w::WQ_UMEM_OFFSET.at(wq)), ring_bytes)?;
        return Ok(Wq { pd, uar_page, dbr_addr, log_stride, log_size, page_shift, buf_off: 0, pas });
    }
    let page_shift = rd(inp, w::LOG_WQ_PG_SZ.at(wq)) + consts::MLX5_ADAPTER_PAGE_SHIFT;
    if page_shift > 30 {
        return Err(bad_param(syndrome::WQ_SIZE));
    }
    // mlx5_ib's raw packet QP hands its RQ the QP's own `page_offset` (and its SQ the offset of the user's send
    // buffer): a ring that starts inside its first page (the 5-bit field keeps it in the first half).
    let page_offset = rd(inp, w::PAGE_OFFSET.at(wq));
    let buf_off = u64::from(page_offset) << page_shift >> PAGE_OFFSET_QUANTA.trailing_zeros();
    // The pages cover the offset too.
    let bytes = buf_off + ring_bytes;
    check_pas(dma, inp, pas, bytes, 1u64 << page_shift)?;
    let pages = bytes.div_ceil(1u64 << page_shift) as u32;
    let pas = (0..pages).map(|k| inp.get64(pas.elem(k))).collect();
    Ok(Wq { pd, uar_page, dbr_addr, log_stride, log_size, page_shift, buf_off, pas })
}
