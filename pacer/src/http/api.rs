//! The HTTP API of CONTRACT.md, the dashboard and the operational endpoints.
//!
//! Routes by scope ([`crate::http::auth`]): the read endpoints and the decisions
//! endpoint behind their token checks, the dashboard page, `/healthz` and
//! `/metrics` open, and the OpenAPI document of all of them
//! ([`crate::http::openapi`]). Every error is JSON ([`crate::http::reply`]).

use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, StatusCode};
use axum::middleware::{from_fn, from_fn_with_state};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post, MethodRouter};
use axum::{Json, Router};
use chrono::Utc;
use serde::{Deserialize, Serialize};

use crate::http::auth::{require_decide, require_read, Auth};
use crate::http::reply::{error, json_errors, method_not_allowed, not_found, ApiPath, ApiQuery};
use crate::pacing::{view, LimitView};

/// Largest request body accepted (a decisions batch): 413 above it.
pub const MAX_BODY_BYTES: usize = 2 * 1024 * 1024;

pub(super) use crate::http::app::AppState;

/// One route: method (as the OpenAPI document spells it), path, handler.
/// The router is built from these tables and `crate::http::openapi`'s test checks
/// the document against them, so a route cannot be added to one alone.
pub(crate) type Route<S> = (&'static str, &'static str, MethodRouter<S>);

/// Behind the read scope.
pub(crate) fn read_routes() -> [Route<AppState>; 7] {
    [
        ("get", "/v1/alerts", get(list_alerts)),
        (
            "get",
            "/v1/leases/{lease_id}",
            get(crate::http::leases::read),
        ),
        ("get", "/v1/limits", get(list_limits)),
        ("get", "/v1/limits/{limit_id}", get(get_limit)),
        ("get", "/v1/limits/{limit_id}/history", get(get_history)),
        ("get", "/v1/shards", get(list_shards)),
        ("get", "/v1/sources", get(list_sources)),
    ]
}

/// Behind the decide scope.
pub(crate) fn decide_routes() -> [Route<AppState>; 3] {
    [
        (
            "post",
            "/v1/decisions",
            post(crate::http::decisions::decisions),
        ),
        ("post", "/v1/leases", post(crate::http::leases::grant)),
        (
            "post",
            "/v1/leases/release",
            post(crate::http::leases::release),
        ),
    ]
}

/// Never behind a token on the API port.
pub(crate) fn open_routes() -> [Route<AppState>; 4] {
    [
        ("get", "/", get(dashboard)),
        ("get", "/dashboard/sources.js", get(dashboard_sources)),
        ("get", "/dashboard/alerts.js", get(dashboard_alerts)),
        (
            "get",
            "/v1/openapi.json",
            get(crate::http::openapi::document),
        ),
    ]
}

/// On both ports, never behind a token.
pub(crate) fn ops_route_table<S: Clone + Send + Sync + 'static>() -> [Route<S>; 2] {
    [
        ("get", "/healthz", get(|| async { "ok" })),
        ("get", "/metrics", get(metrics)),
    ]
}

fn routed<S: Clone + Send + Sync + 'static>(
    routes: impl IntoIterator<Item = Route<S>>,
) -> Router<S> {
    routes
        .into_iter()
        .fold(Router::new(), |router, (_, path, handler)| {
            router.route(path, handler)
        })
}

/// The API port: everything.
pub fn router(state: AppState, auth: Auth) -> Router {
    let read = routed(read_routes()).route_layer(from_fn_with_state(auth.clone(), require_read));
    let decide = routed(decide_routes()).route_layer(from_fn_with_state(auth, require_decide));
    let open = routed(open_routes());
    finish(open.merge(read).merge(decide).merge(ops_routes())).with_state(state)
}

/// The separate operations port (`ADSPEND_PACER_OPS_ADDR`): `/healthz` and
/// `/metrics` only, never behind a token.
pub fn ops_router() -> Router {
    finish(ops_routes())
}

