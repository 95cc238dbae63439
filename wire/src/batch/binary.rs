//! The binary batch format of impressions (version 1), beside NDJSON:
//! about a third of NDJSON's bytes per impression and no JSON to parse.
//! docs/INPUT.md is its specification; in short:
//!
//! ```text
//! message = MAGIC version:u8 entry*          MAGIC = AD 49 42, version = 01
//! entry   = length:varint body[length]
//! body    = id:str ad_id:str cost_micros:varint ts:varint lease_id:str
//! str     = length:varint bytes[length]      (UTF-8; an empty lease_id: none)
//! varint  = unsigned LEB128, at most 10 bytes
//! ```
//!
//! Each entry is decoded and checked on its own, with NDJSON's rules and
//! reasons: an entry that does not decode (cut short, bytes left over after
//! its last field, a varint over 10 bytes) is `invalid_json`, the binary
//! counterpart of a line that is not JSON; a string that is not UTF-8 or a
//! cost beyond u64 is `invalid_field`; an empty or over-long id
//! `id_too_long`; a `ts` beyond 9999-12-31 (or beyond u64) `invalid_ts`.
//! A length that runs past the end of the message leaves nothing to read
//! after it: the rest of the message is one `invalid_json` entry. A message
//! of a version this crate does not read is one `invalid_json` entry.

use std::borrow::Cow;

use crate::batch::Entry;
use crate::impression::{Impression, Reason, Rejection, MAX_TS_MS};
use crate::types::{Micros, MAX_ID_LEN};

/// What a binary batch begins with. `0xAD` cannot begin UTF-8 text (it is a
/// continuation byte), so no NDJSON payload holding an impression begins so.
pub const MAGIC: [u8; 3] = [0xAD, b'I', b'B'];
/// The version this crate writes and reads.
pub const VERSION: u8 = 1;
/// Bytes before the first entry.
pub const HEADER_LEN: usize = MAGIC.len() + 1;
/// The longest varint (a u64 in 7-bit groups).
const MAX_VARINT: usize = 10;

fn reject(reason: Reason, detail: impl Into<String>) -> Rejection {
    Rejection {
        reason,
        detail: detail.into(),
    }
}

/// A varint read: its value, or `None` when it is 10 bytes whose value is
/// beyond u64 (a field's range fault, not the entry's).
type Varint = Option<u64>;

/// The entry does not decode.
struct Cut(&'static str);

struct Cursor<'a> {
    bytes: &'a [u8],
}

impl<'a> Cursor<'a> {
    fn varint(&mut self, what: &'static str) -> Result<Varint, Cut> {
        let mut value = 0u64;
        for (i, &b) in self.bytes.iter().enumerate().take(MAX_VARINT) {
            if i == MAX_VARINT - 1 {
                if b & 0x80 != 0 {
                    return Err(Cut(what));
                }
                self.bytes = &self.bytes[MAX_VARINT..];
                return Ok((b <= 1).then_some(value | u64::from(b) << 63));
            }
            value |= u64::from(b & 0x7f) << (7 * i);
            if b & 0x80 == 0 {
                self.bytes = &self.bytes[i + 1..];
                return Ok(Some(value));
            }
        }
        Err(Cut(what))
    }

    fn bytes(&mut self, what: &'static str) -> Result<&'a [u8], Cut> {
        let len = self.varint(what)?.ok_or(Cut(what))?;
        if len > self.bytes.len() as u64 {
            return Err(Cut(what));
        }
        let (field, rest) = self.bytes.split_at(len as usize);
        self.bytes = rest;
        Ok(field)
    }
}

struct Fields<'a> {
    id: &'a [u8],
    ad_id: &'a [u8],
    cost: Varint,
    ts: Varint,
    lease_id: &'a [u8],
}

fn fields(body: &[u8]) -> Result<Fields<'_>, Cut> {
    let mut cursor = Cursor { bytes: body };
    let fields = Fields {
        id: cursor.bytes("id")?,
        ad_id: cursor.bytes("ad_id")?,
        cost: cursor.varint("cost_micros")?,
        ts: cursor.varint("ts")?,
        lease_id: cursor.bytes("lease_id")?,
    };
    if !cursor.bytes.is_empty() {
        return Err(Cut("the end of the entry"));
    }
    Ok(fields)
}

