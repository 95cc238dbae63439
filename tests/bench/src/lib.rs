//! `adbench`: the benchmark suite. Every contender consumes the same
//! generated events ([`workload`]); results are printed as they come and
//! collected into one table ([`report`]).

pub mod attack;
pub mod checkpoint;
pub mod e2e;
pub mod fair;
pub mod host;
pub mod leases;
pub mod pacing;
pub mod peers;
pub mod recovery;
pub mod report;
pub mod scale;
pub mod soak;
pub mod stages;
pub mod state;
pub mod workload;