fn ops_routes<S: Clone + Send + Sync + 'static>() -> Router<S> {
    routed(ops_route_table())
}

/// JSON 404 and 405, JSON for any other error, and the body limit.
fn finish<S: Clone + Send + Sync + 'static>(router: Router<S>) -> Router<S> {
    router
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(from_fn(json_errors))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

/// The limit's spend in flight under leases, its overspend bound
/// raised by one event beyond each of its live grants, and, across
/// regions, its global spend and every region's part.
fn with_leased(mut view: LimitView, app: &AppState) -> LimitView {
    if let Some(leases) = &app.leases {
        let (held, live) = leases.held_and_live(&view.limit_id);
        view.leased_micros = held;
        view.overspend_bound_micros = view
            .overspend_bound_micros
            .saturating_add(live.saturating_mul(view.max_cost_micros));
    }
    match &app.regions {
        Some(regions) => {
            crate::regions::view::with_regions(view, &regions.book(), adspend_common::now_ms())
        }
        None => view,
    }
}

async fn get_limit(State(app): State<AppState>, ApiPath(limit_id): ApiPath<String>) -> Response {
    let catalog = app.catalog.borrow().clone();
    let Some(limit) = catalog.limit(&limit_id) else {
        return error(StatusCode::NOT_FOUND, format!("unknown limit {limit_id:?}"));
    };
    let spend = app.spend.read().await;
    Json(with_leased(view(limit, &spend, Utc::now()), &app)).into_response()
}

#[derive(Serialize)]
struct History<'a> {
    limit_id: String,
    points: &'a [crate::pacing::state::Point],
}

/// Spend, plan and multiplier over the current period (dashboard charts).
async fn get_history(State(app): State<AppState>, ApiPath(limit_id): ApiPath<String>) -> Response {
    let catalog = app.catalog.borrow().clone();
    if catalog.limit(&limit_id).is_none() {
        return error(StatusCode::NOT_FOUND, format!("unknown limit {limit_id:?}"));
    }
    let spend = app.spend.read().await;
    let points = spend
        .pacing
        .get(limit_id.as_str())
        .map_or(&[][..], |p| &p.history[..]);
    Json(History { limit_id, points }).into_response()
}

#[derive(Deserialize)]
struct Page {
    after: Option<String>,
    limit: Option<usize>,
}

#[derive(Serialize)]
struct LimitsPage {
    limits: Vec<LimitView>,
    /// Pass as `after` for the next page; absent on the last page.
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<String>,
}

/// Most limits in one page of `GET /v1/limits` (each a few hundred bytes).
pub const MAX_PAGE: usize = 1000;

async fn list_limits(State(app): State<AppState>, ApiQuery(page): ApiQuery<Page>) -> Response {
    let size = page.limit.unwrap_or(100);
    if size == 0 || size > MAX_PAGE {
        return error(
            StatusCode::BAD_REQUEST,
            format!("limit must be 1..={MAX_PAGE}"),
        );
    }
    let catalog = app.catalog.borrow().clone();
    // In id order already (the catalog's): a page costs its own size.
    let rest = catalog.limits_after(page.after.as_deref());
    let on_page = &rest[..size.min(rest.len())];
    let spend = app.spend.read().await;
    let now = Utc::now();
    let limits: Vec<LimitView> = on_page
        .iter()
        .map(|limit| with_leased(view(limit, &spend, now), &app))
        .collect();
    let next = if rest.len() > size {
        on_page.last().map(|l| l.id.to_string())
    } else {
        None
    };
    Json(LimitsPage { limits, next }).into_response()
}

#[derive(Deserialize)]
struct AlertsPage {
    /// A stream sequence: alerts older than it.
    after: Option<u64>,
    limit: Option<usize>,
}

/// The newest budget alerts first, paged by stream sequence.
async fn list_alerts(
    State(app): State<AppState>,
    ApiQuery(page): ApiQuery<AlertsPage>,
) -> Response {
    let size = page.limit.unwrap_or(100);
    let max = crate::alerts::recent::MAX_PAGE;
    if size == 0 || size > max {
        return error(StatusCode::BAD_REQUEST, format!("limit must be 1..={max}"));
    }
    Json(app.alerts.page(page.after, size)).into_response()
}

