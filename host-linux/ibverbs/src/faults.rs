//! Fault injection for programs testing their error handling: `MLX5_RS_FAULTS`, a comma list of `KIND@MS`,
//! each fired `MS` milliseconds after a simulated device is first opened in the process. The program then meets
//! what it would meet on hardware: failed posts and commands, `IBV_WC_WR_FLUSH_ERR` completions,
//! `IBV_EVENT_DEVICE_FATAL` (device_gone, health_failure, health_stall); `IBV_EVENT_CQ_ERR` for a CQ that
//! overran, which takes no more completions (cq_overrun: every CQ then, or `cq_overrun:N` the CQ whose
//! `ibv_cq.handle` is N); `IBV_EVENT_PORT_ERR` / `IBV_EVENT_PORT_ACTIVE` with the port's state following
//! (port_down, port_up: a cable pulled and plugged back).

use std::time::Duration;

use mlx5_core::prm::consts;
use mlx5_sim::SimDevice;

/// The environment variable.
pub(crate) const FAULTS_ENV: &str = "MLX5_RS_FAULTS";

/// The kinds, as `MLX5_RS_FAULTS` names them.
const KINDS: &str = "device_gone, health_failure, health_stall, cq_overrun[:CQN], port_down, port_up";

/// A fault kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The device leaves the bus (reads all ones, no more DMA).
    DeviceGone,
    /// Firmware dies with a health syndrome (FW internal error).
    HealthFailure,
    /// Firmware stalls: the heartbeat freezes, commands hang.
    HealthStall,
    /// A CQ overruns (every CQ that exists then, or the one numbered): it enters overflow and a CQ-error
    /// event reports it.
    CqOverrun(Option<u32>),
    /// The port's link goes down, or comes back up.
    PortDown,
    PortUp,
}

/// Parses `KIND@MS,...`.
pub(crate) fn parse(s: &str) -> Result<Vec<(Kind, u64)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            let (kind, ms) = t.split_once('@').ok_or_else(|| format!("{t:?}: expected KIND@MS"))?;
            let kind = match kind.split_once(':') {
                None => match kind {
                    "device_gone" => Kind::DeviceGone,
                    "health_failure" => Kind::HealthFailure,
                    "health_stall" => Kind::HealthStall,
                    "cq_overrun" => Kind::CqOverrun(None),
                    "port_down" => Kind::PortDown,
                    "port_up" => Kind::PortUp,
                    _ => return Err(format!("{t:?}: unknown fault ({KINDS})")),
                },
                Some(("cq_overrun", n)) => {
                    Kind::CqOverrun(Some(n.parse().map_err(|_| format!("{t:?}: CQN is not a number"))?))
                }
                Some(_) => return Err(format!("{t:?}: unknown fault ({KINDS})")),
            };
            let ms = ms.parse::<u64>().map_err(|_| format!("{t:?}: MS is not a number"))?;
            Ok((kind, ms))
        })
        .collect()
}

/// Fires one fault on `dev` now.
pub(crate) fn fire(dev: &SimDevice, kind: Kind) {
    log::info!("injecting {kind:?}");
    match kind {
        Kind::DeviceGone => dev.device_gone(),
        Kind::HealthFailure => dev.fail_health(consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR),
        Kind::HealthStall => dev.stall_health(),
        Kind::CqOverrun(which) => {
            let cqns = which.map_or_else(|| dev.cq_numbers(), |n| vec![n]);
            for cqn in cqns {
                if !dev.overrun_cq(cqn) {
                    log::info!("cq_overrun: CQ {cqn:#x} does not exist or is in error already");
                }
            }
        }
        Kind::PortDown | Kind::PortUp => {
            if dev.set_port_up(kind == Kind::PortUp).is_none() {
                log::info!("{kind:?}: the port was in that state already (or no event could be posted)");
            }
        }
    }
}

/// Starts one timer thread per fault for `dev`.
pub(crate) fn arm(dev: &SimDevice, faults: &[(Kind, u64)]) {
    for &(kind, ms) in faults {
        let dev = dev.clone();
        let spawned = std::thread::Builder::new().name(format!("mlx5-rs-fault-{ms}")).spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            fire(&dev, kind);
        });
        if let Err(e) = spawned {
            log::error!("fault timer: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_or_say_why_not() {
        assert_eq!(
            parse("device_gone@100, health_stall@5").unwrap(),
            vec![(Kind::DeviceGone, 100), (Kind::HealthStall, 5)]
        );
        assert_eq!(parse("").unwrap(), vec![]);
        assert!(parse("device_gone").unwrap_err().contains("KIND@MS"));
        assert!(parse("meteor@1").unwrap_err().contains("unknown fault"));
        assert!(parse("health_failure@soon").unwrap_err().contains("not a number"));
        assert_eq!(
            parse("cq_overrun@10,cq_overrun:1025@20,port_down@1,port_up@2").unwrap(),
            vec![
                (Kind::CqOverrun(None), 10),
                (Kind::CqOverrun(Some(1025)), 20),
                (Kind::PortDown, 1),
                (Kind::PortUp, 2)
            ]
        );
        assert!(parse("cq_overrun:x@1").unwrap_err().contains("CQN is not a number"));
        assert!(parse("port_down:1@1").unwrap_err().contains("unknown fault"));
    }
}
