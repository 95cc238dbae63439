//! What the pacer hears over NATS: the aggregators' sums pushes, folded
//! into the spend state ([`ingest`]), and the limiters' per-source reports,
//! kept for `/v1/sources` and the input lag ([`sources`]).

pub(crate) mod ingest;
pub(crate) mod sources;
