//! One generated set of impressions that every contender in a benchmark run
//! consumes: NDJSON messages in memory plus the truth they must sum to.

use std::sync::Arc;

use bytes::{Bytes, BytesMut};

use adspend_sim::event::{Batch, Generator, GeneratorConfig};
use adspend_sim::truth::CatalogIndex;
use adspend_sim::InputFormat;
use adspend_sim::{
    generate_catalog, Catalog, CatalogSpec, CostDistribution, EventTime, Stats, Truth, TruthBuilder,
};
use adspend_wire::batch::binary::BinaryBatch;

#[derive(Debug, Clone)]
pub struct WorkloadSpec {
    /// Ads in the generated catalog (limits follow from `CatalogSpec::for_ads`).
    pub ads: u32,
    /// Events in all, duplicates included.
    pub events: u64,
    /// Events per NDJSON message.
    pub batch: usize,
    /// Share of events that re-send an earlier impression.
    pub duplicate_rate: f64,
    pub seed: u64,
}

pub struct Workload {
    pub spec: WorkloadSpec,
    pub catalog: Catalog,
    /// NDJSON payloads, `spec.batch` events each (the last may hold fewer).
    pub messages: Vec<Bytes>,
    pub events: u64,
    /// Distinct impressions: what every contender must count.
    pub unique_events: u64,
    /// Spend tuples the unique impressions make (one per limit of the ad).
    pub unique_tuples: u64,
    pub truth: Truth,
}

impl Workload {
    /// Generates the events with the simulator's generator; event times are
    /// "now" at generation, so every daily bucket is today's.
    pub fn generate(spec: &WorkloadSpec) -> anyhow::Result<Workload> {
        let catalog = generate_catalog(&CatalogSpec::for_ads(spec.ads), spec.seed)?;
        Workload::generate_for(catalog, spec)
    }

    /// [`Workload::generate`] over a given catalog (`spec.ads` unused); the
    /// seed also names the impressions, so workloads of different seeds
    /// never share an impression id.
    pub fn generate_for(catalog: Catalog, spec: &WorkloadSpec) -> anyhow::Result<Workload> {
        anyhow::ensure!(spec.batch > 0, "batch must be at least 1");
        let index = Arc::new(CatalogIndex::new(&catalog)?);
        let run_id = format!("w{}", spec.seed);
        let mut generator = Generator::new(
            index.clone(),
            GeneratorConfig {
                seed: spec.seed,
                zipf_exponent: 1.0,
                cost: CostDistribution::Uniform {
                    min: 100,
                    max: 5_000_000,
                },
                duplicate_rate: spec.duplicate_rate,
                bad_rate: 0.0,
                bad_kinds: Vec::new(),
                event_time: EventTime::Now,
            },
            &run_id,
        )
        .map_err(anyhow::Error::msg)?;
        let mut truth = TruthBuilder::from_index(index.clone());
        let mut messages = Vec::with_capacity((spec.events / spec.batch as u64 + 1) as usize);
        let mut buffer = BytesMut::new();
        let mut batch = Batch::default();
        let mut unique_tuples = 0u64;
        let now = chrono::Utc::now().timestamp_millis();
        let mut left = spec.events;
        while left > 0 {
            let events = (spec.batch as u64).min(left) as usize;
            if buffer.capacity() < events * 160 {
                buffer.reserve((events * 160).max(8 << 20));
            }
            batch.clear();
            generator.write_message(events, now, &mut buffer, &mut batch);
            for event in &batch.good {
                if truth.record_seq(event.seq, event.ad, event.cost, event.ts)? {
                    unique_tuples += index.limits_of(event.ad) as u64;
                }
            }
            messages.push(buffer.split().freeze());
            left -= events as u64;
        }
        let unique_events = truth.unique_events();
        let stats = Stats {
            run_id,
            seed: spec.seed,
            messages_published: messages.len() as u64,
            messages_acked: messages.len() as u64,
            events_sent: spec.events,
            events_acked: spec.events,
            ..Stats::default()
        };
        Ok(Workload {
            spec: spec.clone(),
            catalog,
            messages,
            events: spec.events,
            unique_events,
            unique_tuples,
            truth: truth.finish(stats),
        })
    }

    /// Every event on its own, in order (for contenders that take one event
    /// per message).
    pub fn events(&self) -> impl Iterator<Item = Bytes> + '_ {
        self.messages.iter().flat_map(|message| {
            let mut lines = Vec::new();
            let mut start = 0;
            for (i, &b) in message.iter().enumerate() {
                if b == b'\n' {
                    lines.push(message.slice(start..i));
                    start = i + 1;
                }
            }
            lines.push(message.slice(start..));
            lines
        })
    }

    /// The messages in `format`: as generated (NDJSON), or each one's
    /// impressions in a binary batch of its own, in the same order.
    pub fn messages_in(&self, format: InputFormat) -> Vec<Bytes> {
        if format == InputFormat::Ndjson {
            return self.messages.clone();
        }
        self.messages
            .iter()
            .map(|message| {
                let mut batch = BinaryBatch::with_capacity(message.len() / 2);
                for entry in adspend_wire::batch::entries(message) {
                    let i = entry
                        .parsed
                        .expect("a workload holds good impressions only");
                    batch.push(
                        &i.id,
                        &i.ad_id,
                        i.cost_micros,
                        i.ts_ms,
                        i.lease_id.as_deref(),
                    );
                }
                Bytes::from(batch.into_bytes())
            })
            .collect()
    }

    pub fn bytes(&self) -> usize {
        self.messages.iter().map(Bytes::len).sum()
    }
}
