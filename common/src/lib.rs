//! What the adspend services share.
//!
//! Data flows: ad-server impressions → `limiter` (validates against the
//! catalog, emits spend tuples onto the JetStream streams of [`nats`]) →
//! `aggregator` (sums in LMDB, snapshots and checkpoint records, which only
//! it uses and so keeps) → `pacer` (reads sums pushes; the limiter also
//! reports its per-source scheduling to the pacer). The records, their codec
//! and the catalog are `adspend-wire`'s, which every crate imports directly;
//! this crate holds the plumbing around them: [`catalog_source`] watches the
//! catalog, [`etcd`] and [`nats`] are the backends, [`config`],
//! [`telemetry`], [`failpoint`] and the signal handling of `shutdown` are the
//! same in every service, [`service`] is the `main` they share and [`env`]
//! names every setting.

pub mod catalog_source;
pub mod config;
pub mod dedupe_window;
pub mod env;
pub mod error;
pub mod etcd;
pub mod failpoint;
pub mod nats;
pub mod service;
pub(crate) mod shutdown;
pub mod telemetry;

pub use error::{Error, Result};

/// Wall-clock unix milliseconds.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
