//! The docker-compose cluster under test (deploy/docker-compose.yml).
//!
//! `compose` drives the project: it starts it through `scripts/cluster.sh
//! start` (images built beforehand by `scripts/cluster.sh images`; the CA,
//! certificates and passwords generated into deploy/.secrets), injects
//! faults with `docker` (kill, pause, network disconnect, stop, scale),
//! reports each container's state from `docker inspect` so a test can prove
//! its fault happened, reads etcd with `etcdctl` inside an etcd container,
//! and on drop dumps the services' last log lines (after a failure) and
//! removes containers, networks and volumes. `observe` reads the pacer
//! (`/v1/shards`, limits) and the aggregators' metrics, watches that nothing
//! moves backwards, and times takeovers. `traffic` publishes with the
//! simulator while faults happen and settles the result against the ground
//! truth. `failover` is the kill-then-pause run an operator tries first,
//! and `timeline` reads from the services' logs where a failover's seconds
//! go.

pub mod chaos;
mod compose;
pub mod failover;
mod observe;
pub mod timeline;
mod traffic;

pub use compose::{
    metric_sum, metric_value, nats_args, pacer, pacer_client, Cluster, ContainerState, PacerAccess,
    AGGREGATORS, PROJECT, SECRETS_DIR,
};
pub use observe::{shards, wait_applied, Backwards, Monotonic, Shard, Takeover, PARTITIONS};
pub use traffic::{connect_as, settle_exact, Traffic, NATS_URL};
