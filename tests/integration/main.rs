//! The integration suite: one binary, a module per area, all against real
//! nats-server, etcd and S3-compatible processes started by the harness.

mod alerts;
mod catalog_watch;
mod chaos;
mod checkpoint_record;
mod closed_loop;
mod cluster;
mod config_doc;
mod config_errors;
mod dashboard;
mod deadletter;
mod decisions;
mod etcd_endpoints;
mod etcd_tls;
mod fair;
mod fair_watch;
mod freshness;
mod full_disk;
mod harness_selftest;
mod limiter_stall;
mod membership;
mod module_cycles;
mod nats_auth;
mod openapi;
mod pacer_api;
mod pacer_bounds;
mod pacer_https;
mod pipeline;
mod poison;
mod prometheus;
mod recovery;
mod restart;
mod sim_selftest;
mod snapshot_gone;
mod sources;
mod support;
