//! MODIFY_NIC_VPORT_CONTEXT on the function's own vport. Only `roce_en` is modelled: `mlx5_ib` turns RoCE on at
//! probe on an Ethernet port (`mlx5_nic_vport_enable_roce`) and off when it goes, and fails its probe when the
//! command is refused (found under UML with an Ethernet port). QUERY_NIC_VPORT_CONTEXT reports the value.

use mlx5_core::prm::{ifc, Field, Sub};

use super::port::PortModel;
use super::reply::{bad_param, rd, CmdErr};
use super::syndrome;
use crate::config::PortType;

pub(super) fn modify_nic_vport_context(port: &mut PortModel, inp: &[u8]) -> Result<(), CmdErr> {
    use ifc::modify_nic_vport_context_in as i;
    use ifc::modify_nic_vport_field_select as f;
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
        f::MTU,
        f::CHANGE_EVENT,
        f::PROMISC,
        f::PERMANENT_ADDRESS,
        f::ADDRESSES_LIST,
    ];
    if others.into_iter().any(selected) {
        return Err(bad_param(syndrome::NIC_VPORT_FIELD));
    }
    if selected(f::ROCE_EN) {
        port.roce_en = rd(inp, ifc::nic_vport_context::ROCE_EN.at(i::NIC_VPORT_CONTEXT)) != 0;
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
        assert_eq!(modify(&mut h, f::MTU, 0).1, syndrome::NIC_VPORT_FIELD);
        let mut ib = Harness::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
        ib.bring_up();
        assert_eq!(modify(&mut ib, f::ROCE_EN, 1).1, syndrome::BAD_PORT);
    }
}
