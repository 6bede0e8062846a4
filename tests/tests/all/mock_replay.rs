//! Recorded traces replayed through the expectation mock: the simulator's trace.jsonl of a whole bring-up and
//! teardown, and a real ConnectX-4's commands as Linux recorded them (../shared/data/connectx4-fw-14.12.1220).

use std::io::Read;

use mlx5_core::hal::DelayNs;
use mlx5_core::hca::{Config, Hca, Step};
use mlx5_core::mock::MockDevice;
use mlx5_core::prm::MsgBuf;
use mlx5_core::trace::{CmdRecord, CmdTrace};
use mlx5_sim::{SimConfig, SimDevice};
use mlx5_tests::mock_load::{expectations, from_linux_dump, from_trace_jsonl};

struct NoDelay;
impl DelayNs for NoDelay {
    fn delay_ns(&mut self, _ns: u32) {}
}

/// Collects the JSON lines `mlx5 --trace FILE` writes.
#[derive(Default)]
struct JsonLines(String);
impl CmdTrace for JsonLines {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        rec.write_json(&mut self.0).unwrap();
        self.0.push('\n');
    }
}

fn arena(bytes: usize) -> &'static mut [u8] {
    Box::leak(vec![0u8; bytes].into_boxed_slice())
}

#[test]
fn mock_replay_of_a_simulator_trace_runs_the_same_bring_up_and_teardown() {
    let cfg = Config { async_eq_nent: 64, ..Config::default() };
    let sim = SimDevice::new(SimConfig::default());
    let mut d = sim.delay();
    let hca: Hca<_, _, _> = Hca::bring_up(sim.mmio(), sim.dma(), JsonLines::default(), &mut d, cfg).unwrap();
    let given = hca.pages_given();
    let mut hca = hca;
    let text = std::mem::take(&mut hca.cmdq().tracer().0);
    hca.teardown(&mut d).unwrap();
    let recs = from_trace_jsonl(&text).unwrap();
    assert!(recs.len() > 20, "a whole bring-up: {}", recs.len());

    let dev: MockDevice<'_, 128, 128> = MockDevice::new(arena(64 << 20));
    dev.expect_all(expectations(&recs));
    let hca: Hca<_, _> =
        Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg).unwrap_or_else(|e| panic!("{e}: {:?}", dev.done()));
    dev.assert_done();
    // The simulator's page requests (served during bring-up) were replayed as page-request EQEs.
    assert_eq!(hca.pages_given(), given);
    assert_eq!(dev.pages_held(), given);
    drop(hca);
}

#[test]
fn mock_replay_loader_reads_trace_lines_and_names_bad_ones() {
    let line = "{\"slot\":0,\"token\":1,\"opcode\":\"ALLOC_PD\",\"opcode_raw\":2048,\"op_mod\":0,\
                \"input\":\"08000000000000000000000000000000\",\"output\":\"03000000123456780000000000000000\",\
                \"delivery\":\"OK\",\"status\":\"BAD_PARAM\",\"status_raw\":3,\"syndrome\":305419896,\"waited_us\":0}";
    let recs = from_trace_jsonl(line).unwrap();
    assert_eq!(
        (recs[0].opcode, recs[0].output.as_ref().unwrap()[4..8].to_vec()),
        (0x800, vec![0x12, 0x34, 0x56, 0x78])
    );
    let timeout = line.replace("\"output\":\"03000000123456780000000000000000\"", "\"output\":null");
    assert_eq!(from_trace_jsonl(&timeout).unwrap()[0].output, None);
    assert_eq!(from_trace_jsonl("{}\n").unwrap_err(), "line 1: no number opcode_raw");
    assert_eq!(from_trace_jsonl(&line.replace("0800", "08x0")).unwrap_err(), "line 1: bad hex input");
}

