// The dashboard's Sources panel, loaded by dashboard.html after its own
// script (whose getJson, token handling, esc, fmtLag and POLL_MS it uses).
// Fed by GET v1/sources every POLL_MS: per limiter and source, the share of
// the limiter's recent usage, the lag of the oldest waiting message, what
// waits and whether the fair scheduler is holding the source back (those
// rows are highlighted). Each row carries data-source, data-limiter,
// data-held-back and data-stale; the tbody's data-state says which empty
// state (or "rows") is shown.
'use strict';

const sourcesState = {
  view: null,       // the last answer of v1/sources
  error: null,      // {message, status} of the last failed read
};

function fmtRate(perSecond) {
  if (!Number.isFinite(perSecond)) return '–';
  return perSecond < 10 ? perSecond.toFixed(1) : compact(perSecond);
}

function fmtBytes(bytes) {
  if (!Number.isFinite(bytes)) return '–';
  const units = ['B', 'KB', 'MB', 'GB', 'TB'];
  let i = 0;
  while (bytes >= 1000 && i < units.length - 1) { bytes /= 1000; i++; }
  return (i === 0 ? String(bytes) : bytes.toFixed(1)) + ' ' + units[i];
}

function sourceRowHtml(limiter, s) {
  const classes = [s.held_back ? 'held-back' : '', limiter.stale ? 'stale-report' : ''].join(' ').trim();
  const share = Math.min(1, Math.max(0, Number(s.usage_share) || 0));
  const lagMs = Math.round((Number(s.lag_seconds) || 0) * 1000);
  return `<tr data-source="${esc(s.source)}" data-limiter="${esc(limiter.limiter)}" data-held-back="${s.held_back ? 'true' : 'false'}"` +
      ` data-stale="${limiter.stale ? 'true' : 'false'}"${classes ? ` class="${classes}"` : ''}>` +
    `<td class="l id">${s.source === '' ? '<i title="subjects too short to name a source">(none)</i>' : esc(s.source)}` +
      `${s.held_back ? '<span class="badge warn" title="given less than it had waiting, so that others got their share">HELD BACK</span>' : ''}</td>` +
    `<td class="l limiter" title="consumer ${esc(limiter.consumer)}">${esc(limiter.limiter)}` +
      `${limiter.stale ? `<span class="badge bad" title="no report for ${fmtLag(limiter.age_ms)}: numbers as of then">STALE</span>` : ''}</td>` +
    `<td class="num share"><span class="used"><span class="bar"><span style="width:${(share * 100).toFixed(1)}%"></span></span>` +
      `<span class="pct">${Math.round(share * 100)}%</span></span></td>` +
    `<td class="num lag${lagMs >= 10000 ? ' bad' : lagMs >= 1000 ? ' warn' : ''}" data-ms="${lagMs}">${fmtLag(lagMs)}</td>` +
    `<td class="num pending" title="${esc(fmtBytes(s.pending_bytes))} (estimate)">${esc(String(s.pending_messages))}</td>` +
    `<td class="num rate" title="${esc(fmtBytes(Math.round(s.bytes_per_second)))}/s">${fmtRate(s.messages_per_second)}</td></tr>`;
}

// The rows, or why there are none: [state, html].
function sourcesBody() {
  const v = sourcesState.view, e = sourcesState.error;
  const empty = (state, text) => [state, `<tr class="empty"><td colspan="6">${esc(text)}</td></tr>`];
  if (v === null) {
    if (e === null) return empty('loading', 'loading…');
    if (e.status === 404) return empty('unsupported', 'this pacer serves no source reports');
    return empty('error', `cannot read the source reports (${e.message})`);
  }
  const rows = [];
  for (const limiter of v.limiters) for (const s of limiter.sources) rows.push(sourceRowHtml(limiter, s));
  if (rows.length) return ['rows', rows.join('')];
  if (!v.limiters.length) return empty('none', 'no source reports yet: no limiter has reported');
  if (v.limiters.every(l => l.scheduling === 'fifo')) {
    return empty('fifo', 'limiter in fifo mode: one consumer in stream order, no per-source view');
  }
  return empty('no-sources', 'no sources in IMPRESSIONS yet');
}

function renderSources() {
  const [state, html] = sourcesBody();
  const body = $('source-rows');
  body.innerHTML = html;
  body.dataset.state = state;
  const v = sourcesState.view;
  let sub = '';
  if (v && v.limiters.length) {
    const held = v.limiters.reduce((n, l) => n + l.sources.filter(s => s.held_back).length, 0);
    const stale = v.limiters.filter(l => l.stale).length;
    const modes = [...new Set(v.limiters.map(l => l.scheduling))].join(' + ');
    sub = `${v.limiters.length} limiter${v.limiters.length === 1 ? '' : 's'} · ${modes}` +
      (v.limiters.some(l => l.intervening) ? ' · fair order enforced' : '') +
      (held ? ` · ${held} held back` : '') + (stale ? ` · ${stale} stale` : '');
  }
  $('sources-sub').textContent = sub;
  $('sources').classList.toggle('holding', Boolean(v && v.limiters.some(l => l.sources.some(s => s.held_back))));
}

async function pollSources() {
  try {
    sourcesState.view = await getJson('v1/sources');
    sourcesState.error = null;
  } catch (e) {
    // The last answer stays on screen (its stale flags still say how old
    // it is); only with none is the error the panel's content.
    sourcesState.error = {message: String(e.message || e), status: e.status};
    if (e.status === 404) sourcesState.view = null;
  }
  renderSources();
  setTimeout(pollSources, POLL_MS);
}

renderSources();
pollSources();
