//! Shared shape for the many commands that carry at most one value in and one handle out
//! (ENABLE_HCA, SET_ISSI, ALLOC_PD, DEALLOC_UAR, DESTROY_CQ, ...).

use crate::cmdq::{write_header, CmdError, Command};
use crate::prm::{consts, ifc, Field, MsgBuf, Opcode};

/// Size of a firmware page (`MLX5_ADAPTER_PAGE_SIZE`): the unit of every page-address list (`pas[]`) and of the
/// pages MANAGE_PAGES gives.
pub const FW_PAGE_SIZE: usize = consts::MLX5_ADAPTER_PAGE_SIZE as usize;

/// A command made of its header, an optional input field, and an optional output field.
#[derive(Debug, Clone, Copy)]
pub struct Simple {
    /// The command's opcode.
    pub opcode: Opcode,
    /// The header's `op_mod`.
    pub op_mod: u16,
    /// Input length in bytes.
    pub inlen: usize,
    /// Output length in bytes.
    pub outlen: usize,
    /// The input field and the value written into it, if any.
    pub arg: Option<(Field, u32)>,
    /// The output field returned, if any.
    pub result: Option<Field>,
}

impl Simple {
    /// A command of `inlen` / `outlen` bytes with only its header.
    pub const fn new(opcode: Opcode, inlen: usize, outlen: usize) -> Self {
        Self { opcode, op_mod: 0, inlen, outlen, arg: None, result: None }
    }

    /// Sets `op_mod`.
    pub const fn op_mod(mut self, op_mod: u16) -> Self {
        self.op_mod = op_mod;
        self
    }

    /// Writes `value` into input field `field`.
    pub const fn arg(mut self, field: Field, value: u32) -> Self {
        self.arg = Some((field, value));
        self
    }

    /// Returns output field `field` as the result.
    pub const fn result(mut self, field: Field) -> Self {
        self.result = Some(field);
        self
    }
}

impl Command for Simple {
    type In = ifc::mbox_in::Bits;
    type Out = ifc::mbox_out::Bits;
    /// The output field's value (a handle), or 0 when the command returns none.
    type Output = u32;

    fn opcode(&self) -> Opcode {
        self.opcode
    }
    fn inlen(&self) -> usize {
        self.inlen
    }
    fn outlen(&self) -> usize {
        self.outlen
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, self.opcode, self.op_mod);
        if let Some((f, v)) = self.arg {
            msg.set(f, v);
        }
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<u32, CmdError> {
        Ok(self.result.map_or(0, |f| out.get(f)))
    }
}

/// A page-address list (`pas[]`) as a command carries it: one bus address per page, in order.
#[derive(Clone, Copy)]
pub enum Pas<'a> {
    /// Explicit addresses.
    List(&'a [u64]),
    /// `count` consecutive 4 KiB pages starting at `base` (a physically contiguous buffer).
    Contiguous {
        /// First page.
        base: u64,
        /// Pages.
        count: usize,
    },
    /// Addresses produced on demand (pages reserved for firmware across several chunks).
    Source(&'a dyn PageSource),
}

/// Something that lists page addresses without storing them in one slice.
pub trait PageSource {
    /// Pages in the list.
    fn count(&self) -> usize;
    /// Calls `f(i, addr)` for every page, `i` counting from 0.
    fn each(&self, f: &mut dyn FnMut(usize, u64));
}

impl<'a> From<&'a [u64]> for Pas<'a> {
    fn from(list: &'a [u64]) -> Self {
        Pas::List(list)
    }
}

impl<'a, const N: usize> From<&'a [u64; N]> for Pas<'a> {
    fn from(list: &'a [u64; N]) -> Self {
        Pas::List(list)
    }
}

impl core::fmt::Debug for Pas<'_> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            Pas::List(l) => f.debug_tuple("List").field(l).finish(),
            Pas::Contiguous { base, count } => {
                f.debug_struct("Contiguous").field("base", base).field("count", count).finish()
            }
            Pas::Source(s) => f.debug_struct("Source").field("count", &s.count()).finish_non_exhaustive(),
        }
    }
}

