//! Firmware pages (Linux `pagealloc.c`): QUERY_PAGES and MANAGE_PAGES give / take.
//!
//! Firmware asks for host memory at boot, at init and during operation; the driver gives 4 KiB pages by bus
//! address and takes them back at teardown or when firmware returns them (a negative request).

use crate::cmd::{len_with_pas, write_pas, PageSource, Pas};
use crate::cmdq::{write_header, CmdError, Command};
use crate::hal::{Dma, DmaError, DmaRegion};
use crate::prm::{consts, ifc, MsgBuf, Opcode};
use crate::table::Table;

pub use crate::cmd::FW_PAGE_SIZE;

/// Which pages QUERY_PAGES asks about (`MLX5_QUERY_PAGES_IN_OP_MOD_*`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum PageStage {
    /// `MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES`: pages firmware needs to boot.
    Boot,
    /// `MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES`: pages INIT_HCA needs.
    Init,
    /// `MLX5_QUERY_PAGES_IN_OP_MOD_REGULAR_PAGES`: pages for regular operation.
    Regular,
}

impl PageStage {
    const fn op_mod(self) -> u16 {
        match self {
            PageStage::Boot => consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES,
            PageStage::Init => consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES,
            PageStage::Regular => consts::MLX5_QUERY_PAGES_IN_OP_MOD_REGULAR_PAGES,
        }
    }
}

/// Firmware's answer to QUERY_PAGES.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageRequest {
    /// The function asked about (0 for the function itself).
    pub function_id: u16,
    /// Pages firmware wants (positive) or wants to return (negative).
    pub num_pages: i32,
}

/// `QUERY_PAGES` (`mlx5_cmd_query_pages`).
#[derive(Debug, Clone, Copy)]
pub struct QueryPages {
    /// The stage asked about.
    pub stage: PageStage,
}

impl Command for QueryPages {
    type In = ifc::query_pages_in::Bits;
    type Out = ifc::query_pages_out::Bits;
    type Output = PageRequest;
    fn opcode(&self) -> Opcode {
        Opcode::QueryPages
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
    /// The function the pages are for.
    pub function_id: u16,
    /// The pages given.
    pub pages: Pas<'a>,
}

impl Command for ManagePagesGive<'_> {
    type In = ifc::manage_pages_in::Bits;
    type Out = ifc::manage_pages_out::Bits;
    type Output = ();
    fn opcode(&self) -> Opcode {
        Opcode::ManagePages
    }
    fn inlen(&self) -> usize {
        len_with_pas(ifc::manage_pages_in::PAS, self.pages.len())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::ManagePages, consts::MLX5_PAGES_GIVE);
        msg.set(ifc::manage_pages_in::FUNCTION_ID, self.function_id.into());
        msg.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, self.pages.len() as u32);
        write_pas(msg, ifc::manage_pages_in::PAS, self.pages);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, _out: &B) -> Result<(), CmdError> {
        Ok(())
    }
}

/// Where MANAGE_PAGES take puts the addresses firmware hands back.
pub trait PageSink {
    /// How many addresses it can take (the `input_num_entries` asked for).
    fn capacity(&self) -> usize;
    /// Takes the `i`-th returned address (already checked to be page aligned).
    fn put(&mut self, i: usize, addr: u64);
}

impl PageSink for [u64] {
    fn capacity(&self) -> usize {
        self.len()
    }
    fn put(&mut self, i: usize, addr: u64) {
        self[i] = addr;
    }
}

/// `MANAGE_PAGES` take (`MLX5_PAGES_TAKE`, `reclaim_pages_cmd`): asks for up to `pages.capacity()` pages back;
/// the addresses firmware returns go to `pages` and their count is the output.
pub struct ManagePagesTake<'a, S: PageSink + ?Sized = [u64]> {
    /// The function the pages come from.
    pub function_id: u16,
    /// Where the returned addresses go.
    pub pages: &'a mut S,
}

impl<S: PageSink + ?Sized> core::fmt::Debug for ManagePagesTake<'_, S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("ManagePagesTake")
            .field("function_id", &self.function_id)
            .field("capacity", &self.pages.capacity())
            .finish()
    }
}

