//! The faults a campaign draws: what to do to which container, for how
//! long, and under which name it is counted.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::Rng;

/// One thing done to one container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Action {
    /// `docker kill`; healed by starting the container again.
    Kill(String),
    /// `docker pause`; healed by `docker unpause`.
    Pause(String),
    /// `docker restart` (SIGTERM first): nothing left to heal.
    Restart(String),
    /// `docker network disconnect` from `control` (etcd) or `data` (NATS,
    /// S3); healed by connecting it again.
    Cut(String, &'static str),
    /// Start aggregator4 (scale up to four).
    ScaleUp,
    /// Stop aggregator4 by SIGTERM (scale down: a handover).
    ScaleDown,
}

impl Action {
    pub(super) fn target(&self) -> &str {
        match self {
            Action::Kill(s) | Action::Pause(s) | Action::Restart(s) | Action::Cut(s, _) => s,
            Action::ScaleUp | Action::ScaleDown => SCALED,
        }
    }

    pub(super) fn describe(&self) -> String {
        match self {
            Action::Kill(s) => format!("docker kill {s}"),
            Action::Pause(s) => format!("docker pause {s}"),
            Action::Restart(s) => format!("docker restart {s}"),
            Action::Cut(s, net) => format!("disconnect {s} from {net}"),
            Action::ScaleUp => format!("scale up: start {SCALED}"),
            Action::ScaleDown => format!("scale down: SIGTERM {SCALED}"),
        }
    }
}

/// The aggregator that scaling adds and removes.
pub(super) const SCALED: &str = "aggregator4";

/// Which container a template aims at; leaders are looked up when drawn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Target {
    Aggregator,
    Limiter,
    Pacer,
    Nats,
    NatsMetaLeader,
    NatsStreamLeader(&'static str),
    Etcd,
    EtcdLeader,
    S3,
}

impl Target {
    pub(super) fn label(self) -> String {
        match self {
            Target::Aggregator => "aggregator".into(),
            Target::Limiter => "limiter".into(),
            Target::Pacer => "pacer".into(),
            Target::Nats => "nats node".into(),
            Target::NatsMetaLeader => "nats meta leader".into(),
            Target::NatsStreamLeader(s) => format!("nats {s} leader"),
            Target::Etcd => "etcd node".into(),
            Target::EtcdLeader => "etcd leader".into(),
            Target::S3 => "s3".into(),
        }
    }
}

/// What is done, before the targets are resolved to containers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Verb {
    Kill,
    Pause,
    Restart,
    CutControl,
    CutData,
}

impl Verb {
    fn label(self) -> &'static str {
        match self {
            Verb::Kill => "kill",
            Verb::Pause => "pause",
            Verb::Restart => "restart",
            Verb::CutControl => "cut from etcd",
            Verb::CutData => "cut from data",
        }
    }
}

/// One fault as drawn: one or two (verb, target) pairs, or a scaling step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Template {
    One(Verb, Target),
    Two(Hit, Hit),
    ScaleUp,
    ScaleDown,
}

impl Template {
    /// The kind a report counts it under, e.g. `kill etcd leader`.
    pub(super) fn kind(&self) -> String {
        match self {
            Template::One(v, t) => format!("{} {}", v.label(), t.label()),
            Template::Two((v1, t1), (v2, t2)) => {
                format!(
                    "{} {} + {} {}",
                    v1.label(),
                    t1.label(),
                    v2.label(),
                    t2.label()
                )
            }
            Template::ScaleUp => "scale up".into(),
            Template::ScaleDown => "scale down (SIGTERM)".into(),
        }
    }
}

/// Every single fault with its weight in the draw. Kills and cuts of the
/// aggregators and the control plane come most often: they move partitions.
const SINGLE: &[(Verb, Target, u32)] = &[
    (Verb::Kill, Target::Aggregator, 8),
    (Verb::Pause, Target::Aggregator, 5),
    (Verb::Restart, Target::Aggregator, 4),
    (Verb::CutControl, Target::Aggregator, 4),
    (Verb::CutData, Target::Aggregator, 3),
    (Verb::Kill, Target::Limiter, 3),
    (Verb::Pause, Target::Limiter, 2),
    (Verb::Restart, Target::Limiter, 2),
    (Verb::CutData, Target::Limiter, 2),
    (Verb::Kill, Target::Pacer, 2),
    (Verb::Restart, Target::Pacer, 2),
    (Verb::CutData, Target::Pacer, 1),
    (Verb::Kill, Target::Nats, 3),
    (Verb::Kill, Target::NatsMetaLeader, 3),
    (Verb::Kill, Target::NatsStreamLeader("IMPRESSIONS"), 3),
    (Verb::Kill, Target::NatsStreamLeader("SPEND"), 3),
    (Verb::Pause, Target::Nats, 2),
    (Verb::Restart, Target::Nats, 2),
    (Verb::CutData, Target::Nats, 2),
    (Verb::Kill, Target::Etcd, 3),
    (Verb::Kill, Target::EtcdLeader, 5),
    (Verb::Pause, Target::EtcdLeader, 3),
    (Verb::Restart, Target::Etcd, 2),
    (Verb::CutControl, Target::Etcd, 2),
    (Verb::Kill, Target::S3, 2),
    (Verb::Restart, Target::S3, 2),
    (Verb::Pause, Target::S3, 1),
];