fn connectx4() -> String {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/data/connectx4-fw-14.12.1220/trace-mlx5_core.txt.gz");
    let gz = std::fs::read(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    let mut text = String::new();
    flate2::read::GzDecoder::new(&gz[..]).read_to_string(&mut text).unwrap();
    text
}

#[test]
fn mock_replay_loader_reads_the_linux_dump_of_a_connectx4() {
    let recs = from_linux_dump(&connectx4()).unwrap();
    assert_eq!(recs.len(), 42);
    let first: Vec<(u16, u16)> = recs.iter().take(5).map(|r| (r.opcode, r.op_mod)).collect();
    assert_eq!(first, [(0x104, 0), (0x10a, 0), (0x10b, 0), (0x107, 1), (0x108, 1)]);
    // QUERY_ISSI's output came through its mailbox: supported_issi_dw0 at byte 0x6c says ISSI 1 (bit 1).
    let issi = recs[1].output.as_ref().unwrap();
    assert_eq!((issi.len(), &issi[0x6c..0x70]), (0x70, &[0, 0, 0, 2][..]));
    // Every command completed with status 0 and was delivered.
    assert!(recs.iter().all(|r| r.delivery == 0 && r.output.as_ref().is_some_and(|o| o[0] == 0)));
}

#[test]
fn mock_replay_loader_refuses_a_malformed_dump() {
    assert_eq!(
        from_linux_dump("mlx5_core: dump command FOO(0x999) OUTPUT\n000: 07000000\n").unwrap_err(),
        "0x999: dump shorter than a command entry"
    );
    assert!(from_linux_dump("dump command FOO(0xzz) INPUT").unwrap_err().contains("bad opcode"));
}

/// The ConnectX-4 recording into the core's bring-up: the two agree from ENABLE_HCA through SET_HCA_CAP of the
/// general capabilities (11 commands, with the real device's capability pages, boot pages and ISSI), then
/// depart. Linux of 2016 (the recording) went on to QUERY_PAGES(init); the core, as Linux 6.12's
/// `handle_hca_cap_atomic`, first queries the atomic capabilities, which this ConnectX-4 reports (`atomic` set in
/// its current general capabilities), so the first command the recording does not expect is QUERY_HCA_CAP where
/// it has QUERY_PAGES.
#[test]
fn mock_replay_of_a_connectx4_recording_agrees_until_the_atomic_caps() {
    let recs = from_linux_dump(&connectx4()).unwrap();
    let dev: MockDevice<'_, 64, 128> = MockDevice::new(arena(64 << 20));
    dev.expect_all(expectations(&recs));
    let err = Hca::<_, _>::bring_up(&dev, &dev, (), &mut NoDelay, Config::default()).unwrap_err();
    assert_eq!(dev.first_unexpected().as_deref(), Some("expected QUERY_PAGES, got QUERY_HCA_CAP"));
    assert_eq!(dev.matched(), 9);
    assert_eq!(err.step, Step::SetHcaCaps);
    // The recording has no teardown: the unwinding's MANAGE_PAGES take and DISABLE_HCA are answered BAD_OP, so
    // the function was never disabled and the driver keeps the boot pages firmware may still write (one chunk)
    // rather than freeing them under it.
    assert!(err.cleanup.is_some());
    assert_eq!((dev.pages_held(), dev.live_regions()), (6, 1));
}

/// The recording's commands in the order the core sends them on a ConnectX-4, as indices into the recording:
/// ENABLE_HCA, QUERY_ISSI, SET_ISSI, boot QUERY_PAGES and MANAGE_PAGES, ACCESS_REG (host endianness), the general
/// capabilities (maximum, current) and SET_HCA_CAP; then, because this device's current general capabilities
/// have `atomic` and `roce`, the atomic and RoCE capabilities (maximum, current: Linux 6.12's
/// `handle_hca_cap_atomic` and `handle_hca_cap_roce`; the recorded Linux of 2016 asked for them after INIT_HCA,
/// and firmware answers both the same), with no SET of either (`supported_atomic_req_8B_endianness_mode_1` and
/// `sw_r_roce_src_udp_port` are 0); init QUERY_PAGES and MANAGE_PAGES, INIT_HCA; `mlx5_query_hca_caps`'s current
/// general, Ethernet offloads (`eth_net_offloads`), atomic and RoCE pages (no ODP: `pg` 0; no general 2:
/// `hca_cap_2` 0); one ALLOC_UAR; the command, async and pages EQs (`page_request_disable` 0). Not taken: the
/// 2016 driver's QUERY_ADAPTER, its three more UARs and twelve completion EQs (the core makes a completion EQ when
/// a CQ first names its vector), and the flow-table capabilities (no steering).
const CX4_ORDER: [usize; 24] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 17, 16, 19, 18, 9, 10, 11, 12, 14, 16, 18, 23, 27, 28, 29];

