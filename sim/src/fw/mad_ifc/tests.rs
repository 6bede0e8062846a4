use mlx5_core::prm::{consts, ifc, MsgBuf};

use super::*;
use crate::config::SimConfig;
use crate::events::SimEvent;
use crate::fw::reply::rd;
use crate::testkit::submit::Harness;

/// A directed-route Get(NodeInfo) as opensm's first sweep sends it to its own port (hop count 0, permissive
/// DrSLID/DrDLID), byte for byte.
fn dr_get_node_info_bytes() -> [u8; MAD_LEN] {
    let mut b = [0u8; MAD_LEN];
    b[..8].copy_from_slice(&[0x01, 0x81, 0x01, 0x01, 0x00, 0x00, 0x00, 0x00]);
    b[8..16].copy_from_slice(&[0, 0, 0, 0, 0x12, 0x34, 0x56, 0x78]);
    b[16..24].copy_from_slice(&[0x00, 0x11, 0, 0, 0, 0, 0, 0]);
    b[32..36].copy_from_slice(&[0xff, 0xff, 0xff, 0xff]);
    b
}

#[test]
fn smp_parses_and_emits_the_same_bytes() {
    let b = dr_get_node_info_bytes();
    let smp = Smp::parse(&b).unwrap();
    assert_eq!((smp.base_version, smp.mgmt_class, smp.class_version, smp.method), (1, 0x81, 1, METHOD_GET));
    assert_eq!((smp.hop_ptr, smp.hop_cnt, smp.tid), (0, 0, 0x1234_5678));
    assert_eq!((smp.attr_id, smp.attr_mod, smp.m_key), (ATTR_NODE_INFO, 0, 0));
    assert_eq!((smp.dr_slid, smp.dr_dlid), (0xffff, 0xffff));
    assert_eq!(smp.emit(), b);
    // Every field lands where ib_smi.h puts it.
    let mut s = smp.clone();
    s.status = 0x801c;
    s.hop_ptr = 2;
    s.hop_cnt = 3;
    s.attr_mod = 0x0102_0304;
    s.m_key = 0x0a0b_0c0d_0e0f_1011;
    s.initial_path[1] = 7;
    s.return_path[63] = 9;
    s.data[0] = 0x55;
    let e = s.emit();
    assert_eq!(&e[4..8], &[0x80, 0x1c, 2, 3]);
    assert_eq!(&e[20..24], &[1, 2, 3, 4]);
    assert_eq!(&e[24..32], &[0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f, 0x10, 0x11]);
    assert_eq!((e[64], e[129], e[255]), (0x55, 7, 9));
    assert_eq!(Smp::parse(&e).unwrap(), s);
}

#[test]
fn short_or_foreign_mads_are_typed_errors() {
    let b = dr_get_node_info_bytes();
    assert_eq!(Smp::parse(&b[..255]), Err(SmpError::Truncated { len: 255 }));
    assert_eq!(Smp::parse(&[]), Err(SmpError::Truncated { len: 0 }));
    let mut perf = b;
    perf[1] = 0x04;
    let e = Smp::parse(&perf).unwrap_err();
    assert_eq!(e, SmpError::NotSubnetClass { class: 4 });
    assert!(e.to_string().contains("0x04"));
}

