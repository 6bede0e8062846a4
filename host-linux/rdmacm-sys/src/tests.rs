//! In-process tests: the exports driven as a C program drives them, on simulated devices.