/// The ConnectX-4's real answers carry the core through its whole bring-up, in its own order, and every command
/// it sends that carries no bus address is what Linux sent that device byte for byte, but two: SET_HCA_CAP's
/// `log_max_qp` is 18 where Linux of 2016 wrote 17 (its profile 2 then; Linux 6.12's `LOG_MAX_SUPPORTED_QPS` is
/// 18, below this device's maximum of 23), and INIT_HCA is Linux 6.12's 32 bytes. The decisions the core takes
/// from the real capability pages are checked after: ISSI 1, the boot and init page counts, the UAR and EQ
/// numbers firmware gave, the vectors, and the limits derived from the current general capabilities. What
/// follows the recording (the Q counter mlx5_ib allocates because `max_qp_cnt` is 255, the RoCE GID table) is
/// answered by the mock, not the device.
#[test]
fn a_connectx4s_recorded_answers_carry_the_core_through_its_bring_up() {
    use mlx5_core::mock::Reply;
    use mlx5_core::prm::{ifc, Opcode};

    let recs = from_linux_dump(&connectx4()).unwrap();
    let ex = expectations(&recs);
    // SET_HCA_CAP as Linux 6.12 would write it to this device: the recorded input with its profile's log_max_qp.
    let mut set_cap = recs[8].input.clone();
    let lmq = ifc::cmd_hca_cap::LOG_MAX_QP.at(ifc::set_hca_cap_in::CAPABILITY);
    assert_eq!(MsgBuf::get(&set_cap[..], lmq), 17, "the recorded profile");
    set_cap[..].set(lmq, 18);
    let script: Vec<_> = CX4_ORDER
        .iter()
        .map(|&i| {
            let e = ex[i].clone();
            match Opcode::from_raw(recs[i].opcode) {
                // Bus addresses of this run's pages and rings.
                Opcode::ManagePages | Opcode::CreateEq => e,
                Opcode::SetHcaCap => e.input(&set_cap),
                // Linux 6.12's INIT_HCA is 32 bytes: the recorded 16, then `sw_owner_id`, left 0 because this
                // device has no `sw_owner_id` capability.
                Opcode::InitHca => e.input_prefix(&recs[i].input),
                _ => e.input(&recs[i].input),
            }
        })
        .collect();
    let dev: MockDevice<'_, 64, 512> = MockDevice::new(arena(128 << 20));
    dev.expect_all(script);
    for op in [Opcode::AllocQCounter, Opcode::QueryNicVportContext, Opcode::SetRoceAddress] {
        dev.allow_any(op, Reply::ok());
    }
    // The recording's host had 12 CPUs (Linux made 12 completion EQs): ask for as many vectors.
    let cfg = Config { num_comp_vectors: 12, num_irqs: 13, ..Config::default() };
    let hca: Hca<_, _> =
        Hca::bring_up(&dev, &dev, (), &mut NoDelay, cfg).unwrap_or_else(|e| panic!("{e}: {:?}", dev.done()));
    dev.assert_done();

    assert_eq!(hca.issi(), 1);
    // 6 boot pages, 0x3244 init pages, as QUERY_PAGES said.
    assert_eq!(hca.pages_given(), 6 + 0x3244);
    assert_eq!(dev.pages_held(), 6 + 0x3244);
    assert_eq!(hca.uar(), Some(0x10), "the UAR firmware gave");
    assert_eq!((hca.cmd_eqn(), hca.eqn(), hca.pages_eqn()), (Some(0x10), Some(0x11), Some(0x12)));
    // `log_max_eq` 8: 256 EQs less the three async ones leave room for the 12 completion vectors asked for.
    assert_eq!(hca.num_comp_vectors(), 12);

    // The limits devinfo derives, as mlx5_ib derives them from these pages: `max_sge` 30 (the SQ's 512-byte
    // descriptor: (512 - 32) / 16; the RQ's 512 / 16 = 32). The current `log_max_qp` is the recording's answer
    // after Linux of 2016 set 17.
    let c = hca.caps();
    let g = c.general;
    assert_eq!((g.max_sq_sge(), g.max_rq_sge(), g.max_sge()), (30, 32, 30));
    assert_eq!((g.log_max_qp, g.log_max_cq, g.log_max_mkey, g.log_max_pd, g.log_max_srq), (17, 24, 24, 24, 23));
    assert_eq!((g.log_max_qp_sz, g.log_max_cq_sz, g.log_max_srq_sz), (15, 22, 15));
    // An Ethernet port with RoCE (versions 1 and 2: `roce_version` 7) and a 256-entry GID table, which the core
    // programs; atomics with the extended (masked) operations up to 32 bytes: atomic_mode 5 (`get_atomic_mode`),
    // without the SET of host-endian atomics.
    assert_eq!(g.port_type(), mlx5_core::caps::PortType::Ethernet);
    assert_eq!((c.roce_version, c.roce_address_table_size), (Some(7), Some(256)));
    assert_eq!((c.atomic_operations, c.atomic_size_qp, c.atomic_mode()), (Some(15), Some(60), Some(5)));
    drop(hca);
}

