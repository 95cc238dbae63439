//! The HTTP face: the API of CONTRACT.md, the dashboard and the operational
//! endpoints, and the listeners they are served on.
//!
//! [`api`] builds the router from route tables and answers the read
//! endpoints; `POST /v1/decisions` is [`decisions`], `/v1/leases` is
//! [`leases`]; each handler reads the [`app::AppState`]. Requests pass the
//! bearer tokens of [`auth`]; every error is JSON ([`reply`]); [`openapi`]
//! serves the document of all of it. [`serve`] runs a router on a listener
//! guarded against slow clients and greedy addresses, over TLS when set.

mod api;
mod app;
pub(crate) mod auth;
mod decisions;
mod leases;
mod openapi;
mod reply;
pub(crate) mod serve;

pub use api::{ops_router, router, MAX_BODY_BYTES, MAX_PAGE};
pub use app::AppState;
pub use auth::Auth;
pub use serve::{serve, HttpLimits};
