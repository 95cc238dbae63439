//! A minimal bidder on `adspend-client`: it bids only on what its lease book
//! lets it spend, and publishes every impression it serves with the lease id
//! on it.
//!
//! `POST /bid` with `{"ad_id": "ad-1", "cost_micros": 1500}` answers
//! `{"bid": true, "lease_id": "…"}` (and publishes the impression, as if the
//! bid was won and served) or `{"bid": false, "refusal": "…"}`; `GET /stats`
//! says what was served and refused. Ctrl-C releases what was leased and not
//! served, flushes the publisher and prints what it did.
//!
//! Against `scripts/demo.sh`'s pipeline (started from a terminal, so that
//! its services keep running), as the ad servers' NATS user:
//!
//! ```sh
//! set -a; . demo-out/nats-auth/adserver.env; set +a
//! cargo run -p adspend-client --example adserver
//! curl -s -XPOST 127.0.0.1:3000/bid -H 'content-type: application/json' \
//!   -d '{"ad_id":"ad-1","cost_micros":1500}'
//! ```
//!
//! Settings (environment): `ADSPEND_PACER_URL` (default
//! `http://127.0.0.1:8080`), `ADSPEND_PACER_TLS_CA`,
//! `ADSPEND_PACER_DECIDE_TOKEN`, `ADSPEND_NATS_URL` (default
//! `nats://127.0.0.1:4222`), `ADSPEND_NATS_USER`, `ADSPEND_NATS_PASSWORD`,
//! `ADSPEND_NATS_TLS_CA`, `ADSPEND_NATS_INBOX_PREFIX`, `ADSERVER_ADDR`
//! (default `127.0.0.1:3000`), `ADSERVER_SOURCE` (the `impressions.<source>`
//! subject; default `example`).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::Duration;

use adspend_client::{
    Impression, LeaseBook, LeasePolicy, Pacer, PacerConfig, Publisher, PublisherConfig, Renewer,
};
use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};

type Error = Box<dyn std::error::Error + Send + Sync>;

#[derive(Deserialize)]
struct Bid {
    ad_id: String,
    cost_micros: u64,
}

#[derive(Serialize)]
struct Answer {
    bid: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    lease_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    refusal: Option<String>,
}

#[derive(Default)]
struct Stats {
    served: AtomicU64,
    served_micros: AtomicU64,
    refused: AtomicU64,
}

struct Bidder {
    book: LeaseBook,
    publisher: Publisher,
    source: String,
    started_ms: i64,
    stats: Stats,
}

fn setting(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

async fn bid(State(bidder): State<Arc<Bidder>>, Json(bid): Json<Bid>) -> Json<Answer> {
    match bidder.book.try_spend(&bid.ad_id, bid.cost_micros) {
        Ok(lease_id) => {
            let n = bidder.stats.served.fetch_add(1, Relaxed);
            bidder
                .stats
                .served_micros
                .fetch_add(bid.cost_micros, Relaxed);
            let impression = Impression {
                // Unique per impression: a retry of the same id counts once.
                id: format!("{}-{}-{n}", bidder.source, bidder.started_ms),
                ad_id: bid.ad_id,
                cost_micros: bid.cost_micros,
                ts_ms: now_ms(),
                lease_id: Some(lease_id.clone()),
            };
            // Waits while the publisher's buffer is full: backpressure.
            let published = bidder.publisher.publish(impression).await;
            Json(Answer {
                bid: published.is_ok(),
                lease_id: Some(lease_id.to_string()),
                refusal: published.err().map(|e| e.to_string()),
            })
        }
        Err(refusal) => {
            bidder.stats.refused.fetch_add(1, Relaxed);
            Json(Answer {
                bid: false,
                lease_id: None,
                refusal: Some(format!("{refusal:?}")),
            })
        }
    }
}

async fn stats(State(bidder): State<Arc<Bidder>>) -> Json<serde_json::Value> {
    let s = &bidder.stats;
    Json(serde_json::json!({
        "served": s.served.load(Relaxed),
        "served_micros": s.served_micros.load(Relaxed),
        "refused": s.refused.load(Relaxed),
    }))
}

async fn nats() -> Result<async_nats::Client, Error> {
    let url = setting("ADSPEND_NATS_URL").unwrap_or_else(|| "nats://127.0.0.1:4222".into());
    let mut options = async_nats::ConnectOptions::new();
    if let (Some(user), Some(password)) = (
        setting("ADSPEND_NATS_USER"),
        setting("ADSPEND_NATS_PASSWORD"),
    ) {
        options = options.user_and_password(user, password);
    }
    if let Some(ca) = setting("ADSPEND_NATS_TLS_CA") {
        options = options.add_root_certificates(ca.into()).require_tls(true);
    }
    if let Some(prefix) = setting("ADSPEND_NATS_INBOX_PREFIX") {
        options = options.custom_inbox_prefix(prefix);
    }
    Ok(options.connect(url).await?)
}

#[tokio::main]
async fn main() -> Result<(), Error> {
    let pacer = Pacer::new(PacerConfig {
        ca_file: setting("ADSPEND_PACER_TLS_CA").map(Into::into),
        decide_token: setting("ADSPEND_PACER_DECIDE_TOKEN"),
        ..PacerConfig::new(
            setting("ADSPEND_PACER_URL").unwrap_or_else(|| "http://127.0.0.1:8080".into()),
        )
    })?;
    let source = setting("ADSERVER_SOURCE").unwrap_or_else(|| "example".into());
    let book = LeaseBook::new(LeasePolicy::default())?;
    let renewer = Renewer::start(book.clone(), pacer, Duration::from_millis(100));
    let publisher = Publisher::start(nats().await?, PublisherConfig::new(&source));
    let bidder = Arc::new(Bidder {
        book,
        publisher,
        source,
        started_ms: now_ms(),
        stats: Stats::default(),
    });
    let app = Router::new()
        .route("/bid", post(bid))
        .route("/stats", get(stats))
        .with_state(bidder.clone());
    let addr = setting("ADSERVER_ADDR").unwrap_or_else(|| "127.0.0.1:3000".into());
    let listener = tokio::net::TcpListener::bind(&addr).await?;
    println!("adserver: bidding on http://{addr}/bid; Ctrl-C stops");
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;

    // Release what was leased and not served, then flush the impressions.
    let renewed = renewer.shutdown().await;
    let Ok(bidder) = Arc::try_unwrap(bidder) else {
        return Err("a request still holds the bidder".into());
    };
    let report = bidder.publisher.close().await;
    println!(
        "adserver: served {} ({} micros), refused {}; {} grants, {} releases; {} impressions delivered, {} undelivered",
        bidder.stats.served.load(Relaxed),
        bidder.stats.served_micros.load(Relaxed),
        bidder.stats.refused.load(Relaxed),
        renewed.grants.load(Relaxed),
        renewed.releases.load(Relaxed),
        report.delivered,
        report.undelivered.len()
    );
    Ok(())
}
