//! What every request handler shares: the catalog, the spend state, the
//! sources' reports, the recent alerts and the request bounds.

use std::sync::Arc;

use adspend_wire::catalog::Catalog;
use tokio::sync::{watch, RwLock};

use crate::input::sources::SourceReports;
use crate::pacing::state::SpendState;

#[derive(Clone)]
pub struct AppState {
    pub catalog: watch::Receiver<Arc<Catalog>>,
    pub spend: Arc<RwLock<SpendState>>,
    /// The limiters' latest per-source reports.
    pub sources: Arc<std::sync::Mutex<SourceReports>>,
    /// The newest budget alerts ([`crate::alerts::recent`]).
    pub alerts: crate::alerts::Recent,
    /// Most ad ids in one decisions request (ADSPEND_PACER_MAX_DECISION_IDS).
    pub max_decision_ids: usize,
    /// The spend leases; `None` only in tests that need no NATS.
    pub leases: Option<crate::leases::Leases>,
    /// The allotments across regions; `None` in one region.
    pub regions: Option<crate::regions::Regions>,
}
