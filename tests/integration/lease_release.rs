//! `POST /v1/leases/release` on the real pipeline, two pacers: a release
//! made at one pacer frees what was not served at both at once (long
//! before expiry plus the grace), what was served stays held until its
//! spend is reported, a restarted pacer knows the release, and bad or
//! repeated releases change nothing.

use serde_json::{json, Value};

use crate::leases::{
    granted, impressions, line, micros, spawn_pacer, start, wait_field, wait_healthy, BUDGET,
    FIRST_SPEND,
};

async fn release(addr: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/leases/release"))
        .json(&body)
        .send()
        .await
        .expect("POST /v1/leases/release");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON answer"))
}

async fn view(addr: &str, id: &str) -> Value {
    reqwest::get(format!("http://{addr}/v1/leases/{id}"))
        .await
        .expect("GET lease")
        .json()
        .await
        .expect("lease JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_at_one_pacer_frees_what_was_not_served_at_every_pacer() {
    let p = start().await;
    let one = spawn_pacer(&p, &[]);
    let two = spawn_pacer(&p, &[]);
    for pacer in [&one, &two] {
        wait_healthy(&pacer.addr).await;
        wait_field(&pacer.addr, "camp-a", "spend_micros", FIRST_SPEND).await;
    }
    let client = p.client().await;
    // A two-minute lease (with the default 60 s grace it would hold its
    // remainder for three minutes unreleased).
    let got = granted(
        &one.addr,
        json!({"ads": [{"ad_id": "a-1", "micros": 500_000}], "ttl_ms": 120_000}),
    )
    .await;
    let id = got[0]["lease_id"].as_str().expect("a lease id").to_string();
    let other = granted(
        &one.addr,
        json!({"ads": [{"ad_id": "a-2", "micros": 100_000}], "ttl_ms": 120_000}),
    )
    .await;
    let other_id = other[0]["lease_id"]
        .as_str()
        .expect("a lease id")
        .to_string();
    // 15 impressions of 10,000 served under it; 10 reported so far.
    let served: Vec<String> = (0..15)
        .map(|i| line(&format!("served-{i}"), "a-1", 10_000, Some(&id)))
        .collect();
    impressions(&client, &served[..10]).await;
    wait_field(&two.addr, "camp-a", "leased_micros", 400_000 + 100_000).await;

    // A bad entry: nothing of the request is released.
    let (status, body) = release(
        &two.addr,
        json!({"leases": [
            {"lease_id": id, "served_micros": 150_000},
            {"lease_id": other_id, "served_micros": -3},
        ]}),
    )
    .await;
    assert_eq!(status, 422, "{body}");
    let error = body["error"].as_str().unwrap_or_default();
    assert!(error.starts_with("leases[1].served_micros"), "{body}");
    for (bad, named) in [
        (
            json!({"leases": [{"served_micros": 1}]}),
            "leases[0].lease_id",
        ),
        (
            json!({"leases": [{"lease_id": "nope", "served_micros": 1}]}),
            "leases[0].lease_id",
        ),
    ] {
        let (status, body) = release(&two.addr, bad).await;
        assert_eq!(status, 422, "{body}");
        assert!(
            body["error"]
                .as_str()
                .unwrap_or_default()
                .starts_with(named),
            "{body}"
        );
    }
    assert_eq!(view(&two.addr, &id).await["held_micros"], 400_000);

    // Released at the other pacer: 150,000 served, 100,000 of it reported.
    let (status, body) = release(
        &two.addr,
        json!({"leases": [{"lease_id": id, "served_micros": 150_000}, {"lease_id": "zzzz.99.0", "served_micros": 0}]}),
    )
    .await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        body["leases"],
        json!([
            {"lease_id": id, "released": true, "held_micros": 50_000},
            {"lease_id": "zzzz.99.0", "released": false, "held_micros": 0},
        ])
    );
    // Both pacers free the 350,000 not served; the granting one once it has
    // folded the release.
    for pacer in [&one, &two] {
        wait_field(&pacer.addr, "camp-a", "leased_micros", 50_000 + 100_000).await;
    }
    let seen = view(&one.addr, &id).await;
    assert_eq!(
        (&seen["served_micros"], &seen["held_micros"]),
        (&json!(150_000), &json!(50_000)),
        "{seen}"
    );
    let spent = FIRST_SPEND + 100_000;
    let more = granted(
        &one.addr,
        json!({"ads": [{"ad_id": "a-2", "micros": 10_000_000}], "ttl_ms": 120_000}),
    )
    .await;
    assert_eq!(
        micros(&more),
        BUDGET - spent - 50_000 - 100_000,
        "what was not served is granted again"
    );

    // The rest reported: the lease holds nothing. A second release (more
    // served, said late) takes nothing back.
    impressions(&client, &served[10..]).await;
    let (_, again) = release(
        &one.addr,
        json!({"leases": [{"lease_id": id, "served_micros": 400_000}]}),
    )
    .await;
    assert_eq!(again["leases"][0]["released"], true, "{again}");
    wait_field(&two.addr, "camp-a", "spend_micros", spent + 50_000).await;
    let held_elsewhere = 100_000 + micros(&more);
    for pacer in [&one, &two] {
        wait_field(&pacer.addr, "camp-a", "leased_micros", held_elsewhere).await;
    }
    assert_eq!(view(&two.addr, &id).await["served_micros"], 150_000);

    // A pacer started now reads the release from the ledger.
    let three = spawn_pacer(&p, &[]);
    wait_healthy(&three.addr).await;
    wait_field(&three.addr, "camp-a", "spend_micros", spent + 50_000).await;
    // It grants only once it has read the ledger: ask, then look.
    let none = granted(&three.addr, json!({"ads": [{"ad_id": "a-1", "micros": 1}]})).await;
    assert_eq!(micros(&none), 0, "camp-a is fully spent or held");
    wait_field(&three.addr, "camp-a", "leased_micros", held_elsewhere).await;
    assert_eq!(view(&three.addr, &id).await["held_micros"], 0);
}
