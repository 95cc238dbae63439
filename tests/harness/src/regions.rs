//! Three regions linked through NATS, as docs/REGIONS.md ("Topology")
//! describes them: per region one JetStream server, its own JetStream
//! domain named after the region, connected as a leaf node to the region's
//! *hub*; the three hubs are plain core-NATS servers (no JetStream, so no
//! quorum to lose) in one cluster with a route between every two.
//!
//! Every route goes through a [`RouteProxy`] in the test process, one per
//! direction and pair of hubs, so [`RegionsNats::cut`] can sever one
//! region's hub from the others while the region's leaf link stays up.
//! The hubs advertise no route, client or leaf address that bypasses the
//! proxies: a region's leaf node that knows another hub's leaf port
//! reconnects there within a second of its own hub being cut (seen when
//! the hubs advertised them), and a hub that learned another's real route
//! address could dial it around the proxy.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU16, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use adspend_common::nats::regions::REGION_LOCAL_SUBJECTS;
use anyhow::{ensure, Context};
use tempfile::TempDir;

use super::nats::{NatsOptions, NatsServer};
use super::ports::free_port;
use super::process::clean_env;
use super::route_proxy::RouteProxy;
use super::scratch::scratch_dir;
use super::server::{Server, ServerSpec};
use super::tools::tool_path;
use super::wait::{accepts_tcp, http_client, wait_until_ok};

/// The regions, in the order every accessor's index follows.
pub const REGION_NAMES: [&str; 3] = ["east", "west", "south"];

/// How long [`RegionsNats`] waits for links to form.
const LINK_TIMEOUT: Duration = Duration::from_secs(30);

/// A core-NATS hub: no JetStream, a cluster port reached only through
/// route proxies, a leaf-node port for its region's JetStream server.
pub type Hub = Server<HubSpec>;

/// The three regions and their hubs. Everything is killed on `Drop`.
pub struct RegionsNats {
    /// By region, in [`REGION_NAMES`] order; declared first so the servers
    /// are gone before their hubs and proxies.
    servers: Vec<NatsServer>,
    hubs: Vec<Hub>,
    routes: Vec<Route>,
}

/// The proxy a route from hub `from` to hub `to` is dialled through.
struct Route {
    from: usize,
    to: usize,
    proxy: RouteProxy,
}

impl RegionsNats {
    /// Starts the hubs, then the regions' JetStream servers, and returns
    /// once every region reaches every other region's JetStream API.
    ///
    /// # Panics
    ///
    /// If a server does not start or the links do not form within 30 s.
    pub async fn start() -> RegionsNats {
        let cluster_ports: Vec<Arc<AtomicU16>> = REGION_NAMES
            .iter()
            .map(|_| Arc::new(AtomicU16::new(0)))
            .collect();
        let mut routes = Vec::new();
        for from in 0..REGION_NAMES.len() {
            for to in (0..REGION_NAMES.len()).filter(|to| *to != from) {
                let proxy = RouteProxy::start(Arc::clone(&cluster_ports[to])).await;
                routes.push(Route { from, to, proxy });
            }
        }
        let mut hubs = Vec::new();
        for (index, region) in REGION_NAMES.iter().enumerate() {
            let dial: Vec<u16> = routes
                .iter()
                .filter(|route| route.from == index)
                .map(|route| route.proxy.port())
                .collect();
            let spec = HubSpec::new(region, Arc::clone(&cluster_ports[index]), dial);
            hubs.push(Server::launch(spec).await);
        }
        let mut servers = Vec::new();
        for (region, hub) in REGION_NAMES.iter().zip(&hubs) {
            servers.push(NatsServer::start_with(region_options(region, hub)).await);
        }
        let regions = RegionsNats {
            servers,
            hubs,
            routes,
        };
        regions
            .wait_linked(LINK_TIMEOUT)
            .await
            .unwrap_or_else(|err| panic!("{err:#}"));
        regions
    }

    pub fn names(&self) -> [&'static str; 3] {
        REGION_NAMES
    }

