//! The 64-byte CQE (`mlx5_cqe64`, `mlx5_err_cqe`): the byte view [`Cqe`], its opcode and decoded fields.

use crate::prm::{c, consts};

/// The CQE opcode (upper nibble of `op_own`, `MLX5_CQE_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum CqeOpcode {
    /// A send-queue WQE completed (`MLX5_CQE_REQ`).
    Req,
    /// `MLX5_CQE_RESP_WR_IMM`: an RDMA WRITE with immediate arrived.
    RespWrImm,
    /// `MLX5_CQE_RESP_SEND`: a SEND arrived.
    RespSend,
    /// `MLX5_CQE_RESP_SEND_IMM`: a SEND with immediate arrived.
    RespSendImm,
    /// `MLX5_CQE_RESP_SEND_INV`: a SEND with invalidate arrived.
    RespSendInv,
    /// Marks where a resized CQ switched buffers.
    Resize,
    /// `MLX5_CQE_SIG_ERR`: a signature error on a memory key.
    SigErr,
    /// `MLX5_CQE_REQ_ERR`: a send work request failed.
    ReqErr,
    /// `MLX5_CQE_RESP_ERR`: a receive work request failed.
    RespErr,
    /// `MLX5_CQE_INVALID`: not written by the device.
    Invalid,
    /// An opcode the headers do not name.
    Unknown(u8),
}

impl CqeOpcode {
    /// The opcode from the upper nibble of `op_own`.
    #[inline]
    pub const fn from_raw(v: u8) -> Self {
        match v {
            consts::MLX5_CQE_REQ => CqeOpcode::Req,
            consts::MLX5_CQE_RESP_WR_IMM => CqeOpcode::RespWrImm,
            consts::MLX5_CQE_RESP_SEND => CqeOpcode::RespSend,
            consts::MLX5_CQE_RESP_SEND_IMM => CqeOpcode::RespSendImm,
            consts::MLX5_CQE_RESP_SEND_INV => CqeOpcode::RespSendInv,
            consts::MLX5_CQE_RESIZE_CQ => CqeOpcode::Resize,
            consts::MLX5_CQE_SIG_ERR => CqeOpcode::SigErr,
            consts::MLX5_CQE_REQ_ERR => CqeOpcode::ReqErr,
            consts::MLX5_CQE_RESP_ERR => CqeOpcode::RespErr,
            consts::MLX5_CQE_INVALID => CqeOpcode::Invalid,
            _ => CqeOpcode::Unknown(v),
        }
    }

    /// The 4-bit opcode value.
    pub const fn raw(self) -> u8 {
        match self {
            CqeOpcode::Req => consts::MLX5_CQE_REQ,
            CqeOpcode::RespWrImm => consts::MLX5_CQE_RESP_WR_IMM,
            CqeOpcode::RespSend => consts::MLX5_CQE_RESP_SEND,
            CqeOpcode::RespSendImm => consts::MLX5_CQE_RESP_SEND_IMM,
            CqeOpcode::RespSendInv => consts::MLX5_CQE_RESP_SEND_INV,
            CqeOpcode::Resize => consts::MLX5_CQE_RESIZE_CQ,
            CqeOpcode::SigErr => consts::MLX5_CQE_SIG_ERR,
            CqeOpcode::ReqErr => consts::MLX5_CQE_REQ_ERR,
            CqeOpcode::RespErr => consts::MLX5_CQE_RESP_ERR,
            CqeOpcode::Invalid => consts::MLX5_CQE_INVALID,
            CqeOpcode::Unknown(v) => v,
        }
    }

    /// Whether the CQE completes a receive WQE (a responder completion, or a failed receive).
    pub const fn is_receive(self) -> bool {
        matches!(
            self,
            CqeOpcode::RespWrImm
                | CqeOpcode::RespSend
                | CqeOpcode::RespSendImm
                | CqeOpcode::RespSendInv
                | CqeOpcode::RespErr
        )
    }
}

