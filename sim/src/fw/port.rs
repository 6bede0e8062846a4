//! The port side of the simulated HCA: access registers (host endianness, PMTU, PAOS, PTYS, PVLC), SET_DRIVER_VERSION, and
//! the vport queries (QUERY_VPORT_STATE, QUERY_NIC_VPORT_CONTEXT, QUERY_HCA_VPORT_CONTEXT), and the RoCE GID
//! table (SET_ROCE_ADDRESS, QUERY_ROCE_ADDRESS).

use mlx5_core::prm::{consts, ifc, Field, MsgBuf};

use super::eq::EqPost;
use super::reply::{bad_param, rd, rd16, CmdErr};
use super::syndrome;
use crate::config::{PortInfo, PortType, SimConfig};

pub(crate) use crate::wire::GID_ENTRIES;

/// Entries of the RoCE address table (`roce_address_table_size` in the RoCE caps).
pub(crate) const ROCE_ADDRESS_ENTRIES: usize = 256;

/// PVLC `vl_hw_cap` (and `vl_admin`, `vl_operational`) of the IB port: the PRM counts data VLs, so 8 is VL0-VL7,
/// what a ConnectX-5 port offers.
pub(crate) const PVLC_VL_0_7: u32 = 8;

/// The PortInfo:CapabilityMask bits a driver may change (`cap_mask1_field_select` in QUERY_HCA_VPORT_CONTEXT):
/// IsSM (bit 1, set through umad's `issm` device by a subnet manager) and IsCommunicationManagementSupported
/// (bit 16, which ib_cm sets when it binds a port). Without them mlx5_ib warned `set_port_caps_atomic: trying
/// to change bitmask 0x10000 but change supported 0x0` (issue 35).
pub(crate) const CAP_MASK1_CHANGEABLE: u32 = (1 << 1) | (1 << 16);

/// P_Key entries (`pkey_table_size` 0 encodes 128 << 0).
pub(crate) const PKEY_ENTRIES: usize = 128;
/// The default full-membership P_Key (IBTA), entry 0.
pub(crate) const DEFAULT_PKEY: u16 = 0xffff;
/// The link-local GID prefix fe80::/64 (IBTA: GID 0 is the default subnet prefix and the port GUID).
pub(crate) const LINK_LOCAL_PREFIX: u64 = 0xfe80_0000_0000_0000;
/// Blocks of the VLArbitrationTable (attribute modifier 1-4: low 0-31, low 32-63, high 0-31, high 32-63), each
/// an SMP's 64 bytes of attribute data.
pub(crate) const VL_ARB_BLOCKS: usize = 4;

/// The SMA's part of the port: what subnet management sets that no PRM command reports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SmaState {
    pub(crate) m_key: u64,
    pub(crate) m_key_lease_period: u16,
    pub(crate) m_key_protect_bits: u8,
    pub(crate) gid_prefix: u64,
    pub(crate) neighbor_mtu: u8,
    pub(crate) operational_vls: u8,
    pub(crate) vl_high_limit: u8,
    pub(crate) hoq_life: u8,
    pub(crate) enforcement: u8,
    /// SLtoVLMappingTable: 16 SLs, a nibble each.
    pub(crate) sl_to_vl: [u8; 8],
    /// VLArbitrationTable blocks 1-4 (only 1 and 3 within the capacities above).
    pub(crate) vl_arb: [[u8; 64]; VL_ARB_BLOCKS],
}

impl Default for SmaState {
    fn default() -> Self {
        Self {
            m_key: 0,
            m_key_lease_period: 0,
            m_key_protect_bits: 0,
            gid_prefix: LINK_LOCAL_PREFIX,
            neighbor_mtu: 5,
            // Until a subnet manager says otherwise, VL0 only (IBTA 14.2.5.6: OperationalVLs 1).
            operational_vls: 1,
            vl_high_limit: 0,
            hoq_life: 0,
            enforcement: 0,
            sl_to_vl: [0; 8],
            vl_arb: [[0; 64]; VL_ARB_BLOCKS],
        }
    }
}

/// `IB_PORT_INIT` / `IB_PORT_ACTIVE` as the `u8` PortInfo:PortState is.
pub(crate) const IB_INIT: u8 = consts::IB_PORT_INIT as u8;
pub(crate) const IB_ACTIVE: u8 = consts::IB_PORT_ACTIVE as u8;

/// One `roce_addr_layout` image as SET_ROCE_ADDRESS wrote it (all zeros: empty).
pub(crate) type RoceAddr = [u8; ifc::roce_addr_layout::SIZE_BYTES];