#[test]
fn node_info_and_port_info_fixtures_both_ways() {
    // NodeInfo of a one-port CA, vendor 00:02:c9, device 0x1017 (IBTA 14.2.5.3 offsets).
    let mut d = [0u8; SMP_DATA_LEN];
    d[..4].copy_from_slice(&[1, 1, 1, 1]);
    d[4..12].copy_from_slice(&0x1111_2222_3333_4444u64.to_be_bytes());
    d[12..20].copy_from_slice(&0x5555_6666_7777_8888u64.to_be_bytes());
    d[20..28].copy_from_slice(&0x9999_aaaa_bbbb_ccccu64.to_be_bytes());
    d[28..32].copy_from_slice(&[0x00, 0x80, 0x10, 0x17]);
    d[32..36].copy_from_slice(&[0, 0, 0, 3]);
    d[36..40].copy_from_slice(&[1, 0x00, 0x02, 0xc9]);
    let ni = NodeInfo::parse(&d);
    assert_eq!((ni.node_type, ni.num_ports, ni.partition_cap, ni.device_id), (1, 1, 128, 0x1017));
    assert_eq!((ni.node_guid, ni.port_guid, ni.revision), (0x5555_6666_7777_8888, 0x9999_aaaa_bbbb_cccc, 3));
    assert_eq!((ni.local_port_num, ni.vendor_id), (1, 0x0002c9));
    assert_eq!(ni.emit(), d);

    // PortInfo: LID 0x0005, SM LID 0x0001, 4x EDR, Active/LinkUp, LMC 0, MTU 4096, VL0-7 (ib_port_info).
    let mut p = [0u8; SMP_DATA_LEN];
    p[8..16].copy_from_slice(&0xfe80_0000_0000_0000u64.to_be_bytes());
    p[16..20].copy_from_slice(&[0x00, 0x05, 0x00, 0x01]);
    p[20..24].copy_from_slice(&0x0001_4028u32.to_be_bytes());
    p[28..44].copy_from_slice(&[1, 2, 2, 2, 0x14, 0x52, 0x03, 0x11, 0x55, 0x40, 0, 8, 8, 0x05, 0x1f, 0x41]);
    p[48..52].copy_from_slice(&[0, 7, 128, 0x92]);
    p[52] = 8;
    p[60..64].copy_from_slice(&[0x00, 0x20, 0x22, 0x02]);
    let pi = PortInfo::parse(&p);
    assert_eq!((pi.lid, pi.master_sm_lid, pi.capability_mask), (5, 1, 0x0001_4028));
    assert_eq!((pi.link_width_active, pi.link_speed_supported, pi.port_state), (2, 1, 4));
    assert_eq!((pi.port_phys_state, pi.link_down_default_state, pi.lmc), (5, 2, 3));
    assert_eq!((pi.neighbor_mtu, pi.master_sm_sl, pi.vl_cap, pi.mtu_cap), (5, 5, 4, 5));
    assert_eq!((pi.vl_stall_count, pi.hoq_life, pi.operational_vls, pi.enforcement), (0, 0x1f, 4, 1));
    assert_eq!((pi.q_key_violations, pi.guid_cap, pi.client_reregister, pi.subnet_timeout), (7, 128, true, 18));
    assert_eq!((pi.capability_mask2, pi.link_speed_ext_active, pi.link_speed_ext_enabled), (0x20, 2, 2));
    assert_eq!(pi.emit(), p);
}

fn ib(sm: bool) -> Harness {
    let mut h = Harness::new(SimConfig { port_type: PortType::Ib, subnet_manager: sm, ..SimConfig::default() });
    h.bring_up();
    h
}

/// MAD_IFC of `mad` on `port`: the command's status and syndrome, and the response MAD.
fn mad_ifc_on(h: &mut Harness, port: u32, mad: &[u8; MAD_LEN]) -> (u8, u32, [u8; MAD_LEN]) {
    use ifc::mad_ifc_in as i;
    let mut inp = vec![0u8; i::SIZE_BYTES];
    inp.set(i::OPCODE, consts::MLX5_CMD_OP_MAD_IFC.into());
    // As mlx5_MAD_IFC sends its own queries: M_Key and B_Key ignored.
    inp.set(i::OP_MOD, 3);
    inp.set(i::PORT, port);
    inp[i::MAD.byte_off()..i::MAD.byte_off() + MAD_LEN].copy_from_slice(mad);
    let (s, y, out) = h.cmd(&inp, ifc::mad_ifc_out::SIZE_BYTES);
    let off = ifc::mad_ifc_out::RESPONSE_MAD_PACKET.byte_off();
    let mut rsp = [0u8; MAD_LEN];
    rsp.copy_from_slice(&out[off..off + MAD_LEN]);
    (s, y, rsp)
}

fn smp(class: u8, method: u8, attr_id: u16, attr_mod: u32, data: [u8; SMP_DATA_LEN]) -> Smp {
    let mut s = Smp::parse(&dr_get_node_info_bytes()).unwrap();
    s.mgmt_class = class;
    s.method = method;
    s.attr_id = attr_id;
    s.attr_mod = attr_mod;
    s.data = data;
    s
}

/// The response SMP of `req` through MAD_IFC on port 1 (the command itself must succeed).
fn ask(h: &mut Harness, req: &Smp) -> Smp {
    let (s, y, rsp) = mad_ifc_on(h, 1, &req.emit());
    assert_eq!((s, y), (0, 0), "MAD_IFC failed");
    Smp::parse(&rsp).unwrap()
}

fn get(h: &mut Harness, attr_id: u16, attr_mod: u32) -> Smp {
    ask(h, &smp(CLASS_SUBN_LID_ROUTED, METHOD_GET, attr_id, attr_mod, [0; SMP_DATA_LEN]))
}

