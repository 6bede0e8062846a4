//! The capabilities the driver reads (`MLX5_CAP_GEN` and friends), decoded once from the capability blocks.

use crate::init::CapBlock;
use crate::prm::{consts, ifc, MsgBuf};

/// Link layer of the ports (`cmd_hca_cap.port_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(feature = "defmt", derive(defmt::Format))]
pub enum PortType {
    /// `MLX5_CAP_PORT_TYPE_IB`.
    InfiniBand,
    /// `MLX5_CAP_PORT_TYPE_ETH` (RoCE).
    Ethernet,
    /// A port type the headers do not name.
    Unknown(u8),
}

/// The general device capabilities the driver uses (`cmd_hca_cap`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct GeneralCaps {
    /// `port_type` (`MLX5_CAP_PORT_TYPE_*`).
    pub port_type: u8,
    /// `num_ports`.
    pub num_ports: u8,
    /// `log_max_qp`.
    pub log_max_qp: u8,
    /// `log_max_qp_sz`: log2 of the largest WQE count per queue.
    pub log_max_qp_sz: u8,
    /// `log_max_cq`.
    pub log_max_cq: u8,
    /// `log_max_cq_sz`: log2 of the largest CQE count.
    pub log_max_cq_sz: u8,
    /// `log_max_eq`.
    pub log_max_eq: u8,
    /// `log_max_eq_sz`.
    pub log_max_eq_sz: u8,
    /// `log_max_mkey`.
    pub log_max_mkey: u8,
    /// `log_max_pd`.
    pub log_max_pd: u8,
    /// `log_max_srq`.
    pub log_max_srq: u8,
    /// `log_max_srq_sz`.
    pub log_max_srq_sz: u8,
    /// `log_max_msg`: log2 of the largest message.
    pub log_max_msg: u8,
    /// `log_max_mrw_sz`: log2 of the largest memory region or window.
    pub log_max_mrw_sz: u8,
    /// `log_max_ra_req_qp`: outstanding RDMA reads and atomics per QP as initiator.
    pub log_max_ra_req_qp: u8,
    /// `log_max_ra_res_qp`: outstanding RDMA reads and atomics per QP as responder.
    pub log_max_ra_res_qp: u8,
    /// `max_wqe_sz_sq`: largest send WQE in bytes.
    pub max_wqe_sz_sq: u16,
    /// `max_wqe_sz_rq`: largest receive WQE in bytes.
    pub max_wqe_sz_rq: u16,
    /// `max_qp_mcg`.
    pub max_qp_mcg: u32,
    /// `log_max_mcg`.
    pub log_max_mcg: u8,
    /// `pkey_table_size` (encoded).
    pub pkey_table_size: u8,
    /// `gid_table_size` (encoded).
    pub gid_table_size: u16,
    /// `log_pg_sz`: log2 of the smallest page the device accepts.
    pub log_pg_sz: u8,
    /// `log_bf_reg_size`: log2 of a BlueFlame register's size.
    pub log_bf_reg_size: u8,
    /// `bf`: BlueFlame is supported.
    pub bf: bool,
    /// `uar_4k`: 4 KiB UARs are supported.
    pub uar_4k: bool,
    /// `roce`.
    pub roce: bool,
    /// `atomic`.
    pub atomic: bool,
    /// `pg`: on-demand paging.
    pub pg: bool,
    /// `dct`.
    pub dct: bool,
    /// `cq_resize`.
    pub cq_resize: bool,
    /// `cq_moderation`.
    pub cq_moderation: bool,
    /// `cq_oi`: CQs may ignore overruns.
    pub cq_oi: bool,
    /// `cmdif_checksum`.
    pub cmdif_checksum: u8,
    /// `driver_version`: SET_DRIVER_VERSION is supported.
    pub driver_version: bool,
    /// `hca_cap_2`: the second general capability block exists.
    pub hca_cap_2: bool,
    /// `eth_net_offloads`.
    pub eth_net_offloads: bool,
    /// `ipoib_enhanced_offloads`.
    pub ipoib_enhanced_offloads: bool,
    /// `nic_flow_table`.
    pub nic_flow_table: bool,
    /// `ud`: UD transport.
    pub ud: bool,
    /// `rc`: RC transport.
    pub rc: bool,
    /// `uc`: UC transport.
    pub uc: bool,
    /// `xrc`: XRC transport.
    pub xrc: bool,
    /// `stat_rate_support`: bit `n` set when the `stat_rate` encoding `n` is supported.
    pub stat_rate_support: u16,
    /// `vhca_id`.
    pub vhca_id: u16,
    /// `device_frequency_khz`: the device clock.
    pub device_frequency_khz: u32,
    /// `max_qp_cnt`: how many Q counter sets the function may allocate (0: none, as mlx5_ib then skips them).
    pub max_qp_cnt: u16,
    /// `cqe_version`: 1 when CQEs carry a user index (QPs then name `MLX5_IB_DEFAULT_UIDX`).
    pub cqe_version: u8,
    /// `sq_ts_format`: the send queues' timestamp formats (`MLX5_TIMESTAMP_FORMAT_CAP_*`).
    pub sq_ts_format: u8,
    /// `log_max_uctx`: user contexts exist (non-zero), so shared objects carry `MLX5_SHARED_RESOURCE_UID`.
    pub log_max_uctx: u8,
    /// `ats`: the device translates addresses through the PCIe ATS (physical-address keys then say so).
    pub ats: bool,
    /// `relaxed_ordering_write`: memory keys may let the device reorder its writes.
    pub relaxed_ordering_write: bool,
    /// `relaxed_ordering_read`: memory keys may let the device reorder its reads.
    pub relaxed_ordering_read: bool,
    /// `relaxed_ordering_read_pci_enabled`: relaxed reads supported and enabled in PCI config space.
    pub relaxed_ordering_read_pci_enabled: bool,
}

