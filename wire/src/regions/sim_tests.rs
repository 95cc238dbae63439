//! A simulated deployment of 2 to 4 regions, each with its own ledger and
//! pacer figures, under random grants, gifts and report deliveries that the
//! network drops, duplicates, reorders, delays, replays and cuts; the
//! properties of the module docs are checked after every step.

use std::collections::BTreeSet;

use proptest::prelude::*;

use super::*;
use crate::types::Micros;

const DAY: i64 = 86_400_000;

#[derive(Clone, Debug)]
enum Op {
    /// A grant at once counted as spend, within room.
    Spend {
        r: usize,
        micros: Micros,
    },
    /// A lease granted within room.
    Lease {
        r: usize,
        micros: Micros,
    },
    /// Reported spend covers part of the leases.
    Settle {
        r: usize,
        micros: Micros,
    },
    /// Leases expire unused.
    Release {
        r: usize,
        micros: Micros,
    },
    /// The region plans its gifts and gives them.
    Gifts {
        r: usize,
        reserve_permille: u16,
    },
    /// A gift asked for directly, possibly more than the room, to itself.
    Give {
        r: usize,
        to: usize,
        micros: Micros,
    },
    /// The region reports to every other one it is not cut from.
    Publish {
        r: usize,
    },
    /// One message in flight arrives; `twice`: and again at once.
    Deliver {
        pick: usize,
        twice: bool,
    },
    Drop {
        pick: usize,
    },
    /// An old report of `from`, taken from everything it ever sent,
    /// reaches `to` (the region itself: a restart reading back its own).
    Replay {
        from: usize,
        to: usize,
        pick: usize,
    },
    /// Every link between the region and the others is cut; what is in
    /// flight from or to it is lost.
    Cut {
        r: usize,
    },
    Heal,
    /// The region's pacer crosses into the next day.
    NextDay {
        r: usize,
    },
    /// A catalog edit every region applies at once.
    RaiseBudget {
        micros: Micros,
    },
    /// Links healed, every region on the latest day, and every region's
    /// latest report delivered to every other, twice over.
    Quiesce,
}

fn arb_op() -> impl Strategy<Value = Op> {
    let r = 0..4usize;
    let m = 0..1_500u64;
    prop_oneof![
        4 => (r.clone(), m.clone()).prop_map(|(r, micros)| Op::Spend { r, micros }),
        3 => (r.clone(), m.clone()).prop_map(|(r, micros)| Op::Lease { r, micros }),
        2 => (r.clone(), m.clone()).prop_map(|(r, micros)| Op::Settle { r, micros }),
        2 => (r.clone(), m.clone()).prop_map(|(r, micros)| Op::Release { r, micros }),
        6 => (r.clone(), 0..=1100u16).prop_map(|(r, reserve_permille)| Op::Gifts { r, reserve_permille }),
        2 => (r.clone(), r.clone(), m).prop_map(|(r, to, micros)| Op::Give { r, to, micros }),
        5 => r.clone().prop_map(|r| Op::Publish { r }),
        8 => (any::<usize>(), any::<bool>()).prop_map(|(pick, twice)| Op::Deliver { pick, twice }),
        2 => any::<usize>().prop_map(|pick| Op::Drop { pick }),
        3 => (r.clone(), r.clone(), any::<usize>()).prop_map(|(from, to, pick)| Op::Replay { from, to, pick }),
        1 => r.clone().prop_map(|r| Op::Cut { r }),
        1 => Just(Op::Heal),
        1 => r.prop_map(|r| Op::NextDay { r }),
        1 => (0..500u64).prop_map(|micros| Op::RaiseBudget { micros }),
        1 => Just(Op::Quiesce),
    ]
}

/// One region: its ledger and what its pacers have granted in its period.
struct Site {
    ledger: LimitLedger,
    spend: Micros,
    leased: Micros,
    want: Micros,
    seq: u64,
}

struct World {
    budget: Micros,
    sites: Vec<Site>,
    /// (to, report) in flight, in no particular order.
    in_flight: Vec<(usize, RegionReport)>,
    /// Every report each region sent.
    sent: Vec<Vec<RegionReport>>,
    cut: Vec<bool>,
    /// Highest seq each region merged from each other one.
    merged: Vec<Vec<Option<u64>>>,
}

fn region(i: usize) -> RegionName {
    RegionName::new(format!("r{i}")).unwrap()
}

