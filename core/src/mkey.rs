//! Memory keys (PRM CREATE_MKEY / DESTROY_MKEY; Linux `mlx5_core_create_mkey`, mlx5_ib `reg_create` and
//! `mlx5_ib_get_dma_mr`). A memory region is an mkey: a translation from the region's virtual addresses to bus
//! addresses (an MTT, one entry per page), the access rights, and the PD it belongs to. Its lkey and rkey are
//! the same 32-bit key: `mkey_index << 8 | variant`.

use crate::buf::{DmaSeg, PageLayout, PageList};
use crate::cmd::{PageSource, Simple};
use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{c, consts, ifc, Field, MsgBuf, Opcode, SubBuf};

/// Access rights of a memory region, with the bit values of verbs' `IB_UVERBS_ACCESS_*` (local read is always
/// granted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Access(pub u32);

impl Access {
    /// `IB_ACCESS_LOCAL_WRITE`.
    pub const LOCAL_WRITE: Access = Access(1);
    /// `IB_ACCESS_REMOTE_WRITE`.
    pub const REMOTE_WRITE: Access = Access(2);
    /// `IB_ACCESS_REMOTE_READ`.
    pub const REMOTE_READ: Access = Access(4);
    /// `IB_ACCESS_REMOTE_ATOMIC`.
    pub const REMOTE_ATOMIC: Access = Access(8);
    /// Every right this driver supports.
    pub const ALL: Access = Access(15);
    /// `IB_ACCESS_RELAXED_ORDERING` (`IB_ACCESS_OPTIONAL_FIRST`): the device may reorder its PCIe writes and reads
    /// of the region. Optional: accepted always, and set in the key only as far as the device supports it
    /// (mlx5_ib `set_mkc_access_pd_addr_fields`).
    pub const RELAXED_ORDERING: Access = Access(1 << 20);

    /// Whether every right of `other` is granted.
    pub const fn contains(self, other: Access) -> bool {
        self.0 & other.0 == other.0
    }

    /// Bits outside [`Access::ALL`] and [`Access::RELAXED_ORDERING`] (memory windows, on-demand paging, ...).
    pub const fn unsupported(self) -> u32 {
        self.0 & !(Access::ALL.0 | Access::RELAXED_ORDERING.0)
    }
}

impl core::ops::BitOr for Access {
    type Output = Access;
    fn bitor(self, o: Access) -> Access {
        Access(self.0 | o.0)
    }
}

/// How the key translates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Translation<'a> {
    /// Physical-address mode over all of IOVA (`MLX5_MKC_ACCESS_MODE_PA`, `length64`): a virtual address is the
    /// bus address (`mlx5_ib_get_dma_mr`).
    AllIova,
    /// An MTT for `len` bytes at virtual address `va`, laid out by `layout` over `segs`.
    Mtt {
        /// First virtual address.
        va: u64,
        /// Length in bytes.
        len: u64,
        /// The memory's DMA segments.
        segs: &'a [DmaSeg],
        /// Page size and count of the MTT.
        layout: PageLayout,
    },
}

/// `CREATE_MKEY` input.
#[derive(Debug, Clone, Copy)]
pub struct CreateMkey<'a> {
    /// The protection domain.
    pub pd: u32,
    /// Access rights.
    pub access: Access,
    /// The low 8 bits of the key (`mkey_7_0`): varied per registration so a stale key from a freed region does not
    /// match a new one at the same index.
    pub variant: u8,
    /// How the key translates addresses.
    pub translation: Translation<'a>,
    /// `mkc.relaxed_ordering_write`: set only when the device reports `relaxed_ordering_write`.
    pub relaxed_write: bool,
    /// `mkc.relaxed_ordering_read`: set only when the device reports relaxed-ordering reads.
    pub relaxed_read: bool,
    /// `mkc.ma_translation_mode`: 1 for a physical-address key on a device with ATS (`mlx5_ib_get_dma_mr`), so
    /// its accesses go through address translation.
    pub ma_translation_mode: u8,
}

