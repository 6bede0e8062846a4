//! The function's lifecycle state, which every command's gate and the page accounting read.

/// Lifecycle of the function, as ENABLE_HCA / INIT_HCA / TEARDOWN_HCA / DISABLE_HCA move it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum HcaState {
    /// Before ENABLE_HCA (or after DISABLE_HCA).
    #[default]
    Disabled,
    /// After ENABLE_HCA: ISSI, pages and capabilities may be negotiated.
    Enabled,
    /// After INIT_HCA: objects may be created.
    Initialized,
}
