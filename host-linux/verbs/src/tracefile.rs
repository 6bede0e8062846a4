//! Command trace sinks: JSON lines to a file (`mlx5 --trace FILE`, libibverbs' `MLX5_RS_TRACE`) and the
//! Linux-style hexdump. Every command is also logged at debug level (`mlx5 -vv`), with the bring-up step it
//! starts. The tool and the drop-in libibverbs both write them, so they live here, below both.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use mlx5_core::hca::Step;
use mlx5_core::prm::{consts, ifc, Named, Opcode};
use mlx5_core::trace::{CmdOutcome, CmdRecord, CmdTrace};

/// Where traced commands go. Write errors are kept and reported once by [`TraceSink::finish`], so a full disk
/// never aborts a command sequence half way.
#[derive(Debug, Default)]
pub struct TraceSink {
    json: Option<BufWriter<File>>,
    hexdump: bool,
    error: Option<std::io::Error>,
    count: usize,
    steps: Steps,
    /// The bring-up steps of each named device (runs with two devices).
    device_steps: Vec<(String, Steps)>,
}

/// Failed to write the command trace.
#[derive(Debug, thiserror::Error)]
#[error("failed to write the command trace: {0}")]
pub struct TraceError(#[source] pub std::io::Error);

/// The trace file could not be created: the file and the I/O error (its source); the message says why in words.
#[derive(Debug, thiserror::Error)]
#[error("cannot create the trace file {}: {}", .path.display(), create_why(.source))]
pub struct TraceFileError {
    /// The file asked for.
    pub path: PathBuf,
    /// Why `File::create` refused it.
    #[source]
    pub source: std::io::Error,
}

/// The common reasons in words; any other is the I/O error's own message.
fn create_why(e: &std::io::Error) -> String {
    use std::io::ErrorKind as K;
    match e.kind() {
        K::NotFound => "its directory does not exist".to_string(),
        K::PermissionDenied => "permission denied".to_string(),
        K::IsADirectory => "it is a directory".to_string(),
        _ => e.to_string(),
    }
}

impl TraceSink {
    /// A sink writing JSON lines to `path` (created or truncated); the error names the file in words.
    pub fn json_file(path: &Path) -> Result<Self, TraceFileError> {
        let f = File::create(path).map_err(|source| TraceFileError { path: path.to_path_buf(), source })?;
        Ok(Self { json: Some(BufWriter::new(f)), ..Self::default() })
    }

    /// Also print every command as the kernel's hexdump on standard output.
    pub fn with_hexdump(mut self, on: bool) -> Self {
        self.hexdump = on;
        self
    }

    /// Commands recorded so far.
    pub fn count(&self) -> usize {
        self.count
    }

    /// Flushes the file and reports the first write error, if any.
    pub fn finish(mut self) -> Result<usize, TraceError> {
        if let Some(e) = self.error.take() {
            return Err(TraceError(e));
        }
        if let Some(w) = self.json.as_mut() {
            w.flush().map_err(TraceError)?;
        }
        Ok(self.count)
    }
}

impl CmdTrace for TraceSink {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        self.record_on(rec, None);
    }
}

impl TraceSink {
    /// Records `rec`; with `device` (a run with two devices) the JSON line names it first
    /// (`{"device":"mlx5_1","slot":...`) and the debug log line starts with it.
    pub fn record_on(&mut self, rec: &CmdRecord<'_>, device: Option<&str>) {
        self.count += 1;
        if log::log_enabled!(log::Level::Debug) {
            let on = device.map(|d| format!("{d}: ")).unwrap_or_default();
            let steps = match device {
                None => &mut self.steps,
                Some(d) => {
                    let i = match self.device_steps.iter().position(|(n, _)| n == d) {
                        Some(i) => i,
                        None => {
                            self.device_steps.push((d.to_string(), Steps::default()));
                            self.device_steps.len() - 1
                        }
                    };
                    &mut self.device_steps[i].1
                }
            };
            if let Some(step) = steps.next(rec) {
                log::debug!("{on}bring-up step: {step}");
            }
            log::debug!("{on}{}", summary(rec));
        }
        if let Some(w) = self.json.as_mut() {
            let mut line = String::new();
            if let Some(d) = device {
                // Device names are the tool's own (`mlx5_0`, `mlx5_1`): nothing to escape.
                line.push_str(&format!("{{\"device\":\"{d}\","));
            }
            let mut rest = String::new();
            // Formatting into a String cannot fail.
            let _ = rec.write_json(&mut rest);
            line.push_str(if device.is_some() { rest.strip_prefix('{').unwrap_or(&rest) } else { &rest });
            line.push('\n');
            if let Err(e) = w.write_all(line.as_bytes()) {
                self.error.get_or_insert(e);
            }
        }
        if self.hexdump {
            let mut s = String::new();
            let _ = rec.write_hexdump(&mut s);
            // A closed pipe (`mlx5 --hexdump ... | head`) stops the dump, not the command sequence.
            if let Err(e) = std::io::stdout().lock().write_all(s.as_bytes()) {
                self.hexdump = false;
                if e.kind() != std::io::ErrorKind::BrokenPipe {
                    self.error.get_or_insert(e);
                }
            }
        }
    }
}

