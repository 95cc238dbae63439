//! `ADSPEND_AGGREGATOR_ACCEPT_LOSS` parsed: which shards may be rebuilt at a
//! loss, each only at the checkpoint named.

/// The shards an operator allowed to be rebuilt at a loss
/// ([`Config::accept_loss`]): each one only at the checkpoint named.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct AcceptLoss(Vec<(String, u64)>);

impl AcceptLoss {
    /// `<shard>@<checkpoint id>`, comma-separated; empty: none.
    pub(crate) fn parse(value: &str) -> Result<Self, String> {
        let mut accepted = Vec::new();
        for item in value.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (shard, id) = item
                .split_once('@')
                .ok_or_else(|| format!("{item:?}: expected <shard>@<checkpoint id>, e.g. p3@17"))?;
            let valid_shard = !shard.is_empty()
                && shard.len() <= 64
                && shard
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
            if !valid_shard {
                return Err(format!(
                    "{item:?}: the shard is \"all\", \"p<partition>\" or a fixed list's \"p1-3\""
                ));
            }
            let id: u64 = id
                .parse()
                .map_err(|e| format!("{item:?}: the checkpoint id: {e}"))?;
            accepted.push((shard.to_string(), id));
        }
        Ok(AcceptLoss(accepted))
    }

    /// Whether the loss of `shard`'s checkpoint `checkpoint_id` is accepted.
    pub(crate) fn covers(&self, shard: &str, checkpoint_id: u64) -> bool {
        self.0
            .iter()
            .any(|(s, id)| s == shard && *id == checkpoint_id)
    }
}
