//! `kvaffined serve`: follow the configured replicas and answer lookups until SIGINT or
//! SIGTERM.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use parking_lot::Mutex;
use tracing::{info, warn};

use crate::config::{EndpointSpec, ServeArgs};
use crate::discovery::{
    ConfigFileSource, Discovery, DnsPeers, DnsReplicas, EventSourcesCache, KvEventSources,
};
use crate::metrics::EndpointLabel;
use crate::state::{Daemon, Endpoint, EndpointStatus};

/// Heap bytes per index entry, the upper end of what `cargo xtask bench daemon` measures
/// (the table doubles at 7/8 load: 19 to 39 bytes).
const INDEX_BYTES_PER_ENTRY: usize = 40;

/// Heap bytes per booked key, rounded up from `cargo xtask bench daemon`'s figure.
const BOOKED_BYTES_PER_KEY: usize = 112;

const MIB: usize = 1 << 20;

/// How often discovery sources are polled.
const DISCOVERY_POLL: Duration = Duration::from_secs(1);

/// Runs the daemon.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let settings = args.settings()?;
    // A followed stream holds about seven descriptors (its sockets, their connections and
    // libzmq's signalling pipes): 7,260 for 1,024 streams (`docs/benchmarks/scale.md`),
    // past the soft limit of 1,024 many hosts start processes with.
    match rlimit::increase_nofile_limit(u64::MAX) {
        Ok(limit) => info!(open_files = limit, "open file limit"),
        Err(err) => warn!("cannot raise the open file limit: {err}"),
    }
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .context("cannot build the HTTP client")?;
    let mut sources: Vec<Box<dyn Discovery>> = Vec::new();
    let event_sources = Arc::new(EventSourcesCache::new(client.clone()));
    let peers = Arc::new(crate::peers::PeerList::new(args.peers.clone()));
    if let Some(path) = &args.config {
        sources.push(Box::new(ConfigFileSource::new(
            path.clone(),
            event_sources.clone(),
            peers.clone(),
        )?));
    }
    if !args.discover.is_empty() {
        sources.push(Box::new(KvEventSources::new(
            args.discover.clone(),
            event_sources.clone(),
        )));
    }
    for name in &args.discover_dns {
        sources.push(Box::new(DnsReplicas::new(name, event_sources.clone())?));
    }
    let peer_names = args
        .peer_dns
        .iter()
        .map(|name| DnsPeers::new(name))
        .collect::<anyhow::Result<Vec<_>>>()?;
    let auth = args
        .auth_token_file
        .as_deref()
        .map(crate::auth::ApiTokens::load)
        .transpose()?;
    info!(
        "memory bound: the index holds at most {} (block, endpoint) entries (about {} MiB at \
         {INDEX_BYTES_PER_ENTRY} bytes each), bookings at most {} keys (about {} MiB), \
         lookups at most {} in flight (the next one gets 503); per replica, at most {} event \
         messages of at most {} bytes queued (a larger one drops the connection)",
        settings.max_entries,
        settings.max_entries.saturating_mul(INDEX_BYTES_PER_ENTRY) / MIB,
        settings.max_booked_keys,
        settings
            .max_booked_keys
            .saturating_mul(BOOKED_BYTES_PER_KEY)
            / MIB,
        settings.max_inflight_lookups,
        crate::ingest::RECEIVE_HWM,
        settings.max_event_message_bytes,
    );
    info!(
        transparent_huge_pages = crate::huge::kernel_mode().as_deref().unwrap_or("unknown"),
        "index tables of 4 MiB or more ask for huge pages"
    );
    let token = auth.as_ref().and_then(crate::auth::ApiTokens::first);
    let daemon = Arc::new(Daemon::with_auth(settings, auth));
    if !args.peers.is_empty() || !peer_names.is_empty() || args.config.is_some() {
        let peering =
            crate::peers::spawn(daemon.clone(), peers.clone(), token.clone(), client.clone());
        let _ = daemon.peers.set(peering);
    }
    let fleet = Fleet {
        peers,
        daemon: daemon.clone(),
        client,
        flag_endpoints: args.endpoints.clone(),
        sources,
        peer_names,
        last_good: Mutex::new(HashMap::new()),
    };
    fleet.refresh(true).await?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let local = listener.local_addr()?;
    info!(listen = %local, endpoints = daemon.endpoints.read().len(), "kvaffined serving");
    // One machine-readable line, so scripts and tests that bind port 0 learn the port.
    println!("listening on {local}");
    if daemon.peers.get().is_some() {
        // The replicas are known now: take what the peers hold, lookups waiting meanwhile
        // (at most RESTORE_GATE; the restore lifts the wait).
        daemon.restoring.send_replace(true);
        tokio::spawn(crate::peers::restore(
            daemon.clone(),
            fleet.peers.clone(),
            local.to_string(),
            token,
            fleet.client.clone(),
        ));
    }
    let speeds = daemon.clone();
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(crate::state::SPEED_REFRESH_GAP);
        loop {
            ticks.tick().await;
            speeds.refresh_stale_speeds(std::time::Instant::now());
        }
    });
    if !fleet.sources.is_empty() || !fleet.peer_names.is_empty() {
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(DISCOVERY_POLL).await;
                if let Err(err) = fleet.refresh(false).await {
                    warn!("endpoints not updated, keeping the current ones: {err:#}");
                }
            }
        });
    }
    let server = axum::serve(listener, crate::http::router(daemon.clone()))
        .with_graceful_shutdown(shutdown_signal());
    server.await.context("HTTP server failed")?;
    for endpoint in daemon.endpoints.read().iter() {
        endpoint.stop.store(true, Ordering::Relaxed);
    }
    info!("kvaffined stopped");
    Ok(())
}