/// What the port looks like from the host.
#[derive(Debug, Clone)]
pub(crate) struct PortModel {
    pub(crate) port_type: PortType,
    pub(crate) up: bool,
    /// PAOS `admin_status` is up (mlx5e writes it on open and close; the link's own state is `up`).
    pub(crate) admin_up: bool,
    /// PMTU `max_mtu` / `oper_mtu` in bytes.
    pub(crate) max_mtu: u16,
    pub(crate) oper_mtu: u16,
    pub(crate) node_guid: u64,
    pub(crate) mac: [u8; 6],
    pub(crate) lid: u16,
    pub(crate) sm_lid: u16,
    /// PTYS and PortInfo facts from the configuration.
    pub(crate) info: PortInfo,
    /// Q_Key violations: UD packets dropped for a wrong Q_Key (IBA 10.2.4, the port's counter).
    pub(crate) qkey_viol_cntr: u16,
    /// What SET_DRIVER_VERSION wrote.
    pub(crate) driver_version: Option<String>,
    /// Whether the host-endianness register was written (`set_hca_ctrl`).
    pub(crate) host_endianness: Option<u8>,
    /// NIC vport `roce_en` (MODIFY_NIC_VPORT_CONTEXT, `fw/nic_vport.rs`); on from the start on Ethernet.
    pub(crate) roce_en: bool,
    /// The RoCE address (GID) table that SET_ROCE_ADDRESS programs.
    pub(crate) roce_table: Vec<RoceAddr>,
    /// What the NIC half counted (the Ethernet datapath counts, QUERY_VPORT_COUNTER reports).
    pub(crate) eth: EthCounters,
    /// The NIC vport context mlx5e writes: MTU, promiscuous bits (UC, MC, all), allowed lists by type (UC, MC,
    /// VLAN; raw 8-byte entries).
    pub(crate) vport_mtu: u16,
    pub(crate) promisc: [bool; 3],
    pub(crate) vport_lists: [Vec<[u8; 8]>; 3],
    /// PORT_CHANGE sub-types a command made due (a PAOS write changed the operational state, a Set(PortInfo)
    /// changed the LID or the logical state): the device layer posts them once the command completed.
    pub(crate) pending_change: Vec<u8>,
    /// The InfiniBand logical port state while the link is up (IBTA PortInfo:PortState, `IB_PORT_*`): Init until
    /// a subnet manager arms and activates the port through MAD_IFC, or Active from the start without one
    /// ([`SimConfig::subnet_manager`]).
    pub(crate) ib_state: u8,
    /// The P_Key table (entry 0 the default full-membership key until an SM writes PKeyTable).
    pub(crate) pkeys: Vec<u16>,
    /// What only subnet management sets (`fw/mad_ifc.rs`).
    pub(crate) sma: SmaState,
    /// NodeInfo:DeviceID (the PCI device id).
    pub(crate) device_id: u16,
    /// [`SimConfig::subnet_manager`]: a link that comes up is in Init, not Active.
    pub(crate) subnet_managed: bool,
}

/// The NIC half's traffic counters, named after `mlx5_ifc_vport_counter_set_bits` and the Q counter's
/// `out_of_buffer`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct EthCounters {
    pub(crate) transmitted_eth_unicast: Traffic,
    pub(crate) transmitted_eth_multicast: Traffic,
    pub(crate) transmitted_eth_broadcast: Traffic,
    pub(crate) received_eth_unicast: Traffic,
    pub(crate) received_eth_multicast: Traffic,
    pub(crate) received_eth_broadcast: Traffic,
    /// Frames no flow entry steered to an RQ (dropped by steering).
    pub(crate) rx_steer_missed: u64,
    /// Frames steered to an RQ with no receive WQE posted.
    pub(crate) out_of_buffer: u64,
}

/// Packets and octets of one kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Traffic {
    pub(crate) packets: u64,
    pub(crate) octets: u64,
}

impl EthCounters {
    /// Counts `frame` sent (`tx`) or received, by its destination MAC's kind.
    pub(crate) fn count(&mut self, tx: bool, frame: &[u8]) {
        let dst = frame.get(..6).unwrap_or(&[0; 6]);
        let t = match (tx, dst == [0xff; 6], dst[0] & 1 != 0) {
            (true, true, _) => &mut self.transmitted_eth_broadcast,
            (true, false, true) => &mut self.transmitted_eth_multicast,
            (true, false, false) => &mut self.transmitted_eth_unicast,
            (false, true, _) => &mut self.received_eth_broadcast,
            (false, false, true) => &mut self.received_eth_multicast,
            (false, false, false) => &mut self.received_eth_unicast,
        };
        t.packets += 1;
        t.octets += frame.len() as u64;
    }
}

impl PortModel {
    pub(crate) fn new(cfg: &SimConfig) -> Self {
        let ib = cfg.port_type == PortType::Ib;
        Self {
            port_type: cfg.port_type,
            up: cfg.port_up,
            admin_up: true,
            max_mtu: if ib { 4096 } else { 9216 },
            // An InfiniBand port runs one of the IB MTU sizes; a configured size that is not one means 4096.
            oper_mtu: if ib && mlx5_core::port::mtu_to_ib_mtu(cfg.port_mtu).is_none() { 4096 } else { cfg.port_mtu },
            node_guid: cfg.node_guid,
            mac: cfg.mac,
            // Under a subnet manager the port has no LID and knows no SM until the SM's Set(PortInfo).
            lid: if ib && !cfg.subnet_manager { cfg.lid } else { 0 },
            sm_lid: if ib && !cfg.subnet_manager { 1 } else { 0 },
            info: cfg.port_info,
            qkey_viol_cntr: 0,
            driver_version: None,
            host_endianness: None,
            eth: EthCounters::default(),
            pending_change: Vec::new(),
            ib_state: if cfg.subnet_manager { IB_INIT } else { IB_ACTIVE },
            pkeys: {
                let mut t = vec![0; PKEY_ENTRIES];
                t[0] = DEFAULT_PKEY;
                t
            },
            sma: SmaState::default(),
            device_id: cfg.pci_ids.1,
            subnet_managed: cfg.subnet_manager,
            vport_mtu: cfg.port_mtu,
            promisc: [false; 3],
            vport_lists: Default::default(),
            roce_en: cfg.port_type == PortType::Eth,
            roce_table: vec![[0; ifc::roce_addr_layout::SIZE_BYTES]; ROCE_ADDRESS_ENTRIES],
        }
    }

