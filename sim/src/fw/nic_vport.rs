//! MODIFY_NIC_VPORT_CONTEXT on the function's own vport: `roce_en` (`mlx5_ib` turns RoCE on at probe on an
//! Ethernet port, `mlx5_nic_vport_enable_roce`, and fails its probe when the command is refused), and what mlx5e
//! sets when it opens and on every receive-mode change: the MTU, the promiscuous bits and the allowed UC, MC and
//! VLAN lists (bounded by `log_max_current_uc_list` and its kin). QUERY_NIC_VPORT_CONTEXT reports them.

use mlx5_core::prm::{consts, ifc, CmdStatus, Field, Sub};

use super::caps::Caps;
use super::port::PortModel;
use super::reply::{bad_param, err, rd, CmdErr};
use super::syndrome;
use crate::config::PortType;

pub(super) fn modify_nic_vport_context(port: &mut PortModel, caps: &Caps, inp: &[u8]) -> Result<(), CmdErr> {
    use ifc::modify_nic_vport_context_in as i;
    use ifc::modify_nic_vport_field_select as f;
    use ifc::nic_vport_context as n;
    if port.port_type != PortType::Eth {
        // An InfiniBand function has no NIC vport context.
        return Err(bad_param(syndrome::BAD_PORT));
    }
    if rd(inp, i::OTHER_VPORT) != 0 {
        // Not a vport group manager: only the function's own vport.
        return Err(bad_param(syndrome::BAD_FUNCTION));
    }
    let sel: Sub = i::FIELD_SELECT;
    let selected = |fld: Field| rd(inp, fld.at(sel)) != 0;
    // Selecting a field this model does not keep would be silently ignored; refuse it instead.
    let others = [
        f::AFFILIATION,
        f::DISABLE_UC_LOCAL_LB,
        f::DISABLE_MC_LOCAL_LB,
        f::NODE_GUID,
        f::PORT_GUID,
        f::MIN_INLINE,
        f::CHANGE_EVENT,
        f::PERMANENT_ADDRESS,
    ];
    if others.into_iter().any(selected) {
        return Err(bad_param(syndrome::NIC_VPORT_FIELD));
    }
    let ctx = i::NIC_VPORT_CONTEXT;
    // Checked before anything changes: a refused command leaves the context as it was.
    let list = if selected(f::ADDRESSES_LIST) {
        let ty = rd(inp, n::ALLOWED_LIST_TYPE.at(ctx));
        let size = rd(inp, n::ALLOWED_LIST_SIZE.at(ctx));
        let log_max = match ty {
            consts::MLX5_NVPRT_LIST_TYPE_UC => caps.gen(ifc::cmd_hca_cap::LOG_MAX_CURRENT_UC_LIST),
            consts::MLX5_NVPRT_LIST_TYPE_MC => caps.gen(ifc::cmd_hca_cap::LOG_MAX_CURRENT_MC_LIST),
            consts::MLX5_NVPRT_LIST_TYPE_VLAN => caps.gen(ifc::cmd_hca_cap::LOG_MAX_VLAN_LIST),
            _ => return Err(bad_param(syndrome::NIC_VPORT_FIELD)),
        };
        if size > 1 << log_max.min(12) {
            return Err(bad_param(syndrome::NIC_VPORT_FIELD));
        }
        let arr = n::CURRENT_UC_MAC_ADDRESS.at(ctx);
        // The list is the command's tail: an input too short for it is a length error.
        let end = arr.byte_off() + 8 * size as usize;
        if inp.len() < end {
            return Err(err(CmdStatus::BadInpLen, syndrome::BAD_INPUT_LEN));
        }
        let entries: Vec<[u8; 8]> = (0..size as usize)
            .map(|k| {
                let at = arr.byte_off() + 8 * k;
                let mut e = [0u8; 8];
                e.copy_from_slice(&inp[at..at + 8]);
                e
            })
            .collect();
        Some((ty, entries))
    } else {
        None
    };
    if selected(f::ROCE_EN) {
        port.roce_en = rd(inp, n::ROCE_EN.at(ctx)) != 0;
    }
    if selected(f::MTU) {
        // mlx5e_set_mtu: the vport's MTU follows the port's (PMTU).
        port.vport_mtu = rd(inp, n::MTU.at(ctx)) as u16;
    }
    if selected(f::PROMISC) {
        port.promisc = [n::PROMISC_UC, n::PROMISC_MC, n::PROMISC_ALL].map(|b| rd(inp, b.at(ctx)) != 0);
    }
    if let Some((ty, entries)) = list {
        port.vport_lists[ty as usize] = entries;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::testkit::submit::Harness;
    use mlx5_core::prm::{consts, MsgBuf};

    fn modify(h: &mut Harness, select: Field, roce_en: u32) -> (u8, u32) {
        use ifc::modify_nic_vport_context_in as i;
        let mut inp = vec![0u8; i::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_MODIFY_NIC_VPORT_CONTEXT.into());
        inp.set(select.at(i::FIELD_SELECT), 1);
        inp.set(ifc::nic_vport_context::ROCE_EN.at(i::NIC_VPORT_CONTEXT), roce_en);
        let (s, syn, _) = h.cmd(&inp, ifc::modify_nic_vport_context_out::SIZE_BYTES);
        (s, syn)
    }

    fn roce_en(h: &mut Harness) -> u32 {
        let (inlen, outlen) =
            (ifc::query_nic_vport_context_in::SIZE_BYTES, ifc::query_nic_vport_context_out::SIZE_BYTES);
        let (s, _, out) = h.simple(consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT, 0, inlen, outlen);
        assert_eq!(s, 0);
        MsgBuf::get(&out[..], ifc::nic_vport_context::ROCE_EN.at(ifc::query_nic_vport_context_out::NIC_VPORT_CONTEXT))
    }

    #[test]
    fn roce_en_follows_modify_and_other_fields_are_refused() {
        use ifc::modify_nic_vport_field_select as f;
        let mut h = Harness::inline();
        h.bring_up();
        assert_eq!(roce_en(&mut h), 1);
        assert_eq!(modify(&mut h, f::ROCE_EN, 0), (0, 0));
        assert_eq!(roce_en(&mut h), 0);
        assert_eq!(modify(&mut h, f::ROCE_EN, 1), (0, 0));
        assert_eq!(roce_en(&mut h), 1);
        assert_eq!(modify(&mut h, f::PERMANENT_ADDRESS, 0).1, syndrome::NIC_VPORT_FIELD);
        let mut ib = Harness::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
        ib.bring_up();
        assert_eq!(modify(&mut ib, f::ROCE_EN, 1).1, syndrome::BAD_PORT);
    }

    #[test]
    fn mlx5e_s_mtu_promiscuous_bits_and_address_lists_are_kept() {
        use ifc::modify_nic_vport_context_in as i;
        use ifc::modify_nic_vport_field_select as f;
        use ifc::nic_vport_context as n;
        let mut h = Harness::inline();
        h.bring_up();
        let ctx = i::NIC_VPORT_CONTEXT;
        let arr = n::CURRENT_UC_MAC_ADDRESS.at(ctx);
        // An MC list of `size` entries, the input carrying `carried` of them.
        let list = |h: &mut Harness, size: u32, carried: usize| {
            let mut inp = vec![0u8; arr.byte_off() + 8 * carried];
            inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_MODIFY_NIC_VPORT_CONTEXT.into());
            inp.set(f::ADDRESSES_LIST.at(i::FIELD_SELECT), 1);
            inp.set(n::ALLOWED_LIST_TYPE.at(ctx), consts::MLX5_NVPRT_LIST_TYPE_MC);
            inp.set(n::ALLOWED_LIST_SIZE.at(ctx), size);
            for k in 0..carried {
                inp[arr.byte_off() + 8 * k + 2..arr.byte_off() + 8 * k + 8]
                    .copy_from_slice(&[0x33, 0x33, 0, 0, 0, k as u8]);
            }
            let (s, y, _) = h.cmd(&inp, ifc::modify_nic_vport_context_out::SIZE_BYTES);
            (s, y)
        };
        assert_eq!(list(&mut h, 3, 3), (0, 0));
        assert_eq!(h.dev.with_fw(|fw| fw.port.vport_lists[1].len()), 3);
        // Above `log_max_current_mc_list` (8), or a list the input does not carry: refused, the list stays.
        assert_eq!(list(&mut h, 257, 257).1, syndrome::NIC_VPORT_FIELD);
        assert_eq!(list(&mut h, 4, 2), (consts::MLX5_CMD_STAT_BAD_INP_LEN_ERR, syndrome::BAD_INPUT_LEN));
        assert_eq!(h.dev.with_fw(|fw| fw.port.vport_lists[1].len()), 3);
        // MTU and promiscuous bits, reported back by the query.
        let mut inp = vec![0u8; i::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_MODIFY_NIC_VPORT_CONTEXT.into());
        inp.set(f::MTU.at(i::FIELD_SELECT), 1);
        inp.set(f::PROMISC.at(i::FIELD_SELECT), 1);
        inp.set(n::MTU.at(ctx), 1522);
        inp.set(n::PROMISC_MC.at(ctx), 1);
        assert_eq!(h.cmd(&inp, ifc::modify_nic_vport_context_out::SIZE_BYTES).1, 0);
        let (inlen, outlen) =
            (ifc::query_nic_vport_context_in::SIZE_BYTES, ifc::query_nic_vport_context_out::SIZE_BYTES);
        let (s, _, out) = h.simple(consts::MLX5_CMD_OP_QUERY_NIC_VPORT_CONTEXT, 0, inlen, outlen);
        let base = ifc::query_nic_vport_context_out::NIC_VPORT_CONTEXT;
        let get = |fld: Field| MsgBuf::get(&out[..], fld.at(base));
        let got = (get(n::MTU), get(n::PROMISC_MC), get(n::PROMISC_UC));
        assert_eq!((s, got), (0, (1522, 1, 0)));
    }
}
