//! DevX user memory: CREATE_UMEM / DESTROY_UMEM (Linux's `MLX5_IB_METHOD_DEVX_UMEM_REG`, `devx_umem_reg_cmd_build`)
//! and the queues built on one.
//!
//! A UMEM is a page list: `num_of_mtt` entries of `1 << (log_page_size + 12)` bytes, the memory starting
//! `page_offset` bytes into the first. mlx5_ib ORs `MLX5_IB_MTT_READ` / `MLX5_IB_MTT_WRITE` into each entry's low
//! bits. An RQ or SQ (`wq.wq_umem_*`, `wq.dbr_umem_*`) or a QP's buffer (`create_qp_in.wq_umem_*`) may live on one;
//! the firmware takes the ring's pages from the UMEM instead of `pas[]`. Refusals (`BAD_PARAM` unless said):
//! * a page list shorter than `num_of_mtt`, a misaligned or unmapped page: the `pas[]` syndromes;
//! * an unknown UMEM: [`syndrome::UMEM_INVALID`]; a queue beyond its end: [`syndrome::UMEM_TOO_SMALL`]; a ring
//!   that does not start on one of its pages: [`syndrome::UMEM_OFFSET`];
//! * DESTROY_UMEM while a queue lives on it: `BAD_RES_STATE` [`syndrome::IN_USE`].

use std::collections::BTreeMap;

use mlx5_core::prm::{consts, ifc, CmdStatus, MsgBuf};

use super::ids::alloc_id;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;
use super::uctx::{Kind, Role};
use crate::dma::DmaSpace;

/// The low bits of an MTT entry that carry access rights, not address.
const MTT_FLAGS: u64 = consts::MLX5_IB_MTT_PRESENT as u64;
/// The largest UMEM page: 1 GiB.
const MAX_PAGE_SHIFT: u32 = 30;

/// One registered user memory.
#[derive(Debug)]
pub(crate) struct Umem {
    page_shift: u32,
    page_offset: u64,
    mtt: Vec<u64>,
}

impl Umem {
    /// The bytes it covers.
    fn len(&self) -> u64 {
        ((self.mtt.len() as u64) << self.page_shift) - self.page_offset
    }
}

/// The UMEMs and the queues that live on them.
#[derive(Debug)]
pub(crate) struct UmemTable {
    map: BTreeMap<u32, Umem>,
    next: u32,
    /// The UMEMs each queue (by kind and number) was created on.
    users: BTreeMap<(Kind, u32), Vec<u32>>,
}

impl UmemTable {
    pub(crate) fn new() -> Self {
        Self { map: BTreeMap::new(), next: 1, users: BTreeMap::new() }
    }

    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn create(&mut self, dma: &DmaSpace, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::create_umem_in as i;
        use ifc::umem as u;
        let page_shift = rd(inp, u::LOG_PAGE_SIZE.at(i::UMEM)) + consts::MLX5_ADAPTER_PAGE_SHIFT;
        if page_shift > MAX_PAGE_SHIFT {
            return Err(bad_param(syndrome::UMEM_PAGE));
        }
        let page = 1u64 << page_shift;
        let page_offset = u64::from(rd(inp, u::PAGE_OFFSET.at(i::UMEM)));
        if page_offset >= page {
            return Err(bad_param(syndrome::UMEM_PAGE));
        }
        let n = inp.get64(u::NUM_OF_MTT.at(i::UMEM));
        let mtt_at = u::MTT.at(i::UMEM);
        // The list is in the command: its length bounds what is read.
        let given = (inp.len().saturating_sub(mtt_at.byte_off()) / 8) as u64;
        if n == 0 || n > given {
            return Err(bad_param(syndrome::PAS_TOO_FEW));
        }
        let mut mtt = Vec::with_capacity(n as usize);
        for k in 0..n {
            let pa = inp.get64(mtt_at.elem(k as u32)) & !MTT_FLAGS;
            if pa & (page - 1) != 0 {
                return Err(bad_param(syndrome::PAS_MISALIGNED));
            }
            let from = if k == 0 { page_offset } else { 0 };
            if !dma.is_mapped(pa + from, (page - from) as usize) {
                return Err(bad_param(syndrome::PAS_NOT_MAPPED));
            }
            mtt.push(pa);
        }
        let id =
            alloc_id(&self.map, &mut self.next, 1, 1 << 24).ok_or(err(CmdStatus::NoRes, syndrome::NO_RESOURCES))?;
        self.map.insert(id, Umem { page_shift, page_offset, mtt });
        out.set(ifc::create_umem_out::UMEM_ID, id);
        Ok(())
    }