impl CreateMkey<'_> {
    /// MTT entries sent: the page count rounded up to whole octowords (two entries each), as mlx5_ib sizes it.
    fn mtt_entries(&self) -> usize {
        match self.translation {
            Translation::AllIova => 0,
            Translation::Mtt { layout, .. } => layout.npages.next_multiple_of(2),
        }
    }
}

impl Command for CreateMkey<'_> {
    type In = ifc::create_mkey_in::Bits;
    type Out = ifc::create_mkey_out::Bits;
    /// The key (`mkey_index << 8 | variant`).
    type Output = u32;
    fn opcode(&self) -> Opcode {
        Opcode::CreateMkey
    }
    fn inlen(&self) -> usize {
        ifc::create_mkey_in::KLM_PAS_MTT.byte_off() + self.mtt_entries() * c::mlx5_mtt::SIZE
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        use ifc::mkc;
        write_header(msg, Opcode::CreateMkey, 0);
        let octowords = (self.mtt_entries() / 2) as u32;
        {
            let mut c = SubBuf::new(msg, ifc::create_mkey_in::MEMORY_KEY_MKEY_ENTRY);
            let mode = match self.translation {
                Translation::AllIova => consts::MLX5_MKC_ACCESS_MODE_PA,
                Translation::Mtt { .. } => consts::MLX5_MKC_ACCESS_MODE_MTT,
            };
            c.set(mkc::ACCESS_MODE_1_0, mode & 3);
            c.set(mkc::ACCESS_MODE_4_2, mode >> 2);
            c.set(mkc::A, self.access.contains(Access::REMOTE_ATOMIC).into());
            c.set(mkc::RW, self.access.contains(Access::REMOTE_WRITE).into());
            c.set(mkc::RR, self.access.contains(Access::REMOTE_READ).into());
            c.set(mkc::LW, self.access.contains(Access::LOCAL_WRITE).into());
            c.set(mkc::LR, 1);
            c.set(mkc::RELAXED_ORDERING_WRITE, self.relaxed_write.into());
            c.set(mkc::RELAXED_ORDERING_READ, self.relaxed_read.into());
            // Not bound to a QP (`qpn` 0xffffff, as every mlx5_ib mkey).
            c.set(mkc::QPN, 0xff_ffff);
            c.set(mkc::MKEY_7_0, self.variant.into());
            c.set(mkc::PD, self.pd);
            c.set(mkc::MA_TRANSLATION_MODE, self.ma_translation_mode.into());
            match self.translation {
                Translation::AllIova => c.set(mkc::LENGTH64, 1),
                Translation::Mtt { va, len, layout, .. } => {
                    // `reg_create` lets UMR reconfigure the key later, as every populated mlx5_ib key.
                    c.set(mkc::UMR_EN, 1);
                    c.set64(mkc::START_ADDR, va);
                    c.set64(mkc::LEN, len);
                    c.set(mkc::LOG_PAGE_SIZE, layout.page_shift);
                    c.set(mkc::TRANSLATIONS_OCTWORD_SIZE, octowords);
                }
            }
        }
        if let Translation::Mtt { segs, layout, .. } = self.translation {
            msg.set(ifc::create_mkey_in::TRANSLATIONS_OCTWORD_ACTUAL_SIZE, octowords);
            // `klm_pas_mtt` is declared in 32-bit units; each MTT entry (`struct mlx5_mtt`) spans several.
            let arr = ifc::create_mkey_in::KLM_PAS_MTT;
            let per_mtt = (c::mlx5_mtt::SIZE * 8) as u32 / arr.elem_bits;
            PageList { segs, layout }
                .each(&mut |i, addr| msg.set64(Field::new(arr.elem(i as u32 * per_mtt).off, 64), addr));
        }
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<u32, CmdError> {
        Ok(out.get(ifc::create_mkey_out::MKEY_INDEX) << 8 | u32::from(self.variant))
    }
}

/// `DESTROY_MKEY` of `key` (its index is the upper 24 bits).
pub fn destroy_mkey(key: u32) -> Simple {
    Simple::new(Opcode::DestroyMkey, ifc::destroy_mkey_in::SIZE_BYTES, ifc::destroy_mkey_out::SIZE_BYTES)
        .arg(ifc::destroy_mkey_in::MKEY_INDEX, key >> 8)
}