    /// `ACCESS_REGISTER`: host endianness (write), PMTU and PAOS (read, and on Ethernet write: mlx5e sets the
    /// MTU and the admin status when it opens), PTYS and PVLC (read) for local port 1.
    pub(crate) fn access_reg(&mut self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::access_register_in as i;
        let write = rd(inp, ifc::mbox_in::OP_MOD) == 0;
        let id = rd16(inp, i::REGISTER_ID);
        let data_off = i::REGISTER_DATA.byte_off();
        let data = &inp[data_off.min(inp.len())..];
        let out_off = ifc::access_register_out::REGISTER_DATA.byte_off();
        match id {
            consts::MLX5_REG_HOST_ENDIANNESS => {
                if !write || data.is_empty() {
                    return Err(bad_param(syndrome::REG_ACCESS));
                }
                self.host_endianness = Some(data[0]);
                Ok(())
            }
            consts::MLX5_REG_PMTU | consts::MLX5_REG_PAOS => {
                let (len, port_field) = if id == consts::MLX5_REG_PMTU {
                    (ifc::pmtu_reg::SIZE_BYTES, ifc::pmtu_reg::LOCAL_PORT)
                } else {
                    (ifc::paos_reg::SIZE_BYTES, ifc::paos_reg::LOCAL_PORT)
                };
                if data.len() < len || out.len() < out_off + len || (write && self.port_type != PortType::Eth) {
                    return Err(bad_param(syndrome::REG_ACCESS));
                }
                if rd(data, port_field) != 1 {
                    return Err(bad_param(syndrome::BAD_PORT));
                }
                if write {
                    return self.write_pmtu_paos(id, data);
                }
                let reg = &mut out[out_off..out_off + len];
                reg.copy_from_slice(&data[..len]);
                if id == consts::MLX5_REG_PMTU {
                    reg.set(ifc::pmtu_reg::MAX_MTU, self.max_mtu.into());
                    reg.set(ifc::pmtu_reg::ADMIN_MTU, self.oper_mtu.into());
                    reg.set(ifc::pmtu_reg::OPER_MTU, self.oper_mtu.into());
                } else {
                    let st = if self.up { consts::MLX5_PORT_UP } else { consts::MLX5_PORT_DOWN };
                    let st = if self.admin_up { st } else { consts::MLX5_PORT_DOWN };
                    let admin = if self.admin_up { consts::MLX5_PORT_UP } else { consts::MLX5_PORT_DOWN };
                    reg.set(ifc::paos_reg::ADMIN_STATUS, admin);
                    reg.set(ifc::paos_reg::OPER_STATUS, st);
                }
                Ok(())
            }
            consts::MLX5_REG_PPCNT => {
                use ifc::ppcnt_reg as p;
                let len = p::SIZE_BYTES;
                if write || self.port_type != PortType::Eth || data.len() < len || out.len() < out_off + len {
                    return Err(bad_param(syndrome::REG_ACCESS));
                }
                if rd(data, p::LOCAL_PORT) != 1 {
                    return Err(bad_param(syndrome::BAD_PORT));
                }
                let reg = &mut out[out_off..out_off + len];
                reg.copy_from_slice(&data[..len]);
                reg[p::COUNTER_SET.off..p::COUNTER_SET.off + p::COUNTER_SET.len].fill(0);
                // The IEEE 802.3 group counts what the port's wire carried; the other groups (RFC 2863, 2819,
                // per priority, physical layer) read as zeros: the simulated cable has no errors or pauses.
                if rd(data, p::GRP) == consts::MLX5_IEEE_802_3_COUNTERS_GROUP {
                    use ifc::eth_802_3_cntrs_grp_data_layout as g;
                    let e = &self.eth;
                    let sum = |a: Traffic, b: Traffic, c: Traffic| Traffic {
                        packets: a.packets + b.packets + c.packets,
                        octets: a.octets + b.octets + c.octets,
                    };
                    let tx = sum(e.transmitted_eth_unicast, e.transmitted_eth_multicast, e.transmitted_eth_broadcast);
                    let rx = sum(e.received_eth_unicast, e.received_eth_multicast, e.received_eth_broadcast);
                    let set = p::COUNTER_SET;
                    let mut put = |hi: Field, lo: Field, v: u64| {
                        reg.set(hi.at(set), (v >> 32) as u32);
                        reg.set(lo.at(set), v as u32);
                    };
                    put(g::A_FRAMES_TRANSMITTED_OK_HIGH, g::A_FRAMES_TRANSMITTED_OK_LOW, tx.packets);
                    put(g::A_FRAMES_RECEIVED_OK_HIGH, g::A_FRAMES_RECEIVED_OK_LOW, rx.packets);
                    put(g::A_OCTETS_TRANSMITTED_OK_HIGH, g::A_OCTETS_TRANSMITTED_OK_LOW, tx.octets);
                    put(g::A_OCTETS_RECEIVED_OK_HIGH, g::A_OCTETS_RECEIVED_OK_LOW, rx.octets);
                    let (mtx, btx) = (e.transmitted_eth_multicast.packets, e.transmitted_eth_broadcast.packets);
                    put(g::A_MULTICAST_FRAMES_XMITTED_OK_HIGH, g::A_MULTICAST_FRAMES_XMITTED_OK_LOW, mtx);
                    put(g::A_BROADCAST_FRAMES_XMITTED_OK_HIGH, g::A_BROADCAST_FRAMES_XMITTED_OK_LOW, btx);
                    let (mrx, brx) = (e.received_eth_multicast.packets, e.received_eth_broadcast.packets);
                    put(g::A_MULTICAST_FRAMES_RECEIVED_OK_HIGH, g::A_MULTICAST_FRAMES_RECEIVED_OK_LOW, mrx);
                    put(g::A_BROADCAST_FRAMES_RECEIVED_OK_HIGH, g::A_BROADCAST_FRAMES_RECEIVED_OK_LOW, brx);
                }
                Ok(())
            }
            consts::MLX5_REG_PFCC => {
                // Pause and PFC settings (read): none, the simulated cable carries no pause frames. Writes (ethtool
                // -A) are not modelled and are refused.
                use ifc::pfcc_reg as p;
                let len = p::SIZE_BYTES;
                if write || self.port_type != PortType::Eth || data.len() < len || out.len() < out_off + len {
                    return Err(bad_param(syndrome::REG_ACCESS));
                }
                if rd(data, p::LOCAL_PORT) != 1 {
                    return Err(bad_param(syndrome::BAD_PORT));
                }
                let reg = &mut out[out_off..out_off + len];
                reg.set(p::LOCAL_PORT, 1);
                Ok(())
            }
            consts::MLX5_REG_PVLC => {
                // Virtual lanes exist on InfiniBand ports only; a ConnectX-5 IB port has data VLs 0-7.
                use ifc::pvlc_reg as v;
                let len = v::SIZE_BYTES;
                if write || self.port_type != PortType::Ib || data.len() < len || out.len() < out_off + len {
                    return Err(bad_param(syndrome::REG_ACCESS));
                }
                if rd(data, v::LOCAL_PORT) != 1 {
                    return Err(bad_param(syndrome::BAD_PORT));
                }
                let reg = &mut out[out_off..out_off + len];
                reg.copy_from_slice(&data[..len]);
                reg.set(v::VL_HW_CAP, PVLC_VL_0_7);
                reg.set(v::VL_ADMIN, PVLC_VL_0_7);
                reg.set(v::VL_OPERATIONAL, PVLC_VL_0_7);
                Ok(())
            }
            consts::MLX5_REG_PTYS => {
                use ifc::ptys_reg as p;
                let len = p::SIZE_BYTES;
                if write || data.len() < len || out.len() < out_off + len {
                    return Err(bad_param(syndrome::REG_ACCESS));
                }
                if rd(data, p::LOCAL_PORT) != 1 {
                    return Err(bad_param(syndrome::BAD_PORT));
                }
                let ib = self.port_type == PortType::Ib;
                // The protocol asked for must be the port's own (`MLX5_PTYS_IB` or `MLX5_PTYS_EN`).
                let want = if ib { consts::MLX5_PTYS_IB } else { consts::MLX5_PTYS_EN };
                if rd(data, p::PROTO_MASK) != want {
                    return Err(bad_param(syndrome::REG_ACCESS));
                }
                let reg = &mut out[out_off..out_off + len];
                reg.copy_from_slice(&data[..len]);
                let up = self.up;
                if ib {
                    reg.set(p::IB_LINK_WIDTH_CAPABILITY, self.info.ib_link_width_oper.into());
                    reg.set(p::IB_PROTO_CAPABILITY, self.info.ib_proto_oper.into());
                    reg.set(p::IB_LINK_WIDTH_OPER, if up { self.info.ib_link_width_oper.into() } else { 0 });
                    reg.set(p::IB_PROTO_OPER, if up { self.info.ib_proto_oper.into() } else { 0 });
                } else {
                    // A ConnectX-5 reports the legacy protocol list only (no extended capability).
                    reg.set(p::ETH_PROTO_CAPABILITY, self.info.eth_proto_oper);
                    reg.set(p::ETH_PROTO_ADMIN, self.info.eth_proto_oper);
                    reg.set(p::ETH_PROTO_OPER, if up { self.info.eth_proto_oper } else { 0 });
                }
                Ok(())
            }
            _ => Err(bad_param(syndrome::REG_ACCESS)),
        }
    }

