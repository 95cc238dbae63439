//! Writes the seed corpus: valid examples of what each fuzz target reads,
//! made with the wire crate's own parser and encoders, plus a few of the
//! rejections the unit tests name. Run from the repository root:
//!
//!     cargo run --manifest-path fuzz/Cargo.toml --example seeds
//!
//! Files are named `seed-<name>`, so a rerun overwrites them and leaves the
//! fuzzer's own corpus entries (named by hash) alone.

use std::fs;
use std::path::Path;

use adspend_wire::batch::binary::{BinaryBatch, HEADER_LEN, MAGIC};
use adspend_wire::catalog::Catalog;
use adspend_wire::codec::{encode_spend, encode_sums};
use adspend_wire::impression::{parse_line, MAX_TS_MS};
use adspend_wire::types::{
    CheckpointMarker, MsgId, SpendBatch, SpendMessage, SpendTuple, SumEntry, SumsUpdate,
    LIFETIME_BUCKET,
};

const CATALOG: &str = include_str!("../../deploy/catalog.example.json");

const CONTRACT_CATALOG: &str = r#"{
  "limits": {
    "campaign-1": {"budget_micros": 100000000, "period": "daily", "time_zone": "America/New_York"},
    "adset-7":    {"budget_micros": 20000000,  "period": "lifetime", "parent": "campaign-1"}
  },
  "ads": {"ad-1": ["adset-7", "campaign-1"]}
}"#;

/// Daily limits in zones whose days are odd: DST at midnight, quarter-hour
/// offsets, a day skipped (Pacific/Apia 2011-12-30), a 30-minute DST shift;
/// `ts` and `day` are read by the fuzz target (the catalog ignores them).
const ZONES: &[&str] = &[
    "America/Santiago",
    "America/Havana",
    "America/Sao_Paulo",
    "Asia/Kathmandu",
    "Asia/Tehran",
    "Australia/Lord_Howe",
    "Pacific/Apia",
    "Pacific/Kiritimati",
    "Pacific/Chatham",
    "America/St_Johns",
    "Europe/Dublin",
    "Africa/Casablanca",
];

