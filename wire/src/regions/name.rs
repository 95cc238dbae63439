//! [`RegionName`]: the name a region goes by (`ADSPEND_REGION`), checked
//! once where it enters, so the ledger and the reports never hold a bad one.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// Longest region name, in bytes (CONTRACT.md, "Regions").
pub const MAX_REGION_NAME_LEN: usize = 32;

/// A region's name: 1..=[`MAX_REGION_NAME_LEN`] bytes of `[a-z0-9-]`.
/// Ordered as strings; that order decides who gets the remainder of an
/// uneven split ([`super::initial_share`]).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct RegionName(String);

/// Why a string is not a region name, or a set of names not a deployment's
/// regions. The text names the rule broken.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RegionError {
    #[error("region name is empty; it must be 1..=32 bytes of [a-z0-9-]")]
    Empty,
    #[error("region name is {len} bytes long; it must be 1..=32 bytes of [a-z0-9-]")]
    TooLong { len: usize },
    #[error("region name {name:?} has {found:?} at byte {at}; only [a-z0-9-] is allowed")]
    BadChar {
        name: String,
        found: char,
        at: usize,
    },
    #[error("{count} regions; a deployment has at most {max}")]
    TooMany { count: usize, max: usize },
}

impl RegionName {
    pub fn new(name: impl Into<String>) -> Result<RegionName, RegionError> {
        let name = name.into();
        if name.is_empty() {
            return Err(RegionError::Empty);
        }
        if name.len() > MAX_REGION_NAME_LEN {
            return Err(RegionError::TooLong { len: name.len() });
        }
        let bad = name
            .char_indices()
            .find(|(_, c)| !matches!(c, 'a'..='z' | '0'..='9' | '-'));
        if let Some((at, found)) = bad {
            return Err(RegionError::BadChar { name, found, at });
        }
        Ok(RegionName(name))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for RegionName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl FromStr for RegionName {
    type Err = RegionError;

    fn from_str(s: &str) -> Result<RegionName, RegionError> {
        RegionName::new(s)
    }
}

impl TryFrom<String> for RegionName {
    type Error = RegionError;

    fn try_from(s: String) -> Result<RegionName, RegionError> {
        RegionName::new(s)
    }
}

impl From<RegionName> for String {
    fn from(name: RegionName) -> String {
        name.0
    }
}

impl AsRef<str> for RegionName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_contract_alphabet_up_to_32_bytes() {
        for good in ["east", "a", "eu-west-1", "0", "-", &"z".repeat(32)] {
            let name = RegionName::new(good).unwrap();
            assert_eq!(name.as_str(), good);
            assert_eq!(name.to_string(), good);
            assert_eq!(good.parse::<RegionName>().unwrap(), name);
        }
    }

    #[test]
    fn refuses_with_the_rule_broken() {
        assert_eq!(RegionName::new(""), Err(RegionError::Empty));
        assert_eq!(
            RegionName::new("a".repeat(33)),
            Err(RegionError::TooLong { len: 33 })
        );
        let err = RegionName::new("East").unwrap_err();
        assert_eq!(
            err,
            RegionError::BadChar {
                name: "East".into(),
                found: 'E',
                at: 0
            }
        );
        assert!(err.to_string().contains("[a-z0-9-]"), "{err}");
        for bad in ["us_east", "a b", "west.1", "süd", "a/b"] {
            assert!(RegionName::new(bad).is_err(), "{bad}");
        }
        // 32 bytes but not 32 characters: the bound is on bytes.
        assert!(RegionName::new("é".repeat(16)).is_err());
    }

    #[test]
    fn serde_is_a_plain_string_and_validates() {
        let name = RegionName::new("south").unwrap();
        assert_eq!(serde_json::to_string(&name).unwrap(), r#""south""#);
        assert_eq!(
            serde_json::from_str::<RegionName>(r#""south""#).unwrap(),
            name
        );
        let err = serde_json::from_str::<RegionName>(r#""So uth""#).unwrap_err();
        assert!(err.to_string().contains("only [a-z0-9-]"), "{err}");
        assert!(serde_json::from_str::<RegionName>(r#""""#).is_err());
    }
}