/// Adds and removes followed endpoints to match flags and discovery.
struct Fleet {
    daemon: Arc<Daemon>,
    /// The daemons bookings are shared with (the config file's change with it).
    peers: Arc<crate::peers::PeerList>,
    client: reqwest::Client,
    flag_endpoints: Vec<EndpointSpec>,
    sources: Vec<Box<dyn Discovery>>,
    /// The `--peer-dns` names, resolved on every poll.
    peer_names: Vec<DnsPeers>,
    /// Each source's last successful answer, by source name.
    last_good: Mutex<HashMap<String, Vec<EndpointSpec>>>,
}

impl Fleet {
    /// Polls every source and reconciles. At start-up (`strict`) a failing source is an
    /// error; later it keeps its last good answer.
    async fn refresh(&self, strict: bool) -> anyhow::Result<()> {
        for source in &self.sources {
            match source.discover().await {
                Ok(specs) => {
                    self.last_good.lock().insert(source.name(), specs);
                }
                Err(err) if strict => return Err(err),
                Err(err) => {
                    warn!(source = %source.name(), "discovery failed, keeping its last answer: {err:#}")
                }
            }
        }
        let discovered: Vec<EndpointSpec> =
            self.last_good.lock().values().flatten().cloned().collect();
        if !self.peer_names.is_empty() {
            let mut named = std::collections::BTreeSet::new();
            for name in &self.peer_names {
                named.extend(name.addresses().await);
            }
            self.peers.set_dns(named.into_iter().collect());
        }
        self.daemon
            .metrics
            .peers
            .set(self.peers.current().len() as i64);
        self.reconcile(&discovered).await
    }

    /// Follows exactly `discovered` and the flags' endpoints. Sets, not scans: a
    /// thousand pods polled every second.
    async fn reconcile(&self, discovered: &[EndpointSpec]) -> anyhow::Result<()> {
        let mut wanted: Vec<&EndpointSpec> = Vec::new();
        let mut streams: HashMap<(&str, u32), &EndpointSpec> = HashMap::new();
        for spec in self.flag_endpoints.iter().chain(discovered) {
            match streams.get(&(spec.endpoint.as_str(), spec.rank)) {
                Some(existing) if *existing != spec => bail!(
                    "{} is configured twice, differently ({} and {})",
                    spec.stream_name(),
                    existing.events,
                    spec.events
                ),
                Some(_) => {}
                None => {
                    streams.insert((&spec.endpoint, spec.rank), spec);
                    wanted.push(spec);
                }
            }
        }
        let wanted_specs: HashSet<&EndpointSpec> = wanted.iter().copied().collect();
        let current: Vec<Arc<Endpoint>> = self.daemon.endpoints.read().to_vec();
        let gone: Vec<&Arc<Endpoint>> = current
            .iter()
            .filter(|e| !wanted_specs.contains(&e.spec))
            .collect();
        // Every thread told first, so they stop together, not one poll after another.
        for endpoint in &gone {
            endpoint.stop.store(true, Ordering::Relaxed);
        }
        for endpoint in gone {
            self.remove(endpoint).await;
        }
        let followed: HashSet<&EndpointSpec> = current.iter().map(|e| &e.spec).collect();
        for spec in wanted {
            if !followed.contains(spec) {
                self.add(spec.clone())?;
            }
        }
        Ok(())
    }

