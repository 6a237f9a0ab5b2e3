//! Where the endpoints to follow come from. Every source implements [`Discovery`]; the
//! serve loop unions them and reconciles. A source that fails keeps its last good answer,
//! so a transient error never purges a replica.

use std::collections::BTreeMap;
use std::collections::BTreeSet;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use kvaffine_core::events::offset_endpoint_for_rank;
use serde::Deserialize;

use crate::config::{ConfigFile, EndpointSpec};

/// A boxed future, so sources can be held as trait objects.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A source of endpoints to follow.
pub trait Discovery: Send + Sync {
    /// A short name for logs.
    fn name(&self) -> String;
    /// The endpoints this source wants followed now.
    fn discover(&self) -> BoxFuture<'_, anyhow::Result<Vec<EndpointSpec>>>;
}

/// The `--config` file, whose `endpoints` are followed and whose `discover` replicas are
/// asked for their event sources.
pub struct ConfigFileSource {
    path: PathBuf,
    sources: Arc<EventSourcesCache>,
    /// Where the file's `peers` go.
    peers: Arc<crate::peers::PeerList>,
    last: parking_lot::Mutex<Option<(Option<SystemTime>, ConfigFile)>>,
}

impl ConfigFileSource {
    /// Reads `path` now, failing if it is absent or invalid: a bad file at start-up is an
    /// error, a bad edit later keeps the previous endpoints.
    pub fn new(
        path: PathBuf,
        sources: Arc<EventSourcesCache>,
        peers: Arc<crate::peers::PeerList>,
    ) -> anyhow::Result<Self> {
        let source = Self {
            path,
            sources,
            peers,
            last: parking_lot::Mutex::new(None),
        };
        source.read()?;
        Ok(source)
    }

    fn read(&self) -> anyhow::Result<ConfigFile> {
        let text = std::fs::read_to_string(&self.path)
            .with_context(|| format!("cannot read {}", self.path.display()))?;
        ConfigFile::parse(&text).with_context(|| format!("invalid {}", self.path.display()))
    }

    fn current(&self) -> anyhow::Result<(Vec<EndpointSpec>, Vec<String>)> {
        let modified = std::fs::metadata(&self.path)
            .and_then(|m| m.modified())
            .ok();
        let mut last = self.last.lock();
        let stale = last.as_ref().is_none_or(|(seen, _)| *seen != modified);
        if stale {
            let file = self.read()?;
            tracing::info!(path = %self.path.display(), endpoints = file.endpoints.len(), peers = file.peers.len(), "config read");
            self.peers.set_file(file.peers.clone());
            *last = Some((modified, file));
        }
        Ok(last
            .as_ref()
            .map(|(_, f)| (f.endpoints.clone(), f.discover.clone()))
            .unwrap_or_default())
    }
}

impl Discovery for ConfigFileSource {
    fn name(&self) -> String {
        self.path.display().to_string()
    }

    fn discover(&self) -> BoxFuture<'_, anyhow::Result<Vec<EndpointSpec>>> {
        Box::pin(async move {
            let (mut endpoints, replicas) = self.current()?;
            for replica in replicas {
                endpoints.extend(self.sources.get(&replica).await?);
            }
            Ok(endpoints)
        })
    }
}

/// Replicas named by `--discover`, asked for their `/kv_event_sources`.
pub struct KvEventSources {
    replicas: Vec<String>,
    sources: Arc<EventSourcesCache>,
}

impl KvEventSources {
    /// Asks each of `replicas` (`HOST:PORT`).
    pub fn new(replicas: Vec<String>, sources: Arc<EventSourcesCache>) -> Self {
        Self { replicas, sources }
    }
}

impl Discovery for KvEventSources {
    fn name(&self) -> String {
        format!("/kv_event_sources of {}", self.replicas.join(", "))
    }

    fn discover(&self) -> BoxFuture<'_, anyhow::Result<Vec<EndpointSpec>>> {
        Box::pin(async move {
            let mut endpoints = Vec::new();
            for replica in &self.replicas {
                endpoints.extend(self.sources.get(replica).await?);
            }
            Ok(endpoints)
        })
    }
}