    pub(crate) fn set_driver_version(&mut self, inp: &[u8], supported: bool) -> Result<(), CmdErr> {
        if !supported {
            return Err(bad_param(syndrome::CAP_NOT_SET));
        }
        let arr = ifc::set_driver_version_in::DRIVER_VERSION;
        let raw = &inp[arr.byte_off()..arr.byte_off() + arr.count as usize];
        let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
        self.driver_version = Some(String::from_utf8_lossy(&raw[..end]).into_owned());
        Ok(())
    }

    pub(crate) fn query_vport_state(&self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        if rd(inp, ifc::query_vport_state_in::OTHER_VPORT) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        if rd16(inp, ifc::mbox_in::OP_MOD) != consts::MLX5_VPORT_STATE_OP_MOD_VNIC_VPORT {
            return Err(bad_param(syndrome::BAD_OP_MOD));
        }
        // An InfiniBand vport is up once its port is Active, not when the link trains.
        let active = self.port_type != PortType::Ib || self.ib_state == IB_ACTIVE;
        let up = if self.oper_up() && active {
            consts::MLX5_QUERY_VPORT_STATE_OUT_STATE_UP
        } else {
            consts::MLX5_QUERY_VPORT_STATE_OUT_STATE_DOWN
        };
        out.set(ifc::query_vport_state_out::STATE, up);
        out.set(ifc::query_vport_state_out::ADMIN_STATE, consts::MLX5_VPORT_ADMIN_STATE_AUTO);
        Ok(())
    }

