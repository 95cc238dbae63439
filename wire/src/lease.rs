//! Spend leases on the wire: the lease ids the pacer hands out, and the key
//! the pipeline counts a lease's reported spend under.
//!
//! A lease id says when its lease expires and which grant made it:
//! `<expires_at_ms>.<ledger sequence>.<index>`, each in lower-case base 36
//! (for example `mgxk1f2a.1c.3`). The ledger sequence is the grant batch's
//! sequence in the pacers' shared ledger and the index its place in the
//! batch, so two grants never share an id, and the limiter and the
//! aggregator can read the expiry without asking anybody.
//!
//! The limiter books an impression that carries a well-formed lease id to
//! the limits above its ad as always, and once more to the lease's own key,
//! [`lease_key`]: the aggregator sums it like a limit (exactly once, through
//! any crash), and the pacer reads the sum as the spend reported under the
//! lease. An id that is not well formed is ignored: the impression is spend
//! like any other (CONTRACT.md).

/// What every lease key starts with; no catalog limit id may (the catalog
/// refuses one that does).
pub const LEASE_KEY_PREFIX: &str = "~lease/";

/// How long after its lease expires the pipeline keeps a lease's sum (the
/// aggregator deletes it then): longer than any grace a pacer waits for
/// late spend, and as long as the pacers' ledger keeps the grant.
pub const LEASE_RETENTION_MS: u64 = 3_600_000;

/// Longest lease id: its key must fit a limit id's 64 bytes.
pub(crate) const MAX_LEASE_ID_LEN: usize = crate::types::MAX_ID_LEN - LEASE_KEY_PREFIX.len();

/// The parts of a lease id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeaseId {
    pub expires_at_ms: i64,
    /// The grant batch's sequence in the ledger.
    pub seq: u64,
    /// The grant's place in its batch.
    pub index: u32,
}

impl LeaseId {
    /// The id as handed to ad servers.
    pub fn encode(&self) -> String {
        format!(
            "{}.{}.{}",
            base36(self.expires_at_ms.max(0) as u64),
            base36(self.seq),
            base36(u64::from(self.index))
        )
    }

    /// An id this format made, or `None` (any other string: not a lease id
    /// of ours).
    pub fn parse(id: &str) -> Option<LeaseId> {
        if id.is_empty() || id.len() > MAX_LEASE_ID_LEN {
            return None;
        }
        let mut parts = id.split('.');
        let expires_at_ms = i64::try_from(unbase36(parts.next()?)?).ok()?;
        let seq = unbase36(parts.next()?)?;
        let index = u32::try_from(unbase36(parts.next()?)?).ok()?;
        if parts.next().is_some() {
            return None;
        }
        let parsed = LeaseId {
            expires_at_ms,
            seq,
            index,
        };
        // One spelling per id: no leading zeros, so the key is unique too.
        (parsed.encode() == id).then_some(parsed)
    }

    /// The key the lease's reported spend is summed under.
    pub fn key(&self) -> String {
        format!("{LEASE_KEY_PREFIX}{}", self.encode())
    }
}

/// The key of lease id `id`, if it is one of ours.
pub fn lease_key(id: &str) -> Option<String> {
    LeaseId::parse(id).map(|lease| lease.key())
}

/// The lease a key sums the spend of, if it is a lease key.
pub fn lease_of_key(key: &str) -> Option<LeaseId> {
    key.strip_prefix(LEASE_KEY_PREFIX).and_then(LeaseId::parse)
}

fn base36(mut n: u64) -> String {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut out = [0u8; 13];
    let mut at = out.len();
    loop {
        at -= 1;
        out[at] = DIGITS[(n % 36) as usize];
        n /= 36;
        if n == 0 {
            break;
        }
    }
    String::from_utf8_lossy(&out[at..]).into_owned()
}

fn unbase36(s: &str) -> Option<u64> {
    if s.is_empty() || s.len() > 13 {
        return None;
    }
    s.bytes().try_fold(0u64, |n, b| {
        let digit = match b {
            b'0'..=b'9' => b - b'0',
            b'a'..=b'z' => b - b'a' + 10,
            _ => return None,
        };
        n.checked_mul(36)?.checked_add(u64::from(digit))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_id_reads_back_and_its_key_fits_a_limit_id() {
        let lease = LeaseId {
            expires_at_ms: 1_767_225_630_000,
            seq: 4_711,
            index: 99,
        };
        let id = lease.encode();
        assert_eq!(id, "mjuoif5c.3mv.2r");
        assert_eq!(LeaseId::parse(&id), Some(lease));
        assert_eq!(lease_key(&id).as_deref(), Some("~lease/mjuoif5c.3mv.2r"));
        assert_eq!(lease_of_key(&lease.key()), Some(lease));
        let widest = LeaseId {
            expires_at_ms: i64::MAX,
            seq: u64::MAX,
            index: u32::MAX,
        };
        assert!(widest.key().len() <= crate::types::MAX_ID_LEN);
        assert_eq!(LeaseId::parse(&widest.encode()), Some(widest));
    }

    #[test]
    fn strings_that_are_not_our_ids_are_refused() {
        for bad in [
            "",
            "abc",
            "a.b",
            "a.b.c.d",
            "A.b.c",
            "a..c",
            "0a.1.2",
            "a.01.2",
            "-1.1.1",
            "zzzzzzzzzzzzzz.1.1",
            "a.b.zzzzzzz",
            "a.b.c ",
            "ä.b.c",
        ] {
            assert_eq!(LeaseId::parse(bad), None, "{bad:?}");
        }
        assert_eq!(lease_of_key("campaign-1"), None);
        assert_eq!(lease_of_key("~lease/nope"), None);
    }

    proptest! {
        #[test]
        fn every_id_reads_back(expires in 0i64..i64::MAX, seq: u64, index: u32) {
            let lease = LeaseId { expires_at_ms: expires, seq, index };
            prop_assert_eq!(LeaseId::parse(&lease.encode()), Some(lease));
        }

        #[test]
        fn parsing_any_string_is_total(s in "\\PC{0,70}") {
            if let Some(lease) = LeaseId::parse(&s) {
                prop_assert_eq!(lease.encode(), s);
            }
        }
    }
}
