//! The dashboard at `GET /`, rendered by headless Chromium against a real
//! pipeline: every row carries the API's exact micros, exhausted limits come
//! first, `?q=` filters by limit id, and the chart area follows the history
//! endpoint (a chart when it has points, "no history yet" on 404); the
//! Sources panel lists what the limiter reports (`/v1/sources`).
//!
//! Chromium runs the page's own polling for a few seconds of virtual time
//! (`--virtual-time-budget`) and prints the resulting DOM (`--dump-dom`),
//! which is scanned here without an HTML crate: Chromium serializes every
//! attribute in double quotes, which is all the scanner needs.

mod api;
mod chromium;
mod page;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::{Duration, Instant};

use self::api::{read_api, read_history, read_sources, urgency, ApiLimit, HistoryState};
use self::chromium::{chromium_binary, run_chromium};
use self::page::{check_rows, Page};
use crate::support::{assert_exact, sim_config, Backends, Pipeline};

/// Virtual time the page gets before the DOM is taken: several polls.
const VIRTUAL_TIME_MS: u32 = 5_000;
/// The search of the filtered view: some ad sets, not everything.
const QUERY: &str = "set-1";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_shows_exact_spend_exhausted_first_and_filters() {
    let chromium = chromium_binary();
    let mut p = Pipeline::start(Backends::default(), 100).await;
    p.spawn_all().await;
    let truth = p.publish(&sim_config(5_000, 1)).await;
    let comparison = p.settle(&truth, Duration::from_secs(60)).await;
    assert_exact(&comparison, &truth);
    let url = p.pacer_url();
    let (exhausted_id, fuller_id) = budgets_that_order_by_exhaustion(&p).await;

    // The whole view: every limit, exact, exhausted first.
    let (api, page) = render_stable(&chromium, &url, &format!("{url}/")).await;
    let exhausted = api.values().filter(|l| l.exhausted).count();
    assert!(
        exhausted > 0 && exhausted < api.len(),
        "the run must leave some limits exhausted and some not for the order to mean \
         anything: {exhausted} of {} exhausted",
        api.len()
    );
    assert_eq!(
        page.rows
            .iter()
            .map(|r| r.limit_id.as_str())
            .collect::<BTreeSet<_>>(),
        api.keys().map(String::as_str).collect::<BTreeSet<_>>(),
        "the dashboard must list every limit of the API"
    );
    assert_eq!(page.rows.len(), api.len(), "a limit is listed twice");
    check_rows(&page, &api);
    let position = |id: &str| page.rows.iter().position(|r| r.limit_id == id).unwrap();
    assert!(
        position(&exhausted_id) < position(&fuller_id),
        "{exhausted_id} (exhausted) must be listed before {fuller_id} (fuller, not exhausted)"
    );
    assert!(
        !page.stale,
        "the page reports that it cannot read the pacer"
    );
    assert!(page.updated_ms.is_some(), "no 'last updated' time shown");
    assert!(page.lag_ms.is_some(), "no overall lag shown");
    check_sources(&url, &page).await;

    // The default selection is the first (most urgent) row, and its chart
    // area matches what the history endpoint had before the page was read.
    let first = &page.rows[0].limit_id;
    assert_eq!(page.selected.as_deref(), Some(first.as_str()));
    match page.history_before {
        HistoryState::Missing => assert!(
            page.dom.contains("no history yet"),
            "the history of {first} is 404: the chart area must say 'no history yet'"
        ),
        HistoryState::Points => assert_eq!(
            page.chart_history.as_deref(),
            Some("yes"),
            "the history of {first} has points: the chart must draw them"
        ),
        HistoryState::Empty => assert!(
            page.chart_history.is_some() || page.dom.contains("no history yet"),
            "the chart area of {first} shows neither a chart nor 'no history yet'"
        ),
    }

    // `?q=` pre-fills the search and shows only the matching limits.
    let (api, page) = render_stable(&chromium, &url, &format!("{url}/?q={QUERY}")).await;
    let matching: BTreeSet<&str> = api
        .keys()
        .map(String::as_str)
        .filter(|id| id.to_lowercase().contains(QUERY))
        .collect();
    assert!(
        !matching.is_empty() && matching.len() < api.len(),
        "{QUERY:?} must match some limits but not all ({} of {})",
        matching.len(),
        api.len()
    );
    assert_eq!(page.search_value.as_deref(), Some(QUERY));
    assert_eq!(
        page.rows
            .iter()
            .map(|r| r.limit_id.as_str())
            .collect::<BTreeSet<_>>(),
        matching,
        "?q={QUERY} must show exactly the limits whose id contains it"
    );
    check_rows(&page, &api);

    // `?select=` charts a limit: its spend, plan and budget, and its
    // multiplier, once the pacer has recorded a history for it.
    match wait_for_history(&url, &fuller_id).await {
        HistoryState::Missing => {
            eprintln!("dashboard: the pacer has no history endpoint yet; the charts were not drawn")
        }
        HistoryState::Empty => panic!("the pacer recorded no history for {fuller_id}"),
        HistoryState::Points => {
            let (_, page) =
                render_stable(&chromium, &url, &format!("{url}/?select={fuller_id}")).await;
            assert_eq!(page.selected.as_deref(), Some(fuller_id.as_str()));
            assert_eq!(
                page.chart_history.as_deref(),
                Some("yes"),
                "the history of {fuller_id} has points: the chart must draw them"
            );
            for series in ["spend-line", "budget-line", "mult-line"] {
                assert!(
                    page.dom.contains(&format!("class=\"{series}\"")),
                    "the charts of {fuller_id} have no {series}"
                );
            }
        }
    }
}

