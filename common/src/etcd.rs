//! etcd connection, over TLS with a client certificate when the settings
//! ask for it, with a clear error when it cannot be reached.

use std::sync::Arc;
use std::time::Duration;

use etcd_client::{Certificate, Client, ConnectOptions, Identity, TlsOptions};
use tokio_util::sync::{CancellationToken, DropGuard};
use tokio_util::task::TaskTracker;

use crate::config::EtcdArgs;

mod endpoints;
mod status;
use crate::error::{Error, Result};

/// Where a client's background work (the endpoint prober, with several
/// endpoints) runs, and what ends it: a service's tracker and shutdown, so
/// a stop waits for it; or, for a client of its own, a tracker ended when
/// the last clone of this value is dropped.
#[derive(Clone)]
pub struct Background {
    tasks: TaskTracker,
    stop: CancellationToken,
    _owned: Option<Arc<DropGuard>>,
    /// Whether a client on it already reads etcd's status ([`status`]):
    /// one reader per service's background, however many clients.
    reading_status: Arc<std::sync::atomic::AtomicBool>,
}

impl Background {
    /// On a service's `tasks`, ended by `stop`.
    pub fn on(tasks: &TaskTracker, stop: CancellationToken) -> Self {
        Background {
            tasks: tasks.clone(),
            stop,
            _owned: None,
            reading_status: Arc::default(),
        }
    }

    /// Its own: ended when the last clone is dropped. Keep it as long as
    /// the client.
    pub fn own() -> Self {
        let stop = CancellationToken::new();
        Background {
            tasks: TaskTracker::new(),
            _owned: Some(Arc::new(stop.clone().drop_guard())),
            stop,
            reading_status: Arc::default(),
        }
    }
}

/// Connect and prove the cluster answers (a lazy channel would only fail at
/// the first request, far from the setting that caused it). The settings are
/// checked first, so a wrong one is reported by its name.
pub async fn connect(etcd: &EtcdArgs, background: &Background) -> Result<Client> {
    etcd.validate()?;
    let endpoints = etcd.endpoints();
    let joined = endpoints.join(",");
    let fail = |reason: String| Error::EtcdConnect {
        endpoints: joined.clone(),
        reason,
    };
    let mut options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(10))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
    let files = etcd.tls_files()?;
    let tls = files.is_some();
    if let Some(files) = files {
        crate::nats::install_crypto_provider();
        let mut tls = TlsOptions::new().ca_certificate(Certificate::from_pem(files.ca));
        if let Some((cert, key)) = files.identity {
            tls = tls.identity(Identity::from_pem(cert, key));
        }
        options = options.with_tls(tls);
    }
    // With several endpoints, one that is down (or whose name does not
    // resolve yet) fails the requests the client sends its way: ask again
    // until one answers, within the same 15 s. One endpoint fails at once.
    let last_error = std::sync::Mutex::new(None::<String>);
    let attempt = async {
        let mut client = Client::connect(&endpoints, Some(options.clone()))
            .await
            .map_err(|e| fail(with_tls_hint(describe(&e), tls)))?;
        loop {
            match client.status().await {
                Ok(_) => return Ok::<_, Error>(client),
                Err(e) if endpoints.len() > 1 => {
                    *last_error.lock().expect("last error") = Some(describe(&e));
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => return Err(fail(with_tls_hint(describe(&e), tls))),
            }
        }
    };
    let client = tokio::time::timeout(Duration::from_secs(15), attempt)
        .await
        .map_err(|_| {
            let last = last_error.lock().expect("last error").take();
            fail(match last {
                Some(e) => {
                    with_tls_hint(format!("no endpoint answered within 15s; last: {e}"), tls)
                }
                None => "timed out after 15s".into(),
            })
        })??;
    status::watch(&client, background, etcd.quota_bytes());
    if endpoints.len() > 1 {
        let mut probes = endpoints::Endpoints::new(endpoints, options);
        probes.first_round(&client).await;
        let stop = background.stop.clone();
        let shared = client.clone();
        background.tasks.spawn(async move {
            tokio::select! {
                _ = stop.cancelled() => {}
                _ = probes.keep_live(shared) => {}
            }
        });
    }
    Ok(client)
}

/// Names the settings to look at when the failure is a refused
/// certificate, on either side (rustls' alert and verifier names). Under
/// TLS 1.3 the server checks the client's certificate after the client's
/// handshake is done, so its refusal may also arrive as the connection
/// closing instead of an alert.
fn with_tls_hint(reason: String, tls: bool) -> String {
    const CLIENT_REFUSED: [&str; 4] = [
        "alert: BadCertificate",
        "alert: CertificateRequired",
        "alert: UnknownCA",
        "alert: CertificateUnknown",
    ];
    const CLOSED: [&str; 3] = ["connection closed", "connection reset", "broken pipe"];
    let lower = reason.to_lowercase();
    if CLIENT_REFUSED.iter().any(|alert| reason.contains(alert)) {
        format!(
            "{reason} (etcd refused this client: ADSPEND_ETCD_TLS_CERT and ADSPEND_ETCD_TLS_KEY \
             must hold a certificate from a CA that etcd trusts, its --trusted-ca-file)"
        )
    } else if reason.contains("invalid peer certificate") {
        format!("{reason} (etcd's certificate is not signed by the CA in ADSPEND_ETCD_TLS_CA)")
    } else if tls && CLOSED.iter().any(|closed| lower.contains(closed)) {
        format!(
            "{reason} (etcd closed the TLS connection: it may have refused this client's \
             certificate, ADSPEND_ETCD_TLS_CERT and ADSPEND_ETCD_TLS_KEY; etcd's log names \
             the reason)"
        )
    } else {
        reason
    }
}

/// The error with its causes: a refused handshake shows up only in the
/// chain below tonic's "transport error".
fn describe(error: &etcd_client::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

/// The value read by the first `get` of a transaction's answer (the usual
/// `or_else` of a failed compare-and-swap: what the key holds instead).
pub fn txn_got_value(response: &etcd_client::TxnResponse) -> Option<String> {
    response.op_responses().into_iter().find_map(|op| match op {
        etcd_client::TxnOpResponse::Get(get) => get
            .kvs()
            .first()
            .map(|kv| String::from_utf8_lossy(kv.value()).into_owned()),
        _ => None,
    })
}