    pub(super) fn destroy(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        let id = rd(inp, ifc::destroy_umem_in::UMEM_ID);
        if !self.map.contains_key(&id) {
            return Err(bad_param(syndrome::UMEM_INVALID));
        }
        if self.users.values().any(|v| v.contains(&id)) {
            return Err(err(CmdStatus::BadResState, syndrome::IN_USE));
        }
        self.map.remove(&id);
        Ok(())
    }

    /// The pages and page shift of a ring of `bytes` at byte `offset` of UMEM `id`.
    pub(crate) fn ring(&self, id: u32, offset: u64, bytes: u64) -> Result<(Vec<u64>, u32), CmdErr> {
        let m = self.map.get(&id).ok_or(bad_param(syndrome::UMEM_INVALID))?;
        let end = offset.checked_add(bytes).ok_or(bad_param(syndrome::UMEM_TOO_SMALL))?;
        if end > m.len() {
            return Err(bad_param(syndrome::UMEM_TOO_SMALL));
        }
        let start = m.page_offset + offset;
        if start & ((1u64 << m.page_shift) - 1) != 0 {
            return Err(bad_param(syndrome::UMEM_OFFSET));
        }
        let first = (start >> m.page_shift) as usize;
        let last = (m.page_offset + end).div_ceil(1u64 << m.page_shift) as usize;
        Ok((m.mtt[first..last].to_vec(), m.page_shift))
    }

    /// The bus address of `len` bytes (a doorbell record) at byte `offset` of UMEM `id`, within one page.
    pub(crate) fn addr(&self, id: u32, offset: u64, len: u64) -> Result<u64, CmdErr> {
        let m = self.map.get(&id).ok_or(bad_param(syndrome::UMEM_INVALID))?;
        if offset.checked_add(len).is_none_or(|end| end > m.len()) {
            return Err(bad_param(syndrome::UMEM_TOO_SMALL));
        }
        let at = m.page_offset + offset;
        let mask = (1u64 << m.page_shift) - 1;
        if (at & mask) + len > mask + 1 {
            return Err(bad_param(syndrome::UMEM_OFFSET));
        }
        Ok(m.mtt[(at >> m.page_shift) as usize] + (at & mask))
    }

    /// The UMEMs a create command names (its queue's ring and doorbell record).
    pub(super) fn named_by(op: u16, inp: &[u8]) -> Vec<u32> {
        let mut ids = Vec::new();
        let wq = match op {
            consts::MLX5_CMD_OP_CREATE_RQ => Some(ifc::rqc::WQ.at(ifc::create_rq_in::CTX)),
            consts::MLX5_CMD_OP_CREATE_SQ => Some(ifc::sqc::WQ.at(ifc::create_sq_in::CTX)),
            consts::MLX5_CMD_OP_CREATE_QP => {
                if rd(inp, ifc::create_qp_in::WQ_UMEM_VALID) != 0 {
                    ids.push(rd(inp, ifc::create_qp_in::WQ_UMEM_ID));
                }
                None
            }
            _ => None,
        };
        if let Some(wq) = wq {
            use ifc::wq as w;
            if rd(inp, w::WQ_UMEM_VALID.at(wq)) != 0 {
                ids.push(rd(inp, w::WQ_UMEM_ID.at(wq)));
            }
            if rd(inp, w::DBR_UMEM_VALID.at(wq)) != 0 {
                ids.push(rd(inp, w::DBR_UMEM_ID.at(wq)));
            }
        }
        ids
    }