/// The Sources panel against `/v1/sources`: a row per (limiter, source),
/// highlighted exactly where the source is held back. The limiter has
/// reported since it started (every second), so the panel shows rows.
async fn check_sources(url: &str, page: &Page) {
    let api = read_sources(url).await;
    assert!(
        !api.is_empty(),
        "the limiter reported no sources: the panel has nothing to show"
    );
    assert_eq!(
        page.sources_state.as_deref(),
        Some("rows"),
        "the Sources panel shows no rows"
    );
    let shown: BTreeSet<(&str, &str)> = page
        .source_rows
        .iter()
        .map(|r| (r.limiter.as_str(), r.source.as_str()))
        .collect();
    let reported: BTreeSet<(&str, &str)> = api
        .iter()
        .map(|(limiter, source, _)| (limiter.as_str(), source.as_str()))
        .collect();
    assert_eq!(shown, reported, "the Sources panel vs /v1/sources");
    assert_eq!(
        page.source_rows.len(),
        reported.len(),
        "a source is listed twice"
    );
    for row in &page.source_rows {
        let marked = row.class.split_whitespace().any(|c| c == "held-back");
        let flag = row.held_back_attr.as_deref();
        assert!(
            flag == Some("true") || flag == Some("false"),
            "{row:?}: data-held-back"
        );
        assert_eq!(marked, flag == Some("true"), "{row:?}: highlight vs flag");
    }
}

