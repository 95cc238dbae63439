//! Errors of decoding and catalog parsing. `adspend_common::Error` has a
//! variant of the same name and text for each, and converts from this.

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("cannot decode {what}: {reason}")]
    Decode { what: &'static str, reason: String },

    #[error("invalid catalog {source_name}: {reason}")]
    Catalog { source_name: String, reason: String },
}