    /// SET_ROCE_ADDRESS: stores (or, all zeros, clears) an entry after checking the port, index, version and L3 type.
    pub(crate) fn set_roce_address(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::roce_addr_layout as r;
        use ifc::set_roce_address_in as i;
        if self.port_type != PortType::Eth || !matches!(rd(inp, i::VHCA_PORT_NUM), 0 | 1) {
            return Err(bad_param(syndrome::BAD_PORT));
        }
        let index = usize::from(rd16(inp, i::ROCE_ADDRESS_INDEX));
        let sub = i::ROCE_ADDRESS;
        let version = rd(inp, r::ROCE_VERSION.at(sub));
        let l3 = rd(inp, r::ROCE_L3_TYPE.at(sub));
        let version_ok = matches!(version, consts::MLX5_ROCE_VERSION_1 | consts::MLX5_ROCE_VERSION_2);
        let l3_ok = matches!(l3, consts::MLX5_ROCE_L3_TYPE_IPV4 | consts::MLX5_ROCE_L3_TYPE_IPV6);
        let slot = self.roce_table.get_mut(index).ok_or(bad_param(syndrome::GID_INDEX))?;
        if !version_ok || !l3_ok {
            return Err(bad_param(syndrome::ROCE_ADDRESS));
        }
        slot.copy_from_slice(&inp[sub.off..sub.off + sub.len]);
        Ok(())
    }

    /// QUERY_ROCE_ADDRESS: returns an entry as it was stored (all zeros when empty).
    pub(crate) fn query_roce_address(&self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::query_roce_address_in as i;
        if self.port_type != PortType::Eth || !matches!(rd(inp, i::VHCA_PORT_NUM), 0 | 1) {
            return Err(bad_param(syndrome::BAD_PORT));
        }
        let index = usize::from(rd16(inp, i::ROCE_ADDRESS_INDEX));
        let entry = self.roce_table.get(index).ok_or(bad_param(syndrome::GID_INDEX))?;
        let sub = ifc::query_roce_address_out::ROCE_ADDRESS;
        out[sub.off..sub.off + sub.len].copy_from_slice(entry);
        Ok(())
    }

    /// Whether RoCE GID table entry `index` holds an address.
    pub(crate) fn roce_gid_set(&self, index: u32) -> bool {
        self.roce_gid(index).is_some()
    }

    /// The GID of RoCE GID table entry `index`, when it holds one.
    pub(crate) fn roce_gid(&self, index: u32) -> Option<[u8; 16]> {
        let at = ifc::roce_addr_layout::SOURCE_L3_ADDRESS.byte_off();
        let e = usize::try_from(index).ok().and_then(|i| self.roce_table.get(i))?;
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&e[at..at + 16]);
        (gid != [0; 16]).then_some(gid)
    }

    /// Whether some RoCE GID table entry holds `gid` (a link-local, IPv4-mapped or other IPv6 address).
    pub(crate) fn holds_roce_gid(&self, gid: &[u8; 16]) -> bool {
        let at = ifc::roce_addr_layout::SOURCE_L3_ADDRESS.byte_off();
        *gid != [0; 16] && self.roce_table.iter().any(|e| e[at..at + 16] == gid[..])
    }

    pub(crate) fn query_nic_vport_context(&self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::nic_vport_context as n;
        if rd(inp, ifc::query_nic_vport_context_in::OTHER_VPORT) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let base = ifc::query_nic_vport_context_out::NIC_VPORT_CONTEXT;
        out.set(n::ROCE_EN.at(base), u32::from(self.roce_en));
        out.set(n::MTU.at(base), self.vport_mtu.into());
        for (bit, on) in [n::PROMISC_UC, n::PROMISC_MC, n::PROMISC_ALL].into_iter().zip(self.promisc) {
            out.set(bit.at(base), on.into());
        }
        out.set(n::QKEY_VIOLATION_COUNTER.at(base), self.qkey_viol_cntr.into());
        out.set64(n::SYSTEM_IMAGE_GUID.at(base), self.node_guid);
        out.set64(n::PORT_GUID.at(base), self.node_guid);
        out.set64(n::NODE_GUID.at(base), self.node_guid);
        let mac_sub = n::PERMANENT_ADDRESS.at(base);
        let m = self.mac;
        out.set(ifc::mac_address_layout::MAC_ADDR_47_32.at(mac_sub), u32::from(u16::from_be_bytes([m[0], m[1]])));
        out.set(ifc::mac_address_layout::MAC_ADDR_31_0.at(mac_sub), u32::from_be_bytes([m[2], m[3], m[4], m[5]]));
        Ok(())
    }

    pub(crate) fn query_hca_vport_context(&self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::hca_vport_context as h;
        if self.port_type != PortType::Ib {
            // An Ethernet function has no InfiniBand vport context.
            return Err(bad_param(syndrome::BAD_PORT));
        }
        if rd(inp, ifc::query_hca_vport_context_in::OTHER_VPORT) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        // A single-port function takes 0 (what Linux sends unless num_ports == 2) or 1 for its port.
        if !matches!(rd(inp, ifc::query_hca_vport_context_in::PORT_NUM), 0 | 1) {
            return Err(bad_param(syndrome::BAD_PORT));
        }
        let base = ifc::query_hca_vport_context_out::HCA_VPORT_CONTEXT;
        let (state, phys) = if self.up {
            (u32::from(self.ib_state), consts::IB_PORT_PHYS_STATE_LINK_UP)
        } else {
            (consts::IB_PORT_DOWN, consts::IB_PORT_PHYS_STATE_POLLING)
        };
        out.set(h::PORT_PHYSICAL_STATE.at(base), phys);
        out.set(h::PORT_STATE.at(base), state);
        out.set(h::VPORT_STATE.at(base), state);
        // A physical function's port has the SMA (mlx5_ib's set_has_smi_cap: MAD_IFC serves QP0).
        out.set(h::HAS_SMI.at(base), 1);
        out.set64(h::SYSTEM_IMAGE_GUID.at(base), self.node_guid);
        out.set64(h::PORT_GUID.at(base), self.node_guid);
        out.set64(h::NODE_GUID.at(base), self.node_guid);
        out.set(h::LID.at(base), self.lid.into());
        out.set(h::SM_LID.at(base), self.sm_lid.into());
        let i = &self.info;
        out.set(h::CAP_MASK1.at(base), i.cap_mask1);
        out.set(h::CAP_MASK1_FIELD_SELECT.at(base), CAP_MASK1_CHANGEABLE);
        out.set(h::CAP_MASK2.at(base), i.cap_mask2);
        out.set(h::LMC.at(base), i.lmc.into());
        out.set(h::SM_SL.at(base), i.sm_sl.into());
        out.set(h::SUBNET_TIMEOUT.at(base), i.subnet_timeout.into());
        out.set(h::INIT_TYPE_REPLY.at(base), i.init_type_reply.into());
        out.set(h::GRH_REQUIRED.at(base), u32::from(i.grh_required));
        out.set(h::QKEY_VIOLATION_COUNTER.at(base), self.qkey_viol_cntr.into());
        Ok(())
    }
}