impl<S: PageSink + ?Sized> Command for ManagePagesTake<'_, S> {
    type In = ifc::manage_pages_in::Bits;
    type Out = ifc::manage_pages_out::Bits;
    type Output = usize;
    fn opcode(&self) -> Opcode {
        Opcode::ManagePages
    }
    fn outlen(&self) -> usize {
        len_with_pas(ifc::manage_pages_out::PAS, self.pages.capacity())
    }
    fn encode<B: MsgBuf + ?Sized>(&self, msg: &mut B) {
        write_header(msg, Opcode::ManagePages, consts::MLX5_PAGES_TAKE);
        msg.set(ifc::manage_pages_in::FUNCTION_ID, self.function_id.into());
        msg.set(ifc::manage_pages_in::INPUT_NUM_ENTRIES, self.pages.capacity() as u32);
    }
    fn decode<B: MsgBuf + ?Sized>(&mut self, out: &B) -> Result<usize, CmdError> {
        let n = out.get(ifc::manage_pages_out::OUTPUT_NUM_ENTRIES) as usize;
        if n > self.pages.capacity() {
            // Firmware claims more pages than the output can hold: trust none of them.
            return Err(CmdError::OutputTooShort {
                opcode: Opcode::ManagePages,
                needed: len_with_pas(ifc::manage_pages_out::PAS, n),
                got: out.len(),
            });
        }
        // Check every address before handing any over, so a malformed answer changes nothing.
        for i in 0..n {
            let addr = out.get64(ifc::manage_pages_out::PAS.elem(i as u32));
            if !addr.is_multiple_of(FW_PAGE_SIZE as u64) {
                return Err(CmdError::Malformed { opcode: Opcode::ManagePages, what: "page address", value: addr });
            }
        }
        for i in 0..n {
            self.pages.put(i, out.get64(ifc::manage_pages_out::PAS.elem(i as u32)));
        }
        Ok(n)
    }
}

/// Pages per DMA chunk the page pool allocates: one 64-bit bitmap covers a chunk.
pub const CHUNK_PAGES: usize = 64;

/// Pages one MANAGE_PAGES give carries at most: a request for more is given in several commands, so any count
/// firmware asks for (`num_pages` is 32 bits) goes in messages of at most 128 KiB (256 mailbox blocks) rather
/// than in one chain that grows with the request.
pub const GIVE_BATCH: usize = 1 << 14;

/// Pages one MANAGE_PAGES take asks for (`optimal_reclaimed_pages`): what fits in the entry's inline output plus
/// `MLX5_BLKS_FOR_RECLAIM_PAGES` mailbox blocks.
pub const RECLAIM_BATCH: usize = (crate::prm::c::mlx5_cmd_layout::OUT.len
    + consts::MLX5_BLKS_FOR_RECLAIM_PAGES as usize * crate::prm::c::mlx5_cmd_prot_block::DATA.len
    - ifc::manage_pages_out::SIZE_BYTES)
    / (ifc::manage_pages_out::PAS.elem_bits as usize / 8);

/// Why the page pool could not do what firmware asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum PagesError {
    /// The DMA allocator refused a chunk.
    Dma(DmaError),
    /// Every chunk slot is in use: the pool was built for fewer pages than firmware wants (a fixed table), or
    /// no memory was left for the bookkeeping of another chunk.
    Exhausted {
        /// Pages the pool holds.
        capacity_pages: usize,
    },
    /// A reservation is already pending (give it or cancel it first).
    Busy,
}

impl core::fmt::Display for PagesError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            PagesError::Dma(e) => write!(f, "failed to allocate firmware pages: {e}"),
            PagesError::Exhausted { capacity_pages } => {
                write!(f, "firmware wants more than the page pool's {capacity_pages} pages")
            }
            PagesError::Busy => write!(f, "a page reservation is already pending"),
        }
    }
}

impl core::error::Error for PagesError {}

/// `CHUNK_PAGES` pages lent to firmware, and which of them it holds (opaque; a [`Table`] holds them).
#[derive(Debug)]
pub struct FwChunk {
    region: DmaRegion,
    /// Pages firmware owns (given and not returned).
    given: u64,
    /// Pages reserved for a MANAGE_PAGES give that has not completed yet.
    pending: u64,
}

impl FwChunk {
    fn addr(&self, bit: u32) -> u64 {
        self.region.iova() + u64::from(bit) * FW_PAGE_SIZE as u64
    }
}

/// A page pool of at most `N` chunks.
pub type FwPages<const N: usize> = FwPagesOf<heapless::Vec<FwChunk, N>>;

/// The host memory lent to firmware (Linux `pagealloc.c`), without a heap of its own: 4 KiB pages carved from
/// `CHUNK_PAGES`-page DMA chunks, one bitmap per chunk, the chunks in a [`Table`] the user chooses (a fixed one
/// caps the pages at its capacity; a growable one takes any count firmware asks for).
///
/// A chunk goes back to the allocator only when none of its pages is owned by firmware or reserved for it, so
/// memory the device may write is never freed. The chunks are kept in address order, so an address firmware
/// returns is found by binary search; an address the pool never gave is reported, never trusted.
pub struct FwPagesOf<S: Table<FwChunk>> {
    chunks: S,
    given: usize,
    pending: usize,
}

