//! `ADSPEND_AGGREGATOR_WRITERS` parsed: how many writers (shards) a
//! single-machine aggregator runs.

/// `ADSPEND_AGGREGATOR_WRITERS`: a count, or chosen at start.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Writers {
    /// What the data directory or the records hold, else one per core.
    Auto,
    /// Exactly this many (1..=1024); a data directory written otherwise is
    /// refused.
    Count(u32),
}

pub(super) fn parse_writers(value: &str) -> Result<Writers, String> {
    let value = value.trim();
    if value == "auto" {
        return Ok(Writers::Auto);
    }
    match value.parse::<u32>() {
        Ok(n @ 1..=1024) => Ok(Writers::Count(n)),
        _ => Err(format!(
            "{value:?} is not \"auto\" or a number of writers from 1 to 1024"
        )),
    }
}

impl std::fmt::Display for Writers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Writers::Auto => f.write_str("auto"),
            Writers::Count(n) => write!(f, "{n}"),
        }
    }
}