/// A DNS name whose addresses are the replicas (a Kubernetes headless Service), resolved
/// on every poll; every address is asked for its `/kv_event_sources`, all at once. The
/// IPv4 addresses are followed when the name has any, else the IPv6 ones (as Envoy's
/// `V4_PREFERRED` pool does), so a dual-stack pod is followed once. An address in DNS that
/// does not answer keeps its last answer (a pod busy or restarting); one that never
/// answered is not followed, and is logged once. When the name does not resolve (a DNS
/// outage, or a Service with no ready pod), only the known replicas that still answer are
/// kept.
pub struct DnsReplicas {
    host: String,
    port: u16,
    resolver: Box<dyn Resolve>,
    sources: Arc<EventSourcesCache>,
    known: parking_lot::Mutex<BTreeMap<String, Vec<EndpointSpec>>>,
    warned: parking_lot::Mutex<BTreeSet<String>>,
}

/// Resolves a name to addresses: the system's resolver, or a simulated one in tests and
/// benchmarks of a fleet larger than a machine can run.
pub trait Resolve: Send + Sync {
    /// The addresses of `host`, each with `port`.
    fn resolve<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> BoxFuture<'a, std::io::Result<Vec<std::net::SocketAddr>>>;
}

/// The system's resolver (`getaddrinfo`, as every process on the host resolves).
pub struct SystemResolver;

impl Resolve for SystemResolver {
    fn resolve<'a>(
        &'a self,
        host: &'a str,
        port: u16,
    ) -> BoxFuture<'a, std::io::Result<Vec<std::net::SocketAddr>>> {
        Box::pin(async move { Ok(tokio::net::lookup_host((host, port)).await?.collect()) })
    }
}

impl DnsReplicas {
    /// Follows the addresses of `name` (`HOST:PORT`, the replicas' HTTP port).
    pub fn new(name: &str, sources: Arc<EventSourcesCache>) -> anyhow::Result<Self> {
        Self::with_resolver(name, sources, Box::new(SystemResolver))
    }

    /// [`new`](Self::new), resolving through `resolver`.
    pub fn with_resolver(
        name: &str,
        sources: Arc<EventSourcesCache>,
        resolver: Box<dyn Resolve>,
    ) -> anyhow::Result<Self> {
        let (host, port) = dns_name("--discover-dns", name)?;
        Ok(Self {
            host,
            port,
            resolver,
            sources,
            known: parking_lot::Mutex::new(BTreeMap::new()),
            warned: parking_lot::Mutex::new(BTreeSet::new()),
        })
    }

    /// The addresses to follow now, and whether they come from DNS (false: from memory,
    /// the name did not resolve).
    async fn addresses(&self) -> (BTreeSet<String>, bool) {
        match self.resolver.resolve(&self.host, self.port).await {
            Ok(all) => (one_family(&all), true),
            Err(err) => {
                tracing::warn!(name = %self.host, "does not resolve, keeping the known replicas that answer: {err}");
                (self.known.lock().keys().cloned().collect(), false)
            }
        }
    }
}

impl Discovery for DnsReplicas {
    fn name(&self) -> String {
        format!("DNS {}:{}", self.host, self.port)
    }

    fn discover(&self) -> BoxFuture<'_, anyhow::Result<Vec<EndpointSpec>>> {
        Box::pin(async move {
            let (addresses, in_dns) = self.addresses().await;
            let mut probes = tokio::task::JoinSet::new();
            // A thousand pods are asked a few dozen at a time, not in one burst.
            let permits = Arc::new(tokio::sync::Semaphore::new(PROBES_AT_ONCE));
            for address in addresses {
                let (sources, permits) = (self.sources.clone(), permits.clone());
                probes.spawn(async move {
                    let _permit = permits.acquire_owned().await;
                    let answer = sources.get(&address).await;
                    (address, answer)
                });
            }
            let mut answers = BTreeMap::new();
            while let Some(probe) = probes.join_next().await {
                let Ok((address, answer)) = probe else {
                    continue;
                };
                match answer {
                    Ok(specs) => {
                        self.warned.lock().remove(&address);
                        answers.insert(address, specs);
                    }
                    Err(err) => {
                        let known = self.known.lock().get(&address).cloned();
                        match known.filter(|_| in_dns) {
                            Some(specs) => {
                                tracing::warn!(%address, "no answer, keeping its endpoints: {err:#}");
                                answers.insert(address, specs);
                            }
                            None if self.warned.lock().insert(address.clone()) => {
                                tracing::warn!(%address, "not followed until it answers /kv_event_sources (vLLM >= 0.31 with KV events on): {err:#}");
                            }
                            None => {}
                        }
                    }
                }
            }
            let specs = answers.values().flatten().cloned().collect();
            *self.known.lock() = answers;
            Ok(specs)
        })
    }
}

