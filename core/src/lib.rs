#![no_std]
pub mod prm;