/// The scalar fields of capability layout `name` that differ between two images: (field, first, second).
fn cap_diff(name: &str, a: &[u8], b: &[u8]) -> Vec<(&'static str, u64, u64)> {
    use mlx5_core::prm::generated::names::{layout, Kind};
    let l = layout(name).unwrap();
    let mut out = Vec::new();
    for m in l.members.iter().filter(|m| m.kind == Kind::Scalar && m.width <= 32) {
        let f = mlx5_core::prm::Field::new(m.off, m.width);
        let (x, y) = (MsgBuf::get(a, f), MsgBuf::get(b, f));
        if x != y {
            out.push((m.name, u64::from(x), u64::from(y)));
        }
    }
    out
}

/// Where the simulated ConnectX-5's maximum general capabilities differ from the recorded ConnectX-4's, and why.
/// Every field not listed holds the ConnectX-4's value: the real card is the source of those. The other pages:
/// [`CX5_VS_CX4_PAGES`].
const CX5_VS_CX4: &[(&str, &str)] = &[
    // Fields firmware 14.12 (2016) predates or leaves 0 that the simulated device offers, Linux 6.12 reading them.
    ("hca_cap_2", "newer firmware: the second general page exists (all zero here)"),
    ("release_all_pages", "newer firmware: MANAGE_PAGES may return all pages at once"),
    ("uar_4k", "newer firmware: 4 KiB UARs"),
    ("driver_version", "newer firmware: SET_DRIVER_VERSION"),
    ("num_vhca_ports", "newer firmware"),
    ("num_of_uars_per_page", "newer firmware: with uar_4k"),
    ("device_frequency_khz", "newer firmware: the clock in kHz (156,250); the ConnectX-4 reports MHz instead"),
    ("device_frequency_mhz", "the ConnectX-4's clock in MHz (275); superseded by device_frequency_khz"),
    ("out_of_seq_cnt", "the Q counter's out_of_sequence counter, modelled"),
    ("sigerr_cqe", "signature-error CQEs are decoded by the core"),
    ("pg", "ODP capability pages present (the core does not use ODP)"),
    ("cq_period_mode_modify", "MODIFY_CQ of the period mode"),
    ("umr_modify_entity_size_disabled", "UMR loads no translation: mlx5_ib registers with CREATE_MKEY (fw/caps.rs)"),
    (
        "imaicl",
        "memory windows (ALLOC_MW, the bind UMR of user QPs) are modelled (fw/mkey.rs); firmware 14.12 leaves it 0",
    ),
    (
        "log_max_uctx",
        "DevX user contexts (CREATE_UCTX, uid on objects) are modelled (fw/uctx.rs); firmware 14.12 has none",
    ),
    ("cqe_128_always", "128-byte padded CQEs are modelled (fw/cq.rs); firmware 14.12 leaves it 0"),
    ("cqe_compression_128", "CQE compression accepted on 128-byte CQEs too (fw/cq.rs); firmware 14.12 leaves it 0"),
    ("qos", "the QoS page exists: packet pacing's rate limit table (fw/packet_pacing.rs); firmware 14.12 has none"),
    ("mini_cqe_resp_stride_index", "the checksum-with-stride-index mini-CQE format accepted (fw/cq.rs)"),
    // Features the simulator does not model, so it does not offer them.
    ("log_max_bsf_list_size", "no signature offload"),
    ("end_pad", "no end padding of scatter entries"),
    ("cc_query_allowed", "no congestion control (fw/caps.rs)"),
    ("cc_modify_allowed", "no congestion control (fw/caps.rs)"),
    ("vport_group_manager", "no vport manager: one function, no e-switch"),
    ("vhca_group_manager", "no vhca manager"),
    ("eswitch_manager", "no e-switch"),
    ("ets", "no QoS registers"),
    ("nic_flow_table", "only with SimConfig::eth_netdev"),
    ("log_max_sq", "only with SimConfig::eth_netdev"),
    ("compact_address_vector", "no compact address vectors"),
    ("striding_rq", "no striding RQ"),
    ("basic_cyclic_rcv_wqe", "no striding RQ"),
    ("log_max_stride_sz_rq", "no striding RQ"),
    ("log_min_stride_sz_rq", "no striding RQ"),
    ("log_max_stride_sz_sq", "no striding SQ"),
    ("log_min_stride_sz_sq", "no striding SQ"),
    ("sctr_data_cqe", "no scatter-to-CQE"),
    ("cq_eq_remap", "no CQ-to-EQ remapping"),
    ("scqe_break_moderation", "CQ moderation without the solicited-CQE break"),
    ("cq_period_start_from_cqe", "CQ moderation period from the event only"),
    ("qkv", "no Q_Key violation counter"),
    ("pkv", "no P_Key violation counter"),
    ("pad_tx_eth_packet", "no Ethernet padding offload"),
    ("nic_vport_change_event", "no vport change events"),
    ("log_max_l2_table", "no L2 table"),
    ("uar_sz", "UARs of one 4 KiB page"),
    ("log_uar_page_sz", "UAR pages of 4 KiB only"),
    // The simulator's own choices, with no measured source.
    ("pkey_table_size", "128 entries, the size Linux sets"),
    ("max_tc", "eight traffic classes"),
    ("stat_rate_support", "every static rate accepted (the ConnectX-4: bit 0 only, the port's rate)"),
    ("max_wqe_sz_sq_dc", "512 bytes"),
    ("max_qp_mcg", "240"),
    ("log_max_transport_domain", "2^24"),
    ("log_max_rqt", "the Ethernet objects' sizes"),
    ("log_max_rqt_size", "the Ethernet objects' sizes"),
    ("log_max_wq_sz", "the Ethernet objects' sizes"),
    ("log_max_vlan_list", "the Ethernet objects' sizes"),
    ("log_max_current_mc_list", "the Ethernet objects' sizes"),
    ("log_max_current_uc_list", "the Ethernet objects' sizes"),
];