impl PortModel {
    /// The operational state: the link is up and the host has not taken the port down (PAOS).
    pub(crate) fn oper_up(&self) -> bool {
        self.up && self.admin_up
    }

    /// A PMTU write (`admin_mtu`, within 64 bytes and `max_mtu`, becomes the operational MTU) or a PAOS write
    /// (`admin_status` up or down, with `ase`, as `mlx5_set_port_admin_status` sends it).
    fn write_pmtu_paos(&mut self, id: u16, data: &[u8]) -> Result<(), CmdErr> {
        if id == consts::MLX5_REG_PMTU {
            let mtu = rd(data, ifc::pmtu_reg::ADMIN_MTU);
            if !(64..=u32::from(self.max_mtu)).contains(&mtu) {
                return Err(bad_param(syndrome::REG_ACCESS));
            }
            self.oper_mtu = mtu as u16;
            return Ok(());
        }
        if rd(data, ifc::paos_reg::ASE) == 0 {
            // Without `ase` the admin status is not to be changed.
            return Ok(());
        }
        let before = self.up && self.admin_up;
        self.admin_up = match rd(data, ifc::paos_reg::ADMIN_STATUS) {
            consts::MLX5_PORT_UP => true,
            consts::MLX5_PORT_DOWN => false,
            _ => return Err(bad_param(syndrome::REG_ACCESS)),
        };
        // Taking the port down administratively drops the link, bringing it up raises it: an event either way.
        let after = self.up && self.admin_up;
        if before != after {
            let sub =
                if after { consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE } else { consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN };
            self.pending_change.push(sub);
        }
        Ok(())
    }

    /// QUERY_VPORT_COUNTER of the function's own vport: the NIC traffic counters (Ethernet only; `clear` zeroes
    /// them after the read, as firmware does).
    pub(crate) fn query_vport_counter(&mut self, inp: &[u8], out: &mut [u8]) -> Result<(), CmdErr> {
        use ifc::query_vport_counter_in as i;
        use ifc::query_vport_counter_out as o;
        if self.port_type != PortType::Eth {
            return Err(bad_param(syndrome::BAD_PORT));
        }
        if rd(inp, i::OTHER_VPORT) != 0 || rd(inp, i::VPORT_NUMBER) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        let e = self.eth;
        for (sub, t) in [
            (o::RECEIVED_ETH_UNICAST, e.received_eth_unicast),
            (o::RECEIVED_ETH_MULTICAST, e.received_eth_multicast),
            (o::RECEIVED_ETH_BROADCAST, e.received_eth_broadcast),
            (o::TRANSMITTED_ETH_UNICAST, e.transmitted_eth_unicast),
            (o::TRANSMITTED_ETH_MULTICAST, e.transmitted_eth_multicast),
            (o::TRANSMITTED_ETH_BROADCAST, e.transmitted_eth_broadcast),
        ] {
            out.set64(ifc::traffic_counter::PACKETS.at(sub), t.packets);
            out.set64(ifc::traffic_counter::OCTETS.at(sub), t.octets);
        }
        if rd(inp, i::CLEAR) != 0 {
            self.eth = EthCounters {
                rx_steer_missed: e.rx_steer_missed,
                out_of_buffer: e.out_of_buffer,
                ..Default::default()
            };
        }
        Ok(())
    }

