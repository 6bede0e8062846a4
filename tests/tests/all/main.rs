//! The cross-crate tests, one module per area, in one test binary (one link instead of fifteen).
//!
//! The tests of all modules share this process and run on parallel threads, so none may rely on process-global
//! state: the counting global allocator below counts per thread (armed only by `no_alloc`'s tests, around the
//! calls they check), no test sets environment variables, and none binds a fixed port.

mod bfregs;
mod bringup;
mod bringup_faults;
mod cmdq;
mod completion_channel;
mod cq;
mod datapath;
mod eqs_and_health;
mod flush_on_failure;
mod fuzz_regressions;
mod gid;
mod golden;
mod mock_recipe;
mod mock_replay;
mod no_alloc;
mod pages;
mod parity;
mod pcap;
mod qp_rules;
mod ring_props;
mod sim;
mod srq;
mod user_mr;
mod verbs_complete;
mod verbs_devices;
mod verbs_events;
mod verbs_ex;
mod verbs_gsi;
mod verbs_limits;
mod verbs_mr;
mod verbs_port_ah;
mod verbs_recovery;
mod verbs_scale;
mod verbs_smi;
mod verbs_srq;
mod verbs_threads;
mod verbs_vectors;
mod vfio_msix;

/// The counting allocator `no_alloc` arms; unarmed threads allocate through it at the cost of one thread-local read.
#[global_allocator]
static GLOBAL: mlx5_sim::testkit::alloc_count::Counting = mlx5_sim::testkit::alloc_count::Counting;
