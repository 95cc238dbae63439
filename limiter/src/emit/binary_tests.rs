//! The binary batch format through the limiter's mapping: the same
//! impressions as NDJSON lines or as binary entries give the same output,
//! tuple for tuple and dead letter for dead letter (reason and number).

use super::*;
use adspend_wire::batch::binary::BinaryBatch;
use proptest::prelude::*;

fn example_catalog() -> Catalog {
    Catalog::parse(
        "example",
        include_bytes!("../../../deploy/catalog.example.json"),
    )
    .unwrap()
}

/// An impression as an ad server means it, sometimes out of the contract.
type Event = (String, &'static str, u64, i64, Option<String>);

fn event() -> impl Strategy<Value = Event> {
    (
        prop_oneof![
            4 => "i-[0-9]{1,2}",
            2 => "[a-zA-Z0-9-]{1,64}",
            1 => "[a-z]{0,70}",
        ],
        prop_oneof![4 => Just("ad-1"), 4 => Just("ad-2"), 1 => Just("ad-9")],
        prop_oneof![4 => 0..=5_000_000u64, 1 => any::<u64>()],
        prop_oneof![
            4 => 1_600_000_000_000i64..1_900_000_000_000,
            1 => any::<i64>(),
        ],
        prop_oneof![
            2 => Just(None),
            2 => (1u64..4).prop_map(|n| Some(format!("lz1k.{n}.0"))),
            1 => "[a-z.0-9]{1,70}".prop_map(Some),
        ],
    )
}

type Summary = (
    u64,
    Vec<(Reason, u64)>,
    Vec<(&'static str, u32)>,
    Vec<(Vec<String>, Vec<SpendTuple>)>,
);

fn summary(payload: &[u8]) -> Summary {
    let mut out = Output::new(4).with_max_cost(5_000_000);
    out.add(
        &Input {
            stream_seq: 3,
            payload,
        },
        &example_catalog(),
    );
    let parts = out
        .partitions
        .iter()
        .chain(&out.leases)
        .map(|p| {
            let limits = p.limits.iter().map(|l| l.to_string()).collect();
            (limits, p.tuples.clone())
        })
        .collect();
    let letters = out
        .dead_letters
        .iter()
        .map(|d| (d.reason, d.line_no))
        .collect();
    (out.impressions, out.rejected, letters, parts)
}

proptest! {
    #[test]
    fn binary_and_ndjson_map_to_the_same_output(
        events in prop::collection::vec(event(), 0..150),
    ) {
        let mut lines = Vec::new();
        let mut batch = BinaryBatch::new();
        for (id, ad, cost, ts, lease) in &events {
            let mut line = serde_json::json!({"id": id, "ad_id": ad, "cost_micros": cost, "ts": ts});
            if let Some(lease) = lease {
                line["lease_id"] = lease.clone().into();
            }
            lines.push(line.to_string());
            batch.push(id, ad, *cost, *ts, lease.as_deref());
        }
        let ndjson = summary(lines.join("\n").as_bytes());
        let binary = summary(batch.as_bytes());
        prop_assert_eq!(binary, ndjson);
    }
}

#[test]
fn a_binary_entry_is_dead_lettered_with_its_bytes_and_number() {
    let mut batch = BinaryBatch::new();
    batch.push("i-1", "ad-1", 7, 1_700_000_000_000, None);
    batch.push("i-2", "nope", 7, 1_700_000_000_000, None);
    batch.push("", "ad-1", 7, 1_700_000_000_000, None);
    let mut payload = batch.into_bytes();
    payload.extend_from_slice(&[30, 1]);
    let mut out = Output::new(4);
    out.add(
        &Input {
            stream_seq: 9,
            payload: &payload,
        },
        &example_catalog(),
    );
    assert_eq!(out.impressions, 1);
    let letters: Vec<_> = out
        .dead_letters
        .iter()
        .map(|d| (d.reason, d.line_no, d.msg_id()))
        .collect();
    assert_eq!(
        letters,
        vec![
            ("unknown_ad", 1, "9-1".to_string()),
            ("id_too_long", 2, "9-2".to_string()),
            ("invalid_json", 3, "9-3".to_string()),
        ]
    );
    assert!(out.dead_letters[0].line.contains("nope"));
    assert!(out.dead_letters[2].detail.contains("binary entry 3"));
}
