//! Fault injection for programs testing their error handling: `MLX5_RS_FAULTS`, a comma list of `KIND@MS`,
//! each fired `MS` milliseconds after a simulated device is first opened in the process. The program then meets
//! what it would meet on hardware: failed posts and commands, `IBV_WC_WR_FLUSH_ERR` completions,
//! `IBV_EVENT_DEVICE_FATAL`.

use std::time::Duration;

use mlx5_core::prm::consts;
use mlx5_sim::SimDevice;

/// The environment variable.
pub(crate) const FAULTS_ENV: &str = "MLX5_RS_FAULTS";

/// A fault kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The device leaves the bus (reads all ones, no more DMA).
    DeviceGone,
    /// Firmware dies with a health syndrome (FW internal error).
    HealthFailure,
    /// Firmware stalls: the heartbeat freezes, commands hang.
    HealthStall,
}

/// Parses `KIND@MS,...`.
pub(crate) fn parse(s: &str) -> Result<Vec<(Kind, u64)>, String> {
    s.split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| {
            let (kind, ms) = t.split_once('@').ok_or_else(|| format!("{t:?}: expected KIND@MS"))?;
            let kind = match kind {
                "device_gone" => Kind::DeviceGone,
                "health_failure" => Kind::HealthFailure,
                "health_stall" => Kind::HealthStall,
                _ => return Err(format!("{t:?}: unknown fault (device_gone, health_failure, health_stall)")),
            };
            let ms = ms.parse::<u64>().map_err(|_| format!("{t:?}: MS is not a number"))?;
            Ok((kind, ms))
        })
        .collect()
}

/// Starts one timer thread per fault for `dev`.
pub(crate) fn arm(dev: &SimDevice, faults: &[(Kind, u64)]) {
    for &(kind, ms) in faults {
        let dev = dev.clone();
        let spawned = std::thread::Builder::new().name(format!("mlx5-rs-fault-{ms}")).spawn(move || {
            std::thread::sleep(Duration::from_millis(ms));
            log::info!("injecting {kind:?}");
            match kind {
                Kind::DeviceGone => dev.device_gone(),
                Kind::HealthFailure => dev.fail_health(consts::MLX5_INITIAL_SEG_HEALTH_SYNDROME_FW_INTERNAL_ERR),
                Kind::HealthStall => dev.stall_health(),
            }
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
    }
}