/// The history of `limit_id` once it has points (the pacer records one
/// every few seconds), or what it is after a while.
async fn wait_for_history(url: &str, limit_id: &str) -> HistoryState {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = read_history(url, limit_id).await;
        if state != HistoryState::Empty || Instant::now() > deadline {
            return state;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Regenerates `docs/dashboard.png` from the demo's closed loop: the
/// generated catalog of 1,000 ads with lifetime budgets and alerts at 50,
/// 90 and 100%, four ad servers serving by spend leases over a day
/// compressed into a minute (as `scripts/demo.sh` runs them), so the page
/// shows limits stopped at their budgets, spend in flight and the alerts:
/// `cargo test -p adspend-tests --test integration dashboard_screenshot -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes docs/dashboard.png; run by hand after changing the dashboard"]
async fn dashboard_screenshot() {
    use adspend_sim::{run_closed_loop, CostDistribution, LeaseMode, LoopConfig, ServeMode};
    let chromium = chromium_binary();
    let mut catalog =
        adspend_sim::generate_catalog(&adspend_sim::CatalogSpec::for_ads(1000), 7).unwrap();
    for limit in catalog.limits.values_mut() {
        limit.period = adspend_sim::Period::Lifetime;
    }
    let mut p = Pipeline::start_with(Backends::default(), Default::default(), catalog).await;
    let mut doc: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&p.catalog_path).unwrap()).unwrap();
    for limit in doc["limits"].as_object_mut().unwrap().values_mut() {
        limit["alerts"] = serde_json::json!([50, 90, 100]);
    }
    std::fs::write(&p.catalog_path, serde_json::to_vec(&doc).unwrap()).unwrap();
    p.aggregator = Some(p.spawn("aggregator"));
    p.limiter = Some(p.spawn("limiter"));
    p.pacer = Some(p.spawn_with(
        "pacer",
        adspend_harness::free_port(),
        &[("ADSPEND_PACER_LEASE_GRACE_MS", "3000")],
    ));
    p.wait_pacer().await;
    let config = LoopConfig {
        pacer_url: p.pacer_url(),
        servers: 4,
        day: Duration::from_secs(60),
        duration: Duration::from_secs(60),
        peak_rate: 1_500.0,
        cost: CostDistribution::Uniform {
            min: 100_000,
            max: 1_900_000,
        },
        mode: ServeMode::Leases(LeaseMode::with_ttl(Duration::from_secs(3))),
        seed: 7,
        ..LoopConfig::default()
    };
    let client = p.client().await;
    let outcome = run_closed_loop(
        &client,
        &config,
        &p.catalog,
        tokio_util::sync::CancellationToken::new(),
        |_| {},
    )
    .await
    .expect("closed loop");
    let truth = &outcome.truth;
    assert_exact(&p.settle(truth, Duration::from_secs(60)).await, truth);
    // Chart the limit with the most spend that still has budget among the
    // rows in view, next to the exhausted ones.
    let api = read_api(&p.pacer_url()).await;
    let mut by_urgency: Vec<&ApiLimit> = api.values().collect();
    by_urgency.sort_by(|a, b| urgency(a, b));
    let selected = by_urgency
        .iter()
        .take(25)
        .filter(|l| !l.exhausted)
        .max_by_key(|l| l.spend_micros)
        .map(|l| l.limit_id.clone())
        .expect("a limit with budget left");
    let out = adspend_harness::workspace_root().join("docs/dashboard.png");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    // Chromium writes next to the old picture, which is replaced only by a
    // screenshot that passes the checks below: a leftover file proves nothing.
    // Chromium picks the format by the extension: the name must end in .png.
    let fresh = out.with_file_name("dashboard.new.png");
    let _ = std::fs::remove_file(&fresh);
    // The run is a minute of a day: chart the recorded span, not the day.
    let target = format!("{}/?select={selected}&zoom=recorded", p.pacer_url());
    run_chromium(
        &chromium,
        &[
            format!("--screenshot={}", fresh.display()),
            format!("--window-size={},{}", SCREENSHOT.0, SCREENSHOT.1),
            "--hide-scrollbars".into(),
        ],
        &target,
    )
    .await;
    let png = std::fs::read(&fresh)
        .unwrap_or_else(|e| panic!("no screenshot at {}: {e}", fresh.display()));
    assert_eq!(
        png_dimensions(&png),
        Ok(SCREENSHOT),
        "{} is not a {}x{} PNG",
        fresh.display(),
        SCREENSHOT.0,
        SCREENSHOT.1
    );
    // A blank or error page of that size compresses to a few kilobytes; the
    // table, the charts and their labels do not.
    assert!(
        png.len() > MIN_SCREENSHOT_BYTES,
        "the screenshot is {} bytes: an empty page, not the dashboard",
        png.len()
    );
    std::fs::rename(&fresh, &out).expect("replace docs/dashboard.png");
}

/// The screenshot's window, in pixels: (width, height).
const SCREENSHOT: (u32, u32) = (1400, 1000);
/// Smallest plausible screenshot of the dashboard with rows and charts.
const MIN_SCREENSHOT_BYTES: usize = 50_000;

/// Width and height from a PNG's header, after checking that the file is a
/// whole PNG: its signature, an `IHDR` chunk first, an `IEND` chunk last.
fn png_dimensions(png: &[u8]) -> Result<(u32, u32), String> {
    const SIGNATURE: &[u8] = b"\x89PNG\r\n\x1a\n";
    const IEND: &[u8] = b"\0\0\0\0IEND\xaeB`\x82";
    let header = png.strip_prefix(SIGNATURE).ok_or("no PNG signature")?;
    if header.get(4..8) != Some(b"IHDR".as_slice()) {
        return Err("the first chunk is not IHDR".into());
    }
    if !png.ends_with(IEND) {
        return Err("no IEND chunk at the end: truncated".into());
    }
    let size = header.get(8..16).ok_or("IHDR is cut short")?;
    let be = |at: usize| u32::from_be_bytes(size[at..at + 4].try_into().unwrap());
    Ok((be(0), be(4)))
}

