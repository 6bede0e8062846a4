//! Exact PRM layouts and the accessors that read and write them.
//!
//! Every offset comes from [`generated`], which `cargo xtask codegen` derives from the compiler-verified tables
//! vendored in `core/prm/`. Nothing here is typed by hand.
//!
//! Layouts follow the PRM convention (as the kernel's `MLX5_SET`/`MLX5_GET`): bit 0 is the most significant bit
//! of dword 0; a field of width `w <= 32` at bit `off` lives in dword `off / 32` at shift `32 - w - off % 32`, and
//! the dword is stored big endian. 64-bit fields are 64-bit aligned big-endian words (`MLX5_SET64`).
//!
//! Accessors work on any [`MsgBuf`]: a plain byte slice (golden tests, EQE/CQE copies) or a command message
//! scattered over the command entry and its mailbox chain (the command queue), so commands are encoded in place.

/// The layouts, enums and constants generated from the vendored PRM facts.
#[rustfmt::skip]
pub mod generated;

pub use generated::{c, consts, ifc, CmdStatus, DeliveryStatus, EventType, HealthSyndrome, Opcode};

/// An `ifc` layout as a type (`ifc::<name>::Bits`, one per `mlx5_ifc_<name>_bits`), so a command names its input
/// and output layouts and gets their sizes (`MLX5_ST_SZ_BYTES`) from them.
pub trait Layout {
    /// The layout's size in bytes.
    const SIZE_BYTES: usize;
}

/// Formats a decoded code the way the kernel prints it: `NAME(0xN)`, or `UNKNOWN(0xN)` when the headers do not
/// name the value. Build it from any generated enum: `Named(status.name(), status.raw().into())`.
#[derive(Debug, Clone, Copy)]
pub struct Named(pub Option<&'static str>, pub u32);

impl core::fmt::Display for Named {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "{}(0x{:x})", self.0.unwrap_or("UNKNOWN"), self.1)
    }
}

/// A scalar field: `off` bits from the start of its struct, `width` bits wide (1..=32, or 64 when 64-bit aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Field {
    /// Bit offset from the start of the struct (PRM numbering, bit 0 = MSB of dword 0).
    pub off: u32,
    /// Width in bits.
    pub width: u32,
}

impl Field {
    /// A field of `width` bits at bit `off`.
    pub const fn new(off: u32, width: u32) -> Self {
        Self { off, width }
    }

    /// The same field inside a nested struct that starts at byte `base` (as `MLX5_ADDR_OF` + `MLX5_SET`).
    pub const fn at(self, base: Sub) -> Self {
        Self { off: self.off + base.off as u32 * 8, width: self.width }
    }

    /// Byte offset of the dword (or 64-bit word) holding the field.
    const fn byte(self) -> usize {
        if self.width == 64 {
            (self.off / 8) as usize
        } else {
            (self.off / 32 * 4) as usize
        }
    }

    const fn shift(self) -> u32 {
        32 - self.width - self.off % 32
    }

    const fn mask(self) -> u32 {
        if self.width >= 32 {
            u32::MAX
        } else {
            (1u32 << self.width) - 1
        }
    }
}

/// A nested struct or union: `len` bytes at byte `off`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sub {
    /// Byte offset.
    pub off: usize,
    /// Length in bytes.
    pub len: usize,
}

impl Sub {
    /// A nested struct of `len` bytes at byte `off`.
    pub const fn new(off: usize, len: usize) -> Self {
        Self { off, len }
    }

    /// The same nested struct inside an enclosing one that starts at byte `base`.
    pub const fn at(self, base: Sub) -> Self {
        Self { off: self.off + base.off, len: self.len }
    }
}

/// A byte range: a C struct member, or an `mlx5_ifc` field too wide for a scalar (GIDs, MACs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bytes {
    /// Byte offset.
    pub off: usize,
    /// Length in bytes.
    pub len: usize,
}

impl Bytes {
    /// A member of `len` bytes at byte `off`.
    pub const fn new(off: usize, len: usize) -> Self {
        Self { off, len }
    }

    /// The byte after the member.
    pub const fn end(self) -> usize {
        self.off + self.len
    }

    /// Reads this big-endian member (at most 4 bytes) of a structure image that starts at `base` in `buf`.
    #[inline]
    pub fn get_be(self, buf: &[u8], base: usize) -> u32 {
        let src = &buf[base + self.off..base + self.off + self.len];
        if src.len() <= 4 {
            // One load and a byte swap once the length is a constant (the datapath reads CQE fields this way).
            let mut b = [0u8; 4];
            b[4 - src.len()..].copy_from_slice(src);
            u32::from_be_bytes(b)
        } else {
            src.iter().fold(0u32, |a, &b| (a << 8) | u32::from(b))
        }
    }

