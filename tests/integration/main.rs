//! The integration suite: one binary, a module per area, all against real
//! nats-server, etcd and S3-compatible processes started by the harness.

mod harness_selftest;
mod pipeline;
mod sim_selftest;
mod support;
