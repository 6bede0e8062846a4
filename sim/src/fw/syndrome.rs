//! Syndromes the simulated firmware reports with a failing status. Values are the simulator's own (real
//! firmware syndromes are undocumented); each check has its own so a test can tell them apart.

/// `BAD_OP`: the opcode is not implemented.
pub const BAD_OPCODE: u32 = 0x51a0_0001;
/// `BAD_INP_LEN`: `inlen` is shorter than the command's input (with its declared `pas[]`).
pub const BAD_INPUT_LEN: u32 = 0x51a0_0002;
/// `BAD_OUTP_LEN`: `outlen` is shorter than the command's output (with the `pas[]` it may return).
pub const BAD_OUTPUT_LEN: u32 = 0x51a0_0003;
/// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: a command other than QUERY_ISSI / ENABLE_HCA before ENABLE_HCA.
pub const NOT_ENABLED: u32 = 0x51a0_0010;
/// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: ENABLE_HCA on an enabled function.
pub const ALREADY_ENABLED: u32 = 0x51a0_0011;
/// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: an object command or TEARDOWN_HCA before INIT_HCA.
pub const NOT_INITIALIZED: u32 = 0x51a0_0012;
/// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: INIT_HCA, SET_ISSI or SET_HCA_CAP after INIT_HCA.
pub const ALREADY_INITIALIZED: u32 = 0x51a0_0013;
/// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: DISABLE_HCA before TEARDOWN_HCA.
pub const STILL_INITIALIZED: u32 = 0x51a0_0014;
/// `consts::MLX5_CMD_STAT_BAD_SYS_STATE_ERR`: INIT_HCA before the boot and init pages were given.
pub const PAGES_MISSING: u32 = 0x51a0_0015;
/// `consts::MLX5_CMD_STAT_LIM_ERR`: the command waited for pages the driver then said it cannot give
/// (MANAGE_PAGES with op_mod CANT_GIVE).
pub const PAGES_REFUSED: u32 = 0x51a0_0016;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an op_mod the command does not define.
pub const BAD_OP_MOD: u32 = 0x51a0_0020;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_ISSI with an ISSI other than 0 or 1.
pub const BAD_ISSI: u32 = 0x51a0_0021;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a function other than our own (function_id, other_function, embedded_cpu_function).
pub const BAD_FUNCTION: u32 = 0x51a0_0022;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: MODIFY_CQ with a field_select bit the simulator does not know, or a resize without
/// `MLX5_MODIFY_CQ_MASK_LOG_SIZE`.
pub const FIELD_SELECT: u32 = 0x51a0_0023;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a MANAGE_PAGES page address not 4 KiB aligned.
pub const PAGE_MISALIGNED: u32 = 0x51a0_0030;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a MANAGE_PAGES page not inside live DMA memory.
pub const PAGE_NOT_MAPPED: u32 = 0x51a0_0031;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a MANAGE_PAGES page firmware already owns (or listed twice).
pub const PAGE_ALREADY_OWNED: u32 = 0x51a0_0032;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unsupported capability type.
pub const CAP_TYPE: u32 = 0x51a0_0040;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_HCA_CAP changes a field that is not settable.
pub const CAP_READ_ONLY: u32 = 0x51a0_0041;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_HCA_CAP sets a value above the maximum capability.
pub const CAP_ABOVE_MAX: u32 = 0x51a0_0042;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: TEARDOWN_HCA with an unsupported profile.
pub const BAD_PROFILE: u32 = 0x51a0_0043;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown PD.
pub const PD_INVALID: u32 = 0x51a0_0050;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown XRC domain.
pub const XRCD_INVALID: u32 = 0x51a0_0057;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown transport domain.
pub const TD_INVALID: u32 = 0x51a0_0058;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: MODIFY_NIC_VPORT_CONTEXT selects a field the device does not modify.
pub const NIC_VPORT_FIELD: u32 = 0x51a0_0085;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown UAR page.
pub const UAR_INVALID: u32 = 0x51a0_0051;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown EQ.
pub const EQ_INVALID: u32 = 0x51a0_0052;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown CQ.
pub const CQ_INVALID: u32 = 0x51a0_0053;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown memory key index.
pub const MKEY_INVALID: u32 = 0x51a0_0054;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a CREATE_EQ `event_bitmask` asks for an event type the device does
/// not report (one its capabilities do not offer).
pub const EQ_EVENT_TYPE: u32 = 0x51a0_0056;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: log_eq_size / log_cq_size above the `log_max_*_sz` capability.
pub const LOG_SIZE: u32 = 0x51a0_0060;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: cqe_sz other than 64 or 128 bytes.
pub const CQE_SIZE: u32 = 0x51a0_0061;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: fewer `pas[]` entries than the queue needs (or, for CREATE_MKEY, fewer MTT entries than
/// the pages the key covers, in the input or in `translations_octword_size`).
pub const PAS_TOO_FEW: u32 = 0x51a0_0062;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a `pas[]` (or MTT) entry not aligned to the page size.
pub const PAS_MISALIGNED: u32 = 0x51a0_0063;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a `pas[]` (or MTT) page not inside live DMA memory.
pub const PAS_NOT_MAPPED: u32 = 0x51a0_0064;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a page_offset an object does not take (a CQ's or EQ's non-zero one;
/// one of a page or more for an SRQ ring).
pub const PAGE_OFFSET: u32 = 0x51a0_0065;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a CQ doorbell record not inside live DMA memory.
pub const DBR_NOT_MAPPED: u32 = 0x51a0_0066;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a CQ bound to an APU element (not supported).
pub const APU_CQ: u32 = 0x51a0_0067;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: MODIFY_CQ(resize) to fewer entries than the CQEs the driver has not consumed yet.
pub const CQ_TOO_SMALL: u32 = 0x51a0_0068;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a CQ feature the simulator does not model (a collapsed CQ, `cc`).
pub const CQ_FEATURE: u32 = 0x51a0_0069;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: `cqe_comp_en` for a CQE size whose compression cap is 0, a
/// `mini_cqe_res_format` the caps do not offer, or an enhanced `cqe_compression_layout`.
pub const CQE_COMPRESSION: u32 = 0x51a0_006a;
/// `NO_RES`: the object limit (`log_max_*`, UAR pages in the BAR) is reached.
pub const NO_RESOURCES: u32 = 0x51a0_0070;
/// `BAD_RES_STATE`: the object is still used (an EQ by a CQ, a UAR by an EQ or CQ, a PD by a memory key).
pub const IN_USE: u32 = 0x51a0_0071;
/// `BAD_RES_STATE`: MODIFY_CQ(resize) of a CQ in error (overflow or write failure).
pub const CQ_IN_ERROR: u32 = 0x51a0_0072;
/// `BAD_RES_STATE`: MODIFY_CQ(resize) while the old buffer is full: the resize CQE has no free entry.
pub const CQ_FULL: u32 = 0x51a0_0073;
/// ACCESS_REGISTER of a register the device does not model, or in the wrong direction.
pub const REG_ACCESS: u32 = 0x51a0_0080;
/// A port number the device does not have (it has port 1), or a query for the other link layer.
pub const BAD_PORT: u32 = 0x51a0_0081;
/// SET_ROCE_ADDRESS or QUERY_ROCE_ADDRESS with an index at or past `roce_address_table_size`.
pub const GID_INDEX: u32 = 0x51a0_0083;
/// SET_ROCE_ADDRESS with a `roce_version` or `roce_l3_type` the PRM does not define.
pub const ROCE_ADDRESS: u32 = 0x51a0_0084;
/// A command needing a capability firmware does not report (SET_DRIVER_VERSION without `driver_version`).
pub const CAP_NOT_SET: u32 = 0x51a0_0082;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY with an access mode other than PA or MTT.
pub const MKEY_ACCESS_MODE: u32 = 0x51a0_0090;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY with `qpn` other than 0xffffff (keys bound to a QP are not supported).
pub const MKEY_QPN: u32 = 0x51a0_0091;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY(MTT) with `log_page_size` below 12 or above 63.
pub const MKEY_PAGE_SIZE: u32 = 0x51a0_0092;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY whose range wraps around 2^64, or an MTT key with `length64`.
pub const MKEY_LENGTH: u32 = 0x51a0_0093;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_MKEY asking for what the simulator does not model (a free key, umem, BSF, crossing).
pub const MKEY_FEATURE: u32 = 0x51a0_0094;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown QP.
pub const QP_INVALID: u32 = 0x51a0_00a0;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP with a transport service other than RC, UD or (where `uc` is reported) UC.
pub const QP_TYPE: u32 = 0x51a0_00a1;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP with `pm_state` other than `MLX5_QP_PM_MIGRATED`.
pub const QP_PM_STATE: u32 = 0x51a0_00a2;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP with an RQ type other than a regular, a zero-length or an SRQ RQ.
pub const QP_RQ_TYPE: u32 = 0x51a0_00a3;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RQ WQE (`16 << log_rq_stride`) above `max_wqe_sz_rq`.
pub const QP_WQE_SIZE: u32 = 0x51a0_00a4;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP asking for what the simulator does not model (umem, XRC, an SRQ number
/// without the SRQ RQ type, a chosen QPN,
/// the extended context).
pub const QP_FEATURE: u32 = 0x51a0_00a5;
/// `BAD_QP_STATE`: a transition from a state it does not start from (2ERR from RST included).
pub const QP_STATE: u32 = 0x51a0_00a6;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a pkey index beyond the pkey table.
pub const QP_PKEY_INDEX: u32 = 0x51a0_00a7;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an address path the link layer cannot use (IB: no LID; RoCE: no GRH, GID or MAC; a source
/// GID index beyond the table).
pub const QP_PATH: u32 = 0x51a0_00a8;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: INIT2RTR (RC or UD) with an MTU other than `IB_MTU_256..=IB_MTU_4096`.
pub const QP_MTU: u32 = 0x51a0_00a9;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a context value above its capability (`log_msg_max`, `log_rra_max`, `log_sra_max`), or a UC
/// modify with an option or a remote right UC does not take (read, atomic, RNR, ACK and retry parameters, qkey).
pub const QP_CONTEXT: u32 = 0x51a0_00aa;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: INIT2RTR of a RoCE QP whose `src_addr_index` names a GID table entry
/// SET_ROCE_ADDRESS never programmed (or cleared).
pub const GID_NOT_SET: u32 = 0x51a0_00ab;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a Q counter set id that is not allocated (DEALLOC/QUERY_Q_COUNTER, or a
/// QP's `counter_set_id` in RST2INIT).
pub const Q_COUNTER_INVALID: u32 = 0x51a0_00ac;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: remote atomics enabled (`rae`) with an `atomic_mode` the device does not
/// report (0, or a mode above the caps' `atomic_size_qp`), as `set_qpc_atomic_flags` never sends.
pub const QP_ATOMIC_MODE: u32 = 0x51a0_00ad;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_QP with a `ts_format` the device's timestamp capability does not
/// include (free-running on a real-time-only device, real-time on a free-running one, or an undefined value).
pub const QP_TS_FORMAT: u32 = 0x51a0_00ae;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: unknown SRQ or RMP (or one of the other command family).
pub const SRQ_INVALID: u32 = 0x51a0_00b0;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an SRQ WQE stride below 32 bytes or above `max_wqe_sz_rq`.
pub const SRQ_STRIDE: u32 = 0x51a0_00b1;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an SRQ limit (`lwm`) not below the ring size.
pub const SRQ_LWM: u32 = 0x51a0_00b2;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RMP not RDY or whose `wq` is not a linked list, an SRQ not GOOD.
pub const SRQ_CONTEXT: u32 = 0x51a0_00b3;
/// `BAD_OP`: an RMP command at ISSI 0, or an SRQ command (CREATE_SRQ, ARM_RQ, ...) at ISSI 1.
pub const SRQ_ISSI: u32 = 0x51a0_00b4;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RQ or SQ whose `wq` is not cyclic (striding and linked-list rings
/// are not modelled).
pub const WQ_TYPE: u32 = 0x51a0_00c0;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RQ or SQ stride outside 16 B..4 KiB, a ring above `log_max_wq_sz`,
/// a page size above 1 GiB or a non-zero page offset.
pub const WQ_SIZE: u32 = 0x51a0_00c1;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RQ or SQ doorbell record not 4-byte aligned or not in live memory.
pub const WQ_DBR: u32 = 0x51a0_00c2;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RQ or SQ created in a state other than RST, or an RQ on an RMP.
pub const WQ_CONTEXT: u32 = 0x51a0_00c3;
/// `consts::MLX5_CMD_STAT_BAD_RES_STATE_ERR`: MODIFY_RQ/SQ naming a current state the queue is not in, or a move
/// other than RST to RDY, RDY to RDY, ERR or RST, and ERR to RST.
pub const WQ_STATE: u32 = 0x51a0_00c4;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown RQ (destroy, modify, query, a TIR's `inline_rqn`, an RQT entry).
pub const RQ_INVALID: u32 = 0x51a0_00c5;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown SQ.
pub const SQ_INVALID: u32 = 0x51a0_00c6;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown TIS, or an SQ naming other than exactly one.
pub const TIS_INVALID: u32 = 0x51a0_00c7;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown TIR (destroy, modify, a flow entry's destination).
pub const TIR_INVALID: u32 = 0x51a0_00c8;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a TIR dispatch type or hash function the PRM does not define, or packet
/// merging (LRO), which is not offered.
pub const TIR_HASH: u32 = 0x51a0_00c9;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown RQT (destroy, modify, an indirect TIR's `indirect_table`).
pub const RQT_INVALID: u32 = 0x51a0_00ca;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an RQT of size 0, above `log_max_rqt_size`, more entries than its
/// `rqt_max_size`, or a list of other than RQs.
pub const RQT_SIZE: u32 = 0x51a0_00cb;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a steering command on a table type other than NIC receive.
pub const FT_TYPE: u32 = 0x51a0_00d0;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown flow table.
pub const FT_INVALID: u32 = 0x51a0_00d1;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a table level or size above the capabilities, or a miss or forward to a
/// table that is not deeper.
pub const FT_LEVEL: u32 = 0x51a0_00d2;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a miss action the PRM does not define, or a table feature not offered
/// (reformat, decap, software ownership, termination).
pub const FT_MISS: u32 = 0x51a0_00d3;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a flow group range that is empty, beyond the table or overlapping
/// another group, or an entry's index outside its group.
pub const FG_RANGE: u32 = 0x51a0_00d4;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a flow group matching beyond the outer headers.
pub const FG_CRITERIA: u32 = 0x51a0_00d5;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown flow group.
pub const FG_INVALID: u32 = 0x51a0_00d6;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_FLOW_TABLE_ENTRY adding at an index already taken.
pub const FTE_EXISTS: u32 = 0x51a0_00d7;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown flow entry (delete, or a modify of a free index).
pub const FTE_INVALID: u32 = 0x51a0_00d8;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an entry action other than drop or forward, a forward without
/// destinations (or destinations without one), too many, counters, or an unknown destination type.
pub const FTE_ACTION: u32 = 0x51a0_00d9;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: ATTACH_TO_MCG or DETACH_FROM_MCG with a GID that is not multicast.
pub const MCG_GID: u32 = 0x51a0_00e0;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: DETACH_FROM_MCG of a QP not attached to the group.
pub const MCG_NOT_ATTACHED: u32 = 0x51a0_00e1;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a command whose header `uid` is not a live user context (DevX).
pub const UID_INVALID: u32 = 0x51a0_0100;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a destroy, modify or query with a user context's `uid` on an object
/// another context (or the kernel) created.
pub const UID_MISMATCH: u32 = 0x51a0_0101;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_UCTX asking for a `cap` bit `uctx_cap` does not offer.
pub const UCTX_CAP: u32 = 0x51a0_0102;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: an unknown UMEM (DESTROY_UMEM, or a queue naming one).
pub const UMEM_INVALID: u32 = 0x51a0_0103;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a queue or doorbell record reaching past the end of its UMEM.
pub const UMEM_TOO_SMALL: u32 = 0x51a0_0104;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: a ring that does not start on a UMEM page, or a doorbell record that
/// crosses one.
pub const UMEM_OFFSET: u32 = 0x51a0_0105;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_UMEM with a page above 1 GiB or a `page_offset` beyond the page.
pub const UMEM_PAGE: u32 = 0x51a0_0106;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: CREATE_CQ on a UMEM (`cq_umem_valid`, `dbr_umem_valid`): not modelled.
pub const CQ_UMEM: u32 = 0x51a0_0107;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: ALLOC_MEMIC of 0 bytes, of a size not a multiple of 64 bytes
/// (`log_min_memic_alloc_size`) or larger than its range.
pub const MEMIC_SIZE: u32 = 0x51a0_0110;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: ALLOC_MEMIC with `log_memic_addr_alignment` above
/// `log_max_memic_addr_alignment`.
pub const MEMIC_ALIGN: u32 = 0x51a0_0111;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: ALLOC_MEMIC with a range not inside the MEMIC region of the BAR.
pub const MEMIC_RANGE: u32 = 0x51a0_0112;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: DEALLOC_MEMIC of a start and size that name no allocation (never
/// allocated, or already freed).
pub const MEMIC_INVALID: u32 = 0x51a0_0113;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_PP_RATE_LIMIT of index 0 (no limit) or one past the table.
pub const PP_INDEX: u32 = 0x51a0_0120;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_PP_RATE_LIMIT of a rate outside `packet_pacing_min_rate` to
/// `packet_pacing_max_rate`, or a burst bound or typical size the QoS caps do not offer.
pub const PP_RATE: u32 = 0x51a0_0121;
/// `consts::MLX5_CMD_STAT_BAD_PARAM_ERR`: SET_PP_RATE_LIMIT with a `uid` where `packet_pacing_uid` is 0.
pub const PP_UID: u32 = 0x51a0_0122;
/// `ext_synd` in the health buffer of a firmware that died with a non-zero syndrome.
pub const HEALTH_EXT_SYND: u16 = 0x51a0;
