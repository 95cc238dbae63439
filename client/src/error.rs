//! What a call to the pacer can end in.

use std::time::Duration;

/// An error of a [`crate::Pacer`] call.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The pacer refused the request (4xx): not retried. `field` is the
    /// request field the pacer named (`ads[3].micros`), when it named one.
    #[error("pacer refused the request ({status}): {message}")]
    Refused {
        status: u16,
        field: Option<String>,
        message: String,
    },
    /// Unknown or missing token (401), or a token of the other scope (403).
    #[error("pacer refused the token ({status}): {message}")]
    Unauthorized { status: u16, message: String },
    /// No such limit or lease (404).
    #[error("not found: {0}")]
    NotFound(String),
    /// The pacer answered 5xx, or could not be reached, on every try.
    #[error("pacer unavailable after {tries} tries over {elapsed:?}: {last}")]
    Unavailable {
        tries: u32,
        elapsed: Duration,
        last: String,
    },
    /// A 2xx answer that is not the contract's JSON.
    #[error("pacer answered what the contract does not say: {0}")]
    Protocol(String),
    /// A setting of the client (URL, CA file, token) cannot be used.
    #[error("client config: {0}")]
    Config(String),
}

impl Error {
    /// Whether a retry could succeed (the pacer unavailable).
    pub fn is_transient(&self) -> bool {
        matches!(self, Error::Unavailable { .. })
    }
}

/// The request field a pacer error message starts with: `ads[3].micros must
/// be ...` names `ads[3].micros`; a message that does not start with a
/// field path names none.
pub(crate) fn named_field(message: &str) -> Option<String> {
    let first = message.split_whitespace().next()?;
    let first = first.trim_end_matches(':');
    let is_path = !first.is_empty()
        && first
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.[]".contains(c))
        && first.starts_with(|c: char| c.is_ascii_lowercase());
    let known = [
        "ads", "ad_ids", "ttl_ms", "leases", "micros", "limit", "after",
    ];
    (is_path && known.iter().any(|k| first.starts_with(k))).then(|| first.to_string())
}

#[cfg(test)]
mod tests {
    use super::named_field;

    #[test]
    fn the_field_a_pacer_error_names() {
        assert_eq!(
            named_field("ads[3].micros must be an integer >= 1").as_deref(),
            Some("ads[3].micros")
        );
        assert_eq!(
            named_field("ttl_ms must be an integer in 1000..=600000").as_deref(),
            Some("ttl_ms")
        );
        assert_eq!(
            named_field("ads: 2000 ads, at most 1000").as_deref(),
            Some("ads")
        );
        assert_eq!(
            named_field("Failed to parse the request body as JSON"),
            None
        );
        assert_eq!(named_field(""), None);
    }
}