impl Pas<'_> {
    /// Number of pages.
    pub fn len(&self) -> usize {
        match self {
            Pas::List(l) => l.len(),
            Pas::Contiguous { count, .. } => *count,
            Pas::Source(s) => s.count(),
        }
    }

    /// Whether the list has no pages.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Calls `f(i, addr)` for every page in order.
    pub fn each(&self, f: &mut dyn FnMut(usize, u64)) {
        match self {
            Pas::List(l) => l.iter().enumerate().for_each(|(i, &a)| f(i, a)),
            Pas::Contiguous { base, count } => (0..*count).for_each(|i| f(i, base + (i * FW_PAGE_SIZE) as u64)),
            Pas::Source(s) => s.each(f),
        }
    }
}

/// Writes a page-address list (`pas[]`, be64 each, `MLX5_ARRAY_SET64`) starting at element 0 of `arr`.
pub fn write_pas<B: MsgBuf + ?Sized>(msg: &mut B, arr: crate::prm::Array, pas: Pas<'_>) {
    pas.each(&mut |i, addr| msg.set64(arr.elem(i as u32), addr));
}

/// Bytes of a command input that ends in a flexible `pas[]` of `n` be64 entries.
pub const fn len_with_pas(arr: crate::prm::Array, n: usize) -> usize {
    arr.byte_off() + n * (arr.elem_bits as usize / 8)
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    fn len_with_pas_adds_eight_bytes_per_page_after_the_fixed_part() {
        let arr = ifc::create_cq_in::PAS;
        assert_eq!(len_with_pas(arr, 0), arr.byte_off());
        assert_eq!(len_with_pas(arr, 3), arr.byte_off() + 24);
        // The fixed part is the layout itself: the flexible array starts where it ends.
        assert_eq!(len_with_pas(arr, 0), ifc::create_cq_in::SIZE_BYTES);
    }

    #[test]
    fn contiguous_pas_steps_by_the_firmware_page() {
        let pas = Pas::Contiguous { base: 0x10_0000, count: 3 };
        let mut got = [0u64; 3];
        pas.each(&mut |i, a| got[i] = a);
        let p = FW_PAGE_SIZE as u64;
        assert_eq!(got, [0x10_0000, 0x10_0000 + p, 0x10_0000 + 2 * p]);
        assert_eq!((pas.len(), pas.is_empty()), (3, false));
        assert!(Pas::Contiguous { base: 0, count: 0 }.is_empty());
    }

    #[test]
    fn write_pas_stores_each_address_big_endian_in_order() {
        let arr = ifc::manage_pages_in::PAS;
        let list = [0x1111_2222_3333_4000u64, 0x5000];
        let mut b = [0u8; 64];
        write_pas(&mut b[..], arr, Pas::from(&list));
        let o = arr.byte_off();
        assert_eq!(&b[o..o + 8], &0x1111_2222_3333_4000u64.to_be_bytes());
        assert_eq!(&b[o + 8..o + 16], &0x5000u64.to_be_bytes());
        assert!(b[o + 16..].iter().all(|&x| x == 0));
    }

    #[test]
    fn simple_encodes_header_and_argument_and_decodes_its_result() {
        let mut cmd = Simple::new(Opcode::DeallocPd, 16, 16)
            .op_mod(3)
            .arg(ifc::dealloc_pd_in::PD, 0x12_3456)
            .result(ifc::alloc_pd_out::PD);
        let mut b = [0u8; 16];
        cmd.encode(&mut b[..]);
        assert_eq!(b.get(ifc::mbox_in::OPCODE), u32::from(Opcode::DeallocPd.raw()));
        assert_eq!(b.get(ifc::mbox_in::OP_MOD), 3);
        assert_eq!(b.get(ifc::dealloc_pd_in::PD), 0x12_3456);
        let mut out = [0u8; 16];
        out.set(ifc::alloc_pd_out::PD, 0x77);
        assert_eq!(cmd.decode(&out[..]), Ok(0x77));
        assert_eq!((cmd.inlen(), cmd.outlen()), (16, 16));
        let mut none = Simple::new(Opcode::EnableHca, 16, 16);
        assert_eq!(none.decode(&out[..]), Ok(0));
    }

    #[test]
    fn commands_without_overrides_take_their_layout_sizes() {
        let q = crate::vport::QueryNicVportContext;
        assert_eq!(q.inlen(), ifc::query_nic_vport_context_in::SIZE_BYTES);
        assert_eq!(q.outlen(), ifc::query_nic_vport_context_out::SIZE_BYTES);
    }
}
