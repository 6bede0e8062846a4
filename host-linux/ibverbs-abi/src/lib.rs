//! The C structures of rdma-core 44's `<infiniband/verbs.h>` (x86_64 / any LP64 target), laid out exactly:
//! the test at the end compiles a C program against the header and compares every offset and size listed in
//! [`LAYOUT`] and [`SIZES`].
#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_int, c_uint, c_void};

/// `pthread_mutex_t` (glibc, LP64): all zero is `PTHREAD_MUTEX_INITIALIZER`.
pub type pthread_mutex_t = [u64; 5];
/// `pthread_cond_t` (glibc, LP64): all zero is `PTHREAD_COND_INITIALIZER`.
pub type pthread_cond_t = [u64; 6];

pub type Fp = Option<unsafe extern "C" fn()>;

/// `union ibv_gid`: 16 bytes, 8-aligned (its `global` member is two `__be64`).
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_device {
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; 64],
    pub dev_name: [c_char; 64],
    pub dev_path: [c_char; 256],
    pub ibdev_path: [c_char; 256],
}

/// `struct verbs_device` (libibverbs' `driver.h`): the provider's ops pointer and bookkeeping after the device.
/// libmlx5 reads `ops` (NULL here: not an mlx5 provider device, so mlx5dv calls fail with EOPNOTSUPP).
#[repr(C)]
#[derive(Debug)]
pub struct verbs_device {
    pub device: ibv_device,
    pub ops: *const c_void,
    pub refcount: u32,
    pub entry: [*mut c_void; 2],
    pub sysfs: *mut c_void,
    pub core_support: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_context_ops {
    pub _compat_query_device: Fp,
    pub _compat_query_port: Fp,
    pub _compat_alloc_pd: Fp,
    pub _compat_dealloc_pd: Fp,
    pub _compat_reg_mr: Fp,
    pub _compat_rereg_mr: Fp,
    pub _compat_dereg_mr: Fp,
    pub alloc_mw: Option<unsafe extern "C" fn(*mut ibv_pd, c_int) -> *mut c_void>,
    pub bind_mw: Option<unsafe extern "C" fn(*mut ibv_qp, *mut c_void, *mut c_void) -> c_int>,
    pub dealloc_mw: Option<unsafe extern "C" fn(*mut c_void) -> c_int>,
    pub _compat_create_cq: Fp,
    pub poll_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int>,
    pub req_notify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int>,
    pub _compat_cq_event: Fp,
    pub _compat_resize_cq: Fp,
    pub _compat_destroy_cq: Fp,
    pub _compat_create_srq: Fp,
    pub _compat_modify_srq: Fp,
    pub _compat_query_srq: Fp,
    pub _compat_destroy_srq: Fp,
    pub post_srq_recv: Option<unsafe extern "C" fn(*mut ibv_srq, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    pub _compat_create_qp: Fp,
    pub _compat_query_qp: Fp,
    pub _compat_modify_qp: Fp,
    pub _compat_destroy_qp: Fp,
    pub post_send: Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int>,
    pub post_recv: Option<unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int>,
    pub _compat_create_ah: Fp,
    pub _compat_destroy_ah: Fp,
    pub _compat_attach_mcast: Fp,
    pub _compat_detach_mcast: Fp,
    pub _compat_async_event: Fp,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// `struct verbs_context`: the extended ops sit before the `ibv_context`, at negative offsets from it.
#[repr(C)]
#[derive(Debug)]
pub struct verbs_context {
    pub query_port: Option<unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int>,
    /// advise_mr .. modify_qp_rate_limit: not provided (NULL: the inline wrappers return EOPNOTSUPP).
    pub unsupported_a: [Fp; 13],
    pub alloc_parent_domain:
        Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_parent_domain_init_attr) -> *mut ibv_pd>,
    pub dealloc_td: Option<unsafe extern "C" fn(*mut ibv_td) -> c_int>,
    pub alloc_td: Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_td_init_attr) -> *mut ibv_td>,
    pub modify_cq: Option<unsafe extern "C" fn(*mut ibv_cq, *mut ibv_modify_cq_attr) -> c_int>,
    /// post_srq_ops .. create_wq: not provided.
    pub unsupported_a2: [Fp; 6],
    pub query_rt_values: Fp,
    pub create_cq_ex: Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_cq_init_attr_ex) -> *mut ibv_cq_ex>,
    pub priv_: *mut c_void,
    pub query_device_ex:
        Option<unsafe extern "C" fn(*mut ibv_context, *const c_void, *mut ibv_device_attr_ex, usize) -> c_int>,
    /// ibv_destroy_flow .. open_qp.
    pub unsupported_b: [Fp; 5],
    pub create_qp_ex: Option<unsafe extern "C" fn(*mut ibv_context, *mut ibv_qp_init_attr_ex) -> *mut ibv_qp>,
    pub get_srq_num: Fp,
    pub create_srq_ex: Fp,
    pub open_xrcd: Fp,
    pub close_xrcd: Fp,
    pub _abi_placeholder3: u64,
    pub sz: usize,
    pub context: ibv_context,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// A thread domain.
#[repr(C)]
#[derive(Debug)]
pub struct ibv_td {
    pub context: *mut ibv_context,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_td_init_attr {
    pub comp_mask: u32,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_parent_domain_init_attr {
    pub pd: *mut ibv_pd,
    pub td: *mut ibv_td,
    pub comp_mask: u32,
    pub alloc: Option<PdAllocFn>,
    pub free: Option<PdFreeFn>,
    pub pd_context: *mut c_void,
}

/// A parent domain's allocator: (pd, pd_context, size, alignment, resource_type) -> memory, NULL or
/// `IBV_ALLOCATOR_USE_DEFAULT`.
pub type PdAllocFn = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, usize, u64) -> *mut c_void;
/// Its free: (pd, pd_context, memory, resource_type).
pub type PdFreeFn = unsafe extern "C" fn(*mut ibv_pd, *mut c_void, *mut c_void, u64);

#[repr(C)]
#[derive(Debug)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

pub type CqExFn<R> = Option<unsafe extern "C" fn(*mut ibv_cq_ex) -> R>;

#[repr(C)]
#[derive(Debug)]
pub struct ibv_cq_ex {
    pub cq: ibv_cq,
    pub comp_mask: u32,
    pub status: c_int,
    pub wr_id: u64,
    pub start_poll: Option<unsafe extern "C" fn(*mut ibv_cq_ex, *mut c_void) -> c_int>,
    pub next_poll: CqExFn<c_int>,
    pub end_poll: CqExFn<()>,
    pub read_opcode: CqExFn<c_int>,
    pub read_vendor_err: CqExFn<u32>,
    pub read_byte_len: CqExFn<u32>,
    pub read_imm_data: CqExFn<u32>,
    pub read_qp_num: CqExFn<u32>,
    pub read_src_qp: CqExFn<u32>,
    pub read_wc_flags: CqExFn<c_uint>,
    pub read_slid: CqExFn<u32>,
    pub read_sl: CqExFn<u8>,
    pub read_dlid_path_bits: CqExFn<u8>,
    pub read_completion_ts: CqExFn<u64>,
    pub read_cvlan: CqExFn<u16>,
    pub read_flow_tag: CqExFn<u32>,
    pub read_tm_info: Option<unsafe extern "C" fn(*mut ibv_cq_ex, *mut c_void)>,
    pub read_completion_wallclock_ns: CqExFn<u64>,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_cq_init_attr_ex {
    pub cqe: u32,
    pub cq_context: *mut c_void,
    pub channel: *mut ibv_comp_channel,
    pub comp_vector: u32,
    pub wc_flags: u64,
    pub comp_mask: u32,
    pub flags: u32,
    pub parent_domain: *mut ibv_pd,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_srq {
    pub context: *mut ibv_context,
    pub srq_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub handle: u32,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_srq_attr {
    pub max_wr: u32,
    pub max_sge: u32,
    pub srq_limit: u32,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_srq_init_attr {
    pub srq_context: *mut c_void,
    pub attr: ibv_srq_attr,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: pthread_mutex_t,
    pub cond: pthread_cond_t,
    pub events_completed: u32,
}

pub type QpExFn<A> = Option<unsafe extern "C" fn(*mut ibv_qp_ex, A)>;

#[repr(C)]
#[derive(Debug)]
pub struct ibv_qp_ex {
    pub qp_base: ibv_qp,
    pub comp_mask: u64,
    pub wr_id: u64,
    pub wr_flags: c_uint,
    pub wr_atomic_cmp_swp: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u64, u64)>,
    pub wr_atomic_fetch_add: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u64)>,
    pub wr_bind_mw: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut c_void, u32, *const c_void)>,
    pub wr_local_inv: QpExFn<u32>,
    pub wr_rdma_read: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64)>,
    pub wr_rdma_write: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64)>,
    pub wr_rdma_write_imm: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u32)>,
    pub wr_send: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    pub wr_send_imm: QpExFn<u32>,
    pub wr_send_inv: QpExFn<u32>,
    pub wr_send_tso: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut c_void, u16, u16)>,
    pub wr_set_ud_addr: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut ibv_ah, u32, u32)>,
    pub wr_set_xrc_srqn: QpExFn<u32>,
    pub wr_set_inline_data: Option<unsafe extern "C" fn(*mut ibv_qp_ex, *mut c_void, usize)>,
    pub wr_set_inline_data_list: Option<unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_data_buf)>,
    pub wr_set_sge: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, u32)>,
    pub wr_set_sge_list: Option<unsafe extern "C" fn(*mut ibv_qp_ex, usize, *const ibv_sge)>,
    pub wr_start: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    pub wr_complete: Option<unsafe extern "C" fn(*mut ibv_qp_ex) -> c_int>,
    pub wr_abort: Option<unsafe extern "C" fn(*mut ibv_qp_ex)>,
    pub wr_atomic_write: Option<unsafe extern "C" fn(*mut ibv_qp_ex, u32, u64, *const c_void)>,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_data_buf {
    pub addr: *mut c_void,
    pub length: usize,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_ah {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub handle: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (big-endian) or `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct wr_ud {
    pub ah: *mut ibv_ah,
    pub remote_qpn: u32,
    pub remote_qkey: u32,
}

#[repr(C)]
#[derive(Clone, Copy)]
#[allow(missing_debug_implementations)]
pub union ibv_send_wr_wr {
    pub rdma: wr_rdma,
    pub atomic: wr_atomic,
    pub ud: wr_ud,
}

#[repr(C)]
#[allow(missing_debug_implementations)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    /// `imm_data` (big-endian) or `invalidate_rkey`.
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    /// `qp_type.xrc.remote_srqn`.
    pub remote_srqn: u32,
    /// The bind_mw / tso union (48 bytes, 8-aligned).
    pub tail: [u64; 6],
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_rx_hash_conf {
    pub rx_hash_function: u8,
    pub rx_hash_key_len: u8,
    pub rx_hash_key: *mut u8,
    pub rx_hash_fields_mask: u64,
}

#[repr(C)]
#[derive(Debug)]
pub struct ibv_qp_init_attr_ex {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
    pub comp_mask: u32,
    pub pd: *mut ibv_pd,
    pub xrcd: *mut c_void,
    pub create_flags: u32,
    pub max_tso_header: u16,
    pub rwq_ind_tbl: *mut c_void,
    pub rx_hash_conf: ibv_rx_hash_conf,
    pub source_qpn: u32,
    pub send_ops_flags: u64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_device_attr_ex`: the legacy attributes, then extended capabilities this driver reports as zero
/// (no ODP, TSO, RSS, packet pacing, tag matching, CQ moderation or device memory), except
/// `phys_port_cnt_ex`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_device_attr_ex {
    pub orig_attr: ibv_device_attr,
    pub comp_mask: u32,
    /// odp_caps, all zero.
    pub odp_caps: [u64; 3],
    pub completion_timestamp_mask: u64,
    /// kHz.
    pub hca_core_clock: u64,
    /// device_cap_flags_ex .. tm_caps, all zero.
    pub ext: [u64; 11],
    pub cq_mod_caps: ibv_cq_moderation_caps,
    /// max_dm_size and pci_atomic_caps, zero.
    pub ext2: [u64; 2],
    pub xrc_odp_caps: u32,
    pub phys_port_cnt_ex: u32,
}

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

/// `struct ibv_cq_moderation_caps`: the largest count and period `ibv_modify_cq` takes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_cq_moderation_caps {
    pub max_cq_count: u16,
    pub max_cq_period: u16,
}

