//! An input message of impressions, in either of its two formats, as a
//! sequence of entries each parsed into an [`Impression`] or a
//! [`Rejection`]: what the limiter maps and dead-letters, entry by entry.
//!
//! - **NDJSON** (the contract's): one JSON object a line; blank lines are
//!   skipped, a trailing `\r` is cut, and an entry's number is its line
//!   number (from 0, blank lines counted), parsed by
//!   [`parse_line`].
//! - **Binary** ([`binary`], docs/INPUT.md): a message that begins with
//!   [`binary::MAGIC`], which no NDJSON payload that holds an impression
//!   can begin with (its first byte is not valid UTF-8), followed by a
//!   version byte and length-prefixed entries; an entry's number is its
//!   position (from 0).
//!
//! The format is told by the first bytes alone: a payload is binary exactly
//! when it begins with the magic, and NDJSON otherwise. There is no guess
//! from content: a payload that is neither is NDJSON, and its lines are
//! rejected as NDJSON lines are.

pub mod binary;

use crate::impression::{parse_line, Impression, Rejection};

/// The format of an input message, told by its first bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Ndjson,
    /// The binary batch format, with the version its header names (which
    /// may be one this crate does not read: [`entries`] then rejects the
    /// message as one entry).
    Binary(u8),
}

impl Format {
    pub fn of(payload: &[u8]) -> Format {
        match payload.strip_prefix(binary::MAGIC.as_slice()) {
            Some(rest) => Format::Binary(rest.first().copied().unwrap_or(0)),
            None => Format::Ndjson,
        }
    }
}

fn newline(b: &u8) -> bool {
    *b == b'\n'
}

/// One entry of an input message: an NDJSON line or a binary entry.
#[derive(Debug)]
pub struct Entry<'a> {
    /// Its number in the message (the line number for NDJSON), from 0: a
    /// dead letter's `line_no`.
    pub no: u32,
    /// Its bytes (the line; a binary entry's body without its length), what
    /// a dead letter carries.
    pub bytes: &'a [u8],
    pub parsed: Result<Impression<'a>, Rejection>,
}

/// The entries of `payload`, in order, whatever its format.
pub fn entries(payload: &[u8]) -> Entries<'_> {
    match Format::of(payload) {
        Format::Ndjson => Entries::Ndjson {
            lines: payload.split(newline as fn(&u8) -> bool),
            no: 0,
        },
        Format::Binary(_) => Entries::Binary(binary::Reader::new(payload)),
    }
}

/// Iterator over the entries of a message ([`entries`]).
pub enum Entries<'a> {
    Ndjson {
        lines: std::slice::Split<'a, u8, fn(&u8) -> bool>,
        no: u32,
    },
    Binary(binary::Reader<'a>),
}

impl<'a> Iterator for Entries<'a> {
    type Item = Entry<'a>;

    fn next(&mut self) -> Option<Entry<'a>> {
        match self {
            Entries::Ndjson { lines, no } => loop {
                let line = lines.next()?;
                let line_no = *no;
                *no = no.wrapping_add(1);
                let line = line.strip_suffix(b"\r").unwrap_or(line);
                if line.iter().all(u8::is_ascii_whitespace) {
                    continue;
                }
                return Some(Entry {
                    no: line_no,
                    bytes: line,
                    parsed: parse_line(line),
                });
            },
            Entries::Binary(reader) => reader.next(),
        }
    }
}

#[cfg(test)]
mod tests;