/// Two at once: the control plane's leader with an aggregator, a stream
/// leader with an aggregator, the object store with an aggregator.
/// One fault of a pair: what is done to which kind of container.
type Hit = (Verb, Target);

const DOUBLE: &[(Hit, Hit, u32)] = &[
    (
        (Verb::Kill, Target::EtcdLeader),
        (Verb::Kill, Target::Aggregator),
        3,
    ),
    (
        (Verb::Kill, Target::NatsStreamLeader("SPEND")),
        (Verb::Kill, Target::Aggregator),
        2,
    ),
    (
        (Verb::Restart, Target::S3),
        (Verb::Kill, Target::Aggregator),
        2,
    ),
    (
        (Verb::Pause, Target::EtcdLeader),
        (Verb::CutData, Target::Limiter),
        1,
    ),
];

const SCALE_WEIGHT: u32 = 3;

/// Draws the next fault. `scaled_up` says whether aggregator4 runs now: a
/// scaling step goes the other way.
pub(super) fn draw(rng: &mut StdRng, scaled_up: bool) -> Template {
    let single: u32 = SINGLE.iter().map(|s| s.2).sum();
    let double: u32 = DOUBLE.iter().map(|d| d.2).sum();
    let mut pick = rng.random_range(0..single + double + SCALE_WEIGHT);
    for (verb, target, weight) in SINGLE {
        if pick < *weight {
            return Template::One(*verb, *target);
        }
        pick -= weight;
    }
    for (first, second, weight) in DOUBLE {
        if pick < *weight {
            return Template::Two(*first, *second);
        }
        pick -= weight;
    }
    if scaled_up {
        Template::ScaleDown
    } else {
        Template::ScaleUp
    }
}

/// How long a fault stays before it is healed. Anything that should cost
/// an aggregator its lease stays well past the TTL, so a failover (not a
/// pause) is what gets measured.
pub(super) fn hold(rng: &mut StdRng, verb: Verb, target: Target, ttl: Duration) -> Duration {
    let mut ms = |lo: u64, hi: u64| Duration::from_millis(rng.random_range(lo..=hi));
    match (verb, target) {
        (Verb::Restart, _) => Duration::ZERO,
        (Verb::Kill, Target::Aggregator) => ttl * 2 + ms(2_000, 5_000),
        (Verb::Pause | Verb::CutControl, Target::Aggregator) => ttl + ms(1_000, 5_000),
        (_, Target::Etcd | Target::EtcdLeader) => ms(2_000, 10_000),
        (_, Target::Nats | Target::NatsMetaLeader | Target::NatsStreamLeader(_)) => {
            ms(2_000, 10_000)
        }
        _ => ms(1_000, 6_000),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn the_draw_is_reproducible_and_reaches_every_kind() {
        let kinds = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            (0..2_000)
                .map(|i| draw(&mut rng, i % 2 == 0).kind())
                .collect::<Vec<_>>()
        };
        assert_eq!(kinds(7), kinds(7));
        assert_ne!(kinds(7), kinds(8));
        let seen: std::collections::BTreeSet<String> = kinds(7).into_iter().collect();
        assert_eq!(seen.len(), SINGLE.len() + DOUBLE.len() + 2, "{seen:?}");
    }

    #[test]
    fn aggregator_kills_are_held_past_two_ttls() {
        let mut rng = StdRng::seed_from_u64(1);
        let ttl = Duration::from_secs(5);
        for _ in 0..100 {
            assert!(hold(&mut rng, Verb::Kill, Target::Aggregator, ttl) > ttl * 2);
            assert_eq!(
                hold(&mut rng, Verb::Restart, Target::Nats, ttl),
                Duration::ZERO
            );
        }
    }
}
