//! The C structures of rdma-core 44's `<rdma/rdma_cma.h>` (LP64), laid out exactly (sizes and offsets checked
//! by the test below against a C program compiled with the header), and the verbs structures they embed, which
//! are `mlx5-ibverbs`' own (`verbs`, the same file compiled here, so both libraries agree by construction).
#![allow(non_camel_case_types, missing_docs)]

use std::ffi::{c_char, c_int, c_void};

pub use mlx5_ibverbs_abi as verbs;

pub use verbs::{
    ibv_ah, ibv_ah_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_gid, ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_init_attr,
    ibv_qp_init_attr_ex, ibv_srq, ibv_wc,
};

/// `struct rdma_event_channel`: the descriptor `poll()` waits on.
#[repr(C)]
#[derive(Debug)]
pub struct rdma_event_channel {
    pub fd: c_int,
}

/// `struct rdma_ib_addr`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct rdma_ib_addr {
    pub sgid: ibv_gid,
    pub dgid: ibv_gid,
    /// Big-endian.
    pub pkey: u16,
}

/// `struct rdma_addr`: source and destination as `sockaddr_storage`, then the IB addresses.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct rdma_addr {
    pub src_storage: libc::sockaddr_storage,
    pub dst_storage: libc::sockaddr_storage,
    pub ibaddr: rdma_ib_addr,
}

/// `struct ibv_sa_path_rec` (`<infiniband/sa.h>`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ibv_sa_path_rec {
    pub dgid: ibv_gid,
    pub sgid: ibv_gid,
    pub dlid: u16,
    pub slid: u16,
    pub raw_traffic: c_int,
    pub flow_label: u32,
    pub hop_limit: u8,
    pub traffic_class: u8,
    pub reversible: c_int,
    pub numb_path: u8,
    pub pkey: u16,
    pub sl: u8,
    pub mtu_selector: u8,
    pub mtu: u8,
    pub rate_selector: u8,
    pub rate: u8,
    pub packet_life_time_selector: u8,
    pub packet_life_time: u8,
    pub preference: u8,
}

/// `struct rdma_route`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct rdma_route {
    pub addr: rdma_addr,
    pub path_rec: *mut ibv_sa_path_rec,
    pub num_paths: c_int,
}

/// `struct rdma_cm_id`.
#[repr(C)]
#[derive(Debug)]
pub struct rdma_cm_id {
    pub verbs: *mut ibv_context,
    pub channel: *mut rdma_event_channel,
    pub context: *mut c_void,
    pub qp: *mut ibv_qp,
    pub route: rdma_route,
    pub ps: c_int,
    pub port_num: u8,
    pub event: *mut rdma_cm_event,
    pub send_cq_channel: *mut ibv_comp_channel,
    pub send_cq: *mut ibv_cq,
    pub recv_cq_channel: *mut ibv_comp_channel,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut ibv_srq,
    pub pd: *mut ibv_pd,
    pub qp_type: c_int,
}

/// `struct rdma_conn_param`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct rdma_conn_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub flow_control: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
    pub srq: u8,
    pub qp_num: u32,
}

/// `struct rdma_ud_param`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct rdma_ud_param {
    pub private_data: *const c_void,
    pub private_data_len: u8,
    pub ah_attr: ibv_ah_attr,
    pub qp_num: u32,
    pub qkey: u32,
}

/// The `param` union of `struct rdma_cm_event`.
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(missing_debug_implementations)]
pub union rdma_cm_event_param {
    pub conn: rdma_conn_param,
    pub ud: rdma_ud_param,
}

/// `struct rdma_cm_event`.
#[repr(C)]
#[allow(missing_debug_implementations)]
pub struct rdma_cm_event {
    pub id: *mut rdma_cm_id,
    pub listen_id: *mut rdma_cm_id,
    pub event: c_int,
    pub status: c_int,
    pub param: rdma_cm_event_param,
}

/// `struct rdma_addrinfo`.
#[repr(C)]
#[derive(Debug)]
pub struct rdma_addrinfo {
    pub ai_flags: c_int,
    pub ai_family: c_int,
    pub ai_qp_type: c_int,
    pub ai_port_space: c_int,
    pub ai_src_len: libc::socklen_t,
    pub ai_dst_len: libc::socklen_t,
    pub ai_src_addr: *mut libc::sockaddr,
    pub ai_dst_addr: *mut libc::sockaddr,
    pub ai_src_canonname: *mut c_char,
    pub ai_dst_canonname: *mut c_char,
    pub ai_route_len: usize,
    pub ai_route: *mut c_void,
    pub ai_connect_len: usize,
    pub ai_connect: *mut c_void,
    pub ai_next: *mut rdma_addrinfo,
}

