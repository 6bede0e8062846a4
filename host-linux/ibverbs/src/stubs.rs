//! The exports with nothing to do here, so a program (or Debian's libmlx5, libefa and librdmacm, which bind to
//! them at load time) finds every symbol: the provider interface (`ibv_cmd_*`, `verbs_*`, `execute_ioctl`) that
//! only kernel-backed providers call, import/export of objects across processes (needs a uverbs command fd),
//! multicast, ECE, dmabuf and kernel-ABI copies. Each fails with `EOPNOTSUPP` (NULL + errno for pointers), or
//! does nothing where the call returns nothing; fork protection is not needed (`ibv_fork_init` succeeds).

use std::ffi::{c_int, c_void};
use std::ptr;
use std::sync::atomic::AtomicBool;

use crate::set_errno;

/// `verbs_allow_disassociate_destroy` (a `bool` providers read): destroy calls succeed on a gone device.
#[no_mangle]
pub static verbs_allow_disassociate_destroy: AtomicBool = AtomicBool::new(false);

/// Returns EOPNOTSUPP (int-returning exports).
macro_rules! eopnotsupp {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> c_int {
            log::debug!(concat!(stringify!($name), ": not supported"));
            set_errno(libc::EOPNOTSUPP);
            libc::EOPNOTSUPP
        }
    )*};
}

/// Returns NULL with errno EOPNOTSUPP (pointer-returning exports).
macro_rules! null_eopnotsupp {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() -> *mut c_void {
            log::debug!(concat!(stringify!($name), ": not supported"));
            set_errno(libc::EOPNOTSUPP);
            ptr::null_mut()
        }
    )*};
}

/// Does nothing (exports returning void that only the kernel ABI or a provider plugin gives meaning to).
macro_rules! nothing {
    ($($name:ident),* $(,)?) => {$(
        #[no_mangle]
        pub extern "C" fn $name() {
            log::debug!(concat!(stringify!($name), ": not supported, nothing done"));
        }
    )*};
}
eopnotsupp!(
    __ioctl_final_num_attrs,
    execute_ioctl,
    ibv_attach_mcast,
    ibv_cmd_advise_mr,
    ibv_cmd_alloc_dm,
    ibv_cmd_alloc_mw,
    ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast,
    ibv_cmd_close_xrcd,
    ibv_cmd_create_ah,
    ibv_cmd_create_counters,
    ibv_cmd_create_cq,
    ibv_cmd_create_cq_ex,
    ibv_cmd_create_flow,
    ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp,
    ibv_cmd_create_qp_ex,
    ibv_cmd_create_qp_ex2,
    ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq,
    ibv_cmd_create_srq_ex,
    ibv_cmd_create_wq,
    ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd,
    ibv_cmd_dereg_mr,
    ibv_cmd_destroy_ah,
    ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq,
    ibv_cmd_destroy_flow,
    ibv_cmd_destroy_flow_action,
    ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table,
    ibv_cmd_destroy_srq,
    ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast,
    ibv_cmd_free_dm,
    ibv_cmd_get_context,
    ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp,
    ibv_cmd_modify_qp,
    ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq,
    ibv_cmd_modify_wq,
    ibv_cmd_open_qp,
    ibv_cmd_open_xrcd,
    ibv_cmd_poll_cq,
    ibv_cmd_post_recv,
    ibv_cmd_post_send,
    ibv_cmd_post_srq_recv,
    ibv_cmd_query_context,
    ibv_cmd_query_device_any,
    ibv_cmd_query_mr,
    ibv_cmd_query_port,
    ibv_cmd_query_qp,
    ibv_cmd_query_srq,
    ibv_cmd_read_counters,
    ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_dmabuf_mr,
    ibv_cmd_reg_mr,
    ibv_cmd_req_notify_cq,
    ibv_cmd_rereg_mr,
    ibv_cmd_resize_cq,
    ibv_detach_mcast,
    ibv_query_ece,
    ibv_resolve_eth_l2_from_gid,
    ibv_set_ece,
);
null_eopnotsupp!(
    ibv_import_device,
    ibv_import_dm,
    ibv_import_mr,
    ibv_import_pd,
    ibv_reg_dmabuf_mr,
    verbs_open_device,
    _verbs_init_and_alloc_context,
);
nothing!(
    ibv_copy_ah_attr_from_kern,
    ibv_copy_path_rec_from_kern,
    ibv_copy_path_rec_to_kern,
    ibv_copy_qp_attr_from_kern,
    ibv_unimport_dm,
    ibv_unimport_mr,
    ibv_unimport_pd,
    verbs_set_ops,
    verbs_uninit_context,
    verbs_init_cq,
    __verbs_log,
);

/// Called by the constructors of Debian's libmlx5 and libefa to register their provider: no provider is
/// loaded here (the device is this library's own), so the registration is accepted and ignored.
#[no_mangle]
pub extern "C" fn verbs_register_driver_34(_ops: *const c_void) {}

/// Nothing to set up, as rdma-core on a kernel with copy-on-fork: this library maps no device memory a fork
/// would share (a child gets a copy of registered memory), and a child that lists and opens devices gets
/// fresh ones of its own (`mlx5_verbs::fork_generation`); objects inherited from the parent are refused there.
#[no_mangle]
pub extern "C" fn ibv_fork_init() -> c_int {
    0
}

/// `IBV_FORK_UNNEEDED`, as rdma-core answers when the kernel copies pinned pages on fork.
#[no_mangle]
pub extern "C" fn ibv_is_fork_initialized() -> c_int {
    2
}

#[no_mangle]
pub extern "C" fn ibv_dofork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

#[no_mangle]
pub extern "C" fn ibv_dontfork_range(_base: *mut c_void, _size: usize) -> c_int {
    0
}

/// No in-order guarantee is reported (0), as for a device whose data may land out of order.
#[no_mangle]
pub extern "C" fn ibv_query_qp_data_in_order(_qp: *mut c_void, _op: c_int, _flags: u32) -> c_int {
    0
}

/// Providers read their sysfs attributes with it; there is no kernel device here.
#[no_mangle]
pub extern "C" fn ibv_read_ibdev_sysfs_file() -> c_int {
    set_errno(libc::ENOENT);
    -1
}