fn text<'a>(name: &str, bytes: &'a [u8]) -> Result<&'a str, Rejection> {
    std::str::from_utf8(bytes).map_err(|e| {
        reject(
            Reason::InvalidField,
            format!("\"{name}\" is not UTF-8: {e}"),
        )
    })
}

/// Decode and check one entry's body, with NDJSON's rules (module docs).
pub fn parse_entry(body: &[u8]) -> Result<Impression<'_>, Rejection> {
    let fields = fields(body).map_err(|Cut(at)| {
        reject(
            Reason::InvalidJson,
            format!(
                "binary entry of {} bytes does not decode: cut short or malformed at {at}",
                body.len()
            ),
        )
    })?;
    let id = text("id", fields.id)?;
    let ad_id = text("ad_id", fields.ad_id)?;
    let lease_id = text("lease_id", fields.lease_id)?;
    for (name, value) in [("id", id), ("ad_id", ad_id)] {
        if value.is_empty() || value.len() > MAX_ID_LEN {
            return Err(reject(
                Reason::IdTooLong,
                format!(
                    "\"{name}\" must be 1..={MAX_ID_LEN} bytes, has {}",
                    value.len()
                ),
            ));
        }
    }
    let cost_micros: Micros = fields.cost.ok_or_else(|| {
        reject(
            Reason::InvalidField,
            "cost_micros is beyond a u64 (a 10-byte varint over 2^64 - 1)",
        )
    })?;
    let ts_ms = fields
        .ts
        .filter(|&t| t <= MAX_TS_MS as u64)
        .ok_or_else(|| {
            let ts = fields
                .ts
                .map_or("beyond u64".to_string(), |t| t.to_string());
            reject(
                Reason::InvalidTs,
                format!("ts {ts} is not unix milliseconds in 0..={MAX_TS_MS}"),
            )
        })? as i64;
    Ok(Impression {
        id: Cow::Borrowed(id),
        ad_id: Cow::Borrowed(ad_id),
        cost_micros,
        ts_ms,
        lease_id: (!lease_id.is_empty()).then_some(Cow::Borrowed(lease_id)),
    })
}

/// The entries of a binary message (one that begins with [`MAGIC`]).
#[derive(Debug)]
pub struct Reader<'a> {
    payload: &'a [u8],
    /// Where the next entry begins; `None` once the message is read.
    at: Option<usize>,
    no: u32,
}

impl<'a> Reader<'a> {
    pub(crate) fn new(payload: &'a [u8]) -> Self {
        Reader {
            payload,
            at: Some(0),
            no: 0,
        }
    }

    /// The rest of the message as one rejected entry, and the end.
    fn rest_rejected(&mut self, from: usize, detail: String) -> Entry<'a> {
        self.at = None;
        Entry {
            no: self.no,
            bytes: &self.payload[from..],
            parsed: Err(reject(Reason::InvalidJson, detail)),
        }
    }
}

