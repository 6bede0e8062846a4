//! Command delivery, as the PRM's command interface describes it (`mlx5_cmd_layout`, `mlx5_cmd_prot_block`):
//! a rung slot's entry is read and checked (type, token, mailbox chain, signatures, alignment), the command runs
//! ([`Firmware::execute`](crate::fw::Firmware::execute)), and the output goes back through the entry and mailboxes with
//! the owner bit last (the kernel's `cmd_work_handler` / `mlx5_cmd_comp_handler` on the host side).

/// The most recorded messages kept untaken.
const MESSAGES_MAX: usize = 1 << 16;

use std::sync::atomic::{fence, Ordering};

use mlx5_core::prm::{c, consts, ifc, CmdStatus, DeliveryStatus, MsgBuf};

use super::state::{Device, Stalled};
use crate::events::{ExecutedCmd, SimEvent};
use crate::fault::Fault;
use crate::fw::reply::{err, rd, rd16, CmdErr};

/// The most mailbox blocks one message may span (bounds every chain walk; 2 MiB of data).
const MAX_BLOCKS: usize = 4096;

/// Bytes of a message carried in the entry itself (`in[4]` / `out[4]`).
const INLINE_BYTES: usize = c::mlx5_cmd_layout::IN.len;

/// Data bytes per mailbox block (`MLX5_CMD_DATA_BLOCK_SIZE`).
const BLOCK_DATA: usize = consts::MLX5_CMD_DATA_BLOCK_SIZE as usize;

/// Mailbox blocks are 1024-byte aligned (`roundup_pow_of_two(sizeof(block))`, c-layouts.md 2.2).
const BLOCK_ALIGN: u64 = c::mlx5_cmd_prot_block::SIZE.next_power_of_two() as u64;

pub(crate) fn xor8(b: &[u8]) -> u8 {
    b.iter().fold(0, |a, x| a ^ x)
}

fn nblocks(len: usize) -> usize {
    len.saturating_sub(INLINE_BYTES).div_ceil(BLOCK_DATA)
}

/// A mailbox chain read during delivery: the block addresses and their contents.
struct Chain {
    iovas: Vec<u64>,
    blocks: Vec<Vec<u8>>,
}

impl Device {
    /// Reads and checks `n` chained mailbox blocks starting at `first`.
    fn read_chain(&mut self, first: u64, n: usize, token: u8) -> Result<Chain, DeliveryStatus> {
        use c::mlx5_cmd_prot_block as b;
        let mut chain = Chain { iovas: Vec::with_capacity(n), blocks: Vec::with_capacity(n) };
        let mut at = first;
        for k in 0..n {
            let mut blk = vec![0u8; b::SIZE];
            self.dma.read(at, &mut blk).map_err(|_| DeliveryStatus::Fw)?;
            if self.cfg.checksum {
                let ctrl_ok = xor8(&blk[b::DATA.end()..b::SIG.off]) == 0xff;
                if !ctrl_ok || xor8(&blk) != 0xff {
                    return Err(DeliveryStatus::Signat);
                }
            }
            if blk[b::TOKEN.off] != token {
                return Err(DeliveryStatus::Tok);
            }
            if blk.read_u32(b::BLOCK_NUM.off) as usize != k {
                return Err(DeliveryStatus::BadBlkNum);
            }
            let next = blk.read_u64(b::NEXT.off);
            chain.iovas.push(at);
            chain.blocks.push(blk);
            at = next;
        }
        Ok(chain)
    }