    /// `region`'s JetStream server.
    ///
    /// # Panics
    ///
    /// If `region` is not one of [`REGION_NAMES`].
    pub fn server(&self, region: &str) -> &NatsServer {
        &self.servers[index(region)]
    }

    /// The client URL of `region`'s JetStream server; stable across
    /// restarts.
    pub fn url(&self, region: &str) -> String {
        self.server(region).url()
    }

    /// `region`'s hub.
    pub fn hub(&self, region: &str) -> &Hub {
        &self.hubs[index(region)]
    }

    /// Severs every route of `region`'s hub to the other hubs, both ways;
    /// the region inside (its server, its leaf link, its hub) stays whole.
    pub fn cut(&self, region: &str) {
        self.routes_of(region).for_each(RouteProxy::cut);
    }

    /// Undoes [`RegionsNats::cut`]; the hubs dial again within about a
    /// second.
    pub fn heal(&self, region: &str) {
        self.routes_of(region).for_each(RouteProxy::heal);
    }

    fn routes_of(&self, region: &str) -> impl Iterator<Item = &RouteProxy> {
        let at = index(region);
        self.routes
            .iter()
            .filter(move |route| route.from == at || route.to == at)
            .map(|route| &route.proxy)
    }

    /// Crashes `region`'s JetStream server (SIGKILL).
    pub fn kill_region(&mut self, region: &str) {
        self.servers[index(region)].kill();
    }

    /// Starts `region`'s JetStream server again, same ports and store.
    pub async fn restart_region(&mut self, region: &str) {
        self.servers[index(region)].restart().await;
    }

    /// Crashes `region`'s hub (SIGKILL): the region is cut off until
    /// [`RegionsNats::restart_hub`].
    pub fn kill_hub(&mut self, region: &str) {
        self.hubs[index(region)].kill();
    }

    /// Starts `region`'s hub again on the same ports.
    pub async fn restart_hub(&mut self, region: &str) {
        self.hubs[index(region)].restart().await;
    }

    /// Waits until every region's JetStream API answers from every other
    /// region: the leaf links and the routes between hubs are up and
    /// interest has spread.
    ///
    /// # Errors
    ///
    /// If some region still cannot reach another after `timeout`.
    pub async fn wait_linked(&self, timeout: Duration) -> anyhow::Result<()> {
        for (from, server) in REGION_NAMES.iter().zip(&self.servers) {
            let client = async_nats::connect(server.url())
                .await
                .with_context(|| format!("connect to region {from}"))?;
            for to in REGION_NAMES {
                let subject = format!("$JS.{to}.API.INFO");
                wait_until_ok(timeout, Duration::from_millis(100), || {
                    let (client, subject) = (client.clone(), subject.clone());
                    async move {
                        let request = client.request(subject.clone(), "".into());
                        let reply = tokio::time::timeout(Duration::from_secs(1), request)
                            .await
                            .with_context(|| format!("{subject}: no answer"))??;
                        ensure!(!reply.payload.is_empty(), "{subject}: empty answer");
                        Ok(())
                    }
                })
                .await
                .with_context(|| format!("region {from} reaching region {to}'s JetStream"))?;
            }
        }
        Ok(())
    }
}

/// # Panics
///
/// If `region` is not one of [`REGION_NAMES`].
fn index(region: &str) -> usize {
    REGION_NAMES
        .iter()
        .position(|name| *name == region)
        .unwrap_or_else(|| panic!("no region {region:?}; the regions are {REGION_NAMES:?}"))
}

/// A region's JetStream server: its own domain, a leaf node of its hub
/// that lets none of the region's own subjects through
/// ([`REGION_LOCAL_SUBJECTS`]).
fn region_options(region: &str, hub: &Hub) -> NatsOptions {
    let local = REGION_LOCAL_SUBJECTS.map(|s| format!("{s:?}")).join(", ");
    NatsOptions {
        jetstream_domain: Some(region.to_string()),
        extra_config: format!(
            "leafnodes {{\n  remotes: [ {{\n    url: \"nats-leaf://127.0.0.1:{}\"\n    \
             deny_exports: [ {local} ]\n    deny_imports: [ {local} ]\n  }} ]\n}}\n",
            hub.spec().leaf_port
        ),
        ..NatsOptions::default()
    }
}