impl<S: Table<FwChunk>> Default for FwPagesOf<S> {
    fn default() -> Self {
        Self::new()
    }
}

impl<S: Table<FwChunk>> core::fmt::Debug for FwPagesOf<S> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("FwPages")
            .field("given", &self.given)
            .field("pending", &self.pending)
            .field("chunks", &self.chunks.len())
            .finish()
    }
}

/// The pages of the pending reservation, in the order MANAGE_PAGES give lists them.
impl<S: Table<FwChunk>> PageSource for FwPagesOf<S> {
    fn count(&self) -> usize {
        self.pending
    }
    fn each(&self, f: &mut dyn FnMut(usize, u64)) {
        let mut i = 0;
        for c in self.chunks.as_slice() {
            let mut bits = c.pending;
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                f(i, c.addr(b));
                i += 1;
            }
        }
    }
}

impl<S: Table<FwChunk>> FwPagesOf<S> {
    /// An empty pool.
    pub fn new() -> Self {
        Self { chunks: S::default(), given: 0, pending: 0 }
    }

    /// Pages firmware owns.
    pub fn given(&self) -> usize {
        self.given
    }

    /// Pages reserved for a give in flight.
    pub fn pending(&self) -> usize {
        self.pending
    }

    /// DMA chunks currently held.
    pub fn chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Pages the pool can hold (`usize::MAX` when only memory limits it).
    pub const fn capacity_pages() -> usize {
        S::CAPACITY.saturating_mul(CHUNK_PAGES)
    }

    /// Reserves `n` free pages for a give, allocating chunks as needed (free pages of held chunks first).
    pub fn reserve<D: Dma>(&mut self, dma: &D, n: usize) -> Result<(), PagesError> {
        if self.pending != 0 {
            return Err(PagesError::Busy);
        }
        let free_now: usize = self.chunks.as_slice().iter().map(|c| (!c.given).count_ones() as usize).sum();
        if n > Self::capacity_pages().saturating_sub(self.given) {
            return Err(PagesError::Exhausted { capacity_pages: Self::capacity_pages() });
        }
        let mut missing = n.saturating_sub(free_now);
        while missing > 0 {
            if !self.chunks.reserve_one() {
                self.free_empty(dma);
                return Err(PagesError::Exhausted { capacity_pages: Self::capacity_pages() });
            }
            let region = match dma.alloc(CHUNK_PAGES * FW_PAGE_SIZE, FW_PAGE_SIZE) {
                Ok(r) => r,
                Err(e) => {
                    // Chunks added for this reservation hold nothing yet: they go back.
                    self.free_empty(dma);
                    return Err(PagesError::Dma(e));
                }
            };
            // In address order, so `release` finds a chunk by binary search.
            let at = self.chunks.as_slice().partition_point(|c| c.region.iova() < region.iova());
            if let Err(c) = self.chunks.insert(at, FwChunk { region, given: 0, pending: 0 }) {
                // SAFETY: allocated just above and never shown to the device.
                unsafe { dma.free(c.region) };
                self.free_empty(dma);
                return Err(PagesError::Exhausted { capacity_pages: Self::capacity_pages() });
            }
            missing = missing.saturating_sub(CHUNK_PAGES);
        }
        let mut left = n;
        for c in self.chunks.as_mut_slice() {
            while left > 0 && (c.given | c.pending) != u64::MAX {
                let b = (c.given | c.pending).trailing_ones();
                c.pending |= 1 << b;
                left -= 1;
            }
            if left == 0 {
                break;
            }
        }
        self.pending = n;
        Ok(())
    }

