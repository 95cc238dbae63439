//! etcd connection with a clear error when it cannot be reached.

use std::time::Duration;

use etcd_client::{Client, ConnectOptions};

use crate::error::{Error, Result};

/// Connect and prove the cluster answers (a lazy channel would only fail at
/// the first request, far from the setting that caused it).
pub async fn connect(endpoints: &[String]) -> Result<Client> {
    let joined = endpoints.join(",");
    let fail = |reason: String| Error::EtcdConnect {
        endpoints: joined.clone(),
        reason,
    };
    let options = ConnectOptions::new()
        .with_connect_timeout(Duration::from_secs(5))
        .with_timeout(Duration::from_secs(10))
        .with_keep_alive(Duration::from_secs(10), Duration::from_secs(5));
    let attempt = async {
        let mut client = Client::connect(endpoints, Some(options))
            .await
            .map_err(|e| fail(e.to_string()))?;
        client.status().await.map_err(|e| fail(e.to_string()))?;
        Ok(client)
    };
    tokio::time::timeout(Duration::from_secs(15), attempt)
        .await
        .map_err(|_| fail("timed out after 15s".into()))?
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