    /// Writes this big-endian member of a structure image that starts at `base` in `buf` (a member wider than 4
    /// bytes gets the value in its low bytes and zeros above).
    #[inline]
    pub fn put_be(self, buf: &mut [u8], base: usize, v: u32) {
        let dst = &mut buf[base + self.off..base + self.off + self.len];
        if dst.len() <= 4 {
            // A byte swap and one store once the length is a constant (the datapath builds WQEs this way).
            let n = dst.len();
            dst.copy_from_slice(&v.to_be_bytes()[4 - n..]);
        } else {
            // A wider member holds the value in its last four bytes, big endian, with zeros above it.
            let (high, low) = dst.split_at_mut(dst.len() - 4);
            high.fill(0);
            low.copy_from_slice(&v.to_be_bytes());
        }
    }
}

/// An array of `count` elements of `elem_bits` each (`count == 0` for flexible arrays such as `pas[]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Array {
    /// Bit offset of element 0.
    pub off: u32,
    /// Elements (0 for a flexible array).
    pub count: u32,
    /// Bits per element.
    pub elem_bits: u32,
}

impl Array {
    /// An array of `count` elements of `elem_bits` at bit `off`.
    pub const fn new(off: u32, count: u32, elem_bits: u32) -> Self {
        Self { off, count, elem_bits }
    }

    /// Element `i` as a scalar field (for arrays of scalars such as `pas[]` or `event_bitmask[]`).
    pub const fn elem(self, i: u32) -> Field {
        Field { off: self.off + i * self.elem_bits, width: self.elem_bits }
    }

    /// Byte offset of the first element.
    pub const fn byte_off(self) -> usize {
        (self.off / 8) as usize
    }

    /// The same array inside a nested struct that starts at byte `base` (the `pas[]` of a `wq` in an `rmpc`).
    pub const fn at(self, base: Sub) -> Self {
        Self { off: self.off + base.off as u32 * 8, count: self.count, elem_bits: self.elem_bits }
    }
}

/// A command message or a fixed-size device structure that fields can be read from and written to.
///
/// Implementers guarantee that `chunk`/`chunk_mut` return the bytes at `off..off + n` for some `n >= 1`, the
/// longest run that is contiguous in memory. Callers keep every access within [`MsgBuf::len`]; an access past it
/// is a programming error in the encoder (the buffer is always sized from the layout) and panics like a slice index.
pub trait MsgBuf {
    /// Total length of the message in bytes.
    fn len(&self) -> usize;
    /// The contiguous bytes starting at `off` (at least one byte).
    fn chunk(&self, off: usize) -> &[u8];
    /// The contiguous bytes starting at `off` (at least one byte), writable.
    fn chunk_mut(&mut self, off: usize) -> &mut [u8];

    /// Whether the message has no bytes.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copies `out.len()` bytes starting at `off` into `out`.
    fn read_bytes(&self, mut off: usize, out: &mut [u8]) {
        let mut done = 0;
        while done < out.len() {
            let c = self.chunk(off);
            let n = c.len().min(out.len() - done);
            out[done..done + n].copy_from_slice(&c[..n]);
            done += n;
            off += n;
        }
    }

    /// Copies `data` into the message starting at `off`.
    fn write_bytes(&mut self, mut off: usize, data: &[u8]) {
        let mut done = 0;
        while done < data.len() {
            let c = self.chunk_mut(off);
            let n = c.len().min(data.len() - done);
            c[..n].copy_from_slice(&data[done..done + n]);
            done += n;
            off += n;
        }
    }

    /// The big-endian dword at byte `off`.
    fn read_u32(&self, off: usize) -> u32 {
        let mut b = [0u8; 4];
        self.read_bytes(off, &mut b);
        u32::from_be_bytes(b)
    }

    /// Writes a big-endian dword at byte `off`.
    fn write_u32(&mut self, off: usize, v: u32) {
        self.write_bytes(off, &v.to_be_bytes());
    }

    /// The big-endian 64-bit word at byte `off`.
    fn read_u64(&self, off: usize) -> u64 {
        let mut b = [0u8; 8];
        self.read_bytes(off, &mut b);
        u64::from_be_bytes(b)
    }

    /// Writes a big-endian 64-bit word at byte `off`.
    fn write_u64(&mut self, off: usize, v: u64) {
        self.write_bytes(off, &v.to_be_bytes());
    }

    /// `MLX5_GET`: a field of up to 32 bits.
    fn get(&self, f: Field) -> u32 {
        debug_assert!(f.width <= 32, "use get64 for 64-bit fields");
        (self.read_u32(f.byte()) >> f.shift()) & f.mask()
    }

    /// `MLX5_SET`: a field of up to 32 bits; bits of `v` above the width are dropped, neighbours are kept.
    fn set(&mut self, f: Field, v: u32) {
        debug_assert!(f.width <= 32, "use set64 for 64-bit fields");
        let off = f.byte();
        let mask = f.mask() << f.shift();
        let old = self.read_u32(off);
        self.write_u32(off, (old & !mask) | ((v << f.shift()) & mask));
    }