fn set(h: &mut Harness, attr_id: u16, attr_mod: u32, data: [u8; SMP_DATA_LEN]) -> Smp {
    ask(h, &smp(CLASS_SUBN_LID_ROUTED, METHOD_SET, attr_id, attr_mod, data))
}

#[test]
fn get_node_info_node_description_and_guid_info_as_a_connectx5_answers() {
    let mut h = ib(false);
    let req = Smp::parse(&dr_get_node_info_bytes()).unwrap();
    let r = ask(&mut h, &req);
    // A directed-route response: GetResp, the direction bit, the transaction kept.
    assert_eq!((r.method, r.status, r.tid), (METHOD_GET_RESP, STATUS_DIRECTION, 0x1234_5678));
    let ni = NodeInfo::parse(&r.data);
    let guid = SimConfig::default().node_guid;
    assert_eq!((ni.node_type, ni.num_ports, ni.node_guid, ni.port_guid), (1, 1, guid, guid));
    assert_eq!((ni.device_id, ni.vendor_id, ni.partition_cap, ni.local_port_num), (0x1017, 0x0002c9, 128, 1));

    let r = get(&mut h, ATTR_NODE_DESC, 0);
    assert_eq!(r.status, 0);
    assert_eq!(&r.data[..NODE_DESC.len()], NODE_DESC);
    assert!(r.data[NODE_DESC.len()..].iter().all(|&b| b == 0));

    let r = get(&mut h, ATTR_GUID_INFO, 0);
    assert_eq!(r.status, 0);
    assert_eq!(r.data[..8], guid.to_be_bytes());
    assert!(r.data[8..].iter().all(|&b| b == 0));
    // 128 GUIDs: blocks 0-15; block 16 does not exist.
    assert_eq!(get(&mut h, ATTR_GUID_INFO, 15).status, 0);
    assert_eq!(get(&mut h, ATTR_GUID_INFO, 16).status, MadStatus::InvalidField as u16);
}

/// QUERY_HCA_VPORT_CONTEXT's (port state, LID, SM LID) and QUERY_VPORT_STATE's state.
fn vport(h: &mut Harness) -> (u32, u32, u32, u32) {
    use ifc::hca_vport_context as v;
    let (s, _, out) = h.simple(
        consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT,
        0,
        ifc::query_hca_vport_context_in::SIZE_BYTES,
        ifc::query_hca_vport_context_out::SIZE_BYTES,
    );
    assert_eq!(s, 0);
    let b = ifc::query_hca_vport_context_out::HCA_VPORT_CONTEXT;
    assert_eq!(rd(&out, v::HAS_SMI.at(b)), 1);
    let (s, _, st) = h.simple(
        consts::MLX5_CMD_OP_QUERY_VPORT_STATE,
        consts::MLX5_VPORT_STATE_OP_MOD_VNIC_VPORT,
        ifc::query_vport_state_in::SIZE_BYTES,
        ifc::query_vport_state_out::SIZE_BYTES,
    );
    assert_eq!(s, 0);
    let vs = rd(&st, ifc::query_vport_state_out::STATE);
    (rd(&out, v::PORT_STATE.at(b)), rd(&out, v::LID.at(b)), rd(&out, v::SM_LID.at(b)), vs)
}

fn port_changes(h: &Harness, eqn: u8) -> Vec<u8> {
    h.dev
        .events()
        .iter()
        .filter_map(|e| match *e {
            SimEvent::Eqe { eqn: n, event_type, sub_type }
                if n == eqn && event_type == consts::MLX5_EVENT_TYPE_PORT_CHANGE =>
            {
                Some(sub_type)
            }
            _ => None,
        })
        .collect()
}

