//! The adspend wire format and catalog, with no I/O, network or cloud
//! dependencies.
//!
//! [`types`] are the records that travel between the services; [`codec`]
//! turns the spend messages (limiter → aggregator) and sums pushes
//! (aggregator → pacer) into bytes and back, checking what it decodes;
//! [`source_report`] is the limiter's per-source report to the pacer (JSON).
//! [`catalog`] parses and validates the budget catalog and does the period
//! arithmetic the limiter and the pacer must agree on. [`lease`] is the
//! format of spend lease ids and the key a lease's spend is summed under.
//! Errors are [`Error`].
//!
//! `adspend-common` re-exports these modules under the same names, with the
//! NATS, etcd and runtime plumbing around them; the fuzz targets link this
//! crate alone.

pub mod catalog;
pub mod codec;
pub mod error;
pub mod lease;
pub mod source_report;
pub mod types;

pub use error::Error;
