//! The stream of region reports, `REGIONS`: each region's own on
//! `adspend.regions.<region>`, the other regions' brought in by NATS.
//!
//! A stand-in until `adspend_common::nats::regions` (the links between
//! regions) lands: it only finds the stream, or creates the shape every
//! region shares on one NATS (subjects `adspend.regions.>`). Swapping it
//! for the real one is this file only.

use adspend_wire::regions::{RegionName, MAX_REPORT_BYTES};
use async_nats::jetstream::{self, stream};

pub(crate) const REGIONS_STREAM: &str = "REGIONS";
/// Reports kept per region: enough for a report split into parts and a
/// few before it (a restarted pacer reads them all back).
const KEPT_PER_SUBJECT: i64 = 16;

/// The subject a region's pacer publishes its reports on.
pub(crate) fn report_subject(region: &RegionName) -> String {
    format!("adspend.regions.{region}")
}

/// The subjects this pacer reads: every region's reports.
pub(crate) const ALL_REPORTS: &str = "adspend.regions.>";

/// The `REGIONS` stream: found, or created with every region's subject.
pub(crate) async fn ensure(
    js: &jetstream::Context,
    _region: &RegionName,
    _peers: &[RegionName],
    replicas: usize,
) -> Result<stream::Stream, String> {
    js.get_or_create_stream(stream::Config {
        name: REGIONS_STREAM.into(),
        subjects: vec![ALL_REPORTS.into()],
        storage: stream::StorageType::File,
        num_replicas: replicas,
        max_messages_per_subject: KEPT_PER_SUBJECT,
        max_message_size: (MAX_REPORT_BYTES + 1024) as i32,
        ..Default::default()
    })
    .await
    .map_err(|e| format!("stream {REGIONS_STREAM}: {e}"))
}