    /// Entry-level delivery checks and input gathering. Returns the input message and the output chain.
    fn deliver(&mut self, e: &[u8]) -> Result<(Vec<u8>, Chain), DeliveryStatus> {
        use c::mlx5_cmd_layout as l;
        if e[l::TYPE.off] != consts::MLX5_PCI_CMD_XPORT {
            return Err(DeliveryStatus::CmdDescr);
        }
        if self.cfg.checksum && xor8(e) != 0xff {
            return Err(DeliveryStatus::Signat);
        }
        let inlen = e.read_u32(l::INLEN.off) as usize;
        let outlen = e.read_u32(l::OUTLEN.off) as usize;
        // The input must at least hold the header firmware decodes: opcode and op_mod (8 bytes).
        let header = (ifc::mbox_in::OP_MOD.off + ifc::mbox_in::OP_MOD.width) as usize / 8;
        if inlen < header || nblocks(inlen) > MAX_BLOCKS {
            return Err(DeliveryStatus::InLength);
        }
        if nblocks(outlen) > MAX_BLOCKS {
            return Err(DeliveryStatus::OutLength);
        }
        let in_ptr = e.read_u64(l::IN_PTR.off);
        let out_ptr = e.read_u64(l::OUT_PTR.off);
        if inlen > INLINE_BYTES && !in_ptr.is_multiple_of(BLOCK_ALIGN) {
            return Err(DeliveryStatus::InPtrAlign);
        }
        if outlen > INLINE_BYTES && !out_ptr.is_multiple_of(BLOCK_ALIGN) {
            return Err(DeliveryStatus::OutPtrAlign);
        }
        let token = e[l::TOKEN.off];
        let in_chain = self.read_chain(in_ptr, nblocks(inlen), token)?;
        let out_chain = self.read_chain(out_ptr, nblocks(outlen), token)?;
        let mut input = vec![0u8; inlen.max(INLINE_BYTES)];
        input[..INLINE_BYTES].copy_from_slice(&e[l::IN.off..l::IN.end()]);
        for (k, blk) in in_chain.blocks.iter().enumerate() {
            let start = INLINE_BYTES + k * BLOCK_DATA;
            let n = BLOCK_DATA.min(inlen - start);
            input[start..start + n].copy_from_slice(&blk[c::mlx5_cmd_prot_block::DATA.off..][..n]);
        }
        input.truncate(inlen);
        Ok((input, out_chain))
    }

    /// Writes the output blocks, the entry's `out`, its signature and finally `status_own`.
    fn complete(&mut self, slot: u8, entry_iova: u64, e: &mut [u8], delivery: u8, output: Option<(&[u8], Chain)>) {
        use c::mlx5_cmd_layout as l;
        use c::mlx5_cmd_prot_block as b;
        let mut delivery = delivery;
        if let Some((out, chain)) = output {
            for (k, (iova, mut blk)) in chain.iovas.into_iter().zip(chain.blocks).enumerate() {
                let start = INLINE_BYTES + k * BLOCK_DATA;
                let n = BLOCK_DATA.min(out.len().saturating_sub(start));
                blk[b::DATA.off..b::DATA.off + n].copy_from_slice(&out[start..start + n]);
                let mut res = self.dma.write(iova + b::DATA.off as u64, &blk[b::DATA.off..b::DATA.end()]);
                if self.cfg.checksum && res.is_ok() {
                    blk[b::CTRL_SIG.off] = 0;
                    blk[b::SIG.off] = 0;
                    blk[b::CTRL_SIG.off] = !xor8(&blk[b::DATA.end()..b::SIG.off]);
                    blk[b::SIG.off] = !xor8(&blk);
                    res = self.dma.write(iova + b::CTRL_SIG.off as u64, &blk[b::CTRL_SIG.off..b::SIG.end()]);
                }
                if res.is_err() {
                    delivery = DeliveryStatus::Fw.raw();
                    break;
                }
            }
            if delivery == DeliveryStatus::Ok.raw() {
                e[l::OUT.off..l::OUT.end()].copy_from_slice(&out[..INLINE_BYTES]);
                if self.dma.write(entry_iova + l::OUT.off as u64, &e[l::OUT.off..l::OUT.end()]).is_err() {
                    delivery = DeliveryStatus::Fw.raw();
                }
            }
        }
        // Delivery status in bits 7:1, owner bit (bit 0) handed back to software.
        let status_own = delivery << 1;
        e[l::STATUS_OWN.off] = status_own;
        let mut ok = true;
        if self.cfg.checksum {
            e[l::SIG.off] = 0;
            e[l::SIG.off] = !xor8(e);
            ok &= self.dma.write(entry_iova + l::SIG.off as u64, &e[l::SIG.off..l::SIG.end()]).is_ok();
        }
        // Everything else must be visible before the owner byte flips.
        fence(Ordering::SeqCst);
        ok &= self.dma.write_u8_volatile(entry_iova + l::STATUS_OWN.off as u64, status_own).is_ok();
        if !ok {
            self.events.push(SimEvent::CompletionUnwritable { slot });
        }
    }

    fn take_status_fault(&mut self, opcode: u16) -> Option<(u8, u32)> {
        let i = self.faults.iter().position(|f| matches!(f, Fault::Status { .. }) && f.opcode() == opcode)?;
        let Fault::Status { status, syndrome, times, .. } = self.faults[i] else { return None };
        match times {
            0 => {}
            1 => {
                self.faults.remove(i);
            }
            n => self.faults[i] = Fault::Status { opcode, status, syndrome, times: n - 1 },
        }
        Some((status, syndrome))
    }

