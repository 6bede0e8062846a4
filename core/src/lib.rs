#![no_std]
pub mod hal;
pub mod prm;
