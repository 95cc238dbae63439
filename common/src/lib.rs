//! What the adspend services share.
//!
//! Data flows: ad-server impressions → `limiter` (validates against the
//! [`catalog`], emits [`types::SpendTuple`]s encoded by [`codec`] onto the
//! JetStream streams of [`nats`]) → `aggregator` (sums in LMDB, snapshots
//! and checkpoint records, which only it uses and so keeps) → `pacer` (reads
//! [`types::SumsUpdate`] pushes; the limiter also reports its per-source
//! scheduling to the pacer as [`source_report::SourcesReport`]s).
//! [`config`], [`telemetry`], [`failpoint`] and the signal handling of
//! `shutdown` are the same plumbing in every service, [`service`] is the
//! `main` they share and [`env`] names every setting. The wire format and
//! catalog are `adspend-wire`'s, re-exported here under their old paths.

pub mod catalog_source;
pub mod config;
pub mod env;
pub mod error;
pub mod etcd;
pub mod failpoint;
pub mod nats;
pub mod service;
pub(crate) mod shutdown;
pub mod telemetry;

// The wire format and catalog live in `adspend-wire` (no network or runtime
// dependencies); their paths under this crate stay as they were.
pub use adspend_wire::{catalog, codec, source_report, types};

pub use error::{Error, Result};

/// Wall-clock unix milliseconds.
pub fn now_ms() -> i64 {
    chrono::Utc::now().timestamp_millis()
}
