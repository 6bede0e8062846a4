//! Device memory (MEMIC): ALLOC_MEMIC / DEALLOC_MEMIC over the region of the BAR the `device_mem_cap`
//! capabilities name (`memic_bar_start_addr`, `memic_bar_size`), as mlx5_ib's `mlx5_cmd_alloc_memic` and
//! `mlx5_cmd_dealloc_memic` use them. The driver keeps a page bitmap of the region and asks for `memic_size`
//! bytes inside one candidate range of whole pages; a range with no room answers `NO_RES` (Linux's -EAGAIN), on
//! which the driver tries the next page. Addresses in and out are BAR offsets.

use mlx5_core::prm::{ifc, CmdStatus, MsgBuf};

use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;

/// The smallest allocation and its granule: 64 bytes (`log_min_memic_alloc_size` 6, Linux's
/// `MLX5_MEMIC_BASE_SIZE`), the unit `log_memic_addr_alignment` also counts from.
pub(crate) const LOG_MIN_ALLOC: u32 = 6;
/// The largest `log_memic_addr_alignment` (`log_max_memic_addr_alignment`): 64 << 6 = 4 KiB, one page.
pub(crate) const LOG_MAX_ALIGN: u32 = 6;

/// The IOVA at which the datapath reaches device memory: byte `n` of the MEMIC region is at `DMA_BASE + n`,
/// mapped by [`SimDevice::map_device_memory`](crate::SimDevice::map_device_memory) (far above any host memory).
pub const DMA_BASE: u64 = 1 << 40;

/// The MEMIC region and the ranges allocated in it, sorted by start (BAR offsets).
#[derive(Debug)]
pub(crate) struct MemicTable {
    start: u64,
    size: u64,
    allocs: Vec<(u64, u64)>,
}

impl MemicTable {
    /// A region of `size` bytes from BAR offset `start` (`size` 0: no device memory, every command refused).
    pub(crate) fn new(start: u64, size: u64) -> Self {
        MemicTable { start, size, allocs: Vec::new() }
    }

    /// Live allocations.
    pub(crate) fn len(&self) -> usize {
        self.allocs.len()
    }

    pub(crate) fn clear(&mut self) {
        self.allocs.clear();
    }

    pub(super) fn alloc(&mut self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::alloc_memic_in as i;
        if self.size == 0 {
            return Err(err(CmdStatus::BadOp, syndrome::BAD_OPCODE));
        }
        let size = u64::from(rd(inp, i::MEMIC_SIZE));
        let range_size = u64::from(rd(inp, i::RANGE_SIZE));
        let range_start = inp.get64(i::RANGE_START_ADDR);
        let log_align = rd(inp, i::LOG_MEMIC_ADDR_ALIGNMENT);
        if size == 0 || !size.is_multiple_of(1 << LOG_MIN_ALLOC) || size > range_size {
            return Err(bad_param(syndrome::MEMIC_SIZE));
        }
        if log_align > LOG_MAX_ALIGN {
            return Err(bad_param(syndrome::MEMIC_ALIGN));
        }
        let end = self.start + self.size;
        let in_region = range_start >= self.start && range_start.checked_add(range_size).is_some_and(|e| e <= end);
        if !in_region {
            return Err(bad_param(syndrome::MEMIC_RANGE));
        }
        let align = 1u64 << (LOG_MIN_ALLOC + log_align);
        // First fit inside the range: walk the gaps between allocations from `range_start`.
        let range_end = range_start + range_size;
        let mut at = range_start.next_multiple_of(align);
        for &(s, l) in &self.allocs {
            if s + l <= at {
                continue;
            }
            if s >= at + size {
                break;
            }
            at = (s + l).next_multiple_of(align);
        }
        if at + size > range_end {
            return Err(err(CmdStatus::NoRes, syndrome::NO_RESOURCES));
        }
        let pos = self.allocs.partition_point(|&(s, _)| s < at);
        self.allocs.insert(pos, (at, size));
        out.set64(ifc::alloc_memic_out::MEMIC_START_ADDR, at);
        Ok(())
    }