#[test]
fn png_dimensions_reads_the_header_of_a_whole_png() {
    // The framing of a 1400x1000 PNG without its pixels: only the framing
    // is read.
    let mut png = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR\0\0\x05\x78\0\0\x03\xe8\x08\0\0\0\0".to_vec();
    png.extend_from_slice(b"\0\0\0\0IEND\xaeB`\x82");
    assert_eq!(png_dimensions(&png), Ok((1400, 1000)));
    assert!(png_dimensions(&png[..png.len() - 1]).is_err(), "truncated");
    assert!(png_dimensions(&png[1..]).is_err(), "no signature");
    assert!(png_dimensions(b"\x89PNG\r\n\x1a\n").is_err(), "no chunks");
}

/// Rewrites two budgets so that "exhausted first" and "fullest first" give
/// different orders: the limit with the least spend is left less than a
/// typical impression (exhausted, yet under its budget), the one with the
/// most spend more than the costliest impression (not exhausted) at a
/// higher share. Returns (exhausted, fuller) once the pacer serves the new
/// catalog.
async fn budgets_that_order_by_exhaustion(p: &Pipeline) -> (String, String) {
    let url = p.pacer_url();
    let api = read_api(&url).await;
    let spent = || api.values().filter(|l| l.spend_micros > 0);
    let least = spent()
        .min_by_key(|l| l.spend_micros)
        .expect("a limit with spend");
    let most = spent()
        .max_by_key(|l| l.spend_micros)
        .expect("a limit with spend");
    // Impressions cost 100..=5_000_000 micros (the simulator's default).
    let least_budget = least.spend_micros + 500_000;
    let most_budget = most.spend_micros + 5_500_000;
    let mut catalog = p.catalog.clone();
    catalog
        .limits
        .get_mut(&least.limit_id)
        .unwrap()
        .budget_micros = least_budget;
    catalog
        .limits
        .get_mut(&most.limit_id)
        .unwrap()
        .budget_micros = most_budget;
    // The pacer polls the file: replace it whole.
    let staged = p.catalog_path.with_extension("json.new");
    catalog.save(&staged).expect("write catalog");
    std::fs::rename(&staged, &p.catalog_path).expect("replace catalog");
    let (least_id, most_id) = (least.limit_id.clone(), most.limit_id.clone());
    let (least, most) = adspend_harness::wait_until_ok(
        Duration::from_secs(20),
        Duration::from_millis(100),
        || async {
            let api = read_api(&url).await;
            let (least, most) = (api[&least_id].clone(), api[&most_id].clone());
            anyhow::ensure!(
                least.budget_micros == least_budget && most.budget_micros == most_budget,
                "the pacer still serves the old budgets"
            );
            Ok((least, most))
        },
    )
    .await
    .expect("the pacer did not pick up the catalog change");
    assert!(
        least.exhausted && !most.exhausted && most.share() > least.share(),
        "the budget change should leave {least:?} exhausted under a fuller {most:?}"
    );
    (least_id, most_id)
}

/// Renders `target` with the API unchanged around the rendering (a period
/// rolling over mid-read would otherwise be a false mismatch); returns the
/// API's limits and the page.
async fn render_stable(
    chromium: &Path,
    url: &str,
    target: &str,
) -> (BTreeMap<String, ApiLimit>, Page) {
    for _ in 0..3 {
        let before = read_api(url).await;
        // What the page will select by default, to know what its chart
        // area must show.
        let mut by_urgency: Vec<&ApiLimit> = before.values().collect();
        by_urgency.sort_by(|a, b| urgency(a, b));
        let history_before = match by_urgency.first() {
            Some(first) => read_history(url, &first.limit_id).await,
            None => HistoryState::Empty,
        };
        let started = Instant::now();
        let dom = run_chromium(chromium, &["--dump-dom".to_owned()], target).await;
        eprintln!(
            "dashboard: {target} rendered in {:.1}s ({} bytes of DOM)",
            started.elapsed().as_secs_f64(),
            dom.len()
        );
        let after = read_api(url).await;
        if before == after {
            let mut page = Page::parse(dom);
            page.history_before = history_before;
            eprintln!(
                "dashboard: {} rows, {} selected, first row's history {history_before:?}",
                page.rows.len(),
                page.selected.as_deref().unwrap_or("nothing")
            );
            return (after, page);
        }
        eprintln!("dashboard: the API changed while the page rendered; again");
    }
    panic!("the pacer's answers kept changing while the dashboard rendered");
}
