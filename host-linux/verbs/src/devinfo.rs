//! What `ibv_devinfo -v` users expect, read from a brought-up HCA (capabilities, vport contexts, the PMTU
//! register) and computed the way `mlx5_ib_query_device` / `mlx5_ib_query_port` do. `mlx5 devinfo` prints it and
//! the drop-in libibverbs answers `ibv_query_device` / `ibv_query_port` from it, so it lives here, below both.

use mlx5_core::caps::PortType;
use mlx5_core::hal::{DelayNs, Dma, Mmio};
use mlx5_core::hca::{Error, Hca, PageStats, Tables};
use mlx5_core::prm::{consts, ifc};
use mlx5_core::reg::{pmtu_read, PortMtu};
use mlx5_core::trace::CmdTrace;
use mlx5_core::vport::{
    ib_mtu_bytes, ib_mtu_enum, iboe_mtu, QueryHcaVportContext, QueryNicVportContext, QueryVportState,
};
use serde_json::json;

/// Link layer of a port (`ibv_port_attr.link_layer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkLayer {
    InfiniBand,
    Ethernet,
}

impl LinkLayer {
    pub fn name(self) -> &'static str {
        match self {
            LinkLayer::InfiniBand => "InfiniBand",
            LinkLayer::Ethernet => "Ethernet",
        }
    }
}

/// One port (`ibv_port_attr`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PortInfo {
    pub port: u8,
    /// `IB_PORT_*` (`PORT_ACTIVE` = 4).
    pub state: u8,
    pub phys_state: u8,
    /// IB MTU enums (`IB_MTU_256` = 1 .. `IB_MTU_4096` = 5).
    pub max_mtu: u8,
    pub active_mtu: u8,
    pub link_layer: LinkLayer,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub gid_tbl_len: u32,
    pub max_msg_sz: u64,
}

/// The device (`ibv_device_attr` plus identity).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevInfo {
    pub hca_id: String,
    pub fw_version: String,
    pub node_guid: u64,
    pub sys_image_guid: u64,
    /// PCI vendor and device ids as the transport reports them.
    pub vendor_id: u16,
    pub device_id: u16,
    pub phys_port_cnt: u8,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub max_qp: u32,
    pub max_qp_wr: u32,
    pub max_sge: u32,
    pub max_inline_data: u32,
    /// CQs one can create: `1 << log_max_cq` less CQN 0, which the device never hands out (see `numbered`).
    pub max_cq: u32,
    pub max_cqe: u32,
    /// Memory regions: `1 << log_max_mkey` less mkey index 0.
    pub max_mr: u32,
    /// Protection domains: `1 << log_max_pd` less PD 0.
    pub max_pd: u32,
    pub max_qp_rd_atom: u32,
    pub max_qp_init_rd_atom: u32,
    pub max_srq: u32,
    pub max_srq_wr: u32,
    /// Scatter entries per SRQ WQE: the receive limit less the SRQ's next-WQE segment (`max_rq_sg - 1`, mlx5_ib).
    pub max_srq_sge: u32,
    pub max_pkeys: u32,
    pub atomic: bool,
    pub ports: Vec<PortInfo>,
    pub pages: PageStats,
}

/// `IB_PORT_*` names as ibv_devinfo prints them.
pub fn port_state_name(s: u8) -> &'static str {
    match u32::from(s) {
        consts::IB_PORT_NOP => "PORT_NOP",
        consts::IB_PORT_DOWN => "PORT_DOWN",
        consts::IB_PORT_INIT => "PORT_INIT",
        consts::IB_PORT_ARMED => "PORT_ARMED",
        consts::IB_PORT_ACTIVE => "PORT_ACTIVE",
        consts::IB_PORT_ACTIVE_DEFER => "PORT_ACTIVE_DEFER",
        _ => "invalid state",
    }
}

/// A GUID as ibv_devinfo prints it: four groups of 16 bits.
pub fn guid(g: u64) -> String {
    format!("{:04x}:{:04x}:{:04x}:{:04x}", g >> 48, (g >> 32) & 0xffff, (g >> 16) & 0xffff, g & 0xffff)
}