    fn add(&self, spec: EndpointSpec) -> anyhow::Result<()> {
        let slot = self.daemon.free_slot().with_context(|| {
            format!(
                "cannot follow {}: one daemon follows at most {} event streams (run one per pool)",
                spec.stream_name(),
                crate::index::MAX_SLOTS
            )
        })?;
        let endpoint = Arc::new(Endpoint {
            label: EndpointLabel {
                endpoint: spec.stream_name(),
            },
            spec,
            slot,
            status: Mutex::new(EndpointStatus {
                alignment: "unknown",
                speed: crate::speed::SpeedLearner::new(
                    self.daemon.settings.speed_flags.cached_token_cost,
                ),
                ..EndpointStatus::default()
            }),
            stop: AtomicBool::new(false),
            ingest: Mutex::new(None),
        });
        self.daemon.metrics.follow(
            &endpoint.label,
            &endpoint.spec.endpoint,
            endpoint.spec.rank == 0,
        );
        let streams = {
            let mut endpoints = self.daemon.endpoints.write();
            let endpoints = Arc::make_mut(&mut endpoints);
            endpoints.push(endpoint.clone());
            endpoints.len()
        };
        self.daemon.index.write().share_among(streams);
        let ingest = crate::ingest::spawn(self.daemon.clone(), endpoint.clone())
            .context("cannot start an ingest thread")?;
        *endpoint.ingest.lock() = Some(ingest);
        // A replica's ranks share one /metrics: its rank-0 stream scrapes it.
        if endpoint.spec.rank == 0 {
            tokio::spawn(crate::scrape::run(
                self.daemon.clone(),
                endpoint,
                self.client.clone(),
            ));
        }
        Ok(())
    }

    /// Stops following `endpoint` and frees its slot. Its ingest thread may be applying a
    /// batch right now: it is joined before the slot's blocks are purged, so nothing it
    /// applies late can count for the next endpoint given the slot.
    async fn remove(&self, endpoint: &Arc<Endpoint>) {
        info!(endpoint = %endpoint.label.endpoint, "no longer configured: purging its blocks");
        endpoint.stop.store(true, Ordering::Relaxed);
        let streams = {
            let mut endpoints = self.daemon.endpoints.write();
            let endpoints = Arc::make_mut(&mut endpoints);
            endpoints.retain(|e| !Arc::ptr_eq(e, endpoint));
            endpoints.len()
        };
        let ingest = endpoint.ingest.lock().take();
        if let Some(ingest) = ingest {
            if tokio::task::spawn_blocking(move || ingest.join())
                .await
                .is_err()
            {
                warn!(endpoint = %endpoint.label.endpoint, "its ingest thread could not be joined");
            }
        }
        {
            let mut index = self.daemon.index.write();
            index.purge(endpoint.slot);
            index.share_among(streams);
        }
        self.daemon.bookings.write().forget_slot(endpoint.slot);
        self.daemon.backlogs.lock().forget_slot(endpoint.slot);
        self.daemon.history.write().forget_slot(endpoint.slot);
        let metrics = &self.daemon.metrics;
        metrics.incomplete.remove(&endpoint.label);
        metrics.misconfigured.remove(&endpoint.label);
        metrics.kv_cache_unsupported.remove(&endpoint.label);
        // Its speed leaves the fleet's median; its series go with its last stream.
        self.daemon.forget_speed(endpoint.slot);
        let replica = crate::metrics::EndpointLabel {
            endpoint: endpoint.spec.endpoint.clone(),
        };
        let others = self
            .daemon
            .endpoints
            .read()
            .iter()
            .any(|e| e.spec.endpoint == endpoint.spec.endpoint);
        if !others {
            metrics.prefill_tokens_per_second.remove(&replica);
            metrics.prefill_overhead_seconds.remove(&replica);
            metrics.prefill_cached_token_cost.remove(&replica);
            metrics.prefill_context_cost.remove(&replica);
        }
        self.daemon.refresh_speeds(std::time::Instant::now());
    }
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = interrupt => {},
        _ = terminate => {},
    }
}
