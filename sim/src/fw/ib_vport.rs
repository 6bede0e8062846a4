//! The port as `mlx5_ib` queries it on a function with `ib_virt` (the HCA vport access method):
//! QUERY_HCA_VPORT_GID (InfiniBand), QUERY_HCA_VPORT_PKEY and the NODE_DESC register (both link layers).
//!
//! Port numbers: on a single-port function Linux leaves `port_num` at 0 (`vport.c` sets it only when
//! `num_ports == 2`), and firmware takes 0 as the function's own port; 1 names the same port.

use mlx5_core::prm::{consts, ifc, CmdStatus, Field, MsgBuf, Sub};

use super::port::{PortModel, LINK_LOCAL_PREFIX, PKEY_ENTRIES};
use super::reply::{bad_param, err, rd, rd16, CmdErr};
use super::syndrome;
use crate::config::PortType;

/// GID entries (`gid_table_size` 4 encodes 8 << 4).
pub(crate) const GID_ENTRIES: usize = 128;
/// "All entries" in `gid_index` / `pkey_index`.
const ALL: u16 = 0xffff;
/// What firmware reports as the node description until software sets one (64 bytes, NUL padded).
pub(crate) const NODE_DESC: &[u8] = b"MT4119 ConnectX5 mlx5-sim";
/// Bytes of the NODE_DESC register (`IB_DEVICE_NODE_DESC_MAX`, the kernel's `struct mlx5_reg_node_desc`).
const NODE_DESC_LEN: usize = 64;

/// Whether `port_num` names the function's port (0 or 1 on a single-port function).
pub(crate) fn own_port(port_num: u32) -> bool {
    port_num <= 1
}

/// `ib_only`: the query exists on InfiniBand ports only (GIDs; a RoCE port's GIDs are the RoCE address table).
fn check(port: &PortModel, inp: &[u8], other_vport: Field, port_num: Field, ib_only: bool) -> Result<(), CmdErr> {
    if ib_only && port.port_type != PortType::Ib {
        return Err(bad_param(syndrome::BAD_PORT));
    }
    if rd(inp, other_vport) != 0 {
        // Not a vport group manager: only the function's own vport.
        return Err(bad_param(syndrome::BAD_FUNCTION));
    }
    if !own_port(rd(inp, port_num)) {
        return Err(bad_param(syndrome::BAD_PORT));
    }
    Ok(())
}

/// GID `index` of the port: 0 is fe80::/64 plus the port GUID, the rest are unset (zero).
pub(crate) fn gid(port: &PortModel, index: usize) -> [u8; 16] {
    let mut g = [0u8; 16];
    if index == 0 {
        g[..8].copy_from_slice(&LINK_LOCAL_PREFIX.to_be_bytes());
        g[8..].copy_from_slice(&port.node_guid.to_be_bytes());
    }
    g
}

pub(super) fn query_hca_vport_gid(port: &PortModel, inp: &[u8], out: &mut [u8], outlen: usize) -> Result<(), CmdErr> {
    use ifc::query_hca_vport_gid_in as i;
    use ifc::query_hca_vport_gid_out as o;
    check(port, inp, i::OTHER_VPORT, i::PORT_NUM, true)?;
    let index = rd16(inp, i::GID_INDEX);
    let (first, n) = match index {
        ALL => (0, GID_ENTRIES),
        i if usize::from(i) < GID_ENTRIES => (usize::from(i), 1),
        _ => return Err(bad_param(syndrome::GID_INDEX)),
    };
    let base = o::GID.byte_off();
    if outlen.min(out.len()) < base + 16 * n {
        return Err(err(CmdStatus::BadOutpLen, syndrome::BAD_OUTPUT_LEN));
    }
    out.set(o::GIDS_NUM, n as u32);
    for k in 0..n {
        out[base + 16 * k..base + 16 * (k + 1)].copy_from_slice(&gid(port, first + k));
    }
    Ok(())
}

