//! HCA capabilities: the maximum and current images QUERY_HCA_CAP returns and SET_HCA_CAP edits.
//!
//! Each capability type is a `hca_cap_union` image (4 KiB). The values model a ConnectX-5.
//!
//! SET_HCA_CAP rules (what the simulator accepts):
//! * general device caps (`cmd_hca_cap`): every field must equal its current value except those in
//!   [`SETTABLE_GENERAL`]; a field with [`Rule::LeMax`] must not exceed the maximum image.
//! * every other supported type: the image's set bits must be a subset of the maximum image's (firmware lets a
//!   driver turn off, never on, what it does not support).

use mlx5_core::prm::{consts, ifc, Field, MsgBuf, Sub};

use crate::config::{PortType, SimConfig};

/// How a settable general capability may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Rule {
    /// Any value up to the one in the maximum image.
    LeMax,
    /// Any value the field can hold.
    Any,
}

/// General capabilities a driver may change with SET_HCA_CAP (the ones the Linux `handle_hca_cap` family
/// writes). Positions are `cmd_hca_cap` fields, relative to the capability.
/// `log_bf_reg_size`: BlueFlame registers of 512 bytes.
pub(crate) const LOG_BF_REG_SIZE: u32 = 9;

pub(crate) const SETTABLE_GENERAL: &[(Field, Rule)] = {
    use ifc::cmd_hca_cap as g;
    &[
        (g::PKEY_TABLE_SIZE, Rule::LeMax),
        (g::LOG_MAX_QP, Rule::LeMax),
        (g::CMDIF_CHECKSUM, Rule::LeMax),
        (g::UAR_4K, Rule::LeMax),
        (g::LOG_UAR_PAGE_SZ, Rule::Any),
        (g::CACHE_LINE_128BYTE, Rule::Any),
        (g::NUM_VHCA_PORTS, Rule::LeMax),
        (g::DCT, Rule::LeMax),
        (g::ROCE, Rule::LeMax),
        (g::ATOMIC, Rule::LeMax),
        (g::PCI_SYNC_FOR_FW_UPDATE_EVENT, Rule::LeMax),
        (g::RELEASE_ALL_PAGES, Rule::LeMax),
        (g::MKEY_BY_NAME, Rule::LeMax),
        (g::EVENT_ON_VHCA_STATE_TEARDOWN_REQUEST, Rule::LeMax),
        (g::EVENT_ON_VHCA_STATE_IN_USE, Rule::LeMax),
        (g::EVENT_ON_VHCA_STATE_ACTIVE, Rule::LeMax),
        (g::EVENT_ON_VHCA_STATE_ALLOCATED, Rule::LeMax),
        (g::EVENT_ON_VHCA_STATE_INVALID, Rule::LeMax),
    ]
};

/// `log_max_qp` in the current general capabilities before a driver's SET_HCA_CAP (a ConnectX-4's, recorded).
const FW_DEFAULT_LOG_MAX_QP: u8 = 14;

/// Why SET_HCA_CAP was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SetCapError {
    UnsupportedType,
    ReadOnlyField,
    AboveMax,
}

/// One capability type: where it sits in the union, its maximum and its current image.
#[derive(Debug)]
struct CapType {
    cap_type: u16,
    sub: Sub,
    max: Vec<u8>,
    cur: Vec<u8>,
}

#[derive(Debug)]
pub(crate) struct Caps {
    types: Vec<CapType>,
}

fn image() -> Vec<u8> {
    vec![0; ifc::hca_cap_union::SIZE_BYTES]
}

/// The BAR offset of the MEMIC region: right after the UAR pages.
pub(crate) fn memic_bar_start(cfg: &SimConfig) -> u64 {
    ((crate::regs::INIT_SEG_PAGES as u64) + u64::from(cfg.num_uars)) * consts::MLX5_ADAPTER_PAGE_SIZE as u64
}

/// The device memory capabilities (`device_mem_cap`): MEMIC of `cfg.memic_size` bytes, or all zero without.
fn device_mem(cfg: &SimConfig) -> Vec<u8> {
    use ifc::device_mem_cap as d;
    let mut img = image();
    if cfg.memic_size == 0 {
        return img;
    }
    let at = ifc::hca_cap_union::DEVICE_MEM_CAP;
    img[..].set(d::MEMIC.at(at), 1);
    img[..].set(d::LOG_MIN_MEMIC_ALLOC_SIZE.at(at), super::memic::LOG_MIN_ALLOC);
    img[..].set(d::LOG_MAX_MEMIC_ADDR_ALIGNMENT.at(at), super::memic::LOG_MAX_ALIGN);
    img[..].set64(d::MEMIC_BAR_START_ADDR.at(at), memic_bar_start(cfg));
    img[..].set(d::MEMIC_BAR_SIZE.at(at), cfg.memic_size);
    img[..].set(d::MAX_MEMIC_SIZE.at(at), cfg.memic_size);
    // No MEMIC atomic operations (`memic_operations` 0): rdma-core's MEMIC atomic tests skip by name.
    img
}

