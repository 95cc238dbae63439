//! The pacer: aggregator pushes → budget state → answers for bidders.
//!
//! [`ingest`] subscribes to the sums pushes and folds them into
//! [`state::SpendState`] (never backwards, fenced owners dropped, silent
//! shards marked stale); [`api`] joins that state with the catalog's budgets
//! through [`pacing`] to answer `/v1/limits` and `/v1/decisions`, and serves
//! the dashboard, behind the optional bearer tokens of [`auth`], with JSON
//! errors ([`reply`]), on listeners that [`serve`] guards against slow
//! clients.

pub mod api;
pub mod auth;
pub mod config;
pub mod controller;
pub mod error;
pub mod ingest;
pub mod pacing;
pub mod reply;
pub mod serve;
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
    let settings = config.validate()?;
    let addr = settings.api_addr;
    let source = config.catalog.source(&config.etcd)?;
    let catalog = source.clone().watch(shutdown.clone()).await?;
    let client = nats::connect(&config.nats, "adspend-pacer").await?;
    let pushes = ingest::subscribe(&client).await?;
    let spend = Arc::new(RwLock::new(state::SpendState {
        stale_after_ms: config.stale_after_ms as i64,
        listening_since_ms: Some(adspend_common::now_ms()),
        ..state::SpendState::default()
    }));
    let listener = bind("pacer API", addr).await?;
    let ops_listener = match settings.ops_addr {
        Some(ops) => Some(bind("pacer operations", ops).await?),
        None => None,
    };
    let ingest_task = tokio::spawn(ingest::run(
        client,
        pushes,
        spend.clone(),
        catalog.clone(),
        shutdown.clone(),
    ));
    let tick_task = tokio::spawn(ticker(spend.clone(), catalog.clone(), shutdown.clone()));
    let scope = |scope| {
        if settings.auth.required(scope) {
            "token"
        } else {
            "open"
        }
    };
    tracing::info!(
        addr = %addr,
        ops_addr = ?settings.ops_addr,
        catalog = source.describe(),
        read = scope(auth::Scope::Read),
        decide = scope(auth::Scope::Decide),
        max_connections = settings.http.max_connections,
        request_timeout_ms = settings.http.request_timeout.as_millis() as u64,
        "pacer serving"
    );
    let ops_task = ops_listener.map(|listener| {
        let shutdown = shutdown.clone();
        tokio::spawn(serve::serve(
            listener,
            api::ops_router(),
            settings.http,
            shutdown,
        ))
    });
    let app = api::router(api::AppState { catalog, spend }, settings.auth.clone());
    let result = serve::serve(listener, app, settings.http, shutdown.clone())
        .await
        .map_err(|e| Error::Serve(e.to_string()));
    shutdown.cancel();
    let _ = ingest_task.await;
    let _ = tick_task.await;
    if let Some(task) = ops_task {
        if let Ok(Err(e)) = task.await {
            tracing::warn!(error = %e, "operations listener failed");
        }
    }
    tracing::info!("pacer stopped");
    result
}

async fn bind(
    what: &'static str,
    addr: std::net::SocketAddr,
) -> Result<tokio::net::TcpListener, Error> {
    tokio::net::TcpListener::bind(addr).await.map_err(|e| {
        Error::from(adspend_common::Error::Bind {
            what,
            addr: addr.to_string(),
            reason: e.to_string(),
        })
    })
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
