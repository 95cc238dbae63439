//! Serving HTTP so that slow or stuck clients cannot starve the bidders:
//!
//! - a cap on open connections: at the cap the listener stops accepting and
//!   new connections wait in the kernel's backlog (HTTP/1, one request at a
//!   time per connection, so this also caps concurrent requests);
//! - a cap on open connections per client address ([`PerAddr`]; an IPv6
//!   client counts by its /64): a connection past it is answered 429 (JSON)
//!   and closed as soon as it is accepted, so one host holding or
//!   reconnecting many slow connections takes at most its share of the
//!   places and the other addresses keep being served;
//! - deadlines on every connection ([`Deadlines`]): a request's head must
//!   arrive within the request timeout of its first byte (of the accept, for
//!   a connection's first request), a keep-alive connection may sit idle for
//!   the idle timeout, and a response write may stall no longer than the
//!   request timeout; past any of these the connection is closed, which
//!   frees its place under the cap;
//! - once the head is in, the handler, body reading included, has the
//!   request timeout: past it the answer is 408 (JSON) and the connection
//!   closes.
//!
//! axum's `serve` sets no hyper timer, so hyper's own header timeout is off;
//! the deadlines here stand in for it.

use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;
use axum::Router;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;

use crate::http::reply::error;
use crate::telemetry::PACER_HTTP_REFUSED_TOTAL;

mod deadlines;
mod per_addr;
pub(crate) mod tls;

pub(crate) use self::deadlines::Deadlines;
use self::per_addr::PerAddr;
pub(crate) use self::tls::Conn;
use self::tls::TlsAcceptor;

/// Limits of one HTTP listener.
#[derive(Debug, Clone, Copy)]
pub struct HttpLimits {
    pub request_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_connections: usize,
    /// Open connections one client address may hold (at most
    /// `max_connections` in effect).
    pub max_connections_per_addr: usize,
}

/// Serve `app` on `listener` under `limits` until `shutdown`, over TLS
/// when `tls` is given; in-flight requests are finished first.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: HttpLimits,
    tls: Option<TlsAcceptor>,
    shutdown: CancellationToken,
) -> io::Result<()> {
    let listener = Capped {
        permits: Arc::new(Semaphore::new(limits.max_connections)),
        per_addr: Arc::new(PerAddr::new(limits.max_connections_per_addr)),
        listener,
        limits,
        tls,
    };
    let app = app.layer(axum::middleware::from_fn_with_state(
        limits.request_timeout,
        request_deadline,
    ));
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

/// The handler's deadline (body reading included): 408 past it.
async fn request_deadline(State(timeout): State<Duration>, req: Request, next: Next) -> Response {
    match tokio::time::timeout(timeout, next.run(req)).await {
        Ok(response) => response,
        Err(_) => {
            metrics::counter!(PACER_HTTP_REFUSED_TOTAL, "reason" => "timeout").increment(1);
            let mut response = error(
                StatusCode::REQUEST_TIMEOUT,
                format!(
                    "request not completed within {} ms (ADSPEND_PACER_REQUEST_TIMEOUT_MS)",
                    timeout.as_millis()
                ),
            );
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
            response
        }
    }
}

/// A TCP listener that holds at most `max_connections` open connections,
/// and at most `max_connections_per_addr` of them from one address.
struct Capped {
    listener: TcpListener,
    permits: Arc<Semaphore>,
    per_addr: Arc<PerAddr>,
    limits: HttpLimits,
    tls: Option<TlsAcceptor>,
}

impl axum::serve::Listener for Capped {
    type Io = Deadlines<Conn>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        loop {
            // Wait for a place before accepting: the connections over the
            // cap stay in the backlog rather than holding a descriptor each.
            let permit = self
                .permits
                .clone()
                .acquire_owned()
                .await
                .expect("the connection semaphore is never closed");
            let (stream, addr) = axum::serve::Listener::accept(&mut self.listener).await;
            let Some(slot) = PerAddr::take(&self.per_addr, addr.ip()) else {
                // Its place goes back with `permit` at once.
                refuse(stream, addr.ip(), self.per_addr.max(), self.tls.is_some());
                continue;
            };
            // Small JSON answers on the bidder's hot path: no Nagle delay.
            let _ = stream.set_nodelay(true);
            // The handshake happens on the connection's first read, under
            // its first-request deadline, never in this loop.
            let conn = match &self.tls {
                Some(tls) => Conn::handshake(tls, stream),
                None => Conn::Plain(stream),
            };
            return (Deadlines::new(conn, permit, slot, self.limits), addr);
        }
    }

    fn local_addr(&self) -> io::Result<SocketAddr> {
        self.listener.local_addr()
    }
}

/// The environment variable of the per-address cap, for the refusal.
const PER_ADDR_SETTING: &str = adspend_common::env::PACER_MAX_CONNECTIONS_PER_ADDR;

/// A connection past its address's cap: 429 if the socket takes it without
/// waiting (a fresh one does), then closed. No task and no wait, so a flood
/// of them costs an accept and a write each. Over TLS it is only closed: an
/// answer would need a handshake first, which is what the cap saves.
fn refuse(stream: TcpStream, ip: IpAddr, max: usize, tls: bool) {
    metrics::counter!(PACER_HTTP_REFUSED_TOTAL, "reason" => "connections_per_addr").increment(1);
    if tls {
        return;
    }
    let body = format!(
        "{{\"error\":\"too many connections from {ip}: at most {max} ({PER_ADDR_SETTING})\"}}"
    );
    let response = format!(
        "HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n\
         content-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let _ = stream.try_write(response.as_bytes());
}
