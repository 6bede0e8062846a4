/// The CREATE_CQ whose input is the `create_cq_in` vector (and whose queue entry is `cmd_layout_create_cq`), on
/// the pages `pas`. One copy for the core's unit tests (`core/src/golden.rs`) and the command-queue tests
/// (`tests/tests/all/golden.rs`): each `include!`s it with `Pas`, `CqContext`, `CqeSize` and `CreateCq` in scope.
fn create_cq_vector_cmd(pas: &[u64]) -> CreateCq<'_> {
    CreateCq {
        ctx: CqContext {
            cqe_sz: CqeSize::B64,
            log_cq_size: 0xa,
            uar_page: 1,
            c_eqn: 3,
            log_page_size: 0,
            page_offset: 0,
            dbr_addr: 0x1234567000,
            oi: false,
        },
        pas: Pas::List(pas),
    }
}
