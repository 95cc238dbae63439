//! The stream of region reports, `REGIONS`, as `adspend_common::nats::regions`
//! keeps it: this region's own reports on `adspend.regions.<region>`, the
//! other regions' sourced in through the links (or, on one NATS shared by
//! every region, all of `adspend.regions.>` in one stream).

use adspend_common::nats::regions::{ensure_regions_stream, region_report_subject};
use adspend_wire::regions::RegionName;
use async_nats::jetstream::{self, stream};

pub(crate) use adspend_common::nats::regions::{
    regions_sources, resume_stalled_sources, REGIONS_STREAM,
};

/// The subject a region's pacer publishes its reports on.
pub(crate) fn report_subject(region: &RegionName) -> String {
    region_report_subject(region)
}

/// This region's `REGIONS` stream, created or brought up to date.
pub(crate) async fn ensure(
    js: &jetstream::Context,
    region: &RegionName,
    peers: &[RegionName],
    replicas: usize,
) -> Result<stream::Stream, adspend_common::Error> {
    ensure_regions_stream(js, region, peers, replicas).await
}
