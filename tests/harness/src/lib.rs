//! Real infrastructure for the integration suite. Each test starts its own
//! `nats-server` ([`NatsServer`]), `etcd` ([`Etcd`]) and S3-compatible server
//! ([`S3Server`]) on free loopback ports, runs the service binaries as real
//! processes ([`ServiceProcess`]), and crashes or restarts any of them
//! mid-test. Nothing is shared between tests, so they can run in parallel.
//!
//! Modules: `tools` finds the external binaries, `ports` hands out ports,
//! `scratch` owns the temporary directories, `process` owns one child process
//! (signals, logs, cleanup), `server` gives every server kind one lifecycle
//! ([`Server`]: kill, stop, pause, restart), `nats` / `etcd` / `s3` / `redis`
//! add what is particular to each kind, `regions` links three JetStream
//! domains through a cluster of hubs whose routes `route_proxy` can cut
//! ([`RegionsNats`]), `tls` makes throwaway CAs and
//! certificates, `service` runs the workspace's
//! binaries and `wait` holds the polling helpers every readiness check goes
//! through.
//!
//! Cleanup: every child is killed and every directory removed on `Drop`,
//! including while a test panics. If the test process itself is killed, the
//! kernel kills the children (parent-death signal) and the next harness run
//! removes the directories left behind.

mod etcd;
pub mod limiter_progress;
mod nats;
pub mod pipeline;
mod ports;
mod process;
mod redis;
mod regions;
mod route_proxy;
mod s3;
mod scratch;
mod server;
mod service;
mod tls;
mod tools;
mod wait;

pub use etcd::{Etcd, EtcdTls};
pub use nats::{NatsOptions, NatsServer};
pub use nix::sys::signal::Signal;
pub use ports::free_port;
pub use redis::RedisServer;
pub use regions::{Hub, HubSpec, RegionsNats, REGION_NAMES};
pub use s3::S3Server;
pub use server::Server;
pub use service::{service_binary, ServiceBuilder, ServiceProcess};
pub use tls::{CertPair, TestCa};
pub use tools::{tool_path, workspace_root};
pub use wait::{wait_until, wait_until_ok};
