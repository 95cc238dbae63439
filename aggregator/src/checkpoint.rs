//! Durability: checkpoints and the restores they allow.
//!
//! On a marker, [`checkpointer`] copies the store (a base, or a [`delta`]
//! of what changed since the last checkpoint), uploads it to
//! [`snapshot_store`](crate::snapshot_store) and records it in etcd through [`record`], fenced by
//! the owner epoch. A starting shard [`restore`]s from the local LMDB or
//! the recorded snapshot and its deltas; [`missing`] handles a recorded
//! snapshot that is gone; [`trim`] keeps `SPEND` back to the oldest kept
//! base.

pub mod checkpointer;
pub(crate) mod delta;
pub(crate) mod missing;
pub mod record;
pub mod restore;
pub mod trim;
