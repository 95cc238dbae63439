//! Optional bearer tokens for the API, in two scopes:
//!
//! - `read`: `GET /v1/limits`, `/v1/limits/{id}`, `/v1/limits/{id}/history`,
//!   `/v1/shards` and `/v1/sources` (all the dashboard's data);
//! - `decide`: `POST /v1/decisions`.
//!
//! Each scope has its own list (`ADSPEND_PACER_READ_TOKENS`,
//! `ADSPEND_PACER_DECIDE_TOKENS`); a scope with no tokens is open, so with
//! neither set the API is as it always was. A decide token does not read:
//! a bidder needs only decisions, and a leaked bidder token then cannot
//! list every budget and its spend; a client that needs both has its token
//! in both lists. `/healthz`, `/metrics` and the dashboard page and its
//! script (no data) never need a token.
//!
//! Tokens are compared in constant time (in the presented token's content)
//! against every configured token, and never logged: [`Auth`]'s `Debug`
//! shows only counts, and a refusal's log line and metric name the reason,
//! never the token.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

use crate::http::reply::error;
use crate::telemetry::PACER_HTTP_REFUSED_TOTAL;

/// The shortest token accepted: a guessable token is no protection.
pub(crate) const MIN_TOKEN_LEN: usize = 16;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scope {
    Read,
    Decide,
}

impl Scope {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Scope::Read => "read",
            Scope::Decide => "decide",
        }
    }
}

/// The configured tokens of both scopes.
#[derive(Clone, Default)]
pub struct Auth {
    read: Arc<[Box<[u8]>]>,
    decide: Arc<[Box<[u8]>]>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("read_tokens", &self.read.len())
            .field("decide_tokens", &self.decide.len())
            .finish()
    }
}

/// Why a token list does not parse; names the entry by position, never by
/// content.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct BadToken {
    pub(crate) position: usize,
    pub(crate) reason: &'static str,
}

/// Parse a comma-separated token list (blanks around entries and empty
/// entries ignored). Tokens are RFC 6750 `b64token`s of at least
/// [`MIN_TOKEN_LEN`] characters.
pub(crate) fn parse_tokens(list: &str) -> Result<Vec<String>, BadToken> {
    let mut tokens = Vec::new();
    for (i, token) in list
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .enumerate()
    {
        let position = i + 1;
        let body = token.trim_end_matches('=');
        if body.is_empty()
            || !body
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b"-._~+/".contains(&b))
        {
            return Err(BadToken {
                position,
                reason: "has a character outside A-Z a-z 0-9 - . _ ~ + / (and = at the end)",
            });
        }
        if token.len() < MIN_TOKEN_LEN {
            return Err(BadToken {
                position,
                reason: "is shorter than 16 characters",
            });
        }
        tokens.push(token.to_string());
    }
    Ok(tokens)
}

/// Why a request is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// No `Authorization: Bearer` header.
    Missing,
    /// A bearer token that is in neither list (or a malformed header).
    Invalid,
    /// A valid token of the other scope only.
    WrongScope,
}

impl Auth {
    pub fn new(read: Vec<String>, decide: Vec<String>) -> Auth {
        let bytes = |list: Vec<String>| -> Arc<[Box<[u8]>]> {
            list.into_iter()
                .map(|t| t.into_bytes().into_boxed_slice())
                .collect()
        };
        Auth {
            read: bytes(read),
            decide: bytes(decide),
        }
    }

    /// Whether `scope` needs a token at all.
    pub(crate) fn required(&self, scope: Scope) -> bool {
        !self.tokens(scope).is_empty()
    }

    fn tokens(&self, scope: Scope) -> &[Box<[u8]>] {
        match scope {
            Scope::Read => &self.read,
            Scope::Decide => &self.decide,
        }
    }

    /// May a request with these headers use `scope`?
    pub(crate) fn check(&self, scope: Scope, headers: &HeaderMap) -> Result<(), Refusal> {
        if !self.required(scope) {
            return Ok(());
        }
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(Refusal::Missing);
        };
        let token = bearer_token(value).ok_or(Refusal::Invalid)?;
        let other = match scope {
            Scope::Read => Scope::Decide,
            Scope::Decide => Scope::Read,
        };
        // Both lists, every entry, no early exit: the time taken does not
        // tell which token (or which scope) came close.
        let in_scope = matches_any(token, self.tokens(scope));
        let in_other = matches_any(token, self.tokens(other));
        if in_scope {
            Ok(())
        } else if in_other {
            Err(Refusal::WrongScope)
        } else {
            Err(Refusal::Invalid)
        }
    }
}

/// The token of an `Authorization: Bearer <token>` header (scheme case
/// insensitive).
fn bearer_token(value: &HeaderValue) -> Option<&[u8]> {
    let value = value.as_bytes();
    let scheme = value.get(..7)?;
    if !scheme.eq_ignore_ascii_case(b"bearer ") {
        return None;
    }
    let token = value[7..].trim_ascii();
    (!token.is_empty()).then_some(token)
}

fn matches_any(presented: &[u8], tokens: &[Box<[u8]>]) -> bool {
    let mut found = false;
    for token in tokens {
        found |= constant_time_eq(presented, token);
    }
    found
}