/// A registered memory region (`ibv_mr`): keys and the range they cover. Not `Copy`: deregistering consumes it.
#[derive(Debug, PartialEq, Eq)]
pub struct Mr {
    /// Local key.
    pub lkey: u32,
    /// Remote key.
    pub rkey: u32,
    /// First virtual address (the `iova` of `ibv_reg_mr_iova`; by default the CPU address of the memory; 0 for an
    /// all-IOVA key).
    pub addr: u64,
    /// The bus address of the first byte (0 for an all-IOVA key): where the device reaches `addr`.
    pub dma: u64,
    /// Bytes covered (`u64::MAX` for an all-IOVA key).
    pub length: u64,
    /// Access rights.
    pub access: Access,
    /// The protection domain.
    pub pd: u32,
    /// Page size of the MTT (0 for an all-IOVA key).
    pub page_shift: u32,
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn access_rights_combine_and_unsupported_bits_are_isolated() {
        let a = Access::LOCAL_WRITE | Access::REMOTE_READ;
        assert!(a.contains(Access::LOCAL_WRITE) && a.contains(Access::REMOTE_READ));
        assert!(!a.contains(Access::REMOTE_WRITE));
        assert_eq!(a.unsupported(), 0);
        assert_eq!(Access(Access::ALL.0 | 0x40).unsupported(), 0x40);
        assert!(Access::ALL.contains(Access::REMOTE_ATOMIC | Access::REMOTE_WRITE));
        // Relaxed ordering is an optional flag, not an unsupported one.
        assert_eq!((Access::ALL | Access::RELAXED_ORDERING).unsupported(), 0);
        assert_eq!(Access::RELAXED_ORDERING.0, 1 << 20);
    }

    #[test]
    fn relaxed_ordering_bits_are_written_only_when_asked() {
        use crate::prm::MsgBuf;
        let seg = [DmaSeg { iova: 0x1_0000_0000, len: 4096 }];
        let layout = PageLayout { page_shift: 12, offset: 0, npages: 1 };
        let mut cmd = CreateMkey {
            pd: 1,
            access: Access::LOCAL_WRITE,
            variant: 3,
            translation: Translation::Mtt { va: 0x1_0000_0000, len: 4096, segs: &seg, layout },
            relaxed_write: true,
            relaxed_read: false,
            ma_translation_mode: 0,
        };
        let ctx = ifc::create_mkey_in::MEMORY_KEY_MKEY_ENTRY;
        let encode = |cmd: &CreateMkey<'_>| {
            let mut buf = [0u8; 512];
            cmd.encode(&mut buf[..cmd.inlen()]);
            buf
        };
        let b = encode(&cmd);
        let get = |b: &[u8], f: Field| MsgBuf::get(b, f.at(ctx));
        assert_eq!((get(&b, ifc::mkc::RELAXED_ORDERING_WRITE), get(&b, ifc::mkc::RELAXED_ORDERING_READ)), (1, 0));
        assert_eq!((get(&b, ifc::mkc::LW), get(&b, ifc::mkc::LOG_PAGE_SIZE)), (1, 12));
        cmd.relaxed_write = false;
        cmd.relaxed_read = true;
        let b = encode(&cmd);
        assert_eq!((get(&b, ifc::mkc::RELAXED_ORDERING_WRITE), get(&b, ifc::mkc::RELAXED_ORDERING_READ)), (0, 1));
        // A populated MTT key may be reconfigured by UMR (`reg_create`); a physical-address key is not, and
        // follows the device's ATS (`mlx5_ib_get_dma_mr`).
        assert_eq!((get(&b, ifc::mkc::UMR_EN), get(&b, ifc::mkc::MA_TRANSLATION_MODE)), (1, 0));
        cmd.translation = Translation::AllIova;
        cmd.ma_translation_mode = 1;
        let b = encode(&cmd);
        assert_eq!((get(&b, ifc::mkc::UMR_EN), get(&b, ifc::mkc::MA_TRANSLATION_MODE)), (0, 1));
        assert_eq!(get(&b, ifc::mkc::LENGTH64), 1);
    }
}
