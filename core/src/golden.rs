//! The kernel's golden vectors (`tests/vectors/vectors.json`: byte images made with Linux 6.12's own `MLX5_SET`
//! macros, vendored from shared/prm) reproduced by the core's encoders and decoders, without std, so they run on
//! the Cortex-M4F too (`testlist`). The vectors that need a command queue over a simulated device (the queue
//! entry, an error output header, the EQ ring's doorbell) are in `tests/tests/all/golden.rs`, which also checks
//! every vector is reproduced somewhere.

use crate::cmd::Pas;
use crate::cmdq::Command;
use crate::cq::{CqContext, CqeSize, CreateCq};
use crate::eq::{eq_doorbell_value, CreateEq, EqContext, Eqe, Event, EQE_SIZE};
use crate::init::{enable_hca, init_hca, set_issi, CapMode, CapType, QueryHcaCap, QueryIssi};
use crate::pages::{ManagePagesGive, PageStage, QueryPages};
use crate::pd::alloc_pd;
use crate::prm::{ifc, MsgBuf};
use crate::uar::alloc_uar;

const VECTORS: &str = include_str!("../../tests/vectors/vectors.json");

/// The largest vector (init2rtr_qp_in_ib, 304 bytes) with room to spare.
const MAX: usize = 512;

/// One vector's bytes, copied out of the JSON.
struct Golden {
    bytes: [u8; MAX],
    len: usize,
}

impl core::ops::Deref for Golden {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        &self.bytes[..self.len]
    }
}

/// Vector `name`: its `"hex"` decoded and checked against its `"length_bytes"`. A scan rather than a JSON parser
/// (no heap): each vector object holds `"name"`, then `"length_bytes"`, then `"hex"`, in that order.
fn golden(name: &str) -> Golden {
    let mut rest = VECTORS;
    let obj = loop {
        let at = rest.find("\"name\": \"").unwrap_or_else(|| panic!("no vector {name}"));
        rest = &rest[at + 9..];
        if rest.strip_prefix(name).is_some_and(|r| r.starts_with('"')) {
            break rest;
        }
    };
    // The object ends where the next vector's name starts.
    let obj = &obj[..obj.find("\"name\": \"").unwrap_or(obj.len())];
    let field = |key: &str| {
        let at = obj.find(key).unwrap_or_else(|| panic!("{name}: no {key}"));
        &obj[at + key.len()..]
    };
    let len = field("\"length_bytes\": ");
    let len: usize = len[..len.find(|c: char| !c.is_ascii_digit()).unwrap_or(len.len())].parse().unwrap();
    let hex = field("\"hex\": \"");
    let hex = &hex[..hex.find('"').unwrap()];
    assert_eq!(hex.len(), 2 * len, "{name}: length");
    let mut g = Golden { bytes: [0; MAX], len };
    for (i, b) in g.bytes[..len].iter_mut().enumerate() {
        *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
    }
    g
}

/// A command's input as the core encodes it.
fn encode<C: Command>(cmd: &C) -> Golden {
    let mut g = Golden { bytes: [0; MAX], len: cmd.inlen() };
    cmd.encode(&mut g.bytes[..cmd.inlen()]);
    g
}

include!("../../tests/vectors/create_cq_in.rs");

// Safe code over a scan of 60 KB of JSON per vector: left out under Miri (xtask/src/miri.rs).
#[cfg(any(test, feature = "testlist"))]
#[cfg_attr(feature = "testlist", mlx5_testlist_macro::collect)]
mod tests {
    use super::*;