/// Bytes of the 64-byte CQE image (`struct mlx5_cqe64`).
pub const CQE64_SIZE: usize = c::mlx5_cqe64::SIZE;

/// `op_own` of a CQE nobody wrote: invalid opcode, owner 1.
pub const CQE_INIT_OP_OWN: u8 = (consts::MLX5_CQE_INVALID << 4) | consts::MLX5_CQE_OWNER_MASK;

/// A CQE copied out of the ring (`struct mlx5_cqe64`; an error CQE reads the same bytes as `struct mlx5_err_cqe`).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Cqe(pub [u8; CQE64_SIZE]);

impl core::fmt::Debug for Cqe {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("Cqe")
            .field("opcode", &self.opcode())
            .field("qpn", &self.qpn())
            .field("wqe_counter", &self.wqe_counter())
            .field("byte_cnt", &self.byte_cnt())
            .finish_non_exhaustive()
    }
}

pub(super) mod field {
    pub use crate::prm::c::mlx5_cqe64::*;
    pub use crate::prm::c::mlx5_err_cqe::{SYNDROME as ERR_SYNDROME, S_WQE_OPCODE_QPN, VENDOR_ERR_SYND};
}

/// Reads the fields of a 64-byte CQE, from a copy ([`Cqe`]) or in place in the ring ([`CqeRef`]): the decoder is
/// written once over this.
pub(crate) trait CqeRead {
    /// The `op_own` byte.
    fn op_own(&self) -> u8;
    /// The byte at `off` (below 64).
    fn byte(&self, off: usize) -> u8;
    /// A big-endian member of at most 4 bytes (a PRM field of `mlx5_cqe64` / `mlx5_err_cqe`).
    fn be(&self, m: crate::prm::Bytes) -> u32;
    /// The four bytes of `m` unchanged, as a value whose in-memory bytes are theirs (`__be32`).
    fn raw32(&self, m: crate::prm::Bytes) -> u32;
    /// Two adjacent big-endian 32-bit members `hi` then `lo` as one 64-bit value.
    #[inline]
    fn be64(&self, hi: crate::prm::Bytes, lo: crate::prm::Bytes) -> u64 {
        u64::from(self.be(hi)) << 32 | u64::from(self.be(lo))
    }
}

impl CqeRead for Cqe {
    #[inline]
    fn op_own(&self) -> u8 {
        self.0[field::OP_OWN.off]
    }
    #[inline]
    fn byte(&self, off: usize) -> u8 {
        self.0[off]
    }
    #[inline]
    fn be(&self, m: crate::prm::Bytes) -> u32 {
        m.get_be(&self.0, 0)
    }
    #[inline]
    fn raw32(&self, m: crate::prm::Bytes) -> u32 {
        u32::from_ne_bytes([self.0[m.off], self.0[m.off + 1], self.0[m.off + 2], self.0[m.off + 3]])
    }
}

/// A software-owned CQE read where it lies in the ring, after the ownership check and its read barrier: each
/// field is one volatile load of its own width (so a poll copies nothing), and `op_own` is the byte the ownership
/// check read. Made only by the CQ's poll, which keeps the entry software's while the view lives.
pub(crate) struct CqeRef {
    /// The entry's 64 bytes, inside a live fragment of the ring, 8-byte aligned.
    p: *const u8,
    op_own: u8,
}

impl CqeRef {
    /// A view of the 64-byte entry at `p`, whose `op_own` byte read `op_own`.
    ///
    /// # Safety
    /// `p` points at 64 readable bytes, 8-byte aligned, that stay allocated while the view lives.
    #[inline]
    pub(crate) unsafe fn new(p: *const u8, op_own: u8) -> Self {
        Self { p, op_own }
    }