pub(super) fn query_hca_vport_pkey(port: &PortModel, inp: &[u8], out: &mut [u8], outlen: usize) -> Result<(), CmdErr> {
    use ifc::query_hca_vport_pkey_in as i;
    use ifc::query_hca_vport_pkey_out as o;
    // mlx5_ib reads the P_Key table this way on RoCE ports too (`mlx5_query_hca_nic_pkey`).
    check(port, inp, i::OTHER_VPORT, i::PORT_NUM, false)?;
    let index = rd16(inp, i::PKEY_INDEX);
    let (first, n) = match index {
        ALL => (0, PKEY_ENTRIES),
        i if usize::from(i) < PKEY_ENTRIES => (usize::from(i), 1),
        _ => return Err(bad_param(syndrome::QP_PKEY_INDEX)),
    };
    if outlen.min(out.len()) < o::PKEY.byte_off() + ifc::pkey::SIZE_BYTES * n {
        return Err(err(CmdStatus::BadOutpLen, syndrome::BAD_OUTPUT_LEN));
    }
    for k in 0..n {
        let v = u32::from(port.pkeys[first + k]);
        let entry = Sub::new(o::PKEY.byte_off() + ifc::pkey::SIZE_BYTES * k, ifc::pkey::SIZE_BYTES);
        out.set(ifc::pkey::PKEY.at(entry), v);
    }
    Ok(())
}