/// `NAME:PORT` as `flag` takes it.
fn dns_name(flag: &str, name: &str) -> anyhow::Result<(String, u16)> {
    name.rsplit_once(':')
        .and_then(|(h, p)| Some((h, p.parse::<u16>().ok()?)))
        .filter(|(h, _)| !h.is_empty())
        .map(|(h, p)| (h.to_owned(), p))
        .with_context(|| format!("{flag} {name:?}: expected NAME:PORT"))
}

/// The IPv4 addresses of a name's answer when it has any, else its IPv6 ones (as Envoy's
/// `V4_PREFERRED` pool does), so a dual-stack pod counts once.
fn one_family(all: &[std::net::SocketAddr]) -> BTreeSet<String> {
    let v4 = all.iter().any(std::net::SocketAddr::is_ipv4);
    all.iter()
        .filter(|a| a.is_ipv4() == v4)
        .map(ToString::to_string)
        .collect()
}

/// A DNS name whose addresses are peer daemons (a Kubernetes headless Service of the
/// gateway pods, on kvaffined's API port; `--peer-dns`), resolved on every poll. The
/// answer holds this daemon too: it leaves itself out when it finds itself
/// ([`PeerList::itself`](crate::peers::PeerList::itself)). When the name does not
/// resolve, the last answer stands (peers are only ever asked to hold bookings).
pub struct DnsPeers {
    host: String,
    port: u16,
    resolver: Box<dyn Resolve>,
    last: parking_lot::Mutex<BTreeSet<String>>,
}

impl DnsPeers {
    /// Follows the addresses of `name` (`HOST:PORT`, the daemons' API port).
    pub fn new(name: &str) -> anyhow::Result<Self> {
        Self::with_resolver(name, Box::new(SystemResolver))
    }

    /// [`new`](Self::new), resolving through `resolver`.
    pub fn with_resolver(name: &str, resolver: Box<dyn Resolve>) -> anyhow::Result<Self> {
        let (host, port) = dns_name("--peer-dns", name)?;
        Ok(Self {
            host,
            port,
            resolver,
            last: parking_lot::Mutex::new(BTreeSet::new()),
        })
    }

    /// The peers' addresses now: the name's answer, or the last one if it does not
    /// resolve.
    pub async fn addresses(&self) -> BTreeSet<String> {
        match self.resolver.resolve(&self.host, self.port).await {
            Ok(all) => {
                let chosen = one_family(&all);
                *self.last.lock() = chosen.clone();
                chosen
            }
            Err(err) => {
                tracing::warn!(name = %self.host, "does not resolve, keeping the peers it named: {err}");
                self.last.lock().clone()
            }
        }
    }
}

/// How long a replica's `/kv_event_sources` answer is reused. Event endpoints change only
/// when vLLM restarts with other settings (the stream's restart detection sees that
/// meanwhile), while asking on every one-second poll would cost the replicas one request
/// per replica per daemon per second: with a daemon beside every gateway pod, thousands.
/// Each replica's answer lasts between 3/4 and 5/4 of it, by a hash of its address, so a
/// fleet found at once is asked again spread over 15 s, not in one burst every 30 s.
const SOURCES_FRESH_FOR: Duration = Duration::from_secs(30);

/// `/kv_event_sources` requests a discovery poll has in flight at once.
const PROBES_AT_ONCE: usize = 32;

/// How long `replica`'s answer is reused: [`SOURCES_FRESH_FOR`], spread by its address.
fn fresh_for(replica: &str) -> Duration {
    SOURCES_FRESH_FOR.mul_f64(0.75 + spread(replica) / 2.0)
}

/// A fraction in (0, 1] fixed by `address`: periodic work for a fleet followed at once
/// (asking for its event sources, scraping it) is spread over its period by it instead
/// of running in one burst.
pub fn spread(address: &str) -> f64 {
    let hash = std::hash::BuildHasher::hash_one(&foldhash::fast::FixedState::default(), address);
    (1 + hash % 1024) as f64 / 1024.0
}

/// Replicas' `/kv_event_sources` answers, shared by every discovery source and asked
/// again once older than [`SOURCES_FRESH_FOR`].
pub struct EventSourcesCache {
    client: reqwest::Client,
    answers: parking_lot::Mutex<BTreeMap<String, (Instant, Vec<EndpointSpec>)>>,
}