    /// `MLX5_GET64`.
    fn get64(&self, f: Field) -> u64 {
        debug_assert!(f.width == 64);
        self.read_u64(f.byte())
    }

    /// `MLX5_SET64`.
    fn set64(&mut self, f: Field, v: u64) {
        debug_assert!(f.width == 64);
        self.write_u64(f.byte(), v);
    }
}

impl MsgBuf for [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn chunk(&self, off: usize) -> &[u8] {
        &self[off..]
    }
    fn chunk_mut(&mut self, off: usize) -> &mut [u8] {
        &mut self[off..]
    }
    // One contiguous copy (a load and a byte swap for a field) instead of the chunk loop; past the end it panics
    // like the slice index it is.
    #[inline]
    fn read_bytes(&self, off: usize, out: &mut [u8]) {
        out.copy_from_slice(&self[off..off + out.len()]);
    }
    #[inline]
    fn write_bytes(&mut self, off: usize, data: &[u8]) {
        self[off..off + data.len()].copy_from_slice(data);
    }
}

impl<const N: usize> MsgBuf for [u8; N] {
    fn len(&self) -> usize {
        N
    }
    fn chunk(&self, off: usize) -> &[u8] {
        &self[off..]
    }
    fn chunk_mut(&mut self, off: usize) -> &mut [u8] {
        &mut self[off..]
    }
    #[inline]
    fn read_bytes(&self, off: usize, out: &mut [u8]) {
        out.copy_from_slice(&self[off..off + out.len()]);
    }
    #[inline]
    fn write_bytes(&mut self, off: usize, data: &[u8]) {
        self[off..off + data.len()].copy_from_slice(data);
    }
}

/// A view of a nested struct inside a message, so nested layouts are written with their own field tables
/// (`MLX5_ADDR_OF(create_cq_in, in, cq_context)` then `MLX5_SET(cqc, cqc, ...)`).
#[derive(Debug)]
pub struct SubBuf<'a, B: MsgBuf + ?Sized> {
    buf: &'a mut B,
    base: usize,
    len: usize,
}

impl<'a, B: MsgBuf + ?Sized> SubBuf<'a, B> {
    /// The part of `buf` that `sub` covers.
    pub fn new(buf: &'a mut B, sub: Sub) -> Self {
        assert!(sub.off + sub.len <= buf.len(), "nested struct outside its message");
        Self { buf, base: sub.off, len: sub.len }
    }
}

