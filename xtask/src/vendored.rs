//! The vendored PRM files, relative to the workspace root, and how they are read.
//!
//! A leaf: the codegen (which reads them all) and the Linux header extractor (which writes the extra layouts and
//! checks itself against the vendored ones) both use it, so neither imports the other.

use serde_json::Value;
use std::path::Path;

/// Files the vendoring step writes.
pub const VENDORED_IFC: &str = "core/prm/ifc_layouts.json";
pub const VENDORED_C: &str = "core/prm/c_layouts.json";
pub const VENDORED_CONSTS: &str = "core/prm/constants.json";
pub const VENDORED_VECTORS: &str = "tests/vectors/vectors.json";

/// The file `vendor --linux-extra` writes.
pub const VENDORED_EXTRA: &str = "core/prm/linux-extra-layouts.json";
/// The plain C structures `vendor --linux-extra` extracts from Linux's `qp.h`.
pub const VENDORED_EXTRA_C: &str = "core/prm/linux-extra-c-layouts.json";

/// One JSON file, with its path in either error.
pub fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
    serde_json::from_str(&text).map_err(|e| format!("parsing {}: {e}", path.display()))
}
