//! Firmware side: `fw/mkey.rs` (the key table and its access check).
//!
//! Execution through memory keys: every device access by key (gathers of local SGEs, scatters into receive
//! buffers, remote READ/WRITE/atomic targets) goes through [`Keys`] (`MkeyTable::check` and `MkeyTable::pieces`) and the checked
//! DMA translation.

use mlx5_core::prm::consts;

use super::wqe::{Seg, SegView, SendWqe};
use crate::dma::DmaSpace;
use crate::fw::mkey::{Mkey, MkeyAccess, MkeyFault, MkeyTable, Pieces};
use crate::fw::qp::Sge;
use crate::wire::{Payload, INLINE_PAYLOAD};

/// Bytes a gather reserves before reading (more only as the keys check out).
const GATHER_RESERVE: usize = 64 * 1024;

/// What an access through memory keys borrows from the device: the key table, device memory, and the inline
/// bytes of the WQE being executed. The datapath builds one per access (`Datapath::keys`).
pub(super) struct Keys<'a> {
    pub(super) mkeys: &'a MkeyTable,
    pub(super) dma: &'a mut DmaSpace,
    pub(super) inline: &'a mut Vec<u8>,
    /// The QP a remote access arrives on (a type 2 memory window answers only its own); `None` for local ones.
    pub(super) qpn: Option<u32>,
}

