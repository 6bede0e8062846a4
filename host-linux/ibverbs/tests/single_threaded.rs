//! `MLX5_SINGLE_THREADED=1`, rdma-core's promise of one thread at a time, in a binary of its own: the drop-in
//! reads it at `ibv_open_device` for the whole process, and one test here is the only thread that opens. Queues
//! made then lock with an in-use flag instead of a locked instruction (`mlx5-verbs`' own tests show which lock
//! each queue got); here a program's posts and polls work under it, on a context opened with and one without.

mod common;
use common::*;

#[test]
fn posts_and_polls_work_on_a_context_opened_single_threaded() {
    // The variable as rdma-core reads it: exactly "1". Set before any thread of the library exists.
    std::env::set_var("MLX5_SINGLE_THREADED", "1");
    // SAFETY: plain calls of the library's exports, on contexts this test opened and closes.
    unsafe {
        let ctx = ibv_open_device(first_device());
        assert!(!ctx.is_null(), "open: errno {}", errno());
        for round in 0..3 {
            exchange(ctx).unwrap_or_else(|e| panic!("round {round}: {e}"));
        }
        assert_eq!(ibv_close_device(ctx), 0);
        // Any other value leaves the locks as they are: the same exchange on a context opened after.
        std::env::set_var("MLX5_SINGLE_THREADED", "0");
        let ctx = ibv_open_device(first_device());
        assert!(!ctx.is_null(), "open: errno {}", errno());
        exchange(ctx).expect("exchange with the queues' locks");
        assert_eq!(ibv_close_device(ctx), 0);
    }
}