/// `struct ibv_moderate_cq`: an event after `cq_count` completions or `cq_period` microseconds.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_moderate_cq {
    pub cq_count: u16,
    pub cq_period: u16,
}

/// `struct ibv_modify_cq_attr` (`ibv_modify_cq`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_modify_cq_attr {
    /// `IBV_CQ_ATTR_MODERATE` (1) is the only attribute.
    pub attr_mask: u32,
    pub moderate: ibv_moderate_cq,
}

/// `IBV_CQ_ATTR_MODERATE`.
pub const IBV_CQ_ATTR_MODERATE: u32 = 1;

#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ibv_async_event {
    /// The cq / qp / srq / wq pointer, or the port number in the low 32 bits.
    pub element: *mut c_void,
    pub event_type: c_int,
}

/// Offsets checked against the header: (struct, field, Rust's offset).
pub const LAYOUT: &[(&str, &str, usize)] = &{
    use std::mem::offset_of as o;
    [
        ("ibv_device", "node_type", o!(ibv_device, node_type)),
        ("ibv_device", "name", o!(ibv_device, name)),
        ("ibv_device", "dev_name", o!(ibv_device, dev_name)),
        ("ibv_device", "dev_path", o!(ibv_device, dev_path)),
        ("ibv_device", "ibdev_path", o!(ibv_device, ibdev_path)),
        ("ibv_context_ops", "alloc_mw", o!(ibv_context_ops, alloc_mw)),
        ("ibv_context_ops", "bind_mw", o!(ibv_context_ops, bind_mw)),
        ("ibv_context_ops", "dealloc_mw", o!(ibv_context_ops, dealloc_mw)),
        ("ibv_context_ops", "poll_cq", o!(ibv_context_ops, poll_cq)),
        ("ibv_context_ops", "req_notify_cq", o!(ibv_context_ops, req_notify_cq)),
        ("ibv_context_ops", "post_srq_recv", o!(ibv_context_ops, post_srq_recv)),
        ("ibv_context_ops", "post_send", o!(ibv_context_ops, post_send)),
        ("ibv_context_ops", "post_recv", o!(ibv_context_ops, post_recv)),
        ("ibv_context_ops", "_compat_async_event", o!(ibv_context_ops, _compat_async_event)),
        ("ibv_context", "ops", o!(ibv_context, ops)),
        ("ibv_context", "cmd_fd", o!(ibv_context, cmd_fd)),
        ("ibv_context", "async_fd", o!(ibv_context, async_fd)),
        ("ibv_context", "num_comp_vectors", o!(ibv_context, num_comp_vectors)),
        ("ibv_context", "mutex", o!(ibv_context, mutex)),
        ("ibv_context", "abi_compat", o!(ibv_context, abi_compat)),
        ("verbs_context", "query_port", o!(verbs_context, query_port)),
        ("ibv_device_attr_ex", "odp_caps", o!(ibv_device_attr_ex, odp_caps)),
        ("ibv_device_attr_ex", "completion_timestamp_mask", o!(ibv_device_attr_ex, completion_timestamp_mask)),
        ("ibv_device_attr_ex", "hca_core_clock", o!(ibv_device_attr_ex, hca_core_clock)),
        ("ibv_device_attr_ex", "device_cap_flags_ex", o!(ibv_device_attr_ex, ext)),
        ("ibv_device_attr_ex", "cq_mod_caps", o!(ibv_device_attr_ex, cq_mod_caps)),
        ("ibv_device_attr_ex", "max_dm_size", o!(ibv_device_attr_ex, ext2)),
        ("verbs_context", "advise_mr", o!(verbs_context, unsupported_a)),
        ("verbs_context", "alloc_parent_domain", o!(verbs_context, alloc_parent_domain)),
        ("verbs_context", "dealloc_td", o!(verbs_context, dealloc_td)),
        ("verbs_context", "alloc_td", o!(verbs_context, alloc_td)),
        ("verbs_context", "modify_cq", o!(verbs_context, modify_cq)),
        ("verbs_context", "post_srq_ops", o!(verbs_context, unsupported_a2)),
        ("ibv_modify_cq_attr", "attr_mask", o!(ibv_modify_cq_attr, attr_mask)),
        ("ibv_modify_cq_attr", "moderate", o!(ibv_modify_cq_attr, moderate)),
        ("ibv_moderate_cq", "cq_count", o!(ibv_moderate_cq, cq_count)),
        ("ibv_moderate_cq", "cq_period", o!(ibv_moderate_cq, cq_period)),
        ("ibv_parent_domain_init_attr", "pd", o!(ibv_parent_domain_init_attr, pd)),
        ("ibv_parent_domain_init_attr", "td", o!(ibv_parent_domain_init_attr, td)),
        ("ibv_parent_domain_init_attr", "comp_mask", o!(ibv_parent_domain_init_attr, comp_mask)),
        ("ibv_parent_domain_init_attr", "alloc", o!(ibv_parent_domain_init_attr, alloc)),
        ("ibv_parent_domain_init_attr", "free", o!(ibv_parent_domain_init_attr, free)),
        ("ibv_parent_domain_init_attr", "pd_context", o!(ibv_parent_domain_init_attr, pd_context)),
        ("verbs_context", "query_rt_values", o!(verbs_context, query_rt_values)),
        ("verbs_context", "create_cq_ex", o!(verbs_context, create_cq_ex)),
        ("verbs_context", "priv", o!(verbs_context, priv_)),
        ("verbs_context", "query_device_ex", o!(verbs_context, query_device_ex)),
        ("verbs_context", "ibv_destroy_flow", o!(verbs_context, unsupported_b)),
        ("verbs_context", "create_qp_ex", o!(verbs_context, create_qp_ex)),
        ("verbs_context", "get_srq_num", o!(verbs_context, get_srq_num)),
        ("verbs_context", "create_srq_ex", o!(verbs_context, create_srq_ex)),
        ("verbs_context", "open_xrcd", o!(verbs_context, open_xrcd)),
        ("verbs_context", "close_xrcd", o!(verbs_context, close_xrcd)),
        ("verbs_context", "sz", o!(verbs_context, sz)),
        ("verbs_context", "context", o!(verbs_context, context)),
        ("ibv_pd", "handle", o!(ibv_pd, handle)),
        ("ibv_mr", "addr", o!(ibv_mr, addr)),
        ("ibv_mr", "length", o!(ibv_mr, length)),
        ("ibv_mr", "lkey", o!(ibv_mr, lkey)),
        ("ibv_mr", "rkey", o!(ibv_mr, rkey)),
        ("ibv_comp_channel", "fd", o!(ibv_comp_channel, fd)),
        ("ibv_comp_channel", "refcnt", o!(ibv_comp_channel, refcnt)),
        ("ibv_cq", "channel", o!(ibv_cq, channel)),
        ("ibv_cq", "cq_context", o!(ibv_cq, cq_context)),
        ("ibv_cq", "cqe", o!(ibv_cq, cqe)),
        ("ibv_cq", "mutex", o!(ibv_cq, mutex)),
        ("ibv_cq", "cond", o!(ibv_cq, cond)),
        ("ibv_cq", "comp_events_completed", o!(ibv_cq, comp_events_completed)),
        ("ibv_cq", "async_events_completed", o!(ibv_cq, async_events_completed)),
        ("ibv_cq_ex", "comp_mask", o!(ibv_cq_ex, comp_mask)),
        ("ibv_cq_ex", "status", o!(ibv_cq_ex, status)),
        ("ibv_cq_ex", "wr_id", o!(ibv_cq_ex, wr_id)),
        ("ibv_cq_ex", "start_poll", o!(ibv_cq_ex, start_poll)),
        ("ibv_cq_ex", "read_opcode", o!(ibv_cq_ex, read_opcode)),
        ("ibv_cq_ex", "read_completion_ts", o!(ibv_cq_ex, read_completion_ts)),
        ("ibv_cq_ex", "read_completion_wallclock_ns", o!(ibv_cq_ex, read_completion_wallclock_ns)),
        ("ibv_cq_init_attr_ex", "cq_context", o!(ibv_cq_init_attr_ex, cq_context)),
        ("ibv_cq_init_attr_ex", "comp_vector", o!(ibv_cq_init_attr_ex, comp_vector)),
        ("ibv_cq_init_attr_ex", "wc_flags", o!(ibv_cq_init_attr_ex, wc_flags)),
        ("ibv_cq_init_attr_ex", "comp_mask", o!(ibv_cq_init_attr_ex, comp_mask)),
        ("ibv_cq_init_attr_ex", "parent_domain", o!(ibv_cq_init_attr_ex, parent_domain)),
        ("ibv_srq", "srq_context", o!(ibv_srq, srq_context)),
        ("ibv_srq", "pd", o!(ibv_srq, pd)),
        ("ibv_srq", "events_completed", o!(ibv_srq, events_completed)),
        ("ibv_srq_init_attr", "attr", o!(ibv_srq_init_attr, attr)),
        ("ibv_qp", "srq", o!(ibv_qp, srq)),
        ("ibv_qp", "qp_num", o!(ibv_qp, qp_num)),
        ("ibv_qp", "state", o!(ibv_qp, state)),
        ("ibv_qp", "qp_type", o!(ibv_qp, qp_type)),
        ("ibv_qp", "events_completed", o!(ibv_qp, events_completed)),
        ("ibv_qp_ex", "comp_mask", o!(ibv_qp_ex, comp_mask)),
        ("ibv_qp_ex", "wr_id", o!(ibv_qp_ex, wr_id)),
        ("ibv_qp_ex", "wr_flags", o!(ibv_qp_ex, wr_flags)),
        ("ibv_qp_ex", "wr_atomic_cmp_swp", o!(ibv_qp_ex, wr_atomic_cmp_swp)),
        ("ibv_qp_ex", "wr_send", o!(ibv_qp_ex, wr_send)),
        ("ibv_qp_ex", "wr_set_ud_addr", o!(ibv_qp_ex, wr_set_ud_addr)),
        ("ibv_qp_ex", "wr_set_inline_data", o!(ibv_qp_ex, wr_set_inline_data)),
        ("ibv_qp_ex", "wr_set_sge", o!(ibv_qp_ex, wr_set_sge)),
        ("ibv_qp_ex", "wr_set_sge_list", o!(ibv_qp_ex, wr_set_sge_list)),
        ("ibv_qp_ex", "wr_start", o!(ibv_qp_ex, wr_start)),
        ("ibv_qp_ex", "wr_complete", o!(ibv_qp_ex, wr_complete)),
        ("ibv_qp_ex", "wr_abort", o!(ibv_qp_ex, wr_abort)),
        ("ibv_qp_ex", "wr_atomic_write", o!(ibv_qp_ex, wr_atomic_write)),
        ("ibv_ah", "handle", o!(ibv_ah, handle)),
        ("ibv_global_route", "flow_label", o!(ibv_global_route, flow_label)),
        ("ibv_global_route", "traffic_class", o!(ibv_global_route, traffic_class)),
        ("ibv_ah_attr", "dlid", o!(ibv_ah_attr, dlid)),
        ("ibv_ah_attr", "is_global", o!(ibv_ah_attr, is_global)),
        ("ibv_ah_attr", "port_num", o!(ibv_ah_attr, port_num)),
        ("ibv_wc", "status", o!(ibv_wc, status)),
        ("ibv_wc", "opcode", o!(ibv_wc, opcode)),
        ("ibv_wc", "byte_len", o!(ibv_wc, byte_len)),
        ("ibv_wc", "imm_data", o!(ibv_wc, imm_data)),
        ("ibv_wc", "qp_num", o!(ibv_wc, qp_num)),
        ("ibv_wc", "src_qp", o!(ibv_wc, src_qp)),
        ("ibv_wc", "wc_flags", o!(ibv_wc, wc_flags)),
        ("ibv_wc", "pkey_index", o!(ibv_wc, pkey_index)),
        ("ibv_wc", "slid", o!(ibv_wc, slid)),
        ("ibv_wc", "sl", o!(ibv_wc, sl)),
        ("ibv_wc", "dlid_path_bits", o!(ibv_wc, dlid_path_bits)),
        ("ibv_sge", "length", o!(ibv_sge, length)),
        ("ibv_sge", "lkey", o!(ibv_sge, lkey)),
        ("ibv_send_wr", "next", o!(ibv_send_wr, next)),
        ("ibv_send_wr", "sg_list", o!(ibv_send_wr, sg_list)),
        ("ibv_send_wr", "num_sge", o!(ibv_send_wr, num_sge)),
        ("ibv_send_wr", "opcode", o!(ibv_send_wr, opcode)),
        ("ibv_send_wr", "send_flags", o!(ibv_send_wr, send_flags)),
        ("ibv_send_wr", "imm_data", o!(ibv_send_wr, imm_data)),
        ("ibv_send_wr", "wr", o!(ibv_send_wr, wr)),
        ("ibv_send_wr", "qp_type", o!(ibv_send_wr, remote_srqn)),
        ("ibv_send_wr", "bind_mw", o!(ibv_send_wr, tail)),
        ("ibv_recv_wr", "sg_list", o!(ibv_recv_wr, sg_list)),
        ("ibv_recv_wr", "num_sge", o!(ibv_recv_wr, num_sge)),
        ("ibv_qp_init_attr", "cap", o!(ibv_qp_init_attr, cap)),
        ("ibv_qp_init_attr", "qp_type", o!(ibv_qp_init_attr, qp_type)),
        ("ibv_qp_init_attr", "sq_sig_all", o!(ibv_qp_init_attr, sq_sig_all)),
        ("ibv_qp_init_attr_ex", "comp_mask", o!(ibv_qp_init_attr_ex, comp_mask)),
        ("ibv_qp_init_attr_ex", "pd", o!(ibv_qp_init_attr_ex, pd)),
        ("ibv_qp_init_attr_ex", "create_flags", o!(ibv_qp_init_attr_ex, create_flags)),
        ("ibv_qp_init_attr_ex", "rx_hash_conf", o!(ibv_qp_init_attr_ex, rx_hash_conf)),
        ("ibv_qp_init_attr_ex", "source_qpn", o!(ibv_qp_init_attr_ex, source_qpn)),
        ("ibv_qp_init_attr_ex", "send_ops_flags", o!(ibv_qp_init_attr_ex, send_ops_flags)),
        ("ibv_qp_attr", "qkey", o!(ibv_qp_attr, qkey)),
        ("ibv_qp_attr", "dest_qp_num", o!(ibv_qp_attr, dest_qp_num)),
        ("ibv_qp_attr", "qp_access_flags", o!(ibv_qp_attr, qp_access_flags)),
        ("ibv_qp_attr", "cap", o!(ibv_qp_attr, cap)),
        ("ibv_qp_attr", "ah_attr", o!(ibv_qp_attr, ah_attr)),
        ("ibv_qp_attr", "alt_ah_attr", o!(ibv_qp_attr, alt_ah_attr)),
        ("ibv_qp_attr", "pkey_index", o!(ibv_qp_attr, pkey_index)),
        ("ibv_qp_attr", "max_rd_atomic", o!(ibv_qp_attr, max_rd_atomic)),
        ("ibv_qp_attr", "min_rnr_timer", o!(ibv_qp_attr, min_rnr_timer)),
        ("ibv_qp_attr", "rnr_retry", o!(ibv_qp_attr, rnr_retry)),
        ("ibv_qp_attr", "alt_timeout", o!(ibv_qp_attr, alt_timeout)),
        ("ibv_qp_attr", "rate_limit", o!(ibv_qp_attr, rate_limit)),
        ("ibv_port_attr", "gid_tbl_len", o!(ibv_port_attr, gid_tbl_len)),
        ("ibv_port_attr", "max_msg_sz", o!(ibv_port_attr, max_msg_sz)),
        ("ibv_port_attr", "pkey_tbl_len", o!(ibv_port_attr, pkey_tbl_len)),
        ("ibv_port_attr", "lid", o!(ibv_port_attr, lid)),
        ("ibv_port_attr", "lmc", o!(ibv_port_attr, lmc)),
        ("ibv_port_attr", "active_width", o!(ibv_port_attr, active_width)),
        ("ibv_port_attr", "phys_state", o!(ibv_port_attr, phys_state)),
        ("ibv_port_attr", "link_layer", o!(ibv_port_attr, link_layer)),
        ("ibv_port_attr", "port_cap_flags2", o!(ibv_port_attr, port_cap_flags2)),
        ("ibv_device_attr", "node_guid", o!(ibv_device_attr, node_guid)),
        ("ibv_device_attr", "vendor_id", o!(ibv_device_attr, vendor_id)),
        ("ibv_device_attr", "max_qp", o!(ibv_device_attr, max_qp)),
        ("ibv_device_attr", "device_cap_flags", o!(ibv_device_attr, device_cap_flags)),
        ("ibv_device_attr", "atomic_cap", o!(ibv_device_attr, atomic_cap)),
        ("ibv_device_attr", "max_srq_sge", o!(ibv_device_attr, max_srq_sge)),
        ("ibv_device_attr", "max_pkeys", o!(ibv_device_attr, max_pkeys)),
        ("ibv_device_attr", "phys_port_cnt", o!(ibv_device_attr, phys_port_cnt)),
        ("ibv_device_attr_ex", "comp_mask", o!(ibv_device_attr_ex, comp_mask)),
        ("ibv_device_attr_ex", "phys_port_cnt_ex", o!(ibv_device_attr_ex, phys_port_cnt_ex)),
        ("ibv_gid_entry", "gid_index", o!(ibv_gid_entry, gid_index)),
        ("ibv_gid_entry", "gid_type", o!(ibv_gid_entry, gid_type)),
        ("ibv_gid_entry", "ndev_ifindex", o!(ibv_gid_entry, ndev_ifindex)),
        ("ibv_async_event", "event_type", o!(ibv_async_event, event_type)),
    ]
};