impl GeneralCaps {
    /// Reads the fields from a `cmd_hca_cap` block.
    pub fn parse(b: &CapBlock) -> Self {
        use ifc::cmd_hca_cap as g;
        let u8f = |f| b.get(f) as u8;
        let flag = |f| b.get(f) != 0;
        Self {
            port_type: u8f(g::PORT_TYPE),
            num_ports: u8f(g::NUM_PORTS),
            log_max_qp: u8f(g::LOG_MAX_QP),
            log_max_qp_sz: u8f(g::LOG_MAX_QP_SZ),
            log_max_cq: u8f(g::LOG_MAX_CQ),
            log_max_cq_sz: u8f(g::LOG_MAX_CQ_SZ),
            log_max_eq: u8f(g::LOG_MAX_EQ),
            log_max_eq_sz: u8f(g::LOG_MAX_EQ_SZ),
            log_max_mkey: u8f(g::LOG_MAX_MKEY),
            log_max_pd: u8f(g::LOG_MAX_PD),
            log_max_srq: u8f(g::LOG_MAX_SRQ),
            log_max_srq_sz: u8f(g::LOG_MAX_SRQ_SZ),
            log_max_msg: u8f(g::LOG_MAX_MSG),
            log_max_mrw_sz: u8f(g::LOG_MAX_MRW_SZ),
            log_max_ra_req_qp: u8f(g::LOG_MAX_RA_REQ_QP),
            log_max_ra_res_qp: u8f(g::LOG_MAX_RA_RES_QP),
            max_wqe_sz_sq: b.get(g::MAX_WQE_SZ_SQ) as u16,
            max_wqe_sz_rq: b.get(g::MAX_WQE_SZ_RQ) as u16,
            max_qp_mcg: b.get(g::MAX_QP_MCG),
            log_max_mcg: u8f(g::LOG_MAX_MCG),
            pkey_table_size: u8f(g::PKEY_TABLE_SIZE),
            gid_table_size: b.get(g::GID_TABLE_SIZE) as u16,
            log_pg_sz: u8f(g::LOG_PG_SZ),
            log_bf_reg_size: u8f(g::LOG_BF_REG_SIZE),
            bf: flag(g::BF),
            uar_4k: flag(g::UAR_4K),
            roce: flag(g::ROCE),
            atomic: flag(g::ATOMIC),
            pg: flag(g::PG),
            dct: flag(g::DCT),
            cq_resize: flag(g::CQ_RESIZE),
            cq_moderation: flag(g::CQ_MODERATION),
            cq_oi: flag(g::CQ_OI),
            cmdif_checksum: u8f(g::CMDIF_CHECKSUM),
            driver_version: flag(g::DRIVER_VERSION),
            hca_cap_2: flag(g::HCA_CAP_2),
            eth_net_offloads: flag(g::ETH_NET_OFFLOADS),
            ipoib_enhanced_offloads: flag(g::IPOIB_ENHANCED_OFFLOADS),
            nic_flow_table: flag(g::NIC_FLOW_TABLE),
            ud: flag(g::UD),
            rc: flag(g::RC),
            uc: flag(g::UC),
            xrc: flag(g::XRC),
            stat_rate_support: b.get(g::STAT_RATE_SUPPORT) as u16,
            vhca_id: b.get(g::VHCA_ID) as u16,
            device_frequency_khz: b.get(g::DEVICE_FREQUENCY_KHZ),
            max_qp_cnt: b.get(g::MAX_QP_CNT) as u16,
            log_max_uctx: u8f(g::LOG_MAX_UCTX),
            cqe_version: u8f(g::CQE_VERSION),
            sq_ts_format: u8f(g::SQ_TS_FORMAT),
            ats: flag(g::ATS),
            relaxed_ordering_write: flag(g::RELAXED_ORDERING_WRITE),
            relaxed_ordering_read: flag(g::RELAXED_ORDERING_READ),
            relaxed_ordering_read_pci_enabled: flag(g::RELAXED_ORDERING_READ_PCI_ENABLED),
        }
    }