fn pow2(log: u8) -> u32 {
    1u32.checked_shl(u32::from(log)).unwrap_or(0)
}

/// How many objects a number space of `2^log` holds for a caller: number 0 of a CQ or PD is never
/// handed out (the simulated device starts each at 1; the capability names the space, not what is left of it).
/// mlx5_ib reports the whole `1 << log`; a test creates exactly this many and is refused the next, so what is
/// shown is what is honoured (`tests/all/verbs_limits.rs`).
fn numbered(log: u8) -> u32 {
    pow2(log).saturating_sub(1)
}

/// How many memory keys a key space of `2^log` holds for a caller: index 0 is never handed out, nor index 1,
/// whose key with variant 0 is 0x100, `MLX5_INVALID_LKEY` (the key that ends a scatter list).
fn mkeys(log: u8) -> u32 {
    pow2(log).saturating_sub(2)
}

/// Reads everything `devinfo` shows. Only queries: nothing on the device changes.
pub fn query<M: Mmio, D: Dma, T: CmdTrace, S: Tables>(
    hca: &mut Hca<M, D, T, S>,
    delay: &mut impl DelayNs,
    hca_id: &str,
    pci_ids: (u16, u16),
) -> Result<DevInfo, Error> {
    let caps = *hca.caps();
    let g = caps.general;
    let link_layer = match g.port_type() {
        PortType::InfiniBand => LinkLayer::InfiniBand,
        _ => LinkLayer::Ethernet,
    };
    let (node_guid, sys_image_guid) = match link_layer {
        LinkLayer::Ethernet => {
            let n = hca.exec(&mut QueryNicVportContext, delay)?;
            (n.node_guid, n.system_image_guid)
        }
        LinkLayer::InfiniBand => {
            let h = hca.exec(&mut QueryHcaVportContext { port_num: 1 }, delay)?;
            (h.node_guid, h.system_image_guid)
        }
    };
    let mut ports = Vec::new();
    for port in 1..=g.num_ports.max(1) {
        let mut data = [0u8; ifc::pmtu_reg::SIZE_BYTES];
        hca.exec(&mut pmtu_read(port, &mut data), delay)?;
        let mtu = PortMtu::parse(&data);
        let info = match link_layer {
            LinkLayer::Ethernet => {
                let vs = hca.exec(&mut QueryVportState, delay)?;
                let (state, phys_state) = if vs.is_up() {
                    (consts::IB_PORT_ACTIVE, consts::IB_PORT_PHYS_STATE_LINK_UP)
                } else {
                    (consts::IB_PORT_DOWN, consts::IB_PORT_PHYS_STATE_DISABLED)
                };
                let max_mtu = iboe_mtu(mtu.max_mtu.into());
                PortInfo {
                    port,
                    state: state as u8,
                    phys_state: phys_state as u8,
                    max_mtu,
                    active_mtu: iboe_mtu(mtu.oper_mtu.into()).min(max_mtu),
                    link_layer,
                    lid: 0,
                    sm_lid: 0,
                    lmc: 0,
                    gid_tbl_len: caps.roce_address_table_size.map_or(0, u32::from),
                    max_msg_sz: 1u64 << g.log_max_msg.min(63),
                }
            }
            LinkLayer::InfiniBand => {
                let h = hca.exec(&mut QueryHcaVportContext { port_num: port }, delay)?;
                PortInfo {
                    port,
                    state: h.port_state,
                    phys_state: h.port_physical_state,
                    max_mtu: ib_mtu_enum(mtu.max_mtu.into()),
                    active_mtu: ib_mtu_enum(mtu.oper_mtu.into()),
                    link_layer,
                    lid: h.lid,
                    sm_lid: h.sm_lid,
                    lmc: h.lmc,
                    gid_tbl_len: u32::from(g.gid_table_size),
                    max_msg_sz: 1u64 << g.log_max_msg.min(63),
                }
            }
        };
        ports.push(info);
    }
    let (maj, min, sub) = hca.fw_rev();
    Ok(DevInfo {
        hca_id: hca_id.to_string(),
        fw_version: format!("{maj}.{min}.{sub}"),
        node_guid,
        sys_image_guid,
        vendor_id: pci_ids.0,
        device_id: pci_ids.1,
        phys_port_cnt: g.num_ports,
        max_mr_size: u64::MAX,
        page_size_cap: !((1u64 << g.log_pg_sz.min(63)) - 1),
        max_qp: pow2(g.log_max_qp),
        max_qp_wr: pow2(g.log_max_qp_sz),
        max_sge: g.max_sge(),
        max_inline_data: g.max_inline_data(),
        max_cq: numbered(g.log_max_cq),
        max_cqe: pow2(g.log_max_cq_sz).saturating_sub(1),
        max_mr: mkeys(g.log_max_mkey),
        max_pd: numbered(g.log_max_pd),
        max_qp_rd_atom: pow2(g.log_max_ra_res_qp),
        max_qp_init_rd_atom: pow2(g.log_max_ra_req_qp),
        max_srq: pow2(g.log_max_srq),
        max_srq_wr: pow2(g.log_max_srq_sz).saturating_sub(1),
        max_srq_sge: g.max_rq_sge().saturating_sub(1),
        // `mlx5_to_sw_pkey_sz`: 128 entries shifted by the encoded size.
        max_pkeys: consts::MLX5_MIN_PKEY_TABLE_SIZE << g.pkey_table_size.min(consts::MLX5_MAX_LOG_PKEY_TABLE),
        atomic: g.atomic,
        ports,
        pages: hca.page_stats(),
    })
}

