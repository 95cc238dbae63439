//! Container health check: `adspend-probe http://127.0.0.1:9102/metrics` exits
//! 0 when the URL answers HTTP 200, otherwise 1 with one line on stderr.
//! `adspend-probe http://… 403` accepts that status instead (an object
//! store answers an unsigned request with 403 once it is serving).
//! Standard library only, so it runs in a scratch image next to the services.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;

const TIMEOUT: Duration = Duration::from_secs(3);

fn main() -> ExitCode {
    let Some(url) = std::env::args().nth(1) else {
        eprintln!("adspend-probe: usage: adspend-probe http://<host>:<port>/<path>");
        return ExitCode::FAILURE;
    };
    let wanted = std::env::args().nth(2).unwrap_or_else(|| "200".to_owned());
    match probe(&url, &wanted) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("adspend-probe: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// GET `url` (plain `http://host:port/path`) and require status `wanted`.
fn probe(url: &str, wanted: &str) -> Result<(), String> {
    let rest = url
        .strip_prefix("http://")
        .ok_or("only http:// URLs are supported")?;
    let (authority, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    let addr = authority
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {authority}: {e}"))?
        .next()
        .ok_or_else(|| format!("{authority} resolves to no address"))?;
    let mut stream =
        TcpStream::connect_timeout(&addr, TIMEOUT).map_err(|e| format!("connect: {e}"))?;
    stream
        .set_read_timeout(Some(TIMEOUT))
        .and_then(|()| stream.set_write_timeout(Some(TIMEOUT)))
        .map_err(|e| e.to_string())?;
    let request = format!("GET {path} HTTP/1.0\r\nHost: {authority}\r\nConnection: close\r\n\r\n");
    stream
        .write_all(request.as_bytes())
        .map_err(|e| format!("send: {e}"))?;
    // The status line fits in the first read's worth of bytes; the body is not needed.
    let mut head = [0u8; 64];
    let mut len = 0;
    while len < head.len() && !head[..len].contains(&b'\n') {
        match stream.read(&mut head[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) => return Err(format!("receive: {e}")),
        }
    }
    let status_line = String::from_utf8_lossy(&head[..len]);
    let status_line = status_line.lines().next().unwrap_or("").trim();
    match status_line.split_whitespace().nth(1) {
        Some(status) if status == wanted => Ok(()),
        Some(_) => Err(format!("answered {status_line:?}")),
        None => Err("no HTTP status line in the answer".to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::probe;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    /// A one-shot server that answers the first request with `status`.
    fn serve_once(status: &'static str) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            let mut buf = [0u8; 1024];
            let _ = conn.read(&mut buf);
            let _ = write!(conn, "HTTP/1.1 {status}\r\nContent-Length: 2\r\n\r\nok");
        });
        format!("http://127.0.0.1:{port}/metrics")
    }

    #[test]
    fn healthy_unhealthy_and_unreachable() {
        assert_eq!(probe(&serve_once("200 OK"), "200"), Ok(()));
        let err = probe(&serve_once("503 Service Unavailable"), "200").unwrap_err();
        assert!(err.contains("503"), "{err}");
        assert_eq!(probe(&serve_once("403 Forbidden"), "403"), Ok(()));
        let err = probe(&serve_once("200 OK"), "403").unwrap_err();
        assert!(err.contains("200"), "{err}");
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let err = probe(&format!("http://{closed}/healthz"), "200").unwrap_err();
        assert!(err.starts_with("connect"), "{err}");
        assert!(probe("https://example.invalid/", "200").is_err());
    }
}
