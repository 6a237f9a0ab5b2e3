//! DNS discovery of a headless Service of a thousand pods: the DNS answers are simulated
//! (no machine runs a thousand vLLM pods), each pod is a real HTTP listener on its own
//! loopback address answering `/kv_event_sources` as vLLM does, and the daemon's own
//! discovery source asks them.

use std::collections::{BTreeSet, HashMap};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::extract::State;
use kvaffined::discovery::{BoxFuture, Discovery, DnsReplicas, EventSourcesCache, Resolve};
use parking_lot::Mutex;

/// What the pods were asked.
#[derive(Default)]
struct Asked {
    by_pod: Mutex<HashMap<IpAddr, u32>>,
    in_flight: AtomicUsize,
    most_in_flight: AtomicUsize,
}

impl Asked {
    fn total(&self) -> u32 {
        self.by_pod.lock().values().sum()
    }
}

/// The Service's ready pods, as its DNS name answers them.
#[derive(Clone, Default)]
struct Service(Arc<Mutex<Vec<SocketAddr>>>);

impl Resolve for Service {
    fn resolve<'a>(
        &'a self,
        _host: &'a str,
        _port: u16,
    ) -> BoxFuture<'a, std::io::Result<Vec<SocketAddr>>> {
        Box::pin(async move { Ok(self.0.lock().clone()) })
    }
}

async fn kv_event_sources(
    State((asked, pod)): State<(Arc<Asked>, IpAddr)>,
) -> axum::Json<serde_json::Value> {
    *asked.by_pod.lock().entry(pod).or_default() += 1;
    let now = asked.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    asked.most_in_flight.fetch_max(now, Ordering::SeqCst);
    // As long as a busy replica takes, so that requests made at once overlap.
    tokio::time::sleep(Duration::from_millis(5)).await;
    asked.in_flight.fetch_sub(1, Ordering::SeqCst);
    axum::Json(serde_json::json!({
        "0": {"enable_kv_cache_events": true, "publisher": "zmq",
              "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}
    }))
}

/// Pod `n`'s address: one loopback address each, all on `port`.
fn pod(n: usize, port: u16) -> SocketAddr {
    SocketAddr::new(
        IpAddr::V4(Ipv4Addr::new(127, 1, (n / 250) as u8, (n % 250 + 1) as u8)),
        port,
    )
}

async fn start_pod(address: SocketAddr, asked: Arc<Asked>) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(address).await?;
    let app = axum::Router::new()
        .route("/kv_event_sources", axum::routing::get(kv_event_sources))
        .with_state((asked, address.ip()));
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).await;
    });
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_pods_are_followed_without_a_request_storm() {
    const PODS: usize = 1000;
    const JOINING: usize = 100;
    let first = tokio::net::TcpListener::bind(pod(0, 0)).await.unwrap();
    let port = first.local_addr().unwrap().port();
    drop(first);
    let asked = Arc::new(Asked::default());
    for n in 0..PODS + JOINING {
        start_pod(pod(n, port), asked.clone()).await.unwrap();
    }
    let service = Service::default();
    *service.0.lock() = (0..PODS).map(|n| pod(n, port)).collect();
    let client = reqwest::Client::builder().no_proxy().build().unwrap();
    let replicas = DnsReplicas::with_resolver(
        &format!("vllm.test.svc:{port}"),
        Arc::new(EventSourcesCache::new(client)),
        Box::new(service.clone()),
    )
    .unwrap();
    let events = |specs: &[kvaffined::config::EndpointSpec]| -> BTreeSet<String> {
        specs.iter().map(|s| s.events.clone()).collect()
    };
    let want = |pods: std::ops::Range<usize>| -> BTreeSet<String> {
        pods.map(|n| format!("tcp://{}:5557", pod(n, port).ip()))
            .collect()
    };

    let specs = replicas.discover().await.unwrap();
    assert_eq!(events(&specs), want(0..PODS));
    assert_eq!(asked.total(), PODS as u32, "each pod asked once");
    let most = asked.most_in_flight.load(Ordering::SeqCst);
    assert!(
        (2..=32).contains(&most),
        "{most} requests in flight at once: at most 32, and some overlap"
    );

    // The next polls (one a second) ask nobody: the answers are reused.
    for _ in 0..3 {
        assert_eq!(replicas.discover().await.unwrap().len(), PODS);
    }
    assert_eq!(asked.total(), PODS as u32);

    // A rollout: 100 pods leave, 100 new ones join; only the new ones are asked.
    *service.0.lock() = (JOINING..PODS + JOINING).map(|n| pod(n, port)).collect();
    let specs = replicas.discover().await.unwrap();
    assert_eq!(events(&specs), want(JOINING..PODS + JOINING));
    assert_eq!(asked.total(), (PODS + JOINING) as u32);
    assert!(
        asked.by_pod.lock().values().all(|n| *n == 1),
        "no pod asked twice"
    );
}