    /// The port type, decoded.
    pub fn port_type(&self) -> PortType {
        match u32::from(self.port_type) {
            consts::MLX5_CAP_PORT_TYPE_IB => PortType::InfiniBand,
            consts::MLX5_CAP_PORT_TYPE_ETH => PortType::Ethernet,
            n => PortType::Unknown(n as u8),
        }
    }

    /// Scatter entries per receive WQE (`max_wqe_sz_rq / sizeof(struct mlx5_wqe_data_seg)`, mlx5_ib).
    pub fn max_rq_sge(&self) -> u32 {
        u32::from(self.max_wqe_sz_rq) / crate::prm::c::mlx5_wqe_data_seg::SIZE as u32
    }

    /// Largest send descriptor the driver builds (`min(max_wqe_sz_sq, MLX5_SEND_WQE_MAX_SIZE)` bytes, mlx5_ib).
    fn max_sq_desc(&self) -> u32 {
        u32::from(self.max_wqe_sz_sq).min(consts::MLX5_SEND_WQE_MAX_SIZE)
    }

    /// Gather entries per send WQE as `mlx5_ib_query_device` reports them: a descriptor of at most
    /// [`IB_MAX_SQ_DESC`] bytes minus control and remote-address segments, over data segments. 30 on a
    /// ConnectX-4 (`max_wqe_sz_sq` 1024, `tests/all/mock_replay.rs`) or the simulated ConnectX-5; a QP may take
    /// more, up to what its WQE size allows.
    pub fn max_sq_sge(&self) -> u32 {
        use crate::prm::c;
        let overhead = (c::mlx5_wqe_ctrl_seg::SIZE + c::mlx5_wqe_raddr_seg::SIZE) as u32;
        u32::from(self.max_wqe_sz_sq).min(IB_MAX_SQ_DESC).saturating_sub(overhead) / c::mlx5_wqe_data_seg::SIZE as u32
    }

    /// `ibv_device_attr.max_sge`: the smaller of the send and receive limits.
    pub fn max_sge(&self) -> u32 {
        self.max_sq_sge().min(self.max_rq_sge())
    }

    /// Inline bytes a send WQE of every QP type can carry: the descriptor minus the control segment, the largest
    /// fixed part a type reserves (RC: remote address and atomic; UD: the datagram segment, as QP sizing reserves
    /// them) and the inline header. With only control and remote address taken off, an RC or UD QP asking for the
    /// advertised figure was refused.
    pub fn max_inline_data(&self) -> u32 {
        use crate::prm::c;
        let rc = c::mlx5_wqe_raddr_seg::SIZE + c::mlx5_wqe_atomic_seg::SIZE;
        let fixed = rc.max(c::mlx5_wqe_datagram_seg::SIZE);
        let overhead = (c::mlx5_wqe_ctrl_seg::SIZE + fixed + c::mlx5_wqe_inline_seg::SIZE) as u32;
        self.max_sq_desc().saturating_sub(overhead)
    }
}

/// The send descriptor `mlx5_ib_query_device` reckons its gather limit over (`min_t(int, max_wqe_sz_sq, 512)`):
/// a driver constant, not a PRM field.
pub const IB_MAX_SQ_DESC: u32 = 512;