impl<'a> Iterator for Reader<'a> {
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        let mut at = self.at?;
        if at == 0 {
            let version = self.payload.get(MAGIC.len()).copied();
            if version != Some(VERSION) {
                let named =
                    version.map_or("no version byte".to_string(), |v| format!("version {v}"));
                return Some(self.rest_rejected(
                    0,
                    format!("binary batch of {named}: this limiter reads version {VERSION}"),
                ));
            }
            at = HEADER_LEN;
        }
        if at >= self.payload.len() {
            self.at = None;
            return None;
        }
        let mut cursor = Cursor {
            bytes: &self.payload[at..],
        };
        let len = match cursor.varint("length") {
            Ok(Some(len)) if len <= cursor.bytes.len() as u64 => len as usize,
            Ok(Some(len)) => {
                let detail = format!(
                    "binary entry {} of {len} bytes runs past the end of the message \
                     ({} bytes left): the rest of the message is not read",
                    self.no,
                    cursor.bytes.len()
                );
                return Some(self.rest_rejected(at, detail));
            }
            _ => {
                let detail = format!(
                    "binary entry {}: its length is cut short or malformed: \
                     the rest of the message is not read",
                    self.no
                );
                return Some(self.rest_rejected(at, detail));
            }
        };
        let body_at = self.payload.len() - cursor.bytes.len();
        let body = &self.payload[body_at..body_at + len];
        self.at = Some(body_at + len);
        let no = self.no;
        self.no = self.no.wrapping_add(1);
        Some(Entry {
            no,
            bytes: body,
            parsed: parse_entry(body),
        })
    }
}

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push(value as u8 | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn varint_len(value: u64) -> usize {
    (64 - value.max(1).leading_zeros() as usize).div_ceil(7)
}

/// Writes one entry (its length and body) at the end of `out`. Whatever it
/// is given it writes: what the contract refuses (an empty or over-long id,
/// a negative or too late `ts`) the limiter dead-letters with its reason.
/// A negative `ts_ms` is written as its two's complement, beyond any valid
/// `ts`.
pub fn put_entry(
    out: &mut Vec<u8>,
    id: &str,
    ad_id: &str,
    cost_micros: Micros,
    ts_ms: i64,
    lease_id: Option<&str>,
) {
    let lease_id = lease_id.unwrap_or("");
    let strings = [id, ad_id, lease_id];
    let body: usize = strings
        .iter()
        .map(|s| varint_len(s.len() as u64) + s.len())
        .sum::<usize>()
        + varint_len(cost_micros)
        + varint_len(ts_ms as u64);
    out.reserve(varint_len(body as u64) + body);
    put_varint(out, body as u64);
    for (i, s) in strings.iter().enumerate() {
        if i == 2 {
            put_varint(out, cost_micros);
            put_varint(out, ts_ms as u64);
        }
        put_varint(out, s.len() as u64);
        out.extend_from_slice(s.as_bytes());
    }
}

/// A binary batch being written: the header, then one entry a
/// [`push`](BinaryBatch::push).
///
/// ```
/// use adspend_wire::batch::{binary::BinaryBatch, entries};
///
/// let mut batch = BinaryBatch::new();
/// batch.push("imp-1", "ad-1", 1_500, 1_700_000_000_000, None);
/// batch.push("imp-2", "ad-1", 2_000, 1_700_000_000_001, Some("k.1.0"));
/// let read: Vec<_> = entries(batch.as_bytes()).map(|e| e.parsed.unwrap()).collect();
/// assert_eq!(read[1].id, "imp-2");
/// assert_eq!(read[1].lease_id.as_deref(), Some("k.1.0"));
/// ```
#[derive(Clone, Debug)]
pub struct BinaryBatch {
    bytes: Vec<u8>,
    entries: usize,
}

impl Default for BinaryBatch {
    fn default() -> Self {
        BinaryBatch::new()
    }
}

impl BinaryBatch {
    pub fn new() -> Self {
        BinaryBatch::with_capacity(HEADER_LEN)
    }

    /// With room for `bytes` bytes (about 30 an impression of short ids).
    pub fn with_capacity(bytes: usize) -> Self {
        let mut out = Vec::with_capacity(bytes.max(HEADER_LEN));
        out.extend_from_slice(&MAGIC);
        out.push(VERSION);
        BinaryBatch {
            bytes: out,
            entries: 0,
        }
    }

    /// Appends one impression ([`put_entry`]).
    pub fn push(
        &mut self,
        id: &str,
        ad_id: &str,
        cost_micros: Micros,
        ts_ms: i64,
        lease_id: Option<&str>,
    ) {
        put_entry(&mut self.bytes, id, ad_id, cost_micros, ts_ms, lease_id);
        self.entries += 1;
    }

    /// Impressions written.
    pub fn len(&self) -> usize {
        self.entries
    }

    pub fn is_empty(&self) -> bool {
        self.entries == 0
    }

    /// The message as it is, header included.
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes
    }

    pub fn into_bytes(self) -> Vec<u8> {
        self.bytes
    }

    /// Back to the header alone, keeping the allocation.
    pub fn clear(&mut self) {
        self.bytes.truncate(HEADER_LEN);
        self.entries = 0;
    }
}