    #[test]
    #[cfg_attr(miri, ignore)]
    fn the_scan_finds_each_vector_and_refuses_a_missing_one() {
        assert_eq!(&*golden("enable_hca_in"), &[1, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        // A name that only starts another vector's name is not that vector.
        assert_eq!(golden("create_cq_in").len(), 288);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    #[should_panic(expected = "no vector create_cq")]
    fn a_missing_vector_is_named() {
        golden("create_cq");
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn command_inputs_match_byte_for_byte() {
        let pas_cq = [0xaaaa000, 0xbbbb000];
        let pas_eq = [0x10000000, 0x10001000, 0x10002000, 0x10003000];
        let pages = [0x20000000, 0x20001000];
        let create_eq = CreateEq {
            uid: 0,
            ctx: EqContext { log_eq_size: 8, uar_page: 1, intr: 0, log_page_size: 0, page_offset: 0 },
            event_bitmask: [1 << 0xa, 0, 0, 0],
            pas: Pas::List(&pas_eq),
        };
        let cases = [
            ("create_cq_in", encode(&create_cq_vector_cmd(&pas_cq))),
            ("create_eq_in", encode(&create_eq)),
            ("enable_hca_in", encode(&enable_hca(0))),
            ("query_issi_in", encode(&QueryIssi)),
            ("set_issi_in", encode(&set_issi(1))),
            ("query_pages_in_boot", encode(&QueryPages { stage: PageStage::Boot })),
            ("manage_pages_in_give2", encode(&ManagePagesGive { function_id: 0, pages: Pas::List(&pages) })),
            ("query_hca_cap_in_general_cur", encode(&QueryHcaCap { cap: CapType::General, mode: CapMode::Current })),
            ("init_hca_in", encode(&init_hca())),
            ("alloc_pd_in", encode(&alloc_pd())),
            ("alloc_uar_in", encode(&alloc_uar())),
        ];
        for (name, bytes) in cases {
            assert_eq!(&*bytes, &*golden(name), "{name}");
        }
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn command_outputs_decode_and_emit() {
        // create_cq_out: parse the golden image, and emit the same image from the parsed value.
        let out = golden("create_cq_out_ok");
        let pas = [0u64; 1];
        let cqn = create_cq_vector_cmd(&pas).decode(&out[..]).unwrap();
        assert_eq!(cqn, 0x1a);
        let mut emitted = [0u8; ifc::create_cq_out::SIZE_BYTES];
        emitted.set(ifc::create_cq_out::CQN, cqn);
        assert_eq!(&emitted[..], &*out);

        let out = golden("query_pages_out_boot");
        let req = QueryPages { stage: PageStage::Boot }.decode(&out[..]).unwrap();
        assert_eq!((req.function_id, req.num_pages), (0, 44));
        let mut emitted = [0u8; ifc::query_pages_out::SIZE_BYTES];
        emitted.set(ifc::query_pages_out::NUM_PAGES, req.num_pages as u32);
        assert_eq!(&emitted[..], &*out);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn eqe_decodes_and_emits_byte_for_byte() {
        let bytes = golden("eqe_completion_cq1a");
        let mut img = [0u8; EQE_SIZE];
        img.copy_from_slice(&bytes);
        let eqe = Eqe(img);
        assert_eq!(eqe.event(), Event::Completion { cqn: 0x1a });
        assert_eq!(eqe.owner(), 0);
        assert_eq!(&Eqe::emit(&Event::Completion { cqn: 0x1a }).0[..], &*bytes);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn eq_doorbell_value_matches() {
        assert_eq!(&eq_doorbell_value(7, 0x20).to_be_bytes()[..], &*golden("eq_update_ci_arm"));
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn cqe_decodes_and_emits_byte_for_byte() {
        use crate::cq::{
            decode_cqe, Cqe, CqeFields, CqeOpcode, LinkLayer, WcOpcode, WcStatus, WorkCompletion, WrTable,
        };
        use crate::prm::consts;
        struct Ids;
        impl WrTable for Ids {
            fn send_done(&mut self, qpn: u32, wqe_counter: u16) -> Option<u64> {
                Some(u64::from(qpn) << 16 | u64::from(wqe_counter))
            }
            fn recv_done(&mut self, _: u32, _: u32, _: u16) -> Option<u64> {
                None
            }
            fn flush_one(&mut self, _: u32, _: bool) -> Option<WorkCompletion> {
                None
            }
        }
        let bytes = golden("cqe64_req_rdma_write_ok");
        let cqe = Cqe((*bytes).try_into().unwrap());
        assert_eq!((cqe.opcode(), cqe.owner(), cqe.qpn(), cqe.wqe_counter()), (CqeOpcode::Req, 0, 0x123, 5));
        assert_eq!(cqe.wqe_opcode(), consts::MLX5_OPCODE_RDMA_WRITE);
        let wc = decode_cqe(&cqe, 1, 0, LinkLayer::Ethernet, &mut Ids).unwrap().unwrap();
        assert_eq!(
            (wc.opcode, wc.status, wc.qp_num, wc.wr_id),
            (WcOpcode::RdmaWrite, WcStatus::Success, 0x123, 0x123_0005)
        );
        let emitted = CqeFields {
            opcode: consts::MLX5_CQE_REQ,
            wqe_opcode: consts::MLX5_OPCODE_RDMA_WRITE,
            qpn: 0x123,
            wqe_counter: 5,
            ..CqeFields::default()
        }
        .emit();
        assert_eq!(&emitted.0[..], &*bytes);
    }

    #[test]
    #[cfg_attr(miri, ignore)]
    fn init2rtr_matches_byte_for_byte() {
        use crate::cq::LinkLayer;
        use crate::mkey::Access;
        use crate::qp::{
            check_modify, required_attrs, AhAttr, ModifyQp, Mtu, QpAttr, QpAttrMask, QpState, QpType, Transition,
        };
        let attr = QpAttr {
            qp_state: QpState::Rtr,
            qp_access_flags: Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_WRITE | Access::REMOTE_ATOMIC,
            path_mtu: Mtu::M4096,
            dest_qp_num: 0x456,
            rq_psn: 0xabc,
            max_dest_rd_atomic: 16,
            min_rnr_timer: 12,
            ah_attr: AhAttr { dlid: 7, sl: 0, port_num: 1, ..AhAttr::default() },
            ..QpAttr::default()
        };
        // What verbs requires of an RC INIT → RTR, and the access flags the vector sets.
        let mask = required_attrs(QpType::Rc, QpState::Init, QpState::Rtr).unwrap() | QpAttrMask::ACCESS_FLAGS;
        check_modify(QpType::Rc, QpState::Init, &attr, mask).unwrap();
        let cmd = ModifyQp {
            qpn: 0x123,
            qp_type: QpType::Rc,
            transition: Transition::of(QpState::Init, QpState::Rtr).unwrap(),
            attr,
            mask,
            link: LinkLayer::InfiniBand,
            // The vector's log_msg_max (30) is the device's log_max_msg.
            log_max_msg: 30,
            stat_rate: 0,
            roce_v2: false,
            // The vector's QP has PD 0 and CQ 0 (it sets neither field).
            pd: 0,
            cqn_snd: 0,
            cqn_rcv: 0,
            dbr_addr: None,
            cur_access: Access::default(),
            cur_resp_depth: 0,
            // The vector is MLX5_SET of the listed fields only: it leaves pm_state, log_ack_req_freq and
            // atomic_mode 0 (its RAE comes without a mode). Linux's policy for them is checked by the parity table.
            pm_state: 0,
            log_ack_req_freq: 0,
            atomic_mode: 0,
            counter_set_id: None,
            qp_port: 1,
        };
        assert_eq!(&*encode(&cmd), &*golden("init2rtr_qp_in_ib"));
    }
}
