//! Linux host support.
