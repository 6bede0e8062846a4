//! The name and rate helpers (`ibv_wc_status_str`, `ibv_event_type_str`, ..., `ibv_rate_to_mbps`), with
//! libibverbs' own texts, which programs print.

use std::ffi::{c_char, c_int, CStr};

/// A static C string's pointer.
fn s(c: &'static CStr) -> *const c_char {
    c.as_ptr()
}

#[no_mangle]
pub extern "C" fn ibv_wc_status_str(status: c_int) -> *const c_char {
    const NAMES: [&CStr; 22] = [
        c"success",
        c"local length error",
        c"local QP operation error",
        c"local EE context operation error",
        c"local protection error",
        c"Work Request Flushed Error",
        c"memory management operation error",
        c"bad response error",
        c"local access error",
        c"remote invalid request error",
        c"remote access error",
        c"remote operation error",
        c"transport retry counter exceeded",
        c"RNR retry counter exceeded",
        c"local RDD violation error",
        c"remote invalid RD request",
        c"aborted error",
        c"invalid EE context number",
        c"invalid EE context state",
        c"fatal error",
        c"response timeout error",
        c"general error",
    ];
    match usize::try_from(status).ok().and_then(|i| NAMES.get(i)) {
        Some(n) => s(n),
        None => s(c"unknown"),
    }
}

#[no_mangle]
pub extern "C" fn ibv_event_type_str(event: c_int) -> *const c_char {
    const NAMES: [&CStr; 20] = [
        c"CQ error",
        c"local work queue catastrophic error",
        c"invalid request local work queue error",
        c"local access violation work queue error",
        c"communication established",
        c"send queue drained",
        c"path migrated",
        c"path migration request error",
        c"local catastrophic error",
        c"port active",
        c"port error",
        c"LID change",
        c"P_Key change",
        c"SM change",
        c"SRQ catastrophic error",
        c"SRQ limit reached",
        c"last WQE reached",
        c"client reregistration",
        c"GID table change",
        c"WQ fatal",
    ];
    match usize::try_from(event).ok().and_then(|i| NAMES.get(i)) {
        Some(n) => s(n),
        None => s(c"unknown"),
    }
}

#[no_mangle]
pub extern "C" fn ibv_node_type_str(node_type: c_int) -> *const c_char {
    const NAMES: [&CStr; 7] = [
        c"unknown",
        c"InfiniBand channel adapter",
        c"InfiniBand switch",
        c"InfiniBand router",
        c"iWARP NIC",
        c"usNIC",
        c"usNIC UDP",
    ];
    match usize::try_from(node_type).ok().and_then(|i| NAMES.get(i)) {
        Some(n) => s(n),
        None => s(c"unknown"),
    }
}

#[no_mangle]
pub extern "C" fn ibv_port_state_str(state: c_int) -> *const c_char {
    const NAMES: [&CStr; 6] = [c"no state change (NOP)", c"down", c"init", c"armed", c"active", c"active deferred"];
    match usize::try_from(state).ok().and_then(|i| NAMES.get(i)) {
        Some(n) => s(n),
        None => s(c"unknown"),
    }
}

/// `enum ibv_rate` values with their multiple of 2.5 Gb/s and their Mb/s.
const RATES: [(c_int, c_int, c_int); 21] = [
    (2, 1, 2500),
    (5, 2, 5000),
    (3, 4, 10000),
    (6, 8, 20000),
    (4, 12, 30000),
    (7, 16, 40000),
    (8, 24, 60000),
    (9, 32, 80000),
    (10, 48, 120000),
    (11, 6, 14062),
    (12, 22, 56250),
    (13, 45, 112500),
    (14, 67, 168750),
    (15, 10, 25781),
    (16, 40, 103125),
    (17, 120, 309375),
    (18, 20, 53125),
    (19, 80, 206250),
    (20, 160, 412500),
    (21, 240, 618750),
    (22, 320, 825000),
];

#[no_mangle]
pub extern "C" fn ibv_rate_to_mult(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.1)
}

#[no_mangle]
pub extern "C" fn mult_to_ibv_rate(mult: c_int) -> c_int {
    RATES.iter().find(|r| r.1 == mult).map_or(0, |r| r.0)
}

#[no_mangle]
pub extern "C" fn ibv_rate_to_mbps(rate: c_int) -> c_int {
    RATES.iter().find(|r| r.0 == rate).map_or(-1, |r| r.2)
}

#[no_mangle]
pub extern "C" fn mbps_to_ibv_rate(mbps: c_int) -> c_int {
    RATES.iter().find(|r| r.2 == mbps).map_or(0, |r| r.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(p: *const c_char) -> String {
        // SAFETY: the functions return static NUL-terminated strings.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    #[test]
    fn names_follow_libibverbs() {
        assert_eq!(text(ibv_wc_status_str(0)), "success");
        assert_eq!(text(ibv_wc_status_str(5)), "Work Request Flushed Error");
        assert_eq!(text(ibv_wc_status_str(99)), "unknown");
        assert_eq!(text(ibv_wc_status_str(-1)), "unknown");
        assert_eq!(text(ibv_event_type_str(8)), "local catastrophic error");
        assert_eq!(text(ibv_port_state_str(4)), "active");
        assert_eq!(ibv_rate_to_mbps(16), 103125);
        assert_eq!(mbps_to_ibv_rate(2500), 2);
        assert_eq!(ibv_rate_to_mult(3), 4);
        assert_eq!(mult_to_ibv_rate(1000), 0);
    }
}