impl EventSourcesCache {
    /// An empty cache asking through `client`.
    pub fn new(client: reqwest::Client) -> Self {
        Self {
            client,
            answers: parking_lot::Mutex::new(BTreeMap::new()),
        }
    }

    /// `replica`'s event endpoints, asked if not known or stale.
    pub async fn get(&self, replica: &str) -> anyhow::Result<Vec<EndpointSpec>> {
        let fresh = self
            .answers
            .lock()
            .get(replica)
            .filter(|(at, _)| at.elapsed() < fresh_for(replica))
            .map(|(_, specs)| specs.clone());
        if let Some(specs) = fresh {
            return Ok(specs);
        }
        let specs = event_sources(&self.client, replica).await?;
        let mut answers = self.answers.lock();
        // Pods come and go under new addresses: forget answers long unused.
        answers.retain(|_, (at, _)| at.elapsed() < SOURCES_FRESH_FOR * 4);
        answers.insert(replica.to_owned(), (Instant::now(), specs.clone()));
        Ok(specs)
    }
}

/// The part of vLLM's `KVEventsConfig` that discovery reads.
#[derive(Debug, Deserialize)]
pub struct EventSource {
    /// PUB endpoint (possibly a wildcard bind address).
    pub endpoint: String,
    /// Replay endpoint, if any.
    #[serde(default)]
    pub replay_endpoint: Option<String>,
    /// Whether events are on at all.
    #[serde(default = "enabled")]
    pub enable_kv_cache_events: bool,
    /// `zmq` or `null`.
    #[serde(default)]
    pub publisher: Option<String>,
}

fn enabled() -> bool {
    true
}

async fn event_sources(
    client: &reqwest::Client,
    replica: &str,
) -> anyhow::Result<Vec<EndpointSpec>> {
    let url = format!("http://{replica}/kv_event_sources");
    let sources: BTreeMap<String, EventSource> = client
        .get(&url)
        .timeout(std::time::Duration::from_secs(2))
        .send()
        .await
        .with_context(|| format!("GET {url}"))?
        .error_for_status()
        .with_context(|| {
            format!(
                "{replica} does not name its event endpoints (vLLM publishes /kv_event_sources from 0.31 on; for an older replica give --endpoint {replica}=tcp://HOST:EVENTS_PORT,tcp://HOST:REPLAY_PORT)"
            )
        })?
        .json()
        .await
        .with_context(|| format!("{url} is not a map of KVEventsConfig by rank"))?;
    resolve_sources(replica, &sources)
}

