//! Test support for adspend: `harness` spawns the real components (nats-server,
//! etcd, an S3-compatible server) and the service binaries on free loopback
//! ports; `sim` is the ad-server simulator that publishes impressions and
//! writes the ground truth the integration suite compares against; `check`
//! compares the pacer's answers with that truth.

pub mod bench;
pub mod chaos;
pub mod check;
pub mod cluster;
pub mod harness;
pub mod limiter_progress;
pub mod pipeline;
pub mod sim;
pub mod stats;
pub mod stream_truth;
