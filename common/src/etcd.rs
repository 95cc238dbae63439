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
