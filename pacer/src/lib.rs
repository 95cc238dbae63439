//! The pacer: aggregator pushes → budget state → answers for bidders.
//!
//! [`ingest`] subscribes to the sums pushes and folds them into
//! [`state::SpendState`] (never backwards, fenced owners dropped); [`api`]
//! joins that state with the catalog's budgets through [`pacing`] to answer
//! `/v1/limits` and `/v1/decisions`, and serves the dashboard.

pub mod api;
pub mod config;
pub mod controller;
pub mod error;
pub mod ingest;
pub mod pacing;
pub mod shape;
pub mod state;

use std::sync::Arc;

use adspend_common::nats;
use adspend_common::telemetry::{PACER_STALE_LIMITS, PACER_STALE_SHARDS};
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
    let pushes = ingest::subscribe(&client).await?;
    let spend = Arc::new(RwLock::new(state::SpendState {
        stale_after_ms: config.stale_after_ms as i64,
        listening_since_ms: Some(adspend_common::now_ms()),
        ..state::SpendState::default()
    }));
    let listener =
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| adspend_common::Error::Bind {
                what: "pacer API",
                addr: addr.to_string(),
                reason: e.to_string(),
            })?;
    let ingest_task = tokio::spawn(ingest::run(
        client,
        pushes,
        spend.clone(),
        catalog.clone(),
        shutdown.clone(),
    ));
    let tick_task = tokio::spawn(ticker(spend.clone(), catalog.clone(), shutdown.clone()));
    tracing::info!(addr = %addr, catalog = source.describe(), "pacer serving");
    let app = api::router(api::AppState { catalog, spend });
    let serve =
        axum::serve(listener, app).with_graceful_shutdown(shutdown.clone().cancelled_owned());
    let result = serve.await.map_err(|e| Error::Serve(e.to_string()));
    shutdown.cancel();
    let _ = ingest_task.await;
    let _ = tick_task.await;
    tracing::info!("pacer stopped");
    result
}

const TICK: std::time::Duration = std::time::Duration::from_secs(1);
/// A history point every this many ticks.
const HISTORY_EVERY: u64 = 10;

/// Advance the controllers every second; decay the traffic shape hourly.
async fn ticker(
    spend: Arc<RwLock<state::SpendState>>,
    catalog: tokio::sync::watch::Receiver<Arc<adspend_common::catalog::Catalog>>,
    shutdown: CancellationToken,
) {
    let gains = controller::Gains::default();
    let mut interval = tokio::time::interval(TICK);
    let mut ticks: u64 = 0;
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = interval.tick() => {}
        }
        ticks += 1;
        let catalog = catalog.borrow().clone();
        let mut state = spend.write().await;
        let record = ticks % HISTORY_EVERY == 1;
        pacing::tick(
            &mut state,
            &catalog,
            chrono::Utc::now(),
            TICK.as_secs_f64() / 60.0,
            record,
            &gains,
        );
        if ticks.is_multiple_of(3600) {
            state.shape.decay(0.96);
        }
        let now = chrono::Utc::now();
        let stale_shards = state.mark_stale_shards(now.timestamp_millis());
        let stale_limits = pacing::stale_limits(&state, &catalog, now);
        drop(state);
        metrics::gauge!(PACER_STALE_SHARDS).set(stale_shards as f64);
        metrics::gauge!(PACER_STALE_LIMITS).set(stale_limits as f64);
    }
}