#[test]
fn a_subnet_manager_assigns_the_lid_and_moves_the_port_init_armed_active() {
    let mut h = ib(true);
    let uar = h.alloc_uar();
    let (s, eqn, _eq) = h.create_eq(uar, 4, 1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE);
    assert_eq!(s, 0);
    let (down, up) = (consts::MLX5_QUERY_VPORT_STATE_OUT_STATE_DOWN, consts::MLX5_QUERY_VPORT_STATE_OUT_STATE_UP);
    // No SM yet: Init, no LID, the vport down.
    assert_eq!(vport(&mut h), (consts::IB_PORT_INIT, 0, 0, down));
    let mut pi = PortInfo::parse(&get(&mut h, ATTR_PORT_INFO, 0).data);
    assert_eq!((pi.port_state, pi.port_phys_state, pi.lid), (2, 5, 0));
    assert_eq!((pi.vl_cap, pi.mtu_cap, pi.link_width_active, pi.link_speed_ext_active), (4, 5, 2, 2));
    assert_eq!((pi.vl_arb_high_cap, pi.vl_arb_low_cap, pi.guid_cap), (8, 8, 128));
    // opensm's first Set: LID, SM LID and the rest, state unchanged (0).
    pi.lid = 0x0007;
    pi.master_sm_lid = 0x0001;
    pi.port_state = 0;
    pi.operational_vls = 4;
    let r = set(&mut h, ATTR_PORT_INFO, 1, pi.emit());
    assert_eq!(r.status, 0);
    let now = PortInfo::parse(&r.data);
    assert_eq!((now.lid, now.master_sm_lid, now.port_state, now.operational_vls), (7, 1, 2, 4));
    assert_eq!(vport(&mut h), (consts::IB_PORT_INIT, 7, 1, down));
    // Active straight from Init is refused, and nothing changes.
    pi.port_state = 4;
    assert_eq!(set(&mut h, ATTR_PORT_INFO, 1, pi.emit()).status, MadStatus::InvalidField as u16);
    assert_eq!(vport(&mut h).0, consts::IB_PORT_INIT);
    pi.port_state = 3;
    assert_eq!(PortInfo::parse(&set(&mut h, ATTR_PORT_INFO, 0, pi.emit()).data).port_state, 3);
    assert_eq!(vport(&mut h), (consts::IB_PORT_ARMED, 7, 1, down));
    pi.port_state = 4;
    assert_eq!(PortInfo::parse(&set(&mut h, ATTR_PORT_INFO, 0, pi.emit()).data).port_state, 4);
    assert_eq!(vport(&mut h), (consts::IB_PORT_ACTIVE, 7, 1, up));
    // mlx5_ib hears of the LID and of the port going active.
    let want = [consts::MLX5_PORT_CHANGE_SUBTYPE_LID, consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE];
    assert_eq!(port_changes(&h, eqn), want);
    // Active again is no change and no event; Down retrains the link back to Init.
    assert_eq!(set(&mut h, ATTR_PORT_INFO, 0, pi.emit()).status, 0);
    assert_eq!(port_changes(&h, eqn).len(), 2);
    pi.port_state = 1;
    assert_eq!(PortInfo::parse(&set(&mut h, ATTR_PORT_INFO, 0, pi.emit()).data).port_state, 2);
    assert_eq!(port_changes(&h, eqn).last(), Some(&consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN));
}

#[test]
fn an_invalid_port_info_set_gets_status_0x1c_and_changes_nothing() {
    let mut h = ib(true);
    let before = get(&mut h, ATTR_PORT_INFO, 0).data;
    let base = PortInfo::parse(&before);
    type Spoil = fn(&mut PortInfo);
    let bad: [(&str, Spoil); 7] = [
        ("multicast LID", |p| p.lid = 0xc000),
        ("permissive LID", |p| p.lid = 0xffff),
        ("multicast SM LID", |p| p.master_sm_lid = 0xc001),
        ("state Init", |p| p.port_state = 2),
        ("state 6", |p| p.port_state = 6),
        ("NeighborMTU above MTUCap", |p| p.neighbor_mtu = 6),
        ("OperationalVLs above VLCap", |p| p.operational_vls = 5),
    ];
    for (what, f) in bad {
        let mut p = base;
        p.lid = 9;
        f(&mut p);
        let r = set(&mut h, ATTR_PORT_INFO, 0, p.emit());
        assert_eq!(r.status, MadStatus::InvalidField as u16, "{what}");
        assert_eq!(get(&mut h, ATTR_PORT_INFO, 0).data, before, "{what} changed the port");
    }
    // PortInfo of port 2 (a one-port CA).
    assert_eq!(get(&mut h, ATTR_PORT_INFO, 2).status, MadStatus::InvalidField as u16);
}