    /// Runs one rung slot. `first` is false when a postponed command finally executes (delay faults are then
    /// not applied again). Returns `Some(ms)` when the command must be completed `ms` later.
    pub(crate) fn run_slot(&mut self, slot: u8, first: bool) -> Option<u32> {
        use c::mlx5_cmd_layout as l;
        if self.dead() {
            // A dead firmware never looks at the queue again (and a vanished device cannot).
            if first {
                self.events.push(SimEvent::DoorbellWhileDead { slot });
            }
            return None;
        }
        if first && self.stalled.iter().any(|s| s.slot == slot) {
            self.events.push(SimEvent::DoorbellBusy { slot });
            return None;
        }
        let Some(q) = self.regs.cmdq_iova else {
            self.events.push(SimEvent::DoorbellNoQueue { mask: 1 << slot });
            return None;
        };
        if u32::from(slot) >= 1u32 << self.regs.log_cmdq_size.min(5) {
            self.events.push(SimEvent::DoorbellBadSlot { slot });
            return None;
        }
        let Some(entry_iova) =
            u64::from(slot).checked_shl(self.regs.log_cmdq_stride.into()).and_then(|off| q.checked_add(off))
        else {
            self.events.push(SimEvent::DoorbellBadSlot { slot });
            return None;
        };
        // Order the driver's stores to the entry before our reads of it.
        fence(Ordering::SeqCst);
        let mut e = [0u8; c::mlx5_cmd_layout::SIZE];
        if self.dma.read(entry_iova, &mut e).is_err() {
            self.events.push(SimEvent::EntryUnreadable { slot, iova: entry_iova });
            return None;
        }
        if e[l::STATUS_OWN.off] & consts::CMD_OWNER_HW == 0 {
            self.events.push(SimEvent::DoorbellNotOwned { slot });
            return None;
        }
        let head = &e[l::IN.off..l::IN.end()];
        let opcode = rd16(head, ifc::mbox_in::OPCODE);
        let op_mod = rd(head, ifc::mbox_in::OP_MOD) as u16;
        if first {
            let death = self.faults.iter().find_map(|f| match *f {
                Fault::Fatal { opcode: o, synd } if o == opcode => Some(Some(synd)),
                Fault::Stall { opcode: o } if o == opcode => Some(Some(0)),
                Fault::DeviceGone { opcode: o } if o == opcode => Some(None),
                _ => None,
            });
            match death {
                Some(Some(synd)) => {
                    self.fail(synd);
                    return None;
                }
                Some(None) => {
                    self.vanish();
                    return None;
                }
                None => {}
            }
            if self.faults.iter().any(|f| matches!(f, Fault::Hang { .. }) && f.opcode() == opcode) {
                self.events.push(SimEvent::Hung { slot, opcode });
                return None;
            }
            let need = self.faults.iter().position(|f| matches!(f, Fault::NeedPages { .. }) && f.opcode() == opcode);
            // A need of zero pages is already met: the command runs at once.
            if let Some(Fault::NeedPages { pages: pages @ 1.., .. }) = need.map(|i| self.faults.remove(i)) {
                self.events.push(SimEvent::WaitingForPages { slot, opcode, pages });
                self.stalled.push(Stalled { slot, opcode, remaining: pages.into() });
                self.page_request(i32::try_from(pages).unwrap_or(i32::MAX));
                return None;
            }
            let delay = self.faults.iter().find_map(|f| match *f {
                Fault::Delay { opcode: o, ms } if o == opcode => Some(ms),
                _ => None,
            });
            if let Some(ms) = delay {
                self.events.push(SimEvent::Delayed { slot, opcode, ms });
                return Some(ms);
            }
        }
        let mut rec = ExecutedCmd { slot, opcode, op_mod, status: 0, syndrome: 0, delivery: 0 };
        let injected_delivery = self.faults.iter().find_map(|f| match *f {
            Fault::Delivery { opcode: o, status } if o == opcode => Some(status),
            _ => None,
        });
        let delivered = match injected_delivery {
            Some(d) => Err(DeliveryStatus::from_raw(d)),
            None => self.deliver(&e),
        };
        let given_before = self.fw.pages.given;
        // The completion event goes to an EQ that subscribed to command events when the command ran: the CREATE_EQ
        // that makes the command EQ completes without an EQE in it. Linux polls that command and registers its
        // command-event handler only afterwards (`create_async_eqs`, `mlx5_cmd_use_events`); a late interrupt for
        // such an EQE completed its next command early and then underflowed its refcount (seen under UML).
        let cmd_eq_before = self.fw.eqs.subscriber(consts::MLX5_EVENT_TYPE_CMD).is_some();
        let mut message = None;
        match delivered {
            Err(d) => {
                rec.delivery = d.raw();
                self.complete(slot, entry_iova, &mut e, d.raw(), None);
            }
            Ok((input, out_chain)) => {
                let outlen = e.read_u32(l::OUTLEN.off) as usize;
                let mut out = vec![0u8; outlen.max(INLINE_BYTES)];
                let result = match self.take_status_fault(opcode) {
                    Some((status, syndrome)) => Err(err(CmdStatus::from_raw(status), syndrome)),
                    None => self.fw.execute(&mut self.dma, &mut self.events, &input, &mut out, outlen),
                };
                if let Err(CmdErr { status, syndrome }) = result {
                    out.fill(0);
                    out.set(ifc::mbox_out::STATUS, status.raw().into());
                    out.set(ifc::mbox_out::SYNDROME, syndrome);
                }
                for f in &self.faults {
                    if let Fault::CorruptOutput { opcode: o, offset, value } = *f {
                        if o == opcode && offset < out.len() {
                            out[offset] = value;
                        }
                    }
                }
                rec.status = rd(&out, ifc::mbox_out::STATUS) as u8;
                rec.syndrome = rd(&out, ifc::mbox_out::SYNDROME);
                self.complete(slot, entry_iova, &mut e, DeliveryStatus::Ok.raw(), Some((&out, out_chain)));
                rec.delivery = e[l::STATUS_OWN.off] >> 1;
                if self.cfg.record_messages {
                    out.truncate(outlen.max(INLINE_BYTES));
                    message = Some((input, out));
                }
            }
        }
        self.executed.push(rec);
        if self.cfg.record_messages {
            // Bounded: a caller that stops taking them loses the oldest.
            if self.messages.len() >= MESSAGES_MAX {
                self.messages.pop_front();
            }
            let (input, output) = match message {
                Some((i, o)) => (i, Some(o)),
                None => (Vec::new(), None),
            };
            self.messages.push_back(crate::events::CmdMessage { cmd: rec, input, output });
        }
        // A PAOS write or a Set(PortInfo) that changed the port: its PORT_CHANGEs follow the completion.
        // A LID the SMA took: the wire sends with it and peers route to it.
        if self.wire.addr.ib && self.wire.addr.lid != self.fw.port.lid {
            self.wire.set_lid(self.fw.port.lid);
        }
        for sub in std::mem::take(&mut self.fw.port.pending_change) {
            self.port_change(sub);
        }
        let cant_give = opcode == consts::MLX5_CMD_OP_MANAGE_PAGES && op_mod == consts::MLX5_PAGES_CANT_GIVE;
        if cant_give && rec.status == 0 && rec.delivery == 0 {
            self.fail_stalled();
        }
        let given = self.fw.pages.given - given_before;
        self.after_completion(slot, opcode, given, cmd_eq_before);
        None
    }

