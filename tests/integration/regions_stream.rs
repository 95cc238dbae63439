//! `ensure_regions_stream` against a real nats-server: it is idempotent,
//! follows a changed peer set, refuses a stream that is another region's,
//! and leaves a stream shared by every region as it is.

use adspend_common::nats::regions::{
    ensure_regions_stream, region_api_prefix, region_report_subject, REGIONS_STREAM,
    REPORTS_KEPT_PER_REGION,
};
use adspend_common::Error;
use adspend_harness::NatsServer;
use adspend_wire::regions::RegionName;
use async_nats::jetstream::{self, stream};

fn region(name: &str) -> RegionName {
    RegionName::new(name).expect("a valid region name")
}

/// (API prefix, filter subject) of each source, sorted.
fn sources(config: &stream::Config) -> Vec<(String, String)> {
    let mut sources: Vec<(String, String)> = config
        .sources
        .iter()
        .flatten()
        .map(|source| {
            assert_eq!(source.name, REGIONS_STREAM);
            let api = source.external.as_ref().expect("an external source");
            (
                api.api_prefix.clone(),
                source.filter_subject.clone().unwrap_or_default(),
            )
        })
        .collect();
    sources.sort();
    sources
}

fn source_of(peer: &str) -> (String, String) {
    (
        region_api_prefix(&region(peer)),
        region_report_subject(&region(peer)),
    )
}

async fn jetstream(nats: &NatsServer) -> anyhow::Result<jetstream::Context> {
    Ok(jetstream::new(async_nats::connect(nats.url()).await?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regions_stream_is_idempotent_and_follows_the_peer_set() -> anyhow::Result<()> {
    let nats = NatsServer::start().await;
    let js = jetstream(&nats).await?;
    let east = region("east");

    let mut made = ensure_regions_stream(&js, &east, &[region("west")], 1).await?;
    let created = made.info().await?.created;
    let config = made.cached_info().config.clone();
    assert_eq!(config.subjects, vec!["adspend.regions.east"]);
    assert_eq!(config.max_messages_per_subject, REPORTS_KEPT_PER_REGION);
    assert_eq!(config.storage, stream::StorageType::File);
    assert_eq!(sources(&config), vec![source_of("west")]);

    // Again, with the peers in another order and itself among them.
    let peers = [region("west"), east.clone()];
    let mut again = ensure_regions_stream(&js, &east, &peers, 1).await?;
    let info = again.info().await?;
    assert_eq!(info.created, created, "the stream was made again");
    assert_eq!(sources(&info.config), vec![source_of("west")]);

    js.publish(region_report_subject(&east), "kept".into())
        .await?
        .await?;
    let grown = [region("south"), region("west")];
    let mut updated = ensure_regions_stream(&js, &east, &grown, 1).await?;
    let info = updated.info().await?;
    assert_eq!(
        sources(&info.config),
        vec![source_of("south"), source_of("west")]
    );
    assert_eq!(info.state.messages, 1, "an update keeps the reports");

    let shrunk = [region("south")];
    let mut updated = ensure_regions_stream(&js, &east, &shrunk, 1).await?;
    assert_eq!(
        sources(&updated.info().await?.config),
        vec![source_of("south")]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_regions_stream_is_a_mismatch_that_exits_as_a_bad_setting() -> anyhow::Result<()> {
    let nats = NatsServer::start().await;
    let js = jetstream(&nats).await?;
    ensure_regions_stream(&js, &region("west"), &[region("east")], 1).await?;

    let error = ensure_regions_stream(&js, &region("east"), &[region("west")], 1)
        .await
        .expect_err("east must not take west's stream");
    match &error {
        Error::RegionMismatch { expected, found } => {
            assert_eq!(expected, "east");
            assert_eq!(found, "west");
        }
        other => panic!("not a region mismatch: {other}"),
    }
    assert_eq!(error.exit_code(), adspend_common::error::EXIT_BAD_SETTING);
    let config = js
        .get_stream(REGIONS_STREAM)
        .await?
        .cached_info()
        .config
        .clone();
    assert_eq!(config.subjects, vec!["adspend.regions.west"], "left alone");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_shared_by_every_region_is_used_as_it_is() -> anyhow::Result<()> {
    let nats = NatsServer::start().await;
    let js = jetstream(&nats).await?;
    let shared = stream::Config {
        name: REGIONS_STREAM.to_string(),
        subjects: vec!["adspend.regions.>".to_string()],
        max_messages_per_subject: REPORTS_KEPT_PER_REGION,
        ..Default::default()
    };
    js.create_stream(shared).await?;

    for name in ["east", "west", "south"] {
        let peers: Vec<RegionName> = ["east", "west", "south"]
            .into_iter()
            .filter(|peer| *peer != name)
            .map(region)
            .collect();
        let mut stream = ensure_regions_stream(&js, &region(name), &peers, 1).await?;
        let config = stream.info().await?.config.clone();
        assert_eq!(config.subjects, vec!["adspend.regions.>"], "{name}");
        assert!(sources(&config).is_empty(), "{name}: no sources added");
    }
    Ok(())
}

/// A `REGIONS` stream an earlier version made, keeping 16 reports per
/// region (too few for a report in more than 16 parts), is brought to
/// [`REPORTS_KEPT_PER_REGION`] at the next start, its reports kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_keeping_fewer_reports_is_raised_to_the_bound() -> anyhow::Result<()> {
    let nats = NatsServer::start().await;
    let js = jetstream(&nats).await?;
    let east = region("east");
    let mut old = ensure_regions_stream(&js, &east, &[region("west")], 1).await?;
    let mut config = old.cached_info().config.clone();
    config.max_messages_per_subject = 16;
    js.update_stream(config).await?;
    js.publish(region_report_subject(&east), "kept".into())
        .await?
        .await?;
    assert_eq!(old.info().await?.config.max_messages_per_subject, 16);

    let mut again = ensure_regions_stream(&js, &east, &[region("west")], 1).await?;
    let info = again.info().await?;
    assert_eq!(
        info.config.max_messages_per_subject,
        REPORTS_KEPT_PER_REGION
    );
    assert_eq!(sources(&info.config), vec![source_of("west")]);
    assert_eq!(info.state.messages, 1, "the reports were kept");
    Ok(())
}
