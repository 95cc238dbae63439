//! What the HTTP tests share: the router served on a port-0 listener
//! exactly as `run` serves it, and a hand-written HTTP/1.1 client that can
//! also be the slow, stuck or malformed one, from any loopback address.

#![allow(dead_code)] // each test binary uses its own part

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use adspend_pacer::http::{self, serve, AppState, Auth, HttpLimits};
use adspend_pacer::pacing::SpendState;
use adspend_wire::catalog::Catalog;
use serde_json::Value;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::sync::{watch, RwLock};
use tokio_util::sync::CancellationToken;

pub(crate) const CATALOG: &[u8] = br#"{
  "limits": {"campaign": {"budget_micros": 5000, "period": "lifetime"}},
  "ads": {"ad-1": ["campaign"]}
}"#;
pub(crate) const READ: &str = "read-token-0123456789abcdef";
pub(crate) const DECIDE: &str = "decide-token-0123456789abcdef";

pub(crate) const LIMITS: HttpLimits = HttpLimits {
    request_timeout: Duration::from_secs(10),
    idle_timeout: Duration::from_secs(60),
    max_connections: 64,
    max_connections_per_addr: 64,
};

pub(crate) struct Pacer {
    pub addr: SocketAddr,
    pub shutdown: CancellationToken,
    _catalog: watch::Sender<Arc<Catalog>>,
}

impl Drop for Pacer {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub(crate) async fn start(auth: Auth, limits: HttpLimits) -> Pacer {
    start_with(auth, limits, CATALOG, 1_000).await
}

/// [`start`] with another catalog and decisions batch cap.
pub(crate) async fn start_with(
    auth: Auth,
    limits: HttpLimits,
    catalog: &[u8],
    max_decision_ids: usize,
) -> Pacer {
    let catalog = Arc::new(Catalog::parse("test", catalog).unwrap());
    let (sender, receiver) = watch::channel(catalog);
    let state = AppState {
        catalog: receiver,
        spend: Arc::new(RwLock::new(SpendState::default())),
        sources: Default::default(),
        alerts: Default::default(),
        max_decision_ids,
        leases: None,
        regions: None,
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let shutdown = CancellationToken::new();
    tokio::spawn(serve(
        listener,
        http::router(state, auth),
        limits,
        None,
        shutdown.clone(),
    ));
    Pacer {
        addr,
        shutdown,
        _catalog: sender,
    }
}

/// A connection to `addr` from `from` (any of 127.0.0.0/8 on Linux).
pub(crate) async fn connect_from(from: IpAddr, addr: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = TcpSocket::new_v4()?;
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(addr).await
}

pub(crate) struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

/// Shown in failed assertions: a long body cut (a wrongly decided batch
/// is megabytes).
impl std::fmt::Debug for Reply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut cut = self.body.len().min(600);
        while !self.body.is_char_boundary(cut) {
            cut -= 1;
        }
        f.debug_struct("Reply")
            .field("status", &self.status)
            .field("headers", &self.headers)
            .field("body", &&self.body[..cut])
            .field("body_bytes", &self.body.len())
            .finish()
    }
}

impl Reply {
    pub(crate) fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub(crate) fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }

    /// The contract's error shape, with a non-empty message.
    pub(crate) fn assert_json_error(&self, status: u16) {
        assert_eq!(self.status, status, "{self:?}");
        assert!(
            self.header("content-type")
                .is_some_and(|v| v.starts_with("application/json")),
            "{self:?}"
        );
        let json = self.json();
        let message = json["error"].as_str().unwrap_or_default();
        assert!(!message.is_empty(), "{self:?}");
        assert_eq!(json.as_object().map(|o| o.len()), Some(1), "{self:?}");
    }
}

pub(crate) fn parse_reply(raw: &[u8]) -> Reply {
    let text = String::from_utf8_lossy(raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("no complete response in {text:?}"));
    let mut lines = head.split("\r\n");
    let status = lines
        .next()
        .and_then(|l| l.split(' ').nth(1))
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status line in {text:?}"));
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(n, v)| (n.trim().to_string(), v.trim().to_string()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_string(),
    }
}

/// One request on a fresh connection (`Connection: close`), read to EOF.
pub(crate) async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let stream = TcpStream::connect(addr).await.unwrap();
    request_on(stream, method, path, headers, body).await
}

/// [`request`] on a given connection.
pub(crate) async fn request_on(
    mut stream: TcpStream,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &str,
) -> Reply {
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: pacer\r\nConnection: close\r\n");
    for (name, value) in headers {
        raw.push_str(&format!("{name}: {value}\r\n"));
    }
    if !body.is_empty() {
        raw.push_str(&format!("Content-Length: {}\r\n", body.len()));
    }
    raw.push_str("\r\n");
    raw.push_str(body);
    // A server may answer (413) and close before taking the whole body:
    // what it answered is what counts.
    let _ = stream.write_all(raw.as_bytes()).await;
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response).await;
    parse_reply(&response)
}

pub(crate) const JSON: (&str, &str) = ("Content-Type", "application/json");

/// Whether the server has closed `stream` (EOF or reset) within `wait`.
pub(crate) async fn closed_within(stream: &mut TcpStream, wait: Duration) -> bool {
    let mut buf = [0u8; 1024];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return false,
            Ok(Ok(0)) | Ok(Err(_)) => return true,
            Ok(Ok(_)) => continue,
        }
    }
}