#[derive(Serialize)]
struct ShardView {
    shard: String,
    /// Owner epoch of the newest pushes held: it rises when ownership moves.
    epoch: u64,
    /// `SPEND` stream sequence the shard's sums are exact as of.
    seq: u64,
    watermark: i64,
    /// How old the newest spend its sums may lack is, from now: since its
    /// watermark, or the limiters' input lag when that is more.
    lag_ms: i64,
    /// When the last push from the shard arrived (unix ms).
    updated_ms: i64,
    /// No push (not even a heartbeat), or `lag_ms`, past the stale threshold.
    stale: bool,
    /// The shard's dedupe window as last reported; `None` before a report.
    dedupe_window: Option<DedupeWindowView>,
}

/// What a shard's dedupe window holds (`pacer/openapi.json`, `DedupeWindow`).
#[derive(Serialize)]
struct DedupeWindowView {
    effective_ms: Option<u64>,
    configured_ms: u64,
    ids: u64,
    max_ids: u64,
    memory_bytes: u64,
    cut_by_count: bool,
    reported_ms: i64,
}

impl From<&adspend_common::dedupe_window::Report> for DedupeWindowView {
    fn from(report: &adspend_common::dedupe_window::Report) -> Self {
        DedupeWindowView {
            effective_ms: report.effective_ms,
            configured_ms: report.configured_ms,
            ids: report.ids,
            max_ids: report.max_ids,
            memory_bytes: report.memory_bytes,
            cut_by_count: report.cut_by_count(),
            reported_ms: report.at_ms,
        }
    }
}

#[derive(Serialize)]
struct Shards {
    shards: Vec<ShardView>,
}

/// Per shard (a partition in cluster mode): who last pushed and how far it
/// is; operators and the cluster tests watch ownership move here.
async fn list_shards(State(app): State<AppState>) -> Response {
    let spend = app.spend.read().await;
    let now_ms = Utc::now().timestamp_millis();
    let mut shards: Vec<ShardView> = spend
        .shards
        .iter()
        .map(|(name, s)| ShardView {
            shard: name.to_string(),
            epoch: s.epoch,
            seq: s.seq,
            watermark: s.watermark_ms,
            lag_ms: spend.shard_staleness_ms(s, now_ms),
            updated_ms: s.updated_ms,
            stale: spend.shard_stale(s, now_ms)
                || spend.shard_staleness_ms(s, now_ms) > spend.stale_after_ms,
            dedupe_window: spend.dedupe_windows.get(&**name).map(Into::into),
        })
        .collect();
    shards.sort_by(|a, b| a.shard.cmp(&b.shard));
    Json(Shards { shards }).into_response()
}

/// Per limiter, its latest report of how it shares itself among the
/// sources of `IMPRESSIONS` (stale ones marked).
async fn list_sources(State(app): State<AppState>) -> Response {
    let now_ms = Utc::now().timestamp_millis();
    let view = app
        .sources
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .view(now_ms);
    Json(view).into_response()
}

async fn metrics() -> Response {
    match adspend_common::telemetry::metrics_handle() {
        Some(handle) => (
            [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
            handle.render(),
        )
            .into_response(),
        None => error(
            StatusCode::SERVICE_UNAVAILABLE,
            "no metrics recorder installed",
        ),
    }
}

async fn dashboard() -> Html<&'static str> {
    Html(include_str!("dashboard.html"))
}

/// The dashboard's Sources panel (a script of its own, loaded by the page).
async fn dashboard_sources() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("dashboard_sources.js"),
    )
        .into_response()
}

/// The dashboard's Budget alerts panel.
async fn dashboard_alerts() -> Response {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        include_str!("dashboard_alerts.js"),
    )
        .into_response()
}
