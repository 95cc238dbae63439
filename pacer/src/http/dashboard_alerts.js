// The dashboard's Alerts panel, loaded by dashboard.html after its own
// script (whose getJson, esc, compact and POLL_MS it uses). Fed by
// GET v1/alerts?limit=20 every POLL_MS: the newest budget alerts first, one
// row per crossing (data-alert is its id); clicking a row selects its limit.
// The tbody's data-state says which empty state (or "rows") is shown.
'use strict';

const alertsState = {
  page: null,   // the last answer of v1/alerts
  error: null,  // {message, status} of the last failed read
};
const ALERTS_SHOWN = 20;

function fmtMoney(micros) {
  const units = Number(micros) / 1e6;
  return Number.isFinite(units) ? compact(units) : '–';
}

function alertRowHtml(a) {
  const at = new Date(Number(a.at_ms));
  const period = a.period_start === null ? 'lifetime' : esc(String(a.period_start).slice(0, 10));
  const over = Number(a.threshold_percent) >= 100;
  return `<tr data-alert="${esc(a.id)}" data-limit="${esc(a.limit_id)}"${over ? ' class="over"' : ''}>` +
    `<td class="l when" title="${esc(at.toISOString())}">${esc(at.toLocaleString())}</td>` +
    `<td class="l id">${esc(a.limit_id)}</td>` +
    `<td class="l period">${period}</td>` +
    `<td class="num threshold">${esc(String(a.threshold_percent))}%</td>` +
    `<td class="num spend" title="${esc(String(a.spend_micros))} of ${esc(String(a.budget_micros))} micros">` +
      `${fmtMoney(a.spend_micros)} / ${fmtMoney(a.budget_micros)}</td></tr>`;
}

function alertsBody() {
  const page = alertsState.page, e = alertsState.error;
  const empty = (state, text) => [state, `<tr class="empty"><td colspan="5">${esc(text)}</td></tr>`];
  if (page === null) {
    if (e === null) return empty('loading', 'loading…');
    if (e.status === 404) return empty('unsupported', 'this pacer serves no alerts');
    return empty('error', `cannot read the alerts (${e.message})`);
  }
  if (!page.alerts.length) return empty('none', 'no budget alerts yet (limits list theirs under "alerts" in the catalog)');
  return ['rows', page.alerts.map(alertRowHtml).join('')];
}

function renderAlerts() {
  const [state, html] = alertsBody();
  const body = $('alert-rows');
  body.innerHTML = html;
  body.dataset.state = state;
  const page = alertsState.page;
  $('alerts-sub').textContent = page && page.alerts.length
    ? `newest ${page.alerts.length}${page.next ? ' (more on GET /v1/alerts)' : ''}` : '';
}

async function pollAlerts() {
  try {
    alertsState.page = await getJson(`v1/alerts?limit=${ALERTS_SHOWN}`);
    alertsState.error = null;
  } catch (e) {
    alertsState.error = {message: String(e.message || e), status: e.status};
    if (e.status === 404) alertsState.page = null;
  }
  renderAlerts();
  setTimeout(pollAlerts, POLL_MS);
}

$('alert-rows').addEventListener('click', e => {
  const row = e.target.closest('tr[data-limit]');
  if (row) select(row.dataset.limit);
});
renderAlerts();
pollAlerts();
