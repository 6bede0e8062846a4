//! A CM MAD a peer sends to QP1 (`mlx5_rdmacm`): `CmMsg::parse` on arbitrary bytes, and the CM engine fed them
//! as a listening passive side and as an active side waiting for its REP.
//!
//! Asserted: no panic; only exactly 256 bytes parse; a parsed message written again parses to the same message
//! and transaction; a refusal maps to a MAD status; the engine answers at most one MAD per MAD received, keeps at
//! most one new connection, and counts what it drops.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mlx5_rdmacm::cm::{CmMsg, CmPath, Req};
use mlx5_rdmacm::engine::{Engine, EngineConfig, EngineError, State};
use mlx5_rdmacm::mad::MAD_LEN;

const SVC: u64 = 0x0106_4e20;

fn req() -> Req {
    Req {
        local_comm_id: 0,
        service_id: SVC,
        local_ca_guid: 0,
        local_qkey: 0,
        local_qpn: 1,
        responder_resources: 1,
        initiator_depth: 1,
        remote_cm_response_timeout: 20,
        transport_service_type: 0,
        end_to_end_flow_control: false,
        starting_psn: 1,
        local_cm_response_timeout: 20,
        retry_count: 7,
        pkey: 0xffff,
        path_mtu: 3,
        rdc_exists: false,
        rnr_retry_count: 7,
        max_cm_retries: 15,
        srq: false,
        path: CmPath::default(),
        private_data: [0; 92],
    }
}

fuzz_target!(|data: &[u8]| {
    match CmMsg::parse(data) {
        Ok((h, m)) => {
            assert_eq!(data.len(), MAD_LEN, "a MAD of the wrong length was accepted");
            let mut again = [0u8; MAD_LEN];
            m.write(h.tid, &mut again);
            let (h2, m2) = CmMsg::parse(&again).expect("a written message parses");
            assert_eq!((h2.tid, m2), (h.tid, m));
        }
        Err(e) => {
            assert_ne!(e.status(), 0, "a refusal without a MAD status");
            assert!(!e.to_string().contains('\n'));
        }
    }
    // The passive side: listening, nothing else.
    let mut passive: Engine<u8> = Engine::new(0xb, EngineConfig::default());
    passive.listen(SVC).unwrap();
    let r = passive.recv(0, 1, data);
    assert!(std::iter::from_fn(|| passive.poll_output()).count() <= 1);
    assert!(passive.connections() <= 1);
    if let Err(EngineError::Malformed(_)) = r {
        assert_eq!(passive.counters().malformed, 1);
    }
    // The active side: one REQ out, then the input as the answer, then every timeout.
    let mut active: Engine<u8> = Engine::new(0xa, EngineConfig { first_comm_id: 1, ..EngineConfig::default() });
    active.connect(0, 2, req());
    active.poll_output();
    let _ = active.recv(1, 2, data);
    assert!(std::iter::from_fn(|| active.poll_output()).count() <= 1);
    for _ in 0..17 {
        active.tick(u64::MAX);
    }
    // Every exchange ends: established (the input was its REP), refused or timed out.
    assert!(active.connections() == 0 || active.state(1) == Some(State::Established));
});