impl<B: MsgBuf + ?Sized> MsgBuf for SubBuf<'_, B> {
    fn len(&self) -> usize {
        self.len
    }
    fn chunk(&self, off: usize) -> &[u8] {
        assert!(off < self.len, "read past the nested struct");
        let c = self.buf.chunk(self.base + off);
        &c[..c.len().min(self.len - off)]
    }
    fn chunk_mut(&mut self, off: usize) -> &mut [u8] {
        assert!(off < self.len, "write past the nested struct");
        let len = self.len;
        let c = self.buf.chunk_mut(self.base + off);
        let n = c.len().min(len - off);
        &mut c[..n]
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn set_get_match_mlx5_set_convention() {
        // cqc.log_cq_size: 5 bits at bit 227 of create_cq_in -> dword 7, shift 32 - 5 - 3 = 24.
        let f = ifc::cqc::LOG_CQ_SIZE.at(ifc::create_cq_in::CQ_CONTEXT);
        assert_eq!((f.off, f.width), (227, 5));
        let mut b = [0u8; ifc::create_cq_in::SIZE_BYTES];
        b.set(f, 0xa);
        assert_eq!(&b[28..32], &[0x0a, 0, 0, 0]);
        // A neighbour in the same dword (uar_page, 24 bits) is kept.
        b.set(ifc::cqc::UAR_PAGE.at(ifc::create_cq_in::CQ_CONTEXT), 1);
        assert_eq!(&b[28..32], &[0x0a, 0, 0, 1]);
        assert_eq!(b.get(f), 0xa);
        // Values wider than the field are truncated to it, as MLX5_SET masks them.
        b.set(f, 0xff);
        assert_eq!(b.get(f), 0x1f);
        assert_eq!(&b[28..32], &[0x1f, 0, 0, 1]);
    }

    #[test]
    fn set64_is_big_endian() {
        let mut b = [0u8; ifc::create_cq_in::SIZE_BYTES];
        b.set64(ifc::cqc::DBR_ADDR.at(ifc::create_cq_in::CQ_CONTEXT), 0x1234567000);
        assert_eq!(&b[72..80], &[0, 0, 0, 0x12, 0x34, 0x56, 0x70, 0]);
    }

    #[test]
    fn unknown_values_are_kept() {
        assert_eq!(Opcode::from_raw(0x400), Opcode::CreateCq);
        assert_eq!(Opcode::CreateCq.name(), Some("CREATE_CQ"));
        assert_eq!(Opcode::from_raw(0x7777), Opcode::Unknown(0x7777));
        assert_eq!(Opcode::Unknown(0x7777).raw(), 0x7777);
        assert_eq!(CmdStatus::from_raw(3), CmdStatus::BadParam);
        assert_eq!(CmdStatus::BadParam.name(), Some("BAD_PARAM"));
        assert_eq!(CmdStatus::from_raw(0xee), CmdStatus::Unknown(0xee));
        assert_eq!(DeliveryStatus::from_raw(2).name(), Some("TOK"));
    }

    #[test]
    fn sub_buf_confines_accesses() {
        let mut b = [0u8; ifc::create_cq_in::SIZE_BYTES];
        {
            let mut cqc = SubBuf::new(&mut b[..], ifc::create_cq_in::CQ_CONTEXT);
            cqc.set(ifc::cqc::LOG_CQ_SIZE, 0xa);
            assert_eq!(cqc.len(), ifc::cqc::SIZE_BYTES);
        }
        assert_eq!(b[28], 0x0a);
    }
    #[test]
    fn fields_at_dword_edges_do_not_bleed_into_neighbours() {
        let mut b = [0u8; 12];
        // The last bit of dword 0 and the first bit of dword 1 (PRM numbering: bit 0 is the MSB).
        let last = Field::new(31, 1);
        let first_next = Field::new(32, 1);
        b.set(last, 1);
        assert_eq!(&b[..8], &[0, 0, 0, 1, 0, 0, 0, 0]);
        b.set(first_next, 1);
        assert_eq!(&b[..8], &[0, 0, 0, 1, 0x80, 0, 0, 0]);
        // A whole dword, then clearing the single bit again leaves the neighbours alone.
        b.set(Field::new(64, 32), 0xa1b2_c3d4);
        b.set(last, 0);
        assert_eq!(b, [0, 0, 0, 0, 0x80, 0, 0, 0, 0xa1, 0xb2, 0xc3, 0xd4]);
        assert_eq!((b.get(last), b.get(first_next), b.get(Field::new(64, 32))), (0, 1, 0xa1b2_c3d4));
        // A field ending exactly at the dword edge.
        b.set(Field::new(88, 8), 0x5a);
        assert_eq!(b[11], 0x5a);
        assert_eq!(b.get(Field::new(64, 24)), 0xa1_b2c3);
    }

    #[test]
    fn array_elements_step_by_their_width() {
        let pas = ifc::create_cq_in::PAS;
        assert_eq!(pas.byte_off(), pas.elem(0).off as usize / 8);
        assert_eq!(pas.elem(3).off - pas.elem(0).off, 3 * 64);
        let mut b = [0u8; ifc::create_cq_in::SIZE_BYTES + 16];
        b.set64(pas.elem(1), 0x0102_0304_0506_0708);
        let at = pas.byte_off() + 8;
        assert_eq!(&b[at..at + 8], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(b.get64(pas.elem(1)), 0x0102_0304_0506_0708);
    }

    #[test]
    fn bytes_members_are_big_endian_at_their_base() {
        let m = Bytes::new(2, 2);
        let mut b = [0u8; 8];
        m.put_be(&mut b, 4, 0xbeef);
        assert_eq!(b, [0, 0, 0, 0, 0, 0, 0xbe, 0xef]);
        assert_eq!(m.get_be(&b, 4), 0xbeef);
        assert_eq!(m.end(), 4);
        let w = Bytes::new(0, 4);
        w.put_be(&mut b, 0, 0x1122_3344);
        assert_eq!(&b[..4], &[0x11, 0x22, 0x33, 0x44]);
    }

    #[test]
    fn layout_types_carry_the_layout_size() {
        assert_eq!(<ifc::create_cq_in::Bits as Layout>::SIZE_BYTES, ifc::create_cq_in::SIZE_BYTES);
        assert_eq!(<ifc::mbox_out::Bits as Layout>::SIZE_BYTES, 16);
    }

    #[test]
    fn a_wide_member_gets_the_value_in_its_low_bytes() {
        let mut buf = [0xffu8; 12];
        Bytes { off: 2, len: 8 }.put_be(&mut buf, 1, 0x0102_0304);
        assert_eq!(buf, [0xff, 0xff, 0xff, 0, 0, 0, 0, 1, 2, 3, 4, 0xff]);
        let mut two = [0u8; 2];
        Bytes { off: 0, len: 2 }.put_be(&mut two, 0, 0xabcd_1234);
        assert_eq!(two, [0x12, 0x34], "a narrow member keeps the low bytes");
    }
}