/// How a [`Hub`] starts and probes its `nats-server`.
pub struct HubSpec {
    binary: PathBuf,
    /// Unique, so the probe can tell this server from one that took its port.
    server_name: String,
    config_path: PathBuf,
    log_path: PathBuf,
    port: u16,
    monitor_port: u16,
    /// Shared with the proxies that lead here.
    cluster_port: Arc<AtomicU16>,
    leaf_port: u16,
    /// The proxies this hub dials to reach the other hubs.
    routes: Vec<u16>,
    /// Advertised as the route address: no one listens there, so a hub
    /// that learns of this one from a third only ever reaches it through
    /// a proxy of its own.
    nowhere: u16,
    /// Owns everything above; last so it is removed last.
    _dir: TempDir,
}

impl HubSpec {
    fn new(region: &str, cluster_port: Arc<AtomicU16>, routes: Vec<u16>) -> HubSpec {
        static HUBS: AtomicU32 = AtomicU32::new(0);
        let dir = scratch_dir("hub");
        HubSpec {
            binary: tool_path("nats-server"),
            server_name: format!(
                "adspend-hub-{region}-{}-{}",
                std::process::id(),
                HUBS.fetch_add(1, Ordering::Relaxed)
            ),
            config_path: dir.path().join("hub.conf"),
            log_path: dir.path().join("nats-server.log"),
            port: 0,
            monitor_port: 0,
            cluster_port,
            leaf_port: 0,
            routes,
            nowhere: free_port(),
            _dir: dir,
        }
    }

    fn config(&self) -> String {
        let routes: Vec<String> = self
            .routes
            .iter()
            .map(|port| format!("\"nats-route://127.0.0.1:{port}\""))
            .collect();
        format!(
            "server_name: {name:?}\n\
             listen: \"127.0.0.1:{port}\"\n\
             http: \"127.0.0.1:{monitor}\"\n\
             max_payload: 8MB\n\
             cluster {{\n  name: \"adspend-hubs\"\n  listen: \"127.0.0.1:{cluster}\"\n  \
             advertise: \"127.0.0.1:{nowhere}\"\n  no_advertise: true\n  \
             routes: [ {routes} ]\n}}\n\
             leafnodes {{\n  listen: \"127.0.0.1:{leaf}\"\n  no_advertise: true\n}}\n",
            name = self.server_name,
            port = self.port,
            monitor = self.monitor_port,
            cluster = self.cluster_port.load(Ordering::Relaxed),
            nowhere = self.nowhere,
            routes = routes.join(", "),
            leaf = self.leaf_port,
        )
    }

    async fn serves(&self) -> bool {
        if !accepts_tcp(self.port).await {
            return false;
        }
        let varz = format!("http://127.0.0.1:{}/varz", self.monitor_port);
        let Ok(response) = http_client().get(&varz).send().await else {
            return false;
        };
        let Ok(varz) = response.json::<serde_json::Value>().await else {
            return false;
        };
        varz["server_name"] == self.server_name.as_str()
    }
}

impl ServerSpec for HubSpec {
    const NAME: &'static str = "nats-server (hub)";

    fn pick_ports(&mut self) {
        self.port = free_port();
        self.monitor_port = free_port();
        self.leaf_port = free_port();
        self.cluster_port.store(free_port(), Ordering::Relaxed);
        let config = self.config();
        std::fs::write(&self.config_path, config)
            .unwrap_or_else(|err| panic!("write {}: {err}", self.config_path.display()));
    }

    fn port(&self) -> u16 {
        self.port
    }

    fn command(&self) -> Command {
        let mut command = Command::new(&self.binary);
        clean_env(&mut command);
        command.arg("--config").arg(&self.config_path);
        command
    }

    fn log_path(&self) -> &Path {
        &self.log_path
    }

    fn probe(&self) -> impl Future<Output = bool> + '_ {
        self.serves()
    }
}

impl Server<HubSpec> {
    /// The hub's client URL (tests mostly use the regions' servers).
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port())
    }
}