    /// MODIFY_HCA_VPORT_CONTEXT of the port's own vport: the PortInfo capability bits named by
    /// `cap_mask1_field_select` take their values from `cap_mask1` (mlx5_ib's `set_port_caps_atomic`). A bit
    /// outside [`CAP_MASK1_CHANGEABLE`], or a GUID or state-policy change (`field_select`, for other vports
    /// only), is refused.
    pub(crate) fn modify_hca_vport_context(&mut self, inp: &[u8]) -> Result<(), CmdErr> {
        use ifc::hca_vport_context as h;
        use ifc::modify_hca_vport_context_in as i;
        if self.port_type != PortType::Ib {
            return Err(bad_param(syndrome::BAD_PORT));
        }
        if rd(inp, i::OTHER_VPORT) != 0 || rd(inp, i::VPORT_NUMBER) != 0 {
            return Err(bad_param(syndrome::BAD_FUNCTION));
        }
        if !matches!(rd(inp, i::PORT_NUM), 0 | 1) {
            return Err(bad_param(syndrome::BAD_PORT));
        }
        let base = i::HCA_VPORT_CONTEXT;
        let sel = rd(inp, h::CAP_MASK1_FIELD_SELECT.at(base));
        if rd(inp, h::FIELD_SELECT.at(base)) != 0 || sel & !CAP_MASK1_CHANGEABLE != 0 {
            return Err(bad_param(syndrome::FIELD_SELECT));
        }
        let v = rd(inp, h::CAP_MASK1.at(base));
        self.info.cap_mask1 = (self.info.cap_mask1 & !sel) | (v & sel);
        Ok(())
    }

    /// The port's link goes down or comes up: the state QUERY_VPORT_STATE and PAOS report follows, and a
    /// PORT_CHANGE EQE (`MLX5_PORT_CHANGE_SUBTYPE_DOWN` / `_ACTIVE`, port 1 in the upper nibble of
    /// `data.port.port`) goes to the EQ subscribed to port changes. Nothing happens when the state is already so.
    pub(crate) fn set_up(&mut self, post: &mut EqPost, up: bool) -> Option<u8> {
        if self.up == up || post.regs.dead() {
            return None;
        }
        self.up = up;
        // Under a subnet manager a link that trains is Init (INITIALIZED, which mlx5_ib reports as a port
        // error: not yet usable) until the SM activates it.
        let sm = up && self.subnet_managed && self.port_type == PortType::Ib;
        self.ib_state = if sm { IB_INIT } else { IB_ACTIVE };
        let sub = match (up, sm) {
            (false, _) => consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN,
            (true, true) => consts::MLX5_PORT_CHANGE_SUBTYPE_INITIALIZED,
            (true, false) => consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE,
        };
        post.port_change(sub)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::events::SimEvent;
    use crate::testkit::submit::Harness;

    fn pvlc(h: &mut Harness, local_port: u32) -> (u8, u32, u32) {
        use ifc::access_register_in as i;
        let len = ifc::pvlc_reg::SIZE_BYTES;
        let data = i::REGISTER_DATA.byte_off();
        let mut inp = vec![0u8; data + len];
        inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_ACCESS_REG.into());
        inp.set(ifc::mbox_in::OP_MOD, consts::MLX5_ACCESS_REGISTER_IN_OP_MOD_READ);
        inp.set(i::REGISTER_ID, consts::MLX5_REG_PVLC.into());
        inp[data..].set(ifc::pvlc_reg::LOCAL_PORT, local_port);
        let out_data = ifc::access_register_out::REGISTER_DATA.byte_off();
        let (status, syndrome, out) = h.cmd(&inp, out_data + len);
        (status, syndrome, rd(&out[out_data..], ifc::pvlc_reg::VL_HW_CAP))
    }

    #[test]
    fn pvlc_reports_vl0_to_vl7_on_the_ib_port_only() {
        // mlx5_ib's IB port query (mlx5_query_hca_port) ends with PVLC; unserved, the probe failed under UML.
        let mut h = Harness::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
        h.bring_up();
        assert_eq!(pvlc(&mut h, 1), (0, 0, PVLC_VL_0_7));
        assert_eq!(pvlc(&mut h, 2).1, syndrome::BAD_PORT);
        let mut e = Harness::new(SimConfig { port_type: PortType::Eth, ..SimConfig::default() });
        e.bring_up();
        assert_eq!(pvlc(&mut e, 1).1, syndrome::REG_ACCESS);
    }

    #[test]
    fn set_port_caps_atomic_changes_is_cm_as_mlx5_ib_asks_and_nothing_else() {
        use ifc::hca_vport_context as v;
        let mut h = Harness::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
        h.bring_up();
        let query = |h: &mut Harness| {
            let (s, _, out) = h.simple(
                consts::MLX5_CMD_OP_QUERY_HCA_VPORT_CONTEXT,
                0,
                ifc::query_hca_vport_context_in::SIZE_BYTES,
                ifc::query_hca_vport_context_out::SIZE_BYTES,
            );
            assert_eq!(s, 0);
            let base = ifc::query_hca_vport_context_out::HCA_VPORT_CONTEXT;
            (rd(&out, v::CAP_MASK1.at(base)), rd(&out, v::CAP_MASK1_FIELD_SELECT.at(base)))
        };
        let (mask, perm) = query(&mut h);
        // mlx5_ib checks the bit it changes against the permitted ones before it sends the change.
        assert_ne!(perm & 0x1_0000, 0);
        let modify = |h: &mut Harness, sel: u32, value: u32| {
            use ifc::modify_hca_vport_context_in as i;
            let mut inp = vec![0u8; i::SIZE_BYTES];
            inp.set(i::OPCODE, consts::MLX5_CMD_OP_MODIFY_HCA_VPORT_CONTEXT.into());
            inp.set(i::PORT_NUM, 1);
            inp.set(v::CAP_MASK1_FIELD_SELECT.at(i::HCA_VPORT_CONTEXT), sel);
            inp.set(v::CAP_MASK1.at(i::HCA_VPORT_CONTEXT), value);
            h.cmd(&inp, ifc::modify_hca_vport_context_out::SIZE_BYTES).1
        };
        assert_eq!(modify(&mut h, 0x1_0000, 0), 0);
        assert_eq!(query(&mut h).0, mask & !0x1_0000);
        assert_eq!(modify(&mut h, 0x1_0000, 0x1_0000), 0);
        assert_eq!(query(&mut h).0, mask);
        // A bit the port does not let change is refused, and the mask stays.
        assert_eq!(modify(&mut h, 1 << 3, 0), syndrome::FIELD_SELECT);
        assert_eq!(query(&mut h).0, mask);
    }

