//! Fault campaigns. `local` injects one fault per round into a pipeline of
//! processes on this machine (`adchaos`); `cluster` drives the
//! docker-compose cluster (deploy/docker-compose.yml): the driver the
//! cluster tests use, and the random campaign `adclusterchaos` runs.

pub mod cluster;
pub mod local;