    /// `len` (1, 2 or 4) bytes at `off`, as a native value of their bytes; 0 for a member outside the 64 bytes.
    #[inline(always)]
    fn load(&self, off: usize, len: usize) -> u32 {
        if off + len > CQE64_SIZE {
            return 0;
        }
        // SAFETY: in every arm, `off + len <= 64` (checked above), inside the entry `new`'s contract keeps
        // readable; the offset is a multiple of the width (checked per arm) and the entry is 8-byte aligned, so
        // each load is aligned. Volatile: ring memory the device owns again once the consumer index passes it.
        unsafe {
            match len {
                1 => u32::from(self.p.add(off).read_volatile()),
                2 if off.is_multiple_of(2) => u32::from(u16::from_be(self.p.add(off).cast::<u16>().read_volatile())),
                4 if off.is_multiple_of(4) => u32::from_be(self.p.add(off).cast::<u32>().read_volatile()),
                _ => (0..len).fold(0, |a, k| (a << 8) | u32::from(self.p.add(off + k).read_volatile())),
            }
        }
    }
}

impl CqeRead for CqeRef {
    #[inline]
    fn op_own(&self) -> u8 {
        self.op_own
    }
    #[inline]
    fn byte(&self, off: usize) -> u8 {
        self.load(off, 1) as u8
    }
    #[inline]
    fn be(&self, m: crate::prm::Bytes) -> u32 {
        self.load(m.off, m.len)
    }
    #[inline]
    fn raw32(&self, m: crate::prm::Bytes) -> u32 {
        self.load(m.off, 4).to_be()
    }
    #[inline]
    fn be64(&self, hi: crate::prm::Bytes, lo: crate::prm::Bytes) -> u64 {
        if hi.len == 4 && lo.len == 4 && lo.off == hi.off + 4 && hi.off.is_multiple_of(8) && hi.off + 8 <= CQE64_SIZE {
            // SAFETY: `hi.off + 8 <= 64` and 8-byte aligned (checked above) inside the entry `new`'s contract
            // keeps readable and 8-byte aligned. One load for the two members (volatile, as in `load`).
            return u64::from_be(unsafe { self.p.add(hi.off).cast::<u64>().read_volatile() });
        }
        u64::from(self.be(hi)) << 32 | u64::from(self.be(lo))
    }
}

/// The CQE fields the decoder reads, over either view (the [`Cqe`] methods of the same names call these).
pub(crate) trait CqeFieldsRead: CqeRead {
    /// The CQE opcode.
    #[inline]
    fn opcode(&self) -> CqeOpcode {
        CqeOpcode::from_raw(self.op_own() >> 4)
    }
    /// `sop_drop_qpn`: the WQE opcode of a requester CQE in the top byte, the QP number below.
    #[inline]
    fn sop_drop_qpn(&self) -> u32 {
        self.be(field::SOP_DROP_QPN)
    }
    /// `wqe_counter`.
    #[inline]
    fn wqe_counter(&self) -> u16 {
        self.be(field::WQE_COUNTER) as u16
    }
    /// `byte_cnt`.
    #[inline]
    fn byte_cnt(&self) -> u32 {
        self.be(field::BYTE_CNT)
    }
    /// Immediate data, invalidated rkey or pkey.
    #[inline]
    fn imm_inval_pkey(&self) -> u32 {
        self.be(field::IMMEDIATE)
    }
    /// The immediate data unchanged (`__be32`).
    #[inline]
    fn imm_data_be(&self) -> u32 {
        self.raw32(field::IMMEDIATE)
    }
    /// The device clock when the CQE was written.
    #[inline]
    fn timestamp(&self) -> u64 {
        self.be64(field::TIMESTAMP_H, field::TIMESTAMP_L)
    }
    /// `flags_rqpn`.
    #[inline]
    fn flags_rqpn(&self) -> u32 {
        self.be(field::FLAGS_RQPN)
    }
    /// `srqn` (24 bits).
    #[inline]
    fn srqn(&self) -> u32 {
        self.be(field::SRQN) & 0xff_ffff
    }
    /// `slid`.
    #[inline]
    fn slid(&self) -> u16 {
        self.be(field::SLID) as u16
    }
    /// `ml_path`.
    #[inline]
    fn ml_path(&self) -> u8 {
        self.byte(field::ML_PATH.off)
    }
    /// `hds_ip_ext`.
    #[inline]
    fn hds_ip_ext(&self) -> u8 {
        self.byte(field::HDS_IP_EXT.off)
    }
    /// `l4_l3_hdr_type`.
    #[inline]
    fn l4_l3_hdr_type(&self) -> u8 {
        self.byte(field::L4_L3_HDR_TYPE.off)
    }
    /// `vlan_info`.
    #[inline]
    fn vlan_info(&self) -> u16 {
        self.be(field::VLAN_INFO) as u16
    }
    /// `mlx5_err_cqe.syndrome`.
    #[inline]
    fn err_syndrome(&self) -> u8 {
        self.byte(field::ERR_SYNDROME.off)
    }
    /// `mlx5_err_cqe.vendor_err_synd`.
    #[inline]
    fn vendor_err(&self) -> u8 {
        self.byte(field::VENDOR_ERR_SYND.off)
    }
    /// The QP of an error CQE (`s_wqe_opcode_qpn`, low 24 bits).
    #[inline]
    fn err_qpn(&self) -> u32 {
        self.be(field::S_WQE_OPCODE_QPN) & 0xff_ffff
    }
}