    /// After a command succeeded: a queue created on UMEMs holds them until it is destroyed.
    pub(super) fn record(&mut self, op: u16, kind: Kind, role: Role, inp: &[u8], out: &[u8]) {
        match role {
            Role::Create(f) => {
                let ids = Self::named_by(op, inp);
                if !ids.is_empty() {
                    self.users.insert((kind, rd(out, f)), ids);
                }
            }
            Role::Destroy(f) => {
                self.users.remove(&(kind, rd(inp, f)));
            }
            Role::Use(_) => {}
        }
    }

    /// TEARDOWN_HCA: every UMEM goes.
    pub(crate) fn clear(&mut self) {
        *self = Self::new();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fw::syndrome as syn;
    use crate::testkit::eth::Eth;
    use consts::{MLX5_CMD_STAT_BAD_PARAM_ERR as BAD_PARAM, MLX5_CMD_STAT_BAD_RES_STATE_ERR as BAD_RES};
    use mlx5_core::hal::Dma;

    const PAGE: u64 = 4096;

    /// CREATE_UMEM as mlx5_ib builds it: every entry carries MLX5_IB_MTT_READ | MLX5_IB_MTT_WRITE.
    fn umem_in(pages: &[u64], log_page: u32, page_offset: u32, num: u64) -> Vec<u8> {
        use ifc::umem as u;
        let at = u::MTT.at(ifc::create_umem_in::UMEM);
        let mut inp = vec![0u8; at.byte_off() + 8 * pages.len()];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_CREATE_UMEM.into());
        inp.set(u::LOG_PAGE_SIZE.at(ifc::create_umem_in::UMEM), log_page);
        inp.set(u::PAGE_OFFSET.at(ifc::create_umem_in::UMEM), page_offset);
        inp.set64(u::NUM_OF_MTT.at(ifc::create_umem_in::UMEM), num);
        for (k, pa) in pages.iter().enumerate() {
            inp.set64(at.elem(k as u32), pa | MTT_FLAGS);
        }
        inp
    }

    fn create(e: &mut Eth, inp: &[u8]) -> (u8, u32, u32) {
        let (s, y, out) = e.r.h.cmd(inp, ifc::create_umem_out::SIZE_BYTES);
        (s, y, rd(&out, ifc::create_umem_out::UMEM_ID))
    }

    fn destroy(e: &mut Eth, id: u32) -> (u8, u32) {
        e.destroy(consts::MLX5_CMD_OP_DESTROY_UMEM, ifc::destroy_umem_in::UMEM_ID, id)
    }

    /// `n` fresh pages.
    fn pages(e: &mut Eth, n: usize) -> Vec<u64> {
        let r = e.r.h.dma.alloc(n * PAGE as usize, PAGE as usize).unwrap();
        let v = (0..n as u64).map(|k| r.iova() + k * PAGE).collect();
        e.mem.push(r);
        v
    }

    /// The RQ's ring (64 strides of 64 bytes: one page) on UMEM `ring` at `off`, its doorbell record at byte
    /// `dbr_off` of UMEM `dbr`.
    fn rq_on(e: &mut Eth, ring: u32, off: u64, dbr: u32, dbr_off: u64) -> (u8, u32, u32) {
        let wq = ifc::rqc::WQ.at(ifc::create_rq_in::CTX);
        e.rq_with(move |i| {
            use ifc::wq as w;
            i.truncate(w::PAS.at(wq).byte_off());
            i.set(w::PAGE_OFFSET.at(wq), 0);
            i.set(w::WQ_UMEM_VALID.at(wq), 1);
            i.set(w::WQ_UMEM_ID.at(wq), ring);
            i.set64(w::WQ_UMEM_OFFSET.at(wq), off);
            i.set(w::DBR_UMEM_VALID.at(wq), 1);
            i.set(w::DBR_UMEM_ID.at(wq), dbr);
            i.set64(w::DBR_ADDR.at(wq), dbr_off);
        })
    }

