//! The links between regions (CONTRACT.md, "Regions"; docs/REGIONS.md).
//!
//! Each region runs its own JetStream as a JetStream *domain* named after
//! the region, and publishes its reports on `adspend.regions.<region>` into
//! its own `REGIONS` stream. That stream also *sources* every peer's
//! `REGIONS` stream through the peer's domain API (`$JS.<peer>.API`),
//! filtered to the peer's subject, so each region reads every region's
//! reports from one local stream. NATS keeps a source's position and resumes
//! it after a cut; nothing here replicates by hand.

use std::collections::BTreeSet;
use std::time::Duration;

use adspend_wire::regions::RegionName;
use async_nats::jetstream::{self, stream};

use crate::error::{Error, Result};

/// The stream holding this region's reports and, sourced, its peers'.
pub const REGIONS_STREAM: &str = "REGIONS";

/// Report messages kept per region (per subject). A region's report is
/// published in parts of [`adspend_wire::regions::MAX_REPORT_LIMITS`]
/// limits, all on one subject, and a reader starting from the stream (a
/// pacer restoring its own `given` counters, a peer after a cut) needs the
/// newest whole round of parts: 1,024 messages hold two whole rounds of a
/// catalog of up to 102,400 limits (512 parts), so one interrupted round
/// still leaves a whole one. The stream's size is bounded by it: regions ×
/// 1,024 messages of at most one part each. A larger catalog is warned
/// about by the pacer ([`REPORT_PARTS_KEPT_WHOLE`]).
pub const REPORTS_KEPT_PER_REGION: i64 = 1024;

/// Parts of one report round the stream keeps two whole rounds of.
pub const REPORT_PARTS_KEPT_WHOLE: usize = (REPORTS_KEPT_PER_REGION / 2) as usize;

/// The subjects of a stream that every region shares (one NATS for all of
/// them: a development or test topology).
const SHARED_SUBJECTS: &str = "adspend.regions.>";

/// A peer whose source was active within this long is linked: a source
/// consumer hears from its origin at least every second or so (idle
/// heartbeats), so a few seconds of silence means the link is down.
pub const LINKED_WITHIN: Duration = Duration::from_secs(5);

const SUBJECT_PREFIX: &str = "adspend.regions";

/// What stays inside a region: every subject its pipeline uses on its own
/// NATS, and its JetStream API under the plain prefix. A region's leaf link
/// to its hub neither sends nor takes them (its leaf remote's
/// `deny_exports` and `deny_imports`; docs/REGIONS.md), or one region's
/// pacer would read another's sum pushes and lease commits as its own.
/// What crosses is a source's traffic: requests to `$JS.<peer>.API` and
/// the deliveries they set up.
pub const REGION_LOCAL_SUBJECTS: [&str; 5] = [
    "impressions.>",
    "spend.>",
    "deadletter.>",
    "adspend.>",
    "$JS.API.>",
];

/// Where `region` publishes its reports: `adspend.regions.<region>`.
pub fn region_report_subject(region: &RegionName) -> String {
    format!("{SUBJECT_PREFIX}.{region}")
}

/// The JetStream API of `region`'s domain, as seen from any other region:
/// `$JS.<region>.API`.
pub fn region_api_prefix(region: &RegionName) -> String {
    format!("$JS.{region}.API")
}

/// One peer's link, as this region's `REGIONS` stream sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SourceState {
    pub region: RegionName,
    /// Messages the source had not copied yet when it last heard from the
    /// peer. While the link is cut this keeps its last value: it says
    /// nothing about the link, [`SourceState::active`] does.
    pub lag: u64,
    /// How long ago the source last heard from the peer; `None` if never.
    pub active: Option<Duration>,
}

impl SourceState {
    /// Whether the peer was heard within [`LINKED_WITHIN`].
    pub fn is_linked(&self) -> bool {
        self.active.is_some_and(|active| active <= LINKED_WITHIN)
    }
}