impl World {
    fn new(n: usize, budget: Micros) -> World {
        let names: BTreeSet<RegionName> = (0..n).map(region).collect();
        let sites = (0..n)
            .map(|i| Site {
                ledger: LimitLedger::new("c1", region(i), names.clone(), budget, 0).unwrap(),
                spend: 0,
                leased: 0,
                want: 0,
                seq: 0,
            })
            .collect();
        World {
            budget,
            sites,
            in_flight: Vec::new(),
            sent: vec![Vec::new(); n],
            cut: vec![false; n],
            merged: vec![vec![None; n]; n],
        }
    }

    fn n(&self) -> usize {
        self.sites.len()
    }

    /// A grant of up to `micros` within room; the rest is unmet demand.
    fn grant(&mut self, r: usize, micros: Micros) -> Micros {
        let site = &mut self.sites[r];
        let granted = micros.min(site.ledger.room(site.spend, site.leased));
        site.want = micros - granted;
        granted
    }

    fn give(&mut self, r: usize, to: &RegionName, micros: Micros) -> Result<(), TestCaseError> {
        let site = &mut self.sites[r];
        let room = site.ledger.room(site.spend, site.leased);
        let given = site.ledger.give(to, micros, site.spend, site.leased);
        prop_assert!(given <= micros.min(room));
        // (c) a give never takes the allotment below what is granted.
        prop_assert!(site.ledger.allotment() >= site.spend + site.leased);
        Ok(())
    }

    fn publish(&mut self, r: usize) {
        let site = &mut self.sites[r];
        site.seq += 1;
        let entry = site
            .ledger
            .entry(site.spend, site.spend, site.leased, site.want);
        let report = RegionReport::new(region(r), site.seq, 0, vec![entry]);
        // Every report goes through the wire format.
        let report = RegionReport::decode(&report.encode()).unwrap();
        self.sent[r].push(report.clone());
        if self.cut[r] {
            return;
        }
        for to in (0..self.n()).filter(|&to| to != r && !self.cut[to]) {
            self.in_flight.push((to, report.clone()));
        }
    }

    fn deliver(&mut self, to: usize, report: &RegionReport) -> Result<(), TestCaseError> {
        let from: usize = report.region.as_str()[1..].parse().unwrap();
        let site = &mut self.sites[to];
        let before = site.ledger.clone();
        let merged = site.ledger.merge(report.origin(), &report.limits[0]);
        // (b) what was merged already, or older than it, changes nothing;
        // nor does a region's own report read back.
        if from == to || self.merged[to][from].is_some_and(|seq| seq >= report.seq) {
            prop_assert_eq!(
                &site.ledger,
                &before,
                "{:?} from r{} at r{}",
                merged,
                from,
                to
            );
        }
        if merged == Merged::NewPeriod {
            // Its pacer follows into the new day: nothing granted in it yet.
            site.spend = 0;
            site.leased = 0;
            site.want = 0;
        }
        let seen = &mut self.merged[to][from];
        *seen = (*seen).max(Some(report.seq));
        Ok(())
    }

    fn quiesce(&mut self) -> Result<(), TestCaseError> {
        self.cut.fill(false);
        let latest = self
            .sites
            .iter()
            .map(|s| s.ledger.period_start_ms())
            .max()
            .unwrap();
        for site in &mut self.sites {
            if site.ledger.roll_to(latest) {
                site.spend = 0;
                site.leased = 0;
                site.want = 0;
            }
        }
        for _ in 0..2 {
            for r in 0..self.n() {
                self.publish(r);
            }
            for (to, report) in std::mem::take(&mut self.in_flight) {
                self.deliver(to, &report)?;
            }
        }
        // (a) once quiet, the allotments add up to the budget exactly, and
        // every region's view of every other is that region's own.
        let total: u128 = self
            .sites
            .iter()
            .map(|s| u128::from(s.ledger.allotment()))
            .sum();
        prop_assert_eq!(total, u128::from(self.budget));
        for viewer in &self.sites {
            for seen in &self.sites {
                prop_assert_eq!(
                    viewer.ledger.allotment_of(seen.ledger.region()),
                    seen.ledger.allotment()
                );
            }
        }
        Ok(())
    }

