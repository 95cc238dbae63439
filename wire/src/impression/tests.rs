//! Tests of the NDJSON line parser: examples of each reason and an
//! independent oracle (a generic JSON tree) that proptest compares against.

use super::*;
use proptest::prelude::*;

#[test]
fn a_lease_id_rides_along_and_anything_else_there_is_no_lease() {
    let line = |lease: &str| {
        format!(r#"{{"id":"i","ad_id":"a","cost_micros":5,"ts":1,"lease_id":{lease}}}"#)
    };
    let lease = |lease: &str| {
        parse_line(line(lease).as_bytes()).map(|i| i.lease_id.map(|l| l.into_owned()))
    };
    assert_eq!(lease(r#""k.1.0""#), Ok(Some("k.1.0".to_string())));
    assert_eq!(lease(r#""k\u002e1""#), Ok(Some("k.1".to_string())));
    for other in ["null", "5", "-1.5", "true", "[1,\"x\"]", r#"{"a":[1]}"#] {
        assert_eq!(lease(other), Ok(None), "{other}");
    }
    let without = parse_line(br#"{"id":"i","ad_id":"a","cost_micros":5,"ts":1}"#).unwrap();
    assert_eq!(without.lease_id, None);
}

fn reason(line: &str) -> Reason {
    parse_line(line.as_bytes()).unwrap_err().reason
}

type Parsed = Result<(String, String, u64, i64), Reason>;

/// What the contract says of a line, decided on a generic JSON tree
/// rather than the parser's borrowed struct: wrong types first (the
/// whole object is read before any check), then missing (or null)
/// fields, then each field's range, in the order id, ad_id, cost, ts.
fn oracle(line: &[u8]) -> Parsed {
    use serde_json::Value;
    let Ok(text) = std::str::from_utf8(line) else {
        return Err(Reason::InvalidJson);
    };
    let Ok(value) = serde_json::from_str::<Value>(text) else {
        return Err(Reason::InvalidJson);
    };
    let Value::Object(fields) = value else {
        return Err(Reason::InvalidField);
    };
    let get = |name: &str| fields.get(name).filter(|v| !v.is_null());
    for name in ["id", "ad_id"] {
        if get(name).is_some_and(|v| !v.is_string()) {
            return Err(Reason::InvalidField);
        }
    }
    for name in ["cost_micros", "ts"] {
        if get(name).is_some_and(|v| !v.is_number()) {
            return Err(Reason::InvalidField);
        }
    }
    let (Some(id), Some(ad_id), Some(cost), Some(ts)) =
        (get("id"), get("ad_id"), get("cost_micros"), get("ts"))
    else {
        return Err(Reason::MissingField);
    };
    let (id, ad_id) = (id.as_str().unwrap(), ad_id.as_str().unwrap());
    if !(1..=MAX_ID_LEN).contains(&id.len()) || !(1..=MAX_ID_LEN).contains(&ad_id.len()) {
        return Err(Reason::IdTooLong);
    }
    let cost = match (cost.as_u64(), cost.as_i64(), cost.as_f64()) {
        (Some(c), _, _) => c,
        (None, Some(_), _) => return Err(Reason::NegativeCost),
        (_, _, Some(f)) if f < 0.0 => return Err(Reason::NegativeCost),
        (_, _, Some(f)) if f.fract() != 0.0 => return Err(Reason::FractionalCost),
        _ => return Err(Reason::InvalidField),
    };
    match ts.as_i64() {
        Some(ts) if (0..=MAX_TS_MS).contains(&ts) => {
            Ok((id.to_string(), ad_id.to_string(), cost, ts))
        }
        _ => Err(Reason::InvalidTs),
    }
}

/// A field's value: mostly valid, else every kind of wrong.
fn field_value(
    valid: BoxedStrategy<serde_json::Value>,
) -> BoxedStrategy<Option<serde_json::Value>> {
    use serde_json::Value;
    prop_oneof![
        20 => valid.prop_map(Some),
        1 => Just(None),
        1 => Just(Some(Value::Null)),
        1 => any::<bool>().prop_map(|b| Some(Value::Bool(b))),
        1 => "[a-z]{0,70}".prop_map(|s| Some(Value::String(s))),
        1 => any::<i64>().prop_map(|n| Some(n.into())),
        1 => any::<u64>().prop_map(|n| Some(n.into())),
        1 => (-1e21f64..1e21).prop_map(|f| Some(f.into())),
        1 => (0u32..1000).prop_map(|n| Some((f64::from(n) + 0.25).into())),
    ]
    .boxed()
}

/// Lines to judge: generated objects (mostly valid, every field sometimes
/// wrong, unknown fields), such objects with a byte overwritten or cut,
/// and raw bytes.
fn line() -> impl Strategy<Value = Vec<u8>> {
    use serde_json::Value;
    let id = || "[a-zA-Z0-9-]{1,64}".prop_map(Value::String).boxed();
    let object = (
        field_value(id()),
        field_value(id()),
        field_value(any::<u64>().prop_map(Value::from).boxed()),
        field_value((0i64..MAX_TS_MS).prop_map(Value::from).boxed()),
        prop::option::of(any::<i32>()),
    )
        .prop_map(|(id, ad_id, cost, ts, extra)| {
            let mut fields = serde_json::Map::new();
            let named = [
                ("id", id),
                ("ad_id", ad_id),
                ("cost_micros", cost),
                ("ts", ts),
            ];
            for (name, value) in named {
                if let Some(value) = value {
                    fields.insert(name.to_string(), value);
                }
            }
            if let Some(extra) = extra {
                fields.insert("extra".to_string(), extra.into());
            }
            Value::Object(fields).to_string().into_bytes()
        });
    prop_oneof![
        4 => object.clone(),
        1 => (object, any::<prop::sample::Index>(), any::<u8>(), any::<bool>()).prop_map(
            |(mut line, at, byte, cut)| {
                let at = at.index(line.len());
                if cut {
                    line.truncate(at);
                } else {
                    line[at] = byte;
                }
                line
            }
        ),
        1 => prop::collection::vec(any::<u8>(), 0..200),
    ]
}

#[test]
fn accepts_the_contract_format_and_ignores_unknown_fields() {
    let i =
        parse_line(br#"{"id":"i-1","ad_id":"ad-1","cost_micros":1500,"ts":1700000000000,"x":[1]}"#)
            .unwrap();
    assert_eq!(i.id, "i-1");
    assert_eq!(i.ad_id, "ad-1");
    assert_eq!(i.cost_micros, 1500);
    assert_eq!(i.ts_ms, 1_700_000_000_000);
    let escaped = parse_line(br#"{"id":"a\"b","ad_id":"ad","cost_micros":0,"ts":0}"#).unwrap();
    assert_eq!(escaped.id, "a\"b");
}

#[test]
fn every_bad_kind_has_its_reason() {
    assert_eq!(reason("not json"), Reason::InvalidJson);
    assert_eq!(reason("{\"id\":\"a\""), Reason::InvalidJson);
    assert_eq!(
        reason(r#"{"ad_id":"a","cost_micros":1,"ts":1}"#),
        Reason::MissingField
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","ts":1}"#),
        Reason::MissingField
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","cost_micros":1}"#),
        Reason::MissingField
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","cost_micros":-5,"ts":1}"#),
        Reason::NegativeCost
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","cost_micros":-5.5,"ts":1}"#),
        Reason::NegativeCost
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","cost_micros":12.5,"ts":1}"#),
        Reason::FractionalCost
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","cost_micros":"12","ts":1}"#),
        Reason::InvalidField
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","cost_micros":1e30,"ts":1}"#),
        Reason::InvalidField
    );
    let long = "x".repeat(65);
    assert_eq!(
        reason(&format!(
            r#"{{"id":"{long}","ad_id":"a","cost_micros":1,"ts":1}}"#
        )),
        Reason::IdTooLong
    );
    assert_eq!(
        reason(r#"{"id":"","ad_id":"a","cost_micros":1,"ts":1}"#),
        Reason::IdTooLong
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","cost_micros":1,"ts":-1}"#),
        Reason::InvalidTs
    );
    assert_eq!(
        reason(r#"{"id":"a","ad_id":"a","cost_micros":1,"ts":1.5}"#),
        Reason::InvalidTs
    );
}

/// Found by fuzzing (fuzz target limiter_line): a line whose unknown
/// field held bytes that are not UTF-8 was accepted, though it is not
/// JSON.
#[test]
fn bytes_that_are_not_utf8_are_invalid_json() {
    let mut line = br#"{"id":"i-1","ad_id":"ad-1","cost_micros":1,"ts":1,"z":"w"#.to_vec();
    line.extend_from_slice(b"\xff\xfe\"}");
    let rejection = parse_line(&line).unwrap_err();
    assert_eq!(rejection.reason, Reason::InvalidJson);
    assert!(
        rejection.detail.contains("not UTF-8"),
        "{}",
        rejection.detail
    );
    // In a kept field serde_json saw it already; same reason either way.
    let mut id = br#"{"id":"i-"#.to_vec();
    id.extend_from_slice(b"\xc3\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":1}");
    assert_eq!(parse_line(&id).unwrap_err().reason, Reason::InvalidJson);
    // UTF-8 beyond ASCII is fine, in kept and ignored fields alike.
    let ok = parse_line(
        "{\"id\":\"é😀\",\"ad_id\":\"ad-1\",\"cost_micros\":1,\"ts\":1,\"z\":\"ü\"}".as_bytes(),
    )
    .unwrap();
    assert_eq!(ok.id, "é😀");
}

proptest! {
    #[test]
    fn agrees_with_an_independent_oracle(line in line()) {
        let got = parse_line(&line)
            .map(|i| (i.id.into_owned(), i.ad_id.into_owned(), i.cost_micros, i.ts_ms))
            .map_err(|r| r.reason);
        let expected = oracle(&line);
        // A line that is not JSON may also hold a wrong type before the
        // syntax error; the parser reads in order and may report either.
        if expected == Err(Reason::InvalidJson) && got == Err(Reason::InvalidField) {
            return Ok(());
        }
        prop_assert_eq!(got, expected, "line {:?}", String::from_utf8_lossy(&line));
    }

    #[test]
    fn one_bad_field_is_rejected_with_its_reason(
        id in "[a-zA-Z0-9-]{1,64}",
        cost in any::<u64>(),
        ts in 0i64..MAX_TS_MS,
        field in 0usize..4,
        fault in 0usize..4,
    ) {
        use serde_json::json;
        let names = ["id", "ad_id", "cost_micros", "ts"];
        let mut event = json!({"id": id, "ad_id": "ad-1", "cost_micros": cost, "ts": ts});
        let (bad, expected) = match (names[field], fault) {
            (_, 0) => (None, Reason::MissingField),
            (_, 1) => (Some(json!(null)), Reason::MissingField),
            ("id" | "ad_id", 2) => (Some(json!("")), Reason::IdTooLong),
            ("id" | "ad_id", _) => (Some(json!("x".repeat(MAX_ID_LEN + 1))), Reason::IdTooLong),
            ("cost_micros", 2) => (Some(json!(-1 - (cost >> 2) as i64)), Reason::NegativeCost),
            ("cost_micros", _) => (Some(json!((cost >> 40) as f64 + 0.5)), Reason::FractionalCost),
            (_, 2) => (Some(json!(-1 - ts)), Reason::InvalidTs),
            (_, _) => (Some(json!(MAX_TS_MS + 1 + ts)), Reason::InvalidTs),
        };
        match bad {
            None => event.as_object_mut().unwrap().remove(names[field]),
            Some(v) => event.as_object_mut().unwrap().insert(names[field].to_string(), v),
        };
        let line = event.to_string();
        let rejection = parse_line(line.as_bytes()).unwrap_err();
        prop_assert_eq!(rejection.reason, expected, "{}: {}", line, rejection.detail);
    }

    #[test]
    fn valid_events_roundtrip(id in "[a-zA-Z0-9-]{1,64}", ad in "[a-z0-9-]{1,64}", cost in any::<u64>(), ts in 0i64..MAX_TS_MS) {
        let line = serde_json::json!({"id": id, "ad_id": ad, "cost_micros": cost, "ts": ts}).to_string();
        let i = parse_line(line.as_bytes()).unwrap();
        prop_assert_eq!((i.id.as_ref(), i.ad_id.as_ref(), i.cost_micros, i.ts_ms), (id.as_str(), ad.as_str(), cost, ts));
    }
}