/// `enum rdma_cm_event_type`.
pub mod event {
    pub const ADDR_RESOLVED: i32 = 0;
    pub const ADDR_ERROR: i32 = 1;
    pub const ROUTE_RESOLVED: i32 = 2;
    pub const ROUTE_ERROR: i32 = 3;
    pub const CONNECT_REQUEST: i32 = 4;
    pub const CONNECT_RESPONSE: i32 = 5;
    pub const CONNECT_ERROR: i32 = 6;
    pub const UNREACHABLE: i32 = 7;
    pub const REJECTED: i32 = 8;
    pub const ESTABLISHED: i32 = 9;
    pub const DISCONNECTED: i32 = 10;
    pub const DEVICE_REMOVAL: i32 = 11;
    pub const MULTICAST_JOIN: i32 = 12;
    pub const MULTICAST_ERROR: i32 = 13;
    pub const ADDR_CHANGE: i32 = 14;
    pub const TIMEWAIT_EXIT: i32 = 15;
}

/// `rdma_addrinfo.ai_flags` (`RAI_*`).
pub const RAI_PASSIVE: c_int = 1;
/// `RAI_NUMERICHOST`.
pub const RAI_NUMERICHOST: c_int = 2;

/// `IBV_QPT_RC`.
pub const IBV_QPT_RC: c_int = 2;
/// `IBV_QPT_UD`.
pub const IBV_QPT_UD: c_int = 4;

/// The Q_Key of rdma_cm's UDP port space (`RDMA_UDP_QKEY`).
pub const RDMA_UDP_QKEY: u32 = 0x0123_4567;

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// The figures of a C program built with rdma-core 44's `<rdma/rdma_cma.h>` (`offsetof`, `sizeof`).
    #[test]
    fn layouts_match_rdma_cma_h() {
        assert_eq!(size_of::<rdma_cm_id>(), 416);
        assert_eq!(offset_of!(rdma_cm_id, route), 32);
        assert_eq!(offset_of!(rdma_cm_id, ps), 344);
        assert_eq!(offset_of!(rdma_cm_id, port_num), 348);
        assert_eq!(offset_of!(rdma_cm_id, event), 352);
        assert_eq!(offset_of!(rdma_cm_id, pd), 400);
        assert_eq!(offset_of!(rdma_cm_id, qp_type), 408);
        assert_eq!(size_of::<rdma_route>(), 312);
        assert_eq!(offset_of!(rdma_route, path_rec), 296);
        assert_eq!(offset_of!(rdma_route, num_paths), 304);
        assert_eq!(size_of::<rdma_addr>(), 296);
        assert_eq!(offset_of!(rdma_addr, dst_storage), 128);
        assert_eq!(offset_of!(rdma_addr, ibaddr), 256);
        assert_eq!(size_of::<rdma_cm_event>(), 80);
        assert_eq!(offset_of!(rdma_cm_event, event), 16);
        assert_eq!(offset_of!(rdma_cm_event, status), 20);
        assert_eq!(offset_of!(rdma_cm_event, param), 24);
        assert_eq!(size_of::<rdma_conn_param>(), 24);
        assert_eq!(offset_of!(rdma_conn_param, private_data_len), 8);
        assert_eq!(offset_of!(rdma_conn_param, qp_num), 16);
        assert_eq!(size_of::<rdma_ud_param>(), 56);
        assert_eq!(offset_of!(rdma_ud_param, ah_attr), 16);
        assert_eq!(offset_of!(rdma_ud_param, qp_num), 48);
        assert_eq!(offset_of!(rdma_ud_param, qkey), 52);
        assert_eq!(size_of::<rdma_addrinfo>(), 96);
        assert_eq!(offset_of!(rdma_addrinfo, ai_src_addr), 24);
        assert_eq!(offset_of!(rdma_addrinfo, ai_next), 88);
        assert_eq!(size_of::<ibv_sa_path_rec>(), 64);
        assert_eq!(offset_of!(ibv_sa_path_rec, dlid), 32);
        assert_eq!(offset_of!(ibv_sa_path_rec, hop_limit), 44);
        assert_eq!(offset_of!(ibv_sa_path_rec, pkey), 54);
        assert_eq!(offset_of!(ibv_sa_path_rec, mtu), 58);
    }
}