    /// The driver answered a page request with MANAGE_PAGES(CANT_GIVE): every command waiting for pages fails
    /// (`MLX5_CMD_STAT_LIM_ERR`, which Linux reads as `-ENOMEM`) instead of waiting forever, as Linux's
    /// `page_notify_fail` expects of firmware.
    fn fail_stalled(&mut self) {
        for s in std::mem::take(&mut self.stalled) {
            let refusal = Fault::Status {
                opcode: s.opcode,
                status: consts::MLX5_CMD_STAT_LIM_ERR,
                syndrome: crate::fw::syndrome::PAGES_REFUSED,
                times: 1,
            };
            // First in the list, so this command takes it rather than an injected one for the same opcode.
            self.faults.insert(0, refusal);
            self.run_slot(s.slot, false);
        }
    }

    /// What firmware does once a command has completed: the command-completion EQE, page requests the command
    /// triggered (or that waited for an EQ it created), and the commands that were waiting for the pages a
    /// MANAGE_PAGES(give) just brought (`given`).
    fn after_completion(&mut self, slot: u8, opcode: u16, given: u64, event: bool) {
        if event {
            self.post_cmd_completion(slot);
        }
        let requests: Vec<i32> = self
            .faults
            .iter()
            .filter_map(|f| match *f {
                Fault::PageRequest { opcode: o, num_pages } if o == opcode => Some(num_pages),
                _ => None,
            })
            .collect();
        for n in requests {
            self.page_request(n);
        }
        self.flush_page_requests();
        if given == 0 || self.stalled.is_empty() {
            return;
        }
        // The pages go to the waiting commands in the order they stalled.
        let mut left = given;
        for s in &mut self.stalled {
            let take = left.min(s.remaining);
            s.remaining -= take;
            left -= take;
        }
        let (ready, waiting): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.stalled).into_iter().partition(|s| s.remaining == 0);
        self.stalled = waiting;
        for s in ready {
            self.run_slot(s.slot, false);
        }
    }
}
