//! The ad server's side of adspend.
//!
//! - [`Pacer`]: the pacer's HTTP API (limits, decisions, spend leases and
//!   their releases) with a TLS CA, bearer tokens, timeouts, and retries
//!   with backoff on connection errors and 5xx; a 4xx comes back as a typed
//!   [`Error`] carrying the field the pacer named.
//! - [`LeaseBook`]: per ad, the leases an ad server holds.
//!   [`LeaseBook::try_spend`] answers from memory (no network call, no lock
//!   held across one) with the lease id to stamp on the impression, or a
//!   [`Refusal`]. The rules are docs/LEASES.md's: the replaced lease is kept
//!   and spent first, nothing is served within the margin of an expiry, and
//!   every lease let go with something left is released with what was
//!   served under it.
//! - [`Renewer`]: renews the book's leases in batches in the background at
//!   a low-water mark, and releases at shutdown.
//! - [`Publisher`]: impressions to `impressions.<source>` on JetStream in
//!   batches (the binary batch format by default, NDJSON on request:
//!   [`BatchFormat`]) with acks, a bounded buffer (backpressure), retries that the
//!   impression ids make harmless, a flush at close that says what could
//!   not be delivered.
//!
//! ```no_run
//! use std::time::Duration;
//! use adspend_client::{LeaseBook, LeasePolicy, Pacer, PacerConfig, Renewer};
//!
//! # async fn bidder() -> Result<(), Box<dyn std::error::Error>> {
//! let pacer = Pacer::new(PacerConfig::new("http://127.0.0.1:8080"))?;
//! let book = LeaseBook::new(LeasePolicy::default())?;
//! let renewer = Renewer::start(book.clone(), pacer, Duration::from_millis(100));
//! // On the hot path, for each bid won:
//! match book.try_spend("ad-1", 1_250) {
//!     Ok(lease_id) => { /* serve; put lease_id on the impression */ let _ = lease_id; }
//!     Err(refusal) => { /* do not serve: {refusal:?} */ let _ = refusal; }
//! }
//! renewer.shutdown().await; // releases what was not served
//! # Ok(())
//! # }
//! ```

pub mod api;
mod book;
mod error;
mod pacer;
mod publish;
mod renew;

pub use api::{Decision, Grant, LeaseAsk, Limit, Release, Released};
pub use book::{Ask, LeaseBook, LeasePolicy, PolicyError, Refusal};
pub use error::Error;
pub use pacer::{Pacer, PacerConfig, Retry};
pub use publish::{BatchFormat, Closed, Impression, PublishReport, Publisher, PublisherConfig};
pub use renew::{RenewStats, Renewer, MAX_ADS_PER_REQUEST};