fn general(cfg: &SimConfig) -> Vec<u8> {
    use ifc::cmd_hca_cap as g;
    let at = |f: Field| f.at(ifc::hca_cap_union::CMD_HCA_CAP);
    let mut m = image();
    let eth = cfg.port_type == PortType::Eth;
    let nic = eth && cfg.eth_netdev;
    let lim = cfg.object_limits;
    let port_type = if eth { consts::MLX5_CAP_PORT_TYPE_ETH } else { consts::MLX5_CAP_PORT_TYPE_IB };
    let vals: &[(Field, u32)] = &[
        (g::HCA_CAP_2, 1),
        (g::LOG_MAX_SRQ_SZ, 15),
        (g::LOG_MAX_QP_SZ, 15),
        (g::LOG_MAX_QP, lim.log_max_qp.into()),
        (g::LOG_MAX_SRQ, lim.log_max_srq.into()),
        (g::LOG_MAX_CQ_SZ, cfg.log_max_cq_sz.into()),
        (g::LOG_MAX_CQ, lim.log_max_cq.into()),
        (g::LOG_MAX_EQ_SZ, 22),
        (g::LOG_MAX_MKEY, lim.log_max_mkey.into()),
        (g::LOG_MAX_EQ, lim.log_max_eq.into()),
        (g::MAX_INDIRECTION, 4),
        (g::LOG_MAX_MRW_SZ, 64),
        (g::LOG_MAX_KLM_LIST_SIZE, 16),
        (g::LOG_MAX_RA_REQ_DC, 4),
        (g::LOG_MAX_RA_RES_DC, 4),
        (g::LOG_MAX_RA_REQ_QP, 4),
        (g::LOG_MAX_RA_RES_QP, 4),
        // No congestion control is modelled (no QUERY_CONG_STATISTICS / *_CONG_PARAMS), so cc_query_allowed and
        // cc_modify_allowed stay 0: with them mlx5_ib queries congestion statistics when it registers on a RoCE port,
        // and its probe failed on the refusal (found under UML).
        // gid_table_size encodes 8 << n entries; 4 = 128.
        (g::GID_TABLE_SIZE, 4),
        (g::OUT_OF_SEQ_CNT, 1),
        (g::VPORT_COUNTERS, 1),
        // 255 Q counter sets, as the ConnectX-4.
        (g::MAX_QP_CNT, 255),
        // pkey_table_size encodes 128 << n entries; 0 = 128.
        (g::PKEY_TABLE_SIZE, 0),
        (g::LOCAL_CA_ACK_DELAY, 16),
        (g::PORT_TYPE, port_type),
        (g::NUM_PORTS, 1),
        (g::LOG_MAX_MSG, 30),
        (g::MAX_TC, 8),
        (g::STAT_RATE_SUPPORT, 0xffff),
        (g::IB_VIRT, u32::from(!eth)),
        (g::CQE_VERSION, 1),
        // 128-byte CQEs padded (`cqc.cqe_sz` 2): mlx5_ib offers MLX5DV_CQ_INIT_ATTR_FLAGS_CQE_PAD with it (fw/cq.rs).
        (g::CQE_128_ALWAYS, 1),
        // CQE compression (fw/cq.rs): accepted on 64- and 128-byte CQEs in the hash, checksum and
        // checksum-with-stride-index formats. The device never has to compress, and the simulator does not.
        (g::CQE_COMPRESSION, 1),
        (g::CQE_COMPRESSION_128, 1),
        (g::MINI_CQE_RESP_STRIDE_INDEX, 1),
        // The recorded ConnectX-4's limits: at most 16 CQEs in a session, closed after 8 (in its timer's units).
        (g::CQE_COMPRESSION_TIMEOUT, 8),
        (g::CQE_COMPRESSION_MAX_NUM, 16),
        (g::CMDIF_CHECKSUM, 3),
        (g::SIGERR_CQE, 1),
        (g::WQ_SIGNATURE, 1),
        // No DC transport is modelled (no DCI or DCT QP, no CREATE_DCT): with `dct` 1 mlx5_ib accepted DC QPs and
        // the simulator refused them as EINVAL, which rdma-core's tests count as failures; without it mlx5_ib
        // answers EOPNOTSUPP and they skip (found with `linux-drives-sim --python`).
        (g::DCT, 0),
        // The QoS page (`qos()` below): packet pacing's rate limit table (fw/packet_pacing.rs).
        (g::QOS, 1),
        (g::ETH_NET_OFFLOADS, u32::from(eth)),
        (g::ROCE, u32::from(eth)),
        (g::ATOMIC, 1),
        (g::RELAXED_ORDERING_WRITE, u32::from(cfg.relaxed_ordering)),
        (g::RELAXED_ORDERING_READ, u32::from(cfg.relaxed_ordering)),
        (g::CQ_OI, 1),
        (g::CQ_RESIZE, 1),
        (g::CQ_MODERATION, 1),
        (g::CQ_PERIOD_MODE_MODIFY, 1),
        (g::PG, 1),
        (g::BLOCK_LB_MC, 1),
        (g::CD, 1),
        (g::APM, 1),
        // Linux 6.12's mlx5_ib requires `xrc` (`mlx5_ib_dev_res_init` returns -EOPNOTSUPP without it) and then
        // allocates two XRC domains and an XRC SRQ (fw/xrcd.rs, fw/srq.rs); XRC QPs run RC's transport (fw/qp.rs).
        (g::XRC, 1),
        // No UMR WQE loads MTT entries (the UMR QP changes a key's PD and rights, user QPs bind windows), so the
        // device says UMR cannot load translation entries: mlx5_ib then registers
        // user memory with CREATE_MKEY and a PAS list, and keeps no cache of free (UMR-only) mkeys, which the
        // simulator refuses (`mlx5r_umr_can_load_pas`; found under UML: "async reg mr failed").
        (g::UMR_MODIFY_ENTITY_SIZE_DISABLED, 1),
        // Memory windows (fw/mkey.rs): CREATE_MKEY of a free KLM key, and the UMR WQE user QPs bind it with.
        // mlx5_ib reads the bit only to offer ALLOC_MW and the MEM_WINDOW device flags (main.c).
        (g::IMAICL, 1),
        (g::UD, 1),
        (g::UC, 1),
        (g::RC, 1),
        (g::UAR_4K, 1),
        (g::UAR_SZ, 0),
        (g::LOG_PG_SZ, consts::MLX5_ADAPTER_PAGE_SHIFT),
        (g::BF, 1),
        (g::DRIVER_VERSION, 1),
        (g::LOG_BF_REG_SIZE, LOG_BF_REG_SIZE),
        (g::MAX_WQE_SZ_SQ, 1024),
        (g::MAX_WQE_SZ_RQ, 512),
        (g::MAX_WQE_SZ_SQ_DC, 512),
        (g::MAX_QP_MCG, 240),
        (g::LOG_MAX_MCG, 21),
        (g::LOG_MAX_TRANSPORT_DOMAIN, 24),
        (g::LOG_MAX_PD, lim.log_max_pd.into()),
        (g::LOG_MAX_XRCD, 24),
        // DevX user contexts (fw/uctx.rs): mlx5_ib opens one per user context that asks and one for its whitelist.
        // `uctx_cap` stays 0 (no RAW_TX, no INTERNAL_DEV_RES).
        (g::LOG_MAX_UCTX, 8),
        (g::LOG_MAX_RQ, 23),
        // No SQ object (CREATE_SQ) is modelled: with log_max_sq set, mlx5_core's write-combining test
        // (`mlx5_wc_support_get`) created one for every user context and logged its failure (found under UML).
        // Without it BlueFlame is not offered to user space (bf_reg_size 0): doorbells only.
        // With `eth_netdev` (see SimConfig) the Ethernet port offers SQs and NIC steering for mlx5e.
        (g::LOG_MAX_SQ, if nic { 23 } else { 0 }),
        (g::NIC_FLOW_TABLE, u32::from(nic)),
        (g::LOG_MAX_TIR, 23),
        (g::LOG_MAX_TIS, 23),
        (g::LOG_MAX_RMP, lim.log_max_srq.into()),
        (g::LOG_MAX_RQT, 20),
        (g::LOG_MAX_RQT_SIZE, 20),
        (g::LOG_MAX_TIS_PER_SQ, 0),
        (g::LOG_MAX_WQ_SZ, 17),
        (g::LOG_MAX_CURRENT_UC_LIST, 8),
        (g::LOG_MAX_CURRENT_MC_LIST, 8),
        (g::LOG_MAX_VLAN_LIST, 8),
        (g::DEVICE_FREQUENCY_KHZ, 156_250),
        (g::NUM_OF_UARS_PER_PAGE, 1),
        (g::NUM_VHCA_PORTS, 1),
        (g::RELEASE_ALL_PAGES, 1),
        // Device memory (fw/memic.rs), when configured: Linux reads the device_mem_cap type only with this set.
        (g::DEVICE_MEMORY, u32::from(cfg.memic_size != 0)),
    ];
    for &(f, v) in vals {
        m[..].set(at(f), v);
    }
    m
}

