//! `kvaffined serve`: follow the configured replicas and answer lookups until SIGINT or
//! SIGTERM.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use anyhow::{Context, bail};
use parking_lot::Mutex;
use tracing::{info, warn};

use crate::config::{ConfigFile, EndpointSpec, ServeArgs};
use crate::metrics::EndpointLabel;
use crate::state::{Daemon, Endpoint, EndpointStatus};

/// How often the config file is checked for changes.
const CONFIG_POLL: Duration = Duration::from_secs(1);

/// Runs the daemon.
pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let settings = args.settings()?;
    let file_endpoints = match &args.config {
        Some(path) => read_config(path)?.endpoints,
        None => Vec::new(),
    };
    let daemon = Arc::new(Daemon::new(settings));
    let client = reqwest::Client::builder()
        .no_proxy()
        .build()
        .context("cannot build the metrics client")?;
    let fleet = Fleet {
        daemon: daemon.clone(),
        client,
        flag_endpoints: args.endpoints.clone(),
    };
    fleet.reconcile(&file_endpoints)?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("cannot listen on {}", args.listen))?;
    let local = listener.local_addr()?;
    info!(listen = %local, endpoints = daemon.endpoints.read().len(), "kvaffined serving");
    // One machine-readable line, so scripts and tests that bind port 0 learn the port.
    println!("listening on {local}");
    if let Some(path) = args.config.clone() {
        tokio::spawn(watch_config(fleet.clone(), path));
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

fn read_config(path: &PathBuf) -> anyhow::Result<ConfigFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    ConfigFile::parse(&text).with_context(|| format!("invalid {}", path.display()))
}

/// Adds and removes followed endpoints to match the configuration.
#[derive(Clone)]
struct Fleet {
    daemon: Arc<Daemon>,
    client: reqwest::Client,
    flag_endpoints: Vec<EndpointSpec>,
}

impl Fleet {
    fn reconcile(&self, file_endpoints: &[EndpointSpec]) -> anyhow::Result<()> {
        let mut wanted: Vec<EndpointSpec> = Vec::new();
        let mut names = HashSet::new();
        for spec in self.flag_endpoints.iter().chain(file_endpoints) {
            if !names.insert(spec.endpoint.clone()) {
                if !wanted.contains(spec) {
                    bail!(
                        "endpoint {} is configured twice, differently",
                        spec.endpoint
                    );
                }
                continue;
            }
            wanted.push(spec.clone());
        }
        let current: Vec<Arc<Endpoint>> = self.daemon.endpoints.read().clone();
        for endpoint in current.iter().filter(|e| !wanted.contains(&e.spec)) {
            self.remove(endpoint);
        }
        for spec in wanted {
            if !current.iter().any(|e| e.spec == spec) {
                self.add(spec)?;
            }
        }
        Ok(())
    }

    fn add(&self, spec: EndpointSpec) -> anyhow::Result<()> {
        let slot = self.daemon.free_slot().with_context(|| {
            format!(
                "cannot follow {}: one daemon follows at most {} endpoints (run one per pool)",
                spec.endpoint,
                crate::index::MAX_SLOTS
            )
        })?;
        let endpoint = Arc::new(Endpoint {
            label: EndpointLabel {
                endpoint: spec.endpoint.clone(),
            },
            spec,
            slot,
            status: Mutex::new(EndpointStatus {
                alignment: "unknown",
                ..EndpointStatus::default()
            }),
            stop: AtomicBool::new(false),
        });
        self.daemon.endpoints.write().push(endpoint.clone());
        crate::ingest::spawn(self.daemon.clone(), endpoint.clone())
            .context("cannot start an ingest thread")?;
        tokio::spawn(crate::scrape::run(
            self.daemon.clone(),
            endpoint,
            self.client.clone(),
        ));
        Ok(())
    }

    fn remove(&self, endpoint: &Arc<Endpoint>) {
        info!(endpoint = %endpoint.spec.endpoint, "no longer configured: purging its blocks");
        endpoint.stop.store(true, Ordering::Relaxed);
        self.daemon
            .endpoints
            .write()
            .retain(|e| !Arc::ptr_eq(e, endpoint));
        self.daemon.index.write().purge(endpoint.slot);
        self.daemon.bookings.lock().forget_slot(endpoint.slot);
        let metrics = &self.daemon.metrics;
        metrics.incomplete.remove(&endpoint.label);
        metrics.misconfigured.remove(&endpoint.label);
    }
}

async fn watch_config(fleet: Fleet, path: PathBuf) {
    let modified = |p: &PathBuf| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let mut seen: Option<SystemTime> = modified(&path);
    loop {
        tokio::time::sleep(CONFIG_POLL).await;
        let now = modified(&path);
        if now == seen {
            continue;
        }
        seen = now;
        match read_config(&path).and_then(|file| fleet.reconcile(&file.endpoints)) {
            Ok(()) => info!(path = %path.display(), "config reloaded"),
            Err(err) => warn!("config not reloaded, keeping the current endpoints: {err:#}"),
        }
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