impl<T: CqeRead + ?Sized> CqeFieldsRead for T {}

impl Cqe {
    #[inline]
    fn be(&self, m: crate::prm::Bytes) -> u32 {
        m.get_be(&self.0, 0)
    }

    /// `op_own`: opcode, format, solicited and owner bits.
    #[inline]
    pub fn op_own(&self) -> u8 {
        self.0[field::OP_OWN.off]
    }
    /// The CQE opcode.
    #[inline]
    pub fn opcode(&self) -> CqeOpcode {
        CqeOpcode::from_raw(self.op_own() >> 4)
    }
    /// The owner bit.
    #[inline]
    pub fn owner(&self) -> u8 {
        self.op_own() & consts::MLX5_CQE_OWNER_MASK
    }
    /// Bits 3:2 of `op_own`: 0 for a normal CQE, `MLX5_COMPRESSED` for a compressed session header.
    #[inline]
    pub fn format(&self) -> u8 {
        (self.op_own() >> 2) & 3
    }
    /// The solicited-event bit (bit 1 of `op_own`).
    #[inline]
    pub fn solicited(&self) -> bool {
        self.op_own() & 2 != 0
    }
    /// The WQE opcode of a requester CQE (`sop_drop_qpn >> 24`).
    #[inline]
    pub fn wqe_opcode(&self) -> u8 {
        (self.be(field::SOP_DROP_QPN) >> 24) as u8
    }
    /// The QP number (24 bits of `sop_drop_qpn`).
    #[inline]
    pub fn qpn(&self) -> u32 {
        self.be(field::SOP_DROP_QPN) & 0xff_ffff
    }
    /// `wqe_counter`: the index of the completed WQE.
    #[inline]
    pub fn wqe_counter(&self) -> u16 {
        self.be(field::WQE_COUNTER) as u16
    }
    /// `byte_cnt`: bytes transferred.
    #[inline]
    pub fn byte_cnt(&self) -> u32 {
        self.be(field::BYTE_CNT)
    }
    /// Immediate data, invalidated rkey or pkey, by opcode.
    #[inline]
    pub fn imm_inval_pkey(&self) -> u32 {
        self.be(field::IMMEDIATE)
    }
    /// The immediate data as `ibv_wc.imm_data` holds it (`__be32`): the field's bytes unchanged, as rdma-core's
    /// mlx5 provider copies them (`handle_responder`).
    #[inline]
    pub fn imm_data_be(&self) -> u32 {
        let m = field::IMMEDIATE;
        u32::from_ne_bytes([self.0[m.off], self.0[m.off + 1], self.0[m.off + 2], self.0[m.off + 3]])
    }
    /// `timestamp_h:timestamp_l`: the device clock when the CQE was written (raw ticks of `device_frequency_khz`,
    /// what rdma-core's `mlx5_cq_read_wc_completion_ts` returns).
    #[inline]
    pub fn timestamp(&self) -> u64 {
        u64::from(self.be(field::TIMESTAMP_H)) << 32 | u64::from(self.be(field::TIMESTAMP_L))
    }
    /// `flags_rqpn`: GRH type, SL and remote QPN.
    #[inline]
    pub fn flags_rqpn(&self) -> u32 {
        self.be(field::FLAGS_RQPN)
    }
    /// `srqn` (24 bits).
    #[inline]
    pub fn srqn(&self) -> u32 {
        self.be(field::SRQN) & 0xff_ffff
    }
    /// `slid`: the sender's LID.
    #[inline]
    pub fn slid(&self) -> u16 {
        self.be(field::SLID) as u16
    }
    /// `ml_path`: the path bits of the destination LID.
    #[inline]
    pub fn ml_path(&self) -> u8 {
        self.0[field::ML_PATH.off]
    }
    /// `hds_ip_ext`: L3/L4 checksum results.
    #[inline]
    pub fn hds_ip_ext(&self) -> u8 {
        self.0[field::HDS_IP_EXT.off]
    }
    /// `l4_l3_hdr_type`: header types; bit 0 says a VLAN tag was stripped.
    #[inline]
    pub fn l4_l3_hdr_type(&self) -> u8 {
        self.0[field::L4_L3_HDR_TYPE.off]
    }
    /// `vlan_info`: the stripped VLAN tag.
    #[inline]
    pub fn vlan_info(&self) -> u16 {
        self.be(field::VLAN_INFO) as u16
    }
    /// `mlx5_err_cqe.syndrome`.
    #[inline]
    pub fn err_syndrome(&self) -> u8 {
        self.0[field::ERR_SYNDROME.off]
    }
    /// `mlx5_err_cqe.vendor_err_synd`.
    #[inline]
    pub fn vendor_err(&self) -> u8 {
        self.0[field::VENDOR_ERR_SYND.off]
    }
    /// The QP of an error CQE (`s_wqe_opcode_qpn`, low 24 bits; same bytes as `sop_drop_qpn`).
    #[inline]
    pub fn err_qpn(&self) -> u32 {
        self.be(field::S_WQE_OPCODE_QPN) & 0xff_ffff
    }
}