fn general_2() -> Vec<u8> {
    // ConnectX-5 reports the second general block but none of the software vhca-id support Linux would set.
    image()
}

fn odp() -> Vec<u8> {
    let mut m = image();
    let scheme = ifc::odp_cap::TRANSPORT_PAGE_FAULT_SCHEME_CAP.at(ifc::hca_cap_union::ODP_CAP);
    for svc in [ifc::odp_scheme_cap::RC_ODP_CAPS, ifc::odp_scheme_cap::UD_ODP_CAPS] {
        let svc = svc.at(scheme);
        for f in [ifc::odp_per_transport_service_cap::SEND, ifc::odp_per_transport_service_cap::RECEIVE] {
            m[..].set(f.at(svc), 1);
        }
    }
    m
}

/// The QoS page: packet pacing (SET_PP_RATE_LIMIT, fw/packet_pacing.rs) with per-context entries, as mlx5_ib's
/// `pp_is_supported` wants (`packet_pacing`, `packet_pacing_uid`). Rates in kbit/s, from 1 up to the 100 Gb/s of
/// a ConnectX-5 port; 128 entries (index 0 is "no limit"). No burst or typical-size hints.
fn qos() -> Vec<u8> {
    use ifc::qos_cap as q;
    let at = |f: Field| f.at(ifc::hca_cap_union::QOS_CAP);
    let mut m = image();
    for (f, v) in [
        (q::PACKET_PACING, 1),
        (q::PACKET_PACING_UID, 1),
        (q::PACKET_PACING_MIN_RATE, 1),
        (q::PACKET_PACING_MAX_RATE, 100_000_000),
        (q::PACKET_PACING_RATE_TABLE_SIZE, 128),
    ] {
        m[..].set(at(f), v);
    }
    m
}