#[test]
fn pkey_sl2vl_and_vlarb_tables_get_and_set() {
    let mut h = ib(false);
    let r = get(&mut h, ATTR_PKEY_TABLE, 0);
    assert_eq!((r.status, &r.data[..4]), (0, &[0xff, 0xff, 0, 0][..]));
    // opensm writes the default partition and one more into block 0.
    let mut d = [0u8; SMP_DATA_LEN];
    d[..4].copy_from_slice(&[0xff, 0xff, 0x80, 0x02]);
    assert_eq!(set(&mut h, ATTR_PKEY_TABLE, 0, d).data, d);
    // QUERY_HCA_VPORT_PKEY (how mlx5_ib reads P_Keys with ib_virt) sees the SM's table.
    {
        use ifc::query_hca_vport_pkey_in as i;
        let mut inp = vec![0u8; i::SIZE_BYTES];
        inp.set(i::OPCODE, consts::MLX5_CMD_OP_QUERY_HCA_VPORT_PKEY.into());
        inp.set(i::PKEY_INDEX, 1);
        let (s, _, out) = h.cmd(&inp, ifc::query_hca_vport_pkey_out::SIZE_BYTES + 4);
        assert_eq!(s, 0);
        let e = mlx5_core::prm::Sub::new(ifc::query_hca_vport_pkey_out::PKEY.byte_off(), ifc::pkey::SIZE_BYTES);
        assert_eq!(rd(&out, ifc::pkey::PKEY.at(e)), 0x8002);
    }
    assert_eq!(get(&mut h, ATTR_PKEY_TABLE, 3).status, 0);
    assert_eq!(get(&mut h, ATTR_PKEY_TABLE, 4).status, MadStatus::InvalidField as u16);

    // SLtoVL: SL n to VL n % 8, then a VL beyond VL7 (not 15) refused.
    let mut m = [0u8; SMP_DATA_LEN];
    m[..8].copy_from_slice(&[0x01, 0x23, 0x45, 0x67, 0x01, 0x23, 0x45, 0x6f]);
    assert_eq!(set(&mut h, ATTR_SL_TO_VL_TABLE, 0, m).data, m);
    let mut bad = m;
    bad[0] = 0x81;
    assert_eq!(set(&mut h, ATTR_SL_TO_VL_TABLE, 0, bad).status, MadStatus::InvalidField as u16);
    assert_eq!(get(&mut h, ATTR_SL_TO_VL_TABLE, 0).data, m);

    // VLArb: blocks 1 (low 0-31) and 3 (high 0-31) exist at capacities 8/8.
    let mut a = [0u8; SMP_DATA_LEN];
    a[..4].copy_from_slice(&[0x00, 0x40, 0x01, 0x40]);
    assert_eq!(set(&mut h, ATTR_VL_ARB_TABLE, 1 << 16, a).data, a);
    assert_eq!(get(&mut h, ATTR_VL_ARB_TABLE, 3 << 16).data, [0; SMP_DATA_LEN]);
    assert_eq!(get(&mut h, ATTR_VL_ARB_TABLE, 1 << 16).data, a);
    for block in [0, 2, 4, 5] {
        assert_eq!(get(&mut h, ATTR_VL_ARB_TABLE, block << 16).status, MadStatus::InvalidField as u16);
    }
}

#[test]
fn what_the_sma_does_not_serve_gets_the_status_a_real_sma_gives() {
    let mut h = ib(false);
    let unsup = MadStatus::UnsupportedMethodAttr as u16;
    // SMInfo (the SM's, not the SMA's), SwitchInfo and LinearForwardingTable (a switch's), a vendor attribute.
    for attr in [0x0020, 0x0012, 0x0019, 0xff00] {
        assert_eq!(get(&mut h, attr, 0).status, unsup, "attribute {attr:#x}");
    }
    // Read-only attributes.
    for attr in [ATTR_NODE_INFO, ATTR_NODE_DESC, ATTR_GUID_INFO] {
        assert_eq!(set(&mut h, attr, 0, [0; SMP_DATA_LEN]).status, unsup, "Set of {attr:#x}");
    }
    // Send (0x03) and a response method are not SMA methods.
    for method in [0x03, METHOD_GET_RESP] {
        let r = ask(&mut h, &smp(CLASS_SUBN_LID_ROUTED, method, ATTR_NODE_INFO, 0, [0; SMP_DATA_LEN]));
        assert_eq!((r.method, r.status), (METHOD_GET_RESP, MadStatus::UnsupportedMethod as u16));
    }
    let mut v = smp(CLASS_SUBN_DIRECTED_ROUTE, METHOD_GET, ATTR_NODE_INFO, 0, [0; SMP_DATA_LEN]);
    v.base_version = 2;
    assert_eq!(ask(&mut h, &v).status, STATUS_DIRECTION | MadStatus::BadVersion as u16);
    v.base_version = 1;
    v.class_version = 2;
    assert_eq!(ask(&mut h, &v).status, STATUS_DIRECTION | MadStatus::BadVersion as u16);
    // A performance-management MAD is no SMP: class not supported.
    let mut perf = dr_get_node_info_bytes();
    perf[1] = 0x04;
    let (s, _, rsp) = mad_ifc_on(&mut h, 1, &perf);
    assert_eq!((s, rsp[3], &rsp[4..6]), (0, METHOD_GET_RESP, &[0x00, 0x04][..]));
    // A TrapRepress gets no response: the output MAD stays zero.
    let tr = smp(CLASS_SUBN_LID_ROUTED, METHOD_TRAP_REPRESS, 0x0002, 0, [0; SMP_DATA_LEN]);
    let (s, _, rsp) = mad_ifc_on(&mut h, 1, &tr.emit());
    assert_eq!((s, rsp), (0, [0; MAD_LEN]));
}