    /// The pending reservation as a `pas[]` source for MANAGE_PAGES give.
    pub fn pending_pages(&self) -> Pas<'_> {
        Pas::Source(self)
    }

    /// The give completed: firmware owns the reserved pages now.
    pub fn commit(&mut self) {
        for c in self.chunks.as_mut_slice() {
            c.given |= c.pending;
            c.pending = 0;
        }
        self.given += self.pending;
        self.pending = 0;
    }

    /// The give failed: firmware took none of the reserved pages. Chunks left empty go back to the allocator.
    pub fn cancel<D: Dma>(&mut self, dma: &D) {
        for c in self.chunks.as_mut_slice() {
            c.pending = 0;
        }
        self.pending = 0;
        self.free_empty(dma);
    }

    /// Firmware returned `addr`. Returns false (and changes nothing) when the pool never gave it.
    pub fn release(&mut self, addr: u64) -> bool {
        let chunks = self.chunks.as_mut_slice();
        // The last chunk starting at or below `addr` is the only one that can hold it.
        let Some(i) = chunks.partition_point(|c| c.region.iova() <= addr).checked_sub(1) else { return false };
        let c = &mut chunks[i];
        let off = addr - c.region.iova();
        if off >= (CHUNK_PAGES * FW_PAGE_SIZE) as u64 || !off.is_multiple_of(FW_PAGE_SIZE as u64) {
            return false;
        }
        let bit = 1u64 << (off / FW_PAGE_SIZE as u64);
        if c.given & bit == 0 {
            return false;
        }
        c.given &= !bit;
        self.given -= 1;
        true
    }

    /// Returns every chunk that holds no firmware page to the allocator.
    pub fn free_empty<D: Dma>(&mut self, dma: &D) {
        let mut i = self.chunks.len();
        while i > 0 {
            i -= 1;
            let c = &self.chunks.as_slice()[i];
            if c.given == 0 && c.pending == 0 {
                if let Some(c) = self.chunks.remove(i) {
                    // SAFETY: allocated from `dma` in `reserve`; no page of the chunk is owned by or reserved for
                    // firmware, so the device has no business touching it.
                    unsafe { dma.free(c.region) };
                }
            }
        }
    }

    /// Forgets firmware's ownership of every page and frees all chunks (Linux's reclaim in internal-error state:
    /// the device is dead and will not touch host memory again). Returns how many pages firmware still held.
    pub fn abandon_all<D: Dma>(&mut self, dma: &D) -> usize {
        let held = self.given;
        for c in self.chunks.as_mut_slice() {
            c.given = 0;
            c.pending = 0;
        }
        self.given = 0;
        self.pending = 0;
        self.free_empty(dma);
        held
    }
}

/// A [`PageSink`] that hands each returned address straight back to the pool; addresses the pool never gave are
/// counted in `unknown`.
#[derive(Debug)]
pub struct Reclaim<'a, S: Table<FwChunk>> {
    /// The pool the pages go back to.
    pub pool: &'a mut FwPagesOf<S>,
    /// Pages to ask back (the most the output may carry).
    pub capacity: usize,
    /// Returned addresses the pool never gave.
    pub unknown: usize,
    /// The first such address.
    pub first_unknown: Option<u64>,
}

impl<S: Table<FwChunk>> PageSink for Reclaim<'_, S> {
    fn capacity(&self) -> usize {
        self.capacity
    }
    fn put(&mut self, _i: usize, addr: u64) {
        if !self.pool.release(addr) {
            self.unknown += 1;
            self.first_unknown.get_or_insert(addr);
        }
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::hal::tests::TestDma;
    use crate::table::growable::Grow;
    use std::vec::Vec;

    #[test]
    fn a_growable_pool_lends_past_64_mib_and_finds_every_returned_page() {
        let dma = TestDma::default();
        let mut pool = FwPagesOf::<Grow<FwChunk>>::new();
        assert_eq!(FwPagesOf::<Grow<FwChunk>>::capacity_pages(), usize::MAX);
        // One page more than the former 256 chunks held.
        let n = 256 * CHUNK_PAGES + 1;
        pool.reserve(&dma, n).unwrap();
        let mut pages = Vec::new();
        pool.each(&mut |_, a| pages.push(a));
        pool.commit();
        assert_eq!((pool.given(), pool.chunks(), pages.len()), (n, 257, n));
        // Chunks sit in address order whatever order the allocator placed them in.
        let chunks = crate::table::Table::as_slice(&pool.chunks);
        assert!(chunks.windows(2).all(|w| w[0].region.iova() < w[1].region.iova()));
        assert!(!pool.release(pages[0] + 8), "not a page start");
        assert!(!pool.release(1 << 12), "never given");
        // Returned in an order unlike the one given (every 7th first): each is found.
        pages.sort_unstable_by_key(|a| (a / FW_PAGE_SIZE as u64) % 7);
        for (i, a) in pages.iter().enumerate() {
            assert!(pool.release(*a), "page {i}");
            assert!(!pool.release(*a), "page {i} twice");
        }
        pool.free_empty(&dma);
        assert_eq!((pool.given(), pool.chunks(), dma.live()), (0, 0, 0));
    }
}