    #[test]
    fn an_rq_lives_on_umems_that_stay_until_it_goes() {
        let mut e = Eth::new();
        let ring_pages = pages(&mut e, 2);
        let (s, y, ring) = create(&mut e, &umem_in(&ring_pages, 0, 0, 2));
        assert_eq!((s, y), (0, 0));
        // A doorbell UMEM of 8 bytes, 64 bytes into its page (as mlx5_ib registers a small aligned buffer).
        let dbr_page = pages(&mut e, 1)[0];
        let (s, y, dbr) = create(&mut e, &umem_in(&[dbr_page], 0, 64, 1));
        assert_eq!((s, y), (0, 0));
        assert_ne!(ring, dbr);
        // The ring starts on the UMEM's second page; its pages and doorbell record come from the UMEMs.
        let (s, y, rqn) = rq_on(&mut e, ring, PAGE, dbr, 0);
        assert_eq!((s, y), (0, 0));
        let (pas, dbr_addr) = e.r.h.dev.with_fw(|fw| {
            let wq = &fw.rqs.map[&rqn].wq;
            (wq.pas.clone(), wq.dbr_addr)
        });
        assert_eq!((pas, dbr_addr), (vec![ring_pages[1]], dbr_page + 64));
        // Neither UMEM goes while the RQ lives.
        assert_eq!(destroy(&mut e, ring), (BAD_RES, syn::IN_USE));
        assert_eq!(destroy(&mut e, dbr), (BAD_RES, syn::IN_USE));
        assert_eq!(e.destroy(consts::MLX5_CMD_OP_DESTROY_RQ, ifc::destroy_rq_in::RQN, rqn), (0, 0));
        assert_eq!(destroy(&mut e, ring), (0, 0));
        assert_eq!(destroy(&mut e, ring), (BAD_PARAM, syn::UMEM_INVALID));
        // A destroyed UMEM carries no queue.
        assert_eq!(rq_on(&mut e, ring, 0, dbr, 0).1, syn::UMEM_INVALID);
        assert_eq!(destroy(&mut e, dbr), (0, 0));
    }

    #[test]
    fn a_queue_beyond_or_astride_its_umem_is_refused() {
        let mut e = Eth::new();
        let p = pages(&mut e, 2);
        let (_, _, ring) = create(&mut e, &umem_in(&p, 0, 0, 2));
        let (_, _, dbr) = create(&mut e, &umem_in(&p[..1], 0, PAGE as u32 - 8, 1));
        // One page of ring from the second page's middle, or from past the end: too small.
        assert_eq!(rq_on(&mut e, ring, 2 * PAGE, dbr, 0).1, syn::UMEM_TOO_SMALL);
        assert_eq!(rq_on(&mut e, ring, u64::MAX, dbr, 0).1, syn::UMEM_TOO_SMALL);
        // Not on a page of the UMEM.
        assert_eq!(rq_on(&mut e, ring, 64, dbr, 0).1, syn::UMEM_OFFSET);
        // The 8-byte doorbell UMEM holds no record at byte 8.
        assert_eq!(rq_on(&mut e, ring, 0, dbr, 8).1, syn::UMEM_TOO_SMALL);
        assert_eq!(e.r.h.dev.with_fw(|fw| fw.rqs.map.len()), 0);
    }

    #[test]
    fn malformed_umems_are_refused_with_their_syndromes() {
        let mut e = Eth::new();
        let p = pages(&mut e, 2);
        let cases = [
            // The list is shorter than num_of_mtt, or empty.
            (umem_in(&p, 0, 0, 3), syn::PAS_TOO_FEW),
            (umem_in(&p, 0, 0, 0), syn::PAS_TOO_FEW),
            (umem_in(&[p[0] + 512], 0, 0, 1), syn::PAS_MISALIGNED),
            (umem_in(&[0x7000_0000_0000], 0, 0, 1), syn::PAS_NOT_MAPPED),
            (umem_in(&p[..1], 0, PAGE as u32, 1), syn::UMEM_PAGE),
            (umem_in(&p[..1], 31 - 12, 0, 1), syn::UMEM_PAGE),
        ];
        for (inp, want) in cases {
            let (s, y, _) = create(&mut e, &inp);
            assert_eq!((s, y), (BAD_PARAM, want));
        }
        assert_eq!(e.r.h.dev.with_fw(|fw| fw.umems.len()), 0);
        assert_eq!(destroy(&mut e, 77), (BAD_PARAM, syn::UMEM_INVALID));
    }
}