/// Fields to build a CQE image from: what a device (the simulator) writes, and what tests feed the decoder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CqeFields {
    /// `MLX5_CQE_*` opcode.
    pub opcode: u8,
    /// Owner bit.
    pub owner: u8,
    /// Solicited event bit.
    pub solicited: bool,
    /// `MLX5_OPCODE_*` of the completed send WQE.
    pub wqe_opcode: u8,
    /// QP number.
    pub qpn: u32,
    /// Index of the completed WQE.
    pub wqe_counter: u16,
    /// Bytes transferred.
    pub byte_cnt: u32,
    /// Immediate data, invalidated key or P_Key.
    pub imm_inval_pkey: u32,
    /// GRH type, SL and remote QPN.
    pub flags_rqpn: u32,
    /// SRQ number.
    pub srqn: u32,
    /// Source LID.
    pub slid: u16,
    /// Destination path bits.
    pub ml_path: u8,
    /// L3/L4 checksum results.
    pub hds_ip_ext: u8,
    /// Header types; bit 0 = VLAN stripped.
    pub l4_l3_hdr_type: u8,
    /// The stripped VLAN tag.
    pub vlan_info: u16,
    /// For error CQEs (`mlx5_err_cqe`).
    pub syndrome: u8,
    /// Vendor error syndrome.
    pub vendor_err: u8,
    /// The device clock when the CQE is written (not in an error CQE, whose syndromes take those bytes).
    pub timestamp: u64,
}

