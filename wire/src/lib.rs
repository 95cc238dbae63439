//! The adspend wire format and catalog, with no I/O, network or cloud
//! dependencies.
//!
//! [`types`] are the records that travel between the services; [`codec`]
//! turns the spend messages (limiter → aggregator) and sums pushes
//! (aggregator → pacer) into bytes and back, checking what it decodes;
//! [`source_report`] is the limiter's per-source report to the pacer (JSON).
//! [`impression`] parses the ad servers' NDJSON lines into impressions or
//! rejections; [`batch`] splits an input message, NDJSON or a binary batch
//! ([`batch::binary`], which it also writes), into such entries; and
//! [`dead_letter`] is the bounded record of a rejected entry on `DEADLETTER`. [`catalog`] parses and validates the budget catalog and
//! does the period arithmetic the limiter and the pacer must agree on. [`lease`]
//! is the format of spend lease ids and the key a lease's spend is summed
//! under. [`regions`] splits a limit's budget among the regions of a
//! deployment and is the report they exchange to move it where the demand
//! is.
//! Errors are [`Error`].
//!
//! Every crate imports these modules from here (`adspend-common` holds the
//! NATS, etcd and runtime plumbing around them); the fuzz targets link this
//! crate alone.

pub mod batch;
pub mod catalog;
pub mod codec;
pub mod dead_letter;
mod error;
pub mod impression;
pub mod lease;
pub mod regions;
pub mod source_report;
pub mod types;

pub use error::Error;