/// ACCESS_REGISTER of the registers this module owns (NODE_DESC, read only); `None` for any other register.
pub(super) fn access_reg(inp: &[u8], out: &mut [u8]) -> Option<Result<(), CmdErr>> {
    let id = rd16(inp, ifc::access_register_in::REGISTER_ID);
    // mlx5_ib reads it on either link layer (`mlx5_query_node_desc` at its init stage); only MAD_IFC replaces it.
    if id != consts::MLX5_REG_NODE_DESC {
        return None;
    }
    let off = ifc::access_register_out::REGISTER_DATA.byte_off();
    let len = NODE_DESC_LEN;
    if rd(inp, ifc::mbox_in::OP_MOD) != consts::MLX5_ACCESS_REGISTER_IN_OP_MOD_READ || out.len() < off + len {
        return Some(Err(bad_param(syndrome::REG_ACCESS)));
    }
    out[off..off + NODE_DESC.len()].copy_from_slice(NODE_DESC);
    Some(Ok(()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::SimConfig;
    use crate::testkit::submit::Harness;

    fn ib() -> Harness {
        let mut h = Harness::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
        h.bring_up();
        h
    }

    #[test]
    fn hca_vport_context_of_a_single_port_function_takes_port_num_zero() {
        // Linux's mlx5_query_hca_vport_context leaves port_num 0 unless num_ports == 2; the simulator refused it
        // with BAD_PARAM/BAD_PORT and mlx5_ib's probe failed in set_has_smi_cap (found under UML).
        let mut h = ib();
        let (inlen, outlen) =
            (ifc::query_hca_vport_context_in::SIZE_BYTES, ifc::query_hca_vport_context_out::SIZE_BYTES);
        for port_num in [0, 1] {
            let mut inp = vec![0u8; inlen];
            inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT.into());
            inp.set(ifc::query_hca_vport_context_in::PORT_NUM, port_num);
            let (status, syndrome, _) = h.cmd(&inp, outlen);
            assert_eq!((status, syndrome), (0, 0), "port_num {port_num}");
        }
        let mut inp = vec![0u8; inlen];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT.into());
        inp.set(ifc::query_hca_vport_context_in::PORT_NUM, 2);
        assert_eq!(h.cmd(&inp, outlen).1, syndrome::BAD_PORT);
    }

    #[test]
    fn gid_table_entry_zero_is_the_link_local_port_guid_gid() {
        let mut h = ib();
        let guid = h.dev.config().node_guid;
        let mut inp = vec![0u8; ifc::query_hca_vport_gid_in::SIZE_BYTES];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_VPORT_GID.into());
        // One entry, as mlx5_query_hca_vport_gid asks: the GID follows the 16-byte output header.
        let base = ifc::query_hca_vport_gid_out::GID.byte_off();
        let (status, _, out) = h.cmd(&inp, base + 16);
        assert_eq!(status, 0);
        assert_eq!(MsgBuf::get(&out[..], ifc::query_hca_vport_gid_out::GIDS_NUM), 1);
        assert_eq!(out[base..base + 8], 0xfe80_0000_0000_0000u64.to_be_bytes());
        assert_eq!(out[base + 8..base + 16], guid.to_be_bytes());
        assert_eq!(h.dev.gid(0), Some(out[base..base + 16].try_into().unwrap()));
        // The whole table needs room for every entry.
        inp.set(ifc::query_hca_vport_gid_in::GID_INDEX, 0xffff);
        assert_eq!(h.cmd(&inp, base + 16).1, syndrome::BAD_OUTPUT_LEN);
        let (status, _, out) = h.cmd(&inp, base + 16 * GID_ENTRIES);
        assert_eq!(status, 0);
        assert_eq!(MsgBuf::get(&out[..], ifc::query_hca_vport_gid_out::GIDS_NUM), GID_ENTRIES as u32);
        inp.set(ifc::query_hca_vport_gid_in::GID_INDEX, GID_ENTRIES as u32);
        assert_eq!(h.cmd(&inp, base + 16).1, syndrome::GID_INDEX);
    }

    #[test]
    fn pkey_table_holds_the_default_pkey_at_index_zero_on_both_link_layers() {
        // On a RoCE port the IB core's P_Key cache setup failed on this query (found under UML).
        let mut eth = Harness::inline();
        eth.bring_up();
        for mut h in [ib(), eth] {
            let mut inp = vec![0u8; ifc::query_hca_vport_pkey_in::SIZE_BYTES];
            inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_VPORT_PKEY.into());
            inp.set(ifc::query_hca_vport_pkey_in::PKEY_INDEX, 0xffff);
            let base = ifc::query_hca_vport_pkey_out::PKEY.byte_off();
            let (status, _, out) = h.cmd(&inp, base + ifc::pkey::SIZE_BYTES * PKEY_ENTRIES);
            assert_eq!(status, 0);
            let pkey = |k: usize| {
                MsgBuf::get(
                    &out[..],
                    ifc::pkey::PKEY.at(Sub::new(base + ifc::pkey::SIZE_BYTES * k, ifc::pkey::SIZE_BYTES)),
                )
            };
            assert_eq!((pkey(0), pkey(1), pkey(PKEY_ENTRIES - 1)), (0xffff, 0, 0));
        }
    }

    #[test]
    fn node_desc_register_reads_the_firmware_default_on_both_link_layers() {
        // On a RoCE port mlx5_ib's first command was this read, refused by the simulator (found under UML).
        let mut eth = Harness::inline();
        eth.bring_up();
        for mut h in [ib(), eth] {
            let data = ifc::access_register_in::REGISTER_DATA.byte_off();
            let mut inp = vec![0u8; data + NODE_DESC_LEN];
            inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_ACCESS_REG.into());
            inp.set(ifc::mbox_in::OP_MOD, consts::MLX5_ACCESS_REGISTER_IN_OP_MOD_READ);
            inp.set(ifc::access_register_in::REGISTER_ID, consts::MLX5_REG_NODE_DESC.into());
            let out_data = ifc::access_register_out::REGISTER_DATA.byte_off();
            let (status, _, out) = h.cmd(&inp, out_data + NODE_DESC_LEN);
            assert_eq!(status, 0);
            assert_eq!(&out[out_data..out_data + NODE_DESC.len()], NODE_DESC);
            // Writing it is not supported.
            inp.set(ifc::mbox_in::OP_MOD, consts::MLX5_ACCESS_REGISTER_IN_OP_MOD_WRITE);
            assert_eq!(h.cmd(&inp, out_data + NODE_DESC_LEN).1, syndrome::REG_ACCESS);
        }
    }
}