impl DevInfo {
    /// The `ibv_devinfo -v` layout (tabs and all).
    pub fn text(&self) -> String {
        let mut s = format!(
            "hca_id:\t{}\n\ttransport:\t\t\tInfiniBand (0)\n\tfw_ver:\t\t\t\t{}\n\tnode_guid:\t\t\t{}\n\
             \tsys_image_guid:\t\t\t{}\n\tvendor_id:\t\t\t0x{:04x}\n\tvendor_part_id:\t\t\t{}\n\
             \tphys_port_cnt:\t\t\t{}\n\tmax_mr_size:\t\t\t0x{:x}\n\tpage_size_cap:\t\t\t0x{:x}\n\
             \tmax_qp:\t\t\t\t{}\n\tmax_qp_wr:\t\t\t{}\n\tmax_sge:\t\t\t{}\n\tmax_inline_data:\t\t{}\n\
             \tmax_cq:\t\t\t\t{}\n\tmax_cqe:\t\t\t{}\n\tmax_mr:\t\t\t\t{}\n\tmax_pd:\t\t\t\t{}\n\
             \tmax_qp_rd_atom:\t\t\t{}\n\tmax_qp_init_rd_atom:\t\t{}\n\tmax_srq:\t\t\t{}\n\
             \tmax_srq_wr:\t\t\t{}\n\tmax_srq_sge:\t\t\t{}\n\tmax_pkeys:\t\t\t{}\n\tatomic_cap:\t\t\t{}\n",
            self.hca_id,
            self.fw_version,
            guid(self.node_guid),
            guid(self.sys_image_guid),
            self.vendor_id,
            self.device_id,
            self.phys_port_cnt,
            self.max_mr_size,
            self.page_size_cap,
            self.max_qp,
            self.max_qp_wr,
            self.max_sge,
            self.max_inline_data,
            self.max_cq,
            self.max_cqe,
            self.max_mr,
            self.max_pd,
            self.max_qp_rd_atom,
            self.max_qp_init_rd_atom,
            self.max_srq,
            self.max_srq_wr,
            self.max_srq_sge,
            self.max_pkeys,
            if self.atomic { "ATOMIC_HCA (1)" } else { "ATOMIC_NONE (0)" },
        );
        for p in &self.ports {
            s.push_str(&format!(
                "\t\tport:\t{}\n\t\t\tstate:\t\t\t{} ({})\n\t\t\tmax_mtu:\t\t{} ({})\n\
                 \t\t\tactive_mtu:\t\t{} ({})\n\t\t\tsm_lid:\t\t\t{}\n\t\t\tport_lid:\t\t{}\n\
                 \t\t\tport_lmc:\t\t0x{:02x}\n\t\t\tlink_layer:\t\t{}\n\t\t\tmax_msg_sz:\t\t0x{:x}\n\
                 \t\t\tgid_tbl_len:\t\t{}\n",
                p.port,
                port_state_name(p.state),
                p.state,
                ib_mtu_bytes(p.max_mtu),
                p.max_mtu,
                ib_mtu_bytes(p.active_mtu),
                p.active_mtu,
                p.sm_lid,
                p.lid,
                p.lmc,
                p.link_layer.name(),
                p.max_msg_sz,
                p.gid_tbl_len,
            ));
        }
        s
    }