#[test]
fn mad_ifc_refuses_another_port_and_an_ethernet_function() {
    let mut h = ib(false);
    let b = dr_get_node_info_bytes();
    assert_eq!(mad_ifc_on(&mut h, 2, &b).1, syndrome::BAD_PORT);
    assert_eq!(mad_ifc_on(&mut h, 0, &b).0, 0);
    let mut e = Harness::new(SimConfig { port_type: PortType::Eth, ..SimConfig::default() });
    e.bring_up();
    assert_eq!(mad_ifc_on(&mut e, 1, &b).1, syndrome::BAD_PORT);
}

#[test]
fn arbitrary_smps_get_an_answer_never_a_panic() {
    // Every byte of the header and data varied (a fixed generator, so a failure repeats); the command always
    // completes and every answer is a GetResp of the same transaction.
    let mut h = ib(true);
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    for n in 0..3000 {
        let mut b = [0u8; MAD_LEN];
        for c in b.chunks_mut(8) {
            c.copy_from_slice(&next().to_be_bytes()[..c.len()]);
        }
        b[0] = if n % 7 == 0 { b[0] } else { 1 };
        b[1] = if n % 2 == 0 { CLASS_SUBN_LID_ROUTED } else { CLASS_SUBN_DIRECTED_ROUTE };
        b[2] = if n % 5 == 0 { b[2] } else { 1 };
        b[3] = [METHOD_GET, METHOD_SET, b[3]][n % 3];
        b[17] = [0x10, 0x11, 0x14, 0x15, 0x16, 0x17, 0x18, b[17]][n % 8];
        b[16] = if n % 8 == 7 { b[16] } else { 0 };
        let (s, _, rsp) = mad_ifc_on(&mut h, 1, &b);
        assert_eq!(s, 0);
        if b[3] != METHOD_TRAP_REPRESS {
            assert_eq!((rsp[3], &rsp[8..16]), (METHOD_GET_RESP, &b[8..16]));
        }
    }
    // The port still answers.
    assert_eq!(get(&mut h, ATTR_NODE_INFO, 0).status, 0);
}

/// One IB device of a two-port cable for the QP0 tests: waiting for an SM, no LID.
fn sm_port(guid: u64) -> crate::testkit::submit::Rdma {
    let cfg = SimConfig {
        port_type: PortType::Ib,
        subnet_manager: true,
        node_guid: guid,
        mode: crate::config::Mode::Inline,
        ..SimConfig::default()
    };
    crate::testkit::submit::Rdma::new(cfg)
}