/// The same for the other capability pages the recording holds (maximum images): (layout, field, why).
const CX5_VS_CX4_PAGES: &[(&str, &str, &str)] = &[
    ("per_protocol_networking_offload_caps", "lro_cap", "no LRO"),
    ("per_protocol_networking_offload_caps", "lro_time_stamp", "no LRO"),
    ("per_protocol_networking_offload_caps", "lro_min_mss_size", "no LRO"),
    ("per_protocol_networking_offload_caps", "multi_pkt_send_wqe", "no multi-packet send WQE"),
    ("per_protocol_networking_offload_caps", "wqe_inline_mode", "no inline-mode choice"),
    ("per_protocol_networking_offload_caps", "rss_ind_tbl_cap", "only with SimConfig::eth_netdev"),
    ("per_protocol_networking_offload_caps", "tunnel_stateless_gre", "no tunnel offloads"),
    ("per_protocol_networking_offload_caps", "tunnel_stateless_vxlan", "no tunnel offloads"),
    ("atomic_caps", "atomic_req_8B_endianness_mode", "host-endian atomics offered (newer firmware)"),
    ("atomic_caps", "supported_atomic_req_8B_endianness_mode_1", "host-endian atomics offered (newer firmware)"),
    ("atomic_caps", "atomic_operations", "compare-and-swap and fetch-and-add only: no masked atomics"),
    ("atomic_caps", "atomic_size_qp", "8-byte atomics only"),
    ("atomic_caps", "atomic_size_dc", "8-byte atomics only"),
    ("roce_cap", "sw_r_roce_src_udp_port", "software-chosen source ports (newer firmware)"),
    ("roce_cap", "roce_version", "RoCE v1 and v2, not v1.5"),
    ("roce_cap", "l3_type", "IPv4 and IPv6, not the bare GRH type"),
];

