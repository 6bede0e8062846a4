//! The device's configuration: [`SimConfig`] (the ConnectX-5 it models by default), its execution [`Mode`] and
//! [`PortType`].

/// How the device completes commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Mode {
    /// A doorbell executes the command synchronously inside `write32`; delays use a virtual clock.
    #[default]
    Inline,
    /// A worker thread executes doorbells asynchronously; delays really sleep.
    Threaded,
}

/// Port link layer reported in `cmd_hca_cap.port_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PortType {
    /// InfiniBand (`MLX5_CAP_PORT_TYPE_IB`).
    Ib,
    /// Ethernet / RoCE (`MLX5_CAP_PORT_TYPE_ETH`).
    #[default]
    Eth,
}

/// Device configuration. The defaults model a ConnectX-5 with a 32-slot command queue.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub mode: Mode,
    /// log2 of the number of command slots, reported in `cmdq_addr_l_sz` (5 = 32 slots, `MLX5_MAX_COMMANDS`).
    pub log_cmdq_size: u8,
    /// log2 of the distance between command slots in bytes (6 = 64, one `mlx5_cmd_layout`).
    pub log_cmdq_stride: u8,
    /// Command interface revision in `cmdif_rev_fw_sub` (the kernel requires `CMD_IF_REV` = 5).
    pub cmdif_rev: u16,
    /// Firmware version (major, minor, subminor).
    pub fw_rev: (u16, u16, u16),
    /// Value of `cmd_exec_to` (default command timeout in ms).
    pub cmd_exec_to_ms: u32,
    /// Value of `cmd_q_init_to` (ms); non-zero tells the driver the init-segment timeouts are valid. The default
    /// is 0: a firmware without init-segment timeouts, for which Linux takes its defaults and does not send
    /// QUERY_DTOR (which the driver does not implement).
    pub cmd_q_init_to_ms: u32,
    /// For this long after creation (virtual time in inline mode) `initializing` reads 1.
    pub init_delay_ms: u32,
    /// Pages firmware asks for at QUERY_PAGES(boot).
    pub boot_pages: i32,
    /// Additional pages firmware asks for at QUERY_PAGES(init).
    pub init_pages: i32,
    /// Additional pages firmware needs after INIT_HCA: reported by QUERY_PAGES(regular) and asked for by one
    /// page-request EQE as soon as an EQ subscribes to page requests.
    pub regular_pages: i32,
    /// Verify entry and mailbox signatures, and sign the output. Off by default, as the Linux driver runs
    /// (`checksum_disabled`); the entry signature is then not checked either.
    pub checksum: bool,
    /// Link layer reported in the general capabilities.
    pub port_type: PortType,
    /// Number of UAR pages in the BAR after the initialization segment (ALLOC_UAR fails beyond it).
    pub num_uars: u32,
    /// Bytes of device memory (MEMIC) the capabilities offer, in a BAR region after the UAR pages (a multiple of
    /// 4 KiB). 0, the default: no device memory (`device_memory` 0). The bytes themselves come from
    /// `SimDevice::map_device_memory` (under UML, the BAR file's pages); until it is called, a device memory MR's
    /// accesses fault.
    pub memic_size: u32,
    /// PCI vendor and device id the device would show in config space (a ConnectX-5: 15b3:1017).
    pub pci_ids: (u16, u16),
    /// Port 1 link is up.
    pub port_up: bool,
    /// Port MTU in bytes (PMTU `oper_mtu`; the Ethernet MTU for RoCE, the IB MTU for InfiniBand).
    pub port_mtu: u16,
    /// Node (and system image, port) GUID.
    pub node_guid: u64,
    /// Permanent MAC address of the Ethernet port.
    pub mac: [u8; 6],
    /// The largest DMA allocation that succeeds, in bytes; a larger `Dma::alloc` fails with
    /// `DmaError::NoMemory`, so the driver must build big buffers from pages. `None` (the default): no limit.
    pub dma_max_contig: Option<usize>,
    /// `log_max_cq_sz` reported in the general capabilities (22 on a ConnectX-5).
    pub log_max_cq_sz: u8,
    /// How many QPs, CQs, PDs, memory keys, SRQs and EQs the device offers (a ConnectX-5's by default).
    pub object_limits: ObjectLimits,
    /// The port LID on InfiniBand (ignored on Ethernet, where the LID is 0). Two IB devices joined by
    /// [`SimDevice::connect`](crate::sim_device::SimDevice::connect) need different LIDs.
    pub lid: u16,
    /// The InfiniBand port waits for a subnet manager, as a real one does: its link comes up in Init with LID 0
    /// and no SM LID, and only a subnet manager's Set(PortInfo) through MAD_IFC (QP0's SMPs) assigns the LID and
    /// moves it to Armed and Active. Off (the default): Active with [`lid`](Self::lid) from the start, as if an
    /// SM had already swept the fabric.
    pub subnet_manager: bool,
    /// The IPv4 addresses of the port's netdev (only data: the driver turns them into GID entries; the simulator
    /// sends no IP traffic). The default is one, 192.168.1.10; [`next_host`](Self::next_host) takes the next.
    pub ipv4_addrs: &'static [[u8; 4]],
    /// The IPv6 addresses of the port's netdev (none by default).
    pub ipv6_addrs: &'static [[u8; 16]],
    /// Report `relaxed_ordering_write` and `relaxed_ordering_read` in the general capabilities (off by default,
    /// as on a function whose PCI config space has relaxed ordering disabled). Without them CREATE_MKEY refuses
    /// the mkc relaxed-ordering bits.
    pub relaxed_ordering: bool,
    /// What the port reports beyond its type, MTU and addresses (PTYS, the InfiniBand vport context).
    pub port_info: PortInfo,
    /// Write every frame the port sends and receives, as RoCEv2 (Ethernet ports only), to this capture.
    pub pcap: Option<crate::pcap::PcapSink>,
    /// Offer the NIC half on an Ethernet port: `nic_flow_table`, the NIC receive flow-table capabilities,
    /// `rss_ind_tbl_cap` and `log_max_sq`, which open mlx5e's gate and mlx5_core's write-combining test. Off by
    /// default: `log_max_sq` > 0 makes mlx5_core run its write-combining test on every Ethernet port.
    pub eth_netdev: bool,
    /// Keep every command's input and output bytes for [`SimDevice::take_messages`](crate::SimDevice::take_messages)
    /// (a command trace that `mlx5 trace decode` can read field by field). Off by default.
    pub record_messages: bool,
}