/// Creates or brings up to date this region's `REGIONS` stream: its own
/// reports on [`region_report_subject`] (the newest
/// [`REPORTS_KEPT_PER_REGION`], on file, `replicas` copies when created)
/// and one source per peer, reading the peer's `REGIONS` stream through
/// [`region_api_prefix`], filtered to the peer's subject.
///
/// Idempotent. When the peer set changed, the sources are replaced by the
/// new set; the rest of an existing stream stays as it is.
///
/// Two existing streams are not changed:
/// - one whose subjects include `adspend.regions.>` is shared by every
///   region (one NATS for all regions, a development and test topology:
///   every region publishes into it and reads every other's reports from
///   it, so there is nothing to source); it is returned as it is;
/// - one that holds another region's subject means this service is pointed
///   at another region's NATS, or named after the wrong region:
///   [`Error::RegionMismatch`], which stops the service like a bad setting.
pub async fn ensure_regions_stream(
    js: &jetstream::Context,
    region: &RegionName,
    peers: &[RegionName],
    replicas: usize,
) -> Result<stream::Stream> {
    let wanted = regions_config(region, peers, replicas);
    let mut stream = match js.get_stream(REGIONS_STREAM).await {
        Ok(stream) => stream,
        Err(e) if is_not_found(&e) => create(js, &wanted).await?,
        Err(e) => return Err(Error::jetstream(format!("stream info {REGIONS_STREAM}"))(e)),
    };
    let config = stream.cached_info().config.clone();
    if config.subjects.iter().any(|s| s == SHARED_SUBJECTS) {
        return Ok(stream);
    }
    if config.subjects != wanted.subjects {
        return Err(Error::RegionMismatch {
            expected: region.to_string(),
            found: regions_of(&config.subjects),
        });
    }
    if source_keys(&config) == source_keys(&wanted)
        && config.max_messages_per_subject == wanted.max_messages_per_subject
    {
        return Ok(stream);
    }
    // The peer set changed, or an earlier version made the stream keeping
    // fewer reports per region.
    let mut updated = config;
    updated.sources = wanted.sources;
    updated.max_messages_per_subject = wanted.max_messages_per_subject;
    js.update_stream(updated.clone())
        .await
        .map_err(Error::jetstream(format!(
            "update the sources of stream {REGIONS_STREAM} to {:?}",
            source_keys(&updated)
        )))?;
    tracing::info!(
        stream = REGIONS_STREAM,
        %region,
        peers = ?peers.iter().map(RegionName::as_str).collect::<Vec<_>>(),
        "region links updated to the new peer set"
    );
    stream
        .info()
        .await
        .map_err(Error::jetstream(format!("stream info {REGIONS_STREAM}")))?;
    Ok(stream)
}

fn is_not_found(e: &jetstream::context::GetStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::GetStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NOT_FOUND
    )
}

/// Creates the stream that was not there. Another process of the same
/// region may create it at the same moment; then its stream is used.
async fn create(js: &jetstream::Context, wanted: &stream::Config) -> Result<stream::Stream> {
    match js.create_stream(wanted.clone()).await {
        Ok(stream) => Ok(stream),
        Err(e) if made_meanwhile(&e) => js
            .get_stream(REGIONS_STREAM)
            .await
            .map_err(Error::jetstream(format!("stream info {REGIONS_STREAM}"))),
        Err(e) => Err(Error::jetstream(format!("create stream {REGIONS_STREAM}"))(
            e,
        )),
    }
}

fn made_meanwhile(e: &jetstream::context::CreateStreamError) -> bool {
    matches!(
        e.kind(),
        jetstream::context::CreateStreamErrorKind::JetStream(inner)
            if inner.error_code() == jetstream::ErrorCode::STREAM_NAME_EXIST
    )
}

fn regions_config(region: &RegionName, peers: &[RegionName], replicas: usize) -> stream::Config {
    let peers: BTreeSet<&RegionName> = peers.iter().filter(|p| *p != region).collect();
    let sources = peers
        .into_iter()
        .map(|peer| stream::Source {
            name: REGIONS_STREAM.to_string(),
            filter_subject: Some(region_report_subject(peer)),
            external: Some(stream::External {
                api_prefix: region_api_prefix(peer),
                delivery_prefix: None,
            }),
            ..Default::default()
        })
        .collect();
    stream::Config {
        name: REGIONS_STREAM.to_string(),
        subjects: vec![region_report_subject(region)],
        max_messages_per_subject: REPORTS_KEPT_PER_REGION,
        storage: stream::StorageType::File,
        num_replicas: replicas.max(1),
        sources: Some(sources),
        ..Default::default()
    }
}