/// Equality whose time depends on the lengths only, never on where the two
/// differ.
fn constant_time_eq(presented: &[u8], expected: &[u8]) -> bool {
    let mut diff = u8::from(presented.len() != expected.len());
    for (i, e) in expected.iter().enumerate() {
        diff |= presented.get(i).copied().unwrap_or(0) ^ e;
    }
    std::hint::black_box(diff) == 0
}

/// Route layer of the read endpoints.
pub(crate) async fn require_read(State(auth): State<Auth>, req: Request, next: Next) -> Response {
    require(&auth, Scope::Read, req, next).await
}

/// Route layer of the decisions endpoint.
pub(crate) async fn require_decide(State(auth): State<Auth>, req: Request, next: Next) -> Response {
    require(&auth, Scope::Decide, req, next).await
}

async fn require(auth: &Auth, scope: Scope, req: Request, next: Next) -> Response {
    match auth.check(scope, req.headers()) {
        Ok(()) => next.run(req).await,
        Err(refusal) => refused(scope, refusal),
    }
}

/// 401 (no or unknown token) or 403 (the other scope's token), with the
/// `WWW-Authenticate` challenge of RFC 6750.
pub(crate) fn refused(scope: Scope, refusal: Refusal) -> Response {
    let scope = scope.as_str();
    let (status, reason, message, challenge) = match refusal {
        Refusal::Missing => (
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            format!("a bearer token with the {scope} scope is required"),
            format!("Bearer realm=\"adspend-pacer\", scope=\"{scope}\""),
        ),
        Refusal::Invalid => (
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "the bearer token is not valid".to_string(),
            format!("Bearer realm=\"adspend-pacer\", error=\"invalid_token\", scope=\"{scope}\""),
        ),
        Refusal::WrongScope => (
            StatusCode::FORBIDDEN,
            "forbidden",
            format!("the bearer token does not have the {scope} scope"),
            format!(
                "Bearer realm=\"adspend-pacer\", error=\"insufficient_scope\", scope=\"{scope}\""
            ),
        ),
    };
    metrics::counter!(PACER_HTTP_REFUSED_TOTAL, "reason" => reason).increment(1);
    let mut response = error(status, message);
    if let Ok(value) = HeaderValue::from_str(&challenge) {
        response
            .headers_mut()
            .insert(header::WWW_AUTHENTICATE, value);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    const READ: &str = "read-token-0123456789";
    const DECIDE: &str = "decide-token-0123456789";

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = authorization {
            headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        }
        headers
    }

    #[test]
    fn scopes_are_separate_and_an_unset_scope_is_open() {
        let auth = Auth::new(vec![READ.into()], vec![DECIDE.into()]);
        let check = |scope, value: Option<&str>| auth.check(scope, &headers(value));
        let read = format!("Bearer {READ}");
        let decide = format!("bearer {DECIDE}");
        assert_eq!(check(Scope::Read, Some(&read)), Ok(()));
        assert_eq!(check(Scope::Decide, Some(&decide)), Ok(()));
        assert_eq!(check(Scope::Read, Some(&decide)), Err(Refusal::WrongScope));
        assert_eq!(check(Scope::Decide, Some(&read)), Err(Refusal::WrongScope));
        assert_eq!(check(Scope::Read, None), Err(Refusal::Missing));
        for bad in [
            "Bearer read-token-012345678",
            "Bearer read-token-01234567890",
            "Basic cmVhZDp0b2tlbg==",
            "Bearer ",
            READ,
        ] {
            assert_eq!(
                check(Scope::Read, Some(bad)),
                Err(Refusal::Invalid),
                "{bad}"
            );
        }

        let only_read = Auth::new(vec![READ.into()], Vec::new());
        assert!(only_read.required(Scope::Read) && !only_read.required(Scope::Decide));
        assert_eq!(only_read.check(Scope::Decide, &headers(None)), Ok(()));
        let open = Auth::default();
        assert_eq!(open.check(Scope::Read, &headers(None)), Ok(()));
    }

    #[test]
    fn token_lists_parse_and_bad_entries_are_named_by_position() {
        assert_eq!(
            parse_tokens(&format!(" {READ} ,, {DECIDE}=, ")),
            Ok(vec![READ.to_string(), format!("{DECIDE}=")])
        );
        assert_eq!(parse_tokens(""), Ok(Vec::new()));
        assert_eq!(
            parse_tokens(&format!("{READ},short")).unwrap_err().position,
            2
        );
        let bad = parse_tokens("has space in it 0123456789").unwrap_err();
        assert_eq!(bad.position, 1);
        assert!(bad.reason.contains("character"));
        assert!(parse_tokens("=0123456789abcdefgh").is_err());
    }

    #[test]
    fn debug_shows_counts_never_tokens() {
        let auth = Auth::new(vec![READ.into()], vec![DECIDE.into(), READ.into()]);
        let shown = format!("{auth:?}");
        assert!(!shown.contains(READ) && !shown.contains(DECIDE), "{shown}");
        assert!(shown.contains("decide_tokens: 2"), "{shown}");
    }

    #[test]
    fn constant_time_eq_is_equality() {
        assert!(constant_time_eq(b"abc", b"abc"));
        assert!(!constant_time_eq(b"abc", b"abd"));
        assert!(!constant_time_eq(b"ab", b"abc"));
        assert!(!constant_time_eq(b"abcd", b"abc"));
        assert!(!constant_time_eq(b"", b"abc"));
    }
}