#[test]
fn qp0_carries_smps_over_the_cable_to_the_partners_sma_and_back() {
    use crate::testkit::submit::{Bell, QpSpec, TAv, Wqe};
    const SEND: u8 = consts::MLX5_OPCODE_SEND;
    const GRH: usize = 40;
    let (mut a, mut b) = (sm_port(0x2001), sm_port(0x2002));
    let (mut a_cq, mut b_cq) = (a.cq(4), b.cq(4));
    // The SMI QPs, as mlx5_ib creates them (st QP0) and ib_mad brings them to RTS.
    let qp0 = QpSpec { st: consts::MLX5_QP_ST_QP0, ..QpSpec::ud() };
    let mut a0 = a.qp(qp0, a_cq.cqn, a_cq.cqn);
    let mut b0 = b.qp(qp0, b_cq.cqn, b_cq.cqn);
    a.ready_ud(&a0, 0);
    b.ready_ud(&b0, 0);
    let (ma, mb) = (a.mr(4096), b.mr(4096));
    a.h.dev.connect(&b.h.dev);
    // Each side receives into offset 1024 (GRH room first); sends from offset 0.
    let recv = |r: &crate::testkit::submit::Rdma, q: &mut _, m: &crate::testkit::submit::Mr| {
        r.post_recv(q, &[(m.addr() + 1024, (GRH + MAD_LEN) as u32, m.key)]);
    };
    // A directed-route SMP leaves with the permissive DLID (hop count 1: one hop, to the cable's other end).
    let to_partner = TAv { dqpn: 0, qkey: 0, rlid: crate::wire::PERMISSIVE_LID, ..TAv::default() };
    let send = |r: &crate::testkit::submit::Rdma, q: &mut _, m: &crate::testkit::submit::Mr, s: &Smp| {
        m.write(0, &s.emit());
        r.post_send(q, &Wqe::new(SEND).av(&to_partner).data(MAD_LEN as u32, m.key, m.addr()), Bell::Db);
    };
    let mut req = Smp::parse(&dr_get_node_info_bytes()).unwrap();
    req.hop_cnt = 1;
    req.hop_ptr = 1;
    req.initial_path[1] = 1;
    recv(&b, &mut b0, &mb);
    send(&a, &mut a0, &ma, &req);
    assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
    // B's QP0 has it, from QP0, and B's driver hands it to MAD_IFC as mlx5_ib's process_mad does.
    let e = b.poll(&mut b_cq).expect("the SMP crossed the cable");
    assert_eq!((e.qpn(), e.flags_rqpn() & 0xff_ffff, e.byte_cnt()), (b0.qpn, 0, (GRH + MAD_LEN) as u32));
    // Sent to the permissive LID, from it (A has no LID yet): ib_mad answers to that SLID.
    assert_eq!(e.slid(), crate::wire::PERMISSIVE_LID);
    let got: [u8; MAD_LEN] = mb.read(1024 + GRH, MAD_LEN).try_into().unwrap();
    assert_eq!(got, req.emit());
    let (s, _, rsp) = mad_ifc_on(&mut b.h, 1, &got);
    assert_eq!(s, 0);
    // The reply goes back the same way, to A's QP0.
    recv(&a, &mut a0, &ma);
    send(&b, &mut b0, &mb, &Smp::parse(&rsp).unwrap());
    assert_eq!(b.poll(&mut b_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
    let e = a.poll(&mut a_cq).expect("the reply crossed back");
    assert_eq!(e.flags_rqpn() & 0xff_ffff, 0);
    let back = Smp::parse(&ma.read(1024 + GRH, MAD_LEN)).unwrap();
    assert_eq!((back.method, back.status, back.tid), (METHOD_GET_RESP, STATUS_DIRECTION, req.tid));
    assert_eq!(NodeInfo::parse(&back.data).node_guid, 0x2002);

    // The SM (on A) gives B LID 0x12 over the cable; B's SMA takes it and the wire routes to it.
    let mut pi = PortInfo::parse(&get(&mut b.h, ATTR_PORT_INFO, 0).data);
    pi.lid = 0x12;
    pi.master_sm_lid = 0x11;
    pi.port_state = 0;
    let give_lid = Smp { method: METHOD_SET, attr_id: ATTR_PORT_INFO, data: pi.emit(), ..req.clone() };
    recv(&b, &mut b0, &mb);
    send(&a, &mut a0, &ma, &give_lid);
    assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
    assert!(b.poll(&mut b_cq).is_some());
    let (s, _, rsp) = mad_ifc_on(&mut b.h, 1, &mb.read(1024 + GRH, MAD_LEN).try_into().unwrap());
    assert_eq!((s, PortInfo::parse(&Smp::parse(&rsp).unwrap().data).lid), (0, 0x12));
    // The SM's own port takes LID 0x11 through its local SMA.
    let mut own = PortInfo::parse(&get(&mut a.h, ATTR_PORT_INFO, 0).data);
    own.lid = 0x11;
    own.port_state = 0;
    assert_eq!(set(&mut a.h, ATTR_PORT_INFO, 0, own.emit()).status, 0);
    // A LID-routed Get(NodeInfo) to 0x12 now reaches B, from A's LID; B answers to that SLID, from its own.
    let lr = Smp { mgmt_class: CLASS_SUBN_LID_ROUTED, hop_cnt: 0, hop_ptr: 0, ..req.clone() };
    recv(&b, &mut b0, &mb);
    ma.write(0, &lr.emit());
    let lid_routed = |rlid| Wqe::new(SEND).av(&TAv { rlid, ..to_partner });
    a.post_send(&mut a0, &lid_routed(0x12).data(MAD_LEN as u32, ma.key, ma.addr()), Bell::Db);
    assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
    let e = b.poll(&mut b_cq).expect("the LID-routed SMP reached B at its new LID");
    assert_eq!(e.slid(), 0x11);
    recv(&a, &mut a0, &ma);
    mb.write(0, &lr.emit());
    b.post_send(&mut b0, &lid_routed(e.slid()).data(MAD_LEN as u32, mb.key, mb.addr()), Bell::Db);
    assert_eq!(b.poll(&mut b_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
    assert_eq!(a.poll(&mut a_cq).expect("B answers").slid(), 0x12);
    // A LID nobody holds goes nowhere.
    let nobody = TAv { rlid: 0x13, ..to_partner };
    a.post_send(&mut a0, &Wqe::new(SEND).av(&nobody).data(MAD_LEN as u32, ma.key, ma.addr()), Bell::Db);
    assert_eq!(a.poll(&mut a_cq).unwrap().status(), (consts::MLX5_CQE_REQ, 0));
    assert!(a.h.dev.events().iter().any(|e| matches!(e, SimEvent::UdDropped { dqpn: 0, .. })));
}

#[test]
fn a_lid_the_sma_assigns_reaches_the_device_of_another_process_over_the_link() {
    use crate::testkit::submit::{Bell, QpSpec, Rdma, TAv, Wqe};
    use std::time::{Duration, Instant};
    const WAIT: Duration = Duration::from_secs(5);
    let cfg = |guid| SimConfig {
        port_type: PortType::Ib,
        subnet_manager: true,
        node_guid: guid,
        mode: crate::config::Mode::Threaded,
        ..SimConfig::default()
    };
    let (mut a, mut b) = (Rdma::new(cfg(0x4001)), Rdma::new(cfg(0x4002)));
    let at = a.h.dev.wire_listen("127.0.0.1:0").expect("listen");
    b.h.dev.wire_connect(&at.to_string(), WAIT).expect("connect");
    assert!(a.h.dev.wire_wait_peer(WAIT));
    let (mut a_cq, mut b_cq) = (a.cq(4), b.cq(4));
    let qp0 = QpSpec { st: consts::MLX5_QP_ST_QP0, ..QpSpec::ud() };
    let mut a0 = a.qp(qp0, a_cq.cqn, a_cq.cqn);
    let mut b0 = b.qp(qp0, b_cq.cqn, b_cq.cqn);
    a.ready_ud(&a0, 0);
    b.ready_ud(&b0, 0);
    let (ma, mb) = (a.mr(4096), b.mr(4096));
    let mut pi = PortInfo::parse(&get(&mut b.h, ATTR_PORT_INFO, 0).data);
    pi.lid = 0x22;
    pi.port_state = 0;
    assert_eq!(set(&mut b.h, ATTR_PORT_INFO, 0, pi.emit()).status, 0);
    // The update crosses the link on its own; a LID-routed SMP to 0x22 then finds B.
    let lr = Smp { mgmt_class: CLASS_SUBN_LID_ROUTED, ..Smp::parse(&dr_get_node_info_bytes()).unwrap() };
    ma.write(0, &lr.emit());
    let to_b = TAv { dqpn: 0, qkey: 0, rlid: 0x22, ..TAv::default() };
    let end = Instant::now() + WAIT;
    let got = loop {
        b.post_recv(&mut b0, &[(mb.addr() + 1024, 40 + MAD_LEN as u32, mb.key)]);
        a.post_send(&mut a0, &Wqe::new(consts::MLX5_OPCODE_SEND).av(&to_b).data(256, ma.key, ma.addr()), Bell::Db);
        assert_eq!(a.wait_cqe(&mut a_cq).expect("send CQE").status(), (consts::MLX5_CQE_REQ, 0));
        std::thread::sleep(Duration::from_millis(20));
        if let Some(e) = b.poll(&mut b_cq) {
            break Some(e);
        }
        if Instant::now() > end {
            break None;
        }
    };
    let e = got.expect("the LID-routed SMP reached B's new LID across the link");
    assert_eq!(e.flags_rqpn() & 0xff_ffff, 0);
    assert_eq!(&mb.read(1024 + 40, MAD_LEN)[..], &lr.emit()[..]);
}
