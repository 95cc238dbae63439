//! The pacer: aggregator pushes → budget state → answers for bidders.
//!
//! [`ingest`] subscribes to the sums pushes and folds them into
//! [`state::SpendState`] (never backwards, fenced owners dropped); [`api`]
//! joins that state with the catalog's budgets through [`pacing`] to answer
//! `/v1/limits` and `/v1/decisions`, and serves the dashboard.

pub mod api;
pub mod config;
pub mod error;
pub mod ingest;
pub mod pacing;
pub mod state;

use std::sync::Arc;

use adspend_common::nats;
use tokio::sync::RwLock;
use tokio_util::sync::CancellationToken;

pub use config::Config;
pub use error::Error;

/// Serve until `shutdown`.
pub async fn run(config: Config, shutdown: CancellationToken) -> Result<(), Error> {
    let (addr, _) = config.validate()?;
    let source = config.catalog.source(&config.etcd)?;
    let catalog = source.clone().watch(shutdown.clone()).await?;
    let client = nats::connect(&config.nats.nats_url, "adspend-pacer").await?;
    let spend = Arc::new(RwLock::new(state::SpendState::default()));
    let pushes = ingest::subscribe(&client).await?;
    let listener =
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| adspend_common::Error::Bind {
                what: "pacer API",
                addr: addr.to_string(),
                reason: e.to_string(),
            })?;
    let ingest_task = tokio::spawn(ingest::run(client, pushes, spend.clone(), shutdown.clone()));
    tracing::info!(addr = %addr, catalog = source.describe(), "pacer serving");
    let app = api::router(api::AppState { catalog, spend });
    let serve =
        axum::serve(listener, app).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    let result = serve.await.map_err(|e| Error::Serve(e.to_string()));
    shutdown.cancel();
    let _ = ingest_task.await;
    tracing::info!("pacer stopped");
    result
}