const LINES: &[(&str, &str)] = &[
    (
        "contract",
        r#"{"id":"i-1","ad_id":"ad-1","cost_micros":1500,"ts":1700000000000}"#,
    ),
    (
        "unknown-fields",
        r#"{"id":"i-1","ad_id":"ad-1","cost_micros":1500,"ts":1700000000000,"x":[1,{"y":null}],"z":"w"}"#,
    ),
    (
        "escaped",
        r#"{"id":"a\"b\u00e9\ud83d\ude00","ad_id":"ad-2","cost_micros":0,"ts":0}"#,
    ),
    (
        "longest-id",
        r#"{"id":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx","ad_id":"ad-1","cost_micros":5000000,"ts":253402300799999}"#,
    ),
    (
        "long-id",
        r#"{"id":"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx","ad_id":"ad-1","cost_micros":1,"ts":1}"#,
    ),
    (
        "empty-id",
        r#"{"id":"","ad_id":"ad-1","cost_micros":1,"ts":1}"#,
    ),
    (
        "negative-cost",
        r#"{"id":"a","ad_id":"ad-1","cost_micros":-5,"ts":1}"#,
    ),
    (
        "negative-float-cost",
        r#"{"id":"a","ad_id":"ad-1","cost_micros":-5.5,"ts":1}"#,
    ),
    (
        "fractional-cost",
        r#"{"id":"a","ad_id":"ad-1","cost_micros":12.5,"ts":1}"#,
    ),
    (
        "string-cost",
        r#"{"id":"a","ad_id":"ad-1","cost_micros":"12","ts":1}"#,
    ),
    (
        "huge-cost",
        r#"{"id":"a","ad_id":"ad-1","cost_micros":1e30,"ts":1}"#,
    ),
    (
        "u64-max-cost",
        r#"{"id":"a","ad_id":"ad-1","cost_micros":18446744073709551615,"ts":1}"#,
    ),
    (
        "above-ceiling",
        r#"{"id":"a","ad_id":"ad-2","cost_micros":5000001,"ts":1}"#,
    ),
    (
        "negative-ts",
        r#"{"id":"a","ad_id":"ad-1","cost_micros":1,"ts":-1}"#,
    ),
    (
        "fractional-ts",
        r#"{"id":"a","ad_id":"ad-1","cost_micros":1,"ts":1.5}"#,
    ),
    ("missing-id", r#"{"ad_id":"ad-1","cost_micros":1,"ts":1}"#),
    ("missing-ts", r#"{"id":"a","ad_id":"ad-1","cost_micros":1}"#),
    (
        "null-id",
        r#"{"id":null,"ad_id":"ad-1","cost_micros":1,"ts":1}"#,
    ),
    (
        "duplicate-key",
        r#"{"id":"a","id":"b","ad_id":"ad-1","cost_micros":1,"ts":1}"#,
    ),
    (
        "unknown-ad",
        r#"{"id":"a","ad_id":"ad-9","cost_micros":1,"ts":1}"#,
    ),
    ("truncated", r#"{"id":"a""#),
    ("not-json", "not json"),
];

const BATCH: &str =
    "{\"id\":\"i-1\",\"ad_id\":\"ad-1\",\"cost_micros\":1500,\"ts\":1700000000000}\n\
{\"id\":\"i-2\",\"ad_id\":\"ad-2\",\"cost_micros\":250,\"ts\":1700000000001}\r\n\
\n\
garbage\n\
{\"id\":\"i-3\",\"ad_id\":\"ad-9\",\"cost_micros\":7,\"ts\":1700000000002}\n\
   \n\
{\"id\":\"i-1\",\"ad_id\":\"ad-1\",\"cost_micros\":1500,\"ts\":1700000000000}\n";

/// The SPEND batches of an NDJSON payload, as the limiter maps it: each
/// accepted line of an ad in the catalog gives one tuple per limit of its
/// ad; `per_message` tuples a batch, each carrying the limit ids it uses.
/// (Unlike the limiter, this spreads nothing over partitions.)
fn spend_batches(
    catalog: &Catalog,
    payload: &str,
    per_message: usize,
    source_ms: i64,
) -> Vec<Vec<u8>> {
    let mut spend = Vec::new();
    for line in payload.lines() {
        let Ok(impression) = parse_line(line.as_bytes()) else {
            continue;
        };
        for limit in catalog.limits_of_ad(&impression.ad_id).unwrap_or_default() {
            spend.push((
                limit.id.to_string(),
                limit.bucket_of(impression.ts_ms),
                impression.cost_micros,
                MsgId::derive(&limit.id, &impression.id),
            ));
        }
    }
    spend
        .chunks(per_message)
        .map(|chunk| {
            let mut limits: Vec<String> = Vec::new();
            let mut tuples = Vec::new();
            for (limit, bucket, cost_micros, msg_id) in chunk {
                let index = match limits.iter().position(|l| l == limit) {
                    Some(index) => index,
                    None => {
                        limits.push(limit.clone());
                        limits.len() - 1
                    }
                };
                tuples.push(SpendTuple {
                    limit: index as u32,
                    bucket: *bucket,
                    cost_micros: *cost_micros,
                    msg_id: *msg_id,
                });
            }
            encode_spend(&SpendMessage::Batch(SpendBatch {
                source_ms,
                limits,
                tuples,
            }))
        })
        .collect()
}

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("fuzz/corpus").join(target);
    fs::create_dir_all(&dir).expect("corpus directory");
    fs::write(dir.join(format!("seed-{name}")), bytes).expect("seed written");
}

/// limiter_binary: the NDJSON batch's impressions as binary entries (mode
/// byte 0: the target adds the header), each fault the reader names, a
/// whole message of an unknown version (mode 1), and a few structured
/// inputs (mode 2).
fn binary_seeds() {
    let mut batch = BinaryBatch::new();
    for line in BATCH.lines() {
        if let Ok(i) = parse_line(line.as_bytes()) {
            batch.push(&i.id, &i.ad_id, i.cost_micros, i.ts_ms, i.lease_id.as_deref());
        }
    }
    assert!(!batch.is_empty(), "the batch has impressions");
    let entries_of = |batch: &BinaryBatch| {
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(&batch.as_bytes()[HEADER_LEN..]);
        bytes
    };
    write("limiter_binary", "batch", &entries_of(&batch));
    let mut faults = BinaryBatch::new();
    faults.push("i-1", "ad-1", 1_500, 1_700_000_000_000, Some("lz1k.3.0"));
    faults.push("", "ad-1", 1, 1, None);
    faults.push(&"x".repeat(65), "ad-1", 1, 1, None);
    faults.push("i-2", "ad-1", u64::MAX, -1, None);
    faults.push("i-3", "ad-1", 1, MAX_TS_MS + 1, None);
    let mut bytes = entries_of(&faults);
    bytes.extend_from_slice(&[0, 5, 1, b'i', 1, b'a', 0xff, 40, 1]);
    write("limiter_binary", "faults", &bytes);
    let mut v2 = vec![1u8];
    v2.extend_from_slice(batch.as_bytes());
    v2[1 + MAGIC.len()] = 2;
    write("limiter_binary", "version-2", &v2);
    write("limiter_binary", "structured", &[2, 1, 3, b'i', b'-', b'1', 4, b'a', b'd', b'-', b'1', 7, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0, 1]);
}

fn main() {
    assert!(
        Path::new("fuzz/Cargo.toml").exists(),
        "run from the repository root"
    );
    let catalog = Catalog::parse("example", CATALOG.as_bytes()).expect("example catalog");

    // limiter_line: contract lines, each kind of rejection, an NDJSON batch.
    for (name, line) in LINES {
        write("limiter_line", name, line.as_bytes());
    }
    write("limiter_line", "batch", BATCH.as_bytes());
    binary_seeds();

    // spend_decode: the spend of the batch, and markers.
    let batches = spend_batches(&catalog, BATCH, 2, 1_700_000_000_000);
    assert!(!batches.is_empty(), "the batch makes spend");
    for (n, message) in batches.iter().enumerate() {
        write("spend_decode", &format!("limiter-batch-{n}"), message);
    }
    let marker = |marker_id, partition, emitted_ms| {
        encode_spend(&SpendMessage::Marker(CheckpointMarker {
            marker_id,
            partition,
            emitted_ms,
        }))
    };
    write(
        "spend_decode",
        "marker",
        &marker(1_700_000_000_000, 3, 1_700_000_000_000),
    );
    write(
        "spend_decode",
        "marker-max",
        &marker(u64::MAX, u32::MAX, i64::MIN),
    );

    // pacer_push: a heartbeat, a push with spend, a full push.
    let entry = |limit: &str, bucket, bucket_micros, lifetime_micros, lifetime_events| SumEntry {
        limit: limit.into(),
        bucket,
        bucket_micros,
        lifetime_micros,
        lifetime_events,
    };
    let push = |push_seq, full, entries| SumsUpdate {
        shard: "p0".into(),
        epoch: 3,
        seq: 42,
        push_seq,
        full,
        watermark_ms: 1_700_000_000_000,
        source_ms: 1_699_999_999_900,
        entries,
    };
    write(
        "pacer_push",
        "heartbeat",
        &encode_sums(&push(1, false, vec![])),
    );
    write(
        "pacer_push",
        "spend",
        &encode_sums(&push(
            2,
            false,
            vec![
                entry("campaign-1", 19_675, 1_500, 9_000, 6),
                entry("adset-7", LIFETIME_BUCKET, 1_500, 1_500, 1),
            ],
        )),
    );
    write(
        "pacer_push",
        "full",
        &encode_sums(&push(
            7,
            true,
            vec![
                entry("account-1", LIFETIME_BUCKET, 20_000, 20_000, 12),
                entry("adset-8", 19_675, 250, 250, 1),
                entry("adset-8", 19_674, 100, 350, 2),
            ],
        )),
    );

    // catalog_parse: the repository's catalogs, odd time zones, and the
    // errors the unit tests name.
    write("catalog_parse", "deploy-example", CATALOG.as_bytes());
    write(
        "catalog_parse",
        "contract-example",
        CONTRACT_CATALOG.as_bytes(),
    );
    let mut limits = serde_json::Map::new();
    for (i, zone) in ZONES.iter().enumerate() {
        limits.insert(
            format!("l-{i}"),
            serde_json::json!({"budget_micros": 1_000 * (i + 1), "period": "daily", "time_zone": zone}),
        );
    }
    let zones = serde_json::json!({
        "limits": limits,
        "ads": {"ad-1": ["l-0", "l-6"]},
        "ts": 1_700_000_000_000i64,
        "day": 19_675,
    });
    write(
        "catalog_parse",
        "zones",
        serde_json::to_string_pretty(&zones)
            .expect("json")
            .as_bytes(),
    );
    let bad = [
        (
            "cycle",
            r#"{"limits":{"a":{"budget_micros":1,"period":"daily","parent":"b"},"b":{"budget_micros":1,"period":"daily","parent":"a"}}}"#,
        ),
        (
            "unknown-zone",
            r#"{"limits":{"a":{"budget_micros":1,"period":"daily","time_zone":"Mars/Base"}}}"#,
        ),
        (
            "twice",
            r#"{"limits":{"a":{"budget_micros":1,"period":"lifetime"}},"ads":{"x":["a","a"]}}"#,
        ),
        (
            "no-limits",
            r#"{"limits":{"a":{"budget_micros":1,"period":"daily"}},"ads":{"x":[]}}"#,
        ),
    ];
    for (name, doc) in bad {
        write("catalog_parse", name, doc.as_bytes());
    }
    println!("seeds: written under fuzz/corpus/");
}