impl Keys<'_> {
    /// Checks an access through `key`, without translating it.
    #[inline]
    fn mkey_check(&self, key: u32, pd: Option<u32>, va: u64, len: u64, access: MkeyAccess) -> Result<&Mkey, MkeyFault> {
        self.mkeys.check(key, pd, self.qpn, va, len, access)
    }

    /// Checks an access through `key` and translates it into the usual few pieces, without a heap allocation.
    #[inline]
    fn mkey_pieces(
        &self,
        key: u32,
        pd: Option<u32>,
        va: u64,
        len: u64,
        access: MkeyAccess,
    ) -> Result<Pieces, MkeyFault> {
        self.mkeys.pieces(self.dma, key, pd, self.qpn, va, len, access)
    }

    pub(super) fn key_read(&mut self, key: u32, pd: u32, va: u64, len: u64, access: MkeyAccess) -> Result<Vec<u8>, ()> {
        let mut out = Vec::new();
        self.key_read_into(key, pd, va, len, access, &mut out)?;
        Ok(out)
    }

    /// Appends the `len` bytes at `va` through `key` to `out` (grown only once the key checks out).
    pub(super) fn key_read_into(
        &mut self,
        key: u32,
        pd: u32,
        va: u64,
        len: u64,
        access: MkeyAccess,
        out: &mut Vec<u8>,
    ) -> Result<(), ()> {
        self.mkey_check(key, Some(pd), va, len, access).map_err(|_| ())?;
        let start = out.len();
        out.resize(start + usize::try_from(len).map_err(|_| ())?, 0);
        self.key_read_to(key, pd, va, &mut out[start..], access)
    }

    /// Fills `out` with the bytes at `va` through `key`.
    pub(super) fn key_read_to(
        &mut self,
        key: u32,
        pd: u32,
        va: u64,
        out: &mut [u8],
        access: MkeyAccess,
    ) -> Result<(), ()> {
        let len = out.len() as u64;
        // One range (the usual case): checked and copied with one translation.
        let one = self.mkey_check(key, Some(pd), va, len, access).map_err(|_| ())?.contiguous(va, len);
        if let Some(iova) = one {
            return if self.dma.try_read(iova, out) { Ok(()) } else { Err(()) };
        }
        let pieces = self.mkey_pieces(key, Some(pd), va, len, access).map_err(|_| ())?;
        let mut at = 0usize;
        for &(iova, n) in pieces.iter() {
            let n = usize::try_from(n).map_err(|_| ())?;
            let dst = out.get_mut(at..at.saturating_add(n)).ok_or(())?;
            self.dma.read(iova, dst).map_err(|_| ())?;
            at += n;
        }
        Ok(())
    }

    pub(super) fn key_write(&mut self, key: u32, pd: u32, va: u64, data: &[u8], access: MkeyAccess) -> Result<(), ()> {
        let len = data.len() as u64;
        // One range (the usual case): checked and written with one translation.
        let one = self.mkey_check(key, Some(pd), va, len, access).map_err(|_| ())?.contiguous(va, len);
        if let Some(iova) = one {
            return if self.dma.try_write(iova, data) { Ok(()) } else { Err(()) };
        }
        let pieces = self.mkey_pieces(key, Some(pd), va, data.len() as u64, access).map_err(|_| ())?;
        let mut at = 0usize;
        for &(iova, n) in pieces.iter() {
            let n = usize::try_from(n).map_err(|_| ())?;
            self.dma.write(iova, &data[at..at + n]).map_err(|_| ())?;
            at += n;
        }
        Ok(())
    }

    /// The payload of a send: inline bytes and local SGEs (read with `LOCAL_READ`).
    pub(super) fn gather(&mut self, pd: u32, max_msg: u64, w: &SendWqe) -> Result<Vec<u8>, u8> {
        let mut data = Vec::new();
        self.gather_into(pd, max_msg, w, &mut data)?;
        Ok(data)
    }

    /// [`Datapath::gather`] as an RC payload: a small one straight into the packet's inline bytes, a larger one
    /// straight into the shared payload, allocated once at its exact length. Gathering through a buffer and then
    /// sharing a copy held the message twice (and kept the buffer at the largest message's size for good).
    pub(super) fn gather_payload(&mut self, pd: u32, max_msg: u64, w: &SendWqe) -> Result<Payload, u8> {
        let total = w.total_len();
        if total > max_msg {
            return Err(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
        }
        let len = usize::try_from(total).map_err(|_| consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR)?;
        if len <= INLINE_PAYLOAD {
            let mut bytes = [0u8; INLINE_PAYLOAD];
            self.gather_small(pd, w, &mut bytes[..len])?;
            return Ok(Payload::Inline { len: len as u8, bytes });
        }
        // A large message is allocated only once every key checks out (a bad key costs nothing).
        if len > GATHER_RESERVE {
            for s in w.segs.iter() {
                if let SegView::Ptr(g) = s.view() {
                    self.mkey_check(g.lkey, Some(pd), g.addr, g.len, MkeyAccess::LOCAL_READ)
                        .map_err(|_| consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR)?;
                }
            }
        }
        // One allocation of the exact length (a `TrustedLen` iterator), unique until returned.
        let mut data: std::sync::Arc<[u8]> = std::iter::repeat_n(0u8, len).collect();
        let out = std::sync::Arc::get_mut(&mut data).ok_or(consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR)?;
        self.gather_small(pd, w, out)?;
        Ok(Payload::Shared(data))
    }

    /// The payload of `w` into `out`, exactly its length (its length already checked).
    pub(super) fn gather_small(&mut self, pd: u32, w: &SendWqe, out: &mut [u8]) -> Result<(), u8> {
        let mut at = 0usize;
        for s in w.segs.iter() {
            match s.view() {
                SegView::Inline { at: from, len } => {
                    let src = self.inline.get(from..from + len).ok_or(consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR)?;
                    out.get_mut(at..at + len).ok_or(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR)?.copy_from_slice(src);
                    at += len;
                }
                SegView::Ptr(g) => {
                    let n = usize::try_from(g.len).map_err(|_| consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR)?;
                    let dst =
                        out.get_mut(at..at.saturating_add(n)).ok_or(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR)?;
                    self.key_read_to(g.lkey, pd, g.addr, dst, MkeyAccess::LOCAL_READ)
                        .map_err(|_| consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR)?;
                    at += n;
                }
            }
        }
        Ok(())
    }

    /// Appends the payload of `w` to `data` (empty on entry); a message above `max_msg` bytes is refused.
    pub(super) fn gather_into(&mut self, pd: u32, max_msg: u64, w: &SendWqe, data: &mut Vec<u8>) -> Result<(), u8> {
        let total = w.total_len();
        if total > max_msg {
            return Err(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
        }
        // Room for the usual message up front; a large one grows as its keys check out.
        data.reserve(usize::try_from(total).unwrap_or(0).min(GATHER_RESERVE));
        for s in w.segs.iter() {
            match s.view() {
                SegView::Inline { at, len } => data.extend_from_slice(&self.inline[at..at + len]),
                SegView::Ptr(g) => {
                    self.key_read_into(g.lkey, pd, g.addr, g.len, MkeyAccess::LOCAL_READ, data)
                        .map_err(|_| consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR)?;
                }
            }
        }
        Ok(())
    }

    /// Checks the local SGEs a READ or an atomic writes into (`LOCAL_WRITE`); returns their total length.
    pub(super) fn check_scatter(&mut self, pd: u32, segs: &[Seg]) -> Result<u64, u8> {
        let mut total = 0u64;
        for s in segs {
            let SegView::Ptr(g) = s.view() else { return Err(consts::MLX5_CQE_SYNDROME_LOCAL_QP_OP_ERR) };
            self.mkey_pieces(g.lkey, Some(pd), g.addr, g.len, MkeyAccess::LOCAL_WRITE)
                .map_err(|_| consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR)?;
            total = total.saturating_add(g.len);
        }
        Ok(total)
    }

    /// Writes `data` across `sges` in order (`LOCAL_WRITE`); only the bytes written are checked.
    #[inline]
    pub(super) fn scatter(&mut self, pd: u32, sges: &[Sge], data: &[u8]) -> Result<(), u8> {
        let capacity = sges.iter().fold(0u64, |a, g| a.saturating_add(g.len));
        if capacity < data.len() as u64 {
            return Err(consts::MLX5_CQE_SYNDROME_LOCAL_LENGTH_ERR);
        }
        let mut at = 0usize;
        for g in sges {
            if at == data.len() {
                break;
            }
            let n = usize::try_from(g.len).unwrap_or(usize::MAX).min(data.len() - at);
            self.key_write(g.lkey, pd, g.addr, &data[at..at + n], MkeyAccess::LOCAL_WRITE)
                .map_err(|_| consts::MLX5_CQE_SYNDROME_LOCAL_PROT_ERR)?;
            at += n;
        }
        Ok(())
    }
}