    pub(super) fn dealloc(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::dealloc_memic_in as i;
        if self.size == 0 {
            return Err(err(CmdStatus::BadOp, syndrome::BAD_OPCODE));
        }
        let start = inp.get64(i::MEMIC_START_ADDR);
        let size = u64::from(rd(inp, i::MEMIC_SIZE));
        // Only a whole allocation is given back, named by its start and size (a second free finds nothing).
        let pos = self.allocs.iter().position(|&a| a == (start, size)).ok_or(bad_param(syndrome::MEMIC_INVALID))?;
        self.allocs.remove(pos);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx5_core::prm::consts;

    const START: u64 = 0x12000;
    const SIZE: u64 = 0x4000;

    fn alloc_in(range_start: u64, range_size: u32, size: u32, log_align: u32) -> Vec<u8> {
        use ifc::alloc_memic_in as i;
        let mut b = vec![0u8; i::SIZE_BYTES];
        b.set(i::OPCODE, consts::MLX5_CMD_OP_ALLOC_MEMIC.into());
        b.set64(i::RANGE_START_ADDR, range_start);
        b.set(i::RANGE_SIZE, range_size);
        b.set(i::MEMIC_SIZE, size);
        b.set(i::LOG_MEMIC_ADDR_ALIGNMENT, log_align);
        b
    }

    fn dealloc_in(start: u64, size: u32) -> Vec<u8> {
        use ifc::dealloc_memic_in as i;
        let mut b = vec![0u8; i::SIZE_BYTES];
        b.set(i::OPCODE, consts::MLX5_CMD_OP_DEALLOC_MEMIC.into());
        b.set64(i::MEMIC_START_ADDR, start);
        b.set(i::MEMIC_SIZE, size);
        b
    }

    fn alloc(t: &mut MemicTable, inp: &[u8]) -> Result<u64, (CmdStatus, u32)> {
        let mut out = vec![0u8; ifc::alloc_memic_out::SIZE_BYTES];
        t.alloc(inp, &mut out).map_err(|e| (e.status, e.syndrome))?;
        Ok(out.get64(ifc::alloc_memic_out::MEMIC_START_ADDR))
    }

    #[test]
    fn allocations_in_one_page_range_are_packed_and_a_full_range_answers_no_resources() {
        let mut t = MemicTable::new(START, SIZE);
        assert_eq!(alloc(&mut t, &alloc_in(START, 4096, 64, 0)), Ok(START));
        assert_eq!(alloc(&mut t, &alloc_in(START, 4096, 128, 0)), Ok(START + 64));
        // 64-byte alignment << 2 = 256: the next free 256-byte boundary after 192.
        assert_eq!(alloc(&mut t, &alloc_in(START, 4096, 64, 2)), Ok(START + 256));
        assert_eq!(alloc(&mut t, &alloc_in(START, 4096, 3840, 0)), Err((CmdStatus::NoRes, syndrome::NO_RESOURCES)));
        // The driver's next candidate page has room.
        assert_eq!(alloc(&mut t, &alloc_in(START + 4096, 4096, 4096, 0)), Ok(START + 4096));
        assert_eq!(t.len(), 4);
    }

    #[test]
    fn a_freed_range_is_reused_and_a_double_free_is_refused() {
        let mut t = MemicTable::new(START, SIZE);
        let a = alloc(&mut t, &alloc_in(START, 8192, 8192, 0)).unwrap();
        assert_eq!(alloc(&mut t, &alloc_in(START, 4096, 64, 0)), Err((CmdStatus::NoRes, syndrome::NO_RESOURCES)));
        t.dealloc(&dealloc_in(a, 8192)).unwrap();
        let e = t.dealloc(&dealloc_in(a, 8192)).unwrap_err();
        assert_eq!((e.status, e.syndrome), (CmdStatus::BadParam, syndrome::MEMIC_INVALID));
        assert_eq!(alloc(&mut t, &alloc_in(START, 4096, 64, 0)), Ok(START));
        // A free must name the allocation's start and size exactly.
        let e = t.dealloc(&dealloc_in(START, 128)).unwrap_err();
        assert_eq!(e.syndrome, syndrome::MEMIC_INVALID);
        assert_eq!(t.len(), 1);
    }

    #[test]
    fn bad_sizes_alignments_and_ranges_are_refused_with_bad_param() {
        let mut t = MemicTable::new(START, SIZE);
        let bad = |t: &mut MemicTable, inp: Vec<u8>| alloc(t, &inp).unwrap_err();
        assert_eq!(bad(&mut t, alloc_in(START, 4096, 0, 0)), (CmdStatus::BadParam, syndrome::MEMIC_SIZE));
        assert_eq!(bad(&mut t, alloc_in(START, 4096, 100, 0)), (CmdStatus::BadParam, syndrome::MEMIC_SIZE));
        assert_eq!(bad(&mut t, alloc_in(START, 4096, 8192, 0)), (CmdStatus::BadParam, syndrome::MEMIC_SIZE));
        let align = LOG_MAX_ALIGN + 1;
        assert_eq!(bad(&mut t, alloc_in(START, 4096, 64, align)), (CmdStatus::BadParam, syndrome::MEMIC_ALIGN));
        // Below, across the end of and far past the region (no overflow on a range near u64::MAX).
        assert_eq!(bad(&mut t, alloc_in(START - 4096, 4096, 64, 0)), (CmdStatus::BadParam, syndrome::MEMIC_RANGE));
        let r = alloc_in(START + SIZE - 4096, 8192, 64, 0);
        assert_eq!(bad(&mut t, r), (CmdStatus::BadParam, syndrome::MEMIC_RANGE));
        let r = alloc_in(u64::MAX - 64, 4096, 64, 0);
        assert_eq!(bad(&mut t, r), (CmdStatus::BadParam, syndrome::MEMIC_RANGE));
        assert_eq!(t.len(), 0);
    }

    #[test]
    fn without_device_memory_both_commands_are_unknown() {
        let mut t = MemicTable::new(START, 0);
        assert_eq!(alloc(&mut t, &alloc_in(START, 4096, 64, 0)), Err((CmdStatus::BadOp, syndrome::BAD_OPCODE)));
        assert_eq!(t.dealloc(&dealloc_in(START, 64)).unwrap_err().syndrome, syndrome::BAD_OPCODE);
    }
}