fn atomic() -> Vec<u8> {
    use ifc::atomic_caps as a;
    let at = |f: Field| f.at(ifc::hca_cap_union::ATOMIC_CAPS);
    let mut m = image();
    // In the maximum image a mode field carries the most the driver may select.
    m[..].set(at(a::ATOMIC_REQ_8B_ENDIANNESS_MODE), 1);
    m[..].set(at(a::SUPPORTED_ATOMIC_REQ_8B_ENDIANNESS_MODE_1), 1);
    m[..].set(at(a::ATOMIC_OPERATIONS), consts::MLX5_ATOMIC_OPS_CMP_SWAP | consts::MLX5_ATOMIC_OPS_FETCH_ADD);
    m[..].set(at(a::ATOMIC_SIZE_QP), consts::MLX5_ATOMIC_CAPS_ATOMIC_SIZE_QP_8_BYTES);
    m[..].set(at(a::ATOMIC_SIZE_DC), consts::MLX5_ATOMIC_CAPS_ATOMIC_SIZE_DC_8_BYTES);
    m
}

fn roce() -> Vec<u8> {
    use ifc::roce_cap as r;
    let at = |f: Field| f.at(ifc::hca_cap_union::ROCE_CAP);
    let mut m = image();
    m[..].set(at(r::SW_R_ROCE_SRC_UDP_PORT), 1);
    m[..].set(at(r::L3_TYPE), consts::MLX5_ROCE_L3_TYPE_IPV4_CAP | consts::MLX5_ROCE_L3_TYPE_IPV6_CAP);
    m[..].set(at(r::ROCE_VERSION), consts::MLX5_ROCE_VERSION_1_CAP | consts::MLX5_ROCE_VERSION_2_CAP);
    // The IANA RoCEv2 port and the source port range ConnectX firmware reports.
    m[..].set(at(r::R_ROCE_DEST_UDP_PORT), 4791);
    m[..].set(at(r::R_ROCE_MAX_SRC_UDP_PORT), 0xffff);
    m[..].set(at(r::R_ROCE_MIN_SRC_UDP_PORT), 0xc000);
    m[..].set(at(r::ROCE_ADDRESS_TABLE_SIZE), 256);
    m
}

fn eth_offloads(nic: bool) -> Vec<u8> {
    use ifc::per_protocol_networking_offload_caps as e;
    let at = |f: Field| f.at(ifc::hca_cap_union::PER_PROTOCOL_NETWORKING_OFFLOAD_CAPS);
    let mut m = image();
    m[..].set(at(e::CSUM_CAP), 1);
    m[..].set(at(e::VLAN_CAP), 1);
    m[..].set(at(e::MAX_LSO_CAP), 18);
    // TIRs block the function's own loopback traffic on request (`self_lb_block`, set through MODIFY_TIR), as a
    // ConnectX-5's do; without it mlx5_core warns "Self loop back prevention is not supported".
    m[..].set(at(e::SELF_LB_EN_MODIFIABLE), u32::from(nic));
    // RSS through RQTs (mlx5e's gate needs it); the table holds `1 << log_max_rqt_size` entries.
    m[..].set(at(e::RSS_IND_TBL_CAP), u32::from(nic));
    m
}