/// What tells two source lists apart: (API prefix, filter), sorted. The
/// server fills in defaults of its own, so whole `Source`s do not compare.
fn source_keys(config: &stream::Config) -> Vec<(String, String)> {
    let mut keys: Vec<(String, String)> = config
        .sources
        .iter()
        .flatten()
        .map(|source| {
            let api = source
                .external
                .as_ref()
                .map(|e| e.api_prefix.clone())
                .unwrap_or_default();
            (api, source.filter_subject.clone().unwrap_or_default())
        })
        .collect();
    keys.sort();
    keys
}

/// For the mismatch message: the regions an existing stream's subjects
/// name, or the subjects themselves where they are not region subjects.
fn regions_of(subjects: &[String]) -> String {
    let prefix = format!("{SUBJECT_PREFIX}.");
    subjects
        .iter()
        .map(|s| s.strip_prefix(&prefix).unwrap_or(s))
        .collect::<Vec<_>>()
        .join(",")
}

/// The state of each peer's source of `stream` (this region's `REGIONS`),
/// fresh from the server. Peers are told apart by their filter subject; a
/// source that is not a region's is left out. Empty for a shared stream.
pub async fn regions_sources(stream: &mut stream::Stream) -> Result<Vec<SourceState>> {
    let info = stream
        .info()
        .await
        .map_err(Error::jetstream(format!("stream info {REGIONS_STREAM}")))?;
    let prefix = format!("{SUBJECT_PREFIX}.");
    let mut states: Vec<SourceState> = info
        .sources
        .iter()
        .filter_map(|source| {
            let filter = source.filter_subject.as_deref()?;
            let region = RegionName::new(filter.strip_prefix(&prefix)?).ok()?;
            Some(SourceState {
                region,
                lag: source.lag,
                active: source.active,
            })
        })
        .collect();
    states.sort_by(|a, b| a.region.cmp(&b.region));
    Ok(states)
}