/// Sizes checked against the header.
pub const SIZES: &[(&str, usize)] = &{
    use std::mem::size_of as s;
    [
        ("ibv_device", s::<ibv_device>()),
        ("ibv_td", s::<ibv_td>()),
        ("ibv_td_init_attr", s::<ibv_td_init_attr>()),
        ("ibv_parent_domain_init_attr", s::<ibv_parent_domain_init_attr>()),
        ("ibv_context_ops", s::<ibv_context_ops>()),
        ("ibv_context", s::<ibv_context>()),
        ("verbs_context", s::<verbs_context>()),
        ("ibv_pd", s::<ibv_pd>()),
        ("ibv_mr", s::<ibv_mr>()),
        ("ibv_comp_channel", s::<ibv_comp_channel>()),
        ("ibv_cq", s::<ibv_cq>()),
        ("ibv_cq_ex", s::<ibv_cq_ex>()),
        ("ibv_cq_init_attr_ex", s::<ibv_cq_init_attr_ex>()),
        ("ibv_srq", s::<ibv_srq>()),
        ("ibv_srq_attr", s::<ibv_srq_attr>()),
        ("ibv_srq_init_attr", s::<ibv_srq_init_attr>()),
        ("ibv_qp", s::<ibv_qp>()),
        ("ibv_qp_ex", s::<ibv_qp_ex>()),
        ("ibv_data_buf", s::<ibv_data_buf>()),
        ("ibv_ah", s::<ibv_ah>()),
        ("ibv_global_route", s::<ibv_global_route>()),
        ("ibv_ah_attr", s::<ibv_ah_attr>()),
        ("ibv_wc", s::<ibv_wc>()),
        ("ibv_sge", s::<ibv_sge>()),
        ("ibv_send_wr", s::<ibv_send_wr>()),
        ("ibv_recv_wr", s::<ibv_recv_wr>()),
        ("ibv_qp_cap", s::<ibv_qp_cap>()),
        ("ibv_qp_init_attr", s::<ibv_qp_init_attr>()),
        ("ibv_rx_hash_conf", s::<ibv_rx_hash_conf>()),
        ("ibv_qp_init_attr_ex", s::<ibv_qp_init_attr_ex>()),
        ("ibv_qp_attr", s::<ibv_qp_attr>()),
        ("ibv_port_attr", s::<ibv_port_attr>()),
        ("ibv_device_attr", s::<ibv_device_attr>()),
        ("ibv_device_attr_ex", s::<ibv_device_attr_ex>()),
        ("ibv_gid_entry", s::<ibv_gid_entry>()),
        ("ibv_async_event", s::<ibv_async_event>()),
        ("ibv_modify_cq_attr", s::<ibv_modify_cq_attr>()),
    ]
};