/// `max_ft_level` of the NIC receive tables: what the recorded ConnectX-4 reports (255, `../shared/data`). fs_core
/// drops its kernel NIC RX priority below 12 levels, and its anchor table sits at level 66.
pub(crate) const NIC_RX_MAX_FT_LEVEL: u32 = 255;
/// `log_max_ft_size`: fs_core's L2 table needs 2^16 entries.
pub(crate) const NIC_RX_LOG_MAX_FT_SIZE: u32 = 23;

/// The flow-table capabilities: NIC receive tables matching the outer-header fields mlx5e's tables use,
/// forwarding to TIRs and deeper tables (a ConnectX-5 offers more; these are what the simulator steers on).
fn flow_table() -> Vec<u8> {
    use ifc::flow_table_fields_supported as fs;
    use ifc::flow_table_prop_layout as p;
    let mut m = image();
    let rx = ifc::flow_table_nic_cap::FLOW_TABLE_PROPERTIES_NIC_RECEIVE.at(ifc::hca_cap_union::FLOW_TABLE_NIC_CAP);
    let at = |f: Field| f.at(rx);
    let vals: &[(Field, u32)] = &[
        (p::FT_SUPPORT, 1),
        (p::FLOW_MODIFY_EN, 1),
        (p::MODIFY_ROOT, 1),
        (p::IDENTIFIED_MISS_TABLE_MODE, 1),
        (p::FLOW_TABLE_MODIFY, 1),
        (p::LOG_MAX_FT_SIZE, NIC_RX_LOG_MAX_FT_SIZE),
        (p::MAX_FT_LEVEL, NIC_RX_MAX_FT_LEVEL),
        (p::LOG_MAX_FT_NUM, 16),
        (p::LOG_MAX_DESTINATION, 8),
        (p::LOG_MAX_FLOW, 23),
    ];
    for &(f, v) in vals {
        m[..].set(at(f), v);
    }
    let fields = p::FT_FIELD_SUPPORT.at(rx);
    for f in [
        fs::OUTER_DMAC,
        fs::OUTER_SMAC,
        fs::OUTER_ETHER_TYPE,
        fs::OUTER_IP_VERSION,
        fs::OUTER_FIRST_PRIO,
        fs::OUTER_FIRST_VID,
        fs::OUTER_SIP,
        fs::OUTER_DIP,
        fs::OUTER_FRAG,
        fs::OUTER_IP_PROTOCOL,
        fs::OUTER_UDP_SPORT,
        fs::OUTER_UDP_DPORT,
        fs::OUTER_TCP_SPORT,
        fs::OUTER_TCP_DPORT,
    ] {
        m[..].set(f.at(fields), 1);
    }
    m
}