/// How long a peer's JetStream may take to answer [`resume_stalled_sources`]'s
/// probe before it counts as out of reach.
const PEER_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Makes the sources of `stream` (this region's `REGIONS`) again for the
/// peers that are not linked although their `REGIONS` stream answers
/// again, and returns those peers.
///
/// Why: once a source has been silent past the server's 10 s stall check
/// (a cut, the peer's server restarted), the server retries it on a
/// backoff that grows to 2 minutes, and a try made while the link was down
/// waits up to 30 s for its answer: measured, reports flowed again 40 to
/// 50 s after the link did (docs/REGIONS.md). A source removed and added
/// back is tried at once, from where it stopped (the server finds that in
/// the peer's reports this stream holds), so nothing is skipped; a report
/// may come twice, which merging by maximum absorbs.
///
/// Meant to run every few seconds in one process per region. A stream
/// shared by every region has no sources: nothing to do.
pub async fn resume_stalled_sources(
    js: &jetstream::Context,
    stream: &mut stream::Stream,
) -> Result<Vec<RegionName>> {
    let mut back = Vec::new();
    for state in regions_sources(stream).await? {
        if !state.is_linked() && peer_answers(js, &state.region).await {
            back.push(state.region);
        }
    }
    if back.is_empty() {
        return Ok(back);
    }
    let config = stream.cached_info().config.clone();
    let stalled: BTreeSet<String> = back.iter().map(region_report_subject).collect();
    let mut without = config.clone();
    without.sources = config.sources.as_ref().map(|sources| {
        sources
            .iter()
            .filter(|s| {
                !s.filter_subject
                    .as_ref()
                    .is_some_and(|f| stalled.contains(f))
            })
            .cloned()
            .collect()
    });
    for step in [without, config] {
        js.update_stream(step)
            .await
            .map_err(Error::jetstream(format!(
                "update stream {REGIONS_STREAM} to make the sources of {back:?} again"
            )))?;
    }
    tracing::info!(
        stream = REGIONS_STREAM,
        peers = ?back.iter().map(RegionName::as_str).collect::<Vec<_>>(),
        "sources stalled although their peers answer again were made again"
    );
    stream
        .info()
        .await
        .map_err(Error::jetstream(format!("stream info {REGIONS_STREAM}")))?;
    Ok(back)
}

/// Whether `peer`'s `REGIONS` stream answers through the peer's domain
/// API: the way its source takes is open again.
async fn peer_answers(js: &jetstream::Context, peer: &RegionName) -> bool {
    let subject = format!("{}.STREAM.INFO.{REGIONS_STREAM}", region_api_prefix(peer));
    let client = js.client();
    let request = client.request(subject, "".into());
    let Ok(Ok(reply)) = tokio::time::timeout(PEER_PROBE_TIMEOUT, request).await else {
        return false;
    };
    serde_json::from_slice::<serde_json::Value>(&reply.payload)
        .is_ok_and(|info| info.get("error").is_none() && info.get("config").is_some())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name(s: &str) -> RegionName {
        RegionName::new(s).unwrap()
    }

    #[test]
    fn subjects_and_api_prefixes_carry_the_region() {
        assert_eq!(region_report_subject(&name("east")), "adspend.regions.east");
        assert_eq!(region_api_prefix(&name("west")), "$JS.west.API");
    }

    #[test]
    fn one_source_per_peer_never_one_for_itself() {
        let config = regions_config(
            &name("east"),
            &[name("west"), name("east"), name("south")],
            3,
        );
        assert_eq!(config.subjects, vec!["adspend.regions.east"]);
        assert_eq!(config.max_messages_per_subject, REPORTS_KEPT_PER_REGION);
        assert_eq!(config.num_replicas, 3);
        assert_eq!(
            source_keys(&config),
            vec![
                ("$JS.south.API".into(), "adspend.regions.south".into()),
                ("$JS.west.API".into(), "adspend.regions.west".into()),
            ]
        );
    }

    #[test]
    fn a_source_is_linked_while_heard_within_five_seconds() {
        let state = |active| SourceState {
            region: name("west"),
            lag: 0,
            active,
        };
        assert!(state(Some(Duration::from_millis(900))).is_linked());
        assert!(state(Some(LINKED_WITHIN)).is_linked());
        assert!(!state(Some(Duration::from_secs(6))).is_linked());
        assert!(!state(None).is_linked());
    }

    #[test]
    fn every_pipeline_subject_stays_in_its_region() {
        use crate::nats::*;
        // Whether a subject (or a filter's literal part) falls under one
        // of the region's own patterns, all of the form `prefix.>`.
        let local = |subject: &str| {
            REGION_LOCAL_SUBJECTS.iter().any(|pattern| {
                let prefix = pattern.strip_suffix('>').expect("a `prefix.>` pattern");
                subject.starts_with(prefix)
            })
        };
        for subject in [
            IMPRESSIONS_SUBJECTS,
            SPEND_SUBJECTS,
            SPEND_TRIMS_SUBJECTS,
            DEADLETTER_SUBJECTS,
            ALERTS_SUBJECTS,
            SUMS_SUBJECT_PREFIX,
            SUMS_RESYNC_SUBJECT,
            SOURCES_SUBJECT,
            PROGRESS_SUBJECT_PREFIX,
            crate::dedupe_window::SUBJECT_PREFIX,
            "$JS.API.STREAM.INFO.SPEND",
        ] {
            assert!(local(subject), "{subject} would cross between regions");
        }
        assert!(!local(&format!(
            "{}.INFO",
            region_api_prefix(&name("west"))
        )));
    }

    #[test]
    fn a_mismatch_names_the_regions_found() {
        assert_eq!(
            regions_of(&["adspend.regions.west".into(), "other.x".into()]),
            "west,other.x"
        );
    }
}