/// Turns a replica's `{dp_rank: KVEventsConfig}` into followable endpoints: wildcard bind
/// hosts become the replica's host, and when every rank reports the same (unshifted)
/// endpoint, each rank's port is shifted the way vLLM shifts it.
pub fn resolve_sources(
    replica: &str,
    sources: &BTreeMap<String, EventSource>,
) -> anyhow::Result<Vec<EndpointSpec>> {
    let host = replica
        .rsplit_once(':')
        .map(|(h, _)| h)
        .context("replica must be HOST:PORT")?;
    let unshifted = sources.len() > 1
        && sources.values().all(|s| {
            sources
                .values()
                .next()
                .is_some_and(|f| f.endpoint == s.endpoint)
        });
    let localize = |url: &str| {
        url.replace("://*:", &format!("://{host}:"))
            .replace("://[::]:", &format!("://{host}:"))
    };
    let mut out = Vec::new();
    for (rank, source) in sources {
        if !source.enable_kv_cache_events || source.publisher.as_deref() == Some("null") {
            continue;
        }
        let rank: u32 = rank
            .parse()
            .with_context(|| format!("{replica}: rank {rank:?} is not a number"))?;
        let shift = |url: &str| -> anyhow::Result<String> {
            Ok(if unshifted {
                offset_endpoint_for_rank(url, rank)?
            } else {
                url.to_owned()
            })
        };
        out.push(EndpointSpec {
            endpoint: replica.to_owned(),
            events: localize(&shift(&source.endpoint)?),
            replay: source
                .replay_endpoint
                .as_deref()
                .map(|r| shift(r).map(|r| localize(&r)))
                .transpose()?,
            rank,
        });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(json: &str) -> BTreeMap<String, EventSource> {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn a_fleet_found_at_once_is_asked_again_spread_out() {
        let fresh: Vec<f64> = (0..1000)
            .map(|n| fresh_for(&format!("10.1.{}.{}:8000", n / 250, n % 250)).as_secs_f64())
            .collect();
        assert!(fresh.iter().all(|s| (22.5..37.5).contains(s)));
        // Ten windows of 1.5 s: about a tenth of the fleet in each, none in one burst.
        let mut windows = [0; 10];
        for s in &fresh {
            windows[((s - 22.5) / 1.5) as usize] += 1;
        }
        assert!(windows.iter().all(|n| (50..150).contains(n)), "{windows:?}");
    }

    #[test]
    fn wildcard_hosts_become_the_replica_host() {
        let sources = parse(
            r#"{"0": {"enable_kv_cache_events": true, "publisher": "zmq",
                      "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}}"#,
        );
        let specs = resolve_sources("10.1.2.3:8000", &sources).unwrap();
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0].events, "tcp://10.1.2.3:5557");
        assert_eq!(specs[0].replay.as_deref(), Some("tcp://10.1.2.3:5558"));
    }

    #[test]
    fn ranks_get_their_own_ports() {
        let shifted = parse(
            r#"{"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6557"},
                "1": {"endpoint": "tcp://*:5558", "replay_endpoint": "tcp://*:6558"}}"#,
        );
        let unshifted = parse(
            r#"{"0": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6557"},
                "1": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:6557"}}"#,
        );
        for sources in [shifted, unshifted] {
            let specs = resolve_sources("h:80", &sources).unwrap();
            let urls: Vec<(u32, &str, Option<&str>)> = specs
                .iter()
                .map(|s| (s.rank, s.events.as_str(), s.replay.as_deref()))
                .collect();
            assert_eq!(
                urls,
                vec![
                    (0, "tcp://h:5557", Some("tcp://h:6557")),
                    (1, "tcp://h:5558", Some("tcp://h:6558"))
                ]
            );
        }
    }

    #[test]
    fn dns_names_need_a_port() {
        let sources = Arc::new(EventSourcesCache::new(reqwest::Client::new()));
        assert!(DnsReplicas::new("vllm.ns.svc:8000", sources.clone()).is_ok());
        for bad in ["vllm.ns.svc", ":8000", "vllm:http"] {
            assert!(DnsReplicas::new(bad, sources.clone()).is_err(), "{bad}");
        }
    }

    /// A name whose answer the test sets.
    struct Answer(parking_lot::Mutex<std::io::Result<Vec<std::net::SocketAddr>>>);

    impl Resolve for Arc<Answer> {
        fn resolve<'a>(
            &'a self,
            _host: &'a str,
            _port: u16,
        ) -> BoxFuture<'a, std::io::Result<Vec<std::net::SocketAddr>>> {
            Box::pin(async move {
                match &*self.0.lock() {
                    Ok(all) => Ok(all.clone()),
                    Err(err) => Err(std::io::Error::new(err.kind(), err.to_string())),
                }
            })
        }
    }

    #[tokio::test]
    async fn peers_named_by_dns_are_one_family_and_outlive_a_failed_resolution() {
        let answer = Arc::new(Answer(parking_lot::Mutex::new(Ok(vec![
            "10.0.0.1:9100".parse().unwrap(),
            "[fd00::1]:9100".parse().unwrap(),
            "10.0.0.2:9100".parse().unwrap(),
        ]))));
        let peers = DnsPeers::with_resolver("gw.ns.svc:9100", Box::new(answer.clone())).unwrap();
        let both = BTreeSet::from(["10.0.0.1:9100".to_owned(), "10.0.0.2:9100".to_owned()]);
        assert_eq!(peers.addresses().await, both);
        *answer.0.lock() = Err(std::io::ErrorKind::NotFound.into());
        assert_eq!(peers.addresses().await, both);
        *answer.0.lock() = Ok(vec!["[fd00::2]:9100".parse().unwrap()]);
        assert_eq!(
            peers.addresses().await,
            BTreeSet::from(["[fd00::2]:9100".to_owned()])
        );
        for bad in ["gw.ns.svc", ":9100"] {
            assert!(DnsPeers::new(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn disabled_publishers_are_skipped() {
        let sources = parse(r#"{"0": {"endpoint": "tcp://*:5557", "publisher": "null"}}"#);
        assert!(resolve_sources("h:80", &sources).unwrap().is_empty());
    }
}