/// The object counts the general capabilities report, as logarithms. A smaller device than the default
/// ConnectX-5 (a virtual function, a ConnectX-4 Lx) reports smaller ones, and a test can reach every limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ObjectLimits {
    /// `log_max_qp`, the maximum a driver may set (23, as a ConnectX-4 reports it; Linux and the core set 18).
    pub log_max_qp: u8,
    /// `log_max_cq` (24).
    pub log_max_cq: u8,
    /// `log_max_pd` (24).
    pub log_max_pd: u8,
    /// `log_max_mkey` (24).
    pub log_max_mkey: u8,
    /// `log_max_srq` and `log_max_rmp`, the SRQ's object at ISSI 1 (23).
    pub log_max_srq: u8,
    /// `log_max_eq` (8, as a ConnectX-4 reports it): the EQs, so the completion vectors a driver can have.
    pub log_max_eq: u8,
}

impl Default for ObjectLimits {
    fn default() -> Self {
        Self { log_max_qp: 23, log_max_cq: 24, log_max_pd: 24, log_max_mkey: 24, log_max_srq: 23, log_max_eq: 8 }
    }
}

/// The port facts `ibv_query_port` reads: PTYS's operational protocols and the InfiniBand PortInfo fields the
/// subnet manager would have set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortInfo {
    /// PTYS `eth_proto_oper` (one `MLX5E_PROT_MASK` bit; default 100GBASE-CR4, a ConnectX-5's 100 GbE).
    pub eth_proto_oper: u32,
    /// PTYS `ib_link_width_oper` (`MLX5_PTYS_WIDTH_*`; default 4X).
    pub ib_link_width_oper: u16,
    /// PTYS `ib_proto_oper` (one `IB_SPEED_*` bit; default EDR).
    pub ib_proto_oper: u16,
    /// `cap_mask1` (PortInfo:CapabilityMask).
    pub cap_mask1: u32,
    /// `cap_mask2` (PortInfo:CapabilityMask2).
    pub cap_mask2: u32,
    /// LID mask count.
    pub lmc: u8,
    /// The subnet manager's SL.
    pub sm_sl: u8,
    /// Subnet timeout.
    pub subnet_timeout: u8,
    /// PortInfo:InitTypeReply.
    pub init_type_reply: u8,
    /// The subnet requires a GRH.
    pub grh_required: bool,
}

