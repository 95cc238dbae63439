//! `ADSPEND_AGGREGATOR_PARTITIONS` parsed: the partitions this aggregator
//! applies, and the shard name that follows from them.

/// Which partitions this aggregator applies.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Ownership {
    /// All partitions, as one shard.
    All,
    /// A fixed list, as one shard.
    Fixed(Vec<u32>),
    /// Assigned through etcd among the live aggregators, this one joining
    /// as `member_id`; each partition is a shard of its own.
    Cluster { member_id: String },
}

impl Ownership {
    /// The shard name of a single-shard aggregator: the unit of ownership,
    /// checkpoints and pushes.
    pub(crate) fn shard(&self) -> String {
        match self {
            Ownership::Fixed(list) => format!(
                "p{}",
                list.iter()
                    .map(u32::to_string)
                    .collect::<Vec<_>>()
                    .join("-")
            ),
            Ownership::All | Ownership::Cluster { .. } => "all".to_string(),
        }
    }
}
