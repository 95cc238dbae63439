//! The page's side: the rows and markers of the DOM Chromium dumped,
//! scanned without an HTML crate, and their check against the API.

use std::collections::BTreeMap;

use super::api::{ApiLimit, HistoryState};

/// Rows and markers of the rendered dashboard.
#[derive(Debug, Default)]
pub(super) struct Page {
    pub(super) dom: String,
    pub(super) rows: Vec<Row>,
    pub(super) selected: Option<String>,
    pub(super) chart_history: Option<String>,
    pub(super) search_value: Option<String>,
    pub(super) updated_ms: Option<String>,
    pub(super) lag_ms: Option<String>,
    pub(super) stale: bool,
    /// What the history endpoint said for the first row before rendering.
    pub(super) history_before: HistoryState,
    /// The Sources panel: its rows, and which content it shows (`rows` or
    /// an empty state).
    pub(super) source_rows: Vec<SourceRow>,
    pub(super) sources_state: Option<String>,
}

#[derive(Debug, Default)]
pub(super) struct SourceRow {
    pub(super) limiter: String,
    pub(super) source: String,
    pub(super) held_back_attr: Option<String>,
    pub(super) class: String,
}

#[derive(Debug, Default)]
pub(super) struct Row {
    pub(super) limit_id: String,
    pub(super) exhausted_attr: Option<String>,
    pub(super) class: String,
    /// `spend` / `budget` / `remaining` / `leased` → (data-micros, shown text).
    pub(super) money: BTreeMap<String, (String, String)>,
}

impl Page {
    pub(super) fn parse(dom: String) -> Page {
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
                    let kind = ["spend", "budget", "remaining", "leased"]
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
                "tr" if tag.attr("data-source").is_some() => page.source_rows.push(SourceRow {
                    limiter: tag.attr("data-limiter").unwrap_or_default().to_owned(),
                    source: tag.attr("data-source").unwrap_or_default().to_owned(),
                    held_back_attr: tag.attr("data-held-back").map(str::to_owned),
                    class: tag.attr("class").unwrap_or_default().to_owned(),
                }),
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
                    Some("source-rows") => {
                        page.sources_state = tag.attr("data-state").map(str::to_owned)
                    }
                    _ => {}
                },
            }
        }
        page.dom = dom;
        page
    }
}

/// Each row against the API: the four amounts exact (and shown as units
/// with two decimals), the exhausted mark, and the order.
pub(super) fn check_rows(page: &Page, api: &BTreeMap<String, ApiLimit>) {
    for row in &page.rows {
        let limit = api
            .get(&row.limit_id)
            .unwrap_or_else(|| panic!("row {} is not a limit of the API", row.limit_id));
        for (kind, expected) in [
            ("spend", limit.spend_micros),
            ("budget", limit.budget_micros),
            ("remaining", limit.remaining_micros),
            ("leased", limit.leased_micros),
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
