//! The two payload formats the simulator writes: NDJSON (the contract's)
//! and the binary batch format (`adspend_wire::batch::binary`), with the
//! same events either way.

use std::fmt;
use std::str::FromStr;

use adspend_wire::batch::binary::{put_entry, HEADER_LEN, MAGIC, VERSION};
use bytes::{BufMut, BytesMut};

use super::{Generator, GoodEvent};

/// How a message of impressions is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum InputFormat {
    /// One JSON object a line.
    #[default]
    Ndjson,
    /// The binary batch format of docs/INPUT.md.
    Binary,
}

impl fmt::Display for InputFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            InputFormat::Ndjson => "ndjson",
            InputFormat::Binary => "binary",
        })
    }
}

impl FromStr for InputFormat {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "ndjson" => Ok(InputFormat::Ndjson),
            "binary" => Ok(InputFormat::Binary),
            _ => Err(format!("unknown format {s:?}, expected ndjson or binary")),
        }
    }
}

impl Generator {
    /// Writes messages in `format`. Bad events are NDJSON lines, most of
    /// which the binary format cannot express: a generator with a bad rate
    /// writes NDJSON only.
    pub fn with_format(mut self, format: InputFormat) -> Result<Self, String> {
        if format == InputFormat::Binary && self.config.bad_rate > 0.0 {
            return Err("the binary format has no bad events: set the bad rate to 0".into());
        }
        self.format = format;
        Ok(self)
    }

    /// What begins a message: the binary format's header.
    pub(super) fn start_message(&mut self, out: &mut BytesMut) {
        if self.format == InputFormat::Binary {
            out.reserve(HEADER_LEN);
            out.put_slice(&MAGIC);
            out.put_u8(VERSION);
        }
    }

    pub(super) fn write_good_binary(&mut self, event: &GoodEvent, out: &mut BytesMut) {
        let mut id = [0u8; 64];
        let prefix = self.id_prefix.len();
        id[..prefix].copy_from_slice(&self.id_prefix);
        let mut digits = [0u8; 20];
        let digits = decimal(event.seq, &mut digits);
        id[prefix..prefix + digits.len()].copy_from_slice(digits);
        let id = std::str::from_utf8(&id[..prefix + digits.len()]).expect("a run id is UTF-8");
        self.scratch.clear();
        put_entry(
            &mut self.scratch,
            id,
            &self.index.ad_ids[event.ad as usize],
            event.cost,
            event.ts,
            None,
        );
        out.put_slice(&self.scratch);
    }
}

/// `value` in decimal, at the end of `digits`.
fn decimal(mut value: u64, digits: &mut [u8; 20]) -> &[u8] {
    let mut at = digits.len();
    loop {
        at -= 1;
        digits[at] = b'0' + (value % 10) as u8;
        value /= 10;
        if value == 0 {
            break;
        }
    }
    &digits[at..]
}

pub(super) fn put_u64(out: &mut BytesMut, value: u64) {
    out.put_slice(decimal(value, &mut [0u8; 20]));
}

pub(super) fn put_i64(out: &mut BytesMut, value: i64) {
    if value < 0 {
        out.put_u8(b'-');
    }
    put_u64(out, value.unsigned_abs());
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use adspend_wire::batch::entries;

    use super::*;
    use crate::event::{Batch, EventTime, GeneratorConfig};
    use crate::truth::CatalogIndex;
    use crate::{generate_catalog, CatalogSpec, CostDistribution};

    fn message(format: InputFormat) -> (Vec<u8>, Batch) {
        let catalog = generate_catalog(&CatalogSpec::for_ads(50), 4).unwrap();
        let index = Arc::new(CatalogIndex::new(&catalog).unwrap());
        let config = GeneratorConfig {
            seed: 9,
            zipf_exponent: 1.0,
            cost: CostDistribution::Uniform { min: 0, max: 9 },
            duplicate_rate: 0.2,
            bad_rate: 0.0,
            bad_kinds: Vec::new(),
            event_time: EventTime::Now,
        };
        let mut generator = Generator::new(index, config, "run-1")
            .unwrap()
            .with_format(format)
            .unwrap();
        let (mut out, mut batch) = (BytesMut::new(), Batch::default());
        generator.write_message(300, 1_700_000_000_000, &mut out, &mut batch);
        (out.to_vec(), batch)
    }

    #[test]
    fn both_formats_carry_the_same_events() {
        let (ndjson, sent) = message(InputFormat::Ndjson);
        let (binary, same) = message(InputFormat::Binary);
        assert_eq!(sent.good.len(), 300);
        let events = |b: &Batch| -> Vec<(u64, u32, u64, i64)> {
            b.good.iter().map(|e| (e.seq, e.ad, e.cost, e.ts)).collect()
        };
        assert_eq!(events(&sent), events(&same));
        let read = |payload: &[u8]| -> Vec<(String, String, u64, i64)> {
            entries(payload)
                .map(|e| {
                    let i = e.parsed.expect("a good event");
                    (
                        i.id.into_owned(),
                        i.ad_id.into_owned(),
                        i.cost_micros,
                        i.ts_ms,
                    )
                })
                .collect()
        };
        assert_eq!(read(&binary), read(&ndjson));
        assert!(
            binary.len() * 2 < ndjson.len(),
            "{} vs {}",
            binary.len(),
            ndjson.len()
        );
    }
}