    /// The same as one JSON object.
    pub fn json(&self) -> serde_json::Value {
        let ports: Vec<_> = self
            .ports
            .iter()
            .map(|p| {
                json!({
                    "port": p.port,
                    "state": port_state_name(p.state),
                    "state_raw": p.state,
                    "phys_state": p.phys_state,
                    "max_mtu": ib_mtu_bytes(p.max_mtu),
                    "active_mtu": ib_mtu_bytes(p.active_mtu),
                    "link_layer": p.link_layer.name(),
                    "lid": p.lid,
                    "sm_lid": p.sm_lid,
                    "lmc": p.lmc,
                    "gid_tbl_len": p.gid_tbl_len,
                    "max_msg_sz": p.max_msg_sz,
                })
            })
            .collect();
        json!({
            "hca_id": self.hca_id,
            "fw_version": self.fw_version,
            "node_guid": guid(self.node_guid),
            "sys_image_guid": guid(self.sys_image_guid),
            "vendor_id": format!("0x{:04x}", self.vendor_id),
            "device_id": format!("0x{:04x}", self.device_id),
            "phys_port_cnt": self.phys_port_cnt,
            "max_mr_size": self.max_mr_size,
            "page_size_cap": self.page_size_cap,
            "max_qp": self.max_qp,
            "max_qp_wr": self.max_qp_wr,
            "max_sge": self.max_sge,
            "max_inline_data": self.max_inline_data,
            "max_cq": self.max_cq,
            "max_cqe": self.max_cqe,
            "max_mr": self.max_mr,
            "max_pd": self.max_pd,
            "max_qp_rd_atom": self.max_qp_rd_atom,
            "max_qp_init_rd_atom": self.max_qp_init_rd_atom,
            "max_srq": self.max_srq,
            "max_srq_wr": self.max_srq_wr,
            "max_srq_sge": self.max_srq_sge,
            "max_pkeys": self.max_pkeys,
            "atomic": self.atomic,
            "ports": ports,
            "firmware_pages": {
                "boot": self.pages.boot,
                "init": self.pages.init,
                "requested": self.pages.requested,
                "given": self.pages.given,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guid_and_state_formatting() {
        assert_eq!(guid(0x248a_0703_00b4_7a8e), "248a:0703:00b4:7a8e");
        assert_eq!(port_state_name(4), "PORT_ACTIVE");
        assert_eq!(port_state_name(1), "PORT_DOWN");
        assert_eq!(port_state_name(9), "invalid state");
    }

    #[test]
    fn roce_mtu_follows_iboe_get_mtu() {
        // 1500-byte Ethernet leaves 1404 bytes after RoCE headers: IB MTU 1024 (3).
        assert_eq!(iboe_mtu(1500), consts::IB_MTU_1024);
        assert_eq!(iboe_mtu(4200), consts::IB_MTU_4096);
        assert_eq!(iboe_mtu(9000), consts::IB_MTU_4096);
        assert_eq!(iboe_mtu(100), 0);
    }
}
