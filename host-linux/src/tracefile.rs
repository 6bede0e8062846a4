//! Command trace sinks for the `mlx5` tool: JSON lines to a file (`--trace FILE`) and the Linux-style hexdump.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use mlx5_core::trace::{CmdRecord, CmdTrace};

/// Where traced commands go. Write errors are kept and reported once by [`TraceSink::finish`], so a full disk
/// never aborts a command sequence half way.
#[derive(Debug, Default)]
pub struct TraceSink {
    json: Option<BufWriter<File>>,
    hexdump: bool,
    error: Option<std::io::Error>,
    count: usize,
}

/// Failed to write the command trace.
#[derive(Debug, thiserror::Error)]
#[error("failed to write the command trace: {0}")]
pub struct TraceError(#[source] pub std::io::Error);

impl TraceSink {
    /// A sink writing JSON lines to `path` (created or truncated).
    pub fn json_file(path: &Path) -> Result<Self, TraceError> {
        Ok(Self { json: Some(BufWriter::new(File::create(path).map_err(TraceError)?)), ..Self::default() })
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
        self.count += 1;
        if let Some(w) = self.json.as_mut() {
            let mut line = String::new();
            // Formatting into a String cannot fail.
            let _ = rec.write_json(&mut line);
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