    fn apply(&mut self, op: Op) -> Result<(), TestCaseError> {
        let n = self.n();
        match op {
            Op::Spend { r, micros } => {
                let granted = self.grant(r % n, micros);
                self.sites[r % n].spend += granted;
            }
            Op::Lease { r, micros } => {
                let granted = self.grant(r % n, micros);
                self.sites[r % n].leased += granted;
            }
            Op::Settle { r, micros } => {
                let site = &mut self.sites[r % n];
                let covered = micros.min(site.leased);
                site.leased -= covered;
                site.spend += covered;
            }
            Op::Release { r, micros } => {
                let site = &mut self.sites[r % n];
                site.leased -= micros.min(site.leased);
            }
            Op::Gifts {
                r,
                reserve_permille,
            } => {
                let site = &self.sites[r % n];
                let plan =
                    site.ledger
                        .plan_gifts(site.spend, site.leased, site.want, reserve_permille);
                let planned: u128 = plan.iter().map(|g| u128::from(g.1)).sum();
                prop_assert!(planned <= u128::from(site.ledger.room(site.spend, site.leased)));
                for (to, micros) in plan {
                    prop_assert!(micros > 0 && to != region(r % n));
                    self.give(r % n, &to, micros)?;
                }
            }
            Op::Give { r, to, micros } => self.give(r % n, &region(to % n), micros)?,
            Op::Publish { r } => self.publish(r % n),
            Op::Deliver { pick, twice } => {
                if self.in_flight.is_empty() {
                    return Ok(());
                }
                let (to, report) = self.in_flight.swap_remove(pick % self.in_flight.len());
                if self.cut[to] || self.cut[report.region.as_str()[1..].parse::<usize>().unwrap()] {
                    return Ok(());
                }
                self.deliver(to, &report)?;
                if twice {
                    self.deliver(to, &report)?;
                }
            }
            Op::Drop { pick } => {
                if !self.in_flight.is_empty() {
                    self.in_flight.swap_remove(pick % self.in_flight.len());
                }
            }
            Op::Replay { from, to, pick } => {
                let (from, to) = (from % n, to % n);
                if self.sent[from].is_empty() || self.cut[from] || self.cut[to] {
                    return Ok(());
                }
                let report = self.sent[from][pick % self.sent[from].len()].clone();
                self.deliver(to, &report)?;
            }
            Op::Cut { r } => {
                let r = r % n;
                self.cut[r] = true;
                let gone = |&(to, ref report): &(usize, RegionReport)| {
                    to == r || report.region == region(r)
                };
                self.in_flight.retain(|m| !gone(m));
            }
            Op::Heal => self.cut.fill(false),
            Op::NextDay { r } => {
                let site = &mut self.sites[r % n];
                let next = site.ledger.period_start_ms() + DAY;
                prop_assert!(site.ledger.roll_to(next));
                site.spend = 0;
                site.leased = 0;
                site.want = 0;
            }
            Op::RaiseBudget { micros } => {
                self.budget += micros;
                for site in &mut self.sites {
                    site.ledger.set_budget(self.budget);
                }
            }
            Op::Quiesce => self.quiesce()?,
        }
        Ok(())
    }

    /// (a) and (d), per day: the regions on one day hold at most the budget
    /// between them and have granted at most that; and none has granted
    /// past its own allotment.
    fn check(&self) -> Result<(), TestCaseError> {
        let days: BTreeSet<i64> = self
            .sites
            .iter()
            .map(|s| s.ledger.period_start_ms())
            .collect();
        for day in days {
            let on_day = || {
                self.sites
                    .iter()
                    .filter(move |s| s.ledger.period_start_ms() == day)
            };
            let allotted: u128 = on_day().map(|s| u128::from(s.ledger.allotment())).sum();
            prop_assert!(
                allotted <= u128::from(self.budget),
                "allotted {} > {}",
                allotted,
                self.budget
            );
            let granted: u128 = on_day().map(|s| u128::from(s.spend + s.leased)).sum();
            prop_assert!(
                granted <= u128::from(self.budget),
                "granted {} > {}",
                granted,
                self.budget
            );
        }
        for site in &self.sites {
            prop_assert!(site.spend + site.leased <= site.ledger.allotment());
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(128))]

    #[test]
    fn the_budget_is_conserved_across_regions_whatever_the_network_does(
        n in 2..=4usize,
        budget in prop_oneof![0..8u64, 0..5_000u64],
        ops in prop::collection::vec(arb_op(), 1..120),
    ) {
        let mut world = World::new(n, budget);
        for op in ops {
            world.apply(op)?;
            world.check()?;
        }
        world.quiesce()?;
        world.check()?;
    }
}