impl Caps {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        use ifc::hca_cap_union as u;
        let mut types = Vec::new();
        let mut add = |cap_type: u16, sub: Sub, max: Vec<u8>, cur: Vec<u8>| {
            types.push(CapType { cap_type, sub, max, cur });
        };
        let gmax = general(cfg);
        let mut gcur = gmax.clone();
        // Features a driver turns on explicitly start off in the current image.
        for f in [ifc::cmd_hca_cap::CMDIF_CHECKSUM, ifc::cmd_hca_cap::RELEASE_ALL_PAGES] {
            gcur[..].set(f.at(u::CMD_HCA_CAP), 0);
        }
        // Until a driver sets it, 2^14 QPs: the recorded ConnectX-4's current value under a maximum of 2^23.
        let lmq = ifc::cmd_hca_cap::LOG_MAX_QP.at(u::CMD_HCA_CAP);
        gcur[..].set(lmq, cfg.object_limits.log_max_qp.min(FW_DEFAULT_LOG_MAX_QP).into());
        add(consts::MLX5_CAP_GENERAL, u::CMD_HCA_CAP, gmax, gcur);
        let nic = cfg.port_type == PortType::Eth && cfg.eth_netdev;
        let e = eth_offloads(nic);
        add(consts::MLX5_CAP_ETHERNET_OFFLOADS, u::PER_PROTOCOL_NETWORKING_OFFLOAD_CAPS, e.clone(), e);
        let o = odp();
        add(consts::MLX5_CAP_ODP, u::ODP_CAP, o.clone(), o);
        let amax = atomic();
        let mut acur = amax.clone();
        acur[..].set(ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE.at(u::ATOMIC_CAPS), 0);
        add(consts::MLX5_CAP_ATOMIC, u::ATOMIC_CAPS, amax, acur);
        let rmax = roce();
        let mut rcur = rmax.clone();
        rcur[..].set(ifc::roce_cap::SW_R_ROCE_SRC_UDP_PORT.at(u::ROCE_CAP), 0);
        add(consts::MLX5_CAP_ROCE, u::ROCE_CAP, rmax, rcur);
        // Linux asks for the flow-table capabilities only when `nic_flow_table` says they exist.
        if nic {
            let ft = flow_table();
            add(consts::MLX5_CAP_FLOW_TABLE, u::FLOW_TABLE_NIC_CAP, ft.clone(), ft);
        } else {
            // Without the NIC half the type is still answered, all zero (no flow table of any kind): DevX users
            // such as rdma-core's flow tests read it whatever `nic_flow_table` says.
            add(consts::MLX5_CAP_FLOW_TABLE, u::FLOW_TABLE_NIC_CAP, image(), image());
        }
        let qc = qos();
        add(consts::MLX5_CAP_QOS, u::QOS_CAP, qc.clone(), qc);
        let g2 = general_2();
        add(consts::MLX5_CAP_GENERAL_2, u::CMD_HCA_CAP_2, g2.clone(), g2);
        // Without device memory (`device_memory` 0) the type is still answered, all zero, as a ConnectX answers
        // it: DevX users such as rdma-core's tests read it to learn there is none.
        let dm = device_mem(cfg);
        add(consts::MLX5_CAP_DEV_MEM, u::DEVICE_MEM_CAP, dm.clone(), dm);
        Self { types }
    }

    fn find(&self, cap_type: u16) -> Option<&CapType> {
        self.types.iter().find(|t| t.cap_type == cap_type)
    }

    /// The image QUERY_HCA_CAP returns (`current` selects `HCA_CAP_OPMOD_GET_CUR`).
    pub(crate) fn query(&self, cap_type: u16, current: bool) -> Option<&[u8]> {
        self.find(cap_type).map(|t| if current { &t.cur[..] } else { &t.max[..] })
    }

    /// A NIC receive flow-table property (`flow_table_properties_nic_receive`).
    pub(crate) fn nic_rx(&self, f: Field) -> u32 {
        let rx = ifc::flow_table_nic_cap::FLOW_TABLE_PROPERTIES_NIC_RECEIVE.at(ifc::hca_cap_union::FLOW_TABLE_NIC_CAP);
        self.query(consts::MLX5_CAP_FLOW_TABLE, true).map(|img| MsgBuf::get(img, f.at(rx))).unwrap_or(0)
    }

    /// The MEMIC region of the BAR (start offset, bytes), if the device offers device memory.
    pub(crate) fn memic_region(&self) -> Option<(u64, u64)> {
        use ifc::device_mem_cap as d;
        let at = ifc::hca_cap_union::DEVICE_MEM_CAP;
        let img = self.query(consts::MLX5_CAP_DEV_MEM, true)?;
        (MsgBuf::get(img, d::MEMIC.at(at)) != 0)
            .then(|| (img.get64(d::MEMIC_BAR_START_ADDR.at(at)), u64::from(MsgBuf::get(img, d::MEMIC_BAR_SIZE.at(at)))))
    }

    /// A current general capability.
    pub(crate) fn gen(&self, f: Field) -> u32 {
        self.query(consts::MLX5_CAP_GENERAL, true)
            .map(|img| MsgBuf::get(img, f.at(ifc::hca_cap_union::CMD_HCA_CAP)))
            .unwrap_or(0)
    }

    /// The bytes of an 8-byte atomic operand in memory: host order once the driver set host endianness
    /// (`atomic_req_8B_endianness_mode` 1, as Linux's `handle_hca_cap_atomic` and the core set it; mlx5_ib then
    /// reports `IBV_ATOMIC_HCA`), else big-endian. The simulator's host is the requester's and the responder's.
    pub(crate) fn atomic_bytes(&self, v: u64) -> [u8; 8] {
        if self.atomic_host_endian() {
            v.to_ne_bytes()
        } else {
            v.to_be_bytes()
        }
    }

    /// The value of an 8-byte atomic operand read from memory (see [`Caps::atomic_bytes`]).
    pub(crate) fn atomic_value(&self, b: [u8; 8]) -> u64 {
        if self.atomic_host_endian() {
            u64::from_ne_bytes(b)
        } else {
            u64::from_be_bytes(b)
        }
    }

    fn atomic_host_endian(&self) -> bool {
        self.query(consts::MLX5_CAP_ATOMIC, true).map(|img| {
            MsgBuf::get(img, ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE.at(ifc::hca_cap_union::ATOMIC_CAPS))
        }) == Some(1)
    }

    /// The `qpc.atomic_mode` values a QP with remote atomics may name (`get_atomic_mode`): `MLX5_ATOMIC_MODE_IB_COMP`
    /// with the basic operations, and 8 bytes up to the largest `atomic_size_qp` with the extended ones.
    pub(crate) fn atomic_mode_ok(&self, mode: u32) -> bool {
        use ifc::atomic_caps as a;
        if self.gen(ifc::cmd_hca_cap::ATOMIC) == 0 {
            return false;
        }
        let get = |f: Field| {
            self.query(consts::MLX5_CAP_ATOMIC, true)
                .map(|img| MsgBuf::get(img, f.at(ifc::hca_cap_union::ATOMIC_CAPS)))
                .unwrap_or(0)
        };
        let ops = get(a::ATOMIC_OPERATIONS);
        let basic = consts::MLX5_ATOMIC_OPS_CMP_SWAP | consts::MLX5_ATOMIC_OPS_FETCH_ADD;
        let extended = consts::MLX5_ATOMIC_OPS_EXTENDED_CMP_SWAP | consts::MLX5_ATOMIC_OPS_EXTENDED_FETCH_ADD;
        let sizes = get(a::ATOMIC_SIZE_QP) & 0x1ff;
        if mode == consts::MLX5_ATOMIC_MODE_IB_COMP {
            return ops & basic == basic;
        }
        ops & extended != 0 && sizes != 0 && (consts::MLX5_ATOMIC_MODE_8B..=31 - sizes.leading_zeros()).contains(&mode)
    }

    /// A current RoCE capability (0 when the device has none).
    pub(crate) fn roce(&self, f: Field) -> u32 {
        self.query(consts::MLX5_CAP_ROCE, true)
            .map(|img| MsgBuf::get(img, f.at(ifc::hca_cap_union::ROCE_CAP)))
            .unwrap_or(0)
    }

    /// A current QoS capability (`MLX5_CAP_QOS`).
    pub(crate) fn qos(&self, f: Field) -> u32 {
        self.query(consts::MLX5_CAP_QOS, true)
            .map(|img| MsgBuf::get(img, f.at(ifc::hca_cap_union::QOS_CAP)))
            .unwrap_or(0)
    }

    /// A maximum general capability (`MLX5_CAP_GEN_MAX`).
    pub(crate) fn gen_max(&self, f: Field) -> u32 {
        self.query(consts::MLX5_CAP_GENERAL, false)
            .map(|img| MsgBuf::get(img, f.at(ifc::hca_cap_union::CMD_HCA_CAP)))
            .unwrap_or(0)
    }

    /// Overwrites a current general capability, bypassing the SET_HCA_CAP rules (tests of capability checks).
    #[cfg(test)]
    pub(crate) fn force_gen(&mut self, f: Field, v: u32) {
        if let Some(t) = self.types.iter_mut().find(|t| t.cap_type == consts::MLX5_CAP_GENERAL) {
            t.cur[..].set(f.at(ifc::hca_cap_union::CMD_HCA_CAP), v);
        }
    }

    /// SET_HCA_CAP: validates `img` (a `hca_cap_union`, 4 KiB) against the rules above and stores it.
    pub(crate) fn set(&mut self, cap_type: u16, img: &[u8]) -> Result<(), SetCapError> {
        let t = self.types.iter_mut().find(|t| t.cap_type == cap_type).ok_or(SetCapError::UnsupportedType)?;
        let r = t.sub.off..t.sub.off + t.sub.len;
        let new = img.get(r.clone()).ok_or(SetCapError::ReadOnlyField)?;
        if cap_type == consts::MLX5_CAP_GENERAL {
            // Bits outside the settable fields must be unchanged.
            let mut mask = vec![0xffu8; t.sub.len];
            for &(f, _) in SETTABLE_GENERAL {
                mask[..].set(f, 0);
            }
            let cur = &t.cur[r.clone()];
            if new.iter().zip(cur).zip(&mask).any(|((n, c), m)| (n ^ c) & m != 0) {
                return Err(SetCapError::ReadOnlyField);
            }
            let max = &t.max[r.clone()];
            for &(f, rule) in SETTABLE_GENERAL {
                if rule == Rule::LeMax && MsgBuf::get(new, f) > MsgBuf::get(max, f) {
                    return Err(SetCapError::AboveMax);
                }
            }
        } else if new.iter().zip(&t.max[r.clone()]).any(|(n, m)| n & !m != 0) {
            return Err(SetCapError::AboveMax);
        } else if cap_type == consts::MLX5_CAP_ATOMIC {
            // Linux sends only the request mode (the rest of its image is zero); the operations and sizes the
            // device supports are read-only and stay.
            let f = ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE;
            let v = MsgBuf::get(new, f);
            t.cur[r].set(f, v);
            return Ok(());
        }
        t.cur[r].copy_from_slice(new);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn general_cur(c: &Caps) -> Vec<u8> {
        c.query(consts::MLX5_CAP_GENERAL, true).unwrap().to_vec()
    }

    #[test]
    fn general_caps_model_a_connectx5() {
        let c = Caps::new(&SimConfig::default());
        // Current 2^14 QPs until a driver sets more, up to the maximum of 2^23, as the recorded ConnectX-4.
        assert_eq!(c.gen(ifc::cmd_hca_cap::LOG_MAX_QP), 14);
        let max = c.query(consts::MLX5_CAP_GENERAL, false).unwrap();
        assert_eq!(MsgBuf::get(max, ifc::cmd_hca_cap::LOG_MAX_QP), 23);
        assert_eq!(c.gen(ifc::cmd_hca_cap::LOG_MAX_CQ_SZ), 22);
        assert_eq!(c.gen(ifc::cmd_hca_cap::PORT_TYPE), consts::MLX5_CAP_PORT_TYPE_ETH);
        assert_eq!(c.gen(ifc::cmd_hca_cap::LOG_PG_SZ), 12);
        assert_eq!(c.gen(ifc::cmd_hca_cap::CMDIF_CHECKSUM), 0);
        let max = c.query(consts::MLX5_CAP_GENERAL, false).unwrap();
        assert_eq!(MsgBuf::get(max, ifc::cmd_hca_cap::CMDIF_CHECKSUM), 3);
    }

    #[test]
    fn no_capability_promises_an_unimplemented_command() {
        // Each of these made Linux's mlx5_ib send a command the firmware refused with BAD_OP (under UML).
        let c = Caps::new(&SimConfig::default());
        assert_eq!(c.gen(ifc::cmd_hca_cap::CC_QUERY_ALLOWED), 0);
        assert_eq!(c.gen(ifc::cmd_hca_cap::CC_MODIFY_ALLOWED), 0);
        // xrc stays on (mlx5_ib cannot load without it); its domains are implemented (checked in fw/mod.rs's
        // `advertised_xrc_commands_are_implemented`: caps sits below the dispatch that knows the opcodes).
        assert_eq!(c.gen(ifc::cmd_hca_cap::XRC), 1);
    }

    #[test]
    fn set_general_accepts_settable_and_rejects_others() {
        let mut c = Caps::new(&SimConfig::default());
        let gen = consts::MLX5_CAP_GENERAL;
        let mut img = general_cur(&c);
        img[..].set(ifc::cmd_hca_cap::LOG_MAX_QP, 10);
        img[..].set(ifc::cmd_hca_cap::CMDIF_CHECKSUM, 0);
        assert_eq!(c.set(gen, &img), Ok(()));
        assert_eq!(c.gen(ifc::cmd_hca_cap::LOG_MAX_QP), 10);

        let mut img = general_cur(&c);
        img[..].set(ifc::cmd_hca_cap::LOG_MAX_CQ, 5);
        assert_eq!(c.set(gen, &img), Err(SetCapError::ReadOnlyField));

        let mut img = general_cur(&c);
        img[..].set(ifc::cmd_hca_cap::LOG_MAX_QP, 24);
        assert_eq!(c.set(gen, &img), Err(SetCapError::AboveMax));
        assert_eq!(c.gen(ifc::cmd_hca_cap::LOG_MAX_QP), 10);
    }

    #[test]
    fn set_other_types_is_subset_of_max() {
        let mut c = Caps::new(&SimConfig::default());
        let at = consts::MLX5_CAP_ATOMIC;
        let mut img = c.query(at, true).unwrap().to_vec();
        img[..].set(ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE, 1);
        assert_eq!(c.set(at, &img), Ok(()));
        img[..].set(ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE, 2);
        assert_eq!(c.set(at, &img), Err(SetCapError::AboveMax));
        assert_eq!(c.set(0x7f, &img), Err(SetCapError::UnsupportedType));
        // An image with only the request mode (as Linux sends it) keeps the read-only operations and sizes.
        let mut only_mode = vec![0u8; img.len()];
        only_mode[..].set(ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE, 1);
        assert_eq!(c.set(at, &only_mode), Ok(()));
        let cur = c.query(at, true).unwrap();
        let ops = consts::MLX5_ATOMIC_OPS_CMP_SWAP | consts::MLX5_ATOMIC_OPS_FETCH_ADD;
        assert_eq!(MsgBuf::get(cur, ifc::atomic_caps::ATOMIC_OPERATIONS), ops);
        assert_eq!(MsgBuf::get(cur, ifc::atomic_caps::ATOMIC_REQ_8B_ENDIANNESS_MODE), 1);
    }
}