/// The simulated ConnectX-5's maximum capabilities against a real ConnectX-4's, field by field, on every page the
/// recording holds (general, Ethernet offloads, atomic, RoCE): every difference is one [`CX5_VS_CX4`] or
/// [`CX5_VS_CX4_PAGES`] names with its reason, and every name there still differs, so the tables are the
/// documentation of where each value comes from.
#[test]
fn the_simulated_connectx5s_capabilities_are_a_connectx4s_but_where_listed() {
    use mlx5_core::init::{CapMode, CapType, QueryHcaCap};
    use mlx5_core::prm::ifc;
    let recs = from_linux_dump(&connectx4()).unwrap();
    let sim = SimDevice::new(SimConfig::default());
    let mut d = sim.delay();
    let mut hca: Hca<_, _, _> = Hca::bring_up(sim.mmio(), sim.dma(), (), &mut d, Config::default()).unwrap();
    let pages = [
        (6, CapType::General, "cmd_hca_cap"),
        (15, CapType::EthernetOffloads, "per_protocol_networking_offload_caps"),
        (17, CapType::Atomic, "atomic_caps"),
        (19, CapType::Roce, "roce_cap"),
    ];
    let listed = |page: &str, field: &str| {
        (page == "cmd_hca_cap" && CX5_VS_CX4.iter().any(|(m, _)| *m == field))
            || CX5_VS_CX4_PAGES.iter().any(|(p, m, _)| *p == page && *m == field)
    };
    let mut diffs = Vec::new();
    let mut general = None;
    for (rec, cap, page) in pages {
        // The recording's QUERY_HCA_CAP of this type, maximum (op_mod: type << 1).
        assert_eq!((recs[rec].opcode, recs[rec].op_mod), (0x100, cap.raw() << 1), "{page}");
        let cx4 = &recs[rec].output.as_ref().unwrap()[ifc::query_hca_cap_out::CAPABILITY.off..];
        let cx5 = hca.exec(&mut QueryHcaCap { cap, mode: CapMode::Max }, &mut d).unwrap();
        diffs.extend(cap_diff(page, &cx5, cx4).into_iter().map(|(f, x, y)| (page, f, x, y)));
        if page == "cmd_hca_cap" {
            general = Some((cx5, cx4.to_vec()));
        }
    }
    hca.teardown(&mut d).unwrap();
    let unexplained: Vec<_> = diffs.iter().filter(|(p, f, ..)| !listed(p, f)).collect();
    assert!(unexplained.is_empty(), "(page, field, simulated, ConnectX-4) not in the tables: {unexplained:?}");
    let stale: Vec<_> = CX5_VS_CX4
        .iter()
        .map(|(f, _)| ("cmd_hca_cap", *f))
        .chain(CX5_VS_CX4_PAGES.iter().map(|(p, f, _)| (*p, *f)))
        .filter(|(p, f)| !diffs.iter().any(|(q, g, ..)| q == p && g == f))
        .collect();
    assert!(stale.is_empty(), "listed but now equal to the ConnectX-4's: {stale:?}");
    let (cx5, cx4) = general.unwrap();
    let cx4 = &cx4[..];
    // What the two share includes the limits devinfo shows.
    let same = |f| MsgBuf::get(&cx5[..], f) == MsgBuf::get(cx4, f);
    use ifc::cmd_hca_cap as g;
    for f in
        [g::LOG_MAX_QP, g::LOG_MAX_CQ, g::LOG_MAX_MKEY, g::LOG_MAX_PD, g::LOG_MAX_SRQ, g::LOG_MAX_EQ, g::MAX_QP_CNT]
    {
        assert!(same(f), "{f:?}");
    }
}
