//! HTTPS on the API port (`ADSPEND_PACER_TLS_CERT` and `_KEY`): the
//! certificate chain and key loaded once at start, and a connection that
//! makes its TLS handshake on its first read. The accept loop never waits
//! for a handshake, and a client that stalls in one meets the same
//! first-request deadline as one that stalls in its request head.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use adspend_common::Error;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::server::TlsStream;

pub(crate) use tokio_rustls::TlsAcceptor;

use crate::telemetry::PACER_HTTP_REFUSED_TOTAL;

/// The API port's TLS: an acceptor, and the certificate file it came from
/// (for the logs).
#[derive(Clone)]
pub(crate) struct Https {
    pub(crate) acceptor: TlsAcceptor,
    pub(crate) cert: PathBuf,
}

impl std::fmt::Debug for Https {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Https").field("cert", &self.cert).finish()
    }
}

/// HTTPS with a PEM certificate chain (leaf first) and its PEM private key;
/// `cert_setting` and `key_setting` name the settings in errors. HTTP/1.1
/// only, as ALPN says: the deadlines read HTTP/1 heads.
pub(crate) fn load(
    (cert_setting, cert): (&'static str, &Path),
    (key_setting, key): (&'static str, &Path),
) -> Result<Https, Error> {
    let fail = |name: &'static str, path: &Path, reason: String| Error::Config {
        name,
        value: path.display().to_string(),
        reason,
    };
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| {
            fail(
                cert_setting,
                cert,
                format!("cannot read a PEM certificate: {e}"),
            )
        })?;
    if chain.is_empty() {
        return Err(fail(
            cert_setting,
            cert,
            "holds no PEM certificate (-----BEGIN CERTIFICATE-----)".into(),
        ));
    }
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| {
        fail(
            key_setting,
            key,
            format!("cannot read a PEM private key: {e}"),
        )
    })?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| fail(cert_setting, cert, e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key_der)
        .map_err(|e| {
            fail(
                key_setting,
                key,
                format!(
                    "does not go with the certificate in {}: {e}",
                    cert.display()
                ),
            )
        })?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Https {
        acceptor: TlsAcceptor::from(Arc::new(config)),
        cert: cert.to_path_buf(),
    })
}

/// One accepted connection: plain, or TLS before or after its handshake.
pub(crate) enum Conn {
    Plain(TcpStream),
    Handshake(Box<tokio_rustls::Accept<TcpStream>>),
    Tls(Box<TlsStream<TcpStream>>),
    /// The handshake failed; every call fails.
    Failed,
}

impl Conn {
    pub(super) fn handshake(acceptor: &TlsAcceptor, stream: TcpStream) -> Conn {
        Conn::Handshake(Box::new(acceptor.accept(stream)))
    }

    /// Drives the handshake, if one is under way, to its end.
    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self {
            Conn::Handshake(accept) => match Pin::new(accept.as_mut()).poll(cx) {
                Poll::Ready(Ok(stream)) => {
                    *self = Conn::Tls(Box::new(stream));
                    Poll::Ready(Ok(()))
                }
                Poll::Ready(Err(e)) => {
                    // A plain-HTTP client on the TLS port ends here.
                    metrics::counter!(PACER_HTTP_REFUSED_TOTAL, "reason" => "tls_handshake")
                        .increment(1);
                    tracing::debug!(error = %e, "TLS handshake failed");
                    *self = Conn::Failed;
                    Poll::Ready(Err(e))
                }
                Poll::Pending => Poll::Pending,
            },
            Conn::Failed => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::ConnectionAborted,
                "the TLS handshake failed",
            ))),
            Conn::Plain(_) | Conn::Tls(_) => Poll::Ready(Ok(())),
        }
    }
}

/// Runs `$body` on the stream once the handshake is done: `$s` is a
/// `Pin<&mut S>` of the plain or TLS stream.
macro_rules! on_stream {
    ($self:ident, $cx:ident, |$s:ident| $body:expr) => {{
        let this = $self.get_mut();
        match this.poll_ready($cx) {
            Poll::Ready(Ok(())) => {}
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => return Poll::Pending,
        }
        match this {
            Conn::Plain(stream) => {
                let $s = Pin::new(stream);
                $body
            }
            Conn::Tls(stream) => {
                let $s = Pin::new(stream.as_mut());
                $body
            }
            Conn::Handshake(_) | Conn::Failed => unreachable!("poll_ready settles the handshake"),
        }
    }};
}

impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        on_stream!(self, cx, |s| s.poll_read(cx, buf))
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        on_stream!(self, cx, |s| s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        on_stream!(self, cx, |s| s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            Conn::Plain(stream) => stream.is_write_vectored(),
            Conn::Tls(stream) => stream.is_write_vectored(),
            Conn::Handshake(_) | Conn::Failed => false,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        on_stream!(self, cx, |s| s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            Conn::Tls(stream) => Pin::new(stream.as_mut()).poll_shutdown(cx),
            // Nothing was said over TLS yet: dropping the socket closes it.
            Conn::Handshake(_) | Conn::Failed => Poll::Ready(Ok(())),
        }
    }
}