impl Default for PortInfo {
    fn default() -> Self {
        use mlx5_core::prm::consts;
        Self {
            eth_proto_oper: 1 << consts::MLX5E_100GBASE_CR4,
            ib_link_width_oper: consts::MLX5_PTYS_WIDTH_4X as u16,
            ib_proto_oper: consts::IB_SPEED_EDR as u16,
            // Trap, automatic migration, CapabilityMask2 and CM supported (IBTA PortInfo:CapabilityMask bits 3,
            // 5, 15, 16), so the second mask is reported.
            cap_mask1: (1 << 3) | (1 << 5) | (1 << 15) | (1 << 16),
            // A distinct value, so tests see it passed through.
            cap_mask2: 1 << 5,
            lmc: 0,
            sm_sl: 0,
            subnet_timeout: 18,
            init_type_reply: 0,
            grh_required: false,
        }
    }
}

/// The default host's address and the next host's.
static HOST_V4: [[u8; 4]; 2] = [[192, 168, 1, 10], [192, 168, 1, 11]];

impl SimConfig {
    /// Another host's device on the same fabric: this configuration with the next node GUID, MAC and LID, so the
    /// two ports have distinct addresses.
    pub fn next_host(&self) -> SimConfig {
        let mut mac = self.mac;
        mac[5] = mac[5].wrapping_add(1);
        // The default host's address becomes the next one's; any other list is kept.
        let ipv4_addrs = if self.ipv4_addrs == &HOST_V4[..1] { &HOST_V4[1..] } else { self.ipv4_addrs };
        SimConfig {
            node_guid: self.node_guid.wrapping_add(1),
            mac,
            lid: self.lid.wrapping_add(1),
            ipv4_addrs,
            ..self.clone()
        }
    }
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            mode: Mode::Inline,
            log_cmdq_size: 5,
            log_cmdq_stride: 6,
            cmdif_rev: 5,
            fw_rev: (16, 35, 2000),
            cmd_exec_to_ms: 60_000,
            cmd_q_init_to_ms: 0,
            init_delay_ms: 0,
            boot_pages: 8,
            init_pages: 16,
            regular_pages: 4,
            checksum: false,
            port_type: PortType::Eth,
            num_uars: 16,
            memic_size: 0,
            pci_ids: (0x15b3, 0x1017),
            port_up: true,
            port_mtu: 1500,
            node_guid: 0xb8ce_f603_0012_3456,
            mac: [0xb8, 0xce, 0xf6, 0x12, 0x34, 0x56],
            dma_max_contig: None,
            log_max_cq_sz: 22,
            object_limits: ObjectLimits::default(),
            lid: 1,
            subnet_manager: false,
            ipv4_addrs: &HOST_V4[..1],
            ipv6_addrs: &[],
            relaxed_ordering: false,
            port_info: PortInfo::default(),
            pcap: None,
            eth_netdev: false,
            record_messages: false,
        }
    }
}