    #[test]
    fn mlx5e_sets_the_ethernet_port_s_mtu_and_admin_status_and_reads_them_back() {
        use ifc::access_register_in as i;
        let mut h = Harness::new(SimConfig { port_type: PortType::Eth, ..SimConfig::default() });
        h.bring_up();
        // (register, write, edit) -> (status, syndrome, register image)
        let reg = |h: &mut Harness, id: u16, write: bool, edit: &dyn Fn(&mut [u8])| {
            let len = ifc::paos_reg::SIZE_BYTES.max(ifc::pmtu_reg::SIZE_BYTES);
            let data = i::REGISTER_DATA.byte_off();
            let mut inp = vec![0u8; data + len];
            inp.set(ifc::mbox_in::OPCODE, consts::MLX5_CMD_OP_ACCESS_REG.into());
            let op = if write { 0 } else { consts::MLX5_ACCESS_REGISTER_IN_OP_MOD_READ };
            inp.set(ifc::mbox_in::OP_MOD, op);
            inp.set(i::REGISTER_ID, id.into());
            inp[data..].set(ifc::paos_reg::LOCAL_PORT, 1);
            edit(&mut inp[data..]);
            let out_data = ifc::access_register_out::REGISTER_DATA.byte_off();
            let (s, y, out) = h.cmd(&inp, out_data + len);
            (s, y, out[out_data..].to_vec())
        };
        let pmtu = consts::MLX5_REG_PMTU;
        assert_eq!(reg(&mut h, pmtu, true, &|d| d.set(ifc::pmtu_reg::ADMIN_MTU, 1522)).1, 0);
        assert_eq!(rd(&reg(&mut h, pmtu, false, &|_| {}).2, ifc::pmtu_reg::OPER_MTU), 1522);
        assert_eq!(reg(&mut h, pmtu, true, &|d| d.set(ifc::pmtu_reg::ADMIN_MTU, 20_000)).1, syndrome::REG_ACCESS);
        let paos = consts::MLX5_REG_PAOS;
        let down = |d: &mut [u8]| {
            d.set(ifc::paos_reg::ADMIN_STATUS, consts::MLX5_PORT_DOWN);
            d.set(ifc::paos_reg::ASE, 1);
        };
        // An EQ for port changes, as mlx5_core's async EQ subscribes to them.
        let uar = h.alloc_uar();
        let (s, eqn, _eq) = h.create_eq(uar, 4, 1 << consts::MLX5_EVENT_TYPE_PORT_CHANGE);
        assert_eq!(s, 0);
        let changes = |h: &Harness| -> Vec<u8> {
            let pc = consts::MLX5_EVENT_TYPE_PORT_CHANGE;
            let e = h.dev.events();
            e.iter()
                .filter_map(|e| match *e {
                    SimEvent::Eqe { eqn: n, event_type, sub_type } if n == eqn && event_type == pc => Some(sub_type),
                    _ => None,
                })
                .collect()
        };
        assert_eq!(reg(&mut h, paos, true, &down).1, 0);
        let r = reg(&mut h, paos, false, &|_| {}).2;
        assert_eq!((rd(&r, ifc::paos_reg::ADMIN_STATUS), rd(&r, ifc::paos_reg::OPER_STATUS)), (2, 2));
        assert_eq!(changes(&h), [consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN]);
        // Down again: no change, no event.
        assert_eq!(reg(&mut h, paos, true, &down).1, 0);
        assert_eq!(changes(&h).len(), 1);
        // Without `ase` nothing changes.
        assert_eq!(reg(&mut h, paos, true, &|d| d.set(ifc::paos_reg::ADMIN_STATUS, consts::MLX5_PORT_UP)).1, 0);
        assert_eq!(rd(&reg(&mut h, paos, false, &|_| {}).2, ifc::paos_reg::ADMIN_STATUS), consts::MLX5_PORT_DOWN);
        // Up with `ase`: the link comes back and says so.
        let up = |d: &mut [u8]| {
            d.set(ifc::paos_reg::ADMIN_STATUS, consts::MLX5_PORT_UP);
            d.set(ifc::paos_reg::ASE, 1);
        };
        assert_eq!(reg(&mut h, paos, true, &up).1, 0);
        let r = reg(&mut h, paos, false, &|_| {}).2;
        assert_eq!(rd(&r, ifc::paos_reg::OPER_STATUS), consts::MLX5_PORT_UP);
        let want = [consts::MLX5_PORT_CHANGE_SUBTYPE_DOWN, consts::MLX5_PORT_CHANGE_SUBTYPE_ACTIVE];
        assert_eq!(changes(&h), want);
        // An InfiniBand port's MTU and status are not the host's to write.
        let mut ib = Harness::new(SimConfig { port_type: PortType::Ib, ..SimConfig::default() });
        ib.bring_up();
        assert_eq!(reg(&mut ib, paos, true, &down).1, syndrome::REG_ACCESS);
    }
}