/// One trace file shared by the devices of a run: each device's [`DeviceTrace`] writes into it, and
/// [`SharedTrace::finish`] flushes it once every device is closed.
#[derive(Debug, Clone, Default)]
pub struct SharedTrace(Arc<Mutex<TraceSink>>);

impl PartialEq for SharedTrace {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl SharedTrace {
    pub fn new(sink: TraceSink) -> Self {
        Self(Arc::new(Mutex::new(sink)))
    }

    /// The tracer for one device: `Some(name)` puts `"device": name` on each of its lines (runs with two
    /// devices), `None` leaves the lines as a one-device run writes them.
    pub fn device(&self, name: Option<&'static str>) -> DeviceTrace {
        DeviceTrace { shared: self.clone(), device: name }
    }

    /// Flushes the file and reports the first write error, if any; call it once the devices are closed (their
    /// teardown commands are traced too).
    pub fn finish(&self) -> Result<usize, TraceError> {
        let sink = std::mem::take(&mut *self.0.lock().unwrap_or_else(|e| e.into_inner()));
        sink.finish()
    }
}

/// One device's view of a [`SharedTrace`]; hand it to `mlx5_verbs::Context::open_*_with`.
#[derive(Debug)]
pub struct DeviceTrace {
    shared: SharedTrace,
    device: Option<&'static str>,
}

impl CmdTrace for DeviceTrace {
    fn record(&mut self, rec: &CmdRecord<'_>) {
        self.shared.0.lock().unwrap_or_else(|e| e.into_inner()).record_on(rec, self.device);
    }
}

/// One line per command for the debug log: `cmd[0] ENABLE_HCA(0x104) op_mod 0x0: OK(0x0), syndrome 0x0, 3 us`.
pub fn summary(rec: &CmdRecord<'_>) -> String {
    let op = Named(rec.opcode.name(), rec.opcode.raw().into());
    let end = match rec.outcome {
        CmdOutcome::Completed { status, syndrome } => {
            format!("{}, syndrome 0x{syndrome:x}", Named(status.name(), status.raw().into()))
        }
        CmdOutcome::Delivery(d) => format!("delivery status {}", Named(d.name(), d.raw().into())),
        CmdOutcome::BadSignature => "output signature mismatch".to_string(),
        CmdOutcome::Timeout => "timeout".to_string(),
    };
    format!("cmd[{}] {op} op_mod 0x{:x}: {end}, {} us", rec.slot, rec.op_mod, rec.waited_us)
}

/// Which bring-up step (`hca::Step`, named as Linux logs them) a command starts, from the commands seen so far:
/// a new step is reported once, when its first command goes by.
#[derive(Debug, Default)]
struct Steps {
    last: Option<Step>,
    init_hca_done: bool,
    eq_created: bool,
}

impl Steps {
    fn next(&mut self, rec: &CmdRecord<'_>) -> Option<Step> {
        let op_mod = rec.op_mod;
        let step = match rec.opcode {
            Opcode::EnableHca => Some(Step::EnableHca),
            Opcode::QueryIssi | Opcode::SetIssi => Some(Step::SetIssi),
            Opcode::QueryPages if op_mod == consts::MLX5_QUERY_PAGES_IN_OP_MOD_BOOT_PAGES => Some(Step::BootPages),
            Opcode::QueryPages if op_mod == consts::MLX5_QUERY_PAGES_IN_OP_MOD_INIT_PAGES => Some(Step::InitPages),
            Opcode::AccessReg
                if !self.init_hca_done && register_id(rec) == Some(u32::from(consts::MLX5_REG_HOST_ENDIANNESS)) =>
            {
                Some(Step::HcaCtrl)
            }
            Opcode::QueryHcaCap | Opcode::SetHcaCap if !self.init_hca_done => Some(Step::SetHcaCaps),
            Opcode::InitHca => {
                self.init_hca_done = true;
                Some(Step::InitHca)
            }
            Opcode::SetDriverVersion => Some(Step::DriverVersion),
            Opcode::QueryHcaCap => Some(Step::QueryCaps),
            Opcode::AllocUar if !self.eq_created => Some(Step::AllocUar),
            Opcode::CreateEq if !self.eq_created => {
                self.eq_created = true;
                Some(Step::CreateEq)
            }
            Opcode::ManagePages if self.eq_created && self.last == Some(Step::CreateEq) => Some(Step::RegularPages),
            _ => None,
        }?;
        if self.last == Some(step) {
            return None;
        }
        self.last = Some(step);
        Some(step)
    }
}

fn register_id(rec: &CmdRecord<'_>) -> Option<u32> {
    (rec.input.len() >= ifc::access_register_in::SIZE_BYTES)
        .then(|| rec.input.get(ifc::access_register_in::REGISTER_ID))
}