/// Every capability the bring-up read, current values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct DeviceCaps {
    /// The general capabilities (current values).
    pub general: GeneralCaps,
    /// `atomic_caps.atomic_operations` (bit mask of supported atomic operations), when atomics are supported.
    pub atomic_operations: Option<u16>,
    /// `atomic_caps.atomic_size_qp`.
    pub atomic_size_qp: Option<u16>,
    /// `roce_cap.roce_version`, when RoCE is supported.
    pub roce_version: Option<u8>,
    /// `roce_address_table_size`, when the RoCE capabilities were queried.
    pub roce_address_table_size: Option<u16>,
    /// `roce_cap.qp_ts_format`, when the RoCE capabilities were queried.
    pub roce_qp_ts_format: Option<u8>,
}

impl DeviceCaps {
    /// The `ts_format` of a QP (`mlx5_get_qp_default_ts`): `MLX5_TIMESTAMP_FORMAT_DEFAULT` when the device reports a
    /// timestamp capability (RoCE's `qp_ts_format` with RoCE, else the general `sq_ts_format`), else free-running.
    pub fn qp_default_ts(&self) -> u8 {
        let cap = match self.roce_qp_ts_format {
            Some(r) if self.general.port_type() != PortType::InfiniBand => r,
            _ => self.general.sq_ts_format,
        };
        if cap != 0 {
            consts::MLX5_TIMESTAMP_FORMAT_DEFAULT as u8
        } else {
            consts::MLX5_TIMESTAMP_FORMAT_FREE_RUNNING as u8
        }
    }

    /// The `qpc.atomic_mode` of an RC QP with remote atomics (`get_atomic_mode` with `atomic_size_to_mode`): the
    /// largest atomic size of `atomic_size_qp` (8 bytes at least) when the device has the extended operations,
    /// otherwise `MLX5_ATOMIC_MODE_IB_COMP` when it has compare-and-swap and fetch-and-add; `None` without atomics.
    pub fn atomic_mode(&self) -> Option<u8> {
        if !self.general.atomic {
            return None;
        }
        let ops = u32::from(self.atomic_operations.unwrap_or(0));
        let extended = consts::MLX5_ATOMIC_OPS_EXTENDED_CMP_SWAP | consts::MLX5_ATOMIC_OPS_EXTENDED_FETCH_ADD;
        if ops & extended != 0 {
            // Sizes above 256 bytes are beyond what Linux translates.
            let sizes = u32::from(self.atomic_size_qp.unwrap_or(0)) & 0x1ff;
            if sizes != 0 {
                let log_max = 31 - sizes.leading_zeros();
                return Some(if log_max > 3 { log_max as u8 } else { consts::MLX5_ATOMIC_MODE_8B as u8 });
            }
        }
        let basic = consts::MLX5_ATOMIC_OPS_CMP_SWAP | consts::MLX5_ATOMIC_OPS_FETCH_ADD;
        (ops & basic == basic).then_some(consts::MLX5_ATOMIC_MODE_IB_COMP as u8)
    }
}

#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    fn caps(ops: u32, sizes: u32) -> DeviceCaps {
        DeviceCaps {
            general: GeneralCaps { atomic: true, ..GeneralCaps::default() },
            atomic_operations: Some(ops as u16),
            atomic_size_qp: Some(sizes as u16),
            ..DeviceCaps::default()
        }
    }

    #[test]
    fn atomic_mode_follows_get_atomic_mode() {
        use consts as k;
        let basic = k::MLX5_ATOMIC_OPS_CMP_SWAP | k::MLX5_ATOMIC_OPS_FETCH_ADD;
        let ext = k::MLX5_ATOMIC_OPS_EXTENDED_CMP_SWAP;
        assert_eq!(caps(basic, 8).atomic_mode(), Some(k::MLX5_ATOMIC_MODE_IB_COMP as u8));
        assert_eq!(caps(basic | ext, 8).atomic_mode(), Some(k::MLX5_ATOMIC_MODE_8B as u8));
        assert_eq!(caps(basic | ext, 8 | 16 | 32).atomic_mode(), Some(k::MLX5_ATOMIC_MODE_32B as u8));
        // Extended operations without a size fall back to the basic ones.
        assert_eq!(caps(basic | ext, 0).atomic_mode(), Some(k::MLX5_ATOMIC_MODE_IB_COMP as u8));
        assert_eq!(caps(k::MLX5_ATOMIC_OPS_CMP_SWAP, 8).atomic_mode(), None);
        assert_eq!(DeviceCaps::default().atomic_mode(), None);
    }
}