// `struct verbs_device` lives in libibverbs' private driver.h, not in the installed headers: its size is the
// measured one.
const _: () = assert!(std::mem::size_of::<verbs_device>() == 712);

#[cfg(test)]
mod tests {
    use super::*;
    use std::fmt::Write as _;
    use std::path::PathBuf;
    use std::process::Command;

    /// Where `<infiniband/verbs.h>` is: `MLX5_IBVERBS_INCLUDE` (an include directory, e.g. from
    /// `dpkg -x libibverbs-dev_*.deb`), else the system's.
    fn include_dir() -> Option<PathBuf> {
        let dirs = std::env::var_os("MLX5_IBVERBS_INCLUDE").map(PathBuf::from).into_iter();
        dirs.chain([PathBuf::from("/usr/include")]).find(|d| d.join("infiniband/verbs.h").exists())
    }

    /// Compiles a C program against `<infiniband/verbs.h>` that prints every offset and size listed and
    /// compares them one by one. Without the header (libibverbs-dev not installed, `MLX5_IBVERBS_INCLUDE`
    /// unset) it says so and checks nothing; `cargo xtask libibverbs --check` always provides it.
    #[test]
    fn abi_matches_the_verbs_header() {
        let Some(inc) = include_dir() else {
            eprintln!("SKIPPED: <infiniband/verbs.h> not found (install libibverbs-dev or set MLX5_IBVERBS_INCLUDE)");
            return;
        };
        let mut c =
            String::from("#include <stdio.h>\n#include <stddef.h>\n#include <infiniband/verbs.h>\nint main(void){\n");
        for (s, f, _) in LAYOUT {
            writeln!(c, "printf(\"{s}.{f} %zu\\n\", offsetof(struct {s}, {f}));").unwrap();
        }
        for (s, _) in SIZES {
            writeln!(c, "printf(\"sizeof {s} %zu\\n\", sizeof(struct {s}));").unwrap();
        }
        c.push_str("return 0;}\n");
        let dir = std::env::temp_dir().join(format!("mlx5-ibverbs-abi-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (src, exe) = (dir.join("abi.c"), dir.join("abi"));
        std::fs::write(&src, c).unwrap();
        let cc = Command::new("cc").arg("-I").arg(&inc).arg("-o").arg(&exe).arg(&src).output().expect("cc");
        assert!(cc.status.success(), "cc failed: {}", String::from_utf8_lossy(&cc.stderr));
        let text = String::from_utf8(Command::new(&exe).output().unwrap().stdout).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let mut expected = String::new();
        for (s, f, o) in LAYOUT {
            writeln!(expected, "{s}.{f} {o}").unwrap();
        }
        for (s, n) in SIZES {
            writeln!(expected, "sizeof {s} {n}").unwrap();
        }
        for (c_line, rust_line) in text.lines().zip(expected.lines()) {
            assert_eq!(c_line, rust_line, "C header (left) and Rust (right) disagree");
        }
        assert_eq!(text.lines().count(), expected.lines().count());
    }

    #[test]
    fn measured_sizes_hold() {
        // The numbers of ../shared/notes/verbs-abi.md, so a build without the header still checks the layout.
        assert_eq!(std::mem::size_of::<ibv_context>(), 328);
        assert_eq!(std::mem::size_of::<verbs_context>(), 648);
        assert_eq!(std::mem::offset_of!(verbs_context, context), 320);
        assert_eq!(std::mem::size_of::<ibv_qp_ex>(), 352);
        assert_eq!(std::mem::size_of::<ibv_cq_ex>(), 288);
        assert_eq!(std::mem::size_of::<ibv_send_wr>(), 128);
        assert_eq!(std::mem::size_of::<ibv_device_attr_ex>(), 400);
        assert_eq!(std::mem::size_of::<ibv_port_attr>(), 52);
        assert_eq!(std::mem::size_of::<ibv_qp_attr>(), 144);
    }
}