impl CqeFields {
    /// The 64-byte image.
    pub fn emit(&self) -> Cqe {
        let mut b = [0u8; CQE64_SIZE];
        let put = |b: &mut [u8; CQE64_SIZE], m: crate::prm::Bytes, v: u32| m.put_be(b, 0, v);
        put(&mut b, field::SOP_DROP_QPN, u32::from(self.wqe_opcode) << 24 | (self.qpn & 0xff_ffff));
        put(&mut b, field::WQE_COUNTER, self.wqe_counter.into());
        put(&mut b, field::BYTE_CNT, self.byte_cnt);
        put(&mut b, field::IMMEDIATE, self.imm_inval_pkey);
        put(&mut b, field::FLAGS_RQPN, self.flags_rqpn);
        put(&mut b, field::SRQN, self.srqn & 0xff_ffff);
        put(&mut b, field::SLID, self.slid.into());
        put(&mut b, field::VLAN_INFO, self.vlan_info.into());
        b[field::ML_PATH.off] = self.ml_path;
        b[field::HDS_IP_EXT.off] = self.hds_ip_ext;
        b[field::L4_L3_HDR_TYPE.off] = self.l4_l3_hdr_type;
        if !matches!(CqeOpcode::from_raw(self.opcode), CqeOpcode::ReqErr | CqeOpcode::RespErr) {
            // An error CQE (`mlx5_err_cqe`) has its syndromes where the timestamp would be.
            put(&mut b, field::TIMESTAMP_H, (self.timestamp >> 32) as u32);
            put(&mut b, field::TIMESTAMP_L, self.timestamp as u32);
        }
        if matches!(CqeOpcode::from_raw(self.opcode), CqeOpcode::ReqErr | CqeOpcode::RespErr) {
            b[field::ERR_SYNDROME.off] = self.syndrome;
            b[field::VENDOR_ERR_SYND.off] = self.vendor_err;
        }
        b[field::OP_OWN.off] = (self.opcode << 4) | (u8::from(self.solicited) << 1) | (self.owner & 1);
        Cqe(b)
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    fn fields() -> CqeFields {
        CqeFields {
            opcode: consts::MLX5_CQE_RESP_SEND,
            owner: 1,
            solicited: true,
            wqe_opcode: 0x0a,
            qpn: 0x12_3456,
            wqe_counter: 0xbeef,
            byte_cnt: 0x0102_0304,
            imm_inval_pkey: 0xdead_beef,
            flags_rqpn: 0x3a00_0077,
            srqn: 0x00ab_cdef,
            slid: 0x4321,
            ml_path: 0x7f,
            hds_ip_ext: 0x06,
            l4_l3_hdr_type: 0x01,
            vlan_info: 0x2abc,
            syndrome: 0,
            vendor_err: 0,
            timestamp: 0x0123_4567_89ab_cdef,
        }
    }

    #[test]
    fn emitted_fields_read_back_through_the_view() {
        let f = fields();
        let cqe = f.emit();
        assert_eq!(cqe.opcode(), CqeOpcode::RespSend);
        assert_eq!(cqe.owner(), 1);
        assert!(cqe.solicited());
        assert_eq!(cqe.wqe_opcode(), 0x0a);
        assert_eq!(cqe.qpn(), 0x12_3456);
        assert_eq!(cqe.wqe_counter(), 0xbeef);
        assert_eq!(cqe.byte_cnt(), 0x0102_0304);
        assert_eq!(cqe.imm_inval_pkey(), 0xdead_beef);
        assert_eq!(cqe.flags_rqpn(), 0x3a00_0077);
        assert_eq!(cqe.srqn(), 0x00ab_cdef);
        assert_eq!(cqe.slid(), 0x4321);
        assert_eq!(cqe.ml_path(), 0x7f);
        assert_eq!(cqe.hds_ip_ext(), 0x06);
        assert_eq!(cqe.l4_l3_hdr_type(), 0x01);
        assert_eq!(cqe.vlan_info(), 0x2abc);
        assert_eq!(cqe.timestamp(), 0x0123_4567_89ab_cdef);
        assert_eq!(cqe.imm_data_be().to_ne_bytes(), [0xde, 0xad, 0xbe, 0xef]);
    }

    #[test]
    fn multi_byte_fields_are_big_endian_in_the_image() {
        let cqe = fields().emit();
        let at = |m: crate::prm::Bytes| &cqe.0[m.off..m.off + m.len];
        assert_eq!(at(field::BYTE_CNT), &[0x01, 0x02, 0x03, 0x04]);
        assert_eq!(at(field::WQE_COUNTER), &[0xbe, 0xef]);
        // The WQE opcode sits in the top byte of sop_drop_qpn, the QPN in the low 24 bits.
        assert_eq!(at(field::SOP_DROP_QPN), &[0x0a, 0x12, 0x34, 0x56]);
    }

    #[test]
    fn a_hand_written_image_decodes() {
        let mut b = [0u8; CQE64_SIZE];
        b[field::OP_OWN.off] = consts::MLX5_CQE_REQ << 4;
        b[field::SOP_DROP_QPN.off..field::SOP_DROP_QPN.off + 4].copy_from_slice(&[0x11, 0x00, 0x00, 0x2a]);
        b[field::WQE_COUNTER.off..field::WQE_COUNTER.off + 2].copy_from_slice(&[0x00, 0x07]);
        let cqe = Cqe(b);
        assert_eq!(cqe.opcode(), CqeOpcode::Req);
        assert_eq!(cqe.owner(), 0);
        assert!(!cqe.solicited());
        assert_eq!((cqe.wqe_opcode(), cqe.qpn(), cqe.wqe_counter()), (0x11, 0x2a, 7));
    }

    #[test]
    fn op_own_packs_opcode_solicited_and_owner() {
        let f = CqeFields { opcode: consts::MLX5_CQE_REQ_ERR, solicited: true, owner: 3, ..CqeFields::default() };
        let cqe = f.emit();
        // The owner is one bit: 3 keeps only bit 0.
        assert_eq!(cqe.op_own(), (consts::MLX5_CQE_REQ_ERR << 4) | 0b10 | 1);
        assert_eq!(cqe.owner(), 1);
    }

    #[test]
    fn fresh_ring_entries_are_invalid_and_owned_by_the_device_on_lap_zero() {
        let mut b = [0u8; CQE64_SIZE];
        b[field::OP_OWN.off] = CQE_INIT_OP_OWN;
        let cqe = Cqe(b);
        assert_eq!(cqe.opcode(), CqeOpcode::Invalid);
        assert_eq!(cqe.owner(), 1);
        assert_eq!(CQE_INIT_OP_OWN, 0xf1);
    }

    #[test]
    fn opcode_raw_round_trips_and_keeps_unknown_values() {
        for v in 0u8..16 {
            let op = CqeOpcode::from_raw(v);
            assert_eq!(op.raw(), v, "{op:?}");
        }
        assert_eq!(CqeOpcode::from_raw(7), CqeOpcode::Unknown(7));
        assert_eq!(CqeOpcode::from_raw(consts::MLX5_CQE_SIG_ERR), CqeOpcode::SigErr);
    }

    #[test]
    fn error_fields_are_written_only_for_error_opcodes() {
        let ok = CqeFields { opcode: consts::MLX5_CQE_REQ, syndrome: 0x16, vendor_err: 0x81, ..CqeFields::default() };
        assert_eq!((ok.emit().err_syndrome(), ok.emit().vendor_err()), (0, 0));
        let err = CqeFields { opcode: consts::MLX5_CQE_RESP_ERR, qpn: 0x99, ..ok };
        let cqe = err.emit();
        assert_eq!((cqe.err_syndrome(), cqe.vendor_err()), (0x16, 0x81));
        assert_eq!(cqe.err_qpn(), 0x99);
    }
}
