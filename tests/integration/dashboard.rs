//! The dashboard at `GET /`, rendered by headless Chromium against a real
//! pipeline: every row carries the API's exact micros, exhausted limits come
//! first, `?q=` filters by limit id, and the chart area follows the history
//! endpoint (a chart when it has points, "no history yet" on 404).
//!
//! Chromium runs the page's own polling for a few seconds of virtual time
//! (`--virtual-time-budget`) and prints the resulting DOM (`--dump-dom`),
//! which is scanned here without an HTML crate: Chromium serializes every
//! attribute in double quotes, which is all the scanner needs.

use std::collections::{BTreeMap, BTreeSet};
use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use adspend_tests::sim::SimConfig;
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde_json::Value;

use crate::support::{assert_exact, sim_config, Backends, Pipeline};

/// Debian's package puts its launcher here (`scripts/install-deps.sh test`).
const CHROMIUM: &str = "/usr/bin/chromium";
/// A headless run takes a few seconds; this only bounds a hung browser.
const CHROMIUM_TIMEOUT: Duration = Duration::from_secs(120);
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

/// Regenerates `docs/dashboard.png` from a demo-like pipeline (1,000 ads,
/// traffic at a steady rate for a minute, so the charts have a history):
/// `cargo test -p adspend-tests --test integration dashboard_screenshot -- --ignored`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes docs/dashboard.png; run by hand after changing the dashboard"]
async fn dashboard_screenshot() {
    let chromium = chromium_binary();
    let mut p = Pipeline::start(Backends::default(), 1000).await;
    p.spawn_all().await;
    let config = SimConfig {
        events: Some(9_000),
        rate: 150.0,
        ..sim_config(9_000, 7)
    };
    let truth = p.publish(&config).await;
    assert_exact(&p.settle(&truth, Duration::from_secs(60)).await, &truth);
    // Chart the daily limit with the most spend that still has budget among
    // the rows in view: a plan to follow, next to the exhausted ones.
    let api = read_api(&p.pacer_url()).await;
    let mut by_urgency: Vec<&ApiLimit> = api.values().collect();
    by_urgency.sort_by(|a, b| urgency(a, b));
    let selected = by_urgency
        .iter()
        .take(25)
        .filter(|l| !l.exhausted && l.daily)
        .max_by_key(|l| l.spend_micros)
        .map(|l| l.limit_id.clone())
        .expect("a daily limit with budget left");
    let out = adspend_tests::harness::workspace_root().join("docs/dashboard.png");
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    // The run is a minute of a day: chart the recorded span, not the day.
    let target = format!("{}/?select={selected}&zoom=recorded", p.pacer_url());
    run_chromium(
        &chromium,
        &[
            format!("--screenshot={}", out.display()),
            "--window-size=1400,1000".into(),
            "--hide-scrollbars".into(),
        ],
        &target,
    )
    .await;
    assert!(out.is_file(), "no screenshot at {}", out.display());
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
    let (least, most) = adspend_tests::harness::wait_until_ok(
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

// ---- the API's side ----------------------------------------------------------

#[derive(Debug, Clone, PartialEq)]
struct ApiLimit {
    limit_id: String,
    daily: bool,
    spend_micros: u64,
    budget_micros: u64,
    remaining_micros: u64,
    exhausted: bool,
}

impl ApiLimit {
    /// The dashboard's order after exhaustion: share of the budget used.
    fn share(&self) -> f64 {
        self.spend_micros as f64 / self.budget_micros as f64
    }
}

/// The dashboard's order: exhausted first, then by share of the budget used
/// (ties by id).
fn urgency(a: &ApiLimit, b: &ApiLimit) -> std::cmp::Ordering {
    b.exhausted
        .cmp(&a.exhausted)
        .then(b.share().total_cmp(&a.share()))
        .then(a.limit_id.cmp(&b.limit_id))
}

/// Every limit, through the same pages the dashboard reads.
async fn read_api(url: &str) -> BTreeMap<String, ApiLimit> {
    let mut limits = BTreeMap::new();
    let mut after: Option<String> = None;
    loop {
        let mut request = reqwest::Client::new()
            .get(format!("{url}/v1/limits"))
            .query(&[("limit", "1000")]);
        if let Some(after) = &after {
            request = request.query(&[("after", after)]);
        }
        let page: Value = request
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .expect("GET /v1/limits")
            .json()
            .await
            .expect("limits page is JSON");
        for limit in page["limits"].as_array().expect("limits array") {
            let micros = |field: &str| {
                limit[field]
                    .as_u64()
                    .unwrap_or_else(|| panic!("{field} is not a u64 in {limit}"))
            };
            let parsed = ApiLimit {
                limit_id: limit["limit_id"].as_str().expect("limit_id").to_owned(),
                daily: limit["period"] == "daily",
                spend_micros: micros("spend_micros"),
                budget_micros: micros("budget_micros"),
                remaining_micros: micros("remaining_micros"),
                exhausted: limit["exhausted"].as_bool().expect("exhausted"),
            };
            limits.insert(parsed.limit_id.clone(), parsed);
        }
        match page["next"].as_str() {
            Some(next) => after = Some(next.to_owned()),
            None => return limits,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Default)]
enum HistoryState {
    /// 404: the pacer has no history endpoint (yet).
    Missing,
    #[default]
    Empty,
    Points,
}

async fn read_history(url: &str, limit_id: &str) -> HistoryState {
    let response = reqwest::Client::new()
        .get(format!("{url}/v1/limits/{limit_id}/history"))
        .send()
        .await
        .expect("GET history");
    if response.status() == reqwest::StatusCode::NOT_FOUND {
        return HistoryState::Missing;
    }
    let body: Value = response
        .error_for_status()
        .expect("history status")
        .json()
        .await
        .expect("history is JSON");
    match body["points"].as_array() {
        Some(points) if !points.is_empty() => HistoryState::Points,
        _ => HistoryState::Empty,
    }
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

// ---- the page's side ---------------------------------------------------------

/// Rows and markers of the rendered dashboard.
#[derive(Debug, Default)]
struct Page {
    dom: String,
    rows: Vec<Row>,
    selected: Option<String>,
    chart_history: Option<String>,
    search_value: Option<String>,
    updated_ms: Option<String>,
    lag_ms: Option<String>,
    stale: bool,
    /// What the history endpoint said for the first row before rendering.
    history_before: HistoryState,
}

#[derive(Debug, Default)]
struct Row {
    limit_id: String,
    exhausted_attr: Option<String>,
    class: String,
    /// `spend` / `budget` / `remaining` → (data-micros, shown text).
    money: BTreeMap<String, (String, String)>,
}

impl Page {
    fn parse(dom: String) -> Page {
        let mut page = Page::default();
        let tbody = dom
            .find("<tbody id=\"rows\"")
            .unwrap_or_else(|| panic!("no <tbody id=\"rows\"> in the page:\n{}", head(&dom)));
        let tbody_end = tbody + dom[tbody..].find("</tbody>").expect("</tbody>");
        for tag in tags(&dom) {
            let in_rows = (tbody..tbody_end).contains(&tag.start);
            match tag.name.as_str() {
                "tr" if in_rows => {
                    if let Some(id) = tag.attr("data-limit") {
                        page.rows.push(Row {
                            limit_id: id.to_owned(),
                            exhausted_attr: tag.attr("data-exhausted").map(str::to_owned),
                            class: tag.attr("class").unwrap_or_default().to_owned(),
                            money: BTreeMap::new(),
                        });
                    }
                }
                "td" if in_rows => {
                    let class = tag.attr("class").unwrap_or_default();
                    let kind = ["spend", "budget", "remaining"]
                        .into_iter()
                        .find(|k| class.split_whitespace().any(|c| c == *k));
                    if let (Some(kind), Some(row)) = (kind, page.rows.last_mut()) {
                        let micros = tag
                            .attr("data-micros")
                            .unwrap_or_else(|| {
                                panic!("{kind} cell of {} has no data-micros", row.limit_id)
                            })
                            .to_owned();
                        let text = dom[tag.end..]
                            .split("</td>")
                            .next()
                            .map(unescape)
                            .unwrap_or_default();
                        row.money.insert(kind.to_owned(), (micros, text));
                    }
                }
                "body" => {
                    page.stale = tag
                        .attr("class")
                        .is_some_and(|c| c.split_whitespace().any(|c| c == "stale"))
                }
                _ => match tag.attr("id") {
                    Some("detail") => page.selected = tag.attr("data-limit").map(str::to_owned),
                    Some("spend-chart") => {
                        page.chart_history = tag.attr("data-history").map(str::to_owned)
                    }
                    Some("search") => page.search_value = tag.attr("value").map(str::to_owned),
                    Some("updated") => page.updated_ms = tag.attr("data-ms").map(str::to_owned),
                    Some("c-lag") => page.lag_ms = tag.attr("data-ms").map(str::to_owned),
                    _ => {}
                },
            }
        }
        page.dom = dom;
        page
    }
}

/// Each row against the API: the three amounts exact (and shown as units
/// with two decimals), the exhausted mark, and the order.
fn check_rows(page: &Page, api: &BTreeMap<String, ApiLimit>) {
    for row in &page.rows {
        let limit = api
            .get(&row.limit_id)
            .unwrap_or_else(|| panic!("row {} is not a limit of the API", row.limit_id));
        for (kind, expected) in [
            ("spend", limit.spend_micros),
            ("budget", limit.budget_micros),
            ("remaining", limit.remaining_micros),
        ] {
            let (micros, text) = row
                .money
                .get(kind)
                .unwrap_or_else(|| panic!("row {} has no {kind} cell", row.limit_id));
            assert_eq!(
                micros,
                &expected.to_string(),
                "{kind} of {}: page data-micros vs API",
                row.limit_id
            );
            assert_eq!(
                text.trim(),
                units(expected),
                "{kind} of {} as shown",
                row.limit_id
            );
        }
        let marked = row.class.split_whitespace().any(|c| c == "exhausted");
        assert_eq!(
            (marked, row.exhausted_attr.as_deref()),
            (
                limit.exhausted,
                Some(if limit.exhausted { "true" } else { "false" })
            ),
            "exhausted mark of {}",
            row.limit_id
        );
    }
    let order: Vec<&ApiLimit> = page.rows.iter().map(|r| &api[&r.limit_id]).collect();
    for pair in order.windows(2) {
        let (a, b) = (pair[0], pair[1]);
        assert!(
            a.exhausted >= b.exhausted,
            "{} (not exhausted) is listed before {} (exhausted)",
            a.limit_id,
            b.limit_id
        );
        if a.exhausted == b.exhausted {
            assert!(
                a.share() >= b.share(),
                "{} ({:.4} of its budget) is listed before {} ({:.4})",
                a.limit_id,
                a.share(),
                b.limit_id,
                b.share()
            );
        }
    }
}

/// Micros as currency units with two decimals (half up) and thousands
/// separators, as the page shows them.
fn units(micros: u64) -> String {
    let cents = (u128::from(micros) + 5_000) / 10_000;
    let whole = (cents / 100).to_string();
    let mut grouped = String::new();
    for (i, digit) in whole.chars().enumerate() {
        if i > 0 && (whole.len() - i) % 3 == 0 {
            grouped.push(',');
        }
        grouped.push(digit);
    }
    format!("{grouped}.{:02}", cents % 100)
}

/// An opening tag of the serialized DOM.
struct Tag {
    name: String,
    attrs: Vec<(String, String)>,
    /// Byte offset of its `<` and just past its `>`.
    start: usize,
    end: usize,
}

impl Tag {
    fn attr(&self, name: &str) -> Option<&str> {
        self.attrs
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Every opening tag, in order. Text between tags is skipped; `<script>` and
/// `<style>` contents are skipped whole (they may hold `<` themselves).
fn tags(html: &str) -> Vec<Tag> {
    let bytes = html.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(offset) = html[i..].find('<') {
        let start = i + offset;
        i = start + 1;
        if !bytes.get(i).is_some_and(u8::is_ascii_alphabetic) {
            continue;
        }
        let name_end = i + html[i..]
            .find(|c: char| c.is_ascii_whitespace() || c == '>' || c == '/')
            .unwrap_or(html.len() - i);
        let name = html[i..name_end].to_ascii_lowercase();
        let mut attrs = Vec::new();
        let mut j = name_end;
        loop {
            while bytes
                .get(j)
                .is_some_and(|b| b.is_ascii_whitespace() || *b == b'/')
            {
                j += 1;
            }
            match bytes.get(j) {
                None => break,
                Some(b'>') => {
                    j += 1;
                    break;
                }
                Some(_) => {}
            }
            let attr_end = j + html[j..]
                .find(|c: char| c.is_ascii_whitespace() || c == '=' || c == '>')
                .unwrap_or(html.len() - j);
            let attr = html[j..attr_end].to_ascii_lowercase();
            j = attr_end;
            let mut value = String::new();
            if bytes.get(j) == Some(&b'=') && bytes.get(j + 1) == Some(&b'"') {
                let close = j + 2 + html[j + 2..].find('"').expect("unterminated attribute");
                value = unescape(&html[j + 2..close]);
                j = close + 1;
            }
            attrs.push((attr, value));
        }
        i = j;
        if name == "script" || name == "style" {
            if let Some(close) = html[i..].find(&format!("</{name}>")) {
                i += close;
            }
        }
        out.push(Tag {
            name,
            attrs,
            start,
            end: i.min(html.len()),
        });
    }
    out
}

fn unescape(s: &str) -> String {
    s.replace("&quot;", "\"")
        .replace("&#39;", "'")
        .replace("&lt;", "<")
        .replace("&gt;", ">")
        .replace("&nbsp;", "\u{a0}")
        .replace("&amp;", "&")
}

fn head(s: &str) -> String {
    s.chars().take(2_000).collect()
}

// ---- Chromium ----------------------------------------------------------------

fn chromium_binary() -> PathBuf {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("chromium"))
            .find(|candidate| candidate.is_file())
    });
    on_path
        .or_else(|| Some(PathBuf::from(CHROMIUM)).filter(|p| p.is_file()))
        .unwrap_or_else(|| {
            panic!(
                "chromium not found (looked on PATH and at {CHROMIUM}); the dashboard test \
                 renders the page in headless Chromium: run `scripts/install-deps.sh test` \
                 from the workspace root"
            )
        })
}

/// Runs headless Chromium on `target` with `extra` flags and returns its
/// standard output; fails the test on a timeout or a failed exit.
async fn run_chromium(chromium: &Path, extra: &[String], target: &str) -> String {
    let chromium = chromium.to_owned();
    let extra = extra.to_vec();
    let target = target.to_owned();
    tokio::task::spawn_blocking(move || run_chromium_blocking(&chromium, &extra, &target))
        .await
        .expect("chromium runner panicked")
}

fn run_chromium_blocking(chromium: &Path, extra: &[String], target: &str) -> String {
    let dir = tempfile::tempdir().expect("tempdir for chromium");
    let stdout_path = dir.path().join("stdout");
    let stderr_path = dir.path().join("stderr");
    // Output to files, not pipes: a DOM bigger than a pipe buffer would
    // block the browser while this thread waits for it to exit.
    let mut child = Command::new(chromium)
        .args([
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-extensions",
        ])
        .arg(format!(
            "--user-data-dir={}",
            dir.path().join("profile").display()
        ))
        .arg(format!("--virtual-time-budget={VIRTUAL_TIME_MS}"))
        .args(extra)
        .arg(target)
        .stdin(Stdio::null())
        .stdout(File::create(&stdout_path).expect("chromium stdout file"))
        .stderr(File::create(&stderr_path).expect("chromium stderr file"))
        // Its own process group, so a timeout takes the renderer and GPU
        // processes down with it.
        .process_group(0)
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", chromium.display()));
    let deadline = Instant::now() + CHROMIUM_TIMEOUT;
    let status = loop {
        if let Some(status) = child.try_wait().expect("waiting for chromium") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = killpg(Pid::from_raw(child.id() as i32), Signal::SIGKILL);
            let _ = child.wait();
            panic!(
                "chromium did not finish {target} within {CHROMIUM_TIMEOUT:?}; its stderr:\n{}",
                std::fs::read_to_string(&stderr_path).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let stdout = std::fs::read_to_string(&stdout_path).expect("chromium output");
    assert!(
        status.success(),
        "chromium failed on {target} ({status}); its stderr:\n{}",
        std::fs::read_to_string(&stderr_path).unwrap_or_default()
    );
    stdout
}
